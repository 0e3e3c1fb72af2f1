"""Request handlers of the three daemon roles, independent of the transport.

* :class:`IndexService` answers the index operations (``serve`` and ``metadata``).
* ``serve`` adds ``hello`` with its own memory (:class:`LocalMemoryHello`).
* The node agent (:mod:`.agent`) answers only ``hello`` and points clients at the metadata server.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import protocol
from .index import FULL, PoolIndex, StaleEpoch
from .memory import HEADER_SIZE, PoolMemory

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
        self._index_lock = threading.Lock()
        self.errors_before_index = 0
        self._hello = hello
        self._status = status
        self._agents = agents
        self._ops: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            "lookup": self._lookup,
            "write": self._write,
            "commit": self._commit,
            "abort": self._abort,
            "read": self._read,
            "release": self._release,
            "renew": lambda msg: {"results": self._ix.renew(int(msg["epoch"]), [int(x) for x in msg["ids"]])},
            "stats": lambda _msg: {"stats": self._ix.stats()},
            "status": lambda _msg: self._status(),
            "agent": self._agent,
        }

    def handle(self, msg: dict[str, Any], is_unix: bool) -> Reply:
        op = msg.get("op")
        if op == "hello":
            return self._hello(is_unix)
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
            reply = fn(msg)
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

    def _lookup(self, msg: dict[str, Any]) -> dict[str, Any]:
        return {"n": self._ix.lookup_prefix(protocol.unhex_keys(msg["keys"]))}

    def _write(self, msg: dict[str, Any]) -> dict[str, Any]:
        items = [(bytes.fromhex(k), int(n)) for k, n in msg["items"]]
        grants = self._ix.begin_write(items)
        out: list[Any] = []
        for g in grants:
            if g is None or g == FULL:
                out.append(g)
            else:
                out.append([g.lease_id, g.offset])  # type: ignore[union-attr]
        return {"epoch": self._ix.epoch, "grants": out}

    def _commit(self, msg: dict[str, Any]) -> dict[str, Any]:
        items = [(int(lid), int(csum)) for lid, csum in msg["items"]]
        return {"results": self._ix.commit(int(msg["epoch"]), items)}

    def _abort(self, msg: dict[str, Any]) -> dict[str, Any]:
        self._ix.abort(int(msg["epoch"]), [int(x) for x in msg["leases"]])
        return {}

    def _read(self, msg: dict[str, Any]) -> dict[str, Any]:
        grants = self._ix.open_read(protocol.unhex_keys(msg["keys"]), prefix=bool(msg.get("prefix")))
        pins = [None if g is None else [g.pin_id, g.offset, g.nbytes, g.checksum] for g in grants]
        return {"epoch": self._ix.epoch, "pins": pins}

    def _release(self, msg: dict[str, Any]) -> dict[str, Any]:
        corrupt = [int(x) for x in msg.get("corrupt", [])]
        if corrupt:
            log.warning(
                "pool: %d chunk(s) failed their checksum on read and were dropped; if this repeats, "
                "check the pool memory for another writer",
                len(corrupt),
            )
        self._ix.release(int(msg["epoch"]), [int(x) for x in msg["pins"]], corrupt)
        return {}

    def _agent(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Heartbeat of a node agent: the pool's layout is fixed by the first agent's devices."""
        if self._agents is None or self._make_index is None:
            raise ValueError("this daemon is not a metadata server; agents must point --metadata elsewhere")
        node, backend = str(msg["node"]), str(msg["backend"])
        devices = [(str(d["path"]), int(d["usable"])) for d in msg["devices"]]
        with self._index_lock:
            if self.index is None:
                self.index = self._make_index([usable for _, usable in devices])
                log.info(
                    "metadata: pool laid out from node %s: %d region(s), %d bytes",
                    node, len(devices), self._ix.capacity,
                )  # fmt: skip
        capacities = self._ix.capacities
        problem = None
        if len(devices) != len(capacities):
            problem = f"node {node} has {len(devices)} device(s), the pool has {len(capacities)}; list the same devices"
        else:
            for (path, usable), cap in zip(devices, capacities, strict=True):
                if usable < cap:
                    problem = (
                        f"node {node}: device {path} holds {usable} usable bytes but the pool's region needs "
                        f"{cap}; lower the metadata server's --size or use the same devices on every node"
                    )
                    break
        if problem:
            log.error("metadata: refusing agent: %s", problem)
        self._agents.seen(node, [path for path, _ in devices], backend, problem)
        return {"epoch": self._ix.epoch, "regions": capacities, "problem": problem}


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
            "regions": [{"map_size": self._memory.map_size, "capacity": self._capacity}],
            "backend": self._memory.backend,
            "metadata": None,
            "paths": None if is_unix else [self._memory.path],
        }
        return reply, [self._memory.fd] if is_unix else []
