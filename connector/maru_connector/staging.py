"""Staged copies between the engine's KV cache and host memory, for caches the pool cannot reach directly.

GPU caches (and CPU caches whose pages are split) go through host memory that the pool client copies
and checksums in one pass. This module moves the chunk between that host memory and the cache the way
LMCache's and NIXL's GPU paths do:

* one non-blocking CUDA stream per lane (a :class:`StagedCopier` belongs to one lane), so copies never
  queue behind, or hold up, the engine's kernels on its own stream;
* pinned host buffers (two, so the pool copy of one chunk overlaps the device copy of the next) and
  one device buffer of a whole chunk;
* per chunk one gather (or scatter) kernel over every layer (``PagedKV``) and one copy across PCIe;
* events, not stream or device synchronisation: the host waits only for the copy it needs next, on
  blocking events (the thread sleeps instead of spinning a core);
* ordered against the engine: a save's lane waits for ``PagedKV.fence`` (taken behind the forward),
  a load's stream for ``PagedKV.mark`` taken on the engine's stream when the load is handed over
  (:meth:`StagedCopier.after`);
* the lane thread works on the rank's device (``lane.Lane.use_device``), and the device buffer is
  allocated under the lane's stream.

On the CPU the same calls run without streams or events: the gather and scatter are plain copies
into and out of the host buffer, exactly the path the connector took before.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from maru_connector.layout import PagedKV

# Host buffers per lane: one being copied to or from the pool while the other crosses PCIe.
HOST_BUFFERS = 2


class StagedCopier:
    """One lane's staging: host buffers, a device buffer and a stream (the last two on a GPU only).

    Not thread-safe: each lane owns its copier, and a lane runs one job at a time.
    """

    def __init__(self, paged: PagedKV, blocks_per_chunk: int) -> None:
        self.paged = paged
        self.blocks_per_chunk = blocks_per_chunk
        self.chunk_bytes = paged.geometry(blocks_per_chunk).chunk_bytes
        self.cuda = paged.device.type == "cuda"
        self._host = [host_buffer(self.chunk_bytes, pinned=self.cuda) for _ in range(HOST_BUFFERS)]
        self._stream = torch.cuda.Stream(device=paged.device) if self.cuda else None
        self._device = None
        if self._stream is not None:
            # Allocated under the lane's stream: the caching allocator ties the block to the stream that
            # uses it, not to the engine's, which never touches it.
            with torch.cuda.stream(self._stream):
                self._device = device_buffer(self.chunk_bytes, paged.device)
        # Per host buffer, the event after which no queued copy reads it any more (loads).
        self._host_free: list[torch.cuda.Event | None] = [None] * HOST_BUFFERS
        self._next = 0
        self._last: torch.cuda.Event | None = None  # after the latest scatter: what finish() waits for

    def after(self, event: torch.cuda.Event | None) -> None:
        """Order the copies queued from now on after ``event`` (``PagedKV.mark`` on the engine's thread).

        A load waits so, on the GPU and without holding the host, for the work queued before it on the
        engine's stream, as vLLM's own offloading does: a kernel still reading the blocks it overwrites
        (a preempted request's, a step not yet run) runs first. None (the CPU) waits for nothing.
        """
        if event is not None and self._stream is not None:
            self._stream.wait_event(event)

    # ------------------------------------------------------------------ saves

    def gathered(self, chunks: Sequence[Sequence[int]]) -> Iterator[np.ndarray]:
        """Each chunk's packed bytes (its block ids, in order) in host memory, in ``chunks`` order.

        A yielded array is valid until the caller asks for the next one; meanwhile the next chunk's
        gather and device-to-host copy run. Call only once the KV to copy is computed (the worker
        waits for ``PagedKV.fence`` first): the copies run on this lane's stream.
        """
        pending: deque[tuple[int, torch.cuda.Event | None]] = deque()
        for i, block_ids in enumerate(chunks):
            slot = i % HOST_BUFFERS
            pending.append((slot, self._start_gather(block_ids, slot)))
            if len(pending) == HOST_BUFFERS:
                yield self._host_ready(*pending.popleft())
        while pending:
            yield self._host_ready(*pending.popleft())

    def _start_gather(self, block_ids: Sequence[int], slot: int) -> torch.cuda.Event | None:
        host, paged = self._host[slot], self.paged
        if self._stream is None or self._device is None:
            paged.gather(block_ids, paged.chunk_view(host, len(block_ids)))
            return None
        with torch.cuda.stream(self._stream):
            paged.gather(block_ids, paged.chunk_view(self._device, len(block_ids)))
            host.copy_(self._device, non_blocking=True)
            done = _host_waits_for()
            done.record(self._stream)
        return done

    def _host_ready(self, slot: int, done: torch.cuda.Event | None) -> np.ndarray:
        if done is not None:
            done.synchronize()
        return self._host[slot].numpy()

    # ------------------------------------------------------------------ loads

    def scatter(self, fill: Callable[[np.ndarray], object], slots: Sequence[tuple[int, int]]) -> None:
        """``fill`` a host buffer with a chunk's packed bytes, then copy its ``slots`` into the cache.

        ``fill`` (the pool client's verified read) may raise: nothing reaches the cache then. On a GPU
        the copy and scatter are queued on this lane's stream and this returns at once; :meth:`finish`
        waits for every one queued so far.
        """
        slot = self._next
        self._next = (slot + 1) % HOST_BUFFERS
        host, paged = self._host[slot], self.paged
        free = self._host_free[slot]
        if free is not None:
            free.synchronize()  # the copy that last read this buffer is done
        fill(host.numpy())
        if self._stream is None or self._device is None:
            paged.scatter(paged.chunk_view(host, self.blocks_per_chunk), slots)
            return
        with torch.cuda.stream(self._stream):
            self._device.copy_(host, non_blocking=True)
            read = _host_waits_for()
            read.record(self._stream)
            paged.scatter(paged.chunk_view(self._device, self.blocks_per_chunk), slots)
            landed = _host_waits_for()
            landed.record(self._stream)
        self._host_free[slot], self._last = read, landed

    def finish(self) -> None:
        """Wait until every scatter queued so far has landed in the cache (before a load is reported)."""
        if self._last is not None:
            self._last.synchronize()
            self._last = None


def host_buffer(nbytes: int, *, pinned: bool) -> torch.Tensor:
    """A staging buffer in host memory (pinned for a GPU: copies from it run without the CPU)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


def device_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A chunk's staging buffer on ``device``, allocated on the current stream."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _host_waits_for() -> torch.cuda.Event:
    # blocking: the host thread waiting for it sleeps; the default event spins a core while it waits.
    return torch.cuda.Event(blocking=True)
