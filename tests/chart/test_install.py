"""`helm install` into the Kubernetes API emulator, then the operator run exactly as the installed Deployment
says, with every API request it makes checked against the RBAC the chart installed.

The emulator runs no kubelet and enforces no RBAC, so the operator runs here as a local process with the
installed container's arguments and environment, and the authorisation is evaluated by a small RBAC
evaluator over the emulator's request log. What this proves: the CRDs install from the chart, the
operator accepts the chart's command line, serves its health and metrics ports, creates the pool's and
the group's children in the right namespaces, and asks for nothing the chart does not grant.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from maru_localcluster.tools import helm_path
from tests.chart.conftest import CHART, NAMESPACE, RELEASE, REPO_ROOT
from tests.k8s.fixtures import KubeEmulator, k8s_emulator  # noqa: F401  (fixture)

pytestmark = [pytest.mark.tools, pytest.mark.emulator]

GROUP_NAMESPACE = "llm"  # the namespace of examples/inferencegroup.yaml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Access:
    verb: str
    group: str
    resource: str  # with "/subresource"
    namespace: str | None


def access_of(method: str, path: str, query: dict[str, str]) -> Access | None:
    """The RBAC question a request asks; None for discovery and other non-resource URLs."""
    parts = [p for p in path.split("?")[0].split("/") if p]
    if parts[:1] == ["api"] and len(parts) >= 3:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 4:
        group, rest = parts[1], parts[3:]
    else:
        return None
    namespace = None
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    resource = rest[0] + (f"/{rest[2]}" if len(rest) > 2 else "")
    named = len(rest) > 1
    verb = {
        "GET": "get" if named else ("watch" if query.get("watch") in ("true", "1") else "list"),
        "POST": "create",
        "PATCH": "patch",
        "PUT": "update",
        "DELETE": "delete",
    }[method]
    return Access(verb, group, resource, namespace)


def allows(rules: list[dict[str, Any]], access: Access) -> bool:
    return any(
        access.group in rule.get("apiGroups", [])
        and access.resource in rule.get("resources", [])
        and access.verb in rule.get("verbs", [])
        for rule in rules
    )


def authorized(cluster: KubeEmulator, access: Access, account: str) -> bool:
    """Kubernetes' RBAC for one ServiceAccount, from the installed (Cluster)Roles and bindings."""

    def subject_matches(binding: dict[str, Any]) -> bool:
        return {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE} in binding.get("subjects", [])

    def rules_of(ref: dict[str, Any], namespace: str | None) -> list[dict[str, Any]]:
        if ref["kind"] == "ClusterRole":
            role = cluster.get("clusterroles.rbac.authorization.k8s.io", ref["name"])
        else:
            role = cluster.get("roles.rbac.authorization.k8s.io", ref["name"], namespace)
        return (role or {}).get("rules", [])

    for binding in cluster.list("clusterrolebindings.rbac.authorization.k8s.io"):
        if subject_matches(binding) and allows(rules_of(binding["roleRef"], None), access):
            return True
    if access.namespace is not None:
        for binding in cluster.list("rolebindings.rbac.authorization.k8s.io", access.namespace):
            if subject_matches(binding) and allows(rules_of(binding["roleRef"], access.namespace), access):
                return True
    return False


def helm(cluster: KubeEmulator, *args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(helm_path()), *args], capture_output=True, text=True, timeout=120, env=cluster.env(), check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def wait_for(predicate, what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def get_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.mark.parametrize("watch_namespaces", [False, True], ids=["all-namespaces", "watch-namespaces"])
def test_install_then_run_the_operator_within_its_rbac(
    k8s_emulator: KubeEmulator,  # noqa: F811
    tmp_path: Path,
    watch_namespaces: bool,
) -> None:
    cluster = k8s_emulator
    cluster.kubectl("create", "namespace", GROUP_NAMESPACE)  # a watched namespace must exist first
    liveness, metrics = free_port(), free_port()
    values = ["--set", f"livenessProbe.port={liveness}", "--set", f"metrics.port={metrics}"]
    if watch_namespaces:
        values += ["--set", f"watchNamespaces={{{GROUP_NAMESPACE}}}"]
    helm(cluster, "install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--create-namespace", *values)

    # The CRDs came from the chart's crds/ folder.
    crds = {c["metadata"]["name"] for c in cluster.list("customresourcedefinitions.apiextensions.k8s.io")}
    assert {"marupools.maru.io", "inferencegroups.maru.io"} <= crds

    # The user's next commands (NOTES.txt), before the operator starts, so every request after the
    # mark below is the operator's own.
    cluster.kubectl("apply", "-f", str(REPO_ROOT / "examples" / "pool-cxl.yaml"))
    cluster.kubectl("apply", "-f", str(REPO_ROOT / "examples" / "inferencegroup.yaml"))

    deployment = cluster.get("deployments.apps", RELEASE, NAMESPACE)
    assert deployment is not None
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = cluster.env()
    for var in container["env"]:
        if "fieldRef" in var.get("valueFrom", {}):
            # What the downward API would give this pod.
            field = var["valueFrom"]["fieldRef"]["fieldPath"]
            env[var["name"]] = {"metadata.namespace": NAMESPACE, "metadata.name": f"{RELEASE}-0"}[field]
    mark = cluster.mark()
    log = (tmp_path / "operator.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "maru_operator", *container["args"]],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    try:
        # The pool's daemons go to the release namespace, the group's children to its own.
        wait_for(lambda: cluster.get("daemonsets.apps", "cxl-pool-agent", NAMESPACE), "the pool agent DaemonSet")
        wait_for(lambda: cluster.get("deployments.apps", "cxl-pool-metadata", NAMESPACE), "the metadata server")
        wait_for(lambda: cluster.get("roles.rbac.authorization.k8s.io", "qwen-7b-router", GROUP_NAMESPACE), "router")
        wait_for(
            lambda: (cluster.get("marupools.maru.io", "cxl-pool") or {}).get("status", {}).get("conditions"),
            "the pool's status",
        )
        wait_for(
            lambda: (
                (cluster.get("inferencegroups.maru.io", "qwen-7b", GROUP_NAMESPACE) or {})
                .get("status", {})
                .get("conditions")
            ),
            "the group's status",
        )
        # The probe and the metrics port the chart declares are served.
        probe = container["livenessProbe"]["httpGet"]
        port = {p["name"]: p["containerPort"] for p in container["ports"]}[probe["port"]]
        assert wait_for(lambda: get_ok(f"http://127.0.0.1:{port}{probe['path']}"), "the liveness endpoint")
        assert wait_for(lambda: get_ok(f"http://127.0.0.1:{metrics}/metrics"), "the metrics endpoint")
        time.sleep(1.0)  # let the first reconciles' events and status writes land
        assert process.poll() is None, (tmp_path / "operator.log").read_text()[-3000:]
        requests = cluster.requests_since(mark)
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()

    account = pod["serviceAccountName"]
    asked = {a for r in requests if (a := access_of(r.method, r.path, r.query))}
    assert any(a.verb == "patch" and a.resource == "daemonsets" for a in asked)  # applied: created
    assert any(a.resource == "marupools/status" for a in asked)
    denied = sorted(str(a) for a in asked if not authorized(cluster, a, account))
    assert not denied, "the operator needs rights the chart does not grant:\n" + "\n".join(denied)
    # And the evaluator is not vacuous: it refuses what the chart does not grant.
    assert not authorized(cluster, Access("get", "", "secrets", NAMESPACE), account)
    assert not authorized(cluster, Access("update", "apps", "deployments", GROUP_NAMESPACE), account)
    if watch_namespaces:
        assert not authorized(cluster, Access("create", "apps", "deployments", "default"), account)

    # Uninstall removes the operator but, by design, neither the CRDs nor the users' resources.
    helm(cluster, "uninstall", RELEASE, "--namespace", NAMESPACE)
    assert cluster.get("deployments.apps", RELEASE, NAMESPACE) is None
    assert cluster.get("customresourcedefinitions.apiextensions.k8s.io", "marupools.maru.io") is not None
    assert cluster.get("marupools.maru.io", "cxl-pool") is not None
    assert os.path.exists(tmp_path / "operator.log")
