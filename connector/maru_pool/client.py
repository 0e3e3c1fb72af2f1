"""Client of the pool daemon: batched metadata RPCs plus direct access to the shared mapping.

The client connects lazily. Its first call sends ``hello`` to ``url`` and receives the pool memory
(by SCM_RIGHTS on a Unix socket, or a path to open on TCP), maps it, and, when the hello names a
metadata server (multi-node pools), sends every later RPC there. Chunk bytes are copied straight
between the caller's buffers and the mapping; only keys, offsets, leases and checksums cross the
socket.

Failures of the daemon surface as :class:`PoolUnavailable`; the connection is dropped and the next
call reconnects and re-maps, so a restarted daemon is picked up without the caller doing anything.
Leases and pins issued before a restart carry the old epoch and are refused by the new daemon:
their commit reports "not stored", their release is a no-op. Leases and pins are bound to the
connection that took them: a dropped connection gives them back, and its leases cannot be committed.

Chunk bytes are checksummed (xxh3_64) in the same pass that copies them (:mod:`.copyhash`): writers
hash what they copy in, readers verify what they copy out, from one buffer (``fill``, ``read_into``) or
straight from and into the engine's pages (``fill_segments``, ``read_segments``).

Every lease and pin has a deadline (the daemon's ``--lease-seconds``), which the client tracks on its
own clock, conservatively: :meth:`WriteLease.fill` and :meth:`ReadPin.read_into` refuse to touch pool
memory once it has passed (:class:`LeaseLost`), so a stalled writer never writes into space the daemon
has handed to someone else, and :meth:`PoolClient.keep_alive` renews what is about to expire.

One client may be shared by threads (calls are serialised). A client inherited across ``fork`` never
reuses the parent's socket: the child reconnects on its first call.

With ``token_file``, every connection starts with a hello carrying the token read from that file (read
afresh on each connection, so a rotated credential is picked up); the metadata connection of a
multi-node pool is authenticated the same way. A pool that refuses it raises :class:`PoolAuthError`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import socket
import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from . import copyhash, protocol
from .allocator import split_offset
from .copyhash import Segment
from .memory import file_identity
from .readers import Reader
from .units import Endpoint, parse_endpoint

log = logging.getLogger(__name__)

# Devices of one pool a hello may pass (SCM_RIGHTS carries at most 253 fds per message).
MAX_REGIONS = 64
# Share of the daemon's lease period the client allows itself: its clock started before the daemon's.
_DEADLINE_SHARE = 0.8

# Token ids one write request carries at most (hex: twice this in the frame), well under the daemon's default
# --max-frame (16 MiB): a batch over it must not cost its chunks, only their events' tokens.
WRITE_TOKEN_BYTES = 2 << 20
# Why a write was not granted (lease_many): stored or being stored already, no room, parent missing,
# the tenant at its quota (bytes or write leases; see the pool README's Quotas).
PRESENT = "present"
FULL = "full"
ORPHAN = "orphan"
QUOTA = "quota"


class PoolError(Exception):
    """Base of every failure the pool client raises."""


class PoolUnavailable(PoolError):
    """The daemon is down, its socket is missing, or it did not answer within the timeout."""


class PoolAuthError(PoolUnavailable):
    """The pool refused this client's credential (none, malformed, another pool's), or it cannot be read."""


class PoolFull(PoolError):
    """No space, and nothing evictable (everything is pinned or being written)."""


class ChecksumMismatch(PoolError):
    """Bytes read from the pool do not match the checksum they were committed with."""


class LeaseLost(PoolError):
    """A write lease expired (or the daemon restarted) before commit: the chunk was not stored."""


class _StaleEpoch(PoolError):
    pass


# key, pin id, epoch, offset, nbytes, checksum: a pin in a form that pickles and crosses processes.
PinTicket = tuple[bytes, int, int, int, int, int]

_ERRORS: dict[str, type[PoolError]] = {
    protocol.E_UNAVAILABLE: PoolUnavailable,
    protocol.E_FULL: PoolFull,
    protocol.E_STALE_EPOCH: _StaleEpoch,
    **{code: PoolAuthError for code in protocol.AUTH_ERRORS},
    # The daemon's limits (limits.py): over its connection caps, no hello in time.
    protocol.E_BUSY: PoolUnavailable,
    protocol.E_HELLO_TIMEOUT: PoolUnavailable,
}
# Replies after which the daemon has closed the connection: the next call starts a new one.
_LAST_WORDS = (protocol.E_BUSY, protocol.E_HELLO_TIMEOUT, protocol.E_TOO_LARGE)


class _Held:
    """Deadline bookkeeping shared by write leases and read pins (client clock, conservative)."""

    deadline: float
    lease_s: float

    def remaining(self) -> float:
        """Seconds left before the daemon may reclaim this (``inf`` when the daemon set no limit)."""
        return self.deadline - time.monotonic()

    def _extend(self, asked_at: float) -> None:
        self.deadline = asked_at + self.lease_s * _DEADLINE_SHARE


class WriteLease(_Held):
    """Space reserved for one chunk. :meth:`fill` it, then :meth:`commit` (or :meth:`abort`).

    As a context manager it aborts on exit unless committed, so an exception (or a forgotten commit)
    never makes a half-written chunk visible.
    """

    def __init__(
        self,
        client: PoolClient,
        key: bytes,
        lease_id: int,
        epoch: int,
        offset: int,
        buffer: memoryview,
        *,
        lease_s: float = math.inf,
        asked_at: float = 0.0,
    ) -> None:
        self.key = key
        self.buffer = buffer
        self.lease_id = lease_id
        self.offset = offset  # into the pool's data region; for diagnostics
        self.epoch = epoch
        self.lease_s = lease_s
        self._extend(asked_at)
        self._client = client
        self.done = False
        self._checksum: int | None = None

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    def fill(self, data: Any) -> None:
        """Copy all of ``data`` into the buffer, checksumming the *source* on the way.

        The checksum describes the caller's bytes, not whatever the buffer holds at commit: a late
        writer that scribbled over this space could only make readers see :class:`ChecksumMismatch`.
        Raises :class:`LeaseLost` (touching nothing) once the lease's deadline has passed.
        """
        src = _byte_view(data)
        if src.nbytes != self.buffer.nbytes:
            raise PoolError(f"fill: lease holds {self.buffer.nbytes} bytes, data has {src.nbytes}")
        self._check_deadline()
        self._checksum = copyhash.copy_checksum(self.buffer, src, to_pool=True)

    def fill_segments(self, segments: Sequence[Segment]) -> None:
        """Like :meth:`fill`, from the memory ranges ``segments`` (``(address, length)``, back to back).

        For the pages of a chunk in CPU memory: they are copied straight into the pool and hashed on the
        way, with no staging copy. The caller keeps that memory alive and unchanged during the call.
        """
        self._check_deadline()
        if not fill_segments_many([self], [segments])[0]:
            self._check_deadline()  # it ran out in between

    def _check_deadline(self) -> None:
        if self.remaining() <= 0:
            raise LeaseLost(f"chunk {self.key.hex()[:16]}: write lease ran out before the copy; not written")

    def commit(self) -> None:
        """Checksum the buffer (xxh3_64) and make the chunk visible. Raises :class:`LeaseLost`."""
        if not self._client.commit_many([self])[0]:
            raise LeaseLost(f"chunk {self.key.hex()[:16]}: lease expired or pool restarted before commit")

    def abort(self) -> None:
        self._client.abort_many([self])

    def __enter__(self) -> WriteLease:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if not self.done:
            self.abort()


class ReadPin(_Held):
    """A committed chunk pinned for reading: its bytes cannot be evicted or reused until released."""

    def __init__(
        self,
        client: PoolClient,
        key: bytes,
        pin_id: int,
        epoch: int,
        offset: int,
        checksum: int,
        buffer: memoryview,
        *,
        lease_s: float = math.inf,
        asked_at: float = 0.0,
        borrowed: bool = False,
    ) -> None:
        self.key = key
        self.buffer = buffer
        self.pin_id = pin_id
        self.offset = offset  # into the pool's data region; for diagnostics
        self.epoch = epoch
        self.checksum = checksum
        self.lease_s = lease_s
        self._extend(asked_at)
        self._client = client
        # Claimed from another connection's ticket: only that connection can release it.
        self.borrowed = borrowed
        self.done = False
        self.corrupt = False

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    def verify(self) -> None:
        """Raise :class:`ChecksumMismatch` when the bytes in the pool no longer match the committed checksum."""
        if copyhash.checksum(self.buffer) != self.checksum:
            self.corrupt = True
            raise ChecksumMismatch(f"chunk {self.key.hex()[:16]}: bytes in the pool do not match their checksum")

    def ticket(self) -> PinTicket:
        """Plain values that let another process :meth:`PoolClient.claim` this pin (and release it)."""
        return (self.key, self.pin_id, self.epoch, self.offset, self.nbytes, self.checksum)

    def read_into(self, out: Any) -> None:
        """Copy the chunk into the writable buffer ``out`` and verify the copy (not the pool) in one pass.

        What lands in ``out`` is exactly what was checked: the pool's bytes are read once. Raises
        :class:`ChecksumMismatch` and marks the pin corrupt, so its release drops the chunk; raises
        :class:`LeaseLost` once the pin's deadline has passed (the space may belong to a writer now).
        """
        dst = _byte_view(out)
        if dst.readonly or dst.nbytes < self.nbytes:
            raise PoolError(f"read_into: output must be writable and hold {self.nbytes} bytes, got {dst.nbytes}")
        self._check_deadline()
        self._check(copyhash.copy_checksum(dst[: self.nbytes], self.buffer, to_pool=False))

    def read_segments(self, segments: Sequence[Segment]) -> None:
        """Copy the chunk, back to back, into the memory ranges ``segments`` (``(address, length)``),
        verifying it in the same pass; address 0 skips a range (hashed, not copied: all of the chunk is
        always verified).

        For loading straight into the pages of a CPU KV cache, with no staging copy. Unlike
        :meth:`read_into` the bytes are in place before the verdict: on :class:`ChecksumMismatch` (raised
        after the copy; the pin is marked corrupt) the caller must treat every range as garbage.
        Raises :class:`LeaseLost`, touching nothing, once the pin's deadline has passed.
        """
        self._check_deadline()
        if not read_segments_many([self], [segments])[0]:
            self._check_deadline()  # it ran out in between
            raise ChecksumMismatch(f"chunk {self.key.hex()[:16]}: bytes read do not match their checksum")

    def _check_deadline(self) -> None:
        if self.remaining() <= 0:
            raise LeaseLost(f"chunk {self.key.hex()[:16]}: read pin ran out before the copy")

    def _check(self, digest: int) -> None:
        if digest != self.checksum:
            self.corrupt = True
            raise ChecksumMismatch(f"chunk {self.key.hex()[:16]}: bytes read do not match their checksum")

    def release(self) -> None:
        self._client.release_many([self])

    def __enter__(self) -> ReadPin:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


def fill_segments_many(leases: Sequence[WriteLease], segments: Sequence[Sequence[Segment]]) -> list[bool]:
    """:meth:`WriteLease.fill_segments` for several leases in one pass over their bytes.

    Per lease, whether it was filled: one whose deadline has passed is not touched (``False``), and
    must be aborted, not committed. Raises :class:`PoolError` when a lease and its segments differ in size.
    """
    for lease, segs in zip(leases, segments, strict=True):
        total = _segments_total(segs)
        if total != lease.buffer.nbytes:
            raise PoolError(f"fill_segments: lease holds {lease.buffer.nbytes} bytes, segments have {total}")
    live = [i for i, lease in enumerate(leases) if lease.remaining() > 0]
    digests = copyhash.gather_checksum_many([(leases[i].buffer, segments[i]) for i in live])
    for i, digest in zip(live, digests, strict=True):
        leases[i]._checksum = digest
    filled = set(live)
    return [i in filled for i in range(len(leases))]


def read_segments_many(pins: Sequence[ReadPin], segments: Sequence[Sequence[Segment]]) -> list[bool]:
    """:meth:`ReadPin.read_segments` for several pins in one pass over their bytes.

    Per pin, whether its bytes verified. ``False``: its deadline had passed (nothing was copied), or the
    copy failed its checksum (the pin is marked corrupt, and its ranges hold garbage). Raises
    :class:`PoolError` when a pin and its segments differ in size.
    """
    for pin, segs in zip(pins, segments, strict=True):
        total = _segments_total(segs)
        if total != pin.nbytes:
            raise PoolError(f"read_segments: the chunk holds {pin.nbytes} bytes, segments have {total}")
    live = [i for i, pin in enumerate(pins) if pin.remaining() > 0]
    digests = copyhash.scatter_checksum_many([(pins[i].buffer, segments[i]) for i in live])
    good = set()
    for i, digest in zip(live, digests, strict=True):
        if digest == pins[i].checksum:
            good.add(i)
        else:
            pins[i].corrupt = True
    return [i in good for i in range(len(pins))]


class _Mapping:
    """The pool's memory regions (one per device) as mapped by this process."""

    def __init__(self, mms: list[mmap.mmap], header_size: int, capacities: list[int]) -> None:
        self.mms = mms
        self.views = [memoryview(mm)[header_size : header_size + cap] for mm, cap in zip(mms, capacities, strict=True)]

    def view(self, offset: int, nbytes: int) -> memoryview:
        region, local = split_offset(offset)
        if region >= len(self.views) or local + nbytes > self.views[region].nbytes:
            raise PoolError(f"pool handed out [{offset}, +{nbytes}) outside its memory; reconnecting may help")
        return self.views[region][local : local + nbytes]

    @property
    def capacity(self) -> int:
        return sum(v.nbytes for v in self.views)

    @property
    def largest_region(self) -> int:
        return max(v.nbytes for v in self.views)

    def close(self) -> None:
        for view in self.views:
            view.release()
        # Views handed to callers keep a mapping alive; it is unmapped with the last of them.
        for mm in self.mms:
            with contextlib.suppress(BufferError):
                mm.close()


class PoolClient:
    def __init__(self, url: str, *, timeout_s: float = 0.5, token_file: str | None = None) -> None:
        try:
            self._endpoint = parse_endpoint(url)
        except ValueError as err:
            raise PoolError(f"pool url: {err}") from None
        self.url = url
        self.timeout_s = timeout_s
        self.token_file = token_file
        self._warned_no_auth = False
        self._lock = threading.RLock()
        self._sock: socket.socket | None = None
        self._map: _Mapping | None = None
        self._pid = os.getpid()
        self.epoch = 0
        self.backend = ""

    # ------------------------------------------------------------ metadata calls

    def lookup_prefix(self, keys: Sequence[bytes], *, reader: Reader | None = None, handoff: int = 0) -> int:
        """How many leading keys are committed (stops at the first miss). One round trip.

        ``reader``: who asks, for the daemon's reader counters; ``handoff``: keys a prefill announced that the
        caller will wait for (with :meth:`wait_prefixes`, same ``reader``) if this lookup comes short.
        """
        if not keys:
            return 0
        msg: dict[str, Any] = {"op": "lookup", "keys": protocol.hex_keys(list(keys))}
        if reader is not None:
            msg["reader"] = reader.fields()
            if handoff:
                msg["handoff"] = handoff
        return int(self._call(msg)["n"])

    def wait_prefixes(
        self,
        waits: Sequence[tuple[Sequence[bytes], int]],
        timeout_s: float,
        *,
        reader: Reader | None = None,
        final: Sequence[int] = (),
    ) -> list[int] | None:
        """For each ``(keys, need)``, how many leading keys are committed, answered by the daemon as soon
        as one wait has ``need`` of them, or after ``timeout_s`` (kept under this client's RPC timeout).

        One round trip however many waits; None from a daemon that predates the op (poll it instead).
        ``final``: indexes of the waits given up after this one (counted as handoff timeouts if short).
        """
        if not waits:
            return []
        timeout_ms = int(1000 * max(0.0, min(timeout_s, self.timeout_s / 2)))
        items = [[protocol.hex_keys(list(keys)), need] for keys, need in waits]
        msg: dict[str, Any] = {"op": "wait", "waits": items, "timeout_ms": min(timeout_ms, protocol.MAX_WAIT_MS)}
        if reader is not None:
            msg["reader"], msg["final"] = reader.fields(), list(final)
        try:
            reply = self._call(msg)
        except PoolError as err:
            if f"{protocol.E_BAD_REQUEST}: unknown op" in str(err):
                return None
            raise
        return [int(n) for n in reply["n"]]

    def begin_write(self, key: bytes, nbytes: int) -> WriteLease | None:
        """A lease to write ``nbytes`` for ``key``; None when the key is already stored or being stored."""
        return self.begin_write_many([(key, nbytes)])[0]

    def begin_write_many(self, items: Sequence[tuple[bytes, int]]) -> list[WriteLease | None]:
        """Leases for several chunks in one round trip.

        None for a key already committed or being written by someone else, and, when the pool is
        full, for the items that found no room after earlier items of the batch took it. Raises
        :class:`PoolFull` only when not one item could be given space.
        """
        out = self.lease_many(items)
        full = sum(1 for lease in out if lease == FULL)
        if full and not any(isinstance(lease, WriteLease) for lease in out):
            largest = self._mapping().largest_region
            if any(nbytes > largest for _, nbytes, *_ in items):
                raise PoolFull(f"pool full: a chunk is larger than the pool ({largest} bytes); raise --size")
            raise PoolFull(f"pool full: no room for {full} chunk(s) and nothing evictable (all pinned or in flight)")
        return [lease if isinstance(lease, WriteLease) else None for lease in out]

    def lease_many(
        self,
        items: Sequence[
            tuple[bytes, int] | tuple[bytes, int, bytes | None] | tuple[bytes, int, bytes | None, bytes | None]
        ],
    ) -> list[WriteLease | str]:
        """Leases for ``(key, nbytes[, parent[, tokens]])`` items in one round trip; never raises for a full pool.

        ``tokens``: the chunk's token ids (:func:`~.protocol.pack_tokens`), for the tenant's ``stored`` event
        only; a batch sends at most :data:`WRITE_TOKEN_BYTES` of them, the items after that go without.

        Per item a :class:`WriteLease`, or why not: :data:`PRESENT` (stored or being stored already),
        :data:`FULL` (no room even after eviction), :data:`ORPHAN` (``parent``, the chunk before this
        one in its prompt, is not stored: this one could never be hit, so the daemon keeps prompts
        prefix-closed and refuses it) or :data:`QUOTA` (this tenant holds as many bytes or write leases
        as its quota allows, and none of its own chunks could be evicted for this one).
        """
        if not items:
            return []
        wire = []
        token_budget, tokenless = WRITE_TOKEN_BYTES, 0
        for key, nbytes, *rest in items:
            parent = rest[0] if rest else None
            tokens = rest[1] if len(rest) > 1 else None
            if not isinstance(key, bytes) or nbytes <= 0:
                raise PoolError(f"begin_write: need a bytes key and a positive size, got {key!r}, {nbytes}")
            item: list[Any] = [key.hex(), int(nbytes), parent.hex() if parent is not None else None]
            if tokens and len(tokens) <= token_budget:
                token_budget -= len(tokens)
                item.append(tokens.hex())
            else:
                tokenless += bool(tokens)
                if parent is None:
                    item.pop()  # as short as it can be: the daemon reads a missing parent as none
            wire.append(item)
        if tokenless:
            log.debug("pool: %d chunk(s) of a write batch sent without their token ids (batch over %d bytes of them)",
                      tokenless, WRITE_TOKEN_BYTES)  # fmt: skip
        asked_at = time.monotonic()
        with self._lock:
            reply = self._call({"op": "write", "items": wire})
            mapping = self._mapping()
        epoch, lease_s = int(reply["epoch"]), _lease_seconds(reply)
        out: list[WriteLease | str] = []
        for (key, nbytes, *_), grant in zip(items, reply["grants"], strict=True):
            if grant is None or isinstance(grant, str):
                out.append({None: PRESENT, "full": FULL, "orphan": ORPHAN, "quota": QUOTA}.get(grant, FULL))
                continue
            lease_id, offset = grant
            view = mapping.view(offset, nbytes)
            out.append(WriteLease(self, key, int(lease_id), epoch, offset, view, lease_s=lease_s, asked_at=asked_at))
        return out

    def commit_many(self, leases: Sequence[WriteLease]) -> list[bool]:
        """Checksum and commit in one round trip; per lease, False when it was lost (expired or stale)."""
        checksums = [
            lease._checksum if lease._checksum is not None else copyhash.checksum(lease.buffer) for lease in leases
        ]
        return self._commit_checksummed(leases, checksums)

    def abort_many(self, leases: Sequence[WriteLease]) -> None:
        """Give the space back. Best effort: a lease that cannot be aborted expires on its own."""
        pending = [lease for lease in leases if not lease.done]
        for lease in pending:
            lease.done = True
            _release_view(lease.buffer)
        for epoch, group in _by_epoch(pending).items():
            try:
                self._call({"op": "abort", "epoch": epoch, "leases": [lease.lease_id for lease in group]})
            except PoolError as err:
                log.debug("pool: abort of %d lease(s) failed (%s); they expire on their own", len(group), err)

    def open_read(self, key: bytes) -> ReadPin | None:
        """Pin a committed chunk for reading; None on a miss."""
        return self.open_read_many([key])[0]

    def open_read_many(self, keys: Sequence[bytes]) -> list[ReadPin | None]:
        """Pin several chunks in one round trip; None for each miss."""
        if not keys:
            return []
        return self._read(keys, prefix=False)

    def pin_prefix(self, keys: Sequence[bytes]) -> list[ReadPin]:
        """Like :meth:`lookup_prefix`, but the leading hits come back pinned. One round trip.

        Lets a scheduler guarantee that what it reported as a hit is still there when the worker
        loads it: pass :meth:`ReadPin.ticket` values to the worker, which turns them back into pins
        with :meth:`claim`, copies, and releases. Every pin must be released (or it lives until its
        lease expires, holding its space).
        """
        if not keys:
            return []
        return [pin for pin in self._read(keys, prefix=True) if pin is not None]

    def claim(self, tickets: Sequence[PinTicket]) -> list[ReadPin]:
        """Pins from :meth:`ReadPin.ticket` values made by another client (another process) of the same pool.

        No round trip. The pins stay bound to the connection that took them: only that client can
        release or renew them, and releasing a claimed pin here only stops using it. If the daemon
        restarted since, the bytes may have been reused: :meth:`ReadPin.read_into` and
        :meth:`ReadPin.verify` then raise :class:`ChecksumMismatch`.
        """
        if not tickets:
            return []
        with self._lock:
            if self._map is None or self._pid != os.getpid():
                self._call({"op": "stats"})  # any call connects and maps the pool
            mapping = self._mapping()
        out = []
        for key, pin_id, epoch, offset, nbytes, checksum in tickets:
            view = mapping.view(offset, nbytes).toreadonly()
            out.append(ReadPin(self, key, pin_id, epoch, offset, checksum, view, borrowed=True))
        return out

    def _read(self, keys: Sequence[bytes], *, prefix: bool) -> list[ReadPin | None]:
        msg: dict[str, Any] = {"op": "read", "keys": protocol.hex_keys(list(keys))}
        if prefix:
            msg["prefix"] = True
        asked_at = time.monotonic()
        with self._lock:
            reply = self._call(msg)
            mapping = self._mapping()
        epoch, lease_s = int(reply["epoch"]), _lease_seconds(reply)
        if reply.get("refused"):
            # Pins past this tenant's quota come back as misses (never an error): the reader recomputes.
            log.debug("pool: pins refused as misses: %s (this tenant is at its pin quota)", reply["refused"])
        out: list[ReadPin | None] = []
        for key, pin in zip(keys, reply["pins"], strict=False):
            if pin is None:
                out.append(None)
                continue
            pin_id, offset, nbytes, checksum = pin
            view = mapping.view(offset, nbytes).toreadonly()
            out.append(
                ReadPin(self, key, int(pin_id), epoch, offset, int(checksum), view, lease_s=lease_s, asked_at=asked_at)
            )
        return out

    def release_many(self, pins: Sequence[ReadPin]) -> None:
        """Unpin in one round trip; pins found corrupt are reported so the daemon drops their chunk."""
        pending = [pin for pin in pins if not pin.done]
        for pin in pending:
            pin.done = True
            _release_view(pin.buffer)
        pending = [pin for pin in pending if not pin.borrowed]
        for epoch, group in _by_epoch(pending).items():
            msg: dict[str, Any] = {"op": "release", "epoch": epoch, "pins": [p.pin_id for p in group]}
            corrupt = [p.pin_id for p in group if p.corrupt]
            if corrupt:
                msg["corrupt"] = corrupt
            try:
                self._call(msg)
            except PoolError as err:
                log.debug("pool: release of %d pin(s) failed (%s); they expire on their own", len(group), err)

    def renew_many(self, held: Sequence[WriteLease | ReadPin]) -> list[bool]:
        """Extend write leases and read pins by a full lease period; False for each one already lost.

        For holders that may outlive ``--lease-seconds`` (a scheduler keeping pins of a queued request).
        """
        results = [False] * len(held)
        groups: dict[int, list[int]] = {}
        for i, item in enumerate(held):
            if not item.done and not getattr(item, "borrowed", False):
                groups.setdefault(item.epoch, []).append(i)
        for epoch, idx in groups.items():
            ids = [held[i].lease_id if isinstance(held[i], WriteLease) else held[i].pin_id for i in idx]
            asked_at = time.monotonic()
            try:
                reply = self._call({"op": "renew", "epoch": epoch, "ids": ids})["results"]
            except _StaleEpoch:
                continue
            for i, ok in zip(idx, reply, strict=True):
                results[i] = bool(ok)
                if ok:
                    held[i]._extend(asked_at)
        return results

    def keep_alive(self, held: Sequence[WriteLease | ReadPin], *, min_left_s: float) -> None:
        """Renew, in one round trip, those of ``held`` with less than ``min_left_s`` seconds left.

        For copies that may outlast a lease. A lease the daemon no longer knows keeps its old deadline,
        so the next :meth:`WriteLease.fill` or :meth:`ReadPin.read_into` on it fails cleanly.
        """
        due = [item for item in held if not item.done and item.remaining() < min_left_s]
        if due:
            self.renew_many(due)

    def stats(self) -> dict[str, int]:
        return {k: int(v) for k, v in self._call({"op": "stats"})["stats"].items()}

    def status(self) -> dict[str, Any]:
        return dict(self._call({"op": "status"}))

    # ------------------------------------------------------------ convenience

    def put(self, key: bytes, data: Any) -> bool:
        """Store ``data`` (any C-contiguous buffer) under ``key``; False if the key is already present."""
        src = _byte_view(data)
        lease = self.begin_write(key, src.nbytes)
        if lease is None:
            return False
        try:
            lease.fill(src)
        except BaseException:
            lease.abort()
            raise
        if not self.commit_many([lease])[0]:
            raise LeaseLost(f"chunk {key.hex()[:16]}: lease expired or pool restarted before commit")
        return True

    def get_into(self, key: bytes, out: Any) -> bool:
        """Copy the chunk into the writable buffer ``out`` and verify the copy; False on a miss."""
        pin = self.open_read(key)
        if pin is None:
            return False
        with pin:
            pin.read_into(out)
        return True

    def close(self) -> None:
        with self._lock:
            self._reset()

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # ------------------------------------------------------------ internals

    def _commit_checksummed(self, leases: Sequence[WriteLease], checksums: Sequence[int]) -> list[bool]:
        results = [False] * len(leases)
        groups: dict[int, list[int]] = {}
        for i, lease in enumerate(leases):
            if not lease.done:
                groups.setdefault(lease.epoch, []).append(i)
        for epoch, idx in groups.items():
            msg = {"op": "commit", "epoch": epoch, "items": [[leases[i].lease_id, checksums[i]] for i in idx]}
            try:
                reply = self._call(msg)["results"]
            except _StaleEpoch:
                reply = [False] * len(idx)
            for i, ok in zip(idx, reply, strict=True):
                results[i] = bool(ok)
                leases[i].done = True
                _release_view(leases[i].buffer)
        return results

    def _mapping(self) -> _Mapping:
        assert self._map is not None  # set by the _call that just succeeded
        return self._map

    def _call(self, msg: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self._pid != os.getpid():
                # Forked: the socket belongs to the parent; forget it without closing it.
                self._sock, self._map, self._pid = None, None, os.getpid()
            for attempt in (0, 1):
                fresh = self._sock is None
                try:
                    if self._sock is None:
                        self._connect()
                    assert self._sock is not None
                    protocol.send_msg(self._sock, msg)
                    reply, _ = protocol.recv_msg(self._sock)
                    if reply is None:
                        raise ConnectionError("pool daemon closed the connection")
                except TimeoutError:
                    self._reset()
                    raise PoolUnavailable(
                        f"pool at {self.url}: no answer to {msg['op']} within {self.timeout_s}s"
                    ) from None
                except (OSError, protocol.ProtocolError) as err:
                    self._reset()
                    if fresh or attempt:
                        raise PoolUnavailable(f"pool at {self.url}: {err}") from None
                    continue  # a connection from before a daemon restart: retry once on a new one
                if not reply.get("ok"):
                    code = str(reply.get("error"))
                    if code in _LAST_WORDS:
                        self._reset()
                    raise _ERRORS.get(code, PoolError)(f"pool at {self.url}: {code}: {reply.get('message')}")
                return reply
        raise AssertionError("unreachable")

    def _token(self) -> str | None:
        if not self.token_file:
            return None
        try:
            with open(self.token_file, encoding="utf-8") as fh:
                return fh.read().strip()
        except (OSError, UnicodeDecodeError) as err:
            raise PoolAuthError(
                f"pool at {self.url}: cannot read the pool credential {self.token_file} "
                f"({getattr(err, 'strerror', None) or err}); in a group's pod the CSI node plugin mints it there "
                "at start (the pod's FailedMount events say why it did not)"
            ) from None

    def _refused(self, reply: dict[str, Any]) -> PoolError:
        code = str(reply.get("error"))
        cls = PoolAuthError if code in protocol.AUTH_ERRORS else PoolUnavailable
        where = ""
        if cls is PoolAuthError and self.token_file:
            where = (
                f" (credential {self.token_file}: the operator issues it for the pool of the group's "
                "spec.poolRef; for a pool run by hand, `maru-pool token` makes one)"
            )
        return cls(f"pool at {self.url}: {code}: {reply.get('message')}{where}")

    def _authenticate(self, sock: socket.socket, token: str | None) -> None:
        """Authenticate the metadata connection of a multi-node pool (a hello that asks for no memory)."""
        protocol.send_msg(sock, {"op": "hello", "memory": False, "token": token})
        reply, _ = protocol.recv_msg(sock)
        if reply is None:
            raise ConnectionError("metadata server closed the connection during hello")
        if not reply.get("ok"):
            raise self._refused(reply)

    def _connect(self) -> None:
        token = self._token()
        hello_sock = _open_socket(self._endpoint, self.timeout_s)
        try:
            try:
                protocol.send_msg(hello_sock, {"op": "hello", "token": token})
            except OSError:
                # A daemon over its connection caps answers at accept and closes: say why, if it did.
                refusal = _last_word(hello_sock)
                if refusal is not None:
                    raise self._refused(refusal) from None
                raise
            reply, fds = protocol.recv_msg(hello_sock, max_fds=MAX_REGIONS)
        except BaseException:
            hello_sock.close()
            raise
        try:
            if reply is None:
                raise ConnectionError("pool daemon closed the connection during hello")
            if not reply.get("ok"):
                raise self._refused(reply)
            mapping = self._map_memory(reply, fds)
        except BaseException:
            hello_sock.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)
        metadata = reply.get("metadata")
        if metadata:
            hello_sock.close()
            try:
                rpc_sock = _open_socket(parse_endpoint(metadata), self.timeout_s)
            except BaseException:
                mapping.close()
                raise
            try:
                self._authenticate(rpc_sock, token)
            except BaseException:
                rpc_sock.close()
                mapping.close()
                raise
        else:
            rpc_sock = hello_sock
        self._sock, self._map = rpc_sock, mapping
        self.epoch = int(reply["epoch"])
        self.backend = str(reply.get("backend", ""))
        if token and reply.get("auth") is False and not self._warned_no_auth:
            self._warned_no_auth = True
            log.warning("pool at %s does not authenticate clients: its KV is shared by every client of it", self.url)
        log.debug("pool: connected to %s (backend %s, epoch %d)", self.url, self.backend, self.epoch)

    def _map_memory(self, reply: dict[str, Any], fds: list[int]) -> _Mapping:
        regions = reply["regions"]
        paths = reply.get("paths") or []
        if not regions:
            raise PoolUnavailable(
                f"pool at {self.url}: this daemon holds no pool memory (a metadata server?); "
                "point the client at the node agent's unix:// socket"
            )
        if fds and len(fds) != len(regions):
            raise PoolUnavailable(f"pool at {self.url}: got {len(fds)} memory fds for {len(regions)} regions")
        if not fds and len(paths) != len(regions):
            raise PoolUnavailable(
                f"pool at {self.url}: this daemon holds no pool memory (a metadata server?); "
                "point the client at the node agent's unix:// socket"
            )
        # Epoch, layout and uuid are the daemon's word, from this authenticated hello. The header in the
        # mapping is not consulted: every client of the pool can write it, so a check against it would let
        # one tenant fail everyone's connect. Memory passed by fd is the daemon's own; memory opened by path
        # is checked to be the daemon's file by what the kernel says of it, not by bytes in it.
        mms: list[mmap.mmap] = []
        try:
            for i, region in enumerate(regions):
                mm = self._map_one(
                    fds[i] if fds else None, paths[i] if not fds else None, int(region["map_size"]), region.get("file")
                )
                mms.append(mm)
        except BaseException:
            for mm in mms:
                mm.close()
            raise
        return _Mapping(mms, int(reply["header_size"]), [int(r["capacity"]) for r in regions])

    def _map_one(self, fd: int | None, path: str | None, map_size: int, identity: str | None) -> mmap.mmap:
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        if fd is not None:
            return mmap.mmap(fd, map_size, mmap.MAP_SHARED, prot)
        assert path is not None
        try:
            own_fd = os.open(path, os.O_RDWR)
        except OSError as err:
            raise PoolUnavailable(
                f"pool at {self.url}: cannot open pool memory {path} ({err.strerror}); "
                "over tcp:// the client must run on the daemon's node, else use the unix:// socket"
            ) from None
        try:
            if identity and file_identity(own_fd) != identity:
                raise PoolUnavailable(
                    f"pool at {self.url}: {path} here is not the daemon's pool memory (another file of that "
                    "name: another node or mount namespace); over tcp:// the client must see the daemon's "
                    "file, else use the unix:// socket"
                )
            return mmap.mmap(own_fd, map_size, mmap.MAP_SHARED, prot)
        finally:
            os.close(own_fd)

    def _reset(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
        if self._map is not None:
            self._map.close()
            self._map = None


def _open_socket(endpoint: Endpoint, timeout_s: float) -> socket.socket:
    if endpoint.kind == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        address: Any = endpoint.path
    else:
        sock = socket.socket(socket.AF_INET6 if ":" in endpoint.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        address = (endpoint.host, endpoint.port)
    sock.settimeout(timeout_s)
    try:
        sock.connect(address)
    except BaseException:
        sock.close()
        raise
    return sock


def _last_word(sock: socket.socket) -> dict[str, Any] | None:
    """The error frame a daemon sent before closing ``sock``, if one is there to read."""
    try:
        reply, _ = protocol.recv_msg(sock, max_frame=64 * 1024)
    except (OSError, protocol.ProtocolError):
        return None
    return reply if reply is not None and reply.get("ok") is False else None


def _lease_seconds(reply: dict[str, Any]) -> float:
    """The daemon's lease period from a write or read reply (an older daemon sends none: no limit)."""
    lease_ms = reply.get("lease_ms")
    return lease_ms / 1000 if isinstance(lease_ms, (int, float)) and lease_ms > 0 else math.inf


def _by_epoch(items: Sequence[Any]) -> dict[int, list[Any]]:
    groups: dict[int, list[Any]] = {}
    for item in items:
        groups.setdefault(item.epoch, []).append(item)
    return groups


def _byte_view(data: Any) -> memoryview:
    view = data if isinstance(data, memoryview) else memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def _release_view(view: memoryview) -> None:
    # Views the caller derived keep working; ours stops, so a use after release fails loudly.
    with contextlib.suppress(BufferError):
        view.release()


def _segments_total(segments: Sequence[Segment]) -> int:
    return sum(length for _, length in segments)
