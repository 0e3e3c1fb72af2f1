"""maru-router while a rollout stops engines under it: a request whose engine went away without answering is
served elsewhere, never answered 502.

In front of vllm-router, maru-router sends some requests to the pods vllm-router found (it reads ``GET /workers``
every few seconds): a pod deleted since the last look may be stopping when the request reaches it. Its server
then closes the connection, or resets it, before any answer. Nothing reached the client yet and a completion
changes nothing but an engine's cache, so the request is run again through vllm-router, whose discovery saw the
pod go. Here a fake upstream lists a fake engine that does exactly that; loopback only.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.support.servers import free_port, http
from tests.vllm.harness import PoolDaemon, env

from .harness import RecordingEngine, RouterProcess

pytest.importorskip("vllm", reason="maru-router keys prompts with vLLM's hashing (pip install -e '.[vllm]')")

ANSWER = {"choices": [{"index": 0, "text": " up", "finish_reason": "length"}]}


class StoppingEngine:
    """An engine whose server is going down: it reads each request whole, then closes the connection without an
    answer (``reset``: with a TCP reset, as a process killed mid-request)."""

    def __init__(self, *, reset: bool) -> None:
        self.reset = reset
        self.requests = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            with conn:
                head = b""
                while b"\r\n\r\n" not in head and (chunk := conn.recv(65536)):
                    head += chunk
                if b"\r\n\r\n" not in head:
                    continue
                header, body = head.split(b"\r\n\r\n", 1)
                length = next(
                    (
                        int(line.split(b":", 1)[1])
                        for line in header.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                while len(body) < length and (chunk := conn.recv(65536)):
                    body += chunk
                if header.startswith(b"GET"):
                    continue  # the router asking where the engine publishes: no answer either
                self.requests += 1
                if self.reset:
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    def close(self) -> None:
        self.sock.close()


class Upstream:
    """vllm-router as maru-router sees it: ``GET /workers`` lists the engines given; it answers every completion."""

    def __init__(self, prefill: str, decode: str) -> None:
        self.completions = 0
        upstream = self
        workers = {
            "workers": [
                {"url": prefill, "worker_type": "prefill", "is_healthy": True},
                {"url": decode, "worker_type": "decode", "is_healthy": True},
            ]
        }

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                self._send(workers if self.path == "/workers" else {"object": "list", "data": []})

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                upstream.completions += 1
                self._send(ANSWER)

            def _send(self, answer: dict[str, Any]) -> None:
                data = json.dumps(answer).encode()
                self.send_response(200)
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


@pytest.fixture(params=["prefill resets", "decode closes"])
def rolling(request: pytest.FixtureRequest, pool: PoolDaemon, workdir: Path) -> Iterator[tuple[Any, ...]]:
    failing_role = request.param.split()[0]
    stopping = StoppingEngine(reset=request.param.endswith("resets"))
    serving = RecordingEngine("decode" if failing_role == "prefill" else "prefill")
    prefill, decode = (stopping, serving) if failing_role == "prefill" else (serving, stopping)
    upstream = Upstream(prefill.url, decode.url)
    router = None
    try:
        # The role URLs given are the Services; the pods come from the upstream's list, as the operator runs it.
        router = RouterProcess(
            f"rollout-{failing_role}", workdir, prefill="http://127.0.0.1:9", decode="http://127.0.0.1:9",
            pool_url=pool.url, upstream=upstream.url, follow_upstream_workers="0.5",
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while f'maru_router_in_flight_requests{{endpoint="{decode.url}",role="decode"}}' not in router.metrics():
            assert time.monotonic() < deadline, f"the router never took the upstream's workers: {router.metrics()}"
            time.sleep(0.2)
        yield router, stopping, upstream
    finally:
        if router is not None:
            router.close()
        upstream.close()
        stopping.close()
        serving.close()


def post(url: str, body: dict[str, Any]) -> tuple[int, str]:
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_a_request_whose_engine_stops_without_answering_is_served_by_the_upstream(rolling: tuple[Any, ...]) -> None:
    router, stopping, upstream = rolling
    # The first request learns the key scheme through prefill then decode here, on the pods listed.
    status, answer = post(router.url, {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1})
    assert stopping.requests == 1, "the request should have reached the stopping engine first"
    assert (status, json.loads(answer)) == (200, ANSWER), answer
    assert upstream.completions == 1
    assert "unreachable" in router.log_path.read_text()
    assert json.loads(http(router.url + "/health")) == {"status": "ok"}


def test_a_router_stopped_while_it_starts_exits_as_its_containers_pid_1(pool: PoolDaemon, workdir: Path) -> None:
    # A pod deleted while maru-router imports vLLM (a rollout's surge pod): its SIGTERM comes from outside the
    # container's PID namespace, and a PID 1 gets only the signals it handles. It was lost; the pod stayed
    # Terminating until SIGKILL at the end of its grace period.
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        pytest.skip("a PID namespace of its own needs unshare and root")
    log_path = workdir / "router-pid1.log"
    connector = {"maru_pool_url": pool.url, "maru_kv_chunk_tokens": 256}
    argv = [
        unshare, "--pid", "--fork", "--kill-child", sys.executable, "-m", "maru_router", "--host", "127.0.0.1",
        "--port", str(free_port()), "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9",
        "--connector-config", json.dumps(connector),
    ]  # fmt: skip
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env())
    try:
        deadline = time.monotonic() + 120
        while "starting" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
        (router,) = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        os.kill(int(router), signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM, log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
