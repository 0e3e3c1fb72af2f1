"""The state a container reports while the kubelet tidies up after it exits.

Removing an exited container's image root (``buildah rm``) can take seconds when another buildah holds the
storage. Whatever status is published meanwhile must say the container terminated: a container that ran is
never again ``ContainerCreating`` (a crash-looping pod seen so by a client looked like one never started).
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from maru_localcluster import imagestore
from maru_localcluster.kubelet import ContainerRunner


async def _exit_with(code: int) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec("sh", "-c", f"exit {code}")


def test_an_exited_container_reports_terminated_while_its_root_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    removing = threading.Event()
    may_finish = threading.Event()

    def slow_release(name: str) -> None:
        removing.set()
        may_finish.wait(10)

    monkeypatch.setattr(imagestore, "release", slow_release)
    published: list[dict[str, Any]] = []
    worker = SimpleNamespace(log_dir=tmp_path, restart_policy="Always", terminating=False)
    runner = ContainerRunner(worker, {"name": "crasher", "image": "example/crasher"})  # type: ignore[arg-type]
    worker.changed = lambda: published.append(runner.status())

    async def scenario() -> dict[str, Any]:
        runner.proc = await _exit_with(3)
        runner.rootfs_name = "crasher-working-container"
        runner.waiting = None  # as _start leaves it once the process exists
        supervised = asyncio.get_running_loop().create_task(runner._supervise())
        await asyncio.to_thread(removing.wait, 10)
        during = runner.status()
        may_finish.set()
        assert await supervised == 3
        return during

    during = asyncio.run(scenario())
    assert during["state"].get("terminated", {}).get("exitCode") == 3, during["state"]
    assert all("ContainerCreating" not in str(status["state"]) for status in published), published
