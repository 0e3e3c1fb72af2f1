"""What the operator learns from the pools' daemons, shared by the pool and group reconcilers.

A pool's reconcile polls its daemons' ``/status`` anyway: from those answers it keeps each tenant's use of the pool
(a group's ``status.poolUsage``) and the decode traffic per tenant over a sliding window (a group's
DisaggregationActive), and wakes the groups it has news for. No group asks a daemon itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from maru_operator.cache import Key
from maru_operator.traffic import DEFAULT_WINDOW_S, ReaderWindow


class PoolTelemetry:
    def __init__(self, window_s: float = DEFAULT_WINDOW_S, wake: Callable[[Key], None] | None = None) -> None:
        self.window_s = window_s  # how far back DisaggregationActive looks (--disaggregation-window)
        # Puts an owner on the work queue; a pool's poll wakes the groups it has news for.
        self.wake = wake
        # pool -> each tenant's (cache scope's) use, from the daemons' /status
        self.pool_tenants: dict[str, dict[str, Any]] = {}
        # pool -> its decode traffic per tenant over the window, from the same polls
        self.pool_readers: dict[str, ReaderWindow] = {}
        # group -> (its pool, its cache scope there), as its last reconcile saw them
        self.group_scopes: dict[Key, tuple[str, str]] = {}

    def wake_groups(self, pool: str, new_tenants: set[str], reachability_changed: bool) -> None:
        """Groups whose tenant the pool reports for the first time (they look again at its interval from then
        on), or all of the pool's when its daemons stopped or started answering, are reconciled now."""
        if self.wake is None or not (new_tenants or reachability_changed):
            return
        for key, (of_pool, scope) in list(self.group_scopes.items()):
            if of_pool == pool and (reachability_changed or scope in new_tenants):
                self.wake(key)

    def readers_of(self, pool: str) -> ReaderWindow:
        if pool not in self.pool_readers:
            self.pool_readers[pool] = ReaderWindow(self.window_s)
        return self.pool_readers[pool]
