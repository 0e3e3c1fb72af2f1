"""The child applier: make an owner's children match the desired objects, and touch nothing else.

Generic over kinds and owners: the pool and group reconcilers hand it an owner and the objects their pure builders
made; it creates what is missing, applies what differs (server-side apply, as the field manager
:data:`~maru_operator.ownership.FIELD_MANAGER`), deletes what is no longer wanted, and reports names it could not
take (another controller's objects) and writes the API server refused. Whether a child differs is decided once per
change of either side (:meth:`ChildApplier.check`): a fleet of unchanged children costs no diff and no write.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Collection
from dataclasses import dataclass, field
from typing import Any

from maru_operator import metrics
from maru_operator.builders.common import Owner
from maru_operator.builders.scaling import create_replicas, scaled_externally
from maru_operator.cache import Key, Store
from maru_operator.kube import ApiError, Kube
from maru_operator.objects import Object
from maru_operator.ownership import (
    FIELD_MANAGER,
    REPLICAS_PATH,
    adopted_ownership,
    adoption_patch,
    controlled_by,
    created_body,
    describe_controller,
    key_of,
    legacy_owner,
    out_of_sync,
    plan,
    released_ownership,
)

log = logging.getLogger("maru_operator.controller")

# A child's fields are made applied ones with a compare-and-swap: tries before the next pass.
_ADOPT_TRIES = 3
# The most writes one owner has in flight at once: its children are independent of one another.
WRITE_CONCURRENCY = 8
# Kinds the operator never deletes: their owner's deletion does (ownerReferences), and the operator holds
# no delete right on Secrets (the pools' keys, in its own namespace).
NEVER_PRUNED = frozenset({"Secret"})


def _digest(obj: Object) -> bytes:
    # repr, not canonical JSON (twice the cost, on every child of every reconcile): the same builder, or the same
    # server's answer, lists the same keys in the same order, and a digest that differs only costs one diff.
    return hashlib.blake2b(repr(obj).encode(), digest_size=16).digest()


def _fingerprint(actual: Object) -> bytes:
    """What an actual child is compared on: all but its status, resourceVersion and others' managedFields.

    A Deployment's status is written several times on its way to Ready (new resourceVersions each time);
    none of that can make it differ from the desired object.
    """
    meta = actual.get("metadata") or {}
    ours = [
        e for e in meta.get("managedFields") or [] if e.get("manager") == FIELD_MANAGER and not e.get("subresource")
    ]
    return _digest(
        {
            **{k: v for k, v in actual.items() if k not in ("status", "metadata")},
            "metadata": {
                **{k: v for k, v in meta.items() if k not in ("resourceVersion", "generation", "managedFields")},
                "managedFields": ours,
            },
        }
    )


class Replaced(Exception):
    """The child an update was meant for is gone, or another object has its name now."""


@dataclass
class Applied:
    """The children after an apply pass, and the names this owner could not take (key -> why)."""

    children: dict[Key, Object]
    conflicts: dict[Key, str] = field(default_factory=dict)
    # Children the API server refused to write as desired (422: invalid, 403: an admission plugin), key -> why:
    # the child stays as it is and the owner's status says so, while its other children are written.
    refused: dict[Key, str] = field(default_factory=dict)


class ChildApplier:
    def __init__(self, kube: Kube, store: Store) -> None:
        self.kube = kube
        self.store = store
        # child -> (digest of the desired object, resourceVersion, fingerprint of the actual one) when the child
        # was last found in sync or applied: no diff is run again, and an apply the server took as is is not
        # repeated, while the desired object and the child's fingerprint stay the same.
        self.synced: dict[Key, tuple[bytes, Any, bytes]] = {}

    async def apply(self, owner: Owner, desired: list[Object], keep: Collection[Key] = ()) -> Applied:
        """Create, apply and delete children so they match ``desired``; return what is there now.

        Only objects controlled by this very owner (its uid in their controller reference) are ever
        written or deleted; a namesake it does not control is reported as a conflict and left as is,
        even one created between the operator's look and its write: a name is taken with a create,
        which fails on any object of that name, and a child is updated with an apply naming its uid,
        which fails on any other object of that name.
        """
        owner_key: Key = (owner.kind, owner.namespace or "", owner.name)
        ours = {k: o for k, o in self.store.children(owner_key).items() if controlled_by(o, owner.uid)}
        creates, updates, deletes = plan(desired, ours, self._check)
        result = Applied(children=dict(ours))

        async def update(obj: Object, why: str) -> None:
            key = key_of(obj)
            try:
                result.children[key] = await self._update(obj, ours[key], why)
            except Replaced as err:
                # The child it saw is gone, or another object has its name: the name is to be taken again.
                log.info("%s %s: %s; looking at the name afresh", owner.kind, owner.name, err)
                self.store.remove(key)
                self.synced.pop(key, None)
                result.children.pop(key, None)
                await self._take(obj, owner, result)

        async def refusable(obj: Object, write: Awaitable[None]) -> None:
            try:
                await write
            except ApiError as err:
                # Retrying changes nothing until the spec does: it is reported, not raised (a raise stopped the
                # reconcile before its status write, and the queue retried it for ever).
                if err.status not in (403, 422):
                    raise
                kind, ns, name = key_of(obj)
                result.refused[key_of(obj)] = (
                    f"{kind} {f'{ns}/{name}' if ns else name} was not written: "
                    f"{err.reason} ({err.status}): {err.message}"
                )
                log.warning("%s %s: the API server refused %s", owner.kind, owner.name, result.refused[key_of(obj)])

        await _together(
            [refusable(obj, self._take(obj, owner, result)) for obj in creates]
            + [refusable(obj, update(obj, why)) for obj, why in updates]
        )
        for obj in deletes:
            key = key_of(obj)
            if key in keep or key[0] in NEVER_PRUNED:
                continue
            kind, ns, name = key
            log.info("deleting %s %s/%s: no longer wanted by %s %s", kind, ns, name, owner.kind, owner.name)
            await self.kube.delete(kind, ns or None, name, uid=obj["metadata"].get("uid"))
            metrics.WRITES.labels(kind, "delete").inc()
            self.store.remove(key)
            self.synced.pop(key, None)
            result.children.pop(key, None)
        return result

    async def _take(self, obj: Object, owner: Owner, result: Applied) -> None:
        """A child this owner is not known to have: create it, use it if it is ours, else report a conflict."""
        key = key_of(obj)
        # Create first: a create never writes into an existing object, and most names are free (a look
        # before every create was one more request per child).
        try:
            created = await self.kube.create(create_replicas(created_body(obj)))
        except ApiError as err:
            if err.status != 409:
                raise
            # The name is taken: by us (the watch has not told us yet, or an earlier create of ours landed
            # although its answer was lost), or by someone else, whose object is never written to.
            have = await self._claim(obj, owner, result)
            if have is None and key not in result.conflicts:
                raise  # gone again already: the retry looks afresh
        else:
            result.children[key] = await self._created(obj, created)
            return
        if have is None:
            return  # a conflict, reported by _claim
        why = self._check(obj, have)
        result.children[key] = have if why is None else await self._update(obj, have, why)

    async def _claim(self, obj: Object, owner: Owner, result: Applied) -> Object | None:
        """After a create found the name taken: None when it is free again, the object when it is ours; else a
        conflict."""
        kind, ns, name = key_of(obj)
        have = await self.kube.get(kind, ns or None, name)
        if have is None or controlled_by(have, owner.uid):
            if have is not None:
                self.store.put(have)  # ours; the watch has not delivered it yet
            return have
        where = f"{ns}/{name}" if ns else name
        result.conflicts[key_of(obj)] = (
            f"{kind} {where} exists and is not controlled by this {owner.kind} (its controller: "
            f"{describe_controller(have)}); the operator never changes objects it does not control: delete or "
            "rename it"
        )
        log.warning("%s %s: %s", owner.kind, owner.name, result.conflicts[key_of(obj)])
        return None

    async def _created(self, obj: Object, created: Object) -> Object:
        """After a create: the child is in sync as created. Its fields stay the create's (an update entry) until
        the first apply it needs adopts them (see :mod:`maru_operator.ownership`): most children are never
        written again, and an adoption right after every create was half of all writes at fleet scale."""
        kind, ns, name = key_of(obj)
        metrics.WRITES.labels(kind, "create").inc()
        log.info("created %s %s/%s", kind, ns, name)
        self._synced_as(obj, created)
        self.store.put(created)
        return created

    async def _adopt(self, obj: Object, created: Object) -> Object | None:
        """Make the operator's fields of ``created`` (a child it created, or an earlier version wrote with plain
        updates) applied ones; None when it keeps changing or went. All of them, those the spec no longer has
        too (for the apply to remove them), but an externally scaled role's replicas: those are handed over,
        owned by nobody, and the apply keeps them."""
        kind, ns, name = key_of(obj)
        uid = created.get("metadata", {}).get("uid")
        current: Object | None = created
        for _ in range(_ADOPT_TRIES):
            if current is None or current["metadata"].get("uid") != uid:
                return None  # gone or replaced already: the next pass looks at the name afresh
            release = REPLICAS_PATH if scaled_externally(obj) else None
            try:
                ops = adoption_patch(current, release=release)
                if ops is not None:
                    # Our entry alone, as read: a status write since the create does not fail it.
                    return await self.kube.json_patch(kind, ns or None, name, ops)
                # With the resourceVersion: the whole list is replaced, so it must be the one just read (a
                # controller writing status right after the create adds an entry of its own).
                return await self.kube.patch(
                    kind,
                    ns or None,
                    name,
                    {
                        "metadata": {
                            "managedFields": adopted_ownership(current, release=release),
                            "resourceVersion": current["metadata"].get("resourceVersion"),
                        }
                    },
                )
            except ApiError as err:
                # 422: a test of the JSON patch failed (our entry or the uid is no longer as read).
                if err.status not in (404, 409, 422):
                    raise
            current = await self.kube.get(kind, ns or None, name)
        return None

    async def _update(self, obj: Object, have: Object, why: str) -> Object:
        """Apply ``obj`` to the child ``have``, and to no other object that may have its name by now."""
        kind, ns, name = key_of(obj)
        uid = have["metadata"].get("uid")
        try:
            # The cache keeps only the operator's own managedFields (maru_operator.cache.trimmed): the two writes
            # below send the list whole, so they start from the object as the API has it.
            if legacy_owner(have):
                # Created and never applied to (or written by a version of the operator before server-side
                # apply): its fields become applied ones, so this apply removes those the spec no longer has.
                # A role handed to an autoscaler adopts all but its replicas (the create's), which stay as they
                # are, owned by nobody. A status write between the look and the patch is no failure: the patch
                # is tried again on a fresh copy.
                adopted = await self._adopt(obj, await self._whole(have))
                if adopted is None:
                    raise Replaced(
                        f"{kind} {ns}/{name} (uid {uid}) went or kept changing while its fields were adopted"
                    )
            elif scaled_externally(obj) and released_ownership(have, obj) is not None:
                # A role handed to an autoscaler: its replicas stay as they are, owned by nobody, instead
                # of being removed by the apply (and reset to 1) for no longer being the operator's.
                whole = await self._whole(have)
                released = released_ownership(whole, obj)
                if released is not None:
                    await self.kube.patch(
                        kind,
                        ns or None,
                        name,
                        {
                            "metadata": {
                                "managedFields": released,
                                "resourceVersion": whole["metadata"].get("resourceVersion"),
                            }
                        },
                    )
            applied = await self.kube.apply(obj, uid=uid)
        except ApiError as err:
            # 404/409: gone or changed; 422: another object has the name. Which one, a fresh look tells.
            if err.status not in (404, 409, 422):
                raise
            now = await self.kube.get(kind, ns or None, name)
            if now is not None and now["metadata"].get("uid") == uid:
                raise
            raise Replaced(
                f"{kind} {ns}/{name} (uid {uid}) is gone"
                if now is None
                else f"{kind} {ns}/{name} is another object now (uid {now['metadata'].get('uid')}, not {uid})"
            ) from err
        metrics.WRITES.labels(kind, "apply").inc()
        log.info("updated %s %s/%s to match its owner's spec (first difference at %s)", kind, ns, name, why)
        self._synced_as(obj, applied)
        self.store.put(applied)
        return applied

    async def _whole(self, have: Object) -> Object:
        """The child ``have`` as the API has it now, every manager's managedFields included."""
        kind, ns, name = key_of(have)
        uid = have["metadata"].get("uid")
        now = await self.kube.get(kind, ns or None, name)
        if now is None or now["metadata"].get("uid") != uid:
            raise Replaced(
                f"{kind} {ns}/{name} (uid {uid}) is gone"
                if now is None
                else f"{kind} {ns}/{name} is another object now (uid {now['metadata'].get('uid')}, not {uid})"
            )
        return now

    def _synced_as(self, obj: Object, actual: Object) -> None:
        """``actual`` is what applying ``obj`` made: in sync with it until either changes."""
        self.synced[key_of(obj)] = (
            _digest(obj),
            actual.get("metadata", {}).get("resourceVersion"),
            _fingerprint(actual),
        )

    def _check(self, obj: Object, have: Object) -> str | None:
        """:func:`out_of_sync`, run only when the desired object or the child changed since it last passed
        (or was applied as is: then what differs is someone else's, e.g. their list items)."""
        key, digest = key_of(obj), _digest(obj)
        version = have.get("metadata", {}).get("resourceVersion")
        seen = self.synced.get(key)
        if seen is not None and seen[0] == digest:
            if seen[1] == version:
                return None
            fingerprint = _fingerprint(have)
            if seen[2] == fingerprint:
                self.synced[key] = (digest, version, fingerprint)
                return None
        why = out_of_sync(obj, have)
        if why is None:
            self.synced[key] = (digest, version, _fingerprint(have))
        return why


async def _together(writes: list[Awaitable[None]]) -> None:
    """Run independent writes at once, at most WRITE_CONCURRENCY in flight; every one runs to its end, then
    the first failure is raised (the retry redoes only what is still missing)."""
    bound = asyncio.Semaphore(WRITE_CONCURRENCY)

    async def one(write: Awaitable[None]) -> None:
        async with bound:
            await write

    results = await asyncio.gather(*(one(w) for w in writes), return_exceptions=True)
    for outcome in results:
        if isinstance(outcome, BaseException):
            raise outcome
