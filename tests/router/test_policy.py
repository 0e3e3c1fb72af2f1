"""The routing policy's order, pure: how a request that is not served by one engine alone is run in each mode."""

from __future__ import annotations

import itertools

import pytest

from maru_router.balance import Prompt
from maru_router.policy import DIRECT, PD, Routing, Step, after_lookup, pd_step


@pytest.mark.parametrize(
    ("mid_rollout", "upstream", "local_prefill", "may_refresh"),
    list(itertools.product([False, True], repeat=4)),
)
def test_each_mode_runs_a_pd_request_one_way(
    mid_rollout: bool, upstream: bool, local_prefill: bool, may_refresh: bool
) -> None:
    step = pd_step(mid_rollout=mid_rollout, upstream=upstream, local_prefill=local_prefill, may_refresh=may_refresh)
    if mid_rollout:  # pairing within one key revision wins over every mode: another revision's keys would miss
        assert step is Step.COHERENT
    elif not upstream:
        assert step is Step.PREFILL_THEN_DECODE
    elif local_prefill:  # an engine's own cache beats learning the scheme: both run prefill here anyway
        assert step is Step.LOCAL_PREFILL
    elif may_refresh:
        assert step is Step.REFRESH
    else:
        assert step is Step.UPSTREAM


def test_a_prompt_goes_direct_only_when_the_pool_holds_what_it_needs() -> None:
    prompt = Prompt([b"h"], 16, 512)
    assert after_lookup(600, need=2, chunks=2, prompt=prompt).route == DIRECT
    assert after_lookup(600, need=2, chunks=3, prompt=prompt).reason == "covered"
    cold = after_lookup(600, need=2, chunks=1, prompt=prompt)
    assert (cold.route, cold.reason, cold.chunks_hit, cold.prompt_tokens) == (PD, "cold", 1, 600)


def test_a_coverage_outside_zero_to_one_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="min_coverage"):
        Routing(min_coverage=1.5)
