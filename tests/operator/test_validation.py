"""Semantic checks the CRD schema cannot express: each names the field and says what to do."""

from __future__ import annotations

from maru_operator.validation import check_group, check_pool
from tests.operator.helpers import group_spec, pool_spec


def fields(spec) -> list[str]:  # type: ignore[no-untyped-def]
    return [e.field for e in check_group(spec)]


def test_a_good_spec_passes() -> None:
    spec = group_spec(prefill={"tensorParallelSize": 2, "resources": {"limits": {"nvidia.com/gpu": 2}}},
                      decode={"tensorParallelSize": 2, "extraArgs": ["--max-num-seqs=64"]})
    assert check_group(spec) == []


def test_more_ranks_than_gpus() -> None:
    spec = group_spec(prefill={"tensorParallelSize": 4, "resources": {"limits": {"nvidia.com/gpu": "2"}}},
                      decode={"tensorParallelSize": 4})
    errors = check_group(spec)
    assert [e.field for e in errors] == ["spec.prefill.tensorParallelSize"]
    assert "nvidia.com/gpu" in errors[0].message and "4" in errors[0].message


def test_hash_seed_override() -> None:
    spec = group_spec(decode={"env": [{"name": "PYTHONHASHSEED", "value": "42"}]})
    assert fields(spec) == ["spec.decode.env"]
    assert check_group(group_spec(decode={"env": [{"name": "PYTHONHASHSEED", "value": "0"}]})) == []


def test_tensor_parallel_mismatch() -> None:
    assert fields(group_spec(prefill={"tensorParallelSize": 2})) == ["spec.decode.tensorParallelSize"]


def test_kv_cache_dtype_on_one_role_only() -> None:
    spec = group_spec(prefill={"extraArgs": ["--kv-cache-dtype", "fp8"]},
                      decode={"extraArgs": ["--kv-cache-dtype=fp8"]})
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
