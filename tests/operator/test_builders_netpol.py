"""The NetworkPolicy builders: valid, owned, and shaped by the pool and group specs. Who may talk to whom
under them is tested with the evaluator in tests/security/test_network_policies.py."""

from __future__ import annotations

from maru_operator.builders.common import LABEL_MANAGED_BY, MANAGED_BY
from maru_operator.builders.group import PoolView, build_role_deployment
from maru_operator.builders.netpol import (
    NetworkPolicyConfig,
    build_group_policies,
    build_pool_policies,
    pool_clients,
)
from tests.support.specs import GROUP_OWNER, POOL_OWNER, assert_valid, dax_spec, group_spec, pool_spec, pool_view

NS = "maru-system"
ON = NetworkPolicyConfig(scrape_namespaces=("monitoring",))


def test_valid_owned_and_labelled() -> None:
    policies = build_pool_policies(dax_spec(), POOL_OWNER, NS, ON)
    policies += build_group_policies(group_spec(), GROUP_OWNER, pool_view(), NS, ON)
    assert [p["metadata"]["name"] for p in policies] == ["pool-metadata", "pool-agent", "llama-vllm", "llama-router"]
    for policy in policies:
        assert_valid(policy)
        assert policy["metadata"]["ownerReferences"][0]["controller"] is True
        assert policy["metadata"]["labels"][LABEL_MANAGED_BY] == MANAGED_BY
        assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]


def test_shm_pools_have_no_metadata_server_policy() -> None:
    assert [p["metadata"]["name"] for p in build_pool_policies(pool_spec(), POOL_OWNER, NS, ON)] == ["pool-agent"]


def test_pool_clients_are_the_vllm_pods_bound_to_it() -> None:
    pod_labels = build_role_deployment(group_spec(), "decode", GROUP_OWNER, pool_view())["spec"]["template"][
        "metadata"
    ]["labels"]
    assert pool_clients("pool").items() <= pod_labels.items()
    assert not pool_clients("other").items() <= pod_labels.items()


def test_allowed_namespaces_narrow_the_metadata_servers_clients() -> None:
    spec = dax_spec(allowedNamespaces=["llm", "batch"])
    rpc = build_pool_policies(spec, POOL_OWNER, NS, ON)[0]["spec"]["ingress"][0]
    clients = rpc["from"][1]["namespaceSelector"]
    assert clients == {
        "matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["batch", "llm"]}]
    }
    everyone = build_pool_policies(dax_spec(), POOL_OWNER, NS, ON)[0]["spec"]["ingress"][0]["from"][1]
    assert everyone["namespaceSelector"] == {}


def test_vllm_reaches_the_metadata_port_of_its_own_pool() -> None:
    policy = build_group_policies(
        group_spec(), GROUP_OWNER, PoolView("cxl", dax_spec(daemon={"metadataPort": 7500})), NS, ON
    )[0]
    [to_pool] = [rule for rule in policy["spec"]["egress"] if "to" in rule]
    assert to_pool["ports"] == [{"protocol": "TCP", "port": 7500}]
    assert to_pool["to"][0]["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": NS}}
    assert to_pool["to"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "cxl"


def test_unbound_groups_keep_their_vllm_pods_isolated() -> None:
    names = [p["metadata"]["name"] for p in build_group_policies(group_spec(), GROUP_OWNER, None, NS, ON)]
    assert names == ["llama-vllm", "llama-router"]


def test_disabled() -> None:
    off = NetworkPolicyConfig(enabled=False)
    assert build_pool_policies(dax_spec(), POOL_OWNER, NS, off) == []
    assert build_group_policies(group_spec(), GROUP_OWNER, pool_view(), NS, off) == []
