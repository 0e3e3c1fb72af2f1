"""The validation and admission kube-apiserver runs on the built-in kinds' writes, where the operator's writes
meet it: a Deployment's strategy, a PersistentVolumeClaim's update and its resize.

Each rule says which Kubernetes source it mirrors; the messages are kube-apiserver's, so a client that reads
them (the operator's status, a test) sees what a real cluster answers. Values are those of Kubernetes 1.35.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from maru_operator.quantity import parse_quantity

JsonObj = dict[str, Any]
# (field, message) of one refusal, kube-apiserver's StatusCause.
Cause = tuple[str, str]
# Looks an object up: (group, plural, namespace, name) -> the object or None.
Lookup = Callable[[str, str, str | None, str], JsonObj | None]


def deployment_strategy(spec: JsonObj) -> list[Cause]:
    """k8s.io/kubernetes pkg/apis/apps/validation ValidateDeploymentStrategy: Recreate takes no rollingUpdate."""
    strategy = spec.get("strategy") or {}
    kind = strategy.get("type")
    if kind == "Recreate" and strategy.get("rollingUpdate") is not None:
        return [("spec.strategy.rollingUpdate", "Forbidden: may not be specified when strategy `type` is 'Recreate'")]
    if kind not in (None, "Recreate", "RollingUpdate"):
        return [("spec.strategy.type", f'Unsupported value: "{kind}": supported values: "Recreate", "RollingUpdate"')]
    return []


def default_deployment_strategy(spec: JsonObj) -> None:
    """k8s.io/kubernetes pkg/apis/apps/v1 defaults.go SetDefaults_Deployment: a RollingUpdate without its
    parameters gets 25%/25%, each parameter left out too; Recreate gets none."""
    strategy = spec.get("strategy")
    if not isinstance(strategy, dict):
        return
    strategy.setdefault("type", "RollingUpdate")
    if strategy["type"] == "RollingUpdate":
        rolling = strategy.get("rollingUpdate")
        if not isinstance(rolling, dict):
            rolling = strategy["rollingUpdate"] = {}
        rolling.setdefault("maxUnavailable", "25%")
        rolling.setdefault("maxSurge", "25%")


def _storage(spec: JsonObj) -> Any:
    return ((spec.get("resources") or {}).get("requests") or {}).get("storage")


def _without_requests(spec: JsonObj) -> JsonObj:
    resources = {k: v for k, v in (spec.get("resources") or {}).items() if k != "requests"}
    rest = {k: v for k, v in spec.items() if k not in ("resources", "volumeAttributesClassName")}
    return {**rest, "resources": resources} if resources else rest


def pvc_update(new: JsonObj, old: JsonObj) -> list[Cause]:
    """k8s.io/kubernetes pkg/apis/core/validation ValidatePersistentVolumeClaimUpdate (with
    RecoverVolumeExpansionFailure, GA): a claim's spec is immutable but for its requests, and those only once
    it is Bound; the storage request may shrink only while it stays above status.capacity."""
    new_spec, old_spec = dict(new.get("spec") or {}), dict(old.get("spec") or {})
    if new_spec == old_spec:
        return []
    bound = ((old.get("status") or {}).get("phase")) == "Bound"
    if bound:
        # Only resources.requests (and volumeAttributesClassName, which the operator never sets) may change.
        if _without_requests(new_spec) != _without_requests(old_spec):
            return [
                (
                    "spec",
                    "Forbidden: spec is immutable after creation except resources.requests and "
                    "volumeAttributesClassName for bound claims",
                )
            ]
        want, had = _storage(new_spec), _storage(old_spec)
        if want is not None and had is not None and parse_quantity(want) < parse_quantity(had):
            capacity = ((old.get("status") or {}).get("capacity") or {}).get("storage", had)
            if parse_quantity(want) <= parse_quantity(capacity):
                return [("spec.resources.requests.storage", "Forbidden: field can not be less than status.capacity")]
        return []
    return [
        (
            "spec",
            "Forbidden: spec is immutable after creation except resources.requests and "
            "volumeAttributesClassName for bound claims",
        )
    ]


def pvc_resize(new: JsonObj, old: JsonObj, lookup: Lookup) -> str | None:
    """k8s.io/kubernetes plugin/pkg/admission/storage/persistentvolume/resize admission.go
    (PersistentVolumeClaimResize) Validate/allowResize: a bigger storage request is refused (403) unless the
    claim's StorageClass exists and sets allowVolumeExpansion. None when allowed."""
    want, had = _storage(new.get("spec") or {}), _storage(old.get("spec") or {})
    if want is None or had is None or parse_quantity(want) <= parse_quantity(had):
        return None
    name = (new.get("spec") or {}).get("storageClassName") or ""
    klass = lookup("storage.k8s.io", "storageclasses", None, name) if name else None
    if klass is not None and klass.get("allowVolumeExpansion"):
        return None
    return (
        "only dynamically provisioned pvc can be resized and the storageclass that provisions the pvc must "
        "support resize"
    )
