"""Which engine serves a request: the least busy one, by the requests this router has in flight on each.

The pool is a tier every engine reads, so a prompt it covers has no locality to chase: any decode
engine, and any prefill engine that loads from the pool (``kv_both``), serves it from the same
chunks. The only thing left to choose by is load. A covered prompt goes to the least busy decode
engine, or to the least busy prefill engine when that one has fewer requests in flight (decode
wins ties: it is there to generate, and prefill stays free for the prompts the pool lacks).

Locality beyond the pool: an engine whose own prefix cache (read from its KV events,
:mod:`.locality`) holds more of the prompt than the pool gives every engine computes less. That gain, and
only that gain, may take a request to an engine at most ``slack`` requests busier than the least busy
(:func:`local_first`): a prefix the pool already holds is no reason to queue behind a busy engine.

The counts are the requests this router sends itself; another router in front of the same engines
(vllm-router behind ``--upstream``) is not seen.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from maru_router.locality import EngineCache

Role = Literal["prefill", "decode"]


def least_loaded(loads: Sequence[int], turn: int = 0) -> int:
    """Index of the smallest load; among equals, the first at or after ``turn`` (mod the length), so a
    caller that advances ``turn`` on each pick goes round robin over engines equally busy."""
    if not loads:
        raise ValueError("least_loaded: no endpoints")
    low = min(loads)
    n = len(loads)
    return next(i for i in ((turn + k) % n for k in range(n)) if loads[i] == low)


def local_first(
    loads: Sequence[int], local_tokens: Sequence[int], shared_tokens: int, *, slack: int, turn: int = 0
) -> int:
    """The engine to send a prompt to, given each engine's in-flight ``loads``, the tokens of the prompt its own
    cache holds (``local_tokens``) and those the pool gives any engine (``shared_tokens``).

    The least busy engine (round robin among equals), unless an engine at most ``slack`` requests busier holds
    more of the prompt locally than the pool gives: then the one of those that holds the most beyond the pool,
    the less busy first among equals.
    """
    best = least_loaded(loads, turn)
    gains = [max(0, t - shared_tokens) for t in local_tokens]
    near = [i for i in range(len(loads)) if gains[i] > 0 and loads[i] <= loads[best] + slack]
    if not near:
        return best
    return max(near, key=lambda i: (gains[i], -loads[i], i == best))


def direct_target(
    decode: Sequence[int],
    prefill: Sequence[int],
    *,
    to_prefill: bool,
    turn: int = 0,
    picks: tuple[int, int] | None = None,
) -> tuple[Role, int]:
    """Where a prompt the pool covers goes: ``(role, index)`` among the engines whose in-flight counts
    are ``decode`` and ``prefill``. A prefill engine only when ``to_prefill`` and strictly less busy.

    ``picks``: the decode and prefill engine each role would take (by locality, :func:`local_first`);
    by default the least busy of each.
    """
    d, p = picks if picks is not None else (least_loaded(decode, turn), least_loaded(prefill, turn) if prefill else -1)
    if to_prefill and prefill and prefill[p] < decode[d]:
        return "prefill", p
    return "decode", d


@dataclass(frozen=True)
class Prompt:
    """What locality is judged by: the prompt's vLLM block hashes (of ``block_size`` tokens each) and the
    tokens of it the pool holds."""

    hashes: Sequence[bytes]
    block_size: int
    pool_tokens: int


class Endpoints:
    """One role's engines and the requests this router has in flight on each (asyncio: one thread).

    ``caches``: what the engines' own prefix caches hold, by URL, for those whose KV events are read (read
    at each pick: the router adds and drops engines there as it learns of them).
    """

    def __init__(
        self, role: Role, urls: Sequence[str], on_change: Callable[[str, int], None], *,
        caches: Mapping[str, EngineCache] | None = None, slack: int = 1,
    ) -> None:  # fmt: skip
        if not urls:
            raise ValueError(f"router: at least one {role} URL is needed")
        if slack < 0:
            raise ValueError(f"router: the locality slack must be >= 0, got {slack}")
        self.role = role
        self.urls = [u.rstrip("/") for u in urls]
        self.loads = [0] * len(self.urls)
        self.caches: Mapping[str, EngineCache] = caches if caches is not None else {}
        self.slack = slack
        self._turn = itertools.count()
        self._on_change = on_change  # (url, in flight) after every change: the gauge
        for url in self.urls:
            on_change(url, 0)

    def turn(self) -> int:
        """The next tie-break offset: advancing it on each pick is what makes ties round robin."""
        return next(self._turn)

    def pick(self, prompt: Prompt | None = None, among: Sequence[int] | None = None) -> int:
        """The engine for the next request: by load, and by what the engines hold of ``prompt`` beyond the pool
        when their events are read; only among the indices ``among`` when given (engines of one key revision)."""
        turn = self.turn()
        within = list(range(len(self.urls))) if among is None else list(among)
        if not within:
            raise ValueError(f"router: no {self.role} engine to choose among")
        loads = [self.loads[i] for i in within]
        if prompt is None or not any(self.urls[i] in self.caches for i in within):
            return within[least_loaded(loads, turn)]
        local = [self.local_tokens(i, prompt) for i in within]
        return within[local_first(loads, local, prompt.pool_tokens, slack=self.slack, turn=turn)]

    def local_tokens(self, i: int, prompt: Prompt) -> int:
        """Tokens of ``prompt`` engine ``i``'s own cache holds (0 when its events are not read)."""
        cache = self.caches.get(self.urls[i])
        return cache.prefix_tokens(prompt.hashes, prompt.block_size) if cache else 0

    def replace(self, urls: Sequence[str]) -> bool:
        """Follow a changed set of engines (pods come and go); whether it changed. The counts of engines kept
        stay; a request in flight on one that went finishes uncounted. An empty set is not taken: the last
        known engines are better than none."""
        new = [u.rstrip("/") for u in urls]
        if not new or new == self.urls:
            return False
        held = dict(zip(self.urls, self.loads, strict=True))
        self.urls, self.loads = new, [held.get(u, 0) for u in new]
        for url in new:
            if url not in held:
                self._on_change(url, 0)
        return True

    @contextmanager
    def hold(self, i: int) -> Iterator[str]:
        """The engine ``i``'s URL, counted in flight until the block exits (a client gone included)."""
        url = self.urls[i]
        self._add(url, 1)
        try:
            yield url
        finally:
            self._add(url, -1)

    def _add(self, url: str, n: int) -> None:
        if url not in self.urls:
            return  # gone from the set meanwhile
        i = self.urls.index(url)
        self.loads[i] += n
        self._on_change(url, self.loads[i])
