"""What the security tests and the checkov scan look at: the product's manifests, rendered for real.

The examples go through the real ``maru-operator render`` command, with the example InferenceGroup bound
to each example MaruPool in turn (dax and shm groups differ: affinity, socket directory, policies); the
chart goes through the real helm binary.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
CHART = REPO / "charts" / "maru-operator"
POOL_NAMESPACE = "maru-system"
RELEASE = "maru-operator"

Object = dict[str, Any]


def operator_render(paths: Sequence[Path], *flags: str) -> list[Object]:
    """``maru-operator render -f PATH...`` with the pool daemons in :data:`POOL_NAMESPACE`."""
    args = [sys.executable, "-m", "maru_operator", "render", "--pool-namespace", POOL_NAMESPACE, *flags]
    for path in paths:
        args += ["-f", str(path)]
    result = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False, cwd=REPO)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


# The examples for a cluster, and the local cluster's (``make demo`` runs those exactly as rendered). Each set
# is rendered on its own: both hold a pool named local-shm.
LOCAL = "local/"
EXAMPLE_SETS = {"": EXAMPLES, LOCAL: EXAMPLES / "local"}


def example_documents(folder: Path = EXAMPLES) -> list[Object]:
    docs = []
    for path in sorted(folder.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def examples_bound_to_each_pool(workdir: Path, *flags: str) -> dict[str, list[Object]]:
    """Pool name -> the children of a set of examples, its groups bound to that pool; the local set's pools
    are named ``local/<pool>``."""
    out: dict[str, list[Object]] = {}
    for prefix, folder in EXAMPLE_SETS.items():
        docs = example_documents(folder)
        pools = [d["metadata"]["name"] for d in docs if d["kind"] == "MaruPool"]
        groups = [d for d in docs if d["kind"] == "InferenceGroup"]
        assert pools and groups, f"{folder} holds a pool and a group"
        for pool in pools:
            target = workdir / f"bound-to-{prefix.strip('/')}-{pool}"
            target.mkdir(parents=True, exist_ok=True)
            bound = [
                {**d, "spec": {**d["spec"], "poolRef": {"name": pool}}} if d["kind"] == "InferenceGroup" else d
                for d in docs
            ]
            (target / "all.yaml").write_text(yaml.safe_dump_all(bound))
            out[prefix + pool] = operator_render([target], *flags)
    assert {"cxl-pool", "local-shm", LOCAL + "local-shm"} <= set(out), sorted(out)
    return out


def chart_render(helm: Path, *helm_args: str) -> list[Object]:
    """``helm template`` of the chart as released into :data:`POOL_NAMESPACE`."""
    result = subprocess.run(
        [str(helm), "template", RELEASE, str(CHART), "--namespace", POOL_NAMESPACE, *helm_args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]
