"""The client against a real single-node daemon: the contract the vLLM connector codes against."""

from __future__ import annotations

import ctypes
import mmap
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import xxhash

from maru_pool import (
    ChecksumMismatch,
    LeaseLost,
    PoolClient,
    PoolError,
    PoolFull,
    PoolUnavailable,
    copyhash,
)
from maru_pool.memory import HEADER_SIZE
from tests.support.pool import Daemon, connector_env, start_serve


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


@pytest.fixture
def client(serve: Daemon) -> PoolClient:
    c = PoolClient(serve.ready["listen"], timeout_s=5.0)
    yield c
    c.close()


def test_put_then_get_round_trips_bytes(client: PoolClient) -> None:
    data = os.urandom(300_000)
    assert client.put(key(1), data) is True
    out = bytearray(len(data))
    assert client.get_into(key(1), out) is True
    assert bytes(out) == data


def test_put_twice_reports_already_present(client: PoolClient) -> None:
    assert client.put(key(1), b"a" * 100) is True
    assert client.put(key(1), b"b" * 100) is False
    out = bytearray(100)
    client.get_into(key(1), out)
    assert bytes(out) == b"a" * 100


def test_get_into_on_miss_returns_false_and_leaves_buffer(client: PoolClient) -> None:
    out = bytearray(b"x" * 10)
    assert client.get_into(key(9), out) is False
    assert out == b"x" * 10


def test_lookup_prefix_stops_at_first_miss(client: PoolClient) -> None:
    for i in (0, 1, 2, 4):
        client.put(key(i), bytes([i]) * 64)
    assert client.lookup_prefix([key(i) for i in range(6)]) == 3
    assert client.lookup_prefix([key(3), key(0)]) == 0
    assert client.lookup_prefix([]) == 0


def test_lookup_counts_hits_and_misses(client: PoolClient) -> None:
    client.put(key(0), b"z" * 64)
    before = client.stats()
    client.lookup_prefix([key(0), key(1), key(2)])
    after = client.stats()
    assert after["hits"] - before["hits"] == 1
    assert after["misses"] - before["misses"] == 2


def test_write_lease_is_invisible_until_commit(client: PoolClient) -> None:
    lease = client.begin_write(key(1), 1000)
    assert lease is not None and lease.buffer.nbytes == 1000 and not lease.buffer.readonly
    lease.buffer[:] = b"q" * 1000
    assert client.lookup_prefix([key(1)]) == 0
    assert client.open_read(key(1)) is None
    lease.commit()
    assert client.lookup_prefix([key(1)]) == 1
    with client.open_read(key(1)) as pin:
        assert pin is not None
        assert pin.buffer.readonly and bytes(pin.buffer) == b"q" * 1000
        pin.verify()


def test_key_being_written_is_not_leased_twice(client: PoolClient) -> None:
    first = client.begin_write(key(1), 100)
    assert first is not None
    assert client.begin_write(key(1), 100) is None
    first.abort()
    assert client.begin_write(key(1), 100) is not None


def test_lease_context_aborts_on_exception(client: PoolClient) -> None:
    with pytest.raises(RuntimeError), client.begin_write(key(1), 4096) as lease:
        lease.buffer[:4] = b"half"
        raise RuntimeError("writer failed")
    assert client.lookup_prefix([key(1)]) == 0
    assert client.stats()["used_bytes"] == 0


def test_lease_context_without_commit_aborts(client: PoolClient) -> None:
    with client.begin_write(key(1), 4096):
        pass
    assert client.stats()["used_bytes"] == 0
    assert client.lookup_prefix([key(1)]) == 0


def test_batched_write_commit_read_release(client: PoolClient) -> None:
    payloads = {key(i): os.urandom(5000 + i) for i in range(8)}
    leases = client.begin_write_many([(k, len(v)) for k, v in payloads.items()])
    assert all(lease is not None for lease in leases)
    for lease in leases:
        lease.buffer[:] = payloads[lease.key]
    assert client.commit_many(leases) == [True] * 8
    keys = [*payloads, key(99)]
    pins = client.open_read_many(keys)
    assert pins[-1] is None
    for pin in pins[:-1]:
        assert bytes(pin.buffer) == payloads[pin.key]
        pin.verify()
    client.release_many([p for p in pins if p is not None])
    assert client.stats()["pins"] == 0


def test_batched_write_skips_present_keys(client: PoolClient) -> None:
    client.put(key(1), b"x" * 10)
    leases = client.begin_write_many([(key(0), 10), (key(1), 10), (key(0), 10)])
    assert leases[0] is not None and leases[1] is None and leases[2] is None
    leases[0].abort()


def test_checksum_is_xxh3_of_the_bytes(client: PoolClient) -> None:
    data = os.urandom(4096)
    client.put(key(1), data)
    with client.open_read(key(1)) as pin:
        assert pin.checksum == xxhash.xxh3_64_intdigest(data)


def _scribble(sock_dir: Path, offset: int) -> None:
    """Flip one byte of the pool memory as a rogue process would, through its own mapping."""
    with open(sock_dir / "pool.shm", "r+b") as fh, mmap.mmap(fh.fileno(), 0) as mm:
        mm[HEADER_SIZE + offset] ^= 0xFF


def test_get_into_raises_checksum_mismatch_then_the_chunk_is_dropped(client: PoolClient, sock_dir: Path) -> None:
    data = os.urandom(8192)
    client.put(key(1), data)
    with client.open_read(key(1)) as pin:
        offset = pin.offset
    _scribble(sock_dir, offset + 100)
    out = bytearray(8192)
    with pytest.raises(ChecksumMismatch):
        client.get_into(key(1), out)
    # Reported corrupt: the daemon drops it, so the next lookup misses instead of failing again.
    assert client.lookup_prefix([key(1)]) == 0
    assert client.stats()["errors"] >= 1
    assert client.stats()["used_bytes"] == 0


def test_pin_verify_detects_bytes_changed_under_it(client: PoolClient, sock_dir: Path) -> None:
    client.put(key(1), os.urandom(4096))
    with client.open_read(key(1)) as pin:
        pin.verify()
        _scribble(sock_dir, pin.offset)
        with pytest.raises(ChecksumMismatch):
            pin.verify()


def test_commit_after_pool_restart_is_refused(daemons: list[Daemon], sock_dir: Path) -> None:
    first = start_serve(daemons, sock_dir)
    client = PoolClient(first.ready["listen"], timeout_s=5.0)
    lease = client.begin_write(key(1), 4096)
    lease.buffer[:] = b"o" * 4096
    first.stop()
    start_serve(daemons, sock_dir)
    with pytest.raises(LeaseLost):
        lease.commit()
    assert client.lookup_prefix([key(1)]) == 0
    client.close()


def test_unavailable_when_socket_missing(sock_dir: Path) -> None:
    client = PoolClient(f"unix://{sock_dir}/nothing.sock", timeout_s=0.2)
    with pytest.raises(PoolUnavailable):
        client.lookup_prefix([key(1)])
    assert issubclass(PoolUnavailable, PoolError)


def test_bad_url_is_a_pool_error() -> None:
    with pytest.raises(PoolError):
        PoolClient("http://nope")


def test_pin_prefix_pins_leading_hits_and_counts_them(client: PoolClient) -> None:
    for i in (0, 1, 3):
        client.put(key(i), bytes([i]) * 5000)
    before = client.stats()
    pins = client.pin_prefix([key(0), key(1), key(2), key(3)])
    assert [p.key for p in pins] == [key(0), key(1)]
    after = client.stats()
    assert after["pins"] == 2
    assert (after["hits"] - before["hits"], after["misses"] - before["misses"]) == (2, 2)
    client.release_many(pins)
    assert client.stats()["pins"] == 0


def test_ticket_lets_another_process_read_while_the_owner_holds_the_pin(serve: Daemon) -> None:
    scheduler = PoolClient(serve.ready["listen"], timeout_s=5)
    data = os.urandom(70_000)
    scheduler.put(key(1), data)
    (pin,) = scheduler.pin_prefix([key(1)])
    ticket = pin.ticket()
    code = (
        "import sys, ast\n"
        "from maru_pool import PoolClient\n"
        "worker = PoolClient(sys.argv[1], timeout_s=5)\n"
        "(pin,) = worker.claim([ast.literal_eval(sys.argv[2])])\n"
        "out = bytearray(pin.nbytes)\n"
        "pin.read_into(out)\n"
        "pin.release()\n"  # only stops using it: the pin belongs to the scheduler's connection
        "print(worker.stats()['pins'], file=sys.stderr)\n"
        "sys.stdout.buffer.write(bytes(out))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, serve.ready["listen"], repr(ticket)],
        capture_output=True, env=connector_env(), timeout=60, check=True,
    )  # fmt: skip
    assert result.stdout == data
    assert result.stderr.decode().strip().splitlines()[-1] == "1"
    assert scheduler.stats()["pins"] == 1
    scheduler.release_many([pin])
    assert scheduler.stats()["pins"] == 0


def test_begin_write_of_a_chunk_larger_than_the_pool_raises_pool_full(client: PoolClient) -> None:
    client.put(key(1), b"k" * 1000)
    with pytest.raises(PoolFull, match="larger than the pool"):
        client.begin_write(key(2), 64 << 20)
    assert client.lookup_prefix([key(1)]) == 1  # nothing was evicted for it


def test_timeout_raises_pool_unavailable(sock_dir: Path) -> None:
    mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    mute.bind(str(sock_dir / "mute.sock"))
    mute.listen(1)  # accepts connections into the backlog, never answers
    try:
        client = PoolClient(f"unix://{sock_dir}/mute.sock", timeout_s=0.2)
        with pytest.raises(PoolUnavailable, match="no answer"):
            client.lookup_prefix([key(1)])
    finally:
        mute.close()


def test_one_client_shared_by_threads(client: PoolClient) -> None:
    errors: list[BaseException] = []

    def worker(base: int) -> None:
        try:
            for i in range(base, base + 20):
                payload = i.to_bytes(4, "big") * 1000
                client.put(key(i), payload)
                out = bytearray(len(payload))
                assert client.get_into(key(i), out) and out == payload
        except BaseException as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(100 * t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert client.stats()["commits"] == 80


def test_renew_reports_which_leases_and_pins_are_still_held(client: PoolClient) -> None:
    client.put(key(1), b"r" * 100)
    pin = client.open_read(key(1))
    lease = client.begin_write(key(2), 100)
    gone = client.open_read(key(1))
    gone.release()
    assert client.renew_many([pin, lease, gone]) == [True, True, False]
    pin.release()
    lease.abort()
    assert client.renew_many([pin, lease]) == [False, False]


def test_forked_child_reconnects_and_leaves_the_parent_connection_alone(client: PoolClient) -> None:
    client.put(key(1), b"parent" * 100)
    inherited = client._sock
    pid = os.fork()
    if pid == 0:  # child: must not talk over the parent's socket, whose replies could go to either process
        code = 1
        try:
            out = bytearray(600)
            ok = client.get_into(key(1), out) and out == b"parent" * 100 and client.put(key(2), b"child" * 10)
            code = 0 if ok and client._sock is not inherited else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert client.lookup_prefix([key(1), key(2)]) == 2
    assert client._sock is inherited


# --- segments: chunks copied straight between scattered memory (a KV cache's pages) and the pool -----


def _address(buf: bytearray, offset: int = 0) -> int:
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf)) + offset


def test_fill_segments_then_read_segments_round_trip_with_holes(client: PoolClient) -> None:
    """Pages scattered over one buffer are stored as one chunk, then loaded into other places, some skipped."""
    page, pages = 4096, [7, 2, 9, 0, 5]
    engine = bytearray(os.urandom(10 * page))
    lease = client.begin_write(key(1), page * len(pages))
    lease.fill_segments([(_address(engine, p * page), page) for p in pages])
    lease.commit()
    expected = b"".join(engine[p * page : (p + 1) * page] for p in pages)
    with client.open_read(key(1)) as pin:
        assert pin.checksum == xxhash.xxh3_64_intdigest(expected)  # of the engine's bytes, in packed order
        other = bytearray(10 * page)
        targets = [3, None, 8, None, 1]  # blocks 1 and 3 of the chunk are not wanted
        pin.read_segments([(0, page) if t is None else (_address(other, t * page), page) for t in targets])
    for t, p in zip(targets, pages, strict=True):
        if t is not None:
            assert other[t * page : (t + 1) * page] == engine[p * page : (p + 1) * page]
    untouched = [b for b in range(10) if b not in (3, 8, 1)]
    assert all(other[b * page : (b + 1) * page] == bytes(page) for b in untouched)


def test_read_segments_of_a_corrupted_chunk_raises_after_the_copy_and_drops_it(
    client: PoolClient, sock_dir: Path
) -> None:
    data = os.urandom(16384)
    client.put(key(1), data)
    with client.open_read(key(1)) as pin:
        offset = pin.offset
    _scribble(sock_dir, offset + 9000)
    out = bytearray(16384)
    pin = client.open_read(key(1))
    with pytest.raises(ChecksumMismatch):
        pin.read_segments([(_address(out), 8192), (0, 4096), (_address(out, 12288), 4096)])
    assert pin.corrupt
    assert out[:8192] == data[:8192]  # in place before the verdict: the caller must discard it
    pin.release()
    assert client.lookup_prefix([key(1)]) == 0  # reported corrupt: dropped


def test_segments_must_cover_the_chunk_exactly(client: PoolClient) -> None:
    src = bytearray(os.urandom(8192))
    lease = client.begin_write(key(1), 8192)
    with pytest.raises(PoolError, match="lease holds 8192 bytes, segments have 4096"):
        lease.fill_segments([(_address(src), 4096)])
    with pytest.raises(ValueError, match="negative length"):
        lease.fill_segments([(_address(src), 8193), (_address(src), -1)])
    lease.fill_segments([(_address(src), 8192)])
    lease.commit()
    with client.open_read(key(1)) as pin:
        with pytest.raises(PoolError, match="the chunk holds 8192 bytes, segments have 8193"):
            pin.read_segments([(0, 8193)])
        pin.read_segments([(0, 8192)])  # verify only


def test_the_python_fallback_and_the_compiled_module_read_each_others_chunks(client: PoolClient) -> None:
    """A pod whose build lacked the compiled module still shares chunks with the others: same checksum."""
    page = 8192
    engine = bytearray(os.urandom(4 * page))
    segments = [(_address(engine, p * page), page) for p in (3, 1)]
    previous = copyhash.use_native(False)
    try:
        client.put(key(1), engine[:page])
        lease = client.begin_write(key(2), 2 * page)
        lease.fill_segments(segments)
        lease.commit()
    finally:
        copyhash.use_native(previous)
    for k, want in ((key(1), engine[:page]), (key(2), engine[3 * page :] + engine[page : 2 * page])):
        out = bytearray(len(want))
        assert client.get_into(k, out) and out == want
    copyhash.use_native(False)
    try:
        out = bytearray(2 * page)
        with client.open_read(key(2)) as pin:
            pin.read_segments([(_address(out, page), page), (0, page)])
        assert out[page:] == engine[3 * page :]
    finally:
        copyhash.use_native(previous)
