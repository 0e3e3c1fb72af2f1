"""The router as it runs in production: ``python -m maru_router`` in its own process."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from maru_contracts.keys import KeyScheme
from tests.support.processes import stop_process
from tests.support.servers import Server, free_port, http
from tests.vllm.harness import env

START_TIMEOUT_S = 300.0
# Eight TP ranks and one block a chunk: a long prompt makes many keys (a lookup over the pool's frame), a short
# one a few.
SCHEME = KeyScheme(tuple(bytes([i]) * 32 for i in range(1, 9)), hash_block_size=16, chunk_tokens=16,
                   hash_algo="sha256")  # fmt: skip


def reset_prefix_cache(engine: Server) -> None:
    """Empty an engine's own prefix cache (not the pool); vLLM refuses while a request or a save holds blocks.
    The engine must run in vLLM's dev mode (``VLLM_SERVER_DEV_MODE=1``), which serves the endpoint."""
    deadline = time.monotonic() + 60
    while not json.loads(http(f"{engine.url}/reset_prefix_cache", {}))["success"]:
        assert time.monotonic() < deadline, f"{engine.url} kept its prefix cache held"
        time.sleep(0.2)


class RouterProcess:
    def __init__(
        self, name: str, workdir: Path, *, prefill: str | list[str], decode: str, pool_url: str,
        **flags: str | list[str],
    ) -> None:  # fmt: skip
        """``prefill`` and any flag's value: one, or a list to repeat the flag with (empty: the flag alone)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"router-{name}.log"
        connector = {"maru_pool_url": pool_url, "maru_kv_chunk_tokens": 256, "maru_rpc_timeout_ms": 2000}
        args = [
            sys.executable, "-m", "maru_router", "--host", "127.0.0.1", "--port", str(self.port),
            "--decode", decode, "--connector-config", json.dumps(connector),
        ]  # fmt: skip
        for flag, value in {"prefill": prefill, **flags}.items():
            if not value:  # an empty list: a flag without a value
                args.append(f"--{flag.replace('_', '-')}")
            for one in [value] if isinstance(value, str) else value:
                args += [f"--{flag.replace('_', '-')}", one]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env())
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise AssertionError(f"router did not start:\n{self.log_path.read_text()[-3000:]}")
            try:
                http(f"{self.url}/health", timeout=2)
                return
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        return json.loads(http(f"{self.url}/v1/completions", body))

    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        return json.loads(http(f"{self.url}/v1/chat/completions", body))

    def stream(self, body: dict[str, Any], path: str = "/v1/completions") -> list[dict[str, Any]]:
        """The server-sent events of a streamed completion (or chat), parsed."""
        req = urllib.request.Request(
            f"{self.url}{path}",
            data=json.dumps({**body, "stream": True}).encode(),
            headers={"content-type": "application/json"},
        )
        events = []
        with urllib.request.urlopen(req, timeout=120) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[len("data: ") :]))
        return events

    def metrics(self) -> dict[str, float]:
        """``name{labels}`` -> value of every sample the router exposes."""
        samples = {}
        for line in http(f"{self.url}/metrics").splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        return samples

    def routed(self, route: str, reason: str) -> float:
        return self.metrics().get(f'maru_router_requests_total{{reason="{reason}",route="{route}"}}', 0.0)

    def direct_to(self, role: str) -> float:
        """Requests served by one engine alone, of ``role``."""
        return self.metrics().get(f'maru_router_direct_targets_total{{role="{role}"}}', 0.0)

    def engine_requests(self, role: str, url: str) -> float:
        return self.metrics().get(f'maru_router_engine_requests_total{{endpoint="{url}",role="{role}"}}', 0.0)

    def in_flight(self, role: str, url: str) -> float:
        return self.metrics()[f'maru_router_in_flight_requests{{endpoint="{url}",role="{role}"}}']

    def close(self) -> None:
        stop_process(self.proc, grace_s=30)


class VllmRouterProcess:
    """vllm-router over static workers, round robin: in P/D mode (``prefill`` and ``decode``), the upstream the
    operator puts behind maru-router; over plain ``workers``, how two replicas are usually run without us."""

    def __init__(
        self, workdir: Path, *, prefill: str = "", decode: str | tuple[str, ...] = "", workers: tuple[str, ...] = (),
        name: str = "vllm-router",
    ) -> None:  # fmt: skip
        beside = Path(sys.executable).parent / "vllm-router"
        binary = str(beside) if beside.is_file() else shutil.which("vllm-router")
        assert binary is not None, "vllm-router is not installed (a dev dependency: pip install -e '.[dev]')"
        assert bool(workers) != bool(prefill and decode), "either prefill and decode, or workers"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"{name}.log"
        decodes = (decode,) if isinstance(decode, str) else decode
        mode = (
            ["--worker-urls", *workers]
            if workers
            else ["--vllm-pd-disaggregation", "--prefill", prefill, *(a for d in decodes for a in ("--decode", d))]
        )
        argv = [binary, *mode, "--host", "127.0.0.1", "--port", str(self.port), "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(free_port()), "--policy", "round_robin",
                "--worker-startup-check-interval", "1"]  # fmt: skip
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise AssertionError(f"vllm-router did not start:\n{self.log_path.read_text()[-3000:]}")
            try:
                http(f"{self.url}/health", timeout=2)
                return
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)

    def close(self) -> None:
        stop_process(self.proc, grace_s=30)


class RecordingEngine:
    """A fake vLLM server that records every request; the prefill one hands off with :data:`SCHEME`, so a router
    in front keys prompts and asks the pool; ``record`` False keeps no request (a benchmark's huge prompts)."""

    def __init__(self, role: str, *, record: bool = True) -> None:
        self.requests: list[tuple[str, dict[str, Any]]] = []
        engine = self
        handoff = {"maru_key_scheme": SCHEME.to_params()} if role == "prefill" else None

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                self._send(200, {"object": "list", "data": []})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if record:
                    engine.requests.append((self.path, body))
                self._send(200, {"choices": [{"index": 0, "text": " t9", "finish_reason": "length"}],
                                 "kv_transfer_params": handoff})  # fmt: skip

            def _send(self, status: int, answer: dict[str, Any]) -> None:
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
