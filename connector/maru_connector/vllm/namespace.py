"""The key namespace of one engine: everything in its configuration that changes the bytes of its KV.

``engine_identity`` reads vLLM's config once, when the scheduler half starts; the workers add the
KV cache's own half (``kv_format``, ``kv_layers``) in their handshake. Together they make
``keys.Namespace``: two engines share chunks only when every field is equal.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from maru_connector.vllm import common
from maru_connector.weights import is_resolved, loader_source, weights_identity

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# Keys of --model-loader-extra-config that only change how fast the weights load (threads, streaming
# concurrency and memory, a completeness check), never which numbers: vLLM 0.32's default and Run:ai
# loaders. Left out of the key so they cost no hits. Every other key (a tensorizer URI, a sharded
# state's file pattern, a plugin's options) may pick other weights and goes in.
LOAD_SPEED_ONLY_KEYS = frozenset(
    {"enable_multithread_load", "num_threads", "enable_weights_track", "concurrency", "memory_limit", "distributed"}
)


def engine_identity(vllm_config: VllmConfig) -> dict[str, str]:
    """The ``keys.Namespace`` fields an engine's configuration decides."""
    import vllm

    model = vllm_config.model_config
    cache = vllm_config.cache_config
    # Object-storage models are pulled into a local directory; keep the name people configured.
    name = str(getattr(model, "model_weights", "") or model.model)
    load = getattr(vllm_config, "load_config", None)
    download_dir = getattr(load, "download_dir", None)
    load_format = str(getattr(load, "load_format", "auto"))
    # Weights streamed from object storage or read from a tensorizer file are not in model.model,
    # a local directory of config and code alone.
    source = loader_source(
        str(getattr(model, "model_weights", "") or ""), load_format, getattr(load, "model_loader_extra_config", None)
    )
    weights = weights_identity(str(model.model), model.revision, cache_dir=download_dir, source=source)
    if not is_resolved(weights):
        common.log.warning(
            "maru connector: cannot identify the weights of %s from local files; chunk keys use its "
            "name, revision and maru_cache_namespace only, so pin --revision to a commit (or the objects' "
            "ETag), or give a different maru_cache_namespace to each version of the weights",
            source or name,
        )
    skipped = list(getattr(cache, "kv_cache_dtype_skip_layers", None) or [])
    impl = getattr(model, "model_impl", "auto")
    return {
        "model": name,
        "revision": str(model.revision or ""),
        "weights": weights,
        # Which loader fills the weights: `dummy` gives random numbers from the same files, and a
        # tensorizer or sharded-state loader reads other files than the directory's weights.
        "load_format": load_format,
        "loader_config": loader_config(getattr(load, "model_loader_extra_config", None)),
        # Which modelling code computes the KV: vLLM's own, or Transformers' (the model's custom
        # code with trust_remote_code, whose files are in the weights identity).
        "model_impl": str(getattr(impl, "value", impl)),
        "quantization": str(model.quantization or ""),
        "hf_overrides": canonical(model.hf_overrides),
        "dtype": str(model.dtype),
        "kv_cache_dtype": str(cache.cache_dtype) + (f" skip={','.join(skipped)}" if skipped else ""),
        "vllm_version": str(vllm.__version__),
    }


def loader_config(extra: Any) -> str:
    """``--model-loader-extra-config`` without the keys that only change loading speed."""
    if isinstance(extra, dict):
        extra = {k: v for k, v in extra.items() if k not in LOAD_SPEED_ONLY_KEYS}
    return canonical(extra or {})


def kv_layers_digest(layer_names: Sequence[str], block_bytes: int) -> str:
    """A digest of the KV layers a worker registered and the size of one block of each."""
    digest = hashlib.blake2b(digest_size=12, person=b"maru-kv-layers")
    digest.update(json.dumps([list(layer_names), block_bytes]).encode())
    return digest.hexdigest()


def canonical(value: Any) -> str:
    """A stable text for a config value: sorted JSON, or the qualified name of a function."""
    if callable(value):
        return f"callable:{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', repr(value))}"
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr)
    except (TypeError, ValueError):
        return repr(value)
