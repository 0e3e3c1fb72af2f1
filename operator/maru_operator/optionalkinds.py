"""Kinds the operator writes only where their CRD is installed: asked of API discovery, at a bounded rate.

The InferencePool of the Gateway API Inference Extension is such a kind: a group asks for one, and the
cluster may or may not have the CRD (or get it later). kopf serves a child kind whose CRD is missing by
warning once and watching it as soon as the CRD appears (it watches CRDs), so the child watch needs no
special care; what the operator must not do is write an object of a kind the server does not serve, or
take a failed discovery for a missing CRD and prune what exists.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from maru_operator.kube import KINDS, ApiError, Kube, Unreachable

log = logging.getLogger("maru_operator.optionalkinds")

# How long a discovery answer holds: a CRD installed meanwhile is written to at most this much later (the
# groups that asked for the kind look again at this interval while it is missing).
RECHECK_SECONDS = 60.0


@dataclass
class OptionalKind:
    """Whether the API server serves ``kind`` (a key of :data:`maru_operator.kube.KINDS`), asked at most once
    per ``recheck_seconds``."""

    kind: str
    recheck_seconds: float = RECHECK_SECONDS
    monotonic: Callable[[], float] = time.monotonic
    _served: bool | None = None  # None: never answered
    _checked: float = field(default=float("-inf"))

    @property
    def known_served(self) -> bool:
        """Whether discovery's last answer was that the kind is served (no request)."""
        return self._served is True

    async def served(self, kube: Kube) -> bool | None:
        """True or False as discovery last said; None while it has never answered (unknown, not absent)."""
        now = self.monotonic()
        if now - self._checked < self.recheck_seconds:
            return self._served
        self._checked = now
        try:
            served = await kube.serves(self.kind)
        except (ApiError, Unreachable) as err:
            log.warning(
                "could not tell whether the API serves %s (%s); keeping what was known: %s",
                self.kind,
                KINDS[self.kind].prefix,
                err,
            )
            return self._served
        if served != self._served:
            log.info(
                "%s (%s/%s) is %s",
                self.kind,
                KINDS[self.kind].prefix,
                KINDS[self.kind].plural,
                "served" if served else "not served: its CRD is not installed",
            )
        self._served = served
        return served
