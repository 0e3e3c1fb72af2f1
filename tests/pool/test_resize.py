"""A pool daemon restarted with another ``--size`` under engines that still map the old memory.

Engines keep their mapping across a daemon restart (they reconnect, they do not remap first). A shm file
truncated under that mapping turns the engine's next copy past the new end into SIGBUS, which kills
the engine. So a smaller ``--size`` never shrinks the file in place; a larger one grows it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.support.pool import Daemon, connector_env, start_serve, status

MiB = 1 << 20

# A stand-in engine: maps the pool memory it gets in the hello, says so, waits, then touches the
# last page of its mapping (where a chunk of the old pool could be copied to or from).
ENGINE = textwrap.dedent(
    """
    import mmap, os, socket, sys
    from maru_pool import protocol

    sock = socket.socket(socket.AF_UNIX)
    sock.connect(sys.argv[1])
    sock.settimeout(10)
    protocol.send_msg(sock, {"op": "hello"})
    reply, fds = protocol.recv_msg(sock, max_fds=8)
    sock.close()
    size = reply["regions"][0]["map_size"]
    mm = mmap.mmap(fds[0], size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    for fd in fds:
        os.close(fd)
    print("mapped", size, flush=True)
    sys.stdin.readline()
    mm[size - 1] = 0x5A
    print("touched", mm[size - 1], flush=True)
    """
)


def map_in_engine(d: Daemon) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", ENGINE, d.ready["listen"].removeprefix("unix://")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=connector_env(),
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("mapped "), proc.communicate()[1]
    return proc


def test_a_live_mapping_survives_a_restart_with_a_smaller_size(daemons: list[Daemon], sock_dir: Path) -> None:
    first = start_serve(daemons, sock_dir, size="8Mi")
    engine = map_in_engine(first)
    try:
        old_size = os.stat(sock_dir / "pool.shm").st_size
        # A crash (or a killed container) leaves the file behind; a clean stop removes it.
        first.stop(sig=signal.SIGKILL)

        second = start_serve(daemons, sock_dir, size="4Mi")
        out, err = engine.communicate("go\n", timeout=60)
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.communicate()
    assert engine.returncode == 0, f"engine died with {engine.returncode} (SIGBUS is -7): {err}"
    assert "touched 90" in out
    # The file kept its size; the restarted daemon serves the capacity it was asked for.
    assert os.stat(sock_dir / "pool.shm").st_size == old_size
    assert int(status(second)["capacity_bytes"]) == 4 * MiB
    second.stop()
    assert "keeps its" in (second.proc.stderr.read() if second.proc.stderr else "")


def test_a_larger_size_grows_the_file(daemons: list[Daemon], sock_dir: Path) -> None:
    start_serve(daemons, sock_dir, size="4Mi").stop(sig=signal.SIGKILL)
    small = os.stat(sock_dir / "pool.shm").st_size
    start_serve(daemons, sock_dir, size="8Mi")
    assert os.stat(sock_dir / "pool.shm").st_size == small + 4 * MiB
