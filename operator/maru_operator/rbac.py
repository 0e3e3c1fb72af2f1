"""The permissions the operator needs, as data: ``maru-operator rbac`` prints them as a ClusterRole.

Kept next to the code that uses them and checked by a test that replays every request the operator
makes in the integration scenarios against these rules, so the chart's RBAC cannot drift from it.
"""

from __future__ import annotations

from typing import Any

READ = ["get", "list", "watch"]
MANAGE = ["get", "list", "watch", "create", "patch", "delete"]

# (apiGroups, resources, verbs, why)
RULES: list[tuple[list[str], list[str], list[str], str]] = [
    (["maru.io"], ["marupools", "inferencegroups"], [*READ, "patch"],
     "watch the custom resources; patch adds and removes the pool's in-use finalizer"),
    (["maru.io"], ["marupools/status", "inferencegroups/status"], ["get", "patch"],
     "write status (only when it changed)"),
    (["apps"], ["deployments", "daemonsets"], MANAGE,
     "the vLLM, router and pool metadata Deployments, the pool agent DaemonSet; delete prunes unwanted ones"),
    ([""], ["services", "serviceaccounts"], MANAGE, "the router Service and ServiceAccount, the pool metadata Service"),
    (["rbac.authorization.k8s.io"], ["roles", "rolebindings"], MANAGE,
     "the router's Role (read pods in its namespace) and RoleBinding"),
    ([""], ["pods"], READ,
     "list the pool agents' pods for per-node status; also required to grant the router read access to pods "
     "(RBAC refuses to create a Role with permissions its creator lacks)"),
    ([""], ["events"], ["create", "patch"],
     "Events on groups and pools (pools' in the default namespace); kopf may patch its own"),
    (["apiextensions.k8s.io"], ["customresourcedefinitions"], READ,
     "kopf discovers the CRDs it serves and notices when they are installed or removed"),
]


def cluster_role(name: str = "maru-operator") -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "maru-operator"}},
        "rules": [{"apiGroups": list(groups), "resources": list(resources), "verbs": list(verbs)}
                  for groups, resources, verbs, _ in RULES],
    }


def allows(verb: str, group: str, resource: str) -> bool:
    return any(group in groups and resource in resources and verb in verbs for groups, resources, verbs, _ in RULES)
