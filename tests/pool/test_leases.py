"""Leases and pins through a real daemon: unguessable ids, bound to the connection that took them."""

from __future__ import annotations

import ctypes
import itertools
import time
from pathlib import Path

import pytest

from maru_pool import LeaseLost, PoolClient
from tests.support.pool import Daemon, start_serve, wait_for


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


@pytest.fixture
def url(serve: Daemon) -> str:
    return serve.ready["listen"]


def test_another_connection_can_neither_commit_a_lease_nor_release_a_pin(url: str) -> None:
    owner, other = PoolClient(url, timeout_s=5), PoolClient(url, timeout_s=5)
    lease = owner.begin_write(key(1), 1000)
    lease.fill(b"o" * 1000)
    # Knowing the id is not enough: the other connection's commit is refused and counted.
    errors = owner.stats()["errors"]
    reply = other._call({"op": "commit", "epoch": lease.epoch, "items": [[lease.lease_id, 12345]]})
    assert reply["results"] == [False]
    assert owner.stats()["errors"] == errors + 1
    assert owner.lookup_prefix([key(1)]) == 0
    assert owner.commit_many([lease]) == [True]
    out = bytearray(1000)
    assert other.get_into(key(1), out) and out == b"o" * 1000  # committed with the owner's checksum

    (pin,) = owner.open_read_many([key(1)])
    other._call({"op": "release", "epoch": pin.epoch, "pins": [pin.pin_id]})
    other._call({"op": "renew", "epoch": pin.epoch, "ids": [pin.pin_id]})
    assert owner.stats()["pins"] == 1
    owner.release_many([pin])
    assert owner.stats()["pins"] == 0


def test_ids_are_not_guessable_from_each_other(url: str) -> None:
    client = PoolClient(url, timeout_s=5)
    leases = client.begin_write_many([(key(i), 100) for i in range(32)])
    pins_of = [lease.key for lease in leases]
    client.commit_many(leases)
    pins = client.open_read_many(pins_of)
    ids = sorted([lease.lease_id for lease in leases] + [pin.pin_id for pin in pins])
    # Random 64-bit ids: two of them within 2**20 of each other happens about once in 2**33 runs.
    assert min(b - a for a, b in itertools.pairwise(ids)) > 1 << 20
    client.release_many(pins)


def test_a_closed_connection_gives_its_leases_and_pins_back_at_once(daemons: list[Daemon], sock_dir: Path) -> None:
    url = start_serve(daemons, sock_dir, "--lease-seconds", "600").ready["listen"]
    gone = PoolClient(url, timeout_s=5)
    gone.put(key(1), b"1" * 4096)
    gone.begin_write(key(2), 8192)
    gone.open_read(key(1))
    observer = PoolClient(url, timeout_s=5)
    assert (observer.stats()["writing"], observer.stats()["pins"]) == (1, 1)
    gone.close()
    # Leases last 10 minutes here: only the closed connection can free them within the wait.
    wait_for(lambda: observer.stats()["writing"] == 0 and observer.stats()["pins"] == 0, "leases freed")
    stats = observer.stats()
    assert stats["used_bytes"] == 4096 and stats["lease_expiries"] == 0


def test_a_write_past_its_lease_is_refused_by_the_client(daemons: list[Daemon], sock_dir: Path) -> None:
    d = start_serve(daemons, sock_dir, "--lease-seconds", "1")
    client = PoolClient(d.ready["listen"], timeout_s=5)
    lease = client.begin_write(key(1), 4096)
    time.sleep(1.2)
    with pytest.raises(LeaseLost):
        lease.fill(b"late" * 1024)
    # Its space was never touched after the deadline: another key's chunk there keeps its bytes.
    assert client.put(key(2), b"b" * 4096)
    out = bytearray(4096)
    assert client.get_into(key(2), out) and out == b"b" * 4096


def test_renewed_leases_outlive_the_lease_period(daemons: list[Daemon], sock_dir: Path) -> None:
    d = start_serve(daemons, sock_dir, "--lease-seconds", "1")
    client = PoolClient(d.ready["listen"], timeout_s=5)
    lease = client.begin_write(key(1), 4096)
    (pin,) = [client.put(key(2), b"p" * 4096) and client.open_read(key(2))]
    for _ in range(4):
        time.sleep(0.4)
        assert client.renew_many([lease, pin]) == [True, True]
    lease.fill(b"r" * 4096)
    assert client.commit_many([lease]) == [True]
    client.release_many([pin])


def test_segment_copies_past_their_deadline_are_refused_too(daemons: list[Daemon], sock_dir: Path) -> None:
    d = start_serve(daemons, sock_dir, "--lease-seconds", "1")
    client = PoolClient(d.ready["listen"], timeout_s=5)
    client.put(key(2), b"p" * 4096)
    pin = client.open_read(key(2))
    lease = client.begin_write(key(1), 4096)
    time.sleep(1.2)
    late = bytearray(b"late" * 1024)
    address = ctypes.addressof((ctypes.c_char * len(late)).from_buffer(late))
    with pytest.raises(LeaseLost):
        lease.fill_segments([(address, 4096)])
    with pytest.raises(LeaseLost):
        pin.read_segments([(address, 4096)])
    assert late == b"late" * 1024  # touched nothing
