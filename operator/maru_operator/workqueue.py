"""A per-object work queue, as controller-runtime has: events only say *which* object to look at.

kopf delivers the watch events; they can arrive for an owner, for any of its children, or for the pool
a group is bound to, often in bursts. Each one only enqueues the owner's key. The queue guarantees that
one key is never reconciled twice at once, collapses repeated adds while a key waits, and retries
failures with per-key exponential backoff. ``kopf.TemporaryError(delay=…)`` from a reconcile means
"look again in ``delay`` seconds"; ``kopf.PermanentError`` means "wait for the next change".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Hashable

import kopf

from maru_operator import metrics

log = logging.getLogger("maru_operator.workqueue")

Reconcile = Callable[[Hashable], Awaitable[float | None]]


class WorkQueue:
    def __init__(self, reconcile: Reconcile, *, workers: int = 8, max_backoff: float = 60.0) -> None:
        self._reconcile = reconcile
        self._workers = workers
        self._max_backoff = max_backoff
        self._queue: asyncio.Queue[Hashable] = asyncio.Queue()
        self._waiting: set[Hashable] = set()
        self._running: set[Hashable] = set()
        self._dirty: set[Hashable] = set()
        self._timers: dict[Hashable, asyncio.TimerHandle] = {}
        self._failures: dict[Hashable, int] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.processed = 0

    def add(self, key: Hashable, delay: float = 0.0) -> None:
        """Reconcile ``key`` soon (or after ``delay`` seconds; the earliest request wins)."""
        if delay > 0:
            loop = asyncio.get_running_loop()
            due = loop.time() + delay
            timer = self._timers.get(key)
            if timer is not None and timer.when() <= due:
                return
            if timer is not None:
                timer.cancel()
            self._timers[key] = loop.call_at(due, self._fire, key)
            return
        if key in self._running:
            self._dirty.add(key)
        elif key not in self._waiting:
            self._waiting.add(key)
            self._queue.put_nowait(key)
            metrics.QUEUE_DEPTH.set(len(self._waiting))

    def _fire(self, key: Hashable) -> None:
        self._timers.pop(key, None)
        self.add(key)

    def idle(self) -> bool:
        return not self._waiting and not self._running and not self._dirty

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._work(), name=f"maru-worker-{i}") for i in range(self._workers)]

    async def stop(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def _work(self) -> None:
        while True:
            key = await self._queue.get()
            self._waiting.discard(key)
            metrics.QUEUE_DEPTH.set(len(self._waiting))
            self._running.add(key)
            started = time.monotonic()
            kind = key[0] if isinstance(key, tuple) else "?"
            delay: float | None = None
            try:
                delay = await self._reconcile(key)
                self._failures.pop(key, None)
                metrics.RECONCILES.labels(kind, "ok").inc()
            except kopf.TemporaryError as err:
                delay = float(err.delay or 10)
                metrics.RECONCILES.labels(kind, "waiting").inc()
                log.info("%s %s: %s; looking again in %.0fs", kind, _name(key), err, delay)
            except kopf.PermanentError as err:
                metrics.RECONCILES.labels(kind, "invalid").inc()
                log.warning("%s %s: %s; waiting for the object to change", kind, _name(key), err)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # one bad object must not stop the others
                count = self._failures[key] = self._failures.get(key, 0) + 1
                delay = min(self._max_backoff, 0.5 * 2 ** (count - 1))
                metrics.RECONCILES.labels(kind, "error").inc()
                log.warning(
                    "%s %s: reconcile failed (attempt %d), retrying in %.1fs: %s",
                    kind,
                    _name(key),
                    count,
                    delay,
                    err,
                    exc_info=count >= 5,
                )
            finally:
                metrics.RECONCILE_SECONDS.labels(kind).observe(time.monotonic() - started)
                self._running.discard(key)
                self.processed += 1
                if key in self._dirty:
                    self._dirty.discard(key)
                    self.add(key)
            if delay:
                self.add(key, delay)


def _name(key: Hashable) -> str:
    if isinstance(key, tuple) and len(key) == 3:
        return f"{key[1]}/{key[2]}" if key[1] else str(key[2])
    return str(key)
