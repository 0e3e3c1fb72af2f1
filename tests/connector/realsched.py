"""vLLM's real ``Scheduler`` with the Maru connector, and the real worker half beside it.

The test plays the model runner: each :meth:`Engine.step` schedules with vLLM's scheduler (which
calls the connector's scheduler half), hands the step's metadata to a real :class:`MaruWorker` as
vLLM's worker would (preemptions, loads, saves, ``get_finished``, failed blocks, the report), and
feeds vLLM a model output that samples one token for every request whose prompt is computed. No
forward runs: the KV bytes are whatever the worker's tensors hold, which these tests never read.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from maru_connector.vllm import MaruConnector
from maru_connector.vllm.lane import Job
from maru_connector.vllm.worker import MaruWorker
from maru_contracts.config import MaruConnectorConfig
from maru_localcluster.tinymodel import make_tiny_llama

from . import fakes

BS, HEADS, HD = 32, 2, 32  # the CPU layout needs block sizes that are multiples of 32
CHUNK = 2 * BS
HAS_REQ_ID_TO_INDEX = "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}
LAYERS = ["layer0", "layer1"]  # the names fakes.vllm_config gives the worker's attention layers


class Engine:
    """One scheduler and one TP rank, stepped by the test."""

    def __init__(
        self,
        model_dir: Path,
        pool_url: str,
        *,
        num_blocks: int,
        prefix_caching: bool = False,
        window: int | None = None,
        dense: bool = True,
        batch_tokens: int = 4096,
        **extra: Any,
    ) -> None:
        """``window``: two KV cache groups, layer0 full attention and layer1 a sliding window of that many
        tokens, as vLLM's hybrid KV cache manager builds them. ``dense``: pages the worker copies by address;
        else heads in separate planes, copied through its staging buffers (as on a GPU). ``batch_tokens``: the
        scheduler's token budget per step (a prompt longer than it is prefilled in chunks)."""
        model = make_tiny_llama(model_dir)
        extra_config = {"maru_pool_url": pool_url, "maru_kv_chunk_tokens": CHUNK, "maru_rpc_timeout_ms": 5000}
        extra_config |= {f"maru_{k}": v for k, v in extra.items()}
        self.vllm_config = VllmConfig(
            model_config=ModelConfig(model=str(model), dtype="float32", max_model_len=4096, skip_tokenizer_init=True),
            cache_config=CacheConfig(block_size=BS, enable_prefix_caching=prefix_caching),
            scheduler_config=SchedulerConfig(
                max_num_seqs=8,
                max_num_batched_tokens=batch_tokens,
                max_model_len=4096,
                is_encoder_decoder=False,
            ),
            kv_transfer_config=KVTransferConfig(
                kv_connector="MaruConnector",
                kv_connector_module_path="maru_connector.vllm",
                kv_role="kv_both",
                kv_load_failure_policy="recompute",
                kv_connector_extra_config=extra_config,
            ),
            device_config=DeviceConfig("cpu"),
        )
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        worker_cache = fakes.kv_cache_config(
            block_size=BS, heads=HEADS, head_size=HD, num_blocks=num_blocks, window=window
        )
        groups = [KVCacheGroupSpec(g.layer_names, g.kv_cache_spec) for g in worker_cache.kv_cache_groups]
        kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        self.sched = Scheduler(
            self.vllm_config, kv_cache_config, StructuredOutputManager(self.vllm_config), block_size=BS
        )
        assert isinstance(self.sched.connector, MaruConnector)
        self.connector = self.sched.connector
        cfg = MaruConnectorConfig.from_extra_config(extra_config)
        self.worker = MaruWorker(
            fakes.vllm_config(block_size=BS),
            worker_cache,
            cfg,
            loads=True,
            saves=True,
            tp_rank=0,
        )
        self.kv_caches = {
            name: torch.zeros(num_blocks, HEADS, BS, 2 * HD)
            if dense
            else torch.zeros(HEADS, num_blocks, BS, 2 * HD).transpose(0, 1)
            for name in LAYERS
        }
        self.worker.register_kv_caches(self.kv_caches)
        self.connector.set_xfer_handshake_metadata({0: self.worker.handshake()})
        hash_fn = get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(BS, hash_fn)
        self.finished_sending: list[str] = []

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 4) -> Request:
        request = Request(
            req_id,
            prompt,
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            None,
            block_hasher=self._hasher,
        )
        self.sched.add_request(request)
        return request

    def step(self) -> Any:
        """One engine step: schedule, run the worker half as vLLM's worker would, report back."""
        out = self.sched.schedule()
        meta = out.kv_connector_metadata
        w = self.worker
        w.handle_preemptions(meta)
        w.load(meta)
        w.save(meta)
        freed, loaded = w.finished(meta)
        failed = w.take_failed_recving()  # as MaruConnector.get_transfer_results reports them
        loaded |= failed
        invalid = w.take_invalid_blocks()
        report = w.report()
        self.finished_sending += sorted(freed)
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in ids:
            request = self.sched.requests[req_id]
            sampled.append([7] if request.num_computed_tokens >= request.num_tokens else [])
        # vLLM 0.34 dropped req_id_to_index (the order of req_ids says it); 0.32 and 0.33 require it.
        by_index = {"req_id_to_index": {r: i for i, r in enumerate(ids)}} if HAS_REQ_ID_TO_INDEX else {}
        output = ModelRunnerOutput(
            req_ids=ids,
            **by_index,
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(
                finished_sending=freed or None,
                finished_recving=loaded or None,
                failed_recving=failed,
                invalid_block_ids=invalid,
                kv_connector_worker_meta=report,
            ),
        )
        return self.sched.update_from_output(out, output)

    def hold_lane(self, lane: str) -> Callable[[], None]:
        """Keep the worker's ``loads`` or ``saves`` lane busy until the returned function is called,
        as a slow pool would: the jobs queued behind stay in flight."""
        gate = threading.Event()
        getattr(self.worker, f"_{lane}").submit(
            Job(run=lambda: gate.wait() and [], req_ids=frozenset(), on_error=lambda _e: [])
        )
        return gate.set

    def close(self) -> None:
        self.worker.shutdown()
        self.connector.shutdown()


def prompt(n: int, seed: int) -> list[int]:
    return [4 + (seed * 131 + i * 7) % 500 for i in range(n)]
