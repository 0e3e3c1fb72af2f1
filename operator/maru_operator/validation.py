"""Semantic checks the CRD schema cannot express: each names the field, says why, and what to do.

A group that fails one gets ``Ready=False`` (reason InvalidSpec) and a Warning Event; none of its
children is touched, so a typo never rolls healthy pods.
"""

from __future__ import annotations

import re

from maru_contracts.csi import MAX_CACHE, cache_error
from maru_operator.api.common import FieldError
from maru_operator.api.inferencegroup import InferenceGroupSpec, RoleSpec
from maru_operator.api.marupool import MaruPoolSpec
from maru_operator.api.pod import LABEL_KEY_PATTERN, PodOptions
from maru_operator.builders.credentials import CREDENTIAL_DIR
from maru_operator.builders.group import HASH_SEED, HASH_SEED_ENV, PoolView
from maru_operator.builders.pool import daemon_memory, pool_endpoint, socket_host_dir
from maru_operator.quantity import format_bytes, parse_quantity
from maru_operator.vllmflags import values_of

GPU_RESOURCE = "nvidia.com/gpu"

# vLLM flags that change the KV cache's bytes or layout: chunk keys include them, so a value set on
# one role and not the other means decode never finds (or worse, misreads) what prefill stored.
KV_LAYOUT_FLAGS = ("--kv-cache-dtype", "--quantization")


def _gpu_limit(role: RoleSpec) -> int | None:
    value = role.resources.limits.get(GPU_RESOURCE)
    if value is None:
        return None
    try:
        return int(parse_quantity(value))
    except ValueError:
        return None


def check_group(spec: InferenceGroupSpec) -> list[FieldError]:
    errors: list[FieldError] = []
    for role_name in ("prefill", "decode"):
        role: RoleSpec = getattr(spec, role_name)
        gpus = _gpu_limit(role)
        if gpus is not None and role.tensor_parallel_size > gpus:
            errors.append(
                FieldError(
                    f"spec.{role_name}.tensorParallelSize",
                    f"{role.tensor_parallel_size} exceeds the {GPU_RESOURCE} limit of {gpus}: vLLM needs one GPU per "
                    f"tensor-parallel rank; raise resources.limits[{GPU_RESOURCE}] or lower tensorParallelSize",
                )
            )
        if any(e.value_from is not None or e.value != HASH_SEED for e in role.env if e.name == HASH_SEED_ENV):
            errors.append(
                FieldError(
                    f"spec.{role_name}.env",
                    f"{HASH_SEED_ENV} must stay {HASH_SEED}: vLLM seeds its block hashes from it and the pool's chunk "
                    "keys come from those hashes, so a different seed means prefill and decode never share KV; "
                    f"remove {HASH_SEED_ENV} from env",
                )
            )
        errors += _pod_checks(role, f"spec.{role_name}")
    errors += _pod_labels_check(spec.router, "spec.router")
    cache = spec.connector.cache_namespace
    if cache is not None and cache_error(cache):
        # The CSI node plugin mints the group's credential for this name and would refuse it at every pod start.
        errors.append(
            FieldError(
                "spec.connector.cacheNamespace",
                f"must be 1 to {MAX_CACHE} printable characters "
                "(no newline or other control character): the group's pool credential is minted "
                "for it",
            )
        )
    # Prefill and decode may differ in tensorParallelSize: chunks are keyed by the KV heads they hold and a
    # decode rank reads the prefill's ranges that overlap its own (the builders pass it prefill's size).
    # Any two sizes that vLLM itself starts with (each divides the model's KV heads or is a multiple of
    # them) line up that way; the model's head count is not in the spec, so vLLM and the connector check
    # that at engine start, naming --tensor-parallel-size or maru_kv_writer_tp.
    for flag in KV_LAYOUT_FLAGS:
        prefill = values_of(spec.prefill.extra_args, flag)
        decode = values_of(spec.decode.extra_args, flag)
        if prefill != decode:
            errors.append(
                FieldError(
                    "spec.decode.extraArgs",
                    f"{flag} is {prefill or 'unset'} for prefill but {decode or 'unset'} for decode: it changes the "
                    "KV cache layout, so both roles must set it the same way",
                )
            )
    if spec.connector.chunk_tokens % spec.connector.block_size:
        # The CRD's CEL rule catches this on API servers that run CEL; this keeps older ones honest.
        errors.append(
            FieldError(
                "spec.connector.chunkTokens",
                f"{spec.connector.chunk_tokens} is not a multiple of blockSize {spec.connector.block_size}: "
                "a chunk must hold whole KV blocks",
            )
        )
    return errors


def _pod_labels_check(options: PodOptions, where: str) -> list[FieldError]:
    bad = [k for k in options.pod_labels if not re.fullmatch(LABEL_KEY_PATTERN, k)]
    return [
        FieldError(
            f"{where}.podLabels",
            f"{k!r} is not a label key: [prefix/]name, name at most 63 characters of alphanumerics, '-', '_', '.'",
        )
        for k in bad
    ]


def _pod_checks(role: RoleSpec, where: str) -> list[FieldError]:
    """Volumes, mounts, labels and rollout pace that Kubernetes would refuse only when the pods are made."""
    errors = _pod_labels_check(role, where)
    names = [v.name for v in role.volumes]
    for name in sorted({n for n in names if names.count(n) > 1}):
        errors.append(FieldError(f"{where}.volumes", f"{name!r} is used by more than one volume; names are unique"))
    paths = [m.mount_path.rstrip("/") for m in role.volume_mounts]
    for path in sorted({p for p in paths if paths.count(p) > 1}):
        errors.append(FieldError(f"{where}.volumeMounts", f"{path} is mounted twice; give each mount its own path"))
    for path in sorted({p for p in paths if _overlaps(p, CREDENTIAL_DIR)}):
        errors.append(
            FieldError(
                f"{where}.volumeMounts",
                f"{path} overlaps {CREDENTIAL_DIR}, where the group's pool "
                "credential is mounted; mount the volume elsewhere",
            )
        )
    pace = role.strategy.rolling_update
    if (
        role.strategy.type == "RollingUpdate"
        and str(pace.max_surge) in ("0", "0%")
        and str(pace.max_unavailable) in ("0", "0%")
    ):
        errors.append(
            FieldError(
                f"{where}.strategy.rollingUpdate",
                "maxSurge and maxUnavailable cannot both be 0: the update could never proceed; "
                "keep maxUnavailable 1 (no spare GPU needed) or allow a surge",
            )
        )
    return errors


def check_group_on_pool(spec: InferenceGroupSpec, pool: PoolView) -> list[FieldError]:
    """What depends on the bound pool: a user volume may not cover the pool's socket directory, and a
    role's nodeSelector may not contradict the pool's (the pods are pinned to the pool's nodes)."""
    socket_dir = socket_host_dir(pool.spec, pool.name).rstrip("/")
    errors = []
    for role_name in ("prefill", "decode"):
        role: RoleSpec = getattr(spec, role_name)
        for mount in role.volume_mounts:
            if _overlaps(mount.mount_path.rstrip("/"), socket_dir):
                errors.append(
                    FieldError(
                        f"spec.{role_name}.volumeMounts",
                        f"{mount.mount_path} overlaps {socket_dir}, where the pool {pool.name}'s socket is mounted; "
                        "mount the volume elsewhere",
                    )
                )
        for key, value in sorted(role.node_selector.items()):
            want = pool.spec.node_selector.get(key)
            if want is not None and want != value:
                # Required affinity to the pool's nodes AND this nodeSelector: no node has both values, so
                # the pods would stay Pending with nothing saying why.
                errors.append(
                    FieldError(
                        f"spec.{role_name}.nodeSelector",
                        f"{key}={value} contradicts the pool {pool.name}'s nodeSelector {key}={want}: "
                        "the pods run only on the pool's nodes (the pool socket is there), "
                        "so no node could take them; drop the key or select the pool's value",
                    )
                )
    return errors


def _overlaps(path: str, directory: str) -> bool:
    """Whether a mount at ``path`` would hide ``directory`` or sit inside it."""
    return path == directory or directory.startswith(path + "/") or path.startswith(directory + "/")


# sun_path holds 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107


def check_pool(spec: MaruPoolSpec, name: str) -> list[FieldError]:
    errors: list[FieldError] = []
    socket = pool_endpoint(spec, name).removeprefix("unix://")
    if len(socket.encode()) > MAX_SOCKET_PATH:
        errors.append(
            FieldError(
                "spec.daemon.socketDir",
                f"the socket path {socket} is {len(socket.encode())} bytes, over the {MAX_SOCKET_PATH} a Unix socket "
                "path may have; choose a shorter socketDir",
            )
        )
    need = daemon_memory(spec, agent=True)
    what = "size + 4Ki header + 64Mi for the daemon" if spec.backend == "shm" else "64Mi for the daemon"
    for kind in ("requests", "limits"):
        value = getattr(spec.daemon.resources, kind).get("memory")
        if value is None:
            continue
        try:
            given = int(parse_quantity(value))
        except ValueError:
            continue  # the schema's pattern reports it
        if given < need:
            errors.append(
                FieldError(
                    f"spec.daemon.resources.{kind}.memory",
                    f"{value} is less than the pool daemon needs ({format_bytes(need)}: {what}); the pool file "
                    f"lives in the agent's memory and would not fit; raise it or leave it unset to derive it",
                )
            )
    return errors
