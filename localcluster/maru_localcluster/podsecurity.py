"""The Pod Security Standards (``baseline`` and ``restricted``), checked on a pod spec offline.

What kube-apiserver's PodSecurity admission enforces for a namespace labelled
``pod-security.kubernetes.io/enforce: <level>``, written from the published standard (Kubernetes 1.33
policy version): the controls, the fields each one reads, and the values it allows. ``privileged``
allows everything. Windows-only exemptions are not modelled (no pod of this product runs on Windows).

A workload (Deployment, DaemonSet, StatefulSet, Job, CronJob, ReplicaSet) is checked through its pod
template, as the admission plugin does when it warns about a workload it admits.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

Level = Literal["privileged", "baseline", "restricted"]
JsonObj = dict[str, Any]

BASELINE_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    }
)
RESTRICTED_ADDABLE_CAPABILITIES = frozenset({"NET_BIND_SERVICE"})
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
SAFE_SYSCTLS = frozenset(
    {
        "kernel.shm_rmid_forced",
        "net.ipv4.ip_local_port_range",
        "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range",
        "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time",
        "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
        "net.ipv4.tcp_rmem",
        "net.ipv4.tcp_wmem",
    }
)
RESTRICTED_VOLUME_TYPES = frozenset(
    {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
)
_ALLOWED_SECCOMP = frozenset({"RuntimeDefault", "Localhost"})
_APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"
_WORKLOAD_KINDS = frozenset({"Deployment", "DaemonSet", "StatefulSet", "ReplicaSet", "Job"})


@dataclass(frozen=True)
class Violation:
    """One control a pod fails: the control's name (as the standard names it) and what broke it."""

    control: str
    detail: str

    def __str__(self) -> str:
        return f"{self.control}: {self.detail}"


def pod_template(obj: JsonObj) -> tuple[JsonObj, JsonObj] | None:
    """(pod metadata, pod spec) of a Pod or a workload's template; None for other kinds."""
    kind = obj.get("kind")
    if kind == "Pod":
        return obj.get("metadata") or {}, obj.get("spec") or {}
    if kind == "CronJob":
        template = (((obj.get("spec") or {}).get("jobTemplate") or {}).get("spec") or {}).get("template") or {}
    elif kind in _WORKLOAD_KINDS:
        template = (obj.get("spec") or {}).get("template") or {}
    else:
        return None
    return template.get("metadata") or {}, template.get("spec") or {}


def _containers(spec: JsonObj) -> Iterator[tuple[str, JsonObj]]:
    for field in ("initContainers", "containers", "ephemeralContainers"):
        for container in spec.get(field) or []:
            yield f"{field}[{container.get('name', '?')}]", container


def _security(container: JsonObj) -> JsonObj:
    return container.get("securityContext") or {}


def _baseline(meta: JsonObj, spec: JsonObj) -> Iterator[Violation]:
    pod_sc = spec.get("securityContext") or {}
    containers = list(_containers(spec))

    hostprocess = [where for where, c in containers if (_security(c).get("windowsOptions") or {}).get("hostProcess")]
    if (pod_sc.get("windowsOptions") or {}).get("hostProcess"):
        hostprocess.insert(0, "pod")
    if hostprocess:
        yield Violation("HostProcess", "hostProcess: true in " + ", ".join(hostprocess))

    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            yield Violation("Host Namespaces", f"{field}: true")

    for where, c in containers:
        if _security(c).get("privileged"):
            yield Violation("Privileged Containers", f"{where} is privileged")
        added = set((_security(c).get("capabilities") or {}).get("add") or []) - BASELINE_CAPABILITIES
        if added:
            yield Violation("Capabilities", f"{where} adds {sorted(added)}")
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                yield Violation("Host Ports", f"{where} uses hostPort {port['hostPort']}")
        if _security(c).get("procMount") not in (None, "Default"):
            yield Violation("/proc Mount Type", f"{where} sets procMount {_security(c)['procMount']}")

    for volume in spec.get("volumes") or []:
        if "hostPath" in volume:
            yield Violation("HostPath Volumes", f"volume {volume.get('name')} is a hostPath ({volume['hostPath']})")

    for where, context in [("pod", pod_sc), *((w, _security(c)) for w, c in containers)]:
        apparmor = (context.get("appArmorProfile") or {}).get("type")
        if apparmor not in (None, "RuntimeDefault", "Localhost"):
            yield Violation("AppArmor", f"{where} sets appArmorProfile {apparmor}")
        selinux = context.get("seLinuxOptions") or {}
        if selinux.get("type", "") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
            yield Violation("SELinux", f"{where} sets seLinuxOptions {selinux}")
        if (context.get("seccompProfile") or {}).get("type") == "Unconfined":
            yield Violation("Seccomp", f"{where} sets seccompProfile Unconfined")
    for key, value in (meta.get("annotations") or {}).items():
        if key.startswith(_APPARMOR_ANNOTATION) and value != "runtime/default" and not value.startswith("localhost/"):
            yield Violation("AppArmor", f"annotation {key}: {value}")

    for sysctl in pod_sc.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            yield Violation("Sysctls", f"sysctl {sysctl.get('name')} is not in the safe set")


def _restricted(spec: JsonObj) -> Iterator[Violation]:
    pod_sc = spec.get("securityContext") or {}
    containers = list(_containers(spec))

    for volume in spec.get("volumes") or []:
        types = set(volume) - {"name"}
        if not types <= RESTRICTED_VOLUME_TYPES:
            yield Violation("Volume Types", f"volume {volume.get('name')} is of type {sorted(types)}")

    pod_nonroot = pod_sc.get("runAsNonRoot")
    for where, c in containers:
        sc = _security(c)
        if sc.get("allowPrivilegeEscalation") is not False:
            yield Violation("Privilege Escalation", f"{where} does not set allowPrivilegeEscalation: false")
        nonroot = sc.get("runAsNonRoot")
        if nonroot is False or (nonroot is None and pod_nonroot is not True):
            yield Violation("Running as Non-root", f"{where} may run as root (runAsNonRoot is not true)")
        if sc.get("runAsUser") == 0:
            yield Violation("Running as Non-root user", f"{where} sets runAsUser: 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type")
        if seccomp is None and (pod_sc.get("seccompProfile") or {}).get("type") not in _ALLOWED_SECCOMP:
            yield Violation("Seccomp", f"{where} has no RuntimeDefault or Localhost seccomp profile")
        capabilities = sc.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            yield Violation("Capabilities", f"{where} does not drop ALL capabilities")
        added = set(capabilities.get("add") or []) - RESTRICTED_ADDABLE_CAPABILITIES
        if added:
            yield Violation("Capabilities", f"{where} adds {sorted(added)} (only NET_BIND_SERVICE may be added)")
    if pod_sc.get("runAsUser") == 0:
        yield Violation("Running as Non-root user", "pod sets runAsUser: 0")


def check_pod_spec(meta: JsonObj, spec: JsonObj, level: Level) -> list[Violation]:
    """Every control of ``level`` that this pod fails (empty: the pod is admitted)."""
    if level == "privileged":
        return []
    violations = list(_baseline(meta, spec))
    if level == "restricted":
        violations += _restricted(spec)
    return violations


def check(obj: JsonObj, level: Level) -> list[Violation]:
    """Violations of a Pod or a workload's pod template; an object with no pod passes."""
    found = pod_template(obj)
    if found is None:
        return []
    return check_pod_spec(*found, level)
