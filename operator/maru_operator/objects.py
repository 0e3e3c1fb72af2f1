"""What every operator module passes around: a Kubernetes object as the API server's JSON, and its identity."""

from __future__ import annotations

from typing import Any

Object = dict[str, Any]
Key = tuple[str, str, str]  # (kind, namespace or "", name)


def key_of(obj: Object) -> Key:
    """(kind, namespace, name): how the cache stores objects and how children are matched between desired and
    actual. A cluster-scoped object's namespace is ""."""
    meta = obj.get("metadata", {})
    return obj.get("kind", ""), meta.get("namespace") or "", meta.get("name", "")
