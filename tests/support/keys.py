"""A key namespace and block hashes for the key tests."""

from __future__ import annotations

import hashlib

from maru_contracts.keys import (
    Namespace,
    chunk_keys,
)

NS = Namespace(
    model="tiny-llama",
    revision="",
    weights="files:0123",
    load_format="auto",
    loader_config="{}",
    model_impl="auto",
    quantization="",
    hf_overrides="{}",
    dtype="torch.float32",
    kv_cache_dtype="auto",
    kv_format="CPU_ATTN:HNC:float32",
    kv_layers="digest",
    vllm_version="0.32.0",
    block_size=128,
    chunk_tokens=256,
    num_layers=2,
    kv_heads="0-2/2",
    salt="",
)


def fake_block_hashes(n: int, seed: bytes = b"p") -> list[bytes]:
    """A sha256 chain like vLLM's: hash j covers blocks 0..j."""
    out, parent = [], b"root"
    for j in range(n):
        parent = hashlib.sha256(parent + seed + j.to_bytes(4, "little")).digest()
        out.append(parent)
    return out


def keys(hashes: list[bytes], ns: Namespace = NS, **kw: int) -> list[bytes]:
    fp = ns.fingerprint()
    return chunk_keys(hashes, hash_block_size=ns.block_size, chunk_tokens=ns.chunk_tokens, fingerprint=fp, **kw)
