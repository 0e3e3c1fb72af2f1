"""A background lane for the worker half: runs copy jobs in order, off the engine's thread.

The worker hands a step's loads to one lane and its saves to another, and returns to vLLM at
once; each job's result is collected on a later step (``take_done``). Jobs name the requests
whose blocks they touch, so the worker can wait for exactly those before vLLM reuses the blocks
(a preempted request's blocks go back to the free list at once).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from maru_connector.vllm import common


@dataclass
class Job:
    """One unit of work; ``run`` returns the result handed back by :meth:`Lane.take_done`."""

    run: Callable[[], Any]
    req_ids: frozenset[str]
    # Called with the exception instead of a result when ``run`` raises (a connector bug).
    on_error: Callable[[BaseException], Any]
    result: Any = field(default=None, init=False)


class Lane:
    """One thread, one FIFO queue of jobs."""

    def __init__(self, name: str, hook_log: common.RateLimitedLog, stats: common.Counters) -> None:
        self._name = name
        self._hook_log = hook_log
        self._stats = stats
        self._queue: deque[Job] = deque()
        self._running: Job | None = None
        self._done: list[Job] = []
        self._cv = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=f"maru-{name}", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cv:
            self._queue.append(job)
            self._cv.notify_all()

    def take_done(self) -> list[Any]:
        """Results of the jobs finished since the last call, in the order they were submitted."""
        with self._cv:
            done, self._done = self._done, []
        return [job.result for job in done]

    def busy_with(self, req_ids: Iterable[str]) -> set[str]:
        """Which of ``req_ids`` have a job queued or running."""
        wanted = set(req_ids)
        with self._cv:
            jobs = [*self._queue, *([self._running] if self._running is not None else [])]
        return {r for job in jobs for r in job.req_ids & wanted}

    def wait_for(self, req_ids: Iterable[str] | None = None) -> None:
        """Block until no job touching ``req_ids`` (every job, when None) is queued or running."""
        wanted = None if req_ids is None else set(req_ids)
        with self._cv:
            while True:
                jobs = [*self._queue, *([self._running] if self._running is not None else [])]
                if not any(wanted is None or job.req_ids & wanted for job in jobs):
                    return
                self._cv.wait()

    def close(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stopped:
                    self._cv.wait()
                if not self._queue:
                    return
                job = self._running = self._queue.popleft()
            try:
                job.result = job.run()
            except BaseException as err:  # a bug in a job degrades that job, never the lane
                common.hook_failed(self._stats, self._hook_log, f"{self._name} lane", err, "its work is given up")
                job.result = job.on_error(err)
            with self._cv:
                self._running = None
                self._done.append(job)
                self._cv.notify_all()
