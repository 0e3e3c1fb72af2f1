"""How a vLLM pod starts, rolls and stops on a GPU node: /dev/shm, node storage, rollouts, draining.

* ``/dev/shm`` is a memory-backed emptyDir with a size: vLLM's worker queues and NCCL's shared-memory
  transport live there (1Gi per tensor-parallel rank), and without a limit a tmpfs may take the pod's
  whole memory limit.
* ``ephemeral-storage`` is requested for what the pod writes to node storage (compile caches, logs, and a
  per-pod model cache when the group chose one), so the scheduler picks a node with the room.
* Rollouts surge by default: a single-replica role keeps its pod until the new one is ready (never a role
  without pods for the length of a model load), a larger one may also stop one first (so an update goes
  on when no spare GPU is free).
* Stopping drains first: the preStop hook waits until vLLM has no request running or waiting (or the
  drain budget is spent), then the kubelet sends SIGTERM. New requests still reach a terminating pod for a
  while (kube-proxy, vllm-router and maru-router each learn of the deletion in their own time, and a
  request routed just before arrives after), and vLLM fails every request it holds once signalled: so the
  hook waits at least the time its clients take to stop sending, however idle the pod.
* vLLM runs under a small init (``maru_common.init``): as its container's PID 1 it would get only the
  signals it handles, and it handles SIGTERM only once its server is up, so a pod deleted during a model
  load would hold its GPUs until SIGKILL at the end of the (long, draining) grace period.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from maru_operator.api.inferencegroup import RoleSpec, Termination
from maru_operator.quantity import format_bytes

Gi = 2**30
SHM_VOLUME = "dshm"
SHM_PER_RANK = 1 * Gi
# torch.compile and Triton caches, vLLM's temporary files and the container's logs.
SCRATCH_BYTES = 10 * Gi
EPHEMERAL = "ephemeral-storage"
DRAIN_MODULE = "maru_common.drain"
# vLLM's command: ``vllm serve`` under the init, which passes SIGTERM on during a model load.
VLLM_COMMAND = ["python3", "-m", "maru_common.init", "vllm", "serve"]
# On a role Deployment: the hash of the pod template the operator applied, for pacing rollouts
# (maru_operator.rollouts) without diffing templates.
TEMPLATE_HASH = "maru.io/template-hash"


def template_hash(template: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:16]


def shm_size(role: RoleSpec) -> str:
    return role.shm_size or format_bytes(SHM_PER_RANK * role.tensor_parallel_size)


def shm_volume(role: RoleSpec) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod volume, container mount) of /dev/shm."""
    return (
        {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": shm_size(role)}},
        {"name": SHM_VOLUME, "mountPath": "/dev/shm"},
    )


def with_ephemeral_request(resources: dict[str, Any], extra_bytes: int) -> dict[str, Any]:
    """``resources`` with an ephemeral-storage request, unless the user set a request or limit for it."""
    requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
    if EPHEMERAL in requests or EPHEMERAL in limits:
        return resources
    return {**resources, "requests": {**requests, EPHEMERAL: format_bytes(SCRATCH_BYTES + extra_bytes)}}


def rolling_update(role: RoleSpec, replicas: int) -> dict[str, Any]:
    """maxSurge and maxUnavailable, each the user's when set, else derived from the role's replicas."""
    pace = role.strategy.rolling_update
    surge = 1 if pace.max_surge is None else pace.max_surge
    if pace.max_unavailable is not None:
        unavailable = pace.max_unavailable
    else:
        unavailable = 1 if replicas > 1 or str(surge) in ("0", "0%") else 0
    return {"maxSurge": surge, "maxUnavailable": unavailable}


def pre_stop(termination: Termination, port: int, metric: str | None = None, *, min_wait: int) -> dict[str, Any] | None:
    """A server container's lifecycle: drain before SIGTERM, for ``min_wait`` seconds at least (the time the pod's
    clients take to stop sending to it; never past the drain budget), then until the server's in-flight gauge
    (vLLM's own unless ``metric`` names another) on ``port`` reads 0; None when the pod drains for 0 s."""
    drain = termination.drain_seconds
    if drain <= 0:
        return None
    gauge = ["--metric", metric] if metric else []
    wait = ["--min-wait", str(min(min_wait, drain))]
    return {
        "preStop": {
            "exec": {
                "command": ["python3", "-m", DRAIN_MODULE, "--port", str(port), *gauge, *wait, "--timeout", str(drain)]
            }
        }
    }
