"""A stopping router pod cuts no request: the preStop hook the operator renders for both of its containers
(``python -m maru_common.drain`` on maru-router's in-progress gauge) waits while maru-router still serves a
request, and ends once it has answered."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from maru_contracts.router import IN_PROGRESS_METRIC
from maru_operator.builders.group import DIRECT_METRICS_PORT, build_router_deployment
from tests.router.harness import SCHEME, RouterProcess
from tests.support.specs import GROUP_OWNER, group_spec, pool_view
from tests.vllm.harness import PoolDaemon, env

REPO = Path(__file__).resolve().parents[2]


class HeldEngine:
    """A fake vLLM server; while ``hold`` is set its completions wait until it is cleared."""

    def __init__(self, role: str) -> None:
        self.hold = threading.Event()
        self.released = threading.Event()
        self.arrived = threading.Event()
        engine = self
        handoff = {"maru_key_scheme": SCHEME.to_params()} if role == "prefill" else None

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                self._send({"object": "list", "data": []})

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                if engine.hold.is_set():
                    engine.arrived.set()
                    engine.released.wait(120)
                self._send({"choices": [{"index": 0, "text": " t9", "finish_reason": "length"}],
                            "kv_transfer_params": handoff})  # fmt: skip

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
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def routed(pool: PoolDaemon, workdir: Path) -> Iterator[tuple[RouterProcess, HeldEngine]]:
    prefill, decode = HeldEngine("prefill"), HeldEngine("decode")
    router = RouterProcess("drain", workdir, prefill=prefill.url, decode=decode.url, pool_url=pool.url)
    try:
        yield router, decode
    finally:
        router.close()
        prefill.close()
        decode.close()


def _post(url: str, answers: list[int]) -> None:
    import urllib.request

    request = urllib.request.Request(
        f"{url}/v1/completions",
        headers={"content-type": "application/json"},
        data=json.dumps({"model": "m", "prompt": [1, 2, 3], "max_tokens": 1}).encode(),
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        answers.append(answer.status)


def rendered_hook() -> list[str]:
    """The preStop command the operator renders for maru-router, for a group with the default termination."""
    spec = group_spec()
    deployment = build_router_deployment(spec, GROUP_OWNER, pool_view())
    assert deployment is not None
    containers = deployment["spec"]["template"]["spec"]["containers"]
    hooks = [c["lifecycle"]["preStop"]["exec"]["command"] for c in containers]
    assert len(hooks) == 2 and hooks[0] == hooks[1], hooks  # maru-router and vllm-router wait for the same
    assert (
        deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        == spec.router.termination.grace_period_seconds
    )
    return hooks[0]


def test_the_rendered_hook_waits_for_maru_routers_requests_then_ends(
    routed: tuple[RouterProcess, HeldEngine],
) -> None:
    router, decode = routed
    hook = rendered_hook()
    assert hook[hook.index("--port") + 1] == str(DIRECT_METRICS_PORT)
    # Run as rendered, against this router's port (the test router serves its metrics there).
    hook[hook.index("--port") + 1] = str(router.port)
    hook[hook.index("--timeout") + 1] = "60"
    decode.hold.set()
    answers: list[int] = []
    client = threading.Thread(target=_post, args=(router.url, answers))
    client.start()
    assert decode.arrived.wait(60), "the request never reached decode"
    drain = subprocess.Popen(
        [sys.executable if hook[0] == "python3" else hook[0], *hook[1:]],
        env=env(),
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(3)  # three looks of the hook at one request in progress
    assert drain.poll() is None, drain.stderr.read() if drain.stderr else ""
    assert router.metrics()[IN_PROGRESS_METRIC] == 1
    decode.released.set()
    client.join(60)
    assert answers == [200]
    assert drain.wait(30) == 0
    assert "drained" in (drain.stderr.read() if drain.stderr else "")
    assert router.metrics()[IN_PROGRESS_METRIC] == 0
