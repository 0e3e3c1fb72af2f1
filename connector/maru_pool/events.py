"""What the pool holds, as a log of events per tenant: ``stored``, ``removed``, ``cleared``.

The index appends to a tenant's log under its own lock whenever that tenant's content changes: a chunk
committed (``stored``, with the chunk before it in its prompt), evicted or dropped (``removed``), or all
of the tenant's chunks flushed (``cleared``). Keys in the log are the tenant's **own** keys, as its client
sent them, never the scoped keys the index files them under: a tenant reads only its own log, and the keys
it reads are the ones it (and anyone keying prompts the same way) can compute.

A ``stored`` event also keeps, per key, the token ids the chunk's writer sent with it (if it sent them):
the index never holds them, so they live as long as the event does. Consumers of vLLM's events (llm-d's
indexer, Dynamo's router) key blocks by their tokens, so the publisher needs them; a resync takes them
from the stored events still in the ring (a chunk whose event has left the ring is replayed without).

Each log is a ring bounded by the keys it holds (``keep``), numbered by a sequence that only grows; token
ids count as the keys their memory would hold (:data:`KEY_COST_BYTES`). A reader names the last event it
saw (the daemon's epoch and a sequence number); a reader that fell behind the ring, comes from another
daemon epoch, or starts fresh gets a **resync** instead of a silent gap: ``cleared``, then what the tenant
holds now as ``stored`` events (parents first), then the log from there.

Pure data structures: the caller holds the index lock.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

STORED = "stored"
REMOVED = "removed"
CLEARED = "cleared"
Kind = Literal["stored", "removed", "cleared"]
# The medium the pool's events name when republished as vLLM's (which names its media in capitals: GPU, CPU,
# STORAGE); llm-d lower-cases a medium into its device tier.
MEDIUM = "MARU_POOL"

# Keys a tenant's ring keeps by default (measured: about 8 MiB with one key per event, 241 bytes an event, less
# with longer runs, 57 bytes a key more): a reader polling every second keeps up with tens of thousands of chunk
# changes a second (a few thousand when each carries 256 token ids); one behind resyncs.
DEFAULT_KEEP = 65_536
# Token ids count against ``keep`` as one key per this many bytes of the memory they hold (a key of a run
# holds about 57), so a ring of tokenized chunks holds no more memory than one of bare keys: a chunk of 256
# tokens (1,105 bytes with its bytes object and tuple) counts as 18 keys.
KEY_COST_BYTES = 64

# Per key of a stored event, its token ids (little-endian uint32s), or None where its writer sent none.
Tokens = tuple[bytes | None, ...]


@dataclass(frozen=True)
class Event:
    seq: int
    kind: Kind
    keys: tuple[bytes, ...] = ()  # stored: a chain, each key the parent of the next; removed: any keys
    parent: bytes | None = None  # stored: the key before keys[0] in its prompt (None: the prompt's first)
    tokens: Tokens | None = None  # stored: per key its token ids; None when no key has any

    @property
    def cost(self) -> int:
        """What the event counts against the ring's ``keep``: its keys, one for itself, and its token ids
        as the keys their memory would hold."""
        return 1 + len(self.keys) + token_cost(self.tokens)


@dataclass(frozen=True)
class Read:
    """A reader's answer: ``resync`` first drops all it knew, then ``events`` apply in order; ``last`` is
    the sequence number to ask after next time."""

    events: list[Event]
    last: int
    resync: bool


@dataclass
class TenantLog:
    """One tenant's ring of events."""

    keep: int
    seq: int = 0  # the last sequence number given out
    held: int = 0  # keys (and events) counted against keep
    ring: deque[Event] = field(default_factory=deque)

    def append(
        self, kind: Kind, keys: Sequence[bytes] = (), parent: bytes | None = None, tokens: Tokens | None = None
    ) -> None:
        self.seq += 1
        event = Event(self.seq, kind, tuple(keys), parent, tokens)
        self.ring.append(event)
        self.held += event.cost
        while self.held > self.keep and len(self.ring) > 1:
            self.held -= self.ring.popleft().cost

    @property
    def first(self) -> int:
        """The oldest sequence number still held (``seq + 1`` when the ring is empty)."""
        return self.ring[0].seq if self.ring else self.seq + 1

    def since(self, after: int, max_keys: int) -> list[Event]:
        """Events after ``after`` (which the ring must still cover), at least one, then up to ``max_keys``."""
        out: list[Event] = []
        budget = max_keys
        for event in self.ring:
            if event.seq <= after:
                continue
            if out and event.cost > budget:
                break
            out.append(event)
            budget -= event.cost
        return out

    def known_tokens(self) -> dict[bytes, bytes]:
        """Token ids of the keys whose stored event is still in the ring: key -> its tokens."""
        return {
            key: tokens
            for event in self.ring
            if event.tokens is not None
            for key, tokens in zip(event.keys, event.tokens, strict=True)
            if tokens is not None
        }


class EventLogs:
    """Every tenant's log, each bounded by ``keep`` keys."""

    def __init__(self, keep: int = DEFAULT_KEEP) -> None:
        if keep < 1:
            raise ValueError(f"events keep must be a positive number of keys, got {keep}")
        self.keep = keep
        self._logs: dict[str, TenantLog] = {}  # tenant scope -> its ring

    def stored(
        self, tenant: str, chunks: Iterable[tuple[bytes, bytes | None] | tuple[bytes, bytes | None, bytes | None]]
    ) -> None:
        """Chunks ``(key, parent[, tokens])`` committed, in commit order: one event per run of a chain."""
        chunks = list(chunks)
        known = {c[0]: c[2] for c in chunks if len(c) > 2 and c[2] is not None}
        for parent, keys in chains((c[0], c[1]) for c in chunks):
            self._append(tenant, STORED, keys, parent, tokens_of(keys, known))

    def removed(self, tenant: str, keys: Sequence[bytes]) -> None:
        if keys:
            self._append(tenant, REMOVED, keys)

    def cleared(self, tenant: str) -> None:
        self._append(tenant, CLEARED)

    def last(self, tenant: str) -> int:
        log = self._logs.get(tenant)
        return log.seq if log is not None else 0

    def read(
        self,
        tenant: str,
        after: int | None,
        snapshot: Iterable[tuple[bytes, bytes | None]],
        *,
        max_keys: int,
    ) -> Read:
        """The tenant's events after ``after``; a resync from ``snapshot`` (what the tenant holds, parents
        before children) when ``after`` is None or no longer covered by the ring."""
        log = self._logs.get(tenant)
        last = log.seq if log is not None else 0
        if after is not None and log is not None and log.first <= after + 1 and after <= last:
            events = log.since(after, max_keys)
            return Read(events, events[-1].seq if events else after, resync=False)
        if after is not None and log is None and after == 0:
            return Read([], 0, resync=False)  # nothing happened yet, and the reader knows it
        # Events of a resync carry the sequence number the reader continues after: they are not in the ring.
        known = log.known_tokens() if log is not None else {}
        replay = [Event(last, STORED, tuple(keys), parent, tokens_of(keys, known)) for parent, keys in chains(snapshot)]
        return Read([Event(last, CLEARED), *replay], last, resync=True)

    def _append(
        self,
        tenant: str,
        kind: Kind,
        keys: Sequence[bytes] = (),
        parent: bytes | None = None,
        tokens: Tokens | None = None,
    ) -> None:
        log = self._logs.get(tenant)
        if log is None:
            log = self._logs[tenant] = TenantLog(self.keep)
        log.append(kind, keys, parent, tokens)


def token_cost(tokens: Tokens | None) -> int:
    """Keys' worth of ``keep`` that ``tokens`` count as: the bytes they hold, :data:`KEY_COST_BYTES` a key."""
    if tokens is None:
        return 0
    held = sys.getsizeof(tokens) + sum(sys.getsizeof(t) for t in tokens if t is not None)
    return -(-held // KEY_COST_BYTES)


def tokens_of(keys: Sequence[bytes], known: dict[bytes, bytes]) -> Tokens | None:
    """Per key its tokens from ``known``; None when none is known (an event of bare keys costs nothing more)."""
    if not known:
        return None
    tokens = tuple(known.get(key) for key in keys)
    return tokens if any(t is not None for t in tokens) else None


def chains(chunks: Iterable[tuple[bytes, bytes | None]]) -> Iterator[tuple[bytes | None, list[bytes]]]:
    """Group ``(key, parent)`` into runs where each key is the parent of the next, as vLLM's ``BlockStored``
    carries them (one parent for the run's first block); yields ``(parent of the run, keys)``."""
    run: list[bytes] = []
    head: bytes | None = None
    for key, parent in chunks:
        if run and parent == run[-1]:
            run.append(key)
            continue
        if run:
            yield head, run
        run, head = [key], parent
    if run:
        yield head, run
