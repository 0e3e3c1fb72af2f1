"""Every request the operator makes is allowed by the ClusterRole it documents (``maru-operator rbac``)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml

from maru_localcluster.server import KubeEmulator
from maru_operator.rbac import (
    DEFAULT_LEASE_NAMESPACE,
    allows,
    cluster_role,
)
from tests.support.operator import (
    GROUP_NS,
    POOL_NS,
    RunningOperator,
    StubStats,
    bind_documented_rbac,
    group,
    has_condition,
    pool,
    settle,
)

DISCOVERY = {"/api", "/apis", "/version"}
NETPOL_GROUP = "networking.k8s.io"
NETPOL = f"networkpolicies.{NETPOL_GROUP}"


def permission(method: str, path: str, watch: bool) -> tuple[str, str, str] | None:
    """(verb, apiGroup, resource[/subresource]) of a request; None for discovery."""
    segs = [s for s in path.split("/") if s]
    if path in DISCOVERY or not segs:
        return None
    if segs[0] == "api":
        group, rest = "", segs[2:]
    else:
        group, rest = segs[1], segs[3:]
    if not rest:
        return None  # /api/v1, /apis/<group>/<version>: discovery
    if rest[0] == "namespaces" and len(rest) >= 3:
        rest = rest[2:]
    resource = rest[0] + (f"/{rest[2]}" if len(rest) > 2 else "")
    named = len(rest) > 1
    verb = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}.get(method)
    if verb is None:
        verb = "watch" if watch else ("get" if named else "list")
    return verb, group, resource


def test_cluster_role_is_valid() -> None:
    kubernetes_validate.validate(cluster_role(), "1.33", strict=True)
    assert "&id" not in yaml.safe_dump(cluster_role())


def check_requests(kube: KubeEmulator, namespaced: bool) -> set[Any]:
    denied: set[Any] = set()
    used: set[Any] = set()
    for r in kube.requests:
        perm = permission(r.method, r.path, r.is_watch)
        if perm is None:
            continue
        used.add(perm)
        lease_path = f"/namespaces/{DEFAULT_LEASE_NAMESPACE}/leases"
        name = r.path.partition(lease_path + "/")[2].split("/")[0] or None
        if not allows(
            *perm,
            namespaced=namespaced,
            in_pool_namespace=f"/namespaces/{POOL_NS}/" in r.path,
            in_lease_namespace=lease_path in r.path,
            name=name,
        ):
            denied.add((perm, r.path))
    assert not denied, sorted(denied)
    return used


@pytest.mark.emulator
def test_the_operator_works_within_its_rbac_on_a_hardened_cluster(cluster: KubeEmulator, stats: StubStats) -> None:
    """RBAC enforced by the API server, with OwnerReferencesPermissionEnforcement (as OpenShift has it):
    children carry blockOwnerDeletion, which needs update on the owners' finalizers subresource."""
    token = bind_documented_rbac(cluster)
    op = RunningOperator(cluster, stats, token=token, resync_seconds=3600, workers=2).start()
    try:
        cluster.create(pool())
        cluster.create(group())
        cluster.wait_for("inferencegroups.maru.io", "qwen", GROUP_NS, lambda o: has_condition(o, "Ready", "True"))
        cluster.wait_for("marupools.maru.io", "local-shm", None, lambda o: has_condition(o, "Ready", "True"))
        # The router reads pods in its namespace through the ClusterRole the operator bound; the operator
        # itself reads pods nowhere but in the pool namespace.
        router = cluster.service_account_token(GROUP_NS, "qwen-router")
        assert cluster.allowed(router, "list", "pods", GROUP_NS)
        assert not cluster.allowed(router, "list", "pods", POOL_NS)
        assert not cluster.allowed(token, "list", "pods", GROUP_NS)
        assert cluster.allowed(token, "list", "pods", POOL_NS)
        # The NetworkPolicies too, with blockOwnerDeletion, under RBAC and OwnerReferencesPermissionEnforcement.
        assert {p["metadata"]["name"] for p in cluster.list(NETPOL, GROUP_NS)} == {"qwen-vllm", "qwen-router"}
        assert {p["metadata"]["name"] for p in cluster.list(NETPOL, POOL_NS)} == {"local-shm-agent"}
        cluster.delete("marupools.maru.io", "local-shm")
        cluster.delete("inferencegroups.maru.io", "qwen", GROUP_NS)
        cluster.wait_gone("marupools.maru.io", "local-shm")
        settle(op, resync=False)
    finally:
        op.stop()
    denied = sorted({f"{r.method} {r.path}" for r in cluster.requests if r.status == 403})
    assert not denied, denied


@pytest.mark.emulator
def test_every_request_is_allowed(cluster: KubeEmulator, operator: RunningOperator) -> None:
    # The requests the operator sends after a failed create (a look at the name) and a failed apply (a look at
    # the object it meant): both faults must fire, or they cover nothing.
    create_conflict = cluster.inject_fault(r"/namespaces/llm/deployments$", 409, method="POST", times=1)
    cluster.create(pool())
    cluster.create(group())
    cluster.wait_for("inferencegroups.maru.io", "qwen", GROUP_NS, lambda o: has_condition(o, "Ready", "True"))
    settle(operator)
    apply_conflict = cluster.inject_fault(r"/networkpolicies/qwen-vllm$", 409, method="PATCH", times=1)
    cluster.patch("inferencegroups.maru.io", "qwen", {"spec": {"router": {"enabled": False}}}, GROUP_NS)
    cluster.wait_gone("deployments.apps", "qwen-router", GROUP_NS)
    cluster.wait_for(
        NETPOL,
        "qwen-vllm",
        GROUP_NS,
        lambda p: p["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8000}]}],
    )
    assert cluster.call(lambda: (create_conflict.hits, apply_conflict.hits)) == (1, 1)
    cluster.delete("marupools.maru.io", "local-shm")
    cluster.wait_for("marupools.maru.io", "local-shm", None, lambda p: has_condition(p, "InUse", "True"))
    cluster.delete("inferencegroups.maru.io", "qwen", GROUP_NS)
    cluster.wait_gone("marupools.maru.io", "local-shm")
    settle(operator, resync=False)
    used = check_requests(cluster, namespaced=False)
    assert ("patch", "maru.io", "marupools") in used  # the finalizer
    assert ("delete", "apps", "deployments") in used  # pruning
    assert ("list", "", "pods") in used
    assert {
        ("watch", NETPOL_GROUP, "networkpolicies"),
        ("patch", NETPOL_GROUP, "networkpolicies"),
        ("delete", NETPOL_GROUP, "networkpolicies"),
    } <= used  # the router's policy goes with the router


@pytest.mark.emulator
def test_every_request_is_allowed_in_namespaced_mode(cluster: KubeEmulator, stats: StubStats) -> None:
    op = RunningOperator(cluster, stats, resync_seconds=3600, workers=2, namespaces=[GROUP_NS, POOL_NS]).start()
    try:
        cluster.create(pool())
        cluster.create(group())
        cluster.wait_for("inferencegroups.maru.io", "qwen", GROUP_NS, lambda o: has_condition(o, "Ready", "True"))
        settle(op)
        # A hand edit the operator puts back: its fields adopted, then applied (children are created, not patched).
        cluster.patch(NETPOL, "qwen-vllm", {"spec": {"ingress": []}}, GROUP_NS, field_manager="kubectl-edit")
        cluster.wait_for(NETPOL, "qwen-vllm", GROUP_NS, lambda p: p["spec"].get("ingress"))
        settle(op)
    finally:
        op.stop()
    used = check_requests(cluster, namespaced=True)
    assert ("watch", "", "namespaces") in used
    assert {("watch", NETPOL_GROUP, "networkpolicies"), ("patch", NETPOL_GROUP, "networkpolicies")} <= used
    # With --namespace the chart grants workload rights only inside those namespaces (RoleBindings):
    # nothing may be listed or watched cluster-wide except what the cluster-wide role covers.
    cluster_wide_ok = {"marupools", "customresourcedefinitions", "namespaces", "events"}
    assert ("patch", "coordination.k8s.io", "leases") in used or ("create", "coordination.k8s.io", "leases") in used
    for r in cluster.requests:
        perm = permission(r.method, r.path, r.is_watch)
        if perm is None or perm[2].split("/")[0] in cluster_wide_ok:
            continue
        assert any(f"/namespaces/{ns}/" in r.path for ns in (GROUP_NS, POOL_NS)) or (
            f"/namespaces/{DEFAULT_LEASE_NAMESPACE}/leases" in r.path
        ), f"{r.method} {r.path}"
