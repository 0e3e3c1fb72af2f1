"""A random-weight 2-layer Llama made offline, for tests, the benchmark and the local demo (and, for the
tests of which models the connector refuses, a tiny Mamba2 and a tiny Granite 4 hybrid; for MLA, a tiny
DeepSeek-V2; for sliding-window attention, a tiny Gemma 3).

Nothing is downloaded: the weights come from a seeded ``torch`` generator and the tokenizer is a
``tokenizers`` WordLevel vocabulary of ``t4 .. t{N-1}``. Special tokens are ``<s> </s> <pad> <unk>`` (ids 0-3), so text
prompts like ``"t17 t305 t42"`` map one word to one token. The same seed gives the same bytes on disk,
so two engines (prefill and decode) loading the directory compute the same KV.

Compare outputs in float32: with random weights the top two logits often tie exactly in bf16, so
greedy tokens would flip on any reordering of the arithmetic, including vLLM's own prefix caching.

Usage::

    python -m maru_localcluster.tinymodel /tmp/tiny-llama
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VOCAB_SIZE = 512
MAX_MODEL_LEN = 16384
# Bumped when the tokenizer files change, so an older model directory is rewritten.
TOKENIZER_VERSION = 2
SPECIALS = ("<s>", "</s>", "<pad>", "<unk>")


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny model; head_dim 64 is one the CPU attention kernels support."""

    vocab_size: int = VOCAB_SIZE
    hidden_size: int = 256
    intermediate_size: int = 512
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = MAX_MODEL_LEN
    seed: int = 1234


def make_tiny_llama(path: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Write the model and tokenizer to ``path`` (created if missing) and return it.

    Idempotent: a directory that already holds a model of the same spec is left alone, so a test
    run and the demo can share it.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    spec = spec or TinyModelSpec()
    out = Path(path)
    stamp = out / "maru-tinymodel.json"
    wanted = json.dumps({**spec.__dict__, "tokenizer": TOKENIZER_VERSION}, sort_keys=True)
    if stamp.is_file() and stamp.read_text() == wanted:
        return out
    out.mkdir(parents=True, exist_ok=True)

    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    # The default init (std 0.02) gives near-uniform logits; a wider spread makes greedy decoding
    # stable against float32 reuse noise, which the token-equality tests rely on.
    config.initializer_range = 0.2
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)

    _tokenizer(spec.vocab_size, PreTrainedTokenizerFast).save_pretrained(out)
    stamp.write_text(wanted)
    return out


# Layer kinds of ``make_tiny_granite_hybrid``, as Granite 4 configs name them.
MAMBA, ATTENTION = "mamba", "attention"


def make_tiny_granite_hybrid(path: str | Path, layer_types: tuple[str, ...] = (MAMBA, ATTENTION)) -> Path:
    """A random-weight 2-layer Granite 4 hybrid (``GraniteMoeHybridForCausalLM``, no experts), written like
    :func:`make_tiny_llama`. ``layer_types`` picks Mamba2 or attention per layer: the default mixes them
    (what vLLM calls a hybrid model); all attention is how Granite 4 "micro" ships, a hybrid config
    whose KV cache is plain attention."""
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    def build() -> Any:
        config = GraniteMoeHybridConfig(
            **_common_config(),
            hidden_size=256,
            intermediate_size=512,
            shared_intermediate_size=512,
            num_hidden_layers=len(layer_types),
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=0,
            num_experts_per_tok=0,
            layer_types=list(layer_types),
            # Mamba2 mixer: 8 heads of 64 (expand 2 x hidden 256), the shapes vLLM's CPU kernels run.
            mamba_n_heads=8,
            mamba_d_head=64,
            mamba_n_groups=1,
            mamba_d_state=64,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=256,
            position_embedding_type="rope",
        )
        return GraniteMoeHybridForCausalLM(config).to(torch.float32)

    return _write(path, {"kind": "granite-hybrid", "layer_types": list(layer_types)}, build)


def make_tiny_mamba2(path: str | Path) -> Path:
    """A random-weight 2-layer Mamba2 (``Mamba2ForCausalLM``: state-space layers only, no attention)."""
    import torch
    from transformers import Mamba2Config, Mamba2ForCausalLM

    def build() -> Any:
        config = Mamba2Config(
            **_common_config(),
            hidden_size=256,
            num_hidden_layers=2,
            num_heads=8,
            head_dim=64,
            n_groups=1,
            state_size=64,
            conv_kernel=4,
            expand=2,
            chunk_size=256,
        )
        return Mamba2ForCausalLM(config).to(torch.float32)

    return _write(path, {"kind": "mamba2"}, build)


def make_tiny_deepseek_v2(path: str | Path) -> Path:
    """A random-weight 2-layer DeepSeek-V2 (``DeepseekV2ForCausalLM``): MLA attention, MoE after the first layer.

    The latent is ``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64 = 576 wide, the one latent size vLLM's
    CPU MLA kernel runs; the other sizes are as small as that allows. Written like :func:`make_tiny_llama`.
    """
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    def build() -> Any:
        config = DeepseekV2Config(
            **_common_config(),
            hidden_size=256,
            intermediate_size=512,
            moe_intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_rope_head_dim=64,
            qk_nope_head_dim=64,
            v_head_dim=64,
            first_k_dense_replace=1,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            topk_method="greedy",
            n_group=1,
            topk_group=1,
            rms_norm_eps=1e-5,
        )
        # Wider than the default init, as for the Llama: greedy tokens then survive float32 reuse noise.
        config.initializer_range = 0.2
        return DeepseekV2ForCausalLM(config).to(torch.float32)

    return _write(path, {"kind": "deepseek-v2"}, build)


def make_tiny_gemma3(path: str | Path) -> Path:
    """A random-weight 4-layer Gemma 3 (``Gemma3ForCausalLM``): sliding-window (256 tokens) and full attention
    layers alternating, written like :func:`make_tiny_llama`."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    def build() -> Any:
        config = Gemma3TextConfig(
            **_common_config(),
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            sliding_window=256,
            layer_types=["sliding_attention", "full_attention"] * 2,
            query_pre_attn_scalar=64,
            rms_norm_eps=1e-5,
        )
        config.initializer_range = 0.2  # as for the Llama: greedy tokens survive float32 reuse noise
        return Gemma3ForCausalLM(config).to(torch.float32)

    return _write(path, {"kind": "gemma3"}, build)


def _common_config() -> dict[str, Any]:
    return dict(
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=MAX_MODEL_LEN,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )


def _write(path: str | Path, what: dict[str, Any], build: Callable[[], Any], seed: int = 1234) -> Path:
    """Save ``build()``'s model (seeded) and the tokenizer to ``path``, unless it already holds ``what``."""
    import torch
    from transformers import PreTrainedTokenizerFast

    out = Path(path)
    stamp = out / "maru-tinymodel.json"
    wanted = json.dumps({**what, "seed": seed, "tokenizer": TOKENIZER_VERSION}, sort_keys=True)
    if stamp.is_file() and stamp.read_text() == wanted:
        return out
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    build().save_pretrained(out, safe_serialization=True)
    _tokenizer(VOCAB_SIZE, PreTrainedTokenizerFast).save_pretrained(out)
    stamp.write_text(wanted)
    return out


def _tokenizer(vocab_size: int, fast_cls: type):
    from tokenizers import Tokenizer, models, pre_tokenizers

    # Special tokens must not be prefixes of ordinary words: added tokens match inside words.
    vocab = {name: i for i, name in enumerate(SPECIALS)}
    vocab.update({f"t{i}": i for i in range(len(SPECIALS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return fast_cls(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=MAX_MODEL_LEN,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="directory to write the model into")
    args = parser.parse_args(argv)
    print(make_tiny_llama(args.path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
