"""In front of vllm-router, one request at a time learns the engines' key scheme through prefill."""

from __future__ import annotations

from maru_contracts.config import MaruConnectorConfig
from maru_contracts.keys import KeyScheme
from maru_router.proxy import Router

SCHEME = KeyScheme((b"\x01" * 32,), hash_block_size=16, chunk_tokens=256, hash_algo="sha256")


def router(relearn_s: float = 3600.0) -> Router:
    config = MaruConnectorConfig.from_extra_config({"maru_pool_url": "unix:///nonexistent/pool.sock"})
    return Router(
        prefill=["http://prefill"],
        decode=["http://decode"],
        connector=config,
        upstream="http://127.0.0.1:8001",
        relearn_s=relearn_s,
    )


def test_requests_arriving_during_a_refresh_stay_with_the_upstream_router() -> None:
    r = router()
    assert r.claim_refresh()  # no scheme yet: this request learns it
    assert not r.claim_refresh()  # meanwhile: upstream, not a second prefill here
    r._refreshing = False  # the request answered without a scheme (a prompt shorter than a chunk)
    assert r.claim_refresh()


def test_a_learnt_scheme_is_kept_until_it_is_older_than_the_period() -> None:
    fresh = router(relearn_s=3600.0)
    fresh._learn({"maru_key_scheme": SCHEME.to_params()})
    assert fresh.scheme == SCHEME and not fresh.claim_refresh()
    stale = router(relearn_s=1e-9)
    stale._learn({"maru_key_scheme": SCHEME.to_params()})
    assert stale.claim_refresh()
