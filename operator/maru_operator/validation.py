"""Semantic checks the CRD schema cannot express: each names the field, says why, and what to do.

A group that fails one gets ``Ready=False`` (reason InvalidSpec) and a Warning Event; none of its
children is touched, so a typo never rolls healthy pods.
"""

from __future__ import annotations

from maru_operator.api.common import FieldError
from maru_operator.api.inferencegroup import InferenceGroupSpec, RoleSpec
from maru_operator.api.marupool import MaruPoolSpec
from maru_operator.builders.group import HASH_SEED, HASH_SEED_ENV
from maru_operator.builders.pool import daemon_memory, pool_endpoint
from maru_operator.quantity import format_bytes, parse_quantity

GPU_RESOURCE = "nvidia.com/gpu"

# vLLM flags that change the KV cache's bytes or layout: chunk keys include them, so a value set on
# one role and not the other means decode never finds (or worse, misreads) what prefill stored.
KV_LAYOUT_FLAGS = ("--kv-cache-dtype", "--quantization")


def _flag_values(args: list[str], flag: str) -> list[str]:
    """Every value given to ``flag`` in ``args`` (``--f v`` or ``--f=v``; a bare switch counts as "")."""
    values = []
    for i, arg in enumerate(args):
        if arg == flag:
            nxt = args[i + 1] if i + 1 < len(args) else ""
            values.append("" if nxt.startswith("--") else nxt)
        elif arg.startswith(flag + "="):
            values.append(arg.split("=", 1)[1])
    return values


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
            errors.append(FieldError(
                f"spec.{role_name}.tensorParallelSize",
                f"{role.tensor_parallel_size} exceeds the {GPU_RESOURCE} limit of {gpus}: vLLM needs one GPU per "
                f"tensor-parallel rank; raise resources.limits[{GPU_RESOURCE}] or lower tensorParallelSize",
            ))
        seeds = {e.value for e in role.env if e.name == HASH_SEED_ENV}
        if seeds and seeds != {HASH_SEED}:
            errors.append(FieldError(
                f"spec.{role_name}.env",
                f"{HASH_SEED_ENV} must stay {HASH_SEED}: vLLM seeds its block hashes from it and the pool's chunk "
                "keys come from those hashes, so a different seed means prefill and decode never share KV; "
                f"remove {HASH_SEED_ENV} from env",
            ))
    if spec.prefill.tensor_parallel_size != spec.decode.tensor_parallel_size:
        errors.append(FieldError(
            "spec.decode.tensorParallelSize",
            f"{spec.decode.tensor_parallel_size} differs from prefill's {spec.prefill.tensor_parallel_size}: "
            "KV chunks are stored per tensor-parallel rank, so decode would never find prefill's KV; "
            "use the same tensorParallelSize for both roles",
        ))
    for flag in KV_LAYOUT_FLAGS:
        prefill = _flag_values(spec.prefill.extra_args, flag)
        decode = _flag_values(spec.decode.extra_args, flag)
        if prefill != decode:
            errors.append(FieldError(
                "spec.decode.extraArgs",
                f"{flag} is {prefill or 'unset'} for prefill but {decode or 'unset'} for decode: it changes the "
                "KV cache layout, so both roles must set it the same way",
            ))
    if spec.connector.chunk_tokens % spec.connector.block_size:
        # The CRD's CEL rule catches this on API servers that run CEL; this keeps older ones honest.
        errors.append(FieldError(
            "spec.connector.chunkTokens",
            f"{spec.connector.chunk_tokens} is not a multiple of blockSize {spec.connector.block_size}: "
            "a chunk must hold whole KV blocks",
        ))
    return errors


# sun_path holds 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107


def check_pool(spec: MaruPoolSpec, name: str) -> list[FieldError]:
    errors: list[FieldError] = []
    socket = pool_endpoint(spec, name).removeprefix("unix://")
    if len(socket.encode()) > MAX_SOCKET_PATH:
        errors.append(FieldError(
            "spec.daemon.socketDir",
            f"the socket path {socket} is {len(socket.encode())} bytes, over the {MAX_SOCKET_PATH} a Unix socket "
            "path may have; choose a shorter socketDir",
        ))
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
            errors.append(FieldError(
                f"spec.daemon.resources.{kind}.memory",
                f"{value} is less than the pool daemon needs ({format_bytes(need)}: {what}); the pool file "
                f"lives in the agent's memory and would not fit; raise it or leave it unset to derive it",
            ))
    return errors
