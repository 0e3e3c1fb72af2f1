"""Pure status: observed children in, status out; conditions built in one place; Ready derived."""

from __future__ import annotations

from typing import Any

from maru_operator import conditions as cond
from maru_operator.api.common import Condition
from maru_operator.api.inferencegroup import InferenceGroupStatus
from maru_operator.api.marupool import MaruPoolStatus
from maru_operator.status import (
    PoolObservation,
    Router,
    bind,
    changed,
    group_status,
    invalid_group_status,
    pool_status,
    ready_endpoints,
)
from tests.support.specs import NOW, dax_spec, deployment, group_spec, pool_body, pool_spec

LATER = "2026-01-01T01:00:00Z"


def ds(desired: int, ready: int, observed: int = 1) -> dict[str, Any]:
    """A DaemonSet as its controller reports it (``observed``: the generation it looked at; the object is at 1)."""
    return {
        "metadata": {"generation": 1},
        "status": {"desiredNumberScheduled": desired, "numberReady": ready, "observedGeneration": observed},
    }


def pod(node: str, ready: bool = True, ip: str = "10.0.0.1") -> dict[str, Any]:
    return {
        "spec": {"nodeName": node},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def types(conditions: list[Condition]) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status, c.reason) for c in conditions}


class TestPoolStatus:
    def test_shm_ready_with_usage(self) -> None:
        seen = PoolObservation(
            daemonset=ds(2, 2),
            agent_pods=[pod("b"), pod("a")],
            stats={"a": {"used_bytes": 1024, "capacity_bytes": 4 << 30}, "b": {"used_bytes": 1024}},
            bound_groups=["llm/x"],
        )
        st = pool_status("pool", pool_spec(), 4, seen, MaruPoolStatus(), NOW)
        assert st.observed_generation == 4
        assert (st.nodes_desired, st.nodes_ready, st.node_summary) == (2, 2, "2/2")
        assert [n.node for n in st.nodes] == ["a", "b"]
        assert st.capacity == "8Gi" and st.capacity_bytes == 8 << 30
        assert st.used == "2Ki" and st.used_bytes == 2048
        assert st.endpoint == "unix:///run/maru/pool/pool.sock"
        assert st.bound_groups == 1
        assert types(st.conditions) == {
            "Ready": ("True", "PoolReady"),
            "Degraded": ("False", "AllNodesReady"),
            "InUse": ("True", "GroupsBound"),
        }

    def test_unreachable_daemon_leaves_used_unknown(self) -> None:
        seen = PoolObservation(
            daemonset=ds(2, 2), agent_pods=[pod("a"), pod("b")], stats={"a": {"used_bytes": 5}, "b": None}
        )
        st = pool_status("pool", pool_spec(), 1, seen, MaruPoolStatus(), NOW)
        assert st.used == "" and st.used_bytes == 0
        assert st.capacity == "8Gi"

    def test_partly_ready_is_degraded(self) -> None:
        st = pool_status("pool", pool_spec(), 1, PoolObservation(daemonset=ds(3, 1)), MaruPoolStatus(), NOW)
        assert types(st.conditions)["Ready"] == ("True", "PoolReady")
        assert types(st.conditions)["Degraded"] == ("True", "AgentsUnavailable")

    def test_no_nodes(self) -> None:
        st = pool_status("pool", pool_spec(), 1, PoolObservation(daemonset=ds(0, 0)), MaruPoolStatus(), NOW)
        assert types(st.conditions)["Ready"] == ("False", "NoNodesSelected")
        assert "nodeSelector" in cond.get(st.conditions, "Ready").message  # type: ignore[union-attr]

    def test_no_verdict_before_the_daemonset_controller_looked(self) -> None:
        for daemonset in (None, ds(0, 0, observed=0), {"metadata": {"generation": 2}, "status": {}}):
            st = pool_status("pool", pool_spec(), 1, PoolObservation(daemonset=daemonset), MaruPoolStatus(), NOW)
            assert types(st.conditions)["Ready"] == ("False", "AgentsPending")

    def test_dax_waits_for_metadata_server(self) -> None:
        seen = PoolObservation(daemonset=ds(2, 2), metadata_deployment=deployment(1, 0))
        st = pool_status("pool", dax_spec(), 1, seen, MaruPoolStatus(), NOW)
        assert types(st.conditions)["Ready"] == ("False", "MetadataServerNotReady")
        seen.metadata_deployment = deployment(1, 1)
        seen.stats = {"metadata": {"capacity_bytes": 1 << 40, "used_bytes": 1 << 30}}
        st = pool_status("pool", dax_spec(), 1, seen, MaruPoolStatus(), NOW)
        assert types(st.conditions)["Ready"] == ("True", "PoolReady")
        assert (st.capacity, st.used) == ("1Ti", "1Gi")

    def test_dax_capacity_falls_back_to_size(self) -> None:
        seen = PoolObservation(daemonset=ds(1, 1), metadata_deployment=deployment(1, 1), stats={"metadata": None})
        st = pool_status("pool", dax_spec(size="64Gi"), 1, seen, MaruPoolStatus(), NOW)
        assert st.capacity == "64Gi" and st.used == ""

    def test_deletion_blocked(self) -> None:
        seen = PoolObservation(daemonset=ds(1, 1), bound_groups=["llm/a", "llm/b"], deleting=True)
        st = pool_status("pool", pool_spec(), 1, seen, MaruPoolStatus(), NOW)
        in_use = cond.get(st.conditions, "InUse")
        assert in_use is not None and in_use.reason == "DeletionBlocked"
        assert "llm/a, llm/b" in in_use.message and "poolRef" in in_use.message

    def test_unchanged_status_is_not_a_change(self) -> None:
        seen = PoolObservation(daemonset=ds(1, 1), agent_pods=[pod("a")])
        first = pool_status("pool", pool_spec(), 1, seen, MaruPoolStatus(), NOW)
        again = pool_status("pool", pool_spec(), 1, seen, first, LATER)
        assert not changed(first, again)
        assert cond.get(again.conditions, "Ready").last_transition_time == NOW  # type: ignore[union-attr]


class TestBinding:
    def test_bound(self) -> None:
        b = bind("llm", group_spec(), pool_body())
        assert b.ok and b.pool is not None and b.pool.endpoint == "unix:///run/maru/pool/pool.sock"

    def test_missing_pool(self) -> None:
        b = bind("llm", group_spec(), None)
        assert (b.ok, b.reason) == (False, "PoolNotFound")
        assert "poolRef" in b.message

    def test_pool_not_ready(self) -> None:
        b = bind("llm", group_spec(), pool_body(ready=False))
        assert (b.ok, b.reason) == (False, "PoolNotReady")

    def test_namespace_not_allowed(self) -> None:
        b = bind("llm", group_spec(), pool_body(allowedNamespaces=["prod"]))
        assert (b.ok, b.reason, b.revoke) == (False, "NamespaceNotAllowed", True)
        assert bind("prod", group_spec(), pool_body(allowedNamespaces=["prod"])).ok

    def test_pool_deleting(self) -> None:
        body = pool_body()
        body["metadata"]["deletionTimestamp"] = NOW
        assert bind("llm", group_spec(), body).reason == "PoolDeleting"


class TestGroupStatus:
    def children(self, prefill: int = 1, decode: int = 1, router: int = 1) -> dict[str, Any]:
        return {"prefill": deployment(1, prefill), "decode": deployment(2, decode * 2), "router": deployment(1, router)}

    def test_ready(self) -> None:
        b = bind("llm", group_spec(), pool_body())
        st = group_status(group_spec(), 3, b, self.children(), InferenceGroupStatus(), endpoint="http://e", now=NOW)
        assert types(st.conditions) == {
            "PoolBound": ("True", "Bound"),
            "Ready": ("True", "Serving"),
            "Progressing": ("False", "RolloutComplete"),
            "Degraded": ("False", "AllReplicasAvailable"),
        }
        assert (st.prefill.summary, st.decode.summary, st.router.summary) == ("1/1", "2/2", "1/1")
        assert st.endpoint == "http://e" and st.pool_endpoint.startswith("unix://")
        assert st.observed_generation == 3

    def test_waiting_for_replicas(self) -> None:
        b = bind("llm", group_spec(), pool_body())
        children = self.children(decode=0)
        children["decode"]["status"]["updatedReplicas"] = 2
        st = group_status(group_spec(), 1, b, children, InferenceGroupStatus(), endpoint="", now=NOW)
        ready = cond.get(st.conditions, "Ready")
        assert ready is not None and ready.status == "False" and ready.reason == "ReplicasNotReady"
        assert "decode has no ready pod (0/2)" in ready.message
        assert types(st.conditions)["Progressing"] == ("True", "RollingOut")

    def test_a_role_at_zero_replicas_is_not_serving(self) -> None:
        """decode scaled to 0 (an autoscaler, a user, a stale look after revoked access) has nothing ready to serve:
        0 of 0 is no ready pod."""
        b = bind("llm", group_spec(), pool_body())
        children = self.children()
        children["decode"] = deployment(0, 0)
        st = group_status(group_spec(), 1, b, children, InferenceGroupStatus(), endpoint="", now=NOW)
        ready = cond.get(st.conditions, "Ready")
        assert ready is not None and ready.status == "False" and "decode has no ready pod (0/0)" in ready.message

    def test_rollout_of_new_generation_is_progressing(self) -> None:
        b = bind("llm", group_spec(), pool_body())
        children = self.children()
        children["prefill"] = deployment(1, 1, generation=2, observed=1)
        st = group_status(group_spec(), 1, b, children, InferenceGroupStatus(), endpoint="", now=NOW)
        assert cond.get(st.conditions, "Progressing").message == "rolling out: prefill"  # type: ignore[union-attr]

    def test_unbound_takes_the_binding_reason(self) -> None:
        b = bind("llm", group_spec(), None)
        st = group_status(group_spec(), 1, b, {}, InferenceGroupStatus(), endpoint="", now=NOW)
        assert types(st.conditions)["Ready"] == ("False", "PoolNotFound")
        assert types(st.conditions)["PoolBound"] == ("False", "PoolNotFound")

    def test_router_disabled(self) -> None:
        spec = group_spec(router={"enabled": False})
        b = bind("llm", spec, pool_body())
        children = self.children()
        del children["router"]
        st = group_status(spec, 1, b, children, InferenceGroupStatus(), endpoint="", now=NOW)
        assert types(st.conditions)["Ready"] == ("True", "Serving")
        assert st.router.summary == "disabled"

    def test_fewer_ready_than_desired_is_degraded_not_unready(self) -> None:
        b = bind("llm", group_spec(), pool_body())
        children = self.children()
        children["decode"]["status"]["readyReplicas"] = 1
        st = group_status(group_spec(), 1, b, children, InferenceGroupStatus(), endpoint="", now=NOW)
        assert types(st.conditions)["Ready"] == ("True", "Serving")
        degraded = cond.get(st.conditions, "Degraded")
        assert degraded is not None and (degraded.status, degraded.reason) == ("True", "ReplicasUnavailable")
        assert "decode 1/2 ready" in degraded.message

    def test_router_without_ready_endpoints_is_not_ready(self) -> None:
        b = bind("llm", group_spec(), pool_body())
        st = group_status(
            group_spec(),
            1,
            b,
            self.children(),
            InferenceGroupStatus(),
            endpoint="",
            now=NOW,
            router=Router("llm/g", ready_endpoints([{"endpoints": [{"conditions": {"ready": False}}]}])),
        )
        assert types(st.conditions)["Ready"] == ("False", "NoReadyEndpoints")
        assert ready_endpoints([{"endpoints": [{"conditions": {}}, {"conditions": {"ready": True}}]}]) == 2

    def test_a_pool_outage_degrades_a_serving_group(self) -> None:
        b = bind("llm", group_spec(), pool_body(ready=False))
        st = group_status(group_spec(), 1, b, self.children(), InferenceGroupStatus(), endpoint="", now=NOW)
        assert types(st.conditions)["Ready"] == ("True", "Serving")
        assert types(st.conditions)["PoolBound"] == ("False", "PoolNotReady")
        assert types(st.conditions)["Degraded"] == ("True", "PoolUnavailable")

    def test_failed_replicas_degrade(self) -> None:
        b = bind("llm", group_spec(), pool_body())
        children = self.children()
        children["decode"]["status"]["conditions"] = [
            {"type": "ReplicaFailure", "status": "True", "message": 'pods "x" is forbidden: quota'}
        ]
        st = group_status(group_spec(), 1, b, children, InferenceGroupStatus(), endpoint="", now=NOW)
        degraded = cond.get(st.conditions, "Degraded")
        assert degraded is not None and degraded.status == "True" and "quota" in degraded.message

    def test_invalid_spec_keeps_the_rest(self) -> None:
        b = bind("llm", group_spec(), pool_body())
        good = group_status(group_spec(), 1, b, self.children(), InferenceGroupStatus(), endpoint="e", now=NOW)
        bad = invalid_group_status(["spec.x: wrong"], 2, good, LATER)
        assert types(bad.conditions)["Ready"] == ("False", "InvalidSpec")
        assert bad.observed_generation == 2 and bad.prefill == good.prefill
        assert types(bad.conditions)["PoolBound"] == ("True", "Bound")


class TestConditions:
    def test_transition_time_kept_until_status_flips(self) -> None:
        old = cond.merge([], [cond.condition("Ready", True, "A", "", 1)], NOW)
        same = cond.merge(old, [cond.condition("Ready", True, "B", "other", 2)], LATER)
        assert same[0].last_transition_time == NOW
        flipped = cond.merge(old, [cond.condition("Ready", False, "C", "", 2)], LATER)
        assert flipped[0].last_transition_time == LATER

    def test_ready_is_serving(self) -> None:
        def ready(**kw: Any) -> tuple[str, str]:
            args = {
                "conflicts": [],
                "not_serving": [],
                "binding": (True, "Bound", ""),
                "router": ("llm/g", 1),
                "summary": "s",
                "gen": 1,
                **kw,
            }
            c = cond.group_ready(**args)
            return c.status, c.reason

        assert ready() == ("True", "Serving")
        assert ready(binding=(False, "PoolNotReady", "waiting")) == ("True", "Serving")  # serves without the pool
        assert ready(not_serving=["decode"], binding=(False, "PoolNotReady", "w")) == ("False", "PoolNotReady")
        assert ready(not_serving=["decode"]) == ("False", "ReplicasNotReady")
        assert ready(router=("llm/g", 0)) == ("False", "NoReadyEndpoints")
        assert ready(router=None) == ("True", "Serving")
        assert ready(conflicts=["Service llm/g is someone else's"]) == ("False", "ChildConflict")

    def test_unknown(self) -> None:
        assert cond.condition("X", None, "R", "", None).status == "Unknown"


def test_degraded_pool_degrades_its_groups() -> None:
    body = pool_body()
    body["status"]["conditions"].append(
        {
            "type": "Degraded",
            "status": "True",
            "reason": "AgentsUnavailable",
            "message": "1 of 2 node agents are not ready",
        }
    )
    b = bind("llm", group_spec(), body)
    assert b.ok and "1 of 2" in b.pool_problem
    children = TestGroupStatus().children()
    st = group_status(group_spec(), 1, b, children, InferenceGroupStatus(), endpoint="", now=NOW)
    assert types(st.conditions)["Degraded"] == ("True", "PoolDegraded")
    assert types(st.conditions)["Ready"] == ("True", "Serving")  # still serving, without KV sharing on one node
