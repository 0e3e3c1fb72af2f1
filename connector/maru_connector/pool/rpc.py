"""The RPC transport: a threaded stream server (one thread per client connection) over Unix or TCP.

Threads keep it simple: connections are few (a handful per vLLM process) and each request is a short
critical section in the index, so a selector loop would buy nothing measurable.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import socketserver
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import protocol
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
        while True:
            try:
                msg, _ = protocol.recv_msg(sock)
            except (ConnectionError, OSError):
                return
            except protocol.ProtocolError as err:
                log.warning("rpc: dropping a client that sent a malformed frame: %s", err)
                return
            if msg is None:
                return
            reply, fds = self.server.handler(msg, peer)
            try:
                protocol.send_msg(sock, reply, fds)
            except OSError:
                return


class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    handler: Handler
    on_close: CloseHandler


class _TcpServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True
    handler: Handler
    on_close: CloseHandler


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
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="maru-pool-rpc", daemon=True)

    def start(self) -> None:
        self._thread.start()

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
