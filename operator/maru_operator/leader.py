"""Leader election with a coordination.k8s.io Lease, as client-go's leaderelection package does it.

Several replicas of the operator may run; only the holder of the Lease reconciles. The others watch
(their caches stay warm) and try to take the Lease over every ``retry_period``; one that is not
renewed for ``lease_seconds`` is taken over. A leader that cannot renew within ``renew_deadline``
(shorter than ``lease_seconds``) stops reconciling before anyone else may start: each attempt is
bounded by what is left of that deadline (client-go's ``context.WithTimeout(renewDeadline)``), so a
renewal the API server never answers cannot keep it leading past the point where a standby may take
over. Renewing is this module's own loop, never held up by what starting to lead does (``on_lead``: a
fresh list of every watched kind, as long as the cluster and the API server make it): that runs in its
own task, as client-go's ``OnStartedLeading``, is cancelled only when the Lease is lost, and when it
fails the leader steps down and gives the Lease up. A leader that shuts down gives the Lease up at
once, so a rolling update hands over without waiting for it to expire. Becoming and ceasing to be the
leader are Events on the Lease (reason ``LeaderElection``), as client-go posts them.

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
from maru_operator.objects import Object

log = logging.getLogger("maru_operator.leader")


# On the Lease: the namespace of the release whose replica holds it (several releases may contend for one).
RELEASE_NAMESPACE_ANNOTATION = "maru.io/release-namespace"


@dataclass(frozen=True)
class LeaseSettings:
    namespace: str
    name: str
    identity: str
    lease_seconds: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0
    release_namespace: str = ""  # where this replica's release runs (its pool daemons' namespace)


def micro_time(now: datetime.datetime | None = None) -> str:
    """A metav1.MicroTime."""
    return (now or datetime.datetime.now(datetime.UTC)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _failed(leading: asyncio.Task[bool]) -> bool:
    """Whether starting to lead has ended, and in failure (not merely cancelled on losing the Lease)."""
    return leading.done() and not leading.cancelled() and leading.exception() is None and leading.result() is False


def _event_time() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class LeaderElector:
    """Runs ``on_lead`` when this process holds the Lease and ``on_lose`` when it stops holding it."""

    def __init__(
        self,
        kube: Kube,
        settings: LeaseSettings,
        *,
        on_lead: Callable[[], Awaitable[None]],
        on_lose: Callable[[], Awaitable[None]],
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kube = kube
        self.settings = settings
        self._on_lead = on_lead
        self._on_lose = on_lose
        self._monotonic = monotonic
        self._seen: tuple[Any, Any] | None = None  # (holder, renewTime) last observed
        self._seen_at = 0.0
        self._lease_seen: Object | None = None  # the Lease as this process last wrote it (Events name it)
        self._warned_holder: str | None = None
        self.leading = False

    async def run(self) -> None:
        """Forever: wait for the Lease, lead while it is renewed, then wait again."""
        s = self.settings
        try:
            while True:
                deadline = await self._attempt()
                while deadline is None:
                    await asyncio.sleep(s.retry_period)
                    deadline = await self._attempt()
                self.leading = True
                log.info("became the leader (Lease %s/%s, identity %s)", s.namespace, s.name, s.identity)
                # Starting to lead (a fresh list of everything) takes as long as it takes, on a large cluster
                # or a slow API server longer than the renew deadline: it runs in its own task while this one
                # renews, as client-go's OnStartedLeading does, and is cancelled only once the Lease is lost.
                # Bounding it by the deadline instead made a leader drop the Lease, take it again and start
                # over, forever, never reconciling (and still renewing, so no standby took over).
                leading = asyncio.create_task(self._lead(), name="maru-leading")
                try:
                    while (renewed := await self._renew_before(deadline, leading)) is not None:
                        deadline = renewed
                finally:
                    leading.cancel()
                    await asyncio.gather(leading, return_exceptions=True)
                self.leading = False
                failed = _failed(leading)
                if failed:
                    log.warning("stopped leading after failing to start; another replica may take the Lease")
                else:
                    log.warning(
                        "could not renew the Lease %s/%s within %.1f s: stopped reconciling",
                        s.namespace,
                        s.name,
                        s.renew_deadline,
                    )
                await self._on_lose()
                await self._announce(f"{s.identity} stopped leading")
                if failed:
                    # Give a standby the Lease now, and a head start: holding it without reconciling would
                    # block the standby as surely as the old livelock did.
                    await self._release()
                    await asyncio.sleep(s.retry_period)
        finally:
            if self.leading:
                self.leading = False
                await self._on_lose()
                await self._release()

    async def _lead(self) -> bool:
        """What starting to lead does, alongside the renewals (the Event too: posting it must not delay them).

        False when ``on_lead`` failed: the renewals then stop, and this process steps down.
        """
        s = self.settings
        await self._announce(f"{s.identity} became leader")
        try:
            await self._on_lead()
        except Exception:  # logged here: nobody else reads this task's exception
            log.exception("starting to lead failed (Lease %s/%s)", s.namespace, s.name)
            return False
        return True

    async def _renew_before(self, deadline: float, leading: asyncio.Task[bool]) -> float | None:
        """Renew every ``retry_period`` until one renewal succeeds before ``deadline``: the next deadline.

        None once the deadline has passed, or once ``leading`` has failed: the caller stops leading at once.
        """
        s = self.settings
        while (left := deadline - self._monotonic()) > 0:
            if leading.done():
                await asyncio.sleep(min(s.retry_period, left))
            else:  # woken early by a failed start, so that a standby need not wait a whole period for the Lease
                await asyncio.wait([leading], timeout=min(s.retry_period, left))
            if _failed(leading):
                return None
            renewed = await self._attempt(deadline)
            if renewed is not None:
                return renewed
        return None

    async def _attempt(self, deadline: float | None = None) -> float | None:
        """One try to take or renew the Lease, abandoned at ``deadline`` (else after ``renew_deadline``).

        Returns the deadline of the next renewal when this process holds the Lease now, counted from the
        *start* of the try: the write may have landed at once, and a standby counts its ``lease_seconds``
        from when it saw it, never earlier.
        """
        s = self.settings
        started = self._monotonic()
        budget = (deadline if deadline is not None else started + s.renew_deadline) - started
        if budget <= 0:
            return None
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation that arrives as the
            # request completes, and a shutdown (or a step-down) would then go on renewing.
            async with asyncio.timeout(budget):
                held = await self._try_acquire_or_renew()
        except TimeoutError:
            log.warning(
                "Lease %s/%s: no answer from the API server within %.1f s; gave up the attempt",
                s.namespace,
                s.name,
                budget,
            )
            return None
        return started + s.renew_deadline if held else None

    async def _announce(self, message: str) -> None:
        """An Event on the Lease, as client-go's leader election records (best effort, bounded)."""
        if self._lease_seen is None:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.settings.renew_deadline):
                await self.kube.event(
                    self._lease_seen, type_="Normal", reason="LeaderElection", message=message, now=_event_time()
                )

    async def _try_acquire_or_renew(self) -> bool:
        s = self.settings
        now = micro_time()
        try:
            lease = await self.kube.get("Lease", s.namespace, s.name)
            if lease is None:
                self._lease_seen = await self.kube.create(self._lease(now, transitions=0, acquired=now))
                return True
            spec = lease.get("spec") or {}
            holder = spec.get("holderIdentity") or ""
            record = (holder, spec.get("renewTime"))
            if record != self._seen:
                self._seen, self._seen_at = record, self._monotonic()
            duration = float(spec.get("leaseDurationSeconds") or s.lease_seconds)
            if holder and holder != s.identity and self._monotonic() - self._seen_at < duration:
                self._note_other_release(lease, holder)
                return False  # held by another, and renewed recently as far as this process can tell
            mine = holder == s.identity
            transitions = int(spec.get("leaseTransitions") or 0) + (0 if mine else 1)
            body = self._lease(now, transitions=transitions, acquired=spec.get("acquireTime") if mine else now)
            # The resourceVersion makes this a compare-and-swap: of two replicas taking over, one wins.
            body["metadata"]["resourceVersion"] = lease["metadata"]["resourceVersion"]
            self._lease_seen = await self.kube.patch(
                "Lease", s.namespace, s.name, {"metadata": body["metadata"], "spec": body["spec"]}
            )
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

    def _note_other_release(self, lease: Object, holder: str) -> None:
        """Say once per holder when the leader belongs to another release: this one then never leads."""
        theirs = ((lease.get("metadata") or {}).get("annotations") or {}).get(RELEASE_NAMESPACE_ANNOTATION)
        if not theirs or theirs == self.settings.release_namespace or holder == self._warned_holder:
            return
        self._warned_holder = holder
        s = self.settings
        log.warning(
            "the Lease %s/%s is held by a replica of the release in namespace %s (%s), which serves the "
            "same operator instance: this release (namespace %s) stays on standby while it leads; give "
            "each release its own instance",
            s.namespace,
            s.name,
            theirs,
            holder,
            s.release_namespace,
        )

    def _lease(self, now: str, *, transitions: int, acquired: str | None) -> Object:
        s = self.settings
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": s.name,
                "namespace": s.namespace,
                "labels": {"app.kubernetes.io/name": "maru-operator"},
                "annotations": {RELEASE_NAMESPACE_ANNOTATION: s.release_namespace},
            },
            "spec": {
                "holderIdentity": s.identity,
                "leaseDurationSeconds": max(1, round(s.lease_seconds)),
                "acquireTime": acquired or now,
                "renewTime": now,
                "leaseTransitions": transitions,
            },
        }

    async def _release(self) -> None:
        """Give the Lease up on shutdown: another replica takes over at once instead of after expiry.

        Bounded like a renewal: a shutdown never hangs on an API server that does not answer (the Lease
        then expires instead).
        """
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.settings.renew_deadline):
                await self._give_up()

    async def _give_up(self) -> None:
        s = self.settings
        with contextlib.suppress(ApiError, Unreachable):
            lease = await self.kube.get("Lease", s.namespace, s.name)
            if lease is not None and (lease.get("spec") or {}).get("holderIdentity") == s.identity:
                await self.kube.patch(
                    "Lease",
                    s.namespace,
                    s.name,
                    {
                        "metadata": {"resourceVersion": lease["metadata"]["resourceVersion"]},
                        "spec": {"holderIdentity": None, "leaseDurationSeconds": 1, "renewTime": micro_time()},
                    },
                )
                log.info("released the Lease %s/%s", s.namespace, s.name)
