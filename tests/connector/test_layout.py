"""The packed chunk layout, checked by a reader written here from the documented byte order.

A plain round trip (gather, then scatter) would pass with any self-consistent convention, even a
wrong one shared by writer and reader; so every packed buffer is also decoded by hand below, by
byte offset, and the mutation tests show that this check fails when the layout is broken.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from maru_connector.layout import KVLayoutError, PagedKV, describe_kv_caches

BS, H, D = 4, 2, 8  # tokens per block, KV heads, head size (small, so exhaustive checks are cheap)
NUM_BLOCKS, LAYERS, PER_CHUNK = 10, 3, 2


def value(layer: int, block: int, head: int, kv: int, tok: int, dim: int) -> float:
    """A distinct float32-exact value for every logical KV element."""
    return float((((layer * NUM_BLOCKS + block) * H + head) * 2 + kv) * BS * D + tok * D + dim)


def make_cache(layout: str, fill: bool = True) -> tuple[torch.Tensor, callable]:
    """A per-layer tensor in the backend's layout and a logical accessor ``at(t, b, h, kv, n, d)``."""
    if layout == "cpu":
        t = torch.zeros(NUM_BLOCKS, H, BS, 2 * D)

        def at(t: torch.Tensor, b: int, h: int, kv: int, n: int, d: int) -> torch.Tensor:
            # cpu_attn views the block as [H, 2*BS, D]: per head, BS rows of K then BS rows of V.
            return t.view(NUM_BLOCKS, H, 2 * BS, D)[b, h, kv * BS + n, d]
    elif layout in ("kv-first-nhd", "kv-first-hnd"):
        if layout.endswith("nhd"):
            t = torch.zeros(2, NUM_BLOCKS, BS, H, D)
        else:
            t = torch.zeros(2, NUM_BLOCKS, H, BS, D).permute(0, 1, 3, 2, 4)

        def at(t: torch.Tensor, b: int, h: int, kv: int, n: int, d: int) -> torch.Tensor:
            return t[kv, b, n, h, d]
    elif layout in ("block-first-nhd", "block-first-hnd"):
        if layout.endswith("nhd"):
            t = torch.zeros(NUM_BLOCKS, 2, BS, H, D)
        else:
            t = torch.zeros(NUM_BLOCKS, 2, H, BS, D).permute(0, 1, 3, 2, 4)

        def at(t: torch.Tensor, b: int, h: int, kv: int, n: int, d: int) -> torch.Tensor:
            return t[b, kv, n, h, d]
    else:
        raise AssertionError(layout)
    return t, at


def make_layers(layout: str, fill: bool) -> tuple[dict[str, torch.Tensor], callable]:
    layers = {}
    for layer in range(LAYERS):
        t, at = make_cache(layout)
        if fill:
            for b, h, kv, n, d in itertools.product(range(NUM_BLOCKS), range(H), range(2), range(BS), range(D)):
                at(t, b, h, kv, n, d).fill_(value(layer, b, h, kv, n, d))
        layers[f"model.layers.{layer}.self_attn.attn"] = t
    return layers, at


def packed_offset(layout: str, layer: int, j: int, h: int, kv: int, n: int, d: int) -> int:
    """Element offset in a packed chunk, straight from the table in layout.py's docstring."""
    block = ((layer * PER_CHUNK) + j) * (2 * BS * H * D)
    if layout == "cpu":
        return block + ((h * 2 + kv) * BS + n) * D + d
    if layout.endswith("nhd"):
        return block + ((kv * BS + n) * H + h) * D + d
    return block + ((kv * H + h) * BS + n) * D + d


def check_packed(layout: str, buf: bytearray, block_ids: list[int]) -> None:
    """The independent reader: every element of the chunk sits at its documented byte offset."""
    arr = np.frombuffer(bytes(buf), dtype=np.float32)
    assert arr.size == LAYERS * PER_CHUNK * 2 * BS * H * D
    for layer, (j, b), h, kv, n, d in itertools.product(
        range(LAYERS), enumerate(block_ids), range(H), range(2), range(BS), range(D)
    ):
        got = arr[packed_offset(layout, layer, j, h, kv, n, d)]
        want = value(layer, b, h, kv, n, d)
        assert got == want, f"{layout}: layer {layer} block {b} head {h} kv {kv} token {n} dim {d}: {got} != {want}"


def gather(paged: PagedKV, block_ids: list[int]) -> bytearray:
    buf = bytearray(paged.geometry(PER_CHUNK).chunk_bytes)
    paged.gather(block_ids, paged.chunk_view(memoryview(buf), PER_CHUNK))
    return buf


def describe(layers: dict[str, torch.Tensor]) -> PagedKV:
    return describe_kv_caches(layers, block_size=BS, num_kv_heads=H, head_size=D)


LAYOUTS = ["cpu", "kv-first-nhd", "kv-first-hnd", "block-first-nhd", "block-first-hnd"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_is_recognised(layout: str) -> None:
    layers, _ = make_layers(layout, fill=False)
    paged = describe(layers)
    assert paged.name == layout
    assert paged.block_bytes == 2 * BS * H * D * 4
    assert paged.num_layers == LAYERS


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_matches_independent_reader(layout: str) -> None:
    layers, _ = make_layers(layout, fill=True)
    block_ids = [7, 3]  # not in order: the chunk follows the request's block table, not memory
    check_packed(layout, gather(describe(layers), block_ids), block_ids)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_into_other_blocks(layout: str) -> None:
    src_layers, at = make_layers(layout, fill=True)
    buf = gather(describe(src_layers), [7, 3])
    dst_layers, _ = make_layers(layout, fill=False)
    dst = describe(dst_layers)
    # Load only the second block of the chunk (the first is a local prefix-cache hit) into block 5.
    dst.scatter(dst.chunk_view(memoryview(buf), PER_CHUNK), [(1, 5)])
    for layer, (name, t) in enumerate(dst_layers.items()):
        src_t = src_layers[name]
        for h, kv, n, d in itertools.product(range(H), range(2), range(BS), range(D)):
            assert at(t, 5, h, kv, n, d) == at(src_t, 3, h, kv, n, d)
        touched = [b for b in range(NUM_BLOCKS) if b != 5]
        for b in touched:
            assert all(float(at(t, b, h, 0, 0, 0)) == 0.0 for h in range(H)), f"layer {layer} block {b} overwritten"


def test_read_only_pool_buffers_can_be_scattered() -> None:
    layers, _ = make_layers("cpu", fill=True)
    paged = describe(layers)
    ro = memoryview(bytes(gather(paged, [1, 2])))  # pins hand out read-only views
    dst_layers, _ = make_layers("cpu", fill=False)
    dst = describe(dst_layers)
    dst.scatter(dst.chunk_view(ro, PER_CHUNK), [(0, 4), (1, 6)])
    name = next(iter(layers))
    assert torch.equal(dst_layers[name][4], layers[name][1])
    assert torch.equal(dst_layers[name][6], layers[name][2])


# ---------------------------------------------------------------- mutation checks


class ReversedBlocks(PagedKV):
    """Broken on purpose: packs the chunk's blocks in reverse, and unpacks them the same way."""

    def gather(self, block_ids, out):
        super().gather(list(reversed(block_ids)), out)

    def scatter(self, src, slots):
        super().scatter(src, [(PER_CHUNK - 1 - j, d) for j, d in slots])


class SwappedLayers(PagedKV):
    """Broken on purpose: writes the layers in reverse order."""

    def __init__(self, inner: PagedKV) -> None:
        super().__init__(
            inner.name,
            inner.layer_names,
            list(reversed(inner._views)),
            inner._kv_first,
            inner.block_bytes,
            inner.num_blocks,
        )


class SwappedKV(PagedKV):
    """Broken on purpose: packs V before K (kv-first layouts)."""

    def gather(self, block_ids, out):
        super().gather(block_ids, out)
        halves = out.view(out.shape[0], out.shape[1], 2, -1)
        halves[:] = halves.flip(2).clone()


def rebuild(cls: type[PagedKV], paged: PagedKV) -> PagedKV:
    if cls is SwappedLayers:
        return SwappedLayers(paged)
    return cls(paged.name, paged.layer_names, paged._views, paged._kv_first, paged.block_bytes, paged.num_blocks)


@pytest.mark.parametrize(
    ("layout", "mutant"),
    [("cpu", ReversedBlocks), ("cpu", SwappedLayers), ("kv-first-nhd", SwappedKV), ("block-first-hnd", ReversedBlocks)],
)
def test_reader_catches_a_broken_layout(layout: str, mutant: type[PagedKV]) -> None:
    layers, _ = make_layers(layout, fill=True)
    broken = rebuild(mutant, describe(layers))
    with pytest.raises(AssertionError):
        check_packed(layout, gather(broken, [7, 3]), [7, 3])


def test_plain_round_trip_alone_would_miss_a_shared_wrong_convention() -> None:
    # Why the reader exists: the reversed convention round-trips perfectly.
    layers, _ = make_layers("cpu", fill=True)
    broken = rebuild(ReversedBlocks, describe(layers))
    buf = gather(broken, [7, 3])
    dst_layers, _ = make_layers("cpu", fill=False)
    dst = rebuild(ReversedBlocks, describe(dst_layers))
    dst.scatter(dst.chunk_view(memoryview(buf), PER_CHUNK), [(0, 1), (1, 2)])
    name = next(iter(layers))
    assert torch.equal(dst_layers[name][1], layers[name][7])
    assert torch.equal(dst_layers[name][2], layers[name][3])
    with pytest.raises(AssertionError):
        check_packed("cpu", buf, [7, 3])


# ---------------------------------------------------------------- rejection at start


@pytest.mark.parametrize(
    ("tensor", "why"),
    [
        (torch.zeros(NUM_BLOCKS, BS, 2 * D), "MLA"),  # 3-D
        (torch.zeros(NUM_BLOCKS, H + 1, BS, 2 * D), "CPU backend"),  # wrong head count
        (torch.zeros(NUM_BLOCKS, H, BS, 4 * D)[..., : 2 * D], "CPU backend"),  # not contiguous
        (torch.zeros(3, NUM_BLOCKS, BS, H, D), "FlashAttention"),
        (torch.zeros(2, NUM_BLOCKS, BS, H, D * 2)[..., :D], "dense"),  # padded rows
        (torch.zeros(2, NUM_BLOCKS, D, H, BS).permute(0, 1, 4, 3, 2), "FlashAttention"),  # head dim not innermost
    ],
)
def test_unknown_layouts_are_rejected_with_a_clear_error(tensor: torch.Tensor, why: str) -> None:
    with pytest.raises(KVLayoutError, match=why):
        describe({"layer0": tensor})


def test_mixed_layers_are_rejected() -> None:
    with pytest.raises(KVLayoutError, match="mixed"):
        describe({"a": torch.zeros(NUM_BLOCKS, H, BS, 2 * D), "b": torch.zeros(NUM_BLOCKS + 1, H, BS, 2 * D)})


def test_wrong_buffer_size_is_refused() -> None:
    paged = describe(make_layers("cpu", fill=False)[0])
    with pytest.raises(ValueError, match="bytes"):
        paged.chunk_view(memoryview(bytearray(10)), PER_CHUNK)
