"""A daemon of the data plane (``maru-pool``, ``maru-csi``) as a real subprocess, up once it prints its ready line.

Both print ``<program> ready key=value ...`` on stdout when they serve; the fields say where (sockets,
ports) and what they chose.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support.processes import stop_process

REPO = Path(__file__).resolve().parents[2]
# Generous bound on how long a daemon may take to come up or stop on a loaded machine; never asserted on.
START_TIMEOUT_S = 30.0


def connector_env() -> dict[str, str]:
    """This environment with the data plane's packages importable, as they are in the images."""
    env = dict(os.environ)
    paths = [str(REPO / "connector"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


class ReadyDaemon:
    """``python -m <module> <args>`` running, and the fields of its ready line (``self.ready``)."""

    module = ""
    program = ""  # the first word of the ready line

    def __init__(self, *args: str) -> None:
        self.args = list(args)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", self.module, *self.args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=connector_env(),
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
                if line.startswith(f"{self.program} ready "):
                    return dict(kv.split("=", 1) for kv in line.split()[2:])
                if not line:
                    break
        self.stop(signal.SIGKILL)
        raise AssertionError(f"{self.program} {self.args} did not become ready; stderr:\n{self.stderr()}")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Signal it (SIGTERM unless told) and reap it; SIGKILL if it has not exited in START_TIMEOUT_S."""
        return stop_process(self.proc, sig=sig, grace_s=START_TIMEOUT_S)

    def stderr(self) -> str:
        """What it wrote on stderr, once it has exited ("" while it runs)."""
        assert self.proc.stderr is not None
        if self.proc.poll() is None:
            return ""
        text = self.proc.stderr.read()
        self.proc.stderr.close()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return text
