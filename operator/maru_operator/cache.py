"""What the operator has seen through its watches: owners and the children they own, by key.

Fed by kopf's watch events (and by our own write responses, so a reconcile right after a write does
not act on a stale copy). Nothing here does I/O.
"""

from __future__ import annotations

import pickle
import zlib
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from maru_operator.api.common import GROUP
from maru_operator.objects import Key, Object, key_of
from maru_operator.ownership import FIELD_MANAGER

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
# Cached objects are kept compressed (pickled, zlib): a Deployment is ~3 KB so, against ~40 KB as Python dicts,
# and bytes are nothing for the garbage collector to walk (at a thousand groups its passes over the cache's
# dicts were a fifth of the operator's CPU time). The fastest level: a reconcile unpacks its owner's children.
PACK_LEVEL = 1


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


def trimmed(obj: Object) -> Object:
    """``obj`` as the cache keeps it: of its managedFields only the operator's own entries.

    The diff needs no other manager's entries (it asks only which fields the operator applied), and those
    entries were half of what the cache held. The rare writes that must send managedFields whole (adopting
    fields, releasing replicas to an autoscaler) read the object afresh first. ``obj`` itself is not changed.
    """
    meta = obj.get("metadata")
    entries = meta.get("managedFields") if isinstance(meta, dict) else None
    if not entries:
        return obj
    ours = [e for e in entries if e.get("manager") == FIELD_MANAGER and not e.get("subresource")]
    kept = {k: v for k, v in meta.items() if k != "managedFields"}
    if ours:
        kept["managedFields"] = ours
    return {**obj, "metadata": kept}


def _pack(obj: Object) -> bytes:
    # Pickle, not JSON: several times cheaper both ways, and nothing but this cache ever reads it back.
    return zlib.compress(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL), PACK_LEVEL)


def _unpack(packed: bytes) -> Object:
    return pickle.loads(zlib.decompress(packed))  # our own bytes (_pack): never anyone else's


@dataclass(slots=True)
class _Entry:
    """One cached object: packed, with what the cache's own bookkeeping reads of it kept unpacked."""

    packed: bytes
    uid: str | None
    version: str | None  # resourceVersion
    owner: Key | None  # the MaruPool or InferenceGroup controlling it
    slot: Any  # its place in the kind's index (a Service's slices, a pool's groups), if any
    summary: Any = None  # what a summarizer of its kind (Store.summarize) made of it


def _pool_of(obj: Object) -> str | None:
    return ((obj.get("spec") or {}).get("poolRef") or {}).get("name")


def _slot(key: Key, obj: Object) -> Any:
    if key[0] == "EndpointSlice":
        return key[1], (obj.get("metadata", {}).get("labels") or {}).get(SERVICE_NAME_LABEL, "")
    if key[0] == "InferenceGroup":
        return _pool_of(obj)
    return None


class Store:
    """The cached objects by key, each packed (:func:`_pack`): every read hands out a copy of its own."""

    def __init__(self) -> None:
        self._entries: dict[Key, _Entry] = {}
        self._owned: dict[Key, set[Key]] = defaultdict(set)
        self._gone: OrderedDict[Key, int] = OrderedDict()
        # Indexes, so that a reconcile's look-ups cost the same with 10 objects or 50,000.
        self._by_kind: dict[str, set[Key]] = defaultdict(set)
        self._slices: dict[tuple[str, str], set[Key]] = defaultdict(set)  # (namespace, service) -> slices
        self._pool_groups: dict[str, set[Key]] = defaultdict(set)  # pool -> groups naming it
        self._summarizers: dict[str, Callable[[Object], Any]] = {}  # kind -> what summarizes its objects

    def summarize(self, kind: str, summarizer: Callable[[Object], Any]) -> None:
        """Keep ``summarizer(obj)`` of every object of ``kind`` unpacked, for :meth:`summary` and
        :meth:`summaries` (a question asked of every Deployment must not unpack them all)."""
        self._summarizers[kind] = summarizer
        for key in self._by_kind.get(kind, ()):
            self._entries[key].summary = summarizer(_unpack(self._entries[key].packed))

    def summary(self, key: Key) -> Any:
        entry = self._entries.get(key)
        return entry.summary if entry is not None else None

    def summaries(self, kind: str) -> dict[Key, Any]:
        return {k: self._entries[k].summary for k in self._by_kind.get(kind, ())}

    def holds_version(self, obj: Object) -> bool:
        """Whether the cache holds this very version of ``obj`` (same uid and resourceVersion)."""
        cached = self._entries.get(key_of(obj))
        if cached is None:
            return False
        meta = obj.get("metadata") or {}
        return (
            cached.version is not None
            and cached.version == meta.get("resourceVersion")
            and cached.uid == meta.get("uid")
        )

    def holds_since(self, obj: Object) -> bool:
        """Whether the cache holds ``obj``'s version or a later one of the same object (same uid).

        A watch event of a version older than the cached one tells nothing new: the event of the cached
        version, or whoever cached it (a write's answer), brought everything it changed.
        """
        cached = self._entries.get(key_of(obj))
        if cached is None or cached.uid != (obj.get("metadata") or {}).get("uid"):
            return False
        have, seen = _number(cached.version), _version(obj)
        if have is None or seen is None:
            return self.holds_version(obj)
        return have >= seen

    def _index(self, key: Key, old: _Entry | None, new: _Entry | None) -> None:
        """Move ``key`` in the indexes from its cached entry ``old`` to ``new`` (None: out of them)."""
        for entry, add in ((old, False), (new, True)):
            if entry is None or entry.slot is None:
                continue
            index = self._slices if key[0] == "EndpointSlice" else self._pool_groups
            (index[entry.slot].add if add else index[entry.slot].discard)(key)
        if new is None:
            self._by_kind[key[0]].discard(key)
        else:
            self._by_kind[key[0]].add(key)
        before, after = old.owner if old else None, new.owner if new else None
        if before is not None and before != after:
            self._owned[before].discard(key)
            if not self._owned[before]:
                del self._owned[before]
        if after is not None:
            self._owned[after].add(key)

    def put(self, obj: Object) -> None:
        """Cache ``obj`` (:func:`trimmed`) unless the cache holds a newer version or saw it deleted."""
        key = key_of(obj)
        old = self._entries.get(key)
        meta = obj.get("metadata") or {}
        version = meta.get("resourceVersion")
        if old is not None and _older(version, old.version):
            return
        gone_at = self._gone.get(key)
        if gone_at is not None:
            number = _number(version)
            if number is not None and number <= gone_at:
                # A write's response that arrives after the delete was seen: the object is gone, and a
                # reconcile that found it here would believe it in sync and never make it again.
                return
            del self._gone[key]
        kept = trimmed(obj)
        summarizer = self._summarizers.get(key[0])
        entry = _Entry(
            _pack(kept),
            meta.get("uid"),
            version,
            owner_key(kept),
            _slot(key, kept),
            summarizer(kept) if summarizer is not None else None,
        )
        self._index(key, old, entry)
        self._entries[key] = entry

    def remove(self, obj_or_key: Object | Key) -> None:
        key = obj_or_key if isinstance(obj_or_key, tuple) else key_of(obj_or_key)
        cached = self._entries.pop(key, None)
        self._index(key, cached, None)
        # Nothing up to this version may come back: the deleted object's own (a DELETED event), else the
        # cached copy's (our own delete, a 404).
        gone_at = max(
            (
                v
                for v in (
                    _number(cached.version) if cached else None,
                    None if isinstance(obj_or_key, tuple) else _version(obj_or_key),
                )
                if v is not None
            ),
            default=None,
        )
        if gone_at is not None:
            self._gone[key] = max(gone_at, self._gone.get(key, gone_at))
            self._gone.move_to_end(key)
            while len(self._gone) > TOMBSTONES:
                self._gone.popitem(last=False)

    def get(self, key: Key) -> Object | None:
        entry = self._entries.get(key)
        return _unpack(entry.packed) if entry is not None else None

    def owner(self, key: Key) -> Key | None:
        """The owner controlling the cached ``key`` (None: not cached, or no owner of ours), without unpacking it."""
        entry = self._entries.get(key)
        return entry.owner if entry is not None else None

    def version(self, key: Key) -> str | None:
        """The cached resourceVersion of ``key`` (None: not cached), without unpacking it."""
        entry = self._entries.get(key)
        return entry.version if entry is not None else None

    def children(self, owner: Key) -> dict[Key, Object]:
        return {k: _unpack(self._entries[k].packed) for k in self._owned.get(owner, ()) if k in self._entries}

    def owners(self, kind: str) -> list[Key]:
        return sorted(self._by_kind.get(kind, ()))

    def keys(self, kind: str, namespace: str | None = None) -> list[Key]:
        """Cached objects of one kind (in one namespace, or all)."""
        return sorted(k for k in self._by_kind.get(kind, ()) if namespace is None or k[1] == namespace)

    def endpoint_slices(self, namespace: str, service: str) -> list[Object]:
        """The EndpointSlices of one Service (the EndpointSlice controller labels them with its name)."""
        return [_unpack(self._entries[k].packed) for k in sorted(self._slices.get((namespace, service), ()))]

    def groups_of_pool(self, pool: str) -> list[Key]:
        return sorted(self._pool_groups.get(pool, ()))


def _number(version: str | None) -> int | None:
    try:
        return int(version)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def _older(version: str | None, than: str | None) -> bool:
    """True only when ``version`` is provably older (numeric resourceVersions, as every real server uses)."""
    a, b = _number(version), _number(than)
    return a is not None and b is not None and a < b
