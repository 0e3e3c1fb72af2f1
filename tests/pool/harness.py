"""Helpers that run real ``maru-pool`` daemons as subprocesses."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Generous bound on how long a daemon may take to come up on a loaded machine; never asserted on.
START_TIMEOUT_S = 30.0


def pool_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(REPO / "connector"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


class Daemon:
    """A running ``maru-pool`` subprocess and the fields of its ready line."""

    def __init__(self, args: list[str]) -> None:
        self.args = args
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "maru_pool", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=pool_env(),
        )
        self.ready = self._read_ready()

    def _read_ready(self) -> dict[str, str]:
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if sel.select(timeout=0.2):
                line = self.proc.stdout.readline()
                if line.startswith("maru-pool ready "):
                    return dict(kv.split("=", 1) for kv in line.split()[2:])
                if not line:
                    break
        self.stop(sig=signal.SIGKILL)
        _, err = self.proc.communicate()
        raise AssertionError(f"maru-pool {self.args} did not become ready; stderr:\n{err}")

    @property
    def metrics_url(self) -> str:
        return f"http://{self.ready['metrics']}"

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start_serve(daemons: list[Daemon], sock_dir: Path, *extra: str, size: str = "8Mi") -> Daemon:
    d = Daemon(
        [
            "serve",
            "--listen",
            f"unix://{sock_dir}/pool.sock",
            "--size",
            size,
            "--shm-path",
            str(sock_dir / "pool.shm"),
            "--metrics-addr",
            "127.0.0.1:0",
            *extra,
        ]
    )
    daemons.append(d)
    return d
