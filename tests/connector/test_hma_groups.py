"""Several KV cache groups (sliding window + full attention) at vLLM's real Scheduler.

The connector does not implement ``SupportsHMA``: it copies the blocks of one group. vLLM then turns
its hybrid KV cache manager off for it (every sliding-window layer allocated as full attention, one
group, which the connector serves); a KV cache config that still has several groups must be refused
at start with the reason, never accepted and served wrong (keys and block ids of one group only).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.structured_output import StructuredOutputManager

from maru_connector.vllm import MaruConnector
from maru_contracts.config import ConfigError

from .realsched import BS, HD, HEADS, Engine

NO_POOL = "unix:///nonexistent/maru/pool.sock"


def test_vllm_turns_its_hybrid_kv_cache_manager_off_for_the_connector(tmp_path: Path) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

    assert not issubclass(MaruConnector, SupportsHMA)
    engine = Engine(tmp_path, NO_POOL, num_blocks=16)
    try:
        assert engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    finally:
        engine.close()


def test_two_kv_cache_groups_are_refused_at_the_real_scheduler_naming_supports_hma(tmp_path: Path) -> None:
    engine = Engine(tmp_path, NO_POOL, num_blocks=16)
    engine.close()
    full = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HD, dtype=torch.float32)
    window = SlidingWindowSpec(
        block_size=BS, num_kv_heads=HEADS, head_size=HD, dtype=torch.float32, sliding_window=2 * BS
    )
    groups = [KVCacheGroupSpec(["layer0"], full), KVCacheGroupSpec(["layer1"], window)]
    config = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)
    vllm_config = engine.vllm_config
    with pytest.raises(
        ConfigError,
        match=r"its KV cache has 2 groups .* does not implement SupportsHMA yet \(its workers copy one group's",
    ):
        Scheduler(vllm_config, config, StructuredOutputManager(vllm_config), block_size=BS)
