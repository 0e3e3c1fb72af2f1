"""Writable directories of a vLLM container whose root filesystem is read-only.

vLLM 0.32 writes under ``$HOME`` (``~/.cache/vllm``: torch.compile and other caches; ``~/.config/vllm``:
usage stats; ``~/.cache/huggingface``: downloaded weights; ``~/.triton``; ``~/.cache/flashinfer``;
outlines' cache under ``$XDG_CACHE_HOME``) and under the temporary directory (``VLLM_RPC_BASE_PATH``,
torch inductor's default cache, Python's tempfiles). Each of those roots gets an emptyDir, and the
environment points every cache at them, whatever ``HOME`` the image sets: the image may run as
another user than the one the pod names (``runAsUser``), whose home would not be writable anyway.

The directories live as long as the pod, as the container's writable layer did before: a restarted
container keeps its downloads and compile caches, a new pod starts empty.
"""

from __future__ import annotations

from collections.abc import Collection

from maru_operator.builders.common import Object

HOME = "/home/maru"  # the vllm image's home (Dockerfile); any image works, the environment says where
TMP = "/tmp"
_DIRS = {"home": HOME, "tmp": TMP}

CACHE_ENV = {
    "HOME": HOME,
    "XDG_CACHE_HOME": f"{HOME}/.cache",
    "XDG_CONFIG_HOME": f"{HOME}/.config",
    "HF_HOME": f"{HOME}/.cache/huggingface",
    "TRITON_CACHE_DIR": f"{HOME}/.triton/cache",
    "TMPDIR": TMP,
}


def scratch_volumes() -> list[Object]:
    return [{"name": name, "emptyDir": {}} for name in _DIRS]


def scratch_mounts() -> list[Object]:
    return [{"name": name, "mountPath": path} for name, path in _DIRS.items()]


def scratch_env(taken: Collection[str]) -> list[Object]:
    """The cache locations, except those the user sets (theirs win, and a name may appear only once)."""
    return [{"name": k, "value": v} for k, v in CACHE_ENV.items() if k not in taken]
