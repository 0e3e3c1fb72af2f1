"""Fixtures for the real-engine tests: the tiny model, one pool daemon per module, engines."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from .harness import PoolDaemon


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from maru_localcluster.tinymodel import make_tiny_llama

    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def tiny_deepseek(tmp_path_factory: pytest.TempPathFactory) -> str:
    from maru_localcluster.tinymodel import make_tiny_deepseek_v2

    return str(make_tiny_deepseek_v2(tmp_path_factory.mktemp("tiny-deepseek-v2")))


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    # Unix socket paths are limited to ~107 bytes; pytest's tmp paths can exceed that.
    path = Path(tempfile.mkdtemp(prefix="maru-vllm-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def pool(workdir: Path) -> Iterator[PoolDaemon]:
    daemon = PoolDaemon(workdir)
    yield daemon
    daemon.kill()
