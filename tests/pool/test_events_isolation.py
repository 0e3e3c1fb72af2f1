"""Who may read the pool events stream, and what a reader can make the publisher hold.

Each test is an attack on a real ``maru-pool events`` process reading a real daemon, with real ZMQ sockets:
subscribers without the stream's CURVE key, replay requests that ask for everything again and again, and
hundreds of replay peers (each from its own loopback address, as pods are) that ask and never read.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from maru_pool.client import PoolClient
from tests.support.events import BLOCK, commit_prompt, decoded, first_seen, prompt, prompt_tokens, run_events, shape
from tests.support.pool import START_TIMEOUT_S, Daemon, token_file, write_key

END = (-1).to_bytes(8, "big", signed=True)


@pytest.fixture
def tenant(sock_dir: Path) -> tuple[Path, str]:
    key = write_key(sock_dir / "pool.key")
    return key, token_file(sock_dir / "a.token", key, "ns-a/qwen")


def from_address(endpoint: str, source: str) -> str:
    """``endpoint`` connected to from the loopback address ``source`` (ZMQ's ``source;endpoint`` form)."""
    return endpoint.replace("tcp://", f"tcp://{source}:0;", 1)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def replay(
    ctx: zmq.Context[zmq.Socket[bytes]],
    endpoint: str,
    start: int,
    *,
    source: str = "127.0.0.1",
    curve: tuple[bytes, bytes, bytes] | None = None,
    wait_s: float = START_TIMEOUT_S,
) -> list[int] | None:
    """One replay request; the sequence numbers it got back, None when no answer came within ``wait_s``."""
    dealer = ctx.socket(zmq.DEALER)
    if curve:
        dealer.curve_publickey, dealer.curve_secretkey, dealer.curve_serverkey = curve
    dealer.connect(from_address(endpoint, source))
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        got: list[int] = []
        while dealer.poll(int(wait_s * 1000)):
            _, _, seq, _ = dealer.recv_multipart()
            if seq == END:
                return got
            got.append(int.from_bytes(seq, "big"))
        return None
    finally:
        dealer.close(linger=0)


def publish_batches(url: str, token: str, endpoint: str, ctx: zmq.Context[zmq.Socket[bytes]], n: int) -> None:
    """Store one-chunk prompts (with their tokens) until the replay buffer holds batch ``n``; each check asks
    from an address of its own (a peer's requests are rate-limited)."""
    with PoolClient(url, timeout_s=10, token_file=token) as client:
        step = min(n, 100)
        for i in range(20 * n):
            commit_prompt(client, prompt(i % 250, 1), prompt_tokens(i % 250, 1))
            if i >= n and (i - n) % step == 0 and replay(ctx, endpoint, n, source=f"127.0.3.{i // step % 250 + 1}"):
                return
    raise AssertionError(f"batch {n} was never published")


def requests_seen(sock_dir: Path) -> int:
    """Replay requests the publisher has read so far (it logs each at DEBUG)."""
    return (sock_dir / "events.log").read_text().count("events: replay request from ")


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def settled_rss_mib(pid: int, *, samples: int = 6, tolerance_mib: float = 1.0) -> float:
    """The process's RSS once it stopped changing (the peers' requests are all served): the largest of
    ``samples`` consecutive readings within ``tolerance_mib`` of each other."""
    readings = [rss_mib(pid)]
    for _ in range(600):
        time.sleep(0.5)
        readings.append(rss_mib(pid))
        last = readings[-samples:]
        if len(last) == samples and max(last) - min(last) <= tolerance_mib:
            return max(last)
    raise AssertionError(f"the publisher's memory never settled: {readings[-samples:]}")


def test_replies_are_bounded_and_each_peer_is_rate_limited(
    daemons: list[Daemon], sock_dir: Path, tenant: tuple[Path, str], ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    _, token = tenant
    flags = ("--replay-max-batches", "3", "--replay-burst", "2", "--replay-rate", "1")
    with run_events(daemons, sock_dir, tenant, *flags) as (url, fields, _):
        endpoint = fields["replay"]
        publish_batches(url, token, endpoint, ctx, 5)
        # One request gets at most --replay-max-batches, from where it asked; the rest by asking again.
        assert replay(ctx, endpoint, 0, source="127.0.2.1") == [0, 1, 2]
        assert replay(ctx, endpoint, 3, source="127.0.2.1") == [3, 4, 5]
        # A peer that asks again and again gets its burst, then a request a second; the rest go unanswered.
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(from_address(endpoint, "127.0.2.2"))
        started = time.monotonic()
        answered = 0
        for _ in range(16):
            dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            while dealer.poll(300):  # read what came (a reply to a peer that does not read would be abandoned)
                answered += dealer.recv_multipart()[2] == END
        while dealer.poll(2000):  # and what comes late, until nothing came for a while
            answered += dealer.recv_multipart()[2] == END
        # At most the burst, plus one a second of however long the requests took to arrive and be served.
        allowed = 2 + int(time.monotonic() - started) + 1
        dealer.close(linger=0)
        assert 2 <= answered <= allowed and answered < 16, (answered, allowed)
        # Another peer is not held back by it.
        assert replay(ctx, endpoint, 0, source="127.0.2.3") == [0, 1, 2]


def test_slow_replay_peers_cannot_grow_the_publisher(
    daemons: list[Daemon], sock_dir: Path, tenant: tuple[Path, str], ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """200 peers, each from its own address, ask for every buffered batch five times and never read."""
    _, token = tenant
    with run_events(daemons, sock_dir, tenant, "--token-ids", "--log-level", "DEBUG") as (url, fields, proc):
        endpoint = fields["replay"]
        publish_batches(url, token, endpoint, ctx, 1200)
        asked = requests_seen(sock_dir)
        before = settled_rss_mib(proc.pid)
        peers = []
        for i in range(200):
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.RCVBUF, 4096)  # a slow reader: the kernel holds little for it either
            dealer.setsockopt(zmq.RCVHWM, 1)
            dealer.connect(from_address(endpoint, f"127.0.4.{i + 1}"))
            for _ in range(5):
                dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            peers.append(dealer)
        for _ in range(600):  # until the publisher has seen every request
            if requests_seen(sock_dir) >= asked + 1000:
                break
            time.sleep(0.5)
        after = settled_rss_mib(proc.pid)
        print(f"publisher RSS {before:.0f} MiB before 200 slow replay peers, {after:.0f} MiB after")
        # Bounded: each peer's queue holds one reply of --replay-max-batches (100) batches of about 1 KiB.
        assert after - before < 64, (before, after)
        # And the stream still serves: a new peer gets its reply.
        assert replay(ctx, endpoint, 0, source="127.0.2.9") == list(range(100))
        for dealer in peers:
            dealer.close(linger=0)


def curve_keys(sock_dir: Path, *admitted: bytes) -> tuple[tuple[bytes, bytes], Path, Path]:
    """The publisher's key pair, its secret key file and a clients file admitting ``admitted``."""
    public, secret = zmq.curve_keypair()
    (secret_file := sock_dir / "server.key").write_bytes(secret + b"\n")
    (clients := sock_dir / "clients").write_bytes(b"".join(k + b" consumer %d\n" % i for i, k in enumerate(admitted)))
    return (public, secret), secret_file, clients


def test_with_curve_only_admitted_subscribers_get_the_events(
    daemons: list[Daemon], sock_dir: Path, tenant: tuple[Path, str], ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    _, token = tenant
    consumer, stranger = zmq.curve_keypair(), zmq.curve_keypair()
    (server_public, _), secret_file, clients = curve_keys(sock_dir, consumer[0])
    flags = ("--curve-secret-key-file", str(secret_file), "--curve-clients-file", str(clients))
    with run_events(daemons, sock_dir, tenant, *flags) as (url, fields, _):
        assert fields["curve_public_key"] == server_public.decode()

        def subscriber(keys: tuple[bytes, bytes] | None) -> zmq.Socket[bytes]:
            sub = ctx.socket(zmq.SUB)
            if keys:
                sub.curve_publickey, sub.curve_secretkey = keys
                sub.curve_serverkey = server_public
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(fields["publish"])
            return sub

        plain, unlisted, admitted = subscriber(None), subscriber(stranger), subscriber(consumer)
        with PoolClient(url, timeout_s=10, token_file=token) as client:
            first_seen(admitted, client)  # the admitted subscriber reads the stream...
            commit_prompt(client, prompt(7, 1))
            assert admitted.poll(START_TIMEOUT_S * 1000)
            assert shape(decoded(tuple(admitted.recv_multipart()))[2]) == [  # type: ignore[arg-type]
                ("stored", prompt(7, 1), None, BLOCK, [], "MARU_POOL")
            ]
        # ...while everything was published, a subscriber without a key and one with an unlisted key got nothing.
        assert not plain.poll(0) and not unlisted.poll(0)
        # The replay socket admits the same keys.
        assert replay(ctx, fields["replay"], 0, wait_s=2) is None
        assert replay(ctx, fields["replay"], 0, source="127.0.2.1", curve=(*stranger, server_public), wait_s=2) is None
        assert replay(ctx, fields["replay"], 0, source="127.0.2.2", curve=(*consumer, server_public))
        # A key removed from the clients file (a mounted Secret updated in place) is refused from then on.
        clients.write_bytes(stranger[0] + b"\n")
        revoked = subscriber(consumer)
        with PoolClient(url, timeout_s=10, token_file=token) as client:
            first_seen(subscriber(stranger), client, base=200)
        assert not revoked.poll(0)


def test_curve_flags_are_checked_naming_the_flag(sock_dir: Path, tenant: tuple[Path, str]) -> None:
    import subprocess
    import sys

    from tests.support.pool import connector_env

    _, token = tenant
    _, secret_file, clients = curve_keys(sock_dir, zmq.curve_keypair()[0])
    (bad_secret := sock_dir / "bad.key").write_text("not a key\n")
    (empty := sock_dir / "empty").write_text("\n")
    for args, flag in (
        (["--curve-secret-key-file", str(secret_file)], "--curve-clients-file"),
        (["--curve-clients-file", str(clients)], "--curve-secret-key-file"),
        (["--curve-secret-key-file", str(bad_secret), "--curve-clients-file", str(clients)], "--curve-secret-key-file"),
        (["--curve-secret-key-file", str(secret_file), "--curve-clients-file", str(empty)], "--curve-clients-file"),
        (["--curve-secret-key-file", str(secret_file), "--curve-clients-file", "/nonexistent"], "--curve-clients-file"),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "maru_pool", "events", "--token-file", token, "--pool",
             "unix:///nonexistent.sock", "--block-size", "16", "--publish", "tcp://127.0.0.1:0", *args],
            capture_output=True, text=True, env=connector_env(), timeout=START_TIMEOUT_S,
        )  # fmt: skip
        assert result.returncode == 2, (args, result.stderr)
        assert flag in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_one_batch_carries_a_bounded_number_of_keys(
    daemons: list[Daemon], sock_dir: Path, tenant: tuple[Path, str]
) -> None:
    """Many chunks stored at once are published in batches of at most READ_MAX_KEYS keys: a queued message's
    size stays bounded (the daemon would answer one read with up to 65,536 keys)."""
    from maru_pool.client import WriteLease
    from maru_pool.link import TenantLink
    from maru_pool.publisher import READ_MAX_KEYS, Publisher, Translator
    from tests.support.pool import start_serve

    key, token = tenant
    url = start_serve(daemons, sock_dir, "--auth-key-file", str(key), size="64Mi").ready["listen"]
    sent: list[tuple[bytes, bytes, bytes]] = []
    n = READ_MAX_KEYS + 500
    with PoolClient(url, timeout_s=30, token_file=token) as client, TenantLink(url, token_file=token) as link:
        publisher = Publisher(link, sent.append, Translator(BLOCK))
        assert publisher.step(wait_ms=10_000)  # the first batch: AllBlocksCleared
        keys = [i.to_bytes(16, "big") for i in range(n)]
        for first in range(0, n, 1000):
            leases = client.lease_many([(k, 64) for k in keys[first : first + 1000]])
            assert all(isinstance(lease, WriteLease) for lease in leases), {str(x) for x in leases}
            for lease in leases:
                lease.fill(bytes(64))  # type: ignore[union-attr]
            assert all(client.commit_many(leases))  # type: ignore[arg-type]
        published = 0
        while published < n:
            before = len(sent)
            assert publisher.step(wait_ms=10_000)
            for message in sent[before:]:
                stored = [e for e in shape(decoded(message)[2]) if e[0] == "stored"]
                size = sum(len(e[1]) for e in stored)
                assert size <= READ_MAX_KEYS, size
                published += size
        assert published == n
