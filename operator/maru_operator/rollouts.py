"""Pacing pod-template changes across groups: at most ``max_groups`` groups roll their vLLM pods at once.

A change of what the builders render (an operator upgrade, a new default) changes the pod template of
every group's Deployments at the same moment. Applied everywhere at once, every group reloads its model
together: the whole fleet runs at reduced capacity for the length of a model load, and a change that
breaks the pods breaks all of them. So a Deployment whose pod template would change waits while
``max_groups`` other groups are still rolling; a group already rolling goes on (its other role may follow),
and a new group is never held (it has nothing to roll). A rollout that cannot finish (pods that never
become ready) keeps its place: a broken change stops at ``max_groups`` groups, as a canary would.

The Deployments carry the hash of the template the operator applied (``maru.io/template-hash``), so whether a
template would change is one comparison, and nothing but the cluster's own state is needed: a restarted
operator paces exactly as the one before it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from maru_operator.builders.common import LABEL_COMPONENT, Object
from maru_operator.builders.lifecycle import TEMPLATE_HASH
from maru_operator.cache import Key, Store, key_of, owner_key
from maru_operator.status import rollout_done

PACED_COMPONENTS = ("prefill", "decode")
DEFAULT_MAX_GROUPS = 3


def paced(obj: Object) -> bool:
    return (
        obj.get("kind") == "Deployment"
        and (obj["metadata"].get("labels") or {}).get(LABEL_COMPONENT) in PACED_COMPONENTS
    )


def _hash(obj: Object) -> str | None:
    return (obj.get("metadata", {}).get("annotations") or {}).get(TEMPLATE_HASH)


# What the deployment controller numbers each new pod template (ReplicaSet) of a Deployment with.
REVISION = "deployment.kubernetes.io/revision"


def rolling(deployment: Object) -> bool:
    """Rolling a pod template newer than its first, and not done yet (the first rollout of a new group is not
    pacing's). By revision, not generation: a Deployment's generation also moves when only its annotations or
    its replicas change (the first apply after a create removes the create's annotation), which rolls nothing."""
    revision = (deployment.get("metadata", {}).get("annotations") or {}).get(REVISION) or "1"
    return (int(revision) if revision.isdigit() else 1) > 1 and not rollout_done(deployment)


@dataclass(frozen=True, slots=True)
class Rollout:
    """What pacing reads of a role Deployment, kept by the cache beside the packed object."""

    owner: Key | None
    template_hash: str | None
    rolling: bool


def summary(deployment: Object) -> Rollout | None:
    """The cache's summary of a Deployment (:meth:`maru_operator.cache.Store.summarize`); None unless paced."""
    if not paced(deployment):
        return None
    return Rollout(owner_key(deployment), _hash(deployment), rolling(deployment))


@dataclass
class RolloutPacer:
    max_groups: int = DEFAULT_MAX_GROUPS  # 0: no bound

    def held(self, group: Key, desired: Iterable[Object], store: Store) -> list[Key]:
        """The role Deployments of ``group`` whose template change must wait (their keys).

        Reads the cache's summaries of Deployments (``store.summarize("Deployment", summary)``)."""
        changes = []
        for obj in desired:
            if not paced(obj):
                continue
            have = store.summary(key_of(obj))
            if have is not None and have.template_hash != _hash(obj):
                changes.append(key_of(obj))
        if not changes or self.max_groups <= 0:
            return []
        groups = self.rolling_groups(store)
        if group in groups or len(groups) < self.max_groups:
            return []
        return changes

    @staticmethod
    def rolling_groups(store: Store) -> set[Key]:
        return {
            s.owner
            for s in store.summaries("Deployment").values()
            if s is not None and s.rolling and s.owner is not None
        }
