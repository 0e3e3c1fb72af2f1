"""The connector with the cap removed: loaded by a test to show the engine dies without it."""

from __future__ import annotations

from maru_connector.vllm import MaruConnector
from maru_contracts.hits import uncapped_hit_tokens


class UncappedMaruConnector(MaruConnector):
    hit_rule = staticmethod(uncapped_hit_tokens)
