from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from maru_pool.allocator import ExtentAllocator, RegionAllocator, split_offset


def test_uniform_chunks_fill_the_pool_exactly() -> None:
    a = ExtentAllocator(10 * 4096)
    offsets = [a.alloc(4096) for _ in range(10)]
    assert sorted(offsets) == [i * 4096 for i in range(10)]
    assert a.alloc(1) is None
    a.free(offsets[3], 4096)
    assert a.alloc(4000) == offsets[3]


def test_free_coalesces_both_neighbours() -> None:
    a = ExtentAllocator(3 * 4096)
    x, y, z = (a.alloc(4096) for _ in range(3))
    a.free(x, 4096)
    a.free(z, 4096)
    assert a.largest_free() == 4096
    a.free(y, 4096)
    assert a.free_extents() == [(0, 3 * 4096)]
    assert a.used == 0


def test_sizes_round_up_to_alignment() -> None:
    a = ExtentAllocator(1 << 20, align=256)
    assert a.alloc(1) == 0
    assert a.alloc(257) == 256
    assert a.alloc(10) == 768
    assert a.used == 1024


def test_double_free_is_refused() -> None:
    a = ExtentAllocator(4 * 4096)
    x = a.alloc(4096)
    a.free(x, 4096)
    with pytest.raises(ValueError, match="double free"):
        a.free(x, 4096)


def test_mixed_sizes_reuse_holes() -> None:
    a = ExtentAllocator(16 * 4096)
    big = a.alloc(8 * 4096)
    small = a.alloc(4096)
    a.free(big, 8 * 4096)
    # First fit: two 4-page chunks land in the hole the big one left.
    assert a.alloc(4 * 4096) == 0
    assert a.alloc(4 * 4096) == 4 * 4096
    assert small == 8 * 4096


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5 * 4096), st.integers(0, 1000)), max_size=80))
def test_random_alloc_free_never_overlaps(ops: list[tuple[bool, int, int]]) -> None:
    a = ExtentAllocator(32 * 4096)
    live: dict[int, int] = {}
    for is_alloc, size, pick in ops:
        if is_alloc or not live:
            off = a.alloc(size)
            if off is None:
                assert a.largest_free() < a.round(size)
                continue
            live[off] = a.round(size)
        else:
            off = sorted(live)[pick % len(live)]
            a.free(off, live.pop(off))
        regions = sorted([*live.items(), *a.free_extents()])
        for (o1, s1), (o2, _) in itertools.pairwise(regions):
            assert o1 + s1 <= o2
        assert sum(s for _, s in regions) == a.capacity
        assert a.used == sum(live.values())


def test_regions_never_share_a_chunk_and_fill_in_order() -> None:
    a = RegionAllocator([2 * 4096, 3 * 4096])
    offsets = [a.alloc(4096) for _ in range(5)]
    assert [split_offset(o)[0] for o in offsets] == [0, 0, 1, 1, 1]
    assert a.alloc(1) is None
    assert a.capacity == 5 * 4096 and a.used == 5 * 4096
    a.free(offsets[0], 4096)
    a.free(offsets[1], 4096)
    # 2 pages free in region 0 and none in region 1: a 3-page chunk must not straddle.
    assert a.alloc(3 * 4096) is None
    assert split_offset(a.alloc(2 * 4096)) == (0, 0)


def test_region_offsets_round_trip() -> None:
    a = RegionAllocator([4096, 4096, 4096])
    for expected_region in range(3):
        region, local = split_offset(a.alloc(4096))
        assert (region, local) == (expected_region, 0)
