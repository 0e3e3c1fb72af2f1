"""The child applier alone, against the API server emulator: no operator, no builders, no kopf.

It writes what differs and nothing else, deletes what is no longer wanted, and never touches a namesake another
controller owns.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from maru_localcluster.server import KubeEmulator
from maru_operator.applier import ChildApplier
from maru_operator.builders.common import Owner, owner_reference
from maru_operator.cache import Store
from maru_operator.kube import Kube
from tests.support.operator import GROUP_NS, group

pytestmark = pytest.mark.emulator


def account(owner: Owner, name: str, labels: dict[str, str]) -> dict[str, Any]:
    meta = {"name": name, "namespace": GROUP_NS, "labels": labels, "ownerReferences": [owner_reference(owner)]}
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta}


def writes(cluster: KubeEmulator, mark: int) -> list[tuple[str, str]]:
    return [(r.method, r.path.rsplit("/", 1)[-1]) for r in cluster.requests_since(mark) if r.method != "GET"]


def test_the_applier_writes_only_what_differs_and_leaves_a_namesake_alone(cluster: KubeEmulator) -> None:
    body = cluster.create(group())
    owner = Owner.from_body(body)
    foreign = cluster.create(
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "taken", "namespace": GROUP_NS}}
    )

    async def main() -> None:
        async with Kube(cluster.kopf_connection()) as client:
            applier = ChildApplier(client, Store())
            a, b = account(owner, "a", {"k": "1"}), account(owner, "b", {"k": "1"})

            mark = cluster.mark()
            first = await applier.apply(owner, [a, b])
            assert sorted(writes(cluster, mark)) == [("POST", "serviceaccounts"), ("POST", "serviceaccounts")]
            assert {k[2] for k in first.children} == {"a", "b"}

            mark = cluster.mark()
            await applier.apply(owner, [a, b])
            assert writes(cluster, mark) == []  # in sync: no write, and no diff needs a read either

            # A created child's first change adopts the create's fields as applied ones, then applies; later
            # changes are one apply each.
            mark = cluster.mark()
            await applier.apply(owner, [account(owner, "a", {"k": "1", "new": "x"}), b])
            assert writes(cluster, mark) == [("PATCH", "a"), ("PATCH", "a")]
            mark = cluster.mark()
            changed = await applier.apply(owner, [account(owner, "a", {"k": "2"}), b])
            assert writes(cluster, mark) == [("PATCH", "a")]
            assert cluster.get("serviceaccounts", "a", GROUP_NS)["metadata"]["labels"] == {"k": "2"}  # "new" went
            assert not changed.conflicts and not changed.refused

            mark = cluster.mark()
            await applier.apply(owner, [account(owner, "a", {"k": "2"})])
            assert writes(cluster, mark) == [("DELETE", "b")]
            assert cluster.get("serviceaccounts", "b", GROUP_NS) is None

            mark = cluster.mark()
            taken = await applier.apply(owner, [account(owner, "a", {"k": "2"}), account(owner, "taken", {})])
            assert [k[2] for k in taken.conflicts] == ["taken"]
            assert "not controlled by this InferenceGroup" in next(iter(taken.conflicts.values()))
            assert ("PATCH", "taken") not in writes(cluster, mark)
            assert cluster.get("serviceaccounts", "taken", GROUP_NS)["metadata"]["uid"] == foreign["metadata"]["uid"]

    asyncio.run(main())
