"""The chart's CSI driver: the CSIDriver object and the node plugin DaemonSet agree with the plugin's own
command line, the operator's pod volumes and the MaruPool defaults."""

from __future__ import annotations

from typing import Any

import pytest

from maru_contracts.csi import DEFAULT_SOCKET_ROOT, DRIVER_NAME
from maru_csi.server import build_parser
from maru_operator.api.marupool import MaruPoolSpec
from maru_operator.images import DEFAULT_POOL_IMAGE
from tests.support.chart import NAMESPACE, RELEASE, find, one

pytestmark = pytest.mark.tools

CSI_NODE = f"{RELEASE}-csi-node"


def _containers(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    pod = one(objects, "DaemonSet", CSI_NODE)["spec"]["template"]["spec"]
    return {c["name"]: c for c in pod["containers"]}


def _volumes(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    pod = one(objects, "DaemonSet", CSI_NODE)["spec"]["template"]["spec"]
    return {v["name"]: v for v in pod["volumes"]}


def _flags(args: list[str]) -> dict[str, str]:
    return dict(a.removeprefix("--").split("=", 1) for a in args)


def test_csidriver(default_objects: list[dict[str, Any]]) -> None:
    driver = one(default_objects, "CSIDriver")
    assert driver["metadata"]["name"] == DRIVER_NAME  # what the operator writes into vLLM pods
    assert driver["spec"]["volumeLifecycleModes"] == ["Ephemeral"]
    assert driver["spec"]["attachRequired"] is False
    assert driver["spec"]["podInfoOnMount"] is True
    assert driver["spec"]["fsGroupPolicy"] == "None"
    # Credential volumes are re-minted on republish: a rotated key reaches running pods.
    assert driver["spec"]["requiresRepublish"] is True


def test_plugin_command_line_is_one_the_plugin_accepts(default_objects: list[dict[str, Any]]) -> None:
    plugin = _containers(default_objects)["plugin"]
    assert plugin["command"] == ["maru-csi"]
    args = build_parser().parse_args(plugin["args"])
    assert args.endpoint == "unix:///csi/csi.sock"
    assert args.node_id == "$(NODE_NAME)"
    assert {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in plugin["env"]} == {"NODE_NAME": "spec.nodeName"}
    # The socket root is where the pools put their sockets by default.
    default_pool = MaruPoolSpec.model_validate({"backend": "shm", "size": "1Gi"})
    assert args.socket_root == DEFAULT_SOCKET_ROOT == default_pool.daemon.socket_dir
    # The plugin image is the pool image (it carries maru-csi), at the same version.
    assert plugin["image"] == DEFAULT_POOL_IMAGE


def test_mounts_meet_where_the_kubelet_looks(default_objects: list[dict[str, Any]]) -> None:
    containers, volumes = _containers(default_objects), _volumes(default_objects)
    plugin, registrar = containers["plugin"], containers["node-driver-registrar"]
    plugin_dir = f"/var/lib/kubelet/plugins/{DRIVER_NAME}"
    assert volumes["plugin-dir"]["hostPath"] == {"path": plugin_dir, "type": "DirectoryOrCreate"}
    flags = _flags(registrar["args"])
    assert flags["csi-address"] == "/csi/csi.sock"
    assert flags["kubelet-registration-path"] == f"{plugin_dir}/csi.sock"
    assert volumes["registration-dir"]["hostPath"]["path"] == "/var/lib/kubelet/plugins_registry"
    mounts = {m["name"]: m for m in plugin["volumeMounts"]}
    assert mounts["plugin-dir"]["mountPath"] == "/csi"
    # Mounts made under the pods directory must reach the host, and from there the pod.
    assert mounts["pods-dir"] == {
        "name": "pods-dir",
        "mountPath": "/var/lib/kubelet/pods",
        "mountPropagation": "Bidirectional",
    }
    assert volumes["pods-dir"]["hostPath"]["path"] == "/var/lib/kubelet/pods"
    assert mounts["socket-root"]["mountPath"] == volumes["socket-root"]["hostPath"]["path"] == DEFAULT_SOCKET_ROOT
    assert mounts["socket-root"]["readOnly"] is True


def test_the_plugin_itself_is_probed_over_its_csi_socket(default_objects: list[dict[str, Any]]) -> None:
    """The plugin container's liveness and readiness are its CSI Probe, asked over the socket the kubelet uses
    (the livenessprobe sidecar); the registrar's own probe tells only that it registered the plugin."""
    containers = _containers(default_objects)
    plugin, sidecar = containers["plugin"], containers["liveness-probe"]
    (port,) = plugin["ports"]
    flags = _flags(sidecar["args"])
    assert flags["csi-address"] == "/csi/csi.sock"
    assert flags["http-endpoint"] == f":{port['containerPort']}"
    for probe in (plugin["livenessProbe"], plugin["readinessProbe"]):
        assert probe["httpGet"] == {"path": "/healthz", "port": port["name"]}
    assert {m["name"]: m["mountPath"] for m in sidecar["volumeMounts"]} == {"plugin-dir": "/csi"}
    assert sidecar["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert sidecar["securityContext"]["allowPrivilegeEscalation"] is False
    pod = one(default_objects, "DaemonSet", CSI_NODE)["spec"]["template"]["spec"]
    # Evicted last, scheduled first: vLLM pods on the node cannot start without it.
    assert pod["priorityClassName"] == "system-node-critical"
    names = [p["name"] for c in containers.values() for p in c.get("ports", [])]
    assert len(names) == len(set(names)), names


def test_the_priority_class_can_be_left_out(render) -> None:
    pod = one(render("--set", "csiDriver.priorityClassName="), "DaemonSet", CSI_NODE)["spec"]["template"]["spec"]
    assert "priorityClassName" not in pod


def test_privilege_where_it_is_needed_only(default_objects: list[dict[str, Any]]) -> None:
    containers = _containers(default_objects)
    assert containers["plugin"]["securityContext"]["privileged"] is True
    registrar = containers["node-driver-registrar"]["securityContext"]
    assert "privileged" not in registrar and registrar["allowPrivilegeEscalation"] is False
    assert registrar["capabilities"] == {"drop": ["ALL"]}
    pod = one(default_objects, "DaemonSet", CSI_NODE)["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["serviceAccountName"] == CSI_NODE
    assert one(default_objects, "ServiceAccount", CSI_NODE)["automountServiceAccountToken"] is False
    assert one(default_objects, "DaemonSet", CSI_NODE)["metadata"]["namespace"] == NAMESPACE
    # A privileged pod: it goes only where it is let (untainted nodes and GPU nodes, where vLLM pods run, or
    # the taints the values name), not onto every tainted node of the cluster (control-plane nodes).
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert "nodeSelector" not in pod and "affinity" not in pod


def test_the_operators_selectors_never_match_the_plugin(default_objects: list[dict[str, Any]]) -> None:
    plugin_labels = one(default_objects, "DaemonSet", CSI_NODE)["spec"]["template"]["metadata"]["labels"]
    for selector in (
        one(default_objects, "Deployment")["spec"]["selector"]["matchLabels"],
        one(default_objects, "Service")["spec"]["selector"],
    ):
        assert not selector.items() <= plugin_labels.items()


def test_custom_placement_and_paths(render) -> None:
    objects = render(
        "--set",
        "csiDriver.kubeletDir=/var/snap/microk8s/common/var/lib/kubelet/",
        "--set",
        "csiDriver.socketRoot=/var/run/maru",
        "--set",
        "csiDriver.image.tag=0.2.0",
        "--set",
        "csiDriver.priorityClassName=system-node-critical",
        "--set-json",
        'csiDriver.nodeSelector={"maru.io/cxl":"true"}',
        "--set-json",
        'csiDriver.tolerations=[{"key":"cxl","operator":"Exists","effect":"NoSchedule"}]',
        "--set-json",
        'csiDriver.affinity={"nodeAffinity":{"requiredDuringSchedulingIgnoredDuringExecution":'
        '{"nodeSelectorTerms":[{"matchExpressions":[{"key":"maru.io/pool","operator":"Exists"}]}]}}}',
        "--set",
        "logLevel=debug",
    )
    kubelet = "/var/snap/microk8s/common/var/lib/kubelet"
    plugin, registrar = _containers(objects)["plugin"], _containers(objects)["node-driver-registrar"]
    args = build_parser().parse_args(plugin["args"])
    assert args.socket_root == "/var/run/maru" and args.log_level == "DEBUG"
    assert plugin["image"].endswith(":0.2.0")
    assert _flags(registrar["args"])["kubelet-registration-path"] == f"{kubelet}/plugins/{DRIVER_NAME}/csi.sock"
    assert _volumes(objects)["pods-dir"]["hostPath"]["path"] == f"{kubelet}/pods"
    pod = one(objects, "DaemonSet", CSI_NODE)["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"maru.io/cxl": "true"}
    assert pod["tolerations"] == [{"key": "cxl", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["priorityClassName"] == "system-node-critical"
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [{"key": "maru.io/pool", "operator": "Exists"}]}]


def test_a_private_registry_moves_the_sidecars_too(render, default_objects: list[dict[str, Any]]) -> None:
    """images.registry moves every image the chart runs; the sidecars stay upstream's by default."""
    upstream = _containers(default_objects)
    assert upstream["node-driver-registrar"]["image"] == "registry.k8s.io/sig-storage/csi-node-driver-registrar:v2.13.0"
    assert upstream["liveness-probe"]["image"] == "registry.k8s.io/sig-storage/livenessprobe:v2.15.0"
    moved = _containers(render("--set", "images.registry=registry.example.com/maru"))
    assert {name: c["image"].rsplit(":", 1)[0] for name, c in moved.items()} == {
        "plugin": "registry.example.com/maru/maru-pool",
        "node-driver-registrar": "registry.example.com/maru/csi-node-driver-registrar",
        "liveness-probe": "registry.example.com/maru/livenessprobe",
    }
    # A repository named for a sidecar still wins.
    named = _containers(
        render(
            "--set",
            "images.registry=registry.example.com/maru",
            "--set",
            "csiDriver.registrar.image.repository=mirror.example.com/registrar",
        )
    )
    assert named["node-driver-registrar"]["image"] == "mirror.example.com/registrar:v2.13.0"


def test_disabled(render) -> None:
    objects = render("--set", "csiDriver.enabled=false")
    assert not find(objects, "CSIDriver") and not find(objects, "DaemonSet")
    assert [a["metadata"]["name"] for a in find(objects, "ServiceAccount")] == [RELEASE]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--set", "csiDriver.socketRoot=run/maru"], ["/csiDriver/socketRoot"]),
        (["--set", "csiDriver.socketRoot=/"], ["/csiDriver/socketRoot"]),
        (["--set", "csiDriver.enable=false"], ["/csiDriver", "enable"]),
        (["--set", "csiDriver.registrar.image.pullPolicy=Sometimes"], ["/csiDriver/registrar/image/pullPolicy"]),
    ],
    ids=["relative-root", "slash-root", "typo", "bad-pull-policy"],
)
def test_wrong_values_are_refused_by_name(run_helm, template_args, args: list[str], words: list[str]) -> None:
    result = run_helm(*template_args(*args))
    assert result.returncode != 0, f"helm accepted {args}"
    for word in words:
        assert word in result.stderr, result.stderr
