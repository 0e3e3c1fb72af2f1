"""Shared by both halves: the connector's counter and latency names, hook failures, and the pool guard
(:mod:`maru_pool.guard`, which maru-router uses too) under the names the connector has always read.
"""

from __future__ import annotations

import logging
import sys

# Re-exported: the connector's modules and tests read these here.
from maru_pool.guard import (  # noqa: F401
    POOL_ERRORS,
    POOL_SKIPPED_CALLS,
    Counters,
    PoolGuard,
    RateLimitedLog,
    counters,
    log,
    reset_counters,
)

# Counter names; tests and the benchmark read them through counters().
LOOKUPS = "lookups"
LOOKUP_CHUNKS_HIT = "lookup_chunks_hit"
LOOKUP_HANDOFF_POLLS = "lookup_handoff_polls"
LOOKUP_HANDOFF_SHORT = "lookup_handoff_short"
LOOKUP_HANDOFF_WAITS = "lookup_handoff_waits"  # wait RPCs, each serving every handoff then waiting
HIT_TOKENS = "hit_tokens"
LOADED_CHUNKS = "loaded_chunks"
LOAD_FAILED_CHUNKS = "load_failed_chunks"
CHECKSUM_MISMATCHES = "checksum_mismatches"
SAVED_CHUNKS = "saved_chunks"
SAVE_NOT_LEASED = "save_not_leased"
SAVE_SKIPPED_CHUNKS = "save_skipped_chunks"
SAVE_RETRIES = "save_retries"
SAVE_TAINTED_CHUNKS = "save_tainted_chunks"
HOOK_ERRORS = "hook_errors"
SAVE_BEHIND_CHUNKS = "save_behind_chunks"  # skipped: the save lane was too far behind
LANE_JOBS_DROPPED = "lane_jobs_dropped"  # given up unrun: past their deadline, or dropped

ALL_COUNTERS = (
    LOOKUPS,
    LOOKUP_CHUNKS_HIT,
    LOOKUP_HANDOFF_POLLS,
    LOOKUP_HANDOFF_SHORT,
    LOOKUP_HANDOFF_WAITS,
    HIT_TOKENS,
    LOADED_CHUNKS,
    LOAD_FAILED_CHUNKS,
    CHECKSUM_MISMATCHES,
    SAVED_CHUNKS,
    SAVE_NOT_LEASED,
    SAVE_SKIPPED_CHUNKS,
    SAVE_RETRIES,
    SAVE_TAINTED_CHUNKS,
    POOL_ERRORS,
    POOL_SKIPPED_CALLS,
    HOOK_ERRORS,
    SAVE_BEHIND_CHUNKS,
    LANE_JOBS_DROPPED,
)

# Latencies, in seconds, exported as Prometheus histograms (vllm:maru_connector_<name>).
LOAD_SECONDS = "load_seconds"  # one load job: pin its chunks, copy them into KV blocks, release them
SAVE_SECONDS = "save_seconds"  # one save job: lease its chunks, copy them out of KV blocks, commit them
HANDOFF_WAIT_SECONDS = "handoff_wait_seconds"  # a lookup of a prefill's handoff, from asked to answered

ALL_LATENCIES = (LOAD_SECONDS, SAVE_SECONDS, HANDOFF_WAIT_SECONDS)

# The interpreter's GIL switch interval in engine processes (Python's default is 5 ms).
SWITCH_INTERVAL_S = 0.0005


def shorten_switch_interval() -> None:
    """Let the connector's threads (lookups, load and save lanes) take the GIL back within 0.5 ms.

    vLLM's engine loop keeps the GIL while it spins between steps; a thread coming back from a pool
    call or a copy waits for the holder to be asked to drop it, up to one switch interval (5 ms by
    default) each time, which made a load of 16 chunks take 50 ms instead of 5. Never lengthens it.
    """
    if sys.getswitchinterval() > SWITCH_INTERVAL_S:
        sys.setswitchinterval(SWITCH_INTERVAL_S)


def hook_failed(stats: Counters, hook_log: RateLimitedLog, hook: str, err: BaseException, degraded: str) -> None:
    """A connector hook raised: count it and say, at most every few seconds, what it cost.

    The hook's caller then degrades (no load, no save) instead of letting the error reach vLLM, whose
    engine would die of it. A hook raising is a connector bug, not a pool problem.
    """
    stats.count(HOOK_ERRORS)
    hook_log.warning(
        f"hook:{hook}",
        "maru connector: %s raised %s: %s; %s. The engine keeps serving. This is a connector bug: "
        "report it with this log line",
        hook,
        type(err).__name__,
        err,
        degraded,
        level=logging.ERROR,
        exc=True,
    )
