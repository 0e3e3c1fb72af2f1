"""Desired ⊆ actual and field ownership: server defaults and others' additions never cause a write; real
drift and fields the operator owns but no longer wants do."""

from __future__ import annotations

import copy

import pytest

from maru_operator.builders.group import build_role_deployment
from maru_operator.ownership import (
    adopted_ownership,
    controlled_by,
    created_body,
    is_subset,
    legacy_owner,
    out_of_sync,
    plan,
    sets_field,
    stale_field,
)
from tests.support.specs import GROUP_OWNER, group_spec, pool_view


def server_version(obj: dict) -> dict:
    """What an API server hands back: defaults filled in, empties dropped, metadata added."""
    actual = copy.deepcopy(obj)
    actual["metadata"].update(
        uid="x",
        resourceVersion="7",
        generation=1,
        creationTimestamp="2026-01-01T00:00:00Z",
        annotations={**obj["metadata"].get("annotations", {}), "deployment.kubernetes.io/revision": "1"},
    )
    spec = actual["spec"]
    spec.setdefault("revisionHistoryLimit", 10)
    spec.setdefault("progressDeadlineSeconds", 600)
    spec.setdefault(
        "strategy", {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}}
    )
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
    return build_role_deployment(
        group_spec(prefill={"resources": {"limits": {"memory": "1024Mi", "cpu": 2}}}),
        "prefill",
        GROUP_OWNER,
        pool_view(),
    )


def test_server_defaults_are_not_drift(desired: dict) -> None:
    assert is_subset(desired, server_version(desired)) is None
    assert out_of_sync(desired, server_version(desired)) is None


def test_normalised_quantities_are_not_drift(desired: dict) -> None:
    actual = server_version(desired)
    actual["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] = {"memory": "1Gi", "cpu": "2"}
    assert is_subset(desired, actual) is None


def test_changed_arg_is_drift(desired: dict) -> None:
    actual = server_version(desired)
    actual["spec"]["template"]["spec"]["containers"][0]["args"][0] = "other/model"
    assert is_subset(desired, actual) == ".spec.template.spec.containers[0].args[0]"
    assert out_of_sync(desired, actual) == ".spec.template.spec.containers[0].args[0]"


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
    assert [(u[0]["metadata"]["name"], u[1]) for u in updates] == [("llama-prefill", ".spec.replicas")]
    assert [d["metadata"]["name"] for d in deletes] == ["stale"]
    creates, updates, deletes = plan([desired], {})
    assert creates == [desired] and updates == [] and deletes == []
    assert plan([desired], {key: server_version(desired)}) == ([], [], [])


def applied(actual: dict, *paths: tuple[str, ...], manager: str = "maru-operator", operation: str = "Apply") -> dict:
    """``actual`` with a managedFields entry of ``manager`` owning ``paths``."""
    tree: dict = {}
    for path in paths:
        node = tree
        for part in path:
            node = node.setdefault(part, {})
    actual["metadata"].setdefault("managedFields", []).append(
        {"manager": manager, "operation": operation, "fieldsType": "FieldsV1", "fieldsV1": tree}
    )
    return actual


POD = ("f:spec", "f:template", "f:spec")
VLLM = (*POD, "f:containers", 'k:{"name":"vllm"}')


def test_a_field_the_operator_owns_but_no_longer_wants_is_stale(desired: dict) -> None:
    actual = applied(server_version(desired), (*POD, "f:nodeSelector"), (*VLLM, "f:args"), (*VLLM, "."))
    actual["spec"]["template"]["spec"]["nodeSelector"] = {"gpu": "a100"}
    assert is_subset(desired, actual) is None  # the subset test alone cannot see a removal
    assert stale_field(desired, actual) == ".spec.template.spec.nodeSelector"
    assert out_of_sync(desired, actual) == ".spec.template.spec.nodeSelector"
    # The same field owned by someone else is theirs to keep.
    other = applied(server_version(desired), (*POD, "f:nodeSelector"), manager="kubectl-edit", operation="Update")
    assert out_of_sync(desired, other) is None


def test_field_paths_name_list_items_by_key(desired: dict) -> None:
    assert sets_field(desired, (*VLLM, "f:image"))
    assert not sets_field(desired, (*POD, "f:containers", 'k:{"name":"sidecar"}', "."))
    assert sets_field(desired, (*VLLM, "f:ports", 'k:{"containerPort":8000,"protocol":"TCP"}', "f:name"))
    assert sets_field(desired, ("f:metadata", "f:labels", "f:maru.io/role"))
    assert not sets_field(desired, ("f:metadata", "f:annotations", "f:x"))
    assert sets_field({"finalizers": ["a"]}, ("f:finalizers", 'v:"a"'))
    assert not sets_field({"finalizers": ["a"]}, ("f:finalizers", 'v:"b"'))
    port = {"ports": [{"containerPort": 80}]}  # the server defaults protocol to TCP in the key
    assert sets_field(port, ("f:ports", 'k:{"containerPort":80,"protocol":"TCP"}', "."))


def test_an_atomic_list_owned_whole_must_equal_the_desired_one() -> None:
    """NetworkPolicy rules are atomic lists: a rule that lost a part is a change, not a subset."""
    from maru_operator.builders.netpol import DEFAULT_NETWORK, build_group_policies

    with_router = build_group_policies(group_spec(), GROUP_OWNER, pool_view(), "maru-system", DEFAULT_NETWORK)[0]
    without = build_group_policies(
        group_spec(router={"enabled": False}), GROUP_OWNER, pool_view(), "maru-system", DEFAULT_NETWORK
    )[0]
    # The router's rule also opens the engines' KV-events port to it: left out, its rule differs by its peers alone.
    with_router["spec"]["ingress"][0]["ports"] = copy.deepcopy(without["spec"]["ingress"][0]["ports"])
    stored = copy.deepcopy(with_router)
    stored["metadata"].update(uid="x", resourceVersion="7", generation=1)
    actual = applied(
        copy.deepcopy(stored),
        ("f:spec", "f:ingress"),
        ("f:spec", "f:egress"),
        ("f:spec", "f:podSelector", "f:matchLabels", "f:app.kubernetes.io/name"),
    )
    assert out_of_sync(with_router, actual) is None
    # Each rule of the wanted ingress is part of a rule present: the subset test alone sees no change.
    assert is_subset(without["spec"]["ingress"], actual["spec"]["ingress"]) is None
    assert out_of_sync(without, actual) == ".spec.ingress"
    # A list someone else owns is theirs: only subset semantics apply.
    theirs = applied(copy.deepcopy(stored), ("f:spec", "f:ingress"), manager="kubectl-edit", operation="Update")
    assert out_of_sync(without, theirs) is None


def test_objects_written_before_server_side_apply_are_taken_over(desired: dict) -> None:
    legacy = applied(server_version(desired), (*POD, "f:nodeSelector"), operation="Update")
    assert legacy_owner(legacy)
    assert out_of_sync(desired, legacy) == "metadata.managedFields"
    applied(legacy, ("f:metadata", "f:labels", "f:x"), operation="Update")  # a second update entry of ours
    applied(legacy, ("f:metadata", "f:annotations", "f:y"), manager="kubectl-annotate", operation="Update")
    adopted = adopted_ownership(legacy)
    assert [(e["manager"], e["operation"]) for e in adopted] == [
        ("kubectl-annotate", "Update"),
        ("maru-operator", "Apply"),
    ]
    assert adopted[1]["fieldsV1"] == {
        "f:spec": {"f:template": {"f:spec": {"f:nodeSelector": {}}}},
        "f:metadata": {"f:labels": {"f:x": {}}},
    }
    assert not legacy_owner({"metadata": {"managedFields": adopted}})  # adopted: an apply removes them now


def test_a_created_child_is_in_sync_until_the_spec_drops_a_field_the_create_set(desired: dict) -> None:
    """Created, never applied to: the create's entry owns its fields and the server's defaults alike."""
    with_selector = copy.deepcopy(desired)
    with_selector["spec"]["template"]["spec"]["nodeSelector"] = {"gpu": "a100"}
    created = applied(
        server_version(created_body(with_selector)),
        (*POD, "f:nodeSelector"),
        (*POD, "f:restartPolicy"),
        ("f:spec", "f:revisionHistoryLimit"),
        operation="Update",
    )
    assert legacy_owner(created)
    # Defaults the spec never set are no reason to write: a converged fleet stays unwritten across restarts.
    assert out_of_sync(with_selector, created) is None
    # The spec dropped the selector: a subset still, but the create's entry would keep it for ever.
    assert is_subset(desired, created) is None
    assert out_of_sync(desired, created) == "metadata.managedFields"
    # A value changed: applied, after its fields are adopted (the same answer, by the first difference).
    changed = copy.deepcopy(with_selector)
    changed["spec"]["template"]["spec"]["nodeSelector"] = {"gpu": "h100"}
    assert out_of_sync(changed, created) == ".spec.template.spec.nodeSelector.gpu"
    # Created by a version that did not annotate: taken over as before.
    unmarked = applied(server_version(with_selector), (*POD, "f:nodeSelector"), operation="Update")
    assert out_of_sync(with_selector, unmarked) == "metadata.managedFields"


def test_controlled_by_needs_the_owners_uid() -> None:
    ref = {"kind": "InferenceGroup", "name": "a", "uid": "u1", "controller": True}
    child = {"metadata": {"ownerReferences": [ref]}}
    assert controlled_by(child, "u1")
    assert not controlled_by(child, "u2")  # a namesake of an earlier owner, or another owner's
    assert not controlled_by({"metadata": {}}, "u1")
    assert not controlled_by({"metadata": {"ownerReferences": [{"uid": "u1"}]}}, "u1")  # owned, not controlled


def test_a_created_childs_fields_are_adopted_without_the_servers_defaults(desired: dict) -> None:
    """kube-apiserver records a create's defaults as the creator's: adopted, they would look stale."""
    created = applied(
        server_version(desired),
        (*POD, "f:restartPolicy"),
        ("f:spec", "f:revisionHistoryLimit"),
        ("f:metadata", "f:labels", "f:app.kubernetes.io/name"),
        operation="Update",
    )
    adopted = adopted_ownership(created, desired=desired)
    assert adopted[-1]["fieldsV1"] == {"f:metadata": {"f:labels": {"f:app.kubernetes.io/name": {}}}}
    assert stale_field(desired, {"metadata": {"managedFields": adopted}}) is None


def test_a_field_reference_owned_whole_is_not_drift_for_its_defaulted_api_version() -> None:
    """ObjectFieldSelector is +structType=atomic: the server records fieldRef as one leaf and fills in its
    apiVersion. A restarted operator must not take that for a change (one write per restart)."""
    env = {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
    desired = {
        "kind": "DaemonSet",
        "metadata": {"name": "a", "namespace": "p"},
        "spec": {"template": {"spec": {"containers": [{"name": "agent", "env": [env]}]}}},
    }
    actual = copy.deepcopy(desired)
    actual["spec"]["template"]["spec"]["containers"][0]["env"][0]["valueFrom"]["fieldRef"]["apiVersion"] = "v1"
    leaf = {
        "f:spec": {
            "f:template": {
                "f:spec": {
                    "f:containers": {
                        'k:{"name":"agent"}': {
                            ".": {},
                            "f:name": {},
                            "f:env": {
                                'k:{"name":"NODE_NAME"}': {".": {}, "f:name": {}, "f:valueFrom": {"f:fieldRef": {}}}
                            },
                        }
                    }
                }
            }
        }
    }
    actual["metadata"]["managedFields"] = [{"manager": "maru-operator", "operation": "Apply", "fieldsV1": leaf}]
    assert out_of_sync(desired, actual) is None
    actual["spec"]["template"]["spec"]["containers"][0]["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] = "x"
    assert out_of_sync(desired, actual) is not None
