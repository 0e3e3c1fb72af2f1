"""The pool daemons' command lines and /status, checked against the real `maru-pool`."""

from __future__ import annotations

import asyncio
import pathlib
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from maru_localcluster.server import KubeEmulator
from maru_operator.builders.pool import build_agent_daemonset, build_metadata_deployment
from maru_operator.kube import fetch_daemon_status
from maru_pool.cli import build_parser
from tests.support.operator import POOL_NS, RunningOperator, fake_agent_pod, has_condition, pool
from tests.support.specs import POOL_OWNER, container, dax_spec, pool_spec


def parse(args: list[str]) -> Any:
    return build_parser().parse_args(args)


def test_shm_serve_flags_parse() -> None:
    args = parse(container(build_agent_daemonset(pool_spec(size="64Gi"), POOL_OWNER, POOL_NS))["args"])
    assert args.role == "serve"
    assert args.size == 64 << 30
    assert args.listen == "unix:///run/maru/pool/pool.sock"
    assert (args.eviction, args.lease_seconds) == ("lru", 30.0)


def test_dax_agent_flags_parse() -> None:
    args = parse(container(build_agent_daemonset(dax_spec(), POOL_OWNER, POOL_NS))["args"])
    assert args.role == "agent"
    assert args.device == ["/dev/dax0.0", "/dev/dax1.0"]
    assert args.metadata == "tcp://pool-metadata.maru-system.svc:7400"


def test_dax_metadata_flags_parse() -> None:
    dep = build_metadata_deployment(dax_spec(size="256Gi", eviction={"policy": "None"}), POOL_OWNER, POOL_NS)
    assert dep is not None
    args = parse(container(dep)["args"])
    assert args.role == "metadata"
    assert (args.size, args.eviction, args.listen) == (256 << 30, "none", "tcp://0.0.0.0:7400")


@pytest.fixture
def real_daemon(tmp_path: pathlib.Path) -> Iterator[int]:
    """A real `maru-pool serve` on loopback; yields its metrics port."""
    shm = f"/dev/shm/maru-op-test-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "maru_pool",
            "serve",
            "--listen",
            f"unix://{tmp_path}/pool.sock",
            "--size",
            "16Mi",
            "--shm-path",
            shm,
            "--metrics-addr",
            "127.0.0.1:0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        match = re.search(r"metrics=127\.0\.0\.1:(\d+)", line)
        assert match, f"no ready line from maru-pool: {line!r}"
        yield int(match.group(1))
    finally:
        proc.terminate()
        proc.wait(30)
        pathlib.Path(shm).unlink(missing_ok=True)


def test_fetch_status_of_a_real_daemon(real_daemon: int) -> None:
    answer = asyncio.run(fetch_daemon_status(f"http://127.0.0.1:{real_daemon}/status"))
    assert answer is not None
    assert answer["capacity_bytes"] == 16 << 20 and answer["used_bytes"] == 0


def test_fetch_status_never_raises() -> None:
    assert asyncio.run(fetch_daemon_status("http://127.0.0.1:1/status", timeout=0.5)) is None
    assert asyncio.run(fetch_daemon_status("http://256.0.0.1:1/status", timeout=0.5)) is None


@pytest.mark.emulator
def test_pool_status_from_a_real_daemon(cluster: KubeEmulator, real_daemon: int) -> None:
    """The operator's default fetcher reads a real daemon's /status into the pool's status."""
    op = RunningOperator(cluster, fetch_daemon_status, resync_seconds=3600, workers=2).start()  # type: ignore[arg-type]
    try:
        cluster.create(pool(daemon={"metricsPort": real_daemon}))
        cluster.wait_for("daemonsets.apps", "local-shm-agent", POOL_NS)
        fake_agent_pod(cluster, "local-shm", "node-1", "127.0.0.1")
        # Pods are not watched; a DaemonSet change (or the resync) makes the operator look again.
        cluster.patch("daemonsets.apps", "local-shm-agent", {"metadata": {"annotations": {"poke": "1"}}}, POOL_NS)
        p = cluster.wait_for(
            "marupools.maru.io",
            "local-shm",
            None,
            lambda o: o.get("status", {}).get("used") == "0" and has_condition(o, "Ready", "True"),
        )
        assert p["status"]["nodes"][0]["capacity"] == "16Mi"
    finally:
        op.stop()
