"""Which engines the connector can serve at all, decided from the KV cache vLLM allocated.

The connector stores and loads paged attention KV: per token, per layer, in whole blocks of one KV
cache group. vLLM hands both halves the engine's ``KVCacheConfig`` when it builds them, after it has
decided what each layer keeps; that, not the model's name or architecture, is what decides whether a
chunk could ever be stored and loaded (a "hybrid" Granite 4 with attention layers only allocates
plain attention KV, and is served).

What cannot work is refused when the connector is built, at engine start, with one error naming the
model, what its cache holds, and what to do. Such an engine could never be served a hit: the scheduler
half would promise tokens that no load can deliver, and every store would be wasted. Refusing beats
switching the connector off quietly: a pod that asks for prefill/decode through the pool would
otherwise run with decode recomputing every prompt, and the only trace would be a line in its log.
Pool trouble at run time stays a miss; this is a configuration that can never serve.

MLA models (DeepSeek-V2/V3/R1, Kimi K2) keep one latent vector per token and layer instead of K and V per
head, and that latent is the same on every TP rank (vLLM replicates it): :func:`is_latent_cache` tells the
halves so, and they store it once (rank 0) under keys that no rank or TP degree changes, and load it on
every rank, as vLLM's own NIXL and offloading connectors do.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from maru_contracts.config import ConfigError
from maru_contracts.keys import head_ranges

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec

WHAT_TO_DO = "serve this model without the Maru connector (no --kv-transfer-config)"


def kv_cache_problem(kv_cache_config: KVCacheConfig) -> str | None:
    """Why the connector cannot copy this engine's KV cache, or None when it can.

    Several groups (vLLM's hybrid KV cache manager, kept on for this connector: it implements
    ``SupportsHMA``) are copied each with its own keys and block table (``groups.py``) when every group
    is full or sliding-window attention of one block size and KV shape."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec, UniformTypeKVCacheSpecs

    groups = list(kv_cache_config.kv_cache_groups)
    if not groups:
        return "it keeps no KV cache at all (an attention-free model): there is nothing to store or load"
    layers = [spec for group in groups for spec in _layer_specs(group)]
    kinds = ", ".join(f"{n} x {kind}" for kind, n in sorted(Counter(type(s).__name__ for s in layers).items()))
    state = sum(isinstance(s, MambaSpec) for s in layers)
    if state:
        what = (
            f"a hybrid model ({len(layers) - state} attention and {state} Mamba/linear-attention layers)"
            if state < len(layers)
            else f"a state-space model ({state} Mamba/linear-attention layers, no attention)"
        )
        # The scheduler half would answer lookups with tokens; for these layers a load could only
        # write KV bytes over recurrent state. Storing the block-boundary snapshots vLLM's prefix caching
        # keeps is no way out either: its "align" mode keeps the state at the last block boundary a step
        # reached and nulls the interior ones (MambaManager: "align-mode Mamba can null interior states"),
        # so a request leaves about one snapshot, not one per chunk of its prefix.
        return (
            f"it is {what}; a Mamba layer keeps one running state per request, overwritten at every token, "
            "not per-token KV in blocks, and vLLM's prefix caching keeps about one state snapshot per request "
            "(mamba_cache_mode 'align' nulls the interior block states), so a prompt prefix cannot be stored "
            f"in chunks or loaded into blocks and the connector could never serve a hit (KV cache: {kinds})"
        )
    foreign = sorted({type(s).__name__ for s in layers if not isinstance(s, AttentionSpec)})
    if foreign:
        return f"its KV cache holds {', '.join(foreign)}, which is not paged attention KV (KV cache: {kinds})"
    if len(groups) > 1:
        from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

        odd = sorted({type(g.kv_cache_spec).__name__ for g in groups} - {"FullAttentionSpec", "SlidingWindowSpec"})
        if odd or not all(isinstance(g.kv_cache_spec, (FullAttentionSpec, SlidingWindowSpec)) for g in groups):
            return (
                f"its KV cache groups hold {', '.join(odd)}, neither full nor sliding-window attention, which "
                "the connector copies; start vLLM with --disable-hybrid-kv-cache-manager"
            )
        # One chunk geometry and one set of head ranges for every group (keys name them once).
        shapes = {
            (
                g.kv_cache_spec.block_size,
                g.kv_cache_spec.num_kv_heads,
                g.kv_cache_spec.head_size,
                str(g.kv_cache_spec.dtype),
            )
            for g in groups
        }
        if len(shapes) > 1:
            return (
                f"its KV cache groups differ in block size or KV shape (block size, heads, head size, dtype: "
                f"{sorted(shapes)}); start vLLM with --disable-hybrid-kv-cache-manager"
            )
    spec = groups[0].kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        shapes = {(s.num_kv_heads, s.head_size, str(s.dtype)) for s in layers if isinstance(s, AttentionSpec)}
        if len(shapes) > 1:
            return f"its attention layers have different KV shapes (heads, head size, dtype: {sorted(shapes)})"
    return None


def is_latent_cache(kv_cache_config: KVCacheConfig) -> bool:
    """Whether the engine's (one group of) KV cache is an MLA latent cache: one latent per token, no heads.

    Only meaningful for a cache :func:`kv_cache_problem` accepts; vLLM puts MLA layers in a group of
    their own (``MLAAttentionSpec.merge`` refuses any other spec), so one layer tells for all.
    """
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    layers = [spec for group in kv_cache_config.kv_cache_groups for spec in _layer_specs(group)]
    return bool(layers) and all(isinstance(s, MLAAttentionSpec) for s in layers)


def refuse_unsupported_kv_cache(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
    """Raise ``ConfigError`` naming the model when the connector cannot copy its KV cache."""
    problem = kv_cache_problem(kv_cache_config)
    if problem is None:
        return
    raise ConfigError(f"maru connector: model {_model_name(vllm_config)} cannot use the pool: {problem}; {WHAT_TO_DO}")


def _layer_specs(group: object) -> list[KVCacheSpec]:
    """One spec per layer of a group (``UniformTypeKVCacheSpecs`` keeps one per layer already)."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    spec = group.kv_cache_spec  # type: ignore[attr-defined]
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return list(spec.kv_cache_specs.values())
    return [spec] * max(1, len(getattr(group, "layer_names", None) or ()))


def _model_name(vllm_config: VllmConfig) -> str:
    model = vllm_config.model_config
    name = str(getattr(model, "model_weights", "") or model.model)
    try:
        arch = model.architecture
    except Exception:  # only decorates the message; a config without it still gets the error
        arch = None
    return f"{name} ({arch})" if arch else name


def total_kv_heads(vllm_config: VllmConfig, writer_tp: int | None, *, latent: bool) -> int | None:
    """The model's KV heads, which chunk keys name ranges of; None for an MLA latent (no heads to shard).

    Raises ConfigError when this engine's TP size, or the writer's (``maru_kv_writer_tp``), does not
    shard them the way vLLM does (see ``keys.head_range``): no rank could say which heads it holds.
    """
    if latent:
        return None
    total = vllm_config.model_config.get_total_num_kv_heads()
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    for field, size in (("--tensor-parallel-size", tp_size), ("maru_kv_writer_tp", writer_tp or tp_size)):
        try:
            head_ranges(total, size)
        except ValueError as err:
            raise ConfigError(f"{field} {size}: {err}") from None
    return total
