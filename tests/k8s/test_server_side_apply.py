"""Server-side apply and field ownership in the emulator, as kube-apiserver has them.

What an operator that applies its children relies on: an apply of a partial object removes the fields
its manager set before and no longer sets, and nothing another manager set; a field another manager
owns is a conflict unless forced; every write records its manager in managedFields.
"""

from __future__ import annotations

import copy
import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from maru_localcluster.apiserver import ApiError
from maru_localcluster.fieldmanager import from_fields_v1
from maru_localcluster.server import KubeEmulator
from tests.k8s.test_emulator import CRD, GROUP

pytestmark = pytest.mark.emulator

OPERATOR = "maru-operator"


@pytest.fixture
def kube(k8s_emulator: KubeEmulator) -> KubeEmulator:
    return k8s_emulator


def deployment(**pod: Any) -> dict[str, Any]:
    container = {
        "name": "vllm",
        "image": "vllm:1",
        "resources": {"limits": {"cpu": "2", "memory": "8Gi"}},
        "env": [{"name": "A", "value": "1"}],
    }
    container.update(pod.pop("container", {}))
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "app", "namespace": "default", "labels": {"app": "x"}},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "x"}},
            "template": {"metadata": {"labels": {"app": "x"}}, "spec": {"containers": [container], **pod}},
        },
    }


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]


def owned(obj: dict[str, Any], manager: str, operation: str | None = None) -> set[tuple[str, ...]]:
    return set().union(
        *(
            from_fields_v1(e["fieldsV1"])
            for e in obj["metadata"].get("managedFields", [])
            if e["manager"] == manager and operation in (None, e["operation"])
        )
    )


def test_apply_creates_and_records_the_manager(kube: KubeEmulator) -> None:
    created = kube.apply(deployment(nodeSelector={"gpu": "a100"}), OPERATOR)
    (entry,) = created["metadata"]["managedFields"]
    assert (entry["manager"], entry["operation"], entry["apiVersion"], entry["fieldsType"]) == (
        OPERATOR,
        "Apply",
        "apps/v1",
        "FieldsV1",
    )
    paths = owned(created, OPERATOR)
    assert ("f:spec", "f:replicas") in paths
    assert ("f:spec", "f:template", "f:spec", "f:nodeSelector") in paths  # an atomic map: owned whole
    item = ("f:spec", "f:template", "f:spec", "f:containers", 'k:{"name":"vllm"}')
    assert (*item, ".") in paths and (*item, "f:image") in paths
    # Defaults the server filled in belong to nobody.
    assert ("f:spec", "f:revisionHistoryLimit") not in paths
    assert created["spec"]["revisionHistoryLimit"] == 10


def test_apply_removes_what_the_manager_no_longer_sets(kube: KubeEmulator) -> None:
    kube.apply(deployment(nodeSelector={"gpu": "a100"}, tolerations=[{"key": "gpu", "operator": "Exists"}]), OPERATOR)
    desired = deployment(nodeSelector={"zone": "b"})
    del desired["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"]
    desired["metadata"]["labels"] = {"team": "ml"}
    after = kube.apply(desired, OPERATOR)
    spec = pod_spec(after)
    assert spec["nodeSelector"] == {"zone": "b"}  # replaced, not the union
    assert "tolerations" not in spec
    assert spec["containers"][0]["resources"]["limits"] == {"cpu": "2"}
    assert after["metadata"]["labels"] == {"team": "ml"}
    assert after["metadata"]["generation"] == 2


def test_fields_of_other_managers_survive(kube: KubeEmulator) -> None:
    kube.apply(deployment(), OPERATOR)
    live = kube.get("deployments.apps", "app", "default")
    assert live is not None
    # A user adds an annotation and an env var; another controller adds a container of its own.
    containers = copy.deepcopy(pod_spec(live)["containers"])
    containers[0]["env"].append({"name": "USER", "value": "mine"})
    containers.append({"name": "sidecar", "image": "proxy:1"})
    kube.patch(
        "deployments.apps",
        "app",
        {"metadata": {"annotations": {"note": "keep"}}},
        "default",
        field_manager="kubectl-annotate",
    )
    kube.patch(
        "deployments.apps",
        "app",
        {"spec": {"template": {"spec": {"containers": containers}}}},
        "default",
        content_type="application/strategic-merge-patch+json",
        field_manager="mesh-injector",
    )
    # The operator drops its env var A.
    desired = deployment(container={"env": [{"name": "B", "value": "2"}]})
    after = kube.apply(desired, OPERATOR)
    assert after["metadata"]["annotations"] == {"note": "keep"}
    vllm, sidecar = pod_spec(after)["containers"]
    assert [e["name"] for e in vllm["env"]] == ["B", "USER"]
    assert sidecar["name"] == "sidecar"
    assert ("f:metadata", "f:annotations", "f:note") in owned(after, "kubectl-annotate", "Update")


def test_conflict_unless_forced(kube: KubeEmulator) -> None:
    kube.apply(deployment(), OPERATOR)
    kube.patch("deployments.apps", "app", {"spec": {"replicas": 5}}, "default", field_manager="kubectl-scale")
    scaled = kube.get("deployments.apps", "app", "default")
    assert scaled is not None
    assert ("f:spec", "f:replicas") in owned(scaled, "kubectl-scale")
    assert ("f:spec", "f:replicas") not in owned(scaled, OPERATOR)  # an update takes the field
    with pytest.raises(ApiError) as err:
        kube.apply(deployment(), OPERATOR)
    assert err.value.code == 409
    assert 'conflict with "kubectl-scale"' in err.value.message and ".spec.replicas" in err.value.message
    assert err.value.details["causes"] == [
        {"reason": "FieldManagerConflict", "message": 'conflict with "kubectl-scale"', "field": ".spec.replicas"}
    ]
    assert kube.get("deployments.apps", "app", "default")["spec"]["replicas"] == 5  # type: ignore[index]
    forced = kube.apply(deployment(), OPERATOR, force=True)
    assert forced["spec"]["replicas"] == 2
    assert ("f:spec", "f:replicas") in owned(forced, OPERATOR)
    assert not owned(forced, "kubectl-scale")  # its only field was taken: the entry is gone


def test_same_value_is_shared_and_survives_one_owner_leaving(kube: KubeEmulator) -> None:
    kube.apply(deployment(nodeSelector={"gpu": "a100"}), OPERATOR)
    other = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "app", "namespace": "default"},
        "spec": {"template": {"spec": {"nodeSelector": {"gpu": "a100"}}}},
    }
    kube.apply(other, "platform-policy")  # same value: no conflict, both own it
    after = kube.apply(deployment(), OPERATOR)
    assert pod_spec(after)["nodeSelector"] == {"gpu": "a100"}


def test_a_no_op_apply_writes_nothing(kube: KubeEmulator) -> None:
    first = kube.apply(deployment(), OPERATOR)
    changes = kube.call(lambda: kube.emulator.resource_version)
    again = kube.apply(deployment(), OPERATOR)
    assert again["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]
    assert again["metadata"]["managedFields"] == first["metadata"]["managedFields"]
    assert kube.call(lambda: kube.emulator.resource_version) == changes


def test_custom_resources_merge_by_their_schema(kube: KubeEmulator) -> None:
    crd = copy.deepcopy(CRD)
    props = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    props["ports"] = {
        "type": "array",
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["name"],
        "items": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": {"type": "string"}, "port": {"type": "integer"}},
        },
    }
    props["tags"] = {"type": "array", "items": {"type": "string"}}  # atomic by default
    kube.create(crd)
    widget = {
        "apiVersion": f"{GROUP}/v1",
        "kind": "Widget",
        "metadata": {"name": "w", "namespace": "default"},
        "spec": {"size": 2, "ports": [{"name": "a", "port": 1}], "tags": ["x"]},
    }
    kube.apply(widget, OPERATOR)
    kube.patch(
        f"widgets.{GROUP}",
        "w",
        {"spec": {"ports": [{"name": "a", "port": 1}, {"name": "b", "port": 2}]}},
        "default",
        field_manager="user",
    )
    widget["spec"].update(ports=[{"name": "c", "port": 3}], tags=["y"])
    after = kube.apply(widget, OPERATOR)
    # The user's item b stays (owned by the user); the operator's a goes; the atomic list is replaced.
    assert [p["name"] for p in after["spec"]["ports"]] == ["c", "b"]
    assert after["spec"]["tags"] == ["y"]


def test_status_writes_are_tracked_per_subresource(kube: KubeEmulator) -> None:
    kube.apply(deployment(), OPERATOR)
    kube.patch_status("deployments.apps", "app", {"replicas": 2}, "default")
    obj = kube.get("deployments.apps", "app", "default")
    assert obj is not None
    status = [e for e in obj["metadata"]["managedFields"] if e.get("subresource") == "status"]
    assert [e["manager"] for e in status] == ["localcluster"]
    assert ("f:status", "f:replicas") in from_fields_v1(status[0]["fieldsV1"])


def http_apply(kube: KubeEmulator, body: dict[str, Any], query: str) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        f"{kube.url}/apis/apps/v1/namespaces/default/deployments/app?{query}",
        method="PATCH",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/apply-patch+yaml", "User-Agent": "some-client/1.0"},
    )
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_apply_over_http_needs_a_field_manager_and_honours_force(kube: KubeEmulator) -> None:
    code, answer = http_apply(kube, deployment(), "")
    assert code == 400 and "fieldManager" in answer["message"]
    code, answer = http_apply(kube, deployment(), f"fieldManager={OPERATOR}")
    assert code == 200 and answer["metadata"]["managedFields"][0]["manager"] == OPERATOR
    kube.patch("deployments.apps", "app", {"spec": {"replicas": 7}}, "default", field_manager="kubectl-edit")
    code, answer = http_apply(kube, deployment(), f"fieldManager={OPERATOR}")
    assert code == 409 and answer["reason"] == "Conflict"
    code, answer = http_apply(kube, deployment(), f"fieldManager={OPERATOR}&force=true")
    assert code == 200 and answer["spec"]["replicas"] == 2
    # Without a fieldManager, other writes are recorded under the client's User-Agent.
    request = urllib.request.Request(
        f"{kube.url}/apis/apps/v1/namespaces/default/deployments/app",
        method="PATCH",
        data=json.dumps({"metadata": {"labels": {"extra": "1"}}}).encode(),
        headers={"Content-Type": "application/merge-patch+json", "User-Agent": "some-client/1.0"},
    )
    with urllib.request.urlopen(request) as response:
        assert ("f:metadata", "f:labels", "f:extra") in owned(json.loads(response.read()), "some-client")


def test_an_apply_with_a_repeated_list_key_is_refused(kube: KubeEmulator) -> None:
    # kube-apiserver cannot build the typed object: env is keyed by name, so two "A" entries are ambiguous.
    twice = deployment(container={"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]})
    with pytest.raises(ApiError) as caught:
        kube.apply(twice, OPERATOR)
    assert caught.value.code == 500
    assert '.spec.template.spec.containers[name="vllm"].env: duplicate entries for key [name="A"]' in str(caught.value)
    assert kube.get("deployments.apps", "app", "default") is None
    # Other writes keep the duplicates they are given, as the real API server does.
    created = kube.create(twice)
    assert [e["name"] for e in pod_spec(created)["containers"][0]["env"]] == ["A", "A"]


def test_a_uid_in_the_body_is_a_precondition(kube: KubeEmulator) -> None:
    """What a controller relies on to write only the very object it observed, never a namesake."""
    created = kube.apply(deployment(), OPERATOR)
    uid = created["metadata"]["uid"]
    same = deployment()
    same["metadata"]["uid"] = uid
    code, answer = http_apply(kube, same, f"fieldManager={OPERATOR}&force=true")
    assert code == 200, answer

    # Another object of that name (deleted and created again): the apply is refused, as kube-apiserver's
    # ValidateObjectMetaUpdate does (the uid is immutable), and changes nothing.
    other = copy.deepcopy(same)
    other["metadata"]["uid"] = "0b7c9c2e-0000-4000-8000-000000000000"
    before = kube.get("deployments.apps", "app", "default")
    code, answer = http_apply(kube, other, f"fieldManager={OPERATOR}&force=true")
    assert code == 422 and answer["reason"] == "Invalid", answer
    assert (
        'metadata.uid: Invalid value: "0b7c9c2e-0000-4000-8000-000000000000": field is immutable' in (answer["message"])
    )
    assert kube.get("deployments.apps", "app", "default") == before
    # A merge patch naming another uid: the same.
    with pytest.raises(ApiError) as caught:
        kube.patch("deployments.apps", "app", {"metadata": {"uid": "other", "labels": {"b": "1"}}}, "default")
    assert caught.value.code == 422

    # Gone: an apply naming a uid never creates (kube-apiserver's patcher answers 409).
    kube.delete("deployments.apps", "app", "default")
    code, answer = http_apply(kube, same, f"fieldManager={OPERATOR}&force=true")
    assert code == 409 and answer["reason"] == "Conflict", answer
    assert answer["message"] == (
        f'Operation cannot be fulfilled on deployments.apps "app": uid mismatch: the '
        f"provided object specified uid {uid}, and no existing object was found"
    )
    assert kube.get("deployments.apps", "app", "default") is None


def test_an_update_with_another_uid_fails_its_precondition(kube: KubeEmulator) -> None:
    created = kube.apply(deployment(), OPERATOR)
    body = copy.deepcopy(created)
    body["metadata"]["uid"] = "another"
    with pytest.raises(ApiError) as caught:
        kube.replace("deployments.apps", "app", body, "default")
    assert caught.value.code == 409
    assert f"Precondition failed: UID in precondition: another, UID in object meta: {created['metadata']['uid']}" in (
        str(caught.value.message)
    )


def test_an_update_and_an_apply_by_one_name_are_two_managers(kube: KubeEmulator) -> None:
    """kube-apiserver keys managers by (name, operation): an apply never removes, and conflicts with, what the
    same name wrote with a plain update."""
    kube.create(deployment(nodeSelector={"gpu": "a100"}), field_manager=OPERATOR)  # an Update
    kube.apply(deployment(nodeSelector={"gpu": "a100"}), OPERATOR)
    after = kube.apply(deployment(), OPERATOR)  # no nodeSelector any more
    assert pod_spec(after)["nodeSelector"] == {"gpu": "a100"}  # still the Update's
    assert {(e["manager"], e["operation"]) for e in after["metadata"]["managedFields"]} == {
        (OPERATOR, "Update"),
        (OPERATOR, "Apply"),
    }
    with pytest.raises(ApiError) as err:
        kube.apply(deployment(nodeSelector={"gpu": "h100"}), OPERATOR)
    assert err.value.code == 409 and f'conflict with "{OPERATOR}"' in err.value.message
    forced = kube.apply(deployment(nodeSelector={"gpu": "h100"}), OPERATOR, force=True)
    assert pod_spec(forced)["nodeSelector"] == {"gpu": "h100"}
    assert ("f:spec", "f:template", "f:spec", "f:nodeSelector") not in owned(forced, OPERATOR, "Update")


def test_label_selectors_are_atomic(kube: KubeEmulator) -> None:
    """LabelSelector is +structType=atomic: a forced apply takes the whole selector, never merges into it (a
    NetworkPolicy's podSelector; a topology spread constraint's labelSelector, inside a list merged by key)."""

    def policy(labels: dict[str, str]) -> dict[str, Any]:
        return {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "np", "namespace": "default"},
            "spec": {"podSelector": {"matchLabels": labels}, "policyTypes": ["Ingress"]},
        }

    def spread(labels: dict[str, str]) -> dict[str, Any]:
        return deployment(
            topologySpreadConstraints=[
                {
                    "topologyKey": "zone",
                    "whenUnsatisfiable": "DoNotSchedule",
                    "maxSkew": 1,
                    "labelSelector": {"matchLabels": labels},
                }
            ]
        )

    kube.apply(policy({"a": "1"}), OPERATOR)
    after = kube.apply(policy({"b": "2"}), "someone-else", force=True)
    assert after["spec"]["podSelector"] == {"matchLabels": {"b": "2"}}
    assert ("f:spec", "f:podSelector") in owned(after, "someone-else")
    assert ("f:spec", "f:podSelector") not in owned(after, OPERATOR)

    kube.apply(spread({"a": "1"}), OPERATOR)
    after = kube.apply(spread({"b": "2"}), "someone-else", force=True)
    (constraint,) = pod_spec(after)["topologySpreadConstraints"]
    assert constraint["labelSelector"] == {"matchLabels": {"b": "2"}}
