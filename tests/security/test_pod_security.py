"""Serving pods run at Pod Security ``restricted``; only pool infrastructure needs more.

Every example under ``examples/`` is rendered with the real ``maru-operator render`` command, with the
example InferenceGroup bound to each example MaruPool in turn (dax and shm groups differ: affinity,
socket directory), and the chart is rendered with the real helm binary. Every pod template is checked
against the Pod Security Standards:

* the serving pods (vLLM prefill and decode, the router) and the operator pass ``restricted``, so a
  tenant namespace can be labelled ``pod-security.kubernetes.io/enforce: restricted``;
* the pods that fail ``restricted`` are exactly the pool's node agents and the CSI node plugin, both in
  the operator's release namespace, which is labelled ``privileged``. They are exempt by design: the
  agent owns the socket directory on the node (hostPath) and, with ``dax``, opens ``/dev/daxX.Y``
  (privileged); the CSI node plugin bind-mounts that directory into pods (privileged, for mount
  propagation). The test fails if any other pod starts needing more, or if these stop needing it
  (then the docs' exemption list is stale).
"""

from __future__ import annotations

from typing import Any

import pytest

from maru_localcluster.podsecurity import check, pod_template
from tests.security.renders import EXAMPLES, POOL_NAMESPACE, examples_bound_to_each_pool, operator_render

SERVING_APPS = {"vllm", "vllm-router"}
ROLES = {"prefill", "decode", "router"}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Pool name -> the children of every example, with the example groups bound to that pool."""
    return examples_bound_to_each_pool(tmp_path_factory.mktemp("examples"))


def _app(obj: dict[str, Any]) -> str:
    meta, _ = pod_template(obj) or ({}, {})
    return (meta.get("labels") or {}).get("app.kubernetes.io/name", "")


def _pods(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if pod_template(o) is not None]


def _describe(obj: dict[str, Any]) -> str:
    return f"{obj['kind']} {obj['metadata'].get('namespace', '')}/{obj['metadata']['name']}"


def test_the_examples_render_through_the_real_command() -> None:
    # The unmodified examples, exactly as `make render` shows them.
    objects = operator_render([EXAMPLES])
    assert {_app(o) for o in _pods(objects)} >= SERVING_APPS


def test_every_serving_pod_passes_restricted(rendered: dict[str, list[dict[str, Any]]]) -> None:
    checked = []
    for pool, objects in rendered.items():
        serving = [o for o in _pods(objects) if _app(o) in SERVING_APPS]
        roles = {pod_template(o)[0]["labels"]["maru.io/role"] for o in serving}  # type: ignore[index]
        assert roles == ROLES, f"bound to {pool}: roles {roles}"
        for obj in serving:
            violations = check(obj, "restricted")
            assert not violations, f"{_describe(obj)} (pool {pool}) fails restricted:\n" + "\n".join(
                map(str, violations)
            )
            checked.append(obj)
    # Prefill, decode and router for every group bound to each pool: nothing was skipped by accident.
    # examples/ holds two groups (each rendered bound to each of its two pools), examples/local/ one.
    groups = {
        (pool, o["metadata"]["labels"]["app.kubernetes.io/instance"])
        for pool, objects in rendered.items()
        for o in _pods(objects)
        if _app(o) in SERVING_APPS
    }
    assert len(groups) == 5, sorted(groups)
    assert len(checked) == len(ROLES) * len(groups)


def test_the_socket_reaches_serving_pods_through_a_csi_volume(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for objects in rendered.values():
        for obj in _pods(objects):
            if _app(obj) != "vllm":
                continue
            _, spec = pod_template(obj)  # type: ignore[misc]
            csi = {v["name"]: v["csi"] for v in spec["volumes"] if "csi" in v}
            # The pool's socket directory, and the pool credential the node plugin mints: both read-only.
            assert set(csi) == {"maru-socket", "maru-credential"}, spec["volumes"]
            assert all(v["driver"] == "csi.maru.io" and v["readOnly"] is True for v in csi.values()), csi
            assert not [v for v in spec["volumes"] if "secret" in v], "no Secret volume: nothing in the namespace"


def test_only_pool_infrastructure_needs_more_than_restricted(rendered: dict[str, list[dict[str, Any]]]) -> None:
    exempt: dict[str, set[str]] = {}
    for objects in rendered.values():
        for obj in _pods(objects):
            violations = check(obj, "restricted")
            if not violations:
                continue
            meta, _ = pod_template(obj)  # type: ignore[misc]
            labels = meta.get("labels") or {}
            assert (labels.get("app.kubernetes.io/name"), labels.get("app.kubernetes.io/component")) == (
                "maru-pool",
                "agent",
            ), f"{_describe(obj)} needs more than restricted:\n" + "\n".join(map(str, violations))
            assert obj["metadata"]["namespace"] == POOL_NAMESPACE
            exempt[obj["metadata"]["name"]] = {v.control for v in violations}
    # Both example pools' agents are exempt, for the documented reasons (and only those).
    assert set(exempt) == {"cxl-pool-agent", "local-shm-agent"}
    # shm: the socket directory (hostPath) and root, to create the socket in it; no capability, no escalation.
    assert exempt["local-shm-agent"] == {
        "HostPath Volumes",
        "Volume Types",
        "Running as Non-root",
        "Running as Non-root user",
    }
    assert "Privileged Containers" in exempt["cxl-pool-agent"]


@pytest.mark.tools
def test_chart_pods(render) -> None:
    """The operator passes restricted; the CSI node plugin is the chart's only pod that needs more."""
    objects = render()
    pods = _pods(objects)
    assert pods
    for obj in pods:
        violations = check(obj, "restricted")
        meta, _ = pod_template(obj)  # type: ignore[misc]
        component = (meta.get("labels") or {}).get("app.kubernetes.io/component")
        if component == "csi-node":
            assert {"Privileged Containers", "HostPath Volumes"} <= {v.control for v in violations}
        else:
            assert not violations, f"{_describe(obj)} fails restricted:\n" + "\n".join(map(str, violations))
    assert any(
        (pod_template(o)[0].get("labels") or {}).get("app.kubernetes.io/component") == "csi-node" for o in pods
    ), "the chart ships the CSI node plugin"


def _dockerfile_user(target: str) -> int:
    from tests.support.docker import DOCKERFILE, last, stages

    user = last(stages(DOCKERFILE.read_text()), target, "USER")
    assert user, f"the {target} image names no user"
    return int(user.split(":")[0])


def test_serving_pods_name_a_non_root_user(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """runAsNonRoot alone makes the kubelet refuse an image whose user is root (or a name, not a number):
    the pod must say which user it runs as. The UID is the one our images use, so their files fit."""
    images = {"vllm": _dockerfile_user("vllm"), "vllm-router": _dockerfile_user("router")}
    for objects in rendered.values():
        for obj in _pods(objects):
            if _app(obj) not in SERVING_APPS:
                continue
            _, spec = pod_template(obj)  # type: ignore[misc]
            context = spec["securityContext"]
            assert context.get("runAsNonRoot") is True
            assert context.get("runAsUser") == images[_app(obj)], f"{_describe(obj)}: {context}"
            assert context.get("runAsGroup") == images[_app(obj)], f"{_describe(obj)}: {context}"
