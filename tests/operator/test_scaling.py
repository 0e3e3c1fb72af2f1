"""Autoscalers and the operator side by side: who owns a role's replicas, and rollouts that keep serving.

The operator runs as a real kopf process against the API emulator; ``kubectl scale`` writes the role
Deployment's scale subresource, as an HPA or KEDA does.
"""

from __future__ import annotations

from typing import Any

import pytest

from maru_localcluster.server import KubeEmulator
from tests.support.operator import GROUP_NS, RunningOperator, group, has_condition, pool, settle

pytestmark = pytest.mark.emulator

IG = "inferencegroups.maru.io"
MP = "marupools.maru.io"
DEPLOY = "deployments.apps"
PDB = "poddisruptionbudgets.policy"
PVC = "persistentvolumeclaims"


def replicas(cluster: KubeEmulator, role: str) -> int:
    dep = cluster.get(DEPLOY, f"qwen-{role}", GROUP_NS)
    assert dep is not None
    return int(dep["spec"]["replicas"])


def scale(cluster: KubeEmulator, role: str, count: int) -> None:
    cluster.kubectl("scale", f"deployment/qwen-{role}", f"--replicas={count}", "-n", GROUP_NS)


def touch(cluster: KubeEmulator, operator: RunningOperator, value: str) -> None:
    """A spec change the operator applies to both roles: it writes their Deployments again."""
    cluster.patch(
        IG,
        "qwen",
        {"spec": {"prefill": {"podAnnotations": {"touched": value}}, "decode": {"podAnnotations": {"touched": value}}}},
        GROUP_NS,
    )
    settle(operator)


def test_an_external_scalers_replicas_stick(
    cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]
) -> None:
    cluster.create(group(decode={"replicas": 2, "scaler": "External"}))
    dep = cluster.wait_for(DEPLOY, "qwen-decode", GROUP_NS)
    # Created at its initial count, and marked as someone else's to scale.
    assert dep["spec"]["replicas"] == 2 and dep["metadata"]["annotations"]["maru.io/replicas"] == "external"
    settle(operator)
    scale(cluster, "decode", 5)
    scale(cluster, "prefill", 4)
    touch(cluster, operator, "1")
    assert replicas(cluster, "decode") == 5
    # The role the operator scales is put back: that one is the spec's.
    assert replicas(cluster, "prefill") == 1
    dep = cluster.get(DEPLOY, "qwen-decode", GROUP_NS)
    assert dep is not None
    managers = {
        (e["manager"], e["operation"])
        for e in dep["metadata"]["managedFields"]
        if "f:replicas" in e.get("fieldsV1", {}).get("f:spec", {})
    }
    assert not any(m == "maru-operator" for m, _ in managers), managers
    assert dep["spec"]["template"]["metadata"]["annotations"] == {"touched": "1"}


def test_handing_a_running_role_to_an_autoscaler_keeps_its_pods(
    cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]
) -> None:
    cluster.create(group(decode={"replicas": 3}))
    cluster.wait_for(DEPLOY, "qwen-decode", GROUP_NS, lambda d: d["spec"]["replicas"] == 3)
    settle(operator)
    # Dropping the field from the operator's apply would remove it, and the Deployment would fall back to 1.
    cluster.patch(IG, "qwen", {"spec": {"decode": {"scaler": "External"}}}, GROUP_NS)
    settle(operator)
    assert replicas(cluster, "decode") == 3
    scale(cluster, "decode", 4)
    touch(cluster, operator, "2")
    assert replicas(cluster, "decode") == 4
    # Back to the operator: the spec's count again.
    cluster.patch(IG, "qwen", {"spec": {"decode": {"scaler": "Operator"}}}, GROUP_NS)
    settle(operator)
    assert replicas(cluster, "decode") == 3


def test_the_other_role_follows_at_the_ratio(
    cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]
) -> None:
    cluster.create(group(replicaRatio={"prefill": 1, "decode": 2}, decode={"replicas": 2, "scaler": "External"}))
    cluster.wait_for(DEPLOY, "qwen-prefill", GROUP_NS)
    settle(operator)
    assert (replicas(cluster, "prefill"), replicas(cluster, "decode")) == (1, 2)
    scale(cluster, "decode", 5)
    cluster.wait_for(DEPLOY, "qwen-prefill", GROUP_NS, lambda d: d["spec"]["replicas"] == 3)
    settle(operator)
    assert (replicas(cluster, "prefill"), replicas(cluster, "decode")) == (3, 5)


def test_a_ratio_needs_exactly_one_scaled_role(cluster: KubeEmulator, operator: RunningOperator) -> None:
    out = cluster.kubectl(
        "apply",
        "-f",
        "-",
        check=False,
        input=__import__("yaml").safe_dump(group(replicaRatio={"prefill": 1, "decode": 2})),
    )
    # The CRD cannot see across roles; the operator refuses it, naming the field, and writes nothing.
    assert out.returncode == 0, out.stderr
    body = cluster.wait_for(IG, "qwen", GROUP_NS, lambda o: has_condition(o, "Ready", "False"))
    assert "replicaRatio" in str(body["status"]["conditions"])
    assert cluster.get(DEPLOY, "qwen-prefill", GROUP_NS) is None


def test_every_role_gets_a_disruption_budget_and_the_group_a_model_cache(
    cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]
) -> None:
    cluster.create(group())
    for role in ("prefill", "decode", "router"):
        budget = cluster.wait_for(PDB, f"qwen-{role}", GROUP_NS)
        dep = cluster.get(DEPLOY, f"qwen-{role}", GROUP_NS)
        assert dep is not None
        assert budget["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
        assert budget["spec"]["maxUnavailable"] == 1
        if role == "router":
            continue
        volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
        assert volumes["model-cache"]["persistentVolumeClaim"] == {"claimName": "qwen-model-cache"}
    claim = cluster.wait_for(PVC, "qwen-model-cache", GROUP_NS)
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["metadata"]["ownerReferences"][0]["kind"] == "InferenceGroup"
    # A group that names its own claim gets none of the operator's, and a budget can be turned off.
    cluster.patch(
        IG,
        "qwen",
        {
            "spec": {
                "modelCache": {"persistentVolumeClaim": {"claimName": "shared-models"}},
                "decode": {"disruptionBudget": {"enabled": False}},
            }
        },
        GROUP_NS,
    )
    cluster.wait_gone(PVC, "qwen-model-cache", GROUP_NS)
    cluster.wait_gone(PDB, "qwen-decode", GROUP_NS)
    settle(operator)
    dep = cluster.get(DEPLOY, "qwen-decode", GROUP_NS)
    assert dep is not None
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model-cache"]["persistentVolumeClaim"] == {"claimName": "shared-models"}


@pytest.fixture
def paced_operator(cluster: KubeEmulator, stats: Any) -> Any:
    from tests.support.operator import RunningOperator

    running = RunningOperator(cluster, stats, resync_seconds=3600, workers=4, max_rolling_groups=1).start()
    try:
        yield running
    finally:
        running.stop()


def test_pod_template_changes_roll_one_group_at_a_time(
    cluster: KubeEmulator, kube_controllers: Any, paced_operator: RunningOperator
) -> None:
    """An operator upgrade changes every group's template at once; at most --max-rolling-groups roll together,
    and a rollout that does not finish (pods never ready) keeps the others waiting, as a canary."""
    cluster.create(pool())
    cluster.wait_for(MP, "local-shm", None, lambda o: has_condition(o, "Ready", "True"))
    for name in ("a", "b"):
        cluster.create(group(name))
        cluster.wait_for(IG, name, GROUP_NS, lambda o: has_condition(o, "Ready", "True"))
    settle(paced_operator)
    # a's new pods will not become ready: its rollout stays in progress.
    kube_controllers.set_readiness(lambda obj: not obj["metadata"]["name"].startswith("a-"))

    def change(name: str) -> None:
        cluster.patch(IG, name, {"spec": {"decode": {"env": [{"name": "NEW", "value": "1"}]}}}, GROUP_NS)

    def new_template(dep: dict[str, Any] | None) -> bool:
        assert dep is not None
        return any(e["name"] == "NEW" for e in dep["spec"]["template"]["spec"]["containers"][0].get("env") or [])

    change("a")
    cluster.wait_for(DEPLOY, "a-decode", GROUP_NS, new_template)
    change("b")
    body = cluster.wait_for(IG, "b", GROUP_NS, lambda o: has_condition(o, "Progressing", "True"))
    progressing = next(c for c in body["status"]["conditions"] if c["type"] == "Progressing")
    assert progressing["reason"] == "RolloutQueued" and "b-decode" in progressing["message"]
    settle(paced_operator)
    assert not new_template(cluster.get(DEPLOY, "b-decode", GROUP_NS))
    # a's rollout finishes: b goes next.
    kube_controllers.set_readiness(lambda obj: True)
    cluster.wait_for(DEPLOY, "b-decode", GROUP_NS, new_template, timeout=60)
    cluster.wait_for(IG, "b", GROUP_NS, lambda o: has_condition(o, "Progressing", "False"), timeout=60)
