"""Which weights an engine runs: a cheap, deterministic identity for the chunk keys.

The pool outlives pods, and a model's *name* does not pin its numbers: a path baked into an image
keeps its name when the image ships a new fine-tune, and an unset revision follows a moving ``main``.
So the keys carry an identity of the weights themselves, derived without reading them:

* a Hugging Face snapshot (``.../snapshots/<commit>/``, or a repo id whose revision the local
  cache resolves to a commit) is identified by that commit;
* any other directory by its weight files' names, sizes and modification times, plus the
  bytes of its small JSON files (config, checkpoint index, quantization config) and of its
  modelling code (the ``*.py`` files ``trust_remote_code`` runs).

Weights the loader streams from object storage (``s3://``, ``gs://``, ``az://``: vLLM then pulls only
the config and code into a local directory) or reads from a tensorizer file are not in that directory,
and an object store's URI keeps its name when new weights are written there: such weights are
*unresolved* unless something the user gives pins them (:func:`remote_weights_problem`). A tensorizer
file on a local disk is identified like a weight file.

LoRA adapters are weights too: vLLM's block hashes carry an adapter's name and path, not its numbers,
so :func:`adapter_identity` identifies the adapter's files the same way.

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
from typing import Any

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack", ".h5")
# Custom modelling code shipped with the weights (``modeling_*.py``, ``configuration_*.py``), which
# ``trust_remote_code`` runs: a fix to its attention or rotary code changes the KV, not a weight file.
CODE_SUFFIXES = (".py",)
# Small files that change the numbers without changing a weight file: architecture (rope scaling,
# head counts), the checkpoint index, quantization parameters, and the modelling code; read whole.
SMALL_FILE_MAX_BYTES = 4 << 20
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
# Where a loader may read weights that no local file stands for: vLLM's object-storage schemes
# (transformers_utils.runai_utils) and the URLs tensorizer streams from.
REMOTE_SCHEMES = ("s3://", "gs://", "az://", "http://", "https://")


def weights_identity(model: str, revision: str | None = None, *, cache_dir: str | None = None, source: str = "") -> str:
    """A short string that changes whenever the weights ``model`` names may have changed.

    ``model`` is a local directory or a Hugging Face repo id (then looked up in ``cache_dir`` or the
    default hub cache). ``source`` is where the loader really reads the weights when that is not
    ``model``'s files: the object-storage URI vLLM streams them from, or a tensorizer file. Never
    raises: what cannot be resolved is named as such, so an unresolved model keeps working, keyed by
    its name and revision alone (see :func:`remote_weights_problem` for when that is not enough).
    """
    if source and is_remote(source):
        return _unresolved(source, revision)
    identity = _model_identity(model, revision, cache_dir)
    if not source or not is_resolved(identity):
        return identity
    weights = Path(source)
    if weights.is_file():
        return f"{identity}+{_file_identity(weights)}"
    if weights.is_dir():
        return f"{identity}+{_directory_identity(weights)}"
    return _unresolved(source, revision)


def _model_identity(model: str, revision: str | None, cache_dir: str | None) -> str:
    path = Path(model)
    if path.is_dir():
        return _directory_identity(path)
    snapshot = _cached_snapshot(model, revision, cache_dir)
    return _directory_identity(snapshot) if snapshot is not None else _unresolved(model, revision)


def _unresolved(name: str, revision: str | None) -> str:
    return f"unresolved:{name}@{revision or 'default'}"


def is_resolved(identity: str) -> bool:
    return not identity.startswith("unresolved:")


def is_remote(uri: str) -> bool:
    return uri.lower().startswith(REMOTE_SCHEMES)


def loader_source(model_weights: str, load_format: str, loader_config: Any) -> str:
    """Where vLLM's loader reads the weights when the model directory does not hold them, else "".

    ``model_weights`` is vLLM's ``ModelConfig.model_weights`` (set to the object-storage URI when
    the model was given as one; ``model`` is then a local directory with the config alone); a
    ``tensorizer`` load reads ``tensorizer_uri`` (or ``<tensorizer_dir>/model.tensors``).
    """
    if model_weights and is_remote(model_weights):
        return model_weights
    if load_format != "tensorizer":
        return ""
    uri, directory = _option(loader_config, "tensorizer_uri"), _option(loader_config, "tensorizer_dir")
    return uri or (f"{directory.rstrip('/')}/model.tensors" if directory else "")


def remote_weights_problem(identity: str, revision: str, cache_namespace: str) -> str | None:
    """Why chunk keys could not tell these weights from the next ones at the same URI, or None.

    New weights uploaded to the same ``s3://`` prefix (or tensorizer URI) keep every name the keys
    can see, so their engines would load KV computed by the old weights: wrong numbers, no error.
    A revision (the objects' ETag or version id, or any label the deployment changes with them) or
    a ``maru_cache_namespace`` given to each version tells them apart.
    """
    if is_resolved(identity) or revision or cache_namespace:
        return None
    source = identity.removeprefix("unresolved:").rsplit("@", 1)[0]
    if not is_remote(source):
        return None
    return (
        f"the weights are read from {source}, which keeps its name when new weights are written there, so "
        "chunk keys cannot tell two versions apart; pin them with --revision (the objects' ETag or version id) "
        "or give each version its own maru_cache_namespace in --kv-transfer-config"
    )


def adapter_identity(lora_request: Any) -> str:
    """The identity of a LoRA adapter's weights ("" for a request without one).

    Taken when the engine first meets the adapter (vLLM loads it then and keeps it loaded under its
    id), and again whenever the request asks vLLM to reload it in place.
    """
    if lora_request is None:
        return ""
    path = str(getattr(lora_request, "lora_path", "") or "")
    key = (str(getattr(lora_request, "lora_name", "")), int(getattr(lora_request, "lora_int_id", 0) or 0), path)
    identity = _ADAPTERS.get(key)
    if identity is None or getattr(lora_request, "load_inplace", False):
        if len(_ADAPTERS) >= _MAX_ADAPTERS:
            _ADAPTERS.pop(next(iter(_ADAPTERS)))
        identity = _ADAPTERS[key] = f"lora:{key[0]}:{weights_identity(path) if path else _unresolved('', None)}"
    return identity


# (lora_name, lora_int_id, lora_path) -> identity, as first seen; oldest dropped first.
_ADAPTERS: dict[tuple[str, int, str], str] = {}
_MAX_ADAPTERS = 1024


def _option(config: Any, key: str) -> str:
    value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
    return str(value) if value else ""


def _file_identity(file: Path) -> str:
    """A single weights file (a tensorizer archive): its name, size and modification time."""
    st = file.stat()
    digest = hashlib.blake2b(digest_size=16, person=b"maru-weights")
    digest.update(f"{file.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return f"file:{digest.hexdigest()}"


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
