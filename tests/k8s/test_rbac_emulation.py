"""RBAC in the emulator: tokens, Roles and bindings, escalation prevention, OwnerReferencesPermissionEnforcement.

What an operator's RBAC must survive on a hardened cluster (OpenShift turns the owner-reference check
on): requests with a ServiceAccount's token are allowed only what its bindings grant.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from maru_localcluster.server import KubeEmulator
from tests.k8s.test_emulator import CRD, GROUP, widget

pytestmark = pytest.mark.emulator

RBAC = "rbac.authorization.k8s.io/v1"


def http(
    kube: KubeEmulator,
    method: str,
    path: str,
    token: str | None,
    body: Any = None,
    content_type: str = "application/json",
) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": content_type}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(
        kube.url + path, method=method, headers=headers, data=json.dumps(body).encode() if body is not None else None
    )
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def grant(
    kube: KubeEmulator,
    name: str,
    rules: list[dict[str, Any]],
    namespace: str | None = None,
    account: tuple[str, str] = ("default", "robot"),
) -> None:
    """A (Cluster)Role with ``rules`` bound to the ServiceAccount ``account``."""
    kind = "Role" if namespace else "ClusterRole"
    meta = {"name": name, **({"namespace": namespace} if namespace else {})}
    kube.create({"apiVersion": RBAC, "kind": kind, "metadata": meta, "rules": rules})
    kube.create(
        {
            "apiVersion": RBAC,
            "kind": f"{kind}Binding",
            "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": name},
            "subjects": [{"kind": "ServiceAccount", "namespace": account[0], "name": account[1]}],
        }
    )


def rule(group: str, resources: list[str], verbs: list[str]) -> dict[str, Any]:
    return {"apiGroups": [group], "resources": resources, "verbs": verbs}


@pytest.fixture
def kube(k8s_emulator: KubeEmulator) -> KubeEmulator:
    k8s_emulator.create(CRD)
    k8s_emulator.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "other"}})
    return k8s_emulator


@pytest.fixture
def token(kube: KubeEmulator) -> str:
    return kube.service_account_token("default", "robot")


def test_tokens_authenticate_and_rbac_authorizes(kube: KubeEmulator, token: str) -> None:
    assert http(kube, "GET", "/api/v1/namespaces/default/configmaps", None)[0] == 200  # no token: admin
    assert http(kube, "GET", "/api/v1/namespaces/default/configmaps", "forged")[0] == 401
    code, answer = http(kube, "GET", "/api/v1/namespaces/default/configmaps", token)
    assert code == 403 and answer["reason"] == "Forbidden"
    assert 'User "system:serviceaccount:default:robot" cannot list resource "configmaps"' in answer["message"]
    assert http(kube, "GET", "/version", token)[0] == 200  # discovery is open to every authenticated user

    grant(kube, "read-cm", [rule("", ["configmaps"], ["get", "list", "watch"])], namespace="default")
    assert http(kube, "GET", "/api/v1/namespaces/default/configmaps", token)[0] == 200
    assert http(kube, "GET", "/api/v1/namespaces/other/configmaps", token)[0] == 403  # a Role is one namespace
    assert http(kube, "POST", "/api/v1/namespaces/default/configmaps", token, {"metadata": {"name": "x"}})[0] == 403
    grant(kube, "write-cm", [rule("", ["configmaps"], ["create"])])  # a ClusterRole: everywhere
    assert http(kube, "POST", "/api/v1/namespaces/other/configmaps", token, {"metadata": {"name": "x"}})[0] == 201
    assert kube.allowed(token, "create", "configmaps", "default")
    assert not kube.allowed(token, "delete", "configmaps", "default")


def test_apply_that_creates_needs_create(kube: KubeEmulator, token: str) -> None:
    grant(kube, "patch-cm", [rule("", ["configmaps"], ["patch"])])
    path = "/api/v1/namespaces/default/configmaps/x?fieldManager=robot"
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}, "data": {"a": "1"}}
    assert http(kube, "PATCH", path, token, body, "application/apply-patch+yaml")[0] == 403
    kube.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x", "namespace": "default"}})
    assert http(kube, "PATCH", path, token, body, "application/apply-patch+yaml")[0] == 200


def test_block_owner_deletion_needs_update_on_the_owners_finalizers(kube: KubeEmulator, token: str) -> None:
    owner = kube.create(widget("w", 2))
    grant(kube, "cm", [rule("", ["configmaps"], ["create", "patch", "delete", "get"])])
    ref = {
        "apiVersion": f"{GROUP}/v1",
        "kind": "Widget",
        "name": "w",
        "uid": owner["metadata"]["uid"],
        "controller": True,
    }
    child = {"metadata": {"name": "c", "ownerReferences": [{**ref, "blockOwnerDeletion": True}]}}
    code, answer = http(kube, "POST", "/api/v1/namespaces/default/configmaps", token, child)
    assert code == 403
    assert "cannot set blockOwnerDeletion" in answer["message"]
    assert f'cannot update resource "widgets/finalizers" in API group "{GROUP}"' in answer["message"]
    # Without blockOwnerDeletion the owner reference alone is fine.
    plain = {"metadata": {"name": "c", "ownerReferences": [ref]}}
    assert http(kube, "POST", "/api/v1/namespaces/default/configmaps", token, plain)[0] == 201
    grant(kube, "widget-finalizers", [rule(GROUP, ["widgets/finalizers"], ["update"])])
    child["metadata"]["name"] = "d"
    assert http(kube, "POST", "/api/v1/namespaces/default/configmaps", token, child)[0] == 201


def test_changing_owner_references_needs_delete(kube: KubeEmulator, token: str) -> None:
    owner = kube.create(widget("w", 2))
    kube.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "namespace": "default"}})
    grant(kube, "cm", [rule("", ["configmaps"], ["get", "patch"])])
    ref = {"apiVersion": f"{GROUP}/v1", "kind": "Widget", "name": "w", "uid": owner["metadata"]["uid"]}
    patch = {"metadata": {"ownerReferences": [ref]}}
    path = "/api/v1/namespaces/default/configmaps/c"
    assert http(kube, "PATCH", path, token, patch, "application/merge-patch+json")[0] == 403
    assert http(kube, "PATCH", path, token, {"data": {"a": "1"}}, "application/merge-patch+json")[0] == 200
    grant(kube, "cm-delete", [rule("", ["configmaps"], ["delete"])])
    assert http(kube, "PATCH", path, token, patch, "application/merge-patch+json")[0] == 200


def test_roles_grant_only_what_their_writer_holds(kube: KubeEmulator, token: str) -> None:
    grant(kube, "rbac-writer", [rule("rbac.authorization.k8s.io", ["roles", "rolebindings"], ["create"])])
    pod_reader = {
        "apiVersion": RBAC,
        "kind": "Role",
        "metadata": {"name": "pods"},
        "rules": [rule("", ["pods"], ["get", "list"])],
    }
    code, answer = http(kube, "POST", "/apis/rbac.authorization.k8s.io/v1/namespaces/default/roles", token, pod_reader)
    assert code == 403 and "attempting to grant RBAC permissions not currently held" in answer["message"]
    grant(kube, "pods-read", [rule("", ["pods"], ["get", "list"])], namespace="default")
    assert (
        http(kube, "POST", "/apis/rbac.authorization.k8s.io/v1/namespaces/default/roles", token, pod_reader)[0] == 201
    )
    binding = {
        "apiVersion": RBAC,
        "kind": "RoleBinding",
        "metadata": {"name": "pods"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pods"},
        "subjects": [{"kind": "ServiceAccount", "namespace": "default", "name": "router"}],
    }
    assert (
        http(kube, "POST", "/apis/rbac.authorization.k8s.io/v1/namespaces/default/rolebindings", token, binding)[0]
        == 201
    )
    # In a namespace where the writer cannot read pods, neither may its Role.
    assert http(kube, "POST", "/apis/rbac.authorization.k8s.io/v1/namespaces/other/roles", token, pod_reader)[0] == 403


def test_bind_lets_a_writer_reference_a_role_it_does_not_hold(kube: KubeEmulator, token: str) -> None:
    """As Kubernetes' BindingAuthorized: ``bind`` on the ClusterRole by name, checked in the binding's namespace
    (a RoleBinding of it there is enough), lets the writer grant it without holding its rules."""
    kube.create(
        {
            "apiVersion": RBAC,
            "kind": "ClusterRole",
            "metadata": {"name": "pod-reader"},
            "rules": [rule("", ["pods"], ["get", "list"])],
        }
    )
    binder = {
        "apiVersion": RBAC,
        "kind": "ClusterRole",
        "metadata": {"name": "binder"},
        "rules": [
            rule("rbac.authorization.k8s.io", ["rolebindings"], ["create"]),
            {**rule("rbac.authorization.k8s.io", ["clusterroles"], ["bind"]), "resourceNames": ["pod-reader"]},
        ],
    }
    kube.create(binder)
    kube.create(
        {
            "apiVersion": RBAC,
            "kind": "RoleBinding",
            "metadata": {"name": "binder", "namespace": "default"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "binder"},
            "subjects": [{"kind": "ServiceAccount", "namespace": "default", "name": "robot"}],
        }
    )

    def binding(role: str) -> dict[str, Any]:
        return {
            "apiVersion": RBAC,
            "kind": "RoleBinding",
            "metadata": {"name": role},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": [{"kind": "ServiceAccount", "namespace": "default", "name": "router"}],
        }

    path = "/apis/rbac.authorization.k8s.io/v1/namespaces/{}/rolebindings"
    assert http(kube, "POST", path.format("default"), token, binding("pod-reader"))[0] == 201
    # Another ClusterRole by name, or the same one where the writer may not bind: refused.
    kube.create(
        {
            "apiVersion": RBAC,
            "kind": "ClusterRole",
            "metadata": {"name": "secret-reader"},
            "rules": [rule("", ["secrets"], ["get"])],
        }
    )
    code, answer = http(kube, "POST", path.format("default"), token, binding("secret-reader"))
    assert code == 403 and "may not bind" in answer["message"]
    assert http(kube, "POST", path.format("other"), token, binding("pod-reader"))[0] == 403


def test_token_request_issues_bound_service_account_tokens(kube: KubeEmulator) -> None:
    # What the kubelet mounts into pods: a token from the TokenRequest API, valid while its pod and
    # ServiceAccount exist, held to the ServiceAccount's RBAC.
    kube.create({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "robot", "namespace": "default"}})
    pod = kube.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "p", "namespace": "default"},
            "spec": {"serviceAccountName": "robot", "containers": [{"name": "c", "image": "i"}]},
        }
    )
    path = "/api/v1/namespaces/default/serviceaccounts/robot/token"
    ref = {"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": pod["metadata"]["uid"]}
    code, answer = http(kube, "POST", path, None, {"spec": {"expirationSeconds": 3607, "boundObjectRef": ref}})
    assert code == 201 and answer["kind"] == "TokenRequest"
    token = answer["status"]["token"]
    assert http(kube, "POST", path, None, {"spec": {"expirationSeconds": 60}})[0] == 422
    assert http(kube, "POST", "/api/v1/namespaces/default/serviceaccounts/nobody/token", None, {})[0] == 404

    grant(kube, "read-pods", [rule("", ["pods"], ["get"])], namespace="default")
    assert http(kube, "GET", "/api/v1/namespaces/default/pods/p", token)[0] == 200
    assert http(kube, "GET", "/api/v1/namespaces/default/secrets", token)[0] == 403
    assert http(kube, "GET", "/api/v1/namespaces/default/pods/p", token[:-2] + "xx")[0] == 401
    # A token meant for another audience is not one for the API server.
    other = http(kube, "POST", path, None, {"spec": {"audiences": ["vault"]}})[1]["status"]["token"]
    assert http(kube, "GET", "/api/v1/namespaces/default/pods/p", other)[0] == 401
    kube.delete("pods", "p", "default")
    assert http(kube, "GET", "/api/v1/namespaces/default/pods/p", token)[0] == 401  # its pod is gone
