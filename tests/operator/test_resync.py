"""A converged fleet costs nothing: a resync (paged, metadata-only lists) and the watch events that echo the
operator's own writes cause no write, and an echo wakes no reconcile."""

from __future__ import annotations

import copy

import pytest

from maru_localcluster.server import KubeEmulator
from maru_operator import handlers
from tests.support.operator import GROUP_NS, RunningOperator, group, has_condition, object_writes, on_loop, pool, settle

pytestmark = pytest.mark.emulator

IG = "inferencegroups.maru.io"
MP = "marupools.maru.io"


@pytest.fixture
def fleet(cluster: KubeEmulator, operator: RunningOperator) -> KubeEmulator:
    cluster.create(pool())
    cluster.wait_for(MP, "local-shm", None, lambda o: has_condition(o, "Ready", "True"))
    for name in ("qwen", "other"):
        cluster.create(group(name))
    for name in ("qwen", "other"):
        cluster.wait_for(IG, name, GROUP_NS, lambda o: has_condition(o, "Ready", "True"))
    settle(operator)
    return cluster


def test_a_resync_of_a_converged_fleet_writes_nothing(fleet: KubeEmulator, operator: RunningOperator) -> None:
    mark = fleet.mark()
    on_loop(operator, operator.runtime.relist(operator.runtime.kube, [], metadata_only=True))
    settle(operator)  # and every owner reconciled, as the resync timer does
    writes = object_writes(fleet, mark)
    assert writes == [], [f"{r.method} {r.path}" for r in writes]
    lists = [r for r in fleet.requests_since(mark) if r.method == "GET" and not r.is_watch and "limit" in r.query]
    assert len({r.path for r in lists}) >= len(handlers.PRIMED_KINDS)  # every kind listed, in pages


def test_an_echo_of_its_own_write_wakes_nothing(fleet: KubeEmulator, operator: RunningOperator) -> None:
    store = operator.runtime.store
    echoes = operator.call(lambda: [copy.deepcopy(store.get(k)) for k in store.keys("Deployment", GROUP_NS)])
    assert echoes
    processed = operator.call(lambda: operator.runtime.queue.processed)
    mark = fleet.mark()

    async def deliver() -> None:
        for obj in echoes:  # what the watch sends after the operator's own write: the version it holds
            await operator.runtime.child_event(type="MODIFIED", body=obj)

    on_loop(operator, deliver())
    settle(operator, resync=False)
    assert operator.call(lambda: operator.runtime.queue.processed) == processed
    assert object_writes(fleet, mark) == []


def test_a_group_its_status_write_found_gone_still_releases_its_pool(
    fleet: KubeEmulator, operator: RunningOperator
) -> None:
    """A status write that meets 404 drops the group from the cache before the DELETED event comes; the event
    must still wake the pool, which counts its groups (it waited for its next look, up to 30 s)."""
    store = operator.runtime.store
    key = ("InferenceGroup", GROUP_NS, "qwen")
    operator.call(lambda: store.remove(key))  # what the status writer does on 404
    fleet.delete(IG, "qwen", GROUP_NS)
    fleet.wait_for(MP, "local-shm", None, lambda p: p.get("status", {}).get("boundGroups") == 1, timeout=10)
