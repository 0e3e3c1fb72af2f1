"""The demo's process handling, without vLLM: groups stopped, stragglers killed, deaths reported."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

# A parent that forks a grandchild into its own group which ignores SIGTERM, then idles.
STUBBORN_TREE = """
import os, signal, subprocess, sys, time
code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('grandchild up', flush=True); "
child = subprocess.Popen([sys.executable, "-c", code + "time.sleep(600)"])
print("parent up", flush=True)
time.sleep(600)
"""


def _wait_for_text(path: Path, text: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never appeared in {path}: {path.read_text() if path.exists() else '(none)'}")


def test_stop_all_kills_the_whole_group(tmp_path: Path, demo_procs: ModuleType) -> None:
    sup = demo_procs.Supervisor(tmp_path, "t-stop")
    child = sup.start("tree", [sys.executable, "-c", STUBBORN_TREE])
    _wait_for_text(child.log_path, "grandchild up")
    assert len(demo_procs.pids_in_group(child.pid)) == 2
    assert sorted(demo_procs.pids_with_run_id("t-stop")) == sorted(demo_procs.pids_in_group(child.pid))

    report = sup.stop_all(grace_s=5)

    assert report and "tree" in report[0]
    assert demo_procs.pids_in_group(child.pid) == []
    assert demo_procs.pids_with_run_id("t-stop") == []


def test_stop_all_escalates_when_the_leader_ignores_sigterm(tmp_path: Path, demo_procs: ModuleType) -> None:
    sup = demo_procs.Supervisor(tmp_path, "t-stubborn")
    child = sup.start("stubborn", [sys.executable, "-c",
                                   "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                   "print('up', flush=True); time.sleep(600)"])
    _wait_for_text(child.log_path, "up")

    report = sup.stop_all(grace_s=1)

    assert "killed" in report[0]
    assert not child.alive()
    assert demo_procs.pids_with_run_id("t-stubborn") == []


def test_a_dead_child_is_named_with_its_log_tail(tmp_path: Path, demo_procs: ModuleType) -> None:
    sup = demo_procs.Supervisor(tmp_path, "t-dead")
    sup.start("crasher", [sys.executable, "-c", "print('boom: no model here', flush=True); raise SystemExit(3)"])
    try:
        with pytest.raises(demo_procs.StepFailed) as err:
            sup.wait_for("something", lambda: False, timeout_s=30)
        assert "crasher" in str(err.value)
        assert "exited 3" in str(err.value)
        assert "boom: no model here" in str(err.value)
    finally:
        sup.stop_all()


def test_wait_for_times_out_with_the_logs(tmp_path: Path, demo_procs: ModuleType) -> None:
    sup = demo_procs.Supervisor(tmp_path, "t-slow")
    sup.start("sleeper", [sys.executable, "-c", "print('still loading', flush=True); import time; time.sleep(600)"])
    try:
        with pytest.raises(demo_procs.StepFailed) as err:
            sup.wait_for("the sleeper's port", lambda: False, timeout_s=1)
        assert "not ready after" in str(err.value)
    finally:
        sup.stop_all()
    assert demo_procs.pids_with_run_id("t-slow") == []


def test_free_port_is_bindable(demo_procs: ModuleType) -> None:
    import socket

    port = demo_procs.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_run_id_lookup_ignores_this_process(demo_procs: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(demo_procs.RUN_ID_ENV, "t-self")
    # Our own environment at start-up is what /proc shows, so setting it now must not make us a match.
    assert os.getpid() not in demo_procs.pids_with_run_id("t-self")
