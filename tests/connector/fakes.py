"""Minimal stand-ins for the vLLM objects the connector halves read (not for the connector itself)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from types import SimpleNamespace

BLOCK = 128
CHUNK = 256


def vllm_config(
    *,
    block_size: int = BLOCK,
    hash_algo: str = "sha256",
    tp: int = 1,
    dcp: int = 1,
    backend: str = "CPU_ATTN",
    kv_heads: int | None = None,
) -> SimpleNamespace:
    """The parts of a VllmConfig the connector reads; the model is a name, so its weights are unresolved.

    ``kv_heads``: the model's KV heads, by default 2 per TP rank (``kv_cache_config``'s default).
    """
    total_kv_heads = kv_heads or 2 * tp
    layers = {f"layer{i}": SimpleNamespace(attn_backend=SimpleNamespace(get_name=lambda: backend)) for i in range(2)}
    return SimpleNamespace(
        cache_config=SimpleNamespace(
            block_size=block_size, prefix_caching_hash_algo=hash_algo, cache_dtype="auto", kv_cache_dtype_skip_layers=[]
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, decode_context_parallel_size=dcp),
        scheduler_config=SimpleNamespace(async_scheduling=False),
        model_config=SimpleNamespace(
            model="tiny-llama",
            model_weights="",
            revision=None,
            dtype="torch.float32",
            quantization=None,
            hf_overrides={},
            model_impl="auto",
            get_num_layers=lambda _pc: 2,
            get_total_num_kv_heads=lambda: total_kv_heads,
        ),
        load_config=SimpleNamespace(download_dir=None, load_format="auto", model_loader_extra_config={}),
        compilation_config=SimpleNamespace(static_forward_context=layers),
    )


def kv_cache_config(
    *, block_size: int = BLOCK, heads: int = 2, head_size: int = 64, num_blocks: int = 16, window: int | None = None
) -> SimpleNamespace:
    """One group of vLLM's own full-attention spec over two layers: what a Llama engine hands the connector.

    ``window``: two groups instead, as vLLM's hybrid manager builds them: layer0 full attention, layer1 a
    sliding window of that many tokens."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=torch.float32)
    groups = [SimpleNamespace(kv_cache_spec=spec, layer_names=["layer0", "layer1"])]
    if window is not None:
        sliding = SlidingWindowSpec(
            block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=torch.float32, sliding_window=window
        )
        groups = [
            SimpleNamespace(kv_cache_spec=spec, layer_names=["layer0"]),
            SimpleNamespace(kv_cache_spec=sliding, layer_names=["layer1"]),
        ]
    return SimpleNamespace(
        hash_block_size=block_size, num_blocks=num_blocks, kv_cache_layout="LBHNC", kv_cache_groups=groups
    )


def block_hashes(n_tokens: int, seed: int, block: int = BLOCK) -> list[bytes]:
    out, parent = [], b"root"
    for j in range(n_tokens // block):
        parent = hashlib.sha256(parent + f"{seed}:{j}".encode()).digest()
        out.append(parent)
    return out


@dataclass(eq=False)
class Request:
    request_id: str
    num_prompt_tokens: int
    block_hashes: list[bytes]


def request(req_id: str, n_tokens: int, seed: int = 0) -> Request:
    return Request(req_id, n_tokens, block_hashes(n_tokens, seed))


@dataclass
class Blocks:
    ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


@dataclass
class BlockState:
    tables: dict[str, list[int]]

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...] | None:
        return (self.tables[req_id],) if req_id in self.tables else None


@dataclass
class StepOutput:
    """The fields of vLLM's SchedulerOutput that build_connector_meta reads."""

    scheduled_new_reqs: list[SimpleNamespace] = field(default_factory=list)
    scheduled_cached_reqs: SimpleNamespace = field(
        default_factory=lambda: SimpleNamespace(req_ids=[], num_computed_tokens=[])
    )
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    kv_connector_block_state: BlockState | None = None


def step(
    tables: dict[str, list[int]], new: dict[str, tuple[int, int]], cached: dict[str, tuple[int, int]]
) -> StepOutput:
    """One step: ``req_id -> (num_computed_tokens before the step, tokens scheduled)``."""
    return StepOutput(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c) for r, (c, _) in new.items()],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=list(cached), num_computed_tokens=[c for c, _ in cached.values()]
        ),
        num_scheduled_tokens={r: n for r, (_, n) in {**new, **cached}.items()},
        kv_connector_block_state=BlockState(tables),
    )
