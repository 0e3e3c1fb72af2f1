"""What making a child costs: one create, also when its controller writes its status right after it
(kube-controller-manager does so within milliseconds of a Deployment's create); and the adoption of a created
child's fields, before the first apply it needs, keeps the entries other writers added meanwhile."""

from __future__ import annotations

import asyncio
import collections
import re
from typing import Any

import pytest

from maru_localcluster.server import KubeEmulator
from maru_operator.kube import ApiError, Kube
from maru_operator.ownership import FIELD_MANAGER, adoption_patch, owned_fields
from tests.support.operator import GROUP_NS, RunningOperator, group, has_condition, settle

pytestmark = pytest.mark.emulator

DEPLOY = "deployments.apps"


def _kind(path: str) -> str:
    """The plural a request path names (``.../namespaces/NS/deployments/NAME`` -> ``deployments``)."""
    parts = re.sub(r"/namespaces/[^/]+", "", path).strip("/").split("/")
    return parts[3] if parts[0] == "apis" else parts[2]


def test_each_child_is_one_create(cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]) -> None:
    mark = cluster.mark()
    cluster.create(group())
    cluster.wait_for("inferencegroups.maru.io", "qwen", GROUP_NS, lambda o: has_condition(o, "Ready", "True"))
    settle(operator)
    children = [
        r
        for r in cluster.requests_since(mark)
        if f"/namespaces/{GROUP_NS}/" in r.path + "/"
        and _kind(r.path) not in ("inferencegroups", "events")
        and not r.is_watch
    ]
    by_kind: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for r in children:
        by_kind[_kind(r.path)][r.method] += 1
    assert by_kind["deployments"] == {"POST": 3}, by_kind
    for kind, verbs in by_kind.items():
        assert verbs == {"POST": verbs["POST"]}, (kind, verbs)


def test_an_adoption_keeps_a_status_writers_entry_and_refuses_a_stale_read(cluster: KubeEmulator) -> None:
    body = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "s", "namespace": "default", "labels": {"a": "1", "b": "2"}},
        "spec": {"ports": [{"port": 80}]},
    }

    async def main() -> None:
        async with Kube(cluster.kopf_connection()) as client:
            created = await client.create(body)
            # Another manager writes between the create and the adoption.
            cluster.patch(
                "services", "s", {"metadata": {"annotations": {"seen": "yes"}}}, "default", field_manager="someone-else"
            )
            ops = adoption_patch(created, desired=body)
            assert ops is not None
            adopted = await client.json_patch("Service", "default", "s", ops)
            managers = {(e["manager"], e["operation"]) for e in adopted["metadata"]["managedFields"]}
            assert managers == {(FIELD_MANAGER, "Apply"), ("someone-else", "Update")}
            assert ("f:metadata", "f:labels", "f:b") in (owned_fields(adopted) or [])
            with pytest.raises(ApiError) as stale:  # our entry is no longer the one read
                await client.json_patch("Service", "default", "s", ops)
            assert stale.value.status == 422
            # Adopted: an apply without a label removes it.
            applied = await client.apply({**body, "metadata": {**body["metadata"], "labels": {"a": "1"}}})
            assert applied["metadata"]["labels"] == {"a": "1"}

    asyncio.run(main())
    assert adoption_patch({"metadata": {"managedFields": []}}) is None
