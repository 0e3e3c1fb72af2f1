"""The staged copy path (GPU caches, split pages): the same code on the CPU, where CI can run it.

What only a GPU shows (streams, events, pinned copies, GB/s) is measured by
``python -m maru_connector.layout_check --device cuda``; here the same calls run on the CPU and are
checked for the bytes they move, the order of chunks and the kernels they launch per chunk.
"""

from __future__ import annotations

import io
import re

import pytest
import torch

from maru_connector import layout_check
from maru_connector.layout import PagedKV, _all_layers_view, describe_kv_caches
from maru_connector.layout_check import CacheShape
from maru_connector.staging import StagedCopier

SHAPE = CacheShape(num_layers=3, num_blocks=16, heads=2, block_size=16, head_size=32)
PER_CHUNK = 2


def cache(layout: str, shape: CacheShape = SHAPE) -> PagedKV:
    _, views = layout_check.allocate(layout, shape, torch.float32, "cpu")
    for i, view in enumerate(views.values()):
        view.copy_(torch.arange(view.numel(), dtype=torch.float32).view(view.shape) + 1000 * i)
    return describe_kv_caches(
        views, num_blocks=shape.num_blocks, block_size=shape.block_size, num_kv_heads=shape.heads,
        head_size=shape.head_size, backend="TEST",
    )  # fmt: skip


def packed(paged: PagedKV, block_ids: list[int]) -> bytes:
    out = torch.empty(paged.geometry(len(block_ids)).chunk_bytes, dtype=torch.uint8)
    paged.gather(block_ids, paged.chunk_view(out, len(block_ids)))
    return out.numpy().tobytes()


@pytest.mark.parametrize("layout", list(layout_check.LAYOUTS))
def test_gathered_chunks_come_in_order_each_valid_until_the_next(layout: str) -> None:
    paged = cache(layout)
    copier = StagedCopier(paged, PER_CHUNK)
    chunks = [[7, 3], [0, 1], [15, 8], [2, 2], [9, 4]]
    got = []
    for host in copier.gathered(chunks):
        got.append(host.tobytes())  # the caller's pool copy happens here, before the next chunk
    assert got == [packed(paged, ids) for ids in chunks]


@pytest.mark.parametrize("layout", list(layout_check.LAYOUTS))
def test_scatter_lands_the_filled_bytes_and_a_failed_fill_lands_nothing(layout: str) -> None:
    src, dst = cache(layout), cache(layout)
    for view in dst._views:
        view.zero_()
    copier = StagedCopier(dst, PER_CHUNK)
    chunk = packed(src, [5, 6])

    def fill(host) -> None:
        host[:] = memoryview(chunk)

    copier.scatter(fill, [(0, 10), (1, 11)])
    copier.scatter(fill, [(1, 12)])  # a part of a chunk: block 0 of it is not wanted

    def corrupt(host) -> None:
        raise ValueError("checksum mismatch")

    with pytest.raises(ValueError):
        copier.scatter(corrupt, [(0, 13)])
    copier.finish()
    for s, d in zip(src._views, dst._views, strict=True):
        assert torch.equal(d[10], s[5]) and torch.equal(d[11], s[6]) and torch.equal(d[12], s[6])
        assert not d[13].any() and not d[9].any()


@pytest.mark.parametrize("layout", list(layout_check.LAYOUTS))
def test_every_layer_as_one_view_gathers_and_scatters_in_one_kernel_each(layout: str) -> None:
    """The view GPU caches use (one kernel per chunk, not one per layer), forced onto the CPU cache."""
    paged = cache(layout)
    per_layer = packed(paged, [7, 3])
    stacked = _all_layers_view(paged._views)
    assert stacked is not None  # vLLM's one buffer spaces the layers evenly in every layout
    for layer, view in enumerate(paged._views):
        assert stacked[layer].data_ptr() == view.data_ptr() and stacked[layer].stride() == view.stride()
    paged._all = stacked
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert packed(paged, [7, 3]) == per_layer
    assert sum(e.count for e in prof.key_averages() if e.key == "aten::index_select") == 1

    chunk = torch.frombuffer(bytearray(per_layer), dtype=torch.uint8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        paged.scatter(paged.chunk_view(chunk, 2), [(0, 12), (1, 13)])
    assert sum(e.count for e in prof.key_averages() if e.key == "aten::index_copy_") == 1
    assert packed(paged, [12, 13]) == per_layer


def test_layers_that_are_not_one_buffer_keep_the_per_layer_path() -> None:
    paged = cache("LBHNC")
    cloned = [view.clone() for view in paged._views]
    assert _all_layers_view(cloned) is None


def test_layout_check_reports_save_and_load_throughput() -> None:
    """The line a GPU node prints (``--device cuda``), here on the CPU: its shape, never its speed."""
    out = io.StringIO()
    small = CacheShape(num_layers=2, num_blocks=256, heads=2, block_size=16, head_size=32)
    failures, results = layout_check.report_throughput("cpu", shape=small, out=out)
    assert failures == 0
    lines = out.getvalue().splitlines()
    assert len(lines) == len(results) == len(layout_check.BENCH_LAYOUTS)
    for line, layout in zip(lines, layout_check.BENCH_LAYOUTS, strict=True):
        match = re.fullmatch(
            rf"throughput {layout} float32 on cpu: save [\d.e+-]+ GB/s \([\d.]+x limit\), "
            r"load [\d.e+-]+ GB/s \([\d.]+x limit\); host copy\+checksum [\d.e+-]+ GB/s "
            r"\(8 chunks of [\d.]+ MiB, 2 layers, [\d.]+ GiB cache, per rank\)",
            line,
        )
        assert match, line
    # Beside each: the limit measured on the same bytes (the host copy+checksum; pinned copies on a GPU).
    assert all(t.host_gbps > 0 and t.save_limit == t.host_gbps and t.d2h_gbps == 0 for t in results)


def test_the_summary_line_judges_the_worst_ratio_of_2_mib_chunks_and_the_step_cost() -> None:
    """The GPU run's last line, from measured numbers: each direction against the slower of its pinned copy
    and the host copy+checksum; chunks under 2 MiB do not count against the target."""
    big = layout_check.Throughput(
        "LBHNC", "bfloat16", 32 << 20, 8, 20.0, 18.0, d2h_gbps=25.0, h2d_gbps=24.0, host_gbps=30.0
    )
    small = layout_check.Throughput(
        "LBHNC", "bfloat16", 1 << 20, 64, 1.0, 1.0, d2h_gbps=25.0, h2d_gbps=24.0, host_gbps=30.0
    )
    assert (big.save_limit, big.load_limit) == (25.0, 24.0)
    line = layout_check.summary(torch.device("cuda", 0), 0, [big, small], 0.01, "PASS")
    assert line == (
        "SUMMARY cuda:0: cases PASS; save 0.80x, load 0.75x limit (worst, >= 0.8x wanted: BELOW TARGET); "
        "step cost +1.0% (<= 2% wanted: PASS); contexts PASS"
    )
    fast = layout_check.Throughput(
        "LBNHC", "bfloat16", 2 << 20, 64, 22.0, 22.0, d2h_gbps=25.0, h2d_gbps=24.0, host_gbps=21.0
    )
    line = layout_check.summary(torch.device("cuda", 0), 2, [fast], 0.05, "FAIL")
    assert line == (
        "SUMMARY cuda:0: cases FAIL (2); save 1.05x, load 1.05x limit (worst, >= 0.8x wanted: PASS); "
        "step cost +5.0% (<= 2% wanted: BELOW TARGET); contexts FAIL"
    )
