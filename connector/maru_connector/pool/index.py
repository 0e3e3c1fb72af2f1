"""The pool index: which key lives where, who may write or read it, and what to evict.

Every chunk goes through ``writing -> committed -> (evicted | dropped)``:

* ``begin_write`` allocates space and hands out a write lease; the chunk is invisible to readers.
* ``commit`` records the writer's checksum and makes the chunk visible (LRU tail).
* ``open_read`` pins a committed chunk; pinned chunks are never evicted and their space never reused.
* When space runs out, committed unpinned chunks are evicted from the LRU head until the request fits
  (with ``evict=False`` the write is refused instead).
* Every lease and pin has a deadline: a client that dies mid-write or mid-read leaks nothing once
  :meth:`expire` runs (the daemon calls it periodically and before declaring the pool full).

Leases and pins share one id space that starts at a random point, and every mutating call carries the
epoch it was issued in, so a lease from before a daemon restart can never touch the new index.

The index only manages offsets: it never sees chunk bytes, so the same class serves the single-node
daemon and the multi-node metadata server. All public methods are thread-safe.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from .allocator import RegionAllocator

FULL = "full"


class StaleEpoch(Exception):
    """A lease or pin from another daemon epoch (the daemon restarted since it was issued)."""


@dataclass(eq=False)
class Chunk:
    key: bytes
    offset: int
    nbytes: int
    checksum: int = 0
    committed: bool = False
    pins: int = 0
    # Reported corrupt while pinned: already out of the index, space freed at the last unpin.
    dropped: bool = False


@dataclass(eq=False)
class _Lease:
    chunk: Chunk
    deadline: float
    write: bool


@dataclass(frozen=True)
class WriteGrant:
    lease_id: int
    offset: int


@dataclass(frozen=True)
class ReadGrant:
    pin_id: int
    offset: int
    nbytes: int
    checksum: int


class PoolIndex:
    def __init__(
        self,
        capacity: int | list[int],
        *,
        epoch: int,
        lease_seconds: float = 30.0,
        evict: bool = True,
        align: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``capacity``: bytes, or bytes per memory region (device); ``evict``: False refuses writes when full."""
        self.epoch = epoch
        self.lease_seconds = lease_seconds
        self.evict = evict
        self._clock = clock
        self._lock = threading.Lock()
        self._alloc = RegionAllocator(capacity if isinstance(capacity, list) else [capacity], align)
        self._chunks: dict[bytes, Chunk] = {}  # key -> chunk, writing or committed
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # committed keys, least recently used first
        self._leases: dict[int, _Lease] = {}  # lease or pin id -> its chunk and deadline
        self._next_id = random.getrandbits(48) + 1
        self.counters = {
            "evictions": 0,
            "hits": 0,
            "misses": 0,
            "read_misses": 0,
            "lease_expiries": 0,
            "errors": 0,
            "commits": 0,
        }

    @property
    def capacity(self) -> int:
        return self._alloc.capacity

    @property
    def capacities(self) -> list[int]:
        """Usable bytes of each region, in region order."""
        return self._alloc.capacities

    # ----------------------------------------------------------------- lookups

    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            n = 0
            for key in keys:
                chunk = self._chunks.get(key)
                if chunk is None or not chunk.committed:
                    break
                self._lru.move_to_end(key)
                n += 1
            self.counters["hits"] += n
            self.counters["misses"] += len(keys) - n
            return n

    # ----------------------------------------------------------------- writes

    def begin_write(self, items: Sequence[tuple[bytes, int]]) -> list[WriteGrant | str | None]:
        """Per item: a grant, None (key present or being written), or ``FULL`` (no room even after eviction)."""
        with self._lock:
            now = self._clock()
            out: list[WriteGrant | str | None] = []
            for key, nbytes in items:
                if nbytes <= 0:
                    raise ValueError(f"chunk size must be positive, got {nbytes}")
                if key in self._chunks:
                    out.append(None)
                    continue
                offset = self._make_room(nbytes, now)
                if offset is None:
                    out.append(FULL)
                    continue
                chunk = Chunk(key=key, offset=offset, nbytes=nbytes)
                self._chunks[key] = chunk
                lease_id = self._new_id()
                self._leases[lease_id] = _Lease(chunk, now + self.lease_seconds, write=True)
                out.append(WriteGrant(lease_id, offset))
            return out

    def commit(self, epoch: int, items: Sequence[tuple[int, int]]) -> list[bool]:
        """Per (lease id, checksum): True when now visible, False when the lease had expired or was unknown."""
        with self._lock:
            self._check_epoch(epoch)
            out = []
            for lease_id, checksum in items:
                lease = self._leases.get(lease_id)
                if lease is None or not lease.write:
                    self.counters["errors"] += 1
                    out.append(False)
                    continue
                del self._leases[lease_id]
                chunk = lease.chunk
                chunk.checksum = checksum
                chunk.committed = True
                self._lru[chunk.key] = None
                self.counters["commits"] += 1
                out.append(True)
            return out

    def abort(self, epoch: int, lease_ids: Iterable[int]) -> None:
        with self._lock:
            self._check_epoch(epoch)
            for lease_id in lease_ids:
                lease = self._leases.get(lease_id)
                if lease is not None and lease.write:
                    del self._leases[lease_id]
                    self._forget_writing(lease.chunk)

    # ----------------------------------------------------------------- reads

    def open_read(self, keys: Sequence[bytes], *, prefix: bool = False) -> list[ReadGrant | None]:
        """Pin committed chunks; None per miss. With ``prefix``, a lookup that pins: it stops at the
        first miss (returning only the leading hits) and counts hits and misses like :meth:`lookup_prefix`.
        """
        with self._lock:
            now = self._clock()
            out: list[ReadGrant | None] = []
            for key in keys:
                chunk = self._chunks.get(key)
                if chunk is None or not chunk.committed:
                    if prefix:
                        break
                    self.counters["read_misses"] += 1
                    out.append(None)
                    continue
                self._lru.move_to_end(key)
                chunk.pins += 1
                pin_id = self._new_id()
                self._leases[pin_id] = _Lease(chunk, now + self.lease_seconds, write=False)
                out.append(ReadGrant(pin_id, chunk.offset, chunk.nbytes, chunk.checksum))
            if prefix:
                self.counters["hits"] += len(out)
                self.counters["misses"] += len(keys) - len(out)
            return out

    def release(self, epoch: int, pin_ids: Iterable[int], corrupt: Iterable[int] = ()) -> None:
        """Unpin; pins listed in ``corrupt`` read bytes that failed their checksum, so the chunk is dropped."""
        with self._lock:
            self._check_epoch(epoch)
            for pin_id in corrupt:
                lease = self._leases.get(pin_id)
                if lease is not None and not lease.write:
                    self.counters["errors"] += 1
                    self._drop(lease.chunk)
            for pin_id in pin_ids:
                lease = self._leases.get(pin_id)
                if lease is not None and not lease.write:
                    del self._leases[pin_id]
                    self._unpin(lease.chunk)

    def renew(self, epoch: int, ids: Iterable[int]) -> list[bool]:
        """Push the deadline of leases and pins a full lease period from now; False for ones already gone."""
        with self._lock:
            self._check_epoch(epoch)
            deadline = self._clock() + self.lease_seconds
            out = []
            for lease_id in ids:
                lease = self._leases.get(lease_id)
                if lease is not None:
                    lease.deadline = deadline
                out.append(lease is not None)
            return out

    # ----------------------------------------------------------------- housekeeping

    def expire(self) -> int:
        """Reclaim every lease and pin past its deadline; returns how many."""
        with self._lock:
            return self._expire(self._clock())

    def count_error(self) -> None:
        with self._lock:
            self.counters["errors"] += 1

    def stats(self) -> dict[str, int]:
        with self._lock:
            writing = sum(1 for lease in self._leases.values() if lease.write)
            return {
                "capacity_bytes": self._alloc.capacity,
                "used_bytes": self._alloc.used,
                "chunks": len(self._lru),
                "writing": writing,
                "pins": len(self._leases) - writing,
                "epoch": self.epoch,
                **self.counters,
            }

    def check_invariants(self) -> None:
        """Assert that live regions never overlap each other or free space (used by tests)."""
        with self._lock:
            live = {id(c): c for c in self._chunks.values()}
            live.update({id(lease.chunk): lease.chunk for lease in self._leases.values()})
            regions = [(c.offset, self._alloc.round(c.nbytes)) for c in live.values()]
            regions += self._alloc.free_extents()
            regions.sort()
            for (a_off, a_len), (b_off, _) in itertools.pairwise(regions):
                assert a_off + a_len <= b_off, f"overlap at {a_off}+{a_len} > {b_off}"
            assert sum(size for _, size in regions) == self._alloc.capacity, "space leaked or double counted"
            for key in self._lru:
                assert self._chunks[key].committed

    # ----------------------------------------------------------------- internals

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _check_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.counters["errors"] += 1
            raise StaleEpoch(f"epoch {epoch} is not the pool's current epoch {self.epoch}")

    def _make_room(self, nbytes: int, now: float) -> int | None:
        if self._alloc.round(nbytes) > self._alloc.largest_region():
            return None
        offset = self._alloc.alloc(nbytes)
        expired_once = False
        while offset is None:
            victim = next((k for k in self._lru if self._chunks[k].pins == 0), None) if self.evict else None
            if victim is None:
                # Dead clients' leases are the last resort before refusing.
                if expired_once or not self._expire(now):
                    return None
                expired_once = True
            else:
                self._evict(victim)
            offset = self._alloc.alloc(nbytes)
        return offset

    def _evict(self, key: bytes) -> None:
        chunk = self._chunks.pop(key)
        del self._lru[key]
        self._alloc.free(chunk.offset, chunk.nbytes)
        self.counters["evictions"] += 1

    def _forget_writing(self, chunk: Chunk) -> None:
        if self._chunks.get(chunk.key) is chunk:
            del self._chunks[chunk.key]
        self._alloc.free(chunk.offset, chunk.nbytes)

    def _drop(self, chunk: Chunk) -> None:
        if chunk.dropped:
            return
        chunk.dropped = True
        if self._chunks.get(chunk.key) is chunk:
            del self._chunks[chunk.key]
            self._lru.pop(chunk.key, None)
        if chunk.pins == 0:
            self._alloc.free(chunk.offset, chunk.nbytes)

    def _unpin(self, chunk: Chunk) -> None:
        chunk.pins -= 1
        if chunk.dropped and chunk.pins == 0:
            self._alloc.free(chunk.offset, chunk.nbytes)

    def _expire(self, now: float) -> int:
        expired = [(lid, lease) for lid, lease in self._leases.items() if lease.deadline <= now]
        for lease_id, lease in expired:
            del self._leases[lease_id]
            if lease.write:
                self._forget_writing(lease.chunk)
            else:
                self._unpin(lease.chunk)
        self.counters["lease_expiries"] += len(expired)
        return len(expired)
