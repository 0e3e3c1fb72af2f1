"""The product on the local cluster, as a user runs it: the chart installed with helm (the operator as its
pod, from the operator image), resources applied with kubectl and waited for, a claim filled with a model.
Shared by ``make demo`` and the end-to-end tests.

Waits are bounded by progress, not by a fixed window: a loaded two-core machine runs everything two
or three times slower, so a wait goes on while the cluster visibly works (a pod changes state, a
container writes to its log, an object changes) and gives up only after ``STALL_S`` seconds in which
nothing moved, or at a ceiling meant only to end a run that never settles. Its failure shows the pods,
their states and the last lines of their logs.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from maru_localcluster import tools
from maru_localcluster.cluster import LocalCluster
from maru_localcluster.tools import REPO_ROOT

CHART = REPO_ROOT / "charts" / "maru-operator"
POOL_NAMESPACE = "maru-system"
# No visible progress for this long ends a wait; the ceiling ends one that never settles.
STALL_S = 120.0
CEILING_S = 1200.0

T = TypeVar("T")


def activity(cluster: LocalCluster) -> Hashable:
    """What changes while the cluster works: every pod's phase, containers' states and restarts, and the
    size of every container log. (Not the API server's resourceVersion: the operator's Lease renewals
    move it every few seconds whether anything progresses or not.)"""
    pods = []
    for pod in cluster.kube.list("pods"):
        status = pod.get("status") or {}
        containers = tuple(
            (c.get("name"), c.get("ready"), c.get("restartCount"), tuple(c.get("state") or {}))
            for c in status.get("containerStatuses") or []
        )
        pods.append((pod["metadata"]["namespace"], pod["metadata"]["name"], status.get("phase"), containers))
    log_bytes = 0
    for log in cluster.workdir.glob("nodes/*/logs/*/*/*.log"):
        try:
            log_bytes += log.stat().st_size
        except OSError:
            continue
    return tuple(sorted(pods, key=repr)), log_bytes


class ProgressClock:
    """Says when a wait should give up: ``progress`` (default :func:`activity`) unchanged for ``stall_s``,
    or ``ceiling_s`` in all."""

    def __init__(
        self,
        cluster: LocalCluster,
        *,
        stall_s: float = STALL_S,
        ceiling_s: float = CEILING_S,
        progress: Callable[[], Hashable] | None = None,
    ) -> None:
        self.sample = progress or (lambda: activity(cluster))
        self.stall_s, self.ceiling_s = stall_s, ceiling_s
        self.started = self.last_change = time.monotonic()
        self.seen = self.sample()

    def expired(self) -> str | None:
        """None while the wait may go on; else why it should end."""
        now = time.monotonic()
        current = self.sample()
        if current != self.seen:
            self.seen, self.last_change = current, now
        if now - self.last_change > self.stall_s:
            return f"nothing in the cluster changed for {now - self.last_change:.0f}s"
        if now - self.started > self.ceiling_s:
            return f"still changing after {now - self.started:.0f}s"
        return None

    def elapsed(self) -> float:
        return time.monotonic() - self.started


def wait_for(
    what: str,
    check: Callable[[], T],
    cluster: LocalCluster,
    *,
    stall_s: float = STALL_S,
    ceiling_s: float = CEILING_S,
    explain: Callable[[], str] | None = None,
    progress: Callable[[], Hashable] | None = None,
    poll_s: float = 0.5,
) -> T:
    """Poll ``check`` until it returns something truthy, for as long as the cluster makes progress.

    ``progress`` (default: :func:`activity`) is sampled at every poll; the wait fails when it has not
    changed for ``stall_s`` seconds, or after ``ceiling_s`` in all. The failure says which, and shows
    ``explain()`` (default: :func:`why_not_ready`).
    """
    clock = ProgressClock(cluster, stall_s=stall_s, ceiling_s=ceiling_s, progress=progress)
    while True:
        result = check()
        if result:
            return result
        why = clock.expired()
        if why is not None:
            detail = (explain or (lambda: why_not_ready(cluster)))()
            raise AssertionError(f"gave up waiting for {what} after {clock.elapsed():.0f}s ({why})\n{detail}")
        time.sleep(poll_s)


def apply_csi_driver(cluster: LocalCluster) -> None:
    """The chart's CSIDriver object for csi.maru.io, which vLLM pods' socket volumes need, without the chart's
    node plugin DaemonSet (each kubelet of the local cluster runs the plugin itself)."""
    rendered = subprocess.run(
        [str(tools.helm_path()), "template", "maru-operator", str(CHART), "--show-only", "templates/csi-driver.yaml"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    wanted = [d for d in yaml.safe_load_all(rendered.stdout) if d and d["kind"] == "CSIDriver"]
    cluster.kubectl("apply", "--validate=false", "-f", "-", input=yaml.safe_dump_all(wanted))


def create_namespace(cluster: LocalCluster, name: str) -> None:
    if cluster.kube.get("namespaces", name) is None:
        cluster.kubectl("create", "namespace", name)


def prefilled_claim(cluster: LocalCluster, namespace: str, name: str, content: Path, folder: str) -> str:
    """A PersistentVolumeClaim holding ``content`` in ``folder``, as a user fills one before the pods that read
    it (weights copied in by a Job): created with kubectl, bound, then filled, readable by any user (the
    images run as 65532). Returns the claim's folder on this machine."""
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}},
    }
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(claim))
    bound = wait_for(
        f"claim {namespace}/{name} to be bound",
        lambda: (
            (obj := cluster.kube.get("persistentvolumeclaims", name, namespace))
            and (obj.get("status") or {}).get("phase") == "Bound"
            and obj
        ),
        cluster,
    )
    # Where the local cluster keeps a claim's data (volumes.PersistentVolumeClaimVolume), as an NFS export.
    root = cluster.workdir / "persistent-volumes" / namespace / f"{name}-{bound['metadata']['uid']}"
    target = root / folder
    shutil.copytree(content, target, dirs_exist_ok=True)
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return str(root)


class OperatorRelease:
    """``helm install`` of the chart: the operator runs as the chart's Deployment, a pod of the operator image
    (``make images``, under the reference the chart renders), as the chart's ServiceAccount and within its
    RBAC, as on a cluster. The chart's CSI node plugin is off: its DaemonSet's sidecars (node-driver-registrar,
    livenessprobe) are upstream images no registry here serves, and each kubelet runs the plugin itself; the
    chart's CSIDriver object is applied on its own."""

    def __init__(self, cluster: LocalCluster, *values: str, release: str = "maru-operator") -> None:
        self.cluster = cluster
        self.release = release
        self.values = values

    def helm(self, *args: str) -> str:
        done = subprocess.run(
            [str(tools.helm_path()), *args, "--namespace", POOL_NAMESPACE],
            capture_output=True,
            text=True,
            timeout=120,
            env=self.cluster.kube.env(),
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"helm {' '.join(args)} failed: {done.stdout}{done.stderr}")
        return done.stdout

    def install(self) -> OperatorRelease:
        create_namespace(self.cluster, POOL_NAMESPACE)
        # As the README's quickstart: the pool daemons are privileged.
        self.cluster.kubectl(
            "label", "--overwrite", "namespace", POOL_NAMESPACE, "pod-security.kubernetes.io/enforce=privileged"
        )
        sets = [arg for value in ("csiDriver.enabled=false", *self.values) for arg in ("--set", value)]
        self.helm("install", self.release, str(CHART), *sets)
        # The chart's CRDs: established before anything names their kinds.
        self.cluster.kubectl("wait", "--for=condition=Established", "crd", "--all", "--timeout=60s")
        apply_csi_driver(self.cluster)
        return self

    def upgrade(self, *args: str) -> None:
        """``helm upgrade --reuse-values`` with ``args`` (``--set``, ``--set-json``); the Deployment rolls."""
        self.helm("upgrade", self.release, str(CHART), "--reuse-values", *args)

    def rollback(self, revision: int = 1) -> None:
        self.helm("rollback", self.release, str(revision))

    def pods(self) -> list[dict[str, Any]]:
        """The operator's pods, newest first, without those being deleted."""
        pods = self.cluster.kube.list("pods", POOL_NAMESPACE, labels=f"app.kubernetes.io/instance={self.release}")
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        return sorted(live, key=lambda p: str(p["metadata"].get("creationTimestamp")), reverse=True)

    def ready_pod(self) -> dict[str, Any] | None:
        return next((p for p in self.pods() if is_pod_ready(p)), None)

    def wait_ready(self, image_tag: str | None = None) -> dict[str, Any]:
        """The Ready pod (of an image with ``image_tag``, after an upgrade or a rollback)."""

        def ready() -> dict[str, Any] | None:
            pod = self.ready_pod()
            if pod is None or (image_tag and not pod["spec"]["containers"][0]["image"].endswith(f":{image_tag}")):
                return None
            return pod

        return wait_for("the operator's pod to be Ready", ready, self.cluster)

    def alive(self) -> bool:
        """Its pod runs or starts; a container in CrashLoopBackOff is an operator that keeps exiting."""
        for pod in self.pods():
            for status in (pod.get("status") or {}).get("containerStatuses") or []:
                if ((status.get("state") or {}).get("waiting") or {}).get("reason") == "CrashLoopBackOff":
                    return False
        return True

    def log(self, pod: dict[str, Any] | None = None) -> str:
        """The log of ``pod`` (default: the newest operator pod)."""
        pods = [pod] if pod is not None else self.pods()
        return self.cluster.pod_log(POOL_NAMESPACE, pods[0]["metadata"]["name"]) if pods else ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:]) or "(no operator pod)"


def is_pod_ready(pod: dict[str, Any]) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


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
            out.append(
                f"--- pod {meta['namespace']}/{meta['name']} container {status['name']}: "
                f"{state} restarts={status.get('restartCount')}"
            )
            for previous in (False, True):
                try:
                    text = cluster.pod_log(meta["namespace"], meta["name"], status["name"], previous=previous)
                except LookupError:
                    text = ""
                if text:
                    out.append(("(previous run) " if previous else "") + "\n".join(text.splitlines()[-15:]))
    return "\n".join(out)


def wait_ready(
    cluster: LocalCluster,
    resource: str,
    name: str,
    namespace: str | None = None,
    *,
    stall_s: float = STALL_S,
    generation: int | None = None,
) -> dict[str, Any]:
    """Wait until the object is Ready (at ``generation``) while the cluster makes progress; the error
    shows the object's status, the pods and their logs."""
    where = f"{namespace}/{name}" if namespace else name

    def ready() -> dict[str, Any] | None:
        obj = cluster.kube.get(resource, name, namespace)
        return obj if obj is not None and is_ready(obj, generation) else None

    def explain() -> str:
        return (
            f"{resource} {where}: {(cluster.kube.get(resource, name, namespace) or {}).get('status')}\n"
            + why_not_ready(cluster)
        )

    return wait_for(f"{resource} {where} to be Ready", ready, cluster, stall_s=stall_s, explain=explain)
