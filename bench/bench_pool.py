"""Pool throughput and lookup latency through the real client against a real ``maru-pool serve``.

Store and load of chunk-sized payloads (K and V of 256 tokens for 2 and 32 layers of a model with
8 KV heads of 128 dims in bf16, i.e. 1 MiB per layer) are compared with a plain memcpy of the same
bytes in this process: through the compiled one-pass copy+checksum (``maru_pool._copyhash``)
and, as "before", through the Python path it replaced (``copyhash.use_native(False)``: copy, then
xxhash, 1 MiB at a time). The worker-level figure moves whole chunks between engine-like CPU KV
tensors (per-layer views over one buffer, as vLLM allocates them) and the pool the way a CPU worker
does, by page address (``PagedKV.segments``), and, as "before", through the staging copy. Then
``lookup_prefix`` latency for 32, 128 and 512 keys. Figures are merged into ``bench/results.json``
under ``"pool"``.

Run: ``python bench/bench_pool.py``
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "connector"))

from results import merge_results  # noqa: E402

from maru_pool import PoolClient, copyhash  # noqa: E402

if TYPE_CHECKING:
    import torch

    from maru_connector.layout import PagedKV

MiB = 1 << 20
LAYER_BYTES = 2 * 256 * 8 * 128 * 2  # K and V, 256 tokens, 8 KV heads x 128 dims, bf16: 1 MiB
CHUNKS = {"2-layer": 2 * LAYER_BYTES, "32-layer": 32 * LAYER_BYTES}
BATCH_BYTES = 64 * MiB  # bytes moved per timed batch
KV_BLOCK_TOKENS = 16  # vLLM's default block size
CHUNK_TOKENS = 256
POOL_SIZE = 256 * MiB


def best_rates(nbytes: int, fns: dict[str, Callable[[], float | None]], repeats: int) -> dict[str, float]:
    """GB/s of each function's best run. Rounds interleave the functions, so a busy spell on a shared
    machine hits the baseline and the pool alike instead of skewing their ratio. A function that returns
    the seconds it spent copying (between its pool calls) also gets ``<name>_copy``: the copy alone."""
    best: dict[str, float] = {}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            copy_s = fn()
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
            if copy_s is not None:
                best[f"{name}_copy"] = min(best.get(f"{name}_copy", float("inf")), copy_s)
    return {name: nbytes / t / 1e9 for name, t in best.items()}


def python_path(fn: Callable[[], float | None]) -> Callable[[], float | None]:
    """``fn`` on the copy-then-hash Python path the compiled module replaced."""

    def run() -> float | None:
        previous = copyhash.use_native(False)
        try:
            return fn()
        finally:
            copyhash.use_native(previous)

    return run


def start_daemon(workdir: Path) -> tuple[subprocess.Popen[str], str]:
    env = dict(os.environ, PYTHONPATH=str(HERE.parent / "connector"))
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "maru_pool", "serve",
            "--listen", f"unix://{workdir}/pool.sock", "--size", str(POOL_SIZE),
            "--shm-path", f"/dev/shm/maru-bench-{os.getpid()}", "--metrics-addr", "127.0.0.1:0",
            "--log-level", "WARNING",
        ],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("maru-pool ready"):
        proc.kill()
        raise SystemExit(f"maru-pool did not start: {line!r}")
    fields = dict(kv.split("=", 1) for kv in line.split()[2:])
    return proc, fields["listen"]


def bench_chunks(client: PoolClient, name: str, size: int, repeats: int) -> dict[str, float]:
    count = max(2, BATCH_BYTES // size)
    payloads = [os.urandom(size) for _ in range(count)]
    outs = [bytearray(size) for _ in range(count)]
    total = size * count
    round_ = [0]

    def keys() -> list[bytes]:
        return [f"{name}/{round_[0]}/{i}".encode().ljust(32, b"\0") for i in range(count)]

    def memcpy() -> None:
        for src, dst in zip(payloads, outs, strict=True):
            memoryview(dst)[:] = src

    def store() -> float:
        round_[0] += 1  # fresh keys each run; older rounds are evicted, so pages are warm and reused
        leases = client.begin_write_many([(k, size) for k in keys()])
        t0 = time.perf_counter()
        for lease, src in zip(leases, payloads, strict=True):
            assert lease is not None
            lease.fill(src)
        copy_s = time.perf_counter() - t0
        assert all(client.commit_many(leases))
        return copy_s

    def store_put() -> None:
        round_[0] += 1
        for k, src in zip(keys(), payloads, strict=True):
            client.put(k, src)

    def load() -> float:
        pins = client.open_read_many(keys())
        try:
            t0 = time.perf_counter()
            for pin, dst in zip(pins, outs, strict=True):
                assert pin is not None
                pin.read_into(dst)
            return time.perf_counter() - t0
        finally:
            client.release_many([p for p in pins if p is not None])

    def load_get() -> None:
        for k, dst in zip(keys(), outs, strict=True):
            assert client.get_into(k, dst)

    # Cycle through the whole pool once first: this process's first touch of each shm page is a page
    # fault, paid once per client lifetime, which would otherwise dominate the first rounds.
    memcpy()
    for _ in range(POOL_SIZE // total + 1):
        store()
    load()
    # Each load reads the keys of the store just before it, so the order within a round matters.
    fns = {
        "memcpy": memcpy,
        "store": store,
        "load": load,
        "store_python": python_path(store),
        "load_python": python_path(load),
        "put": store_put,
        "get": load_get,
    }
    rates = best_rates(total, fns, repeats)
    copy_rate = rates["memcpy"]
    return {
        "chunk_bytes": size,
        "chunks_per_batch": count,
        "memcpy_gbps": round(copy_rate, 2),
        "store_batched_gbps": round(rates["store"], 2),
        "load_batched_gbps": round(rates["load"], 2),
        "store_put_gbps": round(rates["put"], 2),
        "load_get_into_gbps": round(rates["get"], 2),
        "store_vs_memcpy": round(rates["store"] / copy_rate, 2),
        "load_vs_memcpy": round(rates["load"] / copy_rate, 2),
        "store_copy_vs_memcpy": round(rates["store_copy"] / copy_rate, 2),
        "load_copy_vs_memcpy": round(rates["load_copy"] / copy_rate, 2),
        "before_store_gbps": round(rates["store_python"], 2),
        "before_load_gbps": round(rates["load_python"], 2),
        "before_store_vs_memcpy": round(rates["store_python"] / copy_rate, 2),
        "before_load_vs_memcpy": round(rates["load_python"] / copy_rate, 2),
    }


def engine_kv(layers: int, blocks: int) -> tuple[torch.Tensor, PagedKV]:
    """CPU KV tensors as vLLM 0.32 allocates them: one buffer, one ``[blocks, heads, tokens, 2*dim]`` bf16
    view per layer (LBHNC: layer-major, dense pages), described by the connector's own layout code."""
    import torch

    from maru_connector.layout import describe_kv_caches

    heads, dim = 8, 128
    buffer = torch.empty(layers * blocks * heads * KV_BLOCK_TOKENS * 2 * dim, dtype=torch.bfloat16)
    buffer.view(torch.int16).random_(-(1 << 15), 1 << 15)
    per_layer = buffer.view(layers, blocks, heads, KV_BLOCK_TOKENS, 2 * dim)
    views = {f"model.layers.{i}.self_attn.attn": per_layer[i] for i in range(layers)}
    paged = describe_kv_caches(
        views, num_blocks=blocks, block_size=KV_BLOCK_TOKENS, num_kv_heads=heads, head_size=dim, backend="CPU_ATTN"
    )
    return buffer, paged


def bench_worker(client: PoolClient, repeats: int) -> dict[str, float]:
    """Chunks of a 32-layer model between a prefill engine's KV cache and a decode engine's, through the pool."""
    import torch

    # One torch thread: every copy compared here runs on one core, and OpenMP workers spinning on a busy
    # machine would make the staging path ("before") look many times slower than it is.
    torch.set_num_threads(1)
    layers, per_chunk, chunks = 32, CHUNK_TOKENS // KV_BLOCK_TOKENS, 2
    blocks = per_chunk * chunks
    src_buffer, src = engine_kv(layers, blocks)
    dst_buffer, dst = engine_kv(layers, blocks)
    assert src.direct and dst.direct
    chunk_bytes = src.geometry(per_chunk).chunk_bytes
    total = chunk_bytes * chunks
    heap = bytearray(src_buffer.numel() * src_buffer.element_size())
    staging = torch.empty(chunk_bytes, dtype=torch.uint8)
    # Decode puts the blocks elsewhere than prefill had them.
    save_ids = [list(range(c * per_chunk, (c + 1) * per_chunk)) for c in range(chunks)]
    load_ids = [list(reversed(ids)) for ids in reversed(save_ids)]
    round_ = [0]

    def keys() -> list[bytes]:
        return [f"worker/{round_[0]}/{c}".encode().ljust(32, b"\0") for c in range(chunks)]

    def memcpy() -> None:
        memoryview(heap)[:] = src_buffer.view(torch.uint8).numpy()

    def save(direct: bool) -> Callable[[], float]:
        def run() -> float:
            round_[0] += 1
            leases = client.begin_write_many([(k, chunk_bytes) for k in keys()])
            t0 = time.perf_counter()
            for lease, ids in zip(leases, save_ids, strict=True):
                assert lease is not None
                if direct:
                    lease.fill_segments(src.segments(ids))
                else:
                    src.gather(ids, src.chunk_view(staging, per_chunk))
                    lease.fill(staging.numpy())
            copy_s = time.perf_counter() - t0
            assert all(client.commit_many(leases))
            return copy_s

        return run

    def load(direct: bool) -> Callable[[], float]:
        def run() -> float:
            pins = client.open_read_many(keys())
            try:
                t0 = time.perf_counter()
                for pin, ids in zip(pins, load_ids, strict=True):
                    assert pin is not None
                    if direct:
                        pin.read_segments(dst.segments(ids))
                    else:
                        pin.read_into(staging.numpy())
                        dst.scatter(dst.chunk_view(staging, per_chunk), list(enumerate(ids)))
                return time.perf_counter() - t0
            finally:
                client.release_many([p for p in pins if p is not None])

        return run

    memcpy()
    for _ in range(POOL_SIZE // total + 1):
        save(True)()
    load(True)()
    fns = {
        "memcpy": memcpy,
        "save": save(True),
        "load": load(True),
        "save_staging": python_path(save(False)),
        "load_staging": python_path(load(False)),
    }
    rates = best_rates(total, fns, repeats)
    # What was timed must also be right: one more direct round trip into a cleared engine, byte for byte.
    dst_buffer.zero_()
    save(True)()
    load(True)()
    # As integers: random bf16 bit patterns include NaNs, which never compare equal.
    by_block_src, by_block_dst = (b.view(torch.int16).view(layers, blocks, -1) for b in (src_buffer, dst_buffer))
    for s_ids, d_ids in zip(save_ids, load_ids, strict=True):
        for i, j in zip(s_ids, d_ids, strict=True):
            assert torch.equal(by_block_src[:, i], by_block_dst[:, j]), f"block {i} did not arrive in block {j}"
    copy_rate = rates["memcpy"]
    return {
        "layers": layers,
        "chunk_bytes": chunk_bytes,
        "chunks_per_batch": chunks,
        "page_bytes": src.block_bytes,
        "memcpy_gbps": round(copy_rate, 2),
        "save_gbps": round(rates["save"], 2),
        "load_gbps": round(rates["load"], 2),
        "save_vs_memcpy": round(rates["save"] / copy_rate, 2),
        "load_vs_memcpy": round(rates["load"] / copy_rate, 2),
        "save_copy_vs_memcpy": round(rates["save_copy"] / copy_rate, 2),
        "load_copy_vs_memcpy": round(rates["load_copy"] / copy_rate, 2),
        "before_save_gbps": round(rates["save_staging"], 2),
        "before_load_gbps": round(rates["load_staging"], 2),
        "before_save_vs_memcpy": round(rates["save_staging"] / copy_rate, 2),
        "before_load_vs_memcpy": round(rates["load_staging"] / copy_rate, 2),
    }


def bench_lookup(client: PoolClient, nkeys: int, calls: int) -> dict[str, float]:
    keys = [f"lookup/{i}".encode().ljust(32, b"\0") for i in range(nkeys)]
    for k in keys:
        client.put(k, b"x")
    assert client.lookup_prefix(keys) == nkeys
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        client.lookup_prefix(keys)
        samples.append((time.perf_counter_ns() - t0) / 1000)
    samples.sort()
    return {
        "keys": nkeys,
        "median_us": round(statistics.median(samples), 1),
        "p99_us": round(samples[int(len(samples) * 0.99) - 1], 1),
    }


def main() -> int:
    repeats = int(os.environ.get("BENCH_REPEATS", "15"))
    with tempfile.TemporaryDirectory(prefix="maru-bench-") as workdir:
        proc, url = start_daemon(Path(workdir))
        try:
            client = PoolClient(url, timeout_s=10.0)
            chunks = {name: bench_chunks(client, name, size, repeats) for name, size in CHUNKS.items()}
            worker = bench_worker(client, repeats)
            lookups = [bench_lookup(client, n, calls=300) for n in (32, 128, 512)]
            client.close()
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print(f"copy+checksum: {copyhash.simd()} path; 'before' is the Python copy-then-xxhash path it replaced\n")
    print("GB/s; x: ratio to memcpy; copy: the copy alone, without the batch's two pool calls\n")
    print(f"{'chunk':<10}{'MiB':>5}{'memcpy':>9}{'store':>8}{'load':>8}{'put':>8}{'get':>8}"
          f"{'store x':>9}{'load x':>8}{'copy x':>8}{'/':>2}{'':<5}{'before x':>10}{'/':>2}")  # fmt: skip
    for name, r in chunks.items():
        print(
            f"{name:<10}{r['chunk_bytes'] / MiB:>5.0f}{r['memcpy_gbps']:>9.2f}{r['store_batched_gbps']:>8.2f}"
            f"{r['load_batched_gbps']:>8.2f}{r['store_put_gbps']:>8.2f}{r['load_get_into_gbps']:>8.2f}"
            f"{r['store_vs_memcpy']:>9.2f}{r['load_vs_memcpy']:>8.2f}"
            f"{r['store_copy_vs_memcpy']:>8.2f} /{r['load_copy_vs_memcpy']:>5.2f}"
            f"{r['before_store_vs_memcpy']:>10.2f} /{r['before_load_vs_memcpy']:>5.2f}"
        )
    w = worker
    print(
        f"\nworker: {w['layers']}-layer CPU KV <-> pool by page address ({w['chunk_bytes'] / MiB:.0f} MiB chunks of "
        f"{w['page_bytes'] // 1024} KiB pages), memcpy {w['memcpy_gbps']:.2f}\n"
        f"  save {w['save_gbps']:.2f} ({w['save_vs_memcpy']:.2f}x, copy {w['save_copy_vs_memcpy']:.2f}x), "
        f"load {w['load_gbps']:.2f} ({w['load_vs_memcpy']:.2f}x, copy {w['load_copy_vs_memcpy']:.2f}x); "
        f"before (staging + Python hash): save {w['before_save_vs_memcpy']:.2f}x, "
        f"load {w['before_load_vs_memcpy']:.2f}x"
    )
    print(f"\n{'lookup_prefix keys':<20}{'median us':>10}{'p99 us':>10}")
    for r in lookups:
        print(f"{r['keys']:<20}{r['median_us']:>10.1f}{r['p99_us']:>10.1f}")
    path = merge_results(
        "pool",
        {
            "chunks": chunks,
            "worker_cpu_kv": worker,
            "lookup_prefix": lookups,
            "simd": copyhash.simd(),
            # The ratios hold up on a quiet machine; on a busy one the pool calls of each batch suffer first.
            "load_average_1m": round(os.getloadavg()[0], 1),
            "cpus": os.cpu_count(),
            "note": "store/load: batched begin_write_many+fill+commit_many and open_read_many+read_into+"
            "release_many; put/get: one chunk per call; memcpy: same bytes, same process, best of interleaved "
            "runs; before_*: the Python copy-then-xxhash path; worker_cpu_kv: save = fill_segments of every "
            "layer's pages (PagedKV.segments), load = read_segments into other blocks of another engine, "
            "before_* = gather/scatter through a staging tensor with the Python path",
        },
    )
    print(f"\nmerged into {path.relative_to(HERE.parent)} under 'pool'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
