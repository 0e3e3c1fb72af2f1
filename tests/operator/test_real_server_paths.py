"""The operator's child writes where kube-apiserver disagrees with a lenient server: an autoscaled role that drops
fields and switches to Recreate, revoked and restored pool access, a child the server refuses, status fields
that become empty. The operator runs as a real kopf process against the API emulator, which records a create's
fields after defaulting and refuses what kube-apiserver refuses (see tests/k8s/test_real_server_rules.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from maru_localcluster.server import KubeEmulator
from maru_operator.kube import Kube
from maru_operator.ownership import CREATED_FIELDS_ANNOTATION, FIELD_MANAGER, created_body, out_of_sync
from tests.support.operator import GROUP_NS, RunningOperator, condition_of, group, has_condition, pool, settle

pytestmark = pytest.mark.emulator

IG = "inferencegroups.maru.io"
MP = "marupools.maru.io"
DEPLOY = "deployments.apps"
PVC = "persistentvolumeclaims"


def _deployment(cluster: KubeEmulator, role: str) -> dict[str, Any]:
    dep = cluster.get(DEPLOY, f"qwen-{role}", GROUP_NS)
    assert dep is not None
    return dep


def _scale(cluster: KubeEmulator, role: str, count: int) -> None:
    cluster.kubectl("scale", f"deployment/qwen-{role}", f"--replicas={count}", "-n", GROUP_NS)


def _vllm(dep: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm")


def _deployment_writes(cluster: KubeEmulator, mark: int, role: str) -> list[Any]:
    return [r for r in cluster.writes_since(mark) if r.path.endswith(f"/deployments/qwen-{role}")]


def test_an_autoscaled_role_drops_fields_and_switches_to_recreate(
    cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]
) -> None:
    cluster.create(
        group(
            decode={
                "replicas": 2,
                "scaler": "External",
                "nodeSelector": {"zone": "a"},
                "env": [{"name": "EXTRA", "value": "1"}],
            }
        )
    )
    cluster.wait_for(DEPLOY, "qwen-decode", GROUP_NS)
    settle(operator)
    _scale(cluster, "decode", 3)
    cluster.patch(
        IG,
        "qwen",
        {"spec": {"decode": {"nodeSelector": None, "env": None, "strategy": {"type": "Recreate"}}}},
        GROUP_NS,
    )
    settle(operator)
    dep = _deployment(cluster, "decode")
    assert "zone" not in (dep["spec"]["template"]["spec"].get("nodeSelector") or {})
    assert "EXTRA" not in {e["name"] for e in _vllm(dep).get("env") or []}
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    assert dep["spec"]["replicas"] == 3  # the autoscaler's count stays
    assert CREATED_FIELDS_ANNOTATION not in (dep["metadata"].get("annotations") or {})
    body = cluster.get(IG, "qwen", GROUP_NS)
    assert body is not None and not has_condition(body, "Degraded", "True", "ChildRefused"), body.get("status")
    # In sync from now on: the autoscaler scaling it again, or a resync, writes nothing.
    mark = cluster.mark()
    _scale(cluster, "decode", 4)
    settle(operator)
    assert [r for r in _deployment_writes(cluster, mark, "decode") if "/scale" not in r.path] == []
    assert _deployment(cluster, "decode")["spec"]["replicas"] == 4
    # Nor does an operator that starts afresh (nothing remembered of what it wrote).
    operator.stop()
    mark = cluster.mark()
    restarted = RunningOperator(cluster, operator.stats, resync_seconds=3600, workers=4).start()
    try:
        for _ in range(500):  # its caches list first: settle only once it knows the group
            if restarted.call(lambda: restarted.runtime.store.owners("InferenceGroup")):
                break
            time.sleep(0.02)
        settle(restarted)
    finally:
        restarted.stop()
    assert _deployment_writes(cluster, mark, "decode") == []


def test_an_autoscaled_role_gets_its_replicas_back_when_pool_access_returns(
    cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]
) -> None:
    cluster.create(group(decode={"replicas": 2, "scaler": "External"}))
    cluster.wait_for(DEPLOY, "qwen-decode", GROUP_NS)
    settle(operator)
    _scale(cluster, "decode", 3)
    cluster.patch(MP, "local-shm", {"spec": {"allowedNamespaces": ["elsewhere"]}})
    cluster.wait_for(DEPLOY, "qwen-decode", GROUP_NS, lambda d: d["spec"]["replicas"] == 0)
    cluster.wait_for(DEPLOY, "qwen-prefill", GROUP_NS, lambda d: d["spec"]["replicas"] == 0)
    cluster.patch(MP, "local-shm", {"spec": {"allowedNamespaces": None}})
    cluster.wait_for(DEPLOY, "qwen-decode", GROUP_NS, lambda d: d["spec"]["replicas"] == 3)
    settle(operator)
    assert _deployment(cluster, "decode")["spec"]["replicas"] == 3
    assert _deployment(cluster, "prefill")["spec"]["replicas"] == 1
    assert not any(
        k.startswith("maru.io/replicas-before")
        for k in _deployment(cluster, "decode")["metadata"].get("annotations") or {}
    )


def test_a_refused_child_is_reported_and_the_rest_is_written(
    cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]
) -> None:
    cluster.create(group())
    cluster.wait_for(PVC, "qwen-model-cache", GROUP_NS)
    settle(operator)
    # The claim cannot grow (unbound, or its class does not expand): the server refuses the claim's write.
    cluster.patch(
        IG,
        "qwen",
        {
            "spec": {
                "modelCache": {"persistentVolumeClaim": {"size": "400Gi"}},
                "decode": {"podAnnotations": {"edited": "yes"}},
            }
        },
        GROUP_NS,
    )
    body = cluster.wait_for(IG, "qwen", GROUP_NS, lambda o: has_condition(o, "Degraded", "True", "ChildRefused"))
    settle(operator)
    degraded = condition_of(body, "Degraded")
    assert "PersistentVolumeClaim llm/qwen-model-cache was not written" in degraded["message"], degraded
    assert _deployment(cluster, "decode")["spec"]["template"]["metadata"]["annotations"]["edited"] == "yes"
    events = [e for e in cluster.list("events", GROUP_NS) if e.get("reason") == "ChildRefused"]
    assert events and events[0]["type"] == "Warning", events
    # Undone: the claim is as desired again, and the condition clears.
    cluster.patch(IG, "qwen", {"spec": {"modelCache": None}}, GROUP_NS)
    cluster.wait_for(IG, "qwen", GROUP_NS, lambda o: not has_condition(o, "Degraded", "True", "ChildRefused"))


def test_a_status_field_that_becomes_empty_is_cleared(
    cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]
) -> None:
    cluster.create(group())
    cluster.wait_for(IG, "qwen", GROUP_NS, lambda o: has_condition(o, "PoolBound", "True"))
    settle(operator)
    # What a pool's poll wrote while the group was bound.
    cluster.patch_status(
        IG,
        "qwen",
        {
            **(cluster.get(IG, "qwen", GROUP_NS) or {})["status"],
            "poolUsage": {"used": "1Mi", "usedBytes": 1048576, "chunks": 3},
        },
        GROUP_NS,
    )
    cluster.patch(IG, "qwen", {"spec": {"poolRef": {"name": "gone"}}}, GROUP_NS)
    cluster.wait_for(IG, "qwen", GROUP_NS, lambda o: has_condition(o, "PoolBound", "False"))
    settle(operator)
    status = (cluster.get(IG, "qwen", GROUP_NS) or {})["status"]
    assert "poolUsage" not in status, status
    # Nothing left to write: no status patch on the next pass.
    mark = cluster.mark()
    settle(operator)
    assert [r for r in cluster.writes_since(mark) if r.path.endswith("/inferencegroups/qwen/status")] == []


def test_a_downward_api_item_without_its_api_version_is_in_sync(cluster: KubeEmulator) -> None:
    """The server fills in every fieldRef's apiVersion, also in a downwardAPI volume's items (an atomic list)."""
    body = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d", "namespace": "default"},
        "spec": {
            "selector": {"matchLabels": {"a": "b"}},
            "template": {
                "metadata": {"labels": {"a": "b"}},
                "spec": {
                    "containers": [{"name": "c", "image": "x:1"}],
                    "volumes": [
                        {
                            "name": "info",
                            "downwardAPI": {"items": [{"path": "name", "fieldRef": {"fieldPath": "metadata.name"}}]},
                        }
                    ],
                },
            },
        },
    }

    async def main() -> None:
        async with Kube(cluster.kopf_connection()) as client:
            created = await client.create(created_body(body))
            assert created["spec"]["template"]["spec"]["volumes"][0]["downwardAPI"]["items"][0]["fieldRef"] == {
                "apiVersion": "v1",
                "fieldPath": "metadata.name",
            }
            assert out_of_sync(body, created) is None
            applied = await client.apply(body)
            assert any(
                e["manager"] == FIELD_MANAGER and e["operation"] == "Apply"
                for e in applied["metadata"]["managedFields"]
            )
            assert out_of_sync(body, applied) is None

    asyncio.run(main())


@pytest.fixture
def paced_operator(cluster: KubeEmulator, stats: Any) -> Any:
    running = RunningOperator(cluster, stats, resync_seconds=3600, workers=4, max_rolling_groups=1).start()
    try:
        yield running
    finally:
        running.stop()


def test_a_first_rollout_with_a_new_generation_does_not_hold_other_groups(
    cluster: KubeEmulator, kube_controllers: Any, paced_operator: RunningOperator
) -> None:
    """A Deployment's generation moves with its annotations too: a group still in its first rollout whose
    Deployment got an annotation change is not rolling a new template, and holds no other group's change."""
    cluster.create(pool())
    cluster.wait_for(MP, "local-shm", None, lambda o: has_condition(o, "Ready", "True"))
    kube_controllers.set_readiness(lambda obj: not obj["metadata"]["name"].startswith("a-"))
    cluster.create(group("a", decode={"replicas": 2, "scaler": "External"}))
    cluster.create(group("b"))
    cluster.wait_for(IG, "b", GROUP_NS, lambda o: has_condition(o, "Ready", "True"))
    settle(paced_operator)
    # Only the Deployment's annotations change (its initial count): a new generation, the same template.
    cluster.patch(IG, "a", {"spec": {"decode": {"replicas": 3}}}, GROUP_NS)
    a = cluster.wait_for(DEPLOY, "a-decode", GROUP_NS, lambda d: d["metadata"]["generation"] > 1)
    assert a["metadata"]["annotations"].get("deployment.kubernetes.io/revision") == "1"
    cluster.patch(IG, "b", {"spec": {"decode": {"env": [{"name": "NEW", "value": "1"}]}}}, GROUP_NS)
    cluster.wait_for(DEPLOY, "b-decode", GROUP_NS, lambda d: any(e["name"] == "NEW" for e in _vllm(d).get("env") or []))


@pytest.mark.parametrize(
    "change, field",
    [
        ({"accessMode": "ReadWriteOnce"}, "accessMode"),
        ({"storageClassName": "other"}, "storageClassName"),
        ({"size": "100Gi"}, "size"),
    ],
)
def test_the_groups_claim_only_grows(cluster: KubeEmulator, change: dict[str, Any], field: str) -> None:
    """The CRD refuses what kube-apiserver would refuse on the claim, naming the group's field."""
    from maru_localcluster.apiserver import ApiError

    cluster.create(group(modelCache={"persistentVolumeClaim": {"size": "200Gi"}}))
    with pytest.raises(ApiError) as refused:
        cluster.patch(IG, "qwen", {"spec": {"modelCache": {"persistentVolumeClaim": change}}}, GROUP_NS)
    assert refused.value.code == 422
    assert (
        f"spec.modelCache.persistentVolumeClaim.{field}: {field} of the group's model cache claim"
        in refused.value.message
    ), refused.value.message
    grown = cluster.patch(IG, "qwen", {"spec": {"modelCache": {"persistentVolumeClaim": {"size": "1Ti"}}}}, GROUP_NS)
    assert grown["spec"]["modelCache"]["persistentVolumeClaim"]["size"] == "1Ti"
    # Another claim by name: the operator's own is no longer the group's, nothing to keep.
    cluster.patch(
        IG,
        "qwen",
        {
            "spec": {
                "modelCache": {
                    "persistentVolumeClaim": {"claimName": "shared", "accessMode": "ReadOnlyMany", "size": "1Gi"}
                }
            }
        },
        GROUP_NS,
    )
