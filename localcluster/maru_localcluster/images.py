"""A container image as the kubelet runs it, and Kubernetes' rules for a container's command.

Images come from this machine's image storage (``imagestore``: buildah's, where ``make images`` puts
them); an :class:`Image` is what a runtime reads from one's config. There is no other source: a pod that
names an image the storage lacks fails to pull, as on a node without a registry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from maru_localcluster.defaults import JsonObj


class ImageNotFound(LookupError):
    """No such image here: what ErrImagePull is on a real node."""


@dataclasses.dataclass(frozen=True)
class Image:
    repository: str  # the reference the pod named
    image_id: str  # sha256:<the config's hash>, as the kubelet reports it
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    workdir: str = "/"
    # The config's USER as written; resolved against the image's own /etc/passwd when a container starts.
    user: str = ""
    uid: int = 0
    gid: int = 0
    description: str = ""


def container_argv(container: JsonObj, image: Image) -> list[str]:
    """Kubernetes' rule: ``command`` replaces the entrypoint (and drops the image's cmd), ``args`` the cmd."""
    command = container.get("command")
    args = container.get("args")
    if command:
        return [*command, *(args or [])]
    return [*image.entrypoint, *(image.cmd if args is None else args)]


def expand(text: str, env: Mapping[str, str]) -> str:
    """``$(VAR)`` references, as the kubelet expands them in command, args and env values; ``$$`` escapes."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("$(", i) and (end := text.find(")", i)) != -1:
            name = text[i + 2 : end]
            out.append(env[name] if name in env else text[i : end + 1])
            i = end + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)
