"""First-fit extent allocator with coalescing, over offsets of the pool's data region.

Why this design: chunks of one deployment all have one size (K and V of every layer for one chunk
of tokens), but models sharing a pool differ, so fixed slots would either waste memory or refuse
some models. A free list of extents handles any mix; with a single chunk size it degenerates to
"every free extent fits", so it never fragments. Sizes are rounded up to ``align`` (4 KiB by
default) so every chunk starts on a page boundary.

Free extents are kept sorted by offset (``_starts`` + ``_sizes``) so freeing merges with both
neighbours in O(log n) lookups. Allocation scans first-fit from the lowest offset; the number of
free extents stays small because neighbours always merge.

The allocator knows nothing of keys, leases or eviction: the index decides what to free.
"""

from __future__ import annotations

import bisect


class ExtentAllocator:
    def __init__(self, capacity: int, align: int = 4096) -> None:
        if align <= 0 or align & (align - 1):
            raise ValueError(f"align must be a power of two, got {align}")
        self.align = align
        # The tail that is not a whole alignment unit is never handed out.
        self.capacity = capacity - capacity % align
        self._starts: list[int] = [0] if self.capacity else []
        self._sizes: dict[int, int] = {0: self.capacity} if self.capacity else {}
        self.used = 0

    def round(self, nbytes: int) -> int:
        return -(-nbytes // self.align) * self.align

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a free region of at least ``nbytes`` (rounded), or None when no extent is large enough."""
        if nbytes <= 0:
            raise ValueError(f"allocation size must be positive, got {nbytes}")
        size = self.round(nbytes)
        for i, start in enumerate(self._starts):
            extent = self._sizes[start]
            if extent < size:
                continue
            del self._sizes[start]
            if extent == size:
                del self._starts[i]
            else:
                self._starts[i] = start + size
                self._sizes[start + size] = extent - size
            self.used += size
            return start
        return None

    def free(self, offset: int, nbytes: int) -> None:
        """Return a region from :meth:`alloc`; merges with free neighbours."""
        size = self.round(nbytes)
        if offset % self.align or offset < 0 or offset + size > self.capacity:
            raise ValueError(f"free of [{offset}, {offset + size}) outside the pool or unaligned")
        i = bisect.bisect_left(self._starts, offset)
        if i < len(self._starts) and self._starts[i] < offset + size:
            raise ValueError(f"double free: [{offset}, {offset + size}) overlaps a free extent")
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._sizes[prev] > offset:
                raise ValueError(f"double free: [{offset}, {offset + size}) overlaps a free extent")
        self.used -= size
        # Merge with the following extent.
        if i < len(self._starts) and self._starts[i] == offset + size:
            size += self._sizes.pop(self._starts[i])
            del self._starts[i]
        # Merge with the preceding extent.
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._sizes[prev] == offset:
                self._sizes[prev] += size
                return
        self._starts.insert(i, offset)
        self._sizes[offset] = size

    def largest_free(self) -> int:
        return max(self._sizes.values(), default=0)

    def free_extents(self) -> list[tuple[int, int]]:
        return [(start, self._sizes[start]) for start in self._starts]
