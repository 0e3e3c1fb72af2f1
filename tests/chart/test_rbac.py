"""The operator's RBAC: least privilege, no wildcards, no secrets, scoped by watchNamespaces, documented."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.chart.conftest import CHART, NAMESPACE, RELEASE, find, one

pytestmark = pytest.mark.tools

ROLE_KINDS = ("ClusterRole", "Role")
WORKLOAD_VERBS = {"get", "list", "watch", "create", "update", "patch", "delete"}

# (apiGroup, resource) -> verbs, as the operator needs them; the README table must say the same.
CLUSTER_RULES = {
    ("maru.io", "marupools"): {"get", "list", "watch", "patch", "update"},
    ("maru.io", "marupools/status"): {"get", "patch", "update"},
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"},
    ("", "events"): {"create", "patch"},
    ("events.k8s.io", "events"): {"create", "patch"},
}
NAMESPACED_RULES = {
    ("maru.io", "inferencegroups"): {"get", "list", "watch", "patch", "update"},
    ("maru.io", "inferencegroups/status"): {"get", "patch", "update"},
    ("apps", "deployments"): WORKLOAD_VERBS,
    ("apps", "daemonsets"): WORKLOAD_VERBS,
    ("", "services"): WORKLOAD_VERBS,
    ("", "serviceaccounts"): WORKLOAD_VERBS,
    ("", "configmaps"): WORKLOAD_VERBS,
    ("rbac.authorization.k8s.io", "roles"): WORKLOAD_VERBS,
    ("rbac.authorization.k8s.io", "rolebindings"): WORKLOAD_VERBS,
    ("", "pods"): {"get", "list", "watch"},
}
WATCH_NAMESPACES_ONLY_RULES = {("", "namespaces"): {"get", "list", "watch"}}


def grants(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    """(apiGroup, resource) -> verbs, flattened from a role's rules."""
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def all_roles(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] in ROLE_KINDS]


@pytest.fixture(params=["default", "custom"])
def objects(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return request.getfixturevalue(f"{request.param}_objects")


def test_no_wildcard_anywhere(objects: list[dict[str, Any]]) -> None:
    roles = all_roles(objects)
    assert roles
    for role in roles:
        for rule in role["rules"]:
            for field in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[field], f"{role['metadata']['name']}: {field} has '*'"
            assert "nonResourceURLs" not in rule
            assert "resourceNames" not in rule


def test_nothing_on_secrets_and_no_escalation_verbs(objects: list[dict[str, Any]]) -> None:
    for role in all_roles(objects):
        for (group, resource), verbs in grants(role).items():
            assert resource.split("/")[0] != "secrets", f"{role['metadata']['name']} grants {verbs} on secrets"
            assert not verbs & {"escalate", "bind", "impersonate", "deletecollection"}, (group, resource, verbs)


def test_default_grants_exactly_what_the_operator_needs_cluster_wide(default_objects: list[dict[str, Any]]) -> None:
    cluster = one(default_objects, "ClusterRole", RELEASE)
    namespaced = one(default_objects, "ClusterRole", f"{RELEASE}-namespaced")
    assert grants(cluster) == CLUSTER_RULES
    assert grants(namespaced) == NAMESPACED_RULES
    bindings = {b["roleRef"]["name"]: b for b in find(default_objects, "ClusterRoleBinding")}
    assert set(bindings) == {RELEASE, f"{RELEASE}-namespaced"}
    for binding in bindings.values():
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": RELEASE, "namespace": NAMESPACE}]
    assert not find(default_objects, "RoleBinding")
    assert not find(default_objects, "Role")


def test_watch_namespaces_binds_workload_rights_only_in_those_namespaces(
    custom_objects: list[dict[str, Any]],
) -> None:
    namespaced = one(custom_objects, "ClusterRole", f"{RELEASE}-namespaced")
    assert grants(namespaced) == NAMESPACED_RULES
    assert grants(one(custom_objects, "ClusterRole", RELEASE)) == CLUSTER_RULES | WATCH_NAMESPACES_ONLY_RULES
    # Never bound cluster-wide: only the cluster-scoped role has a ClusterRoleBinding.
    assert [b["roleRef"]["name"] for b in find(custom_objects, "ClusterRoleBinding")] == [RELEASE]
    role_bindings = find(custom_objects, "RoleBinding")
    # The watched namespaces, plus the release namespace where the pool daemons run.
    assert sorted(b["metadata"]["namespace"] for b in role_bindings) == ["llm-serving", "llm-staging", NAMESPACE]
    for binding in role_bindings:
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": f"{RELEASE}-namespaced",
        }
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": RELEASE, "namespace": NAMESPACE}]


def test_release_namespace_in_watch_namespaces_gets_one_binding(render) -> None:
    objects = render("--set", f"watchNamespaces={{{NAMESPACE},llm-serving}}")
    assert sorted(b["metadata"]["namespace"] for b in find(objects, "RoleBinding")) == ["llm-serving", NAMESPACE]


def test_router_role_can_be_granted_where_routers_live(custom_objects: list[dict[str, Any]]) -> None:
    """Kubernetes refuses to let the operator create the routers' pod-read Role unless it holds
    pods get/list/watch itself in that namespace (privilege escalation prevention)."""
    bound = {b["metadata"]["namespace"] for b in find(custom_objects, "RoleBinding")}
    namespaced = grants(one(custom_objects, "ClusterRole", f"{RELEASE}-namespaced"))
    assert {"llm-serving", "llm-staging"} <= bound
    assert {"get", "list", "watch"} <= namespaced[("", "pods")]
    assert {"create", "update", "patch"} <= namespaced[("rbac.authorization.k8s.io", "roles")]


def test_rbac_create_false_renders_no_rbac(render) -> None:
    objects = render("--set", "rbac.create=false")
    assert not [o for o in objects if o["apiVersion"].startswith("rbac.authorization.k8s.io/")]


def readme_table() -> dict[tuple[str, str], set[str]]:
    """The RBAC table of the chart README: (apiGroup, resource) -> verbs."""
    text = (CHART / "README.md").read_text()
    table = text.split("<!-- rbac-table:start -->", 1)[1].split("<!-- rbac-table:end -->", 1)[0]
    rows: dict[tuple[str, str], set[str]] = {}
    for line in table.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        group = cells[0].strip("`")
        group = "" if group == "core" else group
        verbs = set(re.findall(r"[a-z]+", cells[2]))
        for resource in re.findall(r"`([a-z/.]+)`", cells[1]):
            assert (group, resource) not in rows, f"README lists {group}/{resource} twice"
            rows[(group, resource)] = verbs
        assert cells[4], f"README row {cells[0]} {cells[1]} gives no reason"
    return rows


def test_readme_lists_every_rule_and_verb(custom_objects: list[dict[str, Any]]) -> None:
    rendered: dict[tuple[str, str], set[str]] = {}
    for role in all_roles(custom_objects):
        rendered.update(grants(role))
    assert readme_table() == rendered
