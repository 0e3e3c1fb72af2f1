"""Desired ⊆ actual: server defaults and others' additions never cause a write; real drift does."""

from __future__ import annotations

import copy

import pytest

from maru_operator.builders.group import build_role_deployment
from maru_operator.reconcile import is_subset, patch_for, plan
from tests.operator.helpers import GROUP_OWNER, group_spec, pool_view


def server_version(obj: dict) -> dict:
    """What an API server hands back: defaults filled in, empties dropped, metadata added."""
    actual = copy.deepcopy(obj)
    actual["metadata"].update(uid="x", resourceVersion="7", generation=1, creationTimestamp="2026-01-01T00:00:00Z",
                              annotations={"deployment.kubernetes.io/revision": "1"})
    spec = actual["spec"]
    spec.update(revisionHistoryLimit=10, progressDeadlineSeconds=600)
    spec["strategy"] = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}}
    pod = spec["template"]["spec"]
    pod.update(restartPolicy="Always", dnsPolicy="ClusterFirst", schedulerName="default-scheduler")
    for c in pod["containers"]:
        c.update(terminationMessagePath="/dev/termination-log", terminationMessagePolicy="File")
        if c.get("resources") == {}:
            del c["resources"]
    actual["status"] = {"replicas": 1}
    return actual


@pytest.fixture
def desired() -> dict:
    return build_role_deployment(group_spec(prefill={"resources": {"limits": {"memory": "1024Mi", "cpu": 2}}}),
                                 "prefill", GROUP_OWNER, pool_view())


def test_server_defaults_are_not_drift(desired: dict) -> None:
    assert is_subset(desired, server_version(desired)) is None
    assert patch_for(desired, server_version(desired)) is None


def test_normalised_quantities_are_not_drift(desired: dict) -> None:
    actual = server_version(desired)
    actual["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] = {"memory": "1Gi", "cpu": "2"}
    assert is_subset(desired, actual) is None


def test_changed_arg_is_drift(desired: dict) -> None:
    actual = server_version(desired)
    actual["spec"]["template"]["spec"]["containers"][0]["args"][0] = "other/model"
    assert is_subset(desired, actual) == ".spec.template.spec.containers[0].args[0]"
    patch = patch_for(desired, actual)
    assert patch is not None
    assert patch["spec"]["template"]["spec"]["containers"][0]["args"][0] == desired["spec"]["template"]["spec"][
        "containers"][0]["args"][0]
    assert "name" not in patch["metadata"] and "status" not in patch


def test_extra_list_item_is_drift(desired: dict) -> None:
    actual = server_version(desired)
    actual["spec"]["template"]["spec"]["volumes"].append({"name": "x", "emptyDir": {}})
    assert is_subset(desired, actual) == ".spec.template.spec.volumes"


def test_removed_label_is_drift(desired: dict) -> None:
    actual = server_version(desired)
    del actual["metadata"]["labels"]["maru.io/role"]
    assert is_subset(desired, actual) == ".metadata.labels.maru.io/role"


def test_replicas_scaled_by_hand_is_drift(desired: dict) -> None:
    actual = server_version(desired)
    actual["spec"]["replicas"] = 5
    assert is_subset(desired, actual) == ".spec.replicas"


def test_bool_is_not_int() -> None:
    assert is_subset({"a": True}, {"a": 1}) == ".a"
    assert is_subset({"a": False}, {}) is None


def test_plan_creates_updates_deletes(desired: dict) -> None:
    other = copy.deepcopy(desired)
    other["metadata"]["name"] = "stale"
    changed = server_version(desired)
    changed["spec"]["replicas"] = 3
    key = ("Deployment", "llm", "llama-prefill")
    stale_key = ("Deployment", "llm", "stale")
    creates, updates, deletes = plan([desired], {key: changed, stale_key: other})
    assert creates == []
    assert [u[0]["metadata"]["name"] for u in updates] == ["llama-prefill"]
    assert [d["metadata"]["name"] for d in deletes] == ["stale"]
    creates, updates, deletes = plan([desired], {})
    assert creates == [desired] and updates == [] and deletes == []
    assert plan([desired], {key: server_version(desired)}) == ([], [], [])
