"""Chunk keys: derived from vLLM's block hashes, separated by namespace, stable across processes."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from maru_contracts.keys import (
    LATENT_HEADS,
    HeadKeys,
    PromptKeys,
    RankHeads,
    block_hash_sharing_problem,
    chunk_keys,
    head_keys,
    head_range,
    head_ranges,
    interleave_ranks,
    overlap,
    rank_heads,
)
from tests.support.keys import NS, fake_block_hashes, keys

REPO = Path(__file__).resolve().parents[2]


def test_one_key_per_full_chunk_from_its_last_block() -> None:
    hashes = fake_block_hashes(9)  # 9 blocks of 128 = 4.5 chunks of 256
    ks = keys(hashes)
    assert len(ks) == 4
    assert len(set(ks)) == 4
    # The key depends on the chunk's last block hash only (which already chains the prefix).
    other = list(hashes)
    other[0] = b"x" * 32  # a first-block hash that is not a last block of any chunk
    assert keys(other) == ks
    other = list(hashes)
    other[3] = b"y" * 32  # the last block of chunk 1
    assert keys(other)[1] != ks[1]
    assert keys(other)[0] == ks[0]


def test_max_tokens_limits_to_prompt_chunks() -> None:
    hashes = fake_block_hashes(8)
    assert len(keys(hashes, max_tokens=700)) == 2
    assert len(keys(hashes, max_tokens=768)) == 3
    assert keys(hashes, max_tokens=0) == []


@pytest.mark.parametrize(
    "change",
    [
        {"model": "other"},
        {"revision": "abc"},
        {"weights": "files:4567"},
        {"quantization": "fp8"},
        {"load_format": "dummy"},
        {"loader_config": '{"tensorizer_uri":"s3://b/m.tensors"}'},
        {"model_impl": "transformers"},
        {"hf_overrides": '{"rope_scaling":{"factor":4.0}}'},
        {"dtype": "torch.bfloat16"},
        {"kv_cache_dtype": "fp8_e4m3"},
        {"kv_format": "FLASH_ATTN:HNC:float32"},
        {"kv_layers": "other-digest"},
        {"vllm_version": "0.33.0"},
        {"block_size": 64},
        {"chunk_tokens": 512},
        {"num_layers": 3},
        {"kv_heads": "0-1/2"},
        {"kv_heads": "0-2/4"},
        {"kv_heads": "latent"},
        {"salt": "tenant-b"},
        {"hash_algo": "sha256_cbor"},
        {"format_version": 99},
    ],
)
def test_any_namespace_change_changes_every_key(change: dict) -> None:
    hashes = fake_block_hashes(16)
    other_ns = replace(NS, **change)
    a = keys(hashes)
    b = chunk_keys(hashes, hash_block_size=128, chunk_tokens=256, fingerprint=other_ns.fingerprint())
    assert not set(a) & set(b)


def test_keys_are_the_same_in_another_process() -> None:
    hashes = fake_block_hashes(8)
    script = (
        "import json, sys\n"
        "from maru_contracts.keys import Namespace, chunk_keys\n"
        "ns = Namespace(**json.loads(sys.argv[1]))\n"
        "hs = [bytes.fromhex(h) for h in json.loads(sys.argv[2])]\n"
        "print(json.dumps([k.hex() for k in chunk_keys(hs, hash_block_size=128, chunk_tokens=256,"
        " fingerprint=ns.fingerprint())]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, json.dumps(NS.__dict__), json.dumps([h.hex() for h in hashes])],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(REPO / "connector"), "PYTHONHASHSEED": "random"},
    )
    assert json.loads(out.stdout) == [k.hex() for k in keys(hashes)]


def test_chunk_size_must_hold_whole_blocks() -> None:
    with pytest.raises(ValueError):
        chunk_keys(fake_block_hashes(4), hash_block_size=128, chunk_tokens=200, fingerprint=b"f")


def test_interleave_ranks_is_chunk_major() -> None:
    assert interleave_ranks([[b"a0", b"a1", b"a2"], [b"b0", b"b1"]]) == [b"a0", b"b0", b"a1", b"b1"]
    assert interleave_ranks([]) == []


def test_random_seeded_block_hashes_are_detected() -> None:
    assert block_hash_sharing_problem("sha256", {}) is None
    assert block_hash_sharing_problem("sha256_cbor", {}) is None
    assert block_hash_sharing_problem("xxhash", {"PYTHONHASHSEED": "0"}) is None
    problem = block_hash_sharing_problem("xxhash_cbor", {})
    assert problem is not None and "PYTHONHASHSEED" in problem


def test_prompt_keys_equal_chunk_keys_and_follow_a_growing_prompt() -> None:
    fps = [NS.fingerprint(), NS.for_heads("2-4/4").fingerprint()]
    hashes = fake_block_hashes(9)
    pk = PromptKeys(fps, hash_block_size=128, chunk_tokens=256)
    assert pk.update(hashes[:5], 5 * 128) == 0
    assert len(pk) == 2
    assert pk.update(hashes[:5], 5 * 128) == 2  # nothing changed
    for rank, fp in enumerate(fps):
        want = chunk_keys(hashes[:5], hash_block_size=128, chunk_tokens=256, fingerprint=fp)
        assert [pk[i][rank] for i in range(2)] == want
    # A streaming session grows the prompt: new chunks get keys, the old ones keep theirs.
    old = [pk[0], pk[1]]
    assert pk.update(hashes, 9 * 128) == 2
    assert len(pk) == 4 and [pk[0], pk[1]] == old
    assert pk.parents(0) == (None, None) and pk.parents(2) == pk[1]
    assert pk.lookup_order(2) == [pk[0][0], pk[0][1], pk[1][0], pk[1][1]]
    # Hashes past what was computed are dropped and regrown with other tokens: keys from there change.
    regrown = hashes[:3] + fake_block_hashes(6, seed=b"q")[3:]
    assert pk.update(regrown, 6 * 128) == 1
    assert pk[0] == old[0] and pk[1] != old[1]


def test_head_ranges_follow_vllms_sharding_and_replication() -> None:
    assert [head_range(8, 2, r) for r in range(2)] == [(0, 4), (4, 8)]
    assert [head_range(8, 1, 0)] == [(0, 8)]
    # More ranks than KV heads: vLLM replicates each head on consecutive ranks (shard_rank = rank // replicas).
    assert [head_range(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert head_ranges(2, 4) == [(0, 1), (1, 2)]
    for total, tp in ((8, 3), (2, 3), (4, 6)):
        with pytest.raises(ValueError):
            head_range(total, tp, 0)
    assert overlap((0, 4), (2, 6)) == (2, 4) and overlap((0, 2), (2, 4)) is None


def test_head_keys_at_equal_tp_are_one_key_per_rank_used_both_ways() -> None:
    keys = head_keys(4, 2)
    assert keys == HeadKeys(("0-2/4", "2-4/4"), (0, 1), (0, 1))
    assert head_keys(4, 2, 2) == keys
    assert head_keys(None, 4, 2) == HeadKeys((LATENT_HEADS,), (0,), (0,))  # an MLA latent: one key, any TP


def test_head_keys_at_other_tp_load_the_writers_ranges() -> None:
    assert head_keys(4, 1, 2) == HeadKeys(("0-4/4", "0-2/4", "2-4/4"), (0,), (1, 2))
    assert head_keys(4, 2, 1) == HeadKeys(("0-2/4", "2-4/4", "0-4/4"), (0, 1), (2,))
    # Replicated heads are stored once per range: a TP=4 writer over 2 heads stores 2 keys a chunk.
    assert head_keys(2, 1, 4) == HeadKeys(("0-2/2", "0-1/2", "1-2/2"), (0,), (1, 2))


def test_rank_heads_say_what_each_rank_stores_and_reads() -> None:
    # Equal TP: one whole chunk per rank, as before.
    assert rank_heads(4, 2, 1) == RankHeads((2, 4), 1, True, ((1, (2, 4)),))
    assert rank_heads(4, 2, 1).whole
    # TP=1 loading a TP=2 writer's chunks: both halves, re-sharded.
    one = rank_heads(4, 1, 0, 2)
    assert one.reads == ((0, (0, 2)), (1, (2, 4))) and not one.whole
    # TP=2 loading a TP=1 writer's chunk: its half of the one chunk.
    half = rank_heads(4, 2, 1, 1)
    assert half.reads == ((0, (0, 4)),) and not half.whole
    # Replicas: only the first rank of a range stores; a writer whose range is exactly the rank's is whole.
    assert [rank_heads(2, 4, r).stores for r in range(4)] == [True, False, True, False]
    assert [rank_heads(2, 4, r).store_key for r in range(4)] == [0, 0, 1, 1]
    assert rank_heads(2, 4, 3, 2).whole
    assert rank_heads(None, 4, 2).whole and not rank_heads(None, 4, 2).stores


def test_keys_of_different_head_ranges_never_collide() -> None:
    labels = {*head_keys(8, 1, 2).labels, *head_keys(8, 4, 8).labels, *head_keys(8, 2, 4).labels, LATENT_HEADS}
    fps = {NS.for_heads(label).fingerprint() for label in labels}
    assert len(fps) == len(labels)
