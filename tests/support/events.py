"""``maru-pool events`` against a real daemon: prompts stored as the connector stores them, events decoded as
vLLM decodes them."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from maru_pool.client import PoolClient, WriteLease
from maru_pool.events import MEDIUM
from maru_pool.protocol import pack_tokens
from tests.support.pool import START_TIMEOUT_S, Daemon, connector_env, start_serve

BLOCK = 256  # tokens per chunk


def prompt(p: int, n: int) -> list[bytes]:
    return [bytes([p, c]) * 8 for c in range(n)]


def prompt_tokens(p: int, n: int) -> list[int]:
    """The token ids of prompt ``p``'s first ``n`` chunks (as an engine keys and writes them)."""
    return [(p * 7919 + t) % 150_000 for t in range(n * BLOCK)]


def commit_prompt(client: PoolClient, keys: list[bytes], token_ids: list[int] | None = None) -> None:
    """As the connector stores a prompt: each chunk names the one before it and, given ``token_ids``, carries its
    own ``BLOCK`` of them."""
    items: list[Any] = [(key, CHUNK, keys[i - 1] if i else None) for i, key in enumerate(keys)]
    if token_ids is not None:
        items = [(*item, pack_tokens(token_ids[i * BLOCK : (i + 1) * BLOCK])) for i, item in enumerate(items)]
    leases = client.lease_many(items)
    assert all(isinstance(lease, WriteLease) for lease in leases), leases
    for lease in leases:
        lease.fill(bytes(CHUNK))  # type: ignore[union-attr]
    assert all(client.commit_many(leases))  # type: ignore[arg-type]


def decoded(message: tuple[bytes, bytes, bytes]) -> tuple[str, int, list[Any]]:
    topic, seq, payload = message
    batch = vllm_decoder.decode(payload)
    return topic.decode(), int.from_bytes(seq, "big"), batch.events


def shape(events: list[Any]) -> list[tuple[Any, ...]]:
    """Events as comparable tuples: type, hashes, and for stores the parent, size, tokens and medium."""
    out: list[tuple[Any, ...]] = []
    for e in events:
        if isinstance(e, kv_events.BlockStored):
            out.append(("stored", e.block_hashes, e.parent_block_hash, e.block_size, e.token_ids, e.medium))
        elif isinstance(e, kv_events.BlockRemoved):
            out.append(("removed", sorted(e.block_hashes), e.medium))
        else:
            assert isinstance(e, kv_events.AllBlocksCleared), e
            out.append(("cleared",))
    return out


@contextlib.contextmanager
def run_events(
    daemons: list[Daemon], sock_dir: Path, tenant: tuple[Path, str], *extra: str
) -> Iterator[tuple[str, dict[str, str], subprocess.Popen[str]]]:
    """A real ``maru-pool events`` process on a real daemon; yields the pool url, its ready line's fields and the
    process."""
    key, token = tenant
    d = daemons[-1] if daemons else start(daemons, sock_dir, key)
    log = (sock_dir / "events.log").open("w")  # a file, not a pipe: a pipe nobody reads would block its logging
    proc = subprocess.Popen(
        [sys.executable, "-m", "maru_pool", "events", "--pool", d.ready["listen"], "--token-file", token,
         "--publish", "tcp://127.0.0.1:0", "--block-size", str(BLOCK), "--topic", "kv@maru@qwen",
         "--replay", "tcp://127.0.0.1:0", *extra],
        stdout=subprocess.PIPE, stderr=log, text=True, env=connector_env(),
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("maru-pool ready role=events "), (line, (sock_dir / "events.log").read_text())
        fields = dict(kv.split("=", 1) for kv in line.split()[2:])
        assert fields["medium"] == MEDIUM
        yield d.ready["listen"], fields, proc
        proc.terminate()
        assert proc.wait(timeout=START_TIMEOUT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        if proc.stdout is not None:
            proc.stdout.close()


def first_seen(sub: zmq.Socket[bytes], client: PoolClient, base: int = 100) -> int:
    """Store probe prompts until ``sub`` sees one (ZMQ's slow joiner: a subscriber misses what was published
    before its subscription reached the publisher), then read on to the last probe's own event, so that what
    follows is exactly what the caller does next; returns how many probes (prompts ``base + 1``...) were
    stored."""
    deadline = time.monotonic() + START_TIMEOUT_S
    probe = 0
    while True:
        assert time.monotonic() < deadline, "the publisher sent nothing the subscriber saw"
        probe += 1
        commit_prompt(client, prompt(base + probe, 1))
        if sub.poll(1000):
            break
    seen = shape(decoded(tuple(sub.recv_multipart()))[2])  # type: ignore[arg-type]
    # What the poll saw may be an earlier batch (the publisher's first AllBlocksCleared, a late probe).
    while not any(e[0] == "stored" and e[1] == prompt(base + probe, 1) for e in seen):
        assert sub.poll(START_TIMEOUT_S * 1000), f"the last probe was never published after {seen}"
        seen = shape(decoded(tuple(sub.recv_multipart()))[2])  # type: ignore[arg-type]
    return probe


kv_events = pytest.importorskip("vllm.distributed.kv_events")

vllm_decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)

CHUNK = 256 * 1024  # four of them fill the 1 MiB pool; a tenant may hold three


def start(daemons: list[Daemon], sock_dir: Path, key: Path) -> Daemon:
    return start_serve(daemons, sock_dir, "--auth-key-file", str(key), size="1Mi")
