"""The admission plugins of kube-apiserver that change what a pod is, for the local cluster.

* **ServiceAccount**: a pod runs as ``spec.serviceAccountName`` (default ``default``), which must
  exist, and unless ``automountServiceAccountToken`` is false (pod, else ServiceAccount) gets the
  projected ``kube-api-access-*`` volume (token, ``ca.crt``, ``namespace``) mounted at
  ``/var/run/secrets/kubernetes.io/serviceaccount`` in every container.
* **Priority**: ``priorityClassName`` must name an existing PriorityClass; ``spec.priority`` is set
  from it. ``system-node-critical`` and ``system-cluster-critical`` exist from the start.
* **QoS class**: ``status.qosClass`` (Guaranteed, Burstable or BestEffort) is set at creation.
"""

from __future__ import annotations

import random
import string
from typing import Any

from maru_localcluster.apiserver import ApiError, Emulator, JsonObj, ResourceType
from maru_operator.quantity import parse_quantity

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
SYSTEM_PRIORITY_CLASSES = {"system-node-critical": 2000001000, "system-cluster-critical": 2000000000}


def _pod_create(rt: ResourceType, old: JsonObj | None) -> bool:
    return rt.key == ("", "pods") and old is None


def _forbidden(pod: JsonObj, why: str) -> ApiError:
    name = (pod.get("metadata") or {}).get("name") or (pod.get("metadata") or {}).get("generateName", "")
    return ApiError(403, "Forbidden", f'pods "{name}" is forbidden: {why}', {"name": name, "kind": "pods"})


def service_accounts(emulator: Emulator) -> Any:
    def admit(rt: ResourceType, pod: JsonObj, old: JsonObj | None) -> JsonObj:
        if not _pod_create(rt, old):
            return pod
        spec = pod.setdefault("spec", {})
        ns = pod["metadata"]["namespace"]
        name = spec.get("serviceAccountName") or spec.get("serviceAccount") or "default"
        spec["serviceAccountName"] = name
        account = emulator.get_object("", "serviceaccounts", ns, name)
        if account is None:
            raise _forbidden(pod, f'error looking up service account {ns}/{name}: serviceaccount "{name}" not found')
        automount = spec.get("automountServiceAccountToken")
        if automount is None:
            automount = account.get("automountServiceAccountToken")
        containers = (spec.get("containers") or []) + (spec.get("initContainers") or [])
        mounted = any(
            m.get("mountPath") == SERVICE_ACCOUNT_DIR for c in containers for m in c.get("volumeMounts") or []
        )
        if automount is False or mounted:
            return pod
        volume = "kube-api-access-" + "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
        spec.setdefault("volumes", []).append(
            {
                "name": volume,
                "projected": {
                    "defaultMode": 420,
                    "sources": [
                        {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                        {
                            "downwardAPI": {
                                "items": [
                                    {
                                        "path": "namespace",
                                        "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"},
                                    }
                                ]
                            }
                        },
                    ],
                },
            }
        )
        for c in containers:
            c.setdefault("volumeMounts", []).append(
                {"name": volume, "mountPath": SERVICE_ACCOUNT_DIR, "readOnly": True}
            )
        return pod

    return admit


def priority(emulator: Emulator) -> Any:
    def admit(rt: ResourceType, pod: JsonObj, old: JsonObj | None) -> JsonObj:
        if not _pod_create(rt, old):
            return pod
        spec = pod.setdefault("spec", {})
        name = spec.get("priorityClassName")
        if name:
            pc = emulator.get_object("scheduling.k8s.io", "priorityclasses", None, name)
            if pc is None:
                raise _forbidden(pod, f"no PriorityClass with name {name} was found")
        else:
            pc = next(
                (c for c in emulator.list_objects("scheduling.k8s.io", "priorityclasses") if c.get("globalDefault")),
                None,
            )
        spec["priority"] = int(pc["value"]) if pc else 0
        if pc and pc.get("preemptionPolicy"):
            spec["preemptionPolicy"] = pc["preemptionPolicy"]
        return pod

    return admit


def qos_class(pod_spec: JsonObj) -> str:
    containers = pod_spec.get("containers") or []
    any_set = guaranteed = False
    guaranteed = bool(containers)
    for c in containers:
        resources = c.get("resources") or {}
        limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
        for kind in ("cpu", "memory"):
            if kind in limits or kind in requests:
                any_set = True
            limit = limits.get(kind)
            request = requests.get(kind, limit)
            if limit is None or parse_quantity(request) != parse_quantity(limit):
                guaranteed = False
    if not any_set:
        return "BestEffort"
    return "Guaranteed" if guaranteed else "Burstable"


def qos(_emulator: Emulator) -> Any:
    def admit(rt: ResourceType, pod: JsonObj, old: JsonObj | None) -> JsonObj:
        if _pod_create(rt, old):
            pod["status"] = {**(pod.get("status") or {}), "qosClass": qos_class(pod.get("spec") or {})}
        return pod

    return admit


def install(emulator: Emulator) -> None:
    """Add the plugins and the system PriorityClasses (call on the emulator's loop)."""
    emulator.admission.extend([service_accounts(emulator), priority(emulator), qos(emulator)])
    for name, value in SYSTEM_PRIORITY_CLASSES.items():
        if emulator.get_object("scheduling.k8s.io", "priorityclasses", None, name) is None:
            emulator.create_object(
                "scheduling.k8s.io",
                "priorityclasses",
                None,
                {
                    "apiVersion": "scheduling.k8s.io/v1",
                    "kind": "PriorityClass",
                    "metadata": {"name": name},
                    "value": value,
                    "description": "Used for system critical pods that must not be moved from their current node."
                    if name == "system-node-critical"
                    else "Used for system critical pods that must run in the cluster, but can be moved to another node "
                    "if necessary.",
                    "preemptionPolicy": "PreemptLowerPriority",
                },
            )
