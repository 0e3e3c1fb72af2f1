"""The daemon's ``wait`` op: a reader waiting for a handoff blocks in the daemon until the chunks commit."""

from __future__ import annotations

import threading

import pytest

from maru_pool import PoolClient, PoolError
from tests.support.pool import Daemon


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_a_wait_is_answered_by_the_commit_it_waits_for(serve: Daemon) -> None:
    answers: list[list[int] | None] = []
    with (
        PoolClient(serve.ready["listen"], timeout_s=30) as waiter,
        PoolClient(serve.ready["listen"], timeout_s=5) as writer,
    ):
        assert waiter.wait_prefixes([([key(1), key(2)], 0)], 0) == [0]  # connected: the next call only waits
        thread = threading.Thread(target=lambda: answers.append(waiter.wait_prefixes([([key(1), key(2)], 2)], 10)))
        thread.start()
        assert writer.put(key(1), b"a")
        assert writer.put(key(2), b"b")
        thread.join(60)
        assert not thread.is_alive()
    assert answers == [[2]]


def test_a_wait_is_answered_at_its_deadline_with_what_is_there(serve: Daemon) -> None:
    with PoolClient(serve.ready["listen"], timeout_s=5) as client:
        assert client.put(key(7), b"x")
        assert client.wait_prefixes([([key(7), key(8)], 2), ([key(9)], 1)], 0.05) == [1, 0]


@pytest.mark.parametrize(
    ("msg", "field"),
    [
        ({"op": "wait", "waits": [], "timeout_ms": 10**9}, "timeout_ms"),
        ({"op": "wait", "waits": [[[key(1).hex()], -1]], "timeout_ms": 0}, "need"),
        ({"op": "wait", "waits": "x", "timeout_ms": 0}, "waits"),
    ],
)
def test_a_malformed_wait_is_refused_naming_the_field(serve: Daemon, msg: dict, field: str) -> None:
    with PoolClient(serve.ready["listen"], timeout_s=5) as client, pytest.raises(PoolError, match=field):
        client._call(msg)
