"""The GPU copy path's ordering, checked on a CPU: torch.cuda's streams and events record what they are asked.

What the bytes do on a real GPU (and the GB/s) is checked by ``python -m maru_connector.layout_check
--device cuda``; here the calls the connector makes are checked for their order: a lane thread sets its
rank's device before it touches a stream, a load's copies wait for the engine's stream, a host waits on
blocking events, index tensors reach the GPU without a synchronous copy, and the staging buffers belong
to the lane's stream.
"""

from __future__ import annotations

import threading

import pytest
import torch

from maru_connector import layout_check
from maru_connector.layout import PagedKV, describe_kv_caches, index_tensor
from maru_connector.layout_check import CacheShape
from maru_connector.staging import StagedCopier
from maru_connector.vllm import common
from maru_connector.vllm import worker as worker_module
from maru_connector.vllm.lane import Job, Lane
from maru_connector.vllm.metadata import ChunkLoad, ChunkSave, LoadPlan, MaruConnectorMetadata, SavePlan
from maru_connector.vllm.worker import MaruWorker
from maru_contracts.config import MaruConnectorConfig

from . import fakecuda, fakes

SHAPE = CacheShape(num_layers=2, num_blocks=16, heads=2, block_size=16, head_size=32)


def gpu_cache(layout: str = "LHBNC", shape: CacheShape = SHAPE) -> tuple[PagedKV, dict[str, torch.Tensor]]:
    _, views = layout_check.allocate(layout, shape, torch.float16, "cpu")
    for i, view in enumerate(views.values()):
        view.copy_((torch.arange(view.numel()) % 251 + i).view(view.shape).to(torch.float16))
    paged = describe_kv_caches(
        views, num_blocks=shape.num_blocks, block_size=shape.block_size, num_kv_heads=shape.heads,
        head_size=shape.head_size, backend="TEST",
    )  # fmt: skip
    return fakecuda.on_gpu(paged), views


def test_a_lane_thread_sets_its_ranks_device_before_it_touches_a_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fakecuda.install(monkeypatch)
    lane = Lane("test", common.RateLimitedLog(), common.Counters())
    try:
        lane.use_device(fakecuda.DEVICE)

        def copy() -> int:
            with torch.cuda.stream(torch.cuda.Stream(device=fakecuda.DEVICE)):
                return 1

        for _ in range(2):
            lane.submit(Job(run=copy, req_ids=frozenset({"r"}), on_error=lambda err: err))
        assert lane.wait_for(timeout=10)
        assert lane.take_done() == [1, 1]
    finally:
        lane.close()
    on_lane = [c[1:] for c in calls.log if c[0] == "maru-test"]
    assert on_lane[0] == ("set_device", fakecuda.DEVICE), on_lane
    assert [c for c in on_lane if c[0] == "set_device"] == [("set_device", fakecuda.DEVICE)]  # once per thread


def test_a_load_waits_on_the_engine_streams_event_before_it_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fakecuda.install(monkeypatch)
    paged, views = gpu_cache()
    copier = StagedCopier(paged, 2)
    chunk = torch.empty(copier.chunk_bytes, dtype=torch.uint8)
    paged.gather([3, 4], paged.chunk_view(chunk, 2))
    calls.log.clear()
    mark = paged.mark()
    copier.after(mark)
    copier.scatter(lambda host: host.__setitem__(slice(None), chunk.numpy()), [(0, 9), (1, 10)])
    copier.finish()
    assert mark is not None
    recorded = calls.index("record", mark.name, "engine")
    waited = calls.index("wait_event", copier._stream.name, mark.name)
    assert recorded < waited < calls.index("enter stream", copier._stream.name)
    for view in views.values():
        assert torch.equal(view[9], view[3]) and torch.equal(view[10], view[4])


def test_the_workers_loads_wait_for_the_engine_stream_and_its_lanes_use_the_ranks_device(
    monkeypatch: pytest.MonkeyPatch, pool
) -> None:
    """A GPU worker end to end: save two chunks, load them (one re-sharded piece by piece is not needed here)."""
    calls = fakecuda.install(monkeypatch)
    describe = worker_module.describe_kv_caches
    monkeypatch.setattr(worker_module, "describe_kv_caches", lambda *a, **kw: fakecuda.on_gpu(describe(*a, **kw)))
    bs, heads, hd, blocks = 32, 2, 32, 16

    def make() -> tuple[MaruWorker, dict[str, torch.Tensor]]:
        cfg = MaruConnectorConfig.from_extra_config({"maru_pool_url": pool.url, "maru_kv_chunk_tokens": 2 * bs})
        worker = MaruWorker(
            fakes.vllm_config(block_size=bs),
            fakes.kv_cache_config(block_size=bs, heads=heads, head_size=hd, num_blocks=blocks),
            cfg, loads=True, saves=True, tp_rank=0,
        )  # fmt: skip
        caches = {f"layer{i}": torch.randn(blocks, heads, bs, 2 * hd) for i in range(2)}
        worker.register_kv_caches(caches)
        return worker, caches

    producer, src = make()
    keys = (b"\x01" * 16,)
    producer.save(
        MaruConnectorMetadata(
            saves={"r": SavePlan(chunks=(ChunkSave(index=0, keys=keys, parents=(None,), block_ids=(3, 9)),))}
        )
    )
    producer.wait_idle()
    consumer, dst = make()
    calls.log.clear()
    plan = LoadPlan(load_id=1, chunks=(ChunkLoad(keys=keys, slots=((0, 10), (1, 11))),), asynchronous=True)
    consumer.load(MaruConnectorMetadata(loads={"r": plan}))
    consumer.wait_idle()
    consumer.finished(None)
    assert consumer.report().loads == {1: -1}
    for name in src:
        assert torch.equal(dst[name][10], src[name][3]) and torch.equal(dst[name][11], src[name][9])
    lane_stream = consumer._load_staging._stream.name
    (mark,) = [c for c in calls.of("record") if c[3] == "engine"]
    assert mark[0] == threading.current_thread().name  # recorded on the engine's thread, at load()
    assert calls.index("record", mark[2], "engine") < calls.index("wait_event", lane_stream, mark[2])
    assert calls.index("wait_event", lane_stream, mark[2]) < calls.index("enter stream", lane_stream)
    on_lane = [c[1:] for c in calls.log if c[0] == "maru-worker0-loads"]
    assert on_lane[0] == ("set_device", fakecuda.DEVICE), on_lane
    for worker in (producer, consumer):
        worker.shutdown()


def test_host_waits_are_on_blocking_events(monkeypatch: pytest.MonkeyPatch) -> None:
    """A default CUDA event spins a core while the host waits for it; every event waited on here blocks."""
    calls = fakecuda.install(monkeypatch)
    paged, _ = gpu_cache()
    copier = StagedCopier(paged, 2)
    paged.fence()()
    for host in copier.gathered([[1, 2], [3, 4], [5, 6]]):
        assert host.nbytes == copier.chunk_bytes
    for _ in range(3):
        copier.scatter(lambda host: None, [(0, 11), (1, 12)])
    copier.finish()
    waited = calls.of("event synchronize")
    assert len(waited) >= 1 + 3 + 2  # the fence, each gather, the reused host buffers and the last scatter
    assert all(blocking for *_, blocking in waited), waited


def test_index_tensors_reach_the_gpu_without_a_synchronous_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fakecuda.install(monkeypatch)
    paged, views = gpu_cache("LBHNC")
    copier = StagedCopier(paged, 2)
    packed = [bytes(host) for host in copier.gathered([[3, 4]])]
    copier.scatter(lambda host: host.__setitem__(slice(None), bytearray(packed[0])), [(1, 7), (0, 8)])
    copier.finish()
    assert not calls.of("tensor on cuda"), "torch.tensor(..., device=cuda) copies from pageable memory and syncs"
    to_gpu = [c for c in calls.of("to cuda") if c[2] == torch.int64]
    assert len(to_gpu) == 3  # the gather's ids, the scatter's destinations and its picked slots
    assert all(non_blocking and stream == copier._stream.name for _, _, _, non_blocking, stream in to_gpu), to_gpu
    assert len([c for c in calls.of("pin_memory") if c[2] == torch.int64]) == 3
    for view in views.values():
        assert torch.equal(view[7], view[4]) and torch.equal(view[8], view[3])


def test_the_device_buffer_is_allocated_on_the_lanes_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fakecuda.install(monkeypatch)
    copier = StagedCopier(gpu_cache()[0], 2)
    (alloc,) = calls.of("device buffer")
    assert alloc[2] == copier._stream.name


def test_paged_kv_no_longer_synchronises_the_callers_stream() -> None:
    assert not hasattr(PagedKV, "finish_copies")


def test_wide_elements_and_64_bit_offsets_on_a_cache_past_4_gib() -> None:
    """A production-sized cache (meta tensors: no memory) is copied as int64, and the offset of its last block
    of its last layer, past 2**32 bytes, is exact in the index maths (int64 ids, Python-int strides)."""
    shape = CacheShape(num_layers=32, num_blocks=4096, heads=8, block_size=16, head_size=128)
    last_block = shape.num_blocks - 1
    for layout in layout_check.LAYOUTS:
        _, views = layout_check.allocate(layout, shape, torch.bfloat16, "meta")
        paged = describe_kv_caches(
            views, num_blocks=shape.num_blocks, block_size=shape.block_size, num_kv_heads=shape.heads,
            head_size=shape.head_size, backend="TEST",
        )  # fmt: skip
        assert paged._elt == torch.int64, layout
        wide, byte = paged._wide_views[-1], paged._views[-1]
        ids = index_tensor([last_block], paged.device)
        assert ids.dtype == torch.int64
        offset = (wide.storage_offset() + int(ids[0]) * wide.stride(0)) * 8
        assert offset == byte.storage_offset() + last_block * byte.stride(0) > 2**32, layout
        out = torch.empty(paged.geometry(1).chunk_bytes, dtype=torch.uint8, device="meta")
        paged.gather([last_block], paged.chunk_view(out, 1))  # shapes and dtypes agree at this size


@pytest.mark.parametrize(
    ("content_bytes", "element"), [(16, torch.int64), (4, torch.int32), (2, torch.int16), (3, torch.uint8)]
)
def test_pages_are_copied_in_the_widest_element_their_bytes_allow(content_bytes: int, element: torch.dtype) -> None:
    # One token a block: a page is ``content_bytes`` long and so are the steps between pages.
    t = torch.arange(4 * content_bytes, dtype=torch.uint8).view(4, 1, 1, content_bytes)
    paged = describe_kv_caches(
        {"a": t, "b": t.clone()}, num_blocks=4, block_size=1, num_kv_heads=1, head_size=content_bytes,
        backend="TEST", latent=True,
    )  # fmt: skip
    assert paged._elt == element
    chunk = torch.empty(paged.geometry(2).chunk_bytes, dtype=torch.uint8)
    paged.gather([2, 1], paged.chunk_view(chunk, 2))
    paged.scatter(paged.chunk_view(chunk, 2), [(0, 0), (1, 3)])
    assert torch.equal(t[0], t[2]) and torch.equal(t[3], t[1])


def test_a_resharded_load_goes_through_the_load_stream_and_never_syncs_the_engines(
    monkeypatch: pytest.MonkeyPatch, pool
) -> None:
    """Chunks stored by the two ranks of a TP=2 engine, loaded by a TP=1 engine on a GPU: the joined heads are
    scattered by the load lane's copier (its stream, after the engine's event), not on the current stream with
    a stream synchronisation to follow (what ``PagedKV.finish_copies`` did)."""
    heads, bs, hd, blocks = 4, 32, 32, 16
    keys = {label: f"chunk-{label}".encode().ljust(16, b".")[:16] for label in ("0-2/4", "2-4/4")}

    def make(tp: int, rank: int) -> MaruWorker:
        extra = {"maru_pool_url": pool.url, "maru_kv_chunk_tokens": 2 * bs, "maru_kv_writer_tp": 2}
        return MaruWorker(
            fakes.vllm_config(block_size=bs, tp=tp, kv_heads=heads),
            fakes.kv_cache_config(block_size=bs, heads=heads // tp, head_size=hd, num_blocks=blocks),
            MaruConnectorConfig.from_extra_config(extra), loads=True, saves=True, tp_rank=rank,
        )  # fmt: skip

    full = [torch.randn(blocks, heads, bs, 2 * hd) for _ in range(2)]
    for rank in range(2):
        writer = make(2, rank)
        writer.register_kv_caches({f"layer{i}": kv[:, 2 * rank : 2 * rank + 2].clone() for i, kv in enumerate(full)})
        # Every rank's keys, in rank order (the scheduler half's plan): each rank stores under its own.
        chunk = ChunkSave(index=0, keys=tuple(keys.values()), parents=(None, None), block_ids=(2, 3))
        writer.save(MaruConnectorMetadata(saves={"r": SavePlan(chunks=(chunk,))}))
        writer.wait_idle()
        writer.finished(None)
        assert writer.report().saves == {("r", 0): "stored"}
        writer.shutdown()

    calls = fakecuda.install(monkeypatch)
    describe = worker_module.describe_kv_caches
    monkeypatch.setattr(worker_module, "describe_kv_caches", lambda *a, **kw: fakecuda.on_gpu(describe(*a, **kw)))
    reader = make(1, 0)
    caches = {f"layer{i}": torch.zeros(blocks, heads, bs, 2 * hd) for i in range(2)}
    reader.register_kv_caches(caches)
    assert not reader.heads.whole and reader._load_staging is not None
    calls.log.clear()
    plan = LoadPlan(load_id=1, chunks=(ChunkLoad(keys=tuple(keys.values()), slots=((0, 5), (1, 6))),))
    reader.load(MaruConnectorMetadata(loads={"r": plan}))
    reader.finished(None)
    assert reader.report().loads == {1: -1}
    for i, kv in enumerate(full):
        assert torch.equal(caches[f"layer{i}"][[5, 6]], kv[[2, 3]])
    lane_stream = reader._load_staging._stream.name
    (mark,) = [c for c in calls.of("record") if c[3] == "engine"]
    assert calls.index("wait_event", lane_stream, mark[2]) < calls.index("enter stream", lane_stream)
    assert not calls.of("stream synchronize"), calls.of("stream synchronize")
    reader.shutdown()


def test_the_gpu_checks_round_trip_takes_the_workers_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """``layout_check --device cuda`` proves the worker's path, so it must take it: the fence on the engine's
    thread, then on a lane thread the device, the fence's wait, the copier's stream; the load's stream waits for
    the engine's event."""
    calls = fakecuda.install(monkeypatch)
    src, src_views = gpu_cache()
    dst, dst_views = gpu_cache()
    for view in dst_views.values():
        view.zero_()
    saver, loader = StagedCopier(src, 3), StagedCopier(dst, 3)
    calls.log.clear()
    ready = src.fence()
    layout_check.round_trip(saver, loader, [7, 5, 3], {0: 10, 2: 2}, ready)
    (fence_record, mark_record) = [c for c in calls.of("record") if c[3] == "engine"]
    assert fence_record[0] == mark_record[0] == threading.current_thread().name
    lane = [c[1:] for c in calls.log if c[0] == "maru-check-lane"]
    fence = fence_record[2]
    assert lane[0] == ("set_device", fakecuda.DEVICE), lane
    assert lane.index(("event synchronize", fence, True)) < lane.index(("enter stream", saver._stream.name))
    waited = lane.index(("wait_event", loader._stream.name, mark_record[2]))
    assert waited < lane.index(("enter stream", loader._stream.name))
    for a, b in zip(src_views.values(), dst_views.values(), strict=True):
        assert torch.equal(b[10], a[7]) and torch.equal(b[2], a[3]) and not b[5].any()
