"""Pool credentials minted by the node plugin at publish: a read-only tmpfs holding the pod's token.

The plugin runs as a real process and is called over its socket as the kubelet calls it; the token is
checked with the pool daemons' own verification, under the key the pool's init container wrote.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from maru_contracts import csi as csi_contract
from maru_contracts import tenancy
from maru_contracts.csi import CREDENTIALS_DIR, POD_NAMESPACE
from maru_csi import csi_pb2, csi_pb2_grpc, minting, mounts
from tests.support.csi import Layout, needs_root, publish_request
from tests.support.daemon import connector_env

Code = grpc.StatusCode
POOL = "pool-c"
KEY = secrets.token_bytes(32)


def material(
    layout: Layout,
    *,
    pool: str = POOL,
    key: bytes = KEY,
    default: str = "pins=64",
    ceiling: str = "bytes=1000000",
    file_mode: int = 0o600,
    dir_mode: int = 0o700,
) -> Path:
    """The minting file as the pool's init container leaves it; spelled out here: it is the format the plugin
    reads, not something these tests take from the product's writer."""
    directory = layout.sockets / CREDENTIALS_DIR
    directory.mkdir(exist_ok=True)
    directory.chmod(dir_mode)
    path = directory / f"{pool}.json"
    path.write_text(
        json.dumps(
            {
                "version": 1,
                "pool": pool,
                "key": base64.b64encode(key).decode(),
                "tenantQuota": default,
                "maxTenantQuota": ceiling,
            }
        )
    )
    path.chmod(file_mode)
    return path


@pytest.fixture
def pool(layout: Layout) -> Iterator[Path]:
    layout.pool(POOL, ["llm", "team-b"])
    path = material(layout)
    yield path
    material(layout)  # put back what a test broke


def credential_request(
    target: str, cache: str = "chat", quota: str | None = None, *, pool: str = POOL, namespace: str = "llm"
) -> csi_pb2.NodePublishVolumeRequest:
    attributes = {"cache": cache, **({"quota": quota} if quota is not None else {})}
    return publish_request(target, pool, namespace=namespace, attributes=attributes)


def unpublish(node: csi_pb2_grpc.NodeStub, target: str) -> None:
    node.NodeUnpublishVolume(
        csi_pb2.NodeUnpublishVolumeRequest(volume_id="csi-0123456789abcdef", target_path=target), timeout=10
    )


def refused(node: csi_pb2_grpc.NodeStub, request: csi_pb2.NodePublishVolumeRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        node.NodePublishVolume(request, timeout=10)
    assert not os.path.exists(request.target_path), "a refused publish leaves nothing behind"
    return info.value


@needs_root
def test_publish_mints_the_pods_token_in_a_read_only_tmpfs(
    node: csi_pb2_grpc.NodeStub, layout: Layout, pool: Path
) -> None:
    target = layout.target("cred-1")
    node.NodePublishVolume(credential_request(target, quota="bytes=5000000,leases=7"), timeout=10)

    (entry,) = mounts.mounts_at(target)
    assert entry.fs_type == "tmpfs" and entry.read_only and {"nosuid", "nodev", "noexec"} <= entry.options
    token_file = Path(target, "token")
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o444
    principal = tenancy.verify(KEY, token_file.read_text())
    # The namespace is the kubelet's; the bytes asked for are capped by the pool's maxTenantQuota, pins
    # come from its tenantQuota, leases from the request.
    assert principal == tenancy.tenant("llm/chat")
    assert principal.quota == tenancy.Quota(bytes=1000000, pins=64, leases=7)
    assert os.statvfs(target).f_blocks * os.statvfs(target).f_frsize <= mounts.TMPFS_BYTES
    with pytest.raises(OSError):
        token_file.write_text("forged")

    unpublish(node, target)
    assert mounts.mounts_at(target) == [] and not os.path.exists(target)
    unpublish(node, target)  # already gone is fine


# (the pool's tenantQuota, its maxTenantQuota, what the pod's volume asks for, the quota minted)
SELF_RAISED = [
    ("", "", "pins=500000,leases=500000", "pins=65536,leases=16384"),  # the reported attack: the daemon's defaults
    ("pins=64", "", "pins=500000", "pins=64"),  # the pool's default is the ceiling where it sets none
    ("", "", "pins=10,leases=7", "pins=10,leases=7"),  # asking for less is always granted
    ("", "pins=1000000", "pins=500000", "pins=500000"),  # the pool owner allows more
    ("", "", "bytes=5000000", "bytes=5000000"),  # bytes: bounded by the pool in the daemon, as asked here
]


@needs_root
@pytest.mark.parametrize(("default", "ceiling", "asked", "minted"), SELF_RAISED)
def test_a_pod_cannot_raise_its_own_quota(
    node: csi_pb2_grpc.NodeStub, layout: Layout, pool: Path, default: str, ceiling: str, asked: str, minted: str
) -> None:
    """Whoever writes pods in an admitted namespace writes the volume's ``quota``: without a maxTenantQuota it
    was minted as asked, and a token of 500,000 pins grew the pool daemon toward its memory limit."""
    material(layout, default=default, ceiling=ceiling)
    target = layout.target("cred-raise")
    node.NodePublishVolume(credential_request(target, quota=asked), timeout=10)
    try:
        assert tenancy.verify(KEY, Path(target, "token").read_text()).quota == tenancy.Quota.decode(minted)
    finally:
        unpublish(node, target)


@needs_root
def test_the_namespace_comes_from_the_kubelet_not_the_attributes(
    node: csi_pb2_grpc.NodeStub, layout: Layout, pool: Path
) -> None:
    target = layout.target("cred-2")
    node.NodePublishVolume(credential_request(target, cache="team-b/chat", namespace="llm"), timeout=10)
    try:
        principal = tenancy.verify(KEY, Path(target, "token").read_text())
        assert principal.scope == "llm/team-b/chat"  # still inside llm: never team-b's cache
        assert principal.quota == tenancy.Quota(bytes=1000000, pins=64)  # no request: the pool's policy
    finally:
        unpublish(node, target)


@needs_root
def test_a_republish_replaces_a_token_of_a_rotated_key(node: csi_pb2_grpc.NodeStub, layout: Layout, pool: Path) -> None:
    target = layout.target("cred-3")
    request = credential_request(target)
    node.NodePublishVolume(request, timeout=10)
    try:
        node.NodePublishVolume(request, timeout=10)  # a kubelet retry: nothing changes
        assert len(mounts.mounts_at(target)) == 1
        rotated = secrets.token_bytes(32)
        material(layout, key=rotated)
        node.NodePublishVolume(request, timeout=10)
        assert len(mounts.mounts_at(target)) == 1 and mounts.mounts_at(target)[0].read_only
        assert tenancy.verify(rotated, Path(target, "token").read_text()) == tenancy.tenant("llm/chat")
    finally:
        unpublish(node, target)


BAD = [
    # (id, request change, material change, code, words)
    (
        "namespace-not-admitted",
        {"namespace": "other"},
        None,
        Code.PERMISSION_DENIED,
        ["namespace other", "spec.allowedNamespaces"],
    ),
    ("no-pod-namespace", {"namespace": ""}, None, Code.PERMISSION_DENIED, ["podInfoOnMount"]),
    ("empty-cache", {"cache": ""}, None, Code.INVALID_ARGUMENT, ["volumeAttributes.cache"]),
    ("cache-with-newline", {"cache": "a\nb"}, None, Code.INVALID_ARGUMENT, ["volumeAttributes.cache", "printable"]),
    ("cache-too-long", {"cache": "c" * 254}, None, Code.INVALID_ARGUMENT, ["volumeAttributes.cache", "253"]),
    ("bad-quota", {"quota": "bytes=1Gi"}, None, Code.INVALID_ARGUMENT, ["volumeAttributes.quota", "bytes=N"]),
    ("unknown-quota-field", {"quota": "memory=5"}, None, Code.INVALID_ARGUMENT, ["volumeAttributes.quota", "memory"]),
    ("no-material", None, "missing", Code.FAILED_PRECONDITION, ["pool-c.json is missing", "no credential"]),
    (
        "group-readable-material",
        None,
        {"file_mode": 0o640},
        Code.FAILED_PRECONDITION,
        ["pool-c.json", "closed to group and others"],
    ),
    ("open-directory", None, {"dir_mode": 0o755}, Code.FAILED_PRECONDITION, [CREDENTIALS_DIR, "closed to group"]),
    ("another-pools-material", None, {"pool": "pool-x"}, Code.FAILED_PRECONDITION, ["pool 'pool-x'"]),
    ("short-key", None, {"key": b"short"}, Code.FAILED_PRECONDITION, ["key holds 5 bytes"]),
]


@needs_root
@pytest.mark.parametrize(("change", "broken", "code", "words"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_credential_publish_is_refused_by_name(
    node: csi_pb2_grpc.NodeStub, layout: Layout, pool: Path, change, broken, code: grpc.StatusCode, words: list[str]
) -> None:
    if broken == "missing":
        pool.unlink()
    elif broken is not None:
        fields = dict(broken)
        if "pool" in fields:  # another pool's file under this pool's name
            written = material(layout, **fields)
            written.rename(pool)
        else:
            material(layout, **fields)
    change = change or {}
    request = credential_request(
        layout.target("cred-bad"),
        change.get("cache", "chat"),
        change.get("quota"),
        namespace=change.get("namespace", "llm"),
    )
    if change.get("namespace") == "":
        del request.volume_context[POD_NAMESPACE]
    error = refused(node, request)
    assert error.code() == code, error.details()
    for word in words:
        assert word in error.details(), error.details()
    assert base64.b64encode(KEY).decode() not in error.details()


@needs_root
def test_credential_attributes_on_a_socket_volume_are_refused(
    node: csi_pb2_grpc.NodeStub, layout: Layout, pool: Path
) -> None:
    request = publish_request(layout.target("cred-stray"), POOL, attributes={"quota": "pins=1"})
    error = refused(node, request)
    assert error.code() == Code.INVALID_ARGUMENT and "volumeAttributes.cache" in error.details(), error.details()


@needs_root
@pytest.mark.parametrize("name", [CREDENTIALS_DIR, ".x", "_x", "-x"])
def test_the_credentials_directory_is_never_a_pool(
    node: csi_pb2_grpc.NodeStub, layout: Layout, pool: Path, name: str
) -> None:
    for request in (
        publish_request(layout.target("cred-dir"), name),
        credential_request(layout.target("cred-dir"), pool=name),
    ):
        error = refused(node, request)
        assert error.code() == Code.INVALID_ARGUMENT and "volumeAttributes.pool" in error.details(), error.details()


# --------------------------------------------------------------------------------- the init container


def run_minting(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "maru_csi.minting", *args],
        capture_output=True,
        text=True,
        env=connector_env(),
        timeout=60,
    )


@needs_root
def test_the_init_container_writes_what_the_plugin_mints_from(tmp_path: Path) -> None:
    root = tmp_path / "run-maru"
    (root / CREDENTIALS_DIR).mkdir(parents=True, mode=0o755)  # as the kubelet creates a hostPath directory
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY)
    policy = csi_contract.minting_policy(tenancy.Quota(pins=8), tenancy.Quota(bytes=1 << 30))
    done = run_minting("--socket-root", str(root), "--pool", POOL, "--key-file", str(key_file), "--policy", policy)
    assert done.returncode == 0, done.stderr
    assert base64.b64encode(KEY).decode() not in done.stdout + done.stderr
    path = Path(minting.material_path(str(root), POOL))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert path.stat().st_uid == 0
    read = minting.read(str(root), POOL)
    assert (read.key, read.default, read.ceiling) == (KEY, tenancy.Quota(pins=8), tenancy.Quota(bytes=1 << 30))
    assert [p.name for p in path.parent.iterdir()] == [path.name], "no temporary file left behind"


@pytest.mark.parametrize(
    ("args", "word"),
    [
        (["--pool", "_credentials"], "--pool"),
        (["--policy", '{"tenantQuota": "bytes=1Gi"}'], "tenantQuota"),
        (["--policy", '{"extra": ""}'], "--policy"),
        (["--key-file", "/nonexistent/key"], "--key-file"),
    ],
)
def test_the_init_container_refuses_bad_input_naming_the_flag(tmp_path: Path, args: list[str], word: str) -> None:
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY)
    given = {"--socket-root": str(tmp_path), "--pool": POOL, "--key-file": str(key_file), "--policy": "{}"}
    given.update(dict(zip(args[::2], args[1::2], strict=True)))
    done = run_minting(*[x for kv in given.items() for x in kv])
    assert done.returncode == 2 and word in done.stderr, done.stderr
    assert not (tmp_path / CREDENTIALS_DIR).exists()


def test_credentials_swapped_for_a_link_after_the_check_are_not_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check and the read are one directory: ``_credentials`` replaced by a link to another directory (its
    owner's key and policy) right after the plugin checked it is not what the plugin mints from."""
    root = tmp_path / "run-maru"
    minting.write(str(root), POOL, KEY, tenancy.Quota(pins=8), tenancy.Quota(pins=8))
    planted = tmp_path / "planted"
    minting.write(str(planted), POOL, secrets.token_bytes(32), tenancy.DEFAULT_QUOTA, tenancy.DEFAULT_QUOTA)
    directory = root / CREDENTIALS_DIR
    real_lstat, real_fstat = os.lstat, os.fstat
    swapped: list[bool] = []

    def swap() -> None:  # what a racing writer of the socket root would do between check and use
        if not swapped:
            swapped.append(True)
            directory.rename(root / "moved")
            directory.symlink_to(planted / CREDENTIALS_DIR)

    def lstat(path: object, *args: object, **kwargs: object) -> os.stat_result:
        result = real_lstat(path, *args, **kwargs)  # type: ignore[arg-type]
        if os.fspath(path) == str(directory):  # type: ignore[arg-type]
            swap()
        return result

    def fstat(fd: int) -> os.stat_result:
        result = real_fstat(fd)
        if stat.S_ISDIR(result.st_mode):
            swap()
        return result

    monkeypatch.setattr(os, "lstat", lstat)
    monkeypatch.setattr(os, "fstat", fstat)
    got = minting.read(str(root), POOL)
    assert swapped, "the check did not run"
    assert (got.key, got.default) == (KEY, tenancy.Quota(pins=8)), "the plugin read the planted material"
    monkeypatch.undo()
    with pytest.raises(minting.MintingError, match="not a link"):  # a link found there is refused outright
        minting.read(str(root), POOL)
