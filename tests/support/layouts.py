"""vLLM's KV cache layouts as the connector meets them: shapes, split blocks, and tensors allocated the way vLLM
allocates them."""

from __future__ import annotations

import torch
from vllm.config import CacheConfig, VllmConfig
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    KVCacheLayout,
    MLAAttentionSpec,
)
from vllm.v1.worker.utils import allocate_kv_cache

from maru_connector.layout import PagedKV, describe_kv_caches
from maru_connector.layout_check import CacheShape

ALL_LAYOUTS = [layout.name for layout in KVCacheLayout]

SHAPE = CacheShape(num_layers=3, num_blocks=12, heads=2, block_size=32, head_size=32)

SPLIT = CacheShape(num_layers=2, num_blocks=12, heads=2, block_size=64, head_size=32, kernel_block_size=16)


def vllm_allocate(
    layout: str, shape: CacheShape, dtype: torch.dtype, device: torch.device | str = "cpu", *, mla: bool = False
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A KV cache exactly as a vLLM 0.32 worker allocates it (the raw buffer is not exposed: None)."""
    config = VllmConfig(cache_config=CacheConfig(block_size=shape.block_size))
    config.cache_config.kv_cache_layout = layout
    if mla:
        spec = MLAAttentionSpec(block_size=shape.block_size, num_kv_heads=1, head_size=576, dtype=dtype)
    else:
        spec = FullAttentionSpec(
            block_size=shape.block_size, num_kv_heads=shape.heads, head_size=shape.head_size, dtype=dtype
        )
    names = [f"model.layers.{i}.self_attn.attn" for i in range(shape.num_layers)]
    kv_config = get_kv_cache_config_from_groups(
        config, [KVCacheGroupSpec(names, spec)], spec.page_size_bytes * shape.num_layers * shape.num_blocks
    )
    assert kv_config.num_blocks == shape.num_blocks
    kernel = [shape.kernel_block_size] if shape.kernel_block_size else None
    return None, allocate_kv_cache(kv_config, torch.device(device), KVCacheLayout[layout], kernel)


def describe(views: dict[str, torch.Tensor], shape: CacheShape = SHAPE, backend: str = "FLASH_ATTN") -> PagedKV:
    return describe_kv_caches(
        views,
        num_blocks=shape.num_blocks,
        block_size=shape.block_size,
        num_kv_heads=shape.heads,
        head_size=shape.head_size,
        backend=backend,
    )
