"""Wire format of pool RPCs: length-prefixed JSON frames over a Unix or TCP stream socket.

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON. Requests are
``{"op": NAME, ...}``; replies are ``{"ok": true, ...}`` or ``{"ok": false, "error": CODE,
"message": TEXT}``. Keys travel as hex strings. Only metadata crosses the socket: chunk bytes are
read and written in the shared mapping. The one exception to "JSON only" is the ``hello`` reply on
a Unix socket, which carries the pool memory's file descriptor as SCM_RIGHTS ancillary data.

Operations (request fields -> reply fields):

* ``hello``   token?, memory?              -> epoch, header_size, regions [{map_size, capacity, uuid}],
  ``metadata`` URL or null, one fd per region (Unix) or ``paths`` (TCP), auth (whether this daemon checks
  tokens). ``token`` is the client's credential (:mod:`maru_connector.tenancy`); a daemon started with a
  key refuses every other op on a connection until a hello with a valid token (``unauthenticated``,
  ``bad_token``), and runs the connection's ops in its tenant's key space. With ``memory`` false the hello
  only authenticates the connection (a client towards the metadata server, an agent's heartbeat link)
  and is answered with ok, auth and principal
* ``lookup``  keys                        -> n (leading committed keys)
* ``write``   items [[key, nbytes, parent?]...] -> epoch, lease_ms, grants [[lease_id, offset] | null
  (present) | "full" | "orphan" (parent not stored)]
* ``commit``  epoch, items [[lease_id, checksum]...] -> results [bool]
* ``abort``   epoch, leases [lease_id]    -> {}
* ``read``    keys, prefix?               -> epoch, lease_ms, pins [[pin_id, offset, nbytes, checksum] | null]
  (with ``prefix`` true: pins of the leading hits only, counted as a lookup)
* ``release`` epoch, pins [pin_id], corrupt [pin_id] -> {}
* ``renew``   epoch, ids [lease or pin id] -> results [bool] (False: already expired or released)
* ``stats``                               -> stats {name: int}
* ``status``                              -> the /status document
* ``agent``   node, backend, devices [{path, size, usable, uuid}] (agent -> metadata heartbeat)
  -> epoch, regions [capacity per region], region_uuids [uuid per region], assign {path: uuid to write},
  problem

Lease and pin ids are bound to the connection that took them: ``commit``, ``abort``, ``release`` and
``renew`` from another connection treat them as unknown. Keys are bound to the connection's tenant: the
daemon maps each key into the tenant's key space before it reaches the index (keys never travel back).
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

_LEN = struct.Struct(">I")
MAX_FRAME = 64 * 1024 * 1024

# Error codes of failed replies.
E_BAD_REQUEST = "bad_request"
E_FULL = "pool_full"
E_STALE_EPOCH = "stale_epoch"
E_INTERNAL = "internal"
E_UNAVAILABLE = "unavailable"
# Authentication (a daemon started with a pool key): no verified hello on this connection yet; a token
# that is malformed or signed by another key; an op this connection's principal may not call.
E_UNAUTHENTICATED = "unauthenticated"
E_BAD_TOKEN = "bad_token"
E_FORBIDDEN = "forbidden"
AUTH_ERRORS = (E_UNAUTHENTICATED, E_BAD_TOKEN, E_FORBIDDEN)


class ProtocolError(Exception):
    """The peer sent something that is not a frame of this protocol."""


def encode(obj: dict[str, Any]) -> bytes:
    data = json.dumps(obj, separators=(",", ":")).encode()
    return _LEN.pack(len(data)) + data


def send_msg(sock: socket.socket, obj: dict[str, Any], fds: list[int] | None = None) -> None:
    frame = encode(obj)
    if fds:
        sent = socket.send_fds(sock, [frame], fds)
        frame = frame[sent:]
    if frame:
        sock.sendall(frame)


def recv_msg(sock: socket.socket, *, max_fds: int = 0) -> tuple[dict[str, Any] | None, list[int]]:
    """One frame, and any file descriptors that came with it; ``(None, [])`` on a clean EOF."""
    fds: list[int] = []
    if max_fds:
        head, fds, _, _ = socket.recv_fds(sock, _LEN.size, max_fds)
        if not head:
            return None, fds
        if len(head) < _LEN.size:
            head += _recv_exact(sock, _LEN.size - len(head))
    else:
        head = _recv_exact(sock, _LEN.size, eof_ok=True)
        if not head:
            return None, fds
    (length,) = _LEN.unpack(head)
    if length > MAX_FRAME:
        raise ProtocolError(f"frame of {length} bytes exceeds the {MAX_FRAME}-byte limit")
    body = _recv_exact(sock, length)
    try:
        msg = json.loads(body)
    except ValueError as err:
        raise ProtocolError(f"frame is not JSON: {err}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("frame is not a JSON object")
    return msg, fds


def _recv_exact(sock: socket.socket, n: int, *, eof_ok: bool = False) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if eof_ok and got == 0:
                return b""
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def hex_keys(keys: list[bytes] | tuple[bytes, ...]) -> list[str]:
    return [k.hex() for k in keys]


def unhex_keys(values: Any) -> list[bytes]:
    if not isinstance(values, list):
        raise ValueError("keys must be a list of hex strings")
    return [bytes.fromhex(v) for v in values]
