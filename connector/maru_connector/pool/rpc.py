"""The RPC transport: a threaded stream server (one thread per client connection) over Unix or TCP.

Threads keep it simple: connections are few (a handful per vLLM process) and each request is a short
critical section in the index, so a selector loop would buy nothing measurable.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import socketserver
import threading
from collections.abc import Callable
from typing import Any

from . import protocol
from .units import Endpoint

log = logging.getLogger(__name__)

# request, came over a Unix socket -> reply, fds to pass with it
Handler = Callable[[dict[str, Any], bool], tuple[dict[str, Any], list[int]]]


class ListenError(OSError):
    """The listen address cannot be used; the message says why and what to do."""


class _Connection(socketserver.BaseRequestHandler):
    server: _UnixServer | _TcpServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        is_unix = sock.family == socket.AF_UNIX
        if not is_unix:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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
            reply, fds = self.server.handler(msg, is_unix)
            try:
                protocol.send_msg(sock, reply, fds)
            except OSError:
                return


class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    handler: Handler


class _TcpServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True
    handler: Handler


class _Tcp6Server(_TcpServer):
    address_family = socket.AF_INET6


class RpcServer:
    """Serve ``handler`` on ``endpoint`` from a background thread until :meth:`close`."""

    def __init__(self, endpoint: Endpoint, handler: Handler, *, socket_mode: int = 0o666) -> None:
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
