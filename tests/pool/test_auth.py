"""Two tenants' credentials against one real pool: ``maru-pool serve``, and a metadata server with agents.

Each daemon runs as a process with a pool key; tenants hold tokens signed with it (``maru-pool token``,
as the operator issues them). What one tenant stores, another can neither find nor read nor overwrite;
a connection without a valid token gets nothing, on any op; lease and pin ids stay bound to the
connection that took them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from maru_pool import PoolAuthError, PoolClient, PoolUnavailable
from tests.support.pool import (
    Daemon,
    Raw,
    client,
    free_port,
    http_get,
    metric,
    run_cli,
    start_agent,
    start_metadata,
    start_serve,
    token_file,
    write_key,
)

MiB = 1 << 20
K = b"\x07" * 32  # the same client key for both tenants: their salts no longer matter
# Every op a client may send after hello, with a well-formed body.
OPS: list[dict[str, Any]] = [
    {"op": "lookup", "keys": [K.hex()]},
    {"op": "write", "items": [[K.hex(), 4096]]},
    {"op": "commit", "epoch": 1, "items": [[1, 0]]},
    {"op": "abort", "epoch": 1, "leases": [1]},
    {"op": "read", "keys": [K.hex()]},
    {"op": "release", "epoch": 1, "pins": [1]},
    {"op": "renew", "epoch": 1, "ids": [1]},
    {"op": "events", "after": None},
    {"op": "flush"},
    {"op": "stats"},
    {"op": "status"},
    {"op": "agent", "node": "n", "backend": "dax", "devices": []},
]


@pytest.fixture
def keys(sock_dir: Path) -> tuple[Path, Path]:
    """This pool's key, and another pool's."""
    return write_key(sock_dir / "pool.key"), write_key(sock_dir / "other-pool.key")


@pytest.fixture
def tokens(sock_dir: Path, keys: tuple[Path, Path]) -> dict[str, str]:
    key, other = keys
    return {
        "a": token_file(sock_dir / "a.token", key, "ns-a/qwen"),
        "b": token_file(sock_dir / "b.token", key, "ns-b/qwen"),
        "a-of-other-pool": token_file(sock_dir / "a-other.token", other, "ns-a/qwen"),
    }


@pytest.fixture
def served(daemons: list[Daemon], sock_dir: Path, keys: tuple[Path, Path]) -> Daemon:
    return start_serve(daemons, sock_dir, "--auth-key-file", str(keys[0]))


def assert_tenants_isolated(a: PoolClient, b: PoolClient, a_again: PoolClient) -> None:
    """A stores K; B's lookup and read of K miss; B stores K too; each reads its own bytes."""
    assert a.put(K, b"A" * 8192)
    assert b.lookup_prefix([K]) == 0
    assert b.open_read(K) is None
    assert b.open_read_many([K]) == [None]
    assert b.pin_prefix([K]) == []
    assert b.put(K, b"B" * 8192)  # not "present": B's K is another chunk
    out = bytearray(8192)
    assert a_again.get_into(K, out) and out == b"A" * 8192
    assert b.get_into(K, out) and out == b"B" * 8192


def test_serve_keeps_two_tenants_apart(served: Daemon, tokens: dict[str, str]) -> None:
    assert served.ready["auth"] == "on"
    a, b = client(served, tokens["a"]), client(served, tokens["b"])
    assert_tenants_isolated(a, b, client(served, tokens["a"]))
    # The same tenant on another connection (another engine of the group) shares its chunks.
    assert client(served, tokens["a"]).lookup_prefix([K]) == 1
    assert a.stats()["chunks"] == 2


def _non_canonical(token: str, how: str) -> str:
    """A's genuine token respelled so that a lenient base64 decoder still reads the same bytes."""
    version, body, mac = token.strip().split(".")
    if how == "stray-character":
        return f"{version}.{body[:3]}!!!!{body[3:]}.{mac}"  # lenient decoding drops characters outside the alphabet
    if how == "padding":
        return f"{version}.{body}.{mac}="
    # 32 bytes take 43 characters, the last with two unused bits: flip one, the bytes stay the same.
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    return f"{version}.{body}.{mac[:-1]}{alphabet[alphabet.index(mac[-1]) ^ 1]}"


NON_CANONICAL = ["stray-character", "padding", "trailing-bits"]


@pytest.mark.parametrize("who", ["none", "forged", "other-pool", "garbage", *NON_CANONICAL])
def test_serve_refuses_a_client_without_a_valid_token(
    served: Daemon, tokens: dict[str, str], sock_dir: Path, who: str
) -> None:
    path: str | None = None
    if who in NON_CANONICAL:
        path = str(sock_dir / "respelled.token")
        Path(path).write_text(_non_canonical(Path(tokens["a"]).read_text(), who))
    elif who == "forged":
        # A's principal, B's signature: the signature covers the principal.
        a_parts, b_parts = Path(tokens["a"]).read_text().split("."), Path(tokens["b"]).read_text().split(".")
        path = str(sock_dir / "forged.token")
        Path(path).write_text(".".join([a_parts[0], a_parts[1], b_parts[2]]))
    elif who == "other-pool":
        path = tokens["a-of-other-pool"]
    elif who == "garbage":
        path = str(sock_dir / "garbage.token")
        Path(path).write_text("not a token")
    code = "unauthenticated" if who == "none" else "bad_token"
    with pytest.raises(PoolAuthError, match=code):
        client(served, path).lookup_prefix([K])
    # Every op on a connection whose hello failed (or never came) is refused, and nothing was mapped.
    raw = Raw(served.ready["listen"])
    try:
        hello = raw.call({"op": "hello", **({"token": Path(path).read_text()} if path else {})})
        assert hello["ok"] is False and hello["error"] == code, hello
        assert "regions" not in hello
        for msg in OPS:
            reply = raw.call(msg)
            assert reply == {"ok": False, "error": "unauthenticated", "message": reply["message"]}, (msg, reply)
            assert "hello" in reply["message"]
    finally:
        raw.close()
    _, text = http_get(served.metrics_url + "/metrics")
    assert metric(text, "maru_pool_auth_refusals_total") >= 1 + len(OPS)


def test_lease_and_pin_ids_are_unusable_by_another_tenant(served: Daemon, tokens: dict[str, str]) -> None:
    a = client(served, tokens["a"])
    assert a.put(K, b"A" * 4096)
    lease = a.begin_write(b"\x08" * 32, 4096)
    pin = a.open_read(K)
    assert lease is not None and pin is not None
    b = Raw(served.ready["listen"])
    try:
        assert b.call({"op": "hello", "token": Path(tokens["b"]).read_text()})["ok"]
        epoch = lease.epoch
        assert b.call({"op": "commit", "epoch": epoch, "items": [[lease.lease_id, 0]]})["results"] == [False]
        assert b.call({"op": "renew", "epoch": epoch, "ids": [lease.lease_id, pin.pin_id]})["results"] == [False, False]
        assert b.call({"op": "release", "epoch": epoch, "pins": [pin.pin_id], "corrupt": [pin.pin_id]})["ok"]
        assert b.call({"op": "abort", "epoch": epoch, "leases": [lease.lease_id]})["ok"]
        # A hello as another tenant on a verified connection does not switch it.
        again = b.call({"op": "hello", "token": Path(tokens["a"]).read_text()})
        assert again["ok"] is False and again["error"] == "forbidden"
        # Tenants never send agent heartbeats.
        assert b.call(OPS[-1])["error"] == "forbidden"
    finally:
        b.close()
    stats = a.stats()
    assert stats["pins"] == 1 and stats["writing"] == 1  # B released and aborted nothing of A's
    lease.fill(b"L" * 4096)
    lease.commit()
    out = bytearray(4096)
    pin.read_into(out)
    assert out == b"A" * 4096  # B's "corrupt" report did not drop A's chunk
    a.release_many([pin])


def test_a_rotated_key_refuses_old_tokens_on_new_connections(
    served: Daemon, tokens: dict[str, str], keys: tuple[Path, Path], sock_dir: Path
) -> None:
    held = client(served, tokens["a"])
    assert held.put(K, b"A" * 4096)
    new_key = write_key(sock_dir / "new.key")
    os.replace(new_key, keys[0])  # as the kubelet updates a Secret volume: a new file in its place
    with pytest.raises(PoolAuthError, match="another key"):
        client(served, tokens["a"]).lookup_prefix([K])
    assert client(served, token_file(sock_dir / "a2.token", keys[0], "ns-a/qwen")).lookup_prefix([K]) == 1
    assert held.lookup_prefix([K]) == 1  # a connection verified before the rotation stays verified


def test_unreadable_token_file_is_a_clear_auth_error(served: Daemon, sock_dir: Path) -> None:
    with pytest.raises(PoolAuthError, match=r"cannot read the pool credential .*missing\.token"):
        client(served, str(sock_dir / "missing.token")).lookup_prefix([K])


def test_a_pool_without_a_key_serves_anyone_in_one_key_space(
    daemons: list[Daemon], sock_dir: Path, tokens: dict[str, str]
) -> None:
    d = start_serve(daemons, sock_dir)
    assert d.ready["auth"] == "off"
    assert client(d, tokens["a"]).put(K, b"A" * 4096)
    assert client(d, None).lookup_prefix([K]) == 1  # no authentication, no isolation: as documented


@pytest.mark.parametrize(
    ("content", "why"),
    [(b"short", "holds 5 bytes"), (None, "No such file")],
)
def test_a_bad_key_file_stops_the_daemon_naming_the_flag(sock_dir: Path, content: bytes | None, why: str) -> None:
    path = sock_dir / "bad.key"
    if content is not None:
        path.write_bytes(content)
    result = run_cli("serve", "--listen", f"unix://{sock_dir}/x.sock", "--size", "1Mi",
                     "--shm-path", str(sock_dir / "x.shm"), "--auth-key-file", str(path))  # fmt: skip
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "--auth-key-file" in line and why in line, line


# ------------------------------------------------------------------ metadata server and agents over TCP


@pytest.fixture
def device(sock_dir: Path) -> Path:
    path = sock_dir / "dax0.0"
    with open(path, "wb") as fh:
        fh.truncate(8 * MiB)
    return path


def test_metadata_and_agents_keep_two_tenants_apart(
    daemons: list[Daemon], sock_dir: Path, device: Path, keys: tuple[Path, Path], tokens: dict[str, str]
) -> None:
    port = free_port()
    auth = ("--auth-key-file", str(keys[0]))
    meta = start_metadata(daemons, port, extra=auth)
    node_a = start_agent(daemons, sock_dir, "node-a", port, device, extra=auth)
    node_b = start_agent(daemons, sock_dir, "node-b", port, device, extra=auth)
    assert meta.ready["auth"] == node_a.ready["auth"] == "on"
    assert node_a.ready["connected"] == node_b.ready["connected"] == "true"  # their heartbeats authenticated
    # Tenant A on node a, tenant B on node b, tenant A again on node b: one index, two key spaces.
    assert_tenants_isolated(client(node_a, tokens["a"]), client(node_b, tokens["b"]), client(node_b, tokens["a"]))
    # The agent hands its devices to no one without a valid token.
    for path in (None, tokens["a-of-other-pool"]):
        with pytest.raises(PoolAuthError):
            client(node_a, path).lookup_prefix([K])
    raw = Raw(meta.ready["listen"])
    try:
        for msg in OPS:  # the metadata server over TCP, before any hello
            assert raw.call(msg)["error"] == "unauthenticated", msg
        assert (
            raw.call({"op": "hello", "memory": False, "token": Path(tokens["a-of-other-pool"]).read_text()})["error"]
            == "bad_token"
        )
        assert raw.call({"op": "hello", "memory": False, "token": Path(tokens["b"]).read_text()})["ok"]
        # A tenant cannot pose as an agent: no heartbeat, so no say in the pool's layout.
        assert raw.call(OPS[-1])["error"] == "forbidden"
        assert raw.call({"op": "lookup", "keys": [K.hex()]}) == {"ok": True, "n": 1}  # B's own K
    finally:
        raw.close()


def test_an_agent_without_the_pool_key_is_refused_by_the_metadata_server(
    daemons: list[Daemon], sock_dir: Path, device: Path, keys: tuple[Path, Path], tokens: dict[str, str]
) -> None:
    port = free_port()
    start_metadata(daemons, port, extra=("--auth-key-file", str(keys[0])))
    stranger = start_agent(daemons, sock_dir, "node-x", port, device, extra=("--auth-key-file", str(keys[1])))
    assert stranger.ready["connected"] == "false"
    with pytest.raises(PoolUnavailable, match="refused this agent: bad_token"):
        client(stranger, tokens["a-of-other-pool"]).lookup_prefix([K])
