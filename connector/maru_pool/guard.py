"""The pool guard: counters, rate-limited failure logs, and a pool client whose calls fail soft.

The guard is why a sick pool never hurts its caller (a vLLM engine's connector, maru-router): every pool
call goes through it, any failure becomes "no hit" or "not stored" plus a counter and (at most every few
seconds) one log line, and after a failure the pool is left alone for a short back-off so a hung daemon
costs one timeout, not one per request or per layer.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

from maru_contracts.config import MaruConnectorConfig

# The connector's logger: a child of vLLM's, so an engine's lines land in the engine log with its format
# and level. Other callers (maru-router) hand the guard their own.
log = logging.getLogger("vllm.maru_connector")

T = TypeVar("T")

# The guard's own counters; the connector's other counter names are in maru_connector.vllm.common.
POOL_ERRORS = "pool_errors"
POOL_SKIPPED_CALLS = "pool_skipped_calls"

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


class RateLimitedLog:
    """Logs the first occurrence of each failure kind, then at most once per ``interval_s``."""

    def __init__(self, interval_s: float = 10.0, logger: logging.Logger = log) -> None:
        self._logger = logger
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
        self._logger.log(level, msg, *args, exc_info=exc and last is None)


class PoolGuard:
    """Wraps a lazily created pool client; calls fail soft and back off after a failure."""

    # First and longest pause after a failure; doubles per failure in a row, resets on success.
    BACKOFF_S: tuple[float, float] = (0.25, 4.0)

    def __init__(self, cfg: MaruConnectorConfig, side: str, stats: Counters, logger: logging.Logger = log) -> None:
        self._cfg = cfg
        self._stats = stats
        self._side = side
        self._client = None
        self._min_backoff, self._max_backoff = self.BACKOFF_S
        self._backoff = 0.0
        self._retry_at = 0.0
        self._lock = threading.RLock()
        self.log = RateLimitedLog(logger=logger)

    @property
    def client(self):  # -> maru_pool.PoolClient, imported lazily: the pool may be absent
        if self._client is None:
            from maru_pool import PoolClient

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
