"""Where a group's vLLM pods keep downloaded weights: one PersistentVolumeClaim for the whole group.

A model is tens of GB; in an emptyDir each pod downloads it again, into node storage with no bound, and a
rescheduled pod starts over. By default the operator creates ``<group>-model-cache`` (ReadWriteMany), every
pod of both roles mounts it, and ``HF_HUB_CACHE`` points there: the first pod downloads, the others (and
every later pod) read the same files. huggingface_hub locks each file while it downloads it, so two pods
starting together do not write the same blob twice.

The connector reads the same variable to find the snapshot it hashes into the weights' identity, so the
cache keys of both roles name the exact files they serve.
"""

from __future__ import annotations

from typing import Any

from maru_operator.api.inferencegroup import MODEL_CACHE_PATH, InferenceGroupSpec, RoleSpec
from maru_operator.builders.common import Object, Owner, labels, metadata
from maru_operator.builders.scratch import CACHE_ENV
from maru_operator.names import child_name
from maru_operator.quantity import parse_quantity

MODEL_CACHE_VOLUME = "model-cache"
MODEL_CACHE_APP = "model-cache"
MODEL_CACHE_ENV = "HF_HUB_CACHE"


# Where a user's own volume takes the place of the operator's cache: its path, or the hub cache under HF_HOME
# (where groups mounted their claim before the operator had one).
_USER_CACHE_PATHS = (MODEL_CACHE_PATH, CACHE_ENV["HF_HOME"], CACHE_ENV["HF_HOME"] + "/hub")


def replaced_by_user(role: RoleSpec) -> bool:
    """Whether the role mounts its own model cache (the operator's then is not mounted, nor named)."""
    mounted = {m.mount_path.rstrip("/") for m in role.volume_mounts}
    named = {e.name for e in role.env}
    return bool(mounted & set(_USER_CACHE_PATHS)) or MODEL_CACHE_ENV in named


def model_cache_claim_name(spec: InferenceGroupSpec, group: str) -> str | None:
    """The claim the pods mount (the user's or the operator's); None for a per-pod emptyDir."""
    claim = spec.model_cache.claim
    if claim is None:
        return None
    return claim.claim_name or child_name(group, "model-cache")


def build_model_cache_claim(spec: InferenceGroupSpec, owner: Owner) -> Object | None:
    """The operator's claim, unless the group names its own or uses an emptyDir."""
    claim = spec.model_cache.claim
    if claim is None or claim.claim_name or all(replaced_by_user(r) for r in (spec.prefill, spec.decode)):
        return None
    pvc_spec: dict[str, Any] = {
        "accessModes": [claim.access_mode],
        "resources": {"requests": {"storage": claim.size}},
    }
    if claim.storage_class_name:
        pvc_spec["storageClassName"] = claim.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": metadata(
            owner,
            name=child_name(owner.name, "model-cache"),
            namespace=owner.namespace,
            labels=labels(owner, app=MODEL_CACHE_APP, component="model-cache"),
        ),
        "spec": pvc_spec,
    }


def model_cache_volume(spec: InferenceGroupSpec, group: str) -> tuple[Object, Object]:
    """(pod volume, vLLM container mount) of the cache."""
    name = model_cache_claim_name(spec, group)
    if name is not None:
        volume: Object = {"name": MODEL_CACHE_VOLUME, "persistentVolumeClaim": {"claimName": name}}
    else:
        assert spec.model_cache.empty_dir is not None
        volume = {"name": MODEL_CACHE_VOLUME, "emptyDir": {"sizeLimit": spec.model_cache.empty_dir.size_limit}}
    return volume, {"name": MODEL_CACHE_VOLUME, "mountPath": MODEL_CACHE_PATH}


def model_cache_env() -> dict[str, str]:
    return {MODEL_CACHE_ENV: MODEL_CACHE_PATH}


def model_cache_ephemeral_bytes(spec: InferenceGroupSpec) -> int:
    """Node storage a pod's model cache takes (only an emptyDir's counts)."""
    empty = spec.model_cache.empty_dir
    return int(parse_quantity(empty.size_limit)) if empty is not None else 0
