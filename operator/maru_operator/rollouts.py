"""Pacing pod-template changes across groups: at most ``max_groups`` groups roll their vLLM pods at once.

A change of what the builders render (an operator upgrade, a new default) changes the pod template of
every group's Deployments at the same moment. Applied everywhere at once, every group reloads its model
together: the whole fleet runs at reduced capacity for the length of a model load, and a change that
breaks the pods breaks all of them. So a Deployment whose pod template would change waits while
``max_groups`` other groups are still rolling; a group already rolling goes on (its other role may follow),
and a new group is never held (it has nothing to roll). A group annotated ``maru.io/rollout-pacing: "off"``
is never held and holds no other.

Rolling means the newest template has not reached every replica yet: the deployment controller has not seen
the current spec, or the newest ReplicaSet has fewer pods than wanted, or pods of an older template are
left. Availability is not asked: a group with a pod down, or a scale-up waiting for a free GPU, has nothing
left to roll and must not hold the fleet's changes. A change whose new pods never become ready still keeps
its place while the old pods stay (with maxUnavailable 0, the operator's default for a single replica, they
stay until their replacement is ready): a broken change stops at ``max_groups`` groups, as a canary would.

The check and the apply are apart by awaits (the apply is API calls), and the cache shows a group rolling
only once its applied template is back from the server and the deployment controller has looked at it. So
a group let through takes a reservation in the same step as the check (no await between them, so no other
worker of the same loop sees the slot free), held until the cache shows each Deployment it was let through
for with the applied template and rolled, or until ``RESERVATION_SECONDS`` pass (an apply that never lands).
When a slot frees, the groups held longest are woken, as many as slots freed.

The Deployments carry the hash of the template the operator applied (``maru.io/template-hash``), so whether a
template would change is one comparison; a restarted operator starts with no reservation and paces by what
the cluster shows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from maru_operator.builders.common import LABEL_COMPONENT, Object
from maru_operator.builders.lifecycle import TEMPLATE_HASH
from maru_operator.cache import Key, Store, key_of, owner_key

PACED_COMPONENTS = ("prefill", "decode")
DEFAULT_MAX_GROUPS = 3
# On an InferenceGroup: "off" takes it out of pacing (its changes roll at once, its rollouts hold no other).
PACING_ANNOTATION = "maru.io/rollout-pacing"
# How long a group let through holds its slot at most without the cache showing its rollout (an apply that
# failed and is not retried, a kube-controller-manager that is down): the Deployments' default
# progressDeadlineSeconds.
RESERVATION_SECONDS = 600.0


def paced(obj: Object) -> bool:
    return (
        obj.get("kind") == "Deployment"
        and (obj["metadata"].get("labels") or {}).get(LABEL_COMPONENT) in PACED_COMPONENTS
    )


def _hash(obj: Object) -> str | None:
    return (obj.get("metadata", {}).get("annotations") or {}).get(TEMPLATE_HASH)


# What the deployment controller numbers each new pod template (ReplicaSet) of a Deployment with.
REVISION = "deployment.kubernetes.io/revision"


def settled(deployment: Object) -> bool:
    """The newest pod template reached every replica: the deployment controller has seen the current spec,
    its newest ReplicaSet has the wanted count of pods (ready or not) and no pod of an older template is left.
    ``status.updatedReplicas`` is the newest ReplicaSet's pod count (kube-controller-manager,
    pkg/controller/deployment/sync.go calculateStatus) and ``status.replicas`` counts every ReplicaSet's."""
    meta, spec, st = deployment.get("metadata", {}), deployment.get("spec", {}), deployment.get("status") or {}
    if int(st.get("observedGeneration") or 0) < int(meta.get("generation") or 0):
        return False
    updated = int(st.get("updatedReplicas") or 0)
    return updated >= int(spec.get("replicas", 1)) and int(st.get("replicas") or 0) <= updated


def rolling(deployment: Object) -> bool:
    """Rolling a pod template newer than its first, and not settled yet (the first rollout of a new group is
    not pacing's). By revision, not generation: a Deployment's generation also moves when only its annotations
    or its replicas change (the first apply after a create removes the create's annotation), which rolls
    nothing."""
    revision = (deployment.get("metadata", {}).get("annotations") or {}).get(REVISION) or "1"
    return (int(revision) if revision.isdigit() else 1) > 1 and not settled(deployment)


def pacing_off(group: Object | None) -> bool:
    return ((group or {}).get("metadata", {}).get("annotations") or {}).get(PACING_ANNOTATION) == "off"


@dataclass(frozen=True, slots=True)
class Rollout:
    """What pacing reads of a role Deployment, kept by the cache beside the packed object."""

    owner: Key | None
    template_hash: str | None
    rolling: bool
    settled: bool


def summary(deployment: Object) -> Rollout | None:
    """The cache's summary of a Deployment (:meth:`maru_operator.cache.Store.summarize`); None unless paced."""
    if not paced(deployment):
        return None
    return Rollout(owner_key(deployment), _hash(deployment), rolling(deployment), settled(deployment))


@dataclass
class Reservation:
    """A group let through: the role Deployments it changes, the template hash each is to get, and until when."""

    templates: dict[Key, str | None]
    deadline: float


@dataclass
class RolloutPacer:
    max_groups: int = DEFAULT_MAX_GROUPS  # 0: no bound
    clock: Callable[[], float] = time.monotonic
    # Puts a group on the work queue: when a slot frees, the groups held longest go first, as many as slots
    # freed, rather than each at its next look (every ROLLOUT_QUEUE_SECONDS) and in no order.
    wake: Callable[[Key], None] | None = None
    reserved: dict[Key, Reservation] = field(default_factory=dict)
    queued: dict[Key, None] = field(default_factory=dict)  # the held groups, longest held first

    def held(self, group: Key, desired: Iterable[Object], store: Store) -> list[Key]:
        """The role Deployments of ``group`` whose template change must wait (their keys). None held: the group
        holds a slot until its change has rolled. Never awaits, so the check and the reservation are one step.

        Reads the cache's summaries of Deployments (``store.summarize("Deployment", summary)``)."""
        wanted = {key_of(obj): _hash(obj) for obj in desired if paced(obj)}
        mine = self.reserved.get(group)
        if mine is not None:
            # A later change of the same Deployments supersedes the one let through (or undoes it).
            mine.templates.update({k: wanted[k] for k in mine.templates if k in wanted})
        changes = {}
        for key, template in wanted.items():
            have = store.summary(key)
            if have is not None and have.template_hash != template:
                changes[key] = template
        if not changes or self.max_groups <= 0 or pacing_off(store.get(group)):
            self.queued.pop(group, None)
            self._wake_queued(store)  # this group's own rollout may just have ended
            return []
        groups = self.busy_groups(store)
        if group not in groups and len(groups) >= self.max_groups:
            self.queued.setdefault(group)
            return list(changes)
        self.queued.pop(group, None)
        deadline = self.clock() + RESERVATION_SECONDS
        self.reserved[group] = Reservation({**(mine.templates if mine else {}), **changes}, deadline)
        return []

    def _wake_queued(self, store: Store) -> None:
        if not self.queued or self.wake is None:
            return
        free = self.max_groups - len(self.busy_groups(store))
        for group in list(self.queued):
            if free <= 0:
                return
            if store.get(group) is None:
                del self.queued[group]  # deleted while it waited: it comes back to pop itself no more
                continue
            self.wake(group)
            free -= 1

    def busy_groups(self, store: Store) -> set[Key]:
        """The groups holding a slot: rolling in the cache, or let through and not seen rolled yet. Drops the
        reservations whose rollout the cache shows done, or whose deadline passed."""
        now = self.clock()
        for group, reservation in list(self.reserved.items()):
            if now >= reservation.deadline or all(_rolled(store, k, t) for k, t in reservation.templates.items()):
                del self.reserved[group]
        groups = self.rolling_groups(store) | set(self.reserved)
        return {g for g in groups if not pacing_off(store.get(g))}

    @staticmethod
    def rolling_groups(store: Store) -> set[Key]:
        return {
            s.owner
            for s in store.summaries("Deployment").values()
            if s is not None and s.rolling and s.owner is not None
        }


def _rolled(store: Store, key: Key, template: str | None) -> bool:
    """Has the Deployment ``key`` got ``template`` and rolled it to every replica (or is it gone)?"""
    have = store.summary(key)
    return have is None or (have.template_hash == template and have.settled)
