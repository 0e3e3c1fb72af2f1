"""Desired versus actual: whether a child must be applied, and what ownership says about it.

Children are written with server-side apply under one field manager: the API server merges the
desired object in, and removes the fields this manager applied before and no longer sets, while
fields a user or another controller set stay theirs. This module decides, without I/O, when an
apply is needed, so a converged object is never written:

* the desired object is not a *subset* of the actual one (the server adds defaults such as
  ``terminationMessagePath`` and others add annotations: neither is a difference), or
* the manager still owns a field (``metadata.managedFields``) that the desired object no longer sets:
  the apply that removes it is due, or
* the manager owns a list or map *whole* (an atomic one: a NetworkPolicy's rules, a nodeSelector) and
  it holds more than the desired value: an atomic value is replaced as a whole, so a rule that lost a
  part is a change, where for other lists the subset test is right.

A child is made with a plain create, so its fields start out owned by an update entry of the manager, which
no apply ever removes. They become applied ones (are *adopted*) lazily, right before the first apply the
child needs: until then the create's annotation :data:`CREATED_FIELDS_ANNOTATION` says which fields the
operator set, and a desired object that sets other ones (a field the spec dropped) is the change that
adopts them and applies.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Iterator
from typing import Any

from maru_operator.objects import Key, Object, key_of
from maru_operator.quantity import same_quantity

FIELD_MANAGER = "maru-operator"
# On a child the operator created and has not applied to since: a digest of which fields the create set (not
# their values). kube-apiserver records the server's defaults as the creator's fields too, so the create's
# managedFields entry alone cannot tell a field the spec dropped from a default; the first apply removes it.
CREATED_FIELDS_ANNOTATION = "maru.io/created-fields"


# Keys the operator never compares: the API server owns them.
_IGNORED_TOP = {"status"}
_IGNORED_META = {"resourceVersion", "uid", "generation", "creationTimestamp", "managedFields", "selfLink"}
# List-map keys the API server defaults when an item leaves them out (ports' protocol).
_KEY_DEFAULTS = {"protocol": "TCP"}


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


# --- managedFields ------------------------------------------------------------------------------------
#
# A manager's fields are a FieldsV1 tree; every question below is answered in one walk of that tree beside
# the desired (and the actual) object, never by looking each leaf up from the root again: a converged
# Deployment has hundreds of leaves.

_ABSENT = object()


@functools.lru_cache(maxsize=8192)
def _item_key(rest: str) -> tuple[tuple[str, Any], ...]:
    """A ``k:`` step's key fields (parsed once: the same few keys recur on every child)."""
    return tuple(json.loads(rest).items())


@functools.lru_cache(maxsize=8192)
def _set_member(rest: str) -> Any:
    return json.loads(rest)


def _step(node: Any, part: str) -> Any:
    """The value one FieldsV1 step (``f:``, ``k:``, ``v:``, ``.``) names under ``node``, or ``_ABSENT``."""
    kind, _, rest = part.partition(":")
    if kind == "f":
        return node[rest] if isinstance(node, dict) and rest in node else _ABSENT
    if kind == "k":
        if not isinstance(node, list):
            return _ABSENT
        wanted = _item_key(rest)
        return next(
            (
                item
                for item in node
                if isinstance(item, dict) and all(item.get(k, _KEY_DEFAULTS.get(k)) == v for k, v in wanted)
            ),
            _ABSENT,
        )
    if kind == "v":
        return rest if isinstance(node, list) and _set_member(rest) in node else _ABSENT
    if part == ".":
        return node
    return _ABSENT  # a positional path: never ours (we apply no positional lists)


def _dotted(path: tuple[str, ...]) -> str:
    return "." + ".".join(p[2:] if p.startswith("f:") else p for p in path)


def _owned_tree(actual: Object, manager: str, operation: str = "Apply") -> dict[str, Any] | None:
    """The FieldsV1 tree ``manager`` wrote to ``actual`` by ``operation``; None when it never did."""
    for entry in actual.get("metadata", {}).get("managedFields") or []:
        if entry.get("manager") == manager and entry.get("operation") == operation and not entry.get("subresource"):
            return entry.get("fieldsV1") or {}
    return None


def owned_fields(actual: Object, manager: str = FIELD_MANAGER) -> list[tuple[str, ...]] | None:
    """The field paths ``manager`` applied to ``actual`` (FieldsV1 spelling); None when it never applied."""
    tree = _owned_tree(actual, manager)
    if tree is None:
        return None
    paths: list[tuple[str, ...]] = []
    _leaves(tree, (), paths)
    return paths


def _leaves(node: dict[str, Any], prefix: tuple[str, ...], out: list[tuple[str, ...]]) -> None:
    for part, sub in node.items():
        if sub:
            _leaves(sub, (*prefix, part), out)
        else:
            out.append((*prefix, part))


def sets_field(desired: Any, path: tuple[str, ...]) -> bool:
    """Whether ``desired`` sets the field a FieldsV1 path names (``f:``, ``k:``, ``v:`` and ``.`` steps)."""
    node = desired
    for part in path:
        if part == "." or part.startswith("v:"):
            return _step(node, part) is not _ABSENT
        node = _step(node, part)
        if node is _ABSENT:
            return False
    return True


def _walk(
    tree: dict[str, Any], want: Any, have: Any, prefix: tuple[str, ...]
) -> Iterator[tuple[tuple[str, ...], Any, Any]]:
    """Each owned leaf as (path, desired value, actual value), values ``_ABSENT`` where not set."""
    for part, sub in tree.items():
        path = (*prefix, part)
        w = _step(want, part) if want is not _ABSENT else _ABSENT
        h = _step(have, part) if have is not _ABSENT else _ABSENT
        if sub and part != "." and not part.startswith("v:"):
            yield from _walk(sub, w, h, path)
        else:
            yield path, w, h


def stale_field(desired: Object, actual: Object, manager: str = FIELD_MANAGER) -> str | None:
    """The first field ``manager`` owns on ``actual`` that ``desired`` no longer sets, dotted; None if none."""
    for path, want, _ in _walk(_owned_tree(actual, manager) or {}, desired, _ABSENT, ()):
        if want is _ABSENT:
            return _dotted(path)
    return None


def _value_at(obj: Any, path: tuple[str, ...]) -> Any:
    """The value a FieldsV1 path names in ``obj`` (``f:`` and ``k:`` steps), or ``_ABSENT``."""
    node = obj
    for part in path:
        if not part.startswith(("f:", "k:")):
            return _ABSENT
        node = _step(node, part)
        if node is _ABSENT:
            return _ABSENT
    return node


# Fields the API server defaults inside values that are owned whole (+structType=atomic, atomic lists): every
# ObjectFieldSelector (an env var's fieldRef, a downwardAPI volume item's, at any depth of an atomic list such
# as a downwardAPI volume's items) comes back with its apiVersion (SetDefaults_ObjectFieldSelector). Not a
# difference of the owner's.
_ATOMIC_DEFAULTS: dict[str, dict[str, Any]] = {"fieldRef": {"apiVersion": "v1"}}


def _with_atomic_defaults(value: Any, name: str = "") -> Any:
    """``value`` with the server's defaults of :data:`_ATOMIC_DEFAULTS` filled in, wherever they sit in it."""
    if isinstance(value, dict):
        out = {k: _with_atomic_defaults(v, k) for k, v in value.items()}
        return {**_ATOMIC_DEFAULTS[name], **out} if name in _ATOMIC_DEFAULTS else out
    if isinstance(value, list):
        return [_with_atomic_defaults(v) for v in value]
    return value


def _atomic_changed(path: tuple[str, ...], want: Any, have: Any) -> str | None:
    if want is _ABSENT or have is _ABSENT or _empty(want) or not isinstance(have, (list, dict)):
        return None  # an empty value is owned whole for being empty, not for being atomic
    if not path[-1].startswith(("f:", "k:")):
        return None  # an item's own path, or a set member: never a value owned whole
    want = _with_atomic_defaults(want, path[-1][2:] if path[-1].startswith("f:") else "")
    dotted = _dotted(path)
    return dotted if is_subset(have, want, dotted) is not None else None


def changed_atomic(
    desired: Object, actual: Object, manager: str = FIELD_MANAGER, operation: str = "Apply"
) -> str | None:
    """The first list or map ``manager`` owns whole (by ``operation``) whose actual value holds more than the
    desired one."""
    for path, want, have in _walk(_owned_tree(actual, manager, operation) or {}, desired, actual, ()):
        found = _atomic_changed(path, want, have)
        if found:
            return found
    return None


def _stale_or_atomic(desired: Object, actual: Object, manager: str) -> str | None:
    """:func:`stale_field`, then :func:`changed_atomic`, in one walk of the owned fields."""
    atomic = None
    for path, want, have in _walk(_owned_tree(actual, manager) or {}, desired, actual, ()):
        if want is _ABSENT:
            return _dotted(path)
        atomic = atomic or _atomic_changed(path, want, have)
    return atomic


def _mine(actual: Object, manager: str) -> list[dict[str, Any]]:
    return [
        e
        for e in actual.get("metadata", {}).get("managedFields") or []
        if e.get("manager") == manager and not e.get("subresource")
    ]


def legacy_owner(actual: Object, manager: str = FIELD_MANAGER) -> bool:
    """True when ``manager`` wrote ``actual`` only with plain updates (an operator version before apply).

    Fields owned that way are never removed by an apply: :func:`adopted_ownership` turns them into
    applied ones first.
    """
    mine = _mine(actual, manager)
    return bool(mine) and all(e.get("operation") != "Apply" for e in mine)


def _merge_trees(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for key, sub in b.items():
        out[key] = _merge_trees(out.get(key) or {}, sub) if sub or key not in out else out[key]
    return out


def _only_set(tree: dict[str, Any], desired: Any) -> dict[str, Any]:
    """The FieldsV1 ``tree`` without the leaves ``desired`` does not set."""
    out: dict[str, Any] = {}
    for part, sub in tree.items():
        node = _step(desired, part) if desired is not _ABSENT else _ABSENT
        if node is _ABSENT:
            continue
        if sub and part != "." and not part.startswith("v:"):
            kept = _only_set(sub, node)
            if kept:
                out[part] = kept
        else:
            out[part] = sub
    return out


# The one field an externally scaled role's Deployment hands over: its replicas (the autoscaler's from the create on).
REPLICAS_PATH = ("f:spec", "f:replicas")


def _without(tree: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    """The FieldsV1 ``tree`` without the field ``path`` names (and the maps it leaves empty)."""
    if not path or path[0] not in tree:
        return tree
    head, rest = path[0], path[1:]
    out = dict(tree)
    if rest and tree[head]:
        sub = _without(tree[head], rest)
        if sub:
            out[head] = sub
            return out
    del out[head]
    return out


def adopted_ownership(
    actual: Object, manager: str = FIELD_MANAGER, desired: Object | None = None, release: tuple[str, ...] | None = None
) -> list[dict[str, Any]]:
    """``actual``'s managedFields with ``manager``'s update entries made one apply entry.

    The same upgrade kubectl does from client-side to server-side apply: the next apply then removes
    every field the manager set before and no longer wants, whichever way it was written.

    ``desired``: keep only the fields it sets. Right after a create, kube-apiserver records the server's
    defaults (a Deployment's strategy, a container's terminationMessagePath) as the creator's fields: owned
    by an apply they would look stale and cost one more write.

    ``release``: a field (FieldsV1 path) left to nobody, kept as it is by the next apply: an autoscaled role's
    replicas. Everything else is adopted, so the apply removes a field the spec dropped (structured-merge-diff
    prunes only the applier's own previous set: a field owned by nobody would stay for ever).
    """
    entries = actual.get("metadata", {}).get("managedFields") or []
    mine = [e for e in _mine(actual, manager) if e.get("operation") != "Apply"]
    tree: dict[str, Any] = {}
    for entry in mine:
        # The first entry (a create's, often the only one) is taken as it is: merging it into nothing copied it.
        tree = _merge_trees(tree, entry.get("fieldsV1") or {}) if tree else (entry.get("fieldsV1") or {})
    if desired is not None:
        tree = _only_set(tree, desired)
    if release is not None:
        tree = _without(tree, release)
    adopted = {**(mine[0] if mine else {}), "manager": manager, "operation": "Apply", "fieldsV1": tree}
    return [e for e in entries if e not in mine] + [adopted]


def adoption_patch(
    actual: Object, manager: str = FIELD_MANAGER, desired: Object | None = None, release: tuple[str, ...] | None = None
) -> list[dict[str, Any]] | None:
    """A JSON patch making ``manager``'s one update entry the apply entry :func:`adopted_ownership` makes; None
    unless ``actual`` holds exactly one entry of the manager, an update's.

    Only that entry is replaced, and only while it and the uid are as read (``test`` operations): an entry
    that another writer added since (a controller's status write right after a create) stays, where a whole
    list written back would need the resourceVersion read and fail on every such write.
    """
    entries = actual.get("metadata", {}).get("managedFields") or []
    mine = [i for i, e in enumerate(entries) if e.get("manager") == manager and not e.get("subresource")]
    if len(mine) != 1 or entries[mine[0]].get("operation") == "Apply":
        return None
    at = f"/metadata/managedFields/{mine[0]}"
    return [
        {"op": "test", "path": "/metadata/uid", "value": actual["metadata"].get("uid")},
        {"op": "test", "path": at, "value": entries[mine[0]]},
        {"op": "replace", "path": at, "value": adopted_ownership(actual, manager, desired, release)[-1]},
    ]


def released_ownership(
    actual: Object, desired: Object, manager: str = FIELD_MANAGER, path: tuple[str, ...] = REPLICAS_PATH
) -> list[dict[str, Any]] | None:
    """``actual``'s managedFields with the field ``path`` names (an externally scaled role's replicas) owned by
    nobody, when ``manager`` applied it and ``desired`` no longer sets it; None when there is nothing to release.

    An apply removes a field its manager alone owned and no longer applies; the field handed over this way
    keeps its value instead, for whoever writes it next. Only that field: every other one the spec dropped
    stays the manager's, for the apply to remove.
    """
    if sets_field(desired, path):
        return None
    entries = actual.get("metadata", {}).get("managedFields") or []
    for i, entry in enumerate(entries):
        if entry.get("manager") == manager and entry.get("operation") == "Apply" and not entry.get("subresource"):
            tree = entry.get("fieldsV1") or {}
            kept = _without(tree, path)
            if kept == tree:
                return None
            return [*entries[:i], {**entry, "fieldsV1": kept}, *entries[i + 1 :]]
    return None


def _shape(value: Any, out: list[str]) -> None:
    """``value``'s keys (sorted) and list positions, without its values, as tokens appended to ``out``."""
    if isinstance(value, dict):
        out.append("{")
        for key in sorted(value):
            out.append(key)
            _shape(value[key], out)
        out.append("}")
    elif isinstance(value, list):
        out.append("[")
        for item in value:
            _shape(item, out)
        out.append("]")
    else:
        out.append(".")


def field_set_digest(desired: Object) -> str:
    """A digest of which fields ``desired`` sets, whatever their values (lists by position)."""
    tokens: list[str] = []
    _shape(desired, tokens)
    return hashlib.blake2b("\0".join(tokens).encode(), digest_size=8).hexdigest()


def created_body(desired: Object) -> Object:
    """``desired`` as the operator creates it: annotated with the digest of the fields it sets."""
    meta = desired.get("metadata") or {}
    annotations = {**(meta.get("annotations") or {}), CREATED_FIELDS_ANNOTATION: field_set_digest(desired)}
    return {**desired, "metadata": {**meta, "annotations": annotations}}


def created_with(desired: Object, actual: Object) -> bool:
    """Whether ``actual`` was created with the fields ``desired`` sets (so nothing the create set is dropped)."""
    annotations = actual.get("metadata", {}).get("annotations") or {}
    return annotations.get(CREATED_FIELDS_ANNOTATION) == field_set_digest(desired)


def out_of_sync(desired: Object, actual: Object, manager: str = FIELD_MANAGER) -> str | None:
    """Why ``desired`` must be applied to ``actual`` (a field path, for the log); None when it is in sync.

    A child the manager only created (:func:`legacy_owner`) is in sync while the desired object sets the fields
    the create set: a field dropped since would stay, the update entry owning it, unless the fields are adopted
    and applied (the controller's ``_update``), which this answer asks for.
    """
    found = is_subset(desired, actual)
    if found:
        return found
    if legacy_owner(actual, manager):
        if not created_with(desired, actual):
            return "metadata.managedFields"
        return changed_atomic(desired, actual, manager, operation="Update")
    return _stale_or_atomic(desired, actual, manager)


# --- ownership ----------------------------------------------------------------------------------------


def controller_of(obj: Object) -> dict[str, Any] | None:
    """The ownerReference with ``controller: true``, if any."""
    return next((r for r in obj.get("metadata", {}).get("ownerReferences") or [] if r.get("controller")), None)


def controlled_by(obj: Object, owner_uid: str | None) -> bool:
    ref = controller_of(obj)
    return ref is not None and owner_uid is not None and ref.get("uid") == owner_uid


def describe_controller(obj: Object) -> str:
    ref = controller_of(obj)
    if ref is None:
        return "no controller"
    return f"{ref.get('kind')} {ref.get('name')} (uid {ref.get('uid')})"


def plan(
    desired: list[Object], actual: dict[Key, Object], check: Callable[[Object, Object], str | None] = out_of_sync
) -> tuple[list[Object], list[tuple[Object, str]], list[Object]]:
    """(absent: create, (desired, why) to apply, actual objects no longer wanted: delete).

    ``check``: why one desired object must be applied to its actual one (:func:`out_of_sync`, or a caller's
    memo of it)."""
    creates, updates = [], []
    wanted = set()
    for obj in desired:
        key = key_of(obj)
        wanted.add(key)
        have = actual.get(key)
        if have is None:
            creates.append(obj)
            continue
        why = check(obj, have)
        if why is not None:
            updates.append((obj, why))
    deletes = [obj for key, obj in actual.items() if key not in wanted]
    return creates, updates, deletes
