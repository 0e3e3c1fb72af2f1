"""The connector's worker half on CPU tensors against a real pool: a worker, its caches, and save/load metadata."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from maru_connector.vllm.metadata import (
    ChunkLoad,
    ChunkSave,
    LoadPlan,
    MaruConnectorMetadata,
    MaruWorkerReport,
    SavePlan,
)
from maru_connector.vllm.worker import MaruWorker
from maru_contracts.config import MaruConnectorConfig
from tests.connector import fakes


def make(url: str, *, rpc_ms: int = 5000, dense: bool = True) -> tuple[MaruWorker, dict[str, torch.Tensor]]:
    cfg = MaruConnectorConfig.from_extra_config(
        {"maru_pool_url": url, "maru_kv_chunk_tokens": CHUNK, "maru_rpc_timeout_ms": rpc_ms}
    )
    worker = MaruWorker(
        fakes.vllm_config(block_size=BS),
        fakes.kv_cache_config(block_size=BS, heads=HEADS, head_size=HD, num_blocks=NUM_BLOCKS),
        cfg,
        loads=True,
        saves=True,
        tp_rank=0,
    )
    caches = {f"layer{i}": kv_cache(dense=dense) for i in range(2)}
    worker.register_kv_caches(caches)
    assert worker.paged.direct is dense
    assert (worker._load_staging is None) is dense and (worker._save_staging is None) is dense
    return worker, caches


def key(i: int) -> tuple[bytes, ...]:
    return (i.to_bytes(16, "little"),)


def save_meta(chunks: dict[int, tuple[int, int]], *, depends_on: tuple[int, ...] = ()) -> MaruConnectorMetadata:
    saves = tuple(
        ChunkSave(index=n, keys=key(k), parents=(None,), block_ids=ids) for n, (k, ids) in enumerate(chunks.items())
    )
    return MaruConnectorMetadata(saves={"r": SavePlan(chunks=saves, depends_on=depends_on)})


def load_meta(chunks: dict[int, tuple[tuple[int, int], ...]], load_id: int = 1) -> MaruConnectorMetadata:
    plan = LoadPlan(load_id=load_id, chunks=tuple(ChunkLoad(keys=key(k), slots=s) for k, s in chunks.items()))
    return MaruConnectorMetadata(loads={"r": plan})


def settled(worker: MaruWorker) -> MaruWorkerReport | None:
    """The report vLLM would collect on the next step: the lanes' results, then the worker's report."""
    worker.wait_idle()
    worker.finished(None)
    return worker.report()


def wait_stopped(pid: int) -> None:
    """kill() returns before the target stops: a thread already running may still answer a call."""
    tasks = Path(f"/proc/{pid}/task")
    for _ in range(1000):
        states = [(t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in tasks.iterdir()]
        if all(st in ("T", "t") for st in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop: thread states {states}")


BS, HEADS, HD, NUM_BLOCKS = 32, 2, 32, 16  # CPU layout needs block sizes that are multiples of 32
CHUNK = 2 * BS


def kv_cache(*, dense: bool) -> torch.Tensor:
    """One layer's ``[blocks, heads, tokens, content]`` view. Dense pages (CPU engines) are copied by address
    straight between the engine and the pool; heads in separate planes (``LHBNC``) go through staging."""
    if dense:
        return torch.zeros(NUM_BLOCKS, HEADS, BS, 2 * HD)
    return torch.zeros(HEADS, NUM_BLOCKS, BS, 2 * HD).transpose(0, 1)
