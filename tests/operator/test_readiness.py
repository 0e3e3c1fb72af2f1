"""Why a role has no ready pod: one line from its Deployment's conditions and (where read) its pods' states."""

from __future__ import annotations

from typing import Any

from maru_operator import conditions as cond
from maru_operator.api.inferencegroup import InferenceGroupStatus
from maru_operator.readiness import READ_PODS_HINT, why_not_ready
from maru_operator.status import bind, group_status
from tests.support.specs import NOW, deployment, group_spec, pool_body

IMAGE = "registry.example/vllm:v9"


def dep(*conditions: dict[str, Any]) -> dict[str, Any]:
    d = deployment(1, 0)
    d["metadata"]["name"] = "qwen-decode"
    d["spec"]["progressDeadlineSeconds"] = 2400
    d["status"]["conditions"] = list(conditions)
    return d


def pod(name: str = "qwen-decode-abc", *, scheduled: tuple[str, str] | None = None, **container: Any) -> Any:
    conditions = [{"type": "Ready", "status": "False", "reason": "ContainersNotReady"}]
    if scheduled is not None:
        conditions.append({"type": "PodScheduled", "status": "False", "reason": scheduled[0], "message": scheduled[1]})
    statuses = [{"name": "vllm", "image": IMAGE, "ready": False, **container}] if container else []
    return {
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "vllm", "image": IMAGE}]},
        "status": {"phase": "Pending", "conditions": conditions, "containerStatuses": statuses},
    }


DEADLINE = {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded", "message": "timed out"}
STARTING = {"type": "Progressing", "status": "True", "reason": "ReplicaSetUpdated"}
GPUS = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."


def test_unschedulable_names_the_scheduler_message() -> None:
    why = why_not_ready(dep(STARTING), [pod(scheduled=("Unschedulable", GPUS))])
    assert why.stuck
    assert "pod qwen-decode-abc pending: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu." in why.message
    assert "(Unschedulable)" in why.message and "lower its resources" in why.message


def test_an_unbound_claim_points_at_the_claim() -> None:
    message = "0/1 nodes are available: pod has unbound immediate PersistentVolumeClaims."
    why = why_not_ready(dep(STARTING), [pod(scheduled=("Unschedulable", message))])
    assert why.stuck and "unbound immediate PersistentVolumeClaims" in why.message and "describe pvc" in why.message


def test_image_pull_backoff_names_the_image_and_the_registry_setting() -> None:
    why = why_not_ready(
        dep(STARTING),
        [pod(state={"waiting": {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "x"'}})],
    )
    assert why.stuck
    assert why.message.startswith(f"ImagePullBackOff on image {IMAGE} (pod qwen-decode-abc)")
    assert "images.registry" in why.message


def test_crash_loop_says_where_the_logs_are() -> None:
    why = why_not_ready(
        dep(STARTING),
        [
            pod(
                state={"waiting": {"reason": "CrashLoopBackOff"}},
                restartCount=4,
                lastState={"terminated": {"exitCode": 1}},
            )
        ],
    )
    assert why.stuck
    assert "container vllm of pod qwen-decode-abc keeps exiting (CrashLoopBackOff, 4 restarts, last exit code 1)" in (
        why.message
    )
    assert "kubectl logs qwen-decode-abc -c vllm --previous" in why.message


def test_a_starting_pod_is_not_stuck() -> None:
    why = why_not_ready(dep(STARTING), [pod(state={"waiting": {"reason": "ContainerCreating"}})])
    assert not why.stuck and why.message == "pod qwen-decode-abc starting: ContainerCreating"
    loading = why_not_ready(dep(STARTING), [pod(state={"running": {}})])
    assert not loading.stuck and "not ready yet" in loading.message


def test_the_stuck_pod_is_named_before_a_starting_one() -> None:
    pods = [pod("a", state={"running": {}}), pod("b", scheduled=("Unschedulable", GPUS))]
    assert why_not_ready(dep(STARTING), pods).message.startswith("pod b pending")


def test_replica_failure_comes_first() -> None:
    failure = {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate", "message": "exceeded quota"}
    why = why_not_ready(dep(failure, STARTING), [])
    assert why.stuck and why.message == "Deployment qwen-decode cannot create pods (FailedCreate): exceeded quota"


def test_progress_deadline_without_pod_reads_says_how_to_turn_them_on() -> None:
    why = why_not_ready(dep(DEADLINE), None)
    assert why.stuck
    assert "Deployment qwen-decode made no progress within 2400 s (ProgressDeadlineExceeded)" in why.message
    assert READ_PODS_HINT in why.message and "--read-pods" in why.message
    starting = why_not_ready(dep(STARTING), None)
    assert not starting.stuck and "--read-pods" in starting.message


def test_progress_deadline_with_pods_prefers_what_the_pods_say() -> None:
    stuck = pod(state={"waiting": {"reason": "ErrImagePull"}})
    assert why_not_ready(dep(DEADLINE), [stuck]).message.startswith("ErrImagePull on image")
    # Pods that look as if they start, past the deadline: the deadline is the news.
    assert "ProgressDeadlineExceeded" in why_not_ready(dep(DEADLINE), [pod(state={"running": {}})]).message


def test_group_status_tells_why_and_warns_only_when_stuck() -> None:
    b = bind("llm", group_spec(), pool_body())
    children = {"prefill": deployment(1, 1), "decode": dep(STARTING), "router": deployment(1, 1)}
    starting = group_status(
        group_spec(), 1, b, children, InferenceGroupStatus(), endpoint="", now=NOW, pods={"decode": [pod()]}
    )
    ready = cond.get(starting.conditions, "Ready")
    assert ready is not None and (ready.status, ready.reason) == ("False", "ReplicasNotReady")
    assert "decode has no ready pod (0/1): pod qwen-decode-abc starting" in ready.message
    stuck = {"decode": [pod(state={"waiting": {"reason": "ImagePullBackOff"}})]}
    failing = group_status(group_spec(), 1, b, children, InferenceGroupStatus(), endpoint="", now=NOW, pods=stuck)
    ready = cond.get(failing.conditions, "Ready")
    assert ready is not None and (ready.status, ready.reason) == ("False", "ReplicasFailing")
    assert f"decode has no ready pod (0/1): ImagePullBackOff on image {IMAGE}" in ready.message


def test_a_short_role_is_failing_only_when_stuck() -> None:
    b = bind("llm", group_spec(), pool_body())
    decode = deployment(2, 1)
    children = {"prefill": deployment(1, 1), "decode": decode, "router": deployment(1, 1)}

    def degraded(pods: list[Any]) -> tuple[str, str, str]:
        st = group_status(
            group_spec(), 1, b, children, InferenceGroupStatus(), endpoint="", now=NOW, pods={"decode": pods}
        )
        c = cond.get(st.conditions, "Degraded")
        assert c is not None
        return c.status, c.reason, c.message

    assert degraded([pod(state={"running": {}})]) == ("True", "ReplicasUnavailable", "decode 1/2 ready")
    status, reason, message = degraded([pod(scheduled=("Unschedulable", GPUS))])
    assert (status, reason) == ("True", "ReplicasFailing") and message.startswith("decode 1/2 ready: pod ")


def test_the_operator_names_an_unschedulable_pod(pod_controllers: Any, stats: Any) -> None:
    """A real operator with --read-pods, pods kept by the emulator's controllers: decode's pods fit no node."""
    from tests.support.operator import GROUP_NS, RunningOperator, condition_of, group, has_condition, wait_event
    from tests.support.operator import pool as pool_object

    cluster = pod_controllers.kube
    running = RunningOperator(cluster, stats, resync_seconds=3600, workers=2, read_pods=True).start()
    try:
        cluster.create(pool_object())
        cluster.create(group(decode={"replicas": 1, "nodeSelector": {"gpu": "none"}}))
        ig = cluster.wait_for(
            "inferencegroups.maru.io", "qwen", GROUP_NS, lambda o: has_condition(o, "Ready", "False", "ReplicasFailing")
        )
        message = condition_of(ig, "Ready")["message"]
        assert "decode has no ready pod (0/1): pod qwen-decode-" in message and "(Unschedulable)" in message, message
        assert wait_event(cluster, GROUP_NS, "qwen", "ReplicasFailing")["type"] == "Warning"
    finally:
        running.stop()
