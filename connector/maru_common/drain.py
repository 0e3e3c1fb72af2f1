"""Drain a server before it stops: the preStop hook of the operator's vLLM pods and of maru-router.

When a pod is deleted (a rollout, a scale-down, a node drain) the kubelet runs this first and sends
SIGTERM only once it returns. Meanwhile the pod is terminating, but new requests still reach it for a
while: its clients learn of the deletion each in its own time (kube-proxy and vllm-router from their
watches, maru-router at its next look at vllm-router's workers), and a request one of them routed just
before arrives after. vLLM, once signalled, fails every request it holds and any that arrives until its
HTTP server closes. So this waits at least ``--min-wait`` seconds however idle the server is, then until it
reports no request running or waiting on its ``/metrics`` (two looks in a row, a request may be between
queues on one), or until ``--timeout`` seconds passed. Any trouble reading the metrics (vLLM already gone,
no metrics) ends the wait: a hook never holds a pod that cannot be drained.

    python3 -m maru_common.drain --port 8000 --min-wait 10 --timeout 570
    python3 -m maru_common.drain --port 9103 --metric maru_router_requests_in_progress --timeout 570
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable

log = logging.getLogger("maru_common.drain")

IN_FLIGHT_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")
POLL_SECONDS = 1.0
QUIET_LOOKS = 2
READ_TIMEOUT_SECONDS = 5.0


def in_flight(metrics_text: str, names: tuple[str, ...] = IN_FLIGHT_METRICS) -> int | None:
    """The ``names`` series (vLLM's requests running or waiting) summed over every engine the exposition lists;
    None when it lists none."""
    total, seen = 0.0, False
    for line in metrics_text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            try:
                total += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
            seen = True
    return round(total) if seen else None


def read_metrics(url: str) -> str:
    with urllib.request.urlopen(url, timeout=READ_TIMEOUT_SECONDS) as answer:
        return answer.read().decode("utf-8", "replace")


def drain(
    url: str,
    timeout: float,
    *,
    min_wait: float = 0.0,
    names: tuple[str, ...] = IN_FLIGHT_METRICS,
    read: Callable[[str], str] = read_metrics,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """Wait until the server at ``url`` has nothing in flight (``names`` at 0), and at least ``min_wait`` seconds
    (requests routed before its clients saw the deletion still arrive); returns why the wait ended."""
    started = clock()
    deadline = started + timeout
    quiet = 0
    while True:
        try:
            count = in_flight(read(url), names)
        except (OSError, urllib.error.URLError, ValueError) as err:
            return f"metrics unreadable ({err}); not waiting"
        if count is None:
            return "no in-flight metrics in the answer; not waiting"
        quiet = quiet + 1 if count == 0 else 0
        if quiet >= QUIET_LOOKS and clock() - started >= min_wait:
            return "drained"
        if clock() >= deadline:
            return f"timed out with {count} request(s) in flight"
        sleep(POLL_SECONDS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m maru_common.drain", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--port", type=int, default=8000, help="the port serving /metrics on this pod's loopback (vLLM's HTTP port)"
    )
    parser.add_argument(
        "--metric",
        action="append",
        default=[],
        metavar="NAME",
        help="a gauge of requests in flight (repeatable; summed); default: vLLM's " + " and ".join(IN_FLIGHT_METRICS),
    )
    parser.add_argument(
        "--min-wait",
        type=float,
        default=0.0,
        help="seconds to wait at least, idle or not: how long the pod's clients take to stop sending to it",
    )
    parser.add_argument("--timeout", type=float, default=570.0, help="seconds to wait at most")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    started = time.monotonic()
    why = drain(
        f"http://127.0.0.1:{args.port}/metrics",
        args.timeout,
        min_wait=args.min_wait,
        names=tuple(args.metric) or IN_FLIGHT_METRICS,
    )
    log.info("maru drain: %s after %.1fs", why, time.monotonic() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
