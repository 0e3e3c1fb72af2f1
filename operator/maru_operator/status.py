"""Pure status computation: a snapshot of the observed children in, the new status out.

Nothing here reads the API or the clock; the caller passes ``now`` and writes the result only when
:func:`changed` says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from maru_operator import conditions as cond
from maru_operator.api.common import Condition
from maru_operator.api.inferencegroup import InferenceGroupSpec, InferenceGroupStatus, PoolUsage, RoleStatus
from maru_operator.api.marupool import MaruPoolSpec, MaruPoolStatus, PoolNodeStatus
from maru_operator.builders.group import PoolView
from maru_operator.builders.pool import SHM_FILE, pool_endpoint
from maru_operator.objects import Object
from maru_operator.quantity import format_bytes, parse_quantity
from maru_operator.readiness import why_not_ready

# --- MaruPool -----------------------------------------------------------------------------------------


@dataclass
class PoolObservation:
    """Everything the pool's status is derived from, gathered once per reconcile."""

    daemonset: Object | None = None
    metadata_deployment: Object | None = None
    agent_pods: list[Object] = field(default_factory=list)
    # Daemon /status JSON keyed by node name (shm) or "metadata" (dax); None: asked, no answer.
    stats: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    bound_groups: list[str] = field(default_factory=list)
    deleting: bool = False
    # Children the pool could not take because a namesake it does not control is in the way.
    conflicts: list[str] = field(default_factory=list)


def _pod_ready(pod: Object) -> bool:
    for c in pod.get("status", {}).get("conditions") or []:
        if c.get("type") == "Ready":
            return c.get("status") == "True"
    return False


def _observed(workload: Object | None) -> bool:
    """Whether a workload's controller has reported on its current generation."""
    if workload is None:
        return False
    observed = int((workload.get("status") or {}).get("observedGeneration") or 0)
    return observed >= int(workload.get("metadata", {}).get("generation") or 1)


def _deployment_ready(dep: Object | None) -> bool | None:
    if dep is None:
        return None
    want = dep.get("spec", {}).get("replicas", 1)
    return int(dep.get("status", {}).get("readyReplicas") or 0) >= want > 0


def pool_status(
    name: str, spec: MaruPoolSpec, generation: int | None, seen: PoolObservation, old: MaruPoolStatus, now: str
) -> MaruPoolStatus:
    ds_status = (seen.daemonset or {}).get("status", {})
    desired = int(ds_status.get("desiredNumberScheduled") or 0)
    ready = int(ds_status.get("numberReady") or 0)
    metadata_ready = _deployment_ready(seen.metadata_deployment) if spec.backend == "dax" else None
    size_bytes = int(parse_quantity(spec.size)) if spec.size else 0

    nodes = []
    for pod in sorted(seen.agent_pods, key=lambda p: p.get("spec", {}).get("nodeName") or ""):
        node = pod.get("spec", {}).get("nodeName")
        if not node:
            continue
        stats = seen.stats.get(node) or {}
        node_capacity = int(stats.get("capacity_bytes") or 0) or (size_bytes if spec.backend == "shm" else 0)
        nodes.append(
            PoolNodeStatus(
                node=node,
                device=SHM_FILE if spec.backend == "shm" else ",".join(spec.devices) or "all devdax devices",
                capacity=format_bytes(node_capacity) if node_capacity else "",
                ready=_pod_ready(pod),
            )
        )

    capacity = used = None
    if spec.backend == "shm":
        # Each node is a pool of its own: capacity is what the ready nodes hold together.
        capacity = size_bytes * ready
        answers = [seen.stats.get(n.node) for n in nodes if n.ready]
        if answers and all(a is not None and "used_bytes" in a for a in answers):
            used = sum(int(a["used_bytes"]) for a in answers if a is not None)
    else:
        meta = seen.stats.get("metadata")
        if meta is not None:
            capacity = int(meta.get("capacity_bytes") or 0) or None
            used = int(meta["used_bytes"]) if "used_bytes" in meta else None
        if capacity is None and size_bytes:
            capacity = size_bytes

    gen = generation
    if seen.conflicts:
        ready_condition = cond.child_conflict(seen.conflicts, gen)
    elif not _observed(seen.daemonset):
        # Before its controller has looked at the DaemonSet, "no node matches" would be a false alarm.
        ready_condition = cond.agents_pending(gen)
    else:
        ready_condition = cond.pool_ready(ready, desired, metadata_ready, gen)
    new_conditions = [
        ready_condition,
        cond.pool_degraded(ready, desired, metadata_ready, gen),
        cond.pool_in_use(seen.bound_groups, seen.deleting, gen),
    ]
    return MaruPoolStatus(
        observed_generation=generation,
        conditions=cond.merge(old.conditions, new_conditions, now),
        nodes_desired=desired,
        nodes_ready=ready,
        node_summary=f"{ready}/{desired}",
        nodes=nodes,
        capacity=format_bytes(capacity) if capacity else "",
        capacity_bytes=capacity or 0,
        # Unknown use stays empty rather than 0: a pool that did not answer is not an empty pool.
        used=format_bytes(used) if used is not None else "",
        used_bytes=used or 0,
        endpoint=pool_endpoint(spec, name),
        bound_groups=len(seen.bound_groups),
    )


# --- InferenceGroup -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Binding:
    """Whether a group may use its pool; ``pool`` is set only when it may."""

    ok: bool
    reason: str
    message: str
    pool: PoolView | None = None
    revoke: bool = False  # access was taken away: running vLLM pods must stop using the pool
    pool_problem: str = ""  # the pool serves, but not fully (its Degraded message)


def bind(group_namespace: str, spec: InferenceGroupSpec, pool_body: Object | None) -> Binding:
    name = spec.pool_ref.name
    if pool_body is None:
        return Binding(False, "PoolNotFound", f"MaruPool {name} does not exist; create it or fix spec.poolRef.name")
    try:
        pool_spec = MaruPoolSpec.model_validate(pool_body.get("spec") or {})
    except ValueError:
        return Binding(False, "PoolInvalid", f"MaruPool {name} has an invalid spec; see its status and events")
    allowed = pool_spec.allowed_namespaces
    if allowed is not None and group_namespace not in allowed:
        return Binding(
            False,
            "NamespaceNotAllowed",
            f"MaruPool {name} does not list namespace {group_namespace} in spec.allowedNamespaces; "
            "ask its owner to add it, or use another pool",
            revoke=True,
        )
    if pool_body.get("metadata", {}).get("deletionTimestamp"):
        return Binding(False, "PoolDeleting", f"MaruPool {name} is being deleted; point spec.poolRef at another pool")
    pool_conditions = MaruPoolStatus.model_validate(pool_body.get("status") or {}).conditions
    if not cond.is_true(pool_conditions, cond.READY):
        ready = cond.get(pool_conditions, cond.READY)
        detail = f" ({ready.reason}: {ready.message})" if ready and ready.message else ""
        return Binding(False, "PoolNotReady", f"MaruPool {name} is not ready{detail}; waiting for it")
    view = PoolView(name=name, spec=pool_spec)
    degraded = cond.get(pool_conditions, cond.DEGRADED)
    problem = f"MaruPool {name} is degraded: {degraded.message}" if degraded and degraded.status == "True" else ""
    return Binding(True, "Bound", f"bound to MaruPool {name} at {view.endpoint}", view, pool_problem=problem)


def _role_status(dep: Object | None) -> RoleStatus:
    if dep is None:
        return RoleStatus(desired=0, ready=0, summary="0/0")
    desired = int(dep.get("spec", {}).get("replicas", 1))
    ready = int(dep.get("status", {}).get("readyReplicas") or 0)
    return RoleStatus(desired=desired, ready=ready, summary=f"{ready}/{desired}")


def rollout_done(dep: Object) -> bool:
    """The same test as ``kubectl rollout status``."""
    meta, spec, st = dep.get("metadata", {}), dep.get("spec", {}), dep.get("status", {})
    want = int(spec.get("replicas", 1))
    if int(st.get("observedGeneration") or 0) < int(meta.get("generation") or 0):
        return False
    updated = int(st.get("updatedReplicas") or 0)
    return updated >= want and int(st.get("replicas") or 0) <= updated and int(st.get("availableReplicas") or 0) >= want


def _deployment_problem(dep: Object) -> str | None:
    name = dep.get("metadata", {}).get("name", "?")
    for c in dep.get("status", {}).get("conditions") or []:
        if c.get("type") == "ReplicaFailure" and c.get("status") == "True":
            return f"Deployment {name}: {c.get('message') or c.get('reason')}"
        if c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded":
            return f"Deployment {name} exceeded its progress deadline; check its pods' events"
        if c.get("type") == "Available" and c.get("status") == "False" and rollout_done(dep):
            return f"Deployment {name} has no available replicas"
    return None


def ready_endpoints(slices: list[Object]) -> int:
    """Endpoints ready to receive traffic across a Service's EndpointSlices (an unset ready means ready)."""
    return sum(
        1
        for sl in slices
        for e in sl.get("endpoints") or []
        if (e.get("conditions") or {}).get("ready", True) is not False
    )


@dataclass(frozen=True)
class Router:
    """The router's front door as observed: its Service's name, and its ready endpoints."""

    service: str  # namespace/name
    ready_endpoints: int


def group_status(
    spec: InferenceGroupSpec,
    generation: int | None,
    binding: Binding,
    children: dict[str, Object | None],
    old: InferenceGroupStatus,
    *,
    endpoint: str,
    now: str,
    router: Router | None = None,
    conflicts: list[str] | None = None,
    refused: list[str] | None = None,
    queued: list[str] | None = None,
    disaggregation: Condition | None = None,
    pods: dict[str, list[Object]] | None = None,
) -> InferenceGroupStatus:
    """``children`` maps prefill, decode, router to their observed Deployment (None when absent).

    Ready means serving: each of prefill and decode has a ready pod and (with a router) the router
    Service has a ready endpoint. Fewer ready replicas than desired, and a pool outage while vLLM
    serves (it recomputes, without pool hits), are Degraded. ``disaggregation``: the DisaggregationActive
    condition (see :func:`conditions.disaggregation_active`), judged from the pool's traffic by the caller.
    ``pods``: each role's pods, where the operator reads pods (None: it does not), for why a role is not ready
    (:mod:`maru_operator.readiness`); a reason that needs a human makes Ready's and Degraded's reason
    ReplicasFailing (a Warning Event) instead of ReplicasNotReady or ReplicasUnavailable (a start under way).
    """
    roles = {r: _role_status(children.get(r)) for r in ("prefill", "decode", "router")}
    rolling: list[str] = []
    short: list[str] = []  # replicas missing while they start
    failing: list[str] = []  # a Deployment's own trouble, or pods that wait for a human
    not_serving: list[str] = []
    stuck = False  # a role serves nothing for a reason that needs a human
    wanted = [("prefill", True), ("decode", True), ("router", spec.router.enabled)]
    for role, needed in wanted:
        dep = children.get(role)
        if not needed:
            continue
        if dep is None:
            not_serving.append(f"{role} Deployment not created yet")
            continue
        if not rollout_done(dep):
            rolling.append(role)
        problem = _deployment_problem(dep)
        if problem:
            failing.append(problem)
        st = roles[role]
        # A vLLM role at 0 replicas serves nothing (revoked access, a scale to zero): Ready means a ready pod.
        if st.ready >= st.desired and (st.ready > 0 or role == "router"):
            continue
        why = why_not_ready(dep, None if pods is None else pods.get(role, []))
        if st.ready == 0 and role != "router":
            not_serving.append(f"{role} has no ready pod ({st.summary}): {why.message}")
            stuck = stuck or why.stuck
        elif why.stuck and not problem:
            failing.append(f"{role} {st.summary} ready: {why.message}")
        else:
            (failing if why.stuck else short).append(f"{role} {st.summary} ready")
    serving = not not_serving
    # Revoked access stops the group on purpose (its vLLM pods are scaled to zero): Ready=False says why.
    # A child the API server refused keeps its last version: the group serves, but not as its spec says.
    degraded = [("ChildRefused", m) for m in refused or []]
    if not binding.revoke:
        degraded += [(cond.REPLICAS_FAILING, m) for m in failing] + [("ReplicasUnavailable", m) for m in short]
    if not binding.ok and not binding.revoke and serving:
        degraded.append(("PoolUnavailable", f"{binding.message}; vLLM serves without pool hits meanwhile"))
    if binding.pool_problem:
        degraded.append(("PoolDegraded", binding.pool_problem))
    gen = generation
    summary = f"prefill {roles['prefill'].summary}, decode {roles['decode'].summary} ready"
    ready = cond.group_ready(
        conflicts=conflicts or [],
        not_serving=not_serving,
        binding=(binding.ok, binding.reason, binding.message),
        router=(router.service, router.ready_endpoints) if router else None,
        summary=summary,
        gen=gen,
        stuck=stuck,
    )
    conditions = [
        cond.pool_bound(binding.ok, binding.reason, binding.message, gen),
        ready,
        cond.group_progressing(rolling, gen, queued or []),
        cond.group_degraded(degraded, gen),
        *([disaggregation] if disaggregation is not None else []),
    ]
    return InferenceGroupStatus(
        observed_generation=generation,
        conditions=cond.merge(old.conditions, conditions, now),
        prefill=roles["prefill"],
        decode=roles["decode"],
        router=roles["router"] if spec.router.enabled else RoleStatus(summary="disabled"),
        endpoint=endpoint,
        pool_endpoint=binding.pool.endpoint if binding.pool else "",
    )


def invalid_group_status(
    errors: list[str], generation: int | None, old: InferenceGroupStatus, now: str
) -> InferenceGroupStatus:
    """Status of a group whose spec fails a semantic check: Ready=False, everything else as it was."""
    keep = [c for c in old.conditions if c.type != cond.READY]
    new = [*keep, cond.invalid_spec(errors, generation)]
    return old.model_copy(
        update={
            "observed_generation": generation,
            "conditions": cond.merge(old.conditions, new, now),
        }
    )


def invalid_pool_status(errors: list[str], generation: int | None, old: MaruPoolStatus, now: str) -> MaruPoolStatus:
    keep = [c for c in old.conditions if c.type != cond.READY]
    new = [cond.invalid_spec(errors, generation), *keep]
    merged = cond.merge(old.conditions, new, now)
    return old.model_copy(update={"observed_generation": generation, "conditions": merged})


def blocked_pool_status(bound: list[str], generation: int | None, old: MaruPoolStatus, now: str) -> MaruPoolStatus:
    """Status of a deleted pool that waits for its groups: InUse says who holds it, the rest as it was."""
    keep = [c for c in old.conditions if c.type != cond.IN_USE]
    merged = cond.merge(old.conditions, [*keep, cond.pool_in_use(bound, True, generation)], now)
    return old.model_copy(update={"conditions": merged, "bound_groups": len(bound)})


def changed(old: Any, new: Any) -> bool:
    """Whether writing ``new`` would change anything a reader can see."""
    return old.model_dump(by_alias=True, exclude_none=True) != new.model_dump(by_alias=True, exclude_none=True)


_USAGE_FIELDS = {"used", "used_bytes"}


def usage_only_change(old: MaruPoolStatus, new: MaruPoolStatus) -> bool:
    """True when the pool's use moved from one known value to another and nothing else changed.

    That is traffic (in-flight leases come and go), written at a bounded rate; use turning known or
    unknown (a daemon that stops answering) and every condition change are written at once.
    """
    if not old.used or not new.used or old.used_bytes == new.used_bytes:
        return False
    return old.model_dump(exclude=_USAGE_FIELDS) == new.model_dump(exclude=_USAGE_FIELDS)


_SUMMED = ("used_bytes", "chunks", "pins", "leases", "evictions_by_others")


def tenant_usage(stats: dict[str, dict[str, Any] | None]) -> dict[str, PoolUsage] | None:
    """Each tenant's use of a pool from its daemons' /status answers (summed over a shm pool's nodes, each
    a pool of its own; the byte quota is per node). None when no daemon answered with tenants: unknown."""
    answers = [a for a in stats.values() if a is not None and isinstance(a.get("tenants"), list)]
    if not answers:
        return None
    totals: dict[str, dict[str, int]] = {}
    for answer in answers:
        for t in answer["tenants"]:
            row = totals.setdefault(str(t.get("tenant", "")), dict.fromkeys((*_SUMMED, "quota_bytes", "refused"), 0))
            for name in _SUMMED:
                row[name] += int(t.get(name) or 0)
            row["quota_bytes"] = max(row["quota_bytes"], int(t.get("quota_bytes") or 0))
            row["refused"] += sum(int(v) for v in (t.get("refused") or {}).values())
    return {
        scope: PoolUsage(
            used=format_bytes(row["used_bytes"]),
            used_bytes=row["used_bytes"],
            # A tenant that only looked up has no account, so no quota the daemons told: unknown, not zero.
            quota=format_bytes(row["quota_bytes"]) if row["quota_bytes"] else "",
            quota_bytes=row["quota_bytes"],
            chunks=row["chunks"],
            pins=row["pins"],
            leases=row["leases"],
            evictions_by_others=row["evictions_by_others"],
            quota_refusals=row["refused"],
        )
        for scope, row in totals.items()
    }


def group_usage_only_change(old: InferenceGroupStatus, new: InferenceGroupStatus) -> bool:
    """True when only traffic moved: the group's pool usage between two known values, or the figures in the
    message of a DisaggregationActive condition whose status and reason stay. Written at a bounded rate like
    a pool's use; usage turning known or unknown, and every condition transition, are written at once."""
    if (old.pool_usage is None) != (new.pool_usage is None) or not changed(old, new):
        return False
    return _without_traffic(old) == _without_traffic(new)


def _without_traffic(status: InferenceGroupStatus) -> dict[str, Any]:
    quiet = [
        c.model_copy(update={"message": ""}) if c.type == cond.DISAGGREGATION_ACTIVE else c for c in status.conditions
    ]
    return status.model_copy(update={"conditions": quiet}).model_dump(exclude={"pool_usage"})


def _cleared(old: Any, new: Any) -> Any:
    """``new`` as a merge patch over ``old``: an explicit null for each field ``old`` has and ``new`` no longer
    (a merge patch deletes only what it names null, RFC 7386)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    return {**{k: None for k in old if k not in new}, **{k: _cleared(old.get(k), v) for k, v in new.items()}}


def status_body(status: Any, old: Any = None) -> dict[str, Any]:
    """The merge patch writing ``status``; ``old``: the status written before, whose fields ``status`` no longer
    has are cleared (without it they stayed: a group unbound since kept its pool usage)."""
    new = status.model_dump(by_alias=True, exclude_none=True)
    return new if old is None else _cleared(old.model_dump(by_alias=True, exclude_none=True), new)
