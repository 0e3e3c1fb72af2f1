"""What each engine's own prefix cache holds, read from the KV events the engine publishes.

vLLM publishes every block its prefix cache stores or evicts (``--kv-events-config``, a ZMQ PUB socket:
multipart ``(topic, sequence, msgpack batch)``). The router subscribes to each engine it was given an
endpoint for and keeps the set of block hashes the engine holds, in the engine's own hashing, which the
router reproduces for a prompt (:mod:`.prompt_keys`). The longest run of a prompt's leading blocks in that
set is what the engine would not recompute.

A stale index is worse than none: a sequence gap (a batch lost on the socket, an engine restarted and
counting from 0 again) or a batch that cannot be read drops everything known of that engine. Until its
next stores it then looks cold, so requests go by load alone: slower at worst, never wrong.

Only the medium vLLM names for its device cache (``GPU``, or none) counts: a block only in a slower tier
(vLLM's CPU offloading) or in the pool is not what makes one engine faster than another here; the pool is
a tier every engine reads, counted apart (:func:`maru_router.balance.local_first`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

log = logging.getLogger("maru.router.locality")

DEVICE_MEDIA = (None, "GPU")
POLL_MS = 250  # how long the reading thread waits for a batch before it looks whether it should stop
_decoder = msgspec.msgpack.Decoder(type=KVEventBatch)


@dataclass
class EngineCache:
    """The blocks one engine's prefix cache holds, as its events said."""

    blocks: set[bytes | int] = field(default_factory=set)
    int_hashes: bool = False  # the engine sends hashes as integers (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
    block_size: int | None = None  # tokens per block, from the engine's stores
    next_seq: int | None = None  # the sequence number the next batch should carry
    resets: int = 0  # times everything was dropped (gaps, restarts, unreadable batches)

    def apply(self, seq: int, batch: KVEventBatch) -> None:
        if self.next_seq is not None and seq != self.next_seq:
            self.forget()
        self.next_seq = seq + 1
        for event in batch.events:
            if isinstance(event, BlockStored):
                if event.medium in DEVICE_MEDIA:
                    self.block_size = event.block_size
                    if event.block_hashes:
                        self.int_hashes = isinstance(event.block_hashes[0], int)
                    self.blocks.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                if event.medium in DEVICE_MEDIA:
                    self.blocks.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.blocks.clear()

    def forget(self) -> None:
        self.blocks.clear()
        self.next_seq = None
        self.resets += 1

    def prefix_tokens(self, hashes: Sequence[bytes], hash_block_size: int) -> int:
        """Tokens of the prompt's leading blocks (``hashes``: vLLM's, of ``hash_block_size`` tokens) held here;
        0 when the engine's blocks are of another size (its hashes are then not these)."""
        if self.block_size != hash_block_size or not self.blocks:
            return 0
        n = 0
        for h in hashes:
            if (_as_int(h) if self.int_hashes else h) not in self.blocks:
                break
            n += 1
        return n * hash_block_size


def _as_int(block_hash: bytes) -> int:
    # What vLLM sends for a block hash under VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES: its last 8 bytes, big-endian.
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


def announced_endpoint(engine_url: str, sources: object) -> str | None:
    """Where to read an engine's events, from its ``GET /kv_event_sources`` answer (vLLM's publisher config per
    data-parallel rank); None when it publishes none over ZMQ, or one stream per rank (several engine cores
    behind one URL: no one cache to follow).

    vLLM binds its publisher only to a wildcard address, which is reached at the engine's own host.
    """
    if not isinstance(sources, dict) or len(sources) != 1:
        return None
    (config,) = sources.values()
    if not isinstance(config, dict) or not config.get("enable_kv_cache_events") or config.get("publisher") != "zmq":
        return None
    endpoint = config.get("endpoint")
    if not isinstance(endpoint, str) or not endpoint.startswith(("tcp://", "ipc://")):
        return None
    scheme, _, address = endpoint.partition("://")
    host, sep, port = address.rpartition(":")
    if scheme == "tcp" and sep and host in ("*", "0.0.0.0", "[::]", "::"):
        engine_host = urlsplit(engine_url).hostname or "127.0.0.1"
        return f"tcp://{f'[{engine_host}]' if ':' in engine_host else engine_host}:{port}"
    return endpoint


def parse_endpoints(pairs: Sequence[str]) -> dict[str, str]:
    """``ENGINE_URL=ZMQ_ENDPOINT`` flags as a map of engine URL (no trailing slash) to endpoint."""
    out: dict[str, str] = {}
    for pair in pairs:
        url, sep, endpoint = pair.rpartition("=")
        if not sep or not url or not endpoint.startswith(("tcp://", "ipc://")):
            raise ValueError(
                f"--kv-events {pair!r}: must be ENGINE_URL=ENDPOINT, the endpoint tcp://host:port or ipc://path "
                "(where the engine's --kv-events-config publishes)"
            )
        out[url.rstrip("/")] = endpoint
    return out


class Subscriber:
    """One engine's event stream into its :class:`EngineCache`, until :meth:`close`.

    The socket is read by a thread of its own with a blocking poll, and each batch is applied on the event
    loop (the only thread that reads the cache). An asyncio ZMQ socket was seen to miss its wake-ups inside
    the router pod, leaving batches unread until the next one arrived.
    """

    def __init__(self, url: str, endpoint: str, cache: EngineCache, on_batch: Callable[[], None]) -> None:
        self.url, self.endpoint, self.cache = url, endpoint, cache
        self._on_batch = on_batch  # after each batch: the gauges
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, args=(loop,), name=f"kv-events {self.url}", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, POLL_MS / 1000 * 4)

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        import zmq

        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")  # every topic: one engine per socket
        sock.connect(self.endpoint)  # ZMQ reconnects by itself while the engine is away
        log.info("reading the KV events of %s from %s", self.url, self.endpoint)
        try:
            while not self._stop.is_set():
                if sock.poll(POLL_MS):
                    frames = sock.recv_multipart()
                    try:
                        loop.call_soon_threadsafe(self._deliver, frames)
                    except RuntimeError:
                        return  # the loop is closed: the router is stopping
        finally:
            sock.close(linger=0)

    def _deliver(self, frames: list[bytes]) -> None:
        self._take(frames)
        self._on_batch()

    def _take(self, frames: list[bytes]) -> None:
        try:
            _topic, seq, payload = frames
            batch = _decoder.decode(payload)
        except (ValueError, msgspec.DecodeError) as err:
            log.warning("KV events of %s: unreadable batch (%s); forgetting what it held", self.url, err)
            self.cache.forget()
            return
        before = self.cache.resets
        self.cache.apply(int.from_bytes(seq, "big"), batch)
        if self.cache.resets != before:
            log.warning(
                "KV events of %s: sequence gap (a lost batch or an engine restart); forgetting what it "
                "held until its next stores",
                self.url,
            )
