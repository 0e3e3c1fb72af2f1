"""The permissions the operator needs, as data: ``maru-operator rbac`` prints them as a ClusterRole and a Role.

Kept next to the code that uses them and checked by tests that run the operator as a ServiceAccount
holding exactly these rules, against an API server that enforces RBAC and OwnerReferencesPermissionEnforcement,
so the chart's RBAC cannot drift from it.

Four scopes:

* cluster-wide (``CLUSTER_RULES``): MaruPools are cluster-scoped, and the operator serves groups in
  every namespace unless told otherwise;
* only with ``--namespace`` (``NAMESPACED_MODE_RULES``): kopf follows the namespaces it serves;
* the pool namespace only (``POOL_NAMESPACE_RULES``, a Role there): writing DaemonSets, which the
  operator creates only where pools run, listing the pool agents' pods, which run there only, and the
  pools' key Secrets (the only Secrets the operator touches: the CSI node plugin mints the groups' credentials);
* the lease namespace only (``LEASE_NAMESPACE_RULES``, a Role there; ``default`` unless
  ``--lease-namespace``): the leader Lease, kept where every release of the cluster looks for it; get and
  patch name that one Lease (``resourceNames``).

The routers read pods through one fixed ClusterRole per operator instance (:func:`router_cluster_role`,
which the chart installs) that the operator binds in each group's namespace. The operator holds ``bind`` on
that one ClusterRole, not the pod rights it grants: RBAC lets whoever may ``bind`` a role reference it in
a binding without holding its rules, so the operator reads no pods outside its own namespace.
"""

from __future__ import annotations

from typing import Any

READ = ["get", "list", "watch"]
MANAGE = ["get", "list", "watch", "create", "patch", "delete"]

Rule = tuple[list[str], list[str], list[str], str]  # (apiGroups, resources, verbs, why)

CLUSTER_RULES: list[Rule] = [
    (
        ["maru.io"],
        ["marupools"],
        [*READ, "patch"],
        "watch the pools; patch adds and removes the pool's in-use finalizer",
    ),
    (["maru.io"], ["inferencegroups"], READ, "watch the groups (the operator writes only their status)"),
    (["maru.io"], ["marupools/status", "inferencegroups/status"], ["patch"], "write status (only when it changed)"),
    (
        ["maru.io"],
        ["marupools/finalizers", "inferencegroups/finalizers"],
        ["update"],
        "never called: children carry blockOwnerDeletion, which clusters with OwnerReferencesPermissionEnforcement "
        "(OpenShift and others) allow only to who may update the owner's finalizers",
    ),
    (["apps"], ["deployments"], MANAGE, "the vLLM, router and pool metadata Deployments; delete prunes unwanted ones"),
    (["apps"], ["daemonsets"], READ, "watch the pool agent DaemonSets (written in the pool namespace only)"),
    ([""], ["services", "serviceaccounts"], MANAGE, "the router Service and ServiceAccount, the pool metadata Service"),
    (
        [""],
        ["persistentvolumeclaims"],
        MANAGE,
        "each group's model cache claim, shared by its vLLM pods (unless the group names its own)",
    ),
    (
        ["policy"],
        ["poddisruptionbudgets"],
        MANAGE,
        "a PodDisruptionBudget per role: a node drain takes a role down one pod at a time",
    ),
    (
        ["rbac.authorization.k8s.io"],
        ["rolebindings"],
        MANAGE,
        "each router's RoleBinding to the routers' ClusterRole (read pods in its namespace)",
    ),
    (
        ["networking.k8s.io"],
        ["networkpolicies"],
        MANAGE,
        "a NetworkPolicy for every pool daemon and serving pod (who may talk to whom)",
    ),
    (
        ["inference.networking.k8s.io"],
        ["inferencepools"],
        MANAGE,
        "the InferencePool of a group with spec.inferencePool.enabled, where the Gateway API Inference Extension's "
        "CRD is installed",
    ),
    (
        ["discovery.k8s.io"],
        ["endpointslices"],
        ["list", "watch"],
        "Ready needs the router Service's ready endpoints "
        "(only slices labelled as the operator's Services are watched)",
    ),
    ([""], ["events"], ["create"], "Events on groups and pools (a pool's go to the default namespace)"),
    (
        ["apiextensions.k8s.io"],
        ["customresourcedefinitions"],
        ["list", "watch"],
        "kopf notices when the CRDs it serves are installed or removed",
    ),
]

# Only with --namespace: kopf lists and watches namespaces to follow the ones it serves.
NAMESPACED_MODE_RULES: list[Rule] = [
    ([""], ["namespaces"], ["list", "watch"], "kopf follows the namespaces it serves (only with --namespace)"),
]

POOL_NAMESPACE_RULES: list[Rule] = [
    (
        ["apps"],
        ["daemonsets"],
        ["create", "patch", "delete"],
        "the pool agent DaemonSets, which run in the pool namespace only",
    ),
    ([""], ["pods"], ["list"], "the pool agents' pods, for the pool's per-node status"),
    (
        [""],
        ["secrets"],
        ["get", "list", "watch", "create", "patch"],
        "each pool's key, next to its daemons; groups' credentials are minted by the CSI node plugin, so no Secret "
        "elsewhere; only the operator's Secrets are watched (label selector); never deleted (ownerReferences do), "
        "never updated",
    ),
]

# What every router needs (vllm-router's Kubernetes service discovery); bound in its group's namespace.
ROUTER_RULES: list[Rule] = [
    ([""], ["pods"], READ, "vllm-router finds its group's prefill and decode pods by label, in its namespace"),
]


def router_role_name(instance: str = "") -> str:
    """The routers' ClusterRole of an operator instance: one per release, as every release has its own instance;
    the chart names it the same way."""
    return f"maru-operator-{instance}-router" if instance else "maru-operator-router"


# Get and patch name the instance's Lease (resourceNames); create cannot: Kubernetes authorizes a create
# before the object has a name, so a create rule with resourceNames never matches.
LEASE_NAMESPACE_RULES: list[Rule] = [
    (
        ["coordination.k8s.io"],
        ["leases"],
        ["create"],
        "leader election: the first replica of an instance creates its Lease (create cannot be limited by name)",
    ),
    (
        ["coordination.k8s.io"],
        ["leases"],
        ["get", "patch"],
        "leader election: only this instance's Lease (resourceNames), in one namespace for every release, so two "
        "releases of the same instance never both lead",
    ),
]
NAMED_LEASE_VERBS = frozenset({"get", "patch"})
# Where every release keeps the Lease of its instance: a namespace every cluster has, the same for all
# releases, and not kube-system (whose Leases elect the control plane's own leaders).
DEFAULT_LEASE_NAMESPACE = "default"


def lease_name(instance: str) -> str:
    """The leader Lease of an operator instance; the chart's leader-election Role names it too."""
    return f"maru-operator-{instance}" if instance else "maru-operator"


def bind_rule(router_role: str) -> Rule:
    return (
        ["rbac.authorization.k8s.io"],
        ["clusterroles"],
        ["bind"],
        f"bind the routers' ClusterRole {router_role} (and no other: resourceNames) in the groups' namespaces",
    )


def rules(namespaced: bool = False, instance: str = "") -> list[Rule]:
    """The rules granted across the cluster (or, with --namespace, in each served namespace)."""
    return CLUSTER_RULES + [bind_rule(router_role_name(instance))] + (NAMESPACED_MODE_RULES if namespaced else [])


def _rules(
    rules_: list[Rule], names: list[str] | None = None, named_verbs: frozenset[str] = frozenset()
) -> list[dict[str, Any]]:
    """RBAC rules; a rule whose verbs are all ``named_verbs`` is limited to the objects ``names``."""
    out = []
    for groups, resources, verbs, _ in rules_:
        rule: dict[str, Any] = {"apiGroups": list(groups), "resources": list(resources), "verbs": list(verbs)}
        if names and set(verbs) <= named_verbs:
            rule["resourceNames"] = list(names)
        out.append(rule)
    return out


BIND = frozenset({"bind"})


def cluster_role(name: str = "maru-operator", namespaced: bool = False, instance: str = "") -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "maru-operator"}},
        "rules": _rules(rules(namespaced, instance), [router_role_name(instance)], BIND),
    }


def router_cluster_role(instance: str = "") -> dict[str, Any]:
    """The routers' rights; the operator binds it, never holds them."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": router_role_name(instance), "labels": {"app.kubernetes.io/name": "maru-operator"}},
        "rules": _rules(ROUTER_RULES),
    }


def pool_namespace_role(namespace: str, name: str = "maru-operator") -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/name": "maru-operator"}},
        "rules": _rules(POOL_NAMESPACE_RULES),
    }


def lease_namespace_role(
    namespace: str = DEFAULT_LEASE_NAMESPACE, name: str = "maru-operator", instance: str = ""
) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {
            "name": f"{name}-leader-election",
            "namespace": namespace,
            "labels": {"app.kubernetes.io/name": "maru-operator"},
        },
        "rules": _rules(LEASE_NAMESPACE_RULES, [lease_name(instance)], NAMED_LEASE_VERBS),
    }


def bindings(
    namespace: str, service_account: str, name: str = "maru-operator", lease_namespace: str = DEFAULT_LEASE_NAMESPACE
) -> list[dict[str, Any]]:
    """A ClusterRoleBinding of :func:`cluster_role`, RoleBindings of :func:`pool_namespace_role` and of
    :func:`lease_namespace_role`; ``namespace``: the pool namespace, where the ServiceAccount is."""
    subjects = [{"kind": "ServiceAccount", "name": service_account, "namespace": namespace}]
    ref = {"apiGroup": "rbac.authorization.k8s.io", "name": name}
    labels = {"app.kubernetes.io/name": "maru-operator"}
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": name, "labels": labels},
            "roleRef": {**ref, "kind": "ClusterRole"},
            "subjects": subjects,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": name, "namespace": namespace, "labels": labels},
            "roleRef": {**ref, "kind": "Role"},
            "subjects": subjects,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": f"{name}-leader-election", "namespace": lease_namespace, "labels": labels},
            "roleRef": {**ref, "kind": "Role", "name": f"{name}-leader-election"},
            "subjects": subjects,
        },
    ]


def allows(
    verb: str,
    group: str,
    resource: str,
    namespaced: bool = False,
    *,
    in_pool_namespace: bool = False,
    in_lease_namespace: bool = False,
    name: str | None = None,
    instance: str = "",
) -> bool:
    """Whether the documented rules grant ``verb`` on ``group``/``resource`` (in the pool or lease namespace or
    not); ``name``: the object's, for the rules that name theirs."""
    if in_lease_namespace and resource == "leases" and verb in NAMED_LEASE_VERBS and name != lease_name(instance):
        return False
    if resource == "clusterroles" and verb in BIND and name != router_role_name(instance):
        return False
    scope = (
        rules(namespaced, instance)
        + (POOL_NAMESPACE_RULES if in_pool_namespace else [])
        + (LEASE_NAMESPACE_RULES if in_lease_namespace else [])
    )
    return any(group in groups and resource in resources and verb in verbs for groups, resources, verbs, _ in scope)
