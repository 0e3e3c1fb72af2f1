"""In front of vllm-router, one request at a time learns the engines' key scheme through prefill."""

from __future__ import annotations

import pytest

from maru_contracts.handoff import HANDOFF_KEY_SCHEME
from maru_contracts.keys import KeyScheme
from maru_router.scheme import SchemeLearner

SCHEME = KeyScheme((b"\x01" * 32,), hash_block_size=16, chunk_tokens=256, hash_algo="sha256")


def test_requests_arriving_during_a_refresh_stay_with_the_upstream_router() -> None:
    learner = SchemeLearner(relearn_s=3600.0)
    assert learner.claim_refresh()  # no scheme yet: this request learns it
    assert not learner.claim_refresh()  # meanwhile: upstream, not a second prefill here
    learner.release()  # the request answered without a scheme (a prompt shorter than a chunk)
    assert learner.claim_refresh()


def test_a_learnt_scheme_is_kept_until_it_is_older_than_the_period() -> None:
    fresh = SchemeLearner(relearn_s=3600.0)
    fresh.learn({HANDOFF_KEY_SCHEME: SCHEME.to_params()}, "rev-a")
    assert fresh.scheme == SCHEME and fresh.revision == "rev-a" and not fresh.claim_refresh()
    stale = SchemeLearner(relearn_s=1e-9)
    stale.learn({HANDOFF_KEY_SCHEME: SCHEME.to_params()})
    assert stale.claim_refresh()


def test_a_handoff_without_a_readable_scheme_teaches_nothing() -> None:
    learner = SchemeLearner(relearn_s=3600.0)
    learner.learn({HANDOFF_KEY_SCHEME: {"chunk_tokens": "many"}})
    learner.learn(None)
    learner.learn({"maru_chunks": 3})
    assert learner.scheme is None and learner.stale()


def test_a_period_of_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="relearn_s must be > 0"):
        SchemeLearner(relearn_s=0)
