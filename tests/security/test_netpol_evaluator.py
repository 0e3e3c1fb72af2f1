"""The NetworkPolicy evaluator itself: each rule of the Kubernetes semantics, on small cases, so that
what the policy tests conclude from it means something."""

from __future__ import annotations

from typing import Any

import pytest

from maru_localcluster.netpol import Endpoint, Network, selects

NAMESPACES = {"a": {"team": "red"}, "b": {"team": "blue"}}
WEB = Endpoint("web", "198.51.100.1", "a", {"app": "web"}, {"http": 8080})
DB = Endpoint("db", "198.51.100.2", "a", {"app": "db"})
OTHER = Endpoint("other", "198.51.100.3", "b", {"app": "web"})
OUTSIDE = Endpoint("internet", "203.0.113.9")


def policy(spec: dict[str, Any], namespace: str = "a", name: str = "p") -> dict[str, Any]:
    return {"kind": "NetworkPolicy", "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def test_no_policy_allows_everything() -> None:
    net = Network([], NAMESPACES)
    assert net.allows(OTHER, WEB, 1) and net.allows(WEB, OUTSIDE, 443)
    assert net.isolated(WEB) == (False, False)


def test_a_selected_pod_is_isolated_and_others_are_not() -> None:
    net = Network([policy({"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": ["Ingress"]})], NAMESPACES)
    assert not net.allows(DB, WEB, 8080)
    assert net.allows(WEB, DB, 5432)  # db is not selected; web's egress is not isolated
    assert net.allows(WEB, OTHER, 8080)  # the policy's namespace only
    assert "ingress of a/web" in (net.why_refused(DB, WEB, 8080) or "")


def test_policy_types_default_from_the_rules() -> None:
    only_ingress = Network([policy({"podSelector": {}, "egress": []})], NAMESPACES)
    assert only_ingress.isolated(WEB) == (True, False)
    with_egress = Network(
        [policy({"podSelector": {}, "egress": [{"ports": [{"port": 53, "protocol": "UDP"}]}]})], NAMESPACES
    )
    assert with_egress.isolated(WEB) == (True, True)
    assert with_egress.allows(WEB, OUTSIDE, 53, "UDP") and not with_egress.allows(WEB, OUTSIDE, 53)


def test_peers_in_one_entry_are_and_across_entries_or() -> None:
    both = {"namespaceSelector": {"matchLabels": {"team": "blue"}}, "podSelector": {"matchLabels": {"app": "db"}}}
    either = [{"namespaceSelector": {"matchLabels": {"team": "blue"}}}, {"podSelector": {"matchLabels": {"app": "db"}}}]
    and_net = Network(
        [policy({"podSelector": {"matchLabels": {"app": "web"}}, "ingress": [{"from": [both]}]})], NAMESPACES
    )
    or_net = Network(
        [policy({"podSelector": {"matchLabels": {"app": "web"}}, "ingress": [{"from": either}]})], NAMESPACES
    )
    assert not and_net.allows(OTHER, WEB, 1) and not and_net.allows(DB, WEB, 1)
    assert or_net.allows(OTHER, WEB, 1) and or_net.allows(DB, WEB, 1)


def test_pod_selector_alone_means_the_policys_namespace() -> None:
    net = Network(
        [
            policy(
                {
                    "podSelector": {"matchLabels": {"app": "db"}},
                    "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "web"}}}]}],
                }
            )
        ],
        NAMESPACES,
    )
    assert net.allows(WEB, DB, 5432)
    assert not net.allows(OTHER, DB, 5432)  # same labels, other namespace


def test_namespace_names_are_labels() -> None:
    peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "b"}}}
    net = Network([policy({"podSelector": {}, "ingress": [{"from": [peer]}]})], NAMESPACES)
    assert net.allows(OTHER, WEB, 1) and not net.allows(DB, WEB, 1)


def test_ports_named_numbered_ranges_and_protocols() -> None:
    def only(*ports: dict[str, Any]) -> Network:
        return Network(
            [policy({"podSelector": {"matchLabels": {"app": "web"}}, "ingress": [{"ports": list(ports)}]})], NAMESPACES
        )

    assert only({"port": "http"}).allows(DB, WEB, 8080) and not only({"port": "http"}).allows(DB, WEB, 80)
    assert only({"port": 8000, "endPort": 8100}).allows(DB, WEB, 8080)
    assert not only({"port": 8080, "protocol": "UDP"}).allows(DB, WEB, 8080)
    assert only({"protocol": "TCP"}).allows(DB, WEB, 1)


def test_ip_blocks_and_their_exceptions() -> None:
    block = {"ipBlock": {"cidr": "203.0.113.0/24", "except": ["203.0.113.9/32"]}}
    net = Network([policy({"podSelector": {}, "policyTypes": ["Egress"], "egress": [{"to": [block]}]})], NAMESPACES)
    assert net.allows(WEB, Endpoint("mirror", "203.0.113.10"), 443)
    assert not net.allows(WEB, OUTSIDE, 443)
    assert not net.allows(WEB, Endpoint("v6", "2001:db8::1"), 443)
    assert "egress of a/web" in (net.why_refused(WEB, OUTSIDE, 443) or "")


def test_pod_selectors_never_match_outside_the_cluster() -> None:
    net = Network([policy({"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": {}}]}]})], NAMESPACES)
    assert net.allows(OTHER, WEB, 1) and not net.allows(OUTSIDE, WEB, 1)


def test_policies_add_up() -> None:
    deny = policy({"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}, name="deny")
    allow = policy(
        {"podSelector": {"matchLabels": {"app": "db"}}, "ingress": [{"from": [{"podSelector": {}}]}]}, name="allow-db"
    )
    net = Network([deny, allow], NAMESPACES)
    assert not net.allows(DB, WEB, 1)
    # db admits web, but web's own egress is denied by "deny".
    assert not net.allows(WEB, DB, 1)
    net = Network(
        [deny, allow, policy({"podSelector": {}, "policyTypes": ["Egress"], "egress": [{}]}, name="out")], NAMESPACES
    )
    assert net.allows(WEB, DB, 1)


@pytest.mark.parametrize(
    ("expr", "labels", "expected"),
    [
        ({"key": "t", "operator": "In", "values": ["x"]}, {"t": "x"}, True),
        ({"key": "t", "operator": "In", "values": ["x"]}, {}, False),
        ({"key": "t", "operator": "NotIn", "values": ["x"]}, {}, True),
        ({"key": "t", "operator": "NotIn", "values": ["x"]}, {"t": "x"}, False),
        ({"key": "t", "operator": "Exists"}, {"t": ""}, True),
        ({"key": "t", "operator": "DoesNotExist"}, {"t": ""}, False),
    ],
)
def test_match_expressions(expr: dict[str, Any], labels: dict[str, str], expected: bool) -> None:
    assert selects({"matchExpressions": [expr]}, labels) is expected


def test_unknown_namespace_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown namespace"):
        Network([policy({"podSelector": {}}, namespace="nowhere")], NAMESPACES)
