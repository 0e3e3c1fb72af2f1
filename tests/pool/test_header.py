"""A tenant scribbling the pool memory's header, through the mapping every tenant legitimately gets.

The header (magic, version, epoch, capacity, uuid) sits in the same memory as the chunks, and a client
holding the memory's fd can map and write all of it. Nothing another tenant or the daemon relies on may come
from those bytes: clients take the layout from the authenticated hello, the daemons keep their own copy and
put the header back, and a start never trusts an epoch it finds there.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
from pathlib import Path

import pytest

from maru_pool import PoolClient, PoolUnavailable, protocol
from maru_pool.memory import read_header_from
from tests.support.pool import (
    Daemon,
    free_port,
    http_get,
    start_agent,
    start_metadata,
    start_serve,
    status,
    token_file,
    wait_for,
    write_key,
)

MiB = 1 << 20
K = b"\x07" * 32
A_BYTES = b"A" * 8192
HEADER_BYTES = 48  # magic, version, header size, epoch, capacity, uuid
EPOCH_AT = 16


def map_as_tenant(d: Daemon, token: str | None) -> mmap.mmap:
    """What any tenant gets: a hello with its token, the memory's fd by SCM_RIGHTS, mapped read-write."""
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.connect(d.ready["listen"].removeprefix("unix://"))
        sock.settimeout(10)
        protocol.send_msg(sock, {"op": "hello", **({"token": token} if token else {})})
        reply, fds = protocol.recv_msg(sock, max_fds=8)
    finally:
        sock.close()
    assert reply is not None and reply["ok"], reply
    try:
        return mmap.mmap(fds[0], reply["regions"][0]["map_size"], mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        for fd in fds:
            os.close(fd)


def scribble(mm: mmap.mmap) -> None:
    """Garbage over the whole header: another magic, version, epoch, capacity and uuid."""
    mm[:HEADER_BYTES] = os.urandom(HEADER_BYTES)


def poison_epoch(mm: mmap.mmap) -> None:
    """A well-formed header whose epoch is the largest there is (and a uuid the pool never gave)."""
    mm[32:48] = os.urandom(16)
    struct.pack_into("<Q", mm, EPOCH_AT, 2**64 - 1)


def healthy(d: Daemon) -> bool:
    return http_get(d.metrics_url + "/healthz")[0] == 200


@pytest.fixture
def tokens(sock_dir: Path) -> dict[str, str]:
    key = write_key(sock_dir / "pool.key")
    return {
        "key": str(key),
        "a": token_file(sock_dir / "a.token", key, "ns-a/qwen"),
        "b": token_file(sock_dir / "b.token", key, "ns-b/qwen"),
    }


def test_a_scribbled_header_breaks_no_other_tenant_and_no_restart(
    daemons: list[Daemon], sock_dir: Path, tokens: dict[str, str]
) -> None:
    device = sock_dir / "dax0.0"  # kept across restarts, as a device is
    with open(device, "wb") as fh:
        fh.truncate(8 * MiB)
    args = ("--device", str(device), "--auth-key-file", tokens["key"])
    d = start_serve(daemons, sock_dir, *args, size="4Mi")
    a = PoolClient(d.ready["listen"], timeout_s=5, token_file=tokens["a"])
    assert a.put(K, A_BYTES)
    epoch = status(d)["epoch"]
    b = map_as_tenant(d, Path(tokens["b"]).read_text().strip())
    out = bytearray(len(A_BYTES))
    for _ in range(3):
        scribble(b)  # right before each connect: whether or not the daemon has put it back since
        fresh = PoolClient(d.ready["listen"], timeout_s=5, token_file=tokens["a"])
        assert fresh.get_into(K, out) and out == A_BYTES, "another tenant's connect or load failed"
        fresh.close()
    assert a.get_into(K, out) and out == A_BYTES
    assert d.proc.poll() is None and status(d)["epoch"] == epoch  # not restarted, epoch untouched
    # The daemon puts its header back (a restart, or a second node, finds the memory by it).
    wait_for(lambda: read_header_from(b) is not None and read_header_from(b).epoch == epoch, "the header restored")

    # A restart that finds a poisoned epoch (written while no daemon ran) still comes up, with a sane one.
    assert d.stop() == 0
    poison_epoch(b)
    again = start_serve(daemons, sock_dir, *args, size="4Mi")
    assert 0 < int(again.ready["epoch"]) < 2**63 and int(again.ready["epoch"]) != epoch
    assert PoolClient(again.ready["listen"], timeout_s=5, token_file=tokens["a"]).put(K, A_BYTES)
    b.close()


def test_a_scribbled_device_header_keeps_every_node_serving(daemons: list[Daemon], sock_dir: Path) -> None:
    device = sock_dir / "dax0.0"
    with open(device, "wb") as fh:
        fh.truncate(8 * MiB)
    port = free_port()
    start_metadata(daemons, port)
    node_a = start_agent(daemons, sock_dir, "node-a", port, device)
    node_b = start_agent(daemons, sock_dir, "node-b", port, device)
    assert PoolClient(node_a.ready["listen"], timeout_s=5).put(K, A_BYTES)
    b = map_as_tenant(node_b, None)
    original = bytes(b[:HEADER_BYTES])
    b[32:48] = os.urandom(16)  # another uuid: "not a device of this pool"
    struct.pack_into("<Q", b, EPOCH_AT, 2**64 - 1)
    # Either an agent puts the header back, or one of them believes it and stops serving.
    wait_for(
        lambda: bytes(b[:HEADER_BYTES]) == original or not healthy(node_a) or not healthy(node_b),
        "the header restored, or an agent taken out by it",
    )
    assert healthy(node_a) and healthy(node_b)
    out = bytearray(len(A_BYTES))
    for node in (node_a, node_b):
        scribble(b)
        client = PoolClient(node.ready["listen"], timeout_s=5)
        assert client.get_into(K, out) and out == A_BYTES
        client.close()
    b.close()


def test_memory_opened_by_path_is_checked_by_the_kernel_not_by_its_header(
    daemons: list[Daemon], sock_dir: Path
) -> None:
    """Over TCP the client opens the memory by path: another file there, header and all, is refused."""
    shm = sock_dir / "tcp.shm"
    d = Daemon(
        ["serve", "--listen", "tcp://127.0.0.1:0", "--size", "4Mi", "--shm-path", str(shm),
         "--metrics-addr", "127.0.0.1:0"]
    )  # fmt: skip
    daemons.append(d)
    assert PoolClient(d.ready["listen"], timeout_s=5).put(K, A_BYTES)
    copy = sock_dir / "copy.shm"
    copy.write_bytes(shm.read_bytes())  # the same bytes, the same header: another file
    os.replace(copy, shm)
    with pytest.raises(PoolUnavailable, match="not the daemon's pool memory"):
        PoolClient(d.ready["listen"], timeout_s=5).put(K, A_BYTES)
