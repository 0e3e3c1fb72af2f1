"""What a local cluster leaves behind when the process that started it dies without cleaning up.

    python -m maru_localcluster.reaper OWNER_PID WORKDIR [--keep]    (stdin: a pipe from the owner)

Started with the cluster, in a session of its own, it reads its standard input until end of file,
which the kernel delivers when the cluster's process ends, however it ends (SIGKILL included). Then:

1. it waits for every process of the cluster to end: those whose command line or environment names
   the cluster's state folder (kubelets, container shims, CSI plugins, an operator started against
   it). Most are already going: they die with the cluster's process through parent-death signals
   (kubelets first stop their pods, containers die with their shims);
2. after ``GRACE_S`` it kills those that remain;
3. it removes the state folder (unless ``--keep``).

Mounts need nothing: they live in the kubelets' private mount namespaces, as the network lives in
namespaces held by processes, and both go with the last process in them. After a clean ``stop()``
the pipe closes too, and the reaper finds nothing to do.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import time
from pathlib import Path

GRACE_S = 20.0


def _ancestors(pid: int) -> set[int]:
    """``pid`` and its ancestors: never the reaper's to end (the owner may outlive the cluster)."""
    chain = set()
    while pid > 1 and pid not in chain:
        chain.add(pid)
        try:
            pid = int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return chain


def processes_naming(folder: str, spare: set[int] = frozenset()) -> list[int]:  # type: ignore[assignment]
    """Live processes (not this one, none of ``spare``) whose command line or environment contains ``folder``."""
    needle = folder.encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid() or int(entry.name) in spare:
            continue
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            if needle in (entry / "cmdline").read_bytes() or needle in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except (OSError, IndexError):
            continue
    return found


def reap(folder: str, *, keep: bool, spare: set[int], grace_s: float = GRACE_S) -> list[int]:
    """End what remains of the cluster whose state is ``folder``; returns the pids it had to kill."""
    deadline = time.monotonic() + grace_s
    while (left := processes_naming(folder, spare)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if left:
        time.sleep(0.5)
    if not keep:
        shutil.rmtree(folder, ignore_errors=True)
    return left


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    keep = "--keep" in args
    rest = [a for a in args if a != "--keep"]
    if len(rest) != 2 or not rest[0].isdigit():
        print("usage: python -m maru_localcluster.reaper OWNER_PID WORKDIR [--keep]", file=sys.stderr)
        return 2
    owner, folders = int(rest[0]), rest[1:]
    spare = _ancestors(owner)  # read now, while the owner is alive to be walked from
    # Not the terminal's Ctrl-C, not the cluster's signals: only the end of the pipe ends the wait.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while sys.stdin.buffer.read(4096):
        pass
    killed = reap(folders[0], keep=keep, spare=spare)
    if killed:
        print(
            f"local cluster reaper: killed {len(killed)} leftover process(es) of {folders[0]}: {killed}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
