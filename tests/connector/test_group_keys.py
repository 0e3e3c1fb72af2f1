"""Chunk keys name the KV cache group when an engine has several, and stay as they were with one."""

from __future__ import annotations

import pytest

from maru_contracts.keys import group_label
from tests.support.keys import NS, fake_block_hashes, keys

# NS's fingerprint as keys were before groups were named: a one-group engine must keep reading what
# earlier engines stored.
ONE_GROUP_FINGERPRINT = "87bfcf7e25fb586bfd46f23fb95c0a4e723d9825f4e74b978a33ee28d1f01943"


def test_one_group_keeps_todays_keys() -> None:
    assert group_label(0, 1, "full") == ""
    assert NS.for_group(group_label(0, 1, "full")).fingerprint().hex() == ONE_GROUP_FINGERPRINT


def test_groups_never_share_keys() -> None:
    hashes = fake_block_hashes(8)
    labels = [group_label(0, 2, "full"), group_label(1, 2, "sliding_window=512"), group_label(1, 2, "full")]
    assert labels[:2] == ["0/2:full", "1/2:sliding_window=512"]
    sets = [set(keys(hashes, NS.for_group(label))) for label in ["", *labels]]
    for i, a in enumerate(sets):
        for b in sets[i + 1 :]:
            assert not a & b


@pytest.mark.parametrize(("index", "num_groups"), [(-1, 2), (2, 2), (0, 0)])
def test_a_group_outside_the_config_is_an_error(index: int, num_groups: int) -> None:
    with pytest.raises(ValueError, match=rf"KV cache group {index} of {num_groups}"):
        group_label(index, num_groups, "full")
