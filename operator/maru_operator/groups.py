"""The InferenceGroup reconciler: the group's children (prefill and decode Deployments, router, Services,
policies, an InferencePool when asked), bound to its pool, paced with the fleet's rollouts, and its status with
the pool's view of its traffic.

Level-triggered: every pass builds the whole desired state from the spec (:mod:`maru_operator.builders.children`)
and hands it to the child applier; running it twice changes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import kopf
from pydantic import ValidationError

from maru_operator import conditions as cond
from maru_operator import metrics
from maru_operator.api.common import Condition
from maru_operator.api.inferencegroup import InferenceGroupSpec, InferenceGroupStatus
from maru_operator.applier import Applied, ChildApplier
from maru_operator.builders.children import build_group_children
from maru_operator.builders.common import Owner
from maru_operator.builders.group import (
    cache_scope,
    role_name,
    router_endpoint,
    router_name,
    service_name,
)
from maru_operator.builders.inferencepool import build_inference_pool
from maru_operator.builders.netpol import NetworkPolicyConfig, build_group_policies
from maru_operator.builders.scaling import scaled_externally
from maru_operator.cache import Key, Store
from maru_operator.dataplane import DataPlane, container_image
from maru_operator.errors import model_errors
from maru_operator.kube import Kube
from maru_operator.objects import Object
from maru_operator.optionalkinds import OptionalKind
from maru_operator.ownership import (
    controlled_by,
    key_of,
)
from maru_operator.readiness import selector as pod_selector
from maru_operator.rollouts import RolloutPacer
from maru_operator.status import (
    Router,
    bind,
    group_status,
    group_usage_only_change,
    invalid_group_status,
    ready_endpoints,
)
from maru_operator.statuswriter import StatusWriter
from maru_operator.telemetry import PoolTelemetry
from maru_operator.validation import check_group, check_group_on_pool

log = logging.getLogger("maru_operator.controller")

# A group bound to no usable pool looks again this often.
UNBOUND_RETRY_SECONDS = 30.0
# A group whose child the API server refused (422/403) looks again this often.
REFUSED_RETRY_SECONDS = 60.0
# On an autoscaled role's Deployment while its group's pool access is revoked: its replicas before (set to 0).
REVOKED_REPLICAS_ANNOTATION = "maru.io/replicas-before-revoke"
# A group whose rollout waits for others looks again this often (their Deployments' events wake it too).
ROLLOUT_QUEUE_SECONDS = 15.0
# With --read-pods, a group with a role not ready looks at its pods again this often.
POD_RECHECK_SECONDS = 30.0


class GroupReconciler:
    def __init__(
        self,
        *,
        kube: Kube,
        store: Store,
        applier: ChildApplier,
        status: StatusWriter,
        telemetry: PoolTelemetry,
        pool_namespace: str,
        network: NetworkPolicyConfig,
        pacer: RolloutPacer,
        data_plane: DataPlane,
        inference_pools: OptionalKind,
        read_pods: bool,
        usage_interval: float,
        clock: Callable[[], str],
        monotonic: Callable[[], float],
    ) -> None:
        self.kube, self.store, self.applier, self.status, self.telemetry = kube, store, applier, status, telemetry
        self.pool_namespace = pool_namespace
        self.network = network
        self.pacer = pacer
        self.data_plane = data_plane
        self.inference_pools = inference_pools
        self.read_pods = read_pods
        self.usage_interval = usage_interval
        self.clock, self.monotonic = clock, monotonic
        # group -> when a change of its pool usage alone was last written (monotonic seconds)
        self._group_written: dict[Key, float] = {}

    async def reconcile(self, namespace: str, name: str) -> float | None:
        key: Key = ("InferenceGroup", namespace, name)
        body = self.store.get(key)
        if body is None or body.get("metadata", {}).get("deletionTimestamp"):
            metrics.forget_group(namespace, name)
            self.telemetry.group_scopes.pop(key, None)
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
            await self.status.write(body, old, new)
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
            await self.status.write(body, old, invalid_group_status(errors, generation, old, self.clock()))
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
                len(self.pacer.busy_groups(self.store)),
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
        applied = await self.applier.apply(owner, desired, keep)
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
        usage = self.telemetry.pool_tenants.get(spec.pool_ref.name, {}).get(cache_scope(spec, owner)) if bound else None
        new = new.model_copy(update={"pool_usage": (usage or old.pool_usage) if bound else None})
        key = key_of(body)
        if group_usage_only_change(old, new):
            since = self.monotonic() - self._group_written.get(key, float("-inf"))
            if since < self.usage_interval:
                return self.usage_interval - since
            self._group_written[key] = self.monotonic()
        await self.status.write(body, old, new)
        # A group the pool reports on looks again as the pool is polled: its use moves and its
        # DisaggregationActive window slides (a tenant with any traffic, decode lookups too, is reported).
        return self.usage_interval if usage is not None else None

    def _disaggregation(
        self, spec: InferenceGroupSpec, owner: Owner, binding: Any, old: InferenceGroupStatus, generation: int | None
    ) -> Condition:
        """DisaggregationActive from the decode traffic of the group's tenant on its pool over the window.

        Until two polls of the pool can be compared (an operator that just started), the condition the status
        holds stays: an operator restart must not flap it to NoTraffic and back.
        """
        pool = binding.pool.name if binding.pool is not None else None
        window = self.telemetry.pool_readers.get(pool) if pool is not None else None
        group_key: Key = ("InferenceGroup", owner.namespace or "", owner.name)
        if pool is not None:
            self.telemetry.group_scopes[group_key] = (pool, cache_scope(spec, owner))
        else:
            self.telemetry.group_scopes.pop(group_key, None)
        kept = cond.get(old.conditions, cond.DISAGGREGATION_ACTIVE)
        unjudged = window is None or (not window.judged and window.reachable is not False)
        if pool is not None and unjudged and kept is not None:
            return kept.model_copy(update={"observed_generation": generation})
        reads = window.totals(cache_scope(spec, owner), self.monotonic()) if window and window.judged else None
        made = cond.disaggregation_active(
            reads,
            pool=pool,
            reachable=window.reachable if window else None,
            window_s=self.telemetry.window_s,
            gen=generation,
        )
        metrics.set_group_traffic(owner.namespace or "", owner.name, reads, made.status)
        return made
