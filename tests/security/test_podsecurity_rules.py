"""The Pod Security checker itself: a pod that meets ``restricted`` passes, and breaking any one control
is caught and named, so a clean result from the serving-pod test means something."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from maru_localcluster.podsecurity import check, check_pod_spec, pod_template

Pod = dict[str, Any]


def restricted_pod() -> Pod:
    return {
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [
            {
                "name": "app",
                "image": "app:1",
                "ports": [{"containerPort": 8000}],
                "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                "volumeMounts": [{"name": "sock", "mountPath": "/run/x"}],
            }
        ],
        "volumes": [
            {"name": "sock", "csi": {"driver": "csi.example.com", "readOnly": True}},
            {"name": "tmp", "emptyDir": {}},
            {"name": "cfg", "configMap": {"name": "c"}},
            {"name": "token", "projected": {"sources": []}},
        ],
    }


def _app(pod: Pod) -> dict[str, Any]:
    return pod["containers"][0]["securityContext"]


# (id, mutation, level at which it must fail, the control named)
MUTATIONS: list[tuple[str, Callable[[Pod], None], str, str]] = [
    (
        "hostPath",
        lambda p: p["volumes"].append({"name": "h", "hostPath": {"path": "/run"}}),
        "baseline",
        "HostPath Volumes",
    ),
    ("hostNetwork", lambda p: p.update(hostNetwork=True), "baseline", "Host Namespaces"),
    ("hostPID", lambda p: p.update(hostPID=True), "baseline", "Host Namespaces"),
    ("hostIPC", lambda p: p.update(hostIPC=True), "baseline", "Host Namespaces"),
    ("hostPort", lambda p: p["containers"][0]["ports"][0].update(hostPort=8000), "baseline", "Host Ports"),
    ("privileged", lambda p: _app(p).update(privileged=True), "baseline", "Privileged Containers"),
    ("cap-sys-admin", lambda p: _app(p)["capabilities"].update(add=["SYS_ADMIN"]), "baseline", "Capabilities"),
    ("procMount", lambda p: _app(p).update(procMount="Unmasked"), "baseline", "/proc Mount Type"),
    ("seccomp-unconfined", lambda p: _app(p).update(seccompProfile={"type": "Unconfined"}), "baseline", "Seccomp"),
    ("apparmor", lambda p: _app(p).update(appArmorProfile={"type": "Unconfined"}), "baseline", "AppArmor"),
    ("selinux-user", lambda p: _app(p).update(seLinuxOptions={"user": "system_u"}), "baseline", "SELinux"),
    (
        "unsafe-sysctl",
        lambda p: p["securityContext"].update(sysctls=[{"name": "kernel.msgmax", "value": "1"}]),
        "baseline",
        "Sysctls",
    ),
    (
        "init-privileged",
        lambda p: p.update(initContainers=[{"name": "i", "securityContext": {"privileged": True}}]),
        "baseline",
        "Privileged Containers",
    ),
    (
        "volume-type",
        lambda p: p["volumes"].append({"name": "n", "nfs": {"server": "s", "path": "/"}}),
        "restricted",
        "Volume Types",
    ),
    ("escalation-unset", lambda p: _app(p).pop("allowPrivilegeEscalation"), "restricted", "Privilege Escalation"),
    ("escalation-true", lambda p: _app(p).update(allowPrivilegeEscalation=True), "restricted", "Privilege Escalation"),
    ("runAsNonRoot-unset", lambda p: p["securityContext"].pop("runAsNonRoot"), "restricted", "Running as Non-root"),
    (
        "runAsNonRoot-false-in-container",
        lambda p: _app(p).update(runAsNonRoot=False),
        "restricted",
        "Running as Non-root",
    ),
    ("runAsUser-0", lambda p: _app(p).update(runAsUser=0), "restricted", "Running as Non-root user"),
    ("pod-runAsUser-0", lambda p: p["securityContext"].update(runAsUser=0), "restricted", "Running as Non-root user"),
    ("seccomp-unset", lambda p: p["securityContext"].pop("seccompProfile"), "restricted", "Seccomp"),
    ("capabilities-not-dropped", lambda p: _app(p).pop("capabilities"), "restricted", "Capabilities"),
    ("cap-add-chown", lambda p: _app(p)["capabilities"].update(add=["CHOWN"]), "restricted", "Capabilities"),
]


def test_a_restricted_pod_passes_every_level() -> None:
    for level in ("privileged", "baseline", "restricted"):
        assert check_pod_spec({}, restricted_pod(), level) == []


@pytest.mark.parametrize(("mutate", "level", "control"), [m[1:] for m in MUTATIONS], ids=[m[0] for m in MUTATIONS])
def test_each_control_is_caught(mutate: Callable[[Pod], None], level: str, control: str) -> None:
    pod = copy.deepcopy(restricted_pod())
    mutate(pod)
    restricted = check_pod_spec({}, pod, "restricted")
    assert control in {v.control for v in restricted}, restricted
    if level == "baseline":
        assert control in {v.control for v in check_pod_spec({}, pod, "baseline")}
    else:
        assert check_pod_spec({}, pod, "baseline") == [], "a restricted-only control leaked into baseline"
    assert check_pod_spec({}, pod, "privileged") == []


def test_container_level_settings_can_stand_in_for_pod_level() -> None:
    pod = restricted_pod()
    pod["securityContext"] = {}
    _app(pod).update(runAsNonRoot=True, seccompProfile={"type": "RuntimeDefault"})
    assert check_pod_spec({}, pod, "restricted") == []


def test_apparmor_annotation() -> None:
    meta = {"annotations": {"container.apparmor.security.beta.kubernetes.io/app": "unconfined"}}
    assert [v.control for v in check_pod_spec(meta, restricted_pod(), "baseline")] == ["AppArmor"]


def test_workloads_are_checked_through_their_template() -> None:
    pod = restricted_pod()
    pod["hostNetwork"] = True
    template = {"metadata": {"labels": {"a": "b"}}, "spec": pod}
    for obj in (
        {"kind": "Deployment", "spec": {"template": template}},
        {"kind": "DaemonSet", "spec": {"template": template}},
        {"kind": "CronJob", "spec": {"jobTemplate": {"spec": {"template": template}}}},
        {"kind": "Pod", "metadata": {}, "spec": pod},
    ):
        assert pod_template(obj) is not None
        assert [v.control for v in check(obj, "baseline")] == ["Host Namespaces"]
    assert pod_template({"kind": "Service", "spec": {}}) is None
    assert check({"kind": "Service", "spec": {}}, "restricted") == []
