"""One class per group builder: vLLM roles, the router and its RBAC."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from maru_contracts.config import MaruConnectorConfig
from maru_operator.builders.children import build_group_children
from maru_operator.builders.common import LABEL_POOL, LABEL_ROLE
from maru_operator.builders.group import (
    build_role_deployment,
    build_router_deployment,
    build_router_role_binding,
    build_router_service,
    build_router_service_account,
    router_endpoint,
)
from tests.support.specs import GROUP_OWNER, assert_valid, container, flag, group_spec, kv_config, pool_view


class TestRoleDeployment:
    def test_valid_and_named(self) -> None:
        for role in ("prefill", "decode"):
            dep = build_role_deployment(group_spec(), role, GROUP_OWNER, pool_view())
            assert_valid(dep)
            assert dep["metadata"]["name"] == f"llama-{role}"
            assert dep["metadata"]["namespace"] == "llm"
            assert dep["metadata"]["labels"][LABEL_ROLE] == role
            assert dep["spec"]["template"]["metadata"]["labels"][LABEL_ROLE] == role
            assert dep["metadata"]["labels"][LABEL_POOL] == "pool"

    def test_vllm_command_line(self) -> None:
        spec = group_spec(
            model={"name": "m/x", "revision": "abc", "servedModelName": "x", "dtype": "float32", "maxModelLen": 4096},
            connector={"blockSize": 128, "chunkTokens": 512},
            prefill={"tensorParallelSize": 2, "extraArgs": ["--max-num-seqs=8"]},
            decode={"tensorParallelSize": 2},
        )
        c = container(build_role_deployment(spec, "prefill", GROUP_OWNER, pool_view()))
        # vLLM under the init: as PID 1 it would drop a SIGTERM sent during its model load.
        assert c["command"] == ["python3", "-m", "maru_common.init", "vllm", "serve"]
        args = c["args"]
        assert args[0] == "m/x"
        assert flag(args, "--port") == "8000"
        assert flag(args, "--served-model-name") == "x"
        assert flag(args, "--tensor-parallel-size") == "2"
        assert flag(args, "--block-size") == "128"
        assert flag(args, "--dtype") == "float32"
        assert flag(args, "--revision") == "abc"
        assert flag(args, "--max-model-len") == "4096"
        assert args[-1] == "--max-num-seqs=8"

    def test_lora_adapters_render_for_both_roles(self) -> None:
        adapters = [{"name": "sql", "source": "/var/cache/maru/models/sql-lora"}, {"name": "chat", "source": "o/chat"}]
        spec = group_spec(model={"name": "m/x", "adapters": adapters})
        for role in ("prefill", "decode"):
            args = container(build_role_deployment(spec, role, GROUP_OWNER, pool_view()))["args"]
            assert "--enable-lora" in args and flag(args, "--max-loras") == "2"
            at = args.index("--lora-modules")
            assert args[at + 1 : at + 3] == ["sql=/var/cache/maru/models/sql-lora", "chat=o/chat"]
        plain = container(build_role_deployment(group_spec(), "decode", GROUP_OWNER, pool_view()))["args"]
        assert "--enable-lora" not in plain and "--lora-modules" not in plain

    def test_optional_flags_absent(self) -> None:
        args = container(build_role_deployment(group_spec(), "decode", GROUP_OWNER, pool_view()))["args"]
        assert "--revision" not in args and "--max-model-len" not in args
        assert flag(args, "--served-model-name") == "Qwen/Qwen2.5-7B-Instruct"

    def test_kv_transfer_config_from_the_connector_model(self) -> None:
        spec = group_spec(connector={"chunkTokens": 512, "blockSize": 16})
        prefill = kv_config(build_role_deployment(spec, "prefill", GROUP_OWNER, pool_view()))
        decode = kv_config(build_role_deployment(spec, "decode", GROUP_OWNER, pool_view()))
        assert prefill["kv_role"] == "kv_both"  # prefill replicas reuse each other's KV
        assert decode["kv_role"] == "kv_consumer"
        # Everything but the role is identical: the two can never disagree.
        assert {**prefill, "kv_role": None} == {**decode, "kv_role": None}
        parsed = MaruConnectorConfig.from_extra_config(prefill["kv_connector_extra_config"])
        assert parsed.pool_url == "unix:///run/maru/pool/pool.sock"
        assert parsed.chunk_tokens == 512
        assert parsed.cache_namespace == "llm/llama"

    def test_decode_at_another_tp_size_than_prefill_is_told_prefills(self) -> None:
        spec = group_spec(prefill={"tensorParallelSize": 2}, decode={"tensorParallelSize": 1})
        prefill = kv_config(build_role_deployment(spec, "prefill", GROUP_OWNER, pool_view()))
        decode = kv_config(build_role_deployment(spec, "decode", GROUP_OWNER, pool_view()))
        assert decode["kv_connector_extra_config"]["maru_kv_writer_tp"] == 2
        assert MaruConnectorConfig.from_extra_config(decode["kv_connector_extra_config"]).writer_tp == 2
        assert "maru_kv_writer_tp" not in prefill["kv_connector_extra_config"]  # it loads its own chunks
        # Equal sizes render as before the key existed: no rollout for existing groups.
        same = group_spec(prefill={"tensorParallelSize": 2}, decode={"tensorParallelSize": 2})
        for role in ("prefill", "decode"):
            extra = kv_config(build_role_deployment(same, role, GROUP_OWNER, pool_view()))["kv_connector_extra_config"]
            assert "maru_kv_writer_tp" not in extra

    def test_cache_namespace_override_stays_in_the_group_namespace(self) -> None:
        spec = group_spec(connector={"cacheNamespace": "tenant-a"})
        extra = kv_config(build_role_deployment(spec, "decode", GROUP_OWNER, pool_view()))["kv_connector_extra_config"]
        assert extra["maru_cache_namespace"] == "llm/tenant-a"

    def test_pool_rpc_timeout_reaches_both_roles(self) -> None:
        spec = group_spec(connector={"rpcTimeoutMs": 5000})
        for role in ("prefill", "decode"):
            extra = kv_config(build_role_deployment(spec, role, GROUP_OWNER, pool_view()))["kv_connector_extra_config"]
            assert extra["maru_rpc_timeout_ms"] == 5000

    def test_cache_namespace_of_a_long_name_fits(self) -> None:
        from maru_operator.builders.common import Owner

        owner = Owner(kind="InferenceGroup", name="g" * 253, namespace="n" * 63, uid="u")
        other = Owner(kind="InferenceGroup", name="g" * 252 + "h", namespace="n" * 63, uid="u")
        salts = [
            kv_config(build_role_deployment(group_spec(), "decode", o, pool_view()))["kv_connector_extra_config"][
                "maru_cache_namespace"
            ]
            for o in (owner, other)
        ]
        assert all(len(s) <= 253 for s in salts)
        assert salts[0] != salts[1]

    def test_hash_seed_and_user_env(self) -> None:
        spec = group_spec(decode={"env": [{"name": "HF_HOME", "value": "/cache"}]})
        env = container(build_role_deployment(spec, "decode", GROUP_OWNER, pool_view()))["env"]
        assert env[:2] == [{"name": "PYTHONHASHSEED", "value": "0"}, {"name": "HF_HOME", "value": "/cache"}]
        # The user's value wins over the cache default, and no name appears twice (server-side apply refuses).
        names = [e["name"] for e in env]
        assert len(names) == len(set(names)) and "HOME" in names
        env = container(build_role_deployment(spec, "prefill", GROUP_OWNER, pool_view()))["env"]
        assert env[0] == {"name": "PYTHONHASHSEED", "value": "0"}
        assert {"name": "HF_HOME", "value": "/home/maru/.cache/huggingface"} in env

    def test_read_only_root_with_writable_caches(self) -> None:
        dep = build_role_deployment(group_spec(), "prefill", GROUP_OWNER, pool_view())
        c, pod = container(dep), dep["spec"]["template"]["spec"]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        env = {e["name"]: e["value"] for e in c["env"]}
        # Every directory vLLM writes to is on a volume of the pod.
        for variable in ("HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "HF_HOME", "TRITON_CACHE_DIR", "TMPDIR"):
            under = [path for path in mounts if env[variable] == path or env[variable].startswith(path + "/")]
            assert under, f"{variable}={env[variable]} is on the read-only root"
            assert "emptyDir" in volumes[mounts[under[0]]]
        assert mounts["/tmp"] == "tmp"

    def test_pinned_to_pool_nodes(self) -> None:
        view = pool_view(tolerations=[{"key": "cxl", "operator": "Exists"}])
        spec = group_spec(
            decode={"nodeSelector": {"gpu": "h100"}, "tolerations": [{"key": "gpu", "operator": "Exists"}]}
        )
        pod = build_role_deployment(spec, "decode", GROUP_OWNER, view)["spec"]["template"]["spec"]
        required = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        terms = required["nodeSelectorTerms"]
        assert terms == [{"matchExpressions": [{"key": "maru.io/pool", "operator": "In", "values": ["yes"]}]}]
        assert pod["nodeSelector"] == {"gpu": "h100"}
        assert [t["key"] for t in pod["tolerations"]] == ["cxl", "gpu"]

    def test_no_node_affinity_when_pool_selects_every_node(self) -> None:
        pod = build_role_deployment(group_spec(), "prefill", GROUP_OWNER, pool_view(nodeSelector={}))
        assert "affinity" not in pod["spec"]["template"]["spec"]

    def test_decode_prefers_prefill_nodes_on_shm(self) -> None:
        dep = build_role_deployment(group_spec(), "decode", GROUP_OWNER, pool_view())
        pod_affinity = dep["spec"]["template"]["spec"]["affinity"]["podAffinity"]
        terms = pod_affinity["preferredDuringSchedulingIgnoredDuringExecution"]
        selector = terms[0]["podAffinityTerm"]["labelSelector"]["matchLabels"]
        prefill = build_role_deployment(group_spec(), "prefill", GROUP_OWNER, pool_view())
        assert selector.items() <= prefill["spec"]["template"]["metadata"]["labels"].items()
        assert terms[0]["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
        assert "podAffinity" not in prefill["spec"]["template"]["spec"]["affinity"]
        from maru_operator.builders.group import PoolView
        from tests.support.specs import dax_spec

        dax = build_role_deployment(group_spec(), "decode", GROUP_OWNER, PoolView("pool", dax_spec()))
        assert "podAffinity" not in dax["spec"]["template"]["spec"]["affinity"]

    def test_socket_mount_and_shm(self) -> None:
        dep = build_role_deployment(group_spec(), "prefill", GROUP_OWNER, pool_view())
        pod = dep["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        # The pool's socket directory comes from the chart's CSI driver, read-only: no hostPath.
        assert volumes["maru-socket"] == {
            "name": "maru-socket",
            "csi": {
                "driver": "csi.maru.io",
                "readOnly": True,
                "volumeAttributes": {"pool": "pool", "socketDir": "/run/maru"},
            },
        }
        assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
        mounts = {m["name"]: m["mountPath"] for m in container(dep)["volumeMounts"]}
        assert mounts == {
            "maru-socket": "/run/maru/pool",
            "maru-credential": "/var/run/secrets/maru.io/pool",
            "dshm": "/dev/shm",
            "model-cache": "/var/cache/maru/models",
            "home": "/home/maru",
            "tmp": "/tmp",
        }
        assert next(m for m in container(dep)["volumeMounts"] if m["name"] == "maru-socket")["readOnly"] is True

    def test_security_and_probes(self) -> None:
        dep = build_role_deployment(group_spec(), "prefill", GROUP_OWNER, pool_view())
        pod = dep["spec"]["template"]["spec"]
        # runAsUser too: runAsNonRoot alone refuses images whose user is root.
        assert pod["securityContext"] == {
            "runAsNonRoot": True,
            "runAsUser": 65532,
            "runAsGroup": 65532,
            "seccompProfile": {"type": "RuntimeDefault"},
            # The shared model cache is writable by the pods, chowned only once.
            "fsGroup": 65532,
            "fsGroupChangePolicy": "OnRootMismatch",
        }
        assert pod["automountServiceAccountToken"] is False
        c = container(dep)
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert "privileged" not in c["securityContext"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
        # With decode-direct (the default) the engine publishes its KV events for maru-router too.
        assert c["ports"] == [
            {"name": "http", "containerPort": 8000, "protocol": "TCP"},
            {"name": "kv-events", "containerPort": 5557, "protocol": "TCP"},
        ]

    def test_engines_publish_their_kv_events_only_for_a_decode_direct_router(self) -> None:
        for enabled in (True, False):
            spec = group_spec(router={"decodeDirect": {"enabled": enabled}})
            for role in ("prefill", "decode"):
                c = container(build_role_deployment(spec, role, GROUP_OWNER, pool_view()))
                args = c["args"]
                if enabled:
                    events = json.loads(args[args.index("--kv-events-config") + 1])
                    # A wildcard bind: vLLM connects instead of binding to any other address.
                    assert events.pop("topic").startswith("maru.io/kv-revision=")
                    assert events == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557"}
                else:
                    assert "--kv-events-config" not in args
                    assert [p["name"] for p in c["ports"]] == ["http"]

    def test_gpus_from_resources(self) -> None:
        spec = group_spec(prefill={"resources": {"limits": {"nvidia.com/gpu": 2}, "requests": {"cpu": "4"}}})
        c = container(build_role_deployment(spec, "prefill", GROUP_OWNER, pool_view()))
        assert c["resources"] == {
            "limits": {"nvidia.com/gpu": 2, "memory": "32Gi"},
            "requests": {"cpu": "4", "memory": "8Gi", "ephemeral-storage": "10Gi"},
        }
        c = container(build_role_deployment(spec, "decode", GROUP_OWNER, pool_view()))
        assert c["resources"] == {
            "limits": {"memory": "32Gi"},
            "requests": {"cpu": "1", "memory": "8Gi", "ephemeral-storage": "10Gi"},
        }

    def test_memory_defaults_scale_with_tensor_parallel_size_and_yield_to_the_user(self) -> None:
        spec = group_spec(prefill={"tensorParallelSize": 4}, decode={"resources": {"limits": {"memory": "20Gi"}}})
        prefill = container(build_role_deployment(spec, "prefill", GROUP_OWNER, pool_view()))["resources"]
        assert prefill == {
            "limits": {"memory": "128Gi"},
            "requests": {"cpu": "4", "memory": "32Gi", "ephemeral-storage": "10Gi"},
        }
        decode = container(build_role_deployment(spec, "decode", GROUP_OWNER, pool_view()))["resources"]
        # A limit alone: Kubernetes defaults the request to it, nothing is added.
        assert decode == {"limits": {"memory": "20Gi"}, "requests": {"cpu": "1", "ephemeral-storage": "10Gi"}}

    def test_replicas_override(self) -> None:
        spec = group_spec(decode={"replicas": 3})
        assert build_role_deployment(spec, "decode", GROUP_OWNER, pool_view())["spec"]["replicas"] == 3


class TestRouterServiceAccount:
    def test_shape(self) -> None:
        sa = build_router_service_account(group_spec(), GROUP_OWNER)
        assert sa is not None
        assert_valid(sa)
        assert sa["metadata"]["name"] == "llama-router"

    def test_disabled(self) -> None:
        assert build_router_service_account(group_spec(router={"enabled": False}), GROUP_OWNER) is None


class TestRouterRoleBinding:
    def test_binds_the_routers_cluster_role_to_the_router_account(self) -> None:
        rb = build_router_role_binding(group_spec(), GROUP_OWNER)
        assert rb is not None
        assert_valid(rb)
        assert rb["metadata"]["namespace"] == "llm"
        # The roleRef of the Role-bound binding of earlier versions cannot change: another name.
        assert rb["metadata"]["name"] == "llama-router-pods"
        assert rb["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": "maru-operator-router",
        }
        assert rb["subjects"] == [{"kind": "ServiceAccount", "name": "llama-router", "namespace": "llm"}]

    def test_the_cluster_role_is_the_operator_instances(self) -> None:
        owner = replace(GROUP_OWNER, operator_instance="team-a")
        rb = build_router_role_binding(group_spec(), owner)
        assert rb is not None and rb["roleRef"]["name"] == "maru-operator-team-a-router"

    def test_disabled(self) -> None:
        assert build_router_role_binding(group_spec(router={"enabled": False}), GROUP_OWNER) is None


class TestRouterDeployment:
    def test_pd_mode_with_kubernetes_discovery(self) -> None:
        dep = build_router_deployment(group_spec(router={"policy": "power_of_two", "replicas": 2}), GROUP_OWNER)
        assert dep is not None
        assert_valid(dep)
        assert dep["spec"]["replicas"] == 2
        c = container(dep)
        assert c["command"] == ["vllm-router"]
        args = c["args"]
        assert "--vllm-pd-disaggregation" in args and "--service-discovery" in args
        assert flag(args, "--service-discovery-namespace") == "llm"
        assert flag(args, "--service-discovery-port") == "8000"
        assert flag(args, "--policy") == "power_of_two"
        assert flag(args, "--host") == "0.0.0.0"
        i = args.index("--prefill-selector")
        assert args[i + 1 : i + 4] == [
            "app.kubernetes.io/name=vllm",
            "app.kubernetes.io/instance=llama",
            "maru.io/role=prefill",
        ]
        i = args.index("--decode-selector")
        assert args[i + 3] == "maru.io/role=decode"
        assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "llama-router"

    def test_selectors_match_the_role_pods(self) -> None:
        spec = group_spec()
        args = container(build_router_deployment(spec, GROUP_OWNER))["args"]  # type: ignore[arg-type]
        for role in ("prefill", "decode"):
            i = args.index(f"--{role}-selector")
            wanted = dict(a.split("=", 1) for a in args[i + 1 : i + 4])
            pod_labels = build_role_deployment(spec, role, GROUP_OWNER, pool_view())["spec"]["template"]["metadata"]
            assert wanted.items() <= pod_labels["labels"].items()

    def test_flags_parse_with_the_pinned_router(self) -> None:
        """The exact argument list is accepted by vllm-router 0.1.17's own parser."""
        import argparse

        from vllm_router.router_args import RouterArgs

        parser = argparse.ArgumentParser()
        RouterArgs.add_cli_args(parser)
        args = container(build_router_deployment(group_spec(), GROUP_OWNER))["args"]  # type: ignore[arg-type]
        parsed = RouterArgs.from_cli_args(parser.parse_args(args))
        parsed._validate_router_args()
        assert parsed.vllm_pd_disaggregation and parsed.service_discovery
        assert parsed.prefill_selector == {
            "app.kubernetes.io/name": "vllm",
            "app.kubernetes.io/instance": "llama",
            "maru.io/role": "prefill",
        }
        assert parsed.decode_selector["maru.io/role"] == "decode"
        assert parsed.service_discovery_port == 8000

    def test_disabled(self) -> None:
        assert build_router_deployment(group_spec(router={"enabled": False}), GROUP_OWNER) is None


class TestRouterService:
    def test_named_after_the_group(self) -> None:
        svc = build_router_service(group_spec(router={"serviceType": "NodePort", "port": 9000}), GROUP_OWNER)
        assert svc is not None
        assert_valid(svc)
        assert svc["metadata"]["name"] == "llama"
        assert svc["spec"]["type"] == "NodePort"
        assert svc["spec"]["ports"] == [{"name": "http", "port": 9000, "targetPort": "http", "protocol": "TCP"}]
        assert router_endpoint(group_spec(router={"port": 9000}), GROUP_OWNER) == "http://llama.llm.svc:9000"

    def test_disabled(self) -> None:
        spec = group_spec(router={"enabled": False})
        assert build_router_service(spec, GROUP_OWNER) is None
        assert router_endpoint(spec, GROUP_OWNER) == ""


class TestGroupChildren:
    def test_unbound_group_gets_only_the_router(self) -> None:
        kinds = [c["kind"] for c in build_group_children(group_spec(), GROUP_OWNER, None)]
        assert "Deployment" in kinds and len(kinds) == 5 and "PodDisruptionBudget" in kinds
        assert all(
            c["metadata"]["name"].startswith("llama") for c in build_group_children(group_spec(), GROUP_OWNER, None)
        )

    def test_bound_group(self) -> None:
        names = [c["metadata"]["name"] for c in build_group_children(group_spec(), GROUP_OWNER, pool_view())]
        kinds = [c["kind"] for c in build_group_children(group_spec(), GROUP_OWNER, pool_view())]
        assert list(zip(kinds, names, strict=True)) == [
            ("PersistentVolumeClaim", "llama-model-cache"),
            ("Deployment", "llama-prefill"),
            ("PodDisruptionBudget", "llama-prefill"),
            ("Deployment", "llama-decode"),
            ("PodDisruptionBudget", "llama-decode"),
            ("ServiceAccount", "llama-router"),
            ("RoleBinding", "llama-router-pods"),
            ("Service", "llama"),
            ("Service", "llama-prefill"),
            ("Service", "llama-decode"),
            ("Deployment", "llama-router"),
            ("PodDisruptionBudget", "llama-router"),
        ]


class TestRouterResources:
    def test_memory_limit_by_default(self) -> None:
        dep = build_router_deployment(group_spec(), GROUP_OWNER)
        assert dep is not None
        assert container(dep)["resources"] == {
            "limits": {"memory": "1Gi"},
            "requests": {"cpu": "100m", "memory": "128Mi"},
        }

    def test_a_larger_request_raises_the_limit(self) -> None:
        dep = build_router_deployment(group_spec(router={"resources": {"requests": {"memory": "2Gi"}}}), GROUP_OWNER)
        assert dep is not None
        assert container(dep)["resources"] == {
            "limits": {"memory": "2Gi"},
            "requests": {"cpu": "100m", "memory": "2Gi"},
        }


class TestRollout:
    """GPU roles roll without a spare GPU, and slow model loads are not reported as stuck."""

    def test_a_single_replica_is_replaced_only_once_its_successor_is_ready(self) -> None:
        spec = build_role_deployment(group_spec(), "decode", GROUP_OWNER, pool_view())["spec"]
        # maxUnavailable 1 would leave the role without a pod for a whole model load.
        assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}

    def test_more_replicas_surge_and_may_also_stop_one_first(self) -> None:
        spec = build_role_deployment(group_spec(decode={"replicas": 4}), "decode", GROUP_OWNER, pool_view())["spec"]
        # Without a free GPU for the surge pod, the update still goes on one pod at a time.
        assert spec["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 1}

    def test_the_users_pace_wins_and_never_both_zero(self) -> None:
        no_spare = group_spec(decode={"strategy": {"rollingUpdate": {"maxSurge": 0}}})
        spec = build_role_deployment(no_spare, "decode", GROUP_OWNER, pool_view())["spec"]
        assert spec["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
        given = group_spec(
            decode={"replicas": 8, "strategy": {"rollingUpdate": {"maxSurge": "25%", "maxUnavailable": 0}}}
        )
        spec = build_role_deployment(given, "decode", GROUP_OWNER, pool_view())["spec"]
        assert spec["strategy"]["rollingUpdate"] == {"maxSurge": "25%", "maxUnavailable": 0}

    def test_progress_deadline_covers_the_startup_budget(self) -> None:
        for spec, budget in ((group_spec(), 1800), (group_spec(prefill={"startupTimeoutSeconds": 3600}), 3600)):
            dep = build_role_deployment(spec, "prefill", GROUP_OWNER, pool_view())
            probe = container(dep)["startupProbe"]
            assert probe["periodSeconds"] * probe["failureThreshold"] == budget
            # The default 600 s would call a model that is still loading stuck.
            assert dep["spec"]["progressDeadlineSeconds"] > budget

    def test_strategy_per_role(self) -> None:
        spec = group_spec(
            prefill={"strategy": {"type": "Recreate"}},
            decode={"strategy": {"rollingUpdate": {"maxSurge": "25%", "maxUnavailable": 0}}},
        )
        prefill = build_role_deployment(spec, "prefill", GROUP_OWNER, pool_view())
        decode = build_role_deployment(spec, "decode", GROUP_OWNER, pool_view())
        assert prefill["spec"]["strategy"] == {"type": "Recreate"}
        assert decode["spec"]["strategy"] == {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": 0},
        }
        assert_valid(prefill)
        assert_valid(decode)


class TestPodOptions:
    """What real users put in their pods: secrets in env, caches on volumes, placement and identity."""

    def test_env_from_secrets_config_maps_and_fields(self) -> None:
        env = [
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
            {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "mode", "optional": True}}},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "PLAIN", "value": "1"},
        ]
        dep = build_role_deployment(group_spec(prefill={"env": env}), "prefill", GROUP_OWNER, pool_view())
        # The hash seed first, the user's next, then the cache locations of the read-only root.
        assert container(dep)["env"][1 : 1 + len(env)] == env
        assert_valid(dep)

    def test_user_options_compose_with_the_hardened_pod(self) -> None:
        """The user's env, volumes and mounts beside the operator's read-only root, CSI socket and defaults."""
        spec = group_spec(
            prefill={
                "env": [
                    {"name": "HOME", "value": "/data/home"},
                    {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
                ],
                "volumes": [
                    {"name": "models", "persistentVolumeClaim": {"claimName": "model-cache"}},
                    {"name": "big-shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}},
                    {"name": "big-tmp", "emptyDir": {"sizeLimit": "50Gi"}},
                ],
                "volumeMounts": [
                    {"name": "models", "mountPath": "/home/maru/.cache/huggingface"},
                    {"name": "big-shm", "mountPath": "/dev/shm"},
                    {"name": "big-tmp", "mountPath": "/tmp/"},
                ],
                "priorityClassName": "inference-high",
                "strategy": {"type": "Recreate"},
            }
        )
        dep = build_role_deployment(spec, "prefill", GROUP_OWNER, pool_view())
        c, pod = container(dep), dep["spec"]["template"]["spec"]
        names = [e["name"] for e in c["env"]]
        # Server-side apply keys env by name: each once, the user's HOME instead of the operator's.
        assert len(names) == len(set(names))
        assert {"name": "HOME", "value": "/data/home"} in c["env"] and "TMPDIR" in names and "HF_HOME" in names
        mounts = {m["mountPath"].rstrip("/"): m["name"] for m in c["volumeMounts"]}
        assert len(mounts) == len(c["volumeMounts"])
        # The user's /tmp and /dev/shm replace the operator's; $HOME stays on its emptyDir with the cache under it.
        assert mounts == {
            "/run/maru/pool": "maru-socket",
            "/var/run/secrets/maru.io/pool": "maru-credential",
            "/home/maru": "home",
            "/dev/shm": "big-shm",
            "/tmp": "big-tmp",
            "/home/maru/.cache/huggingface": "models",
        }
        volumes = [v["name"] for v in pod["volumes"]]
        assert sorted(volumes) == ["big-shm", "big-tmp", "home", "maru-credential", "maru-socket", "models"]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["resources"]["limits"]["memory"] == "32Gi"
        assert pod["priorityClassName"] == "inference-high" and dep["spec"]["strategy"] == {"type": "Recreate"}
        assert_valid(dep)

    def test_the_operators_volume_names_are_reserved(self) -> None:
        from maru_operator.api.inferencegroup import RESERVED_VOLUMES

        dep = build_role_deployment(group_spec(), "decode", GROUP_OWNER, pool_view())
        assert {v["name"] for v in dep["spec"]["template"]["spec"]["volumes"]} <= set(RESERVED_VOLUMES)

    def test_volumes_and_mounts(self) -> None:
        spec = group_spec(
            decode={
                "volumes": [
                    {"name": "models", "persistentVolumeClaim": {"claimName": "model-cache", "readOnly": True}},
                    {"name": "big-shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}},
                ],
                "volumeMounts": [
                    {"name": "models", "mountPath": "/models", "readOnly": True},
                    {"name": "big-shm", "mountPath": "/dev/shm"},
                ],
            }
        )
        dep = build_role_deployment(spec, "decode", GROUP_OWNER, pool_view())
        pod = dep["spec"]["template"]["spec"]
        mounts = {m["mountPath"]: m["name"] for m in container(dep)["volumeMounts"]}
        # The user's /dev/shm replaces the built-in one; the pool socket stays.
        assert mounts["/dev/shm"] == "big-shm" and mounts["/models"] == "models"
        names = [v["name"] for v in pod["volumes"]]
        assert "dshm" not in names and {"models", "big-shm", "maru-socket"} <= set(names)
        assert_valid(dep)

    def test_pod_placement_identity_and_metadata(self) -> None:
        spec = group_spec(
            prefill={
                "imagePullSecrets": [{"name": "registry"}],
                "priorityClassName": "inference-high",
                "topologySpreadConstraints": [
                    {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"}
                ],
                "podLabels": {"team": "search"},
                "podAnnotations": {"prometheus.io/scrape": "true"},
                "serviceAccountName": "model-reader",
            }
        )
        dep = build_role_deployment(spec, "prefill", GROUP_OWNER, pool_view())
        template = dep["spec"]["template"]
        pod = template["spec"]
        assert pod["imagePullSecrets"] == [{"name": "registry"}]
        assert pod["priorityClassName"] == "inference-high"
        assert pod["serviceAccountName"] == "model-reader"
        (spread,) = pod["topologySpreadConstraints"]
        # Without a labelSelector a constraint counts no pods: it defaults to this role's pods.
        assert spread["labelSelector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
        assert template["metadata"]["labels"]["team"] == "search"
        assert template["metadata"]["annotations"] == {"prometheus.io/scrape": "true"}
        assert dep["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
        assert_valid(dep)

    def test_router_options(self) -> None:
        spec = group_spec(
            router={
                "env": [{"name": "RUST_LOG", "value": "info"}],
                "imagePullSecrets": [{"name": "registry"}],
                "priorityClassName": "inference-high",
                "podLabels": {"team": "search"},
                "podAnnotations": {"a": "b"},
                "topologySpreadConstraints": [
                    {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule"}
                ],
            }
        )
        dep = build_router_deployment(spec, GROUP_OWNER)
        assert dep is not None
        pod = dep["spec"]["template"]["spec"]
        assert container(dep)["env"] == [{"name": "RUST_LOG", "value": "info"}]
        assert pod["imagePullSecrets"] == [{"name": "registry"}] and pod["priorityClassName"] == "inference-high"
        assert dep["spec"]["template"]["metadata"]["labels"]["team"] == "search"
        assert dep["spec"]["template"]["metadata"]["annotations"] == {"a": "b"}
        assert (
            pod["topologySpreadConstraints"][0]["labelSelector"]["matchLabels"]["app.kubernetes.io/component"]
            == "router"
        )
        assert pod["serviceAccountName"] == "llama-router"  # the router's own, for pod discovery
        assert_valid(dep)


class TestEcosystemLabels:
    """Pods carry their role as llm-d selects it, and the revision of their pool keys."""

    @staticmethod
    def pod_labels(spec: Any, role: str) -> dict[str, str]:
        return build_role_deployment(spec, role, GROUP_OWNER, pool_view())["spec"]["template"]["metadata"]["labels"]

    def test_llm_d_role(self) -> None:
        for role in ("prefill", "decode"):
            assert self.pod_labels(group_spec(), role)["llm-d.ai/role"] == role

    def test_kv_revision_is_shared_by_both_roles_and_follows_what_keys_derive_from(self) -> None:
        base = self.pod_labels(group_spec(), "prefill")["maru.io/kv-revision"]
        assert self.pod_labels(group_spec(), "decode")["maru.io/kv-revision"] == base
        # Replicas, resources and the like leave the keys as they are.
        assert (
            self.pod_labels(group_spec(prefill={"replicas": 3, "extraArgs": ["--max-num-seqs=8"]}), "prefill")[
                "maru.io/kv-revision"
            ]
            == base
        )
        for changed in (
            group_spec(connector={"chunkTokens": 512}),
            group_spec(model={"name": "org/other"}),
            group_spec(model={"name": "Qwen/Qwen2.5-7B-Instruct", "revision": "abc"}),
        ):
            assert self.pod_labels(changed, "decode")["maru.io/kv-revision"] != base
