"""A group's InferencePool, by the operator running for real (kopf) against the API emulator: written where the
Gateway API Inference Extension's CRD is installed, said to be missing (and nothing else disturbed) where it is not,
written once the CRD arrives, pruned when the group stops asking for it."""

from __future__ import annotations

import time
from typing import Any

import pytest

from maru_localcluster.server import KubeEmulator
from tests.support.operator import (
    GROUP_NS,
    RunningOperator,
    StubStats,
    bind_documented_rbac,
    condition_of,
    group,
    has_condition,
    pool,
    settle,
)

pytestmark = pytest.mark.emulator

POOLS = "inferencepools.inference.networking.k8s.io"
GROUPS = "inferencegroups.maru.io"
PICKER = {"name": "qwen-epp", "port": {"number": 9002}}
MISSING = (
    "InferencePool requested but the CRD inference.networking.k8s.io/v1 InferencePool is not installed: "
    "install the Gateway API Inference Extension"
)

# The CRD as far as this test needs it: the kind, served and stored at v1 (the real one carries a full schema).
INFERENCE_POOL_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "inferencepools.inference.networking.k8s.io"},
    "spec": {
        "group": "inference.networking.k8s.io",
        "scope": "Namespaced",
        "names": {
            "plural": "inferencepools",
            "singular": "inferencepool",
            "kind": "InferencePool",
            "listKind": "InferencePoolList",
        },
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
            }
        ],
    },
}


def _gateway_group(enabled: bool = True) -> dict[str, Any]:
    return group(inferencePool={"enabled": enabled, "endpointPicker": PICKER})


def _controller(op: RunningOperator) -> Any:
    for _ in range(500):
        if op.runtime.controller is not None:
            return op.runtime.controller
        time.sleep(0.02)
    raise AssertionError("the operator never started its controller")


def _pool_requests(kube: KubeEmulator) -> list[str]:
    """Requests for InferencePool objects (lists, watches, writes), discovery of the group/version aside."""
    return [f"{r.method} {r.path}" for r in kube.requests if "/inferencepools" in r.path]


def test_the_group_gets_its_inference_pool_within_the_documented_rbac(cluster: KubeEmulator, stats: StubStats) -> None:
    """With the CRD installed: the pool selects both roles' vLLM pods and names the picker; a hand-deleted one is
    put back (the kind is watched); disabling prunes it. The operator holds only what ``maru-operator rbac``
    documents, on an API server enforcing it."""
    cluster.create(INFERENCE_POOL_CRD)
    token = bind_documented_rbac(cluster)
    op = RunningOperator(cluster, stats, token=token, resync_seconds=3600, workers=2).start()
    try:
        cluster.create(pool())
        cluster.create(_gateway_group())
        made = cluster.wait_for(POOLS, "qwen", GROUP_NS)
        assert made["spec"]["selector"] == {
            "matchLabels": {"app.kubernetes.io/name": "vllm", "app.kubernetes.io/instance": "qwen"}
        }
        assert made["spec"]["targetPorts"] == [{"number": 8000}]
        assert made["spec"]["endpointPickerRef"] == {
            "kind": "Service",
            "name": "qwen-epp",
            "port": {"number": 9002},
            "failureMode": "FailClose",
        }
        (ref,) = made["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"]) == ("InferenceGroup", "qwen")
        body = cluster.wait_for(
            GROUPS,
            "qwen",
            GROUP_NS,
            lambda o: has_condition(o, "Ready", "True") and has_condition(o, "InferencePoolReady", "True", "Written"),
        )
        # Both roles' pods carry what the pool selects (the simulated controllers make no pods: the templates).
        for role in ("prefill", "decode"):
            template = cluster.get("deployments.apps", f"qwen-{role}", GROUP_NS)["spec"]["template"]  # type: ignore[index]
            assert made["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
            assert template["metadata"]["labels"]["llm-d.ai/role"] == role
        assert body["status"]["endpoint"], "the router still serves the group"

        cluster.delete(POOLS, "qwen", GROUP_NS)
        cluster.wait_for(POOLS, "qwen", GROUP_NS, lambda o: o["metadata"]["uid"] != made["metadata"]["uid"])

        cluster.patch(GROUPS, "qwen", {"spec": {"inferencePool": {"enabled": False}}}, GROUP_NS)
        cluster.wait_gone(POOLS, "qwen", GROUP_NS)
        cluster.wait_for(
            GROUPS,
            "qwen",
            GROUP_NS,
            lambda o: (
                has_condition(o, "Ready", "True")
                and not any(c["type"] == "InferencePoolReady" for c in o["status"]["conditions"])
            ),
        )
        settle(op)
    finally:
        op.stop()
    assert op.error is None
    denied = sorted({f"{r.method} {r.path}" for r in cluster.requests if r.status == 403})
    assert not denied, denied


def test_without_the_crd_the_group_serves_and_says_what_to_install(cluster: KubeEmulator, stats: StubStats) -> None:
    """No error loop: the group is Ready, InferencePoolReady=False names the CRD to install, one Warning Event, no
    request for InferencePool objects; once the CRD is installed the pool is written without a restart."""
    op = RunningOperator(cluster, stats, resync_seconds=3600, workers=2).start()
    try:
        controller = _controller(op)
        controller.inference_pools.recheck_seconds = 1.0  # instead of a minute: the test installs the CRD later
        cluster.create(pool())
        cluster.create(_gateway_group())
        body = cluster.wait_for(
            GROUPS,
            "qwen",
            GROUP_NS,
            lambda o: (
                has_condition(o, "Ready", "True") and has_condition(o, "InferencePoolReady", "False", "CRDNotInstalled")
            ),
        )
        assert MISSING in condition_of(body, "InferencePoolReady")["message"]
        settle(op)
        # Several looks at discovery later (the group looks again each recheck), still one Event, nothing else.
        time.sleep(3)
        settle(op)
        events = [
            e
            for e in cluster.list("events", GROUP_NS)
            if e["involvedObject"]["name"] == "qwen" and e["reason"] == "CRDNotInstalled"
        ]
        assert len(events) == 1, events
        assert events[0]["type"] == "Warning" and MISSING in events[0]["message"]
        assert not _pool_requests(cluster), _pool_requests(cluster)
        # The rest of the group was written, and nothing is rewritten while the CRD stays missing.
        assert cluster.get("deployments.apps", "qwen-decode", GROUP_NS) is not None
        mark = len(cluster.requests)
        time.sleep(2.5)
        settle(op, resync=False)
        writes = [
            f"{r.method} {r.path}" for r in cluster.requests_since(mark) if r.is_write and "/leases/" not in r.path
        ]
        assert not writes, writes

        cluster.create(INFERENCE_POOL_CRD)
        made = cluster.wait_for(POOLS, "qwen", GROUP_NS)
        cluster.wait_for(GROUPS, "qwen", GROUP_NS, lambda o: has_condition(o, "InferencePoolReady", "True"))
        # kopf watches the kind since the CRD came: a hand deletion is noticed and corrected.
        cluster.delete(POOLS, "qwen", GROUP_NS)
        cluster.wait_for(POOLS, "qwen", GROUP_NS, lambda o: o["metadata"]["uid"] != made["metadata"]["uid"])
    finally:
        op.stop()
    assert op.error is None


def test_a_group_without_the_field_never_asks_discovery(cluster: KubeEmulator, stats: StubStats) -> None:
    op = RunningOperator(cluster, stats, resync_seconds=3600, workers=2).start()
    try:
        cluster.create(pool())
        cluster.create(group())
        cluster.wait_for(GROUPS, "qwen", GROUP_NS, lambda o: has_condition(o, "Ready", "True"))
        settle(op)
    finally:
        op.stop()
    # kopf reads no group /apis does not list: a discovery request would be the controller's.
    assert not [r.path for r in cluster.requests if r.path.startswith("/apis/inference.networking.k8s.io")]
    assert not _pool_requests(cluster)


def _served_group(cluster: KubeEmulator, stats: StubStats) -> tuple[RunningOperator, dict[str, Any]]:
    """The CRD installed, the operator running (discovery asked again every half second), the group's pool made."""
    cluster.create(INFERENCE_POOL_CRD)
    op = RunningOperator(cluster, stats, resync_seconds=3600, workers=2).start()
    _controller(op).inference_pools.recheck_seconds = 0.5
    cluster.create(pool())
    cluster.create(_gateway_group())
    made = cluster.wait_for(POOLS, "qwen", GROUP_NS)
    cluster.wait_for(GROUPS, "qwen", GROUP_NS, lambda o: has_condition(o, "InferencePoolReady", "True"))
    settle(op)
    return op, made


def test_a_failed_discovery_is_not_a_missing_crd(cluster: KubeEmulator, stats: StubStats) -> None:
    """An operator that has never been told whether the kind is served (as after a restart) while discovery answers
    500: the InferencePool it watches stays as it is (Unknown, never pruned) until discovery answers. (One that
    was told keeps the last answer through a failure.)"""
    from maru_operator.optionalkinds import OptionalKind

    op, made = _served_group(cluster, stats)
    try:
        mark = len(cluster.requests)
        cluster.inject_fault(r"^/apis/inference\.networking\.k8s\.io/v1/?$", 500, method="GET", times=10_000)
        op.call(
            lambda: setattr(
                op.runtime.controller.groups, "inference_pools", OptionalKind("InferencePool", recheck_seconds=0.5)
            )
        )
        cluster.patch(GROUPS, "qwen", {"metadata": {"annotations": {"touched": "1"}}}, GROUP_NS)
        body = cluster.wait_for(
            GROUPS, "qwen", GROUP_NS, lambda o: has_condition(o, "InferencePoolReady", "Unknown", "DiscoveryFailed")
        )
        assert has_condition(body, "Ready", "True")
        time.sleep(1.2)  # a few more looks at discovery, each failing
        settle(op)
        assert cluster.get(POOLS, "qwen", GROUP_NS)["metadata"]["uid"] == made["metadata"]["uid"]  # type: ignore[index]
        cluster.clear_faults()
        cluster.wait_for(GROUPS, "qwen", GROUP_NS, lambda o: has_condition(o, "InferencePoolReady", "True"))
    finally:
        op.stop()
    deletes = [r.path for r in cluster.requests_since(mark) if r.method == "DELETE" and "/inferencepools" in r.path]
    assert not deletes, deletes
    assert cluster.get(POOLS, "qwen", GROUP_NS)["metadata"]["uid"] == made["metadata"]["uid"]  # type: ignore[index]


def test_an_inference_pool_deleted_in_a_watch_gap_is_made_again_at_the_resync(
    cluster: KubeEmulator, stats: StubStats
) -> None:
    """kopf's watch resumed after a 410 lists again but tells nothing of what went meanwhile: the resync's lists
    cover the kind (once discovery serves it), and the group writes its pool again."""
    from tests.support.operator import on_loop

    op, made = _served_group(cluster, stats)
    try:

        def watch_gap(emulator: Any) -> None:
            emulator.drop_watches(r"/inferencepools")
            emulator.delete_object("inference.networking.k8s.io", "inferencepools", GROUP_NS, "qwen")
            emulator.compact()

        cluster.call(watch_gap, cluster.emulator)
        cluster.wait_until(
            lambda e: any("/inferencepools" in p for p in e.open_watches()), message="the InferencePool watch, again"
        )
        settle(op, resync=False)
        on_loop(op, op.runtime.relist(op.runtime.kube, [], metadata_only=True))
        again = cluster.wait_for(POOLS, "qwen", GROUP_NS)
        assert again["metadata"]["uid"] != made["metadata"]["uid"]
    finally:
        op.stop()
