"""A container's first process for a program not written to be one: ``python3 -m maru_common.init CMD ...``.

The first process of a PID namespace (a container's PID 1) receives only the signals it has a handler for:
the kernel drops the rest, SIGTERM included. vLLM installs its SIGTERM handler only once its HTTP server
starts, after the imports and the model load (minutes for a large model on a GPU node). A vLLM pod deleted
while it starts (a rollout's surge pod, a scale-down, a node drain) therefore ignored its SIGTERM and held
its GPUs until SIGKILL at the end of its grace period, which the operator sets long enough to drain a
request (``drainSeconds``).

This process handles the signals and passes each on to the program, which, no longer PID 1, gets the
default action (it stops) until it installs handlers of its own. It also reaps the orphans a PID 1 inherits,
and exits with the program's status (128 + the signal's number when a signal ended it, as a shell reports
it), which is what the kubelet records as the container's exit code. Docker's ``--init`` and tini do the
same; this one is part of the connector's packages, so any image that can load the connector has it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from types import FrameType

# What a container runtime or a user sends to a container's PID 1 and expects the program to see.
FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
NOT_FOUND = 127  # what a shell answers for a command it cannot find


def exit_code(wait_status: int) -> int:
    code = os.waitstatus_to_exitcode(wait_status)
    return 128 - code if code < 0 else code


def run(argv: list[str]) -> int:
    """Start ``argv``, pass signals on to it until it exits, and return its exit code."""
    child: int | None = None
    pending: list[int] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        if child is None:
            pending.append(signum)  # arrived before the program started: it gets it as soon as it has a pid
            return
        with contextlib.suppress(ProcessLookupError):  # exited already: the wait below collects it
            os.kill(child, signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    try:
        child = os.posix_spawnp(argv[0], argv, os.environ)
    except OSError as err:
        print(f"maru_common.init: cannot start {argv[0]!r}: {err}", file=sys.stderr)
        return NOT_FOUND
    for signum in pending:
        forward(signum, None)
    while True:
        try:
            # Any child: the program, or an orphan this process inherited as PID 1 (reaped, so no zombies).
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return 0  # cannot happen while the program runs; kept so a lost child never spins
        if pid == child:
            return exit_code(status)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--"]:
        args = args[1:]
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.strip().splitlines()[0])
        print("usage: python3 -m maru_common.init [--] COMMAND [ARG ...]")
        return 0 if args else 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
