"""Why a role has no ready pod, in one line: from its Deployment's conditions and, where the operator may read
them, its pods' states.

Pure: the caller passes the Deployment as observed and its pods (None when the operator does not read pods,
its default: ``--read-pods`` turns it on). The line says what is wrong, on which object, and what to do, and
:attr:`NotReady.stuck` says whether it needs a human (a Warning Event) or is a start still under way.

The sources, in the order a human would look (``kubectl describe``):

* the Deployment's ``ReplicaFailure`` condition (the ReplicaSet controller could not create pods: a quota,
  an admission webhook, a missing ServiceAccount), copied there by the Deployment controller;
* each pod's state: unschedulable (``PodScheduled=False``: GPUs, memory, a node selector, an unbound claim),
  an image the node cannot pull, a container that keeps exiting, a container the kubelet cannot configure;
* the Deployment's ``Progressing=False`` with reason ``ProgressDeadlineExceeded``: no progress within
  ``progressDeadlineSeconds`` (derived from the role's ``startupTimeoutSeconds``).
"""

from __future__ import annotations

from dataclasses import dataclass

from maru_operator.objects import Object

READ_PODS_HINT = (
    "the operator reads no pods: run it with --read-pods (chart value readPods=true) for their reason here, or "
    "kubectl describe the role's pods"
)
# A container waiting for these is stuck until a human changes something (the image, a Secret, the spec).
IMAGE_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"})
CONFIG_REASONS = frozenset({"CreateContainerConfigError", "CreateContainerError", "RunContainerError"})


@dataclass(frozen=True)
class NotReady:
    """Why a role's pods are not ready: ``message`` names the object and what to do; ``stuck``: it needs a human
    (a start under way is not)."""

    message: str
    stuck: bool


def _condition(obj: Object, type_: str) -> Object:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == type_), {})


def _ready(pod: Object) -> bool:
    return _condition(pod, "Ready").get("status") == "True"


def _container_problem(pod: Object) -> NotReady | None:
    name = pod.get("metadata", {}).get("name", "?")
    images = {c.get("name"): c.get("image", "?") for c in (pod.get("spec") or {}).get("containers") or []}
    status = pod.get("status") or {}
    for c in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        waiting = (c.get("state") or {}).get("waiting") or {}
        reason, detail = waiting.get("reason", ""), waiting.get("message", "")
        container, image = c.get("name", "?"), c.get("image") or images.get(c.get("name"), "?")
        if reason in IMAGE_REASONS:
            return NotReady(
                f"{reason} on image {image} (pod {name}): check the image name and tag, images.registry and "
                "imagePullSecrets" + (f"; {detail}" if detail else ""),
                True,
            )
        if reason == "CrashLoopBackOff":
            code = ((c.get("lastState") or {}).get("terminated") or {}).get("exitCode")
            last = f", last exit code {code}" if code is not None else ""
            return NotReady(
                f"container {container} of pod {name} keeps exiting (CrashLoopBackOff, {c.get('restartCount', 0)} "
                f"restarts{last}): see kubectl logs {name} -c {container} --previous",
                True,
            )
        if reason in CONFIG_REASONS:
            return NotReady(f"{reason} in pod {name}, container {container}: {detail or 'see its events'}", True)
    return None


def _pod_problem(pod: Object) -> NotReady:
    name = pod.get("metadata", {}).get("name", "?")
    scheduled = _condition(pod, "PodScheduled")
    if scheduled.get("status") == "False":
        detail = scheduled.get("message") or "no node fits it"
        todo = (
            "check the claim (kubectl describe pvc) and its StorageClass"
            if "PersistentVolumeClaim" in detail
            else "free or add nodes with what the role requests, or lower its resources"
        )
        return NotReady(f"pod {name} pending: {detail} ({scheduled.get('reason') or 'FailedScheduling'}): {todo}", True)
    problem = _container_problem(pod)
    if problem is not None:
        return problem
    waiting = [
        ((c.get("state") or {}).get("waiting") or {}).get("reason")
        for c in (pod.get("status") or {}).get("containerStatuses") or []
    ]
    state = next((w for w in waiting if w), "") or "running, not ready yet (loading the model?)"
    return NotReady(f"pod {name} starting: {state}", False)


def _deadline(dep: Object) -> NotReady | None:
    progressing = _condition(dep, "Progressing")
    if progressing.get("status") != "False" or progressing.get("reason") != "ProgressDeadlineExceeded":
        return None
    name = dep.get("metadata", {}).get("name", "?")
    seconds = (dep.get("spec") or {}).get("progressDeadlineSeconds")
    within = f" within {seconds} s" if seconds is not None else ""
    return NotReady(
        f"Deployment {name} made no progress{within} (ProgressDeadlineExceeded): its pods neither became ready nor "
        "failed in a way Kubernetes reports on the Deployment",
        True,
    )


def why_not_ready(dep: Object, pods: list[Object] | None) -> NotReady:
    """Why the Deployment ``dep`` has fewer ready pods than it wants; ``pods``: those its selector matches
    (None: the operator does not read pods)."""
    name = dep.get("metadata", {}).get("name", "?")
    failure = _condition(dep, "ReplicaFailure")
    if failure.get("status") == "True":
        reason = failure.get("reason") or "FailedCreate"
        return NotReady(
            f"Deployment {name} cannot create pods ({reason}): {failure.get('message') or 'see its events'}", True
        )
    deadline = _deadline(dep)
    if pods is None:
        if deadline is not None:
            return NotReady(f"{deadline.message}; {READ_PODS_HINT}", True)
        return NotReady(f"pods starting; {READ_PODS_HINT}", False)
    waiting = [p for p in pods if not _ready(p) and not p.get("metadata", {}).get("deletionTimestamp")]
    problems = sorted((_pod_problem(p) for p in waiting), key=lambda p: not p.stuck)
    if problems and (problems[0].stuck or deadline is None):
        return problems[0]
    if deadline is not None:
        return deadline
    return NotReady("no pod created yet", False)


def selector(dep: Object) -> dict[str, str]:
    """The labels the Deployment selects its pods by (its own matchLabels: exactly its pods)."""
    return dict(((dep.get("spec") or {}).get("selector") or {}).get("matchLabels") or {})
