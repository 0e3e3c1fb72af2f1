"""PodDisruptionBudgets: a node drain takes a group's roles down one pod at a time, never all at once."""

from __future__ import annotations

from maru_operator.api.inferencegroup import DisruptionBudget
from maru_operator.builders.common import Object, Owner, metadata
from maru_operator.names import child_name


def build_disruption_budget(
    owner: Owner, component: str, budget: DisruptionBudget, labels: dict[str, str], pod_selector: dict[str, str]
) -> Object | None:
    """The budget of one role's pods (``pod_selector``: the role Deployment's selector)."""
    if not budget.enabled:
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(owner, name=child_name(owner.name, component), namespace=owner.namespace, labels=labels),
        "spec": {
            "maxUnavailable": budget.max_unavailable,
            "selector": {"matchLabels": dict(pod_selector)},
            # A pod that is not Ready serves nothing: evicting it never costs capacity.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
