"""Print the children the operator would create for given MaruPools and InferenceGroups, offline.

The same builders as the running operator, so what a reviewer (or a GitOps diff) sees is what the
cluster gets. Without a cluster there are no UIDs, so the ownerReferences are left out; a group is
rendered against the pool of the same name in the input (or as if its pool had the default settings).
Objects that name no image get the operator's defaults, moved by the same --image-* flags as ``run``.
The pools' key Secrets are rendered without data: a pool's key is made in the cluster (and the groups'
tokens are minted from it on the nodes, by the CSI node plugin).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import yaml

from maru_operator.api.common import API_VERSION
from maru_operator.api.inferencegroup import InferenceGroupSpec
from maru_operator.api.marupool import MaruPoolSpec
from maru_operator.builders.children import build_group_children
from maru_operator.builders.common import Owner
from maru_operator.builders.group import PoolView
from maru_operator.builders.inferencepool import build_inference_pool
from maru_operator.builders.netpol import (
    DEFAULT_NETWORK,
    NetworkPolicyConfig,
    build_group_policies,
    build_pool_policies,
)
from maru_operator.builders.pool import build_pool_children
from maru_operator.images import DEFAULT_IMAGES, ImageDefaults
from maru_operator.objects import Object
from maru_operator.validation import check_group


class RenderError(ValueError):
    pass


def load_documents(paths: Iterable[str | Path]) -> list[Object]:
    """Every YAML document in the files (directories: their *.yaml / *.yml files, sorted)."""
    docs: list[Object] = []
    for raw in paths:
        path = Path(raw)
        files = sorted([*path.glob("*.yaml"), *path.glob("*.yml")]) if path.is_dir() else [path]
        for file in files:
            docs += [d for d in yaml.safe_load_all(file.read_text()) if isinstance(d, dict)]
    return docs


def _stderr(message: str) -> None:
    print(f"maru-operator render: warning: {message}", file=sys.stderr)


def render_objects(
    docs: list[Object],
    pool_namespace: str,
    warn: Callable[[str], None] = _stderr,
    network: NetworkPolicyConfig = DEFAULT_NETWORK,
    images: ImageDefaults = DEFAULT_IMAGES,
) -> Iterator[Object]:
    ours = [d for d in docs if d.get("apiVersion") == API_VERSION]
    pools = {
        d["metadata"]["name"]: MaruPoolSpec.model_validate(d.get("spec") or {})
        for d in ours
        if d.get("kind") == "MaruPool"
    }
    for doc in ours:
        kind, meta = doc.get("kind"), doc.get("metadata") or {}
        owner = Owner(kind=str(kind), name=meta.get("name", ""), namespace=meta.get("namespace") or None)
        if kind == "MaruPool":
            yield from build_pool_children(images.for_pool(pools[owner.name]), owner, pool_namespace)
            yield from build_pool_policies(pools[owner.name], owner, pool_namespace, network)
        elif kind == "InferenceGroup":
            owner = Owner(kind="InferenceGroup", name=owner.name, namespace=owner.namespace or "default")
            spec = InferenceGroupSpec.model_validate(doc.get("spec") or {})
            errors = check_group(spec)
            if errors:
                raise RenderError(f"InferenceGroup {owner.namespace}/{owner.name}: " + "; ".join(map(str, errors)))
            pool_name = spec.pool_ref.name
            pool_spec = pools.get(pool_name)
            if pool_spec is None:
                warn(
                    f"MaruPool {pool_name} is not in the input: InferenceGroup {owner.namespace}/{owner.name} is "
                    "rendered as if the pool had the default socketDir and no nodeSelector"
                )
                pool_spec = MaruPoolSpec.model_validate({"backend": "shm", "size": "1Gi"})
            pool = PoolView(pool_name, pool_spec)
            yield from build_group_children(images.for_group(spec), owner, pool)
            yield from build_group_policies(spec, owner, pool, pool_namespace, network)
            # The cluster gets it only where the InferencePool CRD is installed; rendered as if it were.
            if (inference_pool := build_inference_pool(spec, owner)) is not None:
                yield inference_pool


def render(
    paths: Iterable[str | Path],
    pool_namespace: str,
    network: NetworkPolicyConfig = DEFAULT_NETWORK,
    images: ImageDefaults = DEFAULT_IMAGES,
) -> str:
    objects = list(render_objects(load_documents(paths), pool_namespace, network=network, images=images))
    return yaml.safe_dump_all(objects, sort_keys=False, width=120)
