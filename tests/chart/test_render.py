"""The chart lints, renders valid Kubernetes objects, and runs the operator as promised."""

from __future__ import annotations

import re
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.support.chart import CHART, CUSTOM_VALUES, NAMESPACE, RELEASE, REPO_ROOT, find, one

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
        "ClusterRole",  # the routers' (the operator binds them to it, never holds it)
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
        "--max-rolling-groups=3",
        "--data-plane-updates=manual",
        "--resync-seconds=600",
        "--pool-usage-interval=30",
        "--api-server-cidr=0.0.0.0/0",
        "--api-server-cidr=::/0",
        "--api-server-port=443",
        "--api-server-port=6443",
        "--image-registry=ghcr.io/maru-pd",
        f"--image-tag={APP_VERSION}",
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
        "--scrape-namespace=monitoring",
        "--api-server-cidr=192.0.2.10/32",
        "--api-server-port=6443",
    ]
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
            600.0,
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
    for key in ("nodeSelector", "tolerations", "priorityClassName", "imagePullSecrets", "topologySpreadConstraints"):
        assert key not in spec
    assert set(spec["affinity"]) == {"podAntiAffinity"}


def test_replicas_prefer_different_nodes(default_objects: list[dict[str, Any]], render) -> None:
    """A standby on the leader's node dies with it: the replicas prefer (never require) other nodes."""
    deployment = one(default_objects, "Deployment")
    (term,) = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    spread = one(
        render(
            "--set-json",
            'topologySpreadConstraints=[{"maxSkew":1,"topologyKey":'
            '"topology.kubernetes.io/zone","whenUnsatisfiable":"ScheduleAnyway"}]',
        ),
        "Deployment",
    )
    (constraint,) = spread["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert constraint == {
        "maxSkew": 1,
        "topologyKey": "topology.kubernetes.io/zone",
        "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": {"matchLabels": deployment["spec"]["selector"]["matchLabels"]},
    }


def test_installs_as_a_subchart(run_helm, tmp_path) -> None:
    """A parent chart hands its subcharts `global`; the closed values schema must accept it."""
    import shutil

    parent = tmp_path / "parent"
    shutil.copytree(CHART, parent / "charts" / "maru-operator")
    (parent / "Chart.yaml").write_text(
        "apiVersion: v2\nname: parent\nversion: 0.1.0\n"
        "dependencies:\n  - name: maru-operator\n    version: '>=0.0.0-0'\n"
    )
    (parent / "values.yaml").write_text("global:\n  imageRegistry: registry.example.com\n")
    result = run_helm("template", "p", str(parent), "--namespace", NAMESPACE)
    assert result.returncode == 0, result.stderr
    assert "kind: DaemonSet" in result.stdout


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


def test_notes_tell_how_to_check_and_what_next(run_helm) -> None:
    result = run_helm("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client")
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    # Helm prints the notes before the operator's pod exists: they say how to check it, not that it runs.
    assert "running" not in notes
    commands = re.findall(r"kubectl [^#\n]+?(?=\s+#|\n)", notes)
    assert commands == [
        f"kubectl -n {NAMESPACE} rollout status deployment/{RELEASE}",
        "kubectl label node <your-gpu-node> maru.io/shm-pool=true",
        "kubectl apply -f examples/pool-shm.yaml",
        "kubectl create namespace llm && kubectl apply -f examples/inferencegroup-shm.yaml",
        "kubectl get mpool,ig --all-namespaces --watch",
    ]
    # The labelled node is the one the pool selects, and the group binds that pool in the namespace created.
    group = yaml.safe_load((REPO_ROOT / "examples" / "inferencegroup-shm.yaml").read_text())
    pool = yaml.safe_load((REPO_ROOT / "examples" / "pool-shm.yaml").read_text())
    assert pool["spec"]["nodeSelector"] == {"maru.io/shm-pool": "true"}
    assert group["spec"]["poolRef"]["name"] == pool["metadata"]["name"]
    assert group["metadata"]["namespace"] == "llm"


# --- images: one registry for everything the chart and the operator run ------------------------------


def operator_args(objects: list[dict[str, Any]]) -> list[str]:
    return container(objects)["args"]


def csi_plugin_image(objects: list[dict[str, Any]]) -> str:
    pod = one(objects, "DaemonSet")["spec"]["template"]["spec"]
    return next(c["image"] for c in pod["containers"] if c["name"] == "plugin")


def test_default_images_are_the_operators_own_defaults(default_objects: list[dict[str, Any]]) -> None:
    """The chart passes the registry and tag the operator would use anyway: nothing depends on which says it."""
    from maru_operator.cli import _parser, image_defaults
    from maru_operator.images import DEFAULT_IMAGES

    args = [a for a in operator_args(default_objects) if a.startswith("--image") or a.endswith("-image")]
    assert image_defaults(_parser().parse_args(["run", *args])) == DEFAULT_IMAGES
    assert container(default_objects)["image"] == f"ghcr.io/maru-pd/maru-operator:{APP_VERSION}"
    assert csi_plugin_image(default_objects) == DEFAULT_IMAGES.pool_image


def test_one_registry_value_moves_every_image(render) -> None:
    objects = render("--set", "images.registry=registry.example.com/mirror/")
    assert container(objects)["image"] == f"registry.example.com/mirror/maru-operator:{APP_VERSION}"
    assert csi_plugin_image(objects) == f"registry.example.com/mirror/maru-pool:{APP_VERSION}"
    args = operator_args(objects)
    assert "--image-registry=registry.example.com/mirror" in args
    assert f"--image-tag={APP_VERSION}" in args
    assert not [a for a in args if a.startswith(("--pool-image", "--vllm-image", "--router-image"))]


def test_each_image_can_be_overridden(render) -> None:
    objects = render(
        "--set",
        "images.registry=registry.example.com/mirror",
        "--set",
        "images.tag=1.0.0-rc.1",
        "--set",
        "images.pool=pools.example.com/pool:7",
        "--set",
        "images.vllm=gpu.example.com/vllm:cu129",
        "--set",
        "images.router=r.example.com/router:2",
        "--set",
        "image.repository=ops.example.com/op",
        "--set",
        "image.tag=v9",
    )
    assert container(objects)["image"] == "ops.example.com/op:v9"
    assert csi_plugin_image(objects) == "pools.example.com/pool:7"  # the CSI plugin runs from the pool image
    args = operator_args(objects)
    for arg in (
        "--image-registry=registry.example.com/mirror",
        "--image-tag=1.0.0-rc.1",
        "--pool-image=pools.example.com/pool:7",
        "--vllm-image=gpu.example.com/vllm:cu129",
        "--router-image=r.example.com/router:2",
    ):
        assert arg in args
    # csiDriver.image.repository still names the plugin's image outright.
    objects = render("--set", "csiDriver.image.repository=csi.example.com/pool", "--set", "images.pool=x/y:1")
    assert csi_plugin_image(objects) == f"csi.example.com/pool:{APP_VERSION}"


@pytest.mark.parametrize("registry", ["https://registry.example.com", "Registry.Example.com", "ghcr.io/maru:0.1"])
def test_a_registry_the_operator_would_refuse_fails_the_install(run_helm, template_args, registry: str) -> None:
    result = run_helm(*template_args("--set", f"images.registry={registry}"))
    assert result.returncode != 0
    assert "images" in result.stderr and "registry" in result.stderr


def test_the_schema_and_the_operator_accept_the_same_registries() -> None:
    import json

    from maru_operator.images import REGISTRY_PATTERN

    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["properties"]["images"]["properties"]["registry"]["pattern"] == f"^{REGISTRY_PATTERN}/?$"
