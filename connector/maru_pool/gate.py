"""Authentication in front of every daemon role: a connection speaks for nobody until its hello is verified.

The client's ``hello`` carries its token (see :mod:`maru_contracts.tenancy`); the gate checks it against
the pool key and binds the principal to the connection. Every later op on that connection runs as that
principal, with the tenant's :class:`~maru_contracts.tenancy.KeyScope`; an op before a verified hello is
refused (``unauthenticated``), and so is an op the principal may not call (``forbidden``: a tenant
sending agent heartbeats). ``hello`` with ``"memory": false`` only authenticates (a client's connection
to the metadata server, an agent's heartbeat link) and is answered here.

Without a key (``--auth-key-file`` not given) the daemon authenticates nothing, as for a pool run by hand:
every connection is anonymous, in one shared key scope, and may call every op.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from maru_contracts import tenancy

from . import protocol
from .rpc import Peer

log = logging.getLogger(__name__)

Reply = tuple[dict[str, Any], list[int]]

# What each principal may call besides hello. None: everything (anonymous, on a pool without a key).
OPS: dict[str, frozenset[str] | None] = {
    "tenant": frozenset(
        {"lookup", "wait", "write", "commit", "abort", "read", "release", "renew", "stats", "status", "events", "flush"}
    ),
    "agent": frozenset({"agent", "stats", "status"}),
    "anonymous": None,
}
# A refused client is logged at most this often per kind of refusal: a misconfigured engine retries.
REFUSAL_LOG_INTERVAL_S = 30.0


class KeyFileError(ValueError):
    """The key file cannot be used; the message says why (never what it holds)."""


class KeyFile:
    """The pool key, read from a file and read again when the file changes.

    A Kubernetes Secret volume is updated in place when the Secret changes, so a rotated key takes
    effect at the next hello without restarting the daemon (connections already verified stay so).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._key = b""
        self.current()  # a key that cannot be read fails the daemon's start, naming the flag

    def current(self) -> bytes:
        try:
            st = os.stat(self.path)
        except OSError as err:
            if self._key:
                return self._key  # mid-update (the kubelet swaps a symlink): keep the last good key
            raise KeyFileError(f"{self.path}: {err.strerror}") from None
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        with self._lock:
            if stamp != self._stamp:
                try:
                    with open(self.path, "rb") as fh:
                        key = tenancy.check_key(fh.read())
                except OSError as err:
                    if self._key:
                        return self._key
                    raise KeyFileError(f"{self.path}: {err.strerror}") from None
                except tenancy.BadKey as err:
                    if self._key:
                        log.error("pool key %s: %s; keeping the previous key", self.path, err)
                        return self._key
                    raise KeyFileError(f"{self.path}: {err}") from None
                if self._key and key != self._key:
                    log.info("pool key %s changed: new hellos are verified against the new key", self.path)
                self._key, self._stamp = key, stamp
            return self._key


@dataclass(frozen=True)
class Session:
    """A verified connection: who it speaks for and the key space of its chunks."""

    principal: tenancy.Principal
    scope: tenancy.KeyScope = field(compare=False)


def session_of(principal: tenancy.Principal) -> Session:
    return Session(principal, tenancy.KeyScope(principal.scope))


ANONYMOUS = session_of(tenancy.ANONYMOUS)

# request, connection, its session -> reply (and fds)
Inner = Callable[[dict[str, Any], Peer, Session], Reply]


def _fail(code: str, message: str) -> Reply:
    return {"ok": False, "error": code, "message": message}, []


class AuthGate:
    """Wraps a role's handler: verifies each connection's hello, then admits its ops by principal."""

    def __init__(self, inner: Inner, keys: KeyFile | None, *, role: str) -> None:
        self._inner = inner
        self._keys = keys
        self._role = role
        self._lock = threading.Lock()
        self._sessions: dict[int, Session] = {}  # connection id -> its verified session
        self._last_logged: dict[str, float] = {}
        self.refusals = 0

    @property
    def enabled(self) -> bool:
        return self._keys is not None

    def handle(self, msg: dict[str, Any], peer: Peer) -> Reply:
        op = msg.get("op")
        if op == "hello":
            return self._hello(msg, peer)
        with self._lock:
            session = self._sessions.get(peer.id)
        if session is None:
            if self._keys is None:
                session = ANONYMOUS  # a pool without a key: clients need not say hello first
            else:
                return self._refuse(
                    protocol.E_UNAUTHENTICATED,
                    f"op {op!r} before a verified hello: this pool authenticates every connection; "
                    "send hello with the token first",
                )
        allowed = OPS.get(session.principal.kind)
        if allowed is not None and op not in allowed:
            return self._refuse(
                protocol.E_FORBIDDEN,
                f"op {op!r} is not for {session.principal.kind} credentials (this connection is {session.principal})",
            )
        return self._inner(msg, peer, session)

    def closed(self, peer: Peer) -> None:
        with self._lock:
            self._sessions.pop(peer.id, None)

    def verified(self, peer: Peer) -> bool:
        """Whether ``peer`` said a verified hello (without a key: always), so the transport may lift its
        before-hello bounds (a small frame, a deadline) from it."""
        if self._keys is None:
            return True
        with self._lock:
            return peer.id in self._sessions

    def _hello(self, msg: dict[str, Any], peer: Peer) -> Reply:
        if self._keys is None:
            session = ANONYMOUS
        else:
            token = msg.get("token")
            if not isinstance(token, str) or not token.strip():
                return self._refuse(
                    protocol.E_UNAUTHENTICATED,
                    "hello without a token: this pool authenticates every client; give the connector its "
                    "pool credential (maru_pool_token_file, which the operator sets)",
                )
            try:
                session = session_of(tenancy.verify(self._keys.current(), token))
            except tenancy.BadToken as err:
                return self._refuse(protocol.E_BAD_TOKEN, f"token refused: {err}")
        with self._lock:
            bound = self._sessions.get(peer.id)
        if bound is not None and bound.principal != session.principal:
            return self._refuse(protocol.E_FORBIDDEN, f"this connection is already {bound.principal}; open another one")
        if msg.get("memory") is False:
            reply: Reply = ({"ok": True, "auth": self.enabled, "principal": session.principal.kind}, [])
        else:
            reply = self._inner(msg, peer, session)
        if reply[0].get("ok"):
            reply[0].setdefault("auth", self.enabled)
            with self._lock:
                self._sessions[peer.id] = session
        return reply

    def _refuse(self, code: str, message: str) -> Reply:
        now = time.monotonic()
        with self._lock:
            self.refusals += 1
            due = now - self._last_logged.get(code, float("-inf")) >= REFUSAL_LOG_INTERVAL_S
            if due:
                self._last_logged[code] = now
        if due:
            log.warning("%s: refused a client (%s): %s", self._role, code, message)
        return _fail(code, message)
