"""Stopping a child process the way a kubelet stops a container: a signal, a grace period, then SIGKILL."""

from __future__ import annotations

import signal
import subprocess


def stop_process(
    proc: subprocess.Popen[bytes] | subprocess.Popen[str], *, sig: int = signal.SIGTERM, grace_s: float = 30.0
) -> int:
    """Send ``sig`` unless it already exited, wait up to ``grace_s``, then SIGKILL; its exit status."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
