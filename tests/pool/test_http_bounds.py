"""The pool daemon's HTTP port (metrics, health, status) against a hostile pod, on a real ``maru-pool serve``.

Reported: a thread per connection with no deadline, so 310 idle connections exhausted a pod-like
``pids.max=300`` and another tenant's lookups failed with ``PoolUnavailable``. Now a fixed pool of threads
answers, idle connections cost no thread, one address holds a few at most, and headers have a deadline.
"""

from __future__ import annotations

import time
from pathlib import Path

from maru_pool import PoolClient
from tests.support.pool import Daemon

from .httpflood import close_all, get, idle_flood, thread_count, trickle

K = b"\x05" * 32


def host_port(d: Daemon) -> tuple[str, int]:
    host, port = d.ready["metrics"].rsplit(":", 1)
    return host, int(port)


def test_idle_connections_take_no_threads_and_the_scraper_and_tenants_are_served(serve: Daemon) -> None:
    host, port = host_port(serve)
    tenant = PoolClient(serve.ready["listen"], timeout_s=5)
    assert tenant.put(K, b"k" * 4096)
    before = thread_count(serve.proc.pid)
    flood = idle_flood(host, port)
    try:
        # Answered after every connection before it was accepted: the count below sees them all.
        status, body = get(host, port, "/metrics")
        assert status == 200 and b"maru_pool_chunks 1.0" in body
        grown = thread_count(serve.proc.pid) - before
        assert grown < 20, f"{grown} threads more for {len(flood)} idle connections"
        # A new connection of another tenant still gets its thread and its answer.
        assert PoolClient(serve.ready["listen"], timeout_s=5).lookup_prefix([K]) == 1
        assert get(host, port, "/healthz")[0] == 200
    finally:
        close_all(flood)
    # The flood's address is served again once the daemon has seen its connections close (a bounded wait).
    statuses = []
    for _ in range(100):
        statuses.append(get(host, port, "/status", source="127.0.0.1")[0])
        if statuses[-1] == 200:
            break
        time.sleep(0.1)
    assert statuses[-1] == 200 and set(statuses) <= {200, 503}, statuses


def test_a_slowloris_is_closed_at_the_header_deadline(serve: Daemon) -> None:
    host, port = host_port(serve)
    answer = trickle(host, port)
    assert answer, "a header trickled forever was never cut off"
    assert answer == b"closed" or answer.startswith(b"HTTP/1.0 408"), answer
    assert get(host, port, "/healthz")[0] == 200


def test_metrics_status_and_health_answer_as_before(serve: Daemon, sock_dir: Path) -> None:
    host, port = host_port(serve)
    assert get(host, port, "/nowhere")[0] == 404
    status, body = get(host, port, "/status")
    assert status == 200 and body.startswith(b"{")
