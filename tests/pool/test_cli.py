"""The daemon's command line against what the operator actually writes into pool pods."""

from __future__ import annotations

import pytest

from maru_pool.cli import build_parser

builders = pytest.importorskip("maru_operator.builders.pool")
from maru_operator.api.marupool import MaruPoolSpec  # noqa: E402
from maru_operator.builders.common import Owner  # noqa: E402

OWNER = Owner(kind="MaruPool", name="pool-a", uid="uid-1", generation=1)


def container_args(obj: dict) -> list[str]:
    (container,) = obj["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["maru-pool"]
    return container["args"]


@pytest.mark.parametrize("policy", ["LRU", "None"])
def test_operator_args_for_shm_pools_parse(policy: str) -> None:
    spec = MaruPoolSpec.model_validate({"backend": "shm", "size": "2Gi", "eviction": {"policy": policy}})
    args = build_parser().parse_args(container_args(builders.build_agent_daemonset(spec, OWNER, "maru-system")))
    assert args.role == "serve" and args.size == 2 << 30
    assert args.eviction == policy.lower()


def test_operator_args_for_dax_pools_parse() -> None:
    spec = MaruPoolSpec.model_validate(
        {"backend": "dax", "size": "64Gi", "devices": ["/dev/dax0.0", "/dev/dax1.0"], "eviction": {"leaseSeconds": 12}}
    )
    agent = build_parser().parse_args(container_args(builders.build_agent_daemonset(spec, OWNER, "maru-system")))
    assert agent.role == "agent" and agent.device == ["/dev/dax0.0", "/dev/dax1.0"]
    assert agent.metadata.startswith("tcp://")
    meta = build_parser().parse_args(container_args(builders.build_metadata_deployment(spec, OWNER, "maru-system")))
    assert meta.role == "metadata" and meta.size == 64 << 30 and meta.lease_seconds == 12


def test_dax_pool_without_size_or_devices_parses() -> None:
    spec = MaruPoolSpec.model_validate({"backend": "dax"})
    agent = build_parser().parse_args(container_args(builders.build_agent_daemonset(spec, OWNER, "maru-system")))
    assert agent.device is None  # discovered on the node
    meta = build_parser().parse_args(container_args(builders.build_metadata_deployment(spec, OWNER, "maru-system")))
    assert meta.size is None  # laid out from the first agent's devices


def test_the_daemon_imports_no_engine_and_no_kubernetes_client() -> None:
    import subprocess
    import sys

    from tests.support.pool import connector_env

    code = (
        "import sys, maru_pool, maru_pool.cli, maru_pool.daemon\n"
        "bad = sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'torch', 'kubernetes', 'kopf', 'numpy'})\n"
        "print(','.join(bad))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=connector_env(), timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""
