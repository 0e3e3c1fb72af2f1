"""``maru-pool serve`` as a real subprocess: flags, lifecycle, leases of dead clients, restarts, metrics."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from maru_pool import ChecksumMismatch, PoolClient, PoolFull
from tests.support.pool import Daemon, connector_env, http_get, metric, run_cli, start_serve, wait_for

MiB = 1 << 20


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


# ------------------------------------------------------------------ arguments


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["serve", "--listen", "unix:///tmp/x.sock", "--size", "2XB"], "--size"),
        (["serve", "--listen", "unix:///no/such/dir/pool.sock", "--size", "1Mi"], "--listen"),
        (["serve", "--listen", "unix:///tmp/x.sock", "--size", "1Mi", "--device", "/no/dax9.9"], "--device"),
        (["serve", "--listen", "unix:///tmp/x.sock"], "--size"),
        (["serve", "--listen", "http://x", "--size", "1Mi"], "--listen"),
        (["serve", "--listen", "unix:///tmp/x.sock", "--size", "1Mi", "--shm-path", "/no/dir/f"], "--shm-path"),
        (["serve", "--listen", "unix:///tmp/x.sock", "--size", "1Mi", "--lease-seconds", "0"], "--lease-seconds"),
        (["agent", "--listen", "unix:///tmp/x.sock", "--metadata", "tcp://h:1", "--device", "/no/dax0.0"], "--device"),
        (
            ["agent", "--listen", "unix:///tmp/x.sock", "--metadata", "unix:///m.sock", "--device", "/dev/null"],
            "--metadata",
        ),
        (["metadata", "--listen", "tcp://127.0.0.1:0", "--size", "0"], "--size"),
        (["serve", "--listen", "unix:///tmp/x.sock", "--size", "1Mi", "--eviction", "fifo"], "--eviction"),
    ],
)
def test_bad_arguments_exit_nonzero_with_one_line_naming_the_flag(args: list[str], flag: str) -> None:
    result = run_cli(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert flag in lines[0] and "error" in lines[0]
    assert result.stdout == ""


def test_metrics_port_in_use_is_reported(daemons: list[Daemon], sock_dir: Path) -> None:
    first = start_serve(daemons, sock_dir)
    result = run_cli(
        "serve", "--listen", f"unix://{sock_dir}/other.sock", "--size", "1Mi",
        "--shm-path", str(sock_dir / "other.shm"), "--metrics-addr", first.ready["metrics"],
    )  # fmt: skip
    assert result.returncode == 2 and "--metrics-addr" in result.stderr
    assert not (sock_dir / "other.sock").exists()


def test_second_daemon_on_a_live_socket_is_refused_and_changes_nothing(serve: Daemon, sock_dir: Path) -> None:
    client = PoolClient(serve.ready["listen"], timeout_s=5)
    client.put(key(1), b"kept" * 1000)
    shm = sock_dir / "pool.shm"
    size_before = shm.stat().st_size
    result = run_cli(
        "serve", "--listen", serve.ready["listen"], "--size", "1Mi",
        "--shm-path", str(shm), "--metrics-addr", "127.0.0.1:0",
    )  # fmt: skip
    assert result.returncode == 2 and "another pool daemon" in result.stderr
    assert shm.stat().st_size == size_before  # not resized under the live daemon
    out = bytearray(4000)
    assert client.get_into(key(1), out) and out == b"kept" * 1000
    assert PoolClient(serve.ready["listen"], timeout_s=5).lookup_prefix([key(1)]) == 1


def test_second_daemon_on_live_memory_is_refused_and_changes_nothing(serve: Daemon, sock_dir: Path) -> None:
    client = PoolClient(serve.ready["listen"], timeout_s=5)
    client.put(key(1), b"mine" * 1000)
    shm = sock_dir / "pool.shm"
    header = shm.read_bytes()[:64]
    result = run_cli(
        "serve", "--listen", f"unix://{sock_dir}/other.sock", "--size", "1Mi",
        "--shm-path", str(shm), "--metrics-addr", "127.0.0.1:0",
    )  # fmt: skip
    assert result.returncode == 2
    assert "--shm-path" in result.stderr and "in use by another pool daemon" in result.stderr
    assert shm.read_bytes()[:64] == header  # epoch untouched
    assert shm.stat().st_size == 4096 + 8 * MiB
    assert not (sock_dir / "other.sock").exists()
    out = bytearray(4000)
    assert client.get_into(key(1), out) and out == b"mine" * 1000


# ------------------------------------------------------------------ lifecycle


def test_ready_line_describes_the_pool(serve: Daemon, sock_dir: Path) -> None:
    assert serve.ready["role"] == "serve"
    assert serve.ready["listen"] == f"unix://{sock_dir}/pool.sock"
    assert serve.ready["backend"] == "shm"
    assert serve.ready["capacity"] == str(8 * MiB)
    host, port = serve.ready["metrics"].rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_exits_cleanly_and_removes_socket_and_shm(serve: Daemon, sock_dir: Path, sig: int) -> None:
    assert (sock_dir / "pool.sock").exists() and (sock_dir / "pool.shm").exists()
    assert serve.stop(sig) == 0
    assert not (sock_dir / "pool.sock").exists()
    assert not (sock_dir / "pool.shm").exists()


def test_stale_socket_of_a_killed_daemon_is_replaced(daemons: list[Daemon], sock_dir: Path) -> None:
    first = start_serve(daemons, sock_dir)
    first.stop(signal.SIGKILL)
    assert (sock_dir / "pool.sock").exists()
    second = start_serve(daemons, sock_dir)
    assert PoolClient(second.ready["listen"], timeout_s=5).put(key(1), b"x" * 10)


def test_tcp_listener_serves_local_clients_by_path(daemons: list[Daemon], sock_dir: Path) -> None:
    d = Daemon(
        ["serve", "--listen", "tcp://127.0.0.1:0", "--size", "4Mi",
         "--shm-path", str(sock_dir / "tcp.shm"), "--metrics-addr", "127.0.0.1:0"]
    )  # fmt: skip
    daemons.append(d)
    assert d.ready["listen"].startswith("tcp://127.0.0.1:") and not d.ready["listen"].endswith(":0")
    client = PoolClient(d.ready["listen"], timeout_s=5)
    client.put(key(1), b"tcp" * 100)
    out = bytearray(300)
    assert client.get_into(key(1), out) and out == b"tcp" * 100


def test_device_backend_maps_a_file_standing_in_for_devdax(daemons: list[Daemon], sock_dir: Path) -> None:
    device = sock_dir / "dax0.0"
    device.write_bytes(b"\0" * (4 * MiB))
    d = Daemon(
        ["serve", "--listen", f"unix://{sock_dir}/pool.sock", "--device", str(device),
         "--metrics-addr", "127.0.0.1:0"]
    )  # fmt: skip
    daemons.append(d)
    assert d.ready["backend"] == "dax" and d.ready["capacity"] == str(4 * MiB - 4096)
    client = PoolClient(d.ready["listen"], timeout_s=5)
    data = os.urandom(100_000)
    client.put(key(1), data)
    with client.open_read(key(1)) as pin:
        assert device.read_bytes()[4096 + pin.offset :][: len(data)] == data
    assert d.stop() == 0
    assert device.exists()  # a device is never removed


# ------------------------------------------------------------------ leases, eviction, restarts


WRITER = textwrap.dedent(
    """
    import sys, time
    from maru_pool import PoolClient
    c = PoolClient(sys.argv[1], timeout_s=5)
    lease = c.begin_write(bytes(32), int(sys.argv[2]))
    lease.buffer[:5] = b"dying"
    print("holding", flush=True)
    time.sleep(600)
    """
)


def test_client_killed_mid_write_leaks_nothing(daemons: list[Daemon], sock_dir: Path) -> None:
    d = start_serve(daemons, sock_dir, "--lease-seconds", "600", size="2Mi")
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, d.ready["listen"], str(2 * MiB)],
        stdout=subprocess.PIPE, text=True, env=connector_env(),
    )  # fmt: skip
    try:
        assert writer.stdout.readline().strip() == "holding"
        client = PoolClient(d.ready["listen"], timeout_s=5)
        assert client.stats()["used_bytes"] == 2 * MiB
        writer.kill()
        writer.wait()
    finally:
        writer.kill()
        writer.wait()
        writer.stdout.close()
    wait_for(lambda: client.stats()["used_bytes"] == 0, "the dead writer's space is reclaimed")
    stats = client.stats()
    # Given back when its connection closed, not ten minutes later when its lease would expire.
    assert stats["disconnect_releases"] == 1 and stats["lease_expiries"] == 0 and stats["writing"] == 0
    assert client.lookup_prefix([bytes(32)]) == 0
    assert client.put(bytes(32), b"alive" * 1000)  # the whole pool is usable again


def test_full_pool_evicts_lru_through_the_daemon(serve: Daemon) -> None:
    client = PoolClient(serve.ready["listen"], timeout_s=5)
    for i in range(8):  # 8 MiB pool, 1 MiB chunks: exactly full
        assert client.put(key(i), bytes([i]) * MiB)
    client.lookup_prefix([key(0)])  # key 1 becomes the least recently used
    assert client.put(key(8), b"\x08" * MiB)
    assert client.lookup_prefix([key(1)]) == 0
    assert client.lookup_prefix([key(0)]) == 1
    assert client.stats()["evictions"] == 1
    out = bytearray(MiB)
    assert client.get_into(key(8), out) and out == b"\x08" * MiB


def test_pinned_chunk_keeps_its_bytes_while_the_pool_churns(serve: Daemon) -> None:
    client = PoolClient(serve.ready["listen"], timeout_s=5)
    original = os.urandom(MiB)
    client.put(key(0), original)
    with client.open_read(key(0)) as pin:
        for i in range(1, 30):  # far more than fits: everything else is evicted over and over
            client.put(key(i), bytes([i]) * MiB)
        assert bytes(pin.buffer) == original
        pin.verify()
    assert client.lookup_prefix([key(0)]) == 1


def test_all_pinned_means_pool_full(serve: Daemon) -> None:
    client = PoolClient(serve.ready["listen"], timeout_s=5)
    pins = []
    for i in range(8):
        client.put(key(i), bytes([i]) * MiB)
        pins.append(client.open_read(key(i)))
    with pytest.raises(PoolFull):
        client.begin_write(key(99), MiB)
    client.release_many(pins)
    assert client.begin_write(key(99), MiB) is not None


def test_restart_never_serves_bytes_of_another_key(daemons: list[Daemon], sock_dir: Path) -> None:
    first = start_serve(daemons, sock_dir)
    old = PoolClient(first.ready["listen"], timeout_s=5)
    a_bytes = b"A" * MiB
    old.put(key(1), a_bytes)
    stale_pin = old.open_read(key(1))
    first.stop(signal.SIGKILL)  # the shm file survives: the new daemon maps the very same memory
    second = start_serve(daemons, sock_dir)
    assert int(second.ready["epoch"]) > int(first.ready["epoch"])

    new = PoolClient(second.ready["listen"], timeout_s=5)
    assert new.lookup_prefix([key(1)]) == 0  # the index was dropped, not trusted
    new.put(key(2), b"B" * MiB)
    with new.open_read(key(2)) as pin:
        assert pin.offset == stale_pin.offset  # the new key reuses A's bytes
    # The old client reconnects by itself; its old key is gone rather than answered with B's bytes.
    out = bytearray(MiB)
    assert old.get_into(key(1), out) is False
    assert old.lookup_prefix([key(1)]) == 0
    with pytest.raises(ChecksumMismatch):
        stale_pin.verify()
    stale_pin.release()  # refused quietly: it belongs to the old epoch
    assert old.get_into(key(2), out) and out == b"B" * MiB


# ------------------------------------------------------------------ HTTP


def test_metrics_healthz_and_status_move(daemons: list[Daemon], sock_dir: Path) -> None:
    serve = start_serve(daemons, sock_dir, "--node-name", "node-1")
    client = PoolClient(serve.ready["listen"], timeout_s=5)
    code, text = http_get(serve.metrics_url + "/metrics")
    assert code == 200
    assert metric(text, "maru_pool_capacity_bytes") == 8 * MiB
    assert metric(text, "maru_pool_chunks") == 0
    client.put(key(1), b"m" * MiB)
    client.lookup_prefix([key(1), key(2)])
    for i in range(3, 12):
        client.put(key(i), b"e" * MiB)
    _, text = http_get(serve.metrics_url + "/metrics")
    assert metric(text, "maru_pool_chunks") == 8
    assert metric(text, "maru_pool_used_bytes") == 8 * MiB
    assert metric(text, "maru_pool_hits_total") == 1
    assert metric(text, "maru_pool_misses_total") == 1
    assert metric(text, "maru_pool_evictions_total") == 2
    for name in ("lease_expiries_total", "errors_total"):
        assert metric(text, f"maru_pool_{name}") == 0

    assert http_get(serve.metrics_url + "/healthz")[0] == 200
    code, body = http_get(serve.metrics_url + "/status")
    status = json.loads(body)
    assert code == 200
    assert status["capacity_bytes"] == 8 * MiB and status["used_bytes"] == 8 * MiB
    assert status["chunks"] == 8 and status["backend"] == "shm"
    assert status["epoch"] == int(serve.ready["epoch"])
    assert status["nodes"] == [{"node": "node-1", "device": str(sock_dir / "pool.shm"), "ready": True}]
    assert http_get(serve.metrics_url + "/nope")[0] == 404
