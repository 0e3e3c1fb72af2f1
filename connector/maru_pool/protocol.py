"""Wire format of pool RPCs: length-prefixed JSON frames over a Unix or TCP stream socket.

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON. Requests are
``{"op": NAME, ...}``; replies are ``{"ok": true, ...}`` or ``{"ok": false, "error": CODE,
"message": TEXT}``. Keys travel as hex strings. Only metadata crosses the socket: chunk bytes are
read and written in the shared mapping. The one exception to "JSON only" is the ``hello`` reply on
a Unix socket, which carries the pool memory's file descriptor as SCM_RIGHTS ancillary data.

Operations (request fields -> reply fields):

* ``hello``   token?, memory?              -> epoch, header_size, regions [{map_size, capacity, uuid, file?}],
  ``metadata`` URL or null, one fd per region (Unix) or ``paths`` (TCP), auth (whether this daemon checks
  tokens). This reply, not the header in the mapping (which every client can write), is what clients go
  by; ``file`` names the memory's file as the kernel knows it, for a client that opens ``paths``.
  ``token`` is the client's credential (:mod:`maru_contracts.tenancy`); a daemon started with a
  key refuses every other op on a connection until a hello with a valid token (``unauthenticated``,
  ``bad_token``), and runs the connection's ops in its tenant's key space. With ``memory`` false the hello
  only authenticates the connection (a client towards the metadata server, an agent's heartbeat link)
  and is answered with ok, auth and principal
* ``lookup``  keys, reader?, handoff?     -> n (leading committed keys)
  ``reader`` {role, chunk_tokens, ranks} says who looks up (``decode``, ``prefill``) and how many tokens a
  key stands for (a chunk has one key per TP rank); ``handoff``: keys the prefill announced, which the reader
  will wait for if they are not all there. Both only feed the daemon's per-tenant reader counters
  (:mod:`.readers`); a lookup without them (an older client) counts as role ``unknown``, and a daemon that
  predates them ignores them
* ``wait``    waits [[keys, need]...], timeout_ms, reader?, final? -> n [leading committed keys per wait],
  answered as soon as one wait has ``need`` of them or ``timeout_ms`` (at most :data:`MAX_WAIT_MS`) passed: a
  reader waiting for a handoff blocks here, on a connection of its own, instead of polling ``lookup``.
  ``final``: indexes of the waits whose reader gives up after this one (their deadline falls within it), so
  the daemon counts a handoff timeout once. A daemon that predates the op answers ``bad_request`` (unknown
  op); clients then poll
* ``write``   items [[key, nbytes, parent?, tokens?]...] -> epoch, lease_ms, grants [[lease_id, offset] | null
  (present) | "full" | "orphan" (parent not stored)]
  ``tokens``: the token ids the chunk holds, as hex of little-endian uint32s (:func:`pack_tokens`), at most
  :data:`MAX_ITEM_TOKENS`; the daemon keeps them in the chunk's ``stored`` event only, never in the index.
  **Items grow at the end.** A daemon reads the elements of an item it knows and ignores any after them
  (every daemon since items carried a parent does), so a client may send a newer element to any daemon,
  which then simply lacks what it does not know (a daemon without tokens publishes events without them);
  an element a client has no value for, but that comes before one it sends, is null (``[key, n, null,
  tokens]``: a prompt's first chunk with its tokens). An item of two or three elements is as valid as ever
* ``commit``  epoch, items [[lease_id, checksum]...] -> results [bool]
* ``abort``   epoch, leases [lease_id]    -> {}
* ``read``    keys, prefix?               -> epoch, lease_ms, pins [[pin_id, offset, nbytes, checksum] | null]
  (with ``prefix`` true: pins of the leading hits only, counted as a lookup)
* ``release`` epoch, pins [pin_id], corrupt [pin_id] -> {}
* ``renew``   epoch, ids [lease or pin id] -> results [bool] (False: already expired or released)
* ``events``  after (null or [epoch, seq]), timeout_ms?, max_keys?, tokens? -> epoch, last, resync, events
  [[kind, keys, parent, tokens?]...]: the connection's tenant's own event log (``maru_pool.events``),
  keys as the tenant wrote them. ``kind`` is ``stored`` (keys a chain, ``parent`` the key before the first),
  ``removed`` or ``cleared``; with ``resync`` true the reader drops all it knew first (it fell behind the
  log, asked from another epoch, or asked after null). Answered as soon as there is an event, or after
  ``timeout_ms`` (at most :data:`MAX_WAIT_MS`) with none; ask again after ``[epoch, last]``.
  With ``tokens`` true every event has a fourth element: null, or per key the hex of the token ids its
  writer sent (null for a key written without them). Without it events keep three elements, as readers
  that unpack three expect; a daemon that predates it ignores the field, so a reader accepts both shapes
* ``flush``                               -> chunks (how many): drop all of the tenant's chunks; its log
  says ``cleared``
* ``stats``                               -> stats {name: int}
* ``status``                              -> the /status document
* ``agent``   node, backend, devices [{path, size, usable, uuid}] (agent -> metadata heartbeat)
  -> epoch, regions [capacity per region], region_uuids [uuid per region], assign {path: uuid to write},
  problem

Frames are bounded by the daemon (:mod:`.limits`): before a verified hello by ``--max-hello-frame`` (a few
KiB: a hello is all that may come), after it by ``--max-frame``. A frame over the bound is answered with
``frame_too_large`` and the connection closed; a body is read as it arrives, never allocated at the size its
header announces. A connection over the daemon's caps is answered ``too_many_connections`` and closed; one that
sends no verified hello within ``--hello-timeout-seconds`` is answered ``hello_timeout`` and closed.

Lease and pin ids are bound to the connection that took them: ``commit``, ``abort``, ``release`` and
``renew`` from another connection treat them as unknown. Keys are bound to the connection's tenant: the
daemon maps each key into the tenant's key space before it reaches the index (keys never travel back).
"""

from __future__ import annotations

import json
import socket
import struct
import time
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
# Limits (see limits.py): a frame over the bound, a connection over the caps, no verified hello in time.
# Each is the last frame on its connection.
E_TOO_LARGE = "frame_too_large"
E_BUSY = "too_many_connections"
E_HELLO_TIMEOUT = "hello_timeout"
# Bounds of a ``wait``: its longest wait, and the most waits in one request.
MAX_WAIT_MS = 10_000
MAX_WAITS = 4096
# The longest chunk key a write may carry: the daemon keeps it as the tenant sent it, for its events.
MAX_KEY_BYTES = 64
# The most keys one ``events`` reply carries (a resync carries all the tenant holds, whatever this says).
MAX_EVENT_KEYS = 65_536
# The most token ids one write item may carry (4 bytes each): far above any chunk size in use.
MAX_ITEM_TOKENS = 1 << 20
_TOKEN = struct.Struct("<I")
# Bodies are read in pieces of at most this many bytes, so memory follows what arrived, not what was announced.
_READ_PIECE = 64 * 1024


class ProtocolError(Exception):
    """The peer sent something that is not a frame of this protocol."""


class FrameTooLarge(ProtocolError):
    """A frame header announced more bytes than the receiver accepts; nothing of its body was read."""

    def __init__(self, length: int, limit: int) -> None:
        super().__init__(f"frame of {length} bytes exceeds the {limit}-byte limit")
        self.length = length
        self.limit = limit


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


def recv_msg(
    sock: socket.socket, *, max_fds: int = 0, max_frame: int = MAX_FRAME, deadline: float | None = None
) -> tuple[dict[str, Any] | None, list[int]]:
    """One frame, and any file descriptors that came with it; ``(None, [])`` on a clean EOF.

    Raises :class:`FrameTooLarge` before reading a body over ``max_frame``, and ``TimeoutError`` once
    ``deadline`` (``time.monotonic()``) passes, however slowly the bytes trickle in.
    """
    fds: list[int] = []
    if max_fds:
        _settle_timeout(sock, deadline)
        head, fds, _, _ = socket.recv_fds(sock, _LEN.size, max_fds)
        if not head:
            return None, fds
        if len(head) < _LEN.size:
            head += _recv_exact(sock, _LEN.size - len(head), deadline=deadline)
    else:
        head = _recv_exact(sock, _LEN.size, eof_ok=True, deadline=deadline)
        if not head:
            return None, fds
    (length,) = _LEN.unpack(head)
    if length > max_frame:
        raise FrameTooLarge(length, max_frame)
    body = _recv_exact(sock, length, deadline=deadline)
    try:
        msg = json.loads(body)
    except ValueError as err:
        raise ProtocolError(f"frame is not JSON: {err}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("frame is not a JSON object")
    return msg, fds


def _settle_timeout(sock: socket.socket, deadline: float | None) -> None:
    """Make the next blocking call on ``sock`` end at ``deadline`` (no deadline: leave the timeout as set)."""
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed before the frame was complete")
    sock.settimeout(left)


def _recv_exact(sock: socket.socket, n: int, *, eof_ok: bool = False, deadline: float | None = None) -> bytes:
    # Grown as bytes arrive: a header that announces a large frame and sends nothing costs nothing.
    buf = bytearray()
    while len(buf) < n:
        _settle_timeout(sock, deadline)
        piece = sock.recv(min(n - len(buf), _READ_PIECE))
        if not piece:
            if eof_ok and not buf:
                return b""
            raise ConnectionError(f"connection closed after {len(buf)} of {n} bytes")
        buf += piece
    return bytes(buf)


def hex_keys(keys: list[bytes] | tuple[bytes, ...]) -> list[str]:
    return [k.hex() for k in keys]


def unhex_keys(values: Any) -> list[bytes]:
    if not isinstance(values, list):
        raise ValueError("keys must be a list of hex strings")
    return [bytes.fromhex(v) for v in values]


def unhex_key(value: Any) -> bytes:
    """A written chunk's key: hex of 1 to :data:`MAX_KEY_BYTES` bytes."""
    key = bytes.fromhex(value)
    if not 1 <= len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"a chunk key must be 1 to {MAX_KEY_BYTES} bytes, got {len(key)}")
    return key


def pack_tokens(token_ids: Any) -> bytes | None:
    """Token ids as little-endian uint32s (what a write item's ``tokens`` carries, hex-encoded); None when
    there are none or one is not an integer from 0 to 2**32 - 1."""
    try:
        n = len(token_ids)
        return struct.pack(f"<{n}I", *token_ids) if 0 < n <= MAX_ITEM_TOKENS else None
    except (struct.error, TypeError):
        return None


def unpack_tokens(packed: bytes) -> list[int]:
    return [t for (t,) in _TOKEN.iter_unpack(packed)]


def unhex_tokens(value: Any) -> bytes:
    """A write item's ``tokens``: hex of 1 to :data:`MAX_ITEM_TOKENS` little-endian uint32s."""
    if not isinstance(value, str):
        raise ValueError(f"a chunk's tokens must be a hex string, got {type(value).__name__}")
    packed = bytes.fromhex(value)
    if not packed or len(packed) % _TOKEN.size or len(packed) > MAX_ITEM_TOKENS * _TOKEN.size:
        raise ValueError(
            f"a chunk's tokens must be 1 to {MAX_ITEM_TOKENS} token ids of {_TOKEN.size} bytes each, "
            f"got {len(packed)} bytes"
        )
    return packed
