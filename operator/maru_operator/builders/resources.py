"""Compute resources of the product's containers: what the user asked for, plus a memory limit always.

A container without a memory limit can take a node's memory until the kernel kills something else,
so every container the operator writes gets one; and one without requests is the first to starve and
to be evicted. The user's ``resources`` win; only what is missing is filled in:

* a memory limit set by the user is kept (Kubernetes then defaults the request to it);
* otherwise the limit is the larger of the user's memory request and the component's default limit;
* with neither set, the request is the component's default request too (without it, Kubernetes would
  default the request to the limit and reserve far more than the container usually uses);
* a CPU request is added when the user set neither a CPU request nor a CPU limit.

CPU limits are never added: they throttle a latency-bound server even when the node is idle.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from maru_operator.quantity import format_bytes, parse_quantity

MEMORY = "memory"
CPU = "cpu"
Mi = 2**20
Gi = 2**30


@dataclass(frozen=True)
class ResourceDefault:
    """A component's memory request and limit (bytes) and CPU request (millicores) when the user gives none."""

    request: int
    limit: int
    cpu_millis: int


# vLLM on GPUs: the API server, the engine core and one worker per tensor-parallel rank each hold
# several GiB of host memory (CUDA context, torch, tokenizer, pinned buffers), and /dev/shm (NCCL)
# is counted too. Scaled by tensorParallelSize. vLLM on CPUs keeps its KV cache in host memory: set
# resources there explicitly.
VLLM_PER_RANK = ResourceDefault(request=8 * Gi, limit=32 * Gi, cpu_millis=1000)
# vllm-router (Rust): small; in-flight request bodies are its only growth.
ROUTER = ResourceDefault(request=128 * Mi, limit=1 * Gi, cpu_millis=100)
# Pool daemons outside the pool memory itself: Python, the HTTP endpoints, the agent's mapping table.
POOL_DAEMON = ResourceDefault(request=128 * Mi, limit=512 * Mi, cpu_millis=100)
# The metadata server's index: about 1 KiB per chunk; chunks are rarely under 128 KiB.
INDEX_BYTES_PER_POOL_BYTE = 1 / 128
# A dax pool without a size cap uses whole devices of unknown size.
METADATA_UNSIZED_LIMIT = 4 * Gi


def scaled(default: ResourceDefault, factor: int) -> ResourceDefault:
    return replace(
        default, request=default.request * factor, limit=default.limit * factor, cpu_millis=default.cpu_millis * factor
    )


def plus(default: ResourceDefault, extra: int) -> ResourceDefault:
    """``default`` with ``extra`` bytes added to request and limit (memory the pod itself holds)."""
    return replace(default, request=default.request + extra, limit=default.limit + extra)


def _cpu(millis: int) -> str:
    return str(millis // 1000) if millis % 1000 == 0 else f"{millis}m"


def with_defaults(resources: dict[str, Any], default: ResourceDefault) -> dict[str, Any]:
    """``resources`` (as in a container) with a memory limit, and requests where none were given."""
    requests = dict(resources.get("requests") or {})
    limits = dict(resources.get("limits") or {})
    if CPU not in requests and CPU not in limits:
        requests[CPU] = _cpu(default.cpu_millis)
    if MEMORY not in limits:
        wanted = int(parse_quantity(requests[MEMORY])) if MEMORY in requests else 0
        if MEMORY not in requests:
            requests[MEMORY] = format_bytes(default.request)
        limits[MEMORY] = format_bytes(max(wanted, default.limit))
    result = {k: v for k, v in resources.items() if k not in ("requests", "limits")}
    return {**result, **{k: v for k, v in (("requests", requests), ("limits", limits)) if v}}
