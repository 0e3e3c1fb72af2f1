"""What the operator caches of its children: only its own managedFields, and writes that need them whole still
keep every other manager's.

The operator runs as a real kopf process against the API emulator; the simulated controllers write the
Deployments' status (an entry of kube-controller-manager), a user annotates with a field manager of their own.
"""

from __future__ import annotations

from typing import Any

import pytest

from maru_localcluster.server import KubeEmulator
from maru_operator.cache import Store, trimmed
from tests.support.operator import GROUP_NS, RunningOperator, group, settle

pytestmark = pytest.mark.emulator

IG = "inferencegroups.maru.io"
DEPLOY = "deployments.apps"


def managers(obj: dict[str, Any] | None) -> set[str]:
    assert obj is not None
    return {e["manager"] for e in obj["metadata"].get("managedFields") or []}


def test_the_cache_keeps_only_the_operators_own_managed_fields(
    cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]
) -> None:
    cluster.create(group())
    cluster.wait_for(DEPLOY, "qwen-decode", GROUP_NS, lambda d: "kube-controller-manager" in managers(d))
    cluster.patch(
        DEPLOY, "qwen-decode", {"metadata": {"annotations": {"team": "search"}}}, GROUP_NS, field_manager="a-user"
    )
    settle(operator)
    assert managers(cluster.get(DEPLOY, "qwen-decode", GROUP_NS)) >= {
        "maru-operator",
        "kube-controller-manager",
        "a-user",
    }
    cached = operator.call(lambda: operator.runtime.store.get(("Deployment", GROUP_NS, "qwen-decode")))
    # The watch events of the status and the annotation were cached without the other managers' entries.
    assert cached["metadata"]["annotations"]["team"] == "search"
    assert managers(cached) == {"maru-operator"}


def test_releasing_replicas_to_an_autoscaler_keeps_other_managers_fields(
    cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]
) -> None:
    """The release writes managedFields whole: from the cache's trimmed copy it would drop everyone else's."""
    cluster.create(group(decode={"replicas": 3}))
    cluster.wait_for(DEPLOY, "qwen-decode", GROUP_NS, lambda d: "kube-controller-manager" in managers(d))
    cluster.patch(
        DEPLOY, "qwen-decode", {"metadata": {"annotations": {"team": "search"}}}, GROUP_NS, field_manager="a-user"
    )
    settle(operator)
    cluster.patch(IG, "qwen", {"spec": {"decode": {"scaler": "External"}}}, GROUP_NS)
    settle(operator)
    dep = cluster.get(DEPLOY, "qwen-decode", GROUP_NS)
    assert dep is not None and dep["spec"]["replicas"] == 3
    assert managers(dep) >= {"maru-operator", "kube-controller-manager", "a-user"}
    # Still the user's: another manager's apply of the same annotation would conflict, not silently take it.
    owned = [e for e in dep["metadata"]["managedFields"] if e["manager"] == "a-user"]
    assert "f:team" in owned[0]["fieldsV1"]["f:metadata"]["f:annotations"]


def test_the_cache_keeps_its_own_entries_packed_and_hands_out_copies() -> None:
    def child(owner_uid: str) -> dict[str, Any]:
        fields = {
            "f:metadata": {"f:ownerReferences": {f'k:{{"uid":"{owner_uid}"}}': {}}},
            "f:spec": {"f:replicas": {}, "f:template": {"f:spec": {"f:containers": {}}}},
        }
        return {
            "kind": "Deployment",
            "metadata": {
                "name": owner_uid,
                "namespace": "ns",
                "resourceVersion": "5",
                "managedFields": [
                    {"manager": "maru-operator", "operation": "Apply", "fieldsV1": fields},
                    {
                        "manager": "maru-operator",
                        "operation": "Update",
                        "subresource": "status",
                        "fieldsV1": {"f:status": {}},
                    },
                    {"manager": "kube-controller-manager", "operation": "Update", "fieldsV1": {"f:status": {}}},
                ],
            },
        }

    a = child("uid-a")
    ta = trimmed(a)
    assert [e["manager"] for e in ta["metadata"]["managedFields"]] == ["maru-operator"]
    assert ta["metadata"]["managedFields"][0] == a["metadata"]["managedFields"][0]
    assert len(a["metadata"]["managedFields"]) == 3  # the object handed in is not changed
    assert trimmed({"kind": "Secret", "metadata": {"name": "x"}}) == {"kind": "Secret", "metadata": {"name": "x"}}

    store = Store()
    store.summarize("Deployment", lambda d: d["metadata"]["name"].upper())
    store.put(a)
    key = ("Deployment", "ns", "uid-a")
    got = store.get(key)
    assert got == ta and store.version(key) == "5" and store.summary(key) == "UID-A"
    got["metadata"]["name"] = "changed"  # a reader's copy: the cache is not changed through it
    assert store.get(key) == ta and store.summaries("Deployment") == {key: "UID-A"}
    store.put({**a, "metadata": {**a["metadata"], "resourceVersion": "4"}})  # older: ignored
    assert store.version(key) == "5"
    store.remove(key)
    assert store.get(key) is None and store.summaries("Deployment") == {}
