"""Handoffs as a producer returns them, and chunks stored in a real pool the way a producer stores them."""

from __future__ import annotations

from maru_contracts.handoff import HANDOFF_CHUNKS, HANDOFF_LAST_KEY
from maru_pool import PoolClient
from tests.connector import fakes
from tests.support.scheduler import expected_keys


def store(url: str, keys: list[bytes]) -> None:
    with PoolClient(url, timeout_s=5) as c:
        for k in keys:
            c.put(k, b"x")


def handoff_for(req: fakes.Request, chunks: int) -> dict:
    return {HANDOFF_CHUNKS: chunks, HANDOFF_LAST_KEY: expected_keys(req)[chunks - 1].hex()}
