"""The command line: `run` as a real subprocess against the emulator, start-up errors, `render`."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import kubernetes_validate
import pytest
import yaml

from maru_localcluster import tools
from maru_localcluster.server import KubeEmulator
from tests.support.operator import GROUP_NS, ROOT, group, has_condition, http_get, install_crds, pool

pytestmark = pytest.mark.emulator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "maru_operator", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=ROOT,
    )


@pytest.fixture
def operator_process(cluster: KubeEmulator, tmp_path: pathlib.Path) -> Iterator[dict[str, Any]]:
    liveness, metrics = free_port(), free_port()
    log_path = tmp_path / "operator.log"
    log = open(log_path, "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "maru_operator",
            "run",
            "--pool-namespace",
            "maru-system",
            "--liveness",
            f"http://127.0.0.1:{liveness}/healthz",
            "--metrics-port",
            str(metrics),
            "--log-format",
            "json",
        ],
        env=cluster.env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    info = {"proc": proc, "liveness": liveness, "metrics": metrics, "log": log_path}
    try:
        yield info
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
        log.close()


def test_run_as_a_process(cluster: KubeEmulator, operator_process: dict[str, Any]) -> None:
    try:
        cluster.create(pool())
        cluster.create(group())
        ig = cluster.wait_for(
            "inferencegroups.maru.io", "qwen", GROUP_NS, lambda o: has_condition(o, "Ready", "True"), timeout=60
        )
        assert ig["status"]["decode"]["summary"] == "2/2"
        status, _ = http_get(f"http://127.0.0.1:{operator_process['liveness']}/healthz")
        assert status == 200
        _, text = http_get(f"http://127.0.0.1:{operator_process['metrics']}/metrics")
        assert 'maru_operator_reconciles_total{kind="InferenceGroup",result="ok"}' in text
        assert "maru_operator_child_writes_total" in text
    except AssertionError:
        raise AssertionError(operator_process["log"].read_text()[-5000:]) from None
    proc = operator_process["proc"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, operator_process["log"].read_text()[-3000:]
    import json

    entries = [json.loads(line) for line in operator_process["log"].read_text().splitlines() if line.startswith("{")]
    messages = [e["message"] for e in entries]
    assert "created Deployment llm/qwen-prefill" in messages
    assert any(m.startswith("InferenceGroup llm/qwen: Ready=True (Serving)") for m in messages)


def test_no_cluster_exits_with_the_server_named(tmp_path: pathlib.Path) -> None:
    port = free_port()
    kubeconfig = tools.write_kubeconfig(f"http://127.0.0.1:{port}", tmp_path / "kubeconfig")
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    result = run_cli("run", "--metrics-port", "0", "--liveness", "", env=env)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"cannot reach the Kubernetes API server at http://127.0.0.1:{port}" in lines[0]


def test_missing_crds_exit_with_the_fix(k8s_emulator: KubeEmulator) -> None:
    result = run_cli("run", "--metrics-port", "0", "--liveness", "", env=k8s_emulator.env())
    assert result.returncode == 1
    assert "CRD is not installed" in result.stderr
    assert "kubectl apply -f crds/" in result.stderr and "Helm chart" in result.stderr


def test_crds_present_passes_preflight(k8s_emulator: KubeEmulator) -> None:
    import asyncio

    from maru_operator.kube import Kube

    install_crds(k8s_emulator)

    async def check() -> None:
        async with Kube(k8s_emulator.kopf_connection()) as kube:
            await kube.preflight()

    asyncio.run(check())


def test_render_examples() -> None:
    result = run_cli("render", "-f", "examples/")
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {
        ("Deployment", "qwen-7b-prefill"),
        ("Deployment", "qwen-7b-decode"),
        ("Service", "qwen-7b"),
        ("DaemonSet", "cxl-pool-agent"),
        ("Deployment", "cxl-pool-metadata"),
        ("DaemonSet", "local-shm-agent"),
    } <= names
    for doc in docs:
        kubernetes_validate.validate(doc, "1.33", strict=True)
        assert "ownerReferences" not in doc["metadata"]


def test_render_uses_the_same_builders(tmp_path: pathlib.Path) -> None:
    from maru_operator.builders.children import build_group_children
    from maru_operator.builders.common import Owner
    from maru_operator.builders.group import PoolView
    from maru_operator.render import render

    pool_doc, group_doc = pool(), group()
    path = tmp_path / "in.yaml"
    path.write_text(yaml.safe_dump_all([pool_doc, group_doc]))
    rendered = [d for d in yaml.safe_load_all(render([path], "maru-system")) if d]
    from maru_operator.api.inferencegroup import InferenceGroupSpec
    from maru_operator.api.marupool import MaruPoolSpec
    from maru_operator.builders.netpol import NetworkPolicyConfig, build_group_policies

    owner = Owner(kind="InferenceGroup", name="qwen", namespace=GROUP_NS)
    spec = InferenceGroupSpec.model_validate(group_doc["spec"])
    view = PoolView("local-shm", MaruPoolSpec.model_validate(pool_doc["spec"]))
    expected = build_group_children(spec, owner, view)
    expected += build_group_policies(spec, owner, view, "maru-system", NetworkPolicyConfig())
    assert [o["kind"] for o in rendered[:3]] == ["Secret", "DaemonSet", "NetworkPolicy"]
    assert rendered[3:] == expected
    # Offline there is no pool key: the key is rendered without data; the group's credential is no Secret (the
    # CSI node plugin mints it).
    assert [o["metadata"]["name"] for o in rendered if o["kind"] == "Secret"] == ["local-shm-key"]
    assert all("data" not in o for o in rendered if o["kind"] == "Secret")


def test_render_warns_about_a_missing_pool(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "group.yaml"
    path.write_text(yaml.safe_dump(group()))
    result = run_cli("render", "-f", str(path))
    assert result.returncode == 0
    assert "MaruPool local-shm is not in the input" in result.stderr
    assert {d["metadata"]["name"] for d in yaml.safe_load_all(result.stdout) if d} >= {"qwen-prefill", "qwen"}


def test_render_reports_an_invalid_group(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(group(decode={"env": [{"name": "PYTHONHASHSEED", "value": "7"}]})))
    result = run_cli("render", "-f", str(path))
    assert result.returncode == 1
    assert "spec.decode.env" in result.stderr


def test_rbac_prints_a_cluster_role_the_pool_namespace_role_and_the_lease_role() -> None:
    result = run_cli("rbac", "--pool-namespace", "ops", "--service-account", "op")
    assert result.returncode == 0, result.stderr
    docs = list(yaml.safe_load_all(result.stdout))
    assert [(d["kind"], d["metadata"].get("namespace")) for d in docs] == [
        ("ClusterRole", None),
        ("Role", "ops"),
        ("Role", "default"),
        ("ClusterRoleBinding", None),
        ("RoleBinding", "ops"),
        ("RoleBinding", "default"),
        ("ClusterRole", None),
    ]
    assert docs[1]["rules"] == [
        {"apiGroups": ["apps"], "resources": ["daemonsets"], "verbs": ["create", "patch", "delete"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "list", "watch", "create", "patch"]},
    ]
    assert not [r for r in docs[0]["rules"] if "secrets" in r["resources"]], "no Secret right across the cluster"
    # The leader Lease is where every release of the cluster looks for it, not in the release namespace.
    # Read and renewed by name; create cannot be limited by name.
    assert docs[2]["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "verbs": ["get", "patch"],
            "resourceNames": ["maru-operator"],
        },
    ]
    team = list(yaml.safe_load_all(run_cli("rbac", "--instance", "team-a").stdout))
    assert team[2]["rules"][1]["resourceNames"] == ["maru-operator-team-a"]
    assert docs[5]["roleRef"]["name"] == docs[2]["metadata"]["name"]
    assert "# Role in ops:" in result.stdout and "# Role in default:" in result.stdout
    # Pods: listed in the pool namespace only; the routers read theirs through a ClusterRole the operator binds.
    assert "#   pods (core): list:" in result.stdout.split("# Role in ops:")[1]
    assert "#   pods (core)" not in result.stdout.split("# Role in ops:")[0]
    assert docs[-1]["kind"] == "ClusterRole" and docs[-1]["metadata"]["name"] == "maru-operator-router"
    assert docs[-1]["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert {
        "apiGroups": ["rbac.authorization.k8s.io"],
        "resources": ["clusterroles"],
        "verbs": ["bind"],
        "resourceNames": ["maru-operator-router"],
    } in docs[0]["rules"]
    for doc in docs:
        kubernetes_validate.validate(doc, "1.33", strict=True)
    for binding in docs[3:6]:
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "op", "namespace": "ops"}]
    moved = list(yaml.safe_load_all(run_cli("rbac", "--lease-namespace", "leases", "--service-account", "op").stdout))
    assert [d["metadata"].get("namespace") for d in moved if d["kind"] in ("Role", "RoleBinding")] == [
        "maru-system",
        "leases",
        "maru-system",
        "leases",
    ]


def test_namespaced_preflight_stays_in_its_namespace(k8s_emulator: KubeEmulator) -> None:
    install_crds(k8s_emulator)
    mark = k8s_emulator.mark()
    import asyncio

    from maru_operator.kube import Kube

    async def check() -> None:
        async with Kube(k8s_emulator.kopf_connection()) as kube:
            await kube.preflight("llm")

    asyncio.run(check())
    paths = [r.path for r in k8s_emulator.requests_since(mark)]
    assert "/apis/maru.io/v1alpha1/namespaces/llm/inferencegroups" in paths
    assert "/apis/maru.io/v1alpha1/inferencegroups" not in paths


def test_the_collector_is_tuned_before_the_loop_starts() -> None:
    import gc

    from maru_operator.cli import GC_YOUNG_THRESHOLD, tune_gc

    before = gc.get_threshold()
    try:
        tune_gc()
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, *before[1:])
        assert gc.get_freeze_count() > 0  # what was imported is out of the collector's sight
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
