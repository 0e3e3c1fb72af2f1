"""The operator's ``/metrics`` port against a hostile pod: the server the CLI starts, in this process.

Reported: prometheus_client's server starts a thread per connection and waits on it with no deadline, so idle
connections from any pod the NetworkPolicy admits exhaust the operator's pids. Now a fixed pool of threads
answers and one address holds a few connections at most.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from maru_operator import metrics
from tests.pool.httpflood import close_all, get, idle_flood, trickle


@pytest.fixture
def server() -> Iterator[tuple[str, int]]:
    served = metrics.serve(0, "127.0.0.1")
    host, port = served.server_address[:2]
    yield host, port
    served.close()


def test_idle_connections_take_no_threads_and_the_scraper_is_served(server: tuple[str, int]) -> None:
    host, port = server
    metrics.QUEUE_DEPTH.set(3)
    before = threading.active_count()
    flood = idle_flood(host, port)
    try:
        status, body = get(host, port, "/metrics")  # answered after every earlier connection was accepted
        assert status == 200 and b"maru_operator_workqueue_depth 3.0" in body
        grown = threading.active_count() - before
        assert grown < 20, f"{grown} threads more for {len(flood)} idle connections"
    finally:
        close_all(flood)


def test_a_slowloris_is_closed_at_the_header_deadline(server: tuple[str, int]) -> None:
    host, port = server
    answer = trickle(host, port)
    assert answer, "a header trickled forever was never cut off"
    assert get(host, port, "/metrics")[0] == 200
