"""First-fit extent allocator with coalescing, over offsets of the pool's data region.

Why this design: chunks of one deployment all have one size (K and V of every layer for one chunk
of tokens), but models sharing a pool differ, so fixed slots would either waste memory or refuse
some models. A free list of extents handles any mix; with a single chunk size it degenerates to
"every free extent fits", so it never fragments. Sizes are rounded up to ``align`` (4 KiB by
default) so every chunk starts on a page boundary.

Free extents are kept sorted by offset (``_starts`` + ``_sizes``) so freeing merges with both
neighbours in O(log n) lookups. Allocation scans first-fit from the lowest offset; the number of
free extents stays small because neighbours always merge.

A pool spread over several devices gets one extent allocator per device (:class:`RegionAllocator`);
the device index sits in the high bits of every offset, so a chunk never straddles two devices.

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


# Offsets of region i start at i << REGION_SHIFT: a chunk can never straddle two devices, and the
# region of any offset is one shift away. 2**44 bytes (16 TiB) per device is far beyond CXL sizes.
REGION_SHIFT = 44


def split_offset(offset: int) -> tuple[int, int]:
    """(region, offset inside the region) of a pool offset."""
    return offset >> REGION_SHIFT, offset & ((1 << REGION_SHIFT) - 1)


class RegionAllocator:
    """One :class:`ExtentAllocator` per memory region (device), behind one offset space.

    Allocation is first fit across regions in order, so a single-region pool behaves exactly like
    its one extent allocator.
    """

    def __init__(self, capacities: list[int], align: int = 4096) -> None:
        if not capacities:
            raise ValueError("a pool needs at least one memory region")
        for cap in capacities:
            if cap >= 1 << REGION_SHIFT:
                raise ValueError(f"region of {cap} bytes exceeds the {1 << REGION_SHIFT}-byte limit")
        self.align = align
        self._regions = [ExtentAllocator(cap, align) for cap in capacities]

    @property
    def capacity(self) -> int:
        return sum(r.capacity for r in self._regions)

    @property
    def used(self) -> int:
        return sum(r.used for r in self._regions)

    @property
    def capacities(self) -> list[int]:
        return [r.capacity for r in self._regions]

    def round(self, nbytes: int) -> int:
        return self._regions[0].round(nbytes)

    def alloc(self, nbytes: int) -> int | None:
        for index, region in enumerate(self._regions):
            offset = region.alloc(nbytes)
            if offset is not None:
                return (index << REGION_SHIFT) | offset
        return None

    def free(self, offset: int, nbytes: int) -> None:
        index, local = split_offset(offset)
        self._regions[index].free(local, nbytes)

    def largest_free(self) -> int:
        return max(r.largest_free() for r in self._regions)

    def largest_region(self) -> int:
        return max(r.capacity for r in self._regions)

    def free_extents(self) -> list[tuple[int, int]]:
        return [
            ((index << REGION_SHIFT) | start, size)
            for index, region in enumerate(self._regions)
            for start, size in region.free_extents()
        ]
