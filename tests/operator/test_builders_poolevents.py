"""The group's pool events publisher: rendered only when asked, with the engines' pool access, restricted."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from maru_localcluster.podsecurity import check
from maru_operator.builders.children import build_group_children
from maru_operator.builders.group import PoolView, build_role_deployment, connector_config
from maru_operator.builders.netpol import NetworkPolicyConfig, build_group_policies
from maru_operator.builders.poolevents import build_pool_events_children
from maru_pool.cli import build_parser
from tests.support.specs import GROUP_OWNER, assert_valid, container, dax_spec, flag, group_spec, pool_view

ON = {"poolEvents": {"enabled": True}}


def test_off_by_default_and_without_a_pool() -> None:
    assert build_pool_events_children(group_spec(), GROUP_OWNER, pool_view()) == []
    assert build_pool_events_children(group_spec(**ON), GROUP_OWNER, None) == []
    names = {o["metadata"]["name"] for o in build_group_children(group_spec(), GROUP_OWNER, pool_view())}
    assert "llama-pool-events" not in names


def test_one_publisher_and_its_service_when_asked() -> None:
    spec = group_spec(**ON)
    deployment, service = build_pool_events_children(spec, GROUP_OWNER, pool_view())
    for obj in (deployment, service):
        assert_valid(obj)
        assert obj["metadata"]["name"] == "llama-pool-events"
    assert {o["metadata"]["name"] for o in build_group_children(spec, GROUP_OWNER, pool_view())} >= {
        "llama-pool-events"
    }
    # Never two publishers at once: a consumer would see every chunk announced twice.
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"kv-events": 5557, "replay": 5558}
    assert check(deployment, "restricted") == []
    assert deployment["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def test_it_reaches_the_pool_as_the_engines_do_and_its_arguments_parse() -> None:
    spec, pool = group_spec(image="registry.example/vllm-maru:1", connector={"chunkTokens": 512},
                            **ON, ), pool_view()  # fmt: skip
    (deployment, _) = build_pool_events_children(spec, GROUP_OWNER, pool)
    c = container(deployment)
    decode = build_role_deployment(spec, "decode", GROUP_OWNER, pool)["spec"]["template"]["spec"]
    assert c["image"] == decode["containers"][0]["image"] == "registry.example/vllm-maru:1"
    # The decode pods' pool socket and credential volumes, and its pool's label (a dax pool admits by it).
    pod = deployment["spec"]["template"]["spec"]
    for name in ("maru-socket", "maru-credential"):
        assert next(v for v in pod["volumes"] if v["name"] == name) == next(
            v for v in decode["volumes"] if v["name"] == name
        )
    assert deployment["spec"]["template"]["metadata"]["labels"]["maru.io/pool"] == "pool"
    assert pod["affinity"]["nodeAffinity"] == decode["affinity"]["nodeAffinity"]
    args = build_parser().parse_args(c["args"])
    cfg = connector_config(spec, GROUP_OWNER, pool)
    assert (args.role, args.pool, args.token_file, args.block_size) == (
        "events",
        cfg.pool_url,
        cfg.pool_token_file,
        512,
    )
    assert (args.publish, args.replay, args.medium) == ("tcp://*:5557", "tcp://*:5558", "MARU_POOL")
    assert args.topic == "kv@llama@" + (spec.model.served_model_name or spec.model.name)  # llm-d's convention
    cpu = group_spec(poolEvents={"enabled": True, "medium": "CPU"})
    assert flag(container(build_pool_events_children(cpu, GROUP_OWNER, pool)[0])["args"], "--medium") == "CPU"


def test_its_network_policy_opens_the_stream_and_reaches_only_the_pool() -> None:
    config = NetworkPolicyConfig()
    names = [p["metadata"]["name"] for p in build_group_policies(group_spec(), GROUP_OWNER, pool_view(), "ns", config)]
    assert "llama-pool-events" not in names
    dax = PoolView("cxl", dax_spec())
    policy = build_group_policies(group_spec(**ON), GROUP_OWNER, dax, "ns", config)[-1]
    assert_valid(policy)
    assert policy["metadata"]["name"] == "llama-pool-events"
    ports = [{"protocol": "TCP", "port": 5557}, {"protocol": "TCP", "port": 5558}]
    # The stream says which prompts the group's tenants sent: by default only the group's namespace reads it.
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {}}], "ports": ports}]
    named = group_spec(poolEvents={"enabled": True, "consumers": [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "llm-d"}},
         "podSelector": {"matchLabels": {"app": "indexer"}}},
        {"podSelector": {"matchExpressions": [{"key": "role", "operator": "In", "values": ["router"]}]}},
    ]})  # fmt: skip
    policy = build_group_policies(named, GROUP_OWNER, dax, "ns", config)[-1]
    assert_valid(policy)
    assert policy["spec"]["ingress"] == [{"from": [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "llm-d"}},
         "podSelector": {"matchLabels": {"app": "indexer"}}},
        {"podSelector": {"matchExpressions": [{"key": "role", "operator": "In", "values": ["router"]}]}},
    ], "ports": ports}]  # fmt: skip
    [to_pool] = [rule for rule in policy["spec"]["egress"] if "to" in rule]
    assert to_pool["ports"] == [{"protocol": "TCP", "port": dax.spec.daemon.metadata_port}]


def test_token_ids_are_opt_in() -> None:
    def args(**events: object) -> list[str]:
        spec = group_spec(poolEvents={"enabled": True, **events})
        return container(build_pool_events_children(spec, GROUP_OWNER, pool_view())[0])["args"]

    assert "--token-ids" not in args()
    assert build_parser().parse_args(args()).token_ids is False
    assert build_parser().parse_args(args(tokenIds=True)).token_ids is True


def test_curve_mounts_the_named_secret_as_a_directory_and_passes_its_keys() -> None:
    spec = group_spec(poolEvents={"enabled": True, "curve": {"secretName": "events-keys"}})
    deployment, _ = build_pool_events_children(spec, GROUP_OWNER, pool_view())
    assert_valid(deployment)
    c, pod = container(deployment), deployment["spec"]["template"]["spec"]
    args = build_parser().parse_args(c["args"])
    [volume] = [v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == "events-keys"]
    [mount] = [m for m in c["volumeMounts"] if m["name"] == volume["name"]]
    assert "subPath" not in mount and mount["readOnly"] is True  # a subPath file is never updated by the kubelet
    paths = {i["key"]: f"{mount['mountPath']}/{i['path']}" for i in volume["secret"]["items"]}
    assert (args.curve_secret_key_file, args.curve_clients_file) == (
        paths["server-secret-key"],
        paths["client-public-keys"],
    )
    assert check(deployment, "restricted") == []
    plain = container(build_pool_events_children(group_spec(**ON), GROUP_OWNER, pool_view())[0])
    assert not any(a.startswith("--curve") for a in plain["args"])


def test_a_consumer_without_a_selector_is_refused_naming_the_field() -> None:
    with pytest.raises(ValidationError, match=r"poolEvents\.consumers: set podSelector, namespaceSelector or both"):
        group_spec(poolEvents={"enabled": True, "consumers": [{}]})
    with pytest.raises(ValidationError, match="secretName"):
        group_spec(poolEvents={"enabled": True, "curve": {"secretName": "Not_A_Name"}})
