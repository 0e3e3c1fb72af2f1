"""Reconcile one owner: read the snapshot, build the desired children, apply the difference, write status.

Every reconcile computes the whole desired state from the spec, so running it twice changes nothing,
and a child edited or deleted by hand is put back on the next pass.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import secrets
import time
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass, field
from typing import Any

import kopf
from pydantic import ValidationError

from maru_contracts.tenancy import KEY_BYTES
from maru_operator import conditions as cond
from maru_operator import metrics
from maru_operator.api.common import Condition
from maru_operator.api.inferencegroup import InferenceGroupSpec, InferenceGroupStatus
from maru_operator.api.marupool import MaruPoolSpec, MaruPoolStatus
from maru_operator.applier import Applied, ChildApplier
from maru_operator.builders.children import build_group_children
from maru_operator.builders.common import LABEL_COMPONENT, LABEL_INSTANCE, LABEL_MANAGED_BY, MANAGED_BY, Owner
from maru_operator.builders.credentials import pool_key, pool_key_name
from maru_operator.builders.group import (
    cache_scope,
    role_name,
    router_endpoint,
    router_name,
    service_name,
)
from maru_operator.builders.inferencepool import build_inference_pool
from maru_operator.builders.netpol import NetworkPolicyConfig, build_group_policies, build_pool_policies
from maru_operator.builders.pool import (
    COMPONENT_AGENT,
    agent_name,
    build_pool_children,
    metadata_name,
)
from maru_operator.builders.scaling import scaled_externally
from maru_operator.cache import Key, Store
from maru_operator.dataplane import DataPlane, Updates, container_image
from maru_operator.images import DEFAULT_IMAGES, ImageDefaults
from maru_operator.kube import ApiError, Kube, StatusFetcher, fetch_daemon_status
from maru_operator.objects import Object
from maru_operator.optionalkinds import OptionalKind
from maru_operator.readiness import selector as pod_selector
from maru_operator.reconcile import (
    controlled_by,
    key_of,
)
from maru_operator.rollouts import RolloutPacer
from maru_operator.rollouts import summary as rollout_summary
from maru_operator.status import (
    PoolObservation,
    Router,
    bind,
    blocked_pool_status,
    changed,
    group_status,
    group_usage_only_change,
    invalid_group_status,
    invalid_pool_status,
    pool_status,
    ready_endpoints,
    status_body,
    tenant_usage,
    usage_only_change,
)
from maru_operator.traffic import DEFAULT_WINDOW_S, ReaderWindow
from maru_operator.validation import check_group, check_group_on_pool, check_pool

log = logging.getLogger("maru_operator.controller")


POOL_FINALIZER = "maru.io/in-use-protection"
# The most often a pool's use (which changes with traffic) is written to its status, and how often a
# pool is looked at without events: its daemons' memory use changes silently.
DEFAULT_USAGE_INTERVAL = 30.0
UNBOUND_RETRY_SECONDS = 30.0
DELETION_RETRY_SECONDS = 15.0
# A group whose child the API server refused (422/403) looks again this often.
REFUSED_RETRY_SECONDS = 60.0
# On an autoscaled role's Deployment while its group's pool access is revoked: its replicas before (set to 0).
REVOKED_REPLICAS_ANNOTATION = "maru.io/replicas-before-revoke"
# A group whose rollout waits for others looks again this often (their Deployments' events wake it too).
ROLLOUT_QUEUE_SECONDS = 15.0
# With --read-pods, a group with a role not ready looks at its pods again this often.
POD_RECHECK_SECONDS = 30.0


def utcnow() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def model_errors(err: ValidationError) -> list[str]:
    """The model's refusals as ``spec.<field>: <rule>`` lines."""
    return [".".join(["spec", *(str(p) for p in e["loc"])]) + f": {e['msg']}" for e in err.errors()]


@dataclass
class Controller:
    kube: Kube
    store: Store
    pool_namespace: str
    fetch_status: StatusFetcher = fetch_daemon_status
    clock: Callable[[], str] = utcnow
    network: NetworkPolicyConfig = field(default_factory=NetworkPolicyConfig)
    pacer: RolloutPacer = field(default_factory=RolloutPacer)
    images: ImageDefaults = DEFAULT_IMAGES  # what pools and groups that name no image get
    # Whether a default image change (an operator upgrade) moves running data planes (see maru_operator.dataplane).
    data_plane_updates: Updates = "manual"
    usage_interval: float = DEFAULT_USAGE_INTERVAL
    monotonic: Callable[[], float] = time.monotonic
    # pool -> when its status was last written (monotonic seconds)
    _pool_written: dict[str, float] = field(default_factory=dict)
    # pool -> each tenant's (cache scope's) use, from the daemons' /status the pool's reconcile polls anyway
    _pool_tenants: dict[str, dict[str, Any]] = field(default_factory=dict)
    # How far back a group's DisaggregationActive condition looks (the operator's --disaggregation-window).
    disaggregation_window: float = DEFAULT_WINDOW_S
    # pool -> its decode traffic per tenant over the window, from the same polls of its daemons
    _pool_readers: dict[str, ReaderWindow] = field(default_factory=dict)
    # group -> (its pool, its cache scope there), as its last reconcile saw them
    _group_scopes: dict[Key, tuple[str, str]] = field(default_factory=dict)
    # Puts an owner on the work queue (the handlers' queue); a pool's poll wakes the groups it has news for.
    wake: Callable[[Key], None] | None = None
    # group -> when a change of its pool usage alone was last written (monotonic seconds)
    _group_written: dict[Key, float] = field(default_factory=dict)
    # Whether the API serves InferencePools (the Gateway API Inference Extension's CRD), for groups asking one.
    inference_pools: OptionalKind = field(default_factory=lambda: OptionalKind("InferencePool"))
    # Whether the operator reads the pods of a role that is not ready, to say why (--read-pods; RBAC opt-in).
    read_pods: bool = False

    def __post_init__(self) -> None:
        self.applier = ChildApplier(self.kube, self.store)
        self.store.summarize("Deployment", rollout_summary)
        self.data_plane = DataPlane(self.images, self.data_plane_updates)

    async def reconcile(self, key: Hashable) -> float | None:
        assert isinstance(key, tuple)
        if key[0] == "MaruPool":
            return await self.reconcile_pool(key[2])
        if key[0] == "InferenceGroup":
            return await self.reconcile_group(key[1], key[2])
        return None

    # --- shared ---------------------------------------------------------------------------------

    async def apply(self, owner: Owner, desired: list[Object], keep: Collection[Key] = ()) -> Applied:
        """Make ``owner``'s children match ``desired`` (:meth:`ChildApplier.apply`)."""
        return await self.applier.apply(owner, desired, keep)

    async def write_status(self, body: Object, old: Any, new: Any) -> None:
        if not changed(old, new):
            return
        kind, ns, name = key_of(body)
        try:
            updated = await self.kube.patch_status(kind, ns or None, name, status_body(new, old))
        except ApiError as err:
            if err.status != 404:
                raise
            # Deleted since it was cached (its DELETED event, or the next relist, tells the rest).
            log.info("%s %s is gone; not writing its status", kind, f"{ns}/{name}" if ns else name)
            self.store.remove(key_of(body))
            return
        metrics.STATUS_WRITES.labels(kind).inc()
        if isinstance(updated, dict) and updated.get("metadata"):
            self.store.put(updated)
        await self.announce(body, old.conditions, new.conditions)

    async def announce(self, body: Object, old: list[Any], new: list[Any]) -> None:
        """Post an Event for each condition that turned bad (Warning) or Ready that turned True."""
        before = {(c.type, c.status, c.reason) for c in old}
        for c in new:
            if (c.type, c.status, c.reason) in before:
                continue
            bad = (
                (c.type == cond.READY and c.status == "False" and c.reason in _WARN_READY)
                or (c.type in (cond.DEGRADED, cond.IN_USE) and c.status == "True" and c.reason in _WARN_OTHER)
                or (c.type in (cond.DISAGGREGATION_ACTIVE, cond.INFERENCE_POOL_READY) and c.status == "False")
            )
            good = c.type == cond.READY and c.status == "True"
            kind, ns, name = key_of(body)
            log.log(
                logging.WARNING if bad else logging.INFO,
                "%s %s: %s=%s (%s) %s",
                kind,
                f"{ns}/{name}" if ns else name,
                c.type,
                c.status,
                c.reason,
                c.message,
            )
            if bad or good:
                await self.kube.event(
                    body,
                    type_="Warning" if bad else "Normal",
                    reason=c.reason,
                    message=c.message or c.reason,
                    now=self.clock(),
                )

    # --- MaruPool -------------------------------------------------------------------------------

    async def reconcile_pool(self, name: str) -> float | None:
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
            await self.write_status(body, old, new_status)
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
        applied = await self.apply(owner, desired)
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
        readers = self._readers_of(name)
        was_reachable, known = readers.reachable, set(self._pool_tenants.get(name, {}))
        readers.observe(self.monotonic(), seen.stats)
        tenants = tenant_usage(seen.stats)
        if tenants is not None:  # no answer: the groups keep the last use they were told
            self._pool_tenants[name] = tenants
        self._wake_groups(name, set(tenants or {}) - known, readers.reachable != was_reachable)
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
            await self.write_status(body, old, new)
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
            await self.write_status(body, old, blocked_pool_status(bound, meta.get("generation"), old, self.clock()))
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

    # --- InferenceGroup -------------------------------------------------------------------------

    async def reconcile_group(self, namespace: str, name: str) -> float | None:
        key: Key = ("InferenceGroup", namespace, name)
        body = self.store.get(key)
        if body is None or body.get("metadata", {}).get("deletionTimestamp"):
            metrics.forget_group(namespace, name)
            self._group_scopes.pop(key, None)
            return None  # the garbage collector removes the children through their ownerReferences
        meta = body.get("metadata", {})
        generation = meta.get("generation")
        old = InferenceGroupStatus.model_validate(body.get("status") or {})
        try:
            spec = InferenceGroupSpec.model_validate(body.get("spec") or {})
            errors = [str(e) for e in check_group(spec)]
        except ValidationError as err:
            errors = model_errors(err)
        if errors:
            new = invalid_group_status(errors, generation, old, self.clock())
            await self.write_status(body, old, new)
            raise kopf.PermanentError("invalid spec, no child touched: " + "; ".join(errors))

        owner = Owner.from_body(body)
        pool_body = self.store.get(("MaruPool", "", spec.pool_ref.name))
        if pool_body is None:
            # Right after start-up the pools' watch may not have listed yet: ask before calling it missing,
            # or every group would flap to PoolNotFound on each operator restart.
            pool_body = await self.kube.get("MaruPool", None, spec.pool_ref.name)
            if pool_body is not None:
                self.store.put(pool_body)
        binding = bind(namespace, spec, pool_body)
        if binding.pool is not None and (errors := [str(e) for e in check_group_on_pool(spec, binding.pool)]):
            await self.write_status(body, old, invalid_group_status(errors, generation, old, self.clock()))
            raise kopf.PermanentError("invalid spec, no child touched: " + "; ".join(errors))
        pool = binding.pool
        # No key here: the CSI node plugin mints the group's credential at publish, from the pool's own key.
        images = self.data_plane.images_for(
            ("InferenceGroup", namespace, name),
            body.get("metadata", {}),
            {
                "vllm": container_image(
                    self.store.get(("Deployment", namespace, role_name(name, "prefill"))), name="vllm"
                ),
                "router": container_image(
                    self.store.get(("Deployment", namespace, router_name(name))), command="vllm-router"
                ),
            },
        )
        desired = build_group_children(images.for_group(spec), owner, pool, self._role_replicas(owner))
        desired += build_group_policies(spec, owner, pool, self.pool_namespace, self.network)
        gateway = build_inference_pool(spec, owner)
        served = await self.inference_pools.served(self.kube) if gateway is not None else None
        if gateway is not None and served:
            desired.append(gateway)
        # A pod template change waits while other groups roll (see maru_operator.rollouts).
        held = self.pacer.held(("InferenceGroup", namespace, name), desired, self.store)
        if held:
            log.info(
                "InferenceGroup %s/%s: pod template change of %s waits: %d groups are rolling out (at most %d "
                "at once, --max-rolling-groups)",
                namespace,
                name,
                ", ".join(k[2] for k in held),
                self.pacer.max_groups,
                self.pacer.max_groups,
            )
            desired = [d for d in desired if key_of(d) not in held]
        keep: set[Key] = set(held)
        if gateway is not None and served is None:
            keep.add(key_of(gateway))  # discovery did not answer: an InferencePool written before stays
        if not binding.ok:
            # Running vLLM pods keep serving through a pool outage (the connector degrades to "no hit");
            # only revoked access stops them. New ones are not created until the pool is usable.
            for role in ("prefill", "decode"):
                dep_key: Key = ("Deployment", namespace, role_name(name, role))
                have = self.store.get(dep_key)
                if have is None or not controlled_by(have, owner.uid):
                    continue
                keep.add(dep_key)
                if binding.revoke and have.get("spec", {}).get("replicas"):
                    log.warning("InferenceGroup %s/%s: %s; scaling %s to 0", namespace, name, binding.message, role)
                    # The uid: this very Deployment, never a namesake that replaced it since it was seen. The
                    # count is remembered on it: an autoscaled role's desired object has none to put back, and
                    # an HPA leaves a target at 0 alone (ScalingDisabled).
                    scaled = await self.kube.patch(
                        "Deployment",
                        namespace,
                        dep_key[2],
                        {
                            "metadata": {
                                "uid": have["metadata"].get("uid"),
                                "annotations": {REVOKED_REPLICAS_ANNOTATION: str(have["spec"]["replicas"])},
                            },
                            "spec": {"replicas": 0},
                        },
                    )
                    self.store.put(scaled)
                    metrics.WRITES.labels("Deployment", "patch").inc()
        else:
            await self._restore_revoked(owner, desired)
        applied = await self.apply(owner, desired, keep)
        children = applied.children
        observed = {
            "prefill": children.get(("Deployment", namespace, role_name(name, "prefill"))),
            "decode": children.get(("Deployment", namespace, role_name(name, "decode"))),
            "router": children.get(("Deployment", namespace, router_name(name))),
        }
        router = None
        if spec.router.enabled:
            svc = service_name(name)
            router = Router(f"{namespace}/{svc}", ready_endpoints(self.store.endpoint_slices(namespace, svc)))
        pods = await self._unready_pods(namespace, observed) if self.read_pods else None
        new = group_status(
            spec,
            generation,
            binding,
            observed,
            old,
            endpoint=router_endpoint(spec, owner),
            now=self.clock(),
            router=router,
            conflicts=list(applied.conflicts.values()),
            refused=list(applied.refused.values()),
            queued=[k[2] for k in held],
            disaggregation=self._disaggregation(spec, owner, binding, old, generation),
            pods=pods,
        )
        if gateway is not None:
            new = self._with_inference_pool(new, old, gateway, served, applied)
        again = await self._write_group_status(body, old, new, spec, owner, binding.pool is not None)
        if not binding.ok:
            raise kopf.TemporaryError(binding.message, delay=UNBOUND_RETRY_SECONDS)
        if held:
            again = min(again or ROLLOUT_QUEUE_SECONDS, ROLLOUT_QUEUE_SECONDS)
        if pods:
            # A pod's state (an image pull backing off) changes no Deployment, whose events wake the group.
            again = min(again or POD_RECHECK_SECONDS, POD_RECHECK_SECONDS)
        if applied.refused:
            # What the server refused may pass later (a quota freed, a StorageClass made expandable): looked at
            # again at a slow pace, never in the queue's fast retries.
            again = min(again or REFUSED_RETRY_SECONDS, REFUSED_RETRY_SECONDS)
        if gateway is not None and not served:
            # Nothing wakes a group when the CRD is installed: it looks again at discovery's own interval.
            recheck = self.inference_pools.recheck_seconds
            again = min(again or recheck, recheck)
        return again

    async def _unready_pods(self, namespace: str, roles: dict[str, Object | None]) -> dict[str, list[Object]]:
        """The pods of each role with fewer ready pods than it wants (see maru_operator.readiness)."""
        out: dict[str, list[Object]] = {}
        for role, dep in roles.items():
            status, want = (dep or {}).get("status") or {}, int((dep or {}).get("spec", {}).get("replicas", 1))
            if dep is not None and int(status.get("readyReplicas") or 0) < want:
                out[role] = await self.kube.list("Pod", namespace, pod_selector(dep))
        return out

    async def _restore_revoked(self, owner: Owner, desired: list[Object]) -> None:
        """Give the autoscaled roles that revoked access scaled to 0 their count from before, once access is back
        (an Operator-scaled role gets its own from the apply); the remembered count goes with the same write."""
        for obj in desired:
            have = self.store.get(key_of(obj))
            if (
                obj.get("kind") != "Deployment"
                or not scaled_externally(obj)
                or have is None
                or not controlled_by(have, owner.uid)
            ):
                continue
            before = (have["metadata"].get("annotations") or {}).get(REVOKED_REPLICAS_ANNOTATION)
            if before is None:
                continue
            kind, ns, name = key_of(obj)
            count = int(before) if before.isdigit() and not have.get("spec", {}).get("replicas") else None
            log.info(
                "InferenceGroup %s/%s: pool access is back; %s",
                owner.namespace,
                owner.name,
                f"scaling {name} back to {count}" if count is not None else f"{name} was scaled since",
            )
            patch: Object = {
                "metadata": {"uid": have["metadata"].get("uid"), "annotations": {REVOKED_REPLICAS_ANNOTATION: None}}
            }
            if count is not None:
                patch["spec"] = {"replicas": count}
            self.store.put(await self.kube.patch(kind, ns or None, name, patch))
            metrics.WRITES.labels(kind, "patch").inc()

    def _with_inference_pool(
        self,
        new: InferenceGroupStatus,
        old: InferenceGroupStatus,
        gateway: Object,
        served: bool | None,
        applied: Applied,
    ) -> InferenceGroupStatus:
        """``new`` with InferencePoolReady (a group that does not ask for an InferencePool has none)."""
        key = key_of(gateway)
        made = cond.inference_pool_ready(
            served, f"{key[1]}/{key[2]}", applied.conflicts.get(key), new.observed_generation
        )
        return new.model_copy(
            update={"conditions": [*new.conditions, *cond.merge(old.conditions, [made], self.clock())]}
        )

    def _role_replicas(self, owner: Owner) -> dict[str, int | None]:
        """Each role Deployment's spec.replicas now (None when it has none of this group's yet)."""
        now: dict[str, int | None] = {}
        for role in ("prefill", "decode"):
            have = self.store.get(("Deployment", owner.namespace or "", role_name(owner.name, role)))
            ok = have is not None and controlled_by(have, owner.uid)
            now[role] = int(have.get("spec", {}).get("replicas", 1)) if ok and have is not None else None
        return now

    async def _write_group_status(
        self,
        body: Object,
        old: InferenceGroupStatus,
        new: InferenceGroupStatus,
        spec: InferenceGroupSpec,
        owner: Owner,
        bound: bool,
    ) -> float | None:
        """Write the group's status with its pool usage (from the pool's own poll of its daemons, no request
        of its own); a change of usage alone waits until ``usage_interval`` has passed since the last one.

        Returns when to look again for usage (None: the pool reports none for this group)."""
        usage = self._pool_tenants.get(spec.pool_ref.name, {}).get(cache_scope(spec, owner)) if bound else None
        new = new.model_copy(update={"pool_usage": (usage or old.pool_usage) if bound else None})
        key = key_of(body)
        if group_usage_only_change(old, new):
            since = self.monotonic() - self._group_written.get(key, float("-inf"))
            if since < self.usage_interval:
                return self.usage_interval - since
            self._group_written[key] = self.monotonic()
        await self.write_status(body, old, new)
        # A group the pool reports on looks again as the pool is polled: its use moves and its
        # DisaggregationActive window slides (a tenant with any traffic, decode lookups too, is reported).
        return self.usage_interval if usage is not None else None

    def _wake_groups(self, pool: str, new_tenants: set[str], reachability_changed: bool) -> None:
        """Groups whose tenant the pool reports for the first time (they look again at its interval from then
        on), or all of the pool's when its daemons stopped or started answering, are reconciled now."""
        if self.wake is None or not (new_tenants or reachability_changed):
            return
        for key, (of_pool, scope) in list(self._group_scopes.items()):
            if of_pool == pool and (reachability_changed or scope in new_tenants):
                self.wake(key)

    def _readers_of(self, pool: str) -> ReaderWindow:
        if pool not in self._pool_readers:
            self._pool_readers[pool] = ReaderWindow(self.disaggregation_window)
        return self._pool_readers[pool]

    def _disaggregation(
        self, spec: InferenceGroupSpec, owner: Owner, binding: Any, old: InferenceGroupStatus, generation: int | None
    ) -> Condition:
        """DisaggregationActive from the decode traffic of the group's tenant on its pool over the window.

        Until two polls of the pool can be compared (an operator that just started), the condition the status
        holds stays: an operator restart must not flap it to NoTraffic and back.
        """
        pool = binding.pool.name if binding.pool is not None else None
        window = self._pool_readers.get(pool) if pool is not None else None
        group_key: Key = ("InferenceGroup", owner.namespace or "", owner.name)
        if pool is not None:
            self._group_scopes[group_key] = (pool, cache_scope(spec, owner))
        else:
            self._group_scopes.pop(group_key, None)
        kept = cond.get(old.conditions, cond.DISAGGREGATION_ACTIVE)
        unjudged = window is None or (not window.judged and window.reachable is not False)
        if pool is not None and unjudged and kept is not None:
            return kept.model_copy(update={"observed_generation": generation})
        reads = window.totals(cache_scope(spec, owner), self.monotonic()) if window and window.judged else None
        made = cond.disaggregation_active(
            reads,
            pool=pool,
            reachable=window.reachable if window else None,
            window_s=self.disaggregation_window,
            gen=generation,
        )
        metrics.set_group_traffic(owner.namespace or "", owner.name, reads, made.status)
        return made


_WARN_READY = {
    "InvalidSpec",
    "PoolNotFound",
    "NamespaceNotAllowed",
    "PoolDeleting",
    "PoolInvalid",
    "NoNodesSelected",
    "ChildConflict",
    "NoReadyEndpoints",
    cond.REPLICAS_FAILING,
}
# Not Warnings, as they are how every start looks: PoolNotReady (a group applied with its pool; the pool's own
# conditions say what keeps it), ReplicasNotReady and ReplicasUnavailable (pods starting; ReplicasFailing when
# they wait for a human).
_WARN_OTHER = {
    "ChildRefused",
    "DeletionBlocked",
    cond.REPLICAS_FAILING,
    "AgentsUnavailable",
    "MetadataServerUnavailable",
    "PoolDegraded",
    "PoolUnavailable",
}
