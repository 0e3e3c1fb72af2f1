"""A hostile client against real pool daemons: what it can make a daemon hold before and after its hello.

Before hello a connection may send one small frame and must send it within ``--hello-timeout-seconds``;
after hello a frame is bounded by ``--max-frame``; connections are capped per peer (uid on a Unix socket, IP on
TCP) and in total. Nothing here is announced and then allocated: the daemon's RSS is read from /proc.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from maru_pool import PoolClient, PoolError
from tests.support.pool import (
    START_TIMEOUT_S,
    Daemon,
    Raw,
    free_port,
    http_get,
    metric,
    run_cli,
    start_metadata,
    start_serve,
    token_file,
    wait_for,
    write_key,
)

MiB = 1 << 20
K = b"\x07" * 32


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def connect(url: str) -> socket.socket:
    if url.startswith("unix://"):
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(url.removeprefix("unix://"))
    else:
        host, port = url.removeprefix("tcp://").rsplit(":", 1)
        sock = socket.create_connection((host, int(port)))
    return sock


def wait_closed(socks: list[socket.socket]) -> list[bytes | None]:
    """What each socket received until the daemon closed it; None for one still open at the (generous) bound."""
    got: dict[int, bytearray] = {i: bytearray() for i in range(len(socks))}
    done: dict[int, bool] = {}
    sel = selectors.DefaultSelector()
    for i, sock in enumerate(socks):
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ, i)
    deadline = time.monotonic() + START_TIMEOUT_S
    while len(done) < len(socks) and time.monotonic() < deadline:
        for sel_key, _ in sel.select(timeout=0.2):
            i = sel_key.data
            try:
                data = socks[i].recv(65536)
            except (ConnectionResetError, BrokenPipeError):
                data = b""
            if data:
                got[i] += data
            else:
                done[i] = True
                sel.unregister(socks[i])
    sel.close()
    return [bytes(got[i]) if i in done else None for i in range(len(socks))]


def error_of(data: bytes | None) -> str | None:
    """The error code of the frame the daemon sent before closing, if any."""
    if not data or len(data) < 4:
        return None
    (n,) = struct.unpack(">I", data[:4])
    return json.loads(data[4 : 4 + n]).get("error")


@pytest.fixture
def key_file(sock_dir: Path) -> Path:
    return write_key(sock_dir / "pool.key")


@pytest.fixture
def token(sock_dir: Path, key_file: Path) -> str:
    return Path(token_file(sock_dir / "a.token", key_file, "ns-a/qwen")).read_text().strip()


def start(kind: str, daemons: list[Daemon], sock_dir: Path, key_file: Path, *extra: str) -> Daemon:
    """The serve daemon on its Unix socket, or the metadata server on its TCP port; both with a pool key."""
    auth = ("--auth-key-file", str(key_file))
    if kind == "serve":
        return start_serve(daemons, sock_dir, *auth, *extra)
    return start_metadata(daemons, free_port(), extra=(*auth, *extra))


def authenticated(d: Daemon, token: str) -> Raw:
    raw = Raw(d.ready["listen"])
    reply = raw.call({"op": "hello", "memory": False, "token": token})
    assert reply["ok"], reply
    return raw


def works(raw: Raw) -> dict[str, Any]:
    reply = raw.call({"op": "status"})  # answered by every role, with or without agents
    assert reply["ok"], reply
    return reply


@pytest.fixture(params=["serve", "metadata"])
def kind(request: pytest.FixtureRequest) -> Iterator[str]:
    yield request.param


def test_frames_announced_before_hello_cost_no_memory(
    kind: str, daemons: list[Daemon], sock_dir: Path, key_file: Path, token: str
) -> None:
    d = start(kind, daemons, sock_dir, key_file)  # default limits
    held = authenticated(d, token)
    before = rss_bytes(d.proc.pid)
    socks = [connect(d.ready["listen"]) for _ in range(4)]
    for sock in socks:
        sock.sendall(struct.pack(">I", 64 * MiB))  # a 64 MiB frame, then nothing
    received = wait_closed(socks)
    grown = rss_bytes(d.proc.pid) - before
    for sock in socks:
        sock.close()
    assert grown < 8 * MiB, f"the daemon's RSS grew by {grown / MiB:.1f} MiB for 4 announced frames"
    assert all(r is not None for r in received), "connections that announced 64 MiB before hello were kept open"
    assert {error_of(r) for r in received} == {"frame_too_large"}, received
    works(held)  # an authenticated connection is unaffected
    assert d.proc.poll() is None


def test_a_connection_that_does_not_say_hello_in_time_is_closed(
    kind: str, daemons: list[Daemon], sock_dir: Path, key_file: Path, token: str
) -> None:
    d = start(kind, daemons, sock_dir, key_file, "--hello-timeout-seconds", "1")
    held = authenticated(d, token)
    silent, partial_header, partial_body = (connect(d.ready["listen"]) for _ in range(3))
    partial_header.sendall(b"\x00\x00")
    partial_body.sendall(struct.pack(">I", 100) + b'{"op":')
    received = wait_closed([silent, partial_header, partial_body])
    assert all(r is not None for r in received), f"unauthenticated connections were kept open: {received}"
    assert {error_of(r) for r in received} == {"hello_timeout"}, received
    works(held)  # authenticated before the bound: not subject to it


@pytest.mark.parametrize("cap", ["per-peer", "total"])
def test_connections_beyond_the_caps_are_refused_while_an_authenticated_client_keeps_working(
    kind: str, cap: str, daemons: list[Daemon], sock_dir: Path, key_file: Path, token: str
) -> None:
    flags = ["--max-connections-per-peer", "3"] if cap == "per-peer" else ["--max-connections", "3"]
    d = start(kind, daemons, sock_dir, key_file, *flags, "--hello-timeout-seconds", "120")
    held = authenticated(d, token)
    flood = [connect(d.ready["listen"]) for _ in range(2)]  # with `held`: the cap of 3
    refused = connect(d.ready["listen"])
    (got,) = wait_closed([refused])
    assert error_of(got) == "too_many_connections", got
    assert got is not None
    message = json.loads(got[4:])["message"]
    if cap == "per-peer":
        assert (f"uid {os.getuid()}" if kind == "serve" else "127.0.0.1") in message, message
    else:
        assert "3 connections" in message, message
    works(held)
    for sock in flood:
        sock.close()

    def admitted() -> bool:  # the daemon frees a slot once it sees the close
        try:
            authenticated(d, token).close()
        except (OSError, AssertionError):
            return False
        return True

    wait_for(admitted, "a new connection admitted once the flood closed")
    _, text = http_get(d.metrics_url + "/metrics")
    assert metric(text, "maru_pool_connection_refusals_total") >= 1
    held.close()
    d.stop()
    assert d.proc.stderr is not None
    log = d.proc.stderr.read()
    assert "too many connections" in log


def test_frames_after_hello_are_bounded_and_read_as_they_arrive(
    daemons: list[Daemon], sock_dir: Path, key_file: Path
) -> None:
    d = start_serve(daemons, sock_dir, "--auth-key-file", str(key_file), "--max-frame", "64Ki")
    tok = token_file(sock_dir / "b.token", key_file, "ns-b/qwen")
    client = PoolClient(d.ready["listen"], timeout_s=5, token_file=tok)
    assert client.put(K, b"x" * 4096)
    with pytest.raises(PoolError, match="frame_too_large"):
        client.lookup_prefix([i.to_bytes(32, "big") for i in range(2000)])  # ~134 KB of hex keys
    assert client.lookup_prefix([K]) == 1  # the client reconnects on its own
    raw = authenticated(d, Path(tok).read_text().strip())
    before = rss_bytes(d.proc.pid)
    raw.sock.sendall(struct.pack(">I", 64 * MiB))
    (got,) = wait_closed([raw.sock])
    assert error_of(got) == "frame_too_large"
    assert rss_bytes(d.proc.pid) - before < 8 * MiB


def test_an_idle_connection_is_closed_and_the_client_reconnects(
    daemons: list[Daemon], sock_dir: Path, key_file: Path
) -> None:
    d = start_serve(daemons, sock_dir, "--auth-key-file", str(key_file), "--idle-timeout-seconds", "1")
    tok = token_file(sock_dir / "b.token", key_file, "ns-b/qwen")
    client = PoolClient(d.ready["listen"], timeout_s=5, token_file=tok)
    assert client.put(K, b"x" * 4096)
    idle = authenticated(d, Path(tok).read_text().strip())
    (got,) = wait_closed([idle.sock])
    assert got == b""  # closed without a frame: nobody is waiting for one
    assert client.lookup_prefix([K]) == 1  # its connection was closed too; the next call reconnects


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--max-connections", "0"), ("--max-connections-per-peer", "x"), ("--hello-timeout-seconds", "0"),
     ("--max-frame", "1Ki"), ("--max-hello-frame", "1"), ("--max-tenant-pins", "0"), ("--max-tenant-leases", "x")],
)  # fmt: skip
def test_bad_limit_flags_exit_2_naming_the_flag(sock_dir: Path, flag: str, value: str) -> None:
    result = run_cli("serve", "--listen", f"unix://{sock_dir}/x.sock", "--size", "1Mi",
                     "--shm-path", str(sock_dir / "x.shm"), flag, value)  # fmt: skip
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert flag in line, line
