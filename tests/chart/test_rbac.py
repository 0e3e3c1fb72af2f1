"""The operator's RBAC: least privilege, no wildcards, scoped by watchNamespaces, documented."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from tests.support.chart import CHART, NAMESPACE, RELEASE, REPO_ROOT, find, one

pytestmark = pytest.mark.tools

ROLE_KINDS = ("ClusterRole", "Role")
CHILD_VERBS = {"get", "list", "watch", "create", "patch", "delete"}

# (apiGroup, resource) -> verbs, as the operator needs them; the README table must say the same.
CLUSTER_RULES = {
    ("maru.io", "marupools"): {"get", "list", "watch", "patch"},
    ("maru.io", "marupools/status"): {"patch"},
    ("maru.io", "marupools/finalizers"): {"update"},
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
    ("", "events"): {"create"},
}
WATCH_NAMESPACES_ONLY_RULES = {
    ("", "namespaces"): {"list", "watch"},
    ("maru.io", "inferencegroups"): {"list"},
}
NAMESPACED_RULES = {
    ("maru.io", "inferencegroups"): {"get", "list", "watch"},
    ("maru.io", "inferencegroups/status"): {"patch"},
    ("maru.io", "inferencegroups/finalizers"): {"update"},
    ("apps", "deployments"): CHILD_VERBS,
    ("apps", "daemonsets"): {"get", "list", "watch"},
    ("", "services"): CHILD_VERBS,
    ("", "serviceaccounts"): CHILD_VERBS,
    # Earlier versions' router Roles, pruned; never written.
    ("rbac.authorization.k8s.io", "rolebindings"): CHILD_VERBS,
    # Only the routers' ClusterRole (resourceNames): the routers' pod reads, granted without holding them.
    ("rbac.authorization.k8s.io", "clusterroles"): {"bind"},
    ("networking.k8s.io", "networkpolicies"): CHILD_VERBS,
    ("", "persistentvolumeclaims"): CHILD_VERBS,
    ("policy", "poddisruptionbudgets"): CHILD_VERBS,
    ("discovery.k8s.io", "endpointslices"): {"list", "watch"},
    # A group's InferencePool, where the Gateway API Inference Extension's CRD is installed.
    ("inference.networking.k8s.io", "inferencepools"): CHILD_VERBS,
}
# A Role in the release namespace, where the pool daemons run.
POOL_NAMESPACE_RULES = {
    ("apps", "daemonsets"): {"create", "patch", "delete"},
    ("", "pods"): {"list"},
    # The pools' keys: never deleted (ownerReferences), never updated. The groups' credentials are minted by
    # the CSI node plugin, so the operator holds no Secret right anywhere else.
    ("", "secrets"): CHILD_VERBS - {"delete"},
}
# The routers' ClusterRole, which the operator binds in the groups' namespaces.
ROUTER_RULES = {("", "pods"): {"get", "list", "watch"}}
ROUTER_CLUSTER_ROLE = "maru-operator-router"
# A Role in leaseNamespace: the leader Lease, where every release of the cluster looks for it.
LEASE_NAMESPACE_RULES = {
    ("coordination.k8s.io", "leases"): {"get", "create", "patch"},
}
# Never called: required by OwnerReferencesPermissionEnforcement to set blockOwnerDeletion on children.
FINALIZER_UPDATES = {("maru.io", "marupools/finalizers"), ("maru.io", "inferencegroups/finalizers")}


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
            assert "*" not in rule.get("resourceNames", [])


def test_no_secret_deletes_and_no_escalation_verbs(objects: list[dict[str, Any]]) -> None:
    for role in all_roles(objects):
        for rule in role["rules"]:
            verbs = set(rule["verbs"])
            if "secrets" in rule["resources"]:
                assert not verbs & {"delete", "update"}, f"{role['metadata']['name']} grants {verbs} on secrets"
            assert not verbs & {"escalate", "impersonate", "deletecollection"}, rule
            if "bind" in verbs:  # the routers' ClusterRole by name, nothing else
                assert rule["resources"] == ["clusterroles"] and rule["verbs"] == ["bind"], rule
                (router,) = rule["resourceNames"]
                assert grants(one(objects, "ClusterRole", router)) == ROUTER_RULES


def test_no_secret_rule_outside_the_release_namespace(objects: list[dict[str, Any]]) -> None:
    """Secrets only through a Role of the release namespace: never a ClusterRole, which a ClusterRoleBinding (or a
    RoleBinding in a group's namespace) would grant elsewhere."""
    holders = []
    for role in all_roles(objects):
        if ("", "secrets") in grants(role):
            holders.append((role["kind"], role["metadata"].get("namespace")))
            bound = [
                b
                for b in find(objects, "RoleBinding") + find(objects, "ClusterRoleBinding")
                if b["roleRef"]["name"] == role["metadata"]["name"] and b["roleRef"]["kind"] == role["kind"]
            ]
            assert {(b["kind"], b["metadata"].get("namespace")) for b in bound} == {("RoleBinding", NAMESPACE)}
    assert holders == [("Role", NAMESPACE)]


def test_default_grants_exactly_what_the_operator_needs_cluster_wide(default_objects: list[dict[str, Any]]) -> None:
    cluster = one(default_objects, "ClusterRole", RELEASE)
    namespaced = one(default_objects, "ClusterRole", f"{RELEASE}-namespaced")
    assert grants(cluster) == CLUSTER_RULES
    assert grants(namespaced) == NAMESPACED_RULES
    bindings = {b["roleRef"]["name"]: b for b in find(default_objects, "ClusterRoleBinding")}
    assert set(bindings) == {RELEASE, f"{RELEASE}-namespaced"}
    for binding in bindings.values():
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": RELEASE, "namespace": NAMESPACE}]
    assert_pool_namespace_role(default_objects)
    assert [b["roleRef"]["kind"] for b in find(default_objects, "RoleBinding")] == ["Role", "Role"]


def assert_pool_namespace_role(objects: list[dict[str, Any]], lease_namespace: str = "default") -> None:
    """DaemonSet writes in the release namespace (where pools run) and nowhere else; the leader Lease in
    leaseNamespace and nowhere else."""
    for role_name, namespace, rules in (
        (f"{RELEASE}-pool-namespace", NAMESPACE, POOL_NAMESPACE_RULES),
        (f"{RELEASE}-leader-election", lease_namespace, LEASE_NAMESPACE_RULES),
    ):
        role = one(objects, "Role", role_name)
        assert role["metadata"]["namespace"] == namespace
        assert grants(role) == rules
        binding = one(objects, "RoleBinding", role_name)
        assert binding["metadata"]["namespace"] == namespace
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role_name}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": RELEASE, "namespace": NAMESPACE}]


def test_the_lease_namespace_is_one_for_every_release(render) -> None:
    """Whatever the release namespace: two releases of one instance must find the same Lease."""
    for namespace in (NAMESPACE, "team-b"):
        objects = render(namespace=namespace)
        role = one(objects, "Role", f"{RELEASE}-leader-election")
        assert role["metadata"]["namespace"] == "default"
        (deployment,) = find(objects, "Deployment")
        assert "--lease-namespace=default" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    moved = render("--set", "leaseNamespace=maru-leases")
    assert_pool_namespace_role(moved, lease_namespace="maru-leases")


@pytest.mark.parametrize("instance", ["", "team-a"])
def test_the_lease_role_reads_and_renews_only_its_instance_lease(render, instance: str) -> None:
    """get and patch name the instance's Lease; create cannot (Kubernetes authorizes it before the name)."""
    from maru_operator.rbac import lease_name, lease_namespace_role

    role = one(render("--set", f"instance={instance}"), "Role", f"{RELEASE}-leader-election")
    by_verbs = {tuple(sorted(r["verbs"])): r.get("resourceNames") for r in role["rules"]}
    assert by_verbs == {("create",): None, ("get", "patch"): [lease_name(instance)]}
    # The same rules as `maru-operator rbac` prints, which the operator's tests run under.
    assert role["rules"] == lease_namespace_role(instance=instance)["rules"]


def test_watch_namespaces_binds_workload_rights_only_in_those_namespaces(
    custom_objects: list[dict[str, Any]],
) -> None:
    namespaced = one(custom_objects, "ClusterRole", f"{RELEASE}-namespaced")
    assert grants(namespaced) == NAMESPACED_RULES
    assert grants(one(custom_objects, "ClusterRole", RELEASE)) == CLUSTER_RULES | WATCH_NAMESPACES_ONLY_RULES
    # Never bound cluster-wide: only the cluster-scoped role has a ClusterRoleBinding.
    assert [b["roleRef"]["name"] for b in find(custom_objects, "ClusterRoleBinding")] == [RELEASE]
    assert_pool_namespace_role(custom_objects)
    role_bindings = [b for b in find(custom_objects, "RoleBinding") if b["roleRef"]["kind"] == "ClusterRole"]
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
    bound = [b for b in find(objects, "RoleBinding") if b["roleRef"]["kind"] == "ClusterRole"]
    assert sorted(b["metadata"]["namespace"] for b in bound) == ["llm-serving", NAMESPACE]


def test_routers_are_bound_a_cluster_role_the_operator_does_not_hold(render) -> None:
    """The operator may bind the routers' ClusterRole where routers live, and reads pods only in its own
    namespace: no pod rights across the cluster or in the groups' namespaces."""
    from maru_operator.rbac import router_role_name

    for instance in ("", "team-a"):
        objects = render("--set", f"instance={instance}")
        router = one(objects, "ClusterRole", router_role_name(instance))
        assert grants(router) == ROUTER_RULES
        namespaced = one(objects, "ClusterRole", f"{RELEASE}-namespaced")
        (bind,) = [r for r in namespaced["rules"] if "bind" in r["verbs"]]
        assert bind["resourceNames"] == [router_role_name(instance)]
        for role in all_roles(objects):
            if role is router:
                continue
            pods = grants(role).get(("", "pods"), set())
            where = role["metadata"].get("namespace")
            assert not pods or (where == NAMESPACE and pods == {"list"}), (role["metadata"]["name"], pods)


def test_rbac_create_false_renders_no_rbac(render) -> None:
    objects = render("--set", "rbac.create=false")
    assert not [o for o in objects if o["apiVersion"].startswith("rbac.authorization.k8s.io/")]


def readme_table() -> dict[str, dict[tuple[str, str], set[str]]]:
    """The RBAC table of the chart README: scope -> (apiGroup, resource) -> verbs."""
    text = (CHART / "README.md").read_text()
    table = text.split("<!-- rbac-table:start -->", 1)[1].split("<!-- rbac-table:end -->", 1)[0]
    rows: dict[str, dict[tuple[str, str], set[str]]] = {}
    for line in table.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        group = cells[0].strip("`")
        group = "" if group == "core" else group
        verbs = set(re.findall(r"[a-z]+", cells[2]))
        scope = rows.setdefault(cells[3], {})
        for resource in re.findall(r"`([a-z/.]+)`", cells[1]):
            assert (group, resource) not in scope, f"README lists {group}/{resource} twice in one scope"
            scope[(group, resource)] = verbs
        assert len(cells[4]) > 20, f"README row {cells[0]} {cells[1]} gives no reason"
    return rows


def test_readme_lists_every_rule_and_verb(custom_objects: list[dict[str, Any]]) -> None:
    table = readme_table()
    assert set(table) == {
        "cluster",
        "cluster, only with `watchNamespaces`",
        "namespaced",
        "release namespace",
        "lease namespace",
        "routers (bound by the operator)",
    }
    assert table["cluster"] == CLUSTER_RULES
    assert table["cluster, only with `watchNamespaces`"] == WATCH_NAMESPACES_ONLY_RULES
    assert table["namespaced"] == NAMESPACED_RULES
    assert table["release namespace"] == POOL_NAMESPACE_RULES
    assert table["lease namespace"] == LEASE_NAMESPACE_RULES
    assert table["routers (bound by the operator)"] == ROUTER_RULES
    assert (
        grants(one(custom_objects, "ClusterRole", RELEASE))
        == table["cluster"] | table["cluster, only with `watchNamespaces`"]
    )
    assert grants(one(custom_objects, "ClusterRole", f"{RELEASE}-namespaced")) == table["namespaced"]


# --- the rules against the operator's code ------------------------------------------------------------

VERB_OF_METHOD = {"POST": {"create"}, "PATCH": {"patch"}, "DELETE": {"delete"}, "PUT": {"update"}}


def _operator_children() -> list[dict[str, Any]]:
    """What the operator creates for the examples, through its own builders."""
    from maru_operator.render import render as render_children

    return [d for d in yaml.safe_load_all(render_children([REPO_ROOT / "examples"], NAMESPACE)) if d]


def _plural(obj: dict[str, Any]) -> tuple[str, str]:
    from maru_operator.kube import KINDS

    group = obj["apiVersion"].rpartition("/")[0]
    return group, KINDS[obj["kind"]].plural


def test_operator_client_methods_are_covered() -> None:
    """Every HTTP method the operator's client sends maps to a granted verb, and nothing unused is granted."""
    source = (REPO_ROOT / "operator" / "maru_operator" / "kube.py").read_text()
    methods = set(re.findall(r"self\.request\(\s*\"([A-Z]+)\"", source))
    assert {"GET", "POST", "PATCH", "DELETE"} <= methods
    used = set().union(*(VERB_OF_METHOD.get(m, set()) for m in methods))
    rules = {**NAMESPACED_RULES, **CLUSTER_RULES}
    granted = set().union(
        *(v for k, v in rules.items() if k not in FINALIZER_UPDATES),
        *POOL_NAMESPACE_RULES.values(),
        *LEASE_NAMESPACE_RULES.values(),
    )
    write_verbs = {"create", "patch", "delete", "update"}
    assert granted & write_verbs == used & write_verbs
    # The only update granted is the one the API server checks, never sent.
    assert {k for k, v in rules.items() if "update" in v} == FINALIZER_UPDATES
    assert all(rules[k] == {"update"} for k in FINALIZER_UPDATES)


def test_every_kind_the_operator_creates_is_granted() -> None:
    children = _operator_children()
    created = {_plural(obj) for obj in children}
    assert {("apps", "deployments"), ("apps", "daemonsets"), ("", "services")} <= created
    from maru_operator.applier import NEVER_PRUNED
    from maru_operator.kube import KINDS

    never_deleted = {("", KINDS[kind].plural) for kind in NEVER_PRUNED}
    assert ("", "secrets") in created & never_deleted
    for key in created:
        granted = NAMESPACED_RULES.get(key, set()) | POOL_NAMESPACE_RULES.get(key, set())
        needed = CHILD_VERBS - {"delete"} if key in never_deleted else CHILD_VERBS
        assert granted >= needed, f"the operator creates {key} without the rights"


def test_every_resource_the_operator_watches_is_granted() -> None:
    from maru_operator.handlers import CHILD_RESOURCES

    for group, _version, plural in CHILD_RESOURCES:
        assert {"list", "watch"} <= NAMESPACED_RULES[(group, plural)], plural
    # The pools' key Secrets: watched in the release namespace only, by the operator's own watch.
    assert ("", "v1", "secrets") not in CHILD_RESOURCES
    assert {"list", "watch"} <= POOL_NAMESPACE_RULES[("", "secrets")]
    for key in (("maru.io", "marupools"),):
        assert {"list", "watch"} <= CLUSTER_RULES[key]
    assert {"list", "watch"} <= NAMESPACED_RULES[("maru.io", "inferencegroups")]


def test_the_operator_binds_only_the_cluster_role_it_may_bind() -> None:
    """Kubernetes refuses a binding to a role whose rights its creator lacks, unless it may ``bind`` that
    role: every binding the operator writes names the routers' ClusterRole, and it writes no Role."""
    children = _operator_children()
    assert not [o for o in children if o["kind"] in ("Role", "ClusterRole")]
    bindings = [o for o in children if o["kind"] == "RoleBinding"]
    assert bindings, "the examples' InferenceGroup has a router"
    for binding in bindings:
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": ROUTER_CLUSTER_ROLE,
        }
