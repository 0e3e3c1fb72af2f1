"""Self-check of the connector's KV copy path on this machine: ``python -m maru_connector.layout_check``.

Needs only ``torch`` (vLLM does not have to be installed), so it runs on any GPU node in about a
minute::

    python -m maru_connector.layout_check --device cuda     # every KVCacheLayout, fp16 and bf16
    python -m maru_connector.layout_check --device cpu      # the same code, as CI runs it

For every ``KVCacheLayout`` of vLLM 0.32 it allocates a KV cache the way vLLM's
``allocate_kv_cache`` does (one byte buffer, one strided ``[blocks, heads, tokens, 2*head_size]``
view per layer), writes K and V through the GPU backends' reading of that view
(``kv.transpose(1, 2).split(head_size, -1)``), packs blocks into host memory with
:class:`~maru_connector.layout.PagedKV` as the connector's saves do, unpacks them into other blocks
of a second cache as its loads do, and compares what the backend reads there, value by value.

Before one of the saves it queues a slow kernel that produces that block's KV: a save that does
not wait for the kernels computing its KV (a copy on another stream, a non-blocking copy without a
sync) packs stale bytes and fails the check. Exit status 0 when every case passes.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from maru_connector.layout import PagedKV, describe_kv_caches

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


class CheckFailed(AssertionError):
    """The bytes a backend would read after a save and a load differ from the ones saved."""


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


def check_layout(
    layout: str,
    shape: CacheShape,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    slow: tuple[int, int] = (64, 4),
    allocator: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]] = allocate,
) -> Saved:
    """Save blocks of one cache and load them into other blocks of another; raise :class:`CheckFailed`.

    ``allocator(layout, shape, dtype, device)`` makes each cache (tests pass vLLM's own).
    """
    device = torch.device(device)
    _, src_views = allocator(layout, shape, dtype, device)
    for layer, view in enumerate(src_views.values()):
        for b in range(shape.num_blocks):
            write_block(view, layer, b, shape)
    describe = dict(
        num_blocks=shape.num_blocks,
        block_size=shape.block_size,
        num_kv_heads=shape.heads,
        head_size=shape.head_size,
        backend=BACKEND,
    )
    src = describe_kv_caches(src_views, **describe)
    per_chunk = 2
    saved = [7, 3]  # not in memory order: a chunk follows the request's block table
    # The last block's KV comes out of a slow kernel queued just before the save.
    late = saved[-1]
    zero = slow_kernel(device, *slow)
    for layer, view in enumerate(src_views.values()):
        for t in block_kv(view, late, shape):
            t.zero_()
        write_block(view, layer, late, shape, extra=zero)
    pool_chunk = bytearray(src.geometry(per_chunk).chunk_bytes)  # stands in for the pool mapping
    src.gather(saved, src.chunk_view(pool_chunk, per_chunk))

    _, dst_views = allocator(layout, shape, dtype, device)
    dst = describe_kv_caches(dst_views, **describe)
    landing = {0: 10, 1: 2}
    dst.scatter(dst.chunk_view(memoryview(bytes(pool_chunk)), per_chunk), sorted(landing.items()))
    for layer, view in enumerate(dst_views.values()):
        for slot, b in landing.items():
            want = expected_kv(layer, saved[slot], shape, dtype, device)
            k, v = block_kv(view, b, shape)
            for name, got, exp in (("K", k, want[0]), ("V", v, want[1])):
                if not torch.equal(got, exp):
                    bad = (got != exp).nonzero()[0].tolist()
                    raise CheckFailed(
                        f"{layout} {dtype} on {device}: layer {layer} block {saved[slot]} -> {b}: {name} differs "
                        f"first at [token, head, dim] {bad}: {got[tuple(bad)].item()} != {exp[tuple(bad)].item()}"
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


def run(device: torch.device | str, *, slow: tuple[int, int] = (64, 4), out=sys.stdout) -> int:
    """Every case on ``device``; returns the number of failures (each one printed)."""
    device = torch.device(device)
    failures = 0
    for layout, shape, dtype in cases(device):
        start = time.perf_counter()
        try:
            paged = check_layout(layout, shape, dtype, device, slow=slow).paged
        except CheckFailed as err:
            failures += 1
            print(f"FAIL {err}", file=out)
            continue
        split = f", kernel blocks of {shape.kernel_block_size}" if shape.kernel_block_size else ""
        took = (time.perf_counter() - start) * 1000
        print(
            f"ok   {layout} {str(dtype).removeprefix('torch.')}{split}: format {paged.format} ({took:.0f} ms)", file=out
        )
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    # On a GPU the slow kernel takes tens of milliseconds, far longer than a save's copy.
    slow = (4096, 40) if device.type == "cuda" else (64, 4)
    failures = run(device, slow=slow)
    print(f"{'FAILED' if failures else 'passed'}: {failures} failure(s) on {device}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
