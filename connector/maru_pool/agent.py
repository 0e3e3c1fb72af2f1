"""The per-node agent of a multi-node (CXL) pool.

It maps the shared devices, keeps their headers' epoch in step with the metadata server, and
answers ``hello`` on a Unix socket by passing the devices' file descriptors (SCM_RIGHTS), so client
pods map CXL memory without access to ``/dev/dax*`` themselves. Every node must list the same
devices, in any order and under any name: each device carries a uuid in its header, and the agent
hands out its devices in the order of the pool's regions as the metadata server names them by uuid.
A device whose uuid is not one of the pool's is refused.

Index calls are not forwarded: the ``hello`` reply names the metadata server and the client talks to
it directly. That keeps the scheduler's lookup one network round trip instead of two, and the agent
off the hot path; the price is that client pods must reach the metadata Service.

With a pool key, the agent hands the devices only to a client whose hello carries a valid token (the
gate checks it before :meth:`NodeAgent.handle` sees the hello), and it authenticates its own heartbeat
link to the metadata server with an ``agent:<node>`` token it signs with the same key.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

from . import protocol
from .gate import Session
from .memory import HEADER_SIZE, PoolMemory
from .rpc import Peer
from .service import Reply, fail
from .units import Endpoint

log = logging.getLogger(__name__)


class NodeAgent:
    def __init__(
        self,
        memories: list[PoolMemory],
        metadata: Endpoint,
        node: str,
        *,
        timeout_s: float = 2.0,
        credential: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.memories = memories
        self._credential = credential  # this agent's token towards the metadata server, made afresh per link
        self.metadata = metadata
        self.node = node
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.epoch: int | None = None
        self._header_epoch: int | None = None  # last epoch written into the devices' headers
        self.regions: list[int] = []
        self._ordered: list[PoolMemory] = []  # the devices in region order, once matched by uuid
        self.connected = False
        self.problem: str | None = None
        self.heartbeat_failures = 0
        # Once the metadata server has matched this node's devices, their uuids are known for good.
        self._layout_known = False

    def heartbeat(self) -> bool:
        """Report to the metadata server and adopt its epoch and capacity; False when unreachable."""
        if not self._layout_known:
            # Until the metadata server has matched this node's devices, read their uuids afresh: another
            # node may have made them part of the pool since. Never after: every client maps the header
            # read-write, so what it holds then may be anyone's scribble; this agent keeps (and restores) its own.
            for memory in self.memories:
                memory.refresh_uuid()
        msg = {
            "op": "agent",
            "node": self.node,
            "backend": "dax",
            "devices": [
                {"path": m.path, "size": m.map_size, "usable": m.capacity, "uuid": m.uuid} for m in self.memories
            ],
        }
        try:
            reply = self._rpc(msg)
        except (OSError, protocol.ProtocolError) as err:
            self._drop()
            if self.connected or self.heartbeat_failures == 0:
                log.warning(
                    "agent %s: metadata server %s unreachable (%s); clients are refused until it answers",
                    self.node,
                    self.metadata.url,
                    err,
                )
            self.connected = False
            self.heartbeat_failures += 1
            return False
        if not reply.get("ok"):
            self.problem = f"metadata server refused this agent: {reply.get('error')}: {reply.get('message')}"
            log.error("agent %s: %s", self.node, self.problem)
            self.connected = False
            return False
        epoch, regions = int(reply["epoch"]), [int(c) for c in reply["regions"]]
        by_path = {m.path: m for m in self.memories}
        with self._lock:
            for path, new_uuid in (reply.get("assign") or {}).items():
                by_path[path].format(new_uuid, epoch)
            # The metadata server checks the layout (it sees every node); this agent just obeys.
            self.problem = reply.get("problem")
            if self.problem:
                log.error("agent %s: %s", self.node, self.problem)
                self._ordered = []
            else:
                by_uuid = {m.uuid: m for m in self.memories}
                self._ordered = [by_uuid[u] for u in reply["region_uuids"]]
                if epoch != self._header_epoch:
                    for memory in self._ordered:
                        memory.write_header(epoch)
                    log.info("agent %s: pool epoch is now %d (was %s)", self.node, epoch, self._header_epoch)
                    self._header_epoch = epoch
                else:
                    # A scribbled header would take the device out of the pool for an agent that starts
                    # next (it finds devices by uuid): put it back every heartbeat.
                    for memory in self._ordered:
                        memory.keep_header(epoch, newer_epoch_ok=True)
                self._layout_known = True
            self.epoch, self.regions = epoch, regions
            self.connected = True
        return True

    def handle(self, msg: dict[str, Any], peer: Peer, _session: Session) -> Reply:
        op = msg.get("op")
        if op == "hello":
            return self._hello(peer.is_unix)
        if op == "status":
            return {"ok": True, **self.status()}, []
        if op == "stats":
            return {"ok": True, "stats": self.stats()}, []
        return fail(
            protocol.E_BAD_REQUEST,
            f"op {op!r}: this is a node agent; index calls go to the metadata server {self.metadata.url}",
        )

    def _hello(self, is_unix: bool) -> Reply:
        with self._lock:
            epoch, regions, problem, ordered = self.epoch, self.regions, self.problem, self._ordered
        if problem:
            return fail(protocol.E_UNAVAILABLE, problem)
        if epoch is None or not ordered:
            return fail(protocol.E_UNAVAILABLE, f"agent has not reached the metadata server {self.metadata.url} yet")
        reply = {
            "ok": True,
            "epoch": epoch,
            "header_size": HEADER_SIZE,
            "regions": [
                {"map_size": m.map_size, "capacity": cap, "uuid": m.uuid}
                for m, cap in zip(ordered, regions, strict=True)
            ],
            "backend": "dax",
            "metadata": self.metadata.url,
            "node": self.node,
            "paths": None if is_unix else [m.path for m in ordered],
        }
        return reply, [m.fd for m in ordered] if is_unix else []

    def stats(self) -> dict[str, int]:
        return {
            "capacity_bytes": sum(self.regions),
            "epoch": self.epoch or 0,
            "metadata_connected": int(self.connected),
            "heartbeat_failures": self.heartbeat_failures,
        }

    def status(self) -> dict[str, Any]:
        return {
            "role": "agent",
            "node": self.node,
            "devices": [m.path for m in self.memories],
            "backend": "dax",
            "capacity_bytes": sum(self.regions),
            "epoch": self.epoch or 0,
            "metadata": self.metadata.url,
            "metadata_connected": self.connected,
            "problem": self.problem,
        }

    def healthy(self) -> bool:
        return self.connected and self.problem is None

    def close(self) -> None:
        self._drop()

    def _rpc(self, msg: dict[str, Any]) -> dict[str, Any]:
        if self._sock is None:
            sock = socket.create_connection((self.metadata.host, self.metadata.port), timeout=self.timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                hello = self._exchange(sock, {"op": "hello", "memory": False, "token": self._credential()})
            except BaseException:
                sock.close()
                raise
            if not hello.get("ok"):
                sock.close()
                return hello  # refused: the heartbeat reports why, e.g. an agent without the pool's key
            self._sock = sock
        return self._exchange(self._sock, msg)

    @staticmethod
    def _exchange(sock: socket.socket, msg: dict[str, Any]) -> dict[str, Any]:
        protocol.send_msg(sock, msg)
        reply, _ = protocol.recv_msg(sock)
        if reply is None:
            raise ConnectionError("metadata server closed the connection")
        return reply

    def _drop(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
