"""Pool keys of prompt chunks, derived from vLLM's own block hashes.

vLLM already hashes every full block of a request into ``request.block_hashes``: a chain where
the hash of block *j* covers every token of blocks ``0..j`` (plus LoRA, multimodal inputs and the
request's ``cache_salt``). The key of chunk *i* is therefore the block hash at the chunk's last
block, keyed with a fingerprint of everything that changes the bytes of the KV (:class:`Namespace`):
the weights themselves and how they are loaded, the modelling code, quantization, config overrides,
dtypes, the KV cache's byte format and layers, the vLLM version, block and chunk size, the range of
KV heads the chunk holds (:func:`head_range`), and the tenant salt.
Nothing re-reads token ids, so a 128k-token prompt costs one small hash per chunk.

A request served through a LoRA adapter gets keys of its own adapter's weights (:func:`with_adapter`):
vLLM's block hashes carry the adapter's name and path, which stay the same when new adapter weights
are written at that path.

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
# turns into misses instead of wrong KV. 2: pages copied in memory order of vLLM 0.32's layouts.
# 3: the load format, the loader's config, the modelling code (model_impl, custom *.py files) are
# in the fingerprint; chunks of version 2 were keyed without them (an engine with dummy weights
# stored under the real model's key), so none of them may ever be hit again.
# 4: chunks are keyed by the KV-head range they hold, not by TP rank and size, so engines of
# different TP sizes find each other's heads.
FORMAT_VERSION = 4

KEY_BYTES = 16

# vLLM seeds NONE_HASH from these algorithms with random bytes unless PYTHONHASHSEED is set
# (vllm.v1.core.kv_cache_utils.resolve_none_hash_seed in 0.32).
RANDOM_SEEDED_HASH_ALGOS = frozenset({"xxhash", "xxhash_cbor"})


@dataclass(frozen=True)
class Namespace:
    """Everything two engines must agree on for a chunk's bytes to be interchangeable.

    The engine's half comes from its configuration (``vllm.namespace``), the KV cache's half from
    what the workers registered (``kv_format``, ``kv_layers``): the scheduler cannot see the latter.
    """

    model: str  # as configured: a repo id or a path (for people reading logs; the weights field decides)
    revision: str
    weights: str  # weights.weights_identity: a commit, or the weight and code files' names, sizes and times
    load_format: str  # --load-format: `dummy` fills the same model with random numbers
    loader_config: str  # canonical JSON of --model-loader-extra-config, less its speed-only keys
    model_impl: str  # --model-impl: vLLM's modelling code or Transformers' (custom code)
    quantization: str
    hf_overrides: str  # canonical JSON of --hf-overrides (e.g. rope scaling)
    dtype: str  # the model's dtype
    kv_cache_dtype: str  # --kv-cache-dtype, and the layers it skips; the scales come with the weights
    kv_format: str  # layout.PagedKV.format: attention backend, page order, tensor dtype
    kv_layers: str  # digest of the KV layers' names and page sizes, from the workers
    vllm_version: str
    block_size: int
    chunk_tokens: int
    num_layers: int
    kv_heads: str  # heads_label(): the KV heads the chunk holds, of how many (LATENT_HEADS for an MLA latent)
    salt: str = ""
    hash_algo: str = "sha256"
    format_version: int = FORMAT_VERSION
    kv_group: str = ""  # group_label(): which of several KV cache groups; "" for one group

    def fingerprint(self) -> bytes:
        """A 32-byte digest of every field; equal only for interchangeable KV."""
        fields = asdict(self)
        if not self.kv_group:
            # An engine with one KV cache group keeps the keys it had before groups were named.
            del fields["kv_group"]
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(canonical.encode(), digest_size=32, person=b"maru-ns").digest()

    def for_heads(self, kv_heads: str) -> Namespace:
        return Namespace(**{**asdict(self), "kv_heads": kv_heads})

    def for_group(self, kv_group: str) -> Namespace:
        return Namespace(**{**asdict(self), "kv_group": kv_group})


def group_label(index: int, num_groups: int, spec_kind: str) -> str:
    """What a chunk's key says of its KV cache group: its index and its spec's kind and window.

    Two groups never share keys, even with equal shapes (a sliding-window group's blocks beside a full
    group's); one group gets "", so a one-group engine's keys stay those of every earlier engine.
    ``spec_kind`` is e.g. ``full`` or ``sliding_window=4096``: an engine that groups the same layers
    differently, or with another window, must not read them.
    """
    if not 0 <= index < num_groups:
        raise ValueError(f"KV cache group {index} of {num_groups}")
    return "" if num_groups == 1 else f"{index}/{num_groups}:{spec_kind}"


# The kv_heads of an MLA latent: one vector per token, the same on every TP rank.
LATENT_HEADS = "latent"

HeadRange = tuple[int, int]  # KV heads [start, end) of the model's total


def head_range(total_heads: int, tp_size: int, tp_rank: int) -> HeadRange:
    """The KV heads rank ``tp_rank`` of a ``tp_size``-way engine holds, as vLLM shards them.

    vLLM 0.32's ``QKVParallelLinear``: with fewer ranks than KV heads each rank holds
    ``total_heads / tp_size`` consecutive heads; with as many or more, each holds one head, replicated on
    ``tp_size / total_heads`` consecutive ranks. Any other pair vLLM refuses, and so does this.
    """
    if total_heads <= 0 or tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"no KV heads for rank {tp_rank} of TP {tp_size} over {total_heads} heads")
    if tp_size >= total_heads:
        if tp_size % total_heads:
            raise ValueError(f"TP {tp_size} is not a multiple of the model's {total_heads} KV heads")
        head = tp_rank // (tp_size // total_heads)
        return head, head + 1
    if total_heads % tp_size:
        raise ValueError(f"the model's {total_heads} KV heads do not split over TP {tp_size}")
    per_rank = total_heads // tp_size
    return tp_rank * per_rank, (tp_rank + 1) * per_rank


def head_ranges(total_heads: int, tp_size: int) -> list[HeadRange]:
    """The distinct head ranges of a ``tp_size``-way engine, in head order: one stored chunk each.

    Replicas of one range hold the same bytes, so it is stored once (by its first rank).
    """
    return sorted({head_range(total_heads, tp_size, r) for r in range(tp_size)})


def heads_label(heads: HeadRange, total_heads: int) -> str:
    """``Namespace.kv_heads`` of a chunk holding ``heads``: ranges that differ never share a key."""
    return f"{heads[0]}-{heads[1]}/{total_heads}"


def overlap(a: HeadRange, b: HeadRange) -> HeadRange | None:
    """The heads both ranges hold, or None."""
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


@dataclass(frozen=True)
class HeadKeys:
    """Which head ranges an engine keys a prompt chunk by: the ones it stores and the ones it loads.

    A chunk gets one key per label (:meth:`Namespace.for_heads`); the engine stores under
    ``labels[i] for i in store`` (its own distinct ranges, in head order) and loads from
    ``labels[i] for i in load`` (its writer's: the same indexes when the TP sizes match).
    """

    labels: tuple[str, ...]
    store: tuple[int, ...]
    load: tuple[int, ...]


def head_keys(total_heads: int | None, tp_size: int, writer_tp: int | None = None) -> HeadKeys:
    """The :class:`HeadKeys` of a ``tp_size``-way engine loading what ``writer_tp``-way engines stored.

    ``total_heads`` None: an MLA latent, one key whatever either TP size. ValueError when a TP size
    does not shard the model's KV heads (see :func:`head_range`).
    """
    if total_heads is None:
        return HeadKeys((LATENT_HEADS,), (0,), (0,))
    own = [heads_label(r, total_heads) for r in head_ranges(total_heads, tp_size)]
    writer = [heads_label(r, total_heads) for r in head_ranges(total_heads, writer_tp or tp_size)]
    labels = own + [label for label in writer if label not in own]
    return HeadKeys(tuple(labels), tuple(range(len(own))), tuple(labels.index(label) for label in writer))


@dataclass(frozen=True)
class RankHeads:
    """One TP rank's part in :class:`HeadKeys`: where its keys sit in a chunk's ``keys`` tuples."""

    heads: HeadRange | None  # the KV heads this rank holds (None: an MLA latent)
    store_key: int  # index of its own range in a ChunkSave's keys
    stores: bool  # the first rank holding its range: replicas hold the same bytes and store nothing
    # (index in a ChunkLoad's keys, the writer's range) of every stored range holding some of its heads
    reads: tuple[tuple[int, HeadRange | None], ...]

    @property
    def whole(self) -> bool:
        """It loads one stored chunk, as is: the writer held exactly its heads (always so at equal TP)."""
        return len(self.reads) == 1 and self.reads[0][1] == self.heads


def rank_heads(total_heads: int | None, tp_size: int, tp_rank: int, writer_tp: int | None = None) -> RankHeads:
    """Rank ``tp_rank``'s :class:`RankHeads`; ``total_heads`` None for an MLA latent (rank 0 stores)."""
    if total_heads is None:
        return RankHeads(None, 0, tp_rank == 0, ((0, None),))
    own = head_range(total_heads, tp_size, tp_rank)
    stores = tp_rank == 0 or head_range(total_heads, tp_size, tp_rank - 1) != own
    writer = head_ranges(total_heads, writer_tp or tp_size)
    reads = tuple((i, r) for i, r in enumerate(writer) if overlap(r, own))
    return RankHeads(own, head_ranges(total_heads, tp_size).index(own), stores, reads)


def with_adapter(fingerprints: Sequence[bytes], adapter: str) -> list[bytes]:
    """The per-rank fingerprints of a request served through the LoRA adapter ``adapter``.

    ``adapter`` is ``weights.adapter_identity`` of the request's adapter; "" (no adapter) keeps the
    engine's fingerprints, so requests without an adapter share keys as before.
    """
    if not adapter:
        return list(fingerprints)
    return [
        hashlib.blake2b(adapter.encode(), digest_size=32, key=fp, person=b"maru-adapter").digest()
        for fp in fingerprints
    ]


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


class PromptKeys:
    """The keys of a live request's full prompt chunks, one per TP rank, following the prompt.

    vLLM can grow a request's prompt while it lives (streaming input sessions extend it with new
    tokens and drop the hashes of blocks past what was computed), so keys are recomputed whenever
    the request's block hashes or prompt length changed, and only from the first chunk that did.
    Because block hashes form a chain, one comparison per chunk boundary tells where they differ.
    """

    def __init__(self, fingerprints: Sequence[bytes], *, hash_block_size: int, chunk_tokens: int) -> None:
        if hash_block_size <= 0 or chunk_tokens % hash_block_size:
            raise ValueError(f"chunk_tokens {chunk_tokens} is not a multiple of block size {hash_block_size}")
        self._fingerprints = list(fingerprints)
        self._hash_block_size = hash_block_size
        self._chunk_tokens = chunk_tokens
        self._per_chunk = chunk_tokens // hash_block_size
        self._keys: list[tuple[bytes, ...]] = []  # per chunk, one key per rank
        self._ends: list[bytes] = []  # per chunk, the block hash its keys derive from
        self._seen: tuple[int, int] = (-1, -1)

    def update(self, block_hashes: Sequence[bytes], num_prompt_tokens: int) -> int:
        """Follow the request; returns the first chunk whose key changed (``len(self)`` if none did)."""
        if (len(block_hashes), num_prompt_tokens) == self._seen:
            return len(self._keys)
        self._seen = (len(block_hashes), num_prompt_tokens)
        n = min(len(block_hashes) // self._per_chunk, max(0, num_prompt_tokens) // self._chunk_tokens)
        same = min(n, len(self._ends))
        while same and bytes(block_hashes[same * self._per_chunk - 1]) != self._ends[same - 1]:
            same -= 1
        del self._keys[same:], self._ends[same:]
        for i in range(same, n):
            end = bytes(block_hashes[(i + 1) * self._per_chunk - 1])
            self._ends.append(end)
            self._keys.append(
                tuple(hashlib.blake2b(end, digest_size=KEY_BYTES, key=fp).digest() for fp in self._fingerprints)
            )
        return same

    def __len__(self) -> int:
        return len(self._keys)

    def __getitem__(self, chunk: int) -> tuple[bytes, ...]:
        return self._keys[chunk]

    def parents(self, chunk: int) -> tuple[bytes | None, ...]:
        """Per rank, the key of the chunk before ``chunk`` in the prompt (None for the first chunk)."""
        return self._keys[chunk - 1] if chunk else (None,) * len(self._fingerprints)

    def lookup_order(self, n: int | None = None, ranks: Sequence[int] | None = None) -> list[bytes]:
        """The first ``n`` chunks' keys, chunk-major and rank-minor (see :func:`interleave_ranks`).

        ``ranks``: only the keys of these fingerprints (the head ranges a loader reads), in that order.
        """
        chunks = self._keys[:n]
        if ranks is None:
            return [key for keys in chunks for key in keys]
        return [keys[r] for keys in chunks for r in ranks]


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


@dataclass(frozen=True)
class KeyScheme:
    """What a reader outside the engine needs to key a prompt exactly as the engine does.

    A producer announces it with its handoff, so a router can compute a prompt's chunk keys with
    vLLM's own block hashing and this module, and ask the pool for its coverage, without guessing
    the engine's namespace (half of it is only known once the workers registered their KV caches).
    """

    fingerprints: tuple[bytes, ...]  # per stored head range (one per TP rank, bar replicas), Namespace.fingerprint()
    hash_block_size: int
    chunk_tokens: int
    hash_algo: str

    def to_params(self) -> dict[str, object]:
        return {
            "fingerprints": [fp.hex() for fp in self.fingerprints],
            "hash_block_size": self.hash_block_size,
            "chunk_tokens": self.chunk_tokens,
            "hash_algo": self.hash_algo,
        }

    @classmethod
    def from_params(cls, params: object) -> KeyScheme:
        """Parse :meth:`to_params` output; ValueError naming the field on anything else."""
        if not isinstance(params, Mapping):
            raise ValueError(f"key scheme: expected an object, got {type(params).__name__}")
        fps = params.get("fingerprints")
        if not isinstance(fps, list) or not fps or not all(isinstance(f, str) and len(f) == 64 for f in fps):
            raise ValueError("key scheme: fingerprints must be a non-empty list of 64-digit hex strings")
        block, chunk, algo = params.get("hash_block_size"), params.get("chunk_tokens"), params.get("hash_algo")
        if not isinstance(block, int) or not isinstance(chunk, int) or block <= 0 or chunk % block or chunk <= 0:
            raise ValueError(f"key scheme: chunk_tokens {chunk} must be a positive multiple of hash_block_size {block}")
        if not isinstance(algo, str) or not algo:
            raise ValueError("key scheme: hash_algo must be a non-empty string")
        try:
            fingerprints = tuple(bytes.fromhex(f) for f in fps)
        except ValueError:
            raise ValueError("key scheme: fingerprints must be hex") from None
        return cls(fingerprints, block, chunk, algo)
