"""The CSI node plugin as a real subprocess, and requests shaped as the kubelet sends them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from maru_contracts.csi import ATTR_POOL, ATTR_SOCKET_DIR, EPHEMERAL, POD_NAME, POD_NAMESPACE
from maru_csi import csi_pb2
from tests.support.daemon import ReadyDaemon

Mode = csi_pb2.VolumeCapability.AccessMode.Mode


class Plugin(ReadyDaemon):
    """A running ``python -m maru_csi`` and the fields of its ready line."""

    module = "maru_csi"
    program = "maru-csi"


def publish_request(
    target: str,
    pool: str,
    *,
    socket_dir: str | None = None,
    volume_id: str = "csi-0123456789abcdef",
    readonly: bool = True,
    namespace: str = "llm",
    attributes: dict[str, str] | None = None,
) -> csi_pb2.NodePublishVolumeRequest:
    """What the kubelet sends for an inline ephemeral volume of a driver with podInfoOnMount."""
    context = {
        ATTR_POOL: pool,
        POD_NAME: "qwen-7b-decode-5d8f7c9b4-x2k7q",
        POD_NAMESPACE: namespace,
        "csi.storage.k8s.io/pod.uid": "6f1c9a6e-0d5b-4a55-9b8e-3f0c2a1d4e5f",
        "csi.storage.k8s.io/serviceAccount.name": "default",
        EPHEMERAL: "true",
    }
    if socket_dir is not None:
        context[ATTR_SOCKET_DIR] = socket_dir
    context.update(attributes or {})
    return csi_pb2.NodePublishVolumeRequest(
        volume_id=volume_id,
        target_path=target,
        volume_capability=csi_pb2.VolumeCapability(
            mount=csi_pb2.VolumeCapability.MountVolume(),
            access_mode=csi_pb2.VolumeCapability.AccessMode(mode=Mode.SINGLE_NODE_WRITER),
        ),
        readonly=readonly,
        volume_context=context,
    )


needs_root = pytest.mark.usefixtures("as_root")


class Layout:
    """A node in a folder: the pools' socket root, the plugin's socket, the kubelet's pod volumes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.sockets = root / "run-maru"
        self.pods = root / "pods"
        self.endpoint = f"unix://{root}/plugin/csi.sock"
        for folder in (self.sockets, self.pods):
            folder.mkdir()

    def pool(self, name: str, admits: list[str] | None = None, *, admission: bool = True) -> Path:
        """A pool's socket directory, as its daemon's hostPath (DirectoryOrCreate) would leave it, with the
        admission file its agent's init container writes: every namespace (``admits`` None), or those listed;
        none at all with ``admission=False``."""
        path = self.sockets / name
        path.mkdir(exist_ok=True)
        rule = path / ADMISSION_FILE
        if not admission:
            rule.unlink(missing_ok=True)
            return path
        # Spelled out, not rendered by the product's own code: this is the file format the plugin reads.
        document: dict[str, object] = {"version": 1, "pool": name, "admit": "AllNamespaces"}
        if admits is not None:
            document.update(admit="ListedNamespaces", namespaces=admits)
        rule.write_text(json.dumps(document))
        rule.chmod(0o644)
        return path

    def target(self, name: str) -> str:
        """A pod volume path, as the kubelet names it; its parent exists, the target itself does not."""
        parent = self.pods / name / "volumes" / "kubernetes.io~csi" / "maru-socket"
        parent.mkdir(parents=True, exist_ok=True)
        return str(parent / "mount")


ADMISSION_FILE = "admission.json"  # beside the pool's socket, written by the pool's agent
