"""Reader counters of a real ``maru-pool serve``: decode prompt tokens found in the pool vs computed, handoff
waits and timeouts, per tenant, in /status and /metrics; clients that do not say their role count as unknown."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from maru_pool import PoolClient, PoolError
from maru_pool.readers import Reader
from tests.support.pool import Daemon, client, http_get, start_serve, token_file, write_key

DECODE = Reader("decode", chunk_tokens=256, ranks=1)
SCOPE = "llm/qwen"


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def readers(d: Daemon, tenant: str = "") -> dict[str, Any]:
    status, body = http_get(d.metrics_url + "/status")
    assert status == 200
    found = [t for t in json.loads(body)["tenants"] if t["tenant"] == tenant]
    assert found, f"no tenant {tenant!r} in /status"
    return found[0].get("readers", {})


def metric_lines(d: Daemon, prefix: str) -> list[str]:
    _, text = http_get(d.metrics_url + "/metrics")
    return sorted(line for line in text.splitlines() if line.startswith(prefix))


def test_decode_lookups_count_tokens_found_and_computed(serve: Daemon) -> None:
    with PoolClient(serve.ready["listen"], timeout_s=5) as c:
        assert c.put(key(1), b"a") and c.put(key(2), b"b")
        assert c.lookup_prefix([key(1), key(2), key(3), key(4)], reader=DECODE) == 2  # half there
        assert c.lookup_prefix([key(1), key(2)], reader=DECODE) == 2  # all there
        # Two TP ranks: a chunk is two keys, and a chunk with one rank's key only is computed.
        two_ranks = Reader("decode", chunk_tokens=256, ranks=2)
        assert c.lookup_prefix([key(1), key(2), key(5), key(6)], reader=two_ranks) == 2
    r = readers(serve)
    assert r["prompt_tokens"] == {"decode": {"pool": 4 * 256 + 256, "computed": 2 * 256 + 256}}
    assert r["lookups"] == {"decode": 3}
    assert (r["handoff_waits"], r["handoff_timeouts"]) == (0, 0)
    assert metric_lines(serve, "maru_pool_tenant_prompt_tokens_total") == [
        'maru_pool_tenant_prompt_tokens_total{role="decode",source="computed",tenant=""} 768.0',
        'maru_pool_tenant_prompt_tokens_total{role="decode",source="pool",tenant=""} 1280.0',
    ]


def test_a_handoff_that_times_out_is_counted_once_when_its_wait_ends(serve: Daemon) -> None:
    keys = [key(1), key(2), key(3)]
    with PoolClient(serve.ready["listen"], timeout_s=5) as c:
        assert c.put(key(1), b"a")
        # The prefill announced 3 chunks; 1 is there: the reader waits (no tokens counted yet).
        assert c.lookup_prefix(keys, reader=DECODE, handoff=3) == 1
        assert readers(serve)["handoff_waits"] == 1 and readers(serve)["prompt_tokens"] == {}
        # A slice that is not the reader's last: nothing is settled.
        assert c.wait_prefixes([(keys, 3)], 0.01, reader=DECODE) == [1]
        assert readers(serve)["prompt_tokens"] == {}
        # Its last slice ends short: one timeout, and the prompt counted once.
        assert c.wait_prefixes([(keys, 3)], 0.01, reader=DECODE, final=[0]) == [1]
    r = readers(serve)
    assert (r["handoff_waits"], r["handoff_timeouts"]) == (1, 1)
    assert r["prompt_tokens"] == {"decode": {"pool": 256, "computed": 512}}
    assert metric_lines(serve, "maru_pool_tenant_handoff_timeouts_total") == [
        'maru_pool_tenant_handoff_timeouts_total{tenant=""} 1.0'
    ]


def test_a_handoff_completed_by_its_commit_counts_from_the_pool(serve: Daemon) -> None:
    keys = [key(1), key(2)]
    with PoolClient(serve.ready["listen"], timeout_s=5) as c:
        assert c.lookup_prefix(keys, reader=DECODE, handoff=2) == 0
        assert c.put(key(1), b"a") and c.put(key(2), b"b")
        assert c.wait_prefixes([(keys, 2)], 1.0, reader=DECODE) == [2]
    r = readers(serve)
    assert (r["handoff_waits"], r["handoff_timeouts"]) == (1, 0)
    assert r["prompt_tokens"] == {"decode": {"pool": 512, "computed": 0}}


def test_older_clients_count_as_unknown_and_work_as_before(serve: Daemon) -> None:
    """A request without ``reader`` (an older client) is answered as always, counted under role unknown."""
    with PoolClient(serve.ready["listen"], timeout_s=5) as c:
        assert c.put(key(1), b"a")
        assert c._call({"op": "lookup", "keys": [key(1).hex(), key(2).hex()]})["n"] == 1
        reply = c._call({"op": "wait", "waits": [[[key(1).hex()], 1]], "timeout_ms": 0})
        assert reply["n"] == [1]
    r = readers(serve)
    assert r["lookups"] == {"unknown": 1}
    assert (r["prompt_tokens"], r["handoff_waits"], r["handoff_timeouts"]) == ({}, 0, 0)
    assert metric_lines(serve, "maru_pool_tenant_lookups_total") == [
        'maru_pool_tenant_lookups_total{role="unknown",tenant=""} 1.0'
    ]


def test_counters_are_per_tenant(daemons: list[Daemon], sock_dir: Path) -> None:
    """A tenant that only looks up (no chunk stored yet) still has its entry."""
    pool_key = write_key(sock_dir / "pool.key")
    served = start_serve(daemons, sock_dir, "--auth-key-file", str(pool_key))
    with client(served, token_file(sock_dir / "t.token", pool_key, SCOPE)) as c:
        assert c.lookup_prefix([key(1)], reader=DECODE) == 0
    assert readers(served, SCOPE)["prompt_tokens"] == {"decode": {"pool": 0, "computed": 256}}


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"reader": {"role": "decode", "chunk_tokens": 0, "ranks": 1}}, "reader.chunk_tokens"),
        ({"reader": {"role": "decode", "chunk_tokens": 256, "ranks": "1"}}, "reader.ranks"),
        ({"reader": "decode"}, "reader must be an object"),
        ({"handoff": -1}, "handoff"),
    ],
)
def test_a_malformed_reader_is_refused_naming_the_field(serve: Daemon, extra: dict, field: str) -> None:
    with PoolClient(serve.ready["listen"], timeout_s=5) as c, pytest.raises(PoolError, match=field):
        c._call({"op": "lookup", "keys": [key(1).hex()], **extra})


def test_final_must_index_the_waits(serve: Daemon) -> None:
    msg = {"op": "wait", "waits": [[[key(1).hex()], 1]], "timeout_ms": 0, "reader": DECODE.fields(), "final": [3]}
    with PoolClient(serve.ready["listen"], timeout_s=5) as c, pytest.raises(PoolError, match="final"):
        c._call(msg)
