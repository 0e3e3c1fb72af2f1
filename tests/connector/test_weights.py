"""The weights identity in chunk keys: cheap, deterministic, and different when the numbers may be."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from maru_connector.weights import is_resolved, weights_identity

COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


def model_dir(root: Path, name: str = "model") -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"hidden_size": 256, "rope_theta": 10000.0}')
    (path / "model-00001-of-00002.safetensors").write_bytes(b"\x01" * 4096)
    (path / "model-00002-of-00002.safetensors").write_bytes(b"\x02" * 2048)
    (path / "model.safetensors.index.json").write_text('{"metadata": {"total_size": 6144}}')
    return path


def test_a_directory_is_identified_the_same_way_every_time_and_by_a_faithful_copy(tmp_path: Path) -> None:
    path = model_dir(tmp_path)
    first = weights_identity(str(path))
    assert first == weights_identity(str(path)) and first.startswith("files:")
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)  # copy2: the times come along, as in an image or with cp -p
    assert weights_identity(str(copy)) == first


def test_rewritten_weights_at_the_same_path_change_the_identity(tmp_path: Path) -> None:
    """A new fine-tune shipped at a fixed path: same names, same sizes, new bytes."""
    path = model_dir(tmp_path)
    before = weights_identity(str(path))
    shard = path / "model-00002-of-00002.safetensors"
    stat = shard.stat()
    shard.write_bytes(b"\x03" * 2048)
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert weights_identity(str(path)) != before


def test_config_changes_change_the_identity_but_json_formatting_does_not(tmp_path: Path) -> None:
    path = model_dir(tmp_path)
    before = weights_identity(str(path))
    config = path / "config.json"
    stat = config.stat()
    config.write_text('{\n  "rope_theta": 10000.0,\n  "hidden_size": 256\n}')
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights_identity(str(path)) == before
    config.write_text('{"hidden_size": 256, "rope_theta": 500000.0}')
    assert weights_identity(str(path)) != before


def test_a_hub_snapshot_is_identified_by_its_commit(tmp_path: Path) -> None:
    repo = tmp_path / "hub" / "models--org--model"
    for commit in (COMMIT_A, COMMIT_B):
        model_dir(repo / "snapshots", commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT_A)
    cache = str(tmp_path / "hub")
    at_main = weights_identity("org/model", None, cache_dir=cache)
    assert at_main.startswith(f"commit:{COMMIT_A}:")
    assert weights_identity("org/model", "main", cache_dir=cache) == at_main
    assert weights_identity("org/model", COMMIT_A, cache_dir=cache) == at_main
    assert weights_identity(str(repo / "snapshots" / COMMIT_A)) == at_main
    # main moved: an unpinned revision now means other weights.
    (repo / "refs" / "main").write_text(COMMIT_B)
    assert weights_identity("org/model", None, cache_dir=cache).startswith(f"commit:{COMMIT_B}:")


def test_what_cannot_be_resolved_says_so(tmp_path: Path) -> None:
    identity = weights_identity("org/absent", "v1", cache_dir=str(tmp_path))
    assert identity == "unresolved:org/absent@v1" and not is_resolved(identity)
    assert is_resolved(weights_identity(str(model_dir(tmp_path))))


def test_custom_modelling_code_is_part_of_the_identity(tmp_path: Path) -> None:
    """trust_remote_code runs the model directory's own *.py: a fix to it changes the KV, not a weight file."""
    path = model_dir(tmp_path)
    code = path / "modeling_tiny.py"
    code.write_text("def rotary(x):\n    return x * 1.0\n")
    before = weights_identity(str(path))
    stat = code.stat()
    code.write_text("def rotary(x):\n    return x * 2.0\n")  # same size, same time: only the bytes say it
    os.utime(code, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights_identity(str(path)) != before
    # Equally in a hub snapshot, where the commit would name a changed file anyway.
    snapshot = model_dir(tmp_path / "hub" / "snapshots", COMMIT_A)
    (snapshot / "modeling_tiny.py").write_text("A = 1\n")
    first = weights_identity(str(snapshot))
    (snapshot / "modeling_tiny.py").write_text("A = 2\n")
    assert weights_identity(str(snapshot)) != first
