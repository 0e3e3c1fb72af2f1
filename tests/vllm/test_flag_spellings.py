"""The operator reads extraArgs as vLLM's own parser does: checked against the installed vLLM's parser."""

from __future__ import annotations

from typing import Any

import pytest

from maru_operator.vllmflags import FLAGS, SHORT_OPTIONS, settings

pytestmark = pytest.mark.vllm

# (arguments, the flag they set, the namespace attribute vLLM sets)
SPELLINGS = [
    (["-tp", "2"], "--tensor-parallel-size", "tensor_parallel_size"),
    (["-tp=2"], "--tensor-parallel-size", "tensor_parallel_size"),
    (["-t", "2"], "--tensor-parallel-size", "tensor_parallel_size"),
    (["--tensor_parallel_size", "2"], "--tensor-parallel-size", "tensor_parallel_size"),
    (["--tensor-parallel=2"], "--tensor-parallel-size", "tensor_parallel_size"),
    (["--kv_transfer_config", '{"kv_role":"kv_both"}'], "--kv-transfer-config", "kv_transfer_config"),
    (["--kv-transfer-config.kv_role=kv_both"], "--kv-transfer-config", "kv_transfer_config"),
    (["--kv-transfer-config.kv_role", "kv_both"], "--kv-transfer-config", "kv_transfer_config"),
    (["--kv-t", '{"kv_role":"kv_both"}'], "--kv-transfer-config", "kv_transfer_config"),
    (["-q", "fp8"], "--quantization", "quantization"),
    (["-qfp8"], "--quantization", "quantization"),
    (["-q=fp8"], "--quantization", "quantization"),
    (["--kv_cache_dtype=fp8"], "--kv-cache-dtype", "kv_cache_dtype"),
    (["--served_model_name", "x"], "--served-model-name", "served_model_name"),
    (["--block_size=32"], "--block-size", "block_size"),
    (["--dt", "float16"], "--dtype", "dtype"),
]


@pytest.fixture(scope="module")
def parser() -> Any:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


@pytest.mark.parametrize(("args", "flag", "dest"), SPELLINGS, ids=[" ".join(s[0]) for s in SPELLINGS])
def test_each_spelling_sets_what_vllm_says(parser: Any, args: list[str], flag: str, dest: str) -> None:
    default = getattr(parser.parse_args(["m"]), dest)
    assert getattr(parser.parse_args(["m", *args]), dest) != default, "vLLM did not take it as that flag"
    assert [s.flag for s in settings(args)] == [flag]


def test_the_abbreviation_table_is_vllms(parser: Any) -> None:
    options = sorted(o for action in parser._actions for o in action.option_strings)
    assert tuple(o for o in options if not o.startswith("--")) == SHORT_OPTIONS
    assert parser.allow_abbrev  # else no abbreviation would need checking
    for flag in FLAGS:
        assert flag.name in options
        for alias in flag.aliases:
            action = next(a for a in parser._actions if flag.name in a.option_strings)
            assert alias in action.option_strings
        # The shortest prefix naming only this flag (the full name when another option extends it).
        shortest = next(
            flag.name[:n]
            for n in range(3, len(flag.name) + 1)
            if [o for o in options if o.startswith(flag.name[:n])] == [flag.name] or flag.name[:n] == flag.name
        )
        assert flag.shortest == shortest, flag.name


def test_rendered_lora_adapters_are_what_vllm_reads(parser: Any) -> None:
    """spec.model.adapters, rendered for a role, parse with vLLM's own parser into its LoRA settings."""
    from maru_operator.builders.group import build_role_deployment
    from tests.support.specs import GROUP_OWNER, container, group_spec, pool_view

    adapters = [{"name": "sql", "source": "/var/cache/maru/models/sql-lora"}, {"name": "chat", "source": "o/chat"}]
    spec = group_spec(model={"name": "m/x", "adapters": adapters})
    args = container(build_role_deployment(spec, "decode", GROUP_OWNER, pool_view()))["args"]
    parsed = parser.parse_args(args)
    assert parsed.enable_lora is True and parsed.max_loras == 2
    assert [(m.name, m.path) for m in parsed.lora_modules] == [
        ("sql", "/var/cache/maru/models/sql-lora"),
        ("chat", "o/chat"),
    ]
