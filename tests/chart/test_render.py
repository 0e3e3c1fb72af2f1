"""The chart lints, renders valid Kubernetes objects, and runs the operator as promised."""

from __future__ import annotations

import re
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.chart.conftest import CHART, CUSTOM_VALUES, NAMESPACE, RELEASE, REPO_ROOT, find, one

pytestmark = pytest.mark.tools

KUBERNETES_VERSION = "1.33.0"
CHART_META = yaml.safe_load((CHART / "Chart.yaml").read_text())
APP_VERSION = CHART_META["appVersion"]

# ServiceMonitor is a prometheus-operator CRD kind, which kubernetes-validate has no schema for:
# it is checked against this subset of monitoring.coreos.com/v1 instead (closed where we write it).
SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name", "namespace"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"matchNames": {"type": "array", "items": {"type": "string"}}},
                },
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}},
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["port"],
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {"type": "string", "pattern": r"^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?)$"},
                            "scrapeTimeout": {
                                "type": "string",
                                "pattern": r"^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?)$",
                            },
                        },
                    },
                },
            },
        },
    },
}


def container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert len(pod["containers"]) == 1
    return pod["containers"][0]


@pytest.mark.parametrize("values", [None, CUSTOM_VALUES], ids=["default", "custom"])
def test_lint_strict(run_helm, values) -> None:
    args = ["lint", "--strict", str(CHART), "--namespace", NAMESPACE]
    if values:
        args += ["--values", str(values)]
    result = run_helm(*args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("which", ["default", "custom"])
def test_every_object_is_valid_kubernetes(request: pytest.FixtureRequest, which: str) -> None:
    objects = request.getfixturevalue(f"{which}_objects")
    assert objects
    for obj in objects:
        if obj["kind"] == "ServiceMonitor":
            jsonschema.validate(obj, SERVICE_MONITOR_SCHEMA)
            continue
        # Raises ValidationError (unknown field, wrong type, missing required field) on failure.
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_validation_catches_a_broken_object(default_objects: list[dict[str, Any]]) -> None:
    """Guards the test above: a misplaced field is refused, so a pass means something."""
    deployment = yaml.safe_load(yaml.safe_dump(one(default_objects, "Deployment")))
    deployment["spec"]["template"]["spec"]["containers"][0]["securityContex"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_crds_render_with_include_crds(render) -> None:
    crds = find(render("--include-crds"), "CustomResourceDefinition")
    assert sorted(c["metadata"]["name"] for c in crds) == ["inferencegroups.maru.io", "marupools.maru.io"]
    for crd in crds:
        kubernetes_validate.validate(crd, KUBERNETES_VERSION, strict=True)


def test_default_objects(default_objects: list[dict[str, Any]]) -> None:
    kinds = sorted(o["kind"] for o in default_objects)
    assert kinds == [
        "CSIDriver",
        "ClusterRole",
        "ClusterRole",
        "ClusterRoleBinding",
        "ClusterRoleBinding",
        "DaemonSet",
        "Deployment",
        "NetworkPolicy",
        "NetworkPolicy",
        "Role",
        "Role",
        "RoleBinding",
        "RoleBinding",
        "Service",
        "ServiceAccount",
        "ServiceAccount",
    ]
    for obj in default_objects:
        if "namespace" in obj["metadata"]:
            # All in the release namespace, but the leader Lease's Role: where every release looks for it.
            lease = obj["metadata"]["name"].endswith("-leader-election")
            assert obj["metadata"]["namespace"] == ("default" if lease else NAMESPACE)


def test_optional_objects(custom_objects: list[dict[str, Any]]) -> None:
    monitor = one(custom_objects, "ServiceMonitor")
    service = one(custom_objects, "Service")
    assert monitor["metadata"]["namespace"] == "monitoring"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    # The ServiceMonitor selects the metrics Service, whose port name it scrapes.
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert [p["name"] for p in service["spec"]["ports"]] == [monitor["spec"]["endpoints"][0]["port"]]
    assert monitor["spec"]["endpoints"][0]["interval"] == "15s"
    pdb = one(custom_objects, "PodDisruptionBudget")
    assert pdb["spec"] == {
        "minAvailable": 1,
        "selector": one(custom_objects, "Deployment")["spec"]["selector"],
    }


def test_pdb_defaults_to_max_unavailable(render) -> None:
    pdb = one(render("--set", "podDisruptionBudget.enabled=true"), "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert "minAvailable" not in pdb["spec"]


def test_service_monitor_needs_the_metrics_service(run_helm, template_args) -> None:
    result = run_helm(*template_args("--set", "serviceMonitor.enabled=true", "--set", "metrics.service.enabled=false"))
    assert result.returncode != 0
    assert "metrics.service.enabled" in result.stderr


def test_replicas_roll_with_a_standby(default_objects: list[dict[str, Any]], render) -> None:
    spec = one(default_objects, "Deployment")["spec"]
    assert spec["replicas"] == 1
    # Leader election hands over: the new pod starts before the old one stops (and gives the Lease up).
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert one(render("--set", "replicas=2"), "Deployment")["spec"]["replicas"] == 2
    # The selector is a subset of the pod labels, and stays fixed across versions (it is immutable).
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "maru-operator",
        "app.kubernetes.io/instance": RELEASE,
    }
    assert spec["selector"]["matchLabels"].items() <= labels.items()


def test_operator_command_default(default_objects: list[dict[str, Any]]) -> None:
    c = container(default_objects)
    assert c["image"] == f"ghcr.io/maru-pd/maru-operator:{APP_VERSION}"
    assert c["imagePullPolicy"] == "IfNotPresent"
    assert c["args"] == [
        "run",
        "--all-namespaces",
        f"--pool-namespace={NAMESPACE}",
        "--lease-namespace=default",
        "--liveness=http://0.0.0.0:8080/healthz",
        "--metrics-port=9090",
        "--workers=8",
        "--resync-seconds=60",
        "--pool-usage-interval=30",
        "--api-server-cidr=0.0.0.0/0",
        "--api-server-cidr=::/0",
        "--api-server-port=443",
        "--api-server-port=6443",
    ]
    assert {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}} in c["env"]
    probe = c["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"healthz": 8080, "metrics": 9090}
    assert probe["port"] == "healthz"
    # Ready once the operator answers on the same endpoint.
    assert c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}


def test_operator_command_custom(custom_objects: list[dict[str, Any]]) -> None:
    c = container(custom_objects)
    assert c["image"] == (
        "registry.example.com/platform/maru-operator:0.2.0-rc.1"
        "@sha256:4f53cda18c2baa0c0354bb5f9a3ecbe5ed12ab4d8e11ba873c2f11161202b945"
    )
    assert c["imagePullPolicy"] == "Always"
    args = c["args"]
    assert "--all-namespaces" not in args
    assert "--instance=team-a" in args
    assert "--pool-usage-interval=60" in args
    assert [a for a in args if a.startswith("--namespace=")] == ["--namespace=llm-serving", "--namespace=llm-staging"]
    assert f"--pool-namespace={NAMESPACE}" in args
    assert "--liveness=http://0.0.0.0:8081/healthz" in args
    assert "--metrics-port=9191" in args
    assert "--verbose" in args
    assert "--workers=16" in args
    assert args[-1] == "--resync-seconds=45"
    assert [a for a in args if a.startswith(("--scrape-namespace", "--api-server"))] == [
        "--scrape-namespace=monitoring", "--api-server-cidr=192.0.2.10/32", "--api-server-port=6443"]
    assert c["readinessProbe"]["periodSeconds"] == 20
    policy = one(custom_objects, "NetworkPolicy", "maru-operator")["spec"]
    assert policy["ingress"][0]["ports"] == [{"protocol": "TCP", "port": 9191}]
    assert {"ipBlock": {"cidr": "192.0.2.10/32"}} in policy["egress"][1]["to"]
    assert {"name": "HTTPS_PROXY", "value": "http://proxy.example.com:3128"} in c["env"]
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"healthz": 8081, "metrics": 9191}
    assert c["resources"] == {
        "requests": {"cpu": "100m", "memory": "256Mi"},
        "limits": {"cpu": "1", "memory": "1Gi"},
    }


@pytest.mark.parametrize("which", ["default", "custom"])
def test_operator_accepts_the_rendered_arguments(request: pytest.FixtureRequest, which: str) -> None:
    """The contract with the operator: its own argument parser reads what the chart renders."""
    from maru_operator.cli import _parser

    objects = request.getfixturevalue(f"{which}_objects")
    args = _parser().parse_args(container(objects)["args"])
    assert args.command == "run"
    assert args.leader_election is True
    assert args.pool_namespace == NAMESPACE
    assert (args.instance, args.pool_usage_interval) == (("", 30.0) if which == "default" else ("team-a", 60.0))
    if which == "default":
        assert args.all_namespaces and args.namespace == []
        assert (args.liveness, args.metrics_port, args.workers, args.resync_seconds, args.verbose) == (
            "http://0.0.0.0:8080/healthz",
            9090,
            8,
            60.0,
            False,
        )
    else:
        assert not args.all_namespaces and args.namespace == ["llm-serving", "llm-staging"]
        assert (args.liveness, args.metrics_port, args.workers, args.resync_seconds, args.verbose) == (
            "http://0.0.0.0:8081/healthz",
            9191,
            16,
            45.0,
            True,
        )


def test_pod_placement_custom(custom_objects: list[dict[str, Any]]) -> None:
    pod = one(custom_objects, "Deployment")["spec"]["template"]
    spec = pod["spec"]
    assert spec["nodeSelector"] == {"node-role.kubernetes.io/control-plane": ""}
    assert spec["tolerations"] == [
        {"key": "node-role.kubernetes.io/control-plane", "operator": "Exists", "effect": "NoSchedule"}
    ]
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms[0]["matchExpressions"][0]["values"] == ["amd64", "arm64"]
    assert spec["priorityClassName"] == "system-cluster-critical"
    assert spec["imagePullSecrets"] == [{"name": "registry-credentials"}]
    assert pod["metadata"]["annotations"] == {"example.com/team": "platform"}
    assert pod["metadata"]["labels"]["example.com/team"] == "platform"


def test_default_pod_has_no_placement_constraints(default_objects: list[dict[str, Any]]) -> None:
    spec = one(default_objects, "Deployment")["spec"]["template"]["spec"]
    for key in ("nodeSelector", "tolerations", "affinity", "priorityClassName", "imagePullSecrets"):
        assert key not in spec


@pytest.mark.parametrize("which", ["default", "custom"])
def test_operator_pod_is_locked_down(request: pytest.FixtureRequest, which: str) -> None:
    objects = request.getfixturevalue(f"{which}_objects")
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container(objects)["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["runAsNonRoot"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "privileged" not in sc or sc["privileged"] is False
    # Nothing from the host.
    assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
    assert all("hostPath" not in v for v in pod.get("volumes", []))
    # A read-only root needs a writable /tmp.
    mounts = {m["mountPath"]: m["name"] for m in container(objects)["volumeMounts"]}
    assert "emptyDir" in {v["name"]: v for v in pod["volumes"]}[mounts["/tmp"]]


def test_service_account_used_by_the_pod(default_objects: list[dict[str, Any]]) -> None:
    account = one(default_objects, "ServiceAccount", RELEASE)
    pod = one(default_objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"] == RELEASE


def test_existing_service_account(render, run_helm, template_args) -> None:
    objects = render("--set", "serviceAccount.create=false", "--set", "serviceAccount.name=platform-operator")
    # Only the CSI node plugin's own account (which holds no rights) is left.
    assert [a["metadata"]["name"] for a in find(objects, "ServiceAccount")] == [f"{RELEASE}-csi-node"]
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "platform-operator"
    for binding in find(objects, "ClusterRoleBinding"):
        assert binding["subjects"][0]["name"] == "platform-operator"
    result = run_helm(*template_args("--set", "serviceAccount.create=false"))
    assert result.returncode != 0
    assert "serviceAccount.name" in result.stderr


@pytest.mark.parametrize("which", ["default", "custom"])
def test_standard_labels_everywhere(request: pytest.FixtureRequest, which: str) -> None:
    for obj in request.getfixturevalue(f"{which}_objects"):
        labels = obj["metadata"]["labels"]
        # The CSI driver's objects carry their own name, so the operator's selectors never match its pods.
        csi = labels.get("app.kubernetes.io/component") == "csi-node"
        assert labels["app.kubernetes.io/name"] == ("maru-operator-csi-node" if csi else "maru-operator")
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["app.kubernetes.io/part-of"] == "maru"
        assert labels["helm.sh/chart"] == f"maru-operator-{CHART_META['version']}"
        assert labels["app.kubernetes.io/version"]
        if which == "custom":
            assert labels["example.com/cost-center"] == "42"


def test_long_release_names_are_truncated_to_63(render) -> None:
    release = "a-very-long-release-name-for-the-kv-cache-pool-test-1"  # 53 characters, Helm's 53
    objects = render(release=release)
    for obj in objects:
        name = obj["metadata"]["name"]
        # RBAC objects' names are path segments (253); the rest are DNS labels or end up in labels.
        limit = 253 if obj["kind"] in ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding") else 63
        assert len(name) <= limit, name
        assert name[-1].isalnum(), name
        for value in obj["metadata"]["labels"].values():
            assert len(value) <= 63, value
    service = one(objects, "Service")["metadata"]["name"]
    assert service.endswith("-metrics")
    assert len(service) <= 63
    assert len(one(objects, "Deployment")["metadata"]["name"]) == 63


def test_release_named_after_the_chart_is_not_doubled(render) -> None:
    assert one(render(release="maru-operator"), "Deployment")["metadata"]["name"] == "maru-operator"
    assert one(render(release="prod"), "Deployment")["metadata"]["name"] == "prod-maru-operator"
    assert one(render("--set", "fullnameOverride=maru"), "Deployment")["metadata"]["name"] == "maru"


def test_notes_tell_the_next_three_commands(run_helm) -> None:
    result = run_helm("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client")
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    commands = re.findall(r"kubectl [^#\n]+?(?=\s+#|\n)", notes)
    assert commands == [
        "kubectl apply -f examples/pool-cxl.yaml",
        "kubectl create namespace llm && kubectl apply -f examples/inferencegroup.yaml",
        "kubectl get mpool,ig --all-namespaces --watch",
    ]
    # The group in the example binds to the pool the notes apply first, in the namespace they create.
    group = yaml.safe_load((REPO_ROOT / "examples" / "inferencegroup.yaml").read_text())
    pool = yaml.safe_load((REPO_ROOT / "examples" / "pool-cxl.yaml").read_text())
    assert group["spec"]["poolRef"]["name"] == pool["metadata"]["name"]
    assert group["metadata"]["namespace"] == "llm"
