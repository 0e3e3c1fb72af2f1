"""The Maru KV connector for vLLM 0.32 (``KVConnectorBase_V1``).

Load it with the ``--kv-transfer-config`` that ``maru_connector.config.kv_transfer_config`` builds::

    {"kv_connector": "MaruConnector", "kv_connector_module_path": "maru_connector.vllm",
     "kv_role": "kv_producer" | "kv_consumer" | "kv_both", "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"maru_pool_url": "unix:///run/maru/pool.sock", ...}}

vLLM builds this class twice: once in the scheduler (role SCHEDULER) and once in every model
worker (role WORKER). The facade builds only the half its role needs (``scheduler.py`` or
``worker.py``) and forwards to it; what the scheduler half decides each step travels to the
workers as one ``metadata.MaruConnectorMetadata``.

Roles: ``kv_producer`` (prefill) stores prompt chunks, ``kv_consumer`` (decode) loads them,
``kv_both`` does both. Pool trouble of any kind degrades to misses and skipped stores.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)

from maru_connector import hits
from maru_connector.config import MaruConnectorConfig
from maru_connector.vllm import common
from maru_connector.vllm.common import counters, reset_counters
from maru_connector.vllm.metadata import MaruConnectorMetadata, MaruWorkerInfo
from maru_connector.vllm.scheduler import MaruScheduler
from maru_connector.vllm.stats import MaruConnectorStats, MaruPromMetrics
from maru_connector.vllm.worker import MaruWorker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
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
    from vllm.v1.request import Request

__all__ = ["MaruConnector", "MaruConnectorMetadata", "counters", "reset_counters"]


class MaruConnector(KVConnectorBase_V1):
    """Stores prompt KV in the shared pool and loads it back on a (capped) hit."""

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
                vllm_config, kv_cache_config, self.cfg, loads=loads, saves=saves, hit_rule=type(self).hit_rule
            )
            if loads and tc.kv_load_failure_policy != "recompute":
                common.log.warning(
                    "maru connector: kv_load_failure_policy is %r; a chunk that fails its checksum will fail "
                    'its request instead of being recomputed (set "kv_load_failure_policy": "recompute")',
                    tc.kv_load_failure_policy,
                )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._worker = MaruWorker(
                vllm_config,
                kv_cache_config,
                self.cfg,
                loads=loads,
                saves=saves,
                tp_rank=get_tensor_model_parallel_rank(),
            )
        self._failed_loads: set[str] = set()

    @property
    def requires_kv_delivery(self) -> bool:
        # Saves finish inside the step that computes them: nothing is pending at preemption.
        return False

    # ============================================================== worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Worker, once at start: learn the KV layout; raises on a layout we cannot copy."""
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """Worker, once after ``register_kv_caches``: the layout and rank the scheduler keys with."""
        return self._worker.handshake() if self._worker is not None else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Worker, every step before the forward (when the step has loads): copy chunks in, synchronously.

        Touches only the blocks the scheduler planned; failures are reported through
        :meth:`get_block_ids_with_load_errors`, never raised.
        """
        meta = self._meta()
        if meta is not None and self._worker is not None and self._worker.loads_enabled:
            self._failed_loads = self._worker.load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Worker, per attention layer: nothing to wait for, loads completed in ``start_load_kv``."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        """Worker, per attention layer: nothing; saves copy all layers at once in ``wait_for_save``."""

    def wait_for_save(self) -> None:
        """Worker, once per step after the forward: store the chunks this step completed, then commit.

        Returns only after the pool has committed them (or the store was given up), so the KV of
        a finished prefill is visible before vLLM returns the request's output.
        """
        meta = self._meta()
        if meta is not None and self._worker is not None and self._worker.saves_enabled:
            self._worker.save(meta, skip_requests=self._failed_loads)
        self._failed_loads = set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Worker, once per step after ``wait_for_save``: blocks whose load failed this step."""
        return self._worker.take_invalid_blocks() if self._worker is not None else set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Either side, every step: this half's counts since the last call (vLLM sums and exports them)."""
        half = self._scheduler or self._worker
        data = half.stats.take() if half is not None else {}
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
                half.shutdown()

    def _meta(self) -> MaruConnectorMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, MaruConnectorMetadata) else None

    # ============================================================== scheduler side

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """Scheduler, once before serving: every worker's layout, by TP rank."""
        if self._scheduler is not None:
            self._scheduler.set_worker_info({r: m for r, m in metadata.items() if isinstance(m, MaruWorkerInfo)})

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Scheduler, when a waiting request is considered: loadable tokens beyond the local hit."""
        assert self._scheduler is not None
        try:
            return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception as err:  # a bug here must cost a miss, not the engine
            common.log.exception("maru connector: lookup failed unexpectedly (%s); treating as a miss", err)
            return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Scheduler, after blocks are allocated for a request it will run this step: plan the load."""
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Scheduler, once per step: the loads and saves the workers run for this step."""
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler, once per finished request: ``(False, None)``, the KV is already committed."""
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)
