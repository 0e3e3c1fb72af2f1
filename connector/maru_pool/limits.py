"""What one client can make a pool daemon hold: frames, connections and time, before and after its hello.

The daemon's memory is every tenant's cache: a daemon OOM-killed by one client loses all of it. So nothing
a client announces is allocated up front, and what it can hold is bounded:

* **Frames.** Before a verified hello a connection may send one small frame (``--max-hello-frame``, a few
  KiB: a hello and its token); after it, frames up to ``--max-frame`` (what the largest legitimate batch
  needs). Bodies are read as their bytes arrive (:func:`.protocol.recv_msg`), so a header announcing a large
  frame costs nothing until the bytes come.
* **Connections.** At most ``--max-connections-per-peer`` per peer (the uid on a Unix socket, from
  ``SO_PEERCRED``; the IP address on TCP) and ``--max-connections`` in all. One over a cap is answered
  ``too_many_connections`` and closed at accept, before a thread is started for it.
* **Time.** A connection must send a verified hello within ``--hello-timeout-seconds`` of connecting, however
  slowly its bytes trickle in; a verified one idle for ``--idle-timeout-seconds`` is closed (its leases
  and pins expired long before; the client reconnects on its next call).

* **Pins and leases.** No tenant holds more than ``--max-tenant-pins`` read pins and ``--max-tenant-leases``
  write leases at once, whatever quota its token carries (see :mod:`.quota`): each is daemon memory.

A daemon without a pool key authenticates nobody, so every connection counts as verified from the start:
only the after-hello bounds and the connection caps apply.
"""

from __future__ import annotations

import argparse
import logging
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

from . import quota
from .units import parse_size

log = logging.getLogger(__name__)

KiB = 1 << 10
MiB = 1 << 20
# A hello carries a token (``maru1.<principal>.<64 hex>``, a principal of a few hundred bytes at most) and
# a few flags; below this a legitimate hello might not fit.
MIN_HELLO_FRAME = 1 * KiB
# A refusal of the same kind is logged at most this often: a flood must not flood the log too.
LOG_INTERVAL_S = 30.0
_UCRED = struct.Struct("3i")  # pid, uid, gid of SO_PEERCRED


@dataclass(frozen=True)
class Limits:
    # Before a verified hello: a hello is all that may come.
    hello_frame_bytes: int = 8 * KiB
    # After it: a write of N chunks is ~150 bytes a chunk on the wire, so 16 MiB holds ~100k chunks, more
    # than a 1M-token prompt in 16-token chunks (65k).
    frame_bytes: int = 16 * MiB
    # A vLLM process opens a handful (scheduler, one per worker); a node runs a few engines.
    connections: int = 1024
    connections_per_peer: int = 256
    hello_timeout_s: float = 5.0
    idle_timeout_s: float | None = 3600.0  # None: never
    # ~250 bytes of daemon memory each: 65,536 pins are ~16 MiB, and a token's quota cannot go past them.
    tenant_pins: int = quota.DEFAULT_PINS
    tenant_leases: int = quota.DEFAULT_LEASES

    @property
    def tenant_ceiling(self) -> quota.Limits:
        return quota.Limits(None, self.tenant_pins, self.tenant_leases)


DEFAULT = Limits()


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The limit flags, common to every daemon role."""
    parser.add_argument(
        "--max-connections", type=_count, default=DEFAULT.connections,
        help="connections served at once, from everyone (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--max-connections-per-peer", type=_count, default=DEFAULT.connections_per_peer,
        help="connections served at once from one peer: a uid on a Unix socket, an IP address on TCP "
        "(default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--hello-timeout-seconds", type=_seconds, default=DEFAULT.hello_timeout_s,
        help="a connection without a verified hello this long after connecting is closed (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--idle-timeout-seconds", type=_seconds_or_never, default=DEFAULT.idle_timeout_s,
        help="a connection silent this long is closed; 0: never (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--max-hello-frame", type=_size, default=DEFAULT.hello_frame_bytes,
        help=f"largest frame before a verified hello, e.g. 8Ki (default %(default)s bytes; at least {MIN_HELLO_FRAME})",
    )  # fmt: skip
    parser.add_argument(
        "--max-frame", type=_size, default=DEFAULT.frame_bytes,
        help="largest frame after hello, e.g. 16Mi (default %(default)s bytes; at least --max-hello-frame)",
    )  # fmt: skip
    parser.add_argument(
        "--max-tenant-pins", type=_count, default=DEFAULT.tenant_pins,
        help="read pins one tenant may hold at once, whatever quota its token carries (serve, metadata; "
        "default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--max-tenant-leases", type=_count, default=DEFAULT.tenant_leases,
        help="write leases one tenant may hold at once, whatever quota its token carries (serve, metadata; "
        "default %(default)s)",
    )  # fmt: skip


def from_args(args: argparse.Namespace) -> Limits:
    """The limits the flags name; ValueError naming the flag for a combination that cannot work."""
    limits = Limits(
        hello_frame_bytes=getattr(args, "max_hello_frame", DEFAULT.hello_frame_bytes),
        frame_bytes=getattr(args, "max_frame", DEFAULT.frame_bytes),
        connections=getattr(args, "max_connections", DEFAULT.connections),
        connections_per_peer=getattr(args, "max_connections_per_peer", DEFAULT.connections_per_peer),
        hello_timeout_s=getattr(args, "hello_timeout_seconds", DEFAULT.hello_timeout_s),
        idle_timeout_s=getattr(args, "idle_timeout_seconds", DEFAULT.idle_timeout_s),
        tenant_pins=getattr(args, "max_tenant_pins", DEFAULT.tenant_pins),
        tenant_leases=getattr(args, "max_tenant_leases", DEFAULT.tenant_leases),
    )
    if limits.hello_frame_bytes < MIN_HELLO_FRAME:
        raise ValueError(
            f"--max-hello-frame {limits.hello_frame_bytes}: a hello with its token needs up to {MIN_HELLO_FRAME} bytes"
        )
    if limits.frame_bytes < limits.hello_frame_bytes:
        raise ValueError(
            f"--max-frame {limits.frame_bytes}: smaller than --max-hello-frame ({limits.hello_frame_bytes}); "
            "a verified connection may send at least what a hello may"
        )
    return limits


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def _seconds_or_never(text: str) -> float | None:
    if text.strip() in ("0", "0.0"):
        return None
    return _seconds(text)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def peer_of(sock: socket.socket, address: Any) -> str:
    """Who a connection speaks for, as far as the kernel says: its uid (Unix socket) or IP address (TCP)."""
    if sock.family == socket.AF_UNIX:
        try:
            _, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        except OSError:
            return "uid ?"  # not Linux: every local client is one peer, the total cap still holds
        return f"uid {uid}"
    host = address[0] if isinstance(address, tuple) and address else str(address)
    return f"address {host}"


class RateLimitedLog:
    """Warns at most once per ``LOG_INTERVAL_S`` per kind, with how many were not logged in between."""

    def __init__(self, logger: logging.Logger = log) -> None:
        self._log = logger
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def warning(self, kind: str, message: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(kind, float("-inf")) < LOG_INTERVAL_S:
                self._quiet[kind] = self._quiet.get(kind, 0) + 1
                return
            self._last[kind] = now
            quiet = self._quiet.pop(kind, 0)
        suffix = f" ({quiet} more like it since the last report)" if quiet else ""
        self._log.warning(message + suffix, *args)


class Admission:
    """Counts open connections per peer and in all; admits a new one only under both caps."""

    def __init__(self, limits: Limits, role: str) -> None:
        self.limits = limits
        self._role = role
        self._lock = threading.Lock()
        self._per_peer: dict[str, int] = {}
        self._open = 0
        self.refusals = 0
        self.logs = RateLimitedLog()

    def admit(self, peer: str) -> str | None:
        """Take a slot for ``peer``; None when admitted (call :meth:`release` once it closes), else why not."""
        with self._lock:
            if self._open >= self.limits.connections:
                why = (
                    f"the pool daemon serves at most {self.limits.connections} connections and all are taken "
                    "(--max-connections); try again later"
                )
            elif self._per_peer.get(peer, 0) >= self.limits.connections_per_peer:
                why = (
                    f"{peer} already holds {self.limits.connections_per_peer} connections to the pool daemon "
                    "(--max-connections-per-peer); close some, or reuse them"
                )
            else:
                self._open += 1
                self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
                return None
            self.refusals += 1
        self.logs.warning("busy", "%s: refused a connection from %s: too many connections: %s", self._role, peer, why)
        return why

    def release(self, peer: str) -> None:
        with self._lock:
            self._open -= 1
            left = self._per_peer.get(peer, 0) - 1
            if left > 0:
                self._per_peer[peer] = left
            else:
                self._per_peer.pop(peer, None)

    @property
    def open(self) -> int:
        return self._open
