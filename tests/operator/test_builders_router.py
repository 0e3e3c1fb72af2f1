"""The router pod with decode-direct: maru-router in front of vllm-router, keyed and placed as the engines are."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from maru_contracts.config import MaruConnectorConfig
from maru_localcluster.podsecurity import check
from maru_operator.builders.children import build_group_children
from maru_operator.builders.group import (
    PoolView,
    build_role_deployment,
    build_role_service,
    build_router_children,
    build_router_deployment,
)
from maru_operator.builders.netpol import (
    DEFAULT_NETWORK,
    NetworkPolicyConfig,
    build_group_policies,
    build_pool_policies,
)
from maru_router.__main__ import parse_args
from maru_router.revisions import revision_of
from tests.support.specs import GROUP_OWNER, POOL_OWNER, assert_valid, dax_spec, flag, group_spec, pool_view


def pod(obj: dict[str, Any] | None) -> dict[str, Any]:
    assert obj is not None
    return obj["spec"]["template"]["spec"]


def containers(obj: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in pod(obj)["containers"]}


def engine_extra_config(spec: Any, pool: PoolView) -> dict[str, Any]:
    args = build_role_deployment(spec, "decode", GROUP_OWNER, pool)["spec"]["template"]["spec"]["containers"][0]["args"]
    return json.loads(flag(args, "--kv-transfer-config"))["kv_connector_extra_config"]


class TestDecodeDirectRouter:
    def test_on_by_default_maru_router_in_front_of_vllm_router(self) -> None:
        dep = build_router_deployment(group_spec(), GROUP_OWNER, pool_view())
        assert dep is not None
        assert_valid(dep)
        c = containers(dep)
        assert list(c) == ["router", "vllm-router"]
        front, pd = c["router"], c["vllm-router"]
        assert front["command"] == ["maru-router"]
        assert front["ports"] == [
            {"name": "http", "containerPort": 8000, "protocol": "TCP"},
            {"name": "direct-metrics", "containerPort": 29001, "protocol": "TCP"},
        ]
        args = front["args"]
        assert flag(args, "--upstream") == "http://127.0.0.1:8001"
        assert flag(args, "--prefill") == "http://llama-prefill.llm.svc:8000"
        assert flag(args, "--decode") == "http://llama-decode.llm.svc:8000"
        assert flag(args, "--min-coverage") == "1.0"
        assert "--direct-to-prefill" not in args  # off: prefill stays free for the prompts the pool lacks
        spread = containers(build_router_deployment(group_spec(router={"decodeDirect": {"toPrefill": True}}),
                                                    GROUP_OWNER, pool_view()))["router"]["args"]  # fmt: skip
        assert flag(spread, "--direct-to-prefill") == "on"
        # It takes the pods vllm-router found as its engines and asks each where it publishes its KV events.
        assert flag(args, "--follow-upstream-workers") == "5"
        assert "--discover-kv-events" in args
        # Each engine announces its key revision (its pod's maru.io/kv-revision) as its events' topic, which the
        # router reads where it learns where the engine publishes: what it pairs prefill and decode by mid-rollout.
        for role in ("prefill", "decode"):
            template = build_role_deployment(group_spec(), role, GROUP_OWNER, pool_view())["spec"]["template"]
            events = json.loads(flag(template["spec"]["containers"][0]["args"], "--kv-events-config"))
            assert revision_of({"0": events}) == template["metadata"]["labels"]["maru.io/kv-revision"]
        # vllm-router behind it: the same P/D router as without decode-direct, on the upstream port.
        assert pd["command"] == ["vllm-router"]
        assert flag(pd["args"], "--port") == "8001"
        assert {p["name"]: p["containerPort"] for p in pd["ports"]} == {"upstream": 8001, "metrics": 29000}
        assert pd["readinessProbe"]["httpGet"]["port"] == "upstream"

    def test_maru_router_keys_prompts_as_the_engines_do(self) -> None:
        spec, pool = group_spec(image="registry.example/vllm-maru:1", connector={"chunkTokens": 512}), pool_view()
        front = containers(build_router_deployment(spec, GROUP_OWNER, pool))["router"]
        engine = build_role_deployment(spec, "decode", GROUP_OWNER, pool)["spec"]["template"]["spec"]["containers"][0]
        # The engines' image (vLLM's hashing and the connector), their connector config and their hash seed.
        assert front["image"] == engine["image"] == "registry.example/vllm-maru:1"
        assert json.loads(flag(front["args"], "--connector-config")) == engine_extra_config(spec, pool)
        seed = {e["name"]: e.get("value") for e in engine["env"]}["PYTHONHASHSEED"]
        assert {e["name"]: e.get("value") for e in front["env"]}["PYTHONHASHSEED"] == seed
        # And the arguments are what maru-router's own parser accepts.
        parsed = parse_args(front["args"])
        assert parsed.upstream == "http://127.0.0.1:8001" and parsed.metrics_port == 29001
        assert MaruConnectorConfig.from_extra_config(json.loads(parsed.connector_config)).chunk_tokens == 512

    def test_a_user_hash_seed_does_not_replace_the_engines(self) -> None:
        spec = group_spec(router={"env": [{"name": "PYTHONHASHSEED", "value": "7"}, {"name": "A", "value": "b"}]})
        env = containers(build_router_deployment(spec, GROUP_OWNER, pool_view()))["router"]["env"]
        assert [e["value"] for e in env if e["name"] == "PYTHONHASHSEED"] == ["0"]
        assert {"name": "A", "value": "b"} in env

    def test_reaches_the_pool_as_the_engines_do(self) -> None:
        spec, pool = group_spec(), pool_view()
        router_pod = pod(build_router_deployment(spec, GROUP_OWNER, pool))
        engine_pod = build_role_deployment(spec, "decode", GROUP_OWNER, pool)["spec"]["template"]["spec"]
        engine_volumes = {v["name"]: v for v in engine_pod["volumes"]}
        engine_mounts = {m["name"]: m for m in engine_pod["containers"][0]["volumeMounts"]}
        front = {c["name"]: c for c in router_pod["containers"]}["router"]
        mounts = {m["name"]: m for m in front["volumeMounts"]}
        for name in ("maru-socket", "maru-credential"):
            assert {v["name"]: v for v in router_pod["volumes"]}[name] == engine_volumes[name]
            assert mounts[name] == engine_mounts[name]
        # vllm-router touches neither.
        upstream_mounts = {
            m["name"] for m in {c["name"]: c for c in router_pod["containers"]}["vllm-router"]["volumeMounts"]
        }
        assert not upstream_mounts & {"maru-socket", "maru-credential"}
        # Read-only root: vLLM's import writes its caches to the scratch directories.
        assert {"home", "tmp"} <= set(mounts)

    def test_only_vllm_router_holds_an_api_token(self) -> None:
        router_pod = pod(build_router_deployment(group_spec(), GROUP_OWNER, pool_view()))
        assert router_pod["automountServiceAccountToken"] is False
        assert router_pod["serviceAccountName"] == "llama-router"
        c = {c["name"]: c for c in router_pod["containers"]}
        token_dir = "/var/run/secrets/kubernetes.io/serviceaccount"
        assert not any(m["mountPath"] == token_dir for m in c["router"]["volumeMounts"])
        (mount,) = [m for m in c["vllm-router"]["volumeMounts"] if m["mountPath"] == token_dir]
        (volume,) = [v for v in router_pod["volumes"] if v["name"] == mount["name"]]
        sources = {next(iter(s)) for s in volume["projected"]["sources"]}
        assert sources == {"serviceAccountToken", "configMap", "downwardAPI"}

    def test_runs_on_the_pool_nodes_beside_decode(self) -> None:
        spec = group_spec()
        pool = pool_view(tolerations=[{"key": "cxl", "operator": "Exists", "effect": "NoSchedule"}])
        router_pod = pod(build_router_deployment(spec, GROUP_OWNER, pool))
        decode_pod = build_role_deployment(spec, "decode", GROUP_OWNER, pool)["spec"]["template"]["spec"]
        assert router_pod["affinity"]["nodeAffinity"] == decode_pod["affinity"]["nodeAffinity"]
        assert router_pod["tolerations"] == [{"key": "cxl", "operator": "Exists", "effect": "NoSchedule"}]
        # An shm pool is per node: the router's lookups must see the pool decode loads from.
        term = router_pod["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
        assert term["podAffinityTerm"]["labelSelector"]["matchLabels"]["maru.io/role"] == "decode"
        dax = pod(build_router_deployment(spec, GROUP_OWNER, PoolView("pool", dax_spec())))
        assert "podAffinity" not in dax["affinity"]

    def test_passes_pod_security_restricted(self) -> None:
        for pool in (pool_view(), PoolView("pool", dax_spec())):
            dep = build_router_deployment(group_spec(), GROUP_OWNER, pool)
            assert dep is not None
            assert check(dep, "restricted") == []

    def test_min_coverage(self) -> None:
        spec = group_spec(router={"decodeDirect": {"minCoverage": 0.5}})
        assert (
            flag(
                containers(build_router_deployment(spec, GROUP_OWNER, pool_view()))["router"]["args"], "--min-coverage"
            )
            == "0.5"
        )
        for bad in (0, 0.001, 1.5):
            with pytest.raises(ValidationError, match=r"minCoverage|min_coverage"):
                group_spec(router={"decodeDirect": {"minCoverage": bad}})

    @pytest.mark.parametrize("why", ["off", "no pool"])
    def test_off_or_without_a_pool_is_vllm_router_alone(self, why: str) -> None:
        today = build_router_deployment(group_spec(), GROUP_OWNER)
        assert today is not None and [c["name"] for c in pod(today)["containers"]] == ["router"]
        assert pod(today)["containers"][0]["command"] == ["vllm-router"]
        if why == "off":
            spec, pool = group_spec(router={"decodeDirect": {"enabled": False}}), pool_view()
        else:
            spec, pool = group_spec(), None
        assert build_router_deployment(spec, GROUP_OWNER, pool) == today
        kinds = [(o["kind"], o["metadata"]["name"]) for o in build_router_children(spec, GROUP_OWNER, pool)]
        assert ("Service", "llama-decode") not in kinds and ("Service", "llama-prefill") not in kinds


class TestRoleServices:
    def test_select_the_role_pods_on_their_http_port(self) -> None:
        spec, pool = group_spec(), pool_view()
        for role in ("prefill", "decode"):
            svc = build_role_service(spec, role, GROUP_OWNER, pool)
            assert svc is not None
            assert_valid(svc)
            assert svc["metadata"]["name"] == f"llama-{role}"
            engine = build_role_deployment(spec, role, GROUP_OWNER, pool)["spec"]["template"]
            assert svc["spec"]["selector"].items() <= engine["metadata"]["labels"].items()
            other = "decode" if role == "prefill" else "prefill"
            other_labels = build_role_deployment(spec, other, GROUP_OWNER, pool)["spec"]["template"]["metadata"]
            assert not svc["spec"]["selector"].items() <= other_labels["labels"].items()
            assert svc["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
            assert engine["spec"]["containers"][0]["ports"][0]["name"] == "http"

    def test_rendered_with_the_group(self) -> None:
        names = {
            (o["kind"], o["metadata"]["name"]) for o in build_group_children(group_spec(), GROUP_OWNER, pool_view())
        }
        assert {("Service", "llama"), ("Service", "llama-prefill"), ("Service", "llama-decode")} <= names


class TestDecodeDirectPolicies:
    def test_the_router_reaches_both_roles_and_is_scraped_on_both_metrics_ports(self) -> None:
        config = NetworkPolicyConfig(scrape_namespaces=("monitoring",))
        policies = {
            p["metadata"]["name"]: p["spec"]
            for p in build_group_policies(group_spec(), GROUP_OWNER, pool_view(), "maru-system", config)
        }
        router = policies["llama-router"]
        (to_vllm,) = [e for e in router["egress"] if {"protocol": "TCP", "port": 8000} in e.get("ports", [])]
        assert to_vllm["ports"] == [{"protocol": "TCP", "port": 8000}, {"protocol": "TCP", "port": 5557}]
        # Both roles (no role label in the peer): decode-direct to decode, the scheme-learning path to prefill.
        assert to_vllm["to"][0]["podSelector"]["matchLabels"] == {
            "app.kubernetes.io/name": "vllm",
            "app.kubernetes.io/instance": "llama",
        }
        scraped = {p["port"] for rule in router["ingress"] if rule.get("from") for p in rule["ports"]}
        assert scraped == {29000, 29001}
        vllm = policies["llama-vllm"]
        assert vllm["ingress"][0]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == "vllm-router"

    def test_with_a_dax_pool_the_router_reaches_its_metadata_server(self) -> None:
        pool = PoolView("pool", dax_spec())
        router = {
            p["metadata"]["name"]: p["spec"]
            for p in build_group_policies(group_spec(), GROUP_OWNER, pool, "maru-system", DEFAULT_NETWORK)
        }["llama-router"]
        port = dax_spec().daemon.metadata_port
        assert any(e.get("ports") == [{"protocol": "TCP", "port": port}] for e in router["egress"]), router["egress"]
        # ... and the metadata server admits it: the router pod carries its pool's label, as the engines do.
        router_labels = build_router_deployment(group_spec(), GROUP_OWNER, pool)["spec"]["template"]["metadata"]  # type: ignore[index]
        (metadata_policy, _) = build_pool_policies(dax_spec(), POOL_OWNER, "maru-system", DEFAULT_NETWORK)
        peers = metadata_policy["spec"]["ingress"][0]["from"]
        assert any(
            p.get("podSelector", {}).get("matchLabels", {}).items() <= router_labels["labels"].items()
            and "maru.io/pool" in p["podSelector"]["matchLabels"]
            for p in peers
        )

    def test_off_the_router_reaches_no_pool(self) -> None:
        off, dax = group_spec(router={"decodeDirect": {"enabled": False}}), PoolView("pool", dax_spec())

        def router_policy(pool: PoolView | None) -> dict[str, Any]:
            return {
                p["metadata"]["name"]: p
                for p in build_group_policies(off, GROUP_OWNER, pool, "maru-system", DEFAULT_NETWORK)
            }["llama-router"]

        assert router_policy(dax) == router_policy(None)
