"""The choice of engine by load (pure), and the in-flight counts the router keeps per engine."""

from __future__ import annotations

import pytest

from maru_router.__main__ import parse_args
from maru_router.balance import Endpoints, direct_target, least_loaded, local_first


def test_least_loaded_picks_the_smallest_load() -> None:
    assert least_loaded([3, 1, 2]) == 1
    assert least_loaded([3, 1, 2], turn=2) == 1


def test_least_loaded_goes_round_robin_among_equals() -> None:
    loads = [0, 5, 0, 0]
    assert [least_loaded(loads, turn) for turn in range(5)] == [0, 2, 2, 3, 0]


def test_least_loaded_of_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="no endpoints"):
        least_loaded([])


@pytest.mark.parametrize(
    ("decode", "prefill", "to_prefill", "target"),
    [
        ([0], [0], True, ("decode", 0)),  # a tie goes to decode
        ([1], [1], True, ("decode", 0)),
        ([1], [0], True, ("prefill", 0)),  # decode busier: the pool lets prefill serve it alone
        ([1], [0], False, ("decode", 0)),  # unless prefill cannot load (kv_producer)
        ([2, 1], [1, 0], True, ("prefill", 1)),
        ([2, 0], [0, 0], True, ("decode", 1)),  # an idle decode engine beats an idle prefill
        ([3, 3], [3, 2], True, ("prefill", 1)),
    ],
)
def test_a_covered_prompt_goes_to_the_least_busy_engine_decode_on_ties(
    decode: list[int], prefill: list[int], to_prefill: bool, target: tuple[str, int]
) -> None:
    assert direct_target(decode, prefill, to_prefill=to_prefill) == target


def test_endpoints_count_what_is_in_flight_and_report_each_change() -> None:
    seen: list[tuple[str, int]] = []
    engines = Endpoints("decode", ["http://a/", "http://b"], lambda url, n: seen.append((url, n)))
    assert seen == [("http://a", 0), ("http://b", 0)]  # the gauge shows every engine from the start
    first = engines.pick()
    with engines.hold(first) as url:
        assert url == engines.urls[first] and engines.loads[first] == 1
        second = engines.pick()
        assert second != first  # the idle one
        with pytest.raises(RuntimeError), engines.hold(second):
            raise RuntimeError("a client gone mid-answer")
        assert engines.loads[second] == 0  # released on the way out, whatever ended the request
    assert engines.loads == [0, 0]
    assert seen[-1] == (engines.urls[first], 0)


def test_endpoints_go_round_robin_when_idle() -> None:
    engines = Endpoints("prefill", ["http://a", "http://b", "http://c"], lambda url, n: None)
    assert [engines.pick() for _ in range(4)] == [0, 1, 2, 0]


def test_endpoints_need_a_url() -> None:
    with pytest.raises(ValueError, match="at least one prefill URL"):
        Endpoints("prefill", [], lambda url, n: None)


def test_direct_to_prefill_is_off_unless_turned_on() -> None:
    # Off by default: measured slower (bench/bench_serve.py), and it puts decoding beside prefill's long steps.
    base = ["--prefill", "http://p", "--decode", "http://d", "--connector-config", "{}"]
    assert parse_args(base).direct_to_prefill == "off"
    assert parse_args([*base, "--direct-to-prefill", "on"]).direct_to_prefill == "on"


@pytest.mark.parametrize(
    ("loads", "local", "shared", "slack", "chosen"),
    [
        ([0, 0], [0, 0], 0, 1, 0),  # nothing held anywhere: by load
        ([0, 0], [0, 512], 0, 1, 1),  # one engine holds the prompt: it computes less
        ([0, 1], [0, 512], 0, 1, 1),  # worth one more request in flight (the slack)
        ([0, 2], [0, 512], 0, 1, 0),  # but not two
        ([0, 1], [0, 512], 0, 0, 0),  # slack 0: only among the least busy
        ([0, 1], [0, 512], 512, 1, 0),  # the pool gives every engine as much: no reason to queue
        ([0, 1], [256, 768], 512, 1, 1),  # the gain beyond the pool counts, not the whole hit
        ([1, 1, 0], [512, 768, 0], 0, 1, 1),  # the most beyond the pool among those near the least busy
        ([1, 0], [512, 512], 0, 1, 1),  # equal gains: the less busy
    ],
)
def test_local_first_weighs_only_what_the_pool_does_not_give_and_only_near_the_least_busy(
    loads: list[int], local: list[int], shared: int, slack: int, chosen: int
) -> None:
    assert local_first(loads, local, shared, slack=slack) == chosen


def test_endpoints_pick_by_what_an_engine_holds_when_its_events_are_read() -> None:
    from maru_router.balance import Prompt
    from maru_router.locality import EngineCache

    held = EngineCache(blocks={b"a", b"b"}, block_size=16)
    engines = Endpoints("prefill", ["http://a", "http://b"], lambda url, n: None, caches={"http://b": held})
    prompt = Prompt(hashes=[b"a", b"b", b"c"], block_size=16, pool_tokens=0)
    assert [engines.pick(prompt) for _ in range(3)] == [1, 1, 1]
    assert [engines.pick() for _ in range(2)] != [1, 1]  # without the prompt: round robin
    assert engines.pick(Prompt(hashes=[b"a"], block_size=16, pool_tokens=16)) in (0, 1)


def test_a_negative_locality_slack_is_refused() -> None:
    with pytest.raises(ValueError, match="locality slack must be >= 0"):
        Endpoints("prefill", ["http://a"], lambda url, n: None, slack=-1)
