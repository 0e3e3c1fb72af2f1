"""Scheduler half of the Maru connector: decides what to load and what to store, moves no bytes.

Runs inside vLLM's scheduler (the engine core process), on the scheduling critical path, so it never
waits for the pool: lookups run on a thread of their own (``lookups.AsyncLookups``; vLLM is told
"ask again" until the answer is in), and the worker half does all copying on its own lanes and
reports back what became of it (``metadata.MaruWorkerReport``).

Each live request has a :class:`RequestState`, a small state machine over its prompt chunks::

    MISSING --save_planned--> SAVING --save_done(stored|present)--> IN_POOL
       ^                         |
       +--save_done(retry: after a back-off of 1, 2, 4 .. steps; tainted: once recomputed)
    MISSING <--load_failed-- IN_POOL <--looked_up--  (chunks the pool had, then failed to give)

A chunk is planned for saving in the step whose forward computes its last token, or in any later
step while it is MISSING and the request still holds its blocks: a save skipped because the pool
was full or failing is retried until it sticks. A request that finishes with saves still SAVING, or
skipped and due again, keeps its blocks (``request_finished`` answers "delay the free") until they
are settled or :data:`FINISHED_RETRY_S` has passed; then the next step's metadata lists it in
``free_now`` and the workers release it.

vLLM 0.32 schedules asynchronously (step N+1 is planned before step N's output is known), so a
synchronous load may fail after saves computed over its blocks were planned: every save names the
loads its request's KV depends on that were not settled when it was planned
(``SavePlan.depends_on``), the worker drops it when one of them failed, and the chunks go back to
MISSING, to be saved once vLLM has recomputed them. Asynchronous loads (the default) settle before
their request computes anything.

A producer tells whoever reads its answer how many leading chunks it stored or is storing
(``kv_transfer_params``: ``maru_chunks``, and the last one's key), and a decode request carrying
them waits (in its lookup, not in the engine) until the pool holds them: prefill commits after it
answers, and the router sends decode about a millisecond later.
"""

from __future__ import annotations

import enum
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from maru_connector.vllm import common
from maru_connector.vllm.groups import held_blocks, kv_groups, load_slots
from maru_connector.vllm.kvspec import is_latent_cache, refuse_unsupported_kv_cache, total_kv_heads
from maru_connector.vllm.lookups import AsyncLookups
from maru_connector.vllm.metadata import (
    ORPHAN,
    PRESENT,
    RETRY,
    SKIPPED,
    STORED,
    TAINTED,
    ChunkLoad,
    ChunkSave,
    LoadPlan,
    MaruConnectorMetadata,
    MaruWorkerInfo,
    MaruWorkerReport,
    SavePlan,
    chunk_token_ids,
)
from maru_connector.vllm.namespace import engine_identity
from maru_connector.weights import adapter_identity, remote_weights_problem
from maru_contracts import hits
from maru_contracts.config import ConfigError, MaruConnectorConfig
from maru_contracts.handoff import HANDOFF_CHUNKS, HANDOFF_KEY_SCHEME, HANDOFF_LAST_KEY
from maru_contracts.keys import (
    KeyScheme,
    Namespace,
    PromptKeys,
    block_hash_sharing_problem,
    head_keys,
    with_adapter,
)
from maru_pool.readers import Reader

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# hits.capped_hit_tokens, or (in one test) the uncapped rule it replaces; keyword arguments only.
HitRule = Callable[..., int]

# A skipped save waits 1, 2, 4 ... steps before the next try, at most this many.
MAX_RETRY_BACKOFF_STEPS = 64
# Work the workers never reported on (a lost report) is given up after this long.
UNREPORTED_AFTER_S = 60.0
# A finished request keeps its blocks at most this long for saves still being retried.
FINISHED_RETRY_S = 2.0
# The block id of vLLM's null block (BlockPool takes the first free block for it): a sliding-window
# group's table holds it where the window moved past, and nothing may be read from or written to it.
NULL_BLOCK = 0


class Chunk(enum.Enum):
    MISSING = "missing"  # not known to be in the pool: saved once computed
    SAVING = "saving"  # handed to the workers, outcome not reported yet
    IN_POOL = "in_pool"  # found by the lookup, stored, or stored by another engine


@dataclass
class RequestState:
    """What the scheduler half knows about one live request, and its named transitions."""

    request: Request
    keys: PromptKeys
    chunks: list[Chunk] = field(default_factory=list)  # per full prompt chunk
    saving_since: dict[int, float] = field(default_factory=dict)  # chunk -> when it was handed over
    retry_at: dict[int, int] = field(default_factory=dict)  # chunk -> first step it may be tried again
    skips_in_a_row: int = 0  # reports in a row with a skipped save: the back-off doubles with each
    # Tokens the engine held locally when it last asked, and leading chunks the pool can give
    # (from the lookup, lowered when a load of them fails).
    local_tokens: int = 0
    chunks_hit: int = 0
    looked_up_keys: int = -1  # how many chunk keys the prompt had when its lookup was asked
    answered: bool = False  # the lookup for looked_up_keys has answered
    unsettled_load: int | None = None  # load id handed to the workers whose outcome is not reported
    # That load runs on the load lane while vLLM holds the request in WAITING_FOR_REMOTE_KVS: vLLM
    # itself keeps the blocks until the load is reported, and none of them may be saved before then.
    loading_async: bool = False
    load: LoadPlan | None = None  # planned at allocation, handed to the workers by the next build
    # Set once vLLM reported the request finished while saves were unsettled: its blocks are held.
    finished_at: float | None = None
    finished_blocks: tuple[list[int], ...] = ()  # per KV cache group
    finished_tokens: int = 0
    # The first chunk a sliding window moved past before it was stored (vLLM freed its blocks), or the
    # first that read a block another request's load failed to fill: neither it nor (the pool keeps
    # prefixes) any later chunk can be stored from this request.
    unsavable_from: int | None = None
    block_ids: tuple[list[int], ...] = ()  # per KV cache group, as last scheduled

    def never_save_from(self, chunk: int) -> None:
        self.unsavable_from = chunk if self.unsavable_from is None else min(self.unsavable_from, chunk)

    def follow_prompt(self) -> None:
        """Keep keys and chunk states in step with the prompt, which streaming input can grow."""
        changed = self.keys.update(self.request.block_hashes, self.request.num_prompt_tokens)
        del self.chunks[changed:]
        for chunk in [c for c in self.saving_since if c >= changed]:
            del self.saving_since[chunk]
        self.chunks += [Chunk.MISSING] * (len(self.keys) - len(self.chunks))

    def looked_up(self, local_tokens: int, chunks_hit: int) -> None:
        self.local_tokens, self.chunks_hit = local_tokens, chunks_hit
        for i in range(min(chunks_hit, len(self.chunks))):
            if self.chunks[i] is Chunk.MISSING:
                self.chunks[i] = Chunk.IN_POOL

    def load_failed(self, first_chunk: int) -> None:
        """The pool could not give chunks from ``first_chunk`` on: vLLM recomputes them, we re-save.

        They are never offered again: a load that failed whole sends the request back to vLLM's
        waiting queue, which asks again, and must then get a smaller answer or it would loop.
        """
        self.chunks_hit = min(self.chunks_hit, first_chunk)
        for i in range(first_chunk, len(self.chunks)):
            if self.chunks[i] is Chunk.IN_POOL:
                self.chunks[i] = Chunk.MISSING

    def saves_due(self, computed_tokens: int, step: float, chunk_tokens: int) -> list[int]:
        """Chunks fully computed by the end of this step that should go to the pool now.

        In prompt order, and only while the chunk before is stored, being stored, or due too: the
        pool refuses a chunk whose parent it does not hold, so offering it earlier would be wasted.
        """
        full = hits.full_chunks(min(computed_tokens, self.request.num_prompt_tokens), chunk_tokens)
        due: list[int] = []
        last = len(self.chunks) if self.unsavable_from is None else self.unsavable_from
        for i in range(min(full, len(self.chunks), last)):
            parent_ok = i == 0 or self.chunks[i - 1] is not Chunk.MISSING or (due and due[-1] == i - 1)
            if self.chunks[i] is Chunk.MISSING and parent_ok and self.retry_at.get(i, 0) <= step:
                due.append(i)
        return due

    def save_planned(self, chunks: list[int], now: float) -> None:
        for i in chunks:
            self.chunks[i] = Chunk.SAVING
            self.saving_since[i] = now

    def saves_reported(self, outcomes: dict[int, str], step: int) -> None:
        """The workers' report on chunks handed over for saving: chunk -> outcome."""
        if any(outcome in (RETRY, SKIPPED) for outcome in outcomes.values()):
            self.skips_in_a_row += 1  # one more step whose saves were skipped: the back-off doubles
        elif any(outcome in (STORED, PRESENT) for outcome in outcomes.values()):
            self.skips_in_a_row = 0
        for chunk, outcome in sorted(outcomes.items()):
            if chunk >= len(self.chunks) or self.saving_since.pop(chunk, None) is None:
                continue  # the prompt changed under it, or the report came twice
            self._save_done(chunk, outcome, step)

    def _save_done(self, chunk: int, outcome: str, step: int) -> None:
        if outcome in (STORED, PRESENT):
            self.chunks[chunk] = Chunk.IN_POOL
            self.retry_at.pop(chunk, None)
            return
        self.chunks[chunk] = Chunk.MISSING
        if outcome == TAINTED:
            self.retry_at.pop(chunk, None)  # due again once recomputed: "computed" decides, not time
        elif outcome == ORPHAN:
            # Its parent is not in the pool (evicted since the lookup, or its own save failed): the
            # chunk is due again as soon as the parent is stored; store the parent again if needed.
            self.retry_at.pop(chunk, None)
            if chunk and self.chunks[chunk - 1] is Chunk.IN_POOL:
                self.chunks[chunk - 1] = Chunk.MISSING
        else:
            doublings = min(max(self.skips_in_a_row - 1, 0), MAX_RETRY_BACKOFF_STEPS.bit_length())
            self.retry_at[chunk] = step + min(MAX_RETRY_BACKOFF_STEPS, 1 << doublings)

    def forget_unreported(self, now: float) -> None:
        for chunk, since in list(self.saving_since.items()):
            if now - since > UNREPORTED_AFTER_S:
                del self.saving_since[chunk]
                self.chunks[chunk] = Chunk.MISSING

    def stored_prefix(self) -> int:
        """Leading chunks that are in the pool or on their way there."""
        n = 0
        while n < len(self.chunks) and self.chunks[n] in (Chunk.IN_POOL, Chunk.SAVING):
            n += 1
        return n

    def saves_unsettled(self, chunk_tokens: int, *, retries: bool = True) -> bool:
        """Whether saves are in flight, or (``retries``) skipped ones are to be tried again."""
        if self.saving_since:
            return True
        return retries and bool(self.saves_due(self.finished_tokens, math.inf, chunk_tokens))


@dataclass(frozen=True)
class _PendingLoad:
    req_id: str
    block_ids: frozenset[int]
    first_chunk: int  # prompt index of the plan's first chunk
    since: float
    asynchronous: bool = False
    chunk_index: tuple[int, ...] = ()  # prompt index of each of the plan's chunks, by position
    chunk_blocks: tuple[frozenset[int], ...] = ()  # destination blocks of each of the plan's chunks

    def failed_chunk(self, position: int) -> int:
        """The prompt chunk at ``position`` of the plan, which a worker names as the first that failed."""
        return self.chunk_index[position] if position < len(self.chunk_index) else self.first_chunk + position

    def unfilled_blocks(self, position: int) -> frozenset[int]:
        """The blocks left unfilled when the chunk at ``position`` failed: its own and every later one's
        (the blocks of a plan that failed without chunks, all of them)."""
        if not self.chunk_blocks:
            return self.block_ids
        return frozenset().union(*self.chunk_blocks[position:])


class MaruScheduler:
    """The scheduler-side state; the facade forwards vLLM's scheduler calls here."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        cfg: MaruConnectorConfig,
        *,
        loads: bool,
        saves: bool,
        hit_rule: HitRule = hits.capped_hit_tokens,
    ) -> None:
        refuse_unsupported_parallelism(vllm_config)
        # Before the block-size checks: a Mamba model's huge state "block" would otherwise be blamed
        # on the chunk size. Refused here too, not only in the workers, so this half never promises
        # a hit it cannot keep, whatever order vLLM builds the halves in.
        refuse_unsupported_kv_cache(vllm_config, kv_cache_config)
        self.cfg = cfg
        self.loads_enabled = loads
        self.saves_enabled = saves
        self._hit_rule = hit_rule
        self.block_size = vllm_config.cache_config.block_size
        self.hash_block_size = getattr(kv_cache_config, "hash_block_size", None) or self.block_size
        cfg.check_block_size(self.block_size)
        cfg.check_block_size(self.hash_block_size)
        self.chunk_tokens = cfg.chunk_tokens
        self.blocks_per_chunk = cfg.chunk_tokens // self.block_size
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        # An MLA latent is the same on every TP rank: one key per chunk, stored by rank 0, loaded by all.
        # Every other cache holds each rank's own KV heads: one key per chunk and distinct head range,
        # loaded from the writer's ranges (maru_kv_writer_tp) when that engine's TP size is another.
        self.latent = is_latent_cache(kv_cache_config)
        total_heads = total_kv_heads(vllm_config, cfg.writer_tp, latent=self.latent)
        self.head_keys = head_keys(total_heads, self.tp_size, cfg.writer_tp)
        # Several KV cache groups (vLLM's hybrid manager: sliding-window layers beside full ones): a
        # chunk has keys per group and head range, group-major; each group is stored and loaded with
        # its own block table, a sliding-window group only where its window reaches (groups.py).
        self.groups = kv_groups(kv_cache_config)
        self._window_groups = any(g.window is not None for g in self.groups)
        # Per group, which of a chunk's keys it stores and loads; None where all of them, as they are
        # (one group at equal TP): no per-chunk selection.
        self._store_ix = [self._key_ix(self.head_keys.store, g) for g in range(len(self.groups))]
        self._load_ix = [self._key_ix(self.head_keys.load, g) for g in range(len(self.groups))]
        self._lookup_ix = (
            self._load_ix[0] if len(self.groups) == 1 else tuple(i for ix in self._load_ix for i in ix or ())
        )
        self.key_ranks = len(self.head_keys.load) * len(self.groups)  # keys a lookup reads per chunk
        # With several groups vLLM takes a failed load only as a failed request (failed_recving, for a
        # request waiting for its asynchronous load), never as failed blocks: loads are asynchronous.
        # Under asynchronous scheduling a load inside the step that fails for a prefill ending in a step
        # already planned makes vLLM 0.32's recovery feed a placeholder token to the model, and the engine
        # dies: loads are asynchronous there too.
        async_scheduling = bool(vllm_config.scheduler_config.async_scheduling)
        self.load_async = cfg.load_async or len(self.groups) > 1 or async_scheduling
        if not cfg.load_async and async_scheduling:
            common.log.warning(
                "maru_load_async: false is not followed: vLLM schedules asynchronously, and a load inside the "
                "step that fails can stop the engine; loads run asynchronously (set maru_load_async: true, or "
                "run vLLM with --no-async-scheduling to load inside the step)"
            )
        self.fingerprints: list[bytes] | None = None
        self._states: dict[str, RequestState] = {}  # req_id -> state, from first sight to finish
        self._pending_loads: dict[int, _PendingLoad] = {}  # load_id -> handed to workers, not reported yet
        self._abandoned: dict[str, tuple[int, ...]] = {}  # req_id -> blocks to report failed next step
        # loader's req_id -> blocks its failed load left unfilled, until that request is gone (it recomputes
        # them; see _quarantine)
        self._unfilled: dict[str, frozenset[int]] = {}
        self._free_now: set[str] = set()  # req_id -> finished, saves settled: workers release it next step
        # The workers' last word on saves was "skipped, the pool is unreachable": finished requests are
        # then not held for retries, which would only keep blocks from vLLM while the pool is away.
        self._pool_down = False
        self._next_load_id = 1
        self._step = 0
        self.stats = common.Counters()
        self.guard = common.PoolGuard(cfg, "scheduler", self.stats)
        self.lookups = None
        if loads:
            # Handoff waits block in the daemon, so they get a connection of their own.
            waits = common.PoolGuard(cfg, "scheduler-handoffs", self.stats)
            # A consumer is the decode of a P/D pair; an engine that also stores reads like a prefill.
            reader = Reader("prefill" if saves else "decode", chunk_tokens=self.chunk_tokens, ranks=self.key_ranks)
            self.lookups = AsyncLookups(self.guard, self.stats, tp_size=self.key_ranks, wait_guard=waits, reader=reader)
        self._handoff_log = common.RateLimitedLog()

        hash_algo = vllm_config.cache_config.prefix_caching_hash_algo
        self._ns_base = dict(
            engine_identity(vllm_config),
            block_size=self.block_size,
            chunk_tokens=self.chunk_tokens,
            salt=cfg.cache_namespace,
            hash_algo=hash_algo,
        )
        # Weights whose next version would get the same keys are refused like unshared hashes.
        self.disabled_reason = block_hash_sharing_problem(hash_algo, os.environ) or remote_weights_problem(
            self._ns_base["weights"], self._ns_base["revision"], cfg.cache_namespace
        )
        if self.disabled_reason:
            # Refuse rather than fall back to a private hash chain: vLLM's block hashes carry the
            # request's cache_salt, LoRA and multimodal inputs, which a re-hash of token ids would
            # silently drop. One clear line; the engine keeps serving without the pool.
            common.log.error("maru connector disabled: %s", self.disabled_reason)

    # ------------------------------------------------------------------ readiness

    def set_worker_info(self, infos: dict[int, MaruWorkerInfo]) -> None:
        """Receive every worker's handshake (its KV cache's format) once, before any request."""
        seen = {
            (info.kv_format, info.block_bytes, info.num_layers, info.kv_layers)
            for info in infos.values()
            if isinstance(info, MaruWorkerInfo)
        }
        ranks = sorted(infos)
        if len(seen) != 1 or ranks != list(range(self.tp_size)):
            common.log.error(
                "maru connector disabled: workers reported KV caches %s for TP ranks %s "
                "(want one format on ranks 0..%d)",
                sorted(seen),
                ranks,
                self.tp_size - 1,
            )
            self.fingerprints = None
            return
        kv_format, block_bytes, num_layers, kv_layers = seen.pop()
        self.namespace = Namespace(
            **self._ns_base,
            kv_format=kv_format,
            kv_layers=kv_layers,
            num_layers=num_layers,
            kv_heads=self.head_keys.labels[0],
        )
        self.fingerprints = [
            self.namespace.for_group(group.label).for_heads(label).fingerprint()
            for group in self.groups
            for label in self.head_keys.labels
        ]
        common.log.info(
            "maru connector ready: pool %s, chunk %d tokens (%d blocks, %d bytes per rank), KV %s, "
            "%d layers, TP %d (%s), weights %s, loads %s, saves %s",
            self.cfg.pool_url,
            self.chunk_tokens,
            self.blocks_per_chunk,
            block_bytes * num_layers * self.blocks_per_chunk,
            kv_format,
            num_layers,
            self.tp_size,
            "one MLA latent, stored by rank 0, loaded by every rank"
            if self.latent
            else f"stores KV heads {', '.join(self._labels(self.head_keys.store))}, "
            f"loads {', '.join(self._labels(self.head_keys.load))}",
            self.namespace.weights,
            self.loads_enabled,
            self.saves_enabled,
        )

    def _key_ix(self, heads: tuple[int, ...], group: int) -> tuple[int, ...] | None:
        """The positions in a chunk's keys of ``heads``' keys for KV cache group ``group``."""
        every = len(self.head_keys.labels)
        if len(self.groups) == 1:
            return None if heads == tuple(range(every)) else heads
        return tuple(group * every + h for h in heads)

    def _labels(self, ix: tuple[int, ...]) -> list[str]:
        return [self.head_keys.labels[i] for i in ix]

    @property
    def active(self) -> bool:
        return self.fingerprints is not None and not self.disabled_reason

    def retire(self, reason: str) -> None:
        """Stop using the pool for the rest of this engine's life: no lookups, loads or saves are planned."""
        if not self.disabled_reason:
            self.disabled_reason = reason
            common.log.warning("maru connector disabled: %s", reason)

    # ------------------------------------------------------------------ vLLM scheduler hooks

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` the workers will load, capped (see ``hits``).

        Called by the scheduler whenever it considers a waiting request. The first call queues the
        request's lookup and answers ``None`` ("ask again"), as do the calls while it is pending;
        the answer is kept for the request's life, so the pool is asked once per prompt. Loads are
        asynchronous (``True``) unless ``maru_load_async`` is off.
        """
        if not (self.loads_enabled and self.active) or self.lookups is None:
            return 0, False
        state = self._state(request)
        prompt_len = request.num_prompt_tokens
        best = self._hit_rule(
            chunks_hit=len(state.keys),
            chunk_tokens=self.chunk_tokens,
            prompt_len=prompt_len,
            block_size=self.block_size,
            num_computed_tokens=num_computed_tokens,
        )
        if best <= 0:
            return 0, False  # the engine already holds all the pool could give
        if state.looked_up_keys != len(state.keys):
            self.stats.count(common.LOOKUPS)
            state.looked_up_keys, state.answered = len(state.keys), False
            self.lookups.submit(
                request.request_id,
                state.keys.lookup_order(ranks=self._lookup_ix),
                expect=self._handoff_expected(request, state),
                wait_s=self.cfg.handoff_wait_ms / 1000,
            )
        if not state.answered:
            chunks_hit = self.lookups.result(request.request_id)
            if chunks_hit is None:
                return None, False
            state.answered = True
            self.lookups.forget(request.request_id)
            state.looked_up(num_computed_tokens, chunks_hit)
            self.stats.count(common.LOOKUP_CHUNKS_HIT, chunks_hit)
        state.local_tokens = num_computed_tokens
        if state.unsettled_load is not None:
            # Asked again before its last load was reported: that load cannot have succeeded (vLLM
            # asks again only after a load that left nothing); recompute rather than risk a loop.
            return 0, False
        hit = self._hit_rule(
            chunks_hit=state.chunks_hit,
            chunk_tokens=self.chunk_tokens,
            prompt_len=prompt_len,
            block_size=self.block_size,
            num_computed_tokens=num_computed_tokens,
        )
        return hit, hit > 0 and self.load_async

    def may_load_async(self, request: Request) -> bool:
        """Whether :meth:`get_num_new_matched_tokens` may answer an asynchronous load for ``request``.

        vLLM 0.34 asks when the request enters the waiting queues, before any lookup, so this must not
        ask the pool: any prompt with a full chunk the capped rule could give counts, and one whose
        lookup already found nothing beyond what the engine holds does not. A false positive only makes
        other asynchronous loads wait for a running slot once.
        """
        if not (self.loads_enabled and self.active and self.load_async) or self.lookups is None:
            return False
        state = self._states.get(request.request_id)
        chunks = request.num_prompt_tokens // self.chunk_tokens  # the most a lookup could find
        if state is not None and state.answered:
            chunks = state.chunks_hit
        return (
            self._hit_rule(
                chunks_hit=chunks,
                chunk_tokens=self.chunk_tokens,
                prompt_len=request.num_prompt_tokens,
                block_size=self.block_size,
                num_computed_tokens=request.num_computed_tokens,
            )
            > 0
        )

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Plan the load of ``num_external_tokens`` into the blocks just allocated.

        Called once per scheduled request right after allocation (the request will run this
        step). Decides on ``num_external_tokens`` only, as the base class asks.
        """
        if not self.active:
            return
        state = self._state(request)
        if num_external_tokens <= 0:
            return
        block_ids = blocks.get_block_ids()
        start, end = state.local_tokens, state.local_tokens + num_external_tokens
        plan: list[ChunkLoad] = []
        for group, ids in zip(self.groups, block_ids, strict=True):
            for chunk, slots in load_slots(group, ids, start, end, self.block_size, self.chunk_tokens).items():
                keys = _pick(state.keys[chunk], self._load_ix[group.index])
                plan.append(ChunkLoad(keys=keys, slots=slots, group=group.index, index=chunk))
        # Prompt order: a failed chunk fails every one after it, in every group.
        plan.sort(key=lambda c: (c.index, c.group))
        first_chunk = plan[0].index if plan else start // self.chunk_tokens
        state.load = LoadPlan(
            load_id=self._new_load_id(), chunks=tuple(plan), first_chunk=first_chunk, asynchronous=self.load_async
        )
        self.stats.count(common.HIT_TOKENS, num_external_tokens)

    def abandon_load(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """``update_state_after_alloc`` failed after vLLM was promised ``num_external_tokens``.

        Have the workers report those blocks as failed next step, so vLLM recomputes them instead of
        reading whatever they hold. Kept free of the request state, which may be what is broken.
        """
        state = self._states.get(request.request_id)
        local = state.local_tokens if state is not None else 0
        end_block = -(-(local + num_external_tokens) // self.block_size)
        self._abandoned[request.request_id] = tuple(
            b for ids in blocks.get_block_ids() for b in ids[local // self.block_size : end_block] if b != NULL_BLOCK
        )
        if state is not None:
            state.load = None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MaruConnectorMetadata:
        """The step's loads (planned at allocation) and saves (chunks computed and not yet stored).

        Called once per step after scheduling. A chunk is saved once its last token is computed,
        whatever the chunked-prefill budget did to earlier steps, so saved bytes always match their
        key. Does not modify ``scheduler_output``.
        """
        self._step += 1
        meta = MaruConnectorMetadata()
        for req_id, fail_blocks in self._abandoned.items():
            meta.loads[req_id] = LoadPlan(
                load_id=self._new_load_id(), chunks=(), fail_blocks=fail_blocks, asynchronous=self.load_async
            )
            if req_id in self._states:
                self._states[req_id].unsettled_load = meta.loads[req_id].load_id
                self._states[req_id].loading_async = self.load_async
        self._abandoned = {}
        for req_id, state in self._states.items():
            if state.load is not None:
                meta.loads[req_id] = state.load
                state.unsettled_load, state.loading_async = state.load.load_id, state.load.asynchronous
                state.load = None
        now = time.monotonic()
        for req_id, plan in meta.loads.items():
            blocks = {d for chunk in plan.chunks for _, d in chunk.slots} | set(plan.fail_blocks)
            self._pending_loads[plan.load_id] = _PendingLoad(
                req_id,
                frozenset(blocks),
                plan.first_chunk,
                now,
                plan.asynchronous,
                tuple(c.index if c.index >= 0 else plan.first_chunk + i for i, c in enumerate(plan.chunks)),
                tuple(frozenset(d for _, d in chunk.slots) for chunk in plan.chunks),
            )
        meta.preempted = frozenset(getattr(scheduler_output, "preempted_req_ids", None) or ())
        if self._window_groups:
            # vLLM frees a sliding-window group's blocks behind the window as its request runs, at the
            # next step's scheduling: saves still reading them finish before this step writes KV.
            meta.window_frees = frozenset(r for r, st in self._states.items() if st.saving_since) - meta.preempted
        if self.saves_enabled and self.active:
            self._plan_saves(scheduler_output, meta, now)
        meta.free_now = frozenset(self._free_now)
        self._free_now = set()
        meta.settled_below = min(self._pending_loads, default=self._next_load_id)
        self._forget_unreported(now)
        return meta

    def fallback_meta(self) -> MaruConnectorMetadata:
        """``build_connector_meta`` failed: fail every load vLLM was promised this step, save nothing.

        Kept free of the request states, which may be what is broken.
        """
        meta = MaruConnectorMetadata()
        promised = dict(self._abandoned)
        for req_id, state in self._states.items():
            if state.load is not None:
                promised[req_id] = tuple(d for chunk in state.load.chunks for _, d in chunk.slots)
                state.load = None
        self._abandoned = {}
        for req_id, fail_blocks in promised.items():
            load_id = self._new_load_id()
            meta.loads[req_id] = LoadPlan(
                load_id=load_id, chunks=(), fail_blocks=fail_blocks, asynchronous=self.load_async
            )
            self._pending_loads[load_id] = _PendingLoad(
                req_id, frozenset(fail_blocks), 0, time.monotonic(), self.load_async
            )
        # Finished requests are released even when their saves cannot be planned: the workers keep
        # each one until their own lane is done with it.
        finished = {r for r, st in self._states.items() if st.finished_at is not None}
        meta.free_now = frozenset(self._free_now | finished)
        self._free_now = set()
        for req_id in finished:
            self.forget(req_id)
        meta.settled_below = min(self._pending_loads, default=self._next_load_id)
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Take the workers' report on a step: settle its loads, and its saves' outcomes."""
        report = getattr(output, "kv_connector_worker_meta", None)
        if not isinstance(report, MaruWorkerReport):
            return
        for load_id, failed in report.loads.items():
            pending = self._pending_loads.pop(load_id, None)
            state = self._states.get(pending.req_id) if pending is not None else None
            if state is None:
                continue
            if state.unsettled_load == load_id:
                state.unsettled_load, state.loading_async = None, False
            if failed >= 0:
                state.load_failed(pending.failed_chunk(failed))
                self._unfilled[pending.req_id] = self._unfilled.get(pending.req_id, frozenset()) | (
                    pending.unfilled_blocks(failed)
                )
                for req_id, other in self._states.items():
                    self._quarantine(req_id, other)
        outcomes = set(report.saves.values())
        if SKIPPED in outcomes:
            self._pool_down = True
        elif outcomes - {TAINTED}:
            self._pool_down = False
        by_request: dict[str, dict[int, str]] = {}
        for (req_id, chunk), outcome in report.saves.items():
            by_request.setdefault(req_id, {})[chunk] = outcome
        for req_id, outcomes in by_request.items():
            state = self._states.get(req_id)
            if state is not None:
                state.saves_reported(outcomes, self._step)

    def request_finished(
        self, request: Request, block_ids: list[int] | tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Whether to hold the request's blocks for its saves, and the handoff for its reader.

        Called once per finished (or aborted) request. Blocks are held (``True``) while any of its
        chunks is being saved or is due again after a skipped save: the save lane may still read
        them, and a retry needs them. The request is then released through ``free_now`` once those
        settle, or after :data:`FINISHED_RETRY_S`. The second value tells a reader (the router passes
        it to decode unchanged) how many leading chunks it may expect in the pool.

        Never held while its asynchronous load runs: vLLM then holds the blocks itself until the
        load is reported (``finished_recving``), frees them at that notice, and would fail on a
        second notice (``finished_sending``) for a request it no longer knows. Nothing is saved
        from blocks a load may still be writing.
        """
        state = self._states.get(request.request_id)
        if state is None:
            self.forget(request.request_id)
            return False, None
        state.follow_prompt()
        handoff = self._handoff(state)
        if self.lookups is not None:
            self.lookups.forget(request.request_id)
        if self.load_in_flight(request.request_id):
            self.forget(request.request_id)
            return False, handoff
        # Tokens whose forward has run: under asynchronous scheduling the next step's are counted
        # already, and their blocks hold nothing yet.
        computed = request.num_computed_tokens - (getattr(request, "num_in_flight_tokens", 0) or 0)
        state.finished_tokens = max(0, min(computed, request.num_prompt_tokens))
        if not (self.saves_enabled and self.active) or not self._worth_holding(state):
            self.forget(request.request_id)
            return False, handoff
        state.finished_at = time.monotonic()
        # One group's block ids (vLLM's request_finished), or every group's (request_finished_all_groups).
        state.finished_blocks = tuple(block_ids) if isinstance(block_ids, tuple) else (list(block_ids),)
        return True, handoff

    def load_in_flight(self, req_id: str) -> bool:
        """Whether an asynchronous load of ``req_id`` was handed to the workers and not reported yet."""
        state = self._states.get(req_id)
        if state is not None and state.unsettled_load is not None and state.loading_async:
            return True
        return any(p.req_id == req_id and p.asynchronous for p in self._pending_loads.values())

    def release_after_error(self, req_id: str) -> bool:
        """``request_finished`` raised: whether vLLM should hold the blocks (a save lane may read them).

        Not while an asynchronous load of the request runs: vLLM holds those blocks itself (see
        :meth:`request_finished`). Otherwise held, and released next step through ``free_now``.
        """
        if self.load_in_flight(req_id):
            self.forget(req_id)
            return False
        self.release(req_id)
        return True

    def has_pending_block_frees(self) -> bool:
        """Blocks of finished requests come back without preemption: only while their copies run.

        vLLM stops preempting while this is True, so a request merely waiting to retry a skipped save
        does not count: that wait can last :data:`FINISHED_RETRY_S`, many steps with no block freed.
        """
        return any(state.finished_at is not None and state.saving_since for state in self._states.values())

    def _worth_holding(self, state: RequestState) -> bool:
        """Whether a finished request keeps its blocks: copies run, or retries may still store them."""
        return state.saves_unsettled(self.chunk_tokens, retries=not self._pool_down)

    def forget(self, req_id: str) -> None:
        self._states.pop(req_id, None)
        self._abandoned.pop(req_id, None)
        self._unfilled.pop(req_id, None)
        if self.lookups is not None:
            self.lookups.forget(req_id)

    def shutdown(self) -> None:
        if self.lookups is not None:
            self.lookups.close()
        self.guard.close()

    # ------------------------------------------------------------------ internals

    def _quarantine(self, req_id: str, state: RequestState) -> None:
        """No chunk of ``state`` from the first one holding a block another request's failed load left unfilled.

        Such a block came to it through vLLM's prefix cache while the load ran (loads inside the step
        only: vLLM shares no block an asynchronous load is filling). vLLM recomputes the loading request,
        but may run this one over the block before that rewrote it, and does not recompute this one: what
        it computes from there on may be wrong, and must not reach the pool. The loading request's own
        chunks are stored again once it recomputed them.
        """
        for loader, unfilled in self._unfilled.items():
            if loader == req_id:
                continue
            for ids in state.block_ids:
                first = next((pos for pos, block in enumerate(ids) if block in unfilled), None)
                if first is not None:
                    state.never_save_from(first // self.blocks_per_chunk)

    def _plan_saves(self, scheduler_output: SchedulerOutput, meta: MaruConnectorMetadata, now: float) -> None:
        """Plan the saves of scheduled requests, and retries for finished ones still holding blocks."""
        block_state = scheduler_output.kv_connector_block_state
        # (req_id, tokens computed by this step, block ids per KV cache group)
        progress: list[tuple[str, int, tuple[list[int], ...]]] = []
        if block_state is not None:
            scheduled = [(r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
            cached = scheduler_output.scheduled_cached_reqs
            scheduled += list(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
            for req_id, computed_before in scheduled:
                if req_id in self._states:
                    computed = computed_before + scheduler_output.num_scheduled_tokens.get(req_id, 0)
                    ids = block_state.get_block_ids(req_id) or tuple([] for _ in self.groups)
                    progress.append((req_id, computed, tuple(ids)))
        for req_id, state in list(self._states.items()):
            if state.finished_at is None:
                continue
            if now - state.finished_at > FINISHED_RETRY_S or not self._worth_holding(state):
                self.release(req_id)
            elif not state.saving_since and not state.loading_async:
                # Never over blocks a load may still be writing (request_finished lets such a request go).
                progress.append((req_id, state.finished_tokens, state.finished_blocks))
        for req_id, computed, block_ids in progress:
            state = self._states[req_id]
            state.block_ids = block_ids
            self._quarantine(req_id, state)
            state.follow_prompt()
            due = state.saves_due(computed, self._step, self.chunk_tokens)
            if not due:
                continue
            chunks: list[ChunkSave] = []
            for i in due:
                # Every group's blocks of the chunk, each still the request's own: where a sliding window
                # moved past, vLLM freed them (its null block stands there) and the chunk can no longer be
                # stored from this request (nor, in prompt order, any after it).
                held = [held_blocks(ids, i, self.blocks_per_chunk, None) for ids in block_ids]
                if len(held) != len(self.groups) or any(ids is None for ids in held):
                    break  # no block table for it (never expected): try again next step
                if any(g.window is not None and NULL_BLOCK in ids for g, ids in zip(self.groups, held, strict=True)):
                    state.never_save_from(i)
                    break
                tokens = chunk_token_ids(state.request, i, self.chunk_tokens)
                for group, ids in zip(self.groups, held, strict=True):
                    ix = self._store_ix[group.index]
                    keys, parents = _pick(state.keys[i], ix), _pick(state.keys.parents(i), ix)
                    chunks.append(
                        ChunkSave(
                            index=i, keys=keys, parents=parents, block_ids=ids, token_ids=tokens, group=group.index
                        )
                    )
            if not chunks:
                continue
            planned = sorted({c.index for c in chunks})
            self.stats.count(common.SAVE_RETRIES, sum(1 for i in planned if i in state.retry_at))
            state.save_planned(planned, now)
            used = {b for ids in block_ids for b in ids[: (planned[-1] + 1) * self.blocks_per_chunk]}
            depends_on = tuple(lid for lid, load in self._pending_loads.items() if load.block_ids & used)
            meta.saves[req_id] = SavePlan(chunks=tuple(chunks), depends_on=depends_on)

    def release(self, req_id: str) -> None:
        """A finished request's saves are settled (or given up): its blocks go back next step."""
        self.forget(req_id)
        self._free_now.add(req_id)

    def _handoff(self, state: RequestState) -> dict[str, Any] | None:
        """What a producer tells the reader of its answer: leading chunks stored or being stored."""
        if not (self.saves_enabled and self.active):
            return None
        n = state.stored_prefix()
        if n <= 0:
            return None
        assert self.fingerprints is not None  # active
        algo = self._ns_base["hash_algo"]
        # What this engine stores: its own head ranges' keys (the first of them names the chunk).
        stored = tuple(self.fingerprints[i] for i in self.head_keys.store)
        scheme = KeyScheme(stored, self.hash_block_size, self.chunk_tokens, algo)
        last = state.keys[n - 1][self.head_keys.store[0]].hex()
        return {HANDOFF_CHUNKS: n, HANDOFF_LAST_KEY: last, HANDOFF_KEY_SCHEME: scheme.to_params()}

    def _handoff_expected(self, request: Request, state: RequestState) -> int:
        """Leading chunks a request's producer announced, if they are chunks of this prompt under our keys."""
        params = getattr(request, "kv_transfer_params", None)
        if not isinstance(params, dict):
            return 0
        n, last = params.get(HANDOFF_CHUNKS), params.get(HANDOFF_LAST_KEY)
        if not isinstance(n, int) or n <= 0 or not isinstance(last, str):
            return 0
        # The producer named its first head range's key: this engine's first range to load.
        if n > len(state.keys) or state.keys[n - 1][self.head_keys.load[0]].hex() != last:
            # Its producer keys this prompt differently (another model, chunk size or namespace): its
            # chunks will never show up under our keys, so waiting for them would only add latency.
            self._handoff_log.warning(
                "handoff-mismatch",
                "maru connector: request %s carries a handoff of %d chunk(s) under keys this engine does not "
                "use; not waiting for them (prefill and decode must share model, chunk size and cache namespace)",
                request.request_id,
                n,
            )
            return 0
        return n

    def track(self, request: Request) -> None:
        """Start following a request (vLLM's ``on_new_request``; any later hook would do too)."""
        if self.active:
            self._state(request)

    def _state(self, request: Request) -> RequestState:
        state = self._states.get(request.request_id)
        if state is None or state.request is not request:
            assert self.fingerprints is not None
            fingerprints = with_adapter(self.fingerprints, adapter_identity(getattr(request, "lora_request", None)))
            keys = PromptKeys(fingerprints, hash_block_size=self.hash_block_size, chunk_tokens=self.chunk_tokens)
            state = RequestState(request, keys)
            self._states[request.request_id] = state
        state.follow_prompt()
        return state

    def _new_load_id(self) -> int:
        load_id = self._next_load_id
        self._next_load_id += 1
        return load_id

    def _forget_unreported(self, now: float) -> None:
        for load_id, load in list(self._pending_loads.items()):
            if now - load.since > UNREPORTED_AFTER_S:
                del self._pending_loads[load_id]
        for state in self._states.values():
            state.forget_unreported(now)


def _pick(keys: tuple, ix: tuple[int, ...] | None) -> tuple:
    return keys if ix is None else tuple(keys[i] for i in ix)


def refuse_unsupported_parallelism(vllm_config: VllmConfig) -> None:
    """Context parallelism shards a block's tokens across ranks: keys and block tables would not match."""
    parallel = vllm_config.parallel_config
    for flag, attr in (
        ("--decode-context-parallel-size", "decode_context_parallel_size"),
        ("--prefill-context-parallel-size", "prefill_context_parallel_size"),
    ):
        size = getattr(parallel, attr, 1) or 1
        if size > 1:
            raise ConfigError(
                f"maru connector: {flag} {size} is not supported (context parallelism shards each KV block "
                f"across ranks); run without it, or without the Maru connector"
            )
