"""Field ownership (``metadata.managedFields``) and server-side apply, as kube-apiserver does them.

Every write records which *manager* set which fields:

* an **apply** (PATCH ``application/apply-patch+yaml`` with a ``fieldManager``) sends a partial object.
  The fields it names become the manager's (operation ``Apply``). Fields the manager applied before and
  no longer names are removed from the object, unless another manager owns them too. A field another
  manager owns with a different value is a conflict (409) unless the apply forces, which takes it over;
  with an equal value the two share it.
* every other write (create, update, merge/JSON/strategic patches) gives the fields it changes to its
  manager (operation ``Update``) and takes them from everyone else; fields it removes lose all owners.

Paths use the FieldsV1 spelling: ``f:<field>``, ``k:<json>`` (an item of a list keyed by some of its
fields), ``v:<json>`` (a member of a set) and ``.`` (the item itself). How a list or map merges comes
from the CRD schema (``x-kubernetes-list-type``, ``x-kubernetes-list-map-keys``, ``x-kubernetes-map-type``)
for custom resources, and from the markers of the built-in Go types (a table by field name) for the rest.

A manager is a (name, operation) pair, as in kube-apiserver: an apply conflicts with the fields the same
name owns through plain updates, and never removes them.

A client may also set managedFields itself: a write that changes them stores them as sent, and a list of
one empty entry (``[{}]``) clears them. Not modelled: positional (``i:``) paths and field-path conversion
between versions.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Iterable
from typing import Any

JsonObj = dict[str, Any]
Path = tuple[str, ...]

ITEM = "."
# The value recorded for an item's own path: an item exists or not, it never conflicts by value.
_PRESENT = object()
_MISSING = object()

# Built-in lists merged item by item (+listType=map), by their keys; 'ports' depends on its owner.
_MAP_LISTS: dict[str, tuple[str, ...]] = {
    "containers": ("name",),
    "initContainers": ("name",),
    "ephemeralContainers": ("name",),
    "env": ("name",),
    "volumes": ("name",),
    "volumeMounts": ("mountPath",),
    "volumeDevices": ("devicePath",),
    "imagePullSecrets": ("name",),
    "ownerReferences": ("uid",),
    "conditions": ("type",),
    "hostAliases": ("ip",),
    "topologySpreadConstraints": ("topologyKey", "whenUnsatisfiable"),
    "resourceClaims": ("name",),
}
_SET_LISTS = {"finalizers"}
# Built-in maps and structs replaced as a whole: the fields whose Go types carry +mapType=atomic or
# +structType=atomic (x-kubernetes-map-type: atomic in kube-apiserver's OpenAPI), for the kinds the operator
# writes. LabelSelector (a Deployment's or DaemonSet's selector, a NetworkPolicy's podSelector and its peers'
# podSelector and namespaceSelector, the labelSelector of affinity terms and topology spread constraints),
# NodeSelector (required node affinity), RoleRef, and the key and field selectors of env valueFrom.
_ATOMIC_MAPS = {
    "selector",
    "nodeSelector",
    "podSelector",
    "namespaceSelector",
    "labelSelector",
    "requiredDuringSchedulingIgnoredDuringExecution",
    "roleRef",
    "secretKeyRef",
    "configMapKeyRef",
    "fieldRef",
    "resourceFieldRef",
}
# Fields with a default of their own, used to key items that leave them out (as the server defaults them).
_KEY_DEFAULTS = {"protocol": "TCP"}
# Metadata a client may set and own; the rest (name, uid, resourceVersion...) is identity or the server's.
_OWNED_METADATA = ("labels", "annotations", "ownerReferences", "finalizers")


@dataclasses.dataclass(frozen=True)
class Shape:
    """How the values under one field merge: from a CRD schema node, or (None) the built-in table."""

    schema: JsonObj | None = None

    def field(self, name: str) -> Shape:
        if self.schema is None:
            return _BUILTIN
        props = self.schema.get("properties") or {}
        if name in props:
            return Shape(props[name])
        extra = self.schema.get("additionalProperties")
        return Shape(extra) if isinstance(extra, dict) else Shape({})

    def item(self) -> Shape:
        if self.schema is None:
            return _BUILTIN
        items = self.schema.get("items")
        return Shape(items) if isinstance(items, dict) else Shape({})

    def atomic_map(self, name: str) -> bool:
        if self.schema is None:
            return name in _ATOMIC_MAPS
        return self.schema.get("x-kubernetes-map-type") == "atomic"

    def list_type(self, name: str, items: list[Any]) -> tuple[str, tuple[str, ...]]:
        """('atomic'|'set'|'map', map keys)."""
        if self.schema is None:
            if name in _SET_LISTS:
                return "set", ()
            if name == "ports":
                # Container ports are keyed by containerPort, Service ports by port (with the protocol).
                container = any(isinstance(i, dict) and "containerPort" in i for i in items)
                return "map", ("containerPort", "protocol") if container else ("port", "protocol")
            if name in _MAP_LISTS:
                return "map", _MAP_LISTS[name]
            return "atomic", ()
        kind = self.schema.get("x-kubernetes-list-type", "atomic")
        return kind, tuple(self.schema.get("x-kubernetes-list-map-keys") or ())


_BUILTIN = Shape(None)


def root_shape(schema: JsonObj | None) -> Shape:
    """The shape of a whole object: a CRD's openAPIV3Schema, or None for a built-in kind."""
    return Shape(schema) if schema is not None else _BUILTIN


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def _item_key(item: JsonObj, keys: tuple[str, ...]) -> JsonObj:
    return {k: item.get(k, _KEY_DEFAULTS.get(k)) for k in keys if k in item or k in _KEY_DEFAULTS}


# -------------------------------------------------------------------------------------------------
# Field sets


def field_values(
    obj: JsonObj, shape: Shape, *, status: bool = False, duplicates: list[str] | None = None
) -> dict[Path, Any]:
    """Every field path ``obj`` sets, with its value; ``status``: the status part, else everything else.

    ``duplicates`` collects the keyed list items that repeat a key, as kube-apiserver words them.
    """
    out: dict[Path, Any] = {}
    for key, value in obj.items():
        if key in ("apiVersion", "kind") or (key == "status") != status:
            continue
        if key == "metadata":
            for name in _OWNED_METADATA:
                if name in (value or {}):
                    _collect(value[name], _BUILTIN, ("f:metadata", f"f:{name}"), name, out, duplicates)
            continue
        _collect(value, shape.field(key), (f"f:{key}",), key, out, duplicates)
    return out


def _collect(
    value: Any, shape: Shape, path: Path, name: str, out: dict[Path, Any], duplicates: list[str] | None = None
) -> None:
    if isinstance(value, dict):
        if not value or shape.atomic_map(name):
            out[path] = value
            return
        for key, sub in value.items():
            _collect(sub, shape.field(key), (*path, f"f:{key}"), key, out, duplicates)
        return
    if isinstance(value, list):
        kind, keys = shape.list_type(name, value)
        if not value or kind == "atomic" or (kind == "map" and not all(isinstance(i, dict) for i in value)):
            out[path] = value
            return
        if kind == "set":
            for item in value:
                out[(*path, f"v:{_json(item)}")] = item
            return
        item_shape = shape.item()
        for item in value:
            key_fields = _item_key(item, keys)
            item_path = (*path, f"k:{_json(key_fields)}")
            if duplicates is not None and (*item_path, ITEM) in out:
                duplicates.append(f"{dotted(path)}: duplicate entries for key {dotted((item_path[-1],))}")
            out[(*item_path, ITEM)] = _PRESENT
            for key, sub in item.items():
                _collect(sub, item_shape.field(key), (*item_path, f"f:{key}"), key, out, duplicates)
        return
    out[path] = value


def to_fields_v1(paths: Iterable[Path]) -> JsonObj:
    tree: JsonObj = {}
    for path in paths:
        node = tree
        for part in path:
            node = node.setdefault(part, {})
    return tree


def from_fields_v1(tree: JsonObj | None) -> set[Path]:
    paths: set[Path] = set()

    def walk(node: JsonObj, prefix: Path) -> None:
        for part, sub in node.items():
            if sub:
                walk(sub, (*prefix, part))
            else:
                paths.add((*prefix, part))

    walk(tree or {}, ())
    return paths


def _covers(owned: set[Path], path: Path) -> bool:
    """Whether ``owned`` holds ``path`` or anything below it."""
    n = len(path)
    return any(p[:n] == path for p in owned)


# -------------------------------------------------------------------------------------------------
# managedFields entries


@dataclasses.dataclass
class Entry:
    manager: str
    operation: str  # Apply or Update
    api_version: str
    time: str
    paths: set[Path]
    subresource: str = ""
    # The FieldsV1 tree the entry was parsed from (read-only): rendered again as it was while its paths stay.
    fields_v1: JsonObj | None = dataclasses.field(default=None, compare=False, repr=False)

    @classmethod
    def parse(cls, raw: JsonObj) -> Entry:
        tree = raw.get("fieldsV1")
        return cls(
            manager=raw.get("manager", ""),
            operation=raw.get("operation", "Update"),
            api_version=raw.get("apiVersion", ""),
            time=raw.get("time", ""),
            paths=from_fields_v1(tree),
            subresource=raw.get("subresource", ""),
            fields_v1=tree if isinstance(tree, dict) else None,
        )

    def render(self, tree: JsonObj | None = None) -> JsonObj:
        """The managedFields entry; ``tree``: its FieldsV1, when known to hold exactly its paths."""
        raw: JsonObj = {
            "manager": self.manager,
            "operation": self.operation,
            "apiVersion": self.api_version,
            "time": self.time,
            "fieldsType": "FieldsV1",
            "fieldsV1": tree if tree is not None else to_fields_v1(sorted(self.paths)),
        }
        if self.subresource:
            raw["subresource"] = self.subresource
        return raw


def entries_of(obj: JsonObj | None) -> list[Entry]:
    return [Entry.parse(e) for e in ((obj or {}).get("metadata") or {}).get("managedFields") or []]


def render_entries(entries: list[Entry], before: list[Entry], now: str) -> list[JsonObj]:
    """managedFields for the object: empty entries dropped, ``time`` moved only where ownership changed."""
    previous = {(e.manager, e.operation, e.subresource): e for e in before}
    out = []
    for entry in entries:
        if not entry.paths:
            continue
        old = previous.get((entry.manager, entry.operation, entry.subresource))
        unchanged = old is not None and old.paths == entry.paths and old.api_version == entry.api_version
        entry.time = old.time if unchanged and old is not None else now
        # Most writes leave most entries as they were: their stored tree is kept, not built again (the stored
        # objects' trees are never changed in place; clients get copies).
        same = old is not None and old.paths == entry.paths
        out.append(entry.render(old.fields_v1 if same and old is not None else None))
    return out


class TypedPatchError(Exception):
    """The applied configuration is not a valid typed object (e.g. two items of a keyed list share a key)."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = errors
        super().__init__("errors:\n  " + "\n  ".join(errors))


class ConflictError(Exception):
    """An apply would change fields other managers own: ``conflicts`` lists (manager, path)."""

    def __init__(self, conflicts: list[tuple[str, Path]]) -> None:
        self.conflicts = conflicts
        super().__init__(self.message)

    @property
    def message(self) -> str:
        lines = [f'conflict with "{m}": {dotted(p)}' for m, p in self.conflicts]
        return f"Apply failed with {len(lines)} conflict{'s' if len(lines) > 1 else ''}: " + "\n".join(lines)


def dotted(path: Path) -> str:
    """A path as kube-apiserver prints it in its messages: ``.spec.containers[name="vllm"].image``."""
    out = ""
    for part in path:
        if part.startswith("f:"):
            out += "." + part[2:]
        elif part.startswith("k:"):
            out += "[" + ",".join(f"{k}={json.dumps(v)}" for k, v in json.loads(part[2:]).items()) + "]"
        elif part.startswith("v:"):
            out += "[=" + part[2:] + "]"
    return out or "."


# -------------------------------------------------------------------------------------------------
# Updates


def track_update(
    old: JsonObj | None, new: JsonObj, shape: Shape, manager: str, api_version: str, subresource: str = ""
) -> list[Entry]:
    """The entries after a non-apply write by ``manager`` turned ``old`` into ``new``."""
    status = subresource == "status"
    before = field_values(old, shape, status=status) if old is not None else {}
    after = field_values(new, shape, status=status)
    changed = {p for p, v in after.items() if p not in before or before[p] != v}
    removed = set(before) - set(after)
    entries = entries_of(old)
    mine = None
    for entry in entries:
        # The scale subresource writes the main object's fields (spec.replicas): its entries and the main
        # resource's own them together, as structured-merge-diff keeps one field set per object.
        if (entry.subresource == "status") != status:
            continue
        entry.paths -= removed
        if entry.manager == manager and entry.operation == "Update" and entry.subresource == subresource:
            mine = entry
        else:
            entry.paths -= changed
    if changed:
        if mine is None:
            mine = Entry(manager, "Update", api_version, "", set(), subresource)
            entries.append(mine)
        mine.paths |= changed
        mine.api_version = api_version
    return entries


# -------------------------------------------------------------------------------------------------
# Apply


def apply(
    live: JsonObj | None, config: JsonObj, shape: Shape, manager: str, api_version: str, *, force: bool
) -> tuple[JsonObj, list[Entry]]:
    """Merge the applied ``config`` of ``manager`` into ``live``; the object and its new entries.

    Raises :class:`ConflictError` when another manager owns a field the config sets to another value
    and ``force`` is false, and :class:`TypedPatchError` when a keyed list of the config repeats a key.
    """
    live = live or {}
    duplicates: list[str] = []
    applied = field_values(config, shape, duplicates=duplicates)
    if duplicates:
        raise TypedPatchError(duplicates)
    current = field_values(live, shape)
    entries = entries_of(live)
    own_before: set[Path] = set()
    others: list[Entry] = []
    for entry in entries:
        if entry.subresource == "status":
            continue  # the status' fields: never an apply's to the main resource (a scale write's are)
        # A manager is a (name, operation) pair: the same name's Update entry is another manager, whose
        # fields this apply conflicts with and never removes, as in kube-apiserver.
        if entry.manager == manager and entry.operation == "Apply":
            own_before = entry.paths
        else:
            others.append(entry)

    conflicts = []
    for entry in others:
        for path in sorted(entry.paths & set(applied)):
            if applied[path] is not _PRESENT and current.get(path, _MISSING) != applied[path]:
                conflicts.append((entry, path))
    if conflicts and not force:
        raise ConflictError([(e.manager, p) for e, p in conflicts])
    for entry, path in conflicts:
        entry.paths.discard(path)

    merged = _merge(live, config, shape, "", root=True)
    still_owned = set().union(*(e.paths for e in others)) | set(applied)
    # Whole items first (their key fields find them), then single fields.
    for path in sorted(own_before - set(applied), key=lambda p: (p[-1] != ITEM, len(p), p)):
        if not _covers(still_owned, path) and not _is_key_field(path):
            _remove(merged, path)

    entries = [e for e in entries if not (e.manager == manager and e.operation == "Apply" and not e.subresource)]
    entries.append(Entry(manager, "Apply", api_version, "", set(applied)))
    return merged, entries


def _is_key_field(path: Path) -> bool:
    """A key field of a list item (``k:{"name":..}/f:name``): it goes with its item, never alone."""
    return (
        len(path) >= 2
        and path[-2].startswith("k:")
        and path[-1].startswith("f:")
        and path[-1][2:] in json.loads(path[-2][2:])
    )


def _merge(live: Any, config: Any, shape: Shape, name: str, *, root: bool = False) -> Any:
    if isinstance(live, dict) and isinstance(config, dict) and not shape.atomic_map(name):
        out = dict(live)
        for key, value in config.items():
            if key == "metadata" and root:
                # Metadata is not in a CRD's schema: it merges as ObjectMeta does everywhere.
                out[key] = _merge(live.get(key) or {}, value, _BUILTIN, key)
            else:
                out[key] = _merge(live[key], value, shape.field(key), key) if key in live else copy.deepcopy(value)
        return out
    if isinstance(live, list) and isinstance(config, list):
        kind, keys = shape.list_type(name, live + config)
        if kind == "set":
            return live + [copy.deepcopy(v) for v in config if v not in live]
        if kind == "map" and all(isinstance(i, dict) for i in live + config):
            rest = {_json(_item_key(i, keys)): i for i in live}
            out = []
            for item in config:
                match = rest.pop(_json(_item_key(item, keys)), None)
                out.append(_merge(match, item, shape.item(), "") if match is not None else copy.deepcopy(item))
            return out + [i for i in live if _json(_item_key(i, keys)) in rest]
    return copy.deepcopy(config)


def _remove(obj: JsonObj, path: Path) -> None:
    """Delete what ``path`` names from ``obj``, then the maps and lists left empty on the way."""
    trail: list[tuple[Any, Any]] = []  # (container, key or index into it)
    node: Any = obj
    for part in path:
        if part == ITEM:
            break
        if part.startswith("f:") and isinstance(node, dict) and part[2:] in node:
            trail.append((node, part[2:]))
            node = node[part[2:]]
        elif part.startswith(("k:", "v:")) and isinstance(node, list):
            wanted = json.loads(part[2:])
            index = next(
                (
                    i
                    for i, item in enumerate(node)
                    if (part[0] == "v" and item == wanted)
                    or (part[0] == "k" and isinstance(item, dict) and _item_key(item, tuple(wanted)) == wanted)
                ),
                None,
            )
            if index is None:
                return
            trail.append((node, index))
            node = node[index]
        else:
            return
    while trail:
        container, key = trail.pop()
        del container[key]
        if container or not trail:
            return
