"""What readers asked the pool for and what it held, per tenant and role: does decode load its prompts?

vLLM's P/D path can fail quietly: decode waits for a handoff, then computes the whole prompt itself, and
nothing but latency says so. Every decode lookup reaches the daemon, so the daemon counts, per tenant:

* **prompt tokens** a reader's lookups asked for and found (``pool``) or did not (``computed``: asked minus
  found, which the engine then computes itself), in whole chunks: the partial chunk at a prompt's end never
  travels through the pool, so it counts on neither side. A reader says its role and its chunk geometry in
  the request (``reader``); a lookup without it (an older client, a router's coverage probe) counts as role
  ``unknown`` and no tokens.
* **handoff waits**: lookups that found fewer chunks than the prefill announced (``handoff``), so the reader
  waits for them in ``wait``.
* **handoff timeouts**: such waits whose last ``wait`` (the reader marks it ``final``) ended with chunks
  still missing. A handoff's tokens are counted once, when its wait ends, not at the lookup that started it.

The counters only grow (a daemon restart starts them afresh); whoever reads them takes differences.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

ROLES = ("decode", "prefill")
UNKNOWN = "unknown"
SOURCES = ("pool", "computed")
# Bounds that keep a reader's numbers sane (a chunk of a million tokens, a thousand TP ranks).
MAX_CHUNK_TOKENS = 1 << 20
MAX_RANKS = 1024


@dataclass(frozen=True)
class Reader:
    """Who looks up, and how many tokens a key stands for: a chunk has one key per TP rank."""

    role: str
    chunk_tokens: int
    ranks: int

    @classmethod
    def parse(cls, value: Any) -> Reader | None:
        """The request's ``reader`` field; None when absent. Raises ValueError naming the field and its rule."""
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError("reader must be an object {role, chunk_tokens, ranks}")
        role, chunk_tokens, ranks = value.get("role"), value.get("chunk_tokens"), value.get("ranks")
        if not isinstance(role, str):
            raise ValueError(f"reader.role must be a string, got {role!r}")
        if not isinstance(chunk_tokens, int) or not 0 < chunk_tokens <= MAX_CHUNK_TOKENS:
            raise ValueError(
                f"reader.chunk_tokens must be an integer from 1 to {MAX_CHUNK_TOKENS}, got {chunk_tokens!r}"
            )
        if not isinstance(ranks, int) or not 0 < ranks <= MAX_RANKS:
            raise ValueError(f"reader.ranks must be an integer from 1 to {MAX_RANKS}, got {ranks!r}")
        # Roles outside the known set count as unknown: a label per client-chosen string would be unbounded.
        return cls(role if role in ROLES else UNKNOWN, chunk_tokens, ranks)

    def tokens(self, keys: int) -> int:
        return keys // self.ranks * self.chunk_tokens

    def fields(self) -> dict[str, Any]:
        """The request field (see :meth:`parse`)."""
        return {"role": self.role, "chunk_tokens": self.chunk_tokens, "ranks": self.ranks}


@dataclass
class _Tenant:
    lookups: dict[str, int] = field(default_factory=dict)  # role -> lookup requests
    tokens: dict[str, dict[str, int]] = field(default_factory=dict)  # role -> source -> prompt tokens
    handoff_waits: int = 0
    handoff_timeouts: int = 0

    def count_tokens(self, reader: Reader, asked: int, found: int) -> None:
        by_source = self.tokens.setdefault(reader.role, dict.fromkeys(SOURCES, 0))
        pool = reader.tokens(found)
        by_source["pool"] += pool
        by_source["computed"] += max(0, reader.tokens(asked) - pool)


class ReaderTally:
    """The counters of every tenant that looked something up; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tenants: dict[str, _Tenant] = {}  # tenant scope -> its counters

    def looked_up(self, tenant: str, reader: Reader | None, asked: int, found: int, handoff: int = 0) -> None:
        """A lookup of ``asked`` keys found the first ``found``; ``handoff``: keys a prefill announced."""
        with self._lock:
            t = self._tenants.setdefault(tenant, _Tenant())
            role = reader.role if reader is not None else UNKNOWN
            t.lookups[role] = t.lookups.get(role, 0) + 1
            if found < handoff:
                t.handoff_waits += 1  # its tokens are counted when its wait ends
            elif reader is not None:
                t.count_tokens(reader, asked, found)

    def wait_ended(self, tenant: str, reader: Reader, asked: int, found: int, need: int) -> None:
        """A reader's wait for a handoff ended: ``found`` of the ``need`` keys it waited for are there."""
        with self._lock:
            t = self._tenants.setdefault(tenant, _Tenant())
            if found < need:
                t.handoff_timeouts += 1
            t.count_tokens(reader, asked, found)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """tenant -> {lookups: {role: n}, prompt_tokens: {role: {pool, computed}}, handoff_waits, handoff_timeouts}"""
        with self._lock:
            return {
                name: {
                    "lookups": dict(t.lookups),
                    "prompt_tokens": {role: dict(by_source) for role, by_source in t.tokens.items()},
                    "handoff_waits": t.handoff_waits,
                    "handoff_timeouts": t.handoff_timeouts,
                }
                for name, t in self._tenants.items()
            }


def with_readers(tenants: list[dict[str, Any]], readers: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each tenant's entry of /status with its reader counters (``readers``); tenants that only looked up
    (no chunk, pin or lease yet) get an entry of their own."""
    out = [{**t, "readers": readers[t["tenant"]]} if t.get("tenant") in readers else t for t in tenants]
    known = {t.get("tenant") for t in tenants}
    out += [{"tenant": name, "readers": r} for name, r in sorted(readers.items()) if name not in known]
    return out
