"""The plugin's Identity and Node services: publish a pool's socket directory, or a pool credential, into a pod.

NodePublishVolume bind-mounts ``<socket root>/<pool>`` read-only at the target path the kubelet gives, or,
for a credential volume (attribute ``cache``), mounts a small tmpfs there holding the token it mints for
the cache in the pod's namespace (:mod:`.minting`); NodeUnpublishVolume unmounts either and removes the
target directory. Both are idempotent and keep no
state: what is published is read back from the mount table, so a restarted plugin unpublishes what
an earlier one published. Errors carry the gRPC codes of the CSI specification and a message that
names the field and the fix, since the kubelet shows it in the pod's events (``FailedMount``).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf import wrappers_pb2

from maru_common.files import replace_file
from maru_contracts import tenancy
from maru_contracts.csi import (
    ATTR_CACHE,
    ATTR_POOL,
    ATTR_QUOTA,
    ATTR_SOCKET_DIR,
    ATTRIBUTES,
    CREDENTIAL_ONLY,
    DRIVER_NAME,
    EPHEMERAL,
    POD_INFO_PREFIX,
    POD_NAME,
    POD_NAMESPACE,
    POD_SERVICE_ACCOUNT,
    TOKEN_FILE,
    cache_error,
    pool_dir_error,
)

from . import admission, csi_pb2, csi_pb2_grpc, minting, mounts

log = logging.getLogger("maru_csi")

Mode = csi_pb2.VolumeCapability.AccessMode.Mode


class CsiError(Exception):
    """A request the plugin refuses, with the gRPC status code the CSI specification assigns."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _invalid(message: str) -> CsiError:
    return CsiError(grpc.StatusCode.INVALID_ARGUMENT, message)


Response = TypeVar("Response")


def _answers_errors(method: Callable[..., Response]) -> Callable[..., Response]:
    """Turn a CsiError into the call's gRPC status; anything else is INTERNAL, logged with its trace."""

    @functools.wraps(method)
    def call(self: Any, request: Any, context: grpc.ServicerContext) -> Response:
        try:
            return method(self, request, context)
        except CsiError as err:
            log.warning("%s refused (%s): %s", method.__name__, err.code.name, err.message)
            context.abort(err.code, err.message)
        except Exception as err:
            log.exception("%s failed", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{method.__name__}: {err}")
        raise AssertionError("unreachable: context.abort raises")

    return call


def vendor_version() -> str:
    try:
        return metadata.version("maru-pd")
    except metadata.PackageNotFoundError:
        return "unknown"


class IdentityService(csi_pb2_grpc.IdentityServicer):
    def __init__(self, socket_root: Path) -> None:
        self.socket_root = socket_root

    def GetPluginInfo(self, request: Any, context: grpc.ServicerContext) -> csi_pb2.GetPluginInfoResponse:
        return csi_pb2.GetPluginInfoResponse(name=DRIVER_NAME, vendor_version=vendor_version())

    def GetPluginCapabilities(
        self, request: Any, context: grpc.ServicerContext
    ) -> csi_pb2.GetPluginCapabilitiesResponse:
        # Node service only: no controller (nothing to provision or attach), no topology.
        return csi_pb2.GetPluginCapabilitiesResponse()

    @_answers_errors
    def Probe(self, request: Any, context: grpc.ServicerContext) -> csi_pb2.ProbeResponse:
        if not self.socket_root.is_dir():
            raise CsiError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"socket root {self.socket_root} is not a directory: the plugin's host mount is missing",
            )
        return csi_pb2.ProbeResponse(ready=wrappers_pb2.BoolValue(value=True))


@dataclass(frozen=True)
class Publication:
    """A checked NodePublishVolume: which pool directory (or which minted credential) goes where, for which pod."""

    volume_id: str
    pool: str
    source: str
    target: str
    pod: str  # namespace/name, or "" when the kubelet sends no pod info
    token: str = field(default="", repr=False)  # a credential volume's minted token; never logged
    credential: str = ""  # the token's principal and quota, for the log (no secret in it)

    def describe(self) -> str:
        pod = f" pod={self.pod}" if self.pod else ""
        what = f"credential={self.credential}" if self.token else f"source={self.source}"
        return f"volume={self.volume_id} pool={self.pool} {what} target={self.target}{pod}"


def _target(path: str) -> str:
    if not path:
        raise _invalid("target_path is required")
    if not os.path.isabs(path) or os.path.normpath(path) != path.rstrip("/"):
        raise _invalid(f"target_path {path!r} must be an absolute, normalized path below /")
    return path.rstrip("/")


def _check_capability(request: csi_pb2.NodePublishVolumeRequest) -> None:
    if not request.HasField("volume_capability"):
        raise _invalid("volume_capability is required")
    capability = request.volume_capability
    if capability.HasField("block"):
        raise _invalid("block access is not supported: the volume is a directory holding the pool socket")
    if capability.access_mode.mode == Mode.UNKNOWN:
        raise _invalid("volume_capability.access_mode is required")
    if capability.mount.fs_type:
        raise _invalid(
            f"fsType {capability.mount.fs_type!r} is not supported: the volume is a bind mount of a directory; "
            "leave spec.volumes[].csi.fsType unset"
        )
    if capability.mount.mount_flags:
        raise _invalid("mount flags are not supported: the volume is always mounted read-only, nosuid, nodev, noexec")
    if not request.readonly:
        raise _invalid(
            "the pool socket directory is published read-only: set readOnly: true on the pod's csi volume "
            "(spec.volumes[].csi.readOnly); clients connect to the socket, they never write the directory"
        )


def check_publish(request: csi_pb2.NodePublishVolumeRequest, socket_root: Path) -> Publication:
    """Validate a publish request and find the pool directory it names; raise CsiError when it is wrong."""
    if not request.volume_id:
        raise _invalid("volume_id is required")
    target = _target(request.target_path)
    _check_capability(request)
    context = dict(request.volume_context)
    unknown = sorted(k for k in context if k not in ATTRIBUTES and not k.startswith(POD_INFO_PREFIX))
    if unknown:
        raise _invalid(f"unknown volumeAttributes {unknown}: {DRIVER_NAME} takes {list(ATTRIBUTES)}")
    if ATTR_CACHE not in context and (stray := [k for k in CREDENTIAL_ONLY if k in context]):
        raise _invalid(
            f"volumeAttributes {stray} apply to a credential volume only: set "
            f"volumeAttributes.{ATTR_CACHE} too, or leave them out of a pool socket volume"
        )
    if context.get(EPHEMERAL, "true") != "true":
        raise _invalid(f"{DRIVER_NAME} serves inline ephemeral volumes only (spec.volumes[].csi in a pod)")
    pool = context.get(ATTR_POOL, "")
    error = pool_dir_error(pool)
    if error:
        raise _invalid(error)
    socket_dir = context.get(ATTR_SOCKET_DIR)
    if socket_dir is not None and os.path.normpath(socket_dir) != str(socket_root):
        raise _invalid(
            f"volumeAttributes.{ATTR_SOCKET_DIR} {socket_dir!r} is not this driver's socket root {socket_root}: "
            f"set the MaruPool's spec.daemon.socketDir to {socket_root}, or install the chart with "
            f"csiDriver.socketRoot={socket_dir}"
        )
    source = socket_root / pool
    try:
        mode = os.lstat(source).st_mode
    except FileNotFoundError:
        raise CsiError(
            grpc.StatusCode.NOT_FOUND,
            f"pool {pool!r} has no socket directory {source} on this node: its pool daemon has not started "
            f"here (yet), or the MaruPool's spec.daemon.socketDir is not the driver's socket root {socket_root}",
        ) from None
    if not stat.S_ISDIR(mode):
        raise CsiError(grpc.StatusCode.FAILED_PRECONDITION, f"{source} is not a directory (a pool's socket directory)")
    pod = admission.PodIdentity(
        namespace=context.get(POD_NAMESPACE, ""),
        name=context.get(POD_NAME, ""),
        service_account=context.get(POD_SERVICE_ACCOUNT, ""),
    )
    _admit(pool, str(source), pod)
    described = pod.describe() if pod.name else ""
    if ATTR_CACHE not in context:
        return Publication(request.volume_id, pool, str(source), target, described)
    token, credential = _mint(context, socket_root, pool, pod)
    return Publication(
        request.volume_id, pool, minting.material_path(str(socket_root), pool), target, described, token, credential
    )


def _mint(context: dict[str, str], socket_root: Path, pool: str, pod: admission.PodIdentity) -> tuple[str, str]:
    """The token of ``tenant:<pod namespace>/<cache>``, its quota the request capped by the pool's policy.

    The namespace comes from the kubelet (podInfoOnMount), never from the attributes: whoever writes pods
    in a namespace may name any of its caches (as they may write a group's poolQuota), never another
    namespace's; the pool's maxTenantQuota (unset: its tenantQuota, then the daemon's defaults) binds whatever
    the pod asks for, so a pod cannot raise its own quota.
    """
    cache = context.get(ATTR_CACHE, "")
    error = cache_error(cache)
    if error:
        raise _invalid(error)
    try:
        requested = tenancy.Quota.decode(context.get(ATTR_QUOTA, ""))
    except ValueError as err:
        raise _invalid(
            f"volumeAttributes.{ATTR_QUOTA} {context[ATTR_QUOTA]!r} is not a quota: {err}; write "
            "bytes=N,pins=N,leases=N (each optional, in that order, positive whole numbers)"
        ) from None
    if not pod.namespace:
        raise CsiError(
            grpc.StatusCode.FAILED_PRECONDITION,
            "a pool credential is minted for the pod's namespace, and the kubelet sent none: the "
            "CSIDriver csi.maru.io needs podInfoOnMount: true (the chart sets it)",
        )
    try:
        material = minting.read(str(socket_root), pool)
    except minting.MintingError as err:
        raise CsiError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"pool {pool!r}: no usable credential material on this node, so no credential is minted: {err}",
        ) from None
    token, scope = material.mint(pod.namespace, cache, requested)
    return token, f"tenant:{scope} quota={material.quota_for(requested)}"


def _admit(pool: str, source: str, pod: admission.PodIdentity) -> None:
    """Publish only to a pod the pool admits, by the rule its agent wrote beside the socket.

    The rule is read at every publish (no cache): a changed ``allowedNamespaces`` applies to the next pod
    once the node's agent has rewritten the file. Missing or unreadable data refuses (closed).
    """
    try:
        rule = admission.read(source)
    except admission.AdmissionError as err:
        raise CsiError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"pool {pool!r}: no usable admission rule on this node, so no pod is admitted: {err}",
        ) from None
    try:
        rule.check(pod)
    except admission.Refused as err:
        raise CsiError(grpc.StatusCode.PERMISSION_DENIED, str(err)) from None


class NodeService(csi_pb2_grpc.NodeServicer):
    def __init__(self, node_id: str, socket_root: Path) -> None:
        self.node_id = node_id
        self.socket_root = socket_root
        # Publish and unpublish are quick; one at a time keeps check-then-mount free of races when the
        # kubelet retries a call that is still running.
        self._lock = threading.Lock()

    def NodeGetCapabilities(self, request: Any, context: grpc.ServicerContext) -> csi_pb2.NodeGetCapabilitiesResponse:
        # No staging, no stats, no expansion: publish and unpublish are all there is.
        return csi_pb2.NodeGetCapabilitiesResponse()

    def NodeGetInfo(self, request: Any, context: grpc.ServicerContext) -> csi_pb2.NodeGetInfoResponse:
        return csi_pb2.NodeGetInfoResponse(node_id=self.node_id)

    @_answers_errors
    def NodePublishVolume(
        self, request: csi_pb2.NodePublishVolumeRequest, context: grpc.ServicerContext
    ) -> csi_pb2.NodePublishVolumeResponse:
        publication = check_publish(request, self.socket_root)
        with self._lock:
            self._publish(publication)
        return csi_pb2.NodePublishVolumeResponse()

    def _publish(self, p: Publication) -> None:
        if p.token:
            self._publish_credential(p)
            return
        stacked = mounts.mounts_at(p.target)
        if stacked:
            if mounts.same_directory(p.target, p.source) and stacked[-1].read_only:
                log.debug("already published %s", p.describe())  # every republish: no news
                return
            raise CsiError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"target_path {p.target} already holds another mount ({stacked[-1].root}): "
                f"not pool {p.pool!r} published read-only",
            )
        created = not os.path.exists(p.target)
        os.makedirs(p.target, mode=0o755, exist_ok=True)
        try:
            mounts.bind_read_only(p.source, p.target)
        except OSError:
            if created:
                os.rmdir(p.target)
            raise
        log.info("published %s", p.describe())

    def _publish_credential(self, p: Publication) -> None:
        """A read-only tmpfs holding ``token``; published again (kubelet retries, requiresRepublish), the token
        is re-minted and replaced when it changed (a rotated pool key, a changed quota policy)."""
        stacked = mounts.mounts_at(p.target)
        if stacked:
            top = stacked[-1]
            if top.fs_type != "tmpfs" or not os.path.isfile(os.path.join(p.target, TOKEN_FILE)):
                raise CsiError(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"target_path {p.target} already holds another mount ({top.fs_type} {top.root}): "
                    f"not a pool credential of pool {p.pool!r}",
                )
            if _read_token(p.target) == p.token:
                log.debug("already published %s", p.describe())  # every republish: no news
                return
            mounts.remount(p.target, read_only=False)
            try:
                _write_token(p.target, p.token)
            finally:
                mounts.remount(p.target, read_only=True)
            log.info("credential replaced %s", p.describe())
            return
        created = not os.path.exists(p.target)
        os.makedirs(p.target, mode=0o755, exist_ok=True)
        try:
            mounts.mount_tmpfs(p.target)
            try:
                _write_token(p.target, p.token)
                mounts.remount(p.target, read_only=True)
            except OSError:
                mounts.unmount(p.target)
                raise
        except OSError:
            if created:
                os.rmdir(p.target)
            raise
        log.info("published %s", p.describe())

    @_answers_errors
    def NodeUnpublishVolume(
        self, request: csi_pb2.NodeUnpublishVolumeRequest, context: grpc.ServicerContext
    ) -> csi_pb2.NodeUnpublishVolumeResponse:
        if not request.volume_id:
            raise _invalid("volume_id is required")
        target = _target(request.target_path)
        with self._lock:
            self._unpublish(request.volume_id, target)
        return csi_pb2.NodeUnpublishVolumeResponse()

    def _unpublish(self, volume_id: str, target: str) -> None:
        for entry in reversed(mounts.mounts_at(target)):
            mounts.unmount(target)
            log.info("unpublished volume=%s target=%s (was %s)", volume_id, target, entry.root)
        try:
            os.rmdir(target)
        except FileNotFoundError:
            pass  # already gone: unpublish is idempotent
        except OSError as err:
            if err.errno == errno.ENOTEMPTY:
                raise CsiError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"target_path {target} is not a mount and not empty: not removed (it is not this driver's)",
                ) from None
            raise


def _read_token(directory: str) -> str:
    try:
        with open(os.path.join(directory, TOKEN_FILE)) as fh:
            return fh.read()
    except OSError:
        return ""


def _write_token(directory: str, token: str) -> None:
    """Write ``token`` atomically, world-readable: the vLLM container's user (any UID) reads it, and the
    volume is this pod's alone."""
    replace_file(directory, TOKEN_FILE, token, 0o444)
