"""maru-router against hostile clients: each attack that once worked, now refused or bounded.

The router runs as its own process over a real pool daemon, with fake engines that record what reaches them
(the prefill one announces a key scheme, so the router keys prompts and asks the pool), and in front of a
real vllm-router as the operator renders it. Loopback only; every wait is bounded by a count, not a clock.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.servers import free_port, http
from tests.vllm.harness import PoolDaemon, env

from .harness import SCHEME, RecordingEngine, RouterProcess, VllmRouterProcess

pytest.importorskip("vllm", reason="maru-router keys prompts with vLLM's hashing (pip install -e '.[vllm]')")

HASH_SEED = "0"  # the engines' and the router's PYTHONHASHSEED (vLLM seeds its block hashes with it)
# Short deadlines, so the tests that wait for them end soon; the defaults are 15 s and 60 s.
LIMITS = {"header_timeout": "2", "body_timeout": "2"}
MiB = 1 << 20


class Fleet:
    def __init__(
        self, router: RouterProcess, metrics_port: int, prefill: RecordingEngine, decode: RecordingEngine
    ) -> None:
        self.router, self.metrics_port, self.prefill, self.decode = router, metrics_port, prefill, decode

    def metric(self, name: str) -> float:
        for line in http(f"http://127.0.0.1:{self.metrics_port}/metrics").splitlines():
            if line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def rss_mib(self) -> float:
        status = Path(f"/proc/{self.router.proc.pid}/status").read_text()
        return int(next(x for x in status.splitlines() if x.startswith("VmRSS:")).split()[1]) / 1024


@pytest.fixture(scope="module")
def hash_seed() -> Iterator[None]:
    before = os.environ.get("PYTHONHASHSEED")
    os.environ["PYTHONHASHSEED"] = HASH_SEED  # for the routers this module starts (they take os.environ)
    yield
    if before is None:
        os.environ.pop("PYTHONHASHSEED")
    else:
        os.environ["PYTHONHASHSEED"] = before


@pytest.fixture(scope="module")
def fleet(pool: PoolDaemon, workdir: Path, hash_seed: None) -> Iterator[Fleet]:
    prefill, decode = RecordingEngine("prefill"), RecordingEngine("decode")
    metrics_port = free_port()
    router = RouterProcess("hostile", workdir, prefill=prefill.url, decode=decode.url, pool_url=pool.url,
                           metrics_port=str(metrics_port), **LIMITS)  # fmt: skip
    try:
        # The first request goes through prefill, whose handoff teaches the router the key scheme.
        post(router.url, {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1})
        yield Fleet(router, metrics_port, prefill, decode)
    finally:
        router.close()
        prefill.close()
        decode.close()


def post(url: str, body: object, path: str = "/v1/completions") -> tuple[int, str]:
    return send(url + path, json.dumps(body).encode())


def send(url: str, data: bytes | None, method: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def message(answer: str) -> str:
    return str(json.loads(answer)["error"]["message"])


def store(pool: PoolDaemon, ids: list[int]) -> None:
    """Put every full chunk of the prompt ``ids`` in the pool, under the keys an engine of SCHEME would use."""
    code = ("import json, sys\nfrom maru_contracts.keys import KeyScheme\n"
            "from maru_router.prompt_keys import chunk_lookup_keys\n"
            "ids, scheme = json.loads(sys.argv[1]), KeyScheme.from_params(json.loads(sys.argv[2]))\n"
            "print(' '.join(k.hex() for k in chunk_lookup_keys(ids, scheme)))")  # fmt: skip
    argv = [sys.executable, "-c", code, json.dumps(ids), json.dumps(SCHEME.to_params())]
    out = subprocess.run(argv, env={**env(), "PYTHONHASHSEED": HASH_SEED}, capture_output=True, text=True, check=True)
    from maru_pool import PoolClient

    client = PoolClient(pool.url)
    try:
        for key in out.stdout.split():
            client.put(bytes.fromhex(key), b"\0" * 64)
    finally:
        client.close()


def upload_all_but_one_byte(port: int, size: int) -> None:
    """A client that announces ``size`` bytes of body, sends all but the last, and goes away."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {size}\r\n\r\n".encode())  # fmt: skip
        piece = b"1" * MiB
        left = size - 1
        while left:
            left -= sock.send(piece[: min(left, MiB)])


def closed_by_router(sock: socket.socket, trickle: bytes, rounds: int = 300) -> bool:
    """Send ``trickle`` a byte at a time, one each 0.2 s (a slow client), until the router closes the
    connection (True) or ``rounds`` bytes went without it (False)."""
    sock.settimeout(0.2)
    for i in range(rounds):
        try:
            sock.send(trickle[i % len(trickle) : i % len(trickle) + 1])
            if sock.recv(4096) == b"":
                return True
        except TimeoutError:
            continue
        except OSError:
            return True
    return False


# ---------------------------------------------------------------------------------------------- the attacks


def test_metrics_are_only_on_the_metrics_port(fleet: Fleet) -> None:
    # The counters were an oracle on the API port (did anyone send this prompt?) and named the engines' pods.
    status, answer = send(fleet.router.url + "/metrics", None)
    assert status == 404
    assert fleet.decode.url not in answer and fleet.prefill.url not in answer
    assert fleet.metric("maru_router_coverage_lookups_total") >= 0
    assert "maru_router_requests_total" in http(f"http://127.0.0.1:{fleet.metrics_port}/metrics")


def test_client_kv_transfer_params_never_reach_decode_on_the_direct_route(fleet: Fleet, pool: PoolDaemon) -> None:
    ids = list(range(100, 100 + 4 * SCHEME.chunk_tokens))
    store(pool, ids)
    direct = fleet.metric('maru_router_requests_total{reason="covered",route="direct"}')
    fleet.decode.requests.clear()
    forged = {"do_remote_prefill": True, "remote_host": "198.51.100.7", "remote_port": 5600,
              "remote_block_ids": [1, 2, 3], "remote_engine_id": "attacker"}  # fmt: skip
    status, _ = post(fleet.router.url, {"model": "m", "prompt": ids, "max_tokens": 2, "kv_transfer_params": forged})
    assert status == 200
    assert fleet.metric('maru_router_requests_total{reason="covered",route="direct"}') - direct == 1
    ((path, body),) = fleet.decode.requests
    assert path == "/v1/completions" and body["prompt"] == ids
    assert "kv_transfer_params" not in body


def test_an_oversized_body_is_refused(fleet: Fleet) -> None:
    status, answer = send(fleet.router.url + "/v1/completions", b" " * (16 * MiB + 1))
    assert status == 413
    assert "--max-body-bytes 16777216" in message(answer)


def test_aborted_uploads_do_not_grow_the_router(fleet: Fleet) -> None:
    # Each upload stopped one byte short once stayed in the router (a reference cycle through the request's
    # stream) until the collector ran: RSS grew by the body's size per upload.
    size = 15 * MiB
    upload_all_but_one_byte(fleet.router.port, size)  # the allocator's first buffers for a body this size
    assert http(fleet.router.url + "/health")
    baseline = fleet.rss_mib()
    peak = baseline
    for _ in range(10):
        upload_all_but_one_byte(fleet.router.port, size)
        assert http(fleet.router.url + "/health")  # the router took the abort before the next upload
        peak = max(peak, fleet.rss_mib())
    assert peak - baseline < 2 * size / MiB, f"RSS {baseline:.0f} -> {peak:.0f} MiB over 10 aborted uploads"


def test_many_large_bodies_at_once_are_bounded_together(fleet: Fleet) -> None:
    # Each body within the limit, but together past the pod's memory (parsed, token ids take several times their
    # size): bodies in flight are bounded, 64 MiB by default, and the rest answered 503 until they are done.
    gauge = "maru_router_buffered_request_bytes"
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (15 * MiB))  # fmt: skip
    held: list[socket.socket] = []
    try:
        for i in range(1, 5):
            sock = socket.create_connection(("127.0.0.1", fleet.router.port))
            held.append(sock)
            sock.sendall(head + b" " * (14 * MiB))
            for _ in range(600):  # until the router read it all
                if fleet.metric(gauge) >= i * 14 * MiB:
                    break
                time.sleep(0.1)
            assert fleet.metric(gauge) == i * 14 * MiB
        with socket.create_connection(("127.0.0.1", fleet.router.port)) as sock:
            sock.sendall(head + b" " * (10 * MiB))
            sock.settimeout(60)
            answer = sock.recv(65536).decode()
        assert answer.startswith("HTTP/1.1 503"), answer[:200]
        assert "--max-buffered-bytes 67108864" in answer
        # What is left of the budget still serves ordinary requests.
        assert post(fleet.router.url, {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1})[0] == 200
    finally:
        for sock in held:
            sock.close()
    for _ in range(600):  # the aborted bodies are given back
        if fleet.metric(gauge) == 0:
            break
        time.sleep(0.1)
    assert fleet.metric(gauge) == 0
    assert post(fleet.router.url, {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1})[0] == 200


def test_clients_trickling_their_headers_are_cut_off(fleet: Fleet) -> None:
    # 600 such connections were once held for as long as their clients liked.
    socks = [socket.create_connection(("127.0.0.1", fleet.router.port)) for _ in range(50)]
    try:
        for sock in socks:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\n")
        assert all(closed_by_router(sock, b"X-Slow: " + b"a" * 64) for sock in socks)
    finally:
        for sock in socks:
            sock.close()
    assert http(fleet.router.url + "/health")


def test_a_client_trickling_its_body_gets_408(fleet: Fleet) -> None:
    with socket.create_connection(("127.0.0.1", fleet.router.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{")  # fmt: skip
        sock.settimeout(60)
        answer = sock.recv(65536).decode()
    assert answer.startswith("HTTP/1.1 408"), answer[:200]
    assert "--body-timeout" in answer


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"model": "m", "prompt": [' + b"7" * 5000 + b"]}", "an integer of more than 4300 digits"),
    ],
    ids=["100k-deep", "5000-digit-int"],
)
def test_pathological_json_answers_400(fleet: Fleet, data: bytes, why: str) -> None:
    status, answer = send(fleet.router.url + "/v1/completions", data)
    assert status == 400
    assert why in message(answer)


def test_a_token_prompt_over_the_limit_is_refused_by_name(fleet: Fleet) -> None:
    before = len(fleet.prefill.requests)
    status, answer = post(fleet.router.url, {"model": "m", "prompt": [7] * ((1 << 20) + 1), "max_tokens": 1})
    assert status == 400
    assert message(answer) == "prompt: 1048577 token ids, more than the router's --max-prompt-tokens 1048576"
    assert len(fleet.prefill.requests) == before


def test_a_lookup_longer_than_the_pool_frame_is_asked_in_batches(fleet: Fleet) -> None:
    # The longest prompt taken makes 524,288 keys here (18.4 MB of lookup), over the daemon's 16 MiB frame: sent
    # at once, the daemon refused it and the router's pool client backed off, every client's prompts then taking
    # the prefill path (pool_error).
    cold = fleet.metric('maru_router_requests_total{reason="cold",route="pd"}')
    errors = fleet.metric('maru_router_fallbacks_total{reason="pool_error"}')
    status, _ = post(fleet.router.url, {"model": "m", "prompt": [8] * (1 << 20), "max_tokens": 1})
    assert status == 200
    assert fleet.metric('maru_router_fallbacks_total{reason="pool_error"}') == errors
    assert fleet.metric('maru_router_requests_total{reason="cold",route="pd"}') - cold == 1


def test_a_failed_engine_is_not_named_to_the_client(pool: PoolDaemon, workdir: Path, hash_seed: None) -> None:
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    router = RouterProcess("gone", workdir, prefill=gone, decode=gone, pool_url=pool.url, **LIMITS)
    try:
        status, answer = post(router.url, {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1})
    finally:
        router.close()
    assert status == 502
    assert gone.split("//")[1] not in answer and "127.0.0.1" not in answer
    assert message(answer) == "prefill failed: ClientConnectorError"


ADMIN = [("POST", "/remove_worker?url={decode}"), ("DELETE", "/workers/{decode}"), ("POST", "/flush_cache"),
         ("GET", "/get_loads"), ("GET", "/workers"), ("GET", "/list_workers"), ("POST", "/add_worker?url={decode}"),
         ("GET", "/get_server_info"), ("POST", "/workers")]  # fmt: skip


def test_in_front_of_vllm_router_its_admin_api_is_never_passed(
    pool: PoolDaemon, workdir: Path, hash_seed: None
) -> None:
    prefill, decode = RecordingEngine("prefill"), RecordingEngine("decode")
    upstream = front = None
    try:
        upstream = VllmRouterProcess(workdir, prefill=prefill.url, decode=decode.url, name="vllm-router-hostile")
        front = RouterProcess("front-hostile", workdir, prefill=prefill.url, decode=decode.url, pool_url=pool.url,
                              upstream=upstream.url, **LIMITS)  # fmt: skip
        workers = http(upstream.url + "/workers")
        for method, path in ADMIN:
            status, answer = send(front.url + path.format(decode=decode.url), b"{}", method=method)
            assert status == 404, (method, path, status, answer)
            assert "not served by this router" in message(answer)
        # vllm-router still has both engines, and serves a cold prompt through them.
        assert http(upstream.url + "/workers") == workers
        post(front.url, {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1})  # learns the key scheme here
        decode.requests.clear()
        status, answer = post(front.url, {"model": "m", "prompt": [4, 5, 6], "max_tokens": 1})
        assert status == 200, answer
        assert [p for p, _ in decode.requests] == ["/v1/completions"]
        # The serving paths a client needs still pass.
        assert send(front.url + "/v1/models", None)[0] == 200
    finally:
        for process in (front, upstream):
            if process is not None:
                process.close()
        prefill.close()
        decode.close()


def test_a_bystander_is_answered_while_long_prompts_are_keyed(fleet: Fleet) -> None:
    # Three prompts at the limit keyed at once once stalled the event loop; /health must answer meanwhile.
    big = {"model": "m", "prompt": [9] * (1 << 20), "max_tokens": 1}
    done: list[int] = []
    threads = [threading.Thread(target=lambda: done.append(post(fleet.router.url, big)[0])) for _ in range(3)]
    for t in threads:
        t.start()
    answered = 0
    while any(t.is_alive() for t in threads) and answered < 1000:
        assert json.loads(http(fleet.router.url + "/health", timeout=30)) == {"status": "ok"}
        answered += 1
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert done == [200, 200, 200]
