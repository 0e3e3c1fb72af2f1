"""What the scheduler half tells the worker half each step, and what the workers tell it back.

Plain dataclasses: vLLM pickles the step metadata to every worker process, and each worker's report
back to the scheduler (``build_connector_worker_meta``), summing the TP ranks' reports with
:meth:`MaruWorkerReport.aggregate`. Built once per step in ``build_connector_meta``; the worker never
mutates it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from maru_pool.protocol import pack_tokens

# What became of one chunk the scheduler handed over for saving (MaruWorkerReport.saves).
STORED = "stored"  # committed by this step
PRESENT = "present"  # already stored, or being stored by another engine: nothing to do
RETRY = "retry"  # not stored (pool full or failing, lease lost): try again later
ORPHAN = "orphan"  # refused: the chunk before it is no longer stored; store that one again first
TAINTED = "tainted"  # computed over a load that failed: dropped; saved again once recomputed
# Not tried: the pool is unreachable or backing off, or the save lane is behind. Retried while the
# request runs, never a reason to hold a finished request's blocks.
SKIPPED = "skipped"
# When ranks disagree, the worse outcome wins (a chunk counts as stored only if every rank stored it).
SEVERITY = {STORED: 0, PRESENT: 0, RETRY: 1, SKIPPED: 1, ORPHAN: 2, TAINTED: 3}


@dataclass(frozen=True)
class ChunkLoad:
    """Copy one pool chunk into the engine's blocks."""

    # One key per head range the writer stored (at equal TP, one per rank; an MLA latent: one key). A rank
    # reads the one holding exactly its heads, or every one overlapping them (keys.RankHeads.reads).
    keys: tuple[bytes, ...]
    # (block index within the chunk, destination block id): only the blocks the engine will not
    # compute itself or hold already (local prefix-cache hits stay untouched), nor a sliding-window
    # group's blocks before its window (vLLM's null block, see ``groups``).
    slots: tuple[tuple[int, int], ...]
    group: int = 0  # the KV cache group whose layers and block table the chunk is for
    index: int = -1  # the chunk's position in the prompt (-1: the plan's first_chunk + its position)


@dataclass(frozen=True)
class LoadPlan:
    """One request's load for this step; ``load_id`` names it in the workers' reports."""

    load_id: int
    # Chunks in prompt order; a failed chunk invalidates the ones after it.
    chunks: tuple[ChunkLoad, ...]
    # Blocks to report as failed without trying: vLLM was promised KV there that the scheduler
    # half could not plan (a fault in one of its hooks). vLLM recomputes them.
    fail_blocks: tuple[int, ...] = ()
    # Prompt index of the first chunk (the report names failures by position in ``chunks``).
    first_chunk: int = 0
    # vLLM was told the load is asynchronous: it runs on the load lane and the request waits for
    # ``get_finished`` to report it; otherwise it runs before the step's forward.
    asynchronous: bool = False


@dataclass(frozen=True)
class ChunkSave:
    """Copy the engine's blocks of one fully computed prompt chunk into the pool."""

    index: int  # the chunk's position in the prompt, echoed in the report
    keys: tuple[bytes, ...]  # one per head range this engine stores; a rank writes keys[RankHeads.store_key]
    # Per head range, the key of the chunk before this one (None for the first): the pool stores a
    # chunk only after its parent, so what it keeps of a prompt is always a prefix.
    parents: tuple[bytes | None, ...]
    # Source block ids, in chunk order; exactly blocks_per_chunk of them, in ``group``'s block table.
    block_ids: tuple[int, ...]
    # The prompt tokens the chunk covers, as little-endian uint32s (pool.protocol.pack_tokens), for the
    # pool's events (consumers of vLLM's KV events key blocks by tokens); None when they do not alone say
    # what the chunk holds, or are unknown. Every TP rank sends the same with its own key.
    token_ids: bytes | None = None
    group: int = 0  # the KV cache group whose layers the chunk holds (keys.Namespace.kv_group)


def chunk_token_ids(request: Any, index: int, chunk_tokens: int) -> bytes | None:
    """The prompt tokens chunk ``index`` of ``request`` covers, packed for :attr:`ChunkSave.token_ids`.

    None where the tokens alone do not say what the chunk holds, because a consumer of the pool's events
    would then take one chunk for another: prompt embeddings (vLLM's token ids there are zeros), multimodal
    inputs (placeholder tokens), a LoRA adapter or a cache salt (in the chunk's key, not in the events).
    Never raises: a chunk's tokens are worth less than its save.
    """
    try:
        if request.prompt_token_ids is None or getattr(request, "prompt_is_token_ids", None) is not None:
            return None
        if getattr(request, "mm_features", None) or getattr(request, "lora_request", None) is not None:
            return None
        if getattr(request, "cache_salt", None):
            return None
        start, end = index * chunk_tokens, (index + 1) * chunk_tokens
        if end > request.num_prompt_tokens:
            return None
        # all_token_ids, as vLLM's own BlockStored: what the block hashes (and so the chunk's key) cover.
        ids = request.all_token_ids[start:end]
        return pack_tokens(ids) if len(ids) == chunk_tokens else None
    except Exception:  # a request shaped unlike vLLM 0.32's: the chunk is saved, its event carries no tokens
        return None


@dataclass(frozen=True)
class SavePlan:
    """One request's chunks completed by this step."""

    chunks: tuple[ChunkSave, ...]
    # Loads not yet confirmed when this step was planned whose blocks this request's KV was
    # computed over (its own, or another request's reused through vLLM's prefix cache). If any of
    # them failed, every chunk here is dropped (TAINTED).
    depends_on: tuple[int, ...] = ()


@dataclass
class MaruConnectorMetadata(KVConnectorMetadata):
    """The step's work for the worker half: loads run before the forward, saves after it."""

    # req_id -> the request's load
    loads: dict[str, LoadPlan] = field(default_factory=dict)
    # req_id -> the request's saves
    saves: dict[str, SavePlan] = field(default_factory=dict)
    # Every load id below this is settled on the scheduler side: workers may forget its outcome.
    settled_below: int = 0
    # Requests vLLM preempted this step: their blocks may be reused, so saves reading them finish first.
    preempted: frozenset[str] = frozenset()
    # Finished requests whose saves are all settled: workers report them in ``finished_sending``
    # (once their own save lane is done with them), and vLLM frees their blocks.
    free_now: frozenset[str] = frozenset()
    # Running requests with saves in flight whose sliding-window blocks vLLM may have freed this step
    # (``remove_skipped_blocks``) and may hand on: their saves finish before the step writes KV.
    window_frees: frozenset[str] = frozenset()

    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.preempted or self.free_now or self.window_frees)


@dataclass
class MaruWorkerReport(KVConnectorWorkerMetadata):
    """What one step's loads and saves came to, on one worker; summed over TP ranks by vLLM."""

    # load_id -> index of the first chunk that failed, or -1 when every chunk loaded
    loads: dict[int, int] = field(default_factory=dict)
    # (req_id, chunk index) -> STORED | PRESENT | RETRY | SKIPPED | ORPHAN | TAINTED
    saves: dict[tuple[str, int], str] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> MaruWorkerReport:
        if not isinstance(other, MaruWorkerReport):
            return self
        loads = dict(self.loads)
        for load_id, failed in other.loads.items():
            mine = loads.get(load_id, -1)
            # A load failed if any rank failed it, from the earliest chunk any rank failed.
            loads[load_id] = max(mine, failed) if min(mine, failed) < 0 else min(mine, failed)
        saves = dict(self.saves)
        for chunk, outcome in other.saves.items():
            mine = saves.get(chunk)
            if mine is None or SEVERITY[outcome] > SEVERITY[mine]:
                saves[chunk] = outcome
        return MaruWorkerReport(loads=loads, saves=saves)

    def is_empty(self) -> bool:
        return not self.loads and not self.saves


@dataclass
class MaruWorkerInfo(KVConnectorHandshakeMetadata):
    """Sent once by each worker after it registered its KV caches (vLLM's handshake path).

    The scheduler half cannot see the attention backend or the cache tensors, yet both are part of
    every key: it waits for this before it looks anything up.
    """

    kv_format: str  # layout.PagedKV.format
    tp_rank: int
    block_bytes: int
    num_layers: int
    kv_layers: str  # digest of the layer names and their page size
