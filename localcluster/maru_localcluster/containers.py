"""From a pod's container to the spec ``podrun`` starts: command, environment, user, mounts.

What the kubelet and the container runtime decide together: the image's entrypoint and environment
under the pod's command, args and env (``$(VAR)`` expanded, ``valueFrom`` resolved), the user from
``securityContext`` over the image's (refusing root under ``runAsNonRoot``, as the kubelet does),
capabilities, and the mounts: the pod's volumes, its ``/etc/hosts``, ``/etc/hostname``,
``/etc/resolv.conf`` and ``/dev/shm``.
"""

from __future__ import annotations

import base64
import dataclasses
import math
import os
from collections.abc import Awaitable, Callable
from typing import Any

from maru_localcluster.images import Image, container_argv, expand
from maru_localcluster.imagestore import home_of
from maru_localcluster.volumes import MountError, field_value
from maru_operator.quantity import parse_quantity

JsonObj = dict[str, Any]
# (kind "configMap" or "secret", namespace, name) -> its data as text, or None when it does not exist.
Lookup = Callable[[str, str, str], Awaitable[dict[str, str] | None]]


class ContainerConfigError(Exception):
    """What the kubelet reports as CreateContainerConfigError: the container cannot be created as specified."""


@dataclasses.dataclass(frozen=True)
class Sandbox:
    """The pod-level facts every container of a pod shares."""

    pod: JsonObj
    pod_ip: str
    netns: str | None  # the pod's network namespace (/proc/<sandbox pid>/ns/net); None: the node's (hostNetwork)
    hostname: str
    hosts_file: str
    hostname_file: str
    resolv_file: str
    shm_dir: str
    volume_paths: dict[str, str]  # volume name -> path on this machine
    services: list[JsonObj]  # the Services of the pod's namespace (for service links)
    kubernetes_service: tuple[str, int] | None
    node_cpus: int
    node_memory: int


def _service_env(services: list[JsonObj]) -> dict[str, str]:
    """Docker-link style variables of every Service, as the kubelet sets with enableServiceLinks."""
    env: dict[str, str] = {}
    for svc in services:
        spec = svc.get("spec") or {}
        ip = spec.get("clusterIP")
        if not ip or ip == "None" or not spec.get("ports"):
            continue
        name = svc["metadata"]["name"].upper().replace("-", "_")
        first = spec["ports"][0]
        env[f"{name}_SERVICE_HOST"] = ip
        env[f"{name}_SERVICE_PORT"] = str(first["port"])
        env[f"{name}_PORT"] = f"{first.get('protocol', 'TCP').lower()}://{ip}:{first['port']}"
        for port in spec["ports"]:
            proto = port.get("protocol", "TCP")
            if port.get("name"):
                env[f"{name}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}"] = str(port["port"])
            prefix = f"{name}_PORT_{port['port']}_{proto}"
            env[prefix] = f"{proto.lower()}://{ip}:{port['port']}"
            env[f"{prefix}_PROTO"] = proto.lower()
            env[f"{prefix}_PORT"] = str(port["port"])
            env[f"{prefix}_ADDR"] = ip
    return env


def _kubernetes_env(service: tuple[str, int]) -> dict[str, str]:
    host, port = service
    return {
        "KUBERNETES_SERVICE_HOST": host,
        "KUBERNETES_SERVICE_PORT": str(port),
        "KUBERNETES_SERVICE_PORT_HTTPS": str(port),
        "KUBERNETES_PORT": f"tcp://{host}:{port}",
        f"KUBERNETES_PORT_{port}_TCP": f"tcp://{host}:{port}",
        f"KUBERNETES_PORT_{port}_TCP_PROTO": "tcp",
        f"KUBERNETES_PORT_{port}_TCP_PORT": str(port),
        f"KUBERNETES_PORT_{port}_TCP_ADDR": host,
    }


def _resource_value(container: JsonObj, ref: JsonObj, box: Sandbox) -> str:
    kind, _, resource = ref["resource"].partition(".")
    amount = ((container.get("resources") or {}).get(kind) or {}).get(resource)
    divisor = parse_quantity(ref.get("divisor") or "1")
    node_total = box.node_cpus if resource == "cpu" else box.node_memory
    value = node_total if amount is None else parse_quantity(amount)
    return str(math.ceil(value / divisor))


async def _value_from(source: JsonObj, container: JsonObj, box: Sandbox, lookup: Lookup) -> str | None:
    if "fieldRef" in source:
        try:
            return field_value(box.pod, source["fieldRef"]["fieldPath"])
        except MountError as err:
            raise ContainerConfigError(str(err)) from None
    if "resourceFieldRef" in source:
        return _resource_value(container, source["resourceFieldRef"], box)
    for kind, key in (("configMap", "configMapKeyRef"), ("secret", "secretKeyRef")):
        if key in source:
            ref = source[key]
            data = await lookup(kind, box.pod["metadata"]["namespace"], ref["name"])
            if data is None or ref["key"] not in data:
                if ref.get("optional"):
                    return None
                what = f'{kind} "{ref["name"]}"' if data is None else f'key "{ref["key"]}" in {kind} "{ref["name"]}"'
                raise ContainerConfigError(f"couldn't find {what}")
            return data[ref["key"]]
    raise ContainerConfigError(f"env valueFrom {sorted(source)} is not supported")


async def container_env(container: JsonObj, image: Image, box: Sandbox, lookup: Lookup) -> dict[str, str]:
    env = dict(image.env)
    env["HOSTNAME"] = box.hostname
    if box.kubernetes_service:
        env.update(_kubernetes_env(box.kubernetes_service))
    if (box.pod.get("spec") or {}).get("enableServiceLinks", True):
        env.update(_service_env(box.services))
    for source in container.get("envFrom") or []:
        kind = "configMap" if "configMapRef" in source else "secret"
        ref = source.get("configMapRef") or source.get("secretRef") or {}
        data = await lookup(kind, box.pod["metadata"]["namespace"], ref["name"])
        if data is None:
            if ref.get("optional"):
                continue
            raise ContainerConfigError(f'{kind} "{ref["name"]}" not found')
        env.update({source.get("prefix", "") + k: v for k, v in data.items()})
    for var in container.get("env") or []:
        if "valueFrom" in var:
            value = await _value_from(var["valueFrom"], container, box, lookup)
            if value is None:
                continue
        else:
            value = expand(var.get("value", ""), env)
        env[var["name"]] = value
    return env


@dataclasses.dataclass(frozen=True)
class Identity:
    uid: int
    gid: int
    groups: list[int]


def identity(pod: JsonObj, container: JsonObj, image: Image) -> Identity:
    pod_sc = (pod.get("spec") or {}).get("securityContext") or {}
    sc = container.get("securityContext") or {}

    def pick(key: str, default: Any) -> Any:
        return sc[key] if sc.get(key) is not None else pod_sc[key] if pod_sc.get(key) is not None else default

    uid, gid = int(pick("runAsUser", image.uid)), int(pick("runAsGroup", image.gid))
    name = image.user.partition(":")[0]
    if pick("runAsNonRoot", False) and pick("runAsUser", None) is None and name and not name.isdigit():
        raise ContainerConfigError(
            f"container has runAsNonRoot and image has non-numeric user ({name}), cannot verify user is non-root "
            f"(pod: {pod['metadata']['name']!r}, container: {container['name']!r})"
        )
    if pick("runAsNonRoot", False) and uid == 0:
        raise ContainerConfigError(
            "container has runAsNonRoot and image will run as root "
            f"(pod: {pod['metadata']['name']!r}, container: {container['name']!r})"
        )
    groups = [int(g) for g in pod_sc.get("supplementalGroups") or []]
    if pod_sc.get("fsGroup") is not None:
        groups.append(int(pod_sc["fsGroup"]))
    return Identity(uid, gid, groups)


def podrun_spec(
    container: JsonObj, image: Image, env: dict[str, str], box: Sandbox, *, layers: dict[str, str], pid_file: str
) -> JsonObj:
    """The JSON ``podrun run`` takes."""
    who = identity(box.pod, container, image)
    argv = [expand(a, env) for a in container_argv(container, image)]
    if not argv:
        raise ContainerConfigError(f"container {container['name']!r}: no command, and the image has no entrypoint")
    if "HOME" not in env:
        env = {**env, "HOME": home_of(who.uid, layers["lower"])}
    mounts: list[JsonObj] = [
        {"kind": "bind", "source": box.hosts_file, "target": "/etc/hosts"},
        {"kind": "bind", "source": box.hostname_file, "target": "/etc/hostname"},
        {"kind": "bind", "source": box.resolv_file, "target": "/etc/resolv.conf"},
        {"kind": "bind", "source": box.shm_dir, "target": "/dev/shm"},
    ]
    for m in container.get("volumeMounts") or []:
        if m["name"] not in box.volume_paths:
            raise ContainerConfigError(f"volumeMount {m['name']!r}: no volume of that name in the pod")
        source = box.volume_paths[m["name"]]
        if m.get("subPath"):
            source = os.path.join(source, m["subPath"])
            os.makedirs(source, exist_ok=True)
        mounts.append({"kind": "bind", "source": source, "target": m["mountPath"], "readonly": bool(m.get("readOnly"))})
    sc = container.get("securityContext") or {}
    privileged = bool(sc.get("privileged"))
    return {
        "argv": argv,
        "env": env,
        "cwd": container.get("workingDir") or image.workdir,
        "uid": who.uid,
        "gid": who.gid,
        "groups": who.groups,
        "hostname": box.hostname,
        "rootfs": layers,
        "readonly_root": bool(sc.get("readOnlyRootFilesystem")),
        "mounts": mounts,
        "capabilities": {"privileged": privileged, **(sc.get("capabilities") or {})},
        "no_new_privs": sc.get("allowPrivilegeEscalation") is False and not privileged,
        "pid_file": pid_file,
        "netns": box.netns,
    }


def decode_secret(data: dict[str, str]) -> dict[str, str]:
    return {k: base64.b64decode(v).decode(errors="replace") for k, v in data.items()}
