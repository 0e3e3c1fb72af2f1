"""The pool's event log: what a tenant holds, as stored/removed/cleared events it alone can read.

First the index's rules (a real :class:`PoolIndex`), then the daemon: real ``maru-pool serve`` processes
with a pool key, real clients committing chunks as two tenants, each reading its own events over its
authenticated socket.
"""

from __future__ import annotations

import sys
import threading
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import rule

from maru_pool import client as client_module
from maru_pool import protocol
from maru_pool.client import PoolClient, PoolError, WriteLease
from maru_pool.events import CLEARED, KEY_COST_BYTES, REMOVED, STORED, Event, EventLogs, chains
from maru_pool.index import PoolIndex, WriteGrant
from maru_pool.kv_events_wire import BlockRemoved, BlockStored
from maru_pool.link import TenantLink
from maru_pool.publisher import Translator
from tests.support.index import EPOCH as INDEX_EPOCH
from tests.support.index import PAGE as INDEX_PAGE
from tests.support.index import Clock, IndexMachine
from tests.support.pool import (
    Daemon,
    free_port,
    run_cli,
    start_agent,
    start_metadata,
    start_serve,
    token_file,
    write_key,
)

PAGE = 4096
EPOCH = 3


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


def name(i: int) -> bytes:
    """What the tenant's client sent for chunk ``i`` (the index files it under another, scoped key)."""
    return b"own" + k(i)


def tokens(i: int, n: int = 4) -> bytes:
    """Chunk ``i``'s token ids as its writer packs them (``n`` of them)."""
    packed = protocol.pack_tokens([1000 * i + t for t in range(n)])
    assert packed is not None
    return packed


def store(
    index: PoolIndex, i: int, parent: int | None = None, tenant: str = "t", token_ids: bytes | None = None
) -> None:
    item = (k(i), PAGE, k(parent) if parent is not None else None, name(i), token_ids)
    (grant,) = index.begin_write([item], tenant=tenant)
    assert isinstance(grant, WriteGrant), grant
    assert index.commit(EPOCH, [(grant.lease_id, i)]) == [True]


def events_of(index: PoolIndex, after: int, tenant: str = "t") -> list[tuple[str, tuple[bytes, ...], bytes | None]]:
    read = index.read_events(tenant, (EPOCH, after), max_keys=1000)
    assert not read.resync
    return [(e.kind, e.keys, e.parent) for e in read.events]


# ------------------------------------------------------------------------------------------- the index


def test_commit_logs_the_tenants_own_keys_as_chains() -> None:
    index = PoolIndex(8 * PAGE, epoch=EPOCH)
    (g0, g1, g2) = index.begin_write(
        [(k(0), PAGE, None, name(0)), (k(1), PAGE, k(0), name(1)), (k(2), PAGE, k(1), name(2))], tenant="t"
    )
    assert all(isinstance(g, WriteGrant) for g in (g0, g1, g2))
    index.commit(EPOCH, [(g.lease_id, 1) for g in (g0, g1, g2)])  # type: ignore[union-attr]
    store(index, 5, parent=1)  # a branch off chunk 1: a run of its own
    assert events_of(index, 0) == [
        (STORED, (name(0), name(1), name(2)), None),
        (STORED, (name(5),), name(1)),
    ]


def test_eviction_logs_removed() -> None:
    index = PoolIndex(2 * PAGE, epoch=EPOCH)
    store(index, 0)
    store(index, 1, parent=0)
    index.lookup_prefix([k(0), k(1)])
    store(index, 9)  # full: the least recently used prompt's deepest chunk goes
    assert events_of(index, 2) == [(REMOVED, (name(1),), None), (STORED, (name(9),), None)]


def test_a_corrupt_chunk_is_removed_with_its_descendants() -> None:
    index = PoolIndex(8 * PAGE, epoch=EPOCH)
    for i in range(3):
        store(index, i, parent=i - 1 if i else None)
    (pin,) = index.open_read([k(1)])
    index.release(EPOCH, [pin.pin_id], corrupt=[pin.pin_id])  # type: ignore[union-attr]
    assert events_of(index, 3) == [(REMOVED, (name(1), name(2)), None)]


def test_flush_drops_the_tenants_chunks_and_logs_cleared() -> None:
    index = PoolIndex(8 * PAGE, epoch=EPOCH)
    store(index, 0)
    store(index, 1, parent=0)
    store(index, 7, tenant="other")
    assert index.flush("t") == 2
    assert index.lookup_prefix([k(0)]) == 0
    assert index.lookup_prefix([k(7)]) == 1  # another tenant's chunks stay
    assert events_of(index, 2) == [(CLEARED, (), None)]
    assert events_of(index, 0, tenant="other") == [(STORED, (name(7),), None)]
    index.check_invariants()


def test_a_reader_behind_the_ring_resyncs_from_what_is_held() -> None:
    index = PoolIndex(16 * PAGE, epoch=EPOCH, events_keep=6)
    store(index, 0)
    store(index, 1, parent=0)
    store(index, 2, parent=1)
    store(index, 3)
    store(index, 4, parent=3)
    (pin,) = index.open_read([k(4)])
    index.release(EPOCH, [pin.pin_id], corrupt=[pin.pin_id])  # type: ignore[union-attr]
    read = index.read_events("t", (EPOCH, 1), max_keys=1000)  # event 2 is no longer in the ring
    assert read.resync
    assert read.last == 6
    # All-cleared first, then every chunk held, each prompt one run with its parents first.
    assert [(e.kind, e.keys, e.parent) for e in read.events] == [
        (CLEARED, (), None),
        (STORED, (name(0), name(1), name(2)), None),
        (STORED, (name(3),), None),
    ]
    assert events_of(index, read.last) == []  # and it continues from there without a gap


def test_a_reader_of_another_epoch_or_a_new_one_resyncs() -> None:
    index = PoolIndex(8 * PAGE, epoch=EPOCH)
    store(index, 0)
    for after in (None, (EPOCH - 1, 1)):
        read = index.read_events("t", after, max_keys=1000)
        assert read.resync and read.last == 1
        assert [e.kind for e in read.events] == [CLEARED, STORED]
    # A tenant that never stored anything: a fresh reader is told "nothing", then waits for news.
    fresh = index.read_events("nobody", None, max_keys=1000)
    assert fresh.resync and [e.kind for e in fresh.events] == [CLEARED]
    assert index.read_events("nobody", (EPOCH, 0), max_keys=1000).events == []


def test_a_read_waits_in_the_daemon_until_an_event_comes() -> None:
    index = PoolIndex(8 * PAGE, epoch=EPOCH)
    got: list[list[Event]] = []
    reader = threading.Thread(
        target=lambda: got.append(index.read_events("t", (EPOCH, 0), max_keys=10, timeout_s=60).events)
    )
    reader.start()
    store(index, 0)
    reader.join(timeout=60)
    assert not reader.is_alive()
    assert [(e.kind, e.keys) for e in got[0]] == [(STORED, (name(0),))]


def test_reads_are_bounded_by_keys_but_never_empty() -> None:
    logs = EventLogs(keep=100)
    logs.stored("t", [(name(i), None) for i in range(3)])  # three roots: three events
    logs.removed("t", [name(i) for i in range(10)])
    first = logs.read("t", 0, (), max_keys=4)
    assert [e.seq for e in first.events] == [1, 2]
    rest = logs.read("t", first.last, (), max_keys=1)
    assert [e.seq for e in rest.events] == [3]
    big = logs.read("t", 3, (), max_keys=1)
    assert [len(e.keys) for e in big.events] == [10]


def test_a_commit_logs_each_chunks_token_ids_in_its_stored_event() -> None:
    index = PoolIndex(8 * PAGE, epoch=EPOCH)
    (g0, g1, g2) = index.begin_write(
        [
            (k(0), PAGE, None, name(0), tokens(0)),
            (k(1), PAGE, k(0), name(1), tokens(1)),
            (k(2), PAGE, k(1), name(2)),  # an older writer: no tokens
        ],
        tenant="t",
    )
    index.commit(EPOCH, [(g.lease_id, 1) for g in (g0, g1, g2)])  # type: ignore[union-attr]
    store(index, 5)  # no chunk of the event has tokens: the event carries none
    read = index.read_events("t", (EPOCH, 0), max_keys=1000)
    assert [(e.keys, e.tokens) for e in read.events] == [
        ((name(0), name(1), name(2)), (tokens(0), tokens(1), None)),
        ((name(5),), None),
    ]
    # The index itself holds no tokens: the lease carried them to the commit, and the lease is gone.
    assert not any(hasattr(chunk, "tokens") for chunk in index._chunks.values())


def test_an_aborted_or_expired_writes_tokens_are_never_logged() -> None:
    clock = Clock()
    index = PoolIndex(8 * PAGE, epoch=EPOCH, lease_seconds=10, clock=clock)
    (aborted, expired) = index.begin_write(
        [(k(0), PAGE, None, name(0), tokens(0)), (k(1), PAGE, None, name(1), tokens(1))], tenant="t"
    )
    index.abort(EPOCH, [aborted.lease_id])  # type: ignore[union-attr]
    clock.now += 11
    index.expire()
    store(index, 0, token_ids=tokens(7))  # the same key written again, with what that writer sent
    assert [(e.keys, e.tokens) for e in index.read_events("t", (EPOCH, 0), max_keys=1000).events] == [
        ((name(0),), (tokens(7),))
    ]
    del expired


def test_a_resync_replays_the_tokens_still_in_the_ring() -> None:
    index = PoolIndex(16 * PAGE, epoch=EPOCH, events_keep=10_000)
    store(index, 0, token_ids=tokens(0))
    store(index, 1, parent=0, token_ids=tokens(1))
    store(index, 2, parent=1)
    read = index.read_events("t", None, max_keys=1000)
    assert read.resync
    assert [(e.kind, e.keys, e.tokens) for e in read.events] == [
        (CLEARED, (), None),
        (STORED, (name(0), name(1), name(2)), (tokens(0), tokens(1), None)),
    ]


def test_token_ids_count_against_keep_as_the_memory_they_hold() -> None:
    chunk = tokens(1, n=256)  # a chunk of the default 256 tokens
    logs = EventLogs(keep=100)
    logs.stored("t", [(name(1), None, chunk)])
    (event,) = logs.read("t", 0, (), max_keys=1000).events
    held = sys.getsizeof(chunk) + sys.getsizeof((chunk,))
    assert event.cost == 1 + 1 + -(-held // KEY_COST_BYTES) == 20
    # The ring drops the oldest events to stay within keep, tokens counted.
    for i in range(2, 12):
        logs.stored("t", [(name(i), None, tokens(i, n=256))])
    log = logs._logs["t"]
    assert log.held <= 100
    assert [e.keys for e in log.ring] == [(name(i),) for i in range(7, 12)]
    # A reader's batch is bounded the same way: it carries what it costs.
    assert len(logs.read("t", 6, (), max_keys=40).events) == 2


def ring_bytes(chunk_tokens: int, keep: int = 4_000) -> float:
    """Memory a tenant's ring holds per unit of keep once full of one-chunk stored events."""
    logs = EventLogs(keep=keep)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(keep):  # a one-key event costs 2 or more: the ring is full before the end
            logs.stored("t", [(i.to_bytes(16, "big"), None, tokens(i, n=chunk_tokens) if chunk_tokens else None)])
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return held / keep


def test_a_ring_of_tokenized_chunks_holds_no_more_memory_than_one_of_bare_keys() -> None:
    bare, tokenized = ring_bytes(0), ring_bytes(256)
    # Measured: 125 bytes per unit of keep bare (a one-key event holds 241), 68 with 256 tokens a chunk.
    assert tokenized <= bare * 1.25, (bare, tokenized)


def test_chains_split_where_a_key_is_not_the_next_ones_parent() -> None:
    a, b, c, d = (bytes([i]) for i in range(4))
    assert list(chains([(a, None), (b, a), (c, None), (d, b)])) == [(None, [a, b]), (None, [c]), (b, [d])]


def test_events_keep_must_be_positive() -> None:
    with pytest.raises(ValueError, match="keep"):
        EventLogs(keep=0)


class EventsMachine(IndexMachine):
    """Random writes, commits, aborts, reads, corrupt releases, evictions, expiries and flushes, with a reader
    that reads now and then: what it rebuilds from the events is always exactly what the index holds. A stale
    index is worse than none."""

    keep = 10_000  # the reader never falls behind: every change must be in the log

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.index = PoolIndex(16 * INDEX_PAGE, epoch=INDEX_EPOCH, lease_seconds=10, align=INDEX_PAGE,
                               clock=self.clock, events_keep=self.keep)  # fmt: skip
        self.replica: set[bytes] = set()
        self.cursor: tuple[int, int] | None = None
        # The same reads through the publisher's translation, applied by two consumers of vLLM's events: one
        # that honours AllBlocksCleared and one that ignores it (llm-d's indexer): both must end up right.
        self.translator = Translator(block_size=16)
        self.consumers: tuple[set[bytes], set[bytes]] = (set(), set())

    @rule(i=st.integers(31, 40), pages=st.integers(3, 8))
    def store_big(self, i: int, pages: int) -> None:
        # Written and committed at once: keeps the pool near full, so writes evict.
        (grant,) = self.index.begin_write([(k(i), pages * INDEX_PAGE)])
        if isinstance(grant, WriteGrant):
            self.index.commit(INDEX_EPOCH, [(grant.lease_id, i)])

    @rule()
    def flush(self) -> None:
        self.index.flush("")
        self.pins = {p: v for p, v in self.pins.items() if self.index._chunks.get(v[0]) is not None}

    @rule(max_keys=st.integers(1, 5))
    def reader_catches_up(self, max_keys: int) -> None:
        while True:
            read = self.index.read_events("", self.cursor, max_keys=max_keys)
            if read.resync:
                self.replica.clear()
            for event in read.events:
                if event.kind == STORED:
                    self.replica.update(event.keys)
                elif event.kind == REMOVED:
                    self.replica.difference_update(event.keys)
                else:
                    self.replica.clear()
            self.cursor = (INDEX_EPOCH, read.last)
            wire = [[e.kind, [key.hex() for key in e.keys], e.parent.hex() if e.parent else None] for e in read.events]
            for event in self.translator.translate(wire, resync=read.resync):
                for honours, consumer in zip((True, False), self.consumers, strict=True):
                    if isinstance(event, BlockStored):
                        consumer.update(event.block_hashes)  # type: ignore[arg-type]
                    elif isinstance(event, BlockRemoved):
                        consumer.difference_update(event.block_hashes)  # type: ignore[arg-type]
                    elif honours:
                        consumer.clear()
            if not read.events:
                break
        held = {key for key, chunk in self.index._chunks.items() if chunk.committed}
        assert self.replica == held
        assert self.consumers == (held, held)


class BehindEventsMachine(EventsMachine):
    keep = 8  # the reader falls behind the ring again and again: its resyncs must rebuild the same


TestEventsMachine = EventsMachine.TestCase
TestEventsMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestBehindEventsMachine = BehindEventsMachine.TestCase
TestBehindEventsMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


# ------------------------------------------------------------------------------------------- the daemon

MiB = 1 << 20


@pytest.fixture
def keyed(sock_dir: Path) -> tuple[Path, dict[str, str]]:
    key = write_key(sock_dir / "pool.key")
    return key, {
        "a": token_file(sock_dir / "a.token", key, "ns-a/qwen"),
        "b": token_file(sock_dir / "b.token", key, "ns-b/qwen"),
    }


def start(daemons: list[Daemon], sock_dir: Path, key: Path, *extra: str) -> Daemon:
    return start_serve(daemons, sock_dir, "--auth-key-file", str(key), *extra, size="1Mi")


def commit_prompt(
    client: PoolClient, keys: list[bytes], nbytes: int = 4096, token_ids: list[bytes | None] | None = None
) -> None:
    """Store a prompt's chunks as the connector does: each names the one before it (and carries its tokens)."""
    items = [(key, nbytes, keys[i - 1] if i else None) for i, key in enumerate(keys)]
    if token_ids is not None:
        items = [(*item, t) for item, t in zip(items, token_ids, strict=True)]  # type: ignore[misc]
    leases = client.lease_many(items)
    assert all(isinstance(lease, WriteLease) for lease in leases), leases
    for lease in leases:
        lease.fill(bytes(nbytes))  # type: ignore[union-attr]
    assert all(client.commit_many(leases))  # type: ignore[arg-type]


def read(link: TenantLink, after: list[int] | None, timeout_ms: int = 0, **extra: object) -> dict:
    return link.call({"op": "events", "after": after, "timeout_ms": timeout_ms, **extra}, wait_s=timeout_ms / 1000)


def test_daemon_serves_each_tenant_only_its_own_events(
    daemons: list[Daemon], sock_dir: Path, keyed: tuple[Path, dict[str, str]]
) -> None:
    key, tokens = keyed
    d = start(daemons, sock_dir, key)
    url = d.ready["listen"]
    prompt = [b"\x01" * 16, b"\x02" * 16, b"\x03" * 16]
    with PoolClient(url, timeout_s=10, token_file=tokens["a"]) as a, TenantLink(url, token_file=tokens["a"]) as la, \
            TenantLink(url, token_file=tokens["b"]) as lb:  # fmt: skip
        start_a, start_b = read(la, None), read(lb, None)
        assert start_a["resync"] and start_a["events"] == [[CLEARED, [], None]]
        commit_prompt(a, prompt)
        got = read(la, [start_a["epoch"], start_a["last"]], timeout_ms=10_000)
        # The keys the tenant wrote, not the scoped keys the daemon files them under.
        assert got["events"] == [[STORED, [k.hex() for k in prompt], None]] and not got["resync"]
        # Tenant b sees nothing of it: no event, and a resync of what it holds is empty.
        assert read(lb, [start_b["epoch"], start_b["last"]])["events"] == []
        assert read(lb, None)["events"] == [[CLEARED, [], None]]


def test_daemon_keeps_the_tokens_each_chunk_was_written_with_for_its_events(
    daemons: list[Daemon], sock_dir: Path, keyed: tuple[Path, dict[str, str]]
) -> None:
    key, tokens_of = keyed
    d = start(daemons, sock_dir, key)
    url = d.ready["listen"]
    new, old = [b"\x01" * 16, b"\x02" * 16], [b"\x03" * 16]
    with PoolClient(url, timeout_s=10, token_file=tokens_of["a"]) as a, \
            TenantLink(url, token_file=tokens_of["a"]) as la:  # fmt: skip
        first = read(la, None)
        commit_prompt(a, new, token_ids=[tokens(1), tokens(2)])  # [key, n, null, tokens], [key, n, parent, tokens]
        commit_prompt(a, old)  # an older client's items: [key, n] (and [key, n, parent])
        after = [first["epoch"], first["last"]]  # both commits are logged before the read: one reply has both
        assert read(la, after, tokens=True)["events"] == [
            [STORED, [k.hex() for k in new], None, [tokens(1).hex(), tokens(2).hex()]],
            [STORED, [k.hex() for k in old], None, None],
        ]
        # A reader that does not ask for tokens (one that predates them) gets the three elements it unpacks.
        assert read(la, after)["events"] == [
            [STORED, [k.hex() for k in new], None],
            [STORED, [k.hex() for k in old], None],
        ]
        # Items grow at the end: an element after the tokens (a newer client's) is ignored, not refused.
        (grant,) = la.call({"op": "write", "items": [["04" * 16, 4096, None, tokens(4).hex(), "newer"]]})["grants"]
        assert isinstance(grant, list)


def test_a_write_batch_over_the_token_budget_sends_the_rest_without_tokens(
    daemons: list[Daemon], sock_dir: Path, keyed: tuple[Path, dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch stays under the daemon's frame limit: its chunks are stored, only their events lose tokens."""
    key, tokens_of = keyed
    d = start(daemons, sock_dir, key)
    url = d.ready["listen"]
    monkeypatch.setattr(client_module, "WRITE_TOKEN_BYTES", 2 * len(tokens(0)))
    keys = [bytes([9, i]) * 8 for i in range(3)]
    with PoolClient(url, timeout_s=10, token_file=tokens_of["a"]) as a, \
            TenantLink(url, token_file=tokens_of["a"]) as la:  # fmt: skip
        first = read(la, None)
        commit_prompt(a, keys, token_ids=[tokens(0), tokens(1), tokens(2)])
        assert read(la, [first["epoch"], first["last"]], tokens=True)["events"] == [
            [STORED, [k.hex() for k in keys], None, [tokens(0).hex(), tokens(1).hex(), None]]
        ]


def test_daemon_refuses_malformed_tokens_naming_them(
    daemons: list[Daemon], sock_dir: Path, keyed: tuple[Path, dict[str, str]]
) -> None:
    key, tokens_of = keyed
    d = start(daemons, sock_dir, key)
    with TenantLink(d.ready["listen"], token_file=tokens_of["a"]) as la:
        for bad, rule in (("00" * 6, "4 bytes each"), ("", "4 bytes each"), (7, "hex string"), ("zz", "fromhex")):
            with pytest.raises(PoolError, match=f"{protocol.E_BAD_REQUEST}.*{rule}"):
                la.call({"op": "write", "items": [["05" * 16, 4096, None, bad]]})
        with pytest.raises(PoolError, match=f"{protocol.E_BAD_REQUEST}.*tokens must be true or false"):
            la.call({"op": "events", "after": None, "tokens": "yes"})


def test_daemon_flush_and_restart_clear_the_tenants_events(
    daemons: list[Daemon], sock_dir: Path, keyed: tuple[Path, dict[str, str]]
) -> None:
    key, tokens = keyed
    d = start(daemons, sock_dir, key)
    url = d.ready["listen"]
    with PoolClient(url, timeout_s=10, token_file=tokens["a"]) as a, TenantLink(url, token_file=tokens["a"]) as la:
        commit_prompt(a, [b"\x01" * 16, b"\x02" * 16])
        before = read(la, None)
        flushed = run_cli("flush", "--pool", url, "--token-file", tokens["a"])
        assert flushed.returncode == 0, flushed.stderr
        assert flushed.stdout.strip() == "flushed 2 chunk(s)"
        after = read(la, [before["epoch"], before["last"]], timeout_ms=10_000)
        assert after["events"] == [[CLEARED, [], None]]
        assert a.lookup_prefix([b"\x01" * 16]) == 0
        # A restarted daemon is a new epoch: a reader of the old one resyncs (cleared, then nothing held).
        d.stop()
        again = start(daemons, sock_dir, key)
        with TenantLink(again.ready["listen"], token_file=tokens["a"]) as relink:
            restarted = read(relink, [after["epoch"], after["last"]])
        assert restarted["resync"] and restarted["events"] == [[CLEARED, [], None]]
        assert restarted["epoch"] != after["epoch"]


def test_daemon_ring_overflow_resyncs_with_what_is_held(
    daemons: list[Daemon], sock_dir: Path, keyed: tuple[Path, dict[str, str]]
) -> None:
    key, tokens = keyed
    d = start(daemons, sock_dir, key, "--events-keep", "4")
    url = d.ready["listen"]
    prompts = [[bytes([p, c]) * 8 for c in range(2)] for p in range(4)]
    with PoolClient(url, timeout_s=10, token_file=tokens["a"]) as a, TenantLink(url, token_file=tokens["a"]) as la:
        first = read(la, None)
        for prompt in prompts:
            commit_prompt(a, prompt)
        behind = read(la, [first["epoch"], first["last"]])
        assert behind["resync"]
        assert behind["events"] == [
            [CLEARED, [], None],
            *[[STORED, [k.hex() for k in prompt], None] for prompt in prompts],
        ]
        assert read(la, [behind["epoch"], behind["last"]])["events"] == []


def test_daemon_refuses_a_malformed_events_request(
    daemons: list[Daemon], sock_dir: Path, keyed: tuple[Path, dict[str, str]]
) -> None:
    key, tokens = keyed
    d = start(daemons, sock_dir, key)
    with TenantLink(d.ready["listen"], token_file=tokens["a"]) as la:
        malformed = (({"after": [1]}, "after"), ({"timeout_ms": 10**9}, "timeout_ms"), ({"max_keys": 0}, "max_keys"))
        for bad, field in malformed:
            with pytest.raises(PoolError, match=f"{protocol.E_BAD_REQUEST}.*{field}"):
                la.call({"op": "events", **bad})
        with pytest.raises(PoolError, match=f"{protocol.E_BAD_REQUEST}.*chunk key must be 1 to 64 bytes"):
            la.call({"op": "write", "items": [["00" * 65, 4096]]})


def test_a_multinode_pools_events_come_from_its_metadata_server(daemons: list[Daemon], sock_dir: Path) -> None:
    device = sock_dir / "dax0.0"
    with open(device, "wb") as fh:
        fh.truncate(8 * MiB)
    port = free_port()
    start_metadata(daemons, port)
    agent = start_agent(daemons, sock_dir, "node-a", port, device)
    keys = [b"\x05" * 16, b"\x06" * 16]
    with PoolClient(agent.ready["listen"], timeout_s=10) as client, TenantLink(f"tcp://127.0.0.1:{port}") as link:
        first = read(link, None)
        commit_prompt(client, keys)
        got = read(link, [first["epoch"], first["last"]], timeout_ms=10_000)
    assert got["events"] == [[STORED, [k.hex() for k in keys], None]]
