"""The local cluster behaves as a kubelet, kube-controller-manager, kube-scheduler and kube-proxy would.

One cluster (two nodes, the second tainted) serves every test; the pods run Debian's shell and Python
from the base image the product's images are built on (``make base-image``). CrashLoopBackOff starts at
1 s here instead of 10 s.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import tempfile
import textwrap
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from maru_localcluster import network
from maru_localcluster.cluster import LocalCluster, processes_in
from tests.required import require_local_cluster
from tests.support import images

require_local_cluster("the local cluster tests")

IMAGE = images.BASE  # Debian's sh, coreutils and Python 3.11 (make base-image)
TAINT = {"key": "dedicated", "value": "gpu", "effect": "NoSchedule"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    images.base()
    with LocalCluster(crashloop_base_s=1.0) as c:
        c.add_node("node-1", {"zone": "a"})
        c.add_node("node-2", {"zone": "b"}, taints=[TAINT])
        yield c
        # A kubelet that died mid-module shows up in later tests only as timeouts: say so here.
        dead = {name: proc.returncode for name, proc in c.nodes.items() if proc.poll() is not None}
        assert not dead, (dead, [c.component_log(f"kubelet-{name}")[-3000:] for name in dead])


def wait(check: Callable[[], Any], what: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        if result := check():
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def apply(cluster: LocalCluster, *docs: dict[str, Any]) -> None:
    cluster.kubectl("apply", "--validate=false", "-f", "-", input=yaml.safe_dump_all(docs))


def pod(name: str, script: str, **spec: Any) -> dict[str, Any]:
    container = {"name": "main", "image": IMAGE, "command": ["/bin/sh", "-c", textwrap.dedent(script)]}
    container.update(spec.pop("container", {}))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"restartPolicy": "Never", "containers": [container], **spec},
    }


def finished(cluster: LocalCluster, name: str, timeout: float = 60) -> tuple[str, str]:
    """Wait for a one-shot pod to end; its phase and log."""
    done = wait(
        lambda: (
            (p := cluster.kube.get("pods", name, "default"))
            and p.get("status", {}).get("phase") in ("Succeeded", "Failed")
            and p
        ),
        f"pod {name} to finish",
        timeout,
    )
    return done["status"]["phase"], cluster.pod_log("default", name)


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in obj.get("status", {}).get("conditions") or [] if c["type"] == type_), {})


def web(replicas: int = 2, version: str = "1", strategy: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web", "namespace": "default"},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": "web"}},
            **({"strategy": strategy} if strategy else {}),
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {
                    "terminationGracePeriodSeconds": 2,
                    "containers": [
                        {
                            "name": "web",
                            "image": IMAGE,
                            "env": [{"name": "VERSION", "value": version}],
                            # Every interface, as in any pod: each pod has a network namespace of its own.
                            "command": ["python", "-m", "http.server", "8080"],
                            "ports": [{"name": "http", "containerPort": 8080}],
                            "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
                        }
                    ],
                },
            },
        },
    }


def web_env(version: str) -> dict[str, Any]:
    body = web(version=version)
    body["spec"]["template"]["spec"]["containers"][0]["env"].append(
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    )
    return body


# ---------------------------------------------------------------------------------------- workloads


def test_deployment_rolls_to_a_new_replicaset_keeping_availability(cluster: LocalCluster) -> None:
    apply(
        cluster,
        web_env("1"),
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web", "namespace": "default"},
            "spec": {"selector": {"app": "web"}, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]},
        },
    )
    cluster.kubectl("rollout", "status", "deployment/web", "--timeout=60s")
    first = {p["metadata"]["name"] for p in cluster.kube.list("pods", "default", labels="app=web")}
    assert len(first) == 2 and all(
        cluster.kube.get("pods", n, "default")["spec"]["nodeName"] == "node-1" for n in first
    )  # node-2's taint is not tolerated
    apply(cluster, web_env("2"))
    lowest = 2

    def rolled() -> bool:
        nonlocal lowest
        pods = cluster.kube.list("pods", "default", labels="app=web")
        ready = [
            p
            for p in pods
            if condition(p, "Ready").get("status") == "True" and not p["metadata"].get("deletionTimestamp")
        ]
        lowest = min(lowest, len(ready))
        names = {p["metadata"]["name"] for p in pods}
        return len(ready) == 2 and not names & first

    wait(rolled, "the rollout")
    assert lowest >= 2 - 0  # maxUnavailable 25% of 2 rounds down to 0: never fewer than 2 ready
    sets = cluster.kube.list("replicasets.apps", "default")
    assert sorted(rs["spec"]["replicas"] for rs in sets) == [0, 2]
    deploy = cluster.kube.get("deployments.apps", "web", "default")
    assert deploy["metadata"]["annotations"]["deployment.kubernetes.io/revision"] == "2"
    assert condition(deploy, "Progressing")["reason"] == "NewReplicaSetAvailable"


def test_an_autoscaler_keeps_its_bounds_and_leaves_a_target_at_zero(cluster: LocalCluster) -> None:
    body = pod("x", "sleep 3600")
    apply(
        cluster,
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "scaled", "namespace": "default"},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": {"app": "scaled"}},
                "template": {"metadata": {"labels": {"app": "scaled"}}, "spec": body["spec"]},
            },
        },
        {
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": "scaled", "namespace": "default"},
            "spec": {
                "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "scaled"},
                "minReplicas": 2,
                "maxReplicas": 3,
            },
        },
    )

    def replicas() -> int:
        return int(cluster.kube.get("deployments.apps", "scaled", "default")["spec"]["replicas"])

    wait(lambda: replicas() == 2, "the autoscaler to raise the target to its minimum")
    dep = cluster.kube.get("deployments.apps", "scaled", "default")
    assert [
        e.get("subresource")
        for e in dep["metadata"]["managedFields"]
        if "f:replicas" in (e.get("fieldsV1") or {}).get("f:spec", {})
    ] == ["scale"]
    cluster.kubectl("scale", "deployment/scaled", "--replicas=0", "-n", "default")
    hpa = wait(
        lambda: next(
            (
                h
                for h in [cluster.kube.get("horizontalpodautoscalers.autoscaling", "scaled", "default")]
                if any(c["reason"] == "ScalingDisabled" for c in h.get("status", {}).get("conditions") or [])
            ),
            None,
        ),
        "ScalingDisabled",
    )
    assert hpa["status"]["desiredReplicas"] == 0 and replicas() == 0
    cluster.kubectl("scale", "deployment/scaled", "--replicas=1", "-n", "default")
    wait(lambda: replicas() == 2, "the autoscaler to scale the target again once it is not at zero")
    cluster.kubectl("delete", "deployment/scaled", "hpa/scaled", "-n", "default")


def test_service_clusterip_and_dns_reach_ready_endpoints(cluster: LocalCluster) -> None:
    slices = wait(
        lambda: [
            s
            for s in cluster.kube.list("endpointslices.discovery.k8s.io", "default")
            if s["metadata"]["labels"].get("kubernetes.io/service-name") == "web" and len(s["endpoints"]) == 2
        ],
        "two endpoints",
    )
    assert slices[0]["ports"] == [{"name": "http", "port": 8080, "protocol": "TCP"}]
    apply(
        cluster,
        pod(
            "client",
            """
        set -e
        python -c "import urllib.request as u; print(u.urlopen('http://web.default.svc.cluster.local/').status)"
        python -c "import urllib.request as u; print(u.urlopen('http://web/').status)"
        echo "host=$(hostname) env=$HOSTNAME api=$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT"
        grep -c web.default.svc /etc/hosts
    """,
            automountServiceAccountToken=False,
        ),
    )
    phase, log = finished(cluster, "client")
    assert phase == "Succeeded", log
    assert log.split()[:2] == ["200", "200"]
    assert f"host=client env=client api={network.KUBERNETES_SERVICE_IP}:443" in log


def test_endpoint_slices_carry_the_service_labels(cluster: LocalCluster) -> None:
    # The EndpointSlice controller copies a Service's labels onto its slices and keeps them in step, so a
    # label selector finds the slices of a set of Services (the operator watches its routers' that way).
    def slices(selector: str) -> list[dict[str, Any]]:
        return cluster.kube.list("endpointslices.discovery.k8s.io", "default", labels=selector)

    cluster.kubectl("label", "service/web", "tier=front", "app.kubernetes.io/managed-by=test")
    found = wait(lambda: slices("tier=front,app.kubernetes.io/managed-by=test"), "slices with the Service's labels")
    for s in found:
        assert s["metadata"]["labels"]["kubernetes.io/service-name"] == "web"
        assert s["metadata"]["labels"]["endpointslice.kubernetes.io/managed-by"] == "endpointslice-controller.k8s.io"
    assert sum(len(s["endpoints"]) for s in found) == 2
    cluster.kubectl("label", "service/web", "tier-")
    wait(lambda: not slices("tier") and slices("app.kubernetes.io/managed-by=test"), "the removed label to go")


def test_recreate_never_runs_old_and_new_pods_together(cluster: LocalCluster) -> None:
    # Each container appends to a node file as it starts and as it handles SIGTERM: the file orders
    # what actually ran, which polling the API could miss between two reads.
    log = cluster.node_root("node-1") / "tmp" / "recreate.log"
    script = """
        trap 'echo "down $VERSION $HOSTNAME" >> /host/recreate.log; exit 0' TERM
        echo "up $VERSION $HOSTNAME" >> /host/recreate.log
        while true; do sleep 0.1; done
    """

    def deployment(version: str) -> dict[str, Any]:
        container = {
            "name": "main",
            "image": IMAGE,
            "env": [{"name": "VERSION", "value": version}],
            "command": ["/bin/sh", "-c", textwrap.dedent(script)],
            "volumeMounts": [{"name": "host", "mountPath": "/host"}],
        }
        spec = {
            "nodeSelector": {"zone": "a"},
            "terminationGracePeriodSeconds": 5,
            "containers": [container],
            "volumes": [{"name": "host", "hostPath": {"path": "/tmp", "type": "DirectoryOrCreate"}}],
        }
        return {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "recreate", "namespace": "default"},
            "spec": {
                "replicas": 2,
                "strategy": {"type": "Recreate"},
                "selector": {"matchLabels": {"app": "recreate"}},
                "template": {"metadata": {"labels": {"app": "recreate"}}, "spec": spec},
            },
        }

    def lines() -> list[list[str]]:
        return [line.split() for line in log.read_text().splitlines()] if log.exists() else []

    apply(cluster, deployment("1"))
    cluster.kubectl("rollout", "status", "deployment/recreate", "--timeout=60s")
    wait(lambda: len(lines()) == 2, "both v1 containers to start")
    apply(cluster, deployment("2"))
    cluster.kubectl("rollout", "status", "deployment/recreate", "--timeout=90s")
    wait(
        lambda: sum(1 for event, version, _ in lines() if (event, version) == ("up", "2")) == 2,
        "both v2 containers to start",
    )
    running: dict[str, set[str]] = {"1": set(), "2": set()}
    for event, version, pod_name in lines():
        if event == "up":
            assert not running["1" if version == "2" else "2"], (pod_name, log.read_text())
            running[version].add(pod_name)
        else:
            running[version].discard(pod_name)
    assert [e for e, v, _ in lines()] == ["up", "up", "down", "down", "up", "up"], log.read_text()
    cluster.kubectl("delete", "deployment", "recreate")


def test_a_pod_failing_readiness_gets_no_traffic(cluster: LocalCluster) -> None:
    # Two pods behind one Service, each serving its name from a node folder; readiness asks for /ready,
    # which only "gate-a" has. As the EndpointSlice controller does, "gate-b" is listed not ready, and
    # kube-proxy never sends it a connection, until it has /ready too.
    site = cluster.node_root("node-1") / "gate"

    def gate(name: str) -> dict[str, Any]:
        (site / name).mkdir(parents=True, exist_ok=True)
        (site / name / "index.html").write_text(name)
        body = pod(
            name,
            "exec python -m http.server 8080 --directory /www",
            restartPolicy="Always",
            nodeSelector={"zone": "a"},
            terminationGracePeriodSeconds=1,
            volumes=[{"name": "www", "hostPath": {"path": f"/gate/{name}", "type": "Directory"}}],
            container={
                "ports": [{"name": "http", "containerPort": 8080}],
                "volumeMounts": [{"name": "www", "mountPath": "/www"}],
                "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 1},
            },
        )
        body["metadata"]["labels"] = {"app": "gate"}
        return body

    (site / "gate-a").mkdir(parents=True)
    (site / "gate-a" / "ready").write_text("")
    apply(
        cluster,
        gate("gate-a"),
        gate("gate-b"),
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "gate", "namespace": "default"},
            "spec": {"selector": {"app": "gate"}, "ports": [{"port": 80, "targetPort": "http"}]},
        },
    )
    ip = {
        n: wait(lambda n=n: (cluster.kube.get("pods", n, "default").get("status") or {}).get("podIP"), f"{n} IP")
        for n in ("gate-a", "gate-b")
    }

    def endpoints() -> dict[str, bool]:
        return {
            e["addresses"][0]: e["conditions"]["ready"]
            for s in cluster.kube.list(
                "endpointslices.discovery.k8s.io", "default", labels="kubernetes.io/service-name=gate"
            )
            for e in s["endpoints"]
        }

    def serves(name: str) -> bool:
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(cluster.pod_url("default", name, 8080), timeout=10) as resp,
        ):
            return bool(resp.read() == name.encode())
        return False

    # gate-b answers on its port (it serves; only its readiness fails), but is listed not ready.
    wait(lambda: serves("gate-b"), "gate-b to serve")
    wait(lambda: endpoints() == {ip["gate-a"]: True, ip["gate-b"]: False}, "gate-a ready, gate-b listed unready")
    assert condition(cluster.kube.get("pods", "gate-b", "default"), "Ready")["status"] == "False"
    url = cluster.service_url("default", "gate")

    def answers(n: int) -> list[str]:
        return [urllib.request.urlopen(url, timeout=10).read().decode() for _ in range(n)]

    assert answers(8) == ["gate-a"] * 8  # kube-proxy goes round robin over ready endpoints: never gate-b
    (site / "gate-b" / "ready").write_text("")
    wait(lambda: endpoints() == {ip["gate-a"]: True, ip["gate-b"]: True}, "gate-b ready")
    assert set(answers(8)) == {"gate-a", "gate-b"}  # and once it is ready, it gets its turn
    cluster.kubectl("delete", "pod", "gate-a", "gate-b")
    cluster.kubectl("delete", "service", "gate")


def test_in_cluster_api_access_with_the_service_account_token(cluster: LocalCluster) -> None:
    # The token is the TokenRequest API's, bound to the pod; the API server authenticates it and holds the
    # pod's ServiceAccount to RBAC: its Role allows reading pods, nothing else; a forged token is refused.
    rbac = "rbac.authorization.k8s.io/v1"
    apply(
        cluster,
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "reader", "namespace": "default"}},
        {
            "apiVersion": rbac,
            "kind": "Role",
            "metadata": {"name": "reader", "namespace": "default"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
        },
        {
            "apiVersion": rbac,
            "kind": "RoleBinding",
            "metadata": {"name": "reader", "namespace": "default"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "reader"},
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": "default"}],
        },
    )
    apply(
        cluster,
        pod(
            "incluster",
            """
        python - <<'EOF'
        import os, ssl, urllib.error, urllib.request
        d = "/var/run/secrets/kubernetes.io/serviceaccount"
        token, ns = open(d + "/token").read(), open(d + "/namespace").read()
        url = f"https://{os.environ['KUBERNETES_SERVICE_HOST']}:{os.environ['KUBERNETES_SERVICE_PORT']}"
        ctx = ssl.create_default_context(cafile=d + "/ca.crt")
        def status(path, bearer):
            req = urllib.request.Request(url + path, headers={"Authorization": "Bearer " + bearer})
            try:
                return urllib.request.urlopen(req, context=ctx).status
            except urllib.error.HTTPError as e:
                return e.code
        print(ns, status(f"/api/v1/namespaces/{ns}/pods/incluster", token),
              status(f"/api/v1/namespaces/{ns}/secrets", token),
              status(f"/api/v1/namespaces/{ns}/pods/incluster", token[:-4] + "AAAA"))
        EOF
    """,
            serviceAccountName="reader",
        ),
    )
    phase, log = finished(cluster, "incluster")
    assert (phase, log.split()) == ("Succeeded", ["default", "200", "403", "401"]), log


def test_components_list_again_after_compaction(cluster: LocalCluster) -> None:
    # The API server forgets its history (etcd compaction) while every watch is cut: the kubelets and
    # kube-proxy resume from a resourceVersion that is gone, get 410 Gone and list again.
    cluster.kube.compact()
    assert cluster.kube.drop_watches() >= 1
    apply(cluster, pod("after-compaction", "echo listed again"))
    phase, log = finished(cluster, "after-compaction")
    assert (phase, log.strip()) == ("Succeeded", "listed again")


def test_daemonset_places_one_pod_per_fitting_node(cluster: LocalCluster) -> None:
    def daemonset(name: str, tolerate: bool) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "containers": [{"name": "d", "image": IMAGE, "command": ["sleep", "600"]}],
            "terminationGracePeriodSeconds": 1,
        }
        if tolerate:
            spec["tolerations"] = [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}]
        return {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "selector": {"matchLabels": {"ds": name}},
                "template": {"metadata": {"labels": {"ds": name}}, "spec": spec},
            },
        }

    apply(cluster, daemonset("plain", False), daemonset("tolerant", True))
    for name, nodes in (("plain", ["node-1"]), ("tolerant", ["node-1", "node-2"])):
        ds = wait(
            lambda name=name, nodes=nodes: (
                (d := cluster.kube.get("daemonsets.apps", name, "default"))
                and d.get("status", {}).get("numberReady") == len(nodes)
                and d
            ),
            f"DaemonSet {name} ready",
        )
        assert ds["status"]["desiredNumberScheduled"] == len(nodes)
        placed = sorted(p["spec"]["nodeName"] for p in cluster.kube.list("pods", "default", labels=f"ds={name}"))
        assert placed == nodes
    cluster.kubectl("delete", "daemonset", "plain", "tolerant")


def test_daemonset_node_selector_leaves_other_nodes_out(cluster: LocalCluster) -> None:
    # Tolerating node-2's taint, so only the nodeSelector decides: no pod where it does not match, one
    # as soon as a node's labels match, and none again once they stop matching.
    apply(
        cluster,
        {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": {"name": "picked", "namespace": "default"},
            "spec": {
                "selector": {"matchLabels": {"ds": "picked"}},
                "template": {
                    "metadata": {"labels": {"ds": "picked"}},
                    "spec": {
                        "nodeSelector": {"zone": "b"},
                        "terminationGracePeriodSeconds": 1,
                        "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
                        "containers": [{"name": "d", "image": IMAGE, "command": ["sleep", "600"]}],
                    },
                },
            },
        },
    )

    def placed() -> list[str]:
        return sorted(
            p["spec"].get("nodeName") or ""
            for p in cluster.kube.list("pods", "default", labels="ds=picked")
            if not p["metadata"].get("deletionTimestamp")
        )

    def ready(n: int) -> bool:
        ds = cluster.kube.get("daemonsets.apps", "picked", "default")
        return bool(ds) and (ds.get("status") or {}).get("numberReady") == n

    wait(lambda: ready(1), "the DaemonSet's pod on node-2")
    assert placed() == ["node-2"]
    assert cluster.kube.get("daemonsets.apps", "picked", "default")["status"]["desiredNumberScheduled"] == 1
    cluster.kubectl("label", "node", "node-1", "zone=b", "--overwrite")
    try:
        wait(lambda: ready(2) and placed() == ["node-1", "node-2"], "a pod on node-1 once it matches")
    finally:
        cluster.kubectl("label", "node", "node-1", "zone=a", "--overwrite")
    wait(lambda: placed() == ["node-2"], "node-1's pod to go once it no longer matches")
    cluster.kubectl("delete", "daemonset", "picked")


def test_unschedulable_pod_says_why(cluster: LocalCluster) -> None:
    apply(cluster, pod("gpu", "true", container={"resources": {"limits": {"nvidia.com/gpu": "1"}}}))
    cond = wait(
        lambda: (
            condition(cluster.kube.get("pods", "gpu", "default"), "PodScheduled").get("reason") == "Unschedulable"
            and condition(cluster.kube.get("pods", "gpu", "default"), "PodScheduled")
        ),
        "FailedScheduling",
    )
    assert "Insufficient nvidia.com/gpu" in cond["message"]
    cluster.kubectl("delete", "pod", "gpu")


def test_missing_priority_class_is_refused_at_admission(cluster: LocalCluster) -> None:
    body = web(replicas=1)
    body["metadata"]["name"] = body["spec"]["template"]["metadata"]["labels"]["app"] = "prio"
    body["spec"]["selector"]["matchLabels"]["app"] = "prio"
    body["spec"]["template"]["spec"]["priorityClassName"] = "no-such-class"
    apply(cluster, body)
    events = wait(
        lambda: [
            e
            for e in cluster.kube.list("events", "default")
            if e["reason"] == "FailedCreate" and "no PriorityClass with name no-such-class" in e["message"]
        ],
        "FailedCreate",
    )
    assert events
    # The refusal reaches the Deployment's ReplicaFailure condition (replica_set.go, then deployment/sync.go).
    failure = wait(
        lambda: [
            c
            for c in (cluster.kube.get("deployments.apps", "prio", "default").get("status") or {}).get("conditions")
            or []
            if c["type"] == "ReplicaFailure" and "no PriorityClass with name no-such-class" in c.get("message", "")
        ],
        "ReplicaFailure",
    )
    assert failure[0]["reason"] == "FailedCreate"
    apply(cluster, pod("critical", "true", priorityClassName="system-node-critical"))
    assert cluster.kube.get("pods", "critical", "default")["spec"]["priority"] == 2000001000
    cluster.kubectl("delete", "deployment", "prio")


# ---------------------------------------------------------------------------------------- kubelet


def test_memory_emptydir_is_a_tmpfs_of_exactly_its_size_limit(cluster: LocalCluster) -> None:
    apply(
        cluster,
        pod(
            "shm",
            """
        python -c "import os; s = os.statvfs('/dev/shm'); print('total', s.f_blocks * s.f_frsize)"
        python -c "import os; fd = os.open('/dev/shm/f', os.O_CREAT | os.O_RDWR); os.posix_fallocate(fd, 0, 2 << 20)" \
            || echo "no room for 2Mi"
    """,
            volumes=[{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}],
            container={"volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}]},
        ),
    )
    phase, log = finished(cluster, "shm")
    assert phase == "Succeeded", log
    assert "total 1048576" in log and "no room for 2Mi" in log, log


def test_restricted_container_as_rendered(cluster: LocalCluster) -> None:
    security = {
        "runAsNonRoot": True,
        "runAsUser": 65532,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    apply(
        cluster,
        pod(
            "restricted",
            """
        id -u; grep CapBnd /proc/self/status; grep NoNewPrivs /proc/self/status
        touch /x 2>/dev/null || echo "read-only root"
        touch /scratch/x && echo "volume writable"
        python -c "import os; print('parent', os.getppid())"
    """,
            volumes=[{"name": "scratch", "emptyDir": {}}],
            container={"securityContext": security, "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]},
        ),
    )
    phase, log = finished(cluster, "restricted")
    assert phase == "Succeeded", log
    lines = log.split("\n")
    assert lines[0] == "65532" and "0000000000000000" in lines[1] and lines[2].endswith("1"), log
    assert "read-only root" in log and "volume writable" in log and "parent 1" in log  # sh is PID 1 of its namespace
    # runAsNonRoot with a root user is refused before anything runs, as the kubelet refuses it.
    apply(cluster, pod("rootful", "true", container={"securityContext": {"runAsNonRoot": True}}))
    waiting = wait(
        lambda: (
            ((cluster.kube.get("pods", "rootful", "default").get("status") or {}).get("containerStatuses") or [{}])[0]
            .get("state", {})
            .get("waiting", {})
            .get("reason")
            == "CreateContainerConfigError"
        ),
        "CreateContainerConfigError",
    )
    assert waiting
    cluster.kubectl("delete", "pod", "rootful")


def test_env_from_secrets_and_config_maps(cluster: LocalCluster) -> None:
    apply(
        cluster,
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "creds", "namespace": "default"},
            "data": {"token": base64.b64encode(b"s3cret").decode()},
            "stringData": {"user": "maru"},
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "settings", "namespace": "default"},
            "data": {"mode": "fast", "level": "3"},
        },
    )
    env = [
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
        {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "mode"}}},
        {"name": "GREETING", "value": "$(MODE)-mode"},  # expands what came before it
        {"name": "ABSENT", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "nope", "optional": True}}},
    ]
    env_from = [{"configMapRef": {"name": "settings"}, "prefix": "CFG_"}, {"secretRef": {"name": "creds"}}]
    apply(
        cluster,
        pod(
            "envs",
            'echo "$TOKEN $MODE $GREETING $CFG_mode $CFG_level $token $user ${ABSENT-unset}"',
            container={"env": env, "envFrom": env_from},
        ),
    )
    phase, log = finished(cluster, "envs")
    assert (phase, log.split()) == (
        "Succeeded",
        ["s3cret", "fast", "fast-mode", "fast", "3", "s3cret", "maru", "unset"],
    ), log

    # A key that is not there: the container is not created, and the kubelet retries until it is there.
    apply(
        cluster,
        pod(
            "needs-key",
            'echo "$LATER"',
            container={"env": [{"name": "LATER", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "later"}}}]},
        ),
    )

    def waiting() -> dict[str, Any]:
        statuses = (cluster.kube.get("pods", "needs-key", "default").get("status") or {}).get("containerStatuses")
        return (statuses or [{}])[0].get("state", {}).get("waiting") or {}

    state = wait(
        lambda: waiting().get("reason") == "CreateContainerConfigError" and waiting(), "CreateContainerConfigError"
    )
    assert 'couldn\'t find key "later" in secret "creds"' in state["message"], state
    assert (cluster.kube.get("pods", "needs-key", "default")["status"]["phase"]) == "Pending"
    cluster.kubectl("patch", "secret", "creds", "-p", json.dumps({"stringData": {"later": "now"}}))
    phase, log = finished(cluster, "needs-key")
    assert (phase, log.strip()) == ("Succeeded", "now")
    cluster.kubectl("delete", "pod", "envs", "needs-key")


def test_the_runtime_shim_keeps_the_machines_root(cluster: LocalCluster) -> None:
    # pivot_root moves every process of a mount namespace: the shim shared the container's, so it lost
    # the machine's root whenever the container pivoted first, and its pid file write failed (EROFS
    # under readOnlyRootFilesystem) - a restarted pool agent crash-looped once, at random.
    apply(
        cluster,
        pod(
            "pivot",
            "sleep 600",
            terminationGracePeriodSeconds=1,
            container={"securityContext": {"readOnlyRootFilesystem": True}},
        ),
    )

    def pivoted() -> int | None:
        # The pid is known as soon as the container process forks, before it pivots into its root.
        pid = cluster.container_pid("default", "pivot", "main")
        return pid if pid and Path(f"/proc/{pid}/root/etc/hostname").read_text().strip() == "pivot" else None

    pid = wait(pivoted, "the container in its own root")
    stat = Path(f"/proc/{pid}/stat").read_text()
    shim = int(stat[stat.rfind(")") + 2 :].split()[1])
    assert Path(f"/proc/{shim}/root/etc/hostname").read_text() == Path("/etc/hostname").read_text()
    cluster.kubectl("delete", "pod", "pivot")


def test_hostpath_types_are_checked(cluster: LocalCluster) -> None:
    spec = {
        "volumes": [{"name": "sock", "hostPath": {"path": "/run/maru/test", "type": "Directory"}}],
        "container": {"volumeMounts": [{"name": "sock", "mountPath": "/run/maru/test"}]},
    }
    apply(cluster, pod("needs-dir", "ls /run/maru/test", nodeSelector={"zone": "a"}, **spec))
    wait(
        lambda: any(
            e["reason"] == "FailedMount" and e["involvedObject"]["name"] == "needs-dir"
            for e in cluster.kube.list("events", "default")
        ),
        "FailedMount",
    )
    (cluster.node_root("node-1") / "run" / "maru" / "test" / "made-by-node").parent.mkdir(parents=True)
    (cluster.node_root("node-1") / "run" / "maru" / "test" / "made-by-node").write_text("")
    phase, log = finished(cluster, "needs-dir")
    assert (phase, log.strip()) == ("Succeeded", "made-by-node")


def test_crash_loop_back_off_and_kubectl_logs_previous(cluster: LocalCluster) -> None:
    apply(cluster, pod("crasher", 'echo "run $(date +%s%N)"; exit 3', restartPolicy="Always"))

    def looping() -> dict[str, Any] | None:
        status = (cluster.kube.get("pods", "crasher", "default").get("status") or {}).get("containerStatuses")
        return status[0] if status and status[0]["restartCount"] >= 2 and "waiting" in status[0]["state"] else None

    status = wait(looping, "two restarts")
    assert status["state"]["waiting"]["reason"] == "CrashLoopBackOff"
    assert status["lastState"]["terminated"]["exitCode"] == 3
    now, previous = (cluster.kubectl("logs", "crasher", *flag).stdout for flag in ((), ("--previous",)))
    assert now.startswith("run ") and previous.startswith("run ") and now != previous
    cluster.kubectl("delete", "pod", "crasher", "--grace-period=1")


def test_liveness_failure_restarts_the_container(cluster: LocalCluster) -> None:
    apply(
        cluster,
        pod(
            "unwell",
            "touch /tmp/alive; sleep 2; rm /tmp/alive; sleep 600",
            restartPolicy="Always",
            terminationGracePeriodSeconds=1,
            container={
                "livenessProbe": {
                    "exec": {"command": ["test", "-f", "/tmp/alive"]},
                    "periodSeconds": 1,
                    "failureThreshold": 2,
                }
            },
        ),
    )
    wait(
        lambda: (
            ((cluster.kube.get("pods", "unwell", "default").get("status") or {}).get("containerStatuses") or [{}])[
                0
            ].get("restartCount", 0)
            >= 1
        ),
        "a liveness restart",
        timeout=60,
    )
    killing = [
        e
        for e in cluster.kube.list("events", "default")
        if e["involvedObject"]["name"] == "unwell" and e["reason"] == "Killing"
    ]
    assert any("failed liveness probe" in e["message"] for e in killing)
    cluster.kubectl("delete", "pod", "unwell")


def test_graceful_deletion_sigterm_then_sigkill(cluster: LocalCluster) -> None:
    marker = cluster.node_root("node-1") / "tmp" / "graceful"
    apply(
        cluster,
        pod(
            "polite",
            """
        trap 'echo got-sigterm > /host/graceful; exit 0' TERM
        while true; do sleep 0.1; done
    """,
            nodeSelector={"zone": "a"},
            restartPolicy="Always",
            volumes=[{"name": "host", "hostPath": {"path": "/tmp", "type": "DirectoryOrCreate"}}],
            container={"volumeMounts": [{"name": "host", "mountPath": "/host"}]},
        ),
        pod("stubborn", "trap '' TERM; while true; do sleep 0.1; done", terminationGracePeriodSeconds=2),
    )
    for name in ("polite", "stubborn"):
        wait(
            lambda name=name: (
                "running"
                in ((cluster.kube.get("pods", name, "default").get("status") or {}).get("containerStatuses") or [{}])[
                    0
                ].get("state", {})
            ),
            f"{name} running",
        )
    spaces = cluster.pid_namespaces(cluster.kube.get("pods", "stubborn", "default"))
    started = time.monotonic()
    cluster.kubectl("delete", "pod", "polite", "stubborn", "--wait=true", "--timeout=60s")
    assert marker.read_text().strip() == "got-sigterm"
    assert time.monotonic() - started >= 2  # stubborn ignored SIGTERM: it went at the end of its grace
    assert processes_in(spaces) == []


def test_pre_stop_hook_runs_before_sigterm(cluster: LocalCluster) -> None:
    """The vLLM pods drain in a preStop hook: it must end before the container gets SIGTERM."""
    marker = cluster.node_root("node-1") / "tmp" / "pre-stop"
    marker.unlink(missing_ok=True)
    apply(
        cluster,
        pod(
            "draining",
            """
        trap 'echo sigterm >> /host/pre-stop; exit 0' TERM
        while true; do sleep 0.1; done
    """,
            nodeSelector={"zone": "a"},
            restartPolicy="Always",
            terminationGracePeriodSeconds=30,
            volumes=[{"name": "host", "hostPath": {"path": "/tmp", "type": "DirectoryOrCreate"}}],
            container={
                "volumeMounts": [{"name": "host", "mountPath": "/host"}],
                "lifecycle": {
                    "preStop": {
                        "exec": {
                            "command": [
                                "/bin/sh",
                                "-c",
                                "echo hook-start >> /host/pre-stop; sleep 1; echo hook-end >> /host/pre-stop",
                            ]
                        }
                    }
                },
            },
        ),
    )
    wait(
        lambda: (
            "running"
            in ((cluster.kube.get("pods", "draining", "default").get("status") or {}).get("containerStatuses") or [{}])[
                0
            ].get("state", {})
        ),
        "draining running",
    )
    # Deleted the moment it is reported running: a running container has its PID 1 in its own root, where the
    # hook runs (the status once said running while the shim still built the root, and the hook was skipped).
    cluster.kubectl("delete", "pod", "draining", "--wait=true", "--timeout=60s")
    events = [
        e.get("message")
        for e in cluster.kube.list("events", "default")
        if e.get("involvedObject", {}).get("name") == "draining"
    ]
    assert marker.read_text().split() == ["hook-start", "hook-end", "sigterm"], events


def test_claims_are_bound_and_shared_across_nodes(cluster: LocalCluster) -> None:
    """A ReadWriteMany claim, as the operator creates for a group's model cache: one folder for every pod,
    on every node, writable by the pods' fsGroup."""
    apply(
        cluster,
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "models", "namespace": "default"},
            "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}},
        },
    )
    claim = wait(
        lambda: (
            (c := cluster.kube.get("persistentvolumeclaims", "models", "default"))
            and c.get("status", {}).get("phase") == "Bound"
            and c
        ),
        "the claim bound",
    )
    assert claim["status"]["capacity"] == {"storage": "1Gi"}
    volume = {
        "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}],
        "securityContext": {"runAsUser": 65532, "runAsGroup": 65532, "fsGroup": 65532},
    }
    mount = {"volumeMounts": [{"name": "models", "mountPath": "/models"}]}
    apply(cluster, pod("writer", "echo weights > /models/blob", nodeSelector={"zone": "a"}, container=mount, **volume))
    assert finished(cluster, "writer")[0] == "Succeeded", cluster.pod_log("default", "writer")
    apply(
        cluster,
        pod(
            "reader",
            "cat /models/blob",
            nodeSelector={"zone": "b"},
            tolerations=[{"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}],
            container=mount,
            **volume,
        ),
    )
    phase, log = finished(cluster, "reader")
    assert (phase, log.strip()) == ("Succeeded", "weights")
    assert cluster.kube.get("pods", "reader", "default")["spec"]["nodeName"] == "node-2"


def test_pods_of_a_deleted_owner_are_collected(cluster: LocalCluster) -> None:
    pods = cluster.kube.list("pods", "default", labels="app=web")
    spaces = set().union(*(cluster.pid_namespaces(p) for p in pods))
    assert processes_in(spaces)
    cluster.kubectl("delete", "deployment", "web")
    wait(lambda: not cluster.kube.list("pods", "default", labels="app=web"), "the web pods to go")
    assert processes_in(spaces) == []
    assert not cluster.kube.list("replicasets.apps", "default")


def test_a_cluster_in_a_deep_folder_starts_its_csi_plugin_and_leaves_no_link(tmp_path: Path) -> None:
    """A node's CSI socket under a folder too deep for a Unix socket path (107 bytes): the kubelet exited with
    'CSI plugin csi.maru.io did not start' (a test runner's worker folders were enough to get there)."""

    def short_folders() -> set[Path]:
        return set(Path(tempfile.gettempdir()).glob("maru-csi-*"))

    images.build()  # the plugin runs from the pool image
    before = short_folders()
    cluster = LocalCluster(tmp_path / ("deep" * 16) / "c")
    with cluster:
        cluster.add_node("solo")  # returns once the node's CSI plugin serves its socket
        made = short_folders() - before
        assert made and all((folder / "plugin" / "csi.sock").is_socket() for folder in made)
    assert not made & short_folders()


def test_stopping_the_cluster_leaves_nothing_behind(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path / "c", crashloop_base_s=1.0)
    with cluster:
        cluster.add_node("solo")
        apply(
            cluster,
            pod(
                "sleeper",
                "sleep 600",
                volumes=[{"name": "m", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}],
                container={"volumeMounts": [{"name": "m", "mountPath": "/m"}]},
            ),
        )
        wait(
            lambda: (
                "running"
                in (
                    (cluster.kube.get("pods", "sleeper", "default").get("status") or {}).get("containerStatuses")
                    or [{}]
                )[0].get("state", {})
            ),
            "sleeper running",
        )
        # The shim reports its PID 1 once the container's root is built, a moment after the status says running.
        spaces = wait(lambda: cluster.pid_namespaces(cluster.kube.get("pods", "sleeper", "default")), "PID 1")
        assert processes_in(spaces)
    assert processes_in(spaces) == []
    assert str(tmp_path) not in Path("/proc/self/mountinfo").read_text()
    assert json.dumps(sorted(p.name for p in (tmp_path / "c").glob("*.log")))


def test_a_reused_pid_namespace_inode_is_not_the_namespace_asked_about() -> None:
    """The kernel gives a dead PID namespace's inode to the next namespace it makes: on a machine running two
    clusters (a demo beside a test run), the other cluster's pod can get it. `make demo` then reported that
    pod's vllm-router as a process of its own left after cleanup. A namespace is its inode and the start time
    of its PID 1."""
    from maru_localcluster.podrun import start_time

    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "sleep", "60"])
    try:

        def namespaced_child() -> int | None:
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            return int(children[0]) if children else None

        child = wait(namespaced_child, "the namespace's PID 1")
        inode = os.readlink(f"/proc/{child}/ns/pid")
        assert inode != os.readlink("/proc/self/ns/pid")
        assert processes_in({f"{inode}@{start_time(child)}"}) == [child]
        # The same inode with another PID 1 (a later namespace that got the inode) is someone else's.
        assert processes_in({f"{inode}@{int(start_time(child)) - 1}"}) == []
    finally:
        proc.kill()
        proc.wait()
