"""Pod volumes as the kubelet provides them, one handler per volume type.

A handler turns a pod's volume into a directory (or file) on this machine, in the kubelet's own
mount namespace, which ``podrun`` then binds into each container at its ``volumeMounts``.
``HANDLERS`` is the table; a CSI handler (NodePublishVolume over the plugin's gRPC socket) is one
more entry, registered with :func:`register`.

* ``hostPath``: a path under the node's root folder (``<node root>/<path>``), with the kubelet's
  type checks (``DirectoryOrCreate`` creates it, ``Directory`` must exist, ``CharDevice`` accepts
  the regular files the node declares as stand-ins for devices such as ``/dev/dax0.0``).
* ``emptyDir``: a directory in the pod's folder; ``medium: Memory`` is a tmpfs of exactly
  ``sizeLimit`` (without one: the pod's memory limit, else the machine's memory), as the kubelet
  mounts it since SizeMemoryBackedVolumes.
* ``configMap``, ``secret``, ``downwardAPI``, ``projected`` (a service account token from the
  TokenRequest API, bound to the pod; its CA and namespace): files written once when the pod starts
  (no live updates, no token refresh: the API server extends the default 3607 s tokens, as
  kube-apiserver does).
* ``persistentVolumeClaim``: the claim's folder on the cluster's shared filesystem
  (``<cluster>/persistent-volumes/<namespace>/<claim>-<uid>``, the same on every node, as an NFS export
  is), once the claim is Bound; with the pod's ``fsGroup`` the folder's group is set to it and made
  group-writable (setgid), as the kubelet does for volumes that support ownership management.
* ``csi`` (inline ephemeral volumes): NodePublishVolume / NodeUnpublishVolume over the gRPC socket of
  the driver's node plugin, which the kubelet runs on its node (see ``kubelet.py``), if the driver's
  CSIDriver object allows ``Ephemeral``; with ``podInfoOnMount`` the pod's name, namespace, uid and
  service account go into the volume context, as the kubelet sends them. The node's filesystem is a
  folder here, so attributes a plugin declares as node paths are given inside that folder.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from maru_localcluster.apiclient import ApiClient, ApiError
from maru_localcluster.podrun import MS_NODEV, MS_NOSUID, SetupError, mount, umount
from maru_operator.quantity import parse_quantity

JsonObj = dict[str, Any]


class MountError(Exception):
    """A volume cannot be set up (FailedMount); the kubelet retries until the pod goes away."""


@dataclasses.dataclass(frozen=True)
class CsiPlugin:
    """A CSI node plugin registered with the kubelet: what node-driver-registrar tells a real one."""

    driver: str
    endpoint: str  # unix:///path/csi.sock
    # volumeAttributes holding a node path (a path on the node's filesystem, here under its root folder).
    node_path_attributes: tuple[str, ...] = ()


@dataclasses.dataclass
class PodContext:
    """What a handler may use: the pod, its folder, the node's root, the API, the cluster's CA."""

    pod: JsonObj
    pod_dir: Path
    node_root: Path
    api: ApiClient
    ca_pem: str
    standin_devices: frozenset[str] = frozenset()
    memory_bytes: int = 0  # the machine's memory: the size of a memory emptyDir with no limit
    csi_plugins: dict[str, CsiPlugin] = dataclasses.field(default_factory=dict)  # driver -> its node plugin

    @property
    def namespace(self) -> str:
        return str(self.pod["metadata"]["namespace"])

    def volume_dir(self, kind: str, name: str) -> Path:
        return self.pod_dir / "volumes" / f"kubernetes.io~{kind}" / name


class VolumeHandler(Protocol):
    async def setup(self, ctx: PodContext, volume: JsonObj) -> str:
        """Make the volume and return its path on this machine."""

    async def teardown(self, ctx: PodContext, volume: JsonObj, path: str) -> None:
        """Undo :meth:`setup` once every container of the pod has stopped."""


HANDLERS: dict[str, VolumeHandler] = {}


def register(kind: str, handler: VolumeHandler) -> None:
    HANDLERS[kind] = handler


def volume_kind(volume: JsonObj) -> str:
    kinds = [k for k in volume if k != "name"]
    return kinds[0] if len(kinds) == 1 else "?"


def handler_for(volume: JsonObj) -> VolumeHandler:
    kind = volume_kind(volume)
    if kind not in HANDLERS:
        raise MountError(
            f"volume {volume.get('name')!r}: type {kind!r} is not supported by the local cluster "
            f"(supported: {', '.join(sorted(HANDLERS))})"
        )
    return HANDLERS[kind]


# ---------------------------------------------------------------------------------------- hostPath


_TYPE_CHECKS: dict[str, Callable[[int], bool]] = {
    "Directory": stat.S_ISDIR,
    "File": stat.S_ISREG,
    "Socket": stat.S_ISSOCK,
    "CharDevice": stat.S_ISCHR,
    "BlockDevice": stat.S_ISBLK,
}


class HostPath:
    async def setup(self, ctx: PodContext, volume: JsonObj) -> str:
        spec = volume["hostPath"]
        path, kind = spec["path"], spec.get("type") or ""
        local = ctx.node_root / path.lstrip("/")
        if kind == "DirectoryOrCreate":
            local.mkdir(parents=True, exist_ok=True, mode=0o755)
        elif kind == "FileOrCreate":
            if not local.parent.is_dir():
                raise MountError(f"hostPath {path}: parent directory does not exist on the node")
            local.touch(mode=0o644, exist_ok=True)
        elif kind in _TYPE_CHECKS:
            try:
                mode = os.stat(local).st_mode
            except FileNotFoundError:
                raise MountError(f"hostPath type check failed: {path} does not exist") from None
            standin = kind == "CharDevice" and path in ctx.standin_devices and stat.S_ISREG(mode)
            if not (_TYPE_CHECKS[kind](mode) or standin):
                raise MountError(f"hostPath type check failed: {path} is not a {kind}")
        elif kind == "":
            if not local.exists():  # no check asked: a missing path becomes a directory, as Docker does
                local.mkdir(parents=True)
        else:
            raise MountError(f"hostPath {path}: unknown type {kind!r}")
        return str(local)

    async def teardown(self, ctx: PodContext, volume: JsonObj, path: str) -> None:
        return None  # the node's files outlive the pod


# ---------------------------------------------------------------------------------------- emptyDir


def memory_limit(pod: JsonObj) -> int | None:
    """The pod's memory limit when every container has one (what bounds a memory emptyDir without sizeLimit)."""
    total = 0
    for c in pod.get("spec", {}).get("containers") or []:
        limit = ((c.get("resources") or {}).get("limits") or {}).get("memory")
        if limit is None:
            return None
        total += int(parse_quantity(limit))
    return total or None


class EmptyDir:
    async def setup(self, ctx: PodContext, volume: JsonObj) -> str:
        spec = volume.get("emptyDir") or {}
        local = ctx.volume_dir("empty-dir", volume["name"])
        local.mkdir(parents=True, exist_ok=True)
        os.chmod(local, 0o777)
        if spec.get("medium") == "Memory" and not os.path.ismount(local):
            if spec.get("sizeLimit") is not None:
                size = int(parse_quantity(spec["sizeLimit"]))
            else:
                size = memory_limit(ctx.pod) or ctx.memory_bytes
            try:
                mount("tmpfs", str(local), "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode=1777")
            except SetupError as err:
                raise MountError(f"emptyDir {volume['name']}: {err}") from None
        elif spec.get("medium") not in (None, "", "Memory"):
            raise MountError(f"emptyDir {volume['name']}: medium {spec.get('medium')!r} is not supported")
        return str(local)

    async def teardown(self, ctx: PodContext, volume: JsonObj, path: str) -> None:
        if os.path.ismount(path):
            umount(path)
        shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------------------- files


def _write_files(target: Path, files: dict[str, tuple[bytes, int]]) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for relative, (content, mode) in files.items():
        path = target / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        os.chmod(path, mode)


async def _object_data(ctx: PodContext, kind: str, name: str, optional: bool) -> dict[str, bytes] | None:
    plural = "configmaps" if kind == "configMap" else "secrets"
    obj = await ctx.api.get(f"/api/v1/namespaces/{ctx.namespace}/{plural}/{name}")
    if obj is None:
        if optional:
            return None
        raise MountError(f'{kind} "{name}" not found in namespace {ctx.namespace}')
    data = (
        {k: v.encode() for k, v in (obj.get("data") or {}).items()}
        if kind == "configMap"
        else {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
    )
    if kind == "configMap":
        data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
    return data


def _select(
    kind: str, name: str, data: dict[str, bytes], items: list[JsonObj] | None, mode: int, optional: bool
) -> dict[str, tuple[bytes, int]]:
    if not items:
        return {k: (v, mode) for k, v in data.items()}
    files = {}
    for item in items:
        if item["key"] not in data:
            if optional:
                continue
            raise MountError(f'{kind} "{name}": key {item["key"]!r} not found')
        files[item["path"]] = (data[item["key"]], item.get("mode", mode))
    return files


def field_value(pod: JsonObj, field_path: str) -> str:
    """A downward-API ``fieldRef``: metadata.name, metadata.labels['x'], status.podIP, spec.nodeName..."""
    meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {})
    for prefix, source in (("metadata.labels", meta.get("labels")), ("metadata.annotations", meta.get("annotations"))):
        if field_path == prefix:
            return "\n".join(f'{k}="{v}"' for k, v in sorted((source or {}).items()))
        if field_path.startswith(prefix + "['") and field_path.endswith("']"):
            return str((source or {}).get(field_path[len(prefix) + 2 : -2], ""))
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.hostIP": status.get("hostIP"),
        "status.podIP": status.get("podIP"),
        "status.hostIPs": ",".join(a["ip"] for a in status.get("hostIPs") or []),
        "status.podIPs": ",".join(a["ip"] for a in status.get("podIPs") or []),
    }
    if field_path not in simple:
        raise MountError(f"fieldRef {field_path!r} is not supported")
    return str(simple[field_path] or "")


async def service_account_token(ctx: PodContext, source: JsonObj) -> str:
    """A token from the TokenRequest API, bound to the pod, as the kubelet gets one for a projected volume."""
    meta, spec = ctx.pod["metadata"], ctx.pod.get("spec") or {}
    account = spec.get("serviceAccountName") or "default"
    request = {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {
            "audiences": [source["audience"]] if source.get("audience") else [],
            "expirationSeconds": int(source.get("expirationSeconds", 3600)),
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta.get("uid")},
        },
    }
    try:
        answer = await ctx.api.create(f"/api/v1/namespaces/{ctx.namespace}/serviceaccounts/{account}/token", request)
    except ApiError as err:
        raise MountError(f'cannot get a token for service account "{account}": {err}') from None
    return str(answer["status"]["token"])


class ObjectVolume:
    """``configMap`` and ``secret`` volumes."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    async def setup(self, ctx: PodContext, volume: JsonObj) -> str:
        spec = volume[self.kind]
        name = spec.get("name") if self.kind == "configMap" else spec.get("secretName")
        optional = bool(spec.get("optional"))
        data = await _object_data(ctx, self.kind, name, optional) or {}
        local = ctx.volume_dir(self.kind.lower(), volume["name"])
        _write_files(local, _select(self.kind, name, data, spec.get("items"), spec.get("defaultMode", 0o644), optional))
        return str(local)

    async def teardown(self, ctx: PodContext, volume: JsonObj, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)


def _downward_files(pod: JsonObj, items: list[JsonObj], mode: int) -> dict[str, tuple[bytes, int]]:
    files = {}
    for item in items or []:
        if "fieldRef" in item:
            files[item["path"]] = (field_value(pod, item["fieldRef"]["fieldPath"]).encode(), item.get("mode", mode))
        else:
            raise MountError(f"downwardAPI item {item.get('path')!r}: only fieldRef is supported")
    return files


class DownwardApi:
    async def setup(self, ctx: PodContext, volume: JsonObj) -> str:
        spec = volume["downwardAPI"]
        local = ctx.volume_dir("downward-api", volume["name"])
        _write_files(local, _downward_files(ctx.pod, spec.get("items") or [], spec.get("defaultMode", 0o644)))
        return str(local)

    async def teardown(self, ctx: PodContext, volume: JsonObj, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)


class Projected:
    async def setup(self, ctx: PodContext, volume: JsonObj) -> str:
        spec = volume["projected"]
        mode = spec.get("defaultMode", 0o644)
        files: dict[str, tuple[bytes, int]] = {}
        for source in spec.get("sources") or []:
            if "serviceAccountToken" in source:
                token = source["serviceAccountToken"]
                files[token["path"]] = ((await service_account_token(ctx, token)).encode(), mode)
            elif "configMap" in source or "secret" in source:
                kind = "configMap" if "configMap" in source else "secret"
                ref = source[kind]
                optional = bool(ref.get("optional"))
                data = await _object_data(ctx, kind, ref["name"], optional) or {}
                files.update(_select(kind, ref["name"], data, ref.get("items"), mode, optional))
            elif "downwardAPI" in source:
                files.update(_downward_files(ctx.pod, source["downwardAPI"].get("items") or [], mode))
            else:
                raise MountError(f"projected volume {volume['name']!r}: source {sorted(source)} is not supported")
        local = ctx.volume_dir("projected", volume["name"])
        _write_files(local, files)
        return str(local)

    async def teardown(self, ctx: PodContext, volume: JsonObj, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)


class Csi:
    """Inline ephemeral CSI volumes, published by the driver's node plugin."""

    @staticmethod
    def _ids(ctx: PodContext, volume: JsonObj) -> tuple[str, Path]:
        uid = ctx.pod["metadata"]["uid"]
        volume_id = "csi-" + hashlib.sha256(f"{uid}/{volume['name']}".encode()).hexdigest()
        return volume_id, ctx.volume_dir("csi", volume["name"]) / "mount"

    @staticmethod
    async def _call(plugin: CsiPlugin, method: str, request: Any, volume: str) -> None:
        import grpc

        from maru_csi import csi_pb2_grpc

        async with grpc.aio.insecure_channel(plugin.endpoint) as channel:
            try:
                await getattr(csi_pb2_grpc.NodeStub(channel), method)(request, timeout=30)
            except grpc.aio.AioRpcError as err:
                raise MountError(
                    f"kubernetes.io/csi: {method} failed for volume {volume!r}: rpc error: "
                    f"code = {err.code().name} desc = {err.details()}"
                ) from None

    async def setup(self, ctx: PodContext, volume: JsonObj) -> str:
        from maru_csi import csi_pb2

        spec = volume["csi"]
        driver = spec.get("driver", "")
        plugin = ctx.csi_plugins.get(driver)
        if plugin is None:
            raise MountError(
                f"kubernetes.io/csi: driver name {driver} not found in the list of registered CSI "
                f"drivers (registered: {', '.join(sorted(ctx.csi_plugins)) or 'none'})"
            )
        csidriver = await ctx.api.get(f"/apis/storage.k8s.io/v1/csidrivers/{driver}")
        modes = ((csidriver or {}).get("spec") or {}).get("volumeLifecycleModes") or ["Persistent"]
        if "Ephemeral" not in modes:
            raise MountError(
                f'volume mode "Ephemeral" not supported by driver {driver} '
                f"({'no CSIDriver object' if csidriver is None else 'CSIDriver ' + str(modes)})"
            )
        context = dict(spec.get("volumeAttributes") or {})
        for key in plugin.node_path_attributes:
            if key in context:
                context[key] = str(ctx.node_root / context[key].lstrip("/"))
        context["csi.storage.k8s.io/ephemeral"] = "true"
        if (csidriver.get("spec") or {}).get("podInfoOnMount"):
            meta = ctx.pod["metadata"]
            context.update(
                {
                    "csi.storage.k8s.io/pod.name": meta["name"],
                    "csi.storage.k8s.io/pod.namespace": meta["namespace"],
                    "csi.storage.k8s.io/pod.uid": meta["uid"],
                    "csi.storage.k8s.io/serviceAccount.name": ctx.pod["spec"].get("serviceAccountName") or "default",
                }
            )
        volume_id, target = self._ids(ctx, volume)
        target.parent.mkdir(parents=True, exist_ok=True)
        request = csi_pb2.NodePublishVolumeRequest(
            volume_id=volume_id,
            target_path=str(target),
            readonly=bool(spec.get("readOnly")),
            volume_capability=csi_pb2.VolumeCapability(
                mount=csi_pb2.VolumeCapability.MountVolume(fs_type=spec.get("fsType", "")),
                access_mode=csi_pb2.VolumeCapability.AccessMode(
                    mode=csi_pb2.VolumeCapability.AccessMode.SINGLE_NODE_WRITER
                ),
            ),
            volume_context=context,
        )
        await self._call(plugin, "NodePublishVolume", request, volume["name"])
        return str(target)

    async def teardown(self, ctx: PodContext, volume: JsonObj, path: str) -> None:
        from maru_csi import csi_pb2

        plugin = ctx.csi_plugins.get(volume["csi"].get("driver", ""))
        if plugin is None:
            return
        volume_id, target = self._ids(ctx, volume)
        await self._call(
            plugin,
            "NodeUnpublishVolume",
            csi_pb2.NodeUnpublishVolumeRequest(volume_id=volume_id, target_path=str(target)),
            volume["name"],
        )


class PersistentVolumeClaimVolume:
    @staticmethod
    def storage_root(ctx: PodContext) -> Path:
        # <cluster>/nodes/<node>/root: the cluster's folder is three up.
        return ctx.node_root.parents[2] / "persistent-volumes"

    async def setup(self, ctx: PodContext, volume: JsonObj) -> str:
        source = volume["persistentVolumeClaim"]
        name = source.get("claimName", "")
        claim = await ctx.api.get(f"/api/v1/namespaces/{ctx.namespace}/persistentvolumeclaims/{name}")
        if claim is None:
            raise MountError(f'persistentvolumeclaim "{name}" not found')
        if (claim.get("status") or {}).get("phase") != "Bound":
            raise MountError(f'persistentvolumeclaim "{name}" is not bound yet')
        path = self.storage_root(ctx) / ctx.namespace / f"{name}-{claim['metadata']['uid']}"
        path.mkdir(parents=True, exist_ok=True)
        group = (ctx.pod["spec"].get("securityContext") or {}).get("fsGroup")
        if group is not None:
            os.chown(path, -1, int(group))
            os.chmod(path, 0o2775)
        return str(path)

    async def teardown(self, ctx: PodContext, volume: JsonObj, path: str) -> None:
        """The claim's data outlives the pod."""


register("hostPath", HostPath())
register("csi", Csi())
register("emptyDir", EmptyDir())
register("configMap", ObjectVolume("configMap"))
register("secret", ObjectVolume("secret"))
register("downwardAPI", DownwardApi())
register("projected", Projected())
register("persistentVolumeClaim", PersistentVolumeClaimVolume())

__all__ = [
    "HANDLERS",
    "CsiPlugin",
    "MountError",
    "PodContext",
    "VolumeHandler",
    "field_value",
    "handler_for",
    "register",
]
