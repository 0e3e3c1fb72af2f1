"""The replay socket of ``maru-pool events``: missed batches again, as vLLM's ``ZmqEventPublisher`` serves them.

A subscriber that sees a gap in the sequence numbers (ZMQ drops messages past the high-water mark, or it
connected late) asks a ROUTER socket for everything from a sequence number on: it sends the number as 8
big-endian bytes, and gets back the batches still buffered from there, each as ``(topic, sequence, payload)``,
then the end marker ``("", -1, "")``. Same frames and same marker as vLLM's (``--kv-events-config``
``replay_endpoint``, ``buffer_steps``), so a consumer's replay code works against the pool too.

What one peer can make this process hold is bounded: a reply carries at most ``max_batches`` batches (a
consumer that needs more asks again from the last one it got, as it would after any gap), each peer address
gets ``rate`` requests a second (``burst`` at once; more are dropped unanswered), a peer's unsent replies queue
up to ``max_batches + 1`` messages and a reply that does not fit is abandoned, not queued, and a request over
``MAX_REQUEST_BYTES`` drops the connection. Without these, slow peers that ask and never read made the
publisher queue every buffered batch once per request.

The socket is served by a thread of its own (ZMQ sockets are used by one thread only), so a replay is
answered at once even while the publisher waits on the pool daemon.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
DEFAULT_BUFFER = 10_000  # batches kept, as vLLM's buffer_steps
DEFAULT_BUFFER_BYTES = 64 << 20  # and at most this many payload bytes (a batch's size is the daemon's reply's)
DEFAULT_MAX_BATCHES = 100  # batches in one reply: what one request can make this process queue
DEFAULT_RATE = 1  # requests a second per peer address
DEFAULT_BURST = 5
MAX_REQUEST_BYTES = 1024  # a request is 8 bytes (a CURVE handshake a few hundred); ZMQ drops a peer that sends more
REPLY_SNDBUF = 128 << 10  # bytes the kernel may hold for one replay peer
MAX_PEERS = 4096  # peer addresses whose request budget is remembered (the least recently seen go first)


def _rare(count: int) -> bool:
    """Log the 1st, 2nd, 4th, 8th... of a kind: a flood of requests logs a few lines, not one each."""
    return count & (count - 1) == 0


class RateLimiter:
    """A token bucket per peer: ``rate`` requests a second, ``burst`` at once."""

    def __init__(self, rate: float, burst: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"rate must be positive and burst at least 1, got {rate} and {burst}")
        self.rate, self.burst, self._clock = rate, burst, clock
        self._peers: OrderedDict[str, tuple[float, float]] = OrderedDict()  # peer -> (tokens, when)

    def allow(self, peer: str) -> bool:
        now = self._clock()
        tokens, then = self._peers.pop(peer, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - then) * self.rate)
        allowed = tokens >= 1
        self._peers[peer] = (tokens - 1 if allowed else tokens, now)
        while len(self._peers) > MAX_PEERS:
            self._peers.popitem(last=False)  # a forgotten peer starts again with a full bucket: no worse
        return allowed


class ReplayServer:
    def __init__(
        self,
        endpoint: str,
        *,
        buffer: int = DEFAULT_BUFFER,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        max_batches: int = DEFAULT_MAX_BATCHES,
        rate: float = DEFAULT_RATE,
        burst: int = DEFAULT_BURST,
        secure: Callable[[Any], None] | None = None,
    ) -> None:
        """``secure``: called with the socket before it binds (CURVE)."""
        import zmq  # only the events role needs ZMQ

        if max_batches < 1:
            raise ValueError(f"max_batches must be at least 1, got {max_batches}")
        self._zmq = zmq
        self._lock = threading.Lock()
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=buffer)  # (seq, topic, payload)
        self._buffer_bytes, self._held = buffer_bytes, 0
        self.max_batches = max_batches
        self.limiter = RateLimiter(rate, burst)
        self.dropped = self.abandoned = 0  # requests over a peer's rate; replies a peer was too slow for
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        # A reply fits a peer's queue once; the next one to a peer that has not read it is abandoned (MANDATORY
        # makes a full queue an error on a non-blocking send instead of a silent drop mid-reply).
        self._sock.setsockopt(zmq.SNDHWM, max_batches + 1)
        # And the kernel holds little more for it: a peer that does not read fills that queue, not the socket's
        # send buffer (which the kernel would grow to megabytes per connection, charged to this pod).
        self._sock.setsockopt(zmq.SNDBUF, REPLY_SNDBUF)
        self._sock.setsockopt(zmq.RCVHWM, 100)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            if secure is not None:
                secure(self._sock)
            self._sock.bind(endpoint)
        except zmq.ZMQError as err:
            self._sock.close(linger=0)
            raise ValueError(f"cannot bind {endpoint}: {err}") from None
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="events-replay", daemon=True)
        self._thread.start()

    def record(self, message: tuple[bytes, bytes, bytes]) -> None:
        """Keep a published message for replays (the oldest go past ``buffer`` batches or ``buffer_bytes``)."""
        topic, seq, payload = message
        with self._lock:
            if len(self._buffer) == self._buffer.maxlen and self._buffer:
                self._held -= len(self._buffer[0][2])
            self._buffer.append((int.from_bytes(seq, "big"), topic, payload))
            self._held += len(payload)
            while self._held > self._buffer_bytes and len(self._buffer) > 1:
                self._held -= len(self._buffer.popleft()[2])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                if self._sock.poll(100):
                    self._answer(self._sock.recv_multipart(copy=False))
            except self._zmq.ZMQError as err:
                if self._stop.is_set():
                    return
                log.warning("events: replay request failed: %s", err)

    def _answer(self, frames: list[Any]) -> None:
        if len(frames) != 3 or len(frames[2].bytes) != 8:
            log.warning("events: ignored a malformed replay request (%d frames)", len(frames))
            return
        client, start = frames[0].bytes, frames[2].bytes
        peer = self._peer_address(frames[2])
        log.debug("events: replay request from %s", peer)
        if not self.limiter.allow(peer):
            self.dropped += 1
            if _rare(self.dropped):
                log.warning("events: dropped replay request(s) over the rate of %s (%d dropped so far)",
                            peer, self.dropped)  # fmt: skip
            return
        first = int.from_bytes(start, "big")
        with self._lock:
            batches = [(seq, topic, payload) for seq, topic, payload in self._buffer if seq >= first]
        batches = batches[: self.max_batches]
        try:
            for seq, topic, payload in batches:
                self._sock.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload), self._zmq.NOBLOCK)
            self._sock.send_multipart((client, b"", b"", END_SEQ, b""), self._zmq.NOBLOCK)
        except self._zmq.ZMQError as err:  # EAGAIN: its queue is full; EHOSTUNREACH: it is gone
            self.abandoned += 1
            if _rare(self.abandoned):
                log.warning("events: abandoned a replay to %s, which does not read its replies: %s (%d so far)",
                            peer, err, self.abandoned)  # fmt: skip
            return
        log.info("events: replayed %d batch(es) from %d to %s", len(batches), first, peer)

    def _peer_address(self, frame: Any) -> str:
        """The peer's IP address as ZMQ saw it (one budget for all of a peer's connections)."""
        try:
            return str(frame.get("Peer-Address"))
        except self._zmq.ZMQError:  # a transport without addresses (ipc, inproc): one budget for all
            return "local"
