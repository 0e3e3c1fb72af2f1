"""``maru-pool events``: a tenant's pool events, republished over ZMQ exactly as vLLM publishes its own.

Everything is read back with vLLM's own decoder (``msgspec`` with ``vllm.distributed.kv_events.KVEventBatch``),
from a real daemon that real clients write to: the format is right when vLLM (and so llm-d and Dynamo, which
read vLLM's) can read it, not when it matches a copy of it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from maru_pool.client import PoolClient
from maru_pool.events import MEDIUM
from maru_pool.kv_events_wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, encode
from maru_pool.link import TenantLink
from maru_pool.protocol import pack_tokens
from maru_pool.publisher import Publisher, Translator
from tests.support.events import (
    BLOCK,
    commit_prompt,
    decoded,
    first_seen,
    kv_events,
    prompt,
    prompt_tokens,
    run_events,
    shape,
    start,
)
from tests.support.pool import START_TIMEOUT_S, Daemon, connector_env, token_file, write_key


@pytest.fixture
def tenant(sock_dir: Path) -> tuple[Path, str]:
    key = write_key(sock_dir / "pool.key")
    return key, token_file(sock_dir / "a.token", key, "ns-a/qwen")


def test_the_wire_format_is_vllms_byte_for_byte() -> None:
    ours = KVEventBatch(
        ts=12.5,
        events=[
            BlockStored([b"\x01" * 16, 7], None, [], BLOCK, None, MEDIUM, None),
            BlockStored([b"\x02" * 16], b"\x01" * 16, [1, 2], BLOCK, None, MEDIUM, None),
            BlockRemoved([b"\x01" * 16], MEDIUM),
            AllBlocksCleared(),
        ],
    )
    theirs = kv_events.KVEventBatch(
        ts=12.5,
        events=[
            kv_events.BlockStored(
                block_hashes=[b"\x01" * 16, 7], parent_block_hash=None, token_ids=[], block_size=BLOCK,
                lora_id=None, medium=MEDIUM, lora_name=None,
            ),
            kv_events.BlockStored(
                block_hashes=[b"\x02" * 16], parent_block_hash=b"\x01" * 16, token_ids=[1, 2], block_size=BLOCK,
                lora_id=None, medium=MEDIUM, lora_name=None,
            ),
            kv_events.BlockRemoved(block_hashes=[b"\x01" * 16], medium=MEDIUM),
            kv_events.AllBlocksCleared(),
        ],
    )  # fmt: skip
    assert encode(ours) == msgspec.msgpack.encode(theirs)


def test_int_hashes_are_vllms_int_block_hashes(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    key = bytes(range(16))
    (stored,) = Translator(BLOCK, int_hashes=True).translate([["stored", [key.hex()], None]], resync=False)
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [maybe_convert_block_hash(key)]


def test_publisher_turns_commits_evictions_flushes_and_restarts_into_vllm_events(
    daemons: list[Daemon], sock_dir: Path, tenant: tuple[Path, str]
) -> None:
    key, token = tenant
    d = start(daemons, sock_dir, key)
    url = d.ready["listen"]
    sent: list[tuple[bytes, bytes, bytes]] = []
    link = TenantLink(url, token_file=token)
    publisher = Publisher(link, sent.append, Translator(BLOCK), topic="kv@maru@qwen")

    def step() -> list[tuple[Any, ...]]:
        before = len(sent)
        assert publisher.step(wait_ms=10_000)
        (message,) = sent[before:]
        topic, seq, events = decoded(message)
        assert (topic, seq) == ("kv@maru@qwen", len(sent) - 1)
        return shape(events)

    first, second = prompt(1, 2), prompt(2, 3)
    with PoolClient(url, timeout_s=10, token_file=token) as client:
        # A fresh publisher first tells consumers to forget what an earlier one announced.
        assert step() == [("cleared",)]
        commit_prompt(client, first)
        assert step() == [("stored", first, None, BLOCK, [], MEDIUM)]
        client.lookup_prefix(first)
        # The tenant's byte quota (three quarters of the pool: three chunks) makes room from its own chunks,
        # the least recently used prompt's tail first, as each lease is granted, before the commit.
        commit_prompt(client, second)
        got = step()
        while got[-1][0] != "stored":
            got += step()
        assert got == [
            ("removed", [first[1]], MEDIUM),
            ("removed", [first[0]], MEDIUM),
            ("stored", second, None, BLOCK, [], MEDIUM),
        ]
        # A flush: explicit removals of everything announced (some consumers ignore AllBlocksCleared), then it.
        with TenantLink(url, token_file=token) as other:
            assert other.call({"op": "flush"})["chunks"] == 3
        assert step() == [("removed", sorted(second), MEDIUM), ("cleared",)]
        commit_prompt(client, first)
        assert step() == [("stored", first, None, BLOCK, [], MEDIUM)]
    # A restarted daemon holds nothing: what was announced is removed, then cleared.
    d.stop()
    start(daemons, sock_dir, key)
    assert step() == [("removed", sorted(first), MEDIUM), ("cleared",)]
    link.close()


def test_stored_events_carry_the_prompt_tokens_of_their_chunks_as_vllm_does(
    daemons: list[Daemon], sock_dir: Path, tenant: tuple[Path, str]
) -> None:
    key, token = tenant
    d = start(daemons, sock_dir, key)
    url = d.ready["listen"]
    sent: list[tuple[bytes, bytes, bytes]] = []

    def publish(publisher: Publisher) -> list[tuple[Any, ...]]:
        """One step, read back with vLLM's decoder."""
        before = len(sent)
        assert publisher.step(wait_ms=10_000)
        return [e for message in sent[before:] for e in shape(decoded(message)[2])]

    tokenized, bare = prompt(1, 2), prompt(2, 1)
    with PoolClient(url, timeout_s=10, token_file=token) as client, TenantLink(url, token_file=token) as link:
        live = Publisher(link, sent.append, Translator(BLOCK), tokens=True)
        assert publish(live) == [("cleared",)]
        commit_prompt(client, tokenized, prompt_tokens(1, 2))
        # vLLM's own BlockStored carries the tokens of its blocks, concatenated in block order: so does ours.
        assert publish(live) == [("stored", tokenized, None, BLOCK, prompt_tokens(1, 2), MEDIUM)]
        commit_prompt(client, bare)  # an older connector: no tokens, an event without them, as before
        assert publish(live) == [("stored", bare, None, BLOCK, [], MEDIUM)]
        # A publisher that starts now resyncs: the tokens come from the stored events still in the daemon's log.
        with TenantLink(url, token_file=token) as link2:
            fresh = publish(Publisher(link2, sent.append, Translator(BLOCK), tokens=True))
        assert fresh[0] == ("cleared",)
        assert sorted(fresh[1:]) == sorted(
            [("stored", tokenized, None, BLOCK, prompt_tokens(1, 2), MEDIUM), ("stored", bare, None, BLOCK, [], MEDIUM)]
        )
        # A --block-size that is not the chunks' size would make consumers split the tokens wrong: none are sent.
        with TenantLink(url, token_file=token) as link3:
            wrong = publish(Publisher(link3, sent.append, Translator(BLOCK // 2), tokens=True))
        assert all(e[4] == [] for e in wrong if e[0] == "stored") and len(wrong) == 3
        # Not asked for (the default): the daemon sends none, and none are published.
        with TenantLink(url, token_file=token) as link4:
            default = publish(Publisher(link4, sent.append, Translator(BLOCK)))
        assert sorted(default[1:]) == sorted(
            [("stored", tokenized, None, BLOCK, [], MEDIUM), ("stored", bare, None, BLOCK, [], MEDIUM)]
        )


def test_a_chain_is_published_with_tokens_only_when_every_chunk_has_them() -> None:
    translator = Translator(4)
    one, two = pack_tokens([1, 2, 3, 4]), pack_tokens([5, 6, 7, 8])
    assert one is not None and two is not None
    keys = [(b"\x01" * 16).hex(), (b"\x02" * 16).hex()]
    events = [
        ["stored", keys, None, [one.hex(), two.hex()]],
        ["stored", keys, None, [one.hex(), None]],
        ["stored", keys, None, None],
        ["stored", keys, None],  # a daemon that predates tokens
    ]
    out = translator.translate(events, resync=False)
    assert [e.token_ids for e in out if isinstance(e, BlockStored)] == [[1, 2, 3, 4, 5, 6, 7, 8], [], [], []]


@pytest.fixture
def events_process(daemons: list[Daemon], sock_dir: Path, tenant: tuple[Path, str]) -> Iterator[tuple[str, str, str]]:
    """Pool url, publish and replay endpoints of a ``maru-pool events`` with its default flags."""
    with run_events(daemons, sock_dir, tenant) as (url, fields, _):
        yield url, fields["publish"], fields["replay"]


@pytest.mark.parametrize("token_ids", [False, True], ids=["default", "token-ids"])
def test_maru_pool_events_publishes_over_zmq(
    daemons: list[Daemon], sock_dir: Path, tenant: tuple[Path, str], token_ids: bool
) -> None:
    """The prompt's tokens are the tenant's prompt: a subscriber gets them only where the publisher was asked to
    publish them (``--token-ids``); by default BlockStored carries none, as vLLM allows."""
    _, token = tenant
    with run_events(daemons, sock_dir, tenant, *(["--token-ids"] if token_ids else [])) as (url, fields, _):
        assert fields["token_ids"] == ("on" if token_ids else "off")
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        sub.connect(fields["publish"])
        try:
            with PoolClient(url, timeout_s=10, token_file=token) as client:
                probe = first_seen(sub, client)
                with TenantLink(url, token_file=token) as link:
                    link.call({"op": "flush"})
                commit_prompt(client, prompt(7, 2), prompt_tokens(7, 2))
                got: list[tuple[Any, ...]] = []
                while len(got) < 3:
                    assert sub.poll(START_TIMEOUT_S * 1000), f"no more events after {got}"
                    topic, seq, events = decoded(tuple(sub.recv_multipart()))  # type: ignore[arg-type]
                    assert topic == "kv@maru@qwen" and seq > 0
                    got += shape(events)
            probes = sorted(key for p in range(1, probe + 1) for key in prompt(100 + p, 1))
            assert got == [
                ("removed", probes, MEDIUM),
                ("cleared",),
                ("stored", prompt(7, 2), None, BLOCK, prompt_tokens(7, 2) if token_ids else [], MEDIUM),
            ]
        finally:
            sub.close(linger=0)


def test_bad_flags_exit_2_naming_the_flag(tenant: tuple[Path, str]) -> None:
    _, token = tenant
    for args, flag in (
        (["--pool", "http://x", "--block-size", "16"], "--pool"),
        (["--pool", "unix:///nonexistent.sock", "--block-size", "16", "--publish", "bogus://x"], "--publish"),
        (["--pool", "unix:///nonexistent.sock", "--block-size", "0"], "--block-size"),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "maru_pool", "events", "--token-file", token, *args],
            capture_output=True, text=True, env=connector_env(), timeout=START_TIMEOUT_S,
        )  # fmt: skip
        assert result.returncode == 2, (args, result.stderr)
        assert flag in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_the_pool_daemon_runs_without_zmq() -> None:
    """The daemons import nothing of the publisher: the pool image needs ZMQ only for ``events``."""
    code = "import sys, maru_pool.cli; sys.exit('zmq' in sys.modules or 'msgspec' in sys.modules)"
    env = {**connector_env(), "PYTHONDONTWRITEBYTECODE": "1"}
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=START_TIMEOUT_S).returncode == 0


def replay_from(endpoint: str, start: int) -> list[tuple[str, int, list[Any]]]:
    """Ask the replay socket as a vLLM subscriber does; the batches it sends back, up to its end marker."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while True:
            assert dealer.poll(START_TIMEOUT_S * 1000), "the replay socket did not answer"
            empty, topic, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert (topic, payload) == (b"", b"")
                return out
            out.append(decoded((topic, seq, payload)))
    finally:
        dealer.close(linger=0)


def test_missed_batches_are_replayed_as_vllm_replays_them(
    events_process: tuple[str, str, str], tenant: tuple[Path, str]
) -> None:
    url, _, replay = events_process
    _, token = tenant
    # The publisher's first batch (AllBlocksCleared) goes out before the prompt is stored, or both share it.
    deadline = time.monotonic() + START_TIMEOUT_S
    while not replay_from(replay, 0):
        assert time.monotonic() < deadline, "the publisher never published its first batch"
        time.sleep(0.2)
    with PoolClient(url, timeout_s=10, token_file=token) as client:
        commit_prompt(client, prompt(9, 2))
    deadline = time.monotonic() + START_TIMEOUT_S
    while len(batches := replay_from(replay, 0)) < 2:
        assert time.monotonic() < deadline, f"the stored prompt was never published: {batches}"
        time.sleep(0.2)
    assert [(topic, seq, shape(events)) for topic, seq, events in batches] == [
        ("kv@maru@qwen", 0, [("cleared",)]),
        ("kv@maru@qwen", 1, [("stored", prompt(9, 2), None, BLOCK, [], MEDIUM)]),
    ]
    assert [seq for _, seq, _ in replay_from(replay, 1)] == [1]
