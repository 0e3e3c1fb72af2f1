"""Self-check of the connector's KV copy path on this machine: ``python -m maru_connector.layout_check``.

Needs only ``torch`` (vLLM does not have to be installed), so it runs on any GPU node, in a few
minutes (under ten on an 8-GPU node)::

    python -m maru_connector.layout_check --device cuda     # every KVCacheLayout, fp16, bf16 and fp8
    python -m maru_connector.layout_check --device cpu      # the same code, as CI runs it

**Correctness.** For every ``KVCacheLayout`` of vLLM 0.32 and fp16, bf16 and fp8 (float32, float16 and
fp8 on the CPU), with whole and split (kernel) blocks, it allocates a KV cache the way vLLM's
``allocate_kv_cache`` does (one byte buffer, one strided ``[blocks, heads, tokens, 2*head_size]`` view
per layer), writes K and V through the GPU backends' reading of that view
(``kv.transpose(1, 2).split(head_size, -1)``), saves a chunk of three blocks and loads two of them
(part of the chunk) into other blocks of a second cache, and compares what the backend reads there,
value by value. The save and the load take the worker's path (:func:`round_trip`): ``PagedKV.fence`` on
the engine's thread, then on a lane thread (device set first) ``StagedCopier``'s gather, pinned copy and
events on its own stream; the load waits for an event on the engine's stream.

One saved block holds a sentinel until a slow kernel, queued just before the save, has run; only
then are its real values written. A save that does not wait for the kernels computing its KV packs
the sentinel and fails. The check proves it can tell: it also runs broken save paths (mutants) that
must fail, a copy taken before the kernel on every device and, on a GPU, a save whose fence waits
for nothing. It prints one table row per case; the last rows round-trip an MLA latent cache
(DeepSeek-V2/V3: one 576-wide latent per token and layer, 64-token blocks) in every layout.

**Throughput.** Then it measures the same staged path for one Llama-3-8B rank (32 layers, 8 KV heads
of 128, bf16, 16-token blocks) in a 16.5 GiB cache, past 2**31 elements even as int64, so the copy
kernels take the 64-bit index path of a production cache; loads land in its last blocks. Per layout
and for 2 MiB and 32 MiB chunks: saves (gather kernel, device-to-host copy, copy and checksum into
pool-like shared memory) and loads (verified copy out of it, host-to-device copy, scatter kernel),
each beside the limit measured on the same bytes in the same run: pinned device-to-host and
host-to-device copies and the host copy+checksum (a small cache on the CPU, where the numbers only
show the path runs). Then a synthetic engine step (bf16 matmuls, one sync a step) is timed alone and
while saves and loads run without pause: the step-time cost of the copies.

**Contexts.** On a node of several GPUs, each rank runs in its own process as a vLLM worker does
(device set, lanes on threads); afterwards only its own device may hold a CUDA context. Lanes that
do not set their device are run too (rank 1), to show whether the check sees their context on GPU 0.

The last line sums it up: ``SUMMARY cuda: cases PASS; save 0.9x, load 0.85x limit (worst, ...);
step cost +0.8% (...); contexts PASS (...)``. Exit status 0 when every round trip is exact, every
mutant caught, every measured round trip exact and no rank opened a stray context; the throughput
and step-cost targets (docs/gpu-cxl.md) are reported, not enforced.
"""

from __future__ import annotations

import argparse
import mmap
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TextIO, TypeVar

import numpy as np
import torch

from maru_connector.layout import PagedKV, describe_kv_caches
from maru_connector.staging import StagedCopier

try:
    from maru_pool.copyhash import copy_checksum

    HOST_LEG = "host copy+checksum"
except ImportError:  # a node with torch alone (no xxhash): the host leg is a plain copy, compared at the end

    def copy_checksum(dst: memoryview, src: memoryview, *, to_pool: bool) -> int:
        np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))
        return 0

    HOST_LEG = "host copy (no checksum: install xxhash to measure it)"

# vLLM 0.32's KVCacheLayout: the memory order of the logical dims [L, B, H, N, C], outermost first.
LAYOUTS: dict[str, tuple[int, int, int, int, int]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
T = TypeVar("T")

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
    # Small integers are exact in fp16 and bf16 (fp8 rounds some, the same way every time it converts);
    # the layer and block offsets make blocks differ.
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
    want = expected_kv(layer, block, shape, torch.float32, view.device)
    if extra is not None:
        want = want + extra.float()  # in float32: fp8 has no arithmetic
    want = want.to(view.dtype)
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


def concrete(device: torch.device | str) -> torch.device:
    """``device`` with its index (``cuda`` alone is the current GPU): what ``torch.cuda.set_device`` takes."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def on_lane(device: torch.device, work: Callable[[], T], *, set_device: bool = True) -> T:
    """``work``'s result, run as a worker's lane runs its jobs: on a thread of its own that first makes the
    rank's device its current one (``lane.Lane``; this module needs torch alone, so it is not imported)."""
    result: dict[str, Any] = {}

    def body() -> None:
        try:
            if set_device and device.type == "cuda":
                torch.cuda.set_device(device)
            result["value"] = work()
        except BaseException as err:  # handed to the caller's thread
            result["error"] = err

    thread = threading.Thread(target=body, name="maru-check-lane")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def round_trip(
    saver: StagedCopier, loader: StagedCopier, saved: list[int], landing: dict[int, int], ready: Callable[[], None]
) -> bytearray:
    """Save blocks ``saved`` of ``saver``'s cache as one chunk and load the chunk's ``landing`` slots into
    ``loader``'s, as ``MaruWorker`` does: ``ready`` is the source's ``fence()`` taken on the engine's thread
    behind the KV's kernels, the save and the load run on lane threads through :class:`StagedCopier` (its
    stream, pinned buffers and events on a GPU), and the load waits for an event on the engine's stream
    (``PagedKV.mark``). Returns the chunk as the pool would hold it.

    The copiers are made before the kernels the save must wait for are queued, as the worker's are at
    start: allocating pinned or device memory serialises the streams, which would hide a missing fence.
    """
    device, dst = saver.paged.device, loader.paged

    def save() -> bytearray:
        ready()
        (host,) = [bytearray(h.tobytes()) for h in saver.gathered([saved])]
        return host

    pool_chunk = on_lane(device, save)
    after = dst.mark()

    def load() -> None:
        loader.after(after)
        loader.scatter(lambda host: np.copyto(host, np.frombuffer(pool_chunk, np.uint8)), sorted(landing.items()))
        loader.finish()

    on_lane(device, load)
    return pool_chunk


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.equal(got.float(), want.float())  # fp8 has no comparison of its own


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


class _NoFence(PagedKV):
    """A save path whose fence waits for nothing: the lane's copy races the kernels computing the KV."""

    def fence(self) -> Callable[[], None]:
        return lambda: None


def copy_before_kernel(paged: PagedKV) -> PagedKV:
    """A save that copies the blocks as they were before the slow kernel was queued.

    Stands in for a copy that runs out of order (on another stream, or asynchronously) on every
    device, the CPU included, where no copy can overtake a kernel.
    """
    frozen = [view.clone() for view in paged._views]
    return PagedKV(paged.format, paged.layer_names, frozen, paged.block_bytes, paged.num_blocks)


def skip_fence(paged: PagedKV) -> PagedKV:
    """A save that does not wait for the engine's stream before its lane copies (a broken ``fence``)."""
    return _NoFence(paged.format, paged.layer_names, paged._views, paged.block_bytes, paged.num_blocks)


# Table column -> (mutant, the device types it can run on).
MUTANTS: dict[str, tuple[Mutant, tuple[str, ...]]] = {
    "copy before kernel": (copy_before_kernel, ("cpu", "cuda")),
    "no fence": (skip_fence, ("cuda",)),
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
    """Save blocks of one cache and load part of the chunk into other blocks of another; raise :class:`CheckFailed`.

    ``allocator(layout, shape, dtype, device)`` makes each cache (tests pass vLLM's own);
    ``mutant`` breaks the save path on purpose (see :data:`MUTANTS`).
    """
    device = torch.device(device)
    _, src_views = allocator(layout, shape, dtype, device)
    saved = [7, 5, 3]  # not in memory order: a chunk follows the request's block table
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
    _, dst_views = allocator(layout, shape, dtype, device)
    dst = describe_kv_caches(dst_views, **describe)
    saved_chunk = len(saved)
    saver, loader = StagedCopier(src, saved_chunk), StagedCopier(dst, saved_chunk)
    if device.type == "cuda":
        # The sentinel is in memory before the kernel is queued: an early copy reads exactly it.
        torch.cuda.synchronize(device)
    zero = slow_kernel(device, *slow)
    for layer, view in enumerate(src_views.values()):
        write_block(view, layer, late, shape, extra=zero)
    ready = src.fence()  # on the engine's thread, behind the kernels, as MaruWorker.save takes it
    landing = {0: 10, 2: 2}  # part of the chunk: its middle block is not loaded
    pool_chunk = round_trip(saver, loader, saved, landing, ready)
    for layer, view in enumerate(dst_views.values()):
        for slot, b in landing.items():
            want = expected_kv(layer, saved[slot], shape, dtype, device)
            k, v = block_kv(view, b, shape)
            for name, got, exp in (("K", k, want[0]), ("V", v, want[1])):
                if not _same(got, exp):
                    got, exp = got.float(), exp.float()
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
        if any((t.float() != 0).any() for b in untouched for t in block_kv(view, b, shape)):
            raise CheckFailed(f"{layout} {dtype} on {device}: layer {layer}: a load wrote outside its blocks")
    return Saved(src, pool_chunk, saved)


def cases(device: torch.device) -> Iterator[tuple[str, CacheShape, torch.dtype]]:
    # fp8: vLLM's kv_cache_dtype=fp8 (e4m3) caches, one byte per value.
    dtypes = [torch.float16, torch.bfloat16] if device.type == "cuda" else [torch.float32, torch.float16]
    for dtype in [*dtypes, torch.float8_e4m3fn]:
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
    """Save two blocks of an MLA latent cache as the worker does (:func:`round_trip`), load them into other
    blocks of another; each token's latent must arrive exact. Raises :class:`CheckFailed`."""
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
    _, dst_views = allocate(layout, shape, dtype, device)
    dst = describe_kv_caches(dst_views, **describe)
    round_trip(StagedCopier(src, 2), StagedCopier(dst, 2), [7, 3], {0: 10, 1: 2}, src.fence())
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

# One TP rank of Llama-3-8B (bf16, 16-token blocks: 2 MiB a block over its 32 layers) in a cache of 8448
# blocks, 16.5 GiB: past 2**31 elements even as the int64 the copies move, so the gather and scatter
# kernels take their 64-bit index path as a ~100 GiB production cache does, and the loads land in its
# last blocks. A small cache on the CPU, where the numbers only show the path runs.
GPU_BENCH = CacheShape(num_layers=32, num_blocks=8448, heads=8, block_size=16, head_size=128)
CPU_BENCH = CacheShape(num_layers=4, num_blocks=256, heads=2, block_size=16, head_size=64)
BENCH_LAYOUTS = ("LBHNC", "LBNHC")
# Chunk sizes measured on a GPU, in tokens: 16 (one block, 2 MiB for GPU_BENCH) and 256 (32 MiB).
GPU_CHUNK_TOKENS = (16, 256)
# Bytes moved per direction and measured pass (at least 8 chunks).
BENCH_BYTES = 256 << 20
# The throughput target (docs/gpu-cxl.md): saves and loads at this share of the slower of the pinned
# copy and the host copy+checksum of the same bytes, for chunks of 2 MiB or more.
TARGET_RATIO = 0.8
# The step-time target: a concurrent synthetic matmul load slows down by at most this share.
TARGET_STEP_COST = 0.02


@dataclass(frozen=True)
class Throughput:
    """GB/s of the staged path beside the limits measured on the same bytes in the same run.

    ``d2h_gbps`` and ``h2d_gbps``: pinned device-to-host and host-to-device copies (0 on the CPU);
    ``host_gbps``: the pool client's copy+checksum. A save is limited by the slower of the first and
    the last, a load by the slower of the second and the last (the double buffer overlaps them).
    """

    layout: str
    dtype: str
    chunk_bytes: int
    chunks: int
    save_gbps: float
    load_gbps: float
    d2h_gbps: float = 0.0
    h2d_gbps: float = 0.0
    host_gbps: float = 0.0

    @property
    def save_limit(self) -> float:
        return min(x for x in (self.d2h_gbps, self.host_gbps) if x > 0) if self.host_gbps else 0.0

    @property
    def load_limit(self) -> float:
        return min(x for x in (self.h2d_gbps, self.host_gbps) if x > 0) if self.host_gbps else 0.0

    @property
    def save_ratio(self) -> float:
        return self.save_gbps / self.save_limit if self.save_limit else 0.0

    @property
    def load_ratio(self) -> float:
        return self.load_gbps / self.load_limit if self.load_limit else 0.0


class _Bench:
    """One cache, a copier per direction, pool-like shared memory: saves and loads as a worker's lanes run them."""

    def __init__(self, layout: str, shape: CacheShape, dtype: torch.dtype, device: torch.device, per_chunk: int):
        chunks = max(8, BENCH_BYTES // (shape.num_layers * per_chunk * _block_bytes(shape, dtype)))
        chunks = min(chunks, shape.num_blocks // (2 * per_chunk))
        if chunks < 1:
            raise ValueError(f"{shape.num_blocks} blocks cannot hold a chunk of {per_chunk} blocks twice")
        self.device, self.chunks = device, chunks
        _, views = allocate(layout, shape, dtype, device)
        self.paged = describe_kv_caches(
            views, num_blocks=shape.num_blocks, block_size=shape.block_size, num_kv_heads=shape.heads,
            head_size=shape.head_size, backend=BACKEND,
        )  # fmt: skip
        # Saved from the first blocks, loaded into the last ones (the far end of a 64-bit-indexed cache).
        self.sources = [list(range(c * per_chunk, (c + 1) * per_chunk)) for c in range(chunks)]
        top = shape.num_blocks - chunks * per_chunk
        self.targets = [[top + b for b in blocks] for blocks in self.sources]
        for view in views.values():
            used = view.unflatten(0, (shape.num_blocks, -1))[: chunks * per_chunk]
            used.copy_(torch.rand(used.shape, device=device).to(dtype))
        self.saver, self.loader = StagedCopier(self.paged, per_chunk), StagedCopier(self.paged, per_chunk)
        self.size = self.saver.chunk_bytes
        self.pool = mmap.mmap(-1, self.size * chunks)  # shared memory, as the pool's mapping
        self.slots = [memoryview(self.pool)[c * self.size : (c + 1) * self.size] for c in range(chunks)]
        self.sums = [0] * chunks

    def save(self) -> None:
        ready = self.paged.fence()

        def run() -> None:  # MaruWorker._store: each chunk copied and checksummed into the pool as it comes
            ready()
            for c, host in enumerate(self.saver.gathered(self.sources)):
                self.sums[c] = copy_checksum(self.slots[c], memoryview(host), to_pool=True)

        on_lane(self.device, run)

    def load(self) -> None:
        after = self.paged.mark()

        def run() -> None:
            self.loader.after(after)
            for c, blocks in enumerate(self.targets):
                fill = lambda host, c=c: _read_verified(host, self.slots[c], self.sums[c])  # noqa: E731
                self.loader.scatter(fill, list(enumerate(blocks)))
            self.loader.finish()

        on_lane(self.device, run)

    def limits(self) -> tuple[float, float, float]:
        """GB/s of pinned D2H and H2D copies (0 on the CPU) and of the host copy+checksum, of the same bytes."""
        total = self.size * self.chunks
        host = [torch.empty(self.size, dtype=torch.uint8, pin_memory=self.device.type == "cuda") for _ in range(2)]

        def checksum() -> None:
            for c in range(self.chunks):
                copy_checksum(self.slots[c], memoryview(host[c % 2].numpy()), to_pool=True)

        host_gbps = total / _timed(checksum, self.device) / 1e9
        if self.device.type != "cuda":
            return 0.0, 0.0, host_gbps
        stream = torch.cuda.Stream(device=self.device)
        with torch.cuda.stream(stream):
            dev = torch.empty(self.size, dtype=torch.uint8, device=self.device)

        def d2h() -> None:
            with torch.cuda.stream(stream):
                for c in range(self.chunks):
                    host[c % 2].copy_(dev, non_blocking=True)
            stream.synchronize()

        def h2d() -> None:
            with torch.cuda.stream(stream):
                for c in range(self.chunks):
                    dev.copy_(host[c % 2], non_blocking=True)
            stream.synchronize()

        return total / _timed(d2h, self.device) / 1e9, total / _timed(h2d, self.device) / 1e9, host_gbps

    def verify(self, what: str) -> None:
        for src, dst in zip(self.sources, self.targets, strict=True):
            for view in self.paged._views:
                if not torch.equal(view[dst], view[src]):
                    raise CheckFailed(f"{what}: the measured round trip changed blocks {src}")

    def close(self) -> None:
        for view in self.slots:
            view.release()
        self.pool.close()


def _block_bytes(shape: CacheShape, dtype: torch.dtype) -> int:
    return shape.heads * shape.block_size * 2 * shape.head_size * torch.empty((), dtype=dtype).element_size()


def _after(ready: Callable[[], None], chunks: Iterator[np.ndarray]) -> list[np.ndarray]:
    """Wait for ``ready``, then each chunk copied out of its host buffer before the next one is asked for."""
    ready()
    return [host.copy() for host in chunks]


def measure(
    layout: str,
    shape: CacheShape,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    chunk_tokens: int = 256,
) -> Throughput:
    """Save chunks through :class:`StagedCopier` into pool-like memory and load them back, beside the limits.

    Each chunk's blocks go to other blocks of the same cache, which are then compared with the
    originals, so a fast but wrong path fails (:class:`CheckFailed`) instead of printing a number.
    """
    device = concrete(device)
    bench = _Bench(layout, shape, dtype, device, max(1, chunk_tokens // shape.block_size))
    try:
        save_s, load_s = _timed(bench.save, device), _timed(bench.load, device)
        name = str(dtype).removeprefix("torch.")
        bench.verify(f"{layout} {name} on {device}")
        d2h, h2d, host = bench.limits()
        total = bench.size * bench.chunks
        return Throughput(
            layout, name, bench.size, bench.chunks, total / save_s / 1e9, total / load_s / 1e9, d2h, h2d, host
        )
    finally:
        bench.close()


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


def report_throughput(
    device: torch.device | str,
    *,
    shape: CacheShape | None = None,
    layouts: tuple[str, ...] | None = None,
    out: TextIO = sys.stdout,
) -> tuple[int, list[Throughput]]:
    """Measure and print the staged path's GB/s for save and load beside the limits; ``(failures, results)``."""
    device = concrete(device)
    cuda = device.type == "cuda"
    shape = shape or (GPU_BENCH if cuda else CPU_BENCH)
    layouts = layouts or (tuple(LAYOUTS) if cuda else BENCH_LAYOUTS)
    dtype = torch.bfloat16 if cuda else torch.float32
    failures, results = 0, []
    for layout in layouts:
        for tokens in GPU_CHUNK_TOKENS if cuda else (256,):
            try:
                t = measure(layout, shape, dtype, device, chunk_tokens=tokens)
            except CheckFailed as err:
                print(f"FAIL throughput {layout}: {err}", file=out)
                failures += 1
                continue
            results.append(t)
            pinned = f"pinned D2H {t.d2h_gbps:.3g}, H2D {t.h2d_gbps:.3g}, " if cuda else ""
            print(
                f"throughput {t.layout} {t.dtype} on {device}: save {t.save_gbps:.3g} GB/s "
                f"({t.save_ratio:.2f}x limit), load {t.load_gbps:.3g} GB/s ({t.load_ratio:.2f}x limit); "
                f"{pinned}{HOST_LEG} {t.host_gbps:.3g} GB/s "
                f"({t.chunks} chunks of {t.chunk_bytes / (1 << 20):.2f} MiB, {shape.num_layers} layers, "
                f"{_cache_gib(shape, dtype):.1f} GiB cache, per rank)",
                file=out,
            )
    return failures, results


def _cache_gib(shape: CacheShape, dtype: torch.dtype) -> float:
    return shape.num_layers * shape.num_blocks * _block_bytes(shape, dtype) / (1 << 30)


# ---------------------------------------------------------------- what the copies cost the engine


def step_cost(device: torch.device, shape: CacheShape = GPU_BENCH, *, steps: int = 40) -> tuple[float, float, float]:
    """``(step ms alone, step ms with copies, cost)``: a synthetic engine step (bf16 matmuls on the current
    stream, one host sync a step, as vLLM's) timed alone, then while a lane thread saves and loads chunks of
    ``shape`` without pause. ``cost`` is the share the median step slowed down by."""
    device = concrete(device)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)

    def median_step() -> float:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            for _ in range(4):
                a @ a
            torch.cuda.current_stream(device).synchronize()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    median_step()  # warm up
    alone = median_step()
    bench = _Bench("LBHNC", shape, torch.bfloat16, device, max(1, 256 // shape.block_size))
    stop = threading.Event()
    errors: list[BaseException] = []

    def traffic() -> None:
        torch.cuda.set_device(device)
        try:
            while not stop.is_set():
                bench.save()
                bench.load()
        except BaseException as err:
            errors.append(err)

    thread = threading.Thread(target=traffic, name="maru-check-traffic")
    thread.start()
    try:
        time.sleep(0.2)
        busy = median_step()
    finally:
        stop.set()
        thread.join()
        bench.close()
    if errors:
        raise errors[0]
    return alone * 1e3, busy * 1e3, busy / alone - 1


# ---------------------------------------------------------------- CUDA contexts of a multi-GPU node


def active_contexts() -> list[int]:
    """The devices whose primary CUDA context this process holds (libcuda's own state; opens none)."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    if cuda.cuInit(0) != 0:
        raise RuntimeError("cuInit failed")
    count = ctypes.c_int()
    cuda.cuDeviceGetCount(ctypes.byref(count))
    active = []
    for ordinal in range(count.value):
        dev, flags, on = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        cuda.cuDeviceGet(ctypes.byref(dev), ordinal)
        cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(on))
        if on.value:
            active.append(ordinal)
    return active


def _rank_contexts(rank: int, set_device: bool) -> list[int]:
    """In a fresh process, as a vLLM worker of ``rank``: set the device, round-trip on lane threads, report."""
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    shape = CacheShape()
    _, src_views = allocate("LBHNC", shape, torch.bfloat16, device)
    _, dst_views = allocate("LBHNC", shape, torch.bfloat16, device)
    describe = dict(num_blocks=shape.num_blocks, block_size=shape.block_size, num_kv_heads=shape.heads,
                    head_size=shape.head_size, backend=BACKEND)  # fmt: skip
    src, dst = describe_kv_caches(src_views, **describe), describe_kv_caches(dst_views, **describe)
    saver, loader = StagedCopier(src, 2), StagedCopier(dst, 2)
    ready = src.fence()
    chunk = on_lane(device, lambda: _after(ready, saver.gathered([[1, 2]]))[0], set_device=set_device)
    after = dst.mark()

    def load() -> None:
        loader.after(after)
        loader.scatter(lambda host: np.copyto(host, chunk), [(0, 3), (1, 4)])
        loader.finish()

    on_lane(device, load, set_device=set_device)
    torch.cuda.synchronize(device)
    return active_contexts()


def check_contexts(out: TextIO = sys.stdout) -> tuple[int, str]:
    """Every rank of this node in its own process: only its own device may hold a context afterwards.

    Also runs lanes that do not set their device (the bug this looks for) on rank 1 and says whether it
    saw their context on GPU 0 (reported, not counted: a torch that defers the switch opens none).
    ``(failures, summary cell)``.
    """
    import multiprocessing

    n = torch.cuda.device_count()
    if n < 2:
        print("contexts: - (one GPU: a context on another device cannot happen here)", file=out)
        return 0, "-"
    ctx = multiprocessing.get_context("spawn")
    failures = 0
    with ctx.Pool(1, maxtasksperchild=1) as pool:  # a fresh process per rank: contexts are per process
        for rank in range(n):
            active = pool.apply(_rank_contexts, (rank, True))
            ok = active == [rank]
            failures += not ok
            print(f"contexts rank {rank}: {active} {'PASS' if ok else 'FAIL (a context on another GPU)'}", file=out)
    with ctx.Pool(1) as pool:
        active = pool.apply(_rank_contexts, (1, False))
    # Not seen is no failure of the node: this torch may defer the device switch that opens the context.
    verdict = "PASS (caught)" if 0 in active else "NOT SEEN (no context on GPU 0 even without set_device)"
    print(f"contexts mutant (lanes without set_device, rank 1): {active} {verdict}", file=out)
    return failures, "PASS" if not failures else "FAIL"


# ---------------------------------------------------------------- the whole check


def summary(
    device: torch.device, cases_failed: int, results: list[Throughput], cost: float | None, contexts: str
) -> str:
    """One line: PASS/FAIL of the cases, the worst GB/s ratios of 2 MiB+ chunks, the step cost, the contexts."""
    big = [t for t in results if t.chunk_bytes >= 2 << 20] or results
    parts = [f"SUMMARY {device}: cases {'PASS' if not cases_failed else f'FAIL ({cases_failed})'}"]
    if big:
        save, load = min(t.save_ratio for t in big), min(t.load_ratio for t in big)
        met = "PASS" if min(save, load) >= TARGET_RATIO else "BELOW TARGET"
        if device.type != "cuda":
            met = "the target is a GPU's"  # a CPU cache's gather is a host copy of its own
        parts.append(f"save {save:.2f}x, load {load:.2f}x limit (worst, >= {TARGET_RATIO}x wanted: {met})")
    if cost is not None:
        met = "PASS" if cost <= TARGET_STEP_COST else "BELOW TARGET"
        parts.append(f"step cost {cost * 100:+.1f}% (<= {TARGET_STEP_COST * 100:.0f}% wanted: {met})")
    parts.append(f"contexts {contexts}")
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-throughput", action="store_true", help="skip the GB/s and step-cost measurements")
    parser.add_argument("--no-contexts", action="store_true", help="skip the per-rank CUDA context check")
    args = parser.parse_args(argv)
    device = concrete(args.device)
    cuda = device.type == "cuda"
    started = time.monotonic()
    # On a GPU the slow kernel takes tens of milliseconds, far longer than a save's copy.
    slow = (4096, 40) if cuda else (64, 4)
    out = sys.stdout  # as it is now (a caller may have replaced it)
    failed = run(device, slow=slow, out=out)
    results: list[Throughput] = []
    cost = None
    if not args.no_throughput:
        bad, results = report_throughput(device, out=out)
        failed += bad
        if cuda:
            alone, busy, cost = step_cost(device)
            print(
                f"step time: {alone:.2f} ms alone, {busy:.2f} ms with saves and loads running ({cost * 100:+.1f}%)",
                file=out,
            )
    contexts = "-"
    if cuda and not args.no_contexts:
        bad, contexts = check_contexts(out)
        failed += bad
    print(summary(device, failed, results, cost, contexts) + f" ({time.monotonic() - started:.0f} s)", file=out)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
