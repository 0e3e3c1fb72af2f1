"""Compute resources of the product's containers: what the user asked for, plus a memory limit always.

A container without a memory limit can take a node's memory until the kernel kills something else,
so every container the operator writes gets one. The user's ``resources`` win; only what is missing is
filled in, and only for memory:

* a memory limit set by the user is kept (Kubernetes then defaults the request to it);
* otherwise the limit is the larger of the user's memory request and the component's default limit;
* with neither set, the request is the component's default request too (without it, Kubernetes would
  default the request to the limit and reserve far more than the container usually uses).

CPU limits are never added: they throttle a latency-bound server even when the node is idle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from maru_operator.quantity import format_bytes, parse_quantity

MEMORY = "memory"
Mi = 2**20
Gi = 2**30


@dataclass(frozen=True)
class MemoryDefault:
    """A component's memory request and limit when the user gives neither, in bytes."""

    request: int
    limit: int


# vLLM on GPUs: the API server, the engine core and one worker per tensor-parallel rank each hold
# several GiB of host memory (CUDA context, torch, tokenizer, pinned buffers), and /dev/shm (NCCL)
# is counted too. Scaled by tensorParallelSize. vLLM on CPUs keeps its KV cache in host memory: set
# resources there explicitly.
VLLM_PER_RANK = MemoryDefault(request=8 * Gi, limit=32 * Gi)
# vllm-router (Rust): small; in-flight request bodies are its only growth.
ROUTER = MemoryDefault(request=128 * Mi, limit=1 * Gi)
# Pool daemons outside the pool memory itself: Python, the HTTP endpoints, the agent's mapping table.
POOL_DAEMON = MemoryDefault(request=128 * Mi, limit=512 * Mi)
# The metadata server's index: about 1 KiB per chunk; chunks are rarely under 128 KiB.
INDEX_BYTES_PER_POOL_BYTE = 1 / 128
# A dax pool without a size cap uses whole devices of unknown size.
METADATA_UNSIZED_LIMIT = 4 * Gi


def scaled(default: MemoryDefault, factor: int) -> MemoryDefault:
    return MemoryDefault(request=default.request * factor, limit=default.limit * factor)


def plus(default: MemoryDefault, extra: int) -> MemoryDefault:
    """``default`` with ``extra`` bytes added to request and limit (memory the pod itself holds)."""
    return MemoryDefault(request=default.request + extra, limit=default.limit + extra)


def with_memory_defaults(resources: dict[str, Any], default: MemoryDefault) -> dict[str, Any]:
    """``resources`` (as in a container) with a memory limit, and a request when neither was given."""
    requests = dict(resources.get("requests") or {})
    limits = dict(resources.get("limits") or {})
    if MEMORY not in limits:
        wanted = int(parse_quantity(requests[MEMORY])) if MEMORY in requests else 0
        if MEMORY not in requests:
            requests[MEMORY] = format_bytes(default.request)
        limits[MEMORY] = format_bytes(max(wanted, default.limit))
    result = {k: v for k, v in resources.items() if k not in ("requests", "limits")}
    return {**result, **{k: v for k, v in (("requests", requests), ("limits", limits)) if v}}
