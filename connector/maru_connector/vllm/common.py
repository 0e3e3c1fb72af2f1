"""Shared by both halves: counters, rate-limited failure logs, and the pool guard.

The guard is why a sick pool never hurts the engine: every pool call goes through it, any failure
becomes "no hit" or "not stored" plus a counter and (at most every few seconds) one log line, and
after a failure the pool is left alone for a short back-off so a hung daemon costs one timeout,
not one per request or per layer.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

from maru_connector.config import MaruConnectorConfig

# A child of vLLM's logger, so lines land in the engine log with its format and level.
log = logging.getLogger("vllm.maru_connector")

T = TypeVar("T")

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
POOL_ERRORS = "pool_errors"
POOL_SKIPPED_CALLS = "pool_skipped_calls"
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

_counters: Counter[str] = Counter()
_counters_lock = threading.Lock()


def counters() -> dict[str, int]:
    """A snapshot of this process's connector counters (both halves when they share a process)."""
    with _counters_lock:
        return dict(_counters)


def reset_counters() -> None:
    with _counters_lock:
        _counters.clear()


class Counters:
    """One half's counters and latencies: what it reports to vLLM's stats (deltas) and to :func:`counters`."""

    def __init__(self) -> None:
        self._pending: Counter[str] = Counter()
        self._samples: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    def count(self, name: str, n: int = 1) -> None:
        if not n:
            return
        with self._lock:
            self._pending[name] += n
        with _counters_lock:
            _counters[name] += n

    def observe(self, name: str, seconds: float) -> None:
        """One latency sample of ``name`` (one of ALL_LATENCIES)."""
        with self._lock:
            self._samples.setdefault(name, []).append(seconds)

    def take(self) -> dict[str, int | list[float]]:
        """Counts and latency samples since the last call (vLLM pulls these once per step and merges them)."""
        with self._lock:
            out: dict[str, int | list[float]] = {**self._pending, **self._samples}
            self._pending, self._samples = Counter(), {}
        return out


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


class RateLimitedLog:
    """Logs the first occurrence of each failure kind, then at most once per ``interval_s``."""

    def __init__(self, interval_s: float = 10.0) -> None:
        self._interval = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: Counter[str] = Counter()
        self._lock = threading.Lock()

    def warning(self, kind: str, msg: str, *args: object, level: int = logging.WARNING, exc: bool = False) -> None:
        """Log now unless ``kind`` was logged less than ``interval_s`` ago; ``exc`` adds the traceback
        (only to the first line of a kind: the rest would repeat it)."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self._interval:
                self._suppressed[kind] += 1
                return
            self._last[kind] = now
            n = self._suppressed.pop(kind, 0)
        if n:
            msg += " (%d similar since the last report)"
            args = (*args, n)
        log.log(level, msg, *args, exc_info=exc and last is None)


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


class PoolGuard:
    """Wraps a lazily created pool client; calls fail soft and back off after a failure."""

    # First and longest pause after a failure; doubles per failure in a row, resets on success.
    BACKOFF_S: tuple[float, float] = (0.25, 4.0)

    def __init__(self, cfg: MaruConnectorConfig, side: str, stats: Counters) -> None:
        self._cfg = cfg
        self._stats = stats
        self._side = side
        self._client = None
        self._min_backoff, self._max_backoff = self.BACKOFF_S
        self._backoff = 0.0
        self._retry_at = 0.0
        self._lock = threading.RLock()
        self.log = RateLimitedLog()

    @property
    def client(self):  # -> maru_connector.pool.PoolClient, imported lazily: the pool may be absent
        if self._client is None:
            from maru_connector.pool import PoolClient

            self._client = PoolClient(
                self._cfg.pool_url,
                timeout_s=self._cfg.rpc_timeout_ms / 1000,
                token_file=self._cfg.pool_token_file or None,
            )
        return self._client

    def call(self, what: str, fn: Callable[..., T], *args: object) -> tuple[bool, T | None]:
        """Run ``fn(client, *args)``; ``(True, result)``, or ``(False, None)`` after logging.

        Calls from several threads (the worker's load and save lanes) take turns, so a hung pool
        costs one timeout: whoever waited behind it finds the back-off already set.
        """
        with self._lock:
            if self._retry_at and time.monotonic() < self._retry_at:
                self._stats.count(POOL_SKIPPED_CALLS)
                return False, None
            try:
                result = fn(self.client, *args)
            except Exception as err:  # never into vLLM: any failure is a miss or a skipped store
                self.failed(what, err)
                return False, None
            self._backoff = 0.0
            self._retry_at = 0.0
            return True, result

    def backing_off(self) -> bool:
        """Whether calls are being skipped after a failure (the pool is dead or hung)."""
        return bool(self._retry_at) and time.monotonic() < self._retry_at

    def failed(self, what: str, err: BaseException) -> None:
        self._stats.count(POOL_ERRORS)
        full = type(err).__name__ == "PoolFull"
        if not full:
            # A full pool answers fast, so it needs no back-off; a dead or hung one does.
            self._backoff = min(self._max_backoff, max(self._min_backoff, self._backoff * 2))
            self._retry_at = time.monotonic() + self._backoff
        self.log.warning(
            f"{self._side}:{type(err).__name__}",
            "maru pool %s failed on the %s side (%s: %s); treating as %s",
            what,
            self._side,
            type(err).__name__,
            err,
            "not stored" if what.startswith("save") else "a miss",
        )

    def close(self) -> None:
        if self._client is not None:
            # Closing a broken client must not fail engine shutdown.
            with contextlib.suppress(Exception):
                self._client.close()
            self._client = None
