"""What the demo relies on from vllm-router in P/D mode, checked against two fake vLLM servers.

No vLLM here: two small HTTP servers record what the router sends them. With the demo's own flags,
the router must send the prefill request first with ``max_tokens: 1`` and ``do_remote_decode``,
then the original request to decode with the prefill's ``kv_transfer_params`` passed through
unchanged, and keep token-id prompts and ``return_token_ids`` intact (the demo's exact lengths and
output comparisons depend on both).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

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
                answer = {"id": "x", "object": "text_completion",
                          "choices": [{"index": 0, "text": " t9", "finish_reason": "length"}],
                          "kv_transfer_params": PREFILL_PARAMS if engine.role == "prefill" else None}
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


@pytest.fixture
def routed(tmp_path: Path, demo_run_module: ModuleType, demo_procs: ModuleType) -> Iterator[tuple[Any, ...]]:
    if demo_run_module.router_binary() is None:
        pytest.fail("vllm-router is not installed (it is a dev dependency: pip install -e '.[dev]')")
    prefill, decode = FakeEngine("prefill"), FakeEngine("decode")
    sup = demo_procs.Supervisor(tmp_path, "t-router")
    d = demo_run_module.Demo(args=None, workdir=tmp_path, run_id="t-router", sup=sup,
                             progress=demo_run_module.Progress(1))
    d.prefill_url, d.decode_url = prefill.url, decode.url
    try:
        demo_run_module.start_router(d)
        yield d, prefill, decode
    finally:
        sup.stop_all()
        prefill.close()
        decode.close()


def test_router_sends_prefill_then_decode_with_the_prefill_params(routed: tuple[Any, ...],
                                                                  demo_run_module: ModuleType) -> None:
    d, prefill, decode = routed
    prompt = demo_run_module.prompt_ids(300, seed=5)
    body = demo_run_module.request_body(prompt)

    answer = demo_run_module.stream_completion(d.router_url, body, timeout_s=60)

    assert answer.text == " t9" and answer.token_ids == [9]
    (p,) = prefill.requests
    (dreq,) = decode.requests
    assert p["max_tokens"] == 1
    assert p["stream"] is False
    assert p["kv_transfer_params"]["do_remote_decode"] is True
    assert p["prompt"] == prompt
    assert dreq["prompt"] == prompt
    assert dreq["max_tokens"] == body["max_tokens"]
    assert dreq["stream"] is True
    assert dreq["return_token_ids"] is True and dreq["ignore_eos"] is True
    assert dreq["kv_transfer_params"] == PREFILL_PARAMS


def test_router_flags_leave_no_process(routed: tuple[Any, ...], demo_procs: ModuleType) -> None:
    d, _, _ = routed
    assert d.router is not None and d.router.alive()
    d.sup.stop_all()
    assert demo_procs.pids_with_run_id("t-router") == []
