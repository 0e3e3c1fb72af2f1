"""The images the operator puts in the pods of MaruPools and InferenceGroups that name none.

A MaruPool's ``spec.daemon.image`` and an InferenceGroup's ``spec.image`` and ``spec.router.image`` are
optional: unset, the operator's configured defaults apply. One registry (``--image-registry``, the chart's
``images.registry``) moves every default at once, so a cluster that pulls from a private mirror needs no
image in any object; an image an object names still wins. The default tag is the operator's own version,
which is the chart's appVersion, so the operator, the pool daemons and vLLM move together; the router
image keeps the version of the vllm-router it packages.

The names are those the Dockerfile's targets are built and released under (``make images``,
.github/workflows/release.yml); tests keep the three in step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from maru_operator import __version__

if TYPE_CHECKING:
    from maru_operator.api.inferencegroup import InferenceGroupSpec
    from maru_operator.api.marupool import MaruPoolSpec

DEFAULT_REGISTRY = "ghcr.io/maru-pd"
POOL_NAME = "maru-pool"  # the Dockerfile's `pool` target
VLLM_NAME = "vllm-maru"  # the Dockerfile's `vllm` target
ROUTER_NAME = "vllm-router"  # the Dockerfile's `router` target
ROUTER_VERSION = "0.1.17"  # the vllm-router release the router target packages

# A registry host (optionally with a port) and path, lower case as image references require; no scheme, no tag.
REGISTRY_PATTERN = r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?(:[0-9]+)?(/[a-z0-9]+([._-]+[a-z0-9]+)*)*"
TAG_PATTERN = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"


@dataclass(frozen=True)
class ImageDefaults:
    """What the operator's flags say; each ``*_image`` property is what an object without an image gets."""

    registry: str = DEFAULT_REGISTRY
    tag: str = __version__
    # Whole references that replace <registry>/<name>:<tag> for one image; empty: derived.
    pool: str = ""
    vllm: str = ""
    router: str = ""

    @property
    def pool_image(self) -> str:
        return self.pool or f"{self.registry}/{POOL_NAME}:{self.tag}"

    @property
    def vllm_image(self) -> str:
        return self.vllm or f"{self.registry}/{VLLM_NAME}:{self.tag}"

    @property
    def router_image(self) -> str:
        return self.router or f"{self.registry}/{ROUTER_NAME}:{ROUTER_VERSION}"

    def for_pool(self, spec: MaruPoolSpec) -> MaruPoolSpec:
        """The spec as the builders see it: the pool image filled in when the object names none."""
        if spec.daemon.image:
            return spec
        return spec.model_copy(update={"daemon": spec.daemon.model_copy(update={"image": self.pool_image})})

    def for_group(self, spec: InferenceGroupSpec) -> InferenceGroupSpec:
        """The spec as the builders see it: the vLLM and router images filled in when the object names none."""
        update: dict[str, object] = {}
        if not spec.image:
            update["image"] = self.vllm_image
        if not spec.router.image:
            update["router"] = spec.router.model_copy(update={"image": self.router_image})
        return spec.model_copy(update=update) if update else spec


def check_registry(text: str) -> str:
    """``text`` without a trailing slash; ValueError naming the rule when it is not a registry path."""
    registry = text.rstrip("/")
    if not re.fullmatch(REGISTRY_PATTERN, registry):
        raise ValueError(
            f"{text!r} is not a registry path such as registry.example.com/maru or localhost:5000 "
            "(lower case, no scheme such as https://, no tag)"
        )
    return registry


def check_tag(text: str) -> str:
    if not re.fullmatch(TAG_PATTERN, text):
        raise ValueError(
            f"{text!r} is not an image tag (letters, digits, '_', '.', '-'; at most 128; not starting with '.' or '-')"
        )
    return text


def check_reference(text: str) -> str:
    """A whole image reference: no whitespace, no scheme; the registry resolves the rest."""
    if not text or re.search(r"\s", text) or "://" in text:
        raise ValueError(f"{text!r} is not an image reference such as registry.example.com/maru/maru-pool:0.1.0")
    return text


DEFAULT_IMAGES = ImageDefaults()
# Out of the box (no flags): what the Dockerfile's targets are released as.
DEFAULT_POOL_IMAGE = DEFAULT_IMAGES.pool_image
DEFAULT_VLLM_IMAGE = DEFAULT_IMAGES.vllm_image
DEFAULT_ROUTER_IMAGE = DEFAULT_IMAGES.router_image
