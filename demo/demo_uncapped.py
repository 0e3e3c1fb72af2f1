"""The bundled connector with the capped-hit rule swapped for the upstream one, for ``--show-uncapped``.

Loaded by a throw-away decode engine (``kv_connector_module_path: demo_uncapped``) to show what the cap
prevents: a prompt whose length is an exact multiple of the chunk, fully in the pool, leaves the
scheduler no token to compute and the engine dies. Never used for serving.
"""

from __future__ import annotations

from maru_connector.vllm import MaruConnector
from maru_contracts.hits import uncapped_hit_tokens


class UncappedMaruConnector(MaruConnector):
    hit_rule = staticmethod(uncapped_hit_tokens)
