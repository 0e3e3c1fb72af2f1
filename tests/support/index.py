"""The pool index driven by hand: a settable clock, keys, and a random-operation state machine to extend."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from maru_pool.index import PoolIndex, WriteGrant

PAGE = 4096

EPOCH = 7


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class IndexMachine(RuleBasedStateMachine):
    """Random sequences of every operation: live regions never overlap, pinned bytes never move."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.index = PoolIndex(16 * PAGE, epoch=EPOCH, lease_seconds=10, align=PAGE, clock=self.clock)
        self.leases: dict[int, tuple[bytes, int]] = {}  # lease id -> key, offset
        self.pins: dict[int, tuple[bytes, int, int]] = {}  # pin id -> key, offset, checksum
        self.committed_checksum: dict[bytes, int] = {}

    @rule(i=st.integers(0, 30), pages=st.integers(1, 5), extra=st.integers(0, PAGE - 1), chained=st.booleans())
    def write(self, i: int, pages: int, extra: int, chained: bool) -> None:
        # Chained: chunk i of a prompt whose chunk i - 1 must be stored first.
        parent = k(i - 1) if chained and i else None
        (grant,) = self.index.begin_write([(k(i), pages * PAGE - extra, parent)])
        if isinstance(grant, WriteGrant):
            self.leases[grant.lease_id] = (k(i), grant.offset)

    @precondition(lambda self: self.leases)
    @rule(pick=st.integers(0, 1000), abort=st.booleans())
    def finish(self, pick: int, abort: bool) -> None:
        # Ids are random: pick by insertion order, which the rule sequence alone determines.
        lease_id = list(self.leases)[pick % len(self.leases)]
        key, _ = self.leases.pop(lease_id)
        if abort:
            self.index.abort(EPOCH, [lease_id])
        elif self.index.commit(EPOCH, [(lease_id, lease_id)]) == [True]:
            self.committed_checksum[key] = lease_id

    @rule(i=st.integers(0, 30))
    def read(self, i: int) -> None:
        (pin,) = self.index.open_read([k(i)])
        if pin is not None:
            self.pins[pin.pin_id] = (k(i), pin.offset, pin.checksum)

    @precondition(lambda self: self.pins)
    @rule(pick=st.integers(0, 1000), corrupt=st.booleans())
    def release(self, pick: int, corrupt: bool) -> None:
        pin_id = list(self.pins)[pick % len(self.pins)]
        del self.pins[pin_id]
        self.index.release(EPOCH, [pin_id], [pin_id] if corrupt else [])
        if corrupt:
            # The chunk and its descendants left the index; other pins of them now hold dropped chunks.
            self.pins = {p: v for p, v in self.pins.items() if self.index._chunks.get(v[0]) is not None}

    @rule(dt=st.floats(0, 6))
    def time_passes(self, dt: float) -> None:
        self.clock.now += dt
        self.index.expire()
        # Whatever expired is gone from our books too: a later commit/release of it must be harmless.
        live = self.index._leases
        self.leases = {lid: v for lid, v in self.leases.items() if lid in live}
        self.pins = {pid: v for pid, v in self.pins.items() if pid in live}

    @invariant()
    def no_overlap_no_leak(self) -> None:
        self.index.check_invariants()

    @invariant()
    def pinned_chunks_stay_put(self) -> None:
        for key, offset, checksum in self.pins.values():
            chunk = self.index._chunks.get(key)
            assert chunk is not None and chunk.committed
            assert (chunk.offset, chunk.checksum) == (offset, checksum)

    @invariant()
    def every_stored_chunk_can_be_hit(self) -> None:
        for chunk in self.index._chunks.values():
            if chunk.committed and chunk.parent is not None:
                assert self.index._chunks[chunk.parent].committed


def k(i: int) -> bytes:
    return i.to_bytes(32, "big")
