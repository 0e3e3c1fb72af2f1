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
    (["maru.io"], ["marupools"], [*READ, "patch"],
     "watch the pools; patch adds and removes the pool's in-use finalizer"),
    (["maru.io"], ["inferencegroups"], READ, "watch the groups (the operator writes only their status)"),
    (["maru.io"], ["marupools/status", "inferencegroups/status"], ["patch"], "write status (only when it changed)"),
    (["apps"], ["deployments", "daemonsets"], MANAGE,
     "the vLLM, router and pool metadata Deployments, the pool agent DaemonSet; delete prunes unwanted ones"),
    ([""], ["services", "serviceaccounts"], MANAGE, "the router Service and ServiceAccount, the pool metadata Service"),
    (["rbac.authorization.k8s.io"], ["roles", "rolebindings"], MANAGE,
     "the router's Role (read pods in its namespace) and RoleBinding"),
    (["networking.k8s.io"], ["networkpolicies"], MANAGE,
     "a NetworkPolicy for every pool daemon and serving pod (who may talk to whom)"),
    ([""], ["pods"], READ,
     "list the pool agents' pods for per-node status; also required to grant the router read access to pods "
     "(RBAC refuses to create a Role with permissions its creator lacks)"),
    ([""], ["events"], ["create"], "Events on groups and pools (a pool's go to the default namespace)"),
    (["apiextensions.k8s.io"], ["customresourcedefinitions"], ["list", "watch"],
     "kopf notices when the CRDs it serves are installed or removed"),
]


# Only with --namespace: kopf lists and watches namespaces to follow the ones it serves.
NAMESPACED_RULES: list[tuple[list[str], list[str], list[str], str]] = [
    ([""], ["namespaces"], ["list", "watch"], "kopf follows the namespaces it serves (only with --namespace)"),
]


def rules(namespaced: bool = False) -> list[tuple[list[str], list[str], list[str], str]]:
    return RULES + (NAMESPACED_RULES if namespaced else [])


def cluster_role(name: str = "maru-operator", namespaced: bool = False) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "maru-operator"}},
        "rules": [{"apiGroups": list(groups), "resources": list(resources), "verbs": list(verbs)}
                  for groups, resources, verbs, _ in rules(namespaced)],
    }


def allows(verb: str, group: str, resource: str, namespaced: bool = False) -> bool:
    return any(group in groups and resource in resources and verb in verbs
               for groups, resources, verbs, _ in rules(namespaced))
