"""Which weights an engine runs: a cheap, deterministic identity for the chunk keys.

The pool outlives pods, and a model's *name* does not pin its numbers: a path baked into an image
keeps its name when the image ships a new fine-tune, and an unset revision follows a moving ``main``.
So the keys carry an identity of the weights themselves, derived without reading them:

* a Hugging Face snapshot (``.../snapshots/<commit>/``, or a repo id whose revision the local
  cache resolves to a commit) is identified by that commit;
* any other directory by its weight files' names, sizes and modification times, plus the
  bytes of its small JSON files (config, checkpoint index, quantization config) and of its
  modelling code (the ``*.py`` files ``trust_remote_code`` runs).

Files are only listed and stat'ed, and small JSON and code files read: microseconds to milliseconds.
Two copies of one model made separately on two nodes get different identities unless their
modification times match (container images, ``cp -p`` and ``rsync -t`` keep them); that costs hits,
never correctness.
Pure module: standard library only.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack", ".h5")
# Custom modelling code shipped with the weights (``modeling_*.py``, ``configuration_*.py``), which
# ``trust_remote_code`` runs: a fix to its attention or rotary code changes the KV, not a weight file.
CODE_SUFFIXES = (".py",)
# Small files that change the numbers without changing a weight file: architecture (rope scaling,
# head counts), the checkpoint index, quantization parameters, and the modelling code; read whole.
SMALL_FILE_MAX_BYTES = 4 << 20
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def weights_identity(model: str, revision: str | None = None, *, cache_dir: str | None = None) -> str:
    """A short string that changes whenever the weights ``model`` names may have changed.

    ``model`` is a local directory or a Hugging Face repo id (then looked up in ``cache_dir`` or the
    default hub cache). Never raises: what cannot be resolved is named as such, so an unresolved
    model keeps working, keyed by its name and revision alone.
    """
    path = Path(model)
    if path.is_dir():
        return _directory_identity(path)
    snapshot = _cached_snapshot(model, revision, cache_dir)
    if snapshot is not None:
        return _directory_identity(snapshot)
    return f"unresolved:{model}@{revision or 'default'}"


def is_resolved(identity: str) -> bool:
    return not identity.startswith("unresolved:")


def _directory_identity(path: Path) -> str:
    resolved = path.resolve()
    commit = resolved.name if resolved.parent.name == "snapshots" and _COMMIT.match(resolved.name) else None
    digest = hashlib.blake2b(digest_size=16, person=b"maru-weights")
    for name, file in _model_files(resolved):
        try:
            st = file.stat()
        except OSError:
            continue
        digest.update(f"{name}\0".encode())
        if name.endswith((".json", *CODE_SUFFIXES)) and st.st_size <= SMALL_FILE_MAX_BYTES:
            digest.update(_read(file))
            continue
        digest.update(f"{st.st_size}\0".encode())
        if commit is None:
            # No commit to vouch for the bytes: a rewritten file changes its modification time.
            digest.update(str(st.st_mtime_ns).encode())
    label = f"commit:{commit}" if commit else "files"
    return f"{label}:{digest.hexdigest()}"


def _model_files(root: Path) -> list[tuple[str, Path]]:
    found = []
    for directory, subdirs, files in os.walk(root, followlinks=True):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
        for name in files:
            if name.endswith((*WEIGHT_SUFFIXES, ".json", *CODE_SUFFIXES)):
                file = Path(directory, name)
                found.append((file.relative_to(root).as_posix(), file))
    return sorted(found)


def _read(file: Path) -> bytes:
    try:
        raw = file.read_bytes()
    except OSError:
        return b""
    if not file.name.endswith(".json"):
        return raw
    try:
        # Key order and whitespace are not the numbers.
        return json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":")).encode()
    except ValueError:
        return raw


def _cached_snapshot(repo_id: str, revision: str | None, cache_dir: str | None) -> Path | None:
    """The local snapshot of ``repo_id`` at ``revision`` in a Hugging Face hub cache, if there is one."""
    if "/" not in repo_id or repo_id.startswith(("/", ".")):
        return None
    root = Path(cache_dir) if cache_dir else _default_hub_cache()
    repo = root / ("models--" + repo_id.replace("/", "--"))
    rev = revision or "main"
    commit = rev if _COMMIT.match(rev) else None
    if commit is None:
        try:
            commit = (repo / "refs" / rev).read_text().strip()
        except OSError:
            return None
    snapshot = repo / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def _default_hub_cache() -> Path:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var])
    hf_home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(hf_home) / "hub"
