"""The CSI node plugin over its Unix socket, with a real gRPC client, as the kubelet calls it.

Identity and node info; bad requests answered with the CSI specification's status codes and a message
naming the field; publish and unpublish as real read-only bind mounts (root only), idempotent; and a
pool daemon reached through the published directory by an unprivileged process, across a daemon
restart and a plugin restart.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from maru_contracts.csi import DRIVER_NAME, SOCKET_FILE
from maru_csi import csi_pb2, csi_pb2_grpc, mounts
from tests.support.csi import Layout, Mode, Plugin, needs_root, publish_request
from tests.support.daemon import connector_env
from tests.support.pool import Daemon

Code = grpc.StatusCode


def refused(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


# --------------------------------------------------------------------------------- identity, info


def test_plugin_info(identity: csi_pb2_grpc.IdentityStub) -> None:
    info = identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest())
    assert info.name == DRIVER_NAME
    assert info.vendor_version
    # Node service only: no controller to call, no topology to honour.
    assert list(identity.GetPluginCapabilities(csi_pb2.GetPluginCapabilitiesRequest()).capabilities) == []
    probe = identity.Probe(csi_pb2.ProbeRequest())
    assert probe.HasField("ready") and probe.ready.value is True


def test_node_info(node: csi_pb2_grpc.NodeStub, plugin: Plugin) -> None:
    assert node.NodeGetInfo(csi_pb2.NodeGetInfoRequest()).node_id == "node-a" == plugin.ready["node"]
    # No STAGE_UNSTAGE_VOLUME: the kubelet goes straight to NodePublishVolume.
    assert list(node.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest()).capabilities) == []


def test_calls_it_does_not_serve_are_unimplemented(channel: grpc.Channel) -> None:
    stage = channel.unary_unary("/csi.v1.Node/NodeStageVolume")
    assert refused(lambda: stage(b"", timeout=10)).code() == Code.UNIMPLEMENTED


# --------------------------------------------------------------------------------- bad requests


def _mutated(layout: Layout, change: Callable[[csi_pb2.NodePublishVolumeRequest], None]):
    layout.pool("pool-a")
    request = publish_request(layout.target("bad"), "pool-a")
    change(request)
    return request


def _set(field: str, value: object) -> Callable[[csi_pb2.NodePublishVolumeRequest], None]:
    return lambda r: setattr(r, field, value)


def _context(key: str, value: str | None) -> Callable[[csi_pb2.NodePublishVolumeRequest], None]:
    def change(r: csi_pb2.NodePublishVolumeRequest) -> None:
        if value is None:
            del r.volume_context[key]
        else:
            r.volume_context[key] = value

    return change


def _block(r: csi_pb2.NodePublishVolumeRequest) -> None:
    r.volume_capability.block.SetInParent()


# (id, change to a valid request, status code, words the message must contain)
BAD_PUBLISH = [
    ("no-volume-id", _set("volume_id", ""), Code.INVALID_ARGUMENT, ["volume_id"]),
    ("no-target", _set("target_path", ""), Code.INVALID_ARGUMENT, ["target_path"]),
    ("relative-target", _set("target_path", "pods/x/mount"), Code.INVALID_ARGUMENT, ["target_path", "absolute"]),
    ("dotdot-target", _set("target_path", "/tmp/x/../../etc"), Code.INVALID_ARGUMENT, ["target_path"]),
    ("root-target", _set("target_path", "/"), Code.INVALID_ARGUMENT, ["target_path"]),
    ("no-capability", lambda r: r.ClearField("volume_capability"), Code.INVALID_ARGUMENT, ["volume_capability"]),
    ("block", _block, Code.INVALID_ARGUMENT, ["block"]),
    ("no-access-mode", lambda r: r.volume_capability.access_mode.Clear(), Code.INVALID_ARGUMENT, ["access_mode"]),
    (
        "fs-type",
        lambda r: setattr(r.volume_capability.mount, "fs_type", "ext4"),
        Code.INVALID_ARGUMENT,
        ["fsType", "ext4"],
    ),
    (
        "mount-flags",
        lambda r: r.volume_capability.mount.mount_flags.append("rw"),
        Code.INVALID_ARGUMENT,
        ["mount flags"],
    ),
    ("read-write", _set("readonly", False), Code.INVALID_ARGUMENT, ["readOnly: true"]),
    ("no-pool", _context("pool", None), Code.INVALID_ARGUMENT, ["volumeAttributes.pool", "required"]),
    ("pool-escapes-root", _context("pool", ".."), Code.INVALID_ARGUMENT, ["volumeAttributes.pool", "'..'"]),
    ("pool-with-slash", _context("pool", "a/b"), Code.INVALID_ARGUMENT, ["volumeAttributes.pool"]),
    ("pool-too-long", _context("pool", "p" * 64), Code.INVALID_ARGUMENT, ["volumeAttributes.pool"]),
    ("typo-in-attribute", _context("pol", "pool-a"), Code.INVALID_ARGUMENT, ["'pol'", "pool", "socketDir"]),
    (
        "other-socket-dir",
        _context("socketDir", "/var/run/elsewhere"),
        Code.INVALID_ARGUMENT,
        ["socketDir", "/var/run/elsewhere", "spec.daemon.socketDir", "csiDriver.socketRoot"],
    ),
    ("persistent", _context("csi.storage.k8s.io/ephemeral", "false"), Code.INVALID_ARGUMENT, ["ephemeral"]),
    (
        "unknown-pool",
        _context("pool", "no-such-pool"),
        Code.NOT_FOUND,
        ["no-such-pool", "no socket directory", "spec.daemon.socketDir"],
    ),
]


@pytest.mark.parametrize(("change", "code", "words"), [b[1:] for b in BAD_PUBLISH], ids=[b[0] for b in BAD_PUBLISH])
def test_bad_publish_is_refused_by_name(
    node: csi_pb2_grpc.NodeStub, layout: Layout, change, code: grpc.StatusCode, words: list[str]
) -> None:
    request = _mutated(layout, change)
    error = refused(lambda: node.NodePublishVolume(request, timeout=10))
    assert error.code() == code, error.details()
    for word in words:
        assert word in error.details(), error.details()
    # Nothing was created or mounted for a refused request.
    if request.target_path.startswith(str(layout.pods)):
        assert not os.path.exists(request.target_path)


def test_pool_path_that_is_not_a_directory(node: csi_pb2_grpc.NodeStub, layout: Layout) -> None:
    (layout.sockets / "a-file").write_text("")
    error = refused(lambda: node.NodePublishVolume(publish_request(layout.target("file"), "a-file"), timeout=10))
    assert error.code() == Code.FAILED_PRECONDITION and "not a directory" in error.details()


def test_a_socket_dir_equal_to_the_root_is_accepted(node: csi_pb2_grpc.NodeStub, layout: Layout) -> None:
    # Checked before any mount: an unknown pool with the right socketDir fails on the pool, not the dir.
    request = publish_request(layout.target("ok-dir"), "missing", socket_dir=f"{layout.sockets}/")
    assert refused(lambda: node.NodePublishVolume(request, timeout=10)).code() == Code.NOT_FOUND


@pytest.mark.parametrize(
    ("volume_id", "target", "word"), [("", "/tmp/x", "volume_id"), ("v", "", "target_path"), ("v", "x", "target_path")]
)
def test_bad_unpublish_is_refused_by_name(node: csi_pb2_grpc.NodeStub, volume_id: str, target: str, word: str) -> None:
    request = csi_pb2.NodeUnpublishVolumeRequest(volume_id=volume_id, target_path=target)
    error = refused(lambda: node.NodeUnpublishVolume(request, timeout=10))
    assert error.code() == Code.INVALID_ARGUMENT and word in error.details()


# --------------------------------------------------------------------------------- admission


def test_a_namespace_the_pool_does_not_admit_is_refused(node: csi_pb2_grpc.NodeStub, layout: Layout) -> None:
    """A pod may name any pool in its volume; it gets the socket only if the pool admits its namespace. The
    message (the pod's FailedMount event) names the pod's namespace, the pool and the rule."""
    layout.pool("pool-prod", admits=["prod", "staging"])
    request = publish_request(layout.target("intruder"), "pool-prod", namespace="llm")
    error = refused(lambda: node.NodePublishVolume(request, timeout=10))
    assert error.code() == Code.PERMISSION_DENIED, error.details()
    for word in ("namespace llm", "MaruPool pool-prod", "spec.allowedNamespaces", "prod", "staging"):
        assert word in error.details(), error.details()
    assert not os.path.exists(request.target_path)


def test_without_pod_info_a_restricted_pool_admits_nobody(node: csi_pb2_grpc.NodeStub, layout: Layout) -> None:
    layout.pool("pool-prod", admits=["prod"])
    request = publish_request(layout.target("anonymous"), "pool-prod", namespace="prod")
    del request.volume_context["csi.storage.k8s.io/pod.namespace"]
    error = refused(lambda: node.NodePublishVolume(request, timeout=10))
    assert error.code() == Code.PERMISSION_DENIED and "podInfoOnMount" in error.details(), error.details()


def _corrupt(text: str, mode: int = 0o644) -> Callable[[Path], None]:
    def write(rule: Path) -> None:
        rule.write_text(text)
        rule.chmod(mode)

    return write


def _symlink(rule: Path) -> None:
    elsewhere = rule.parent.parent / "elsewhere.json"
    elsewhere.write_text('{"version": 1, "pool": "pool-x", "admit": "AllNamespaces"}')
    rule.symlink_to(elsewhere)


# (id, what becomes of the pool's admission file, words the message must contain)
NO_RULE = [
    ("missing", None, ["admission.json is missing"]),
    ("not-json", _corrupt("admit everyone"), ["not JSON"]),
    (
        "empty-list",
        _corrupt('{"version": 1, "pool": "pool-x", "admit": "ListedNamespaces", "namespaces": []}'),
        ["non-empty list"],
    ),
    ("no-admit", _corrupt('{"version": 1, "pool": "pool-x"}'), ["admit"]),
    ("other-version", _corrupt('{"version": 2, "pool": "pool-x", "admit": "AllNamespaces"}'), ["version 2"]),
    (
        "world-writable",
        _corrupt('{"version": 1, "pool": "pool-x", "admit": "AllNamespaces"}', 0o666),
        ["no other user may write"],
    ),
    ("symlink", _symlink, ["cannot be opened"]),
    # A root-owned copy of another pool's laxer rule (pool-open admits every namespace) is not this pool's.
    (
        "another-pools-rule",
        _corrupt('{"version": 1, "pool": "pool-open", "admit": "AllNamespaces"}'),
        ["pool 'pool-open'", "not of 'pool-x'"],
    ),
]


@pytest.mark.parametrize(("change", "words"), [r[1:] for r in NO_RULE], ids=[r[0] for r in NO_RULE])
def test_without_a_usable_admission_rule_nobody_is_admitted(
    node: csi_pb2_grpc.NodeStub, layout: Layout, change: Callable[[Path], None] | None, words: list[str]
) -> None:
    """Refused closed: missing or unusable admission data never means "every namespace"."""
    pool = layout.pool("pool-x", admission=False)
    (pool / "elsewhere.json").unlink(missing_ok=True)
    if change is not None:
        change(pool / "admission.json")
    request = publish_request(layout.target("no-rule"), "pool-x")
    error = refused(lambda: node.NodePublishVolume(request, timeout=10))
    assert error.code() == Code.FAILED_PRECONDITION, error.details()
    for word in ("'pool-x'", "no pod is admitted", *words):
        assert word in error.details(), error.details()
    assert not os.path.exists(request.target_path)


@needs_root
def test_an_admitted_namespace_gets_the_socket(node: csi_pb2_grpc.NodeStub, layout: Layout) -> None:
    (layout.pool("pool-prod", admits=["prod", "staging"]) / "name").write_text("pool-prod")
    target = layout.target("admitted")
    node.NodePublishVolume(publish_request(target, "pool-prod", namespace="staging"), timeout=10)
    try:
        assert Path(target, "name").read_text() == "pool-prod"
    finally:
        node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(volume_id="v", target_path=target))


@needs_root
def test_a_pool_without_allowed_namespaces_admits_every_namespace(node: csi_pb2_grpc.NodeStub, layout: Layout) -> None:
    (layout.pool("pool-open") / "name").write_text("pool-open")
    for namespace in ("llm", "team-b", "default"):
        target = layout.target(f"open-{namespace}")
        node.NodePublishVolume(publish_request(target, "pool-open", namespace=namespace), timeout=10)
        try:
            assert Path(target, "name").read_text() == "pool-open"
        finally:
            node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(volume_id="v", target_path=target))


@needs_root
def test_a_changed_rule_applies_to_the_next_publish(node: csi_pb2_grpc.NodeStub, layout: Layout) -> None:
    """No cache: once the node's agent has rewritten the file, the next pod is judged by the new rule."""
    layout.pool("pool-moving", admits=["prod"])
    request = publish_request(layout.target("moving"), "pool-moving", namespace="llm")
    assert refused(lambda: node.NodePublishVolume(request, timeout=10)).code() == Code.PERMISSION_DENIED
    layout.pool("pool-moving", admits=["prod", "llm"])
    node.NodePublishVolume(request, timeout=10)
    node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(volume_id="v", target_path=request.target_path))


# --------------------------------------------------------------------------------- real mounts


def _published(target: str) -> list[mounts.MountEntry]:
    return mounts.mounts_at(target)


@needs_root
def test_publish_and_unpublish(node: csi_pb2_grpc.NodeStub, layout: Layout) -> None:
    pool = layout.pool("pool-a")
    (pool / "marker").write_text("pool-a")
    target = layout.target("pod-1")
    request = publish_request(target, "pool-a", socket_dir=str(layout.sockets))

    node.NodePublishVolume(request, timeout=10)
    (entry,) = _published(target)
    assert entry.read_only and {"nosuid", "nodev", "noexec"} <= entry.options
    assert Path(target, "marker").read_text() == "pool-a"  # the pool's directory, not a copy
    (pool / "later").write_text("")  # what the daemon creates later shows up too (e.g. its socket)
    assert Path(target, "later").exists()
    with pytest.raises(OSError) as info:
        Path(target, "x").write_text("")
    assert info.value.errno == errno.EROFS

    # The same call again (a kubelet retry) changes nothing.
    node.NodePublishVolume(request, timeout=10)
    assert len(_published(target)) == 1

    node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(volume_id=request.volume_id, target_path=target))
    assert _published(target) == [] and not os.path.exists(target)
    assert (pool / "marker").exists(), "unpublishing never touches the pool's directory"
    # Again: already gone is fine.
    node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(volume_id=request.volume_id, target_path=target))


@needs_root
def test_two_pods_two_pools(node: csi_pb2_grpc.NodeStub, layout: Layout) -> None:
    for pool in ("pool-a", "pool-b"):
        (layout.pool(pool) / "name").write_text(pool)
    targets = {pool: layout.target(f"pod-{pool}") for pool in ("pool-a", "pool-b")}
    for pool, target in targets.items():
        node.NodePublishVolume(publish_request(target, pool, volume_id=f"csi-{pool}"), timeout=10)
    for pool, target in targets.items():
        assert Path(target, "name").read_text() == pool
        node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(volume_id=f"csi-{pool}", target_path=target))
        assert not os.path.exists(target)


@needs_root
def test_publishing_another_pool_at_a_used_target_is_refused(node: csi_pb2_grpc.NodeStub, layout: Layout) -> None:
    layout.pool("pool-a")
    layout.pool("pool-b")
    target = layout.target("pod-clash")
    node.NodePublishVolume(publish_request(target, "pool-a"), timeout=10)
    try:
        error = refused(lambda: node.NodePublishVolume(publish_request(target, "pool-b"), timeout=10))
        assert error.code() == Code.ALREADY_EXISTS and "pool-b" in error.details()
        assert len(_published(target)) == 1
    finally:
        node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(volume_id="v", target_path=target))


@needs_root
def test_unpublish_leaves_a_foreign_directory_alone(node: csi_pb2_grpc.NodeStub, layout: Layout) -> None:
    target = Path(layout.target("foreign"))
    target.mkdir()
    (target / "data").write_text("not ours")
    error = refused(
        lambda: node.NodeUnpublishVolume(
            csi_pb2.NodeUnpublishVolumeRequest(volume_id="v", target_path=str(target)), timeout=10
        )
    )
    assert error.code() == Code.FAILED_PRECONDITION
    assert (target / "data").read_text() == "not ours"


@needs_root
def test_every_access_mode_the_kubelet_may_send(node: csi_pb2_grpc.NodeStub, layout: Layout) -> None:
    layout.pool("pool-a")
    for mode in (Mode.SINGLE_NODE_WRITER, Mode.SINGLE_NODE_MULTI_WRITER, Mode.SINGLE_NODE_READER_ONLY):
        target = layout.target(f"mode-{mode}")
        request = publish_request(target, "pool-a")
        request.volume_capability.access_mode.mode = mode
        node.NodePublishVolume(request, timeout=10)
        assert _published(target)[-1].read_only
        node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(volume_id="v", target_path=target))


# Run as root until the imports are done, then as the vLLM image's user: the pool client reaches the
# daemon through the published directory with no privilege at all, and stores and loads a chunk.
UNPRIVILEGED_CLIENT = """
import os, sys
from maru_pool import PoolClient
os.setgroups([]); os.setgid(65532); os.setuid(65532)
client = PoolClient(sys.argv[1], timeout_s=10)
key = bytes(range(32))
if sys.argv[2] == "put":
    assert client.put(key, b"kv" * 512), "already stored"
out = bytearray(1024)
assert client.get_into(key, out) and bytes(out) == b"kv" * 512, "chunk not found through the published socket"
print("ok", os.getuid())
"""


def _client(url: str, step: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", UNPRIVILEGED_CLIENT, url, step],
        capture_output=True,
        text=True,
        timeout=120,
        env=connector_env(),
        check=False,
    )
    assert result.returncode == 0 and result.stdout.split() == ["ok", "65532"], result.stderr[-3000:]


def _serve(pool_dir: Path) -> Daemon:
    return Daemon(
        [
            "serve",
            "--listen",
            f"unix://{pool_dir}/{SOCKET_FILE}",
            "--size",
            "4Mi",
            "--shm-path",
            f"/dev/shm/mcsi-{os.getpid()}-{pool_dir.name}",
            "--metrics-addr",
            "127.0.0.1:0",
        ]
    )


@needs_root
def test_an_unprivileged_client_reaches_the_pool_through_the_volume(layout: Layout) -> None:
    """The whole path: pool daemon -> socket directory -> plugin publishes it -> a non-root process in
    the 'pod' connects, gets the memory fd, stores and loads a chunk. The published directory follows a
    daemon restart (a new socket in the same directory), and a restarted plugin unpublishes what the
    earlier one published (it keeps no state)."""
    pool_dir = layout.pool("pool-e2e")
    daemon = _serve(pool_dir)
    target = layout.target("pod-e2e")
    first = Plugin(
        "--endpoint",
        f"unix://{layout.root}/plugin/e2e.sock",
        "--node-id",
        "node-a",
        "--socket-root",
        str(layout.sockets),
    )
    try:
        with grpc.insecure_channel(first.ready["endpoint"]) as ch:
            csi_pb2_grpc.NodeStub(ch).NodePublishVolume(publish_request(target, "pool-e2e"), timeout=30)
        assert first.stop() == 0
        url = f"unix://{target}/{SOCKET_FILE}"
        _client(url, "put")

        daemon.stop()
        daemon = _serve(pool_dir)  # a new socket file, a new (empty) index
        _client(url, "put")

        second = Plugin(
            "--endpoint",
            f"unix://{layout.root}/plugin/e2e.sock",
            "--node-id",
            "node-a",
            "--socket-root",
            str(layout.sockets),
        )
        try:
            with grpc.insecure_channel(second.ready["endpoint"]) as ch:
                csi_pb2_grpc.NodeStub(ch).NodeUnpublishVolume(
                    csi_pb2.NodeUnpublishVolumeRequest(volume_id="csi-0123456789abcdef", target_path=target), timeout=30
                )
        finally:
            assert second.stop() == 0
        assert _published(target) == [] and not os.path.exists(target)
    finally:
        daemon.stop()
        for stream in (daemon.proc.stdout, daemon.proc.stderr):
            if stream is not None:
                stream.close()


# --------------------------------------------------------------------------------- the process


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "maru_csi", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**connector_env(), "NODE_NAME": "", "CSI_ENDPOINT": ""},
        check=False,
    )


@pytest.mark.parametrize(
    ("args", "word"),
    [
        (["--node-id", "n", "--socket-root", "/tmp"], "--endpoint"),
        (["--endpoint", "tcp://0.0.0.0:1", "--node-id", "n", "--socket-root", "/tmp"], "--endpoint"),
        (["--endpoint", "unix:///tmp/mcsi-x.sock", "--socket-root", "/tmp"], "--node-id"),
        (["--endpoint", "unix:///tmp/mcsi-x.sock", "--node-id", "n", "--socket-root", "/no/such/dir"], "--socket-root"),
    ],
    ids=["no-endpoint", "tcp-endpoint", "no-node-id", "missing-root"],
)
def test_bad_flags_exit_2_naming_the_flag(args: list[str], word: str) -> None:
    result = _run(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and word in lines[0], result.stderr


def test_refuses_to_take_over_a_live_socket(plugin: Plugin, layout: Layout) -> None:
    result = _run("--endpoint", layout.endpoint, "--node-id", "n", "--socket-root", str(layout.sockets))
    assert result.returncode == 2 and "another process serves" in result.stderr
    assert plugin.proc.poll() is None


def test_socket_is_for_root_only(plugin: Plugin, layout: Layout) -> None:
    path = layout.endpoint[len("unix://") :]
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_stops_on_sigterm_and_removes_its_socket(layout: Layout) -> None:
    endpoint = f"unix://{layout.root}/plugin/stop.sock"
    started = Plugin("--endpoint", endpoint, "--node-id", "n", "--socket-root", str(layout.sockets))
    assert started.stop() == 0
    assert not os.path.exists(endpoint[len("unix://") :])
    assert "stopped" in started.stderr()
