"""``maru-pool events``: republish a tenant's pool events over ZMQ in vLLM's KV event format.

The daemon keeps each tenant's event log (:mod:`.events`) and serves it only to that tenant, over its
authenticated socket (``events`` op). This process reads it with the tenant's token and publishes what it
reads on a ZMQ PUB socket exactly as a vLLM engine publishes its own KV events (:mod:`.kv_events_wire`),
with the pool as the medium, so llm-d's KV-cache indexer, Dynamo's router or anything else that consumes
vLLM's events learns what the pool holds for this tenant.

A stale index is worse than none, and some consumers ignore ``AllBlocksCleared`` (llm-d's indexer only logs
it), so the publisher remembers which keys it announced as stored and turns every clear into explicit
removals first: a tenant's flush, a daemon restart (a new epoch) and a resync after this publisher fell
behind the daemon's log each publish ``BlockRemoved`` for what is gone, then ``AllBlocksCleared``, then what
the pool holds now. A fresh publisher's first batch starts with ``AllBlocksCleared`` (consumers drop what an
earlier incarnation announced).

With ``--token-ids`` (off by default: they are the tenants' prompts, and vLLM allows an empty list),
``BlockStored.token_ids`` carries the prompt tokens of the event's chunks, concatenated in the order of its
block hashes (as vLLM's own events carry a block run's tokens), taken from what the engines sent with their
writes; without it the daemon is not even asked for them. It is empty, too, when any chunk of the event came
without them (an older connector, a prompt whose tokens alone do not say what its chunks hold, a resync of a
chunk whose event left the log), or when a chunk's token count is not ``--block-size``: a consumer splits
token_ids by block_size.

Who may read the stream: with ``--curve-secret-key-file`` both sockets are ZMQ CURVE servers and admit only
the subscribers whose public keys ``--curve-clients-file`` lists (read again when it changes, as a mounted
Secret does); without it, anyone who reaches the ports (the operator's NetworkPolicy decides who does).
What a subscriber can make this process hold is bounded: ``--send-hwm`` messages queued per subscriber
(ZMQ drops the rest for that subscriber, which sees the gap and replays), subscription messages of at most
``MAX_SUBSCRIPTION_BYTES``, and the replay socket's own limits (:mod:`.replay`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .client import PoolAuthError, PoolError
from .events import CLEARED, MEDIUM, REMOVED, STORED
from .kv_events_wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, block_hash, message
from .link import TenantLink
from .protocol import unpack_tokens

log = logging.getLogger(__name__)

# How long one read may wait in the daemon for an event (a long poll), and the back-off after a failure.
POLL_MS = 1000
RETRY_S = (0.5, 5.0)
# Messages queued for one subscriber that does not read (vLLM's publisher queues 100,000: with 200 such
# subscribers that was hundreds of MiB); past it ZMQ drops that subscriber's messages, and it replays the gap.
DEFAULT_SEND_HWM = 1_000
# Keys one read (and so one batch) may carry, but a resync's: what bounds a queued message, with the HWMs above
# (the daemon's own limit, 65,536 keys, made a batch of up to ~70 MiB with token ids).
READ_MAX_KEYS = 4_096
MAX_REFUSED_LOGGED = 1024  # distinct refused CURVE keys logged, then no more
MAX_SUBSCRIPTION_BYTES = 1024  # what a subscriber sends is its subscriptions (topic prefixes): nothing long

WireEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class Translator:
    """The daemon's events in, vLLM's out; keeps the keys announced as stored, so a clear becomes removals."""

    block_size: int  # tokens per chunk: what one key (block hash) stands for
    medium: str = MEDIUM
    int_hashes: bool = False
    announced: dict[bytes, None] = field(default_factory=dict)  # keys published as stored, not since removed
    mismatched: int = 0  # stored events published without tokens because a chunk's count was not block_size

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size (tokens per chunk) must be positive, got {self.block_size}")
        if not self.medium:
            raise ValueError("medium must not be empty")

    def translate(self, events: Sequence[Sequence[Any]], *, resync: bool) -> list[WireEvent]:
        """vLLM events for one ``events`` reply: ``[kind, [hex keys], parent hex | None, tokens?]`` each, where
        ``tokens`` (from a daemon asked for them) is None or per key its token ids' hex or None."""
        out: list[WireEvent] = []
        if resync:
            # What the consumer may still hold from before, less what is still there, goes explicitly.
            now = {bytes.fromhex(k) for kind, keys, *_ in events if kind == STORED for k in keys}
            self._remove(out, [key for key in self.announced if key not in now])
        for i, (kind, hex_keys, parent, *rest) in enumerate(events):
            keys = [bytes.fromhex(k) for k in hex_keys]
            if kind == STORED:
                self.announced.update(dict.fromkeys(keys))
                out.append(
                    BlockStored(
                        block_hashes=[self._hash(k) for k in keys],
                        parent_block_hash=self._hash(bytes.fromhex(parent)) if parent else None,
                        token_ids=self._token_ids(rest[0] if rest else None, len(keys)),
                        block_size=self.block_size,
                        lora_id=None,
                        medium=self.medium,
                        lora_name=None,
                    )
                )
            elif kind == REMOVED:
                self._remove(out, keys)
            elif kind == CLEARED:
                # A resync's own clear removed only what is gone (above): what is still there is stored again.
                if not (resync and i == 0):
                    self._remove(out, list(self.announced))
                self.announced.clear()
                out.append(AllBlocksCleared())
            else:
                log.warning("events: skipped an event of unknown kind %r (a newer daemon?)", kind)
        return out

    def _token_ids(self, tokens: Sequence[str | None] | None, n_keys: int) -> list[int]:
        """The event's token ids, block after block; empty unless every block has exactly block_size."""
        if not tokens or len(tokens) != n_keys or any(t is None for t in tokens):
            return []
        per_block = [unpack_tokens(bytes.fromhex(t)) for t in tokens if t is not None]
        if any(len(ids) != self.block_size for ids in per_block):
            if not self.mismatched:
                log.warning(
                    "events: chunks of %s token(s) but --block-size %d; publishing them without token ids "
                    "(set --block-size to the group's chunk size)",
                    sorted({len(ids) for ids in per_block}), self.block_size,
                )  # fmt: skip
            self.mismatched += 1
            return []
        return [t for ids in per_block for t in ids]

    def _remove(self, out: list[WireEvent], keys: list[bytes]) -> None:
        for key in keys:
            self.announced.pop(key, None)
        if keys:
            out.append(BlockRemoved(block_hashes=[self._hash(k) for k in keys], medium=self.medium))

    def _hash(self, key: bytes) -> bytes | int:
        return block_hash(key, as_int=self.int_hashes)


class Publisher:
    """Reads the tenant's log and sends one ZMQ message per batch of events read."""

    def __init__(
        self,
        link: TenantLink,
        send: Callable[[tuple[bytes, bytes, bytes]], None],
        translator: Translator,
        *,
        topic: str = "",
        tokens: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``tokens``: ask the daemon for each chunk's token ids and publish them in ``BlockStored``."""
        self._link = link
        self.tokens = tokens
        self._send = send
        self.translator = translator
        self.topic = topic
        self._clock = clock
        self.cursor: tuple[int, int] | None = None  # (daemon epoch, last sequence number read)
        self.seq = 0  # the next ZMQ sequence number

    def step(self, wait_ms: int = POLL_MS) -> int:
        """One read (waiting up to ``wait_ms`` in the daemon); returns how many vLLM events it published."""
        after = list(self.cursor) if self.cursor else None
        # tokens: each event's token ids too (a daemon that predates them ignores the field; see protocol.py).
        request = {"op": "events", "after": after, "timeout_ms": wait_ms, "max_keys": READ_MAX_KEYS,
                   "tokens": self.tokens}  # fmt: skip
        reply = self._link.call(request, wait_s=wait_ms / 1000)
        epoch, resync = int(reply["epoch"]), bool(reply["resync"])
        if resync and self.cursor is not None:
            why = "the daemon restarted" if self.cursor[0] != epoch else "this publisher fell behind the daemon's log"
            log.warning("events: resync (%s): removals, AllBlocksCleared, then what the pool holds", why)
        wire = self.translator.translate(reply["events"], resync=resync)
        self.cursor = (epoch, int(reply["last"]))
        if wire:
            self._send(message(self.topic, self.seq, KVEventBatch(ts=self._clock(), events=wire)))
            log.debug("events: published batch %d (%d events, %d keys held)", self.seq, len(wire), self.held)
            self.seq += 1
        return len(wire)

    def close(self) -> None:
        self._link.close()

    @property
    def held(self) -> int:
        return len(self.translator.announced)

    def run(self, stop: threading.Event) -> None:
        """Publish until ``stop``; a daemon that is down or restarting is retried with back-off (its events
        are not lost: the next read resumes after the cursor, or resyncs)."""
        delay = RETRY_S[0]
        failing = False
        while not stop.is_set():
            try:
                self.step()
            except PoolAuthError as err:
                log.error("events: the pool refused the token: %s; retrying in %.0f s", err, RETRY_S[1])
                stop.wait(RETRY_S[1])
                continue
            except PoolError as err:
                if not failing:
                    log.warning("events: cannot read the pool's events: %s; retrying", err)
                failing = True
                stop.wait(delay)
                delay = min(delay * 2, RETRY_S[1])
                continue
            if failing:
                log.info("events: reading the pool's events again (epoch %d)", self.cursor[0] if self.cursor else 0)
            failing, delay = False, RETRY_S[0]


def bind(endpoint: str, *, hwm: int = DEFAULT_SEND_HWM, secure: Callable[[Any], None] | None = None) -> tuple[Any, str]:
    """A ZMQ PUB socket bound to ``endpoint`` (``tcp://*:5557``; port 0 picks one), and where it is bound.
    ``secure``: called with the socket before it binds (CURVE)."""
    import zmq  # only this role needs ZMQ: the pool daemon itself does not

    sock = zmq.Context.instance().socket(zmq.PUB)
    sock.set_hwm(hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_SUBSCRIPTION_BYTES)
    try:
        if secure is not None:
            secure(sock)
        sock.bind(endpoint)
    except zmq.ZMQError as err:
        sock.close(linger=0)
        raise ValueError(f"cannot bind {endpoint}: {err}") from None
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


class CurveClients:
    """The subscribers' public keys (Z85, one a line, optionally followed by a name), read again whenever the file
    changes: a mounted Secret is updated in place, so a key is added or revoked without a restart."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._refused: set[bytes] = set()
        self.keys: frozenset[bytes] = frozenset()
        self.reload()
        if not self.keys:
            raise ValueError(f"{path}: lists no public key (Z85, 40 characters a line)")
        log.info("events: subscribers authenticated by CURVE, %d key(s) admitted", len(self.keys))

    def reload(self) -> None:
        st = os.stat(self.path)
        if (st.st_mtime_ns, st.st_ino) == self._stamp:
            return
        with open(self.path, encoding="ascii") as f:
            # Z85 has '#' in its alphabet and no blanks: what follows a key on its line names its holder.
            keys = [line.split()[0] for line in f if line.strip()]
        bad = [k for k in keys if len(k) != 40]
        if bad:
            raise ValueError(f"{self.path}: {bad[0][:12]!r}... is not a Z85 public key (40 characters)")
        changed = self._stamp is not None
        self.keys, self._stamp = frozenset(k.encode() for k in keys), (st.st_mtime_ns, st.st_ino)
        if changed:
            log.info("events: subscriber keys changed, %d admitted", len(self.keys))

    def callback(self, domain: str, key: bytes) -> bool:
        """zmq.auth's credentials provider: is this client's public key (Z85) admitted?"""
        try:
            self.reload()
        except (OSError, ValueError) as err:  # a half-written update: keep the keys read last
            log.warning("events: cannot read the subscriber keys again, keeping %d: %s", len(self.keys), err)
        admitted = key in self.keys
        # A refused ZMQ peer reconnects every few hundred ms: say so once per key, not once per attempt.
        if not admitted and key not in self._refused and len(self._refused) < MAX_REFUSED_LOGGED:
            self._refused.add(key)
            log.warning("events: refused a subscriber whose public key is not listed: %s", key.decode(errors="replace"))
        return admitted


@dataclass
class Curve:
    """The sockets' CURVE server keys and the admitted subscribers, checked by a ZAP handler thread."""

    public: bytes
    secret: bytes
    clients: CurveClients
    authenticator: Any = None

    @classmethod
    def load(cls, secret_key_file: str, clients_file: str) -> Curve:
        import zmq
        import zmq.auth.thread

        if not zmq.has("curve"):
            raise ValueError("this ZMQ has no CURVE support")
        with open(secret_key_file, encoding="ascii") as f:
            secret = f.read().strip().encode()
        try:
            public = zmq.curve_public(secret)
        except (ValueError, zmq.ZMQError):
            raise ValueError(f"{secret_key_file}: not a Z85 CURVE secret key (40 characters)") from None
        curve = cls(public, secret, CurveClients(clients_file))
        curve.authenticator = zmq.auth.thread.ThreadAuthenticator(zmq.Context.instance(), log=log)
        curve.authenticator.start()
        curve.authenticator.configure_curve_callback(domain="*", credentials_provider=curve.clients)
        return curve

    def secure(self, sock: Any) -> None:
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def close(self) -> None:
        if self.authenticator is not None:
            self.authenticator.stop()


@dataclass
class Role:
    """The ``events`` role, built from its flags: what to run, what to print when ready, what to close."""

    publisher: Publisher
    ready: dict[str, str]
    closers: list[Callable[[], None]]


def build(args: Any) -> Role:
    """ValueError names the flag that is wrong."""
    try:
        translator = Translator(args.block_size, medium=args.medium, int_hashes=args.int_hashes)
    except ValueError as err:
        flag = "--medium" if "medium" in str(err) else "--block-size"
        raise ValueError(f"{flag}: {err}") from None
    curve = _curve(args)
    closers: list[Callable[[], None]] = [curve.close] if curve else []
    secure = curve.secure if curve else None
    try:
        link = TenantLink(args.pool, token_file=args.token_file)
    except PoolError as err:
        _close(closers)
        raise ValueError(f"--pool: {err}") from None
    try:
        sock, bound = bind(args.publish, hwm=args.send_hwm, secure=secure)
    except ValueError as err:
        _close(closers)
        raise ValueError(f"--publish: {err}") from None
    closers.insert(0, lambda: sock.close(linger=0))
    ready = {"role": "events", "pool": args.pool, "publish": bound, "medium": args.medium,
             "token_ids": "on" if args.token_ids else "off"}  # fmt: skip
    if curve:
        ready["curve_public_key"] = curve.public.decode()
    send: Callable[[tuple[bytes, bytes, bytes]], None] = sock.send_multipart
    if args.replay:
        from .replay import ReplayServer

        try:
            replay = ReplayServer(args.replay, buffer=args.replay_buffer, max_batches=args.replay_max_batches,
                                  rate=args.replay_rate, burst=args.replay_burst, secure=secure)  # fmt: skip
        except ValueError as err:
            _close(closers)
            raise ValueError(f"--replay: {err}") from None
        closers.insert(1, replay.close)
        ready["replay"] = replay.endpoint

        def send(message: tuple[bytes, bytes, bytes]) -> None:
            sock.send_multipart(message)
            replay.record(message)

    return Role(Publisher(link, send, translator, topic=args.topic, tokens=args.token_ids), ready, closers)


def _curve(args: Any) -> Curve | None:
    secret, clients = args.curve_secret_key_file, args.curve_clients_file
    if bool(secret) != bool(clients):
        given, missing = ("--curve-secret-key-file", "--curve-clients-file")[:: 1 if secret else -1]
        raise ValueError(f"{missing}: required with {given}")
    if not secret:
        return None
    try:
        return Curve.load(secret, clients)
    except OSError as err:
        flag = "--curve-secret-key-file" if err.filename == secret else "--curve-clients-file"
        raise ValueError(f"{flag}: {err}") from None
    except ValueError as err:
        flag = "--curve-clients-file" if str(err).startswith(clients) else "--curve-secret-key-file"
        raise ValueError(f"{flag}: {err}") from None


def _close(closers: list[Callable[[], None]]) -> None:
    for close in closers:
        close()


def run(role: Role, stop: threading.Event) -> int:
    """Publish until ``stop``, then close the link and the sockets."""
    try:
        role.publisher.run(stop)
    finally:
        role.publisher.close()
        _close(role.closers)
    log.info("events: stopped after %d batch(es)", role.publisher.seq)
    return 0
