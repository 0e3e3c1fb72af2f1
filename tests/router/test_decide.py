"""The decode-direct threshold and the key scheme a producer announces (pure)."""

from __future__ import annotations

import pytest

from maru_contracts.keys import KeyScheme
from maru_router.decide import chunks_needed, decode_direct

CHUNK = 256


@pytest.mark.parametrize(
    ("prompt_len", "min_coverage", "need"),
    [
        (CHUNK - 1, 1.0, None),  # no full chunk: nothing the pool could give
        (CHUNK, 1.0, 1),  # exactly one chunk: the capped hit leaves its last token to decode
        (8 * CHUNK + 20, 1.0, 8),  # every full chunk; the partial tail is decode's
        (8 * CHUNK + 20, 0.5, 4),
        (8 * CHUNK + 20, 0.01, 1),
        (3 * CHUNK, 0.5, 2),  # rounded up: half of three chunks is two
    ],
)
def test_chunks_needed(prompt_len: int, min_coverage: float, need: int | None) -> None:
    assert chunks_needed(prompt_len, CHUNK, min_coverage) == need


def test_decode_direct_only_at_or_above_the_threshold() -> None:
    assert decode_direct(8, 8 * CHUNK + 20, CHUNK, 1.0)
    assert not decode_direct(7, 8 * CHUNK + 20, CHUNK, 1.0)
    assert not decode_direct(0, CHUNK - 1, CHUNK, 1.0)


@pytest.mark.parametrize("bad", [0.0, -1.0, 1.5])
def test_min_coverage_out_of_range_is_named(bad: float) -> None:
    with pytest.raises(ValueError, match="min_coverage"):
        chunks_needed(1000, CHUNK, bad)


def test_key_scheme_round_trips_through_kv_transfer_params() -> None:
    scheme = KeyScheme((b"\x01" * 32, b"\x02" * 32), 128, 256, "sha256")
    assert KeyScheme.from_params(scheme.to_params()) == scheme


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ("x", "expected an object"),
        ({"fingerprints": [], "hash_block_size": 128, "chunk_tokens": 256, "hash_algo": "sha256"}, "fingerprints"),
        ({"fingerprints": ["zz" * 32], "hash_block_size": 128, "chunk_tokens": 256, "hash_algo": "sha256"}, "hex"),
        ({"fingerprints": ["00" * 32], "hash_block_size": 128, "chunk_tokens": 200, "hash_algo": "sha256"}, "chunk"),
        ({"fingerprints": ["00" * 32], "hash_block_size": 128, "chunk_tokens": 256, "hash_algo": ""}, "hash_algo"),
    ],
)
def test_a_malformed_key_scheme_is_refused_by_field(params: object, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        KeyScheme.from_params(params)
