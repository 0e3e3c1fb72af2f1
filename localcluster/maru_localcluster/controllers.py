"""kube-controller-manager and kube-scheduler for the local cluster, on the API server's own event loop.

Each pass (run after every change, and every second for timed work) converges the whole cluster,
level-triggered, as the real controllers do from their informers:

* **Deployment** → ReplicaSets named ``<deployment>-<pod-template-hash>``: a new ReplicaSet per
  template, ``RollingUpdate`` with ``maxSurge``/``maxUnavailable`` (scale the new one up within the
  surge, the old ones down as far as availability allows) or ``Recreate`` (old pods gone first);
  ``deployment.kubernetes.io/revision``; old ReplicaSets beyond ``revisionHistoryLimit`` removed;
  status with the Available and Progressing conditions (ProgressDeadlineExceeded included).
* **ReplicaSet** → pods ``<replicaset>-<5 chars>``; surplus pods deleted unscheduled, then not
  ready, then newest first.
* **DaemonSet** → one pod per node the template fits (nodeSelector, required node affinity, taints
  against the tolerations plus the DaemonSet ones); ``RollingUpdate`` replaces at most
  ``maxUnavailable`` pods at a time; pods are bound to their node directly.
* **scheduler** (``scheduler.py``) binds pending pods; **EndpointSlice** per Service with a
  selector (ready, serving and terminating endpoints, named target ports resolved per pod; the
  Service's labels copied onto its slices and kept in step, beside ``kubernetes.io/service-name``);
  **ServiceAccount** ``default`` and ConfigMap ``kube-root-ca.crt`` in every namespace; **pod GC**
  removes the pods of nodes that are gone (owner-reference GC is the API server's, ``apiserver.py``).
* **HorizontalPodAutoscaler** (autoscaling/v2): no metrics server here, so a target's count is only kept within
  ``minReplicas``/``maxReplicas`` (through its scale subresource); a target at 0 is left there
  (ScalingActive=False, ScalingDisabled), as kube-controller-manager's HPA controller does.
* **PersistentVolumeClaim**: a provisioner of one shared filesystem (as an NFS class is) binds every claim
  at once, whatever its access mode and class, with the capacity it asked for; the kubelets mount
  ``<cluster>/persistent-volumes/<namespace>/<claim>-<uid>`` (``volumes.py``).

Writes go straight to the API server's store (no HTTP), as the same loop serves the API; watchers
see them like any other write. A create the API server refuses (a missing PriorityClass or
ServiceAccount) becomes a FailedCreate event and a ReplicaFailure condition, retried every few
seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import hashlib
import json
import math
import random
import time
from typing import TYPE_CHECKING, Any, Self

from maru_localcluster import events
from maru_localcluster.apiserver import ApiError, Emulator, JsonObj
from maru_localcluster.scheduler import choose_node, selector_matches, why_not

if TYPE_CHECKING:
    from maru_localcluster.server import KubeEmulator

# kube-controller-manager's pod name suffix alphabet: no vowels, no look-alike digits.
_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
HASH_LABEL = "pod-template-hash"
DS_HASH_LABEL = "controller-revision-hash"
REVISION = "deployment.kubernetes.io/revision"
SLICE_MANAGER = "endpointslice-controller.k8s.io"
RETRY_FAILED_CREATE_S = 3.0


def _now() -> str:
    return events.now()


def _age_s(stamp: str | None) -> float:
    if not stamp:
        return 0.0
    then = datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    return (datetime.datetime.now(tz=datetime.UTC) - then).total_seconds()


def short_hash(obj: Any, length: int = 10) -> str:
    digest = hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).digest()
    return "".join(_ALPHABET[b % len(_ALPHABET)] for b in digest[:length])


def controller_uid(obj: JsonObj) -> str | None:
    for ref in obj["metadata"].get("ownerReferences") or []:
        if ref.get("controller"):
            return ref.get("uid")
    return None


def owner_ref(owner: JsonObj) -> JsonObj:
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def pod_ready(pod: JsonObj) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def pod_active(pod: JsonObj) -> bool:
    return not pod["metadata"].get("deletionTimestamp") and (pod.get("status") or {}).get("phase") not in (
        "Succeeded",
        "Failed",
    )


def pod_available(pod: JsonObj, min_ready_s: float) -> bool:
    if not pod_ready(pod):
        return False
    if min_ready_s <= 0:
        return True
    ready = next(c for c in pod["status"]["conditions"] if c.get("type") == "Ready")
    return _age_s(ready.get("lastTransitionTime")) >= min_ready_s


def resolve_int_or_percent(value: Any, total: int, round_up: bool) -> int:
    if isinstance(value, str) and value.endswith("%"):
        share = int(value[:-1]) * total / 100
        return math.ceil(share) if round_up else math.floor(share)
    return int(value or 0)


def _condition(old: list[JsonObj], type_: str, ok: bool, reason: str, message: str) -> JsonObj:
    prev = next((c for c in old if c.get("type") == type_), {})
    status = "True" if ok else "False"
    same = prev.get("status") == status
    stamp = _now()
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "lastUpdateTime": prev.get("lastUpdateTime") if same and prev.get("reason") == reason else stamp,
        "lastTransitionTime": prev.get("lastTransitionTime") if same else stamp,
    }


def _nonzero(status: JsonObj) -> JsonObj:
    return {k: v for k, v in status.items() if v != 0}


class EmulatorLoopTask:
    """A controller's ``_run``, as a task on the emulator's event loop from ``with`` until the block ends."""

    kube: KubeEmulator
    _task: asyncio.Task[None] | None = None

    def __enter__(self) -> Self:
        def start() -> None:
            self._task = asyncio.get_running_loop().create_task(self._run())

        self.kube.call(start)
        return self

    def __exit__(self, *_: object) -> None:
        def stop() -> None:
            if self._task is not None:
                self._task.cancel()

        self.kube.call(stop)

    async def _run(self) -> None:
        raise NotImplementedError


class ControllerManager(EmulatorLoopTask):
    """Runs the controllers and the scheduler against ``kube`` until the context exits."""

    def __init__(self, kube: KubeEmulator, *, ca_pem: str) -> None:
        self.kube = kube
        self.ca_pem = ca_pem
        self._task: asyncio.Task[None] | None = None
        self._recorder = events.Recorder()
        self._failed_create: dict[str, float] = {}  # owner uid -> monotonic time of the last refusal
        self._failed_why: dict[str, str] = {}  # owner uid -> the last refusal's message
        self.passes = 0
        self.errors: list[str] = []

    async def _run(self) -> None:
        emulator = self.kube.emulator
        while True:
            changed = emulator.next_change()
            try:
                self.reconcile(emulator)
            except Exception as err:  # a controller bug must not stop the others for good
                import traceback

                self.errors.append(traceback.format_exc())
                del err
            self.passes += 1
            with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(changed), timeout=1.0)
            await asyncio.sleep(0.02)  # let a burst of writes land before the next pass

    # ------------------------------------------------------------------------------------- helpers

    def _record(
        self,
        emulator: Emulator,
        obj: JsonObj,
        reason: str,
        message: str,
        type_: str = "Normal",
        component: str = "controllermanager",
    ) -> None:
        ns = obj["metadata"].get("namespace") or "default"
        repeat = self._recorder.repeat_of(obj, reason, message)
        try:
            if repeat is not None:
                ns, name, count = repeat
                emulator.patch_object("", "events", ns, name, {"count": count + 1, "lastTimestamp": _now()})
                self._recorder.remember(obj, reason, message, ns, name, count + 1)
                return
            body = events.event_body(obj, reason, message, component=component, type_=type_)
            created = emulator.create_object("", "events", ns, body)
            self._recorder.remember(obj, reason, message, ns, created["metadata"]["name"], 1)
        except ApiError:
            pass  # the namespace is going away

    def _write_status(self, emulator: Emulator, group: str, plural: str, obj: JsonObj, status: JsonObj) -> None:
        if obj.get("status") == status or obj["metadata"].get("deletionTimestamp"):
            return
        meta = obj["metadata"]
        with contextlib.suppress(ApiError):
            emulator.replace_object(
                group, plural, meta.get("namespace"), meta["name"], {**obj, "status": status}, subresource="status"
            )

    def _may_create(self, owner_uid: str) -> bool:
        last = self._failed_create.get(owner_uid)
        return last is None or time.monotonic() - last > RETRY_FAILED_CREATE_S

    def _create_pod(
        self,
        emulator: Emulator,
        owner: JsonObj,
        template: JsonObj,
        name: str,
        extra_labels: dict[str, str],
        node: str | None = None,
    ) -> str | None:
        """Create a pod from ``template``; the refusal message (recorded as FailedCreate) when refused."""
        spec = copy.deepcopy(template.get("spec") or {})
        if node:
            spec["nodeName"] = node
        tmeta = template.get("metadata") or {}
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "labels": {**(tmeta.get("labels") or {}), **extra_labels},
                "annotations": dict(tmeta.get("annotations") or {}),
                "ownerReferences": [owner_ref(owner)],
            },
            "spec": spec,
        }
        if not body["metadata"]["annotations"]:
            del body["metadata"]["annotations"]
        try:
            pod = emulator.create_object("", "pods", owner["metadata"]["namespace"], body)
        except ApiError as err:
            self._failed_create[owner["metadata"]["uid"]] = time.monotonic()
            self._failed_why[owner["metadata"]["uid"]] = err.message
            self._record(emulator, owner, "FailedCreate", f"Error creating: {err.message}", "Warning")
            return err.message
        self._failed_create.pop(owner["metadata"]["uid"], None)
        self._record(emulator, owner, "SuccessfulCreate", f"Created pod: {pod['metadata']['name']}")
        return None

    def _delete_pod(self, emulator: Emulator, owner: JsonObj | None, pod: JsonObj) -> None:
        meta = pod["metadata"]
        with contextlib.suppress(ApiError):
            emulator.delete_object("", "pods", meta["namespace"], meta["name"])
            if owner is not None:
                self._record(emulator, owner, "SuccessfulDelete", f"Deleted pod: {meta['name']}")

    # ------------------------------------------------------------------------------------- passes

    def reconcile(self, emulator: Emulator) -> None:
        self.namespaces(emulator)
        for d in emulator.list_objects("apps", "deployments"):
            self.deployment(emulator, d)
        pods = emulator.list_objects("", "pods")
        for rs in emulator.list_objects("apps", "replicasets"):
            self.replicaset(emulator, rs, pods)
        nodes = [n for n in emulator.list_objects("", "nodes") if not n["metadata"].get("deletionTimestamp")]
        pods = emulator.list_objects("", "pods")
        for ds in emulator.list_objects("apps", "daemonsets"):
            self.daemonset(emulator, ds, nodes, pods)
        pods = emulator.list_objects("", "pods")
        self.schedule(emulator, nodes, pods)
        self.pod_gc(emulator, nodes, pods)
        pods = emulator.list_objects("", "pods")
        for rs in emulator.list_objects("apps", "replicasets"):
            self.replicaset_status(emulator, rs, pods)
        for d in emulator.list_objects("apps", "deployments"):
            self.deployment_status(emulator, d)
        self.endpoint_slices(emulator, pods)
        self.claims(emulator)
        for hpa in emulator.list_objects("autoscaling", "horizontalpodautoscalers"):
            self.autoscaler(emulator, hpa)

    # --- HorizontalPodAutoscalers: no metrics here, so only the bounds and the zero rule

    def autoscaler(self, emulator: Emulator, hpa: JsonObj) -> None:
        """k8s.io/kubernetes pkg/controller/podautoscaler/horizontal.go reconcileAutoscaler, without metrics (the
        local cluster has no metrics server: the metrics' proposal is the current count). A target at 0 replicas is
        left alone (ScalingActive=False ScalingDisabled: a target scaled to zero by someone else stays so), else its
        count is kept within [minReplicas, maxReplicas] through the scale subresource."""
        spec, ns = hpa.get("spec") or {}, hpa["metadata"]["namespace"]
        ref = spec.get("scaleTargetRef") or {}
        plural = {"Deployment": "deployments", "StatefulSet": "statefulsets", "ReplicaSet": "replicasets"}.get(
            ref.get("kind", "")
        )
        target = emulator.get_object("apps", plural, ns, ref.get("name", "")) if plural else None
        old = hpa.get("status") or {}
        if target is None:
            conditions = [
                (
                    "AbleToScale",
                    False,
                    "FailedGetScale",
                    f"the HPA controller was unable to get the target's current scale: "
                    f'{ref.get("kind", "").lower()}s "{ref.get("name")}" not found',
                )
            ]
            status = {
                **old,
                "currentReplicas": old.get("currentReplicas", 0),
                "desiredReplicas": old.get("desiredReplicas", 0),
            }
        else:
            current = int((target.get("spec") or {}).get("replicas", 1))
            low, high = int(spec.get("minReplicas", 1)), int(spec.get("maxReplicas", 1))
            if current == 0 and low != 0:
                desired = 0
                conditions = [
                    (
                        "AbleToScale",
                        True,
                        "SucceededGetScale",
                        "the HPA controller was able to get the target's current scale",
                    ),
                    (
                        "ScalingActive",
                        False,
                        "ScalingDisabled",
                        "scaling is disabled since the replica count of the target is zero",
                    ),
                ]
            else:
                desired = min(max(current, low), high)
                limited = desired != current
                conditions = [
                    (
                        "AbleToScale",
                        True,
                        "SucceededRescale" if limited else "ReadyForNewScale",
                        f"the HPA controller was able to update the target scale to {desired}"
                        if limited
                        else "recommended size matches current size",
                    ),
                    (
                        "ScalingActive",
                        True,
                        "ValidMetricFound",
                        "the HPA was able to successfully calculate a replica count",
                    ),
                    (
                        "ScalingLimited",
                        limited,
                        "TooFewReplicas"
                        if desired > current
                        else "TooManyReplicas"
                        if limited
                        else "DesiredWithinRange",
                        "the desired replica count is outside the allowed range"
                        if limited
                        else "the desired count is within the acceptable range",
                    ),
                ]
                if limited:
                    with contextlib.suppress(ApiError):
                        emulator.patch_object(
                            "apps", plural, ns, ref["name"], {"spec": {"replicas": desired}}, subresource="scale"
                        )
                    self._record(
                        emulator,
                        hpa,
                        "SuccessfulRescale",
                        f"New size: {desired}; reason: All metrics below target"
                        if desired < current
                        else f"New size: {desired}; reason: Current number of replicas below Spec.MinReplicas",
                    )
                    old = {**old, "lastScaleTime": _now()}
            status = {**old, "currentReplicas": current, "desiredReplicas": desired}
        now = _now()
        before = {c.get("type"): c for c in old.get("conditions") or []}
        status["conditions"] = [
            {
                "type": t,
                "status": "True" if ok else "False",
                "reason": reason,
                "message": message,
                "lastTransitionTime": before[t]["lastTransitionTime"]
                if t in before and before[t].get("status") == ("True" if ok else "False")
                else now,
            }
            for t, ok, reason, message in conditions
        ]
        self._write_status(emulator, "autoscaling", "horizontalpodautoscalers", hpa, status)

    # --- PersistentVolumeClaims: bound at once to the shared filesystem

    def claims(self, emulator: Emulator) -> None:
        for claim in emulator.list_objects("", "persistentvolumeclaims"):
            if (claim.get("status") or {}).get("phase") == "Bound":
                continue
            spec = claim.get("spec") or {}
            status = {
                "phase": "Bound",
                "accessModes": list(spec.get("accessModes") or ["ReadWriteOnce"]),
                "capacity": dict((spec.get("resources") or {}).get("requests") or {}),
            }
            self._write_status(emulator, "", "persistentvolumeclaims", claim, status)

    # --- namespaces: the default ServiceAccount and the cluster's CA

    def namespaces(self, emulator: Emulator) -> None:
        for ns in emulator.list_objects("", "namespaces"):
            if ns["metadata"].get("deletionTimestamp"):
                continue
            name = ns["metadata"]["name"]
            with contextlib.suppress(ApiError):
                if emulator.get_object("", "serviceaccounts", name, "default") is None:
                    emulator.create_object(
                        "",
                        "serviceaccounts",
                        name,
                        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}},
                    )
                if emulator.get_object("", "configmaps", name, "kube-root-ca.crt") is None:
                    emulator.create_object(
                        "",
                        "configmaps",
                        name,
                        {
                            "apiVersion": "v1",
                            "kind": "ConfigMap",
                            "metadata": {"name": "kube-root-ca.crt"},
                            "data": {"ca.crt": self.ca_pem},
                        },
                    )

    # --- Deployment

    def _owned(self, emulator: Emulator, group: str, plural: str, owner: JsonObj) -> list[JsonObj]:
        uid = owner["metadata"]["uid"]
        return [
            o for o in emulator.list_objects(group, plural, owner["metadata"]["namespace"]) if controller_uid(o) == uid
        ]

    def deployment(self, emulator: Emulator, d: JsonObj) -> None:
        meta, spec = d["metadata"], d.get("spec") or {}
        if meta.get("deletionTimestamp") or spec.get("paused"):
            return
        ns, name = meta["namespace"], meta["name"]
        template = spec.get("template") or {}
        h = short_hash(template)
        rss = self._owned(emulator, "apps", "replicasets", d)
        new = next((rs for rs in rss if (rs["metadata"].get("labels") or {}).get(HASH_LABEL) == h), None)
        replicas = int(spec.get("replicas", 1))
        if new is None:
            revision = 1 + max(
                (int((rs["metadata"].get("annotations") or {}).get(REVISION, 0)) for rs in rss), default=0
            )
            labels = {**(template.get("metadata") or {}).get("labels", {}), HASH_LABEL: h}
            selector = copy.deepcopy(spec.get("selector") or {})
            selector.setdefault("matchLabels", {})[HASH_LABEL] = h
            rs_template = copy.deepcopy(template)
            rs_template.setdefault("metadata", {})["labels"] = labels
            start = replicas if (spec.get("strategy") or {}).get("type") != "Recreate" and not rss else 0
            body = {
                "apiVersion": "apps/v1",
                "kind": "ReplicaSet",
                "metadata": {
                    "name": f"{name}-{h}",
                    "labels": labels,
                    "ownerReferences": [owner_ref(d)],
                    "annotations": {
                        REVISION: str(revision),
                        "deployment.kubernetes.io/desired-replicas": str(replicas),
                    },
                },
                "spec": {
                    "replicas": start,
                    "selector": selector,
                    "template": rs_template,
                    "minReadySeconds": spec.get("minReadySeconds", 0),
                },
            }
            try:
                new = emulator.create_object("apps", "replicasets", ns, body)
            except ApiError as err:
                self._record(emulator, d, "FailedCreate", f"Failed to create new replica set: {err.message}", "Warning")
                return
            self._record(
                emulator, d, "ScalingReplicaSet", f"Scaled up replica set {new['metadata']['name']} from 0 to {start}"
            )
            rss.append(new)
            if d["metadata"].get("annotations", {}).get(REVISION) != str(revision):
                with contextlib.suppress(ApiError):
                    # Through the status, as the deployment controller's UpdateStatus: no new generation.
                    emulator.patch_object(
                        "apps",
                        "deployments",
                        ns,
                        name,
                        {"metadata": {"annotations": {REVISION: str(revision)}}},
                        subresource="status",
                    )
        olds = [rs for rs in rss if rs is not new and rs["metadata"]["uid"] != new["metadata"]["uid"]]
        if (spec.get("strategy") or {}).get("type") == "Recreate":
            self._recreate(emulator, d, new, olds, replicas)
        else:
            self._rolling(emulator, d, new, olds, replicas)
        self._cleanup_history(emulator, d, olds)

    def _scale(self, emulator: Emulator, d: JsonObj, rs: JsonObj, replicas: int) -> None:
        current = int(rs["spec"].get("replicas", 0))
        if current == replicas:
            return
        meta = rs["metadata"]
        with contextlib.suppress(ApiError):
            emulator.patch_object(
                "apps", "replicasets", meta["namespace"], meta["name"], {"spec": {"replicas": replicas}}
            )
            rs["spec"]["replicas"] = replicas
            verb = "up" if replicas > current else "down"
            self._record(
                emulator,
                d,
                "ScalingReplicaSet",
                f"Scaled {verb} replica set {meta['name']} from {current} to {replicas}",
            )

    def _recreate(self, emulator: Emulator, d: JsonObj, new: JsonObj, olds: list[JsonObj], replicas: int) -> None:
        for rs in olds:
            self._scale(emulator, d, rs, 0)
        old_uids = {rs["metadata"]["uid"] for rs in olds}
        if any(controller_uid(p) in old_uids for p in emulator.list_objects("", "pods", d["metadata"]["namespace"])):
            return  # Recreate: never run old and new pods together, even terminating ones
        self._scale(emulator, d, new, replicas)

    def _rolling(self, emulator: Emulator, d: JsonObj, new: JsonObj, olds: list[JsonObj], replicas: int) -> None:
        rolling = ((d.get("spec") or {}).get("strategy") or {}).get("rollingUpdate") or {}
        surge = resolve_int_or_percent(rolling.get("maxSurge", "25%"), replicas, round_up=True)
        unavailable = resolve_int_or_percent(rolling.get("maxUnavailable", "25%"), replicas, round_up=False)
        if surge == 0 and unavailable == 0:
            unavailable = 1
        all_rs = [new, *olds]
        total = sum(int(rs["spec"].get("replicas", 0)) for rs in all_rs)
        new_count = int(new["spec"].get("replicas", 0))
        if new_count < replicas:
            room = replicas + surge - total
            if room > 0:
                self._scale(emulator, d, new, new_count + min(room, replicas - new_count))
        elif new_count > replicas:
            self._scale(emulator, d, new, replicas)
        self._scale_down_old(emulator, d, new, olds, replicas - unavailable)

    def _scale_down_old(
        self, emulator: Emulator, d: JsonObj, new: JsonObj, olds: list[JsonObj], min_available: int
    ) -> None:
        """kube-controller-manager's reconcileOldReplicaSets: unhealthy old pods first, then available ones
        as far as ``min_available`` allows."""

        def spec_replicas(rs: JsonObj) -> int:
            return int(rs["spec"].get("replicas", 0))

        def available(rs: JsonObj) -> int:
            return int((rs.get("status") or {}).get("availableReplicas", 0))

        if sum(spec_replicas(rs) for rs in olds) == 0:
            return
        olds = sorted(olds, key=lambda r: r["metadata"].get("creationTimestamp", ""))
        all_pods = spec_replicas(new) + sum(spec_replicas(rs) for rs in olds)
        budget = all_pods - min_available - (spec_replicas(new) - available(new))
        if budget <= 0:
            return
        for rs in olds:
            cut = min(budget, spec_replicas(rs) - available(rs))
            if cut > 0:
                self._scale(emulator, d, rs, spec_replicas(rs) - cut)
                budget -= cut
        surplus = available(new) + sum(available(rs) for rs in olds) - min_available
        for rs in olds:
            cut = min(surplus, spec_replicas(rs))
            if cut > 0:
                self._scale(emulator, d, rs, spec_replicas(rs) - cut)
                surplus -= cut

    def _cleanup_history(self, emulator: Emulator, d: JsonObj, olds: list[JsonObj]) -> None:
        limit = int((d.get("spec") or {}).get("revisionHistoryLimit", 10))
        idle = [
            rs
            for rs in olds
            if int(rs["spec"].get("replicas", 0)) == 0 and int((rs.get("status") or {}).get("replicas", 0)) == 0
        ]
        idle.sort(key=lambda r: int((r["metadata"].get("annotations") or {}).get(REVISION, 0)))
        for rs in idle[: max(0, len(idle) - limit)]:
            with contextlib.suppress(ApiError):
                emulator.delete_object("apps", "replicasets", rs["metadata"]["namespace"], rs["metadata"]["name"])

    def deployment_status(self, emulator: Emulator, d: JsonObj) -> None:
        meta, spec = d["metadata"], d.get("spec") or {}
        if meta.get("deletionTimestamp"):
            return
        template_hash = short_hash(spec.get("template") or {})
        rss = self._owned(emulator, "apps", "replicasets", d)
        new = next((rs for rs in rss if (rs["metadata"].get("labels") or {}).get(HASH_LABEL) == template_hash), None)
        replicas = int(spec.get("replicas", 1))

        def total(field: str, sets: list[JsonObj]) -> int:
            return sum(int((rs.get("status") or {}).get(field, 0)) for rs in sets)

        rolling = (spec.get("strategy") or {}).get("rollingUpdate") or {}
        max_unavailable = (
            0
            if (spec.get("strategy") or {}).get("type") == "Recreate"
            else resolve_int_or_percent(rolling.get("maxUnavailable", "25%"), replicas, round_up=False)
        )
        available = total("availableReplicas", rss)
        updated = total("replicas", [new]) if new else 0
        status = _nonzero(
            {
                "observedGeneration": meta.get("generation", 1),
                "replicas": total("replicas", rss),
                "updatedReplicas": updated,
                "readyReplicas": total("readyReplicas", rss),
                "availableReplicas": available,
                "unavailableReplicas": max(replicas - available, 0),
            }
        )
        old = (d.get("status") or {}).get("conditions") or []
        complete = (
            new is not None and updated == replicas and total("replicas", rss) == replicas and available >= replicas
        )
        ok = available >= replicas - max_unavailable
        progressing = next((c for c in old if c.get("type") == "Progressing"), {})
        if complete:
            prog = _condition(
                old,
                "Progressing",
                True,
                "NewReplicaSetAvailable",
                f'ReplicaSet "{new["metadata"]["name"] if new else ""}" has successfully progressed.',
            )
        elif progressing.get("reason") == "ProgressDeadlineExceeded" or (
            progressing and _age_s(progressing.get("lastUpdateTime")) > float(spec.get("progressDeadlineSeconds", 600))
        ):
            prog = _condition(
                old,
                "Progressing",
                False,
                "ProgressDeadlineExceeded",
                f'ReplicaSet "{new["metadata"]["name"] if new else ""}" has timed out progressing.',
            )
        else:
            prog = _condition(
                old,
                "Progressing",
                True,
                "ReplicaSetUpdated",
                f'ReplicaSet "{new["metadata"]["name"] if new else ""}" is progressing.',
            )
            if progressing.get("reason") == "ReplicaSetUpdated" and progressing.get("status") == "True":
                prog["lastUpdateTime"] = progressing.get("lastUpdateTime", prog["lastUpdateTime"])
        conditions = [
            _condition(
                old,
                "Available",
                ok,
                "MinimumReplicasAvailable" if ok else "MinimumReplicasUnavailable",
                "Deployment has minimum availability." if ok else "Deployment does not have minimum availability.",
            ),
            prog,
        ]
        failure = next(
            (
                c
                for rs in rss
                if rs is new
                for c in (rs.get("status") or {}).get("conditions") or []
                if c.get("type") == "ReplicaFailure" and c.get("status") == "True"
            ),
            None,
        )
        if failure:
            conditions.append(
                _condition(
                    old, "ReplicaFailure", True, failure.get("reason", "FailedCreate"), failure.get("message", "")
                )
            )
        status["conditions"] = conditions
        self._write_status(emulator, "apps", "deployments", d, status)

    # --- ReplicaSet

    def replicaset(self, emulator: Emulator, rs: JsonObj, pods: list[JsonObj]) -> None:
        meta, spec = rs["metadata"], rs.get("spec") or {}
        if meta.get("deletionTimestamp"):
            return
        uid = meta["uid"]
        mine = [p for p in pods if controller_uid(p) == uid and pod_active(p)]
        want = int(spec.get("replicas", 1))
        if len(mine) < want and self._may_create(uid):
            for _ in range(want - len(mine)):
                suffix = "".join(random.choice(_ALPHABET) for _ in range(5))
                if self._create_pod(emulator, rs, spec.get("template") or {}, f"{meta['name']}-{suffix}", {}):
                    break
        elif len(mine) > want:
            # Unscheduled < pending < not ready < ready go first; among equals the newest.
            victims = sorted(mine, key=lambda p: p["metadata"].get("creationTimestamp", ""), reverse=True)
            victims.sort(
                key=lambda p: (
                    bool((p.get("spec") or {}).get("nodeName")),
                    (p.get("status") or {}).get("phase") == "Running",
                    pod_ready(p),
                )
            )
            for pod in victims[: len(mine) - want]:
                self._delete_pod(emulator, rs, pod)

    def replicaset_status(self, emulator: Emulator, rs: JsonObj, pods: list[JsonObj]) -> None:
        meta, spec = rs["metadata"], rs.get("spec") or {}
        if meta.get("deletionTimestamp"):
            return
        mine = [p for p in pods if controller_uid(p) == meta["uid"] and pod_active(p)]
        min_ready = float(spec.get("minReadySeconds", 0))
        template_labels = (spec.get("template") or {}).get("metadata", {}).get("labels") or {}
        status: JsonObj = {
            "replicas": len(mine),
            **_nonzero(
                {
                    "fullyLabeledReplicas": sum(
                        1
                        for p in mine
                        if all((p["metadata"].get("labels") or {}).get(k) == v for k, v in template_labels.items())
                    ),
                    "readyReplicas": sum(1 for p in mine if pod_ready(p)),
                    "availableReplicas": sum(1 for p in mine if pod_available(p, min_ready)),
                }
            ),
            "observedGeneration": meta.get("generation", 1),
        }
        failed = self._failed_create.get(meta["uid"])
        if failed is not None:
            old = (rs.get("status") or {}).get("conditions") or []
            status["conditions"] = [
                _condition(
                    old,
                    "ReplicaFailure",
                    True,
                    "FailedCreate",
                    # The refusal itself, as pkg/controller/replicaset/replica_set.go (calculateStatus) writes
                    # manageReplicasErr.Error(); the Deployment controller copies it (deployment/sync.go).
                    self._failed_why.get(meta["uid"]) or "pods could not be created; see the ReplicaSet's events",
                )
            ]
            for c in status["conditions"]:
                c.pop("lastUpdateTime", None)
        self._write_status(emulator, "apps", "replicasets", rs, status)

    # --- DaemonSet

    def daemonset(self, emulator: Emulator, ds: JsonObj, nodes: list[JsonObj], pods: list[JsonObj]) -> None:
        meta, spec = ds["metadata"], ds.get("spec") or {}
        if meta.get("deletionTimestamp"):
            return
        template = spec.get("template") or {}
        pod_spec = template.get("spec") or {}
        h = short_hash(template)
        uid = meta["uid"]
        mine = [p for p in pods if controller_uid(p) == uid]
        active = [p for p in mine if pod_active(p)]
        fitting = {n["metadata"]["name"] for n in nodes if why_not(n, pod_spec, daemon=True) is None}
        by_node: dict[str, list[JsonObj]] = {}
        for p in active:
            by_node.setdefault((p.get("spec") or {}).get("nodeName") or "", []).append(p)
        for node, there in by_node.items():
            if node not in fitting:
                for p in there:
                    self._delete_pod(emulator, ds, p)
            for p in sorted(there, key=lambda p: p["metadata"].get("creationTimestamp", ""))[1:]:
                self._delete_pod(emulator, ds, p)
        terminating_on = {(p.get("spec") or {}).get("nodeName") for p in mine if not pod_active(p)}
        for node in sorted(fitting):
            # A node whose old pod is still terminating gets its new one afterwards (maxSurge 0).
            if node not in by_node and node not in terminating_on and self._may_create(uid):
                suffix = "".join(random.choice(_ALPHABET) for _ in range(5))
                self._create_pod(emulator, ds, template, f"{meta['name']}-{suffix}", {DS_HASH_LABEL: h}, node=node)
        strategy = spec.get("updateStrategy") or {}
        if strategy.get("type", "RollingUpdate") == "RollingUpdate":
            allowed = (
                resolve_int_or_percent(
                    (strategy.get("rollingUpdate") or {}).get("maxUnavailable", 1), len(fitting), round_up=True
                )
                or 1
            )
            current = {(p.get("spec") or {}).get("nodeName"): p for p in active}
            unavailable = sum(1 for n in fitting if not (n in current and pod_ready(current[n])))
            outdated = [
                p
                for n, p in current.items()
                if n in fitting and (p["metadata"].get("labels") or {}).get(DS_HASH_LABEL) != h
            ]
            outdated.sort(key=lambda p: pod_ready(p))  # not-ready old pods first: they cost no availability
            for p in outdated:
                if not pod_ready(p):
                    self._delete_pod(emulator, ds, p)
                elif unavailable < allowed:
                    self._delete_pod(emulator, ds, p)
                    unavailable += 1
        mine = [p for p in emulator.list_objects("", "pods", meta["namespace"]) if controller_uid(p) == uid]
        scheduled = [p for p in mine if pod_active(p) and (p.get("spec") or {}).get("nodeName") in fitting]
        ready = sum(1 for p in scheduled if pod_ready(p))
        status = {
            "currentNumberScheduled": len(scheduled),
            "desiredNumberScheduled": len(fitting),
            "numberMisscheduled": sum(
                1 for p in mine if pod_active(p) and (p.get("spec") or {}).get("nodeName") not in fitting
            ),
            "numberReady": ready,
            **_nonzero(
                {
                    "observedGeneration": meta.get("generation", 1),
                    "updatedNumberScheduled": sum(
                        1 for p in scheduled if (p["metadata"].get("labels") or {}).get(DS_HASH_LABEL) == h
                    ),
                    "numberAvailable": ready,
                    "numberUnavailable": len(fitting) - ready,
                }
            ),
        }
        self._write_status(emulator, "apps", "daemonsets", ds, status)

    # --- scheduler and pod GC

    def schedule(self, emulator: Emulator, nodes: list[JsonObj], pods: list[JsonObj]) -> None:
        for pod in pods:
            spec, meta = pod.get("spec") or {}, pod["metadata"]
            if (
                spec.get("nodeName")
                or meta.get("deletionTimestamp")
                or spec.get("schedulerName", "default-scheduler") != "default-scheduler"
            ):
                continue
            node, message = choose_node(pod, nodes, pods)
            old = (pod.get("status") or {}).get("conditions") or []
            if node is None:
                cond = {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": message,
                    "lastProbeTime": None,
                }
                prev = next((c for c in old if c.get("type") == "PodScheduled"), {})
                if (prev.get("status"), prev.get("message")) != ("False", message):
                    cond["lastTransitionTime"] = prev.get("lastTransitionTime") or _now()
                    self._write_status(
                        emulator,
                        "",
                        "pods",
                        pod,
                        {**(pod.get("status") or {}), "phase": "Pending", "conditions": [cond]},
                    )
                    self._record(emulator, pod, "FailedScheduling", message, "Warning", component="default-scheduler")
                continue
            try:
                bound = emulator.replace_object(
                    "", "pods", meta["namespace"], meta["name"], {**pod, "spec": {**spec, "nodeName": node}}
                )
            except ApiError:
                continue
            pod["spec"]["nodeName"] = node  # later pods of this pass see it placed
            cond = {"type": "PodScheduled", "status": "True", "lastProbeTime": None, "lastTransitionTime": _now()}
            self._write_status(
                emulator, "", "pods", bound, {**(bound.get("status") or {}), "phase": "Pending", "conditions": [cond]}
            )
            self._record(
                emulator,
                pod,
                "Scheduled",
                f"Successfully assigned {meta['namespace']}/{meta['name']} to {node}",
                component="default-scheduler",
            )

    def pod_gc(self, emulator: Emulator, nodes: list[JsonObj], pods: list[JsonObj]) -> None:
        names = {n["metadata"]["name"] for n in nodes}
        for pod in pods:
            node = (pod.get("spec") or {}).get("nodeName")
            if node and node not in names:
                with contextlib.suppress(ApiError):
                    emulator.delete_object(
                        "", "pods", pod["metadata"]["namespace"], pod["metadata"]["name"], grace_period=0
                    )

    # --- EndpointSlices

    def endpoint_slices(self, emulator: Emulator, pods: list[JsonObj]) -> None:
        slices = emulator.list_objects("discovery.k8s.io", "endpointslices")
        for svc in emulator.list_objects("", "services"):
            meta, spec = svc["metadata"], svc.get("spec") or {}
            selector = spec.get("selector")
            if not selector or meta.get("deletionTimestamp"):
                continue
            ns = meta["namespace"]
            members = [
                p
                for p in pods
                if p["metadata"]["namespace"] == ns
                and (p.get("status") or {}).get("podIP")
                and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
                and selector_matches({"matchLabels": selector}, p["metadata"].get("labels") or {})
            ]
            groups: dict[str, tuple[list[JsonObj], list[JsonObj]]] = {}
            for pod in members:
                ports = _slice_ports(spec.get("ports") or [], pod)
                key = short_hash(ports, 5)
                groups.setdefault(key, (ports, []))[1].append(_endpoint(pod))
            # As kube-controller-manager does: the Service's own labels, then the two that tie the slice to it.
            slice_labels = {
                **(meta.get("labels") or {}),
                "kubernetes.io/service-name": meta["name"],
                "endpointslice.kubernetes.io/managed-by": SLICE_MANAGER,
            }
            wanted = {}
            for key, (ports, endpoints) in groups.items():
                name = f"{meta['name']}-{key}"
                wanted[name] = {
                    "apiVersion": "discovery.k8s.io/v1",
                    "kind": "EndpointSlice",
                    "metadata": {
                        "name": name,
                        "namespace": ns,
                        "ownerReferences": [owner_ref(svc)],
                        "labels": slice_labels,
                    },
                    "addressType": "IPv4",
                    "ports": ports,
                    "endpoints": sorted(endpoints, key=lambda e: e["addresses"][0]),
                }
            if not wanted:  # a Service without endpoints still has an (empty) slice
                name = f"{meta['name']}-empty"
                wanted[name] = {
                    "apiVersion": "discovery.k8s.io/v1",
                    "kind": "EndpointSlice",
                    "metadata": {
                        "name": name,
                        "namespace": ns,
                        "ownerReferences": [owner_ref(svc)],
                        "labels": slice_labels,
                    },
                    "addressType": "IPv4",
                    "ports": [],
                    "endpoints": [],
                }
            existing = {
                s["metadata"]["name"]: s
                for s in slices
                if s["metadata"]["namespace"] == ns
                and (s["metadata"].get("labels") or {}).get("kubernetes.io/service-name") == meta["name"]
                and (s["metadata"].get("labels") or {}).get("endpointslice.kubernetes.io/managed-by") == SLICE_MANAGER
            }
            for name, body in wanted.items():
                have = existing.get(name)
                with contextlib.suppress(ApiError):
                    if have is None:
                        emulator.create_object("discovery.k8s.io", "endpointslices", ns, body)
                    elif (have.get("endpoints"), have.get("ports"), have["metadata"].get("labels")) != (
                        body["endpoints"],
                        body["ports"],
                        slice_labels,
                    ):
                        emulator.replace_object(
                            "discovery.k8s.io",
                            "endpointslices",
                            ns,
                            name,
                            {
                                **have,
                                "metadata": {**have["metadata"], "labels": slice_labels},
                                "endpoints": body["endpoints"],
                                "ports": body["ports"],
                            },
                        )
            for name in existing.keys() - wanted.keys():
                with contextlib.suppress(ApiError):
                    emulator.delete_object("discovery.k8s.io", "endpointslices", ns, name)


def _slice_ports(service_ports: list[JsonObj], pod: JsonObj) -> list[JsonObj]:
    out = []
    for port in service_ports:
        target = port.get("targetPort", port.get("port"))
        if isinstance(target, str) and not target.isdigit():
            number = next(
                (
                    int(p["containerPort"])
                    for c in (pod.get("spec") or {}).get("containers") or []
                    for p in c.get("ports") or []
                    if p.get("name") == target
                ),
                None,
            )
            if number is None:
                continue
        else:
            number = int(target)
        entry = {"port": number, "protocol": port.get("protocol", "TCP")}
        if port.get("name"):
            entry["name"] = port["name"]
        out.append(entry)
    return out


def _endpoint(pod: JsonObj) -> JsonObj:
    terminating = bool(pod["metadata"].get("deletionTimestamp"))
    ready = pod_ready(pod)
    return {
        "addresses": [pod["status"]["podIP"]],
        "conditions": {"ready": ready and not terminating, "serving": ready, "terminating": terminating},
        "targetRef": {
            "kind": "Pod",
            "namespace": pod["metadata"]["namespace"],
            "name": pod["metadata"]["name"],
            "uid": pod["metadata"]["uid"],
        },
        **({"nodeName": pod["spec"]["nodeName"]} if (pod.get("spec") or {}).get("nodeName") else {}),
    }
