"""Ownership and labels shared by every builder: one place, so every child is findable the same way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from maru_operator.api.common import API_VERSION
from maru_operator.names import label_value
from maru_operator.objects import Object as Object  # re-exported: the builders take their object type from here

MANAGED_BY = "maru-operator"
PART_OF = "maru"

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_ROLE = "maru.io/role"
# Set on a group's children so `kubectl get all -l maru.io/pool=<pool>` finds who uses a pool.
LABEL_POOL = "maru.io/pool"
# Which operator installation serves an object: set by users on MaruPools and InferenceGroups (none:
# the default instance), copied by the operator onto their children.
LABEL_OPERATOR_INSTANCE = "maru.io/operator-instance"


def instance_selector(instance: str) -> str:
    """The label selector of what an operator instance serves ("" is the default instance)."""
    return f"{LABEL_OPERATOR_INSTANCE}={instance}" if instance else f"!{LABEL_OPERATOR_INSTANCE}"


@dataclass(frozen=True)
class Owner:
    """The custom resource a child belongs to; ``uid`` is None when rendering without a cluster."""

    kind: str
    name: str
    namespace: str | None = None
    uid: str | None = None
    generation: int | None = None
    operator_instance: str = ""  # the owner's maru.io/operator-instance label, copied to its children

    @classmethod
    def from_body(cls, body: Any) -> Owner:
        meta = body.get("metadata", {})
        return cls(
            kind=body.get("kind", ""),
            name=meta.get("name", ""),
            namespace=meta.get("namespace") or None,
            uid=meta.get("uid") or None,
            generation=meta.get("generation"),
            operator_instance=(meta.get("labels") or {}).get(LABEL_OPERATOR_INSTANCE, ""),
        )

    @property
    def instance(self) -> str:
        """The owner's name as a label value (hashed when it does not fit)."""
        return label_value(self.name)


def labels(owner: Owner, *, app: str, component: str, role: str | None = None) -> dict[str, str]:
    result = {
        LABEL_NAME: app,
        LABEL_INSTANCE: owner.instance,
        LABEL_COMPONENT: component,
        LABEL_PART_OF: PART_OF,
        LABEL_MANAGED_BY: MANAGED_BY,
    }
    if role:
        result[LABEL_ROLE] = role
    return result


def selector(owner: Owner, *, app: str, component: str) -> dict[str, str]:
    """The immutable part of the labels: a Deployment's selector can never change after creation."""
    return {LABEL_NAME: app, LABEL_INSTANCE: owner.instance, LABEL_COMPONENT: component}


def owner_reference(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": owner.kind,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        # Foreground deletion of the owner waits for children; GC deletes them either way.
        "blockOwnerDeletion": True,
    }


def metadata(owner: Owner, *, name: str, namespace: str | None, labels: dict[str, str]) -> dict[str, Any]:
    """Child metadata with the owner reference (omitted when rendering: no uid to point at)."""
    meta: dict[str, Any] = {"name": name, "labels": dict(labels)}
    if owner.operator_instance:
        # On the child object only (never on pods): it selects what the serving operator watches.
        meta["labels"][LABEL_OPERATOR_INSTANCE] = owner.operator_instance
    if namespace:
        meta["namespace"] = namespace
    if owner.uid:
        meta["ownerReferences"] = [owner_reference(owner)]
    return meta


# The user and group of the product's images (the Dockerfile's USER 65532:65532).
NONROOT_UID = 65532


def restricted_pod_security(uid: int = NONROOT_UID) -> dict[str, Any]:
    """Pod Security Standards "restricted" for a pod, with the user named.

    runAsNonRoot alone makes the kubelet refuse an image whose user is root (or a name rather than a
    number); with runAsUser the pod starts whatever the image says, as that non-root user.
    """
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def restricted_container_security() -> dict[str, Any]:
    """Pod Security Standards "restricted" for a container: no privilege, no capabilities."""
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def env_list(pairs: dict[str, str]) -> list[dict[str, str]]:
    return [{"name": k, "value": v} for k, v in pairs.items()]
