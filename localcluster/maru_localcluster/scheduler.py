"""kube-scheduler's decisions for the local cluster: which node a pod may run on, and which it gets.

Filters: the node is Ready and schedulable, ``nodeSelector``, required node affinity
(``matchExpressions`` and ``matchFields``), taints with effect NoSchedule/NoExecute tolerated, and
resources: the requests of the pods already there plus this one fit the node's allocatable
(cpu, memory, and extended resources such as ``nvidia.com/gpu``, which no local node has).
Scores: preferred node affinity, preferred pod affinity/anti-affinity by ``kubernetes.io/hostname``,
then the node with the fewest pods (then by name), so replicas spread over nodes.
Not modelled: topology spread constraints, required pod (anti-)affinity, preemption, volume binding.
"""

from __future__ import annotations

from typing import Any

from maru_operator.quantity import parse_quantity

JsonObj = dict[str, Any]

# Tolerations the DaemonSet controller adds to its pods (daemons run on nodes in trouble too).
DAEMONSET_TOLERATIONS = [
    {"key": f"node.kubernetes.io/{key}", "operator": "Exists", "effect": effect}
    for key, effect in (
        ("not-ready", "NoExecute"),
        ("unreachable", "NoExecute"),
        ("disk-pressure", "NoSchedule"),
        ("memory-pressure", "NoSchedule"),
        ("pid-pressure", "NoSchedule"),
        ("unschedulable", "NoSchedule"),
    )
]


def labels_match(labels: dict[str, str], expressions: list[JsonObj]) -> bool:
    for e in expressions:
        key, op, values = e.get("key"), e.get("operator"), e.get("values") or []
        present, value = key in labels, labels.get(key)
        if op == "In":
            ok = present and value in values
        elif op == "NotIn":
            ok = not present or value not in values
        elif op == "Exists":
            ok = present
        elif op == "DoesNotExist":
            ok = not present
        elif op in ("Gt", "Lt"):
            try:
                number, bound = int(value or ""), int(values[0])
                ok = present and (number > bound if op == "Gt" else number < bound)
            except (ValueError, IndexError):
                ok = False
        else:
            ok = False
        if not ok:
            return False
    return True


def selector_matches(selector: JsonObj | None, labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels + matchExpressions); an empty selector matches everything."""
    if selector is None:
        return False
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    return labels_match(labels, selector.get("matchExpressions") or [])


def _term_matches(node: JsonObj, term: JsonObj) -> bool:
    labels = node["metadata"].get("labels") or {}
    fields = {"metadata.name": node["metadata"]["name"]}
    return labels_match(labels, term.get("matchExpressions") or []) and labels_match(
        fields, term.get("matchFields") or []
    )


def tolerates(tolerations: list[JsonObj], taint: JsonObj) -> bool:
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        if t.get("operator") == "Exists":
            if not t.get("key") or t["key"] == taint.get("key"):
                return True
        elif t.get("key") == taint.get("key") and (t.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def node_ready(node: JsonObj) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (node.get("status") or {}).get("conditions") or []
    )


def why_not(node: JsonObj, pod_spec: JsonObj, *, daemon: bool = False) -> str | None:
    """None when the pod may run on the node, else the scheduler's reason."""
    labels = node["metadata"].get("labels") or {}
    if not daemon and (node.get("spec") or {}).get("unschedulable"):
        return "node(s) were unschedulable"
    if not node_ready(node) and not daemon:
        return "node(s) were not ready"
    if any(labels.get(k) != v for k, v in (pod_spec.get("nodeSelector") or {}).items()):
        return "node(s) didn't match Pod's node affinity/selector"
    required = ((pod_spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    terms = required.get("nodeSelectorTerms") or []
    if terms and not any(_term_matches(node, t) for t in terms):
        return "node(s) didn't match Pod's node affinity/selector"
    tolerations = list(pod_spec.get("tolerations") or []) + (DAEMONSET_TOLERATIONS if daemon else [])
    for taint in (node.get("spec") or {}).get("taints") or []:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not tolerates(tolerations, taint):
            return f"node(s) had untolerated taint {{{taint.get('key')}: {taint.get('value', '')}}}"
    return None


def pod_requests(pod_spec: JsonObj) -> dict[str, float]:
    """Requests of a pod (limits stand in for missing requests, as the API server defaults them)."""
    total: dict[str, float] = {}
    for c in pod_spec.get("containers") or []:
        resources = c.get("resources") or {}
        merged = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
        for name, amount in merged.items():
            total[name] = total.get(name, 0.0) + float(parse_quantity(amount))
    return total


def fits_resources(node: JsonObj, pod_spec: JsonObj, others: list[JsonObj]) -> str | None:
    node_allocatable = (node.get("status") or {}).get("allocatable") or {}
    allocatable = {k: float(parse_quantity(v)) for k, v in node_allocatable.items()}
    used: dict[str, float] = {}
    for other in others:
        for name, amount in pod_requests(other.get("spec") or {}).items():
            used[name] = used.get(name, 0.0) + amount
    for name, amount in pod_requests(pod_spec).items():
        if amount <= 0 or name == "ephemeral-storage":
            continue
        if used.get(name, 0.0) + amount > allocatable.get(name, 0.0):
            return f"Insufficient {name}"
    return None


def _affinity_score(node: JsonObj, pod: JsonObj, pods_on: dict[str, list[JsonObj]]) -> int:
    spec = pod.get("spec") or {}
    affinity = spec.get("affinity") or {}
    score = 0
    for pref in (affinity.get("nodeAffinity") or {}).get("preferredDuringSchedulingIgnoredDuringExecution") or []:
        if _term_matches(node, pref.get("preference") or {}):
            score += int(pref.get("weight", 0))
    namespace = pod["metadata"].get("namespace")
    here = pods_on.get(node["metadata"]["name"], [])
    for kind, sign in (("podAffinity", 1), ("podAntiAffinity", -1)):
        for pref in (affinity.get(kind) or {}).get("preferredDuringSchedulingIgnoredDuringExecution") or []:
            term = pref.get("podAffinityTerm") or {}
            if term.get("topologyKey") != "kubernetes.io/hostname":
                continue
            namespaces = term.get("namespaces") or [namespace]
            if any(
                p["metadata"].get("namespace") in namespaces
                and selector_matches(term.get("labelSelector"), p["metadata"].get("labels") or {})
                for p in here
            ):
                score += sign * int(pref.get("weight", 0))
    return score


def choose_node(pod: JsonObj, nodes: list[JsonObj], pods: list[JsonObj]) -> tuple[str | None, str]:
    """(node name, "") or (None, the FailedScheduling message)."""
    spec = pod.get("spec") or {}
    pods_on: dict[str, list[JsonObj]] = {}
    for p in pods:
        node = (p.get("spec") or {}).get("nodeName")
        if node and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
            pods_on.setdefault(node, []).append(p)
    reasons: dict[str, int] = {}
    fitting = []
    for node in nodes:
        reason = why_not(node, spec) or fits_resources(node, spec, pods_on.get(node["metadata"]["name"], []))
        if reason:
            reasons[reason] = reasons.get(reason, 0) + 1
        else:
            fitting.append(node)
    if not fitting:
        detail = ", ".join(f"{n} {r}" for r, n in sorted(reasons.items()))
        return None, f"0/{len(nodes)} nodes are available: {detail or 'no nodes registered'}."
    best = max(
        fitting,
        key=lambda n: (
            _affinity_score(n, pod, pods_on),
            -len(pods_on.get(n["metadata"]["name"], [])),
            [-ord(ch) for ch in n["metadata"]["name"]],
        ),
    )
    return best["metadata"]["name"], ""
