"""Leader election with a coordination.k8s.io Lease, as client-go's leaderelection package does it.

Several replicas of the operator may run; only the holder of the Lease reconciles. The others watch
(their caches stay warm) and try to take the Lease over every ``retry_period``; one that is not
renewed for ``lease_seconds`` is taken over. A leader that cannot renew within ``renew_deadline``
(shorter than ``lease_seconds``) stops reconciling before anyone else may start. A leader that shuts
down gives the Lease up at once, so a rolling update hands over without waiting for it to expire.

Why a Lease and not kopf's peering: peering needs kopf's own CRDs in the cluster, and replicas of
the same priority both keep running (kopf only warns), which is the fight this prevents. A Lease is
the standard object (``kubectl get lease``), needs no CRD, and grants exactly one holder.

Expiry is judged by this process's own clock since it last saw the Lease change, not by the times
written in it, so clock skew between nodes cannot make a live leader look expired.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from maru_operator.kube import ApiError, Kube, Unreachable

log = logging.getLogger("maru_operator.leader")

Object = dict[str, Any]


@dataclass(frozen=True)
class LeaseSettings:
    namespace: str
    name: str
    identity: str
    lease_seconds: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0


def micro_time(now: datetime.datetime | None = None) -> str:
    """A metav1.MicroTime."""
    return (now or datetime.datetime.now(datetime.UTC)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    """Runs ``on_lead`` when this process holds the Lease and ``on_lose`` when it stops holding it."""

    def __init__(self, kube: Kube, settings: LeaseSettings, *, on_lead: Callable[[], Awaitable[None]],
                 on_lose: Callable[[], Awaitable[None]], monotonic: Callable[[], float] = time.monotonic) -> None:
        self.kube = kube
        self.settings = settings
        self._on_lead = on_lead
        self._on_lose = on_lose
        self._monotonic = monotonic
        self._seen: tuple[Any, Any] | None = None  # (holder, renewTime) last observed
        self._seen_at = 0.0
        self.leading = False

    async def run(self) -> None:
        """Forever: wait for the Lease, lead while it is renewed, then wait again."""
        s = self.settings
        try:
            while True:
                while not await self._try_acquire_or_renew():
                    await asyncio.sleep(s.retry_period)
                self.leading = True
                log.info("became the leader (Lease %s/%s, identity %s)", s.namespace, s.name, s.identity)
                await self._on_lead()
                last_renewal = self._monotonic()
                while self._monotonic() - last_renewal < s.renew_deadline:
                    await asyncio.sleep(s.retry_period)
                    if await self._try_acquire_or_renew():
                        last_renewal = self._monotonic()
                self.leading = False
                log.warning("lost the Lease %s/%s (not renewed for %.0f s): stopped reconciling",
                            s.namespace, s.name, s.renew_deadline)
                await self._on_lose()
        finally:
            if self.leading:
                self.leading = False
                await self._on_lose()
                await self._release()

    async def _try_acquire_or_renew(self) -> bool:
        s = self.settings
        now = micro_time()
        try:
            lease = await self.kube.get("Lease", s.namespace, s.name)
            if lease is None:
                await self.kube.create(self._lease(now, transitions=0, acquired=now))
                return True
            spec = lease.get("spec") or {}
            holder = spec.get("holderIdentity") or ""
            record = (holder, spec.get("renewTime"))
            if record != self._seen:
                self._seen, self._seen_at = record, self._monotonic()
            duration = float(spec.get("leaseDurationSeconds") or s.lease_seconds)
            if holder and holder != s.identity and self._monotonic() - self._seen_at < duration:
                return False  # held by another, and renewed recently as far as this process can tell
            mine = holder == s.identity
            transitions = int(spec.get("leaseTransitions") or 0) + (0 if mine else 1)
            body = self._lease(now, transitions=transitions, acquired=spec.get("acquireTime") if mine else now)
            # The resourceVersion makes this a compare-and-swap: of two replicas taking over, one wins.
            body["metadata"]["resourceVersion"] = lease["metadata"]["resourceVersion"]
            await self.kube.patch("Lease", s.namespace, s.name, {"metadata": body["metadata"], "spec": body["spec"]})
            if not mine:
                log.info("took the Lease %s/%s over from %s", s.namespace, s.name, holder or "nobody")
            return True
        except ApiError as err:
            if err.status not in (404, 409):
                log.warning("Lease %s/%s: %s", s.namespace, s.name, err)
            return False
        except Unreachable as err:
            log.warning("Lease %s/%s: %s", s.namespace, s.name, err)
            return False

    def _lease(self, now: str, *, transitions: int, acquired: str | None) -> Object:
        s = self.settings
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": s.name, "namespace": s.namespace,
                         "labels": {"app.kubernetes.io/name": "maru-operator"}},
            "spec": {
                "holderIdentity": s.identity,
                "leaseDurationSeconds": max(1, round(s.lease_seconds)),
                "acquireTime": acquired or now,
                "renewTime": now,
                "leaseTransitions": transitions,
            },
        }

    async def _release(self) -> None:
        """Give the Lease up on shutdown: another replica takes over at once instead of after expiry."""
        s = self.settings
        with contextlib.suppress(ApiError, Unreachable):
            lease = await self.kube.get("Lease", s.namespace, s.name)
            if lease is not None and (lease.get("spec") or {}).get("holderIdentity") == s.identity:
                await self.kube.patch("Lease", s.namespace, s.name, {
                    "metadata": {"resourceVersion": lease["metadata"]["resourceVersion"]},
                    "spec": {"holderIdentity": None, "leaseDurationSeconds": 1, "renewTime": micro_time()},
                })
                log.info("released the Lease %s/%s", s.namespace, s.name)
