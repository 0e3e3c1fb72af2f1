"""Which default images an object's data plane runs, and when that moves.

The pool, vLLM and router images an object does not name come from the operator (its version, or
``--image-*``). Without this module an operator upgrade would change every pool DaemonSet, vLLM Deployment and
router at once: each node's shm cache dropped, every engine restarted, the whole fleet in one go. Instead, a
default image keeps running at the tag its children already run until the user opts in: for one object with the
annotation ``maru.io/data-plane-updates: auto``, or for the fleet with ``--data-plane-updates auto`` (a group's
move is a pod template change, so ``--max-rolling-groups`` paces it). A moved registry (``--image-registry``)
or an image the object names itself is the user's own change and applies at once.

Level-triggered: what runs is read off the live children, so nothing is remembered between reconciles and a
restored or re-adopted object behaves the same.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any, Literal

from maru_operator.images import ImageDefaults

log = logging.getLogger("maru_operator.dataplane")

UPDATES_ANNOTATION = "maru.io/data-plane-updates"
Updates = Literal["manual", "auto"]
UPDATES: tuple[Updates, ...] = ("manual", "auto")
Slot = Literal["pool", "vllm", "router"]


def repository(image: str) -> str:
    """``image`` without its tag or digest: registry and path."""
    name = image.split("@", 1)[0]
    slash, colon = name.rfind("/"), name.rfind(":")
    return name[:colon] if colon > slash else name


def updates_of(meta: Mapping[str, Any], fleet: Updates) -> Updates:
    """The object's own choice (its annotation, when it is one of :data:`UPDATES`), else the fleet's."""
    value = (meta.get("annotations") or {}).get(UPDATES_ANNOTATION)
    return value if value in UPDATES else fleet


def pinned(defaults: ImageDefaults, running: Mapping[Slot, str | None], updates: Updates) -> ImageDefaults:
    """``defaults`` with each slot's image held at what already runs, unless ``updates`` is auto.

    Held: a running image of the default's repository at another tag (or digest). Anything else (nothing
    running yet, another repository) takes the default.
    """
    if updates == "auto":
        return defaults
    current = {"pool": defaults.pool_image, "vllm": defaults.vllm_image, "router": defaults.router_image}
    held = {
        slot: image
        for slot, image in running.items()
        if image and image != current[slot] and repository(image) == repository(current[slot])
    }
    return dataclasses.replace(defaults, **held) if held else defaults


def held_back(defaults: ImageDefaults, used: ImageDefaults) -> dict[Slot, tuple[str, str]]:
    """slot -> (image kept, the default it is held from), for the slots :func:`pinned` held."""
    out: dict[Slot, tuple[str, str]] = {}
    for slot in ("pool", "vllm", "router"):
        kept, default = getattr(used, f"{slot}_image"), getattr(defaults, f"{slot}_image")
        if kept != default:
            out[slot] = (kept, default)
    return out


def container_image(
    obj: Mapping[str, Any] | None, *, name: str | None = None, command: str | None = None
) -> str | None:
    """The image of ``obj``'s first pod-template container called ``name`` (or running ``command``)."""
    if not obj:
        return None
    for container in obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers") or []:
        if (name is None or container.get("name") == name) and (
            command is None or (container.get("command") or [None])[0] == command
        ):
            return container.get("image")
    return None


@dataclasses.dataclass
class DataPlane:
    """The operator's default images and the fleet's update choice; says once per object what it holds back."""

    defaults: ImageDefaults
    fleet_updates: Updates = "manual"
    # object -> what was last said about it (nothing held: absent)
    _said: dict[Any, dict[Slot, tuple[str, str]]] = dataclasses.field(default_factory=dict)

    def images_for(
        self, key: tuple[str, str, str], meta: Mapping[str, Any], running: Mapping[Slot, str | None]
    ) -> ImageDefaults:
        used = pinned(self.defaults, running, updates_of(meta, self.fleet_updates))
        held = held_back(self.defaults, used)
        if held and self._said.get(key) != held:
            kind, namespace, name = key
            where = f"{namespace}/{name}" if namespace else name
            log.info(
                "%s %s keeps its data plane: %s; annotate it %s=auto (or run the operator with "
                "--data-plane-updates auto) to move it",
                kind,
                where,
                "; ".join(f"{kept} (default now {default})" for kept, default in held.values()),
                UPDATES_ANNOTATION,
                extra={"object": f"{kind}/{where}", "reason": "DataPlaneHeld"},
            )
        if held:
            self._said[key] = held
        else:
            self._said.pop(key, None)
        return used
