"""Real ``maru-pool`` daemons as subprocesses, and what the tests ask of them (HTTP, CLI, tokens, metrics)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from maru_contracts import tenancy
from maru_pool import PoolClient, protocol
from tests.support.daemon import START_TIMEOUT_S, ReadyDaemon, connector_env


class Daemon(ReadyDaemon):
    """A running ``maru-pool`` subprocess and the fields of its ready line."""

    module = "maru_pool"
    program = "maru-pool"

    def __init__(self, args: list[str]) -> None:
        super().__init__(*args)

    @property
    def metrics_url(self) -> str:
        return f"http://{self.ready['metrics']}"


def start_serve(daemons: list[Daemon], sock_dir: Path, *extra: str, size: str = "8Mi") -> Daemon:
    d = Daemon(
        [
            "serve",
            "--listen",
            f"unix://{sock_dir}/pool.sock",
            "--size",
            size,
            "--shm-path",
            str(sock_dir / "pool.shm"),
            "--metrics-addr",
            "127.0.0.1:0",
            *extra,
        ]
    )
    daemons.append(d)
    return d


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "maru_pool", *args],
        capture_output=True,
        text=True,
        env=connector_env(),
        timeout=START_TIMEOUT_S,
    )


def wait_for(condition: Callable[[], bool], what: str) -> None:
    """Poll until ``condition`` holds; the bound only keeps a broken daemon from hanging the suite."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.05)


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"metric {name} not exported")


def write_key(path: Path) -> Path:
    path.write_bytes(os.urandom(tenancy.KEY_BYTES))
    return path


def token_file(path: Path, key_file: Path, scope: str) -> str:
    """A tenant's token, made by the real ``maru-pool token`` command."""
    result = run_cli("token", "--key-file", str(key_file), "--tenant", scope)
    assert result.returncode == 0, result.stderr
    path.write_text(result.stdout)
    return str(path)


class Raw:
    """One connection speaking the wire protocol directly, to send what a real client never would."""

    def __init__(self, url: str) -> None:
        if url.startswith("unix://"):
            self.sock = socket.socket(socket.AF_UNIX)
            self.sock.connect(url.removeprefix("unix://"))
        else:
            host, port = url.removeprefix("tcp://").rsplit(":", 1)
            self.sock = socket.create_connection((host, int(port)))
        self.sock.settimeout(10)

    def call(self, msg: dict[str, Any]) -> dict[str, Any]:
        protocol.send_msg(self.sock, msg)
        reply, fds = protocol.recv_msg(self.sock, max_fds=8)
        for fd in fds:
            os.close(fd)
        assert reply is not None
        return reply

    def close(self) -> None:
        self.sock.close()


def client(d: Daemon, token: str | None) -> PoolClient:
    return PoolClient(d.ready["listen"], timeout_s=5, token_file=token)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status(d: Daemon) -> dict:
    with urllib.request.urlopen(d.metrics_url + "/status", timeout=5) as resp:
        return json.loads(resp.read())


def start_metadata(daemons: list[Daemon], port: int, size: str | None = "4Mi", extra: Sequence[str] = ()) -> Daemon:
    d = Daemon(
        ["metadata", "--listen", f"tcp://127.0.0.1:{port}", *(["--size", size] if size else []),
         "--metrics-addr", "127.0.0.1:0", "--lease-seconds", "30", *extra]
    )  # fmt: skip
    daemons.append(d)
    return d


def start_agent(
    daemons: list[Daemon], sock_dir: Path, name: str, port: int, *devices: Path, extra: Sequence[str] = ()
) -> Daemon:
    flags = [x for d in devices for x in ("--device", str(d))]
    d = Daemon(
        ["agent", "--listen", f"unix://{sock_dir}/{name}.sock", "--metadata", f"tcp://127.0.0.1:{port}",
         *flags, "--node-name", name, "--heartbeat-seconds", "0.1", "--metrics-addr", "127.0.0.1:0", *extra]
    )  # fmt: skip
    daemons.append(d)
    return d
