"""One vLLM engine (CPU, in-process core) driven over stdin/stdout by the tests.

Run as ``python -m tests.vllm.engine_proc '<json options>'``. Each request is one JSON line on stdin,
each answer one line on stdout prefixed with ``@@`` (vLLM writes its own lines there too).

Ops: ``generate`` (prompts as token ids, greedy), ``counters`` (connector counters of this process,
both halves), ``metrics`` (the connector's Prometheus counters), ``corrupt`` (flip bytes of one stored
chunk in the pool memory), ``exit``.
"""

from __future__ import annotations

import json
import mmap
import os
import sys
import time
import traceback
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def build(opts: dict[str, Any]):
    from vllm import LLM

    from maru_connector.config import MaruConnectorConfig, kv_transfer_config

    kwargs: dict[str, Any] = dict(
        model=opts["model"],
        dtype="float32",
        max_model_len=16384,
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        kv_cache_memory_bytes=256 << 20,
        enable_prefix_caching=bool(opts.get("prefix_caching", False)),
        max_num_seqs=8,
        seed=0,
    )
    if opts.get("log_stats"):
        kwargs["disable_log_stats"] = False
    if opts.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = opts["max_num_batched_tokens"]
    if opts.get("role"):
        cfg = MaruConnectorConfig.from_extra_config(
            {
                "maru_pool_url": opts["pool_url"],
                "maru_kv_chunk_tokens": opts.get("chunk_tokens", 256),
                # Generous: a loaded CI machine must not turn a slow answer into a miss the test counts.
                "maru_rpc_timeout_ms": opts.get("rpc_timeout_ms", 5000),
            }
        )
        ktc = kv_transfer_config(opts["role"], cfg)
        if opts.get("connector_module"):
            ktc["kv_connector"], ktc["kv_connector_module_path"] = opts["connector_module"]
        kwargs["kv_transfer_config"] = ktc
    return LLM(**kwargs)


def generate(llm, req: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=req.get("max_tokens", 16), temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in req["prompts"]], sp, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs], "elapsed_s": elapsed}


def chunk_key(llm, prompt: list[int], chunk: int) -> bytes:
    """The key the connector stores chunk ``chunk`` of ``prompt`` under, from vLLM's block hash chain."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    from maru_connector.keys import chunk_keys

    core = llm.llm_engine.engine_core.engine_core
    sched = core.scheduler.connector._scheduler
    hash_fn = get_hash_fn_by_name(llm.llm_engine.vllm_config.cache_config.prefix_caching_hash_algo)
    bs = sched.hash_block_size
    parent, hashes = None, []
    for b in range(len(prompt) // bs):
        parent = kv_cache_utils.hash_block_tokens(hash_fn, parent, prompt[b * bs : (b + 1) * bs])
        hashes.append(parent)
    keys = chunk_keys(hashes, hash_block_size=bs, chunk_tokens=sched.chunk_tokens, fingerprint=sched._fingerprints[0])
    return keys[chunk]


def corrupt(llm, req: dict[str, Any]) -> dict[str, Any]:
    """Flip bytes in the middle of one stored chunk, behind the pool's back (as a bad DIMM would)."""
    from maru_connector.pool import PoolClient
    from maru_connector.pool.memory import HEADER_SIZE

    key = chunk_key(llm, req["prompt"], req["chunk"])
    client = PoolClient(req["pool_url"], timeout_s=5)
    try:
        reply = client._call({"op": "read", "keys": [key.hex()]})
        pin = reply["pins"][0]
        if pin is None:
            return {"error": "chunk not in the pool"}
        pin_id, offset, nbytes, _ = pin
        client._call({"op": "release", "epoch": reply["epoch"], "pins": [pin_id]})
    finally:
        client.close()
    with open(req["shm_path"], "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        at = HEADER_SIZE + offset + nbytes // 2
        mm[at : at + 16] = bytes(b ^ 0xFF for b in mm[at : at + 16])
    return {"ok": True, "key": key.hex()}


def metrics(llm) -> dict[str, float]:
    """The connector's Prometheus counters as vLLM exports them (needs ``log_stats``)."""
    from prometheus_client import REGISTRY

    llm.llm_engine.do_log_stats()
    out: dict[str, float] = {}
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name.startswith("vllm:maru_connector_") and sample.name.endswith("_total"):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def main() -> int:
    opts = json.loads(sys.argv[1])
    llm = build(opts)
    from maru_connector.vllm import counters

    def answer(obj: dict[str, Any]) -> None:
        sys.stdout.write("@@" + json.dumps(obj) + "\n")
        sys.stdout.flush()

    answer({"ready": True})
    for line in sys.stdin:
        req = json.loads(line)
        op = req["op"]
        try:
            if op == "exit":
                answer({"ok": True})
                break
            if op == "generate":
                answer(generate(llm, req))
            elif op == "counters":
                answer({"counters": counters()})
            elif op == "metrics":
                answer({"metrics": metrics(llm)})
            elif op == "corrupt":
                answer(corrupt(llm, req))
            else:
                answer({"error": f"unknown op {op}"})
        except Exception as err:  # report to the test, which decides whether dying was expected
            answer({"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
