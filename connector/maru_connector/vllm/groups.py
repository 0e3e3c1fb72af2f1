"""Several KV cache groups: what each one needs of a prompt prefix the pool gives, and which blocks take it.

With vLLM's hybrid KV cache manager on (only for a connector that implements ``SupportsHMA``), a model
whose layers keep different spans of tokens (Gemma 3, gpt-oss: sliding-window layers beside full ones)
gets one KV cache group per kind of layer, each with a block table of its own. A hit that ends at token
``end`` (block-aligned, short of the prompt's end: ``hits.capped_hit_tokens``) needs, per group:

- full attention: every token before ``end``;
- a sliding window of ``W`` tokens: only ``[end - W + 1, end)``, what the first token computed after the
  hit reads. vLLM's ``SlidingWindowManager`` skips the tokens before that (``get_num_skipped_tokens``)
  and gives their whole blocks the null block (``add_local_computed_blocks`` pads with it), which every
  request shares: a load must never write it.

Pure arithmetic over plain values (the scheduler half builds :class:`KVGroup` once from the engine's
``KVCacheConfig``); a test holds it to what vLLM's own block manager allocates.

Storing: every chunk of every group. Any chunk of a sliding-window group is the window of some later
prompt's hit (one that ends a chunk or two after it), so none can be left out; the saving is vLLM's GPU
memory and the loads, which read only the window. Its blocks are freed while the request runs
(``remove_skipped_blocks``): a chunk is saved only from blocks the request still holds
(:func:`held_blocks`), and saves still reading them finish before the next step writes KV
(``MaruConnectorMetadata.window_frees``). A chunk longer than the window can lose its first blocks before
its last token is computed (a prefill step ending inside it, more than a block plus the window past its
start): it and the request's later chunks are then not stored (``RequestState.unsavable_from``).

A failed load of several groups is reported per request (vLLM cannot map block ids back to a group and
raises), so their loads are always asynchronous (``MaruScheduler.load_async``).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from maru_contracts.keys import group_label

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

FULL = "full"


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group: its layers, the tokens they keep, and what its chunk keys say of it."""

    index: int
    layers: tuple[str, ...]
    window: int | None  # sliding window in tokens; None: full attention (every token kept)
    label: str  # keys.group_label: "" when the engine has one group, so its keys stay as they were

    @property
    def kind(self) -> str:
        return FULL if self.window is None else f"sliding_window={self.window}"

    def first_needed_token(self, end: int) -> int:
        """The first token the group's layers read when computing token ``end`` (vLLM's skip rule)."""
        if self.window is None:
            return 0
        return max(0, end - self.window + 1)

    def needed_blocks(self, start: int, end: int, block_size: int) -> range:
        """Blocks to load for a hit taking tokens ``[start, end)`` from the pool.

        Blocks wholly before the window hold vLLM's null block and stay untouched; a block the window
        starts inside is loaded whole (vLLM keeps it, and the tokens before the window are never read).
        """
        first = max(start, self.first_needed_token(end) // block_size * block_size)
        return range(first // block_size, end // block_size)

    def needed_chunks(self, start: int, end: int, block_size: int, chunk_tokens: int) -> range:
        """Prompt chunks the pool must hold for this group, for a hit taking tokens ``[start, end)``."""
        blocks = self.needed_blocks(start, end, block_size)
        if not blocks:
            return range(0)
        per_chunk = chunk_tokens // block_size
        return range(blocks.start // per_chunk, (blocks.stop - 1) // per_chunk + 1)


def kv_groups(kv_cache_config: KVCacheConfig) -> tuple[KVGroup, ...]:
    """The engine's KV cache groups, in vLLM's order (the order of ``KVCacheBlocks.get_block_ids()``).

    One group is copied whole, whatever its spec (what ``kvspec`` accepts: full attention, MLA, per-layer
    specs, sliding layers vLLM allocated as full). Of several, raises ValueError for a group that keeps
    neither all tokens nor a sliding window (chunked local attention, Mamba state): no prefix of it
    could be loaded by these rules.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) == 1:
        return (KVGroup(0, tuple(groups[0].layer_names), None, group_label(0, 1, FULL)),)
    out = []
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            window: int | None = spec.sliding_window
        elif isinstance(spec, FullAttentionSpec):
            window = None
        else:
            raise ValueError(f"KV cache group {index} holds {type(spec).__name__}, neither full nor sliding-window")
        kind = FULL if window is None else f"sliding_window={window}"
        out.append(KVGroup(index, tuple(group.layer_names), window, group_label(index, len(groups), kind)))
    return tuple(out)


HitTokens = Callable[[int], int]  # chunks hit -> tokens beyond the local hit (hits.capped_hit_tokens, bound)


def hit_tokens(
    groups: Sequence[KVGroup],
    present: Sequence[Container[int]],
    *,
    max_chunks: int,
    local_tokens: int,
    block_size: int,
    chunk_tokens: int,
    rule: HitTokens,
) -> int:
    """Tokens beyond ``local_tokens`` every group can take from the pool (0: a miss).

    ``present[g]`` holds the chunk indices the pool has for group ``g``. The hit is the longest the
    capped ``rule`` allows for some count of leading chunks such that every group finds every chunk it
    needs: a group missing one would compute over KV that was never loaded.
    """
    for chunks in range(max_chunks, 0, -1):
        tokens = rule(chunks)
        if tokens <= 0:
            continue
        end = local_tokens + tokens
        if all(
            all(c in have for c in group.needed_chunks(local_tokens, end, block_size, chunk_tokens))
            for group, have in zip(groups, present, strict=True)
        ):
            return tokens
    return 0


def load_slots(
    group: KVGroup, block_ids: Sequence[int], start: int, end: int, block_size: int, chunk_tokens: int
) -> dict[int, tuple[tuple[int, int], ...]]:
    """Per prompt chunk, the ``(block within the chunk, block id)`` pairs a load of ``[start, end)`` writes."""
    per_chunk = chunk_tokens // block_size
    out: dict[int, list[tuple[int, int]]] = {}
    for block in group.needed_blocks(start, end, block_size):
        out.setdefault(block // per_chunk, []).append((block % per_chunk, block_ids[block]))
    return {chunk: tuple(slots) for chunk, slots in out.items()}


def held_blocks(block_ids: Sequence[int], chunk: int, per_chunk: int, null_block: int | None) -> tuple[int, ...] | None:
    """The block ids of prompt chunk ``chunk`` in a request's block table for one group, or None when
    the request no longer holds them all: vLLM put its null block where a sliding window moved past
    (``remove_skipped_blocks``), and a save from there would store the null block's zeros as KV.
    ``null_block`` None: a full-attention group, whose table vLLM never nulls."""
    ids = tuple(block_ids[chunk * per_chunk : (chunk + 1) * per_chunk])
    return ids if len(ids) == per_chunk and null_block not in ids else None
