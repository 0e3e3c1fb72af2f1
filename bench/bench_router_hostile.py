"""maru-router under a hostile client: a bystander's latency and the router's RSS, the router before its hardening
against this one, in one run.

Both routers run as their own processes over one real ``maru-pool serve`` and fake engines (the prefill one
announces a key scheme of eight TP ranks and 16-token chunks, so prompts are keyed and looked up). A bystander
sends a 64-token completion in a loop, one at a time, while each attack runs:

* ``uploads_60MiB``: 16 uploads announcing 60 MiB, stopped one byte short and closed (accepted before: the body
  limit was 64 MiB); ``uploads_15MiB``: the same at 15 MiB, under the body limit now (the aborted request's cycle);
* ``prompts_8M``: three concurrent completions of 8M token ids; ``prompts_1M``: the same at 1M, the longest
  prompt the router now keys.

For each attack: the bystander's latency (median, max, requests), the router's RSS before, at its peak, and 2 s
after, and the attackers' statuses. Merges into ``bench/results.json`` under ``"router_hostile"``.

Run: ``python bench/bench_router_hostile.py [--baseline REV]`` (default: the commit before the hardening).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO / "connector"), str(REPO)]

from results import merge_results  # noqa: E402

from tests.router.harness import RecordingEngine  # noqa: E402
from tests.support.processes import stop_process  # noqa: E402
from tests.support.servers import free_port  # noqa: E402
from tests.vllm.harness import PoolDaemon  # noqa: E402

MiB = 1 << 20
BYSTANDER = json.dumps({"model": "m", "prompt": list(range(1000, 1064)), "max_tokens": 1}).encode()


class Router:
    """``python -m maru_router`` from the tree at ``root``."""

    def __init__(self, root: Path, name: str, workdir: Path, prefill: str, decode: str, pool_url: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        connector = {"maru_pool_url": pool_url, "maru_kv_chunk_tokens": 256, "maru_rpc_timeout_ms": 2000}
        env = {**os.environ, "PYTHONPATH": f"{root / 'connector'}{os.pathsep}{root}", "PYTHONHASHSEED": "0",
               "OMP_NUM_THREADS": "1"}  # fmt: skip
        # The baseline may predate the split into one package per deployable, when the router was maru_connector's.
        module = "maru_router" if (root / "connector" / "maru_router").is_dir() else "maru_connector.router"
        argv = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(self.port),
                "--prefill", prefill, "--decode", decode, "--connector-config", json.dumps(connector)]  # fmt: skip
        with open(workdir / f"router-{name}.log", "w") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir)
        for _ in range(600):
            assert self.proc.poll() is None, f"router {name} exited: see {workdir}/router-{name}.log"
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2).read()
                break
            except OSError:
                time.sleep(0.5)
        post(self.url, BYSTANDER)  # through prefill: the router learns the key scheme

    def rss_mib(self) -> float:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(next(x for x in status.splitlines() if x.startswith("VmRSS:")).split()[1]) / 1024

    def close(self) -> None:
        stop_process(self.proc)


def post(url: str, data: bytes, timeout: float = 600) -> int:
    req = urllib.request.Request(url + "/v1/completions", data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return 0


def abort_upload(port: int, size: int) -> str:
    """Announce ``size`` bytes of body, send all but the last, close; what the router answered, if anything."""
    try:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {size}\r\n\r\n".encode())  # fmt: skip
            piece, left = b"1" * MiB, size - 1
            while left:
                left -= sock.send(piece[: min(left, MiB)])
            return "sent"
    except OSError as err:
        return type(err).__name__


def token_prompt(n: int) -> bytes:
    return b'{"model":"m","max_tokens":1,"prompt":[' + b",".join([b"9"] * n) + b"]}"


def under_attack(router: Router, attack: Callable[[], list[Any]]) -> dict[str, Any]:
    """Run ``attack`` while a bystander sends its prompt in a loop and the router's RSS is sampled."""
    stop = threading.Event()
    latencies: list[float] = []
    statuses: list[int] = []
    peak = [router.rss_mib()]

    def bystander() -> None:
        while not stop.is_set():
            start = time.perf_counter()
            statuses.append(post(router.url, BYSTANDER, timeout=120))
            latencies.append(time.perf_counter() - start)

    def sample() -> None:
        while not stop.wait(0.1):
            peak.append(router.rss_mib())

    before = router.rss_mib()
    threads = [threading.Thread(target=bystander), threading.Thread(target=sample)]
    for t in threads:
        t.start()
    start = time.perf_counter()
    outcome = attack()
    took = time.perf_counter() - start
    stop.set()
    for t in threads:
        t.join()
    time.sleep(2)
    return {
        "attack_s": round(took, 2),
        "attackers": sorted(set(map(str, outcome))),
        "bystander_ms_p50": round(1000 * statistics.median(latencies), 1),
        "bystander_ms_max": round(1000 * max(latencies), 1),
        "bystander_requests": len(latencies),
        "bystander_failed": sum(s != 200 for s in statuses),
        "rss_mib_before": round(before),
        "rss_mib_peak": round(max(peak)),
        "rss_mib_after_2s": round(router.rss_mib()),
    }


def concurrently(n: int, fn: Callable[[], Any]) -> list[Any]:
    out: list[Any] = []
    threads = [threading.Thread(target=lambda: out.append(fn())) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def measure(router: Router) -> dict[str, Any]:
    idle = under_attack(router, lambda: [time.sleep(3)])
    results = {"idle": {k: v for k, v in idle.items() if k.startswith(("bystander", "rss_mib_before"))}}
    for size in (60, 15):
        results[f"uploads_{size}MiB"] = under_attack(
            router, lambda size=size: [abort_upload(router.port, size * MiB) for _ in range(16)]
        )
    for millions in (8, 1):
        body = token_prompt(millions << 20)
        results[f"prompts_{millions}M"] = under_attack(
            router, lambda body=body: concurrently(3, lambda: post(router.url, body))
        )
    return results


def baseline_commit() -> str:
    limits = "connector/maru_router/limits.py"
    added = subprocess.run(["git", "log", "--follow", "--diff-filter=A", "--format=%H", "--", limits],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    assert added, "no commit adds the router's limits: pass --baseline"
    return f"{added[-1]}~1"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", help="the router to compare with (a git revision; default: before hardening)")
    args = parser.parse_args()
    rev = args.baseline or baseline_commit()
    commit = subprocess.run(["git", "rev-parse", "--short", rev], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout.strip()  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="maru-hostile-", dir="/tmp") as tmp:
        work = Path(tmp)
        old = work / "baseline"
        old.mkdir()
        archive = subprocess.run(["git", "archive", rev, "connector"], cwd=REPO, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
        pool = PoolDaemon(work)
        prefill, decode = RecordingEngine("prefill", record=False), RecordingEngine("decode", record=False)
        figures: dict[str, Any] = {}
        try:
            for name, root in ((f"before ({commit})", old), ("after", REPO)):
                router = Router(root, name.split()[0], work, prefill.url, decode.url, pool.url)
                try:
                    figures[name] = measure(router)
                finally:
                    router.close()
                print(json.dumps({name: figures[name]}, indent=1), flush=True)
        finally:
            prefill.close()
            decode.close()
            pool.kill()
    print("merged into", merge_results("router_hostile", figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
