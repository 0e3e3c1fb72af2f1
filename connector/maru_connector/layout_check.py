"""Self-check of the connector's KV copy path on this machine: ``python -m maru_connector.layout_check``.

Needs only ``torch`` (vLLM does not have to be installed), so it runs on any GPU node in about a
minute::

    python -m maru_connector.layout_check --device cuda     # every KVCacheLayout, fp16 and bf16
    python -m maru_connector.layout_check --device cpu      # the same code, as CI runs it

For every ``KVCacheLayout`` of vLLM 0.32 it allocates a KV cache the way vLLM's
``allocate_kv_cache`` does (one byte buffer, one strided ``[blocks, heads, tokens, 2*head_size]``
view per layer), writes K and V through the GPU backends' reading of that view
(``kv.transpose(1, 2).split(head_size, -1)``), packs blocks into pinned host memory with
:class:`~maru_connector.layout.PagedKV` as the connector's saves do, unpacks them into other blocks
of a second cache as its loads do, and compares what the backend reads there, value by value.

One saved block holds a sentinel until a slow kernel, queued just before the save, has run; only
then are its real values written. A save that does not wait for the kernels computing its KV (a
copy on another stream, a non-blocking copy without a sync) packs the sentinel and fails. The
check proves it can tell: it also runs broken save paths (mutants) that must fail, a copy taken
before the kernel on every device and, on a GPU, a gather on a side stream that waits for nothing.
It prints one table row per case; exit status 0 when every round trip is exact and every mutant
is caught. The last rows round-trip an MLA latent cache (DeepSeek-V2/V3: one 576-wide latent per token and
layer, 64-token blocks) in every layout, bf16 on a GPU.

Then it measures the connector's staged copy path (``staging.StagedCopier``, what a GPU worker's
lanes run) for a cache of a Llama-3-8B rank on a GPU (32 layers, 8 KV heads of 128, bf16, 16-token
blocks, 256-token chunks of 32 MiB; a small cache on the CPU): saves (gather kernel, device-to-host
copy, copy and checksum into pool-like shared memory) and loads (verified copy out of it,
host-to-device copy, scatter kernel), and prints the GB/s of each, per rank. The numbers say how fast
this machine moves KV, nothing more: they are not checked against anything.
"""

from __future__ import annotations

import argparse
import mmap
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TextIO

import torch

from maru_connector.layout import PagedKV, describe_kv_caches
from maru_connector.staging import StagedCopier
from maru_pool.copyhash import copy_checksum

# vLLM 0.32's KVCacheLayout: the memory order of the logical dims [L, B, H, N, C], outermost first.
LAYOUTS: dict[str, tuple[int, int, int, int, int]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
# What the GPU attention backends are called in the chunk's format name for this check.
BACKEND = "FLASH_ATTN"


# What a block holds until the slow kernel has run: never an expected value (those are 0..254), and
# exact in every dtype checked, so a save that copied too early is told apart from any other bug.
SENTINEL = -7.0


class CheckFailed(AssertionError):
    """The bytes a backend would read after a save and a load differ from the ones saved.

    ``stale`` is True when they are the sentinel: the save copied a block before the kernel that
    computes it had run.
    """

    def __init__(self, message: str, *, stale: bool = False) -> None:
        super().__init__(message)
        self.stale = stale


@dataclass(frozen=True)
class CacheShape:
    num_layers: int = 3
    num_blocks: int = 12
    heads: int = 2
    block_size: int = 32
    head_size: int = 64
    # Tokens per kernel block when vLLM splits a block for the attention kernels (None: no split).
    kernel_block_size: int | None = None

    @property
    def ratio(self) -> int:
        return self.block_size // (self.kernel_block_size or self.block_size)


def _strides(order: tuple[int, ...], sizes: list[int]) -> list[int]:
    strides = [0] * len(sizes)
    step = 1
    for dim in reversed(order):
        strides[dim] = step
        step *= sizes[dim]
    return strides


def allocate(
    layout: str, shape: CacheShape, dtype: torch.dtype, device: torch.device | str
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A zeroed byte buffer and its per-layer ``[kernel blocks, H, kernel tokens, 2*D]`` views.

    Mirrors ``vllm.v1.worker.utils.allocate_kv_cache`` (0.32) for one group of full-attention layers
    with unpadded pages: byte strides in the layout's memory order; a block split into kernel blocks
    keeps its layer stride and divides its block stride.
    """
    order = LAYOUTS[layout]
    content = 2 * shape.head_size * torch.empty((), dtype=dtype).element_size()
    sizes = [shape.num_layers, shape.num_blocks, shape.heads, shape.block_size, content]
    layer_stride, block_stride = _strides(order, sizes)[:2]
    ratio = shape.ratio
    if ratio > 1 and block_stride != shape.heads * shape.block_size * content:
        raise ValueError(f"{layout} does not store blocks as dense pages; vLLM refuses to split them")
    kernel_sizes = [shape.num_layers, shape.num_blocks * ratio, shape.heads, shape.block_size // ratio, content]
    strides = _strides(order, kernel_sizes)
    strides[0], strides[1] = layer_stride, block_stride // ratio
    buf = torch.zeros(
        shape.num_layers * shape.num_blocks * shape.heads * shape.block_size * content, dtype=torch.int8, device=device
    )
    views = {
        f"model.layers.{layer}.self_attn.attn": torch.as_strided(
            buf, kernel_sizes[1:], strides[1:], layer * layer_stride
        ).view(dtype)
        for layer in range(shape.num_layers)
    }
    return buf, views


def block_kv(view: torch.Tensor, block: int, shape: CacheShape) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one block as the GPU backends read them: ``[N, H, D]`` each."""
    k, v = view.transpose(1, 2).split(shape.head_size, dim=-1)  # [kernel blocks, kernel tokens, H, D]
    picked = slice(block * shape.ratio, (block + 1) * shape.ratio)
    return k[picked].flatten(0, 1), v[picked].flatten(0, 1)


def expected_kv(layer: int, block: int, shape: CacheShape, dtype: torch.dtype, device) -> torch.Tensor:
    """Distinct values for every (K|V, token, head, dim) of one block of one layer: ``[2, N, H, D]``."""
    n = 2 * shape.block_size * shape.heads * shape.head_size
    # Small integers are exact in fp16 and bf16; the layer and block offsets make blocks differ.
    base = torch.arange(n, device=device, dtype=torch.float32) % 251
    return (
        (base + (layer * shape.num_blocks + block) % 5)
        .to(dtype)
        .view(2, shape.block_size, shape.heads, shape.head_size)
    )


def write_block(
    view: torch.Tensor, layer: int, block: int, shape: CacheShape, extra: torch.Tensor | None = None
) -> None:
    """Write a block's expected K and V through the backends' view (``extra`` is added on the device)."""
    want = expected_kv(layer, block, shape, view.dtype, view.device)
    if extra is not None:
        want = want + extra.to(view.dtype)
    k, v = view.transpose(1, 2).split(shape.head_size, dim=-1)
    per_kernel = shape.block_size // shape.ratio
    for kernel in range(shape.ratio):
        tokens = slice(kernel * per_kernel, (kernel + 1) * per_kernel)
        k[block * shape.ratio + kernel].copy_(want[0, tokens])
        v[block * shape.ratio + kernel].copy_(want[1, tokens])


def fill_block(view: torch.Tensor, block: int, shape: CacheShape, value: float) -> None:
    """Set every K and V value of one block to ``value`` (in place, kernel block by kernel block)."""
    k, v = view.transpose(1, 2).split(shape.head_size, dim=-1)
    for kernel in range(shape.ratio):
        k[block * shape.ratio + kernel].fill_(value)
        v[block * shape.ratio + kernel].fill_(value)


def slow_kernel(device: torch.device, size: int, rounds: int) -> torch.Tensor:
    """A 0-valued scalar that is only known once a long chain of kernels has run."""
    acc = torch.full((size, size), 1.0 / size, device=device)
    for _ in range(rounds):
        acc = torch.tanh(acc @ acc)
    return acc.sum() * 0


@dataclass
class Saved:
    """What one check stored: the source cache's description, the packed chunk, its block ids."""

    paged: PagedKV
    chunk: bytearray
    block_ids: list[int]


# ---------------------------------------------------------------- broken save paths the check must catch

# A mutant turns the source cache's PagedKV into a broken one; it is applied after the sentinel is
# written and before the slow kernel is queued.
Mutant = Callable[[PagedKV], PagedKV]


class _UnorderedGather(PagedKV):
    """Gathers on a fresh side stream that waits for nothing: the bug a GPU save path can have."""

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        side = torch.cuda.Stream(device=self.device)
        with torch.cuda.stream(side):
            super().gather(block_ids, out)
        # The host waits for its own copy, as a save would; the copy never waited for the kernels.
        side.synchronize()


def copy_before_kernel(paged: PagedKV) -> PagedKV:
    """A save that copies the blocks as they were before the slow kernel was queued.

    Stands in for a copy that runs out of order (on another stream, or asynchronously) on every
    device, the CPU included, where no copy can overtake a kernel.
    """
    frozen = [view.clone() for view in paged._views]
    return PagedKV(paged.format, paged.layer_names, frozen, paged.block_bytes, paged.num_blocks)


def gather_on_side_stream(paged: PagedKV) -> PagedKV:
    """A save whose gather runs on a side stream without waiting for the stream computing the KV."""
    return _UnorderedGather(paged.format, paged.layer_names, paged._views, paged.block_bytes, paged.num_blocks)


# Table column -> (mutant, the device types it can run on).
MUTANTS: dict[str, tuple[Mutant, tuple[str, ...]]] = {
    "copy before kernel": (copy_before_kernel, ("cpu", "cuda")),
    "side-stream gather": (gather_on_side_stream, ("cuda",)),
}


def check_layout(
    layout: str,
    shape: CacheShape,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    slow: tuple[int, int] = (64, 4),
    allocator: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]] = allocate,
    mutant: Mutant | None = None,
) -> Saved:
    """Save blocks of one cache and load them into other blocks of another; raise :class:`CheckFailed`.

    ``allocator(layout, shape, dtype, device)`` makes each cache (tests pass vLLM's own);
    ``mutant`` breaks the save path on purpose (see :data:`MUTANTS`).
    """
    device = torch.device(device)
    _, src_views = allocator(layout, shape, dtype, device)
    saved = [7, 3]  # not in memory order: a chunk follows the request's block table
    # The last block's KV comes out of a slow kernel queued just before the save; until then the
    # block holds the sentinel, so only a copy ordered after that kernel sees its real values.
    late = saved[-1]
    for layer, view in enumerate(src_views.values()):
        for b in range(shape.num_blocks):
            if b == late:
                fill_block(view, b, shape, SENTINEL)
            else:
                write_block(view, layer, b, shape)
    describe = dict(
        num_blocks=shape.num_blocks,
        block_size=shape.block_size,
        num_kv_heads=shape.heads,
        head_size=shape.head_size,
        backend=BACKEND,
    )
    src = describe_kv_caches(src_views, **describe)
    if mutant is not None:
        src = mutant(src)
    if device.type == "cuda":
        # The sentinel is in memory before the kernel is queued: an early copy reads exactly it.
        torch.cuda.synchronize(device)
    zero = slow_kernel(device, *slow)
    for layer, view in enumerate(src_views.values()):
        write_block(view, layer, late, shape, extra=zero)
    per_chunk = 2
    # Pinned host memory on a GPU, as MaruWorker's staging buffer: the copy a save really makes.
    chunk_bytes = src.geometry(per_chunk).chunk_bytes
    staging = torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    src.gather(saved, src.chunk_view(staging, per_chunk))
    pool_chunk = bytearray(staging.numpy().tobytes())  # stands in for the pool mapping (lease.fill)

    _, dst_views = allocator(layout, shape, dtype, device)
    dst = describe_kv_caches(dst_views, **describe)
    landing = {0: 10, 1: 2}
    # A load copies the pool's bytes into the staging buffer, then scatters from it (MaruWorker).
    staging.copy_(torch.frombuffer(bytearray(pool_chunk), dtype=torch.uint8))
    dst.scatter(dst.chunk_view(staging, per_chunk), sorted(landing.items()))
    for layer, view in enumerate(dst_views.values()):
        for slot, b in landing.items():
            want = expected_kv(layer, saved[slot], shape, dtype, device)
            k, v = block_kv(view, b, shape)
            for name, got, exp in (("K", k, want[0]), ("V", v, want[1])):
                if not torch.equal(got, exp):
                    bad = (got != exp).nonzero()[0].tolist()
                    stale = bool((got == SENTINEL).any())
                    why = (
                        " (the sentinel: the save copied this block before the kernel computing it had run)"
                        if stale
                        else ""
                    )
                    raise CheckFailed(
                        f"{layout} {dtype} on {device}: layer {layer} block {saved[slot]} -> {b}: {name} differs "
                        f"first at [token, head, dim] {bad}: {got[tuple(bad)].item()} != {exp[tuple(bad)].item()}"
                        + why,
                        stale=stale,
                    )
        untouched = [b for b in range(shape.num_blocks) if b not in landing.values()]
        if any(t.any() for b in untouched for t in block_kv(view, b, shape)):
            raise CheckFailed(f"{layout} {dtype} on {device}: layer {layer}: a load wrote outside its blocks")
    return Saved(src, pool_chunk, saved)


def cases(device: torch.device) -> Iterator[tuple[str, CacheShape, torch.dtype]]:
    dtypes = [torch.float16, torch.bfloat16] if device.type == "cuda" else [torch.float32, torch.float16]
    for dtype in dtypes:
        for layout in LAYOUTS:
            yield layout, CacheShape(), dtype
        # Only layer-outer dense layouts let vLLM split a block into kernel blocks.
        for layout in ("LBHNC", "LBNHC"):
            yield layout, CacheShape(block_size=64, kernel_block_size=16), dtype


# An MLA latent cache (DeepSeek-V2/V3: 512 compressed KV + 64 rope key per token and layer, one "head") has
# the bytes of a one-head K/V cache of head size 288, so ``allocate`` makes it; 64-token blocks as FlashMLA's.
LATENT_WIDTH = 576
LATENT_SHAPE = CacheShape(num_layers=3, num_blocks=12, heads=1, block_size=64, head_size=LATENT_WIDTH // 2)


def latent_cases(device: torch.device) -> Iterator[tuple[str, torch.dtype]]:
    for dtype in [torch.bfloat16] if device.type == "cuda" else [torch.float32]:
        for layout in LAYOUTS:
            yield layout, dtype


def check_latent(layout: str, dtype: torch.dtype, device: torch.device | str) -> PagedKV:
    """Save two blocks of an MLA latent cache through pinned host memory, load them into other blocks of
    another; each token's latent must arrive exact. Raises :class:`CheckFailed`."""
    device = torch.device(device)
    shape = LATENT_SHAPE
    describe = dict(
        num_blocks=shape.num_blocks, block_size=shape.block_size, num_kv_heads=1, head_size=LATENT_WIDTH,
        backend=BACKEND, latent=True,
    )  # fmt: skip
    _, src_views = allocate(layout, shape, dtype, device)
    for layer, view in enumerate(src_views.values()):
        values = torch.arange(view.numel(), device=device, dtype=torch.float32) % 251 + 1000 * layer
        view.copy_(values.view(view.shape).to(dtype))
    src = describe_kv_caches(src_views, **describe)
    staging = torch.empty(src.geometry(2).chunk_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    src.gather([7, 3], src.chunk_view(staging, 2))
    _, dst_views = allocate(layout, shape, dtype, device)
    dst = describe_kv_caches(dst_views, **describe)
    dst.scatter(dst.chunk_view(staging, 2), [(0, 10), (1, 2)])
    for (name, want), got in zip(src_views.items(), dst_views.values(), strict=True):
        for saved, landed in ((7, 10), (3, 2)):
            if not torch.equal(got[landed], want[saved]):
                raise CheckFailed(
                    f"MLA latent {layout} {dtype} on {device}: block {saved} of {name} changed on its way"
                )
    return src


def run(
    device: torch.device | str,
    *,
    slow: tuple[int, int] = (64, 4),
    mutants: dict[str, tuple[Mutant, tuple[str, ...]]] | None = None,
    out: TextIO = sys.stdout,
) -> int:
    """Every case on ``device``, as a table; returns the number of failed cells (each one explained).

    A round trip passes when every value arrives exact; a mutant's cell passes when the check
    failed it for having copied the sentinel, and reads ``-`` where it cannot run on this device.
    """
    device = torch.device(device)
    mutants = MUTANTS if mutants is None else mutants
    columns = ["layout", "dtype", "block", "format", "round trip", *mutants]
    rows: list[list[str]] = []
    details: list[str] = []
    for layout, shape, dtype in cases(device):
        name = str(dtype).removeprefix("torch.")
        split = f" = {shape.ratio}x{shape.kernel_block_size}" if shape.kernel_block_size else ""
        block = f"{shape.block_size}{split}"
        try:
            fmt = check_layout(layout, shape, dtype, device, slow=slow).paged.format
            cells = [fmt, "PASS"]
        except CheckFailed as err:
            cells = ["?", "FAIL"]
            details.append(f"FAIL round trip: {err}")
        for column, (mutant, devices) in mutants.items():
            if device.type not in devices:
                cells.append("-")
                continue
            try:
                check_layout(layout, shape, dtype, device, slow=slow, mutant=mutant)
            except CheckFailed as err:
                if err.stale:
                    cells.append("PASS")
                    continue
                details.append(f"FAIL {column}: {layout} {name} failed, but not for copying early: {err}")
            else:
                details.append(
                    f"FAIL {column}: {layout} {name}: the check passed a save that does not wait for the "
                    "kernel computing its KV; it cannot vouch for the ordering on this machine"
                )
            cells.append("FAIL")
        rows.append([layout, name, block, *cells])
    for layout, dtype in latent_cases(device):
        name = str(dtype).removeprefix("torch.")
        try:
            cells = [check_latent(layout, dtype, device).format, "PASS"]
        except CheckFailed as err:
            cells = ["?", "FAIL"]
            details.append(f"FAIL round trip: {err}")
        # The copy code and its ordering are the K/V cases'; only the page shape differs here.
        rows.append([layout, name, str(LATENT_SHAPE.block_size), *cells, *["-"] * len(mutants)])
    widths = [max(len(str(r[i])) for r in [columns, *rows]) for i in range(len(columns))]
    for row in [columns, *rows]:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip(), file=out)
    for line in details:
        print(line, file=out)
    failures = sum(row.count("FAIL") for row in rows)
    if failures:
        print(f"FAIL: {failures} check(s) failed on {device}", file=out)
    else:
        print(f"PASS: {len(rows)} cases on {device}, every round trip exact, every broken save caught", file=out)
    return failures


# ---------------------------------------------------------------- throughput of the staged copy path

# One TP rank of Llama-3-8B (bf16, 16-token blocks, 256-token chunks: 32 MiB a chunk) on a GPU; a small
# cache on the CPU, where the number only shows the path runs.
GPU_BENCH = CacheShape(num_layers=32, num_blocks=512, heads=8, block_size=16, head_size=128)
CPU_BENCH = CacheShape(num_layers=4, num_blocks=256, heads=2, block_size=16, head_size=64)
BENCH_LAYOUTS = ("LBHNC", "LBNHC")


@dataclass(frozen=True)
class Throughput:
    layout: str
    dtype: str
    chunk_bytes: int
    chunks: int
    save_gbps: float
    load_gbps: float


def measure(
    layout: str, shape: CacheShape, dtype: torch.dtype, device: torch.device | str, *, chunks: int = 8
) -> Throughput:
    """Save ``chunks`` chunks through :class:`StagedCopier` into pool-like memory and load them back.

    Each chunk's blocks go to other blocks of the same cache, which are then compared with the
    originals, so a fast but wrong path fails (:class:`CheckFailed`) instead of printing a number.
    """
    device = torch.device(device)
    per_chunk = 256 // shape.block_size if shape.block_size <= 256 else 1
    if 2 * chunks * per_chunk > shape.num_blocks:
        raise ValueError(f"{shape.num_blocks} blocks cannot hold {chunks} chunks of {per_chunk} blocks twice")
    _, views = allocate(layout, shape, dtype, device)
    for view in views.values():
        view.copy_(torch.rand(view.shape, device=device).to(dtype))
    paged = describe_kv_caches(
        views, num_blocks=shape.num_blocks, block_size=shape.block_size, num_kv_heads=shape.heads,
        head_size=shape.head_size, backend=BACKEND,
    )  # fmt: skip
    copier = StagedCopier(paged, per_chunk)
    size = copier.chunk_bytes
    pool = mmap.mmap(-1, size * chunks)  # shared memory, as the pool's mapping
    slots = [memoryview(pool)[c * size : (c + 1) * size] for c in range(chunks)]
    sources = [list(range(c * per_chunk, (c + 1) * per_chunk)) for c in range(chunks)]
    targets = [[b + chunks * per_chunk for b in blocks] for blocks in sources]
    sums: list[int] = [0] * chunks

    def save() -> None:
        for c, host in enumerate(copier.gathered(sources)):
            sums[c] = copy_checksum(slots[c], memoryview(host), to_pool=True)

    def load() -> None:
        for c in range(chunks):
            copier.scatter(lambda host, c=c: _read_verified(host, slots[c], sums[c]), list(enumerate(targets[c])))
        copier.finish()

    save_s, load_s = _timed(save, device), _timed(load, device)
    for src, dst in zip(sources, targets, strict=True):
        for view in paged._views:
            if not torch.equal(view[dst], view[src]):
                raise CheckFailed(f"{layout} {dtype} on {device}: the measured round trip changed blocks {src}")
    for view in slots:
        view.release()
    pool.close()
    total = size * chunks
    name = str(dtype).removeprefix("torch.")
    return Throughput(layout, name, size, chunks, total / save_s / 1e9, total / load_s / 1e9)


def _read_verified(host: object, slot: memoryview, want: int) -> None:
    got = copy_checksum(memoryview(host), slot, to_pool=False)  # type: ignore[arg-type]
    if got != want:
        raise CheckFailed(f"the pool copy of a chunk changed: checksum {got:#x} != {want:#x}")


def _timed(step: Callable[[], None], device: torch.device) -> float:
    """Seconds of the faster of two runs of ``step``, after one run that warms buffers and kernels up."""
    best = float("inf")
    for attempt in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if attempt:
            best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def report_throughput(device: torch.device | str, *, shape: CacheShape | None = None, out: TextIO = sys.stdout) -> int:
    """Measure and print the staged path's GB/s for save and load; returns the number of failed layouts."""
    device = torch.device(device)
    shape = shape or (GPU_BENCH if device.type == "cuda" else CPU_BENCH)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    failures = 0
    for layout in BENCH_LAYOUTS:
        try:
            t = measure(layout, shape, dtype, device)
        except CheckFailed as err:
            print(f"FAIL throughput {layout}: {err}", file=out)
            failures += 1
            continue
        print(
            f"throughput {t.layout} {t.dtype} on {device}: save {t.save_gbps:.3g} GB/s, load {t.load_gbps:.3g} GB/s "
            f"({t.chunks} chunks of {t.chunk_bytes / (1 << 20):.2f} MiB, {shape.num_layers} layers, per rank)",
            file=out,
        )
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-throughput", action="store_true", help="skip the save/load GB/s measurement")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    # On a GPU the slow kernel takes tens of milliseconds, far longer than a save's copy.
    slow = (4096, 40) if device.type == "cuda" else (64, 4)
    failed = run(device, slow=slow)
    if not args.no_throughput:
        failed += report_throughput(device)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
