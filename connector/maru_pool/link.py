"""A tenant's metadata-only connection to a pool daemon: its events and its flush, no memory mapped.

:class:`~.client.PoolClient` maps the pool memory at its hello, which an engine needs and a process that
only watches what the pool holds does not: a :class:`TenantLink` says hello with ``"memory": false`` (the
daemon authenticates it and hands over no memory) and then calls index ops as that tenant. Point it at a
``serve`` daemon (Unix or TCP) or at the metadata server of a multi-node pool; a node agent answers only
hellos.
"""

from __future__ import annotations

import contextlib
import socket
from typing import Any

from . import protocol
from .client import PoolAuthError, PoolError, PoolUnavailable, _open_socket
from .units import parse_endpoint


class TenantLink:
    """Calls ops on one connection, opened (and authenticated) on first use and again after a failure."""

    def __init__(self, url: str, *, token_file: str | None = None, timeout_s: float = 5.0) -> None:
        try:
            self._endpoint = parse_endpoint(url)
        except ValueError as err:
            raise PoolError(f"pool url: {err}") from None
        self.url = url
        self.token_file = token_file
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None

    def call(self, msg: dict[str, Any], *, wait_s: float = 0.0) -> dict[str, Any]:
        """One op; ``wait_s`` is how long the daemon may hold the answer back (a long poll) on top of the
        link's timeout. Raises :class:`PoolUnavailable` (and drops the connection) when the daemon cannot
        be reached or answers nothing, :class:`PoolAuthError` when it refuses the token."""
        for attempt in (0, 1):
            fresh = self._sock is None
            try:
                if self._sock is None:
                    self._sock = self._connect()
                self._sock.settimeout(self.timeout_s + wait_s)
                protocol.send_msg(self._sock, msg)
                reply, _ = protocol.recv_msg(self._sock)
                break
            except PoolError:
                self.close()
                raise
            except (OSError, protocol.ProtocolError) as err:
                self.close()
                if fresh or attempt:
                    raise PoolUnavailable(f"pool at {self.url}: {msg.get('op')}: {err or type(err).__name__}") from None
                # A connection from before a daemon restart: once more, on a new one.
        if reply is None:
            self.close()
            raise PoolUnavailable(f"pool at {self.url}: the daemon closed the connection")
        if not reply.get("ok"):
            code = str(reply.get("error"))
            cls = PoolAuthError if code in protocol.AUTH_ERRORS else PoolError
            if code in (protocol.E_UNAVAILABLE, protocol.E_STALE_EPOCH):
                cls = PoolUnavailable
            raise cls(f"pool at {self.url}: {code}: {reply.get('message')}")
        return reply

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None

    def _connect(self) -> socket.socket:
        token = self._token()
        sock = _open_socket(self._endpoint, self.timeout_s)
        try:
            protocol.send_msg(sock, {"op": "hello", "memory": False, "token": token})
            reply, _ = protocol.recv_msg(sock)
            if reply is None:
                raise PoolUnavailable(f"pool at {self.url}: the daemon closed the connection during hello")
            if not reply.get("ok"):
                code = str(reply.get("error"))
                cls = PoolAuthError if code in protocol.AUTH_ERRORS else PoolUnavailable
                raise cls(f"pool at {self.url}: {code}: {reply.get('message')}")
        except BaseException:
            sock.close()
            raise
        return sock

    def _token(self) -> str | None:
        if not self.token_file:
            return None
        try:
            with open(self.token_file, encoding="utf-8") as fh:
                return fh.read().strip()
        except (OSError, UnicodeDecodeError) as err:
            raise PoolAuthError(
                f"cannot read the pool credential {self.token_file} ({getattr(err, 'strerror', None) or err})"
            ) from None

    def __enter__(self) -> TenantLink:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
