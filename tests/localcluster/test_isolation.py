"""Pods own their network, and a cluster leaves nothing behind, even when its process is killed.

A process on this machine holds ``0.0.0.0:9400`` (as a pool daemon listening on every address does);
two clusters run side by side, each with a pod serving on ``0.0.0.0:9400`` in its own network
namespace. Then one cluster's process is killed with SIGKILL mid-run: no cleanup code of it runs, yet
its processes, mounts, network namespace and state folder all go, and the other cluster and the
machine's listener are untouched.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.required import require_local_cluster
from tests.support import images

require_local_cluster("the local cluster isolation test")

REPO = Path(__file__).resolve().parents[2]
PORT = 9400


class ClusterProcess:
    """``tests.localcluster.cluster_proc`` in a process of its own."""

    def __init__(self, name: str, log: Path) -> None:
        self.name = name
        self.log = log
        self._log_file = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.localcluster.cluster_proc", name],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log_file,
        )
        self.info: dict[str, Any] = {}

    def ready(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # the cluster bounds its own wait for the pod
        assert line, f"cluster {self.name} exited ({self.proc.wait()}):\n{self.log.read_text()[-3000:]}"
        self.info = json.loads(line)
        assert "error" not in self.info, self.info
        return self.info

    def answer(self) -> str:
        with urllib.request.urlopen(self.info["url"], timeout=10) as resp:
            return str(resp.read().decode())

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()


@pytest.fixture
def machine_listener() -> Iterator[socket.socket]:
    """``0.0.0.0:9400`` held on this machine's own network, as any daemon may hold it (by this test, or by
    whoever already holds it)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("0.0.0.0", PORT))
        sock.listen()
    except OSError:
        # Someone on this machine already holds it: the condition under test holds all the same.
        sock.close()
        sock = socket.create_connection(("127.0.0.1", PORT), timeout=5)
    with sock:
        yield sock


def _children(pid: int) -> set[int]:
    """``pid`` and every process below it."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        current = todo.pop()
        if current not in found:
            found.add(current)
            todo.extend(parents.get(current, []))
    return found


def _start_time(pid: int) -> str | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else fields[19]


def _traces_of(workdir: str, netns: str, processes: dict[int, str | None]) -> list[str]:
    """What is left of a cluster: its processes, a process in its network, a mount or file of its folder."""
    left = [f"process {pid}" for pid, started in processes.items() if started and _start_time(pid) == started]
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if os.readlink(entry / "ns" / "net") == netns:
                left.append(f"process {entry.name} in the cluster network")
            if workdir in (entry / "mountinfo").read_text():
                left.append(f"a mount of {workdir} seen by process {entry.name}")
    if os.path.exists(workdir):
        left.append(f"the folder {workdir}")
    return left


def _wait_gone(info: dict[str, Any], processes: dict[int, str | None], timeout: float = 120) -> None:
    """Until nothing of the cluster is left; the reaper gives stragglers 20 s before it kills them."""
    deadline = time.monotonic() + timeout
    while left := _traces_of(info["workdir"], info["netns"], processes):
        assert time.monotonic() < deadline, f"left behind by {info['workdir']}: {left}"
        time.sleep(0.5)


@pytest.mark.usefixtures("machine_listener")
def test_two_clusters_beside_a_machine_port_and_one_killed_leaves_nothing(tmp_path: Path) -> None:
    images.base()  # the image their pods run
    a, b = ClusterProcess("cluster-a", tmp_path / "a.log"), ClusterProcess("cluster-b", tmp_path / "b.log")
    try:
        info_a, info_b = a.ready(), b.ready()
        # Each pod bound 0.0.0.0:9400 in a network of its own, beside the machine's listener and each other.
        assert (a.answer(), b.answer()) == ("cluster-a", "cluster-b")
        assert info_a["netns"] != info_b["netns"]
        processes = {pid: _start_time(pid) for pid in _children(info_a["pid"])}
        assert len(processes) > 5, processes  # the cluster, its kubelet, kube-proxy, shims, the pod...
        assert _traces_of(info_a["workdir"], info_a["netns"], processes)  # the check can see a live cluster

        os.kill(info_a["pid"], signal.SIGKILL)  # no cleanup code of the cluster's process runs
        a.proc.wait()
        _wait_gone(info_a, processes)

        assert b.answer() == "cluster-b"  # the other cluster never noticed
        with socket.create_connection(("127.0.0.1", PORT), timeout=10):
            pass  # and the machine's process still listens on its port
    finally:
        a.stop()
        b.stop()
    if b.info:
        _wait_gone(b.info, {})  # and a clean stop leaves nothing either
