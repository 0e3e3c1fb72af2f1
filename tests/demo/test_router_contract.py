"""What the product relies on from vllm-router in P/D mode, checked against two fake vLLM servers.

No vLLM here: two small HTTP servers record what the router sends them (given as static workers: the
local cluster's end-to-end tests cover its Kubernetes discovery). The router must send the prefill
request first with ``max_tokens: 1`` and ``do_remote_decode``,
then the original request to decode with the prefill's ``kv_transfer_params`` passed through
unchanged, and keep token-id prompts and ``return_token_ids`` intact (the demo's exact lengths and
output comparisons depend on both).
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.support.servers import PREFILL_PARAMS, FakeEngine


def is_up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def _router(tmp_path: Path, prefills: int) -> Iterator[tuple[Any, ...]]:
    beside = Path(sys.executable).parent / "vllm-router"
    binary = str(beside) if beside.is_file() else shutil.which("vllm-router")
    if binary is None:
        pytest.fail("vllm-router is not installed (it is a dev dependency: pip install -e '.[dev]')")
    prefill = [FakeEngine("prefill") for _ in range(prefills)]
    decode = FakeEngine("decode")
    port = _free_port()
    argv = [
        binary,
        "--vllm-pd-disaggregation",
        *(a for e in prefill for a in ("--prefill", e.url)),
        "--decode",
        decode.url,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(_free_port()),
        "--policy",
        "round_robin",
        "--worker-startup-check-interval",
        "1",
    ]
    with open(tmp_path / "router.log", "wb") as log:
        router = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while not is_up(url + "/health"):
            assert router.poll() is None, (tmp_path / "router.log").read_text()
            assert time.monotonic() < deadline, "the router did not come up"
            time.sleep(0.2)
        yield url, router, prefill, decode
    finally:
        if router.poll() is None:
            router.send_signal(signal.SIGTERM)
            try:
                router.wait(timeout=15)
            except subprocess.TimeoutExpired:
                router.kill()
                router.wait()
        for engine in (*prefill, decode):
            engine.close()


@pytest.fixture
def routed(tmp_path: Path) -> Iterator[tuple[Any, ...]]:
    with _router(tmp_path, prefills=1) as (url, router, (prefill,), decode):
        yield url, router, prefill, decode


def test_router_sends_prefill_then_decode_with_the_prefill_params(
    routed: tuple[Any, ...], demo_run_module: ModuleType
) -> None:
    url, _, prefill, decode = routed
    prompt = demo_run_module.prompt_ids(300, seed=5)
    body = demo_run_module.request_body(prompt)

    answer = demo_run_module.stream_completion(url, body, timeout_s=60)

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


def test_router_stops_on_sigterm(routed: tuple[Any, ...]) -> None:
    # It is PID 1 of its container in a cluster: it must act on SIGTERM, not wait for SIGKILL.
    _, router, _, _ = routed
    router.send_signal(signal.SIGTERM)
    assert router.wait(timeout=15) is not None


def test_router_takes_turns_between_prefill_workers(tmp_path: Path, demo_run_module: ModuleType) -> None:
    """The demo's fleet hit relies on it: with two prefill replicas, round robin sends a prompt's repeat
    to the replica that did not compute it (while decode, the only one, gets every request)."""
    with _router(tmp_path, prefills=2) as (url, _, prefill, decode):
        served = []
        for k in range(6):
            before = [len(e.requests) for e in prefill]
            body = demo_run_module.request_body(demo_run_module.prompt_ids(300, seed=k // 2))
            demo_run_module.stream_completion(url, body, timeout_s=60)
            (which,) = [i for i, e in enumerate(prefill) if len(e.requests) > before[i]]
            served.append(which)
        assert served[0::2] == [served[0]] * 3 and served[1::2] == [1 - served[0]] * 3, served
        assert len(decode.requests) == 6
