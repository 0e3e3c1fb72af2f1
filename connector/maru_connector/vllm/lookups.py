"""Pool lookups off the engine core: one background thread answers them, the scheduler never waits.

vLLM asks the scheduler half how much of a waiting request the pool holds every time it considers
the request, on the engine-core thread that also runs every step. A synchronous RPC there stalls
every running request for as long as the pool takes to answer (the RPC timeout when it hangs).
Instead the first ask queues the lookup here and answers ``None`` ("ask again"); vLLM skips the
request for that step and asks again later, by which time the answer is usually in. Each prompt is
looked up once: the answer is kept for the request's life (a stale answer only costs a failed load,
which vLLM recomputes).

A lookup may also *wait for a handoff*: a decode request carries the number of chunks its prefill
had stored or was storing when it answered (``kv_transfer_params``), and prefill commits
asynchronously, so the decode's lookup waits until the pool holds that many leading chunks, or
until a deadline, and then answers with what it found. The waiting is the daemon's: a second thread,
on a connection of its own, sends every pending handoff in one ``wait`` request that the daemon
answers when a commit completes one of them (or after :data:`WAIT_SLICE_S`, to take in handoffs that
came in meanwhile), so 200 waiting decodes cost a few RPCs, not 200 poll loops on the lookup thread.
A daemon too old for ``wait`` is polled instead.

Each lookup and wait tells the daemon who reads (``reader``: role and chunk geometry) and which handoff it
waits for, so the daemon can count decode prompt tokens found in the pool vs computed, and handoffs that
timed out (``maru_pool.readers``). A handoff is settled on the daemon's word only: when its keys
are there, or after the wait marked ``final`` (the one its deadline falls in), so the daemon counts each
handoff once, as this side does.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from dataclasses import dataclass, field

from maru_connector.vllm import common
from maru_pool.readers import Reader

# Polls of a lookup that waits for a handoff start this far apart and double up to the maximum.
POLL_FIRST_S = 0.001
POLL_MAX_S = 0.02
# A wait request covers the handoffs pending when it was sent; one arriving later joins the next.
WAIT_SLICE_S = 0.05


@dataclass(order=True)
class _Job:
    due: float
    seq: int
    req_id: str = field(compare=False)
    keys: list[bytes] = field(compare=False)
    expect: int = field(compare=False)  # leading chunks a handoff promised (0: none)
    deadline: float = field(compare=False)
    poll_s: float = field(compare=False, default=POLL_FIRST_S)
    asked: float = field(compare=False, default=0.0)  # when the engine asked (due moves with polls)


class AsyncLookups:
    """Answers ``lookup_prefix`` for the scheduler half on a thread of its own.

    ``tp_size`` divides the pool's answer: every chunk has one key per TP rank, and a chunk is a hit
    only when every rank's key is.
    """

    def __init__(
        self,
        guard: common.PoolGuard,
        stats: common.Counters,
        *,
        tp_size: int,
        wait_guard: common.PoolGuard | None = None,
        reader: Reader | None = None,
    ) -> None:
        """``wait_guard``: a guard of its own (its own connection) for handoff waits; None: poll.
        ``reader``: who this engine is to the daemon's reader counters (None: it does not say)."""
        self._guard = guard
        self._reader = reader
        self._wait_guard = wait_guard
        self._daemon_waits = wait_guard is not None  # False once the daemon turns out too old for ``wait``
        self._stats = stats
        self._tp_size = tp_size
        self._jobs: list[_Job] = []  # heap by due time
        self._results: dict[str, int] = {}  # req_id -> leading chunks the pool holds
        self._wanted: dict[str, int] = {}  # req_id -> seq of its queued or running lookup
        self._waiting: dict[str, _Job] = {}  # req_id -> handoff lookup left to the daemon's wait
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="maru-lookups", daemon=True)
        self._thread.start()
        self._waiter: threading.Thread | None = None
        if wait_guard is not None:
            self._waiter = threading.Thread(target=self._wait_loop, name="maru-handoffs", daemon=True)
            self._waiter.start()

    def submit(self, req_id: str, keys: list[bytes], *, expect: int = 0, wait_s: float = 0.0) -> None:
        """Queue a lookup of ``keys`` (in the pool's lookup order); replaces an earlier one for ``req_id``."""
        now = time.monotonic()
        job = _Job(now, next(self._seq), req_id, keys, expect, now + (wait_s if expect else 0.0), asked=now)
        with self._cv:
            self._results.pop(req_id, None)
            self._wanted[req_id] = job.seq
            heapq.heappush(self._jobs, job)
            self._cv.notify_all()  # two threads wait on it: wake the lookup thread for sure

    def result(self, req_id: str) -> int | None:
        """Leading chunks found for ``req_id``, or None while its lookup has not finished."""
        with self._cv:
            return self._results.get(req_id)

    def forget(self, req_id: str) -> None:
        with self._cv:
            self._results.pop(req_id, None)
            self._wanted.pop(req_id, None)
            self._waiting.pop(req_id, None)

    def close(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._thread.join(timeout=5)
        if self._waiter is not None:
            self._waiter.join(timeout=5)
        if self._wait_guard is not None:
            self._wait_guard.close()

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and (not self._jobs or self._jobs[0].due > time.monotonic()):
                    self._cv.wait(timeout=self._jobs[0].due - time.monotonic() if self._jobs else None)
                if self._stopped:
                    return
                job = heapq.heappop(self._jobs)
                if self._wanted.get(job.req_id) != job.seq:
                    continue  # forgotten or replaced while queued
            try:
                self._lookup(job)
            except Exception as err:  # a bug here must not kill the thread: the request becomes a miss
                self._guard.failed("lookup", err)
                self._answer(job, 0)

    def _lookup(self, job: _Job) -> None:
        # Decided before asking: a handoff the daemon was told this reader waits for is always waited for,
        # so the daemon's count of handoff waits and timeouts matches what happens here.
        will_wait = bool(job.expect) and time.monotonic() < job.deadline
        # A reader that polls (an older daemon) is not counted: its every poll would look like a new lookup.
        reader = self._reader if self._daemon_waits else None
        handoff = job.expect * self._tp_size if will_wait else 0
        ok, n = self._guard.call("lookup", lambda c, ks: c.lookup_prefix(ks, reader=reader, handoff=handoff), job.keys)
        chunks = (n or 0) // self._tp_size if ok else 0
        now = time.monotonic()
        if ok and chunks < job.expect and will_wait:
            # The prefill that promised these chunks is still committing them.
            if self._daemon_waits:
                with self._cv:  # the daemon answers when they commit (see _wait_loop)
                    if self._wanted.get(job.req_id) == job.seq:
                        self._waiting[job.req_id] = job
                        self._cv.notify_all()
                return
            self._stats.count(common.LOOKUP_HANDOFF_POLLS)  # a daemon too old to wait: look again shortly
            job.due, job.poll_s = now + job.poll_s, min(POLL_MAX_S, job.poll_s * 2)
            with self._cv:
                if self._wanted.get(job.req_id) == job.seq:
                    heapq.heappush(self._jobs, job)
            return
        if job.expect and chunks < job.expect:
            self._stats.count(common.LOOKUP_HANDOFF_SHORT)
        self._answer(job, chunks)

    def _wait_loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and not self._waiting:
                    self._cv.wait()
                if self._stopped:
                    return
                jobs = list(self._waiting.values())
            try:
                self._wait_once(jobs)
            except Exception as err:  # a bug here must not kill the thread: these requests become misses
                self._guard.failed("handoff-wait", err)
                for job in jobs:
                    self._settle_wait(job, 0)

    def _wait_once(self, jobs: list[_Job]) -> None:
        """One ``wait`` request for every pending handoff; answers the ones it completes or ends."""
        assert self._wait_guard is not None
        sent = time.monotonic()
        slice_s = max(0.0, min(WAIT_SLICE_S, min(job.deadline for job in jobs) - sent))
        # The waits given up after this one, whatever it finds: their deadline falls within it.
        final = [i for i, job in enumerate(jobs) if job.deadline - sent <= slice_s]
        items = [(job.keys, job.expect * self._tp_size) for job in jobs]
        self._stats.count(common.LOOKUP_HANDOFF_WAITS)
        ok, found = self._wait_guard.call(
            "handoff-wait", lambda c, its: c.wait_prefixes(its, slice_s, reader=self._reader, final=final), items
        )
        if ok and found is None:
            # A daemon that predates ``wait``: back to polling, on the lookup thread, for good.
            common.log.info("maru pool daemon has no wait op (older release): handoffs are polled")
            with self._cv:
                self._daemon_waits, moved = False, [j for j in jobs if self._waiting.pop(j.req_id, None) is j]
                for job in moved:
                    job.due = time.monotonic()
                    heapq.heappush(self._jobs, job)
                self._cv.notify_all()
            return
        last = set(final)
        for i, (job, n) in enumerate(zip(jobs, found if ok and found is not None else [0] * len(jobs), strict=True)):
            chunks = n // self._tp_size
            # A wait past its deadline but not marked final goes once more, with no time left, marked final.
            if not ok or chunks >= job.expect or i in last:
                self._settle_wait(job, chunks)

    def _settle_wait(self, job: _Job, chunks: int) -> None:
        with self._cv:
            if self._waiting.get(job.req_id) is not job:
                return  # forgotten meanwhile
            del self._waiting[job.req_id]
        if chunks < job.expect:
            self._stats.count(common.LOOKUP_HANDOFF_SHORT)
        self._answer(job, chunks)

    def _answer(self, job: _Job, chunks: int) -> None:
        if job.expect:
            self._stats.observe(common.HANDOFF_WAIT_SECONDS, time.monotonic() - job.asked)
        with self._cv:
            if self._wanted.get(job.req_id) == job.seq:
                del self._wanted[job.req_id]
                self._results[job.req_id] = chunks
