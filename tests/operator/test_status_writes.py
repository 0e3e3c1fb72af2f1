"""Status writes: an object's own status write never triggers its reconcile; pool usage that changes with
traffic reaches status at a bounded rate; condition changes are written at once."""

from __future__ import annotations

import time
from typing import Any

import pytest

from maru_localcluster.server import KubeEmulator
from tests.support.operator import (
    POOL_NS,
    RunningOperator,
    StubStats,
    fake_agent_pod,
    group,
    has_condition,
    pool,
    settle,
)

pytestmark = pytest.mark.emulator

MP = "marupools.maru.io"
IG = "inferencegroups.maru.io"
POOL_STATUS = r"/marupools/local-shm/status$"


class TrafficStats(StubStats):
    """Daemons under traffic: every answer reports more memory in use (in-flight leases come and go)."""

    async def __call__(self, url: str) -> dict[str, Any] | None:
        self.calls.append(url)
        return {"capacity_bytes": 1 << 30, "used_bytes": len(self.calls) * 4096}


@pytest.fixture
def stats() -> StubStats:
    return TrafficStats()


def pod_lists(kube: KubeEmulator, mark: int) -> int:
    return sum(
        1
        for r in kube.requests_since(mark)
        if r.method == "GET" and r.path == f"/api/v1/namespaces/{POOL_NS}/pods" and not r.is_watch
    )


def test_usage_under_traffic_is_written_at_a_bounded_rate(
    cluster: KubeEmulator, operator: RunningOperator, stats: StubStats, kube_controllers: Any
) -> None:
    cluster.create(pool())
    cluster.wait_for(MP, "local-shm", None, lambda o: has_condition(o, "Ready", "True"))
    fake_agent_pod(cluster, "local-shm", "node-1", "10.1.2.3")
    operator.call(lambda: operator.runtime.queue.add(("MaruPool", "", "local-shm")))  # as the resync would
    cluster.wait_for(MP, "local-shm", None, lambda o: o.get("status", {}).get("used"))
    mark = cluster.mark()
    time.sleep(2.0)  # the daemons' usage changes on every look
    writes = cluster.writes_since(mark, POOL_STATUS)
    assert len(writes) <= 1, f"{len(writes)} status writes and {pod_lists(cluster, mark)} pod lists in 2 s"
    assert pod_lists(cluster, mark) <= 1
    # A condition change is written at once, rate limit or not.
    kube_controllers.set_readiness(lambda obj: 0 if obj["kind"] == "DaemonSet" else True)
    cluster.wait_for(MP, "local-shm", None, lambda o: has_condition(o, "Ready", "False", "AgentsNotReady"))


def test_own_status_writes_do_not_trigger_reconciles(cluster: KubeEmulator, operator: RunningOperator) -> None:
    cluster.create(pool())
    cluster.create(group())
    cluster.wait_for(IG, "qwen", "llm", lambda o: has_condition(o, "Ready", "True"))
    settle(operator, resync=False)
    before = operator.call(lambda: operator.runtime.queue.processed)
    # Someone else's status-only write (as the operator's own would be): not a reason to reconcile.
    cluster.patch_status(IG, "qwen", {"endpoint": "http://elsewhere"}, "llm")
    cluster.patch_status(MP, "local-shm", {"used": "1Ki"})
    settle(operator, resync=False)
    assert operator.call(lambda: operator.runtime.queue.processed) == before
    # A spec change still is.
    cluster.patch(IG, "qwen", {"spec": {"decode": {"replicas": 1}}}, "llm")
    settle(operator, resync=False)
    assert operator.call(lambda: operator.runtime.queue.processed) > before
