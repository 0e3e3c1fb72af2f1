"""DisaggregationActive: the window over the pool daemons' decode counters, and the condition judged from it."""

from __future__ import annotations

from typing import Any

from maru_operator import conditions as cond
from maru_operator.api.inferencegroup import InferenceGroupStatus, PoolUsage
from maru_operator.status import group_usage_only_change, tenant_usage
from maru_operator.traffic import MIN_TOKENS, DecodeReads, ReaderWindow, decode_reads

SCOPE = "llm/qwen"


def answer(
    epoch: int = 1, scope: str = SCOPE, *, pool: int = 0, computed: int = 0, waits: int = 0, timeouts: int = 0
) -> dict[str, Any]:
    """A daemon's /status as the pool daemon writes it (readers.py)."""
    return {
        "epoch": epoch,
        "tenants": [
            {
                "tenant": scope,
                "used_bytes": 1,
                "readers": {
                    "lookups": {"decode": 1},
                    "prompt_tokens": {"decode": {"pool": pool, "computed": computed}},
                    "handoff_waits": waits,
                    "handoff_timeouts": timeouts,
                },
            },
            {"tenant": "other/x", "used_bytes": 1},  # no reader counters (an account only)
        ],
    }


class TestWindow:
    def test_the_first_poll_is_a_baseline_then_differences_count(self) -> None:
        w = ReaderWindow(300)
        w.observe(0, {"node-1": answer(pool=10_000, computed=500)})
        assert not w.judged and w.totals(SCOPE, 0) == DecodeReads()
        w.observe(30, {"node-1": answer(pool=10_600, computed=900, waits=2, timeouts=1)})
        assert w.judged
        assert w.totals(SCOPE, 30) == DecodeReads(pool=600, computed=400, handoff_waits=2, handoff_timeouts=1)
        assert w.totals("other/x", 30) == DecodeReads()

    def test_old_differences_leave_the_window(self) -> None:
        w = ReaderWindow(100)
        w.observe(0, {"m": answer(pool=0)})
        w.observe(10, {"m": answer(pool=1000)})
        w.observe(60, {"m": answer(pool=1000, computed=50)})
        assert w.totals(SCOPE, 60) == DecodeReads(pool=1000, computed=50)
        assert w.totals(SCOPE, 200) == DecodeReads()  # both older than 100 s by then

    def test_nodes_are_summed_and_a_restarted_daemon_counts_from_its_restart(self) -> None:
        w = ReaderWindow(300)
        w.observe(0, {"n1": answer(pool=5000), "n2": answer(computed=100)})
        # n1 restarted (new epoch, counters from zero): what it counted since then, nothing lost or doubled.
        w.observe(30, {"n1": answer(epoch=2, pool=300), "n2": answer(computed=400)})
        assert w.totals(SCOPE, 30) == DecodeReads(pool=300, computed=300)

    def test_a_poll_nobody_answers_is_unreachable_and_no_daemon_to_ask_is_nothing(self) -> None:
        w = ReaderWindow(300)
        assert w.reachable is None
        w.observe(0, {"n1": None})
        assert w.reachable is False and not w.judged
        w.observe(10, {})
        assert w.reachable is False
        w.observe(20, {"n1": answer()})
        assert w.reachable is True

    def test_a_tenant_that_only_looked_up_has_no_quota_to_show(self) -> None:
        usage = tenant_usage({"n1": {"tenants": [{"tenant": SCOPE, "readers": answer()["tenants"][0]["readers"]}]}})
        assert usage is not None and (usage[SCOPE].quota, usage[SCOPE].used) == ("", "0")

    def test_daemons_without_reader_counters_report_nothing(self) -> None:
        assert decode_reads({"capacity_bytes": 1, "tenants": [{"tenant": SCOPE, "used_bytes": 1}]}) == {}
        assert decode_reads({"capacity_bytes": 1}) == {}


def judge(reads: DecodeReads | None, *, reachable: bool | None = True, pool: str | None = "local-shm") -> Any:
    return cond.disaggregation_active(reads, pool=pool, reachable=reachable, window_s=300, gen=3)


class TestCondition:
    def test_decode_loading_from_the_pool_is_active(self) -> None:
        c = judge(DecodeReads(pool=9000, computed=1000))
        assert (c.type, c.status, c.reason, c.observed_generation) == (
            "DisaggregationActive",
            "True",
            "DecodeLoadsFromPool",
            3,
        )
        assert "computed 10% of its prompt tokens" in c.message and "last 300 s" in c.message

    def test_decode_computing_most_of_its_prompts_is_not(self) -> None:
        c = judge(DecodeReads(pool=1000, computed=9000, handoff_waits=10, handoff_timeouts=2))
        assert (c.status, c.reason) == ("False", "DecodeRecomputing")
        for hint in ("90%", "MaruPool local-shm", "cacheNamespace", "evict", "prefill stores"):
            assert hint in c.message

    def test_timeouts_dominating_name_the_handoff(self) -> None:
        c = judge(DecodeReads(pool=1000, computed=9000, handoff_waits=10, handoff_timeouts=6))
        assert (c.status, c.reason) == ("False", "HandoffTimeouts")
        assert "6 timed out" in c.message and "maru_handoff_wait_ms" in c.message

    def test_too_little_traffic_is_unknown_with_a_message_that_does_not_move(self) -> None:
        a, b = judge(DecodeReads(computed=MIN_TOKENS - 1)), judge(DecodeReads(pool=7))
        assert (a.status, a.reason) == ("Unknown", "NoTraffic")
        assert a.message == b.message == judge(None).message

    def test_half_and_half_is_still_active(self) -> None:
        assert judge(DecodeReads(pool=MIN_TOKENS, computed=MIN_TOKENS)).status == "True"

    def test_daemons_that_do_not_answer_and_groups_without_a_pool(self) -> None:
        c = judge(DecodeReads(pool=9000), reachable=False)
        assert (c.status, c.reason) == ("False", "PoolUnreachable")
        assert "network policy" in c.message
        assert judge(None, pool=None).reason == "NotBound"


class TestBoundedWrites:
    def status(self, message: str, status: str = "True", used: int = 1) -> InferenceGroupStatus:
        c = cond.condition(cond.DISAGGREGATION_ACTIVE, status == "True", "DecodeLoadsFromPool", message, 1)
        return InferenceGroupStatus(conditions=[c], pool_usage=PoolUsage(used_bytes=used))

    def test_new_figures_alone_are_traffic_a_transition_is_not(self) -> None:
        assert group_usage_only_change(self.status("96%"), self.status("97%"))
        assert group_usage_only_change(self.status("96%"), self.status("97%", used=2))
        assert not group_usage_only_change(self.status("96%"), self.status("96%"))
        assert not group_usage_only_change(self.status("96%"), self.status("10%", status="False"))
