"""How the operator writes its children: what it removes, what it leaves, what it never touches."""

from __future__ import annotations

from typing import Any

import pytest

from maru_localcluster.server import KubeEmulator
from maru_operator.builders.scratch import CACHE_ENV
from tests.support.operator import (
    GROUP_NS,
    POOL_NS,
    RunningOperator,
    StubStats,
    condition_of,
    group,
    has_condition,
    pool,
    settle,
)

pytestmark = pytest.mark.emulator

IG = "inferencegroups.maru.io"
MP = "marupools.maru.io"
DEPLOY = "deployments.apps"
NETPOL = "networkpolicies.networking.k8s.io"
DS = "daemonsets.apps"


def pod_spec(kube: KubeEmulator, name: str) -> dict[str, Any]:
    dep = kube.get(DEPLOY, name, GROUP_NS)
    assert dep is not None, name
    return dep["spec"]["template"]["spec"]


def test_fields_removed_from_the_spec_leave_the_children(
    cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]
) -> None:
    cluster.create(
        group(
            prefill={
                "replicas": 1,
                "nodeSelector": {"gpu": "a100"},
                "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
                "resources": {"limits": {"cpu": 2, "memory": "8Gi"}},
            }
        )
    )
    cluster.wait_for(DEPLOY, "qwen-prefill", GROUP_NS)
    # Someone else's field on the same child: never the operator's to remove.
    cluster.patch(
        DEPLOY,
        "qwen-prefill",
        {"metadata": {"annotations": {"team": "search"}}},
        GROUP_NS,
        field_manager="kubectl-annotate",
    )
    settle(operator)
    cluster.patch(
        IG,
        "qwen",
        {
            "spec": {
                "prefill": {
                    "nodeSelector": {"gpu": None, "zone": "b"},
                    "tolerations": None,
                    "resources": {"limits": {"memory": None}},
                }
            }
        },
        GROUP_NS,
    )
    settle(operator)
    spec = pod_spec(cluster, "qwen-prefill")
    assert spec.get("nodeSelector") == {"zone": "b"}  # replaced, not {gpu: a100, zone: b}
    assert "tolerations" not in spec
    # The removed 8Gi limit leaves; the operator's default memory limit takes its place.
    assert spec["containers"][0]["resources"].get("limits") == {"cpu": 2, "memory": "32Gi"}

    cluster.patch(IG, "qwen", {"spec": {"prefill": {"nodeSelector": None}}}, GROUP_NS)
    settle(operator)
    assert "nodeSelector" not in pod_spec(cluster, "qwen-prefill")
    dep = cluster.get(DEPLOY, "qwen-prefill", GROUP_NS)
    assert dep is not None and dep["metadata"]["annotations"]["team"] == "search"


def test_a_field_dropped_before_any_apply_leaves_the_child(
    cluster: KubeEmulator, operator: RunningOperator, stats: StubStats, ready_pool: dict[str, Any]
) -> None:
    """Children are created, not applied, and their fields adopted by the first apply they need. A spec that only
    drops a field (or a part of a policy rule) leaves a child that is still a superset of the desired one: the field
    must go nonetheless, also when the operator restarted in between and remembers nothing of what it created."""
    selector = {"replicas": 1, "nodeSelector": {"gpu": "a100"}}
    cluster.create(group(prefill=selector, decode={**selector, "replicas": 2}))
    cluster.wait_for(IG, "qwen", GROUP_NS, lambda o: has_condition(o, "Ready", "True"))
    settle(operator)
    dep = cluster.get(DEPLOY, "qwen-prefill", GROUP_NS)
    assert dep is not None
    assert {e["operation"] for e in dep["metadata"]["managedFields"] if e["manager"] == "maru-operator"} == {"Update"}
    cluster.patch(IG, "qwen", {"spec": {"prefill": {"nodeSelector": None}}}, GROUP_NS)
    settle(operator)
    assert "nodeSelector" not in pod_spec(cluster, "qwen-prefill")
    assert pod_spec(cluster, "qwen-decode")["nodeSelector"] == {"gpu": "a100"}

    operator.stop()
    # Without the router, the vLLM pods' ingress rule keeps its ports and loses its peers (a list owned whole).
    cluster.patch(IG, "qwen", {"spec": {"decode": {"nodeSelector": None}, "router": {"enabled": False}}}, GROUP_NS)
    restarted = RunningOperator(cluster, stats, resync_seconds=3600, workers=2).start()
    try:
        settle(restarted)
        assert "nodeSelector" not in pod_spec(cluster, "qwen-decode")
        policy = cluster.get(NETPOL, "qwen-vllm", GROUP_NS)
        assert policy is not None and policy["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8000}]}]
        mark = cluster.mark()
        settle(restarted)
        assert cluster.writes_since(mark) == []  # adopted and applied once: in sync from then on
    finally:
        restarted.stop()


def test_children_written_before_server_side_apply_lose_removed_fields(
    cluster: KubeEmulator, operator: RunningOperator, stats: StubStats, ready_pool: dict[str, Any]
) -> None:
    """After an upgrade from a version that wrote children with plain creates and merge patches."""
    cluster.create(group(prefill={"replicas": 1, "nodeSelector": {"gpu": "a100"}}))
    cluster.wait_for(DEPLOY, "qwen-prefill", GROUP_NS)
    settle(operator)
    operator.stop()
    dep = cluster.get(DEPLOY, "qwen-prefill", GROUP_NS)
    assert dep is not None
    # What the earlier version left: its fields owned by plain updates under its User-Agent's name.
    legacy = [
        {**e, "operation": "Update"} if e["manager"] == "maru-operator" else e for e in dep["metadata"]["managedFields"]
    ]
    cluster.patch(DEPLOY, "qwen-prefill", {"metadata": {"managedFields": legacy}}, GROUP_NS)
    cluster.patch(IG, "qwen", {"spec": {"prefill": {"nodeSelector": None}}}, GROUP_NS)
    upgraded = RunningOperator(cluster, stats, resync_seconds=3600, workers=2).start()
    try:
        settle(upgraded)
        assert "nodeSelector" not in pod_spec(cluster, "qwen-prefill")
        managers = {
            (e["manager"], e["operation"])
            for e in cluster.get(DEPLOY, "qwen-prefill", GROUP_NS)["metadata"]["managedFields"]
        }  # type: ignore[index]
        assert ("maru-operator", "Apply") in managers and ("maru-operator", "Update") not in managers
    finally:
        upgraded.stop()


def test_an_object_it_does_not_control_is_never_taken_over(
    cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]
) -> None:
    mine = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "qwen", "namespace": GROUP_NS, "labels": {"owner": "me"}},
        "spec": {"selector": {"app": "mine"}, "ports": [{"port": 80}]},
    }
    cluster.create(mine, field_manager="kubectl-create")
    before = cluster.get("services", "qwen", GROUP_NS)
    cluster.create(group())
    ig = cluster.wait_for(IG, "qwen", GROUP_NS, lambda o: has_condition(o, "Ready", "False", "ChildConflict"))
    message = condition_of(ig, "Ready")["message"]
    assert "Service llm/qwen" in message and "not controlled by" in message
    settle(operator)
    assert cluster.get("services", "qwen", GROUP_NS) == before  # not one field written
    warning = [e for e in cluster.list("events", GROUP_NS) if e.get("reason") == "ChildConflict"]
    assert warning and warning[0]["type"] == "Warning" and "Service llm/qwen" in warning[0]["message"]
    assert cluster.get(DEPLOY, "qwen-decode", GROUP_NS) is not None  # the rest of the group is there

    # Deleting the group never takes the user's Service with it.
    cluster.delete(IG, "qwen", GROUP_NS)
    cluster.wait_gone(DEPLOY, "qwen-decode", GROUP_NS)
    assert cluster.get("services", "qwen", GROUP_NS) == before

    # Once the name is free, a new group gets its own Service.
    cluster.delete("services", "qwen", GROUP_NS)
    cluster.create(group())
    svc = cluster.wait_for("services", "qwen", GROUP_NS)
    assert svc["metadata"]["ownerReferences"][0]["kind"] == "InferenceGroup"


def user_daemonset(name: str) -> dict[str, Any]:
    labels = {"app": "mine"}
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": name, "namespace": POOL_NS},
        "spec": {
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"containers": [{"name": "c", "image": "mine:1"}]}},
        },
    }


def user_service(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": GROUP_NS, "labels": {"owner": "me"}},
        "spec": {"selector": {"app": "mine"}, "ports": [{"port": 80}]},
    }


def assert_conflict_reported(cluster: KubeEmulator, resource: str, namespace: str | None, name: str, what: str) -> None:
    """Ready=False ChildConflict naming the object, and a Warning Event saying the same."""
    owner = cluster.wait_for(resource, name, namespace, lambda o: has_condition(o, "Ready", "False", "ChildConflict"))
    message = condition_of(owner, "Ready")["message"]
    assert what in message and "not controlled by" in message, message
    # Posted right after the status write; a cluster-scoped pool's go to "default".
    event = cluster.wait_until(
        lambda e: next(
            (
                ev
                for ev in e.list_objects("", "events", namespace or "default")
                if ev.get("reason") == "ChildConflict" and ev["involvedObject"]["name"] == name
            ),
            None,
        ),
        message=f"a ChildConflict Event on {name}",
    )
    assert event["type"] == "Warning" and what in event["message"]


def test_a_pool_child_it_does_not_control_is_never_taken_over(cluster: KubeEmulator, operator: RunningOperator) -> None:
    cluster.create(user_daemonset("local-shm-agent"), field_manager="kubectl-create")
    before = cluster.get(DS, "local-shm-agent", POOL_NS)
    cluster.create(pool())
    assert_conflict_reported(cluster, MP, None, "local-shm", f"DaemonSet {POOL_NS}/local-shm-agent")
    settle(operator)
    assert cluster.get(DS, "local-shm-agent", POOL_NS) == before  # not one field written
    assert cluster.get(NETPOL, "local-shm-agent", POOL_NS) is not None  # the rest of the pool is there

    # Deleting the pool never takes the user's DaemonSet with it.
    cluster.delete(MP, "local-shm")
    cluster.wait_gone(MP, "local-shm")
    cluster.wait_gone(NETPOL, "local-shm-agent", POOL_NS)
    assert cluster.get(DS, "local-shm-agent", POOL_NS) == before


@pytest.mark.parametrize("child", ["group Service", "pool DaemonSet"])
def test_a_namesake_created_between_look_and_create_is_never_taken_over(
    cluster: KubeEmulator, operator: RunningOperator, child: str
) -> None:
    """The race: the name is free when the operator looks, and someone creates it before its write lands."""
    if child == "group Service":
        cluster.create(pool())
        cluster.wait_for(MP, "local-shm", None, lambda o: has_condition(o, "Ready", "True"))
        resource, namespace, name, body = "services", GROUP_NS, "qwen", user_service("qwen")
        owner = (IG, GROUP_NS, "qwen", f"Service {GROUP_NS}/qwen")
    else:
        resource, namespace, name, body = DS, POOL_NS, "local-shm-agent", user_daemonset("local-shm-agent")
        owner = (MP, None, "local-shm", f"DaemonSet {POOL_NS}/local-shm-agent")
    plural = resource.split(".")[0]
    taken: dict[str, Any] = {}

    def someone_creates(emulator: Any) -> None:
        group = resource.partition(".")[2]
        taken["obj"] = emulator.create_object(group, plural, namespace, body, manager="kubectl-create")

    # Whatever the operator sends to write that name (a create, or an apply that would create it).
    hook = cluster.on_request(
        rf"/namespaces/{namespace}/{plural}(/{name})?$", someone_creates, method=("POST", "PATCH")
    )
    cluster.create(group() if child == "group Service" else pool())
    assert_conflict_reported(cluster, owner[0], owner[1], owner[2], owner[3])
    settle(operator)
    assert hook.hits == 1
    mine = cluster.get(resource, name, namespace)
    assert mine is not None and "ownerReferences" not in mine["metadata"], mine["metadata"]
    # Not one field written (the DaemonSet controller may have written its status since).
    assert mine["spec"] == taken["obj"]["spec"] and mine["metadata"].get("labels") == body["metadata"].get("labels")
    assert {e["manager"] for e in mine["metadata"]["managedFields"] if not e.get("subresource")} == {"kubectl-create"}


def test_a_child_replaced_before_its_update_is_never_taken_over(
    cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]
) -> None:
    """The operator applies an update to the child it observed: a namesake that replaced it is not that one."""
    cluster.create(group())
    cluster.wait_for(IG, "qwen", GROUP_NS, lambda o: has_condition(o, "Ready", "True"))
    settle(operator)
    replacement: dict[str, Any] = {}

    def someone_replaces(emulator: Any) -> None:
        emulator.delete_object("", "services", GROUP_NS, "qwen")
        replacement["obj"] = emulator.create_object(
            "", "services", GROUP_NS, user_service("qwen"), manager="kubectl-create"
        )

    hook = cluster.on_request(rf"/namespaces/{GROUP_NS}/services/qwen$", someone_replaces, method="PATCH")
    # A change of the router's port: the operator updates its Service.
    cluster.patch(IG, "qwen", {"spec": {"router": {"port": 8080}}}, GROUP_NS)
    assert_conflict_reported(cluster, IG, GROUP_NS, "qwen", f"Service {GROUP_NS}/qwen")
    settle(operator)
    assert hook.hits == 1
    assert cluster.get("services", "qwen", GROUP_NS) == replacement["obj"]


def test_pod_options_reach_the_pods_and_leave_with_the_spec(
    cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]
) -> None:
    options = {
        "env": [
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
            {"name": "HOME", "value": "/models/home"},
        ],
        "volumes": [
            {"name": "models", "persistentVolumeClaim": {"claimName": "model-cache"}},
            {"name": "big-shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}},
            {"name": "big-tmp", "emptyDir": {"sizeLimit": "64Gi"}},
        ],
        "volumeMounts": [
            {"name": "models", "mountPath": "/models"},
            {"name": "big-shm", "mountPath": "/dev/shm"},
            {"name": "big-tmp", "mountPath": "/tmp"},
        ],
        "imagePullSecrets": [{"name": "registry"}],
        "priorityClassName": "inference",
        "serviceAccountName": "model-reader",
        "podLabels": {"team": "search"},
        "strategy": {"type": "Recreate"},
    }
    cluster.create(group(prefill={"replicas": 1, **options}))
    dep = cluster.wait_for(DEPLOY, "qwen-prefill", GROUP_NS)
    pod = dep["spec"]["template"]["spec"]
    env = pod["containers"][0]["env"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in env
    # The user's HOME instead of the read-only root's (env is keyed by name: one HOME).
    assert [e for e in env if e["name"] == "HOME"] == [{"name": "HOME", "value": "/models/home"}]
    # The user's /dev/shm and /tmp replace the operator's; the socket and $HOME emptyDir stay.
    assert {v["name"] for v in pod["volumes"]} == {
        "maru-socket",
        "maru-credential",
        "model-cache",
        "home",
        "models",
        "big-shm",
        "big-tmp",
    }
    assert (pod["serviceAccountName"], pod["priorityClassName"]) == ("model-reader", "inference")
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    # Taken out of the spec, they leave the Deployment (and the operator's volumes and env come back).
    cluster.patch(IG, "qwen", {"spec": {"prefill": {k: None for k in options}}}, GROUP_NS)
    settle(operator)
    dep = cluster.get(DEPLOY, "qwen-prefill", GROUP_NS)
    assert dep is not None
    pod = dep["spec"]["template"]["spec"]
    assert {v["name"] for v in pod["volumes"]} == {
        "maru-socket",
        "maru-credential",
        "dshm",
        "model-cache",
        "home",
        "tmp",
    }
    assert "serviceAccountName" not in pod and "priorityClassName" not in pod and "imagePullSecrets" not in pod
    assert "team" not in dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    env = pod["containers"][0]["env"]
    assert [e["name"] for e in env] == ["PYTHONHASHSEED", "HF_HUB_CACHE", *CACHE_ENV]
    assert {"name": "HOME", "value": CACHE_ENV["HOME"]} in env


def test_a_volume_over_the_pool_socket_touches_nothing(
    cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]
) -> None:
    cluster.create(
        group(
            decode={
                "volumes": [{"name": "v", "emptyDir": {}}],
                "volumeMounts": [{"name": "v", "mountPath": "/run/maru"}],
            }
        )
    )
    ig = cluster.wait_for(IG, "qwen", GROUP_NS, lambda o: has_condition(o, "Ready", "False", "InvalidSpec"))
    assert "spec.decode.volumeMounts" in condition_of(ig, "Ready")["message"]
    settle(operator)
    assert cluster.list(DEPLOY, GROUP_NS) == []


def test_network_policies_are_applied_like_every_child(
    cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]
) -> None:
    cluster.create(group())
    cluster.wait_for(NETPOL, "qwen-router", GROUP_NS)
    settle(operator)
    writes = [r for r in cluster.requests if "/networkpolicies" in r.path and r.is_write]
    # Created (a create fails on a namesake); its fields made applied ones before it is first updated, by apply.
    kinds = {(r.method, r.content_type.split(";")[0]) for r in writes}
    assert ("POST", "application/json") in kinds and kinds <= {
        ("POST", "application/json"),
        ("PATCH", "application/merge-patch+json"),
        ("PATCH", "application/json-patch+json"),
        ("PATCH", "application/apply-patch+yaml"),
    }, [(r.method, r.path, r.content_type) for r in writes]
    policy = cluster.get(NETPOL, "qwen-vllm", GROUP_NS)
    assert policy is not None
    managers = {(e["manager"], e["operation"]) for e in policy["metadata"]["managedFields"]}
    assert managers == {("maru-operator", "Update")}
    rules = policy["spec"]["ingress"]

    # A hand edit of the rules is put back; someone else's label stays.
    cluster.patch(
        NETPOL,
        "qwen-vllm",
        {"metadata": {"labels": {"team": "search"}}, "spec": {"ingress": []}},
        GROUP_NS,
        field_manager="kubectl-edit",
    )
    restored = cluster.wait_for(NETPOL, "qwen-vllm", GROUP_NS, lambda o: o["spec"].get("ingress") == rules)
    assert restored["metadata"]["labels"]["team"] == "search"
    ours = {e["operation"] for e in restored["metadata"]["managedFields"] if e["manager"] == "maru-operator"}
    assert ours == {"Apply"}

    # Without the router its policy goes, and the vLLM pods' ingress opens to whatever routes to them.
    cluster.patch(IG, "qwen", {"spec": {"router": {"enabled": False}}}, GROUP_NS)
    cluster.wait_gone(NETPOL, "qwen-router", GROUP_NS)
    cluster.wait_for(
        NETPOL,
        "qwen-vllm",
        GROUP_NS,
        lambda o: o["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8000}]}],
    )
