"""Every child of an InferenceGroup: the roles, the router and the pool events publisher, each built by its own
module (this one sits above them, so none imports another's caller)."""

from __future__ import annotations

from collections.abc import Mapping

from maru_operator.api.inferencegroup import InferenceGroupSpec
from maru_operator.builders.common import Object, Owner
from maru_operator.builders.group import (
    PoolView,
    build_role_deployment,
    build_role_disruption_budget,
    build_router_children,
)
from maru_operator.builders.modelcache import build_model_cache_claim
from maru_operator.builders.poolevents import build_pool_events_children


def build_group_children(
    spec: InferenceGroupSpec, owner: Owner, pool: PoolView | None, observed: Mapping[str, int | None] | None = None
) -> list[Object]:
    """Every child of a bound group (``pool`` given), or only the router when there is no pool.

    ``observed``: each role Deployment's ``spec.replicas`` as it is now, which a role following the other
    through ``replicaRatio`` is computed from.
    """
    children: list[Object | None] = []
    if pool is not None:
        children.append(build_model_cache_claim(spec, owner))
        for role in ("prefill", "decode"):
            children.append(build_role_deployment(spec, role, owner, pool, observed))
            children.append(build_role_disruption_budget(spec, role, owner, pool))
    return ([c for c in children if c is not None] + build_router_children(spec, owner, pool)
            + build_pool_events_children(spec, owner, pool))  # fmt: skip
