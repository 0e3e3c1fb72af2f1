"""Request handlers of the three daemon roles, independent of the transport.

* :class:`IndexService` answers the index operations (``serve`` and ``metadata``).
* ``serve`` adds ``hello`` with its own memory (:class:`LocalMemoryHello`).
* The node agent (:mod:`.agent`) answers only ``hello`` and points clients at the metadata server.

Every role sits behind :class:`~.gate.AuthGate`, which hands each request the connection's verified
:class:`~.gate.Session`. Keys are mapped into the session's key space here, in one place, before any
reaches the index: a tenant's keys and another tenant's never meet, whatever salt their clients use.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import protocol
from .gate import Session
from .index import FULL, ORPHAN, QUOTA, PoolIndex, ReadGrant, StaleEpoch
from .memory import HEADER_SIZE, PoolMemory, file_identity, new_device_uuid
from .readers import Reader, ReaderTally, with_readers
from .rpc import Peer

log = logging.getLogger(__name__)

Reply = tuple[dict[str, Any], list[int]]


def fail(code: str, message: str) -> Reply:
    return {"ok": False, "error": code, "message": message}, []


@dataclass
class AgentSeen:
    node: str
    devices: list[str]
    backend: str
    last_seen: float
    problem: str | None = None


class AgentRegistry:
    """Node agents known to a metadata server, from their heartbeats."""

    def __init__(self, stale_after_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._lock = threading.Lock()
        self._agents: dict[str, AgentSeen] = {}  # node name -> last heartbeat

    def seen(self, node: str, devices: list[str], backend: str, problem: str | None) -> None:
        with self._lock:
            self._agents[node] = AgentSeen(node, devices, backend, self._clock(), problem)

    def snapshot(self) -> list[dict[str, Any]]:
        now = self._clock()
        with self._lock:
            return [
                {
                    "node": a.node,
                    "devices": a.devices,
                    "backend": a.backend,
                    "last_seen_seconds": round(now - a.last_seen, 3),
                    "ready": now - a.last_seen <= self.stale_after_s and a.problem is None,
                    "problem": a.problem,
                }
                for a in sorted(self._agents.values(), key=lambda a: a.node)
            ]


@dataclass(frozen=True)
class _Caller:
    owner: int  # the connection's id: leases and pins are bound to it
    session: Session

    def keys(self, values: Any) -> list[bytes]:
        """The request's hex keys, in the caller's tenant key space."""
        return self.session.scope.all(protocol.unhex_keys(values))

    @property
    def tenant(self) -> dict[str, Any]:
        """Whom the index charges, with the quota its token carried (None, unlimited: no authentication)."""
        principal = self.session.principal
        return {"tenant": principal.scope, "quota": principal.quota if principal.kind == "tenant" else None}


class IndexService:
    """Index operations; ``hello`` and ``status`` come from the role that owns this service.

    A metadata server started without ``--size`` has no index until the first agent reports its
    devices (``make_index``); until then index calls are answered "unavailable".
    """

    def __init__(
        self,
        index: PoolIndex | None,
        *,
        hello: Callable[[bool], Reply],
        status: Callable[[], dict[str, Any]],
        agents: AgentRegistry | None = None,
        make_index: Callable[[list[int]], PoolIndex] | None = None,
    ) -> None:
        self.index = index
        self._make_index = make_index
        self._region_uuids: list[str] = []  # device uuid of each region, fixed when the pool is laid out
        self._index_lock = threading.Lock()
        self.errors_before_index = 0
        self._hello = hello
        self._status = status
        self._agents = agents
        self.readers = ReaderTally()
        # op -> handler(request, caller): leases and pins are bound to the caller's connection, keys to its tenant
        self._ops: dict[str, Callable[[dict[str, Any], _Caller], dict[str, Any]]] = {
            "lookup": self._lookup,
            "wait": self._wait,
            "write": self._write,
            "commit": self._commit,
            "abort": self._abort,
            "read": self._read,
            "release": self._release,
            "renew": self._renew,
            "events": self._events,
            "flush": self._flush,
            "stats": lambda _msg, _caller: {"stats": self._ix.stats()},
            "status": lambda _msg, _caller: self._status(),
            "agent": self._agent,
        }

    def tenant_stats(self) -> list[dict[str, Any]]:
        """Per tenant: its use against its quota (the index's) and what its readers found (``readers``)."""
        return with_readers(self.index.tenant_stats() if self.index is not None else [], self.readers.snapshot())

    def closed(self, peer: Peer) -> None:
        """A connection closed: whatever it still held is given back now, not at lease expiry."""
        if self.index is not None:
            n = self.index.release_owner(peer.id)
            if n:
                log.info("pool: a closed connection still held %d lease(s) or pin(s); freed them", n)

    def handle(self, msg: dict[str, Any], peer: Peer, session: Session) -> Reply:
        op = msg.get("op")
        if op == "hello":
            return self._hello(peer.is_unix)
        fn = self._ops.get(op) if isinstance(op, str) else None
        if fn is None:
            self._count_error()
            return fail(protocol.E_BAD_REQUEST, f"unknown op {op!r}")
        if self.index is None and op not in ("agent", "status"):
            return fail(
                protocol.E_UNAVAILABLE,
                "no node agent has reported the pool's devices yet; check that the agents reach this server",
            )
        try:
            reply = fn(msg, _Caller(peer.id, session))
        except StaleEpoch as err:
            return fail(protocol.E_STALE_EPOCH, f"{err}; the pool daemon restarted, reconnect")
        except (KeyError, TypeError, ValueError) as err:
            self._count_error()
            return fail(protocol.E_BAD_REQUEST, f"op {op}: malformed request: {err!r}")
        except Exception:  # a bug must cost one request, not the daemon
            log.exception("rpc: op %s failed; the request was answered with an internal error", op)
            self._count_error()
            return fail(protocol.E_INTERNAL, f"op {op}: internal error (see the pool daemon's log)")
        reply["ok"] = True
        return reply, []

    @property
    def _ix(self) -> PoolIndex:
        assert self.index is not None  # handle() answers "unavailable" before any op gets here
        return self.index

    def _count_error(self) -> None:
        if self.index is None:
            self.errors_before_index += 1
        else:
            self.index.count_error()

    def _lookup(self, msg: dict[str, Any], caller: _Caller) -> dict[str, Any]:
        reader, handoff = Reader.parse(msg.get("reader")), msg.get("handoff", 0)
        if not isinstance(handoff, int) or handoff < 0:
            raise ValueError(f"handoff must be a non-negative integer, got {handoff!r}")
        keys = caller.keys(msg["keys"])
        n = self._ix.lookup_prefix(keys)
        self.readers.looked_up(caller.session.principal.scope, reader, len(keys), n, handoff)
        return {"n": n}

    def _wait(self, msg: dict[str, Any], caller: _Caller) -> dict[str, Any]:
        timeout_ms, waits = msg["timeout_ms"], msg["waits"]
        if not isinstance(timeout_ms, int) or not 0 <= timeout_ms <= protocol.MAX_WAIT_MS:
            raise ValueError(f"timeout_ms must be an integer from 0 to {protocol.MAX_WAIT_MS}, got {timeout_ms!r}")
        if not isinstance(waits, list) or len(waits) > protocol.MAX_WAITS:
            raise ValueError(f"waits must be a list of at most {protocol.MAX_WAITS} [keys, need] pairs")
        reader, final = Reader.parse(msg.get("reader")), msg.get("final", [])
        if not isinstance(final, list) or not all(isinstance(i, int) and 0 <= i < len(waits) for i in final):
            raise ValueError("final must be a list of indexes into waits")
        parsed = []
        for keys, need in waits:
            if not isinstance(need, int) or need < 0:
                raise ValueError(f"a wait's need must be a non-negative integer, got {need!r}")
            parsed.append((caller.keys(keys), need))
        found = self._ix.wait_prefixes(parsed, timeout_ms / 1000)
        if reader is not None:
            # A wait ends when its keys are there or its reader's last slice is over; the rest come again.
            last = set(final)
            for i, ((keys, need), n) in enumerate(zip(parsed, found, strict=True)):
                if n >= need or i in last:
                    self.readers.wait_ended(caller.session.principal.scope, reader, len(keys), n, need)
        return {"n": found}

    def _write(self, msg: dict[str, Any], caller: _Caller) -> dict[str, Any]:
        scoped = caller.session.scope
        # Each chunk keeps the tenant's own key beside the scoped one, and its token ids: the tenant's events
        # name them. Elements after the tokens are a newer client's: ignored (protocol.py, "items grow at the end").
        items = [
            (
                scoped(key),
                int(n),
                scoped(bytes.fromhex(rest[0])) if rest and rest[0] is not None else None,
                key,
                protocol.unhex_tokens(rest[1]) if len(rest) > 1 and rest[1] is not None else None,
            )
            for k, n, *rest in msg["items"]
            for key in (protocol.unhex_key(k),)
        ]
        grants = self._ix.begin_write(items, caller.owner, **caller.tenant)
        out: list[Any] = []
        for g in grants:
            if g is None or g in (FULL, ORPHAN, QUOTA):
                out.append(g)
            else:
                out.append([g.lease_id, g.offset])  # type: ignore[union-attr]
        return {"epoch": self._ix.epoch, "lease_ms": self._lease_ms, "grants": out}

    def _commit(self, msg: dict[str, Any], caller: _Caller) -> dict[str, Any]:
        items = [(int(lid), int(csum)) for lid, csum in msg["items"]]
        return {"results": self._ix.commit(int(msg["epoch"]), items, caller.owner)}

    def _abort(self, msg: dict[str, Any], caller: _Caller) -> dict[str, Any]:
        self._ix.abort(int(msg["epoch"]), [int(x) for x in msg["leases"]], caller.owner)
        return {}

    def _read(self, msg: dict[str, Any], caller: _Caller) -> dict[str, Any]:
        grants = self._ix.open_read(
            caller.keys(msg["keys"]), prefix=bool(msg.get("prefix")), owner=caller.owner, **caller.tenant
        )
        pins = [[g.pin_id, g.offset, g.nbytes, g.checksum] if isinstance(g, ReadGrant) else None for g in grants]
        reply: dict[str, Any] = {"epoch": self._ix.epoch, "lease_ms": self._lease_ms, "pins": pins}
        refused = sum(g == QUOTA for g in grants)
        if refused:
            # Misses to the reader, with the reason: the tenant holds as many pins as its quota allows.
            reply["refused"] = {QUOTA: refused}
        return reply

    def _release(self, msg: dict[str, Any], caller: _Caller) -> dict[str, Any]:
        corrupt = [int(x) for x in msg.get("corrupt", [])]
        if corrupt:
            log.warning(
                "pool: %d chunk(s) failed their checksum on read and were dropped; if this repeats, "
                "check the pool memory for another writer",
                len(corrupt),
            )
        self._ix.release(int(msg["epoch"]), [int(x) for x in msg["pins"]], corrupt, caller.owner)
        return {}

    def _events(self, msg: dict[str, Any], caller: _Caller) -> dict[str, Any]:
        after, timeout_ms = msg.get("after"), msg.get("timeout_ms", 0)
        max_keys, tokens = msg.get("max_keys", protocol.MAX_EVENT_KEYS), msg.get("tokens", False)
        if after is not None and not (
            isinstance(after, list) and len(after) == 2 and all(isinstance(x, int) and x >= 0 for x in after)
        ):
            raise ValueError(f"after must be null or [epoch, seq] (non-negative integers), got {after!r}")
        if not isinstance(timeout_ms, int) or not 0 <= timeout_ms <= protocol.MAX_WAIT_MS:
            raise ValueError(f"timeout_ms must be an integer from 0 to {protocol.MAX_WAIT_MS}, got {timeout_ms!r}")
        if not isinstance(max_keys, int) or not 1 <= max_keys <= protocol.MAX_EVENT_KEYS:
            raise ValueError(f"max_keys must be an integer from 1 to {protocol.MAX_EVENT_KEYS}, got {max_keys!r}")
        if not isinstance(tokens, bool):
            raise ValueError(f"tokens must be true or false, got {tokens!r}")
        read = self._ix.read_events(
            caller.session.principal.scope,
            (after[0], after[1]) if after is not None else None,
            max_keys=max_keys,
            timeout_s=timeout_ms / 1000,
        )
        events = [[e.kind, protocol.hex_keys(e.keys), e.parent.hex() if e.parent else None] for e in read.events]
        if tokens:
            # Only for a reader that asked: one that predates tokens unpacks three elements.
            for out, e in zip(events, read.events, strict=True):
                out.append([t.hex() if t is not None else None for t in e.tokens] if e.tokens is not None else None)
        return {"epoch": self._ix.epoch, "last": read.last, "resync": read.resync, "events": events}

    def _flush(self, _msg: dict[str, Any], caller: _Caller) -> dict[str, Any]:
        n = self._ix.flush(caller.session.principal.scope)
        log.info("pool: tenant %s flushed its chunks (%d dropped)", caller.session.principal, n)
        return {"chunks": n}

    def _renew(self, msg: dict[str, Any], caller: _Caller) -> dict[str, Any]:
        return {"results": self._ix.renew(int(msg["epoch"]), [int(x) for x in msg["ids"]], caller.owner)}

    @property
    def _lease_ms(self) -> int:
        return int(self._ix.lease_seconds * 1000)

    def _agent(self, msg: dict[str, Any], _caller: _Caller) -> dict[str, Any]:
        """Heartbeat of a node agent: the pool's layout is fixed by the first agent's devices.

        Devices are matched to the pool's regions by the uuid in their header, never by order or
        size; the agent that lays the pool out is told which uuid to write into devices that have none.
        """
        if self._agents is None or self._make_index is None:
            raise ValueError("this daemon is not a metadata server; agents must point --metadata elsewhere")
        node, backend = str(msg["node"]), str(msg["backend"])
        devices = [(str(d["path"]), int(d["usable"]), d.get("uuid") or None) for d in msg["devices"]]
        assign: dict[str, str] = {}
        with self._index_lock:
            if self.index is None:
                assign = {path: new_device_uuid() for path, _, found in devices if found is None}
                self._region_uuids = [found or assign[path] for path, _, found in devices]
                self.index = self._make_index([usable for _, usable, _ in devices])
                log.info(
                    "metadata: pool laid out from node %s: %d region(s), %d bytes, devices %s",
                    node, len(devices), self._ix.capacity, ", ".join(self._region_uuids),
                )  # fmt: skip
        devices = [(path, usable, found or assign.get(path)) for path, usable, found in devices]
        capacities = self._ix.capacities
        problem = self._layout_problem(node, devices, capacities)
        if problem:
            log.error("metadata: refusing agent: %s", problem)
        self._agents.seen(node, [path for path, _, _ in devices], backend, problem)
        return {
            "epoch": self._ix.epoch,
            "regions": capacities,
            "region_uuids": self._region_uuids,
            "assign": assign,
            "problem": problem,
        }

    def _layout_problem(
        self, node: str, devices: list[tuple[str, int, str | None]], capacities: list[int]
    ) -> str | None:
        """Why ``node``'s devices cannot serve the pool's regions, or None."""
        by_uuid = {found: (path, usable) for path, usable, found in devices if found is not None}
        if len(by_uuid) != len([found for _, _, found in devices if found is not None]):
            return f"node {node} lists one device twice (two paths carry the same uuid); list each device once"
        for path, _, found in devices:
            if found is None:
                return (
                    f"node {node}: device {path} carries no pool header: it is not a device of this pool "
                    "(yet); list only the devices the first node listed"
                )
            if found not in self._region_uuids:
                return (
                    f"node {node}: device {path} (uuid {found}) is not a device of this pool "
                    f"(pool devices: {', '.join(self._region_uuids)}); list only the pool's devices"
                )
        for region, (wanted, cap) in enumerate(zip(self._region_uuids, capacities, strict=True)):
            if wanted not in by_uuid:
                return (
                    f"node {node} does not list the pool's device {wanted} (region {region}); "
                    "list the same devices on every node"
                )
            path, usable = by_uuid[wanted]
            if usable < cap:
                return (
                    f"node {node}: device {path} holds {usable} usable bytes but the pool's region needs "
                    f"{cap}; lower the metadata server's --size or use the same devices on every node"
                )
        return None


class LocalMemoryHello:
    """``hello`` of the single-node daemon: its own mapping, by fd on Unix sockets, by path on TCP."""

    def __init__(self, memory: PoolMemory, epoch: int, capacity: int) -> None:
        self._memory = memory
        self._epoch = epoch
        self._capacity = capacity

    def __call__(self, is_unix: bool) -> Reply:
        reply = {
            "ok": True,
            "epoch": self._epoch,
            "header_size": HEADER_SIZE,
            "regions": [
                {
                    "map_size": self._memory.map_size,
                    "capacity": self._capacity,
                    "uuid": self._memory.uuid,
                    # lets a client that opens the memory by path (TCP) check it is this daemon's file
                    "file": file_identity(self._memory.fd),
                }
            ],
            "backend": self._memory.backend,
            "metadata": None,
            "paths": None if is_unix else [self._memory.path],
        }
        return reply, [self._memory.fd] if is_unix else []
