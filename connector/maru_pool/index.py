"""The pool index: which key lives where, who may write or read it, and what to evict.

Every chunk goes through ``writing -> committed -> (evicted | dropped)``:

* ``begin_write`` allocates space and hands out a write lease; the chunk is invisible to readers.
* ``commit`` records the writer's checksum and makes the chunk visible.
* ``open_read`` pins a committed chunk; pinned chunks are never evicted and their space never reused.
* Every lease and pin has a deadline: a client that dies mid-write or mid-read leaks nothing once
  :meth:`expire` runs (the daemon calls it periodically and before declaring the pool full), and one
  whose connection closes leaks nothing at once (:meth:`release_owner`).

**Prompts are chains.** A chunk may name its *parent*, the chunk before it in the same prompt (and
the same TP rank). A lookup stops at the first miss, so a chunk whose parent is gone can never be hit:
the index therefore keeps every prompt prefix-closed. A chunk is granted only when its parent is
stored or being stored, committed only when its parent is committed, eviction takes only *leaves*
(chunks no stored chunk descends from), and a chunk dropped as corrupt takes its descendants with it.
When space runs out, the least recently used chunk is found and the deepest stored descendant of it
is evicted, repeatedly, until the request fits (with ``evict=False`` the write is refused instead).
Lookups and reads touch a prompt's chunks from the last to the first, so the head of a prompt is
always its most recently used chunk and the tail ages first.

**Tenants.** Every chunk, lease and pin is charged to a tenant's :class:`~.quota.Account` (its key scope;
"" for a pool without authentication), whose quota bounds the bytes it holds and its pins and leases
outstanding. Eviction for another tenant's write takes from tenants over their quota, then over their fair
share, and only then the global least recently used chunk (see :mod:`.quota`).

Lease and pin ids are random 64-bit numbers, and each is bound to its *owner* (the connection that
took it): another connection cannot commit, abort, renew or release it, even knowing the id. Every
mutating call also carries the epoch it was issued in, so a lease from before a daemon restart can
never touch the new index.

The index only manages offsets: it never sees chunk bytes, so the same class serves the single-node
daemon and the multi-node metadata server. All public methods are thread-safe.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from maru_contracts.tenancy import Quota

from .allocator import RegionAllocator
from .events import DEFAULT_KEEP, EventLogs, Read
from .quota import CEILING, QUOTA, Account, Accounts, Limits

FULL = "full"
# Refused because the chunk's parent is neither stored nor being stored: it could never be hit.
ORPHAN = "orphan"


class StaleEpoch(Exception):
    """A lease or pin from another daemon epoch (the daemon restarted since it was issued)."""


@dataclass(eq=False)
class Chunk:
    key: bytes
    offset: int
    nbytes: int
    parent: bytes | None = None
    checksum: int = 0
    committed: bool = False
    pins: int = 0
    # Removed while pinned (dropped as corrupt, or with a dropped ancestor): space freed at the last unpin.
    dropped: bool = False
    # Committed chunks whose parent this is (insertion-ordered set).
    children: dict[bytes, None] = field(default_factory=dict)
    account: Account | None = None  # the tenant it is charged to (set by begin_write)
    # The key as the tenant's client sent it, before the daemon scoped it: what the tenant's events name.
    name: bytes = b""
    used_at: int = 0  # when it was last used, on the index's use counter (eviction compares tenants by it)


@dataclass(eq=False)
class _Lease:
    chunk: Chunk
    deadline: float
    write: bool
    owner: int
    # A write's token ids, for the chunk's stored event: held by the lease, never by the committed chunk.
    tokens: bytes | None = None


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
        events_keep: int = DEFAULT_KEEP,
        tenant_ceiling: Limits = CEILING,
    ) -> None:
        """``capacity``: bytes, or bytes per memory region (device); ``evict``: False refuses writes when full;
        ``events_keep``: keys each tenant's event log keeps (see :mod:`.events`); ``tenant_ceiling``: the most
        pins and leases any tenant holds, whatever its token says (see :mod:`.quota`)."""
        self.epoch = epoch
        self.lease_seconds = lease_seconds
        self.evict = evict
        self._clock = clock
        self._lock = threading.Lock()
        # Notified on every commit: readers waiting for a handoff (wait_prefixes) look again.
        self._committed = threading.Condition(self._lock)
        # Notified whenever a tenant's event log grows: event readers (read_events) look again.
        self._logged = threading.Condition(self._lock)
        self.events = EventLogs(events_keep)
        self._alloc = RegionAllocator(capacity if isinstance(capacity, list) else [capacity], align)
        self._chunks: dict[bytes, Chunk] = {}  # key -> chunk, writing or committed
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # committed keys, least recently used first
        self._leases: dict[int, _Lease] = {}  # lease or pin id -> its chunk, deadline and owner
        self.accounts = Accounts(self._alloc.capacity, tenant_ceiling)
        self._uses = itertools.count(1)
        self.counters = {
            "evictions": 0,
            "hits": 0,
            "misses": 0,
            "read_misses": 0,
            "lease_expiries": 0,
            "disconnect_releases": 0,
            "orphans": 0,
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
            n = self._prefix(keys)
            self._touch(keys[:n])
            self.counters["hits"] += n
            self.counters["misses"] += len(keys) - n
            return n

    def wait_prefixes(self, waits: Sequence[tuple[Sequence[bytes], int]], timeout_s: float) -> list[int]:
        """Leading committed keys of each ``(keys, need)``, once one has ``need`` or ``timeout_s`` passed.

        Blocks the caller's thread on the commits' condition, not in a poll: one call serves any number
        of waits, and it is answered the moment a commit satisfies one of them. Counts no hits or
        misses: the reader's lookup that follows does.
        """
        until = time.monotonic() + timeout_s
        with self._committed:
            while True:
                found = [self._prefix(keys) for keys, _ in waits]
                left = until - time.monotonic()
                if left <= 0 or any(n >= need for n, (_, need) in zip(found, waits, strict=True)):
                    return found
                self._committed.wait(left)

    def _prefix(self, keys: Sequence[bytes]) -> int:
        n = 0
        for key in keys:
            chunk = self._chunks.get(key)
            if chunk is None or not chunk.committed:
                break
            n += 1
        return n

    # ----------------------------------------------------------------- writes

    def begin_write(
        self,
        items: Sequence[
            tuple[bytes, int]
            | tuple[bytes, int, bytes | None]
            | tuple[bytes, int, bytes | None, bytes]
            | tuple[bytes, int, bytes | None, bytes, bytes | None]
        ],
        owner: int = 0,
        *,
        tenant: str = "",
        quota: Quota | None = None,
    ) -> list[WriteGrant | str | None]:
        """Per ``(key, nbytes[, parent[, name[, tokens]]])``: a grant, None (key present or being written),
        ``ORPHAN`` (the parent is neither stored nor being stored), ``QUOTA`` (the tenant is at its lease or
        byte quota, even after evicting its own unpinned chunks) or ``FULL`` (no room even after eviction).

        ``name`` is the key as the tenant sent it, before scoping (default ``key``): its events carry it, with
        ``tokens`` (the chunk's token ids, kept by the lease until the commit logs them).
        ``tenant`` and ``quota``: who is charged and its token's quota (None: unlimited)."""
        with self._lock:
            now = self._clock()
            account = self.accounts.get(tenant, quota)
            out: list[WriteGrant | str | None] = []
            for key, nbytes, *rest in items:
                parent = rest[0] if rest else None
                name = rest[1] if len(rest) > 1 else key
                tokens = rest[2] if len(rest) > 2 else None
                if nbytes <= 0:
                    raise ValueError(f"chunk size must be positive, got {nbytes}")
                if key in self._chunks:
                    out.append(None)
                    continue
                if parent is not None and parent not in self._chunks:
                    self.counters["orphans"] += 1
                    out.append(ORPHAN)
                    continue
                refused = self._admit(account, nbytes, keep=parent)
                if refused is not None:
                    account.refused[refused] += 1
                    out.append(QUOTA)
                    continue
                offset = self._make_room(nbytes, now, keep=parent, writer=account)
                if offset is None:
                    out.append(FULL)
                    continue
                chunk = Chunk(key=key, offset=offset, nbytes=nbytes, parent=parent, account=account, name=name)
                account.used += self._alloc.round(nbytes)
                account.leases += 1
                self._chunks[key] = chunk
                lease_id = self._new_id()
                self._leases[lease_id] = _Lease(chunk, now + self.lease_seconds, write=True, owner=owner, tokens=tokens)
                out.append(WriteGrant(lease_id, offset))
            return out

    def commit(self, epoch: int, items: Sequence[tuple[int, int]], owner: int = 0) -> list[bool]:
        """Per (lease id, checksum): True when now visible; False when the lease had expired, is unknown,
        belongs to another owner, or the chunk's parent is not committed (it could never be hit)."""
        with self._lock:
            self._check_epoch(epoch)
            out = []
            # tenant -> (name, parent's name, tokens) committed
            stored: dict[str, list[tuple[bytes, bytes | None, bytes | None]]] = {}
            for lease_id, checksum in items:
                lease = self._owned(lease_id, owner, write=True)
                if lease is None:
                    self.counters["errors"] += 1
                    out.append(False)
                    continue
                self._end_lease(lease_id)
                chunk = lease.chunk
                parent = self._chunks.get(chunk.parent) if chunk.parent is not None else None
                if chunk.parent is not None and (parent is None or not parent.committed):
                    self.counters["orphans"] += 1
                    self._forget_writing(chunk)
                    out.append(False)
                    continue
                chunk.checksum = checksum
                chunk.committed = True
                if parent is not None:
                    parent.children[chunk.key] = None
                self._lru[chunk.key] = None
                self._account(chunk).lru[chunk.key] = None
                chunk.used_at = next(self._uses)
                self.counters["commits"] += 1
                stored.setdefault(self._account(chunk).name, []).append(
                    (chunk.name, parent.name if parent is not None else None, lease.tokens)
                )
                out.append(True)
            if any(out):
                self._committed.notify_all()
            for tenant, chunks in stored.items():
                self.events.stored(tenant, chunks)
            if stored:
                self._logged.notify_all()
            return out

    def abort(self, epoch: int, lease_ids: Iterable[int], owner: int = 0) -> None:
        with self._lock:
            self._check_epoch(epoch)
            for lease_id in lease_ids:
                lease = self._owned(lease_id, owner, write=True)
                if lease is not None:
                    self._end_lease(lease_id)
                    self._forget_writing(lease.chunk)

    # ----------------------------------------------------------------- reads

    def open_read(
        self,
        keys: Sequence[bytes],
        *,
        prefix: bool = False,
        owner: int = 0,
        tenant: str = "",
        quota: Quota | None = None,
    ) -> list[ReadGrant | str | None]:
        """Pin committed chunks; None per miss, ``QUOTA`` per pin refused because the tenant holds as many
        as its quota allows (a miss to the reader). With ``prefix``, a lookup that pins: it stops at the
        first miss or refusal (returning only the leading hits, then ``QUOTA`` if that is why it stopped)
        and counts hits and misses like :meth:`lookup_prefix`.
        """
        with self._lock:
            now = self._clock()
            account = self.accounts.get(tenant, quota)
            out: list[ReadGrant | str | None] = []
            for key in keys:
                chunk = self._chunks.get(key)
                if chunk is None or not chunk.committed:
                    if prefix:
                        break
                    self.counters["read_misses"] += 1
                    out.append(None)
                    continue
                if account.at_limit("pins"):
                    account.refused["pins"] += 1
                    out.append(QUOTA)
                    if prefix:
                        break
                    self.counters["read_misses"] += 1
                    continue
                chunk.pins += 1
                account.pins += 1
                pin_id = self._new_id()
                self._leases[pin_id] = _Lease(chunk, now + self.lease_seconds, write=False, owner=owner)
                out.append(ReadGrant(pin_id, chunk.offset, chunk.nbytes, chunk.checksum))
            pinned = [key for key, grant in zip(keys, out, strict=False) if isinstance(grant, ReadGrant)]
            self._touch(pinned)
            if prefix:
                self.counters["hits"] += len(pinned)
                self.counters["misses"] += len(keys) - len(pinned)
            return out

    def release(self, epoch: int, pin_ids: Iterable[int], corrupt: Iterable[int] = (), owner: int = 0) -> None:
        """Unpin; pins listed in ``corrupt`` read bytes that failed their checksum, so the chunk is dropped
        (with its descendants, which could no longer be hit)."""
        with self._lock:
            self._check_epoch(epoch)
            for pin_id in corrupt:
                lease = self._owned(pin_id, owner, write=False)
                if lease is not None:
                    self.counters["errors"] += 1
                    self._log_removed(self._drop(lease.chunk))
            for pin_id in pin_ids:
                lease = self._owned(pin_id, owner, write=False)
                if lease is not None:
                    self._end_lease(pin_id)
                    self._unpin(lease.chunk)

    def renew(self, epoch: int, ids: Iterable[int], owner: int = 0) -> list[bool]:
        """Push the deadline of leases and pins a full lease period from now; False for ones already gone
        (or another owner's)."""
        with self._lock:
            self._check_epoch(epoch)
            deadline = self._clock() + self.lease_seconds
            out = []
            for lease_id in ids:
                lease = self._owned(lease_id, owner, write=None)
                if lease is not None:
                    lease.deadline = deadline
                out.append(lease is not None)
            return out

    def release_owner(self, owner: int) -> int:
        """Abort every write lease and drop every pin of ``owner`` (its connection closed); returns how many."""
        with self._lock:
            held = [(lid, lease) for lid, lease in self._leases.items() if lease.owner == owner]
            for lease_id, lease in held:
                self._end_lease(lease_id)
                if lease.write:
                    self._forget_writing(lease.chunk)
                else:
                    self._unpin(lease.chunk)
            self.counters["disconnect_releases"] += len(held)
            return len(held)

    # ----------------------------------------------------------------- events

    def flush(self, tenant: str) -> int:
        """Drop every chunk ``tenant`` has stored (pinned ones keep their space until unpinned) and log
        ``cleared`` for it; returns how many. Chunks still being written commit later as new ones."""
        with self._lock:
            account = self._find_account(tenant)
            dropped = 0
            for key in list(account.lru) if account is not None else []:
                chunk = self._chunks.get(key)
                if chunk is not None and not chunk.dropped:
                    dropped += len(self._drop(chunk))
            self.events.cleared(tenant)
            self._logged.notify_all()
            return dropped

    def read_events(self, tenant: str, after: tuple[int, int] | None, *, max_keys: int, timeout_s: float = 0.0) -> Read:
        """``tenant``'s events after ``after`` (an epoch and the last sequence number the reader saw),
        waiting up to ``timeout_s`` for one; a resync (``cleared``, then what the tenant holds) when
        ``after`` is None, of another epoch, or older than what the log still holds."""
        until = time.monotonic() + timeout_s
        seq = after[1] if after is not None and after[0] == self.epoch else None
        with self._logged:
            while True:
                account = self._find_account(tenant)
                read = self.events.read(tenant, seq, self._held_chains(account), max_keys=max_keys)
                left = until - time.monotonic()
                if read.resync or read.events or left <= 0:
                    return read
                self._logged.wait(left)

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

    def tenant_stats(self) -> list[dict[str, object]]:
        """Per tenant: bytes, pins and leases held against its quota, evictions suffered, refusals."""
        with self._lock:
            return self.accounts.snapshot()

    def check_invariants(self) -> None:
        """Assert that live regions never overlap each other or free space (used by tests)."""
        with self._lock:
            held = {id(c): c for c in self._chunks.values()}
            held.update({id(lease.chunk): lease.chunk for lease in self._leases.values()})
            for account in self.accounts:
                mine = [c for c in held.values() if c.account is account and not (c.dropped and c.pins == 0)]
                assert account.used == sum(self._alloc.round(c.nbytes) for c in mine), f"{account.name}: bytes"
                leases = [lease for lease in self._leases.values() if lease.chunk.account is account]
                assert account.leases == sum(lease.write for lease in leases), f"{account.name}: leases"
                assert account.pins == sum(not lease.write for lease in leases), f"{account.name}: pins"
                assert all(self._chunks[k].account is account for k in account.lru), f"{account.name}: lru"
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
            for chunk in self._chunks.values():
                if chunk.committed and chunk.parent is not None:
                    parent = self._chunks.get(chunk.parent)
                    assert parent is not None and parent.committed, "a stored chunk lost its parent"
                    assert chunk.key in parent.children
                for child in chunk.children:
                    assert self._chunks[child].parent == chunk.key

    # ----------------------------------------------------------------- internals

    def _new_id(self) -> int:
        while True:
            lease_id = secrets.randbits(64)
            if lease_id and lease_id not in self._leases:
                return lease_id

    def _owned(self, lease_id: int, owner: int, *, write: bool | None) -> _Lease | None:
        """The lease or pin ``lease_id`` if ``owner`` holds it (and it is of the kind asked for)."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.owner != owner or (write is not None and lease.write != write):
            return None
        return lease

    def _touch(self, keys: Sequence[bytes]) -> None:
        """Mark a prompt's chunks used, its head last: the tail of a prompt ages before its head."""
        for key in reversed(keys):
            self._lru.move_to_end(key)
            chunk = self._chunks[key]
            self._account(chunk).lru.move_to_end(key)
            chunk.used_at = next(self._uses)

    def _check_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.counters["errors"] += 1
            raise StaleEpoch(f"epoch {epoch} is not the pool's current epoch {self.epoch}")

    def _admit(self, account: Account, nbytes: int, keep: bytes | None) -> str | None:
        """None when ``account`` may take one more lease of ``nbytes`` (evicting its own unpinned chunks to
        stay within its byte quota); else the quota it is at (``leases`` or ``bytes``)."""
        # Expired leases and pins are not swept here: a tenant hammering at its quota would make every one of
        # its requests scan every lease of the pool. The periodic sweep reclaims them within a second.
        if account.at_limit("leases"):
            return "leases"
        size, limit = self._alloc.round(nbytes), account.byte_limit(self._alloc.capacity)
        if limit >= self._alloc.capacity:
            return None  # a quota of the whole pool is no quota: what does not fit is the pool being full
        if size > limit:
            return "bytes"
        while account.used + size > limit:
            victim = self._victim_in(account.lru, keep)[1] if self.evict else None
            if victim is None:
                return "bytes"  # the rest is pinned or being written: the tenant's own doing, never another's
            self._evict(victim, account)
        return None

    def _make_room(
        self, nbytes: int, now: float, keep: bytes | None = None, writer: Account | None = None
    ) -> int | None:
        """Space for ``nbytes``, evicting leaves as needed; ``keep`` (the new chunk's parent) is spared."""
        if self._alloc.round(nbytes) > self._alloc.largest_region():
            return None
        offset = self._alloc.alloc(nbytes)
        expired_once = False
        while offset is None:
            victim = self._victim(keep, writer) if self.evict else None
            if victim is None:
                # Dead clients' leases are the last resort before refusing.
                if expired_once or not self._expire(now):
                    return None
                expired_once = True
            else:
                self._evict(victim, writer)
            offset = self._alloc.alloc(nbytes)
        return offset

    def _victim(self, keep: bytes | None, writer: Account | None = None) -> Chunk | None:
        """What to evict for ``writer``: the least recently used evictable chunk of the tenants over their
        byte quota, else of those over their fair share, else of the whole pool (see :mod:`.quota`)."""
        if writer is not None:
            for tier in (self.accounts.over_quota(), self.accounts.over_share(writer)):
                found = [self._victim_in(a.lru, keep) for a in tier]
                candidates = [(used_at, chunk) for used_at, chunk in found if chunk is not None]
                if candidates:
                    return min(candidates, key=lambda c: c[0])[1]
        return self._victim_in(self._lru, keep)[1]

    def _victim_in(self, lru: OrderedDict[bytes, None], keep: bytes | None) -> tuple[int, Chunk | None]:
        """The deepest stored descendant of the least recently used chunk of ``lru`` that has an unpinned
        one, and when that chunk was used."""
        for key in lru:
            head = chunk = self._chunks[key]
            while chunk.children:
                chunk = self._chunks[next(reversed(chunk.children))]
            if chunk.pins == 0 and chunk.key != keep:
                return head.used_at, chunk
        return 0, None

    def _evict(self, chunk: Chunk, writer: Account | None = None) -> None:
        del self._chunks[chunk.key]
        del self._lru[chunk.key]
        account = self._account(chunk)
        del account.lru[chunk.key]
        if writer is None or writer is account:
            account.evicted_by_self += 1
        else:
            account.evicted_by_others += 1
        self._unlink(chunk)
        self._free(chunk)
        self.counters["evictions"] += 1
        self._log_removed([chunk])

    def _account(self, chunk: Chunk) -> Account:
        assert chunk.account is not None  # begin_write charges every chunk it makes
        return chunk.account

    def _free(self, chunk: Chunk) -> None:
        """Give a chunk's space back, and take it off its tenant's bill."""
        self._alloc.free(chunk.offset, chunk.nbytes)
        self._account(chunk).used -= self._alloc.round(chunk.nbytes)

    def _end_lease(self, lease_id: int) -> None:
        """Forget a lease or pin, and take it off its tenant's count."""
        lease = self._leases.pop(lease_id)
        account = self._account(lease.chunk)
        if lease.write:
            account.leases -= 1
        else:
            account.pins -= 1

    def _unlink(self, chunk: Chunk) -> None:
        parent = self._chunks.get(chunk.parent) if chunk.parent is not None else None
        if parent is not None:
            parent.children.pop(chunk.key, None)

    def _forget_writing(self, chunk: Chunk) -> None:
        if self._chunks.get(chunk.key) is chunk:
            del self._chunks[chunk.key]
        self._free(chunk)

    def _drop(self, chunk: Chunk) -> list[Chunk]:
        """Take a chunk and its descendants out of the index; pinned ones keep their space until unpinned.
        Returns the committed chunks taken out (what readers of the tenant's events knew as stored)."""
        doomed = [chunk]
        removed: list[Chunk] = []
        while doomed:
            chunk = doomed.pop()
            if chunk.dropped:
                continue
            chunk.dropped = True
            if self._chunks.get(chunk.key) is chunk:
                del self._chunks[chunk.key]
                self._lru.pop(chunk.key, None)
                self._account(chunk).lru.pop(chunk.key, None)
                self._unlink(chunk)
                if chunk.committed:
                    removed.append(chunk)
            doomed.extend(self._chunks[k] for k in chunk.children if k in self._chunks)
            chunk.children.clear()
            if chunk.pins == 0:
                self._free(chunk)
        return removed

    def _log_removed(self, chunks: Sequence[Chunk]) -> None:
        by_tenant: dict[str, list[bytes]] = {}
        for chunk in chunks:
            by_tenant.setdefault(self._account(chunk).name, []).append(chunk.name)
        for tenant, names in by_tenant.items():
            self.events.removed(tenant, names)
        if by_tenant:
            self._logged.notify_all()

    def _find_account(self, tenant: str) -> Account | None:
        return next((account for account in self.accounts if account.name == tenant), None)

    def _held_chains(self, account: Account | None) -> Iterator[tuple[bytes, bytes | None]]:
        """``(name, parent's name)`` of every chunk ``account`` holds, each after its parent (depth first,
        so a prompt comes out as one run)."""
        if account is None:
            return
        for key in account.lru:
            root = self._chunks[key]
            if root.parent is not None:
                continue
            stack = [(root, None)]
            while stack:
                chunk, parent = stack.pop()
                yield chunk.name, parent
                # Reversed, so the first child is visited next and continues the run of its parent.
                stack.extend((self._chunks[child], chunk.name) for child in reversed(chunk.children))

    def _unpin(self, chunk: Chunk) -> None:
        chunk.pins -= 1
        if chunk.dropped and chunk.pins == 0:
            self._free(chunk)

    def _expire(self, now: float) -> int:
        expired = [(lid, lease) for lid, lease in self._leases.items() if lease.deadline <= now]
        for lease_id, lease in expired:
            self._end_lease(lease_id)
            if lease.write:
                self._forget_writing(lease.chunk)
            else:
                self._unpin(lease.chunk)
        self.counters["lease_expiries"] += len(expired)
        return len(expired)
