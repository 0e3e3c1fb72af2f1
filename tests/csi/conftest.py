"""Fixtures of the CSI node plugin tests: one real plugin process per module, a gRPC client on its socket."""

from __future__ import annotations

import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from maru_csi import csi_pb2_grpc, mounts
from tests.required import require_root
from tests.support.csi import Layout, Plugin


@pytest.fixture(scope="session")
def as_root() -> None:
    """Session-scoped, so it is set up before the plugin: without root nothing of the test starts."""
    require_root("the CSI plugin's bind mounts")


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
