"""The group's pool events publisher: rendered only when asked, with the engines' pool access, restricted."""

from __future__ import annotations

from maru_connector.pool.cli import build_parser
from maru_localcluster.podsecurity import check
from maru_operator.builders.group import PoolView, build_group_children, build_role_deployment, connector_config
from maru_operator.builders.netpol import NetworkPolicyConfig, build_group_policies
from maru_operator.builders.poolevents import build_pool_events_children
from tests.operator.helpers import GROUP_OWNER, assert_valid, container, dax_spec, flag, group_spec, pool_view

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
        "llama-pool-events"}
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
            v for v in decode["volumes"] if v["name"] == name)
    assert deployment["spec"]["template"]["metadata"]["labels"]["maru.io/pool"] == "pool"
    assert pod["affinity"]["nodeAffinity"] == decode["affinity"]["nodeAffinity"]
    args = build_parser().parse_args(c["args"])
    cfg = connector_config(spec, GROUP_OWNER, pool)
    assert (args.role, args.pool, args.token_file, args.block_size) == (
        "events", cfg.pool_url, cfg.pool_token_file, 512)
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
    assert policy["spec"]["ingress"] == [{"ports": ports}]  # any consumer: it runs where its installation put it
    [to_pool] = [rule for rule in policy["spec"]["egress"] if "to" in rule]
    assert to_pool["ports"] == [{"protocol": "TCP", "port": dax.spec.daemon.metadata_port}]
