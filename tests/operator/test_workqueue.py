"""The work queue: one reconcile per key at a time, adds collapse, errors back off, delays requeue."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Hashable

import kopf

from maru_operator.cache import Store, owner_key
from maru_operator.workqueue import WorkQueue


async def until(predicate, limit: int = 2000) -> None:  # type: ignore[no-untyped-def]
    for _ in range(limit):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition never held")


def test_never_concurrent_and_collapses() -> None:
    async def main() -> None:
        running: set[Hashable] = set()
        calls: Counter[Hashable] = Counter()
        gate = asyncio.Event()

        async def reconcile(key: Hashable) -> None:
            assert key not in running, "same key reconciled twice at once"
            running.add(key)
            calls[key] += 1
            await gate.wait()
            running.discard(key)

        queue = WorkQueue(reconcile, workers=4)
        queue.start()
        queue.add(("K", "", "a"))
        await until(lambda: calls[("K", "", "a")] == 1)
        for _ in range(10):  # while running: marks dirty once
            queue.add(("K", "", "a"))
        queue.add(("K", "", "b"))
        gate.set()
        await until(queue.idle)
        assert calls == {("K", "", "a"): 2, ("K", "", "b"): 1}
        await queue.stop()

    asyncio.run(main())


def test_errors_retry_and_temporary_errors_requeue() -> None:
    async def main() -> None:
        calls: Counter[Hashable] = Counter()

        async def reconcile(key: Hashable) -> float | None:
            calls[key] += 1
            if key == "boom" and calls[key] < 3:
                raise RuntimeError("API said 500")
            if key == "wait" and calls[key] < 2:
                raise kopf.TemporaryError("pool not ready", delay=0.01)
            if key == "bad":
                raise kopf.PermanentError("invalid spec")
            return None

        queue = WorkQueue(reconcile, workers=2)
        queue._max_backoff = 0.02
        queue.start()
        for key in ("boom", "wait", "bad"):
            queue.add(key)
        await until(lambda: calls["boom"] == 3 and calls["wait"] == 2)
        await asyncio.sleep(0.05)
        assert calls["bad"] == 1  # permanent: not retried until the next event
        await queue.stop()

    asyncio.run(main())


def test_delayed_add_keeps_the_earliest() -> None:
    async def main() -> None:
        seen: list[Hashable] = []

        async def reconcile(key: Hashable) -> None:
            seen.append(key)

        queue = WorkQueue(reconcile, workers=1)
        queue.start()
        queue.add("k", delay=0.02)
        queue.add("k", delay=30)
        await until(lambda: seen == ["k"])
        await queue.stop()

    asyncio.run(main())


class TestStore:
    def child(self, name: str, rv: str = "1", owner: str = "g") -> dict:
        return {
            "kind": "Deployment",
            "metadata": {
                "name": name,
                "namespace": "llm",
                "resourceVersion": rv,
                "ownerReferences": [
                    {
                        "apiVersion": "maru.io/v1alpha1",
                        "kind": "InferenceGroup",
                        "name": owner,
                        "uid": "u",
                        "controller": True,
                    }
                ],
            },
        }

    def test_children_by_owner(self) -> None:
        store = Store()
        store.put(self.child("a"))
        store.put(self.child("b", owner="other"))
        assert list(store.children(("InferenceGroup", "llm", "g"))) == [("Deployment", "llm", "a")]
        store.remove(self.child("a"))
        assert store.children(("InferenceGroup", "llm", "g")) == {}

    def test_older_versions_do_not_replace_newer(self) -> None:
        store = Store()
        store.put(self.child("a", "5"))
        store.put(self.child("a", "4"))
        assert store.get(("Deployment", "llm", "a"))["metadata"]["resourceVersion"] == "5"  # type: ignore[index]

    def test_a_write_answered_after_the_delete_was_seen_does_not_bring_the_object_back(self) -> None:
        """The operator creates a child (rv 5), someone deletes it (the DELETED event, rv 6, is handled),
        then the create's response (rv 5) reaches the store: the child stays gone, so the next reconcile
        makes it again instead of believing it in sync."""
        store = Store()
        store.put(self.child("a", "5"))
        store.remove(self.child("a", "6"))
        store.put(self.child("a", "5"))
        assert store.get(("Deployment", "llm", "a")) is None
        assert store.children(("InferenceGroup", "llm", "g")) == {}
        store.put(self.child("a", "7"))  # made again: newer than the delete
        assert store.get(("Deployment", "llm", "a"))["metadata"]["resourceVersion"] == "7"  # type: ignore[index]

    def test_a_removal_by_key_forgets_what_was_cached_up_to_its_version(self) -> None:
        store = Store()
        store.put(self.child("a", "5"))
        store.remove(("Deployment", "llm", "a"))  # our own delete, or a 404: no newer version known
        store.put(self.child("a", "5"))
        assert store.get(("Deployment", "llm", "a")) is None
        store.put(self.child("a", "8"))
        assert store.get(("Deployment", "llm", "a")) is not None

    def test_owner_key_ignores_foreign_owners(self) -> None:
        foreign = self.child("a")
        foreign["metadata"]["ownerReferences"][0]["apiVersion"] = "apps/v1"
        assert owner_key(foreign) is None
        pool_child = self.child("x")
        pool_child["metadata"]["ownerReferences"][0]["kind"] = "MaruPool"
        assert owner_key(pool_child) == ("MaruPool", "", "g")

    def test_groups_of_pool(self) -> None:
        store = Store()
        store.put(
            {"kind": "InferenceGroup", "metadata": {"name": "a", "namespace": "n"}, "spec": {"poolRef": {"name": "p"}}}
        )
        store.put(
            {"kind": "InferenceGroup", "metadata": {"name": "b", "namespace": "n"}, "spec": {"poolRef": {"name": "q"}}}
        )
        assert store.groups_of_pool("p") == [("InferenceGroup", "n", "a")]
