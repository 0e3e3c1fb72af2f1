"""What kube-apiserver refuses or does on the paths the operator's child writes take, in the emulator too: a
create's fields recorded after defaulting, a Deployment's strategy validated, a PersistentVolumeClaim's update
validated and its resize admitted, a Deployment's generation moved by an annotation, scale writes tagged."""

from __future__ import annotations

from typing import Any

import pytest

from maru_localcluster.apiserver import ApiError
from maru_localcluster.server import KubeEmulator
from tests.k8s.test_server_side_apply import deployment, owned

pytestmark = pytest.mark.emulator

DEPLOY = "deployments.apps"
PVC = "persistentvolumeclaims"


@pytest.fixture
def kube(k8s_emulator: KubeEmulator) -> KubeEmulator:
    return k8s_emulator


def test_a_creates_fields_include_the_servers_defaults(kube: KubeEmulator) -> None:
    created = kube.create(deployment(), field_manager="creator")
    fields = owned(created, "creator", "Update")
    assert ("f:spec", "f:strategy", "f:rollingUpdate", "f:maxSurge") in fields
    assert ("f:spec", "f:template", "f:spec", "f:containers", 'k:{"name":"vllm"}', "f:terminationMessagePath") in fields


def test_recreate_with_rolling_update_parameters_is_refused(kube: KubeEmulator) -> None:
    body = deployment()
    body["spec"]["strategy"] = {"type": "Recreate", "rollingUpdate": {"maxSurge": 1}}
    with pytest.raises(ApiError) as refused:
        kube.create(body)
    assert refused.value.code == 422
    assert (
        "spec.strategy.rollingUpdate: Forbidden: may not be specified when strategy `type` is 'Recreate'"
        in refused.value.message
    )
    body["spec"]["strategy"] = {"type": "Recreate"}
    assert kube.create(body)["spec"]["strategy"] == {"type": "Recreate"}
    # A RollingUpdate without its parameters gets the defaults, as SetDefaults_Deployment gives them.
    changed = kube.patch(DEPLOY, "app", {"spec": {"strategy": {"type": "RollingUpdate"}}}, "default")
    assert changed["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": "25%", "maxSurge": "25%"}


def test_an_annotation_change_moves_a_deployments_generation(kube: KubeEmulator) -> None:
    created = kube.create(deployment())
    assert created["metadata"]["generation"] == 1
    annotated = kube.patch(DEPLOY, "app", {"metadata": {"annotations": {"a": "b"}}}, "default")
    assert annotated["metadata"]["generation"] == 2
    # Not so for other kinds: a Service's generation is its spec's.
    svc = kube.create(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "s", "namespace": "default"},
            "spec": {"ports": [{"port": 80}]},
        }
    )
    assert (
        kube.patch("services", "s", {"metadata": {"annotations": {"a": "b"}}}, "default")["metadata"]["generation"]
        == svc["metadata"]["generation"]
    )


def test_a_scale_write_is_tagged_and_takes_the_replicas(kube: KubeEmulator) -> None:
    kube.apply(deployment(), "maru-operator")
    kube.kubectl("scale", "deployment/app", "--replicas=5", "-n", "default")
    dep = kube.get(DEPLOY, "app", "default")
    assert dep is not None and dep["spec"]["replicas"] == 5
    scalers = [
        e for e in dep["metadata"]["managedFields"] if "f:replicas" in (e.get("fieldsV1") or {}).get("f:spec", {})
    ]
    assert [(e["operation"], e.get("subresource")) for e in scalers] == [("Update", "scale")]
    assert ("f:spec", "f:replicas") not in owned(dep, "maru-operator")
    # The scaler's entry is a manager's like any: an apply setting the replicas conflicts with it.
    with pytest.raises(ApiError) as conflict:
        kube.apply(deployment(), "maru-operator")
    assert conflict.value.code == 409


def _claim(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "c", "namespace": "default"},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "10Gi"}}, **spec},
    }


def _bind(kube: KubeEmulator, size: str = "10Gi") -> None:
    kube.patch_status(PVC, "c", {"phase": "Bound", "capacity": {"storage": size}}, "default")


@pytest.mark.parametrize(
    "change, code, words",
    [
        ({"accessModes": ["ReadWriteOnce"]}, 422, "spec: Forbidden: spec is immutable after creation"),
        ({"storageClassName": "other"}, 422, "spec: Forbidden: spec is immutable after creation"),
        ({"resources": {"requests": {"storage": "5Gi"}}}, 422, "field can not be less than status.capacity"),
        (
            {"resources": {"requests": {"storage": "20Gi"}}},
            403,
            "the storageclass that provisions the pvc must support resize",
        ),
    ],
)
def test_a_bound_claims_spec_changes_are_refused(
    kube: KubeEmulator, change: dict[str, Any], code: int, words: str
) -> None:
    kube.create(_claim(storageClassName="fixed"))
    kube.create(
        {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": "fixed"}, "provisioner": "x"}
    )
    _bind(kube)
    with pytest.raises(ApiError) as refused:
        kube.patch(PVC, "c", {"spec": change}, "default")
    assert refused.value.code == code and words in refused.value.message, refused.value.message


def test_a_claim_grows_only_when_bound_on_a_class_that_expands(kube: KubeEmulator) -> None:
    kube.create(
        {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "StorageClass",
            "metadata": {"name": "grows"},
            "provisioner": "x",
            "allowVolumeExpansion": True,
        }
    )
    kube.create(_claim(storageClassName="grows"))
    bigger = {"spec": {"resources": {"requests": {"storage": "20Gi"}}}}
    with pytest.raises(ApiError) as unbound:
        kube.patch(PVC, "c", bigger, "default")
    assert unbound.value.code == 422
    _bind(kube)
    grown = kube.patch(PVC, "c", bigger, "default")
    assert grown["spec"]["resources"]["requests"]["storage"] == "20Gi"
    # Labels and annotations are no part of the spec: always allowed.
    kube.patch(PVC, "c", {"metadata": {"labels": {"a": "b"}}}, "default")
