"""The product on the local cluster, as a user runs it: CRDs applied with kubectl, the operator as
``python -m maru_operator run`` outside the cluster (with the cluster's kubeconfig), resources applied
and waited for with kubectl. Shared by ``make demo`` and the end-to-end tests.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from maru_localcluster import tools
from maru_localcluster.cluster import LocalCluster
from maru_localcluster.images import package_roots
from maru_localcluster.tools import REPO_ROOT

CRDS = REPO_ROOT / "crds"
POOL_NAMESPACE = "maru-system"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def apply_crds(cluster: LocalCluster) -> None:
    """``kubectl apply -f crds/`` and wait until they are established (kubectl maps them after that)."""
    cluster.kubectl("apply", "--validate=false", "-f", str(CRDS))
    cluster.kubectl("wait", "--for=condition=Established", "crd", "--all", "--timeout=60s")


def install_csi_driver(cluster: LocalCluster) -> None:
    """The chart's CSIDriver object for csi.maru.io, which vLLM pods' socket volumes need (the node
    plugin itself runs with each kubelet)."""
    rendered = subprocess.run(
        [str(tools.helm_path()), "template", "maru-operator", str(REPO_ROOT / "charts" / "maru-operator"),
         "--show-only", "templates/csi-driver.yaml"], capture_output=True, text=True, check=True, timeout=60)
    cluster.kubectl("apply", "--validate=false", "-f", "-", input=rendered.stdout)


def create_namespace(cluster: LocalCluster, name: str) -> None:
    if cluster.kube.get("namespaces", name) is None:
        cluster.kubectl("create", "namespace", name)


class OperatorProcess:
    """``python -m maru_operator run`` against the cluster, logging to ``log_path``."""

    def __init__(self, cluster: LocalCluster, log_path: Path, *, pool_namespace: str = POOL_NAMESPACE,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.cluster = cluster
        self.log_path = log_path
        self.argv = [sys.executable, "-m", "maru_operator", "run", "--pool-namespace", pool_namespace,
                     # Out of the cluster it shares the machine's ports: a free one for liveness, no metrics.
                     "--liveness", f"http://127.0.0.1:{free_port()}/healthz", "--metrics-port", "0",
                     "--resync-seconds", "10", *extra_args]
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> OperatorProcess:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def start(self) -> OperatorProcess:
        env = self.cluster.env(PYTHONPATH=os.pathsep.join(package_roots()))
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 20) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == type_), None)


def is_ready(obj: dict[str, Any], generation: int | None = None) -> bool:
    """Ready=True, computed from at least ``generation`` when given."""
    ready = condition(obj, "Ready")
    if not ready or ready.get("status") != "True":
        return False
    if generation is None:
        return True
    return int((obj.get("status") or {}).get("observedGeneration") or 0) >= generation


def why_not_ready(cluster: LocalCluster) -> str:
    """What a user would look at when something does not become Ready: objects, pods, their logs."""
    out = [cluster.kubectl("get", "mpool,ig,deploy,ds,pods", "-A", "-o", "wide", check=False).stdout]
    for pod in cluster.kube.list("pods"):
        meta = pod["metadata"]
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            state = status.get("state") or {}
            if status.get("ready") and "running" in state:
                continue
            out.append(f"--- pod {meta['namespace']}/{meta['name']} container {status['name']}: "
                       f"{state} restarts={status.get('restartCount')}")
            for previous in (False, True):
                try:
                    text = cluster.pod_log(meta["namespace"], meta["name"], status["name"], previous=previous)
                except LookupError:
                    text = ""
                if text:
                    out.append(("(previous run) " if previous else "") + "\n".join(text.splitlines()[-15:]))
    return "\n".join(out)


def wait_ready(cluster: LocalCluster, resource: str, name: str, namespace: str | None = None, *,
               timeout: float = 300, generation: int | None = None) -> dict[str, Any]:
    """Wait until the object is Ready (at ``generation``); the error shows the pods and their logs."""
    deadline = time.monotonic() + timeout
    while True:
        obj = cluster.kube.get(resource, name, namespace)
        if obj is not None and is_ready(obj, generation):
            return obj
        if time.monotonic() > deadline:
            where = f"{namespace}/{name}" if namespace else name
            raise AssertionError(f"{resource} {where} not Ready after {timeout:.0f}s: "
                                 f"{(obj or {}).get('status')}\n{why_not_ready(cluster)}")
        time.sleep(0.5)
