"""The connector's counters and latencies in vLLM's stats pipeline: the periodic log line and ``/metrics``.

Each half hands vLLM the counts and latency samples since its last report (``get_kv_connector_stats``);
vLLM merges the workers' and the scheduler's, logs them every interval and feeds them to
:class:`MaruPromMetrics`, which exposes one ``vllm:maru_connector_<name>_total`` counter per counter and
one ``vllm:maru_connector_<name>`` histogram per latency (``load_seconds``, ``save_seconds``,
``handoff_wait_seconds``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from maru_connector.vllm import common

_HELP = {
    common.LOOKUPS: "Prompts looked up in the Maru pool (one round trip each).",
    common.LOOKUP_CHUNKS_HIT: "Leading prompt chunks found in the pool by lookups.",
    common.LOOKUP_HANDOFF_POLLS: "Lookups repeated while a prefill was still committing the chunks it announced.",
    common.LOOKUP_HANDOFF_SHORT: "Lookups that gave up waiting for chunks a prefill announced (deadline passed).",
    common.HIT_TOKENS: "Prompt tokens the engine took from the pool instead of computing them.",
    common.LOADED_CHUNKS: "Chunks copied from the pool into KV blocks.",
    common.LOAD_FAILED_CHUNKS: "Chunks that could not be loaded (missing, unreadable, corrupt); recomputed.",
    common.CHECKSUM_MISMATCHES: "Chunks whose bytes no longer matched their checksum.",
    common.SAVED_CHUNKS: "Chunks stored and committed to the pool.",
    common.SAVE_NOT_LEASED: "Chunks the pool gave no lease for: already stored, being stored elsewhere, or no room.",
    common.SAVE_SKIPPED_CHUNKS: "Chunks not stored because the pool failed, was full or refused the commit.",
    common.SAVE_RETRIES: "Stores tried again after being skipped, while the request still held its blocks.",
    common.SAVE_TAINTED_CHUNKS: "Chunks not stored because they were computed over a load that failed.",
    common.HOOK_ERRORS: "Connector hooks that raised; the engine went on without the pool for that work.",
    common.POOL_ERRORS: "Pool calls that failed (down, slow, full, protocol error).",
    common.POOL_SKIPPED_CALLS: "Pool calls not attempted during the back-off after a failure.",
    common.LOOKUP_HANDOFF_WAITS: "Waits in the pool for chunks a prefill announced (one call serves every "
    "waiting handoff).",
    common.SAVE_BEHIND_CHUNKS: "Chunks not stored because the save lane was too far behind the engine.",
    common.LANE_JOBS_DROPPED: "Pool jobs given up before they ran (past their deadline, or their request went).",
}

_LATENCY_HELP = {
    common.LOAD_SECONDS: "Seconds one load job took: pin its chunks in the pool, copy them into KV blocks, "
    "release them (one job serves the step's requests, or one asynchronous batch).",
    common.SAVE_SECONDS: "Seconds one save job took on the save lane: lease its chunks, copy them out of KV "
    "blocks, commit them.",
    common.HANDOFF_WAIT_SECONDS: "Seconds from a lookup of the chunks a prefill handed off to its answer "
    "(found, or the wait ran out); includes the pool's wait for a prefill still "
    "committing them.",
}
# Pool round trips are sub-millisecond; copies of many chunks and handoff waits (maru_handoff_wait_ms,
# 1 s by default) reach seconds.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class MaruConnectorStats(KVConnectorStats):
    """``data`` is ``counter name -> count`` and ``latency name -> [seconds, ...]`` over one interval."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> MaruConnectorStats:
        merged = dict(self.data)
        for name, value in other.data.items():
            if isinstance(value, list):
                merged[name] = [*merged.get(name, []), *value]
            else:
                merged[name] = merged.get(name, 0) + value
        return MaruConnectorStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        """The log line's figures: the counts, and each latency's mean in milliseconds."""
        out: dict[str, int | float] = {name: self.data[name] for name in common.ALL_COUNTERS if self.data.get(name)}
        for name in common.ALL_LATENCIES:
            samples = self.data.get(name)
            if samples:
                out[f"{name.removesuffix('_seconds')}_avg_ms"] = round(1000 * sum(samples) / len(samples), 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class MaruPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per connector counter and one histogram per latency, labelled per engine like
    vLLM's own."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: create_metric_per_engine(
                self._counter_cls(name=f"vllm:maru_connector_{name}", documentation=_HELP[name], labelnames=labelnames),
                per_engine_labelvalues,
            )
            for name in common.ALL_COUNTERS
        }
        self._histograms = {
            name: create_metric_per_engine(
                self._histogram_cls(
                    name=f"vllm:maru_connector_{name}",
                    documentation=_LATENCY_HELP[name],
                    buckets=list(LATENCY_BUCKETS),
                    labelnames=labelnames,
                ),
                per_engine_labelvalues,
            )
            for name in common.ALL_LATENCIES
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if name in self._histograms:
                histogram = self._histograms[name][engine_idx]
                for seconds in value:
                    histogram.observe(seconds)
            elif (per_engine := self._counters.get(name)) is not None and value:
                per_engine[engine_idx].inc(value)
