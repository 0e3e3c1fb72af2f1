"""One class per pool builder: the pool daemons' exact shape, flags and security."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from maru_contracts.poolsize import HEADER_SIZE, parse_size
from maru_localcluster.admission import qos_class
from maru_operator.builders.common import LABEL_MANAGED_BY, MANAGED_BY
from maru_operator.builders.pool import (
    build_agent_daemonset,
    build_metadata_deployment,
    build_metadata_service,
    build_pool_children,
    daemon_memory,
    pool_endpoint,
    shm_volume_bytes,
)
from maru_operator.builders.resources import POOL_DAEMON
from maru_operator.quantity import parse_quantity
from tests.support.specs import POOL_OWNER, assert_valid, container, dax_spec, flag, pool_spec

NS = "maru-system"


class TestMetadataDeployment:
    def test_only_for_dax(self) -> None:
        assert build_metadata_deployment(pool_spec(), POOL_OWNER, NS) is None

    def test_runs_metadata_server_with_contract_flags(self) -> None:
        dep = build_metadata_deployment(dax_spec(size="64Gi"), POOL_OWNER, NS)
        assert dep is not None
        assert_valid(dep)
        c = container(dep)
        assert c["command"] == ["maru-pool"]
        args = c["args"]
        assert args[0] == "metadata"
        assert flag(args, "--listen") == "tcp://0.0.0.0:7400"
        assert flag(args, "--metrics-addr") == "0.0.0.0:9400"
        assert flag(args, "--lease-seconds") == "30"
        assert flag(args, "--eviction") == "lru"
        assert flag(args, "--size") == "64Gi"
        assert flag(args, "--auth-key-file") == "/etc/maru/pool-key/key"

    def test_never_two_at_once(self) -> None:
        dep = build_metadata_deployment(dax_spec(), POOL_OWNER, NS)
        assert dep is not None
        assert dep["spec"]["replicas"] == 1
        assert dep["spec"]["strategy"] == {"type": "Recreate"}

    def test_unprivileged(self) -> None:
        dep = build_metadata_deployment(dax_spec(), POOL_OWNER, NS)
        assert dep is not None
        pod = dep["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        sc = container(dep)["securityContext"]
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["allowPrivilegeEscalation"] is False
        # Nothing from the host: only the pool key, readable by its non-root user (no fsGroup).
        assert pod["volumes"] == [
            {
                "name": "pool-key",
                "secret": {"secretName": "pool-key", "defaultMode": 0o444, "items": [{"key": "key", "path": "key"}]},
            }
        ]
        assert container(dep)["volumeMounts"] == [
            {"name": "pool-key", "mountPath": "/etc/maru/pool-key", "readOnly": True}
        ]

    def test_owned_and_labelled(self) -> None:
        dep = build_metadata_deployment(dax_spec(), POOL_OWNER, NS)
        assert dep is not None
        meta = dep["metadata"]
        assert meta["name"] == "pool-metadata" and meta["namespace"] == NS
        assert meta["ownerReferences"][0]["uid"] == "uid-pool"
        assert meta["ownerReferences"][0]["kind"] == "MaruPool"
        assert meta["labels"][LABEL_MANAGED_BY] == MANAGED_BY
        assert dep["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()


class TestMetadataService:
    def test_only_for_dax(self) -> None:
        assert build_metadata_service(pool_spec(), POOL_OWNER, NS) is None

    def test_exposes_rpc_and_metrics(self) -> None:
        svc = build_metadata_service(dax_spec(daemon={"metadataPort": 7500}), POOL_OWNER, NS)
        assert svc is not None
        assert_valid(svc)
        assert svc["metadata"]["name"] == "pool-metadata"
        assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"rpc": 7500, "metrics": 9400}
        dep = build_metadata_deployment(dax_spec(), POOL_OWNER, NS)
        assert dep is not None
        assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()


class TestAgentDaemonSet:
    def test_dax_agent_flags(self) -> None:
        ds = build_agent_daemonset(dax_spec(), POOL_OWNER, NS)
        assert_valid(ds)
        args = container(ds)["args"]
        assert args[0] == "agent"
        assert flag(args, "--listen") == "unix:///run/maru/pool/pool.sock"
        assert flag(args, "--metadata") == "tcp://pool-metadata.maru-system.svc:7400"
        assert [args[i + 1] for i, a in enumerate(args) if a == "--device"] == ["/dev/dax0.0", "/dev/dax1.0"]
        assert flag(args, "--auth-key-file") == "/etc/maru/pool-key/key"

    def test_dax_devices_are_char_device_hostpaths(self) -> None:
        ds = build_agent_daemonset(dax_spec(), POOL_OWNER, NS)
        volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
        assert volumes["dax-0"]["hostPath"] == {"path": "/dev/dax0.0", "type": "CharDevice"}
        mounts = {m["mountPath"] for m in container(ds)["volumeMounts"]}
        assert {"/dev/dax0.0", "/dev/dax1.0", "/run/maru/pool"} <= mounts

    def test_dax_is_the_only_privileged_pod(self) -> None:
        assert container(build_agent_daemonset(dax_spec(), POOL_OWNER, NS))["securityContext"]["privileged"] is True
        shm = container(build_agent_daemonset(pool_spec(), POOL_OWNER, NS))["securityContext"]
        assert "privileged" not in shm
        assert shm["capabilities"] == {"drop": ["ALL"]}
        assert shm["allowPrivilegeEscalation"] is False
        assert shm["readOnlyRootFilesystem"] is True

    def test_shm_serves_each_node_alone(self) -> None:
        ds = build_agent_daemonset(
            pool_spec(size="2Gi", eviction={"policy": "None", "leaseSeconds": 5}), POOL_OWNER, NS
        )
        assert_valid(ds)
        args = container(ds)["args"]
        assert args[0] == "serve"
        assert "--metadata" not in args
        assert flag(args, "--size") == "2Gi"
        assert flag(args, "--eviction") == "none"
        assert flag(args, "--lease-seconds") == "5"
        assert flag(args, "--metrics-addr") == "0.0.0.0:9400"
        assert flag(args, "--auth-key-file") == "/etc/maru/pool-key/key"

    def test_the_daemons_ceiling_follows_the_pools_quota_policy(self) -> None:
        """The daemons hold every tenant to --max-tenant-pins/--max-tenant-leases whatever its token says; a pool
        whose policy grants more raises them, so its own tokens are never held below what they carry."""
        for spec in (pool_spec(), pool_spec(tenantQuota={"pins": 100}), dax_spec(maxTenantQuota={"leases": 8})):
            for obj in (build_agent_daemonset(spec, POOL_OWNER, NS), build_metadata_deployment(spec, POOL_OWNER, NS)):
                if obj is not None:
                    assert not {"--max-tenant-pins", "--max-tenant-leases"} & set(container(obj)["args"])
        raised = {"tenantQuota": {"pins": 100_000}, "maxTenantQuota": {"pins": 200_000, "leases": 20_000}}
        args = container(build_agent_daemonset(pool_spec(**raised), POOL_OWNER, NS))["args"]
        assert (flag(args, "--max-tenant-pins"), flag(args, "--max-tenant-leases")) == ("200000", "20000")
        dep = build_metadata_deployment(dax_spec(tenantQuota={"leases": 30_000}), POOL_OWNER, NS)
        assert dep is not None and flag(container(dep)["args"], "--max-tenant-leases") == "30000"
        assert "--max-tenant-pins" not in container(dep)["args"]

    def test_the_agents_read_the_pool_key_as_root_only(self) -> None:
        for spec in (pool_spec(), dax_spec()):
            ds = build_agent_daemonset(spec, POOL_OWNER, NS)
            volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
            assert volumes["pool-key"]["secret"]["secretName"] == "pool-key"
            assert volumes["pool-key"]["secret"]["defaultMode"] == 0o400
            assert {"name": "pool-key", "mountPath": "/etc/maru/pool-key", "readOnly": True} in container(ds)[
                "volumeMounts"
            ]

    def test_shm_volume_holds_the_whole_pool_file(self) -> None:
        # A kubelet mounts this emptyDir as a tmpfs of exactly sizeLimit; the daemon reserves header + size
        # in it. Sized to the pool alone (what this test asserted before), every shm agent crash-looped.
        for size in ("2Gi", "256Mi", "1000000", "3G"):
            ds = build_agent_daemonset(pool_spec(size=size), POOL_OWNER, NS)
            shm = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}["shm"]["emptyDir"]
            assert shm["medium"] == "Memory"
            limit = int(parse_quantity(shm["sizeLimit"]))
            assert limit >= HEADER_SIZE + parse_size(size), size
            assert limit % 4096 == 0 and limit - (HEADER_SIZE + parse_size(size)) < 4096, size
        assert shm_volume_bytes(pool_spec(size="2Gi")) == 2 * 2**30 + 4096

    def test_agent_requests_the_memory_it_holds(self) -> None:
        # Without a request the agent is BestEffort: evicted first under memory pressure, cache and all.
        resources = container(build_agent_daemonset(pool_spec(size="2Gi"), POOL_OWNER, NS))["resources"]
        pool_file = 2 * 2**30 + 4096
        assert parse_quantity(resources["requests"]["memory"]) == pool_file + POOL_DAEMON.request
        assert parse_quantity(resources["limits"]["memory"]) == pool_file + POOL_DAEMON.limit
        assert parse_quantity(resources["requests"]["memory"]) >= daemon_memory(pool_spec(size="2Gi"), agent=True)
        dax = container(build_agent_daemonset(dax_spec(size="64Gi"), POOL_OWNER, NS))["resources"]
        assert parse_quantity(dax["requests"]["memory"]) == POOL_DAEMON.request  # device memory is not the pod's

    def test_limits_make_the_agent_guaranteed(self) -> None:
        spec = pool_spec(size="1Gi", daemon={"resources": {"limits": {"cpu": "1"}}})
        ds = build_agent_daemonset(spec, POOL_OWNER, NS)
        assert_valid(ds)
        resources = container(ds)["resources"]
        assert resources["requests"] == resources["limits"]
        assert parse_quantity(resources["limits"]["memory"]) == 2**30 + 4096 + POOL_DAEMON.limit
        assert qos_class(ds["spec"]["template"]["spec"]) == "Guaranteed"
        user = pool_spec(size="1Gi", daemon={"resources": {"requests": {"cpu": "250m", "memory": "4Gi"}}})
        assert container(build_agent_daemonset(user, POOL_OWNER, NS))["resources"] == {
            "requests": {"cpu": "250m", "memory": "4Gi"},
            "limits": {"memory": "4Gi"},
        }
        assert qos_class(build_agent_daemonset(pool_spec(), POOL_OWNER, NS)["spec"]["template"]["spec"]) == "Burstable"

    def test_any_limit_makes_the_daemons_guaranteed(self) -> None:
        # A memory limit alone left the default CPU request without a CPU limit: Burstable, evicted
        # before Guaranteed pods under memory pressure, with the node's cache. Each missing limit now
        # takes its request, so any limit the user sets is a Guaranteed agent and metadata server.
        for resources in (
            {"limits": {"memory": "2Gi"}},
            {"limits": {"cpu": "1"}},
            {"requests": {"cpu": "300m"}, "limits": {"memory": "2Gi"}},
            {"requests": {"memory": "2Gi"}, "limits": {"cpu": "500m"}},
        ):
            for spec in (
                pool_spec(size="1Gi", daemon={"resources": resources}),
                dax_spec(size="1Gi", daemon={"resources": resources}),
            ):
                agent = build_agent_daemonset(spec, POOL_OWNER, NS)
                metadata = build_metadata_deployment(spec, POOL_OWNER, NS)
                for workload in (agent, *([metadata] if metadata else [])):
                    assert_valid(workload)
                    got = container(workload)["resources"]
                    assert got["requests"] == got["limits"], (resources, got)
                    assert qos_class(workload["spec"]["template"]["spec"]) == "Guaranteed", (resources, got)
        # What the user set is kept: their limits, and a CPU request where they gave no CPU limit.
        got = container(
            build_agent_daemonset(
                pool_spec(size="1Gi", daemon={"resources": {"requests": {"cpu": "300m"}, "limits": {"memory": "2Gi"}}}),
                POOL_OWNER,
                NS,
            )
        )["resources"]
        assert got["limits"] == {"cpu": "300m", "memory": "2Gi"}
        # The shm agent's memory limit is never below what it holds, even when only a CPU limit is set.
        got = container(
            build_agent_daemonset(
                pool_spec(size="1Gi", daemon={"resources": {"limits": {"cpu": "500m"}}}), POOL_OWNER, NS
            )
        )["resources"]
        assert parse_quantity(got["limits"]["memory"]) >= daemon_memory(pool_spec(size="1Gi"), agent=True)

    def test_priority_class(self) -> None:
        for ds in (
            build_agent_daemonset(pool_spec(), POOL_OWNER, NS),
            build_metadata_deployment(dax_spec(), POOL_OWNER, NS),
        ):
            assert ds is not None
            assert ds["spec"]["template"]["spec"]["priorityClassName"] == "system-node-critical"
        custom = build_agent_daemonset(pool_spec(daemon={"priorityClassName": "maru-pool"}), POOL_OWNER, NS)
        assert custom["spec"]["template"]["spec"]["priorityClassName"] == "maru-pool"
        none = build_agent_daemonset(pool_spec(daemon={"priorityClassName": ""}), POOL_OWNER, NS)
        assert "priorityClassName" not in none["spec"]["template"]["spec"]

    def test_runs_on_selected_nodes_with_tolerations(self) -> None:
        spec = pool_spec(tolerations=[{"key": "cxl", "operator": "Exists", "effect": "NoSchedule"}])
        pod = build_agent_daemonset(spec, POOL_OWNER, NS)["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"maru.io/pool": "yes"}
        assert pod["tolerations"] == [{"key": "cxl", "operator": "Exists", "effect": "NoSchedule"}]
        assert pod["automountServiceAccountToken"] is False

    def test_socket_dir_per_pool(self) -> None:
        spec = pool_spec(daemon={"socketDir": "/var/run/maru/"})
        ds = build_agent_daemonset(spec, POOL_OWNER, NS)
        volume = ds["spec"]["template"]["spec"]["volumes"][0]
        assert volume["hostPath"] == {"path": "/var/run/maru/pool", "type": "DirectoryOrCreate"}
        assert pool_endpoint(spec, "pool") == "unix:///var/run/maru/pool/pool.sock"


class TestPoolChildren:
    def test_dax_has_four_shm_two(self) -> None:
        assert [c["kind"] for c in build_pool_children(dax_spec(), POOL_OWNER, NS)] == [
            "Secret",
            "Service",
            "Deployment",
            "DaemonSet",
        ]
        assert [c["kind"] for c in build_pool_children(pool_spec(), POOL_OWNER, NS)] == ["Secret", "DaemonSet"]

    def test_pure(self) -> None:
        assert build_pool_children(dax_spec(), POOL_OWNER, NS) == build_pool_children(dax_spec(), POOL_OWNER, NS)


class TestPrivateRegistry:
    """Pool daemons pull from a private registry with the Secrets the pool names (in the operator's namespace)."""

    def test_both_daemons_get_the_pull_secrets(self) -> None:
        spec = dax_spec(daemon={"imagePullSecrets": [{"name": "mirror-credentials"}]})
        metadata = build_metadata_deployment(spec, POOL_OWNER, "maru-system")
        assert metadata is not None
        agent = build_agent_daemonset(spec, POOL_OWNER, "maru-system")
        for workload in (metadata, agent):
            assert workload["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "mirror-credentials"}]
            assert_valid(workload)

    def test_none_by_default(self) -> None:
        agent = build_agent_daemonset(pool_spec(), POOL_OWNER, "maru-system")
        assert "imagePullSecrets" not in agent["spec"]["template"]["spec"]

    def test_a_secret_named_twice_is_refused_naming_the_field(self) -> None:
        with pytest.raises(ValidationError, match="imagePullSecrets"):
            pool_spec(daemon={"imagePullSecrets": [{"name": "a"}, {"name": "a"}]})


class TestCredentialsInitContainer:
    """The agent's init container brings the pool's key and quota policy to each node, for the CSI node plugin."""

    @staticmethod
    def init(ds: dict) -> dict:
        (found,) = [c for c in ds["spec"]["template"]["spec"]["initContainers"] if c["name"] == "credentials"]
        return found

    def test_writes_the_minting_file_under_the_socket_root_from_the_key_secret(self) -> None:
        import json

        from maru_operator.builders.pool import build_agent_daemonset

        spec = pool_spec(tenantQuota={"pins": 64}, maxTenantQuota={"bytes": "1Gi"})
        ds = build_agent_daemonset(spec, POOL_OWNER, NS, b"k" * 32)
        assert_valid(ds)
        init = self.init(ds)
        args = dict(zip(init["args"][::2], init["args"][1::2], strict=True))
        assert init["command"] == ["python", "-m", "maru_csi.minting"]
        assert args["--socket-root"] == "/run/maru" and args["--pool"] == "pool"
        assert args["--key-file"] == "/etc/maru/pool-key/key"
        assert json.loads(args["--policy"]) == {"tenantQuota": "pins=64", "maxTenantQuota": f"bytes={1 << 30}"}
        volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
        assert volumes["credentials"]["hostPath"] == {"path": "/run/maru/_credentials", "type": "DirectoryOrCreate"}
        assert {m["name"]: m["mountPath"] for m in init["volumeMounts"]} == {
            "credentials": "/run/maru/_credentials",
            "pool-key": "/etc/maru/pool-key",
        }
        assert init["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert "k" * 32 not in str(ds), "the key travels in the Secret volume, never in the pod spec"

    def test_a_new_key_rolls_the_agents_so_each_node_rewrites_its_file(self) -> None:
        from maru_operator.builders.pool import KEY_DIGEST_ANNOTATION, build_agent_daemonset

        def template(key: bytes | None) -> dict:
            return build_agent_daemonset(pool_spec(), POOL_OWNER, NS, key)["spec"]["template"]

        assert template(b"a" * 32) == template(b"a" * 32)
        assert template(b"a" * 32) != template(b"b" * 32)
        assert KEY_DIGEST_ANNOTATION not in template(None)["metadata"].get("annotations", {})
