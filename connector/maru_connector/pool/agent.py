"""The per-node agent of a multi-node (CXL) pool.

It maps the shared device, keeps the pool header's epoch in step with the metadata server, and
answers ``hello`` on a Unix socket by passing the device's file descriptor (SCM_RIGHTS), so client
pods map CXL memory without access to ``/dev/dax*`` themselves.

Index calls are not forwarded: the ``hello`` reply names the metadata server and the client talks to
it directly. That keeps the scheduler's lookup one network round trip instead of two, and the agent
off the hot path; the price is that client pods must reach the metadata Service.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from typing import Any

from . import protocol
from .memory import HEADER_SIZE, PoolMemory
from .service import Reply, fail
from .units import Endpoint

log = logging.getLogger(__name__)

E_UNAVAILABLE = "unavailable"


class NodeAgent:
    def __init__(self, memory: PoolMemory, metadata: Endpoint, node: str, *, timeout_s: float = 2.0) -> None:
        self.memory = memory
        self.metadata = metadata
        self.node = node
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.epoch: int | None = None
        self.capacity = 0
        self.connected = False
        self.problem: str | None = None
        self.heartbeat_failures = 0

    def heartbeat(self) -> bool:
        """Report to the metadata server and adopt its epoch and capacity; False when unreachable."""
        msg = {
            "op": "agent",
            "node": self.node,
            "device": self.memory.path,
            "backend": self.memory.backend,
            "device_size": self.memory.map_size,
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
            self.problem = f"metadata server refused this agent: {reply.get('message')}"
            log.error("agent %s: %s", self.node, self.problem)
            self.connected = False
            return False
        epoch, capacity = int(reply["epoch"]), int(reply["capacity"])
        with self._lock:
            if capacity > self.memory.capacity:
                self.problem = (
                    f"device {self.memory.path} holds {self.memory.capacity} usable bytes but the metadata "
                    f"server's pool is {capacity} bytes; lower the metadata server's --size"
                )
                log.error("agent %s: %s", self.node, self.problem)
            else:
                self.problem = None
            if epoch != self.epoch:
                self.memory.write_header(epoch)
                log.info("agent %s: pool epoch is now %d (was %s)", self.node, epoch, self.epoch)
            self.epoch, self.capacity = epoch, capacity
            self.connected = True
        return True

    def handle(self, msg: dict[str, Any], is_unix: bool) -> Reply:
        op = msg.get("op")
        if op == "hello":
            return self._hello(is_unix)
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
            epoch, capacity, problem = self.epoch, self.capacity, self.problem
        if problem:
            return fail(E_UNAVAILABLE, problem)
        if epoch is None:
            return fail(E_UNAVAILABLE, f"agent has not reached the metadata server {self.metadata.url} yet")
        reply = {
            "ok": True,
            "epoch": epoch,
            "capacity": capacity,
            "header_size": HEADER_SIZE,
            "map_size": self.memory.map_size,
            "backend": self.memory.backend,
            "metadata": self.metadata.url,
            "node": self.node,
            "path": None if is_unix else self.memory.path,
        }
        return reply, [self.memory.fd] if is_unix else []

    def stats(self) -> dict[str, int]:
        return {
            "capacity_bytes": self.capacity,
            "epoch": self.epoch or 0,
            "metadata_connected": int(self.connected),
            "heartbeat_failures": self.heartbeat_failures,
        }

    def status(self) -> dict[str, Any]:
        return {
            "role": "agent",
            "node": self.node,
            "device": self.memory.path,
            "backend": self.memory.backend,
            "device_size": self.memory.map_size,
            "capacity_bytes": self.capacity,
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
            self._sock = sock
        protocol.send_msg(self._sock, msg)
        reply, _ = protocol.recv_msg(self._sock)
        if reply is None:
            raise ConnectionError("metadata server closed the connection")
        return reply

    def _drop(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
