"""The operator for real (in-process kopf) against the API emulator over HTTP, with simulated controllers."""

from __future__ import annotations

from typing import Any

import pytest

from maru_localcluster.server import KubeEmulator
from tests.support.operator import (
    GROUP_NS,
    POOL_NS,
    RunningOperator,
    StubStats,
    condition_of,
    create_namespace,
    fake_agent_pod,
    group,
    has_condition,
    object_writes,
    pool,
    settle,
    wait_event,
)

pytestmark = pytest.mark.emulator

IG = "inferencegroups.maru.io"
MP = "marupools.maru.io"
DEPLOY = "deployments.apps"
DS = "daemonsets.apps"
NETPOL = "networkpolicies.networking.k8s.io"


def ready(obj: dict[str, Any]) -> bool:
    return has_condition(obj, "Ready", "True")


def events(kube: KubeEmulator, namespace: str, name: str) -> list[dict[str, Any]]:
    return [e for e in kube.list("events", namespace) if e.get("involvedObject", {}).get("name") == name]


def wait_group_ready(kube: KubeEmulator, name: str = "qwen", namespace: str = GROUP_NS) -> dict[str, Any]:
    return kube.wait_for(IG, name, namespace, ready)


@pytest.fixture
def ready_pool(cluster: KubeEmulator, operator: RunningOperator) -> dict[str, Any]:
    cluster.create(pool())
    return cluster.wait_for(MP, "local-shm", None, ready)


def test_create_pool_and_group(cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]) -> None:
    ds = cluster.get(DS, "local-shm-agent", POOL_NS)
    assert ds is not None
    assert ds["metadata"]["ownerReferences"][0]["uid"] == ready_pool["metadata"]["uid"]
    assert "maru.io/in-use-protection" in ready_pool["metadata"]["finalizers"]
    st = ready_pool["status"]
    assert (st["nodeSummary"], st["capacity"], st["endpoint"]) == ("1/1", "1Gi", "unix:///run/maru/local-shm/pool.sock")

    cluster.create(group())
    # Ready as soon as the router Service has a ready endpoint; the replica counts may follow a moment later.
    ig = cluster.wait_for(IG, "qwen", GROUP_NS, lambda o: ready(o) and o["status"]["router"]["summary"] == "1/1")
    uid = ig["metadata"]["uid"]
    for resource, name in [
        (DEPLOY, "qwen-prefill"),
        (DEPLOY, "qwen-decode"),
        (DEPLOY, "qwen-router"),
        ("services", "qwen"),
        ("serviceaccounts", "qwen-router"),
        ("rolebindings.rbac.authorization.k8s.io", "qwen-router-pods"),
        (NETPOL, "qwen-vllm"),
        (NETPOL, "qwen-router"),
    ]:
        child = cluster.get(resource, name, GROUP_NS)
        assert child is not None, f"{resource} {name} missing"
        assert child["metadata"]["ownerReferences"][0]["uid"] == uid
    st = ig["status"]
    assert (st["prefill"]["summary"], st["decode"]["summary"], st["router"]["summary"]) == ("1/1", "2/2", "1/1")
    assert st["endpoint"] == "http://qwen.llm.svc:8000"
    assert st["observedGeneration"] == ig["metadata"]["generation"]
    assert has_condition(ig, "PoolBound", "True", "Bound")
    cluster.wait_for(MP, "local-shm", None, lambda p: p.get("status", {}).get("boundGroups") == 1)
    assert wait_event(cluster, GROUP_NS, "qwen", "Serving")["type"] == "Normal"


def test_network_policies_are_children_kept_as_built(
    cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]
) -> None:
    agent_policy = cluster.wait_for(NETPOL, "local-shm-agent", POOL_NS)
    assert agent_policy["metadata"]["ownerReferences"][0]["uid"] == ready_pool["metadata"]["uid"]
    cluster.create(group())
    wait_group_ready(cluster)
    # Opened by hand (ingress from anywhere): put back on the next pass.
    cluster.patch(NETPOL, "qwen-vllm", {"spec": {"ingress": [{}]}}, GROUP_NS)
    cluster.wait_for(NETPOL, "qwen-vllm", GROUP_NS, lambda p: p["spec"]["ingress"] != [{}])
    cluster.delete(NETPOL, "qwen-router", GROUP_NS)
    cluster.wait_for(NETPOL, "qwen-router", GROUP_NS)
    # No router, no router policy.
    cluster.patch(IG, "qwen", {"spec": {"router": {"enabled": False}}}, GROUP_NS)
    cluster.wait_gone(NETPOL, "qwen-router", GROUP_NS)


def test_update_rolls_children(cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]) -> None:
    cluster.create(group())
    wait_group_ready(cluster)
    cluster.patch(
        IG,
        "qwen",
        {"spec": {"decode": {"replicas": 3, "extraArgs": ["--max-num-seqs=8"]}, "connector": {"chunkTokens": 512}}},
        GROUP_NS,
    )
    decode = cluster.wait_for(DEPLOY, "qwen-decode", GROUP_NS, lambda d: d["spec"]["replicas"] == 3)
    args = decode["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[-1] == "--max-num-seqs=8"
    prefill = cluster.wait_for(
        DEPLOY, "qwen-prefill", GROUP_NS, lambda d: '"maru_kv_chunk_tokens":512' in str(d["spec"]["template"])
    )
    assert prefill is not None
    ig = cluster.wait_for(
        IG,
        "qwen",
        GROUP_NS,
        lambda o: (
            o.get("status", {})["decode"]["summary"] == "3/3"
            and ready(o)
            and o["status"]["observedGeneration"] == o["metadata"]["generation"]
        ),
    )
    assert ig["metadata"]["generation"] == 2

    cluster.patch(IG, "qwen", {"spec": {"router": {"enabled": False}}}, GROUP_NS)
    cluster.wait_gone(DEPLOY, "qwen-router", GROUP_NS)
    cluster.wait_gone("services", "qwen", GROUP_NS)
    cluster.wait_for(IG, "qwen", GROUP_NS, lambda o: o.get("status", {})["endpoint"] == "" and ready(o))


def test_drift_is_corrected(cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]) -> None:
    cluster.create(group())
    wait_group_ready(cluster)
    original = cluster.get(DEPLOY, "qwen-decode", GROUP_NS)
    assert original is not None
    wanted = original["spec"]["template"]["spec"]["containers"][0]["args"]
    cluster.patch(
        DEPLOY,
        "qwen-decode",
        {
            "spec": {
                "replicas": 7,
                "template": {
                    "spec": {
                        "containers": [{**original["spec"]["template"]["spec"]["containers"][0], "args": ["hacked"]}]
                    }
                },
            }
        },
        GROUP_NS,
    )
    cluster.wait_for(
        DEPLOY,
        "qwen-decode",
        GROUP_NS,
        lambda d: d["spec"]["replicas"] == 2 and d["spec"]["template"]["spec"]["containers"][0]["args"] == wanted,
    )
    cluster.delete("services", "qwen", GROUP_NS)
    cluster.delete(DS, "local-shm-agent", POOL_NS)
    cluster.wait_for("services", "qwen", GROUP_NS)
    cluster.wait_for(DS, "local-shm-agent", POOL_NS)


def test_delete_group_removes_children(
    cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]
) -> None:
    cluster.create(group())
    wait_group_ready(cluster)
    cluster.delete(IG, "qwen", GROUP_NS)
    for name in ("qwen-prefill", "qwen-decode", "qwen-router"):
        cluster.wait_gone(DEPLOY, name, GROUP_NS)
    cluster.wait_gone("services", "qwen", GROUP_NS)
    cluster.wait_for(MP, "local-shm", None, lambda p: p.get("status", {})["boundGroups"] == 0)


def test_pool_not_ready_then_ready(cluster: KubeEmulator, operator: RunningOperator, kube_controllers: Any) -> None:
    kube_controllers.hold()
    cluster.create(pool())
    cluster.create(group())
    ig = cluster.wait_for(IG, "qwen", GROUP_NS, lambda o: has_condition(o, "PoolBound", "False", "PoolNotReady"))
    assert has_condition(ig, "Ready", "False", "PoolNotReady")
    assert "local-shm" in condition_of(ig, "PoolBound")["message"]
    settle(operator)
    assert cluster.get(DEPLOY, "qwen-prefill", GROUP_NS) is None
    assert cluster.get(DEPLOY, "qwen-decode", GROUP_NS) is None
    # How every start looks (a group applied with its pool): Normal; the pool's own conditions say what keeps it.
    assert not [e for e in events(cluster, GROUP_NS, "qwen") if e["type"] == "Warning"]
    kube_controllers.release()
    wait_group_ready(cluster)
    assert cluster.get(DEPLOY, "qwen-prefill", GROUP_NS) is not None


def test_missing_pool_then_created(cluster: KubeEmulator, operator: RunningOperator) -> None:
    cluster.create(group(pool_name="later"))
    cluster.wait_for(IG, "qwen", GROUP_NS, lambda o: has_condition(o, "PoolBound", "False", "PoolNotFound"))
    cluster.create(pool("later"))
    wait_group_ready(cluster)


def test_namespace_not_allowed(cluster: KubeEmulator, operator: RunningOperator) -> None:
    cluster.create(pool(allowedNamespaces=["prod"]))
    cluster.create(group())
    ig = cluster.wait_for(IG, "qwen", GROUP_NS, lambda o: has_condition(o, "PoolBound", "False", "NamespaceNotAllowed"))
    assert "allowedNamespaces" in condition_of(ig, "PoolBound")["message"]
    wait_event(cluster, GROUP_NS, "qwen", "NamespaceNotAllowed")
    settle(operator)
    assert cluster.get(DEPLOY, "qwen-prefill", GROUP_NS) is None
    warnings = [e for e in events(cluster, GROUP_NS, "qwen") if e["type"] == "Warning"]
    assert [e["reason"] for e in warnings] == ["NamespaceNotAllowed"]
    # Granting access lets the group proceed by itself; revoking it again scales the vLLM pods to zero.
    cluster.patch(MP, "local-shm", {"spec": {"allowedNamespaces": ["prod", GROUP_NS]}})
    wait_group_ready(cluster)
    cluster.patch(MP, "local-shm", {"spec": {"allowedNamespaces": ["prod"]}})
    cluster.wait_for(DEPLOY, "qwen-decode", GROUP_NS, lambda d: d["spec"]["replicas"] == 0)
    # A group refused by the pool does not hold it: the pool can be deleted.
    cluster.wait_for(MP, "local-shm", None, lambda p: p.get("status", {}).get("boundGroups") == 0)
    cluster.delete(MP, "local-shm")
    cluster.wait_gone(MP, "local-shm")


def test_pool_deletion_waits_for_bound_groups(
    cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]
) -> None:
    cluster.create(group())
    wait_group_ready(cluster)
    cluster.delete(MP, "local-shm")
    held = cluster.wait_for(MP, "local-shm", None, lambda p: has_condition(p, "InUse", "True", "DeletionBlocked"))
    assert "llm/qwen" in condition_of(held, "InUse")["message"]
    blocked = wait_event(cluster, "default", "local-shm", "DeletionBlocked")
    assert blocked["type"] == "Warning" and "llm/qwen" in blocked["message"]
    cluster.wait_for(IG, "qwen", GROUP_NS, lambda o: has_condition(o, "PoolBound", "False", "PoolDeleting"))
    assert cluster.get(DEPLOY, "qwen-decode", GROUP_NS) is not None  # serving pods are left alone
    cluster.delete(IG, "qwen", GROUP_NS)
    cluster.wait_gone(MP, "local-shm")
    cluster.wait_gone(DS, "local-shm-agent", POOL_NS)


def test_group_deleted_during_a_watch_gap_releases_its_pool(cluster: KubeEmulator, stats: StubStats) -> None:
    """kopf lists again after a 410 Gone, without DELETED events for what went away in the gap."""
    op = RunningOperator(cluster, stats, resync_seconds=1, workers=2).start()
    try:
        cluster.create(pool())
        cluster.create(group())
        wait_group_ready(cluster)
        cluster.wait_for(MP, "local-shm", None, lambda p: p.get("status", {}).get("boundGroups") == 1)
        cluster.delete(MP, "local-shm")
        cluster.wait_for(MP, "local-shm", None, lambda p: has_condition(p, "InUse", "True", "DeletionBlocked"))

        def watch_gap(emulator: Any) -> None:
            # The group watch breaks, the group is deleted before kopf is back, and the API server's
            # history is compacted: kopf's resumed watch gets 410 Gone and it lists again.
            emulator.drop_watches(r"/inferencegroups")
            emulator.delete_object("maru.io", "inferencegroups", GROUP_NS, "qwen")
            emulator.compact()

        cluster.call(watch_gap, cluster.emulator)
        cluster.wait_gone(MP, "local-shm")
    finally:
        op.stop()


def test_pool_with_a_spec_the_model_refuses_can_be_deleted(
    cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]
) -> None:
    # Stored by an API server that did not run the CRD's CEL rules (or before a CRD upgrade).
    cluster.call(setattr, cluster.emulator, "validate_schemas", False)
    try:
        cluster.patch(MP, "local-shm", {"spec": {"size": None}})  # shm needs a size
    finally:
        cluster.call(setattr, cluster.emulator, "validate_schemas", True)
    p = cluster.wait_for(MP, "local-shm", None, lambda o: has_condition(o, "Ready", "False", "InvalidSpec"))
    assert "size" in condition_of(p, "Ready")["message"]
    cluster.delete(MP, "local-shm")
    cluster.wait_gone(MP, "local-shm")


def test_child_watches_select_on_the_server(
    cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]
) -> None:
    """The operator never streams every Deployment, Service and RoleBinding in the cluster, and never reads
    Roles at all (it creates none; its RBAC grants nothing on them)."""
    cluster.create(group())
    wait_group_ready(cluster)
    settle(operator)
    children = (
        "/deployments",
        "/daemonsets",
        "/services",
        "/serviceaccounts",
        "/rolebindings",
        "/networkpolicies",
        "/endpointslices",
    )
    reads = [r for r in cluster.requests if r.method == "GET" and r.path.endswith(children)]
    assert {kind for kind in children if any(r.is_watch and r.path.endswith(kind) for r in reads)} == set(children)
    unselected = sorted(
        {
            f"{r.path}?{r.query}"
            for r in reads
            if "app.kubernetes.io/managed-by=maru-operator" not in r.query.get("labelSelector", "")
        }
    )
    assert not unselected, unselected
    assert not [r.path for r in cluster.requests if r.path.endswith("/roles")]


def test_long_names(cluster: KubeEmulator, operator: RunningOperator) -> None:
    pool_name = "p." + "x" * 240
    group_name = "g" * 250
    cluster.create(pool(pool_name))
    cluster.create(group(group_name, pool_name=pool_name))
    ig = cluster.wait_for(IG, group_name, GROUP_NS, ready)
    deployments = cluster.list(DEPLOY, GROUP_NS)
    assert len(deployments) == 3
    assert all(len(d["metadata"]["name"]) <= 63 for d in deployments)
    assert all(len(v) <= 63 for d in deployments for v in d["metadata"]["labels"].values())
    assert len(ig["status"]["endpoint"]) < 120


def test_idempotent_after_convergence(
    cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]
) -> None:
    cluster.create(group())
    cluster.create(group("other"))
    wait_group_ready(cluster)
    wait_group_ready(cluster, "other")
    cluster.wait_for(MP, "local-shm", None, lambda p: p.get("status", {})["boundGroups"] == 2)
    settle(operator)
    mark = cluster.mark()
    for _ in range(3):
        settle(operator)
    writes = object_writes(cluster, mark)
    assert writes == [], [f"{r.method} {r.path}" for r in writes]
    reads = cluster.requests_since(mark)
    assert any(r.method == "GET" for r in reads)  # the resync did run (pool pods are listed)


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (
            {
                "prefill": {"tensorParallelSize": 2, "resources": {"limits": {"nvidia.com/gpu": 1}}},
                "decode": {"tensorParallelSize": 2},
            },
            "spec.prefill.tensorParallelSize",
        ),
        ({"decode": {"env": [{"name": "PYTHONHASHSEED", "value": "7"}]}}, "spec.decode.env"),
        ({"decode": {"extraArgs": ["--kv-cache-dtype=fp8"]}}, "spec.decode.extraArgs"),
    ],
    ids=["tp-over-gpus", "hash-seed", "kv-dtype-one-role"],
)
def test_semantic_error(
    cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any], spec: dict[str, Any], field: str
) -> None:
    # A fresh invalid group: no child at all.
    cluster.create(group("fresh", **spec))
    ig = cluster.wait_for(IG, "fresh", GROUP_NS, lambda o: has_condition(o, "Ready", "False", "InvalidSpec"))
    assert field in condition_of(ig, "Ready")["message"]
    warning = wait_event(cluster, GROUP_NS, "fresh", "InvalidSpec")
    assert warning["type"] == "Warning" and field in warning["message"]
    settle(operator)
    assert [d for d in cluster.list(DEPLOY, GROUP_NS) if d["metadata"]["name"].startswith("fresh")] == []

    # A running group made invalid: its children are not touched, it keeps serving.
    cluster.create(group())
    wait_group_ready(cluster)
    before = {d["metadata"]["name"]: d["metadata"]["resourceVersion"] for d in cluster.list(DEPLOY, GROUP_NS)}
    mark = cluster.mark()
    cluster.patch(IG, "qwen", {"spec": spec}, GROUP_NS)
    cluster.wait_for(
        IG,
        "qwen",
        GROUP_NS,
        lambda o: has_condition(o, "Ready", "False", "InvalidSpec") and o["status"]["observedGeneration"] == 2,
    )
    settle(operator)
    after = {d["metadata"]["name"]: d["metadata"]["resourceVersion"] for d in cluster.list(DEPLOY, GROUP_NS)}
    assert after == before
    assert [r.path for r in cluster.writes_since(mark) if "/deployments" in r.path] == []
    assert operator.error is None


def test_api_errors_and_dropped_watches(
    cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]
) -> None:
    """Each fault is aimed at a request the operator sends, and each must have fired (else it covers nothing)."""
    faults = [
        # Creates are POSTs: an AlreadyExists makes the operator look at the name again, then retry.
        cluster.inject_fault(r"/namespaces/llm/deployments$", 409, method="POST", times=1, message="already exists"),
        cluster.inject_fault(r"/namespaces/llm/deployments$", 500, method="POST", times=2),
        cluster.inject_fault(r"/namespaces/llm/services$", 503, method="POST", times=1),
        cluster.inject_fault(r"/inferencegroups/qwen/status$", 500, method="PATCH", times=2),
    ]
    cluster.create(group())
    wait_group_ready(cluster)
    assert cluster.drop_watches(r"/inferencegroups") >= 1
    assert cluster.drop_watches(r"/deployments") >= 1
    # Updates are applies (PATCH) of the one Deployment whose spec changed.
    faults.append(cluster.inject_fault(r"/deployments/qwen-decode$", 500, method="PATCH", times=2))
    cluster.patch(IG, "qwen", {"spec": {"decode": {"replicas": 4}}}, GROUP_NS)
    cluster.wait_for(DEPLOY, "qwen-decode", GROUP_NS, lambda d: d["spec"]["replicas"] == 4)
    # A Deployment deleted by hand is created again, through a failing server.
    faults.append(cluster.inject_fault(r"/namespaces/llm/deployments$", 503, method="POST", times=1))
    cluster.delete(DEPLOY, "qwen-prefill", GROUP_NS)
    cluster.wait_for(DEPLOY, "qwen-prefill", GROUP_NS)
    cluster.wait_for(IG, "qwen", GROUP_NS, lambda o: o.get("status", {})["decode"]["summary"] == "4/4" and ready(o))
    assert operator.error is None
    fired = cluster.call(lambda: [(f.path.pattern, f.status, f.hits, f.times) for f in faults])
    assert all(hits > 0 and left == 0 for _, _, hits, left in fired), fired


def test_pool_usage_from_the_daemons(
    cluster: KubeEmulator, operator: RunningOperator, stats: StubStats, ready_pool: dict[str, Any]
) -> None:
    fake_agent_pod(cluster, "local-shm", "node-1", "10.1.2.3")
    stats.answers["http://10.1.2.3:9400/status"] = {"capacity_bytes": 1 << 30, "used_bytes": 3 << 20, "chunks": 12}
    settle(operator)
    p = cluster.wait_for(MP, "local-shm", None, lambda o: o.get("status", {}).get("used") == "3Mi")
    assert p["status"]["nodes"] == [
        {"node": "node-1", "device": "/dev/shm/maru-pool", "capacity": "1Gi", "ready": True}
    ]
    stats.answers["http://10.1.2.3:9400/status"] = None  # the daemon stops answering
    settle(operator)
    p = cluster.wait_for(MP, "local-shm", None, lambda o: o.get("status", {}).get("used") == "")
    assert ready(p)


@pytest.mark.tools
def test_kubectl_apply_examples(cluster: KubeEmulator, operator: RunningOperator, kube_controllers: Any) -> None:
    from tests.support.operator import ROOT

    kube_controllers.add_node("cxl-1", {"maru.io/cxl": "true"})
    kube_controllers.add_node("cxl-2", {"maru.io/cxl": "true"})
    create_namespace(cluster, "llm")
    result = cluster.kubectl("apply", "--validate=false", "-f", str(ROOT / "crds"), "-f", str(ROOT / "examples"))
    assert "inferencegroup.maru.io/qwen-7b" in result.stdout
    cxl = cluster.wait_for(MP, "cxl-pool", None, ready)
    assert cxl["status"]["nodeSummary"] == "2/2"
    assert cluster.get(DEPLOY, "cxl-pool-metadata", POOL_NS) is not None
    cluster.wait_for(IG, "qwen-7b", "llm", ready)
    out = cluster.kubectl("get", "ig", "-n", "llm").stdout
    assert "qwen-7b" in out and "1/1" in out and "2/2" in out


def test_restart_writes_nothing(
    cluster: KubeEmulator, operator: RunningOperator, stats: StubStats, ready_pool: dict[str, Any]
) -> None:
    cluster.create(group())
    wait_group_ready(cluster)
    cluster.wait_for(MP, "local-shm", None, lambda p: p.get("status", {})["boundGroups"] == 1)
    settle(operator)
    operator.stop()
    mark = cluster.mark()
    restarted = RunningOperator(cluster, stats, resync_seconds=3600, workers=4).start()
    try:
        settle(restarted)
        settle(restarted)
        writes = object_writes(cluster, mark)
        assert writes == [], [f"{r.method} {r.path}" for r in writes]
        # ... and it is alive: a change made now is acted on.
        cluster.patch(IG, "qwen", {"spec": {"decode": {"replicas": 1}}}, GROUP_NS)
        cluster.wait_for(DEPLOY, "qwen-decode", GROUP_NS, lambda d: d["spec"]["replicas"] == 1)
    finally:
        restarted.stop()


def test_watched_namespaces_only(cluster: KubeEmulator, stats: StubStats) -> None:
    create_namespace(cluster, "elsewhere")
    op = RunningOperator(cluster, stats, resync_seconds=3600, workers=2, namespaces=[GROUP_NS, POOL_NS]).start()
    try:
        cluster.create(pool())
        cluster.wait_for(MP, "local-shm", None, ready)  # cluster-scoped pools are always served
        cluster.create(group())
        cluster.create(group(namespace="elsewhere"))
        wait_group_ready(cluster)
        settle(op)
        assert cluster.get(DEPLOY, "qwen-prefill", "elsewhere") is None
        assert "status" not in (cluster.get(IG, "qwen", "elsewhere") or {})
    finally:
        op.stop()


def test_pool_semantic_error(cluster: KubeEmulator, operator: RunningOperator) -> None:
    cluster.create(pool(daemon={"socketDir": "/" + "s" * 100}))
    p = cluster.wait_for(MP, "local-shm", None, lambda o: has_condition(o, "Ready", "False", "InvalidSpec"))
    assert "spec.daemon.socketDir" in condition_of(p, "Ready")["message"]
    assert wait_event(cluster, "default", "local-shm", "InvalidSpec")["type"] == "Warning"
    settle(operator)
    assert cluster.list(DS, POOL_NS) == []
    cluster.patch(MP, "local-shm", {"spec": {"daemon": {"socketDir": "/run/maru"}}})
    cluster.wait_for(MP, "local-shm", None, ready)


def test_partly_ready_pool_with_real_pods(k8s_emulator: KubeEmulator, pod_controllers: Any, stats: StubStats) -> None:
    """Per-node entries come from the agent pods; a node whose agent is down degrades the pool and its groups."""
    kube = k8s_emulator
    pod_controllers.add_node("node-2", {"maru.io/pool": "yes"})
    pod_controllers.add_node("gpu-only", {})
    op = RunningOperator(kube, stats, resync_seconds=3600, workers=2).start()
    try:
        stats.default = {"capacity_bytes": 1 << 30, "used_bytes": 1 << 20}
        kube.create(pool())
        p = kube.wait_for(MP, "local-shm", None, lambda o: ready(o) and o.get("status", {}).get("used") == "2Mi")
        assert [(n["node"], n["ready"]) for n in p["status"]["nodes"]] == [("node-1", True), ("node-2", True)]
        assert p["status"]["capacity"] == "2Gi"
        kube.create(group())
        wait_group_ready(kube)
        pod_controllers.set_readiness(lambda obj: 1 if obj["kind"] == "DaemonSet" else True)
        p = kube.wait_for(MP, "local-shm", None, lambda o: has_condition(o, "Degraded", "True", "AgentsUnavailable"))
        assert has_condition(p, "Ready", "True")
        settle(op)
        p = kube.get(MP, "local-shm")
        assert p is not None
        assert sorted(n["ready"] for n in p["status"]["nodes"]) == [False, True]
        assert p["status"]["capacity"] == "1Gi"
        assert p["status"]["used"] == "1Mi"  # only ready nodes' daemons count
        ig = kube.wait_for(IG, "qwen", GROUP_NS, lambda o: has_condition(o, "Degraded", "True", "PoolDegraded"))
        assert "1 of 2 node agents" in condition_of(ig, "Degraded")["message"]
    finally:
        op.stop()
