"""Which engine serves a request: the least busy one, by the requests this router has in flight on each.

The pool is a tier every engine reads, so a prompt it covers has no locality to chase: any decode
engine, and any prefill engine that loads from the pool (``kv_both``), serves it from the same
chunks. The only thing left to choose by is load. A covered prompt goes to the least busy decode
engine, or to the least busy prefill engine when that one has fewer requests in flight (decode
wins ties: it is there to generate, and prefill stays free for the prompts the pool lacks).

The counts are the requests this router sends itself; another router in front of the same engines
(vllm-router behind ``--upstream``) is not seen.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Literal

Role = Literal["prefill", "decode"]


def least_loaded(loads: Sequence[int], turn: int = 0) -> int:
    """Index of the smallest load; among equals, the first at or after ``turn`` (mod the length), so a
    caller that advances ``turn`` on each pick goes round robin over engines equally busy."""
    if not loads:
        raise ValueError("least_loaded: no endpoints")
    low = min(loads)
    n = len(loads)
    return next(i for i in ((turn + k) % n for k in range(n)) if loads[i] == low)


def direct_target(
    decode: Sequence[int], prefill: Sequence[int], *, to_prefill: bool, turn: int = 0
) -> tuple[Role, int]:
    """Where a prompt the pool covers goes: ``(role, index)`` among the engines whose in-flight counts
    are ``decode`` and ``prefill``. A prefill engine only when ``to_prefill`` and strictly less busy."""
    d = least_loaded(decode, turn)
    if to_prefill and prefill:
        p = least_loaded(prefill, turn)
        if prefill[p] < decode[d]:
            return "prefill", p
    return "decode", d


class Endpoints:
    """One role's engines and the requests this router has in flight on each (asyncio: one thread)."""

    def __init__(self, role: Role, urls: Sequence[str], on_change: Callable[[str, int], None]) -> None:
        if not urls:
            raise ValueError(f"router: at least one {role} URL is needed")
        self.role = role
        self.urls = [u.rstrip("/") for u in urls]
        self.loads = [0] * len(self.urls)
        self._turn = itertools.count()
        self._on_change = on_change  # (url, in flight) after every change: the gauge
        for url in self.urls:
            on_change(url, 0)

    def turn(self) -> int:
        """The next tie-break offset: advancing it on each pick is what makes ties round robin."""
        return next(self._turn)

    def pick(self) -> int:
        return least_loaded(self.loads, self.turn())

    @contextmanager
    def hold(self, i: int) -> Iterator[str]:
        """The engine ``i``'s URL, counted in flight until the block exits (a client gone included)."""
        self._add(i, 1)
        try:
            yield self.urls[i]
        finally:
            self._add(i, -1)

    def _add(self, i: int, n: int) -> None:
        self.loads[i] += n
        self._on_change(self.urls[i], self.loads[i])
