"""Fixtures of the CSI node plugin tests: one real plugin process per module, a gRPC client on its socket."""

from __future__ import annotations

import json
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from maru_csi import csi_pb2_grpc, mounts
from tests.required import require_root

from .harness import Plugin

ADMISSION_FILE = "admission.json"  # beside the pool's socket, written by the pool's agent


@pytest.fixture(scope="session")
def as_root() -> None:
    """Session-scoped, so it is set up before the plugin: without root nothing of the test starts."""
    require_root("the CSI plugin's bind mounts")


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


def _unmount_below(folder: Path) -> None:
    for entry in reversed(mounts.parse_mountinfo(mounts.MOUNTINFO.read_text())):
        if entry.mount_point.startswith(f"{folder}/"):
            mounts.unmount(entry.mount_point)


@pytest.fixture(scope="module")
def layout() -> Iterator[Layout]:
    # Unix socket paths are limited to ~107 bytes; pytest's tmp paths can exceed that.
    root = Path(tempfile.mkdtemp(prefix="mcsi-", dir="/tmp"))
    root.chmod(0o755)  # pool clients in these tests may run as another user
    yield Layout(root)
    _unmount_below(root)  # nothing may stay mounted, whatever a test left behind
    shutil.rmtree(root)


@pytest.fixture(scope="module")
def plugin(layout: Layout) -> Iterator[Plugin]:
    started = Plugin("--endpoint", layout.endpoint, "--node-id", "node-a", "--socket-root", str(layout.sockets))
    yield started
    started.stop(signal.SIGKILL)
    started.stderr()


@pytest.fixture(scope="module")
def channel(plugin: Plugin, layout: Layout) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(layout.endpoint) as ch:
        grpc.channel_ready_future(ch).result(timeout=30)
        yield ch


@pytest.fixture(scope="module")
def identity(channel: grpc.Channel) -> csi_pb2_grpc.IdentityStub:
    return csi_pb2_grpc.IdentityStub(channel)


@pytest.fixture(scope="module")
def node(channel: grpc.Channel) -> csi_pb2_grpc.NodeStub:
    return csi_pb2_grpc.NodeStub(channel)
