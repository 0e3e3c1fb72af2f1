"""Fixtures for the connector's unit tests: a real pool daemon when a test needs one."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vllm.harness import PoolDaemon


@pytest.fixture
def pool() -> Iterator[PoolDaemon]:
    # Unix socket paths are limited to ~107 bytes; pytest's tmp paths can exceed that.
    workdir = Path(tempfile.mkdtemp(prefix="maru-conn-", dir="/tmp"))
    daemon = PoolDaemon(workdir, size="64Mi")
    yield daemon
    daemon.kill()
    shutil.rmtree(workdir, ignore_errors=True)
