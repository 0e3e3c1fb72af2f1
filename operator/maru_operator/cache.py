"""What the operator has seen through its watches: owners and the children they own, by key.

Fed by kopf's watch events (and by our own write responses, so a reconcile right after a write does
not act on a stale copy). Nothing here does I/O.
"""

from __future__ import annotations

import json
from collections import OrderedDict, defaultdict
from typing import Any

from maru_operator.api.common import GROUP
from maru_operator.reconcile import FIELD_MANAGER

Object = dict[str, Any]
Key = tuple[str, str, str]  # (kind, namespace or "", name)

OWNER_KINDS = ("MaruPool", "InferenceGroup")
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
# How often the cache is checked against fresh lists (and every owner looked at), watch events or not.
# The watches keep the cache current and pools poll their daemons on their own timer, so this is a safety
# net against lost events, not a pacemaker: controller-runtime's default is 10 hours. Ten minutes keeps the
# net tight while a 5,000-object cluster pays about 11 paged metadata-only lists (~2.5 MB) and one reconcile
# per owner (a few ms each, the diffs memoised) per period: well under 1% of one core and of the API server.
RESYNC_SECONDS = 600.0
# Deleted objects' last versions, kept only as long as a reconcile's write could still be answering.
TOMBSTONES = 4096
# Distinct parts of the operator's own managedFields trees shared between cached objects. Every group's prefill
# Deployment owns the same spec fields (the keys name containers and labels, not the group), so a fleet has a few
# dozen and one ownerReferences part per owner; the bound only keeps the table from growing without end.
SHARED_FIELD_SETS = 1024


def key_of(obj: Object) -> Key:
    meta = obj.get("metadata", {})
    return obj.get("kind", ""), meta.get("namespace") or "", meta.get("name", "")


def owner_key(obj: Object) -> Key | None:
    """The owner (MaruPool or InferenceGroup) controlling ``obj``, from its ownerReferences."""
    meta = obj.get("metadata", {})
    for ref in meta.get("ownerReferences") or []:
        if ref.get("controller") and str(ref.get("apiVersion", "")).startswith(GROUP + "/"):
            kind = ref.get("kind")
            if kind == "MaruPool":
                return "MaruPool", "", ref.get("name", "")
            if kind == "InferenceGroup":
                return "InferenceGroup", meta.get("namespace") or "", ref.get("name", "")
    return None


def _newer_or_equal(new: Object, old: Object) -> bool:
    """False only when ``new`` is provably older (numeric resourceVersions, as every real server uses)."""
    a = new.get("metadata", {}).get("resourceVersion")
    b = old.get("metadata", {}).get("resourceVersion")
    try:
        return int(a) >= int(b)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return True


def _version(obj: Object | None) -> int | None:
    try:
        return int(((obj or {}).get("metadata") or {}).get("resourceVersion"))
    except (TypeError, ValueError):
        return None


def not_newer(obj: Object, version: str | None) -> bool:
    """Whether ``obj`` is no newer than a list taken at ``version`` (unknown versions count as older)."""
    try:
        return int(obj.get("metadata", {}).get("resourceVersion")) <= int(version)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return True


# canonical JSON of a FieldsV1 subtree -> the one parsed copy the cache's objects share (read-only)
_field_sets: OrderedDict[str, Any] = OrderedDict()


def _one(fields: Any) -> Any:
    text = json.dumps(fields, separators=(",", ":"))
    shared = _field_sets.get(text)
    if shared is None:
        _field_sets[text] = shared = fields
        while len(_field_sets) > SHARED_FIELD_SETS:
            _field_sets.popitem(last=False)
    else:
        _field_sets.move_to_end(text)
    return shared


def _shared(tree: dict[str, Any]) -> dict[str, Any]:
    """A FieldsV1 tree rebuilt from subtrees shared with the other cached objects that own the same fields.

    Shared two levels down (``f:spec`` / ``f:template``, ``f:metadata`` / ``f:labels``): the trees of two
    groups' prefill Deployments differ only under ``f:ownerReferences``, whose keys name the owner's uid.
    Nothing in the cache mutates a tree.
    """
    return {part: {p: _one(sub) for p, sub in node.items()} if isinstance(node, dict) else node
            for part, node in tree.items()}


def trimmed(obj: Object) -> Object:
    """``obj`` as the cache keeps it: of its managedFields only the operator's own entries, each tree of fields
    shared with the other objects that own the same.

    The diff needs no other manager's entries (it asks only which fields the operator applied), and those
    entries were half of what the cache held. The rare writes that must send managedFields whole (adopting
    fields, releasing replicas to an autoscaler) read the object afresh first. ``obj`` itself is not changed.
    """
    meta = obj.get("metadata")
    entries = meta.get("managedFields") if isinstance(meta, dict) else None
    if not entries:
        return obj
    ours = [{**e, "fieldsV1": _shared(e["fieldsV1"])} if isinstance(e.get("fieldsV1"), dict) else e
            for e in entries if e.get("manager") == FIELD_MANAGER and not e.get("subresource")]
    kept = {k: v for k, v in meta.items() if k != "managedFields"}
    if ours:
        kept["managedFields"] = ours
    return {**obj, "metadata": kept}


def _pool_of(obj: Object) -> str | None:
    return ((obj.get("spec") or {}).get("poolRef") or {}).get("name")


class Store:
    def __init__(self) -> None:
        self.objects: dict[Key, Object] = {}
        self._owned: dict[Key, set[Key]] = defaultdict(set)
        self._owner_of: dict[Key, Key] = {}
        self._gone: OrderedDict[Key, int] = OrderedDict()
        # Indexes, so that a reconcile's look-ups cost the same with 10 objects or 50,000.
        self._by_kind: dict[str, set[Key]] = defaultdict(set)
        self._slices: dict[tuple[str, str], set[Key]] = defaultdict(set)  # (namespace, service) -> slices
        self._pool_groups: dict[str, set[Key]] = defaultdict(set)  # pool -> groups naming it

    def holds_version(self, obj: Object) -> bool:
        """Whether the cache holds this very version of ``obj`` (same uid and resourceVersion)."""
        cached = self.objects.get(key_of(obj))
        if cached is None:
            return False
        a, b = cached.get("metadata") or {}, obj.get("metadata") or {}
        return a.get("resourceVersion") is not None and a.get("resourceVersion") == b.get("resourceVersion") \
            and a.get("uid") == b.get("uid")

    def holds_since(self, obj: Object) -> bool:
        """Whether the cache holds ``obj``'s version or a later one of the same object (same uid).

        A watch event of a version older than the cached one tells nothing new: the event of the cached
        version, or whoever cached it (a write's answer), brought everything it changed.
        """
        cached = self.objects.get(key_of(obj))
        if cached is None:
            return False
        a, b = cached.get("metadata") or {}, obj.get("metadata") or {}
        if a.get("uid") != b.get("uid"):
            return False
        have, seen = _version(cached), _version(obj)
        if have is None or seen is None:
            return self.holds_version(obj)
        return have >= seen

    def _index(self, key: Key, obj: Object | None) -> None:
        """Move ``key`` in the indexes from its cached object to ``obj`` (None: out of them)."""
        old = self.objects.get(key)
        for o, add in ((old, False), (obj, True)):
            if o is None:
                continue
            if key[0] == "EndpointSlice":
                slot = (key[1], (o.get("metadata", {}).get("labels") or {}).get(SERVICE_NAME_LABEL, ""))
                (self._slices[slot].add if add else self._slices[slot].discard)(key)
            elif key[0] == "InferenceGroup" and (pool := _pool_of(o)):
                (self._pool_groups[pool].add if add else self._pool_groups[pool].discard)(key)
        if obj is None:
            self._by_kind[key[0]].discard(key)
        else:
            self._by_kind[key[0]].add(key)

    def put(self, obj: Object) -> None:
        """Cache ``obj`` (:func:`trimmed`) unless the cache holds a newer version or saw it deleted."""
        key = key_of(obj)
        old = self.objects.get(key)
        if old is not None and not _newer_or_equal(obj, old):
            return
        gone_at = self._gone.get(key)
        if gone_at is not None:
            version = _version(obj)
            if version is not None and version <= gone_at:
                # A write's response that arrives after the delete was seen: the object is gone, and a
                # reconcile that found it here would believe it in sync and never make it again.
                return
            del self._gone[key]
        obj = trimmed(obj)
        self._index(key, obj)
        self.objects[key] = obj
        owner = owner_key(obj)
        previous = self._owner_of.get(key)
        if previous and previous != owner:
            self._owned[previous].discard(key)
        if owner:
            self._owner_of[key] = owner
            self._owned[owner].add(key)

    def remove(self, obj_or_key: Object | Key) -> None:
        key = obj_or_key if isinstance(obj_or_key, tuple) else key_of(obj_or_key)
        self._index(key, None)
        cached = self.objects.pop(key, None)
        # Nothing up to this version may come back: the deleted object's own (a DELETED event), else the
        # cached copy's (our own delete, a 404).
        gone_at = max((v for v in (_version(cached), None if isinstance(obj_or_key, tuple) else
                                   _version(obj_or_key)) if v is not None), default=None)
        if gone_at is not None:
            self._gone[key] = max(gone_at, self._gone.get(key, gone_at))
            self._gone.move_to_end(key)
            while len(self._gone) > TOMBSTONES:
                self._gone.popitem(last=False)
        owner = self._owner_of.pop(key, None)
        if owner:
            self._owned[owner].discard(key)
            if not self._owned[owner]:
                del self._owned[owner]

    def get(self, key: Key) -> Object | None:
        return self.objects.get(key)

    def children(self, owner: Key) -> dict[Key, Object]:
        return {k: self.objects[k] for k in self._owned.get(owner, ()) if k in self.objects}

    def owners(self, kind: str) -> list[Key]:
        return sorted(self._by_kind.get(kind, ()))

    def keys(self, kind: str, namespace: str | None = None) -> list[Key]:
        """Cached objects of one kind (in one namespace, or all)."""
        return sorted(k for k in self._by_kind.get(kind, ()) if namespace is None or k[1] == namespace)

    def endpoint_slices(self, namespace: str, service: str) -> list[Object]:
        """The EndpointSlices of one Service (the EndpointSlice controller labels them with its name)."""
        return [self.objects[k] for k in sorted(self._slices.get((namespace, service), ()))]

    def groups_of_pool(self, pool: str) -> list[Key]:
        return sorted(self._pool_groups.get(pool, ()))
