"""Ready means serving: the router Service has ready endpoints and each role has a ready pod.

Fewer replicas than desired, or a pool outage (vLLM keeps serving by recomputing), is Degraded, not
not-Ready; and a pool reports no problem its DaemonSet controller has not had the chance to look at.
"""

from __future__ import annotations

from typing import Any

import pytest

from maru_localcluster.server import KubeEmulator
from tests.support.operator import GROUP_NS, RunningOperator, condition_of, group, has_condition, pool, settle

pytestmark = pytest.mark.emulator

IG = "inferencegroups.maru.io"
MP = "marupools.maru.io"
DS = "daemonsets.apps"


def ready(obj: dict[str, Any]) -> bool:
    return has_condition(obj, "Ready", "True")


@pytest.fixture
def serving(cluster: KubeEmulator, operator: RunningOperator) -> dict[str, Any]:
    cluster.create(pool())
    cluster.create(group())
    return cluster.wait_for(IG, "qwen", GROUP_NS, ready)


def test_a_missing_replica_is_degraded_not_unready(
    cluster: KubeEmulator, operator: RunningOperator, kube_controllers: Any, serving: dict[str, Any]
) -> None:
    kube_controllers.set_readiness(lambda obj: 1 if obj["metadata"]["name"] == "qwen-decode" else True)
    ig = cluster.wait_for(IG, "qwen", GROUP_NS, lambda o: has_condition(o, "Degraded", "True", "ReplicasUnavailable"))
    assert ready(ig), condition_of(ig, "Ready")
    assert "decode 1/2" in condition_of(ig, "Degraded")["message"]
    # No ready pod of a role: nothing serves.
    kube_controllers.set_readiness(lambda obj: 0 if obj["metadata"]["name"] == "qwen-prefill" else True)
    ig = cluster.wait_for(IG, "qwen", GROUP_NS, lambda o: has_condition(o, "Ready", "False", "ReplicasNotReady"))
    assert "prefill" in condition_of(ig, "Ready")["message"]
    kube_controllers.set_readiness(lambda obj: True)
    ig = cluster.wait_for(IG, "qwen", GROUP_NS, lambda o: ready(o) and has_condition(o, "Degraded", "False"))


def test_ready_needs_the_routers_endpoints(
    cluster: KubeEmulator, operator: RunningOperator, kube_controllers: Any
) -> None:
    kube_controllers.hold_endpoints()
    cluster.create(pool())
    cluster.create(group())
    ig = cluster.wait_for(IG, "qwen", GROUP_NS, lambda o: o.get("status", {}).get("router", {}).get("ready") == 1)
    settle(operator)
    ig = cluster.get(IG, "qwen", GROUP_NS)
    assert ig is not None and has_condition(ig, "Ready", "False", "NoReadyEndpoints"), condition_of(ig, "Ready")
    assert "Service llm/qwen" in condition_of(ig, "Ready")["message"]
    kube_controllers.release_endpoints()
    cluster.wait_for(IG, "qwen", GROUP_NS, ready)
    # Without a router, the roles alone decide.
    kube_controllers.hold_endpoints()
    cluster.patch(IG, "qwen", {"spec": {"router": {"enabled": False}}}, GROUP_NS)
    cluster.wait_for(IG, "qwen", GROUP_NS, lambda o: ready(o) and o["status"]["endpoint"] == "")


def test_a_pool_outage_is_degraded_while_vllm_serves(
    cluster: KubeEmulator, operator: RunningOperator, kube_controllers: Any, serving: dict[str, Any]
) -> None:
    kube_controllers.set_readiness(lambda obj: 0 if obj["kind"] == "DaemonSet" else True)
    cluster.wait_for(MP, "local-shm", None, lambda o: has_condition(o, "Ready", "False"))
    ig = cluster.wait_for(IG, "qwen", GROUP_NS, lambda o: has_condition(o, "Degraded", "True", "PoolUnavailable"))
    assert ready(ig), condition_of(ig, "Ready")
    assert has_condition(ig, "PoolBound", "False", "PoolNotReady")
    assert "local-shm" in condition_of(ig, "Degraded")["message"]
    kube_controllers.set_readiness(lambda obj: True)
    cluster.wait_for(IG, "qwen", GROUP_NS, lambda o: ready(o) and has_condition(o, "Degraded", "False"))


def test_no_node_warning_before_the_daemonset_controller_looked(
    cluster: KubeEmulator, operator: RunningOperator, kube_controllers: Any
) -> None:
    kube_controllers.pause()
    cluster.create(pool())
    p = cluster.wait_for(MP, "local-shm", None, lambda o: has_condition(o, "Ready", "False"))
    settle(operator)
    assert cluster.get(DS, "local-shm-agent", "maru-system") is not None
    p = cluster.get(MP, "local-shm")
    assert p is not None and not has_condition(p, "Ready", "False", "NoNodesSelected"), condition_of(p, "Ready")
    assert not [e for e in cluster.list("events", "default") if e.get("reason") == "NoNodesSelected"]
    kube_controllers.resume()
    cluster.wait_for(MP, "local-shm", None, ready)
    assert not [e for e in cluster.list("events", "default") if e["type"] == "Warning"]
