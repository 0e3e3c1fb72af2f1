"""Real ``vllm serve`` processes and the HTTP the tests speak to them, and a stand-in engine for the router
contract (it answers as a vLLM engine does, with a recorded request log)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from maru_contracts.config import MaruConnectorConfig, kv_transfer_config_json
from tests.support.pool import free_port
from tests.support.processes import stop_process
from tests.vllm.harness import env

START_TIMEOUT_S = 300.0


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
                time.sleep(0.2)  # a refused connection costs nothing; a start is seen a moment after it ends
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
        stop_process(self.proc, grace_s=60)


PREFILL_PARAMS = {"maru": "opaque-from-prefill", "n": 3}


class FakeEngine:
    def __init__(self, role: str) -> None:
        self.role = role
        self.requests: list[dict[str, Any]] = []
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                self._send(200, b"{}", "application/json")

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                engine.requests.append(body)
                if body.get("stream"):
                    events = [{"choices": [{"index": 0, "text": " t9", "token_ids": [9]}]}]
                    data = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
                    self._send(200, data + b"data: [DONE]\n\n", "text/event-stream")
                    return
                answer = {
                    "id": "x",
                    "object": "text_completion",
                    "choices": [{"index": 0, "text": " t9", "finish_reason": "length"}],
                    "kv_transfer_params": PREFILL_PARAMS if engine.role == "prefill" else None,
                }
                self._send(200, json.dumps(answer).encode(), "application/json")

            def _send(self, status: int, data: bytes, ctype: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
