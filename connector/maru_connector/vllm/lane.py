"""A background lane for the worker half: runs copy jobs in order, off the engine's thread.

The worker hands a step's loads to one lane and its saves to another, and returns to vLLM at
once; each job's result is collected on a later step (``take_done``). Jobs name the requests
whose blocks they touch, so the worker can wait for exactly those before vLLM reuses the blocks
(a preempted request's blocks go back to the free list at once).

Work is bounded: the worker asks how far behind a lane is (``queued``) and skips work rather than
queue it without end; a job carries a deadline past which it is given up unrun (its ``on_error``
answers for it); a job not yet started can be dropped (``drop``); and ``wait_for`` takes a timeout.

On a GPU the lane's thread works on the rank's device (``use_device``): a new thread's current device is
GPU 0, and its first stream switch would open a CUDA context there (0.3-0.5 GiB) on every rank, after
vLLM sized its KV cache. vLLM's own threads set their device for the same reason.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from maru_connector.vllm import common


class JobDropped(Exception):
    """Handed to ``on_error`` for a job given up before it ran (past its deadline, or dropped)."""


@dataclass
class Job:
    """One unit of work; ``run`` returns the result handed back by :meth:`Lane.take_done`."""

    run: Callable[[], Any]
    req_ids: frozenset[str]
    # Called with the exception instead of a result when ``run`` raises (a connector bug) or the job
    # is given up unrun (JobDropped); what it returns is the job's result.
    on_error: Callable[[BaseException], Any]
    # time.monotonic() after which the job is given up instead of started (None: never).
    deadline: float | None = None
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
        self._device: torch.device | None = None  # what use_device asked for
        self._bound: torch.device | None = None  # what the thread has set (touched by the thread only)
        self._thread = threading.Thread(target=self._loop, name=f"maru-{name}", daemon=True)
        self._thread.start()

    def use_device(self, device: torch.device) -> None:
        """Make ``device`` (the KV cache's) the thread's current CUDA device before its next job runs."""
        with self._cv:
            self._device = device

    def submit(self, job: Job) -> None:
        with self._cv:
            self._queue.append(job)
            self._cv.notify_all()

    def queued(self) -> int:
        """Jobs waiting behind the running one: how far behind the lane is."""
        with self._cv:
            return len(self._queue)

    def take_done(self) -> list[Any]:
        """Results of the jobs finished since the last call, in the order they were submitted.

        A job whose ``on_error`` raised has no result and is left out.
        """
        with self._cv:
            done, self._done = self._done, []
        return [job.result for job in done if job.result is not None]

    def busy_with(self, req_ids: Iterable[str]) -> set[str]:
        """Which of ``req_ids`` have a job queued or running."""
        wanted = set(req_ids)
        with self._cv:
            jobs = [*self._queue, *([self._running] if self._running is not None else [])]
        return {r for job in jobs for r in job.req_ids & wanted}

    def drop(self, req_ids: Iterable[str]) -> int:
        """Give up the queued (not started) jobs touching ``req_ids`` now; returns how many.

        A job not started has read nothing, so nothing needs waiting for; its ``on_error`` answers
        for it here, and its result is collected with the others.
        """
        wanted = set(req_ids)
        with self._cv:
            dropped = [job for job in self._queue if job.req_ids & wanted]
            for job in dropped:
                self._queue.remove(job)
        for job in dropped:
            job.result = self._give_up(job, JobDropped(f"{self._name}: dropped before it ran"))
        with self._cv:
            self._done.extend(dropped)
            self._cv.notify_all()
        return len(dropped)

    def wait_for(self, req_ids: Iterable[str] | None = None, timeout: float | None = None) -> bool:
        """Block until no job touching ``req_ids`` (every job, when None) is queued or running.

        False when ``timeout`` seconds passed first.
        """
        wanted = None if req_ids is None else set(req_ids)
        until = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while True:
                jobs = [*self._queue, *([self._running] if self._running is not None else [])]
                if not any(wanted is None or job.req_ids & wanted for job in jobs):
                    return True
                left = None if until is None else until - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)

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
                job.result = self._run(job)
            finally:
                with self._cv:
                    self._running = None
                    self._done.append(job)
                    self._cv.notify_all()

    def _run(self, job: Job) -> Any:
        """The job's result; whatever goes wrong degrades that job, never the lane."""
        if job.deadline is not None and time.monotonic() > job.deadline:
            return self._give_up(job, JobDropped(f"{self._name}: past its deadline before it ran"))
        try:
            self._bind_device()
            return job.run()
        except BaseException as err:
            common.hook_failed(self._stats, self._hook_log, f"{self._name} lane", err, "its work is given up")
            return self._on_error(job, err)

    def _bind_device(self) -> None:
        """Before any stream or event of the job: set the rank's device as this thread's current one."""
        with self._cv:
            device = self._device
        if device is not None and device.type == "cuda" and device != self._bound:
            torch.cuda.set_device(device)
            self._bound = device

    def _give_up(self, job: Job, why: JobDropped) -> Any:
        self._stats.count(common.LANE_JOBS_DROPPED)
        return self._on_error(job, why)

    def _on_error(self, job: Job, err: BaseException) -> Any:
        try:
            return job.on_error(err)
        except BaseException as again:
            what = f"{self._name} lane (on_error)"
            common.hook_failed(self._stats, self._hook_log, what, again, "its outcome is lost")
            return None
