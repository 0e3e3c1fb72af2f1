"""Fixtures that run real ``maru-pool`` daemons as subprocesses and clean them up."""

from __future__ import annotations

import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.pool import Daemon, start_serve


@pytest.fixture
def daemons() -> Iterator[list[Daemon]]:
    """Started daemons are stopped at the end of the test, whatever happened."""
    started: list[Daemon] = []
    yield started
    for d in started:
        d.stop(sig=signal.SIGKILL)
        for stream in (d.proc.stdout, d.proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    # Unix socket paths are limited to ~107 bytes; pytest's tmp paths can exceed that.
    path = Path(tempfile.mkdtemp(prefix="mp-", dir="/tmp"))
    yield path
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


@pytest.fixture
def serve(daemons: list[Daemon], sock_dir: Path) -> Daemon:
    """A single-node pool of 8 MiB on a shm file in the test's directory."""
    return start_serve(daemons, sock_dir)
