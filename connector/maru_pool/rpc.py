"""The RPC transport: a threaded stream server (one thread per client connection) over Unix or TCP.

Threads keep it simple: connections are few (a handful per vLLM process) and each request is a short
critical section in the index, so a selector loop would buy nothing measurable. What a client can make the
server hold (connections, frame sizes, time before and after hello) is bounded by :mod:`.limits`: a refused
connection costs no thread, and no frame is allocated before its bytes arrive.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import protocol
from .limits import DEFAULT, Admission, Limits, peer_of
from .units import Endpoint

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Peer:
    """One client connection. Leases and pins are bound to ``id``: only this connection may use them."""

    id: int
    is_unix: bool


# request, the connection it came on -> reply, fds to pass with it
Handler = Callable[[dict[str, Any], Peer], tuple[dict[str, Any], list[int]]]
# called once when a connection closes, for whatever reason
CloseHandler = Callable[[Peer], None]
# whether the connection has said a verified hello (then frames up to --max-frame, no hello deadline)
Verified = Callable[[Peer], bool]


class ListenError(OSError):
    """The listen address cannot be used; the message says why and what to do."""


class _Connection(socketserver.BaseRequestHandler):
    server: _UnixServer | _TcpServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        peer = Peer(id=secrets.randbits(63) + 1, is_unix=sock.family == socket.AF_UNIX)
        if not peer.is_unix:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self._serve(sock, peer)
        finally:
            try:
                self.server.on_close(peer)
            except Exception:  # a bug in cleanup must not kill the server thread silently
                log.exception("rpc: cleanup after a closed connection failed")

    def _serve(self, sock: socket.socket, peer: Peer) -> None:
        limits = self.server.limits
        hello_deadline = time.monotonic() + limits.hello_timeout_s
        while True:
            # Until a verified hello: small frames, and one deadline for all of them (a trickle cannot
            # stretch it). After it: full-size frames, each to arrive within the idle timeout.
            verified = self.server.verified(peer)
            if verified:
                idle = limits.idle_timeout_s
                deadline, max_frame = (time.monotonic() + idle if idle else None), limits.frame_bytes
                sock.settimeout(None)
            else:
                deadline, max_frame = hello_deadline, limits.hello_frame_bytes
            try:
                msg, _ = protocol.recv_msg(sock, max_frame=max_frame, deadline=deadline)
            except TimeoutError:
                if not verified:
                    self._last_word(sock, protocol.E_HELLO_TIMEOUT, (
                        f"no verified hello within {limits.hello_timeout_s:g}s of connecting "
                        "(--hello-timeout-seconds); closing"))  # fmt: skip
                else:
                    log.debug("rpc: closing a connection idle for %ss", limits.idle_timeout_s)
                return
            except protocol.FrameTooLarge as err:
                bound = "--max-frame" if verified else "--max-hello-frame (before a verified hello)"
                self._last_word(sock, protocol.E_TOO_LARGE, f"{err} ({bound}); closing")
                return
            except (ConnectionError, OSError):
                return
            except protocol.ProtocolError as err:
                self.server.admission.logs.warning(
                    "malformed", "rpc: dropping a client that sent a malformed frame: %s", err
                )
                return
            if msg is None:
                return
            reply, fds = self.server.handler(msg, peer)
            try:
                # A client that stops reading its replies must not hold this thread forever.
                sock.settimeout(limits.idle_timeout_s or limits.hello_timeout_s)
                protocol.send_msg(sock, reply, fds)
            except OSError:
                return

    def _last_word(self, sock: socket.socket, code: str, message: str) -> None:
        """Tell the client why it is being closed (best effort), and the log (rate-limited)."""
        self.server.admission.logs.warning(code, "rpc: %s: %s", code, message)
        _send_refusal(sock, code, message)


def _send_refusal(sock: socket.socket, code: str, message: str) -> None:
    """One error frame, never blocking: the client may not be reading, and the socket is closed next."""
    try:
        sock.setblocking(False)
        sock.send(protocol.encode({"ok": False, "error": code, "message": message}))
    except OSError:
        pass


class _Limited(socketserver.BaseServer):
    """Admission at accept: a connection over the caps is answered and closed before a thread starts."""

    handler: Handler
    on_close: CloseHandler
    verified: Verified
    limits: Limits
    admission: Admission
    _admitted: dict[socket.socket, str]
    _admitted_lock: threading.Lock

    def verify_request(self, request: Any, client_address: Any) -> bool:
        who = peer_of(request, client_address)
        why = self.admission.admit(who)
        if why is not None:
            _send_refusal(request, protocol.E_BUSY, why)
            return False
        with self._admitted_lock:
            self._admitted[request] = who
        return True

    def close_request(self, request: Any) -> None:
        # Runs once per accepted connection (refused ones too): the slot is given back exactly once.
        with self._admitted_lock:
            who = self._admitted.pop(request, None)
        if who is not None:
            self.admission.release(who)
        super().close_request(request)


class _UnixServer(socketserver.ThreadingMixIn, _Limited, socketserver.UnixStreamServer):
    daemon_threads = True


class _TcpServer(socketserver.ThreadingMixIn, _Limited, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True


class _Tcp6Server(_TcpServer):
    address_family = socket.AF_INET6


class RpcServer:
    """Serve ``handler`` on ``endpoint`` from a background thread until :meth:`close`."""

    def __init__(
        self,
        endpoint: Endpoint,
        handler: Handler,
        *,
        on_close: CloseHandler = lambda _peer: None,
        socket_mode: int = 0o666,
        verified: Verified = lambda _peer: True,
        limits: Limits = DEFAULT,
        role: str = "rpc",
    ) -> None:
        self.endpoint = endpoint
        server: _UnixServer | _TcpServer
        cls: type[_TcpServer]
        if endpoint.kind == "unix":
            _clear_stale_socket(endpoint.path)
            try:
                server = _UnixServer(endpoint.path, _Connection)
            except OSError as err:
                raise ListenError(f"--listen {endpoint.url}: cannot bind: {err.strerror}") from None
            # Clients in other pods run as other users; access is governed by the socket's directory.
            os.chmod(endpoint.path, socket_mode)
        else:
            try:
                cls = _Tcp6Server if ":" in endpoint.host else _TcpServer
                server = cls((endpoint.host, endpoint.port), _Connection)
            except OSError as err:
                raise ListenError(f"--listen {endpoint.url}: cannot bind: {err.strerror}") from None
            host, port = server.server_address[:2]
            self.endpoint = Endpoint(kind="tcp", host=str(host), port=int(port))
        server.handler = handler
        server.on_close = on_close
        server.verified = verified
        server.limits = limits
        server.admission = Admission(limits, role)
        server._admitted, server._admitted_lock = {}, threading.Lock()
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="maru-pool-rpc", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stats(self) -> dict[str, int]:
        """Open connections, and connections refused at accept for being over a cap."""
        admission = self._server.admission
        return {"connections": admission.open, "connection_refusals": admission.refusals}

    def close(self) -> None:
        # shutdown() waits for serve_forever to notice, so it would hang if that never started.
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()
        if self.endpoint.kind == "unix":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.endpoint.path)


def _clear_stale_socket(path: str) -> None:
    """Remove a socket left by a daemon that died; refuse to steal one that is still served."""
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)
        log.info("rpc: removed stale socket %s left by an earlier daemon", path)
        return
    except OSError as err:
        raise ListenError(f"--listen unix://{path}: exists and cannot be probed: {err.strerror}") from None
    finally:
        probe.close()
    raise ListenError(f"--listen unix://{path}: another pool daemon is serving this socket; stop it first")
