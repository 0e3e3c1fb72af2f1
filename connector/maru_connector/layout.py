"""The packed chunk layout: the only module that knows where KV bytes sit, in vLLM and in the pool.

vLLM 0.32 allocates the KV cache of a model as one shared byte buffer and hands the connector one
4-D view per attention layer, logical ``[blocks, heads, tokens, content]``, whose strides follow the
engine's resolved ``KVCacheLayout`` (``LBHNC``, ``LBNHC``, ``LHBNC``, ``BLHNC``, ``BLNHC`` or
``BHLNC``: the memory order of layer, block, head, token and content). The views are usually not
contiguous. This module recognises the page of one block of one layer inside that buffer from the
strides alone and copies it whole, by byte range. For CPU caches with dense pages it can also hand out
the pages' addresses (:meth:`PagedKV.segments`), so the pool client copies between them and the pool
directly, in one pass, with no staging buffer.

A pool chunk holds ``blocks_per_chunk`` consecutive KV blocks of one request, for every attention
layer of this TP rank, packed as::

    chunk[layer][block_in_chunk][page bytes]      (C order, no padding, no header)

``page bytes`` are the block's bytes in the order they sit in the engine's memory: ``[H, N, C]``
for the head-major layouts (``LBHNC``, ``BLHNC``, and ``LHBNC``/``BHLNC``, whose head planes are
concatenated), ``[N, H, C]`` for the token-major ones (``LBNHC``, ``BLNHC``). When vLLM splits a
manager block into several kernel blocks, the kernel pages follow each other. A page that is one
dense range of memory (every layout but ``LHBNC`` and ``BHLNC``) is copied with one range copy.

What the bytes *mean* is decided by the attention backend that reads them: GPU backends read the
content dim as K then V of each token (``kv.transpose(1, 2).split(head_size, -1)``), the CPU backend
reads each head's ``[N, 2*D]`` as ``[2*N, D]`` (all K rows, then all V rows). So the format's
identity (:attr:`PagedKV.format`) names the backend, the page order and the dtype, and goes into every
chunk key: engines that would read each other's bytes differently never share a key.

A chunk holds the KV heads of the rank that stored it. An engine of another TP size loads it through
:meth:`PagedKV.reshard`: the page is ``[units before the head dim, heads, bytes after it]`` in the page
order (the same for any head count: it is in the format, hence in the key), so the heads a loader holds are
sliced out of each stored piece and laid side by side into the chunk that loader would have stored.

MLA caches (``latent=True``) hold one latent vector per token and layer, ``[blocks, 1, tokens, latent]``
(DeepSeek-V2/V3: 512 compressed KV + 64 rope key = 576 wide); their pages are copied the same way, and the
format says ``latent<width>`` instead of a head count, so an MLA chunk never shares a key with a paged K/V
chunk. The latent is the same on every TP rank. Other shapes are refused at registration with a message
naming them, instead of producing wrong bytes later. Only ``torch`` is imported here.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
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
    storage (no copy), one ``[num_blocks, *page]`` view per layer. ``gather`` and ``scatter`` are the
    only code that moves KV bytes here; :meth:`segments` says where they are, for copies made elsewhere.
    """

    def __init__(
        self,
        format: str,
        layer_names: list[str],
        views: list[torch.Tensor],
        block_bytes: int,
        num_blocks: int,
        heads: tuple[int, int, int] = (1, 1, 0),
    ) -> None:
        self.format = format
        self.layer_names = layer_names
        self._views = views
        self._page_shape = tuple(views[0].shape[1:])
        self.block_bytes = block_bytes
        self.num_blocks = num_blocks
        # A page as [outer, heads, inner] bytes: outer units before the head dim, the head count,
        # bytes of one head after it (the dims around the heads do not depend on the TP size).
        self.page_outer, self.heads, self.head_inner = heads
        self.device = views[0].device
        # On a GPU, every layer as one [layers, blocks, *page] view when vLLM's one buffer spaces them
        # evenly (it does for every KVCacheLayout): one gather or scatter kernel per chunk, not one per
        # layer. Not on the CPU, where indexing a strided view along its second dim is far slower
        # (measured: under 0.1 GB/s against several GB/s a layer at a time).
        stacked = _all_layers_view(views)
        self._all = stacked if self.device.type == "cuda" else None
        # The copies move the widest element the pages allow (8 bytes where they can), not one byte: a
        # byte-wise gather of a ~100 GiB cache runs 8 times the threads and needs 64-bit index maths
        # sooner. The uint8 views stay for the byte arithmetic (segments, tests).
        self._elt = _widest([*views, *([stacked] if stacked is not None else [])])
        self._wide_views = [view.view(self._elt) for view in views]
        self._wide_page = tuple(self._wide_views[0].shape[1:])

    @property
    def _wide_all(self) -> torch.Tensor | None:
        return self._all.view(self._elt) if self._all is not None else None

    @property
    def num_layers(self) -> int:
        return len(self._views)

    @property
    def dense(self) -> bool:
        """True when every page is one range of memory (one copy per block and layer)."""
        return len(self._page_shape) == 1

    def mark(self) -> torch.cuda.Event | None:
        """An event behind the work queued so far on this thread's current stream (the engine's), or None on the CPU.

        A copy on another stream that waits for it (``Stream.wait_event``) runs after that work: a load
        must not overwrite blocks a kernel still reads, nor a save read blocks a kernel still writes.
        """
        if self.device.type != "cuda":
            return None
        # blocking: a host that waits for it (fence) sleeps instead of spinning a core.
        event = torch.cuda.Event(blocking=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def fence(self) -> Callable[[], None]:
        """A wait for the KV computed so far, for a copy that runs on another thread.

        Called on the engine's thread after a forward; the copy thread calls the result before it
        reads blocks. On a GPU it waits for an event recorded behind the forward's kernels on the
        engine's stream; on the CPU the forward has finished by the time this is called.
        """
        event = self.mark()
        return _no_wait if event is None else event.synchronize

    @property
    def direct(self) -> bool:
        """True when :meth:`segments` can describe a chunk: dense pages in CPU memory, addressable by pointer."""
        return self.dense and self.device.type == "cpu" and all(view.stride(1) == 1 for view in self._views)

    def segments(self, block_ids: Sequence[int | None]) -> list[tuple[int, int]]:
        """Where a chunk's bytes sit in the engine: ``(address, length)`` per page, in packed order.

        One page per layer and per entry of ``block_ids`` (the chunk's blocks in order), layer-major,
        exactly the order of ``chunk[layer][block_in_chunk][page bytes]``. A ``None`` entry, a block the
        caller does not want (a load of part of a chunk), gives ``(0, length)``. The addresses are valid
        while the engine's KV cache tensors are (an engine going to sleep frees them). Raises
        :class:`KVLayoutError` unless :attr:`direct`, ``IndexError`` for a block id out of range (an
        address past the cache would be written to blindly).
        """
        if not self.direct:
            raise KVLayoutError(f"{self.format} on {self.device}: pages are not dense CPU memory; use gather/scatter")
        for block_id in block_ids:
            if block_id is not None and not 0 <= block_id < self.num_blocks:
                raise IndexError(f"block id {block_id} is outside the KV cache's {self.num_blocks} blocks")
        page = self.block_bytes
        out = []
        for view in self._views:
            base, step = view.data_ptr(), view.stride(0)
            out += [(0, page) if b is None else (base + b * step, page) for b in block_ids]
        return out

    def geometry(self, blocks_per_chunk: int) -> ChunkGeometry:
        return ChunkGeometry(self.num_layers, blocks_per_chunk, self.block_bytes)

    def chunk_view(self, buf: memoryview | bytearray | torch.Tensor, blocks_per_chunk: int) -> torch.Tensor:
        """A ``[layers, blocks_per_chunk, block_bytes]`` uint8 tensor over ``buf`` (no copy)."""
        geo = self.geometry(blocks_per_chunk)
        flat = buf.view(torch.uint8).reshape(-1) if isinstance(buf, torch.Tensor) else _frombuffer(buf)
        if flat.numel() != geo.chunk_bytes:
            raise ValueError(f"chunk buffer holds {flat.numel()} bytes, layout needs {geo.chunk_bytes}")
        return flat.view(geo.num_layers, blocks_per_chunk, geo.block_bytes)

    def reshard(
        self,
        pieces: Sequence[tuple[tuple[int, int], memoryview | bytearray | torch.Tensor]],
        heads: tuple[int, int],
        blocks_per_chunk: int,
    ) -> torch.Tensor:
        """This engine's chunk of KV heads ``heads`` cut and joined from chunks of other head ranges.

        ``pieces`` are ``((start, end), packed chunk)`` of an engine with another TP size: the same
        format, so the same page order, with ``end - start`` heads. Each page's head dim is sliced and
        the slices laid side by side in head order; the result (``[layers, blocks, block_bytes]``, host
        memory) is what this engine would have stored itself, ready for :meth:`scatter`. Raises
        ``ValueError`` when the pieces do not cover ``heads`` or a piece is not the size its heads make.
        """
        lo, hi = heads
        if hi - lo != self.heads:
            raise ValueError(f"heads {lo}-{hi} are not this engine's {self.heads} per page")
        shape = (self.num_layers, blocks_per_chunk, self.page_outer)
        out = torch.empty((*shape, self.heads, self.head_inner), dtype=torch.uint8)
        covered = 0
        for (start, end), buf in pieces:
            a, b = max(lo, start), min(hi, end)
            if a >= b:
                continue
            flat = buf.view(torch.uint8).reshape(-1) if isinstance(buf, torch.Tensor) else _frombuffer(buf)
            want = self.num_layers * blocks_per_chunk * self.page_outer * (end - start) * self.head_inner
            if flat.numel() != want:
                raise ValueError(f"the chunk of heads {start}-{end} holds {flat.numel()} bytes, not {want}")
            src = flat.view(*shape, end - start, self.head_inner)
            out[:, :, :, a - lo : b - lo] = src[:, :, :, a - start : b - start]
            covered += b - a
        if covered != self.heads:
            raise ValueError(f"the chunks cover {covered} of heads {lo}-{hi}")
        return out.view(self.num_layers, blocks_per_chunk, self.block_bytes)

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """Copy blocks ``block_ids`` of every layer into ``out`` (``[layers, len(ids), block_bytes]``).

        ``out`` on the cache's device gets one gather kernel, queued on the current stream (after the
        kernels that computed the KV, when that is the stream they ran on); ``out`` elsewhere (host
        memory) gets the gather and one copy, which returns once the bytes are there.
        """
        n = len(block_ids)
        ids = index_tensor(block_ids, self.device)
        same_device = out.device == self.device
        wide = out.view(self._elt)
        if self._wide_all is not None:
            dst = wide.view(self.num_layers, n, *self._wide_page)
            if same_device:
                torch.index_select(self._wide_all, 1, ids, out=dst)
            else:
                dst.copy_(self._wide_all.index_select(1, ids))
            return
        for layer, view in enumerate(self._wide_views):
            dst = wide[layer].view(n, *self._wide_page)
            if same_device:
                torch.index_select(view, 0, ids, out=dst)
            else:
                dst.copy_(view.index_select(0, ids))

    def scatter(self, src: torch.Tensor, slots: Sequence[tuple[int, int]]) -> None:
        """Copy packed blocks into the engine: ``slots`` is ``(block_in_chunk, dst_block_id)`` pairs.

        ``src`` (``[layers, blocks_per_chunk, block_bytes]``) on the cache's device is scattered by
        kernels queued on the current stream, one per chunk; ``src`` in host memory is copied over
        first (the CPU; a GPU's loads stage through ``StagedCopier``, which copies it on its stream).
        """
        if not slots:
            return
        if src.device != self.device:
            src = src.to(self.device)
        src = src.view(self._elt)
        dst = index_tensor([d for _, d in slots], self.device)
        picked = [s for s, _ in slots]
        if picked != list(range(src.shape[1])):
            src = src.index_select(1, index_tensor(picked, self.device))
        blocks = src.view(self.num_layers, len(slots), *self._wide_page)
        if self._wide_all is not None:
            self._wide_all.index_copy_(1, dst, blocks)
            return
        for layer, view in enumerate(self._wide_views):
            view.index_copy_(0, dst, blocks[layer])


def index_tensor(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """``ids`` as an int64 index on ``device`` (64-bit: offsets in a cache past 2 GiB elements stay exact).

    To a GPU through pinned host memory, copied without blocking on the current stream: a tensor built
    with ``device=cuda`` is copied from pageable memory, which waits for the stream to drain first, so a
    lane's next copy could never overlap the one before. The caching host allocator keeps the pinned
    buffer until the copy has run.
    """
    host = torch.tensor(list(ids), dtype=torch.int64)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


# Element types a page can be copied as, widest first (int: the bytes are moved, never interpreted).
_WIDE_ELEMENTS = (torch.int64, torch.int32, torch.int16)


def _widest(views: Sequence[torch.Tensor]) -> torch.dtype:
    """The widest element every one of ``views`` (uint8, last dim contiguous) can be viewed as, else uint8."""
    for dtype in _WIDE_ELEMENTS:
        size = dtype.itemsize
        if all(
            v.stride(-1) == 1
            and v.shape[-1] % size == 0
            and v.storage_offset() % size == 0
            and all(step % size == 0 for step in v.stride()[:-1])
            for v in views
        ):
            return dtype
    return torch.uint8


def _all_layers_view(views: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``views`` stacked without a copy, when they are evenly spaced slices of one storage; else None."""
    first = views[0]
    storage = first.untyped_storage().data_ptr()
    step = views[1].storage_offset() - first.storage_offset() if len(views) > 1 else 0
    for layer, view in enumerate(views):
        same = view.untyped_storage().data_ptr() == storage and view.stride() == first.stride()
        if not same or view.storage_offset() != first.storage_offset() + layer * step:
            return None
    if len(views) > 1 and step <= 0:
        return None
    return first.as_strided((len(views), *first.shape), (step, *first.stride()), first.storage_offset())


def _no_wait() -> None:
    pass


def _frombuffer(buf: memoryview | bytearray) -> torch.Tensor:
    with warnings.catch_warnings():
        # Read-only buffers come back as read-only memoryviews; the callers only read them.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=torch.uint8)


def describe_kv_caches(
    kv_caches: Mapping[str, torch.Tensor],
    *,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    backend: str,
    latent: bool = False,
) -> PagedKV:
    """Recognise the pages of the engine's KV cache from the registered views, or raise :class:`KVLayoutError`.

    ``num_blocks`` is the KV cache manager's block count, ``block_size`` its tokens per block,
    ``num_kv_heads`` per TP rank, ``backend`` the name of the attention backend reading the cache.
    ``latent``: an MLA cache, one ``head_size``-wide latent per token (``num_kv_heads`` 1), no separate V.
    All layers must share one shape, stride pattern and dtype.
    """
    if not kv_caches:
        raise KVLayoutError("no KV cache tensors were registered (attention-free model?)")
    names = list(kv_caches)
    first = kv_caches[names[0]]
    for layer_name in names[1:]:
        t = kv_caches[layer_name]
        if t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype:
            raise KVLayoutError(
                f"layer {layer_name} has shape {tuple(t.shape)} stride {t.stride()} {t.dtype}, unlike "
                f"{names[0]} {tuple(first.shape)} {first.stride()} {first.dtype}: mixed layouts are not supported"
            )
    dims, page_order, outer = _page_dims(first, num_blocks, block_size, num_kv_heads, head_size, latent=latent)
    views = [_page_view(kv_caches[name], num_blocks, dims) for name in names]
    block_bytes = 1
    for size, _ in dims:
        block_bytes *= size
    kind = f"latent{head_size}:" if latent else ""
    fmt = f"{backend}:{kind}{page_order}:{str(first.dtype).removeprefix('torch.')}"
    heads = first.shape[1]
    return PagedKV(fmt, names, views, block_bytes, num_blocks, (outer, heads, block_bytes // (outer * heads)))


def _page_dims(
    t: torch.Tensor, num_blocks: int, block_size: int, heads: int, head_size: int, *, latent: bool = False
) -> tuple[list[tuple[int, int]], str, int]:
    """The page of one block as ``(size, byte stride)`` runs, outermost first, its dim order, and how many
    units of the dims before the head dim the page holds (the head dim's place, for :meth:`PagedKV.reshard`)."""
    shape, stride = tuple(t.shape), t.stride()
    where = f"KV cache tensor of shape {shape}, stride {stride}, dtype {t.dtype}"
    if t.dim() != 4:
        raise KVLayoutError(f"unsupported {where}: expected vLLM's 4-D [blocks, heads, tokens, content] view")
    kernel_blocks, h, kernel_tokens, content = shape
    if latent:
        if h != 1 or heads != 1 or content != head_size:
            raise KVLayoutError(
                f"unsupported {where}: expected an MLA latent cache [blocks, 1, tokens, {head_size}] "
                f"(one latent of {head_size} per token)"
            )
    elif h == 1 and content == head_size:
        raise KVLayoutError(
            f"unsupported {where}: this looks like an MLA latent cache [blocks, 1, tokens, {content}], "
            "but vLLM's KV cache spec for these layers is not MLA"
        )
    elif h != heads or content != 2 * head_size:
        raise KVLayoutError(
            f"unsupported {where}: expected [blocks, {heads}, tokens, {2 * head_size}] "
            f"(K and V of {heads} KV heads of size {head_size})"
        )
    ratio = kernel_blocks // num_blocks if num_blocks > 0 else 0
    if ratio <= 0 or kernel_blocks % num_blocks or kernel_tokens * ratio != block_size:
        raise KVLayoutError(
            f"unsupported {where}: {kernel_blocks} kernel blocks of {kernel_tokens} tokens do not split "
            f"{num_blocks} blocks of {block_size} tokens evenly"
        )
    if stride[3] != 1:
        raise KVLayoutError(f"unsupported {where}: the content dim is not contiguous")
    elt = t.element_size()
    # Dims inside one manager block, in logical order: kernel block, head, token, content (bytes).
    # Sorting by stride gives their order in memory (stable, so size-1 dims keep logical order).
    dims = [("K", ratio, stride[0] * elt), ("H", h, stride[1] * elt), ("N", kernel_tokens, stride[2] * elt)]
    dims.append(("C", content * elt, 1))
    # A single head's stride ties with the token stride of a token-major page: the larger dim goes
    # first, so one head per rank (high TP) gives the same order, hence the same format, as many.
    in_memory = sorted(dims, key=lambda d: (-d[2], d[1] == 1))
    page_order = "".join(name for name, size, _ in in_memory if name != "K" or size > 1)
    outer = 1
    for name, size, _ in in_memory:
        if name == "H":
            break
        outer *= size
    # Merge dims that continue each other in memory; a dense page collapses into one run.
    runs: list[tuple[int, int]] = []
    for _, size, step in reversed(in_memory):
        if size == 1:
            continue
        if runs and step == runs[0][0] * runs[0][1]:
            runs[0] = (runs[0][0] * size, runs[0][1])
        else:
            runs.insert(0, (size, step))
    extent = 1
    for size, step in reversed(runs):
        if step < extent:
            raise KVLayoutError(f"unsupported {where}: the dims of one block overlap in memory")
        extent = (size - 1) * step + extent
    if len(runs) == 1 and stride[0] * elt * ratio < extent:
        raise KVLayoutError(f"unsupported {where}: consecutive blocks overlap in memory")
    return runs, page_order, outer


def _page_view(t: torch.Tensor, num_blocks: int, runs: list[tuple[int, int]]) -> torch.Tensor:
    """A uint8 ``[num_blocks, *run sizes]`` view over ``t``'s storage, one page per row."""
    elt = t.element_size()
    ratio = t.shape[0] // num_blocks
    return t.view(torch.uint8).as_strided(
        (num_blocks, *[size for size, _ in runs]),
        (t.stride(0) * elt * ratio, *[step for _, step in runs]),
        t.storage_offset() * elt,
    )
