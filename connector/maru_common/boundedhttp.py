"""An HTTP server for small GET endpoints (metrics, health, status) whose cost is bounded whatever clients do.

The standard library's threading servers start a thread per connection and wait on it with no deadline, so
a few hundred idle connections exhaust a pod's ``pids.max`` (and with it the threads the process needs for its
real work: a pool daemon then cannot serve its tenants' lookups). Here:

* **One thread waits on every connection** (a selector) until its request's headers are complete; a
  connection costs a file descriptor, never a thread, until then.
* **A fixed pool of workers** answers complete requests: the thread count never grows with clients.
* **Deadlines**: the headers must arrive within ``header_timeout_s`` of connecting, however slowly they
  trickle in (a slowloris gets 408 and is closed), and a worker gives up on a client that does not read
  its answer within ``write_timeout_s``.
* **Caps**: at most ``max_connections`` connections open at once, and ``max_per_peer`` from one address (a
  pod), so one pod's flood leaves room for the scraper; a connection over a cap is answered 503 and closed
  at once.

Requests are HTTP/1.0 style, one per connection: headers only (a body is never read), which is all a
Prometheus scrape or a probe sends. Handlers are ordinary :class:`http.server.BaseHTTPRequestHandler`
subclasses. Standard library only: the operator and the pool daemon both use it.
"""

from __future__ import annotations

import contextlib
import io
import logging
import queue
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

log = logging.getLogger(__name__)

KiB = 1 << 10
# A select wakes at least this often, to expire deadlines and to notice close().
_TICK_S = 0.25
# A refusal of the same kind is logged at most this often: a flood must not flood the log too.
_LOG_INTERVAL_S = 30.0


@dataclass(frozen=True)
class HttpLimits:
    workers: int = 4
    max_connections: int = 64
    max_per_peer: int = 8
    header_timeout_s: float = 5.0
    write_timeout_s: float = 10.0
    max_header_bytes: int = 16 * KiB


DEFAULT_LIMITS = HttpLimits()


@dataclass
class _Pending:
    peer: str
    deadline: float
    buf: bytearray = field(default_factory=bytearray)


class _Prebuffered:
    """A connection whose request was read already: the handler reads it from memory and writes to the socket."""

    def __init__(self, sock: socket.socket, head: bytes) -> None:
        self._sock = sock
        self._head = head

    def makefile(self, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if "r" in mode:
            return io.BytesIO(self._head)
        return self._sock.makefile(mode, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def _reply(sock: socket.socket, code: int, reason: str) -> None:
    """A one-line answer, never blocking: the client may not be reading, and the socket is closed next."""
    body = f"{reason}\n".encode()
    head = f"HTTP/1.0 {code} {reason}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
    try:
        sock.setblocking(False)
        sock.send(head.encode() + b"Connection: close\r\n\r\n" + body)
    except OSError:
        pass


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


class BoundedHttpServer:
    """Serve ``handler`` on ``host:port`` (port 0: a free one) from ``1 + limits.workers`` threads."""

    def __init__(
        self,
        host: str,
        port: int,
        handler: type[BaseHTTPRequestHandler],
        *,
        name: str = "http",
        limits: HttpLimits = DEFAULT_LIMITS,
    ) -> None:
        if limits.workers < 1 or limits.max_connections < 1 or limits.max_per_peer < 1:
            raise ValueError(f"{name}: workers, max_connections and max_per_peer must be at least 1: {limits}")
        self.limits = limits
        self.handler = handler
        self.name = name
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((host, port))
            self._listener.listen(128)
        except OSError:
            self._listener.close()
            raise
        self._listener.setblocking(False)
        self.server_address = self._listener.getsockname()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._pending: dict[socket.socket, _Pending] = {}
        self._work: queue.Queue[tuple[socket.socket, bytes, Any] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._open: dict[str, int] = {}  # per peer: connections accepted and not closed yet
        self._stopping = threading.Event()
        self.refusals = 0
        self._last_log: dict[str, float] = {}
        self._threads = [threading.Thread(target=self._accept_loop, name=f"{name}-accept", daemon=True)]
        self._threads += [
            threading.Thread(target=self._worker, name=f"{name}-worker-{i}", daemon=True) for i in range(limits.workers)
        ]

    # -- lifecycle

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def close(self) -> None:
        self._stopping.set()
        for _ in range(self.limits.workers):
            self._work.put(None)
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout=self.limits.write_timeout_s + 1)
        for sock in list(self._pending):
            _close(sock)
        self._pending.clear()
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(self._listener)
        self._selector.close()
        self._listener.close()

    @property
    def open_connections(self) -> int:
        with self._lock:
            return sum(self._open.values())

    # -- the accept loop: every connection waits here, threadless, until its headers are complete

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            for key, _ in self._selector.select(timeout=_TICK_S):
                sock = key.fileobj
                if sock is self._listener:
                    self._accept()
                else:
                    self._read(sock)  # type: ignore[arg-type]
            self._expire()

    def _accept(self) -> None:
        while True:
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:  # out of descriptors: the backlog holds them until some close
                self._warn("accept", "%s: cannot accept a connection: %s", self.name, err)
                time.sleep(_TICK_S)  # the listener stays readable: without a pause this loop would spin
                return
            peer = str(address[0]) if isinstance(address, tuple) else str(address)
            why = self._admit(peer)
            if why is not None:
                self._warn("busy", "%s: refused a connection from %s: %s", self.name, peer, why)
                _reply(sock, 503, "Service Unavailable")
                sock.close()
                continue
            sock.setblocking(False)
            self._pending[sock] = _Pending(peer, time.monotonic() + self.limits.header_timeout_s)
            self._selector.register(sock, selectors.EVENT_READ)

    def _admit(self, peer: str) -> str | None:
        with self._lock:
            if sum(self._open.values()) >= self.limits.max_connections:
                why = f"all {self.limits.max_connections} connections are taken"
            elif self._open.get(peer, 0) >= self.limits.max_per_peer:
                why = f"it holds {self.limits.max_per_peer} connections already"
            else:
                self._open[peer] = self._open.get(peer, 0) + 1
                return None
            self.refusals += 1
            return why

    def _release(self, peer: str) -> None:
        with self._lock:
            left = self._open.get(peer, 0) - 1
            if left > 0:
                self._open[peer] = left
            else:
                self._open.pop(peer, None)

    def _read(self, sock: socket.socket) -> None:
        pending = self._pending[sock]
        try:
            data = sock.recv(4 * KiB)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(sock)
            return
        pending.buf += data
        end = pending.buf.find(b"\r\n\r\n")
        if end < 0:
            end = pending.buf.find(b"\n\n")
        if end < 0:
            if len(pending.buf) > self.limits.max_header_bytes:
                _reply(sock, 431, "Request Header Fields Too Large")
                self._drop(sock)
            return
        self._selector.unregister(sock)
        del self._pending[sock]
        self._work.put((sock, bytes(pending.buf), pending.peer))

    def _expire(self) -> None:
        now = time.monotonic()
        late = [sock for sock, pending in self._pending.items() if pending.deadline <= now]
        for sock in late:
            _reply(sock, 408, "Request Timeout")
            self._drop(sock)
        if late:
            self._warn(
                "timeout",
                "%s: closed %d connections without a request within %gs",
                self.name,
                len(late),
                self.limits.header_timeout_s,
            )

    def _drop(self, sock: socket.socket) -> None:
        pending = self._pending.pop(sock)
        self._selector.unregister(sock)
        _close(sock)
        self._release(pending.peer)

    # -- the workers

    def _worker(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            sock, head, peer = item
            try:
                sock.setblocking(True)
                sock.settimeout(self.limits.write_timeout_s)  # sendall's deadline for the whole answer
                self.handler(_Prebuffered(sock, head), (peer, 0), self)  # type: ignore[arg-type]
            except Exception:  # a client gone mid-answer, or a bug in a handler: never the worker's end
                log.debug("%s: answering %s failed", self.name, peer, exc_info=True)
            finally:
                _close(sock)
                self._release(peer)

    def _warn(self, kind: str, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last_log.get(kind, float("-inf")) >= _LOG_INTERVAL_S:
            self._last_log[kind] = now
            log.warning(message, *args)
