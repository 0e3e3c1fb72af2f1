"""Status writes and the Events that go with them: what ``kubectl describe`` shows a human.

A status is written only when it changed; each condition that turned bad is logged as a warning and posted as a
Warning Event, and Ready turning True as a Normal one. Only what needs a human is a Warning: every start passes
through conditions (PoolNotReady, ReplicasNotReady) that are not.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from maru_operator import conditions as cond
from maru_operator import metrics
from maru_operator.cache import Store
from maru_operator.kube import ApiError, Kube
from maru_operator.objects import Object
from maru_operator.ownership import key_of
from maru_operator.status import changed, status_body

log = logging.getLogger("maru_operator.controller")


class StatusWriter:
    def __init__(self, kube: Kube, store: Store, clock: Callable[[], str]) -> None:
        self.kube = kube
        self.store = store
        self.clock = clock

    async def write(self, body: Object, old: Any, new: Any) -> None:
        """Write ``new`` as ``body``'s status when it differs from ``old``, then announce what turned."""
        if not changed(old, new):
            return
        kind, ns, name = key_of(body)
        try:
            updated = await self.kube.patch_status(kind, ns or None, name, status_body(new, old))
        except ApiError as err:
            if err.status != 404:
                raise
            # Deleted since it was cached (its DELETED event, or the next relist, tells the rest).
            log.info("%s %s is gone; not writing its status", kind, f"{ns}/{name}" if ns else name)
            self.store.remove(key_of(body))
            return
        metrics.STATUS_WRITES.labels(kind).inc()
        if isinstance(updated, dict) and updated.get("metadata"):
            self.store.put(updated)
        await self.announce(body, old.conditions, new.conditions)

    async def announce(self, body: Object, old: list[Any], new: list[Any]) -> None:
        """Post an Event for each condition that turned bad (Warning) or Ready that turned True."""
        before = {(c.type, c.status, c.reason) for c in old}
        for c in new:
            if (c.type, c.status, c.reason) in before:
                continue
            bad = (
                (c.type == cond.READY and c.status == "False" and c.reason in _WARN_READY)
                or (c.type in (cond.DEGRADED, cond.IN_USE) and c.status == "True" and c.reason in _WARN_OTHER)
                or (c.type in (cond.DISAGGREGATION_ACTIVE, cond.INFERENCE_POOL_READY) and c.status == "False")
            )
            good = c.type == cond.READY and c.status == "True"
            kind, ns, name = key_of(body)
            log.log(
                logging.WARNING if bad else logging.INFO,
                "%s %s: %s=%s (%s) %s",
                kind,
                f"{ns}/{name}" if ns else name,
                c.type,
                c.status,
                c.reason,
                c.message,
            )
            if bad or good:
                await self.kube.event(
                    body,
                    type_="Warning" if bad else "Normal",
                    reason=c.reason,
                    message=c.message or c.reason,
                    now=self.clock(),
                )


_WARN_READY = {
    "InvalidSpec",
    "PoolNotFound",
    "NamespaceNotAllowed",
    "PoolDeleting",
    "PoolInvalid",
    "NoNodesSelected",
    "ChildConflict",
    "NoReadyEndpoints",
    cond.REPLICAS_FAILING,
}
# Not Warnings, as they are how every start looks: PoolNotReady (a group applied with its pool; the pool's own
# conditions say what keeps it), ReplicasNotReady and ReplicasUnavailable (pods starting; ReplicasFailing when
# they wait for a human).
_WARN_OTHER = {
    "ChildRefused",
    "DeletionBlocked",
    cond.REPLICAS_FAILING,
    "AgentsUnavailable",
    "MetadataServerUnavailable",
    "PoolDegraded",
    "PoolUnavailable",
}
