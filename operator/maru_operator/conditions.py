"""Every condition the operator writes is built here; Ready is derived from what was observed, never set by hand.

Reasons are CamelCase and stable (alerts match on them); messages say what is wrong and what to do.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from maru_operator.api.common import Condition
from maru_operator.traffic import MIN_TOKENS, DecodeReads

READY = "Ready"
DEGRADED = "Degraded"
PROGRESSING = "Progressing"
POOL_BOUND = "PoolBound"
IN_USE = "InUse"
DISAGGREGATION_ACTIVE = "DisaggregationActive"
INFERENCE_POOL_READY = "InferencePoolReady"
# Ready's and Degraded's reason when a role's pods wait for a human (see maru_operator.readiness).
REPLICAS_FAILING = "ReplicasFailing"


def condition(type_: str, ok: bool | None, reason: str, message: str, generation: int | None) -> Condition:
    status = "Unknown" if ok is None else ("True" if ok else "False")
    return Condition(type=type_, status=status, reason=reason, message=message, observed_generation=generation)


# --- MaruPool -----------------------------------------------------------------------------------------


def pool_degraded(nodes_ready: int, nodes_desired: int, metadata_ready: bool | None, gen: int | None) -> Condition:
    if metadata_ready is False:
        return condition(
            DEGRADED,
            True,
            "MetadataServerUnavailable",
            "the pool's metadata server is not ready; check its pod's logs and events",
            gen,
        )
    if nodes_desired and nodes_ready < nodes_desired:
        return condition(
            DEGRADED,
            True,
            "AgentsUnavailable",
            f"{nodes_desired - nodes_ready} of {nodes_desired} node agents are not ready; "
            "groups on those nodes run without KV sharing",
            gen,
        )
    return condition(DEGRADED, False, "AllNodesReady", "", gen)


def pool_ready(nodes_ready: int, nodes_desired: int, metadata_ready: bool | None, gen: int | None) -> Condition:
    if nodes_desired == 0:
        return condition(
            READY,
            False,
            "NoNodesSelected",
            "no node matches spec.nodeSelector (or none tolerates its taints); label the memory "
            "nodes or fix the selector",
            gen,
        )
    if metadata_ready is False:
        return condition(READY, False, "MetadataServerNotReady", "waiting for the pool's metadata server", gen)
    if nodes_ready == 0:
        return condition(
            READY,
            False,
            "AgentsNotReady",
            f"0 of {nodes_desired} node agents are ready; see the agent pods' events",
            gen,
        )
    return condition(READY, True, "PoolReady", f"{nodes_ready} of {nodes_desired} nodes serve the pool", gen)


def agents_pending(gen: int | None) -> Condition:
    return condition(
        READY, False, "AgentsPending", "waiting for the DaemonSet controller to schedule the pool's node agents", gen
    )


def pool_in_use(groups: list[str], deleting: bool, gen: int | None) -> Condition:
    if not groups:
        return condition(IN_USE, False, "NoBoundGroups", "", gen)
    names = ", ".join(groups[:10]) + (f" and {len(groups) - 10} more" if len(groups) > 10 else "")
    if deleting:
        return condition(
            IN_USE,
            True,
            "DeletionBlocked",
            f"deletion waits for the InferenceGroups bound to this pool: {names}; delete them or "
            "point their spec.poolRef at another pool",
            gen,
        )
    return condition(IN_USE, True, "GroupsBound", f"bound InferenceGroups: {names}", gen)


# --- InferenceGroup -----------------------------------------------------------------------------------


def pool_bound(ok: bool, reason: str, message: str, gen: int | None) -> Condition:
    return condition(POOL_BOUND, ok, reason, message, gen)


def group_progressing(rolling: list[str], gen: int | None, queued: Sequence[str] = ()) -> Condition:
    if queued:
        return condition(
            PROGRESSING,
            True,
            "RolloutQueued",
            "pod template change of " + ", ".join(queued) + " waits while other groups roll out "
            "(the operator's --max-rolling-groups)",
            gen,
        )
    if rolling:
        return condition(PROGRESSING, True, "RollingOut", "rolling out: " + ", ".join(rolling), gen)
    return condition(PROGRESSING, False, "RolloutComplete", "", gen)


def group_degraded(problems: list[tuple[str, str]], gen: int | None) -> Condition:
    """``problems``: (reason, message); the first names the reason (replicas, then the pool)."""
    if problems:
        return condition(DEGRADED, True, problems[0][0], "; ".join(m for _, m in problems), gen)
    return condition(DEGRADED, False, "AllReplicasAvailable", "", gen)


def group_ready(
    *,
    conflicts: list[str],
    not_serving: list[str],
    binding: tuple[bool, str, str],
    router: tuple[str, int] | None,
    summary: str,
    gen: int | None,
    stuck: bool = False,
) -> Condition:
    """Ready is serving: no child in conflict, a ready pod per role, the router Service with a ready endpoint.

    ``binding``: (bound, reason, message) of PoolBound, which names why nothing serves when unbound;
    ``router``: (its Service as namespace/name, ready endpoints), None without a router; ``stuck``: a role
    that serves nothing waits for a human (ReplicasFailing), not for its pods to start (ReplicasNotReady).
    """
    if conflicts:
        return child_conflict(conflicts, gen)
    if not_serving:
        bound, reason, message = binding
        if not bound:
            return condition(READY, False, reason, message, gen)
        reason = REPLICAS_FAILING if stuck else "ReplicasNotReady"
        return condition(READY, False, reason, "waiting: " + "; ".join(not_serving), gen)
    if router is not None and router[1] == 0:
        return condition(
            READY,
            False,
            "NoReadyEndpoints",
            f"Service {router[0]} has no ready endpoint: clients cannot reach the router; check the "
            "router pods' readiness and the Service's selector",
            gen,
        )
    front = f"; the router Service has {router[1]} ready endpoint(s)" if router else ""
    return condition(READY, True, "Serving", summary + front, gen)


def disaggregation_active(
    reads: DecodeReads | None,
    *,
    pool: str | None,
    reachable: bool | None,
    window_s: float,
    gen: int | None,
    min_tokens: int = MIN_TOKENS,
) -> Condition:
    """Whether decode loads its prompts from the pool, from the pool daemons' decode counters over the window.

    ``reads``: the group's decode traffic in the window (None: not judged yet, no poll to compare with);
    ``pool``: the MaruPool the group is bound to (None: not bound); ``reachable``: whether the pool's daemons
    answered the operator's last poll (None: never polled).
    False when decode computed most of its prompt tokens itself (more than half, over at least
    ``min_tokens``), or when the daemons cannot be polled; Unknown with too little decode traffic to judge.
    """
    window = f"the last {window_s:.0f} s"
    if pool is None:
        return condition(
            DISAGGREGATION_ACTIVE,
            None,
            "NotBound",
            "the group is not bound to a pool (see PoolBound): decode has no pool to load from",
            gen,
        )
    if reachable is False:
        return condition(
            DISAGGREGATION_ACTIVE,
            False,
            "PoolUnreachable",
            f"the operator cannot read /status of MaruPool {pool}'s daemons, so it cannot tell whether "
            "decode loads its prompts from the pool (with the pool down, decode recomputes every "
            "prompt): check the pool's agent pods and that no network policy keeps the operator from "
            "their metrics port",
            gen,
        )
    if reads is None or reads.tokens < min_tokens:
        return condition(
            DISAGGREGATION_ACTIVE,
            None,
            "NoTraffic",
            f"fewer than {min_tokens} decode prompt tokens (in whole chunks) looked up in MaruPool "
            f"{pool} over {window}: too little decode traffic to judge (pool daemons older than "
            "these counters report none)",
            gen,
        )
    share = 100 * reads.computed // reads.tokens
    figures = (
        f"decode computed {share}% of its prompt tokens itself over {window} ({reads.computed} of "
        f"{reads.tokens} in whole chunks; {reads.handoff_waits} handoff waits, {reads.handoff_timeouts} "
        "timed out)"
    )
    if 2 * reads.computed <= reads.tokens:
        return condition(
            DISAGGREGATION_ACTIVE,
            True,
            "DecodeLoadsFromPool",
            f"decode loads its prompts from MaruPool {pool}: {figures}",
            gen,
        )
    if reads.handoff_timeouts and 2 * reads.handoff_timeouts >= reads.handoff_waits:
        return condition(
            DISAGGREGATION_ACTIVE,
            False,
            "HandoffTimeouts",
            f"{figures}: the chunks prefill announced did not reach MaruPool {pool} before decode's "
            "handoff wait ran out. Check the prefill pods' logs for pool errors (pool full, quota "
            "refusals), the pool's evictions (maru_pool_tenant_evictions_total), and whether the "
            "connector's handoff wait (maru_handoff_wait_ms) is shorter than prefill's saves take",
            gen,
        )
    return condition(
        DISAGGREGATION_ACTIVE,
        False,
        "DecodeRecomputing",
        f"{figures}: decode does not find its prompts in MaruPool {pool}. Check that prefill and "
        "decode key prompts alike (same model, revision, chunk size and cacheNamespace; decode logs "
        "'under keys this engine does not use'), that chunks are not evicted before decode reads "
        "them (maru_pool_tenant_evictions_total, the group's quota), and that prefill stores at "
        "all (its pods' logs for pool errors)",
        gen,
    )


def inference_pool_ready(served: bool | None, pool: str, conflict: str | None, gen: int | None) -> Condition:
    """Whether the InferencePool the group asks for (``pool``: namespace/name) is written; ``served``: whether the
    API server serves the kind (None: discovery has not answered); ``conflict``: why its name is not ours."""
    if conflict:
        return condition(INFERENCE_POOL_READY, False, "ChildConflict", conflict, gen)
    if served is None:
        return condition(
            INFERENCE_POOL_READY,
            None,
            "DiscoveryFailed",
            "the operator could not ask the API server whether it serves inference.networking.k8s.io/v1 "
            "InferencePool; it asks again, and an InferencePool already written stays meanwhile",
            gen,
        )
    if not served:
        return condition(
            INFERENCE_POOL_READY,
            False,
            "CRDNotInstalled",
            "InferencePool requested but the CRD inference.networking.k8s.io/v1 InferencePool is not "
            "installed: install the Gateway API Inference Extension (the group is served through its "
            "router meanwhile)",
            gen,
        )
    return condition(
        INFERENCE_POOL_READY,
        True,
        "Written",
        f"InferencePool {pool} selects the group's prefill and decode pods for its endpoint picker",
        gen,
    )


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
