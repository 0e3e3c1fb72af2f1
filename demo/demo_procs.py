"""Child processes of the demo: started in their own process groups, always stopped.

Every child gets its own session, so a Ctrl-C at the terminal reaches only the demo, which then
stops the children in order (router first, pool last) instead of racing them. ``vllm serve`` forks
an engine core and a worker, so after the leader has had its SIGTERM (and the chance to stop them in
order), whatever is left of its group is signalled as a whole. Every
child also carries ``MARU_DEMO_RUN_ID`` in its environment, so a test can prove after the fact that
nothing of a run survived, including grandchildren that left their group.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

RUN_ID_ENV = "MARU_DEMO_RUN_ID"
_PR_SET_PDEATHSIG = 1


class StepFailed(Exception):
    """A demo step failed; the message says which and why (with a log tail where one helps)."""


@dataclass
class Child:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    stopped: bool = field(default=False)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def died_message(self) -> str:
        code = self.popen.poll()
        how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exited {code}"
        return f"{self.name} (pid {self.pid}) {how}; last lines of {self.log_path.name}:\n{_indent(self.log_tail())}"


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def _die_with_parent() -> None:
    # Runs in the child between fork and exec. If the demo itself is SIGKILLed it cannot clean up;
    # the kernel then sends SIGTERM to each direct child, which shuts its own children down.
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1 (the kernel picks it; a race with another binder is possible)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Supervisor:
    """Starts children with logs in ``workdir`` and stops every one of them, whatever happened."""

    def __init__(self, workdir: Path, run_id: str, base_env: dict[str, str] | None = None) -> None:
        self.workdir = workdir
        self.run_id = run_id
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.children: list[Child] = []

    def start(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> Child:
        log_path = self.workdir / f"{name}.log"
        child_env = {**self.base_env, **(env or {}), RUN_ID_ENV: self.run_id}
        with open(log_path, "wb") as log:
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=child_env,
                cwd=self.workdir,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        child = Child(name, popen, log_path)
        self.children.append(child)
        return child

    def check_alive(self) -> None:
        """Raise :class:`StepFailed` naming the first child that is no longer running."""
        for child in self.children:
            if not child.stopped and not child.alive():
                raise StepFailed(child.died_message())

    def wait_for(
        self,
        what: str,
        ready: Callable[[], bool],
        timeout_s: float,
        watch: Sequence[Child] | None = None,
        interval_s: float = 0.25,
    ) -> float:
        """Poll ``ready`` until true; fail early when a watched child dies. Returns the seconds waited."""
        start = time.monotonic()
        deadline = start + timeout_s
        while True:
            for child in watch if watch is not None else self.children:
                if not child.alive():
                    raise StepFailed(f"while waiting for {what}: {child.died_message()}")
            if ready():
                return time.monotonic() - start
            if time.monotonic() > deadline:
                tails = "\n".join(f"  {c.name}:\n{_indent(c.log_tail(15))}" for c in (watch or self.children))
                raise StepFailed(f"{what} not ready after {timeout_s:.0f}s\n{tails}")
            time.sleep(interval_s)

    def stop_all(self, grace_s: float = 15.0) -> list[str]:
        """Stop every child, newest first: SIGTERM to it, then its group, then SIGKILL. A line per child."""
        report: list[str] = []
        for child in reversed(self.children):
            if child.stopped:
                continue
            report.append(self._stop(child, grace_s))
            child.stopped = True
        return report

    def stop_one(self, child: Child, grace_s: float = 15.0) -> str:
        if child.stopped:
            return f"{child.name} (pid {child.pid}) already stopped"
        child.stopped = True
        return self._stop(child, grace_s)

    def _stop(self, child: Child, grace_s: float) -> str:
        pgid = child.pid  # start_new_session makes the child its group's leader
        if child.alive():
            # The leader alone first: vLLM's API server then shuts its engine core down in order,
            # where a signal to the whole group would race the two and log a dead engine.
            with contextlib.suppress(ProcessLookupError):
                child.popen.send_signal(signal.SIGTERM)
            try:
                child.popen.wait(timeout=grace_s)
                how = "stopped"
            except subprocess.TimeoutExpired:
                _signal_group(pgid, signal.SIGKILL)
                child.popen.wait(timeout=30)
                how = f"killed (no exit {grace_s:.0f}s after SIGTERM)"
        else:
            how = f"had already exited ({child.popen.returncode})"
        # The leader may be gone while a forked helper of it lingers in the group: give it a moment, then kill.
        deadline = time.monotonic() + 5.0
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if group_alive(pgid):
            _signal_group(pgid, signal.SIGTERM)
            how += ", rest of its group sent SIGTERM"
            time.sleep(1.0)
        if group_alive(pgid):
            _signal_group(pgid, signal.SIGKILL)
            how += ", leftover group members killed"
            # SIGKILL is asynchronous: return only once they are really gone.
            deadline = time.monotonic() + 10.0
            while group_alive(pgid) and time.monotonic() < deadline:
                time.sleep(0.05)
        return f"{child.name} (pid {child.pid}) {how}"


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def group_alive(pgid: int) -> bool:
    """Whether any process (zombies excepted) is still in process group ``pgid``."""
    return bool(pids_in_group(pgid))


def pids_in_group(pgid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command name: state ppid pgrp ...
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry.name))
    return out


def pids_with_run_id(run_id: str) -> list[int]:
    """Live processes whose environment carries this run's id (what a leak check looks for)."""
    needle = f"{RUN_ID_ENV}={run_id}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text()
        except OSError:
            continue
        if state[state.rfind(")") + 2 :].split()[:1] != ["Z"]:
            found.append(int(entry.name))
    return found
