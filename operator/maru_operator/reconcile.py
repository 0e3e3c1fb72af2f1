"""Desired versus actual: what, if anything, must be written to make a child match its builder.

An object is up to date when the desired object is a *subset* of the actual one, field by field:
the API server adds defaults (``terminationMessagePath``, ``clusterIP``, ``revisionHistoryLimit``...)
and other controllers add annotations, and neither must cause a write. Reconciling an unchanged
object therefore sends nothing. When something differs, the whole desired object is sent as a JSON
merge patch: maps merge (others' keys survive), lists are replaced by ours (our containers, our args).
"""

from __future__ import annotations

from typing import Any

from maru_operator.quantity import same_quantity

# Keys the operator never compares: the API server owns them.
_IGNORED_TOP = {"status"}
_IGNORED_META = {"resourceVersion", "uid", "generation", "creationTimestamp", "managedFields", "selfLink"}


def _empty(value: Any) -> bool:
    return value is None or value == {} or value == [] or value == "" or value is False


def is_subset(desired: Any, actual: Any, path: str = "") -> str | None:
    """None when ``desired`` ⊆ ``actual``; else the path of the first difference (for the log)."""
    if isinstance(desired, dict):
        if not isinstance(actual, dict):
            return path or "."
        for key, want in desired.items():
            if path == "" and key in _IGNORED_TOP:
                continue
            if path == ".metadata" and key in _IGNORED_META:
                continue
            if key not in actual:
                # Go drops empty maps, lists, strings and false on the way back; absent equals empty.
                if _empty(want):
                    continue
                return f"{path}.{key}"
            found = is_subset(want, actual[key], f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(desired, list):
        if not isinstance(actual, list) or len(desired) != len(actual):
            return path
        for i, (want, have) in enumerate(zip(desired, actual, strict=True)):
            found = is_subset(want, have, f"{path}[{i}]")
            if found:
                return found
        return None
    if desired == actual and type(desired) is type(actual):
        return None
    if isinstance(desired, bool) or isinstance(actual, bool):
        return path  # equal bools of the same type returned above; True is not 1
    # Quantities come back normalised (``1`` for 1, ``1Gi`` stays, ``0.5`` becomes ``500m``).
    if str(desired) == str(actual) or same_quantity(desired, actual):
        return None
    return path


def patch_for(desired: dict[str, Any], actual: dict[str, Any] | None) -> dict[str, Any] | None:
    """The merge patch that makes ``actual`` match ``desired``; None when nothing needs writing."""
    if actual is None:
        raise ValueError("patch_for needs an actual object; create missing ones")
    if is_subset(desired, actual) is None:
        return None
    patch = {k: v for k, v in desired.items() if k not in ("apiVersion", "kind", "status")}
    meta = dict(patch.get("metadata", {}))
    meta.pop("name", None)
    meta.pop("namespace", None)
    patch["metadata"] = meta
    return patch


def key_of(obj: dict[str, Any]) -> tuple[str, str, str]:
    """(kind, namespace, name): how children are matched between desired and actual."""
    meta = obj.get("metadata", {})
    return obj.get("kind", ""), meta.get("namespace") or "", meta.get("name", "")


def plan(desired: list[dict[str, Any]], actual: dict[tuple[str, str, str], dict[str, Any]]) -> tuple[
    list[dict[str, Any]], list[tuple[dict[str, Any], dict[str, Any]]], list[dict[str, Any]]
]:
    """(to create, (desired, merge patch) to update, actual objects to delete)."""
    creates, updates = [], []
    wanted = set()
    for obj in desired:
        key = key_of(obj)
        wanted.add(key)
        have = actual.get(key)
        if have is None:
            creates.append(obj)
            continue
        patch = patch_for(obj, have)
        if patch is not None:
            updates.append((obj, patch))
    deletes = [obj for key, obj in actual.items() if key not in wanted]
    return creates, updates, deletes
