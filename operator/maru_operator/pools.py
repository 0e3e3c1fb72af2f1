"""The MaruPool reconciler: the pool's children (daemons, key, metadata server, policies), its finalizer while
groups are bound to it, and its status from its daemons' answers.

Level-triggered: every pass builds the whole desired state from the spec (:mod:`maru_operator.builders.pool`) and
hands it to the child applier; running it twice changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from typing import Any

import kopf
from pydantic import ValidationError

from maru_contracts.tenancy import KEY_BYTES
from maru_operator.api.marupool import MaruPoolSpec, MaruPoolStatus
from maru_operator.applier import ChildApplier
from maru_operator.builders.common import LABEL_COMPONENT, LABEL_INSTANCE, LABEL_MANAGED_BY, MANAGED_BY, Owner
from maru_operator.builders.credentials import pool_key, pool_key_name
from maru_operator.builders.netpol import NetworkPolicyConfig, build_pool_policies
from maru_operator.builders.pool import (
    COMPONENT_AGENT,
    agent_name,
    build_pool_children,
    metadata_name,
)
from maru_operator.cache import Key, Store
from maru_operator.dataplane import DataPlane, container_image
from maru_operator.errors import model_errors
from maru_operator.kube import Kube, StatusFetcher
from maru_operator.objects import Object
from maru_operator.ownership import (
    controlled_by,
)
from maru_operator.status import (
    PoolObservation,
    blocked_pool_status,
    changed,
    invalid_pool_status,
    pool_status,
    tenant_usage,
    usage_only_change,
)
from maru_operator.statuswriter import StatusWriter
from maru_operator.telemetry import PoolTelemetry
from maru_operator.validation import check_pool

log = logging.getLogger("maru_operator.controller")

POOL_FINALIZER = "maru.io/in-use-protection"
DELETION_RETRY_SECONDS = 15.0


class PoolReconciler:
    def __init__(
        self,
        *,
        kube: Kube,
        store: Store,
        applier: ChildApplier,
        status: StatusWriter,
        telemetry: PoolTelemetry,
        pool_namespace: str,
        fetch_status: StatusFetcher,
        network: NetworkPolicyConfig,
        data_plane: DataPlane,
        usage_interval: float,
        clock: Callable[[], str],
        monotonic: Callable[[], float],
    ) -> None:
        self.kube, self.store, self.applier, self.status, self.telemetry = kube, store, applier, status, telemetry
        self.pool_namespace = pool_namespace
        self.fetch_status = fetch_status
        self.network = network
        self.data_plane = data_plane
        self.usage_interval = usage_interval
        self.clock, self.monotonic = clock, monotonic
        # pool -> when its status was last written (monotonic seconds)
        self._pool_written: dict[str, float] = {}

    async def reconcile(self, name: str) -> float | None:
        key: Key = ("MaruPool", "", name)
        body = self.store.get(key)
        if body is None:
            return None
        meta = body.get("metadata", {})
        old = MaruPoolStatus.model_validate(body.get("status") or {})
        if meta.get("deletionTimestamp"):
            # Before anything reads the spec: a pool whose spec is invalid must still be deletable.
            return await self._release_pool(body, old)
        try:
            spec = MaruPoolSpec.model_validate(body.get("spec") or {})
            errors = [str(e) for e in check_pool(spec, name)]
        except ValidationError as err:
            errors = model_errors(err)
        if errors:
            new_status = invalid_pool_status(errors, meta.get("generation"), old, self.clock())
            await self.status.write(body, old, new_status)
            raise kopf.PermanentError("invalid spec, no child touched: " + "; ".join(errors))
        owner = Owner.from_body(body)
        bound = self._bound_groups(body)
        finalizers = list(meta.get("finalizers") or [])

        if POOL_FINALIZER not in finalizers:
            # Nothing may delete the pool's memory from under the groups using it (see the deletion branch).
            updated = await self.kube.patch(
                "MaruPool",
                None,
                name,
                {
                    "metadata": {
                        "finalizers": [*finalizers, POOL_FINALIZER],
                        "resourceVersion": meta.get("resourceVersion"),
                    }
                },
            )
            self.store.put(updated)
            body, meta = updated, updated.get("metadata", {})

        ns = self.pool_namespace
        key = await self._pool_key(owner)
        images = self.data_plane.images_for(
            ("MaruPool", "", name),
            meta,
            {"pool": container_image(self.store.get(("DaemonSet", ns, agent_name(name))), name="agent")},
        )
        desired = build_pool_children(images.for_pool(spec), owner, ns, key)
        desired += build_pool_policies(spec, owner, ns, self.network)
        applied = await self.applier.apply(owner, desired)
        children = applied.children
        pods = await self.kube.list(
            "Pod",
            ns,
            {
                LABEL_MANAGED_BY: MANAGED_BY,
                LABEL_INSTANCE: owner.instance,
                LABEL_COMPONENT: COMPONENT_AGENT,
            },
        )
        seen = PoolObservation(
            daemonset=children.get(("DaemonSet", ns, agent_name(name))),
            metadata_deployment=children.get(("Deployment", ns, metadata_name(name))),
            agent_pods=pods,
            bound_groups=bound,
            conflicts=list(applied.conflicts.values()),
        )
        seen.stats = await self._pool_stats(spec, name, pods)
        readers = self.telemetry.readers_of(name)
        was_reachable, known = readers.reachable, set(self.telemetry.pool_tenants.get(name, {}))
        readers.observe(self.monotonic(), seen.stats)
        tenants = tenant_usage(seen.stats)
        if tenants is not None:  # no answer: the groups keep the last use they were told
            self.telemetry.pool_tenants[name] = tenants
        self.telemetry.wake_groups(name, set(tenants or {}) - known, readers.reachable != was_reachable)
        new = pool_status(name, spec, meta.get("generation"), seen, old, self.clock())
        return await self._write_pool_status(body, old, new)

    async def _write_pool_status(self, body: Object, old: MaruPoolStatus, new: MaruPoolStatus) -> float:
        """Write now, or hold a change of use alone until ``usage_interval`` has passed since the last write.

        Returns when to look at the pool again: when held usage is due, else after ``usage_interval``.
        """
        name = body["metadata"]["name"]
        since = self.monotonic() - self._pool_written.get(name, float("-inf"))
        if usage_only_change(old, new) and since < self.usage_interval:
            return self.usage_interval - since
        if changed(old, new):
            await self.status.write(body, old, new)
            self._pool_written[name] = self.monotonic()
        return self.usage_interval

    def _bound_groups(self, body: Object) -> list[str]:
        """``namespace/name`` of the groups holding the pool; read from the raw spec, valid or not.

        Groups refused by allowedNamespaces never got pods using this pool: they do not hold it.
        """
        allowed = (body.get("spec") or {}).get("allowedNamespaces")
        return [
            f"{ns}/{n}"
            for _, ns, n in self.store.groups_of_pool(body["metadata"]["name"])
            if allowed is None or ns in allowed
        ]

    async def _release_pool(self, body: Object, old: MaruPoolStatus) -> None:
        """A deleted pool keeps its finalizer while groups are bound to it, then lets go."""
        meta = body["metadata"]
        name = meta["name"]
        finalizers = list(meta.get("finalizers") or [])
        if POOL_FINALIZER not in finalizers:
            return None
        bound = self._bound_groups(body)
        if bound:
            await self.status.write(body, old, blocked_pool_status(bound, meta.get("generation"), old, self.clock()))
            raise kopf.TemporaryError(
                f"deletion waits for {len(bound)} bound InferenceGroup(s): {', '.join(bound[:5])}",
                delay=DELETION_RETRY_SECONDS,
            )
        remaining = [f for f in finalizers if f != POOL_FINALIZER]
        await self.kube.patch(
            "MaruPool",
            None,
            name,
            {"metadata": {"finalizers": remaining or None, "resourceVersion": meta.get("resourceVersion")}},
        )
        log.info("MaruPool %s: no group is bound any more; released for deletion", name)
        return None

    async def _current_key(self, pool: str, pool_uid: str | None) -> bytes | None:
        """The key in the pool's key Secret (from the cache, else the API, which may not have listed yet);
        None when there is none, or the Secret of that name is not the pool's."""
        key: Key = ("Secret", self.pool_namespace, pool_key_name(pool))
        secret = self.store.get(key)
        if secret is None:
            secret = await self.kube.get("Secret", self.pool_namespace, key[2])
            if secret is not None:
                secret.setdefault("kind", "Secret")
                self.store.put(secret)
        return pool_key(secret) if secret is not None and controlled_by(secret, pool_uid) else None

    async def _pool_key(self, owner: Owner) -> bytes:
        """The pool's key: the one its Secret holds, or a new random one when there is none yet.

        A key is generated once and kept: a new one refuses every token issued under the old one until the
        groups' credentials and the daemons' key files catch up (a rotation, which deleting the Secret does).
        """
        existing = await self._current_key(owner.name, owner.uid)
        if existing is not None:
            return existing
        log.info(
            "MaruPool %s: generating its key (Secret %s/%s)", owner.name, self.pool_namespace, pool_key_name(owner.name)
        )
        return secrets.token_bytes(KEY_BYTES)

    async def _pool_stats(self, spec: MaruPoolSpec, name: str, pods: list[Object]) -> dict[str, Any]:
        """Best effort: a daemon that does not answer leaves ``used`` unknown, never fails the reconcile."""
        port = spec.daemon.metrics_port
        urls: dict[str, str] = {}
        if spec.backend == "dax":
            urls["metadata"] = f"http://{metadata_name(name)}.{self.pool_namespace}.svc:{port}/status"
        else:
            for pod in pods:
                node, ip = pod.get("spec", {}).get("nodeName"), pod.get("status", {}).get("podIP")
                if node and ip:
                    urls[node] = f"http://{ip}:{port}/status"
        answers = await asyncio.gather(*(self.fetch_status(u) for u in urls.values()))
        return dict(zip(urls, answers, strict=True))
