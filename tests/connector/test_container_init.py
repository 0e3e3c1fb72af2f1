"""maru_common.init, the first process of the operator's vLLM containers: signals reach a program that has
no handler for them yet, its exit code is the container's, and orphans are reaped.

The PID 1 cases run the init as the first process of a PID namespace of its own (``unshare --pid``, root),
where the kernel drops every signal PID 1 has no handler for: what a container's PID 1 lives with.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from maru_common.init import NOT_FOUND, main

INIT = [sys.executable, "-m", "maru_common.init"]
# A program that, like vLLM while it loads a model, has no SIGTERM handler: it says it is up and sleeps.
NO_HANDLER = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(300)"]
CONNECTOR = str(Path(__file__).resolve().parents[2] / "connector")


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [CONNECTOR, os.environ.get("PYTHONPATH")]))}


def in_own_pid_namespace(argv: list[str], tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path]:
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        pytest.skip("a PID namespace of its own needs unshare and root")
    out = tmp_path / "out.log"
    with open(out, "wb") as log:
        proc = subprocess.Popen([unshare, "--pid", "--fork", "--kill-child", *argv], stdout=log, stderr=log, env=env())
    return proc, out


def first_process(proc: subprocess.Popen[bytes]) -> int:
    """The host pid of the namespace's PID 1 (unshare's one child)."""
    deadline = time.monotonic() + 60
    while True:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        if children:
            return int(children[0])
        assert proc.poll() is None and time.monotonic() < deadline, "unshare started no process"
        time.sleep(0.02)


def wait_for(out: Path, text: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while text not in out.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
        time.sleep(0.02)


def children_of(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def state_of(pid: int) -> str:
    # /proc/PID/stat: "pid (comm) S ..."; comm may hold spaces, the state follows its closing parenthesis.
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_as_pid_1_a_sigterm_stops_a_program_that_has_no_handler_yet(tmp_path: Path) -> None:
    proc, out = in_own_pid_namespace([*INIT, *NO_HANDLER], tmp_path)
    try:
        init = first_process(proc)
        wait_for(out, "up", proc)
        os.kill(init, signal.SIGTERM)  # from outside the namespace, as the kubelet's runtime sends it
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM, out.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_as_pid_1_it_reaps_the_orphans_it_inherits(tmp_path: Path) -> None:
    # The subshell exits at once; its `sleep` becomes the init's child and exits soon after. Unreaped, it
    # would stay a zombie under PID 1 for the container's life.
    program = ["sh", "-c", "(sleep 0.2 &); echo up; sleep 300"]
    proc, out = in_own_pid_namespace([*INIT, *program], tmp_path)
    try:
        init = first_process(proc)
        wait_for(out, "up", proc)
        deadline = time.monotonic() + 60
        while len(children := children_of(init)) != 1:
            assert time.monotonic() < deadline, [(c, state_of(c)) for c in children]
            time.sleep(0.05)
        assert state_of(children[0]) != "Z"
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize(
    ("program", "code"),
    [
        (["sh", "-c", "exit 3"], 3),
        (["sh", "-c", "kill -KILL $$"], 128 + signal.SIGKILL),
        (["no-such-program-anywhere"], NOT_FOUND),
    ],
)
def test_the_exit_code_is_the_programs(program: list[str], code: int) -> None:
    done = subprocess.run([*INIT, *program], env=env(), capture_output=True, timeout=60, check=False)
    assert done.returncode == code, done.stderr.decode()
    if code == NOT_FOUND:
        assert b"no-such-program-anywhere" in done.stderr


def test_a_signal_reaches_the_programs_own_handler(tmp_path: Path) -> None:
    program = [
        sys.executable,
        "-c",
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))\n"
        "print('up', flush=True)\n"
        "time.sleep(300)\n",
    ]
    out = tmp_path / "out.log"
    with open(out, "wb") as log:
        proc = subprocess.Popen([*INIT, *program], stdout=log, stderr=log, env=env())
    try:
        wait_for(out, "up", proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 7, out.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_without_a_command_it_says_how_to_use_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: python3 -m maru_common.init" in capsys.readouterr().out
