"""A small simulated kube-controller-manager for the emulator.

The emulator runs no controllers, so Deployments and DaemonSets never report ready replicas on
their own. This writes their ``status`` (through the status subresource, as the real controllers
do) whenever anything changes, and an EndpointSlice per Service with a selector, as the
EndpointSlice controller does: one endpoint per replica of the Deployments (or per pod, with
``pods=True``) the selector matches, ready as many as are ready, the Service's labels copied onto
the slice. No pods are created unless asked: readiness is decided by a test-controlled function, so a
test can hold a workload "not ready" and release it later.

Zero counts are omitted from the status, as the real API does (``omitempty``), so code reading
``status.readyReplicas`` must cope with its absence.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import hashlib
import itertools
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from maru_localcluster.apiserver import Emulator, JsonObj
from maru_localcluster.controllers import EmulatorLoopTask, resolve_int_or_percent

if TYPE_CHECKING:
    from maru_localcluster.server import KubeEmulator

# The field manager the real controllers write status as.
MANAGER = "kube-controller-manager"
REVISION = "deployment.kubernetes.io/revision"
SLICE_MANAGER = "endpointslice-controller.k8s.io"


def _is_ready(pod: JsonObj) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


# Given a Deployment or DaemonSet, how many of its replicas (or nodes) are ready:
# True = all of them, False = none, an int = that many (clamped to the desired count).
Readiness = Callable[[JsonObj], bool | int]


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _nonzero(status: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in status.items() if v != 0}


def _conditions(old: list[JsonObj], wanted: list[tuple[str, bool, str, str]]) -> list[JsonObj]:
    # Keep lastTransitionTime unless the condition flips, or every pass would be a write.
    previous = {c.get("type"): c for c in old}
    result = []
    for type_, ok, reason, message in wanted:
        status = "True" if ok else "False"
        prev = previous.get(type_)
        stamp = prev["lastTransitionTime"] if prev and prev.get("status") == status else _now()
        update = prev.get("lastUpdateTime", stamp) if prev and prev.get("status") == status else stamp
        result.append(
            {
                "type": type_,
                "status": status,
                "reason": reason,
                "message": message,
                "lastTransitionTime": stamp,
                "lastUpdateTime": update,
            }
        )
    return result


def node_matches(node: JsonObj, pod_spec: JsonObj) -> bool:
    """Does a pod template schedule onto this node? nodeSelector and required node affinity."""
    labels = node.get("metadata", {}).get("labels") or {}
    for k, v in (pod_spec.get("nodeSelector") or {}).items():
        if labels.get(k) != v:
            return False
    required = ((pod_spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    terms = required.get("nodeSelectorTerms") or []
    if terms:
        return any(all(_expr_matches(labels, e) for e in term.get("matchExpressions") or []) for term in terms)
    return True


def _expr_matches(labels: dict[str, str], expr: JsonObj) -> bool:
    key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
    if op == "In":
        return labels.get(key) in values
    if op == "NotIn":
        return labels.get(key) not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    return False


class KubeControllers(EmulatorLoopTask):
    """Deployment and DaemonSet status controllers, running as a task on the emulator's loop."""

    def __init__(self, kube: KubeEmulator, *, delay: float = 0.0, pods: bool = False) -> None:
        self.kube = kube
        self.delay = delay  # a pause before each pass, to let clients see intermediate states
        # Also keep Pod objects (Running, with a podIP, Ready per the readiness) for each workload,
        # e.g. for a router's pod discovery. Pods are owned by their Deployment/DaemonSet directly
        # (no ReplicaSets) and are replaced when the pod template changes.
        self.pods = pods
        self._pod_ips = itertools.count(2)
        self._templates: dict[str, tuple[str, int]] = {}  # Deployment uid -> (its pod template, its revision)
        # Deployment uid -> (its newest pod template, pods of older templates still running)
        self._rolls: dict[str, tuple[str, int]] = {}
        self._readiness: Readiness = lambda obj: True
        self._held = False
        self._paused = False
        self._endpoints_held = False
        self._task: asyncio.Task[None] | None = None
        self.passes = 0

    # ---------------------------------------------------------------------------------------------
    # Test controls (call from the test thread).

    def set_readiness(self, readiness: Readiness) -> None:
        """Decide per workload how many replicas/nodes are ready; re-evaluated on every change."""
        self._readiness = readiness
        self.kube.call(self.kube.emulator.poke)

    def hold(self) -> None:
        """Nothing becomes ready until :meth:`release`."""
        self._held = True
        self.kube.call(self.kube.emulator.poke)

    def release(self) -> None:
        self._held = False
        self.kube.call(self.kube.emulator.poke)

    def pause(self) -> None:
        """Write nothing at all until :meth:`resume`, as a kube-controller-manager that is down or behind:
        new workloads keep a status their controller has not observed yet."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self.kube.call(self.kube.emulator.poke)

    def hold_endpoints(self) -> None:
        """Services show no ready endpoint, whatever their pods do, until :meth:`release_endpoints`."""
        self._endpoints_held = True
        self.kube.call(self.kube.emulator.poke)

    def release_endpoints(self) -> None:
        self._endpoints_held = False
        self.kube.call(self.kube.emulator.poke)

    def add_node(self, name: str, labels: dict[str, str] | None = None, ready: bool = True) -> JsonObj:
        return self.kube.create(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
                "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
            }
        )

    # ---------------------------------------------------------------------------------------------
    # Lifecycle.

    async def _run(self) -> None:
        emulator = self.kube.emulator
        while True:
            changed = emulator.next_change()
            if self.delay:
                await asyncio.sleep(self.delay)
            if not self._paused:
                self.reconcile(emulator)
                self.passes += 1
            await changed

    # ---------------------------------------------------------------------------------------------
    # Reconciliation (on the emulator's loop).

    def _ready_count(self, obj: JsonObj, desired: int) -> int:
        if self._held:
            return 0
        verdict = self._readiness(obj)
        if verdict is True:
            return desired
        if verdict is False:
            return 0
        return max(0, min(int(verdict), desired))

    def reconcile(self, emulator: Emulator) -> None:
        nodes = [n for n in emulator.list_objects("", "nodes") if not n["metadata"].get("deletionTimestamp")]
        for deploy in emulator.list_objects("apps", "deployments"):
            desired = int((deploy.get("spec") or {}).get("replicas", 1))
            if not self.pods:
                self._write(emulator, "deployments", deploy, self._deployment_status(deploy))
                continue
            # With no Node objects at all, pods run "somewhere"; with nodes, they must fit one.
            pod_spec = deploy["spec"]["template"].get("spec") or {}
            fitting = [n["metadata"]["name"] for n in nodes if node_matches(n, pod_spec)]
            placements: list[str | None] = [fitting[i % len(fitting)] if fitting else None for i in range(desired)]
            schedulable = desired if (fitting or not nodes) else 0
            status = self._deployment_status(deploy, schedulable)
            self._write(emulator, "deployments", deploy, status)
            self._sync_pods(emulator, deploy, placements, status.get("readyReplicas", 0), bool(nodes))
        for ds in emulator.list_objects("apps", "daemonsets"):
            status = self._daemonset_status(ds, nodes)
            self._write(emulator, "daemonsets", ds, status)
            if self.pods:
                pod_spec = ds["spec"]["template"].get("spec") or {}
                placements = [n["metadata"]["name"] for n in nodes if node_matches(n, pod_spec)]
                self._sync_pods(emulator, ds, list(placements), status["numberReady"], True)
        for svc in emulator.list_objects("", "services"):
            self.sync_endpoint_slice(emulator, svc)

    # --- EndpointSlices

    def _members(self, emulator: Emulator, svc: JsonObj) -> list[bool]:
        """Readiness of each endpoint the Service selects: its pods, or its Deployments' replicas."""
        selector = (svc.get("spec") or {}).get("selector") or {}
        ns = svc["metadata"]["namespace"]

        def selected(labels: dict[str, str]) -> bool:
            return all(labels.get(k) == v for k, v in selector.items())

        if self.pods:
            return [
                _is_ready(p)
                for p in emulator.list_objects("", "pods", ns)
                if (p.get("status") or {}).get("podIP") and selected(p["metadata"].get("labels") or {})
            ]
        members: list[bool] = []
        for deploy in emulator.list_objects("apps", "deployments", ns):
            if selected(((deploy["spec"].get("template") or {}).get("metadata") or {}).get("labels") or {}):
                status = deploy.get("status") or {}
                ready = int(status.get("readyReplicas") or 0)
                members += [i < ready for i in range(int(status.get("replicas") or 0))]
        return members

    def sync_endpoint_slice(self, emulator: Emulator, svc: JsonObj) -> None:
        meta = svc["metadata"]
        if not (svc.get("spec") or {}).get("selector") or meta.get("deletionTimestamp"):
            return
        ns, name = meta["namespace"], meta["name"]
        members = self._members(emulator, svc)
        endpoints = [
            {
                "addresses": [f"10.245.{i // 250}.{i % 250 + 2}"],
                "conditions": {
                    "ready": ready and not self._endpoints_held,
                    "serving": ready and not self._endpoints_held,
                    "terminating": False,
                },
            }
            for i, ready in enumerate(members)
        ]
        ports = [
            {
                "name": p.get("name", ""),
                "port": p["targetPort"] if isinstance(p.get("targetPort"), int) else p.get("port"),
                "protocol": p.get("protocol", "TCP"),
            }
            for p in svc["spec"].get("ports") or []
        ]
        slice_name = f"{name}-{hashlib.sha256(name.encode()).hexdigest()[:5]}"
        body = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "addressType": "IPv4",
            # The Service's own labels are copied, as the EndpointSlice controller does.
            "metadata": {
                "name": slice_name,
                "namespace": ns,
                "labels": {
                    **(meta.get("labels") or {}),
                    "kubernetes.io/service-name": name,
                    "endpointslice.kubernetes.io/managed-by": SLICE_MANAGER,
                },
                "ownerReferences": [
                    {
                        "apiVersion": "v1",
                        "kind": "Service",
                        "name": name,
                        "uid": meta["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "endpoints": endpoints,
            "ports": ports,
        }
        have = emulator.get_object("discovery.k8s.io", "endpointslices", ns, slice_name)
        if have is None:
            emulator.create_object("discovery.k8s.io", "endpointslices", ns, body, manager=SLICE_MANAGER)
        elif (
            any(have.get(k) != body[k] for k in ("endpoints", "ports"))
            or have["metadata"].get("labels") != body["metadata"]["labels"]
        ):
            emulator.replace_object(
                "discovery.k8s.io",
                "endpointslices",
                ns,
                slice_name,
                {**body, "metadata": {**have["metadata"], "labels": body["metadata"]["labels"]}},
                manager=SLICE_MANAGER,
            )

    def _sync_pods(
        self, emulator: Emulator, owner: JsonObj, placements: list[str | None], ready: int, have_nodes: bool
    ) -> None:
        meta = owner["metadata"]
        if meta.get("deletionTimestamp"):
            return
        namespace = meta["namespace"]
        template = owner["spec"]["template"]
        template_hash = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]
        owned = [
            p
            for p in emulator.list_objects("", "pods", namespace)
            if any(r.get("uid") == meta["uid"] for r in p["metadata"].get("ownerReferences") or [])
        ]
        wanted = {f"{meta['name']}-{template_hash}-{i}": node for i, node in enumerate(placements)}
        for pod in owned:
            if pod["metadata"]["name"] not in wanted:
                emulator.delete_object("", "pods", namespace, pod["metadata"]["name"])
        existing = {p["metadata"]["name"] for p in owned}
        for i, (name, node) in enumerate(wanted.items()):
            if name not in existing:
                spec = copy.deepcopy(template.get("spec") or {})
                if node:
                    spec["nodeName"] = node
                emulator.create_object(
                    "",
                    "pods",
                    namespace,
                    {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "metadata": {
                            "name": name,
                            "labels": {
                                **(template.get("metadata") or {}).get("labels", {}),
                                "pod-template-hash": template_hash,
                            },
                            "ownerReferences": [
                                {
                                    "apiVersion": owner["apiVersion"],
                                    "kind": owner["kind"],
                                    "name": meta["name"],
                                    "uid": meta["uid"],
                                    "controller": True,
                                    "blockOwnerDeletion": True,
                                }
                            ],
                        },
                        "spec": spec,
                    },
                    manager=MANAGER,
                )
            pod = emulator.get_object("", "pods", namespace, name)
            assert pod is not None
            scheduled = node is not None or not have_nodes
            is_ready = scheduled and i < ready
            old_status = pod.get("status") or {}
            n = next(self._pod_ips)
            pod_ip = old_status.get("podIP") or f"10.244.{n // 250}.{n % 250 + 2}"
            status = {
                "phase": "Running" if scheduled else "Pending",
                "podIP": pod_ip,
                "podIPs": [{"ip": pod_ip}],
                "hostIP": "192.168.0.1",
                "conditions": _conditions(
                    old_status.get("conditions") or [],
                    [
                        ("PodScheduled", scheduled, "Scheduled" if scheduled else "Unschedulable", ""),
                        ("Ready", is_ready, "PodReady" if is_ready else "ContainersNotReady", ""),
                    ],
                ),
            }
            if pod.get("status") != status:
                emulator.replace_object(
                    "", "pods", namespace, name, {**pod, "status": status}, subresource="status", manager="kubelet"
                )

    def _write(self, emulator: Emulator, plural: str, obj: JsonObj, status: JsonObj) -> None:
        meta = obj["metadata"]
        annotations = meta.get("annotations") or {}
        if plural == "deployments":
            annotations = {**annotations, REVISION: self._revision(obj)}
        if (obj.get("status") != status or annotations != (meta.get("annotations") or {})) and not meta.get(
            "deletionTimestamp"
        ):
            # A replace, not a merge patch: counts that dropped to zero must disappear. A Deployment's revision
            # goes with its status, as the deployment controller writes it (UpdateStatus: no new generation).
            emulator.replace_object(
                "apps",
                plural,
                meta.get("namespace"),
                meta["name"],
                {**obj, "metadata": {**meta, "annotations": annotations}, "status": status},
                subresource="status",
                manager=MANAGER,
            )

    def _revision(self, deploy: JsonObj) -> str:
        """The Deployment's revision (deployment.kubernetes.io/revision): one more for each new pod template."""
        template = json.dumps((deploy.get("spec") or {}).get("template"), sort_keys=True)
        uid = deploy["metadata"]["uid"]
        last, revision = self._templates.get(uid, (template, 1))
        if last != template:
            revision += 1  # a rollback to an older template is a new revision too, as in Kubernetes
        self._templates[uid] = (template, revision)
        return str(revision)

    def _roll(self, deploy: JsonObj, desired: int, ready: int) -> tuple[int, int]:
        """(pods of the newest template, pods of older ones) after this pass. A new Deployment gets all its pods
        at once; a new template replaces the old pods as fast as its own become ready, and while they do not
        the rollout stops where the strategy lets it (kube-controller-manager, pkg/controller/deployment/
        rolling.go: the new ReplicaSet grows to replicas + maxSurge less the old pods, the old ones shrink only
        down to replicas - maxUnavailable while the new ones are unavailable)."""
        spec = deploy.get("spec") or {}
        template = json.dumps(spec.get("template"), sort_keys=True)
        uid = deploy["metadata"]["uid"]
        last, old = self._rolls.get(uid, (template, 0))
        if last != template:
            old = max(old, desired)  # every pod running so far has an older template now
        strategy = spec.get("strategy") or {}
        if ready >= desired or strategy.get("type") == "Recreate":
            old = 0
        if old:
            pace = strategy.get("rollingUpdate") or {}
            surge = resolve_int_or_percent(pace.get("maxSurge", "25%"), desired, round_up=True)
            unavailable = resolve_int_or_percent(pace.get("maxUnavailable", "25%"), desired, round_up=False)
            old = min(old, max(0, desired - unavailable))
            new = min(desired, max(0, desired + surge - old))
        else:
            new = desired
        self._rolls[uid] = (template, old)
        return new, old

    def _deployment_status(self, deploy: JsonObj, schedulable: int | None = None) -> JsonObj:
        spec = deploy.get("spec") or {}
        desired = int(spec.get("replicas", 1))
        ready = self._ready_count(deploy, desired if schedulable is None else min(desired, schedulable))
        # updatedReplicas: the pods of the newest ReplicaSet, ready or not (pkg/controller/deployment/sync.go
        # calculateStatus, GetActualReplicaCountForReplicaSets of the new ReplicaSet); replicas: all of them.
        updated, older = self._roll(deploy, desired, ready)
        old = deploy.get("status") or {}
        status = _nonzero(
            {
                "observedGeneration": deploy["metadata"].get("generation", 1),
                "replicas": updated + older,
                "updatedReplicas": updated,
                "readyReplicas": ready,
                "availableReplicas": ready,
                "unavailableReplicas": desired - ready,
            }
        )
        status["conditions"] = _conditions(
            old.get("conditions") or [],
            [
                (
                    "Available",
                    ready >= desired,
                    "MinimumReplicasAvailable" if ready >= desired else "MinimumReplicasUnavailable",
                    "Deployment has minimum availability."
                    if ready >= desired
                    else "Deployment does not have minimum availability.",
                ),
                (
                    "Progressing",
                    True,
                    "NewReplicaSetAvailable" if ready >= desired else "ReplicaSetUpdated",
                    "ReplicaSet has successfully progressed." if ready >= desired else "ReplicaSet is progressing.",
                ),
            ],
        )
        return status

    def _daemonset_status(self, ds: JsonObj, nodes: list[JsonObj]) -> JsonObj:
        pod_spec = ((ds.get("spec") or {}).get("template") or {}).get("spec") or {}
        desired = sum(1 for n in nodes if node_matches(n, pod_spec))
        ready = self._ready_count(ds, desired)
        return {
            # The four counts below are required fields of DaemonSetStatus, so zeros stay.
            "currentNumberScheduled": desired,
            "desiredNumberScheduled": desired,
            "numberMisscheduled": 0,
            "numberReady": ready,
            **_nonzero(
                {
                    "observedGeneration": ds["metadata"].get("generation", 1),
                    "updatedNumberScheduled": desired,
                    "numberAvailable": ready,
                    "numberUnavailable": desired - ready,
                }
            ),
        }
