"""A CXL pool simulated on one machine: a metadata server and two node agents mapping one file."""

from __future__ import annotations

import mmap
import os
import signal
import urllib.request
from pathlib import Path

import pytest

from maru_pool import LeaseLost, PoolClient, PoolUnavailable
from maru_pool.memory import HEADER_SIZE, read_header_from
from tests.support.pool import Daemon, free_port, start_agent, start_metadata, status, wait_for

MiB = 1 << 20


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


@pytest.fixture
def device(sock_dir: Path) -> Path:
    path = sock_dir / "dax0.0"
    with open(path, "wb") as fh:
        fh.truncate(8 * MiB)
    return path


@pytest.fixture
def cluster(daemons: list[Daemon], sock_dir: Path, device: Path) -> tuple[Daemon, Daemon, Daemon, int]:
    port = free_port()
    meta = start_metadata(daemons, port)
    a = start_agent(daemons, sock_dir, "node-a", port, device)
    b = start_agent(daemons, sock_dir, "node-b", port, device)
    return meta, a, b, port


def test_chunk_written_on_one_node_is_read_on_the_other(cluster: tuple[Daemon, Daemon, Daemon, int]) -> None:
    meta, a, b, _ = cluster
    assert a.ready["connected"] == "true" and a.ready["backend"] == "dax"
    on_a = PoolClient(a.ready["listen"], timeout_s=5)
    on_b = PoolClient(b.ready["listen"], timeout_s=5)
    data = os.urandom(3 * MiB // 2)
    assert on_a.put(key(1), data)
    assert on_b.lookup_prefix([key(1), key(2)]) == 1
    out = bytearray(len(data))
    assert on_b.get_into(key(1), out) and out == data
    assert on_b.put(key(1), data) is False  # one index for the whole pool
    # Batched paths through the other node.
    leases = on_b.begin_write_many([(key(2), 1000), (key(3), 2000)])
    for lease in leases:
        lease.buffer[:] = lease.key[-1:] * lease.nbytes
    assert on_b.commit_many(leases) == [True, True]
    pins = on_a.open_read_many([key(2), key(3)])
    assert [bytes(p.buffer) for p in pins] == [b"\x02" * 1000, b"\x03" * 2000]
    on_a.release_many(pins)
    assert on_a.stats()["pins"] == 0
    assert status(meta)["chunks"] == 3


def test_metadata_status_reports_agents_and_capacity(cluster: tuple[Daemon, Daemon, Daemon, int]) -> None:
    meta, a, _, _ = cluster
    PoolClient(a.ready["listen"], timeout_s=5).put(key(1), b"x" * MiB)
    s = status(meta)
    assert s["role"] == "metadata" and s["backend"] == "dax"
    assert s["capacity_bytes"] == 4 * MiB and s["used_bytes"] == MiB and s["chunks"] == 1
    assert [(n["node"], n["ready"]) for n in s["nodes"]] == [("node-a", True), ("node-b", True)]
    agent_status = status(a)
    assert agent_status["metadata_connected"] is True and agent_status["epoch"] == s["epoch"]


def test_agents_write_the_metadata_epoch_into_the_shared_header(
    cluster: tuple[Daemon, Daemon, Daemon, int], device: Path
) -> None:
    meta, _, _, _ = cluster
    with open(device, "r+b") as fh, mmap.mmap(fh.fileno(), HEADER_SIZE) as mm:
        header = read_header_from(mm)
    assert header is not None and header.epoch == int(meta.ready["epoch"])


def test_client_pointed_at_the_metadata_server_is_told_where_to_go(
    cluster: tuple[Daemon, Daemon, Daemon, int],
) -> None:
    meta, _, _, _ = cluster
    with pytest.raises(PoolUnavailable, match="node agent"):
        PoolClient(meta.ready["listen"], timeout_s=5).lookup_prefix([key(1)])


def test_metadata_restart_drops_the_index_and_old_leases(
    cluster: tuple[Daemon, Daemon, Daemon, int], daemons: list[Daemon]
) -> None:
    meta, a, b, port = cluster
    on_a = PoolClient(a.ready["listen"], timeout_s=5)
    on_a.put(key(1), b"1" * MiB)
    lease = on_a.begin_write(key(2), MiB)
    meta.stop(signal.SIGKILL)
    meta2 = start_metadata(daemons, port)
    assert int(meta2.ready["epoch"]) > int(meta.ready["epoch"])
    wait_for(lambda: status(b)["epoch"] == int(meta2.ready["epoch"]), "agents adopt the new epoch")
    with pytest.raises(LeaseLost):
        lease.commit()
    on_b = PoolClient(b.ready["listen"], timeout_s=5)
    assert on_b.lookup_prefix([key(1)]) == 0
    assert on_a.lookup_prefix([key(1)]) == 0
    assert on_b.put(key(1), b"new" * 1000)
    out = bytearray(3000)
    assert on_a.get_into(key(1), out) and out == b"new" * 1000


def test_agent_started_before_metadata_refuses_then_serves(daemons: list[Daemon], sock_dir: Path, device: Path) -> None:
    port = free_port()
    agent = start_agent(daemons, sock_dir, "early", port, device)
    assert agent.ready["connected"] == "false"
    client = PoolClient(agent.ready["listen"], timeout_s=5)
    with pytest.raises(PoolUnavailable, match="metadata server"):
        client.lookup_prefix([key(1)])
    start_metadata(daemons, port)
    wait_for(lambda: status(agent)["metadata_connected"], "the agent reaches the metadata server")
    assert client.put(key(1), b"late" * 100)


def test_node_with_a_smaller_device_is_refused_with_the_fix(
    cluster: tuple[Daemon, Daemon, Daemon, int], daemons: list[Daemon], sock_dir: Path
) -> None:
    meta, _, _, port = cluster
    small = sock_dir / "dax-small"
    # The pool's device as another node sees it, but smaller (say, a different namespace size).
    small.write_bytes((sock_dir / "dax0.0").read_bytes()[:HEADER_SIZE] + bytes(2 * MiB - HEADER_SIZE))
    agent = start_agent(daemons, sock_dir, "node-c", port, small)
    with pytest.raises(PoolUnavailable, match="--size"):
        PoolClient(agent.ready["listen"], timeout_s=5).lookup_prefix([key(1)])
    assert "lower the metadata server's --size" in status(agent)["problem"]
    nodes = {n["node"]: n["ready"] for n in status(meta)["nodes"]}
    assert nodes == {"node-a": True, "node-b": True, "node-c": False}


def test_without_size_the_pool_spans_every_listed_device(daemons: list[Daemon], sock_dir: Path) -> None:
    devices = []
    for name, size in (("dax0.0", 3 * MiB), ("dax1.0", 5 * MiB)):
        path = sock_dir / name
        path.write_bytes(bytes(size))
        devices.append(path)
    port = free_port()
    meta = start_metadata(daemons, port, size=None)
    a = start_agent(daemons, sock_dir, "node-a", port, *devices)
    b = start_agent(daemons, sock_dir, "node-b", port, *devices)
    s = status(meta)
    assert s["regions"] == [3 * MiB - HEADER_SIZE, 5 * MiB - HEADER_SIZE]
    assert s["capacity_bytes"] == 8 * MiB - 2 * HEADER_SIZE
    on_a = PoolClient(a.ready["listen"], timeout_s=5)
    on_b = PoolClient(b.ready["listen"], timeout_s=5)
    payloads = {key(i): os.urandom(MiB) for i in range(7)}  # 2 fit in the first device, 4 in the second
    for k, v in payloads.items():
        assert on_a.put(k, v)
    assert status(meta)["stats"]["evictions"] == 1  # the seventh did not fit without evicting
    out = bytearray(MiB)
    found = 0
    for k, v in payloads.items():
        if on_b.get_into(k, out):
            assert out == v
            found += 1
    assert found == 6
    # Each device got its share: chunk bytes sit in both files.
    assert any(device.read_bytes()[HEADER_SIZE:].strip(b"\0") for device in devices[:1])
    assert any(device.read_bytes()[HEADER_SIZE:].strip(b"\0") for device in devices[1:])


def test_metadata_without_agents_answers_unavailable_and_reports_empty_status(daemons: list[Daemon]) -> None:
    meta = start_metadata(daemons, free_port(), size=None)
    s = status(meta)
    assert s["capacity_bytes"] == 0 and s["nodes"] == [] and s["regions"] == []
    with urllib.request.urlopen(meta.metrics_url + "/metrics", timeout=5) as resp:
        assert "maru_pool_capacity_bytes 0.0" in resp.read().decode()


def test_devices_listed_in_another_order_are_matched_by_their_header(daemons: list[Daemon], sock_dir: Path) -> None:
    """Node b lists the same two devices in the other order: each is still found by its UUID."""
    first, second = sock_dir / "dax0.0", sock_dir / "dax1.0"
    for path in (first, second):
        path.write_bytes(bytes(3 * MiB))
    port = free_port()
    start_metadata(daemons, port, size=None)
    a = start_agent(daemons, sock_dir, "node-a", port, first, second)
    b = start_agent(daemons, sock_dir, "node-b", port, second, first)
    on_a = PoolClient(a.ready["listen"], timeout_s=5)
    on_b = PoolClient(b.ready["listen"], timeout_s=5)
    payloads = {key(i): os.urandom(MiB) for i in range(4)}  # two chunks in each device
    for i, (k, v) in enumerate(payloads.items()):
        assert (on_a if i % 2 else on_b).put(k, v)
    out = bytearray(MiB)
    for k, v in payloads.items():
        for client in (on_a, on_b):
            assert client.get_into(k, out) and out == v


def test_a_device_of_another_pool_is_refused(
    cluster: tuple[Daemon, Daemon, Daemon, int], daemons: list[Daemon], sock_dir: Path
) -> None:
    """Same size, other memory: a node that lists it must not write into what it believes is the pool."""
    meta, a, _, port = cluster
    on_a = PoolClient(a.ready["listen"], timeout_s=5)
    assert on_a.put(key(1), b"pool" * 1000)
    stranger = sock_dir / "dax9.0"
    stranger.write_bytes(bytes(8 * MiB))
    c = start_agent(daemons, sock_dir, "node-c", port, stranger)
    wait_for(lambda: status(c)["problem"] is not None, "node-c is refused")
    assert "dax9.0" in status(c)["problem"] and "not a device of this pool" in status(c)["problem"]
    with pytest.raises(PoolUnavailable, match="not a device of this pool"):
        PoolClient(c.ready["listen"], timeout_s=5).lookup_prefix([key(1)])
    nodes = {n["node"]: n["ready"] for n in status(meta)["nodes"]}
    assert nodes["node-c"] is False
