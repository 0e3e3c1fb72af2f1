"""The packed chunk layout: the only module that knows where KV bytes sit, in vLLM and in the pool.

A pool chunk holds ``blocks_per_chunk`` consecutive KV blocks of one request, for every attention
layer of this TP rank, packed as::

    chunk[layer][block_in_chunk][block_bytes]     (C order, no padding, no header)

``block_bytes`` is one block of one layer exactly as the attention backend keeps it in memory.
Blocks are copied whole, never token by token, because some backends cannot be indexed per
token: the CPU backend stores each block as, per KV head, all of its tokens' K rows followed by
all of their V rows. The layout's name goes into every chunk key (see ``keys.Namespace``), so
engines whose backends order bytes differently can never read each other's chunks.

Supported per-layer tensors (the logical shapes vLLM 0.32 hands to ``register_kv_caches``):

=================  ==============================  ===========================================
name               logical shape                   block_bytes, in order
=================  ==============================  ===========================================
``cpu``            ``[B, H, N, 2*C]``               per head: N rows of K, then N rows of V
``kv-first-nhd``   ``[2, B, N, H, C]`` (FlashAttn)  K block ``[N, H, C]``, then V block
``kv-first-hnd``   same, HND strides                K block ``[H, N, C]``, then V block
``block-first-nhd`` ``[B, 2, N, H, C]`` (FlashInfer) K ``[N, H, C]``, then V, contiguous
``block-first-hnd`` same, HND strides               K ``[H, N, C]``, then V
=================  ==============================  ===========================================

(B blocks, N tokens per block, H KV heads, C head size.) Any other shape or stride pattern is
rejected when the KV caches are registered, with a message naming it, instead of producing
wrong bytes later.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch


class KVLayoutError(ValueError):
    """The engine's KV cache tensors are not in a layout this connector can copy."""


@dataclass(frozen=True)
class ChunkGeometry:
    """Sizes of one packed chunk."""

    num_layers: int
    blocks_per_chunk: int
    block_bytes: int

    @property
    def chunk_bytes(self) -> int:
        return self.num_layers * self.blocks_per_chunk * self.block_bytes


class PagedKV:
    """Block-granular access to the engine's per-layer paged KV tensors.

    Built once by :func:`describe_kv_caches`; holds strided uint8 views over the engine's own
    storage (no copy). ``gather`` and ``scatter`` are the only code that moves KV bytes.
    """

    def __init__(
        self,
        name: str,
        layer_names: list[str],
        views: list[torch.Tensor],
        kv_first: bool,
        block_bytes: int,
        num_blocks: int,
    ) -> None:
        self.name = name
        self.layer_names = layer_names
        # Block-first: one [num_blocks, block_bytes] view per layer. KV-first: [2, num_blocks, half].
        self._views = views
        self._kv_first = kv_first
        self.block_bytes = block_bytes
        self.num_blocks = num_blocks
        self.device = views[0].device

    @property
    def num_layers(self) -> int:
        return len(self._views)

    def geometry(self, blocks_per_chunk: int) -> ChunkGeometry:
        return ChunkGeometry(self.num_layers, blocks_per_chunk, self.block_bytes)

    def chunk_view(self, buf: memoryview | bytearray, blocks_per_chunk: int) -> torch.Tensor:
        """A ``[layers, blocks_per_chunk, block_bytes]`` uint8 tensor over ``buf`` (no copy)."""
        geo = self.geometry(blocks_per_chunk)
        if len(buf) != geo.chunk_bytes:
            raise ValueError(f"chunk buffer holds {len(buf)} bytes, layout needs {geo.chunk_bytes}")
        with warnings.catch_warnings():
            # Read-only pins come back as read-only memoryviews; scatter only reads them.
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(buf, dtype=torch.uint8)
        return flat.view(geo.num_layers, blocks_per_chunk, geo.block_bytes)

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """Copy blocks ``block_ids`` of every layer into ``out`` (``[layers, len(ids), block_bytes]``)."""
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        for layer, view in enumerate(self._views):
            if self._kv_first:
                picked = view.index_select(1, ids).transpose(0, 1)  # [n, 2, half]
                out[layer].view(len(ids), 2, -1).copy_(picked)
            elif self.device.type == "cpu":
                torch.index_select(view, 0, ids, out=out[layer])
            else:
                out[layer].copy_(view.index_select(0, ids))

    def scatter(self, src: torch.Tensor, slots: Sequence[tuple[int, int]]) -> None:
        """Copy packed blocks into the engine: ``slots`` is ``(block_in_chunk, dst_block_id)`` pairs."""
        if not slots:
            return
        idx = torch.tensor([s for s, _ in slots], dtype=torch.long)
        dst = torch.tensor([d for _, d in slots], dtype=torch.long, device=self.device)
        for layer, view in enumerate(self._views):
            blocks = src[layer].index_select(0, idx).to(self.device)
            if self._kv_first:
                view.index_copy_(1, dst, blocks.view(len(slots), 2, -1).transpose(0, 1))
            else:
                view.index_copy_(0, dst, blocks)


def describe_kv_caches(
    kv_caches: Mapping[str, torch.Tensor],
    *,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
) -> PagedKV:
    """Recognise the backend's layout from the registered tensors, or raise :class:`KVLayoutError`.

    ``num_kv_heads`` is per TP rank. All layers must share one layout, dtype and block count.
    """
    if not kv_caches:
        raise KVLayoutError("no KV cache tensors were registered (attention-free model?)")
    names = list(kv_caches)
    first = kv_caches[names[0]]
    name, kv_first = _classify(first, block_size, num_kv_heads, head_size)
    views = []
    for layer_name in names:
        t = kv_caches[layer_name]
        if t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype:
            raise KVLayoutError(
                f"layer {layer_name} has shape {tuple(t.shape)} stride {t.stride()} {t.dtype}, unlike "
                f"{names[0]} {tuple(first.shape)} {first.stride()} {first.dtype}: mixed layouts are not supported"
            )
        views.append(_byte_view(t, kv_first))
    num_blocks = first.shape[1] if kv_first else first.shape[0]
    per_block = views[0].shape[-1] * (2 if kv_first else 1)
    return PagedKV(name, names, views, kv_first, per_block, num_blocks)


def _classify(t: torch.Tensor, block_size: int, heads: int, head_size: int) -> tuple[str, bool]:
    shape, stride = tuple(t.shape), t.stride()
    where = f"KV cache tensor of shape {shape}, stride {stride}, dtype {t.dtype}"
    if t.dim() == 4:
        if shape[1:] == (heads, block_size, 2 * head_size) and t.is_contiguous():
            return "cpu", False
        raise KVLayoutError(
            f"unsupported {where}: expected the CPU backend's contiguous "
            f"[blocks, {heads}, {block_size}, {2 * head_size}]"
        )
    if t.dim() == 5:
        # Physical order of the last three logical dims (N, H, C) tells NHD from HND.
        inner = sorted(range(2, 5), key=lambda d: -stride[d])
        order = {(2, 3, 4): "nhd", (3, 2, 4): "hnd"}.get(tuple(inner))
        if shape[0] == 2 and shape[2:] == (block_size, heads, head_size) and order:
            kind, kv_first, outer = "kv-first", True, (0, 1)
        elif shape[1] == 2 and shape[2:] == (block_size, heads, head_size) and order:
            kind, kv_first, outer = "block-first", False, (0, 1)
        else:
            raise KVLayoutError(
                f"unsupported {where}: expected [2, blocks, {block_size}, {heads}, "
                f"{head_size}] (FlashAttention) or [blocks, 2, ...] (FlashInfer), NHD or HND"
            )
        if not _dense_region(t, start_dim=1 if not kv_first else 2) or not _outer_ok(t, outer, kv_first):
            raise KVLayoutError(f"unsupported {where}: a block is not one dense region of memory")
        return f"{kind}-{order}", kv_first
    raise KVLayoutError(f"unsupported {where}: MLA and other single-tensor layouts are not supported yet")


def _dense_region(t: torch.Tensor, start_dim: int) -> bool:
    """True when dims ``start_dim..`` tile one contiguous range (in some order, no gaps)."""
    dims = sorted(range(start_dim, t.dim()), key=lambda d: t.stride(d))
    expected = 1
    for d in dims:
        if t.stride(d) != expected:
            return False
        expected *= t.shape[d]
    return True


def _outer_ok(t: torch.Tensor, outer: tuple[int, int], kv_first: bool) -> bool:
    inner = 1
    for d in range(2, t.dim()):
        inner *= t.shape[d]
    if kv_first:
        # K and V halves of a block are each dense; the blocks of one half are evenly strided.
        return t.stride(1) >= inner
    # Block-first: K and V of a block sit back to back, so the whole block is one region.
    return t.stride(1) == inner and t.stride(0) >= 2 * inner


def _byte_view(t: torch.Tensor, kv_first: bool) -> torch.Tensor:
    """A uint8 view over ``t``'s storage: ``[B, block_bytes]`` or ``[2, B, half_block_bytes]``."""
    elt = t.element_size()
    if kv_first:
        half = t.shape[2] * t.shape[3] * t.shape[4]
        v = t.as_strided((2, t.shape[1], half), (t.stride(0), t.stride(1), 1), t.storage_offset())
        return v.view(torch.uint8).view(2, t.shape[1], half * elt)
    per_block = 1
    for d in t.shape[1:]:
        per_block *= d
    v = t.as_strided((t.shape[0], per_block), (t.stride(0), 1), t.storage_offset())
    return v.view(torch.uint8)
