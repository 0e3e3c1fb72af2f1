"""The leader elector alone, against an in-memory Lease: what starting to lead does never holds up the renewals."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from maru_operator.kube import ApiError
from maru_operator.leader import LeaderElector, LeaseSettings

SETTINGS = LeaseSettings(
    namespace="default", name="maru-operator", identity="me", lease_seconds=3.0, renew_deadline=1.0, retry_period=0.05
)


class FakeKube:
    """Holds one Lease; a patch is a compare-and-swap on its resourceVersion, as the API server does it."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0
        self.renewals = 0
        self.events: list[str] = []

    def _stored(self, body: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        body["metadata"]["resourceVersion"] = str(self.version)
        self.lease = body
        return copy.deepcopy(body)

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.lease)

    async def create(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._stored(copy.deepcopy(body))

    async def patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        assert self.lease is not None
        if patch["metadata"]["resourceVersion"] != self.lease["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", "the Lease changed")
        body = copy.deepcopy(self.lease)
        body["metadata"].update(patch["metadata"])
        body["spec"].update(patch["spec"])
        self.renewals += 1
        return self._stored(body)

    async def event(self, involved: dict[str, Any], *, type_: str, reason: str, message: str, now: str) -> None:
        self.events.append(message)


async def until(predicate, limit: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    end = loop.time() + limit
    while not predicate():
        assert loop.time() < end, "condition never held"
        await asyncio.sleep(0.01)


def test_starting_to_lead_outlasts_the_renew_deadline_while_the_lease_is_renewed() -> None:
    async def main() -> None:
        kube = FakeKube()
        primed, lost = asyncio.Event(), []

        async def lead() -> None:
            before = kube.renewals
            # Priming a large cluster: done only once several renew deadlines have passed, counted in renewals
            # (this process's own), never in seconds of wall clock.
            await until(lambda: kube.renewals >= before + 3 * round(SETTINGS.renew_deadline / SETTINGS.retry_period))
            primed.set()

        async def lose() -> None:
            lost.append(True)

        elector = LeaderElector(kube, SETTINGS, on_lead=lead, on_lose=lose)  # type: ignore[arg-type]
        task = asyncio.create_task(elector.run())
        await asyncio.wait_for(primed.wait(), 30)
        assert elector.leading and not lost
        assert kube.events == ["me became leader"]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert lost == [True]
        assert kube.lease is not None and kube.lease["spec"]["holderIdentity"] is None  # given up on shutdown

    asyncio.run(main())


def test_losing_the_lease_cancels_starting_to_lead() -> None:
    async def main() -> None:
        kube = FakeKube()
        cancelled, lost = asyncio.Event(), asyncio.Event()

        async def lead() -> None:
            # Another holder writes the Lease (an operator edited it, say): the renewals now conflict.
            kube.lease["metadata"]["resourceVersion"] = "elsewhere"  # type: ignore[index]
            kube.lease["spec"]["holderIdentity"] = "other"  # type: ignore[index]
            try:
                await asyncio.Event().wait()  # priming that never ends
            except asyncio.CancelledError:
                cancelled.set()
                raise

        async def lose() -> None:
            lost.set()

        elector = LeaderElector(kube, SETTINGS, on_lead=lead, on_lose=lose)  # type: ignore[arg-type]
        task = asyncio.create_task(elector.run())
        await asyncio.wait_for(lost.wait(), 30)
        assert cancelled.is_set() and not elector.leading
        assert kube.events == ["me became leader", "me stopped leading"]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())


def test_a_leader_that_fails_to_start_steps_down_and_gives_the_lease_up() -> None:
    async def main() -> None:
        kube = FakeKube()
        lost = asyncio.Event()
        attempts: list[int] = []

        async def lead() -> None:
            attempts.append(1)
            raise RuntimeError("no list")

        async def lose() -> None:
            lost.set()

        elector = LeaderElector(kube, SETTINGS, on_lead=lead, on_lose=lose)  # type: ignore[arg-type]
        task = asyncio.create_task(elector.run())
        await asyncio.wait_for(lost.wait(), 30)
        # Released, so that a standby may take it at once rather than after it expires.
        await until(lambda: kube.lease is not None and kube.lease["spec"]["holderIdentity"] is None)
        assert kube.events[:2] == ["me became leader", "me stopped leading"]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
