"""Is disaggregation working? Decode prompt tokens loaded from the pool vs computed, over a sliding window.

The pool daemons count, per tenant (a group's cache scope), the decode prompt tokens their lookups found and did
not find, and the handoffs decode waited for and gave up on (``maru_pool.readers``): counters since
each daemon's start. Each pool reconcile polls the daemons' ``/status`` anyway; :class:`ReaderWindow` keeps the
differences between polls of the last ``window_s`` seconds, per tenant, so a group's condition judges recent
traffic only. Pure: the caller passes the clock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, fields
from typing import Any

# The window the operator judges by default (its --disaggregation-window), and the fewest decode prompt
# tokens in it worth a judgement: a few short prompts say nothing.
DEFAULT_WINDOW_S = 300.0
MIN_TOKENS = 4096


@dataclass(frozen=True)
class DecodeReads:
    """A tenant's decode counters (cumulative from a daemon, or summed over a window)."""

    pool: int = 0  # decode prompt tokens (whole chunks) found in the pool
    computed: int = 0  # decode prompt tokens (whole chunks) not found: decode computed them itself
    handoff_waits: int = 0
    handoff_timeouts: int = 0

    @property
    def tokens(self) -> int:
        return self.pool + self.computed

    def __add__(self, other: DecodeReads) -> DecodeReads:
        return DecodeReads(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def since(self, before: DecodeReads | None) -> DecodeReads:
        """What happened after ``before`` (None, or a counter that went back: the daemon restarted, all of it)."""
        if before is None or any(getattr(self, f.name) < getattr(before, f.name) for f in fields(self)):
            return self
        return DecodeReads(*(getattr(self, f.name) - getattr(before, f.name) for f in fields(self)))


def decode_reads(answer: dict[str, Any]) -> dict[str, DecodeReads]:
    """Each tenant's decode counters in one daemon's /status; tenants without them are left out."""
    out: dict[str, DecodeReads] = {}
    for t in answer.get("tenants") or []:
        readers = t.get("readers") if isinstance(t, dict) else None
        if not isinstance(readers, dict):
            continue
        tokens = (readers.get("prompt_tokens") or {}).get("decode") or {}
        out[str(t.get("tenant", ""))] = DecodeReads(
            pool=int(tokens.get("pool") or 0),
            computed=int(tokens.get("computed") or 0),
            handoff_waits=int(readers.get("handoff_waits") or 0),
            handoff_timeouts=int(readers.get("handoff_timeouts") or 0),
        )
    return out


class ReaderWindow:
    """One pool's decode traffic per tenant over the last ``window_s`` seconds, from successive polls.

    Each daemon (by the key its answer came under: a node, or "metadata") is differenced against its own last
    answer of the same epoch, so a restart of one node's daemon neither loses nor double counts the others'.
    """

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._last: dict[str, tuple[Any, dict[str, DecodeReads]]] = {}  # daemon -> (its epoch, its counters)
        self._deltas: deque[tuple[float, str, DecodeReads]] = deque()  # (when, tenant, what happened since)
        self.polls = 0  # polls answered by at least one daemon
        self.reachable: bool | None = None  # whether the last poll got an answer; None: never polled

    def observe(self, now: float, answers: dict[str, dict[str, Any] | None]) -> None:
        """One poll of the pool's daemons (answer None: that daemon did not answer). No daemon to ask: nothing."""
        if not answers:
            return
        answered = {source: a for source, a in answers.items() if a is not None}
        self.reachable = bool(answered)
        if not answered:
            return
        self.polls += 1
        for source, answer in answered.items():
            epoch, counters = answer.get("epoch"), decode_reads(answer)
            before_epoch, before = self._last.get(source, (None, None))
            self._last[source] = (epoch, counters)
            if before is None:
                continue  # the first look at a daemon is the baseline: when its counts happened is unknown
            for tenant, now_counts in counters.items():
                delta = now_counts.since(before.get(tenant) if before_epoch == epoch else None)
                if delta != DecodeReads():
                    self._deltas.append((now, tenant, delta))
        self._expire(now)

    def totals(self, tenant: str, now: float) -> DecodeReads:
        self._expire(now)
        total = DecodeReads()
        for _, who, delta in self._deltas:
            if who == tenant:
                total += delta
        return total

    @property
    def judged(self) -> bool:
        """Whether two answered polls have been seen: before that there is no difference to judge by."""
        return self.polls >= 2

    def _expire(self, now: float) -> None:
        while self._deltas and self._deltas[0][0] < now - self.window_s:
            self._deltas.popleft()
