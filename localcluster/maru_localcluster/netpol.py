"""Who may talk to whom under a set of NetworkPolicies, decided offline as Kubernetes defines it.

A connection from ``src`` to ``dst`` on a port is allowed when both ends allow it:

* egress at ``src``: a pod is isolated for egress when some policy of its namespace selects it and
  lists ``Egress`` in ``policyTypes``; an isolated pod may connect only where an egress rule of one of
  those policies admits the destination and port. Traffic from outside the cluster has no egress side.
* ingress at ``dst``: the same with ``Ingress`` and ingress rules.

Policies add up (any admitting rule suffices); a pod no policy selects is not isolated. A rule with no
``from``/``to`` admits every peer, one with no ``ports`` every port. A peer is a ``podSelector`` (pods of
the policy's namespace), a ``namespaceSelector`` (every pod of those namespaces), both (the pods
matching both), or an ``ipBlock`` (matched against the endpoint's address; CNIs differ on whether
that covers pod addresses, so tests should not rely on it for pods). Named ports resolve against the
destination's container ports. Not modelled: SCTP specifics, the host network (the kubelet's probes),
Services (policies see the endpoint after the Service's address translation, as here).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

Object = dict[str, Any]


@dataclass(frozen=True)
class Endpoint:
    """A pod (``namespace`` set) or something outside the cluster (``namespace`` None), by address."""

    name: str
    ip: str
    namespace: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    # container port name -> number, to resolve named ports of policies
    ports: Mapping[str, int] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}" if self.namespace else self.name


def selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A label selector (matchLabels and matchExpressions) against labels; an empty selector matches all."""
    selector = selector or {}
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        present = key in labels
        if op == "In" and not (present and labels[key] in values):
            return False
        if op == "NotIn" and present and labels[key] in values:
            return False
        if op == "Exists" and not present:
            return False
        if op == "DoesNotExist" and present:
            return False
        if op not in ("In", "NotIn", "Exists", "DoesNotExist"):
            raise ValueError(f"unknown selector operator {op!r}")
    return True


def _in_block(ip: str, block: Mapping[str, Any]) -> bool:
    address = ipaddress.ip_address(ip)
    network = ipaddress.ip_network(block["cidr"], strict=False)
    if address.version != network.version or address not in network:
        return False
    return not any(
        address.version == ipaddress.ip_network(e, strict=False).version
        and address in ipaddress.ip_network(e, strict=False)
        for e in block.get("except") or []
    )


class Network:
    """The policies of a cluster, and the labels of its namespaces."""

    def __init__(self, policies: Iterable[Object], namespaces: Mapping[str, Mapping[str, str]]) -> None:
        self.policies = [p for p in policies if p.get("kind") == "NetworkPolicy"]
        # Every namespace carries its name as a label (the API server sets it since 1.22).
        self.namespaces = {ns: {**labels, "kubernetes.io/metadata.name": ns} for ns, labels in namespaces.items()}
        for policy in self.policies:
            if policy["metadata"].get("namespace") not in self.namespaces:
                raise ValueError(f"NetworkPolicy {policy['metadata']['name']} is in an unknown namespace")

    def _peer_matches(self, peer: Mapping[str, Any], policy_namespace: str, other: Endpoint) -> bool:
        if "ipBlock" in peer:
            return _in_block(other.ip, peer["ipBlock"])
        if other.namespace is None:
            return False  # pod and namespace selectors only ever match pods
        if "namespaceSelector" in peer:
            if not selects(peer["namespaceSelector"], self.namespaces[other.namespace]):
                return False
        elif other.namespace != policy_namespace:
            return False
        return "podSelector" not in peer or selects(peer["podSelector"], other.labels)

    @staticmethod
    def _port_matches(rule_ports: list[Mapping[str, Any]] | None, dst: Endpoint, port: int, protocol: str) -> bool:
        if not rule_ports:
            return True
        for entry in rule_ports:
            if entry.get("protocol", "TCP") != protocol:
                continue
            wanted = entry.get("port")
            if wanted is None:
                return True
            if isinstance(wanted, str):
                wanted = dst.ports.get(wanted)
                if wanted is None:
                    continue
            if wanted <= port <= entry.get("endPort", wanted):
                return True
        return False

    def _direction(self, pod: Endpoint, kind: str) -> list[Object] | None:
        """The policies isolating ``pod`` in one direction; None when it is not isolated."""
        if pod.namespace is None:
            return None
        isolating = []
        for policy in self.policies:
            if policy["metadata"]["namespace"] != pod.namespace:
                continue
            spec = policy.get("spec") or {}
            if not selects(spec.get("podSelector"), pod.labels):
                continue
            types = spec.get("policyTypes") or (["Ingress", "Egress"] if spec.get("egress") else ["Ingress"])
            if kind in types:
                isolating.append(policy)
        return isolating or None

    def why_refused(self, src: Endpoint, dst: Endpoint, port: int, protocol: str = "TCP") -> str | None:
        """None when ``src`` may open ``port`` on ``dst``; else which side refuses and why."""
        egress = self._direction(src, "Egress")
        if egress is not None and not any(
            self._port_matches(rule.get("ports"), dst, port, protocol)
            and (not rule.get("to") or any(self._peer_matches(p, str(src.namespace), dst) for p in rule["to"]))
            for policy in egress
            for rule in (policy["spec"].get("egress") or [])
        ):
            names = ", ".join(p["metadata"]["name"] for p in egress)
            return f"egress of {src} (isolated by {names}) admits no {dst}:{port}/{protocol}"
        ingress = self._direction(dst, "Ingress")
        if ingress is not None and not any(
            self._port_matches(rule.get("ports"), dst, port, protocol)
            and (not rule.get("from") or any(self._peer_matches(p, str(dst.namespace), src) for p in rule["from"]))
            for policy in ingress
            for rule in (policy["spec"].get("ingress") or [])
        ):
            names = ", ".join(p["metadata"]["name"] for p in ingress)
            return f"ingress of {dst} (isolated by {names}) admits no {src} on {port}/{protocol}"
        return None

    def allows(self, src: Endpoint, dst: Endpoint, port: int, protocol: str = "TCP") -> bool:
        return self.why_refused(src, dst, port, protocol) is None

    def isolated(self, pod: Endpoint) -> tuple[bool, bool]:
        """(ingress, egress): whether some policy isolates the pod in each direction."""
        return self._direction(pod, "Ingress") is not None, self._direction(pod, "Egress") is not None
