"""Every connector counter is exported to Prometheus with its help text (a missing one fails the engine's start)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the connector's metrics need vLLM")


def test_every_counter_has_help() -> None:
    from maru_connector.vllm import common, stats

    assert set(common.ALL_COUNTERS) <= set(stats._HELP), set(common.ALL_COUNTERS) - set(stats._HELP)
