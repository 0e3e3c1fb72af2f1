"""Per-tenant quotas of the pool index: what each tenant holds, what it may hold, and whom eviction takes from.

A tenant's limits come from its token (:class:`maru_contracts.tenancy.Quota`, signed by the pool key), so the
daemon needs no tenant list and no reload: each request carries its connection's quota, and the tenant's
account takes the limits of the last request it saw. A field the token leaves out is the pool's default
(:func:`resolve`). Clients without a token (a pool run without a key: one anonymous tenant) are unlimited.

Three limits, as in Mooncake Store's tenant quotas (admission checks, then tenant-scoped eviction, then a
clear refusal):

* **bytes**: pool memory of the tenant's chunks, stored or being written, in allocation units (a one-byte
  chunk takes 4 KiB of the pool, so it counts 4 KiB). A write that would take the tenant past it first
  evicts the tenant's *own* least recently used chunks; when what is left is pinned or being written, the
  write is refused (``quota``), never charged to another tenant.
* **pins**: read pins outstanding. A pin past it is refused: the reader sees a miss.
* **leases**: write leases outstanding. A lease past it is refused: the chunk is not stored.

**Eviction order when the pool is full** (another tenant's write needs room): first the least recently
used chunks of tenants over their byte quota (a quota lowered by a newer token), then of tenants over their
*fair share*, and only then the global least recently used chunk. A tenant's fair share is the pool
divided among the tenants holding memory in proportion to their byte quotas (never more than its quota), so
a tenant within its share keeps its chunks under another tenant's flood: while the pool is full and it is
below its share, someone else is above theirs.

**The default of the default** (a ``maru1`` token, or a quota field left out): bytes = three quarters of the
pool, so one tenant, whatever it holds (leases, pins renewed forever), leaves a quarter of the pool to the
others; a pool with a single tenant gives up that quarter, which ``tenantQuota.bytes`` equal to the pool's
size gives back. Pins and leases: :data:`DEFAULT_PINS` and :data:`DEFAULT_LEASES`, far above what a fleet
of engines holds at once (a scheduler pins the hits of its queued requests) and low enough that a tenant
cannot grow the index's tables without bound.

**The daemon's hard ceiling** (``--max-tenant-pins``, ``--max-tenant-leases``; by default the defaults above):
whatever a token carries, no tenant holds more pins or leases than this. A token's quota is only as trusted as
whoever asked for it, and each pin or lease is daemon memory (a few hundred bytes): without a ceiling, one
tenant whose token carries a huge quota grows the daemon until the kernel kills it, and every tenant's chunks
go with it. Clients without a token (a pool run without a key) are held to it too.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from maru_contracts.tenancy import DAEMON_DEFAULTS, Quota

log = logging.getLogger(__name__)
# Refused because the tenant is at its quota (write grants; read pins are answered as misses).
QUOTA = "quota"
# A tenant's default byte quota, as a fraction of the pool: see the module's docstring.
DEFAULT_BYTES_NUM, DEFAULT_BYTES_DEN = 3, 4
DEFAULT_PINS = DAEMON_DEFAULTS["pins"]
DEFAULT_LEASES = DAEMON_DEFAULTS["leases"]
KINDS = ("bytes", "pins", "leases")


@dataclass(frozen=True)
class Limits:
    """A tenant's resolved limits; None: unlimited (bytes: the pool)."""

    bytes: int | None
    pins: int | None
    leases: int | None


UNLIMITED = Limits(None, None, None)
# The daemon's hard ceiling on any tenant's pins and leases (bytes: the pool); see the module's docstring.
CEILING = Limits(None, DEFAULT_PINS, DEFAULT_LEASES)


def _capped(value: int | None, cap: int | None) -> int | None:
    return value if cap is None else cap if value is None else min(value, cap)


def resolve(quota: Quota | None, capacity: int, ceiling: Limits = CEILING) -> Limits:
    """The limits of a token's quota on a pool of ``capacity`` bytes, held to the daemon's ``ceiling``;
    ``quota`` None (no authentication): only the ceiling."""
    if quota is None:
        return Limits(None, ceiling.pins, ceiling.leases)
    default_bytes = capacity * DEFAULT_BYTES_NUM // DEFAULT_BYTES_DEN
    return Limits(
        bytes=quota.bytes if quota.bytes is not None else default_bytes,
        pins=_capped(quota.pins if quota.pins is not None else DEFAULT_PINS, ceiling.pins),
        leases=_capped(quota.leases if quota.leases is not None else DEFAULT_LEASES, ceiling.leases),
    )


@dataclass(eq=False)
class Account:
    """One tenant's use of the pool; the index updates it under its lock."""

    name: str
    limits: Limits
    used: int = 0  # bytes allocated to its chunks (rounded to the allocation unit)
    pins: int = 0
    leases: int = 0
    # Its committed keys, least recently used first (the index's global LRU holds them too).
    lru: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    evicted_by_others: int = 0  # its chunks evicted to make room for another tenant's
    evicted_by_self: int = 0  # its chunks evicted for its own writes (pool full, or at its byte quota)
    refused: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))

    def byte_limit(self, capacity: int) -> int:
        return capacity if self.limits.bytes is None else min(self.limits.bytes, capacity)

    def at_limit(self, kind: str) -> bool:
        limit = getattr(self.limits, kind)
        return limit is not None and getattr(self, kind) >= limit


class Accounts:
    """Every tenant the index has seen, by scope (the anonymous tenant is "")."""

    def __init__(self, capacity: int, ceiling: Limits = CEILING) -> None:
        self.capacity = capacity
        self.ceiling = ceiling
        self._by_name: dict[str, Account] = {}

    def get(self, name: str, quota: Quota | None) -> Account:
        """The tenant's account, with the limits of ``quota`` (the last request's token wins)."""
        limits = resolve(quota, self.capacity, self.ceiling)
        account = self._by_name.get(name)
        if account is None:
            account = self._by_name[name] = Account(name, limits)
        elif account.limits != limits:
            account.limits = limits
        else:
            return account
        self._report_capped(name, quota, limits)
        return account

    def _report_capped(self, name: str, quota: Quota | None, limits: Limits) -> None:
        """Once per change of a tenant's limits: say when its token asked for more than the ceiling allows."""
        if quota is None:
            return
        capped = [
            f"{kind} {getattr(quota, kind)} -> {getattr(limits, kind)}"
            for kind in ("pins", "leases")
            if getattr(quota, kind) is not None and getattr(quota, kind) > getattr(limits, kind)
        ]
        if capped:
            log.warning(
                "tenant %s: its token's quota is over this daemon's ceiling (--max-tenant-pins, "
                "--max-tenant-leases), held to it: %s",
                name or "(anonymous)",
                ", ".join(capped),
            )

    def __iter__(self) -> Iterator[Account]:
        return iter(self._by_name.values())

    def over_quota(self) -> list[Account]:
        return [a for a in self._by_name.values() if a.used > a.byte_limit(self.capacity)]

    def over_share(self, writer: Account) -> list[Account]:
        """Tenants holding more than their fair share of the pool (see the module's docstring)."""
        active = [a for a in self._by_name.values() if a.used > 0 or a is writer]
        weights = {a: a.byte_limit(self.capacity) for a in active}
        total = sum(weights.values())
        if not total:
            return []
        return [a for a in active if a.used > min(weights[a], self.capacity * weights[a] // total)]

    def snapshot(self) -> list[dict[str, Any]]:
        """Per tenant, for ``/status`` and ``/metrics``; quotas None are unlimited."""
        out = []
        for a in sorted(self._by_name.values(), key=lambda a: a.name):
            out.append(
                {
                    "tenant": a.name,
                    "used_bytes": a.used,
                    "quota_bytes": a.byte_limit(self.capacity),
                    "chunks": len(a.lru),
                    "pins": a.pins,
                    "quota_pins": a.limits.pins,
                    "leases": a.leases,
                    "quota_leases": a.limits.leases,
                    "evictions_by_others": a.evicted_by_others,
                    "evictions_by_self": a.evicted_by_self,
                    "refused": dict(a.refused),
                }
            )
        return out
