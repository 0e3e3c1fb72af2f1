"""The pool daemon under a hostile tenant: its RSS under a self-raised quota, and a bystander tenant's lookups under
an idle flood of its HTTP port, the code before its hardening against these and after, in one run.

* ``self_raised_quota``: a pod's credential volume asks ``quota: pins=500000`` of a pool with no
  ``maxTenantQuota``; the CSI plugin's minting (``minting.Material.mint``) makes its token, and the tenant pins
  one chunk 500,000 times (50 batches of 10,000) on a real ``maru-pool serve``. Figures: the quota minted, the
  pins granted, the daemon's RSS before and after. ``token_signed_as_asked``: the same with a token signed
  directly with pins=500000 (past any minting): what the daemon's own ceiling holds.
* ``http_idle_flood``: the daemon in a pids cgroup with ``pids.max=300`` (as a pod's), 310 idle connections to its
  metrics port from 127.0.0.1; tenant B opens a new connection per lookup (50 before the flood, 50 during).
  Figures: B's lookups answered and their latency (median, max), the daemon's threads and the cgroup's pids,
  and whether a scrape from 127.0.0.2 is answered. Needs root (a cgroup v1 pids hierarchy at
  /sys/fs/cgroup/pids); skipped otherwise.

Merges into ``bench/results.json`` under ``"pool_hostile"``.

Run: ``python bench/bench_pool_hostile.py [--baseline REV]`` (default: the commit before the hardening).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE)]

from results import merge_results  # noqa: E402

PIDS_ROOT = Path("/sys/fs/cgroup/pids")
FLOOD = 310
PINS_ASKED = 500_000
BOUNDED_HTTP = "connector/maru_common/boundedhttp.py"  # the hardening's first commit adds it


class Serve:
    """A ``maru-pool serve`` of the code in ``tree`` (its ``connector`` directory), with a pool key."""

    def __init__(self, tree: Path, work: Path) -> None:
        self.work = work
        self.key = secrets.token_bytes(32)
        (work / "key").write_bytes(self.key)
        env = dict(os.environ, PYTHONPATH=str(tree))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", pool_module(tree), "serve", "--listen", f"unix://{work}/pool.sock",
             "--size", "64Mi", "--shm-path", f"{work}/pool.shm", "--metrics-addr", "127.0.0.1:0",
             "--auth-key-file", f"{work}/key"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
        )  # fmt: skip
        assert self.proc.stdout is not None
        self.ready = dict(kv.split("=", 1) for kv in self.proc.stdout.readline().split()[2:])

    def token_file(self, token: str) -> str:
        path = self.work / f"{secrets.token_hex(4)}.token"
        path.write_text(token)
        return str(path)

    def rss_mib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
        raise AssertionError("no VmRSS")

    def threads(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/task"))

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def pool_module(tree: Path) -> str:
    """The pool's package in ``tree``: the baseline may predate the split into one package per deployable."""
    return "maru_pool" if (tree / "maru_pool").is_dir() else "maru_connector.pool"


def client_modules(tree: Path) -> tuple[Any, Any, Any]:
    """``tenancy``, ``minting`` and ``PoolClient`` as the code in ``tree`` names them."""
    split = (tree / "maru_pool").is_dir()
    names = (
        ("maru_contracts.tenancy", "maru_csi.minting")
        if split
        else ("maru_connector.tenancy", "maru_connector.csi.minting")
    )
    tenancy, minting = (importlib.import_module(name) for name in names)
    return tenancy, minting, importlib.import_module(pool_module(tree)).PoolClient


def self_raised_quota(tree: Path, work: Path, *, minted: bool) -> dict[str, Any]:
    tenancy, minting, PoolClient = client_modules(tree)

    d = Serve(tree, work)
    try:
        if minted:  # the pool's material with no tenantQuota and no maxTenantQuota: the defaults
            token, _ = minting.Material("pool-a", d.key).mint("ns-b", "chat", tenancy.Quota(pins=PINS_ASKED))
        else:
            token = tenancy.issue(d.key, tenancy.tenant("ns-b/chat", tenancy.Quota(pins=PINS_ASKED)))
        b = PoolClient(d.ready["listen"], timeout_s=30, token_file=d.token_file(token))
        key = b"\x0b" * 32
        assert b.put(key, b"b" * 4096)
        figures: dict[str, Any] = {
            "token_quota": str(tenancy.verify(d.key, token).quota),
            "rss_mib_before": d.rss_mib(),
        }
        started, granted = time.monotonic(), 0
        for _ in range(PINS_ASKED // 10_000):
            granted += sum(p is not None for p in b.open_read_many([key] * 10_000))
        figures.update(pins_granted=granted, seconds=round(time.monotonic() - started, 1), rss_mib_after=d.rss_mib())
        return figures
    finally:
        d.kill()


def http_idle_flood(tree: Path, work: Path) -> dict[str, Any]:
    tenancy, _, PoolClient = client_modules(tree)

    d = Serve(tree, work)
    cgroup = PIDS_ROOT / f"maru-bench-{os.getpid()}"
    cgroup.mkdir()
    flood: list[socket.socket] = []
    try:
        (cgroup / "pids.max").write_text("300")
        (cgroup / "cgroup.procs").write_text(str(d.proc.pid))
        token = d.token_file(tenancy.issue(d.key, tenancy.tenant("ns-b/chat")))
        key = b"\x09" * 32
        assert PoolClient(d.ready["listen"], timeout_s=5, token_file=token).put(key, b"b" * 4096)

        def lookups(n: int) -> dict[str, Any]:
            answered, latency = 0, []
            for _ in range(n):
                started = time.perf_counter()
                client = PoolClient(d.ready["listen"], timeout_s=5, token_file=token)  # a new connection each
                try:
                    if client.lookup_prefix([key]) == 1:
                        answered += 1
                        latency.append((time.perf_counter() - started) * 1000)
                except Exception:  # PoolUnavailable: what the bystander saw
                    pass
                finally:
                    client.close()
            return {
                "answered": answered,
                "of": n,
                "p50_ms": round(statistics.median(latency), 2) if latency else None,
                "max_ms": round(max(latency), 2) if latency else None,
            }

        figures: dict[str, Any] = {"bystander_idle": lookups(50), "threads_idle": d.threads()}
        host, port = d.ready["metrics"].rsplit(":", 1)
        for _ in range(FLOOD):
            try:
                flood.append(socket.create_connection((host, int(port)), timeout=5, source_address=("127.0.0.1", 0)))
            except OSError:
                break
        time.sleep(2)  # the old server's threads start as it accepts
        figures.update(
            threads_flood=d.threads(),
            pids_flood=int((cgroup / "pids.current").read_text()),
            bystander_flood=lookups(50),
        )
        try:
            with socket.create_connection((host, int(port)), timeout=10, source_address=("127.0.0.2", 0)) as scrape:
                scrape.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
                figures["scrape_flood"] = scrape.recv(100).split(b"\r\n")[0].decode() or "closed"
        except OSError as err:
            figures["scrape_flood"] = type(err).__name__
        return figures
    finally:
        for sock in flood:
            sock.close()
        d.kill()
        cgroup.rmdir()


def measure(tree: Path) -> dict[str, Any]:
    """Every figure of the code in ``tree``, each in a fresh directory."""
    figures: dict[str, Any] = {}
    runs = [
        ("self_raised_quota", lambda w: self_raised_quota(tree, w, minted=True)),
        ("token_signed_as_asked", lambda w: self_raised_quota(tree, w, minted=False)),
    ]
    if os.geteuid() == 0 and PIDS_ROOT.is_dir():
        runs.append(("http_idle_flood", lambda w: http_idle_flood(tree, w)))
    for name, run in runs:
        work = Path(tempfile.mkdtemp(prefix="maru-ph-", dir="/tmp"))
        try:
            figures[name] = run(work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return figures


def baseline_commit() -> str:
    added = subprocess.run(["git", "log", "--follow", "--diff-filter=A", "--format=%H", "--", BOUNDED_HTTP],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    assert added, "no commit adds the bounded HTTP server: pass --baseline"
    return f"{added[-1]}~1"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", help="the code to compare with (a git revision; default: before hardening)")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # a child run: the code on its PYTHONPATH
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(Path(args.measure))))
        return 0
    rev = args.baseline or baseline_commit()
    commit = subprocess.run(["git", "rev-parse", "--short", rev], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout.strip()  # fmt: skip
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="maru-hostile-pool-", dir="/tmp") as tmp:
        old = Path(tmp)
        archive = subprocess.run(["git", "archive", rev, "connector"], cwd=REPO, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
        built = REPO / "connector" / "maru_pool" / "_copyhash.abi3.so"
        if built.exists():  # the native copy is built, not committed: the same for both
            # The baseline may predate the package split, when the module lived in maru_connector.
            source = next((old / "connector").glob("*/_copyhash.c"))
            shutil.copy(built, source.parent)
        for name, tree in ((f"before ({commit})", old / "connector"), ("after", REPO / "connector")):
            done = subprocess.run(
                [sys.executable, __file__, "--measure", str(tree)],
                capture_output=True,
                text=True,
                env=dict(os.environ, PYTHONPATH=str(tree)),
                check=True,
                timeout=600,
            )
            figures[name] = json.loads(done.stdout.splitlines()[-1])
            print(json.dumps({name: figures[name]}, indent=1), flush=True)
    print("merged into", merge_results("pool_hostile", figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
