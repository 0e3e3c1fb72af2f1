"""`helm install` into the Kubernetes API emulator, then the operator run exactly as the installed Deployment
says, as the installed ServiceAccount, against an API server that enforces the RBAC the chart installed.

The emulator runs no kubelet, so the operator runs here as a local process with the installed container's
arguments and environment and a kubeconfig carrying its ServiceAccount's token. The emulator authorizes
every request with the installed Roles and bindings, refuses Roles that grant more than their writer holds,
and enforces OwnerReferencesPermissionEnforcement (as OpenShift does). What this proves: the CRDs install
from the chart, the operator accepts the chart's command line, serves its health and metrics ports, creates
the pool's and the group's children in the right namespaces, and is never refused a request.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from maru_localcluster.tools import helm_path
from maru_operator.images import DEFAULT_IMAGES
from tests.k8s.fixtures import KubeEmulator, k8s_emulator  # noqa: F401  (fixture)
from tests.support.chart import CHART, NAMESPACE, RELEASE, REPO_ROOT

pytestmark = [pytest.mark.tools, pytest.mark.emulator]

GROUP_NAMESPACE = "llm"  # the namespace of examples/inferencegroup.yaml
MIRROR = "registry.example.com/mirror"  # images.registry of the install


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def helm(cluster: KubeEmulator, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(helm_path()), *args], capture_output=True, text=True, timeout=120, env=cluster.env(), check=False
    )
    if check:
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
    values = [
        "--set",
        f"livenessProbe.port={liveness}",
        "--set",
        f"metrics.port={metrics}",
        "--set",
        f"images.registry={MIRROR}",
    ]
    if watch_namespaces:
        values += ["--set", f"watchNamespaces={{{GROUP_NAMESPACE}}}"]
    # As the README's quickstart: the release namespace and its Pod Security label first (the CSI plugin and
    # the pool daemons are privileged), then the install without --create-namespace.
    cluster.kubectl("create", "namespace", NAMESPACE)
    cluster.kubectl("label", "namespace", NAMESPACE, "pod-security.kubernetes.io/enforce=privileged")
    helm(cluster, "install", RELEASE, str(CHART), "--namespace", NAMESPACE, *values)

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
    account = pod["serviceAccountName"]
    token = cluster.service_account_token(NAMESPACE, account)
    env["KUBECONFIG"] = str(cluster.kubeconfig_for(token, tmp_path / "operator-kubeconfig"))
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
        agent = wait_for(lambda: cluster.get("daemonsets.apps", "cxl-pool-agent", NAMESPACE), "the agent DaemonSet")
        # images.registry reached the operator: the example pool names no image and gets the mirror's.
        assert {c["image"] for c in agent["spec"]["template"]["spec"]["containers"]} == {
            f"{MIRROR}/maru-pool:{DEFAULT_IMAGES.tag}"
        }
        wait_for(lambda: cluster.get("deployments.apps", "cxl-pool-metadata", NAMESPACE), "the metadata server")
        wait_for(
            lambda: cluster.get("rolebindings.rbac.authorization.k8s.io", "qwen-7b-router-pods", GROUP_NAMESPACE),
            "the router's RoleBinding",
        )
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

    # Written with the chart's rights: created (a create's fields are adopted later, at the first apply that needs
    # them, so a fresh pool's agents see no patch).
    assert any(r.method == "POST" and r.path.endswith("/daemonsets") and r.status == 201 for r in requests)
    assert any(r.path.endswith("/marupools/cxl-pool/status") for r in requests)
    denied = sorted({f"{r.method} {r.path}" for r in requests if r.status in (401, 403)})
    assert not denied, "the operator needs rights the chart does not grant:\n" + "\n".join(denied)
    # And the enforcement is not vacuous: it refuses what the chart does not grant.
    assert not cluster.allowed(token, "delete", "secrets", NAMESPACE)  # pool keys go with their pool, by GC
    # Secrets in the release namespace only (the pools' keys): the CSI node plugin mints the groups' credentials.
    assert cluster.allowed(token, "watch", "secrets", NAMESPACE)
    assert not cluster.allowed(token, "get", "secrets", GROUP_NAMESPACE)
    assert not cluster.allowed(token, "list", "secrets", None)
    assert not cluster.allowed(token, "update", "deployments.apps", GROUP_NAMESPACE)
    assert not cluster.allowed(token, "create", "daemonsets.apps", GROUP_NAMESPACE)  # only where pools run
    assert cluster.allowed(token, "create", "daemonsets.apps", NAMESPACE)
    assert cluster.allowed(token, "update", "inferencegroups.maru.io", GROUP_NAMESPACE, subresource="finalizers")
    if watch_namespaces:
        assert not cluster.allowed(token, "create", "deployments.apps", "default")

    # Uninstall removes the operator but, by design, neither the CRDs nor the users' resources.
    helm(cluster, "uninstall", RELEASE, "--namespace", NAMESPACE)
    assert cluster.get("deployments.apps", RELEASE, NAMESPACE) is None
    assert cluster.get("customresourcedefinitions.apiextensions.k8s.io", "marupools.maru.io") is not None
    assert cluster.get("marupools.maru.io", "cxl-pool") is not None
    assert os.path.exists(tmp_path / "operator.log")


def test_a_second_release_serving_the_same_instance_is_refused(k8s_emulator: KubeEmulator) -> None:  # noqa: F811
    """Two releases in different namespaces must not reconcile the same objects."""
    cluster = k8s_emulator
    helm(cluster, "install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--create-namespace")
    # The CSI driver is cluster-scoped: one release installs it, the others use it.
    second = helm(
        cluster,
        "install",
        "maru-b",
        str(CHART),
        "--namespace",
        "team-b",
        "--create-namespace",
        "--set",
        "csiDriver.enabled=false",
        check=False,
    )
    assert second.returncode != 0
    assert f"release {RELEASE} in namespace {NAMESPACE} already runs a maru-operator serving instance" in second.stderr
    assert cluster.get("deployments.apps", "maru-b-maru-operator", "team-b") is None
    helm(
        cluster,
        "install",
        "maru-b",
        str(CHART),
        "--namespace",
        "team-b",
        "--create-namespace",
        "--set",
        "instance=team-b",
        "--set",
        "csiDriver.enabled=false",
    )
    args = cluster.get("deployments.apps", "maru-b-maru-operator", "team-b")["spec"]["template"]["spec"]["containers"][
        0
    ]["args"]  # type: ignore[index]
    assert "--instance=team-b" in args
    # An upgrade of a release is not a second release.
    helm(cluster, "upgrade", RELEASE, str(CHART), "--namespace", NAMESPACE)
