"""Every condition the operator writes is built here; Ready is derived from what was observed, never set by hand.

Reasons are CamelCase and stable (alerts match on them); messages say what is wrong and what to do.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from maru_operator.api.common import Condition

READY = "Ready"
DEGRADED = "Degraded"
PROGRESSING = "Progressing"
POOL_BOUND = "PoolBound"
IN_USE = "InUse"


def condition(type_: str, ok: bool | None, reason: str, message: str, generation: int | None) -> Condition:
    status = "Unknown" if ok is None else ("True" if ok else "False")
    return Condition(type=type_, status=status, reason=reason, message=message, observed_generation=generation)


# --- MaruPool -----------------------------------------------------------------------------------------

def pool_degraded(nodes_ready: int, nodes_desired: int, metadata_ready: bool | None, gen: int | None) -> Condition:
    if metadata_ready is False:
        return condition(DEGRADED, True, "MetadataServerUnavailable",
                         "the pool's metadata server is not ready; check its pod's logs and events", gen)
    if nodes_desired and nodes_ready < nodes_desired:
        return condition(DEGRADED, True, "AgentsUnavailable",
                         f"{nodes_desired - nodes_ready} of {nodes_desired} node agents are not ready; "
                         "groups on those nodes run without KV sharing", gen)
    return condition(DEGRADED, False, "AllNodesReady", "", gen)


def pool_ready(nodes_ready: int, nodes_desired: int, metadata_ready: bool | None, gen: int | None) -> Condition:
    if nodes_desired == 0:
        return condition(READY, False, "NoNodesSelected",
                         "no node matches spec.nodeSelector (or none tolerates its taints); label the memory "
                         "nodes or fix the selector", gen)
    if metadata_ready is False:
        return condition(READY, False, "MetadataServerNotReady", "waiting for the pool's metadata server", gen)
    if nodes_ready == 0:
        return condition(READY, False, "AgentsNotReady",
                         f"0 of {nodes_desired} node agents are ready; see the agent pods' events", gen)
    return condition(READY, True, "PoolReady", f"{nodes_ready} of {nodes_desired} nodes serve the pool", gen)


def agents_pending(gen: int | None) -> Condition:
    return condition(READY, False, "AgentsPending",
                     "waiting for the DaemonSet controller to schedule the pool's node agents", gen)


def pool_in_use(groups: list[str], deleting: bool, gen: int | None) -> Condition:
    if not groups:
        return condition(IN_USE, False, "NoBoundGroups", "", gen)
    names = ", ".join(groups[:10]) + (f" and {len(groups) - 10} more" if len(groups) > 10 else "")
    if deleting:
        return condition(IN_USE, True, "DeletionBlocked",
                         f"deletion waits for the InferenceGroups bound to this pool: {names}; delete them or "
                         "point their spec.poolRef at another pool", gen)
    return condition(IN_USE, True, "GroupsBound", f"bound InferenceGroups: {names}", gen)


# --- InferenceGroup -----------------------------------------------------------------------------------

def pool_bound(ok: bool, reason: str, message: str, gen: int | None) -> Condition:
    return condition(POOL_BOUND, ok, reason, message, gen)


def group_progressing(rolling: list[str], gen: int | None, queued: Sequence[str] = ()) -> Condition:
    if queued:
        return condition(PROGRESSING, True, "RolloutQueued",
                         "pod template change of " + ", ".join(queued) + " waits while other groups roll out "
                         "(the operator's --max-rolling-groups)", gen)
    if rolling:
        return condition(PROGRESSING, True, "RollingOut", "rolling out: " + ", ".join(rolling), gen)
    return condition(PROGRESSING, False, "RolloutComplete", "", gen)


def group_degraded(problems: list[tuple[str, str]], gen: int | None) -> Condition:
    """``problems``: (reason, message); the first names the reason (replicas, then the pool)."""
    if problems:
        return condition(DEGRADED, True, problems[0][0], "; ".join(m for _, m in problems), gen)
    return condition(DEGRADED, False, "AllReplicasAvailable", "", gen)


def group_ready(*, conflicts: list[str], not_serving: list[str], binding: tuple[bool, str, str],
                router: tuple[str, int] | None, summary: str, gen: int | None) -> Condition:
    """Ready is serving: no child in conflict, a ready pod per role, the router Service with a ready endpoint.

    ``binding``: (bound, reason, message) of PoolBound, which names why nothing serves when unbound;
    ``router``: (its Service as namespace/name, ready endpoints), None without a router.
    """
    if conflicts:
        return child_conflict(conflicts, gen)
    if not_serving:
        bound, reason, message = binding
        if not bound:
            return condition(READY, False, reason, message, gen)
        return condition(READY, False, "ReplicasNotReady", "waiting: " + "; ".join(not_serving), gen)
    if router is not None and router[1] == 0:
        return condition(READY, False, "NoReadyEndpoints",
                         f"Service {router[0]} has no ready endpoint: clients cannot reach the router; check the "
                         "router pods' readiness and the Service's selector", gen)
    front = f"; the router Service has {router[1]} ready endpoint(s)" if router else ""
    return condition(READY, True, "Serving", summary + front, gen)


def child_conflict(messages: list[str], gen: int | None) -> Condition:
    """A child's name is taken by an object this owner does not control: it is left alone, and said so."""
    return condition(READY, False, "ChildConflict", "; ".join(messages), gen)


def invalid_spec(errors: Iterable[str], gen: int | None) -> Condition:
    return condition(READY, False, "InvalidSpec", "; ".join(errors), gen)


# --- bookkeeping --------------------------------------------------------------------------------------

def merge(old: list[Condition], new: list[Condition], now: str) -> list[Condition]:
    """New conditions, keeping ``lastTransitionTime`` of those whose status did not change."""
    previous = {c.type: c for c in old}
    merged = []
    for cond in new:
        before = previous.get(cond.type)
        if before is not None and before.status == cond.status and before.last_transition_time:
            stamp = before.last_transition_time
        else:
            stamp = now
        merged.append(cond.model_copy(update={"last_transition_time": stamp}))
    return merged


def get(conditions: list[Condition], type_: str) -> Condition | None:
    return next((c for c in conditions if c.type == type_), None)


def is_true(conditions: list[Condition], type_: str) -> bool:
    cond = get(conditions, type_)
    return cond is not None and cond.status == "True"
