"""DisaggregationActive end to end: a real pool daemon counts two groups' decode lookups, the operator (real kopf
against the API emulator) polls its /status, and each group's condition says whether its decode loads from the
pool. Idle once judged, a group costs no status write; a daemon that stops answering is PoolUnreachable."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from maru_contracts import tenancy
from maru_localcluster.server import KubeEmulator
from maru_operator.kube import fetch_daemon_status
from maru_pool import PoolClient
from maru_pool.readers import Reader
from tests.support.operator import (
    GROUP_NS,
    POOL_NS,
    RunningOperator,
    fake_agent_pod,
    group,
    has_condition,
    pool,
    wait_event,
)
from tests.support.pool import Daemon, start_serve

pytestmark = pytest.mark.emulator

IG = "inferencegroups.maru.io"
MP = "marupools.maru.io"
DECODE = Reader("decode", chunk_tokens=256, ranks=1)
KEYS = 32  # chunks per prompt: 8,192 tokens per lookup, over the condition's minimum


@pytest.fixture
def pool_daemon() -> Iterator[tuple[Daemon, Path, bytes]]:
    """A real ``maru-pool serve`` with a pool key (so each group is a tenant of its own); its dir and key."""
    workdir = Path(tempfile.mkdtemp(prefix="mp-da-", dir="/tmp"))  # short: Unix socket paths are bounded
    key = os.urandom(tenancy.KEY_BYTES)
    (workdir / "pool.key").write_bytes(key)
    started: list[Daemon] = []
    try:
        yield start_serve(started, workdir, "--auth-key-file", str(workdir / "pool.key")), workdir, key
    finally:
        for d in started:
            d.stop(sig=signal.SIGKILL)
            for stream in (d.proc.stdout, d.proc.stderr):
                if stream is not None:
                    stream.close()
        for child in workdir.iterdir():
            child.unlink()
        workdir.rmdir()


def decode_client(d: Daemon, workdir: Path, key: bytes, group_name: str) -> PoolClient:
    """A client with the token the group's decode pods would hold (scope ``<namespace>/<group>``)."""
    path = workdir / f"{group_name}.token"
    path.write_text(tenancy.issue(key, tenancy.tenant(f"{GROUP_NS}/{group_name}")))
    return PoolClient(d.ready["listen"], timeout_s=5, token_file=str(path))


def prompt(tag: int) -> list[bytes]:
    return [tag.to_bytes(4, "big") + i.to_bytes(12, "big") for i in range(KEYS)]


def disaggregation(obj: dict[str, Any], status: str, reason: str) -> bool:
    return has_condition(obj, "DisaggregationActive", status, reason)


def test_hits_are_active_misses_are_recomputing(cluster: KubeEmulator, pool_daemon: tuple[Daemon, Path, bytes]) -> None:
    d, workdir, key = pool_daemon
    port = int(d.ready["metrics"].rsplit(":", 1)[1])
    op = RunningOperator(
        cluster,
        fetch_daemon_status,
        resync_seconds=3600,
        workers=2,  # type: ignore[arg-type]
        usage_interval=1.0,
    ).start()
    try:
        cluster.create(pool(daemon={"metricsPort": port}))
        cluster.wait_for("daemonsets.apps", "local-shm-agent", POOL_NS)
        fake_agent_pod(cluster, "local-shm", "node-1", "127.0.0.1")
        cluster.patch("daemonsets.apps", "local-shm-agent", {"metadata": {"annotations": {"poke": "1"}}}, POOL_NS)
        cluster.wait_for(MP, "local-shm", None, lambda o: o.get("status", {}).get("used") == "0")
        for name in ("hits", "misses"):
            cluster.create(group(name))
            # Two polls of the daemon compared, no decode traffic yet.
            cluster.wait_for(IG, name, GROUP_NS, lambda o: disaggregation(o, "Unknown", "NoTraffic"))

        with decode_client(d, workdir, key, "hits") as hits, decode_client(d, workdir, key, "misses") as misses:
            for k in prompt(1):
                assert hits.put(k, b"kv")  # what the group's prefill stored
            for _ in range(4):
                assert hits.lookup_prefix(prompt(1), reader=DECODE) == KEYS
                # Keys the other group's prefill never stored (as when the roles key prompts differently).
                assert misses.lookup_prefix(prompt(2), reader=DECODE) == 0

        ok = cluster.wait_for(IG, "hits", GROUP_NS, lambda o: disaggregation(o, "True", "DecodeLoadsFromPool"))
        bad = cluster.wait_for(IG, "misses", GROUP_NS, lambda o: disaggregation(o, "False", "DecodeRecomputing"))
        message = next(c["message"] for c in bad["status"]["conditions"] if c["type"] == "DisaggregationActive")
        assert "computed 100% of its prompt tokens" in message and "cacheNamespace" in message
        assert wait_event(cluster, GROUP_NS, "misses", "DecodeRecomputing")["type"] == "Warning"
        assert ok["status"]["conditions"][-1]["type"] == "DisaggregationActive"
        labels = {"namespace": GROUP_NS, "group": "hits"}
        assert REGISTRY.get_sample_value("maru_operator_group_decode_pool_share", labels) == 1.0
        assert (
            REGISTRY.get_sample_value("maru_operator_group_decode_prompt_tokens", {**labels, "source": "pool"})
            == 4 * KEYS * 256
        )

        # Judged and idle: polls every second change nothing, so nothing is written.
        mark = cluster.mark()
        time.sleep(3.0)
        assert cluster.writes_since(mark, r"/inferencegroups/[^/]+/status$") == []

        d.stop(sig=signal.SIGKILL)  # the operator can no longer read the pool's /status
        for name in ("hits", "misses"):
            cluster.wait_for(IG, name, GROUP_NS, lambda o: disaggregation(o, "False", "PoolUnreachable"))
    finally:
        op.stop()
