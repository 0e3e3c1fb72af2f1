"""The Maru KV connector for vLLM 0.32, 0.33 and 0.34 (``KVConnectorBase_V1``; ``supported.py``).

Load it with the ``--kv-transfer-config`` that ``maru_contracts.config.kv_transfer_config`` builds::

    {"kv_connector": "MaruConnector", "kv_connector_module_path": "maru_connector.vllm",
     "kv_role": "kv_producer" | "kv_consumer" | "kv_both", "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"maru_pool_url": "unix:///run/maru/pool.sock", ...}}

vLLM builds this class twice: once in the scheduler (role SCHEDULER) and once in every model
worker (role WORKER). The facade builds only the half its role needs (``scheduler.py`` or
``worker.py``) and forwards to it; what the scheduler half decides each step travels to the
workers as one ``metadata.MaruConnectorMetadata``, and what became of it comes back as one
``metadata.MaruWorkerReport``.

Roles: ``kv_producer`` stores prompt chunks, ``kv_consumer`` (decode) loads them, ``kv_both``
(prefill, by default: the pool is one prefix cache for the whole fleet) does both. Lookups, loads
and saves all run off the engine's thread (``lookups.py``, ``lane.py``), so a slow or hung pool
never stalls a step. Pool trouble of any kind degrades to misses and skipped stores, and so does
a bug: every hook catches what its half raises, logs it (rate-limited), and degrades for that step
(a load is reported failed so vLLM recomputes it; a save is skipped), because an exception that
reaches vLLM kills its engine. Only a configuration the connector cannot serve is refused, at start.
"""

from __future__ import annotations

from maru_connector.vllm import supported  # noqa: F401  # first: refuses an unsupported vLLM before its modules load

# isort: split
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from maru_connector.vllm import common
from maru_connector.vllm.common import counters, reset_counters
from maru_connector.vllm.metadata import MaruConnectorMetadata, MaruWorkerInfo
from maru_connector.vllm.scheduler import MaruScheduler
from maru_connector.vllm.stats import MaruConnectorStats, MaruPromMetrics
from maru_connector.vllm.worker import MaruWorker
from maru_contracts import hits
from maru_contracts.config import MaruConnectorConfig

if TYPE_CHECKING:
    import torch
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["HOOKS", "MaruConnector", "MaruConnectorMetadata", "counters", "reset_counters"]

# Every hook of KVConnectorBase_V1 (0.32, and the ones 0.33 and 0.34 add), and why the connector answers it
# the way it does. A test fails when vLLM's base class grows a hook that is not listed here.
HOOKS: dict[str, str] = {
    # ---- implemented here
    "register_kv_caches": "implemented: recognise the KV cache's pages; refuse what cannot be copied",
    "get_handshake_metadata": "implemented: the worker's KV format, which goes into every key",
    "set_xfer_handshake_metadata": "implemented: the scheduler waits for the workers' KV format",
    "start_load_kv": "implemented: hand the step's loads to the load lane (or run them, when synchronous)",
    "wait_for_layer_load": "implemented: nothing to wait for, a request computes only once its load is done",
    "save_kv_layer": "implemented: nothing per layer; saves copy every layer on the save lane",
    "wait_for_save": "implemented: hand the step's completed chunks to the save lane",
    "handle_preemptions": "implemented: finish saves reading preempted requests' blocks before reuse",
    "get_finished": "implemented: loads done (finished_recving), finished requests released (finished_sending)",
    "has_pending_block_frees": "implemented: finished requests hold blocks only until their saves settle",
    "get_block_ids_with_load_errors": "implemented: blocks whose load failed, so vLLM recomputes them",
    "build_connector_worker_meta": "implemented: what became of each load and save, for the scheduler",
    "get_kv_connector_stats": "implemented: counters for vLLM's log line and /metrics",
    "build_kv_connector_stats": "implemented: our stats class",
    "build_prom_metrics": "implemented: one Prometheus counter per connector counter",
    "shutdown": "implemented: close the pool connection",
    "on_new_request": "implemented: start following the request",
    "get_num_new_matched_tokens": "implemented: one pool lookup, capped hit",
    "update_state_after_alloc": "implemented: plan the load into the blocks just allocated",
    "build_connector_meta": "implemented: the step's loads and saves",
    "update_connector_output": "implemented: settle loads, retry skipped saves, roll back tainted ones",
    "request_finished": "implemented: hold blocks while saves settle; tell decode what prefill stored",
    # SupportsHMA's one hook: vLLM calls it instead of request_finished, with every group's blocks.
    "request_finished_all_groups": "implemented: request_finished with every KV cache group's blocks",
    "requires_kv_delivery": "implemented: False, a best-effort cache: a dropped save is a later miss",
    "reset_cache": "implemented: vLLM resets caches when it sleeps or updates weights; the shared pool is "
    "never cleared, but this engine's keys may no longer name its weights: it stops using the pool until restart",
    # vLLM 0.33: a classmethod taking the kv_transfer_config; 0.32 never calls it.
    "supports_sleep_mode": "implemented (vLLM 0.33, 0.34): True, sleeping is safe: the connector lets go of the "
    "KV cache and, once awake, stays off the pool (the weights may have been reloaded)",
    "unregister_kv_caches": "implemented (vLLM 0.33, 0.34): stop touching the KV cache while it sleeps, or while "
    "0.34's extensible cache lends its memory to a weight update",
    "restore_kv_caches": "implemented (vLLM 0.33, 0.34): stay off the pool until restart, the weights may be new",
    "may_load_async": "implemented (vLLM 0.34): True for a prompt the pool could serve, so with "
    "--max-num-inflight-kv-loads its load starts while the running batch is full, within that cap",
    "supports_lookahead_block_hashes": "implemented (vLLM 0.34): False, keys are built on plain block hashes; "
    "with EAGLE block drop vLLM then hashes without lookahead",
    "kv_cache_access": "implemented (vLLM 0.34): IN_PROCESS, chunks are copied by this process from the mapped "
    "cache, so any allocation of the extensible KV cache works",
    # ---- vLLM's default is right for this connector
    "role": "base: set by the constructor",
    "bind_connector_metadata": "base: stores the step's metadata",
    "clear_connector_metadata": "base: drops it after the step",
    "has_connector_metadata": "base",
    "get_mem_pool_context": "base: the engine's own allocator; the pool is mapped, not allocated",
    "set_host_xfer_buffer_ops": "base: no host transfer buffer, copies go straight to the mapping",
    "finish_forward": "base: nothing runs after the forward but wait_for_save",
    "reset_capture_state": "base: nothing is captured in CUDA graphs",
    "get_transfer_results": "implemented: get_finished, and failed loads per request with several KV cache groups",
    "get_finished_count": "base: every worker reports every request it finished",
    "get_kv_connector_kv_cache_events": "base: the pool emits no KV events",
    "bind_kv_cache_manager": "base: the block pool is not needed",
    "bind_gpu_block_pool": "base: the block pool is not needed",
    "get_loaded_kv_cache_group_ids": "base: every prefix-cacheable group, each loaded from its own chunks",
    "get_external_cache_hit_sources": "base, with _cache_hit_source = HOST (shared host or CXL memory)",
    "register_finished_partial_tail": "base: partial tails are never stored",
    "take_events": "base: no KV events",
    "has_pending_push_work": "base: no push transfers",
    "get_required_kvcache_layout": "base: None, every layout vLLM 0.32 resolves is copied as it is",
    "requires_piecewise_for_cudagraph": "base: no layer-by-layer work inside the graph",
    "set_xfer_handshake_metadata_pp_aware": "base: refuses pipeline-parallel ranks, which are not supported",
    "supports_divergent_local_hybrid_hits": "base: False, no recurrent state to restore (Mamba is refused)",
}


class MaruConnector(KVConnectorBase_V1, SupportsHMA):
    """Stores prompt KV in the shared pool and loads it back on a (capped) hit.

    ``SupportsHMA``: vLLM keeps its hybrid KV cache manager on, so a model with sliding-window layers
    (Gemma 3, gpt-oss) keeps only their windows in memory; each KV cache group is stored and loaded
    under its own keys, with its own block table (``groups.py``)."""

    _cache_hit_source = CacheHitSource.HOST

    # Test seam: the uncapped rule reproduces the engine crash the cap prevents.
    hit_rule = staticmethod(hits.capped_hit_tokens)

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        self.cfg = MaruConnectorConfig.from_extra_config(tc.kv_connector_extra_config)
        loads, saves = tc.kv_role in ("kv_consumer", "kv_both"), tc.kv_role in ("kv_producer", "kv_both")
        self._scheduler: MaruScheduler | None = None
        self._worker: MaruWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = MaruScheduler(
                vllm_config,
                kv_cache_config,
                self.cfg,
                loads=loads,
                saves=saves,
                hit_rule=type(self).hit_rule,
            )
            if loads and tc.kv_load_failure_policy != "recompute":
                common.log.warning(
                    "maru connector: kv_load_failure_policy is %r; a chunk that fails its checksum will fail "
                    'its request instead of being recomputed (set "kv_load_failure_policy": "recompute")',
                    tc.kv_load_failure_policy,
                )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tp_group

            self._worker = MaruWorker(
                vllm_config,
                kv_cache_config,
                self.cfg,
                loads=loads,
                saves=saves,
                tp_rank=get_tensor_model_parallel_rank(),
                tp_group=get_tp_group(),
            )
        half = self._scheduler or self._worker
        self._stats = half.stats if half is not None else common.Counters()
        common.shorten_switch_interval()
        self._hook_log = common.RateLimitedLog()

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a save lost to a preemption is a later miss, not a broken handoff.
        return False

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig | None = None) -> bool:
        """vLLM 0.33+ asks ``supports_sleep_mode(kv_transfer_config)`` when ``--enable-sleep-mode`` is set.

        Sleeping is safe: the connector lets go of the KV cache, and after waking it stays off the pool
        until restart, because sleep is mostly used to reload weights (RL) and the chunk keys name the
        weights the engine started with (see :meth:`restore_kv_caches`)."""
        return True

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: KVTransferConfig | None = None) -> bool:
        """vLLM 0.34: keys are chained from vLLM's plain block hashes; lookahead hashing stays off."""
        return False

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: KVTransferConfig | None = None) -> Any:
        """vLLM 0.34: the workers copy chunks in this process (never register or export the cache)."""
        from vllm.config.kv_transfer import KVCacheAccess  # vLLM 0.34+; 0.32 and 0.33 never call this

        return KVCacheAccess.IN_PROCESS

    def _failed(self, hook: str, err: BaseException, degraded: str) -> None:
        common.hook_failed(self._stats, self._hook_log, hook, err, degraded)

    # ============================================================== worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Worker, once at start: learn the KV cache's pages; raises on a cache it cannot copy."""
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        """Worker (vLLM 0.33), before the KV cache sleeps: stop touching it; loads and saves degrade."""
        if self._worker is not None:
            try:
                self._worker.unregister_kv_caches()
            except Exception as err:
                self._failed("unregister_kv_caches", err, "the pool stays unused until the next restart")

    def restore_kv_caches(self) -> None:
        """Worker (vLLM 0.33), after wake-up: the weights may have been reloaded while the engine slept,
        and the keys name the ones it started with, so the worker stays off the pool until restart."""
        if self._worker is not None:
            try:
                self._worker.restore_kv_caches()
            except Exception as err:
                self._failed("restore_kv_caches", err, "the pool stays unused until the next restart")

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """Worker, once after ``register_kv_caches``: the KV format and rank the scheduler keys with."""
        if self._worker is None:
            return None
        try:
            return self._worker.handshake()
        except Exception as err:
            # A rank that reports nothing makes the scheduler half refuse the handshake: no keys at all.
            self._failed("get_handshake_metadata", err, "this rank reports no KV format and the connector stays off")
            return None

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Worker, at the start of a step, before anything writes KV: saves still reading the blocks
        of requests preempted by this step's scheduling finish first (vLLM may hand the blocks on)."""
        if self._worker is None or not isinstance(kv_connector_metadata, MaruConnectorMetadata):
            return
        try:
            self._worker.handle_preemptions(kv_connector_metadata)
        except Exception as err:
            self._failed("handle_preemptions", err, "waiting for every save in flight instead")
            self._worker.wait_idle()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Worker, every step with loads: hand asynchronous loads to the load lane, run the others.

        vLLM calls it before the forward when the step has synchronous loads, else after the forward
        is launched. Touches only the blocks the scheduler planned; failures are reported through
        :meth:`get_block_ids_with_load_errors`, never raised.
        """
        meta = self._meta()
        if meta is None or self._worker is None or not meta.loads:
            return
        try:
            self._worker.load(meta)
        except Exception as err:
            self._failed("start_load_kv", err, "the step's loads are reported failed and vLLM recomputes them")
            try:
                self._worker.fail_loads(meta)
            except Exception as again:
                self._failed("start_load_kv (failing the loads)", again, "some loaded blocks may be unusable")

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Worker, per attention layer: nothing to wait for, a request computes only once loaded."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        """Worker, per attention layer: nothing; saves copy all layers at once on the save lane."""

    def wait_for_save(self) -> None:
        """Worker, once per step after the forward: hand the chunks this step completed to the save lane.

        Returns at once. The chunks' blocks stay valid until their copy is done (see ``worker``); a
        decode that needs them right after prefill answers waits for them in its own lookup.
        """
        meta = self._meta()
        if meta is None or self._worker is None or not meta.saves:
            return
        try:
            self._worker.save(meta)
        except Exception as err:
            self._failed("wait_for_save", err, "the step's unfinished saves are skipped and retried later")
            try:
                self._worker.skip_saves(meta)
            except Exception as again:
                self._failed("wait_for_save (skipping)", again, "some saves are not retried")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Worker, once per step after ``wait_for_save``: ``(requests released, requests loaded)``.

        Released: finished requests whose saves the scheduler half has settled (``free_now``) and
        this worker's save lane is done with; vLLM frees their blocks. Loaded: requests whose
        asynchronous load finished, loaded or not (failed blocks go out in the same step through
        :meth:`get_block_ids_with_load_errors`).
        """
        if self._worker is None:
            return None, None
        try:
            freed, loaded = self._worker.finished(self._meta())
        except Exception as err:
            self._failed("get_finished", err, "finished loads are reported, releases wait for the next step")
            try:
                return None, self._worker.finished_degraded() or None
            except Exception as again:
                self._failed("get_finished (degraded)", again, "finished loads are reported on a later step")
                return None, None
        return freed or None, loaded or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """Worker, once per step: :meth:`get_finished`, and with several KV cache groups the requests whose
        load failed (vLLM recomputes their prompts; it takes no failed blocks from several groups)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        sending, recving = self.get_finished(finished_req_ids)
        failed = self._worker.take_failed_recving() if self._worker is not None else set()
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()), finished_recving=set(recving or ()) | failed, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Worker, once per step after ``wait_for_save``: blocks whose load failed this step."""
        if self._worker is None:
            return set()
        try:
            return self._worker.take_invalid_blocks()
        except Exception as err:
            self._failed("get_block_ids_with_load_errors", err, "failed blocks are reported directly")
            out, self._worker.invalid_blocks = set(self._worker.invalid_blocks), set()
            return out

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """Worker, once per step: what became of the step's loads and saves, for the scheduler half."""
        if self._worker is None:
            return None
        try:
            return self._worker.report()
        except Exception as err:
            self._failed("build_connector_worker_meta", err, "the step's outcomes are lost; its saves are retried")
            return None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Either side, every step: this half's counts since the last call (vLLM sums and exports them)."""
        try:
            data = self._stats.take()
        except Exception as err:
            self._failed("get_kv_connector_stats", err, "this interval's counts are lost")
            return None
        return MaruConnectorStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return MaruConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return MaruPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        for half in (self._scheduler, self._worker):
            if half is not None:
                try:
                    half.shutdown()
                except Exception as err:
                    self._failed("shutdown", err, "the pool connection is left to the process exit")

    def _meta(self) -> MaruConnectorMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, MaruConnectorMetadata) else None

    # ============================================================== scheduler side

    def reset_cache(self) -> bool | None:
        """Scheduler: vLLM resets its caches (sleep at level 1 or 2, a pause that clears caches around a
        weight update, ``reset_prefix_cache(reset_connector=True)``).

        The pool is shared by the fleet and is not cleared. But the weights may have changed, and the
        chunk keys name the weights the engine started with: from now on this engine neither loads nor
        stores, until it restarts. True: nothing stale will reach this engine; False if that failed.
        """
        if self._scheduler is None:
            return None
        try:
            self._scheduler.retire(
                "vLLM reset the connector's cache (sleep, or a weight update); the weights may no longer "
                "be the ones the chunk keys name, so this engine stops using the pool until it restarts "
                "(the pool itself is shared and is not cleared)"
            )
        except Exception as err:
            self._failed("reset_cache", err, "vLLM is told the reset failed")
            return False
        return True

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """Scheduler, once before serving: every worker's KV format, by TP rank."""
        if self._scheduler is None:
            return
        try:
            self._scheduler.set_worker_info({r: m for r, m in metadata.items() if isinstance(m, MaruWorkerInfo)})
        except Exception as err:
            self._failed("set_xfer_handshake_metadata", err, "the connector stays disabled")
            # Never key with a namespace the workers' handshake did not confirm.
            self._scheduler.fingerprints = None

    def on_new_request(self, request: Request) -> None:
        """Scheduler, when a request arrives: start following it."""
        try:
            self._sched.track(request)
        except Exception as err:
            self._failed("on_new_request", err, "the request is followed from its first step instead")

    def may_load_async(self, request: Request) -> bool:
        """Scheduler (vLLM 0.34), when a request enters the waiting queues: whether it may load
        asynchronously, so that with ``--max-num-inflight-kv-loads`` its load starts while the running
        batch is full (within that cap). Cheap: no pool lookup, a prompt that could hold a chunk."""
        try:
            return self._sched.may_load_async(request)
        except Exception as err:
            self._failed("may_load_async", err, "the request waits for a running slot before its load")
            return False

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Scheduler, when a waiting request is considered: loadable tokens beyond the local hit."""
        try:
            return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception as err:
            self._failed("get_num_new_matched_tokens", err, "the request is treated as a miss")
            return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Scheduler, after blocks are allocated for a request it will run this step: plan the load."""
        try:
            self._sched.update_state_after_alloc(request, blocks, num_external_tokens)
        except Exception as err:
            self._failed("update_state_after_alloc", err, "its load is reported failed and vLLM recomputes it")
            if num_external_tokens > 0:
                try:
                    self._sched.abandon_load(request, blocks, num_external_tokens)
                except Exception as again:
                    self._failed("update_state_after_alloc (abandoning)", again, "its loaded blocks may be unusable")

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Scheduler, once per step: the loads and saves the workers run for this step."""
        try:
            return self._sched.build_connector_meta(scheduler_output)
        except Exception as err:
            self._failed("build_connector_meta", err, "the step's loads are reported failed and nothing is saved")
            try:
                return self._sched.fallback_meta()
            except Exception as again:
                self._failed("build_connector_meta (fallback)", again, "the step's loads may be unusable")
                return MaruConnectorMetadata()

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Scheduler, once per step output: the workers' report on that step."""
        try:
            self._sched.update_connector_output(connector_output)
        except Exception as err:
            self._failed("update_connector_output", err, "the step's outcomes are lost; its saves are retried")

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler, once per finished request: hold its blocks while saves settle; the handoff for decode."""
        try:
            return self._sched.request_finished(request, block_ids)
        except Exception as err:
            # Hold the blocks anyway (a save lane may still be reading them), unless its asynchronous
            # load runs: vLLM holds those itself. A held request is released next step, and each
            # worker lets go of it once its own lanes are done with it.
            self._failed("request_finished", err, "its unsettled saves are given up")
            try:
                return self._sched.release_after_error(request.request_id), None
            except Exception as again:
                self._failed("request_finished (releasing)", again, "its blocks are freed now")
                return False, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler, for a connector implementing ``SupportsHMA``: :meth:`request_finished` with every
        KV cache group's blocks (vLLM calls only this one then)."""
        try:
            return self._sched.request_finished(request, tuple(block_ids))
        except Exception as err:
            self._failed("request_finished_all_groups", err, "its unsettled saves are given up")
            try:
                return self._sched.release_after_error(request.request_id), None
            except Exception as again:
                self._failed("request_finished_all_groups (releasing)", again, "its blocks are freed now")
                return False, None

    def has_pending_block_frees(self) -> bool:
        """Scheduler: finished requests' blocks are held for their saves and come back soon."""
        try:
            return self._scheduler is not None and self._scheduler.has_pending_block_frees()
        except Exception as err:
            self._failed("has_pending_block_frees", err, "vLLM may preempt instead of waiting")
            return False

    @property
    def _sched(self) -> MaruScheduler:
        assert self._scheduler is not None, "a scheduler hook was called on a worker"
        return self._scheduler
