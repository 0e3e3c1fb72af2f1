"""Scheduler half of the Maru connector: decides what to load and what to store, moves no bytes.

Runs inside vLLM's scheduler (the engine core process). Every method here is on the scheduling
critical path, so the only pool traffic is one ``lookup_prefix`` round trip per new request; the
worker half does all copying.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from maru_connector import hits
from maru_connector.config import MaruConnectorConfig
from maru_connector.keys import Namespace, block_hash_sharing_problem, chunk_keys, interleave_ranks
from maru_connector.vllm import common
from maru_connector.vllm.metadata import ChunkLoad, ChunkSave, MaruConnectorMetadata, MaruWorkerInfo

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# hits.capped_hit_tokens, or (in one test) the uncapped rule it replaces; keyword arguments only.
HitRule = Callable[..., int]


@dataclass
class _Tracked:
    """What the scheduler half remembers about one live request."""

    request: Request
    # Per prompt chunk, one key per TP rank; computed once, on first use.
    keys: list[tuple[bytes, ...]] | None = None
    # Chunks [0, handled) are in the pool already or were handed to the worker to store.
    handled: int = 0
    # From the last lookup: local tokens the engine held then, and pool chunks hit.
    local_tokens: int = 0
    chunks_hit: int = 0


class MaruScheduler:
    """The scheduler-side state machine; the facade forwards vLLM's scheduler calls here."""

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
        self._fingerprints: list[bytes] | None = None
        self._tracked: dict[str, _Tracked] = {}  # req_id -> state, from first sight to finish
        self._loads: dict[str, list[ChunkLoad]] = {}  # req_id -> load plan for the next step
        self.stats = common.Counters()
        self.guard = common.PoolGuard(cfg, "scheduler", self.stats)

        model = vllm_config.model_config
        hash_algo = vllm_config.cache_config.prefix_caching_hash_algo
        self._ns_base = dict(
            model=str(model.model),
            revision=str(model.revision or ""),
            dtype=f"{model.dtype}/{vllm_config.cache_config.cache_dtype}",
            block_size=self.block_size,
            chunk_tokens=self.chunk_tokens,
            num_layers=model.get_num_layers(vllm_config.parallel_config),
            tp_size=self.tp_size,
            salt=cfg.cache_namespace,
            hash_algo=hash_algo,
        )
        self.disabled_reason = block_hash_sharing_problem(hash_algo, os.environ)
        if self.disabled_reason:
            # Refuse rather than fall back to a private hash chain: vLLM's block hashes carry the
            # request's cache_salt, LoRA and multimodal inputs, which a re-hash of token ids would
            # silently drop. One clear line; the engine keeps serving without the pool.
            common.log.error("maru connector disabled: %s", self.disabled_reason)

    # ------------------------------------------------------------------ readiness

    def set_worker_info(self, infos: dict[int, MaruWorkerInfo]) -> None:
        """Receive every worker's handshake (KV layout per TP rank) once, before any request."""
        layouts = {info.kv_layout for info in infos.values() if isinstance(info, MaruWorkerInfo)}
        ranks = sorted(infos)
        if len(layouts) != 1 or ranks != list(range(self.tp_size)):
            common.log.error(
                "maru connector disabled: workers reported layouts %s for TP ranks %s (want one layout, ranks 0..%d)",
                sorted(layouts),
                ranks,
                self.tp_size - 1,
            )
            self._fingerprints = None
            return
        layout = layouts.pop()
        self._fingerprints = [
            Namespace(**self._ns_base, kv_layout=layout, tp_rank=r).fingerprint() for r in range(self.tp_size)
        ]
        common.log.info(
            "maru connector ready: pool %s, chunk %d tokens (%d blocks), layout %s, TP %d, loads %s, saves %s",
            self.cfg.pool_url,
            self.chunk_tokens,
            self.blocks_per_chunk,
            layout,
            self.tp_size,
            self.loads_enabled,
            self.saves_enabled,
        )

    @property
    def active(self) -> bool:
        return self._fingerprints is not None and not self.disabled_reason

    # ------------------------------------------------------------------ vLLM scheduler hooks

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` the worker will load, capped (see ``hits``).

        Called by the scheduler when it considers a waiting request, possibly several times if the
        request does not fit yet. One pool round trip; a pool failure is a miss. Never async.
        """
        tracked = self._track(request)
        if not (self.loads_enabled and self.active):
            return 0, False
        prompt_len = request.num_prompt_tokens
        keys = self._keys(tracked)
        best = self._hit_rule(
            chunks_hit=len(keys),
            chunk_tokens=self.chunk_tokens,
            prompt_len=prompt_len,
            block_size=self.block_size,
            num_computed_tokens=num_computed_tokens,
        )
        if best <= 0:
            return 0, False  # the engine already holds all the pool could give
        self.stats.count(common.LOOKUPS)
        ok, n = self.guard.call(
            "lookup", lambda c, ks: c.lookup_prefix(ks), interleave_ranks(list(zip(*keys, strict=True)))
        )
        chunks_hit = (n or 0) // self.tp_size if ok else 0
        tracked.local_tokens = num_computed_tokens
        tracked.chunks_hit = chunks_hit
        ext = self._hit_rule(
            chunks_hit=chunks_hit,
            chunk_tokens=self.chunk_tokens,
            prompt_len=prompt_len,
            block_size=self.block_size,
            num_computed_tokens=num_computed_tokens,
        )
        self.stats.count(common.LOOKUP_CHUNKS_HIT, chunks_hit)
        return ext, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Plan the load of ``num_external_tokens`` into the blocks just allocated.

        Called once per scheduled request right after allocation (the request will run this
        step). Decides on ``num_external_tokens`` only, as the base class asks.
        """
        tracked = self._track(request)
        if not self.active:
            return
        # Chunks the pool already holds need no store, whether or not they are loaded.
        tracked.handled = max(tracked.handled, tracked.chunks_hit)
        if num_external_tokens <= 0:
            return
        block_ids = blocks.get_block_ids()[0]
        start, end = tracked.local_tokens, tracked.local_tokens + num_external_tokens
        first_block, end_block = start // self.block_size, end // self.block_size
        keys = self._keys(tracked)
        plan: list[ChunkLoad] = []
        for chunk in range(first_block // self.blocks_per_chunk, -(-end_block // self.blocks_per_chunk)):
            base = chunk * self.blocks_per_chunk
            slots = tuple(
                (j, block_ids[base + j]) for j in range(self.blocks_per_chunk) if first_block <= base + j < end_block
            )
            plan.append(ChunkLoad(keys=keys[chunk], slots=slots))
        self._loads[request.request_id] = plan
        self.stats.count(common.HIT_TOKENS, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MaruConnectorMetadata:
        """The step's loads (planned at allocation) and saves (chunks this step completes).

        Called once per step after scheduling. A chunk is saved in the step whose forward computes
        its last token, whatever the chunked-prefill budget did to earlier steps, so saved bytes
        always match their key. Does not modify ``scheduler_output``.
        """
        meta = MaruConnectorMetadata(loads=self._loads)
        self._loads = {}
        if not (self.saves_enabled and self.active):
            return meta
        block_state = scheduler_output.kv_connector_block_state
        progress: list[tuple[str, int]] = [
            (r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs
        ]
        cached = scheduler_output.scheduled_cached_reqs
        progress += list(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id, computed_before in progress:
            tracked = self._tracked.get(req_id)
            if tracked is None or block_state is None:
                continue
            done = computed_before + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            full = hits.full_chunks(min(done, tracked.request.num_prompt_tokens), self.chunk_tokens)
            if full <= tracked.handled:
                continue
            block_ids = (block_state.get_block_ids(req_id) or ([],))[0]
            keys = self._keys(tracked)
            saves = []
            for chunk in range(tracked.handled, full):
                ids = block_ids[chunk * self.blocks_per_chunk : (chunk + 1) * self.blocks_per_chunk]
                if len(ids) < self.blocks_per_chunk:
                    break  # no block table for it (never expected): try again next step
                saves.append(ChunkSave(keys=keys[chunk], block_ids=tuple(ids)))
            tracked.handled += len(saves)
            if saves:
                meta.saves[req_id] = saves
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request. Returns ``(False, None)``: its blocks may be freed now.

        Every chunk was saved synchronously inside the step that computed it (the worker commits
        before the step's output reaches the scheduler), so by the time vLLM reports the request
        finished its KV is already committed and nothing still reads its blocks.
        """
        self._tracked.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        return False, None

    def shutdown(self) -> None:
        self.guard.close()

    # ------------------------------------------------------------------ internals

    def _track(self, request: Request) -> _Tracked:
        tracked = self._tracked.get(request.request_id)
        if tracked is None or tracked.request is not request:
            tracked = _Tracked(request)
            self._tracked[request.request_id] = tracked
        return tracked

    def _keys(self, tracked: _Tracked) -> list[tuple[bytes, ...]]:
        if tracked.keys is None:
            assert self._fingerprints is not None
            hashes = tracked.request.block_hashes
            per_rank = [
                chunk_keys(
                    hashes,
                    hash_block_size=self.hash_block_size,
                    chunk_tokens=self.chunk_tokens,
                    fingerprint=fp,
                    max_tokens=tracked.request.num_prompt_tokens,
                )
                for fp in self._fingerprints
            ]
            tracked.keys = list(zip(*per_rank, strict=True))
        return tracked.keys
