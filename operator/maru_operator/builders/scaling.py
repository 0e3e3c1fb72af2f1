"""Who sets a role's replicas: the operator, an autoscaler, or the other role through a ratio.

A role with ``scaler: External`` is scaled by someone else (an HPA or KEDA on the role's Deployment,
``kubectl scale``): the Deployment the operator applies carries no ``spec.replicas`` at all, so the
operator neither owns nor writes it, and server-side apply never puts the autoscaler's count back. The
count the role starts with is set once, at the create (:func:`create_replicas`). The annotation says so
on the Deployment, for whoever reads it, and tells the controller which field is the create's alone.

With ``replicaRatio``, the other role follows the scaled one: its replicas are computed from the scaled
role's Deployment as it is now (``observed``), rounded up, at least one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from maru_operator.api.inferencegroup import InferenceGroupSpec

REPLICAS_ANNOTATION = "maru.io/replicas"
EXTERNAL = "external"
INITIAL_REPLICAS_ANNOTATION = "maru.io/initial-replicas"


def desired_replicas(spec: InferenceGroupSpec, role: str, observed: Mapping[str, int | None]) -> int | None:
    """The role's replicas for the operator to apply; None when an external scaler owns them."""
    role_spec = getattr(spec, role)
    if role_spec.scaler == "External":
        return None
    ratio = spec.replica_ratio
    if ratio is None:
        return role_spec.replicas
    other = "decode" if role == "prefill" else "prefill"
    scaled = observed.get(other)
    if scaled is None:
        scaled = getattr(spec, other).replicas  # not created yet: it starts at its own replicas
    mine, theirs = getattr(ratio, role), getattr(ratio, other)
    return max(1, math.ceil(scaled * mine / theirs))


def external_annotations(spec: InferenceGroupSpec, role: str) -> dict[str, str]:
    role_spec = getattr(spec, role)
    if role_spec.scaler != "External":
        return {}
    return {REPLICAS_ANNOTATION: EXTERNAL, INITIAL_REPLICAS_ANNOTATION: str(role_spec.replicas)}


def scaled_externally(obj: Mapping[str, Any]) -> bool:
    return (obj.get("metadata", {}).get("annotations") or {}).get(REPLICAS_ANNOTATION) == EXTERNAL


def create_replicas(obj: dict[str, Any]) -> dict[str, Any]:
    """What to create for ``obj``: an externally scaled Deployment starts at its initial replicas."""
    if not scaled_externally(obj):
        return obj
    initial = int(obj["metadata"]["annotations"][INITIAL_REPLICAS_ANNOTATION])
    return {**obj, "spec": {**obj["spec"], "replicas": initial}}
