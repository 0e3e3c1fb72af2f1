"""Pool keys of prompt chunks, derived from vLLM's own block hashes.

vLLM already hashes every full block of a request into ``request.block_hashes``: a chain where
the hash of block *j* covers every token of blocks ``0..j`` (plus LoRA, multimodal inputs and the
request's ``cache_salt``). The key of chunk *i* is therefore the block hash at the chunk's last
block, keyed with a fingerprint of everything that changes the bytes of the KV: model, revision,
dtype, KV layout, block and chunk size, tensor-parallel rank and size, and the tenant salt.
Nothing re-reads token ids, so a 128k-token prompt costs one small hash per chunk.

The chain only matches across engines when vLLM's root hash (``NONE_HASH``) is the same in every
process: :func:`block_hash_sharing_problem` says when it is not.

Pure module: no vLLM or torch import.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

# Bumped whenever the packed chunk format or the key derivation changes, so old pool content
# turns into misses instead of wrong KV.
FORMAT_VERSION = 1

KEY_BYTES = 16

# vLLM seeds NONE_HASH from these algorithms with random bytes unless PYTHONHASHSEED is set
# (vllm.v1.core.kv_cache_utils.resolve_none_hash_seed in 0.32).
RANDOM_SEEDED_HASH_ALGOS = frozenset({"xxhash", "xxhash_cbor"})


@dataclass(frozen=True)
class Namespace:
    """Everything two engines must agree on for a chunk's bytes to be interchangeable."""

    model: str
    revision: str
    dtype: str
    kv_layout: str
    block_size: int
    chunk_tokens: int
    num_layers: int
    tp_rank: int
    tp_size: int
    salt: str = ""
    hash_algo: str = "sha256"
    format_version: int = FORMAT_VERSION

    def fingerprint(self) -> bytes:
        """A 32-byte digest of every field; equal only for interchangeable KV."""
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(canonical.encode(), digest_size=32, person=b"maru-ns").digest()

    def for_rank(self, tp_rank: int) -> Namespace:
        return Namespace(**{**asdict(self), "tp_rank": tp_rank})


def chunk_keys(
    block_hashes: Sequence[bytes],
    *,
    hash_block_size: int,
    chunk_tokens: int,
    fingerprint: bytes,
    max_tokens: int | None = None,
) -> list[bytes]:
    """Keys of the full chunks covered by ``block_hashes`` (and by ``max_tokens`` when given).

    A chunk counts only when every one of its blocks is hashed, i.e. full: a prompt's partial
    tail never gets a key. ``chunk_tokens`` must be a multiple of ``hash_block_size``.
    """
    if hash_block_size <= 0 or chunk_tokens % hash_block_size:
        raise ValueError(f"chunk_tokens {chunk_tokens} is not a multiple of block size {hash_block_size}")
    per_chunk = chunk_tokens // hash_block_size
    n_chunks = len(block_hashes) // per_chunk
    if max_tokens is not None:
        n_chunks = min(n_chunks, max(0, max_tokens) // chunk_tokens)
    keys = []
    for i in range(n_chunks):
        last = block_hashes[(i + 1) * per_chunk - 1]
        keys.append(hashlib.blake2b(bytes(last), digest_size=KEY_BYTES, key=fingerprint).digest())
    return keys


def interleave_ranks(per_rank: Sequence[Sequence[bytes]]) -> list[bytes]:
    """Keys ordered chunk-major, rank-minor, so one prefix lookup spans every TP rank.

    A chunk is usable only when every rank stored its shard; with this order the pool's count of
    leading committed keys, divided by the rank count, is the count of usable chunks.
    """
    if not per_rank:
        return []
    n = min(len(keys) for keys in per_rank)
    return [per_rank[r][i] for i in range(n) for r in range(len(per_rank))]


def block_hash_sharing_problem(hash_algo: str, env: Mapping[str, str]) -> str | None:
    """Why block hashes would differ between two engines on the same prompt, or None.

    vLLM 0.32 derives NONE_HASH (the root of every block-hash chain) from PYTHONHASHSEED when it
    is set, from a fixed string for the sha256 algorithms, and from fresh random bytes for the
    xxhash algorithms. Random roots make every key unique to one process: stores would only fill
    the pool and lookups would never hit.
    """
    if hash_algo in RANDOM_SEEDED_HASH_ALGOS and env.get("PYTHONHASHSEED") is None:
        return (
            f"--prefix-caching-hash-algo {hash_algo} seeds vLLM's block hashes randomly per process "
            "unless PYTHONHASHSEED is set; set the same PYTHONHASHSEED on every prefill and decode "
            "engine, or use sha256 / sha256_cbor"
        )
    return None
