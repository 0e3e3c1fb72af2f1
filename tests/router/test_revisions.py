"""Pairing prefill and decode within one key revision, and the revision an engine announces (pure)."""

from __future__ import annotations

import pytest

from maru_router.balance import Endpoints
from maru_router.revisions import Pairing, events_topic, pairable, parse_revisions, revision_of

P1, P2 = "http://10.0.0.1:8000", "http://10.0.0.2:8000"
D1, D2, D3 = "http://10.0.1.1:8000", "http://10.0.1.2:8000", "http://10.0.1.3:8000"


def test_one_revision_or_none_known_leaves_the_pairing_free() -> None:
    assert pairable([P1, P2], [D1, D2], {}) is None
    assert pairable([P1, P2], [D1, D2], {P1: "a", P2: "a", D1: "a", D2: "a"}) is None
    assert pairable([P1, P2], [D1, D2], {P1: "a", D2: "a"}) is None  # the others not announced yet


def test_mid_rollout_each_prefill_pairs_with_the_decodes_of_its_own_revision() -> None:
    # An old prefill and a new one; two old decodes and a new one.
    revisions = {P1: "old", P2: "new", D1: "old", D2: "new", D3: "old"}
    assert pairable([P1, P2], [D1, D2, D3], revisions) == Pairing([0, 1], {0: [0, 2], 1: [1]})


def test_a_revision_without_decode_is_no_prefill_choice_and_unknown_pairs_with_nothing() -> None:
    # The new prefill has no new decode yet; the decode of unknown revision is nobody's partner.
    assert pairable([P1, P2], [D1, D2], {P1: "old", P2: "new", D1: "old"}) == Pairing([0], {0: [0]})


def test_no_revision_with_both_roles_leaves_no_pair() -> None:
    # Old prefills gone, new decodes not ready: every request must be served by one engine alone.
    assert pairable([P2], [D1], {P2: "new", D1: "old"}) == Pairing([], {})


def test_a_pick_among_some_engines_never_leaves_them() -> None:
    engines = Endpoints("decode", [D1, D2, D3], lambda *_: None)
    engines.loads = [0, 5, 3]
    assert engines.pick() == 0
    assert {engines.pick(among=[1, 2]) for _ in range(4)} == {2}  # the least busy of those allowed
    engines.loads = [0, 3, 3]
    assert {engines.pick(among=[1, 2]) for _ in range(4)} == {1, 2}  # round robin among equals
    with pytest.raises(ValueError, match="no decode engine"):
        engines.pick(among=[])


def test_an_engine_announces_its_revision_as_its_events_topic() -> None:
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557"}
    assert revision_of({"0": {**config, "topic": events_topic("3f2a")}}) == "3f2a"
    assert (
        revision_of({"0": {**config, "topic": events_topic("3f2a")}, "1": {**config, "topic": events_topic("3f2a")}})
        == "3f2a"
    )
    assert revision_of({"0": config}) is None  # vLLM's default topic: no revision announced
    assert revision_of({"0": {**config, "topic": "kv@pod@model"}}) is None  # another consumer's convention
    assert revision_of({"0": {**config, "topic": events_topic("")}}) is None
    assert (
        revision_of({"0": {**config, "topic": events_topic("a")}, "1": {**config, "topic": events_topic("b")}}) is None
    )
    assert revision_of({}) is None
    assert revision_of(None) is None


def test_given_revisions_are_parsed_and_bad_ones_named() -> None:
    assert parse_revisions(["http://10.0.0.1:8000/=a1"]) == {"http://10.0.0.1:8000": "a1"}
    for bad in ("10.0.0.1:8000=a1", "http://10.0.0.1:8000=", "http://10.0.0.1:8000"):
        with pytest.raises(ValueError, match=r"--engine-revision.*ENGINE_URL=REVISION"):
            parse_revisions([bad])
