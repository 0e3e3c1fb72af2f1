"""The replay socket of ``maru-pool events``: missed batches again, as vLLM's ``ZmqEventPublisher`` serves them.

A subscriber that sees a gap in the sequence numbers (ZMQ drops messages past the high-water mark, or it
connected late) asks a ROUTER socket for everything from a sequence number on: it sends the number as 8
big-endian bytes, and gets back every batch still buffered from there, each as ``(topic, sequence, payload)``,
then the end marker ``("", -1, "")``. Same frames and same marker as vLLM's (``--kv-events-config``
``replay_endpoint``, ``buffer_steps``), so a consumer's replay code works against the pool too.

The socket is served by a thread of its own (ZMQ sockets are used by one thread only), so a replay is
answered at once even while the publisher waits on the pool daemon.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
DEFAULT_BUFFER = 10_000  # batches kept, as vLLM's buffer_steps


class ReplayServer:
    def __init__(self, endpoint: str, *, buffer: int = DEFAULT_BUFFER) -> None:
        import zmq  # only the events role needs ZMQ

        self._zmq = zmq
        self._lock = threading.Lock()
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=buffer)  # (seq, topic, payload)
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as err:
            self._sock.close(linger=0)
            raise ValueError(f"cannot bind {endpoint}: {err}") from None
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="events-replay", daemon=True)
        self._thread.start()

    def record(self, message: tuple[bytes, bytes, bytes]) -> None:
        """Keep a published message for replays (the oldest go past ``buffer``)."""
        topic, seq, payload = message
        with self._lock:
            self._buffer.append((int.from_bytes(seq, "big"), topic, payload))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                if self._sock.poll(100):
                    self._answer(self._sock.recv_multipart())
            except self._zmq.ZMQError as err:
                if self._stop.is_set():
                    return
                log.warning("events: replay request failed: %s", err)

    def _answer(self, frames: list[Any]) -> None:
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("events: ignored a malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        with self._lock:
            batches = [(seq, topic, payload) for seq, topic, payload in self._buffer if seq >= first]
        for seq, topic, payload in batches:
            self._sock.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
        self._sock.send_multipart((client, b"", b"", END_SEQ, b""))
        log.info("events: replayed %d batch(es) from %d", len(batches), first)
