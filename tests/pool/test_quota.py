"""Quotas per tenant against a real ``maru-pool serve``: one tenant can no longer take the whole pool.

The attacks reported against the daemon: tenant B floods the pool (global LRU evicted all of A's chunks),
pins every chunk it stores (A got ``PoolFull`` until B let go), or holds thousands of one-byte write
leases (each takes 4 KiB of the pool: 2,048 fill 8 MiB). Tenants hold the real ``maru-pool token``'s
tokens; B's quota is the pool default (three quarters of the pool) or one its token carries.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from maru_contracts import tenancy
from maru_pool import PoolAuthError, PoolClient, PoolFull, quota
from maru_pool.client import QUOTA, WriteLease
from maru_pool.index import FULL, PoolIndex
from maru_pool.quota import QUOTA as INDEX_QUOTA
from tests.support.pool import Daemon, client, http_get, run_cli, start_serve, write_key

MiB = 1 << 20
CHUNK = 64 * 1024  # 128 chunks fill the 8 MiB pool; B's default quota (6 MiB) is 96 of them
A_SCOPE, B_SCOPE = "ns-a/qwen", "ns-b/qwen"


def key(tenant: str, i: int) -> bytes:
    return tenant.encode().ljust(16, b".") + i.to_bytes(16, "big")


def make_token(path: Path, key_file: Path, scope: str, *quota: str) -> str:
    result = run_cli("token", "--key-file", str(key_file), "--tenant", scope, *quota)
    assert result.returncode == 0, result.stderr
    path.write_text(result.stdout)
    return str(path)


@pytest.fixture
def pool_key(sock_dir: Path) -> Path:
    return write_key(sock_dir / "pool.key")


@pytest.fixture
def served(daemons: list[Daemon], sock_dir: Path, pool_key: Path) -> Daemon:
    return start_serve(daemons, sock_dir, "--auth-key-file", str(pool_key))


@pytest.fixture
def a(served: Daemon, sock_dir: Path, pool_key: Path) -> PoolClient:
    return client(served, make_token(sock_dir / "a.token", pool_key, A_SCOPE))


def b_client(served: Daemon, sock_dir: Path, pool_key: Path, *quota: str) -> PoolClient:
    return client(served, make_token(sock_dir / "b.token", pool_key, B_SCOPE, *quota))


def tenants(d: Daemon) -> dict[str, dict]:
    status, body = http_get(d.metrics_url + "/status")
    assert status == 200
    return {t["tenant"]: t for t in json.loads(body)["tenants"]}


def tenant_metric(d: Daemon, name: str, **labels: str) -> float:
    _, text = http_get(d.metrics_url + "/metrics")
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{") and line.split("}")[0].removeprefix(f"{name}{{") == want:
            return float(line.split()[-1])
    raise AssertionError(f"{name}{{{want}}} not exported")


def store_and_check(a: PoolClient, first: int, n: int) -> None:
    """A stores ``n`` chunks and reads every one back."""
    for i in range(first, first + n):
        assert a.put(key("a", i), bytes([i % 251]) * CHUNK), f"A could not store chunk {i}"
    check(a, first, n)


def check(a: PoolClient, first: int, n: int) -> None:
    """A loads ``n`` chunks it stored, intact."""
    out = bytearray(CHUNK)
    for i in range(first, first + n):
        assert a.get_into(key("a", i), out) and out == bytes([i % 251]) * CHUNK


def test_a_flood_of_one_tenant_leaves_the_others_chunks(
    served: Daemon, a: PoolClient, sock_dir: Path, pool_key: Path
) -> None:
    store_and_check(a, 0, 16)  # 1 MiB of A's, within any quota
    b = b_client(served, sock_dir, pool_key)
    for i in range(400):  # 25 MiB through an 8 MiB pool
        b.put(key("b", i), b"B" * CHUNK)
    assert [a.lookup_prefix([key("a", i)]) for i in range(16)] == [1] * 16, "B's flood evicted A's chunks"
    check(a, 0, 16)
    store_and_check(a, 100, 8)  # and A still stores
    seen = tenants(served)
    assert seen[B_SCOPE]["used_bytes"] <= seen[B_SCOPE]["quota_bytes"] == 6 * MiB
    assert seen[A_SCOPE]["evictions_by_others"] == 0
    assert tenant_metric(served, "maru_pool_tenant_evictions_total", tenant=A_SCOPE, by="other") == 0
    assert tenant_metric(served, "maru_pool_tenant_evictions_total", tenant=B_SCOPE, by="self") > 0


def test_pinning_every_chunk_leaves_room_for_the_others(
    served: Daemon, a: PoolClient, sock_dir: Path, pool_key: Path
) -> None:
    b = b_client(served, sock_dir, pool_key)
    pins = []
    stored = 0
    for i in range(200):  # store a chunk, pin it, and never let go (renewed below)
        try:
            if not b.put(key("b", i), b"B" * CHUNK):
                break
        except PoolFull:
            break
        stored += 1
        pin = b.open_read(key("b", i))
        assert pin is not None
        pins.append(pin)
    assert stored == 96, "B stored past its default quota (three quarters of the pool)"
    assert all(b.renew_many(pins))
    store_and_check(a, 0, 24)  # A stores and loads in the quarter B cannot take
    assert tenants(served)[B_SCOPE]["refused"]["bytes"] >= 1


def test_a_pin_past_the_quota_is_a_miss(served: Daemon, a: PoolClient, sock_dir: Path, pool_key: Path) -> None:
    b = b_client(served, sock_dir, pool_key, "--quota-pins", "8")
    for i in range(20):
        assert b.put(key("b", i), b"B" * CHUNK)
    keys = [key("b", i) for i in range(20)]
    pins = b.open_read_many(keys)
    assert sum(p is not None for p in pins) == 8  # refused pins are misses, never an error
    assert len(b.pin_prefix(keys)) == 0  # at the quota: the first pin of a prefix is refused too
    assert tenant_metric(served, "maru_pool_tenant_quota_refusals_total", tenant=B_SCOPE, kind="pins") == 13
    assert tenants(served)[B_SCOPE]["pins"] == 8
    store_and_check(a, 0, 4)  # A's pins are A's own
    b.release_many([p for p in pins if p is not None])
    assert len(b.pin_prefix(keys)) == 8  # given back: pins again, up to the quota


def test_thousands_of_one_byte_leases_leave_room_for_the_others(
    served: Daemon, a: PoolClient, sock_dir: Path, pool_key: Path
) -> None:
    b = b_client(served, sock_dir, pool_key)
    got = b.lease_many([(key("b", i), 1) for i in range(2048)])  # 2,048 x 4 KiB would fill the pool
    granted = [g for g in got if isinstance(g, WriteLease)]
    assert len(granted) == 1536  # 6 MiB of 4 KiB units: B's default quota
    assert set(got[1536:]) == {QUOTA}  # refused with the reason, not "full"
    store_and_check(a, 0, 24)
    b.abort_many(granted)


def test_a_lease_quota_in_the_token_is_enforced(served: Daemon, a: PoolClient, sock_dir: Path, pool_key: Path) -> None:
    b = b_client(served, sock_dir, pool_key, "--quota-leases", "100", "--quota-bytes", "1Mi")
    got = b.lease_many([(key("b", i), 1) for i in range(2048)])
    granted = [g for g in got if isinstance(g, WriteLease)]
    assert len(granted) == 100 and got.count(QUOTA) == 1948
    assert b.begin_write_many([(key("b", 5000), 1)]) == [None]  # over quota: not stored, not PoolFull
    b.abort_many(granted[:10])
    again = [g for g in b.lease_many([(key("b", 3000 + i), 1) for i in range(20)]) if isinstance(g, WriteLease)]
    assert len(again) == 10
    seen = tenants(served)[B_SCOPE]
    assert (seen["leases"], seen["quota_leases"], seen["quota_bytes"]) == (100, 100, MiB)
    assert seen["refused"]["leases"] == 1948 + 1 + 10
    # Bytes: 1 MiB holds 16 chunks of 64 KiB; more evict B's own oldest, never A's.
    b.abort_many(granted[10:] + again)
    store_and_check(a, 0, 8)
    for i in range(40):
        assert b.put(key("b", 10_000 + i), b"B" * CHUNK)
    assert sum(b.lookup_prefix([key("b", 10_000 + i)]) for i in range(40)) == 16
    assert [a.lookup_prefix([key("a", i)]) for i in range(8)] == [1] * 8


def test_the_token_carries_the_quota_and_a_forged_quota_is_refused(
    served: Daemon, sock_dir: Path, pool_key: Path
) -> None:
    path = make_token(sock_dir / "q.token", pool_key, B_SCOPE, "--quota-bytes", "1Mi", "--quota-pins", "8")
    token = Path(path).read_text().strip()
    assert token.startswith("maru2.")
    principal = tenancy.verify(pool_key.read_bytes(), token)
    assert principal == tenancy.tenant(B_SCOPE)
    assert principal.quota == tenancy.Quota(bytes=MiB, pins=8)
    # A tenant that rewrites its quota (or grafts one onto a maru1 token) is refused at the hello.
    version, body, _quota, mac = token.split(".")
    bigger = base64.urlsafe_b64encode(b"bytes=8388608,pins=8").rstrip(b"=").decode()
    plain = Path(make_token(sock_dir / "p.token", pool_key, B_SCOPE)).read_text().strip()
    for forged in (f"{version}.{body}.{bigger}.{mac}", f"maru2.{body}.{bigger}.{plain.split('.')[2]}"):
        (sock_dir / "forged.token").write_text(forged)
        with pytest.raises(PoolAuthError, match=r"bad_token|another key"):
            client(served, str(sock_dir / "forged.token")).lookup_prefix([key("b", 0)])
    # The genuine one is accepted and enforced; a maru1 token still means the pool's defaults.
    assert client(served, path).put(key("b", 1), b"x" * CHUNK)
    assert tenants(served)[B_SCOPE]["quota_bytes"] == MiB
    assert client(served, str(sock_dir / "p.token")).put(key("b", 2), b"x" * CHUNK)
    assert tenants(served)[B_SCOPE]["quota_bytes"] == 6 * MiB


def test_a_token_asking_for_more_pins_and_leases_than_the_daemon_allows_is_held_to_its_ceiling(
    daemons: list[Daemon], sock_dir: Path, pool_key: Path
) -> None:
    """Reported: a self-raised token (pins=500000) took 500,000 pins and grew the daemon toward its memory limit.
    Whatever a token carries, the daemon's --max-tenant-pins and --max-tenant-leases (the defaults unless set)
    bound what one tenant holds; a token asking for less keeps its own quota."""
    served = start_serve(daemons, sock_dir, "--auth-key-file", str(pool_key), "--max-tenant-leases", "300")
    b = b_client(served, sock_dir, pool_key, "--quota-pins", "500000", "--quota-leases", "500000")
    assert b.put(key("b", 0), b"B" * CHUNK)
    granted = 0
    for _ in range(7):  # 70,000 pins asked for, in frames well under --max-frame
        granted += sum(p is not None for p in b.open_read_many([key("b", 0)] * 10_000))
    assert granted == quota.DEFAULT_PINS
    leases = b.lease_many([(key("b", 100 + i), 1) for i in range(400)])
    assert sum(isinstance(g, WriteLease) for g in leases) == 300
    seen = tenants(served)[B_SCOPE]
    assert (seen["pins"], seen["quota_pins"], seen["leases"], seen["quota_leases"]) == (
        quota.DEFAULT_PINS,
        quota.DEFAULT_PINS,
        300,
        300,
    )
    # Under the ceiling a token's own quota holds, as before.
    a = client(served, make_token(sock_dir / "a.token", pool_key, A_SCOPE, "--quota-pins", "8"))
    assert a.put(key("a", 0), b"A" * CHUNK)
    assert sum(p is not None for p in a.open_read_many([key("a", 0)] * 20)) == 8
    assert "over this daemon's ceiling" in "".join(_stderr_so_far(served))


def _stderr_so_far(d: Daemon) -> list[str]:
    """What the daemon logged: stop it (the test is done with it) and read its stderr."""
    d.stop()
    assert d.proc.stderr is not None
    return d.proc.stderr.readlines()


def test_quota_text_round_trips_and_refuses_what_it_would_not_write() -> None:
    q = tenancy.Quota(bytes=5, leases=7)
    assert q.encode() == "bytes=5,leases=7" and tenancy.Quota.decode(q.encode()) == q
    for bad in ("leases=7,bytes=5", "bytes=05", "bytes=0", "bytes=5,bytes=5", "cpu=1", "bytes=-1", "bytes"):
        with pytest.raises(ValueError):
            tenancy.Quota.decode(bad)
    with pytest.raises(ValueError):
        tenancy.Quota(pins=0)
    key_bytes = b"k" * 32
    assert tenancy.issue(key_bytes, tenancy.tenant("t")).startswith("maru1.")  # no quota: the old format
    with pytest.raises(ValueError):
        tenancy.issue(key_bytes, tenancy.Principal("agent", "n", tenancy.Quota(pins=1)))


# ------------------------------------------------------------------ eviction order (the index alone)

PAGE = 4096


def test_eviction_takes_from_a_tenant_over_its_share_before_global_lru() -> None:
    ix = PoolIndex(64 * PAGE, epoch=1)
    whole = tenancy.Quota(bytes=64 * PAGE)  # quotas of the whole pool: only the fair share protects A
    for i in range(8):
        (g,) = ix.begin_write([(key("a", i), PAGE)], tenant="a", quota=whole)
        ix.commit(1, [(g.lease_id, 0)])  # type: ignore[union-attr]
    for i in range(500):
        (g,) = ix.begin_write([(key("b", i), PAGE)], tenant="b", quota=whole)
        assert g != FULL
        ix.commit(1, [(g.lease_id, 0)])  # type: ignore[union-attr]
    assert ix.lookup_prefix([key("a", i) for i in range(8)]) == 8  # A (8 pages) is within its share (32)
    ix.check_invariants()


def test_a_tenant_over_its_lowered_quota_is_evicted_first() -> None:
    ix = PoolIndex(16 * PAGE, epoch=1)
    quotas = {"a": tenancy.Quota(bytes=14 * PAGE), "b": tenancy.Quota(bytes=12 * PAGE)}
    for tenant, n in (("b", 10), ("a", 6)):
        for i in range(n):
            (g,) = ix.begin_write([(key(tenant, i), PAGE)], tenant=tenant, quota=quotas[tenant])
            ix.commit(1, [(g.lease_id, 0)])  # type: ignore[union-attr]
    ix.begin_write([], tenant="b", quota=tenancy.Quota(bytes=2 * PAGE))  # B's newer token: 2 pages
    # The pool is full and B is over its quota: A's next chunks take B's space, never A's older ones.
    for i in range(6, 14):
        (g,) = ix.begin_write([(key("a", i), PAGE)], tenant="a", quota=quotas["a"])
        assert g not in (FULL, INDEX_QUOTA)
        ix.commit(1, [(g.lease_id, 0)])  # type: ignore[union-attr]
    assert ix.lookup_prefix([key("a", i) for i in range(14)]) == 14
    assert {t["tenant"]: t["evictions_by_others"] for t in ix.tenant_stats()} == {"a": 0, "b": 8}
    # B's own next write brings it under its quota first, at its own expense.
    (g,) = ix.begin_write([(key("b", 99), PAGE)], tenant="b", quota=tenancy.Quota(bytes=2 * PAGE))
    assert g not in (FULL, INDEX_QUOTA)
    assert {t["tenant"]: t["used_bytes"] for t in ix.tenant_stats()}["b"] == 2 * PAGE
    ix.check_invariants()
