"""Semantic checks the CRD schema cannot express: each names the field and says what to do."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from maru_operator.validation import check_group, check_pool
from tests.support.specs import group_spec, pool_spec


def fields(spec) -> list[str]:  # type: ignore[no-untyped-def]
    return [e.field for e in check_group(spec)]


def test_a_good_spec_passes() -> None:
    spec = group_spec(
        prefill={"tensorParallelSize": 2, "resources": {"limits": {"nvidia.com/gpu": 2}}},
        decode={"tensorParallelSize": 2, "extraArgs": ["--max-num-seqs=64"]},
    )
    assert check_group(spec) == []


def test_more_ranks_than_gpus() -> None:
    spec = group_spec(
        prefill={"tensorParallelSize": 4, "resources": {"limits": {"nvidia.com/gpu": "2"}}},
        decode={"tensorParallelSize": 4},
    )
    errors = check_group(spec)
    assert [e.field for e in errors] == ["spec.prefill.tensorParallelSize"]
    assert "nvidia.com/gpu" in errors[0].message and "4" in errors[0].message


def test_hash_seed_override() -> None:
    spec = group_spec(decode={"env": [{"name": "PYTHONHASHSEED", "value": "42"}]})
    assert fields(spec) == ["spec.decode.env"]
    assert check_group(group_spec(decode={"env": [{"name": "PYTHONHASHSEED", "value": "0"}]})) == []


def test_prefill_and_decode_may_differ_in_tensor_parallel_size() -> None:
    """Chunks are keyed by KV-head range and re-sharded on load: any two sizes vLLM starts with work."""
    for prefill, decode in ((2, 1), (1, 2), (4, 2), (2, 8), (2, 3)):
        spec = group_spec(prefill={"tensorParallelSize": prefill}, decode={"tensorParallelSize": decode})
        assert check_group(spec) == [], (prefill, decode)


def test_kv_cache_dtype_on_one_role_only() -> None:
    spec = group_spec(
        prefill={"extraArgs": ["--kv-cache-dtype", "fp8"]}, decode={"extraArgs": ["--kv-cache-dtype=fp8"]}
    )
    assert check_group(spec) == []
    errors = check_group(group_spec(prefill={"extraArgs": ["--kv-cache-dtype=fp8"]}))
    assert [e.field for e in errors] == ["spec.decode.extraArgs"]
    assert "--kv-cache-dtype" in errors[0].message


def test_chunk_not_multiple_of_block() -> None:
    # The CRD's CEL rule rejects this at admission; the operator checks again for servers without CEL.
    spec = group_spec()
    spec.connector.__dict__["chunk_tokens"] = 100
    assert fields(spec) == ["spec.connector.chunkTokens"]


def test_socket_path_too_long() -> None:
    errors = check_pool(pool_spec(daemon={"socketDir": "/" + "d" * 100}), "pool")
    assert [e.field for e in errors] == ["spec.daemon.socketDir"]
    assert check_pool(pool_spec(), "p" * 253) == []


def test_pool_daemon_memory_below_what_the_pool_needs() -> None:
    # The shm pool file (size + header) is charged to the agent: a smaller limit is an OOM kill.
    (error,) = check_pool(pool_spec(size="4Gi", daemon={"resources": {"limits": {"memory": "4Gi"}}}), "pool")
    assert error.field == "spec.daemon.resources.limits.memory"
    assert "4Gi is less than the pool daemon needs" in error.message
    assert check_pool(pool_spec(size="4Gi", daemon={"resources": {"requests": {"memory": "5Gi"}}}), "pool") == []
    assert check_pool(pool_spec(size="4Gi"), "pool") == []


# --- flags as vLLM's own parser reads them -------------------------------------------------------------

OWNED_SPELLINGS = [
    ["-tp", "2"],
    ["-tp=2"],
    ["-t", "2"],
    ["--tensor_parallel_size", "2"],
    ["--tensor-parallel=2"],
    ["--kv_transfer_config={}"],
    ["--kv-transfer-config.kv_role=kv_both"],
    ["--kv-transfer-config.kv_role", "kv_both"],
    ["--kv-transfer={}"],
    ["--served_model_name", "x"],
    ["--block_size=32"],
    ["--port", "9000"],
]


@pytest.mark.parametrize("args", OWNED_SPELLINGS, ids=[" ".join(a) for a in OWNED_SPELLINGS])
def test_operator_owned_flags_in_any_spelling(args: list[str]) -> None:
    with pytest.raises(ValidationError) as caught:
        group_spec(decode={"extraArgs": args})
    assert "extraArgs" in str(caught.value) and args[0] in str(caught.value)


@pytest.mark.parametrize(
    ("prefill", "decode"),
    [
        (["-q", "fp8"], []),
        (["-qfp8"], ["--quantization=awq"]),
        (["--kv_cache_dtype=fp8"], []),
    ],
)
def test_kv_layout_flags_in_any_spelling_must_agree(prefill: list[str], decode: list[str]) -> None:
    spec = group_spec(prefill={"extraArgs": prefill}, decode={"extraArgs": decode})
    assert fields(spec) == ["spec.decode.extraArgs"]


def test_the_same_setting_spelled_differently_agrees() -> None:
    spec = group_spec(
        prefill={"extraArgs": ["-q", "fp8", "--kv-cache-dtype", "fp8"]},
        decode={"extraArgs": ["--quantization=fp8", "--kv_cache_dtype=fp8"]},
    )
    assert check_group(spec) == []
    # Flags that merely share a prefix are other flags.
    assert check_group(group_spec(prefill={"extraArgs": ["--kv-cache-dtype-skip-layers", "0"]})) == []
    group_spec(decode={"extraArgs": ["--model-impl", "vllm", "--max-num-seqs=8", "-O3"]})  # accepted


# --- what users put in their pods ---------------------------------------------------------------------


def test_hash_seed_from_a_secret_is_refused() -> None:
    env = [{"name": "PYTHONHASHSEED", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]
    assert fields(group_spec(prefill={"env": env})) == ["spec.prefill.env"]


def test_pod_fields_kubernetes_would_refuse_later() -> None:
    spec = group_spec(
        decode={
            "volumes": [{"name": "a", "emptyDir": {}}, {"name": "a", "emptyDir": {}}],
            "volumeMounts": [{"name": "a", "mountPath": "/x"}, {"name": "a", "mountPath": "/x/"}],
            "podLabels": {"bad key!": "v"},
            "strategy": {"rollingUpdate": {"maxSurge": 0, "maxUnavailable": "0%"}},
        }
    )
    assert sorted(fields(spec)) == [
        "spec.decode.podLabels",
        "spec.decode.strategy.rollingUpdate",
        "spec.decode.volumeMounts",
        "spec.decode.volumes",
    ]


def test_a_volume_over_the_pool_socket_is_refused() -> None:
    from maru_operator.validation import check_group_on_pool
    from tests.support.specs import pool_view

    for path in ("/run/maru/pool", "/run/maru", "/run/maru/pool/sub"):
        spec = group_spec(
            prefill={"volumes": [{"name": "v", "emptyDir": {}}], "volumeMounts": [{"name": "v", "mountPath": path}]}
        )
        assert [e.field for e in check_group_on_pool(spec, pool_view())] == ["spec.prefill.volumeMounts"], path
    ok = group_spec(
        prefill={
            "volumes": [{"name": "v", "emptyDir": {}}],
            "volumeMounts": [{"name": "v", "mountPath": "/run/maru-cache"}],
        }
    )
    assert check_group_on_pool(ok, pool_view()) == []


@pytest.mark.parametrize(
    ("adapters", "says"),
    [
        ([{"name": "a", "source": "p"}, {"name": "a", "source": "q"}], "the name 'a' is used twice"),
        ([{"name": "x", "source": "p"}], "the served model's name"),
        ([{"name": "a=b", "source": "p"}], "adapters.0.name"),
        ([{"name": "a", "source": "two words"}], "adapters.0.source"),
        ([{"name": "a"}], "adapters.0.source"),
    ],
)
def test_bad_lora_adapters_are_refused_naming_the_field(adapters: list[dict[str, str]], says: str) -> None:
    with pytest.raises(ValidationError) as err:
        group_spec(model={"name": "m/x", "servedModelName": "x", "adapters": adapters})
    assert says in str(err.value)
