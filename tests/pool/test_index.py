"""The index's rules with a fake clock: leases, pins, LRU eviction, expiry and epochs."""

from __future__ import annotations

import pytest
from hypothesis import settings

from maru_pool.index import FULL, ORPHAN, PoolIndex, ReadGrant, StaleEpoch, WriteGrant
from tests.support.index import EPOCH, PAGE, Clock, IndexMachine, k


def make(pages: int = 4, lease_seconds: float = 10.0) -> tuple[PoolIndex, Clock]:
    clock = Clock()
    return PoolIndex(pages * PAGE, epoch=EPOCH, lease_seconds=lease_seconds, clock=clock), clock


def store(index: PoolIndex, i: int, nbytes: int = PAGE) -> WriteGrant:
    (grant,) = index.begin_write([(k(i), nbytes)])
    assert isinstance(grant, WriteGrant)
    assert index.commit(EPOCH, [(grant.lease_id, 1000 + i)]) == [True]
    return grant


def test_commit_makes_visible_with_its_checksum() -> None:
    index, _ = make()
    (grant,) = index.begin_write([(k(1), 100)])
    assert index.lookup_prefix([k(1)]) == 0
    index.commit(EPOCH, [(grant.lease_id, 42)])
    (pin,) = index.open_read([k(1)])
    assert pin == ReadGrant(pin.pin_id, grant.offset, 100, 42)


def test_full_pool_evicts_least_recently_used() -> None:
    index, _ = make(pages=3)
    for i in range(3):
        store(index, i)
    index.lookup_prefix([k(0)])  # 0 is now the most recently used; 1 is the oldest
    store(index, 3)
    assert index.lookup_prefix([k(1)]) == 0
    assert index.lookup_prefix([k(0)]) == 1 and index.lookup_prefix([k(2)]) == 1
    assert index.stats()["evictions"] == 1


def test_pinned_chunk_is_never_evicted_nor_reused() -> None:
    index, _ = make(pages=2)
    g0 = store(index, 0)
    store(index, 1)
    (pin,) = index.open_read([k(0)])  # pinned, and most recent
    index.lookup_prefix([k(1)])  # now 0 is the LRU head, but pinned
    g2 = store(index, 2)
    assert g2.offset != g0.offset
    assert index.lookup_prefix([k(0)]) == 1
    (g3,) = index.begin_write([(k(3), PAGE)])
    assert isinstance(g3, WriteGrant) and g3.offset != g0.offset
    assert index.lookup_prefix([k(2)]) == 0  # evicted in its place
    index.release(EPOCH, [pin.pin_id])
    index.check_invariants()


def test_everything_pinned_or_in_flight_means_full() -> None:
    index, _ = make(pages=2)
    store(index, 0)
    index.open_read([k(0)])
    index.begin_write([(k(1), PAGE)])
    assert index.begin_write([(k(2), PAGE)]) == [FULL]


def test_chunk_larger_than_pool_is_full_without_evicting() -> None:
    index, _ = make(pages=2)
    store(index, 0)
    assert index.begin_write([(k(1), 3 * PAGE)]) == [FULL]
    assert index.lookup_prefix([k(0)]) == 1


def test_dead_writer_leaks_nothing_after_its_lease_expires() -> None:
    index, clock = make(pages=2, lease_seconds=5)
    index.begin_write([(k(0), PAGE), (k(1), PAGE)])
    assert index.begin_write([(k(2), PAGE)]) == [FULL]
    clock.now += 4.9
    assert index.expire() == 0
    clock.now += 0.2
    assert index.expire() == 2
    stats = index.stats()
    assert stats["used_bytes"] == 0 and stats["lease_expiries"] == 2 and stats["writing"] == 0
    # The key is free to be written again by someone alive.
    assert isinstance(index.begin_write([(k(0), PAGE)])[0], WriteGrant)


def test_full_pool_reclaims_expired_leases_before_refusing() -> None:
    index, clock = make(pages=1, lease_seconds=5)
    index.begin_write([(k(0), PAGE)])
    clock.now += 6
    assert isinstance(index.begin_write([(k(1), PAGE)])[0], WriteGrant)
    assert index.stats()["lease_expiries"] == 1


def test_commit_after_expiry_is_refused() -> None:
    index, clock = make(lease_seconds=5)
    (grant,) = index.begin_write([(k(0), PAGE)])
    clock.now += 6
    index.expire()
    assert index.commit(EPOCH, [(grant.lease_id, 1)]) == [False]
    assert index.lookup_prefix([k(0)]) == 0


def test_expired_pin_unpins() -> None:
    index, clock = make(pages=1, lease_seconds=5)
    store(index, 0)
    index.open_read([k(0)])
    assert index.begin_write([(k(1), PAGE)]) == [FULL]
    clock.now += 6
    index.expire()
    assert isinstance(index.begin_write([(k(1), PAGE)])[0], WriteGrant)


def test_other_epoch_is_refused_and_counted() -> None:
    index, _ = make()
    (grant,) = index.begin_write([(k(0), PAGE)])
    with pytest.raises(StaleEpoch):
        index.commit(EPOCH - 1, [(grant.lease_id, 1)])
    with pytest.raises(StaleEpoch):
        index.release(EPOCH + 1, [grant.lease_id])
    assert index.stats()["errors"] == 2
    assert index.lookup_prefix([k(0)]) == 0


def test_a_pin_id_cannot_commit_and_a_lease_id_cannot_release() -> None:
    index, _ = make()
    store(index, 0)
    (pin,) = index.open_read([k(0)])
    (grant,) = index.begin_write([(k(1), PAGE)])
    assert index.commit(EPOCH, [(pin.pin_id, 5)]) == [False]
    index.release(EPOCH, [grant.lease_id])
    assert index.stats()["writing"] == 1
    assert index.commit(EPOCH, [(grant.lease_id, 5)]) == [True]


def test_corrupt_report_drops_chunk_and_frees_space_at_last_unpin() -> None:
    index, _ = make(pages=2)
    store(index, 0)
    (p1,) = index.open_read([k(0)])
    (p2,) = index.open_read([k(0)])
    index.release(EPOCH, [p1.pin_id], corrupt=[p1.pin_id])
    assert index.lookup_prefix([k(0)]) == 0
    assert index.stats()["used_bytes"] == PAGE  # still pinned by p2
    index.release(EPOCH, [p2.pin_id])
    assert index.stats()["used_bytes"] == 0
    index.check_invariants()


def test_abort_frees_and_unknown_abort_is_harmless() -> None:
    index, _ = make()
    (grant,) = index.begin_write([(k(0), PAGE)])
    index.abort(EPOCH, [grant.lease_id, 12345])
    assert index.stats()["used_bytes"] == 0
    index.abort(EPOCH, [grant.lease_id])
    index.check_invariants()


def chain(index: PoolIndex, prompt: str, chunks: range | list[int]) -> list[bytes]:
    """Store chunks of one prompt in one batch, each naming the chunk before it as its parent."""
    keys = [pk(prompt, i) for i in chunks]
    grants = index.begin_write([(pk(prompt, i), PAGE, pk(prompt, i - 1) if i else None) for i in chunks])
    assert all(isinstance(g, WriteGrant) for g in grants), grants
    assert index.commit(EPOCH, [(g.lease_id, 1) for g in grants]) == [True] * len(grants)
    return keys


def pk(prompt: str, i: int) -> bytes:
    return f"{prompt}:{i}".encode().ljust(32, b"\0")


def survivors(index: PoolIndex, prompt: str, n: int) -> list[int]:
    return [i for i in range(n) if pk(prompt, i) in index._chunks]


def test_what_survives_of_a_prompt_is_always_a_prefix() -> None:
    """A prefill stores a prompt over two steps; pressure from the next prompt must cut its tail."""
    index, _ = make(pages=10)
    index.lookup_prefix([pk("A", i) for i in range(8)])  # the prefill's lookup: a miss
    chain(index, "A", range(4))  # chunks completed in the first step
    chain(index, "A", range(4, 8))  # ... and in the second
    index.lookup_prefix([pk("B", i) for i in range(4)])
    chain(index, "B", range(2))
    chain(index, "B", range(2, 4))
    kept = survivors(index, "A", 8)
    assert kept == list(range(len(kept))), f"A keeps {kept}: not a prefix"
    assert index.lookup_prefix([pk("A", i) for i in range(8)]) == len(kept) == 6
    index.check_invariants()


def test_lookups_age_a_prompts_tail_before_its_head() -> None:
    index, _ = make(pages=6)
    chain(index, "A", range(3))
    chain(index, "B", range(3))
    index.lookup_prefix([pk("A", i) for i in range(3)])  # A used again: B is now the older prompt
    chain(index, "C", range(2))
    assert survivors(index, "A", 3) == [0, 1, 2]
    assert survivors(index, "B", 3) == [0]


def test_a_chunk_whose_parent_is_missing_is_refused() -> None:
    index, _ = make(pages=6)
    assert index.begin_write([(pk("A", 1), PAGE, pk("A", 0))]) == [ORPHAN]
    assert index.stats()["used_bytes"] == 0 and index.stats()["orphans"] == 1
    # Parent and child in one batch: the child is granted while its parent is being written ...
    parent, child = index.begin_write([(pk("A", 0), PAGE, None), (pk("A", 1), PAGE, pk("A", 0))])
    # ... but committed only after it: a child whose parent never made it is refused and freed.
    index.abort(EPOCH, [parent.lease_id])
    assert index.commit(EPOCH, [(child.lease_id, 1)]) == [False]
    assert index.stats()["used_bytes"] == 0
    index.check_invariants()


def test_a_corrupt_chunk_takes_its_descendants_with_it() -> None:
    index, _ = make(pages=6)
    chain(index, "A", range(4))
    (pin,) = index.open_read([pk("A", 1)])
    index.release(EPOCH, [pin.pin_id], [pin.pin_id])
    assert survivors(index, "A", 4) == [0]
    assert index.stats()["used_bytes"] == PAGE
    index.check_invariants()


def test_a_pinned_leaf_is_skipped_and_the_parent_of_a_new_chunk_is_spared() -> None:
    index, _ = make(pages=4)
    chain(index, "A", range(2))
    chain(index, "B", range(1))
    chain(index, "C", range(1))
    (pin,) = index.open_read([pk("A", 1)])  # A is the oldest prompt, but its leaf is being read
    (grant,) = index.begin_write([(pk("B", 1), PAGE, pk("B", 0))])  # B:0 is older than C:0, yet needed
    assert isinstance(grant, WriteGrant)
    assert survivors(index, "A", 2) == [0, 1] and survivors(index, "B", 1) == [0]
    assert survivors(index, "C", 1) == []
    index.release(EPOCH, [pin.pin_id])
    index.check_invariants()


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_without_eviction_a_full_pool_refuses_but_still_reclaims_dead_leases() -> None:
    clock = Clock()
    index = PoolIndex(2 * PAGE, epoch=EPOCH, lease_seconds=5, evict=False, clock=clock)
    store(index, 0)
    index.begin_write([(k(1), PAGE)])  # a writer that will die
    assert index.begin_write([(k(2), PAGE)]) == [FULL]
    assert index.lookup_prefix([k(0)]) == 1 and index.stats()["evictions"] == 0
    clock.now += 6
    assert isinstance(index.begin_write([(k(2), PAGE)])[0], WriteGrant)


def test_chunks_spread_over_regions() -> None:
    index = PoolIndex([PAGE, 2 * PAGE], epoch=EPOCH)
    grants = index.begin_write([(k(i), PAGE) for i in range(3)])
    assert all(isinstance(g, WriteGrant) for g in grants)
    assert index.capacity == 3 * PAGE and index.capacities == [PAGE, 2 * PAGE]
    assert index.begin_write([(k(9), 2 * PAGE)]) == [FULL]  # fits no single region once full
    index.check_invariants()


def test_renew_keeps_a_pin_past_its_first_deadline() -> None:
    index, clock = make(pages=1, lease_seconds=5)
    store(index, 0)
    (pin,) = index.open_read([k(0)])
    assert index.begin_write([(k(1), PAGE)]) == [FULL]
    clock.now += 4
    assert index.renew(EPOCH, [pin.pin_id, 424242]) == [True, False]
    clock.now += 4  # 8 s after the pin, 4 s after the renewal
    assert index.expire() == 0
    assert index.begin_write([(k(1), PAGE)]) == [FULL]
    clock.now += 2
    assert index.expire() == 1
    with pytest.raises(StaleEpoch):
        index.renew(EPOCH + 1, [pin.pin_id])
