"""Several KV cache groups (sliding window + full attention) at vLLM's real Scheduler.

The connector implements ``SupportsHMA``: vLLM keeps its hybrid KV cache manager on, and the connector
copies each group's chunks under its own keys, from and into its own block table, a sliding-window group
only where its window reaches; groups it cannot copy are refused at start, naming what to do.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.structured_output import StructuredOutputManager

from maru_connector.vllm import MaruConnector
from maru_contracts.config import ConfigError

from .realsched import BS, CHUNK, HD, HEADS, Engine, prompt

NO_POOL = "unix:///nonexistent/maru/pool.sock"


def test_vllm_keeps_its_hybrid_kv_cache_manager_on_for_the_connector(tmp_path: Path) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

    assert issubclass(MaruConnector, SupportsHMA)
    engine = Engine(tmp_path, NO_POOL, num_blocks=16)
    try:
        assert not engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    finally:
        engine.close()


def test_groups_it_cannot_copy_are_refused_at_the_real_scheduler_naming_what_to_do(tmp_path: Path) -> None:
    engine = Engine(tmp_path, NO_POOL, num_blocks=16)
    engine.close()
    full = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HD, dtype=torch.float32)
    local = ChunkedLocalAttentionSpec(
        block_size=BS, num_kv_heads=HEADS, head_size=HD, dtype=torch.float32, attention_chunk_size=2 * BS
    )
    groups = [KVCacheGroupSpec(["layer0"], full), KVCacheGroupSpec(["layer1"], local)]
    config = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)
    vllm_config = engine.vllm_config
    with pytest.raises(
        ConfigError,
        match=r"its KV cache groups hold ChunkedLocalAttentionSpec, .* --disable-hybrid-kv-cache-manager",
    ):
        Scheduler(vllm_config, config, StructuredOutputManager(vllm_config), block_size=BS)


def run_until(engine: Engine, done: Callable[[], bool]) -> None:
    """Step until ``done()``, letting the pool lookups answer and the worker's copies finish in between."""
    for _ in range(400):
        if done():
            return
        engine.step()
        engine.worker.wait_idle()
        time.sleep(0.01)
    raise AssertionError("not done after 400 steps")


WINDOW = 3 * BS  # 96 tokens: a hit ending at token 256 reads tokens 161..255, blocks 5-7 (chunks 2 and 3)


@pytest.mark.parametrize("dense", [True, False], ids=["direct", "staging"])
def test_two_groups_are_stored_and_loaded_each_with_its_own_blocks(pool, tmp_path: Path, dense: bool) -> None:
    """vLLM's real Scheduler with its hybrid manager on (a full and a sliding-window group), the connector's
    scheduler half and a real worker over a real pool: the first request stores every chunk of both groups
    from their own block tables; the same prompt again loads the full group's chunks and only the sliding
    group's window, into the blocks vLLM gave it, and every loaded block equals the stored one byte for byte;
    by address between dense pages, and through a staging buffer per group."""
    engine = Engine(tmp_path, pool.url, num_blocks=64, window=WINDOW, dense=dense)
    assert engine.worker.paged.direct is dense
    manager, worker, kv = engine.sched.kv_cache_manager, engine.worker, engine.kv_caches
    layer = {0: "layer0", 1: "layer1"}  # the full group's layer, the sliding group's
    per_chunk = CHUNK // BS
    seen: list[tuple[str, dict, tuple[list[int], ...]]] = []  # (what, the step's plans, the request's tables)
    save, load = worker.save, worker.load

    def saving(meta) -> None:
        if "a" in meta.saves:
            seen.append(("save", dict(meta.saves), manager.get_block_ids("a")))
        save(meta)

    def loading(meta) -> None:
        if "b" in meta.loads:
            seen.append(("load", dict(meta.loads), manager.get_block_ids("b")))
        load(meta)

    worker.save, worker.load = saving, loading  # type: ignore[method-assign]
    try:
        assert engine.sched.kv_cache_config.kv_cache_groups[1].kv_cache_spec.sliding_window == WINDOW
        torch.manual_seed(0)
        for t in kv.values():
            t.copy_(torch.randn_like(t))
        tokens = prompt(4 * CHUNK + 5, seed=3)
        engine.add("a", tokens, max_tokens=1)
        run_until(engine, lambda: "a" in engine.finished_sending)
        [(_, plans, tables)] = [s for s in seen if s[0] == "save"]
        stored = {(c.group, c.index): c.block_ids for c in plans["a"].chunks}
        assert stored == {
            (g, i): tuple(tables[g][i * per_chunk : (i + 1) * per_chunk]) for g in (0, 1) for i in range(4)
        }
        snapshot = {(g, b): kv[layer[g]][tables[g][b]].clone() for g in (0, 1) for b in range(4 * per_chunk)}
        for t in kv.values():
            t.zero_()

        second = engine.add("b", tokens, max_tokens=1)
        run_until(engine, second.is_finished)
        [(_, plans, (full_ids, window_ids))] = [s for s in seen if s[0] == "load"]
        got = {(c.group, c.index): c.slots for c in plans["b"].chunks}
        # The capped hit: 4 chunks (the prompt's 5 last tokens are computed). The sliding group reads
        # tokens 161..255 when computing token 256: blocks 5-7 only, and vLLM nulled blocks 0-4.
        assert got == {
            **{(0, i): tuple((j, full_ids[i * per_chunk + j]) for j in range(per_chunk)) for i in range(4)},
            (1, 2): ((1, window_ids[5]),),
            (1, 3): ((0, window_ids[6]), (1, window_ids[7])),
        }
        null = manager.block_pool.null_block.block_id
        assert window_ids[:5] == [null] * 5
        for (g, index), slots in got.items():
            for j, block in slots:
                assert torch.equal(kv[layer[g]][block], snapshot[(g, index * per_chunk + j)]), (g, index, j)
        assert not kv[layer[1]][null].any()  # the null block is never written
    finally:
        engine.close()


def test_a_failed_load_of_two_groups_is_a_failed_request_that_vllm_recomputes(pool, tmp_path: Path) -> None:
    """vLLM cannot map failed block ids back to a request when there are several groups (its scheduler
    raises): the load is asynchronous and its failure is reported per request (failed_recving), so the
    engine lives on and recomputes the prompt."""
    engine = Engine(tmp_path, pool.url, num_blocks=64, window=WINDOW, load_async=False)  # asynchronous anyway
    tokens = prompt(4 * CHUNK + 5, seed=4)
    engine.add("a", tokens, max_tokens=1)
    run_until(engine, lambda: "a" in engine.finished_sending)
    worker, call = engine.worker, engine.worker.guard.call
    failed: list[str] = []
    take = worker.take_failed_recving

    def pool_fails_loads(what: str, fn, *args):  # the pool goes away between the lookup and the load
        return (False, None) if what == "load" else call(what, fn, *args)

    def taking() -> set[str]:
        out = take()
        failed.extend(out)
        return out

    worker.guard.call, worker.take_failed_recving = pool_fails_loads, taking  # type: ignore[method-assign]
    second = engine.add("b", tokens, max_tokens=1)
    run_until(engine, second.is_finished)
    assert failed == ["b"]
    assert not worker.invalid_blocks
    assert second.num_computed_tokens >= len(tokens)  # recomputed, not taken from blocks the load never wrote
    engine.close()


def test_a_chunk_whose_window_blocks_vllm_freed_first_is_never_stored_nor_waited_for(pool, tmp_path: Path) -> None:
    """A prefill step that ends inside a chunk, past its first block plus the window: vLLM frees that
    block of the sliding group before the step completing the chunk runs. The chunk (and, the pool keeping
    prefixes, every later one) can no longer be stored from this request: nothing of the null block is
    stored, and the finished request does not keep its blocks for retries that cannot succeed."""
    engine = Engine(tmp_path, pool.url, num_blocks=64, window=BS, batch_tokens=CHUNK - 1)
    saves: list[dict] = []
    save = engine.worker.save
    engine.worker.save = lambda meta: (saves.append(dict(meta.saves)), save(meta))[1]  # type: ignore[method-assign]
    try:
        request = engine.add("a", prompt(2 * CHUNK + 5, seed=5), max_tokens=1)
        state = None
        for _ in range(400):
            state = engine.connector._scheduler._states.get("a") or state
            if request.is_finished():
                break
            engine.step()
            engine.worker.wait_idle()
            time.sleep(0.01)
        assert request.is_finished()
        assert state is not None and state.unsavable_from == 0
        assert not any(step.get("a") for step in saves)
        assert "a" not in engine.connector._scheduler._states  # released at once, not held for retries
    finally:
        engine.close()
