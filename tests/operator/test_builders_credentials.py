"""The pool's key Secret and the groups' credential volumes: shape, ownership, minted tokens, mounts."""

from __future__ import annotations

import base64
import os

import pytest

from maru_contracts import tenancy
from maru_contracts.config import MaruConnectorConfig
from maru_operator.builders.children import build_group_children
from maru_operator.builders.common import LABEL_MANAGED_BY, MANAGED_BY, Owner
from maru_operator.builders.credentials import (
    build_pool_key_secret,
    pool_key,
    pool_key_name,
)
from maru_operator.builders.group import PoolView, build_role_deployment, cache_scope
from maru_operator.validation import check_group
from tests.support.specs import (
    GROUP_OWNER,
    KEY,
    NS,
    POOL_OWNER,
    assert_valid,
    container,
    group_spec,
    kv_config,
    minted_token,
    pool_spec,
)


def bound_pool(**fields: object) -> PoolView:
    return PoolView(name="pool", spec=pool_spec(**fields))


class TestPoolKeySecret:
    def test_owned_by_the_pool_next_to_its_daemons(self) -> None:
        secret = build_pool_key_secret(POOL_OWNER, NS, KEY)
        assert_valid(secret)
        assert secret["metadata"]["name"] == pool_key_name("pool") == "pool-key"
        assert secret["metadata"]["namespace"] == NS
        assert secret["type"] == "Opaque"
        (ref,) = secret["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["uid"], ref["controller"]) == ("MaruPool", "uid-pool", True)
        assert secret["metadata"]["labels"][LABEL_MANAGED_BY] == MANAGED_BY
        assert pool_key(secret) == KEY

    def test_rendered_offline_without_data(self) -> None:
        secret = build_pool_key_secret(Owner(kind="MaruPool", name="pool"), NS, None)
        assert "data" not in secret and "ownerReferences" not in secret["metadata"]
        assert pool_key(secret) is None

    @pytest.mark.parametrize("data", [None, {}, {"key": "not base64!"}, {"key": base64.b64encode(b"short").decode()}])
    def test_a_key_no_daemon_would_take_is_no_key(self, data: dict | None) -> None:
        assert pool_key({"data": data} if data is not None else {}) is None


class TestGroupCredential:
    def test_no_secret_among_a_groups_children(self) -> None:
        """The node plugin mints the group's credential: the operator writes no Secret in the group's namespace."""
        for pool in (bound_pool(), None):
            assert "Secret" not in [c["kind"] for c in build_group_children(group_spec(), GROUP_OWNER, pool)]

    def test_the_minted_token_names_the_scope_under_the_pool_key(self) -> None:
        token = minted_token(group_spec(), GROUP_OWNER, bound_pool())
        assert tenancy.verify(KEY, token) == tenancy.tenant("llm/llama")
        with pytest.raises(tenancy.BadToken):
            tenancy.verify(os.urandom(32), token)  # another pool's key refuses it

    def test_a_long_scope_is_hashed_the_same_by_operator_and_plugin(self) -> None:
        owner = Owner(kind="InferenceGroup", name="g", namespace="n" * 63, uid="u")
        spec = group_spec(connector={"cacheNamespace": "c" * 253})
        scope = cache_scope(spec, owner)
        assert len(scope) == 253
        assert tenancy.verify(KEY, minted_token(spec, owner, bound_pool())).scope == scope


class TestScope:
    def test_default_scope_is_namespace_and_name(self) -> None:
        assert cache_scope(group_spec(), GROUP_OWNER) == "llm/llama"

    def test_two_groups_of_one_namespace_share_by_naming_the_same_cache(self) -> None:
        other = Owner(kind="InferenceGroup", name="llama-canary", namespace="llm", uid="u2")
        spec = group_spec(connector={"cacheNamespace": "shared"})
        assert cache_scope(spec, GROUP_OWNER) == cache_scope(spec, other) == "llm/shared"

    def test_a_group_cannot_reach_another_namespace_scope(self) -> None:
        """Namespace A naming B's cache gets A/B/..., a scope of A, with a token of A's: B's chunks stay B's."""
        b_owner = Owner(kind="InferenceGroup", name="qwen-7b", namespace="b", uid="ub")
        a_owner = Owner(kind="InferenceGroup", name="prober", namespace="a", uid="ua")
        b_scope = cache_scope(group_spec(), b_owner)
        probe = group_spec(connector={"cacheNamespace": "b/qwen-7b"})
        assert check_group(probe) == []  # allowed, and harmless
        a_scope = cache_scope(probe, a_owner)
        assert (b_scope, a_scope) == ("b/qwen-7b", "a/b/qwen-7b")
        a_token = minted_token(probe, a_owner, bound_pool())
        assert tenancy.verify(KEY, a_token).scope == a_scope
        assert tenancy.KeyScope(a_scope)(b"k" * 32) != tenancy.KeyScope(b_scope)(b"k" * 32)
        # The connector's salt follows the scope too, so not even the client-side keys coincide.
        extra = kv_config(build_role_deployment(probe, "decode", a_owner, bound_pool()))["kv_connector_extra_config"]
        assert extra["maru_cache_namespace"] == "a/b/qwen-7b"


class TestMountedCredential:
    def test_vllm_pods_mount_it_and_the_connector_reads_it(self) -> None:
        spec = group_spec(poolQuota={"bytes": "1Gi", "pins": 8})
        for role in ("prefill", "decode"):
            dep = build_role_deployment(spec, role, GROUP_OWNER, bound_pool())
            pod = dep["spec"]["template"]["spec"]
            volumes = {v["name"]: v for v in pod["volumes"]}
            assert volumes["maru-credential"] == {
                "name": "maru-credential",
                "csi": {
                    "driver": "csi.maru.io",
                    "readOnly": True,
                    # The group's request as it wrote it: the plugin caps it by the pool's maxTenantQuota.
                    "volumeAttributes": {
                        "pool": "pool",
                        "socketDir": "/run/maru",
                        "cache": "llama",
                        "quota": f"bytes={1 << 30},pins=8",
                    },
                },
            }
            assert {
                "name": "maru-credential",
                "mountPath": "/var/run/secrets/maru.io/pool",
                "readOnly": True,
            } in container(dep)["volumeMounts"]
            cfg = MaruConnectorConfig.from_extra_config(kv_config(dep)["kv_connector_extra_config"])
            assert cfg.pool_token_file == "/var/run/secrets/maru.io/pool/token"
            assert_valid(dep)

    def test_a_changed_pool_policy_does_not_roll_the_groups_pods(self) -> None:
        """The pods carry the group's request, not the capped quota: the pool's policy reaches the nodes."""
        before = build_role_deployment(group_spec(), "decode", GROUP_OWNER, bound_pool())
        after = build_role_deployment(
            group_spec(), "decode", GROUP_OWNER, bound_pool(maxTenantQuota={"pins": 4}, tenantQuota={"leases": 2})
        )
        assert before["spec"]["template"] == after["spec"]["template"]

    def test_a_user_volume_cannot_take_its_name_or_path(self) -> None:
        with pytest.raises(ValueError, match="maru-credential"):
            group_spec(decode={"volumes": [{"name": "maru-credential", "emptyDir": {}}]})
        spec = group_spec(
            decode={
                "volumes": [{"name": "s", "emptyDir": {}}],
                "volumeMounts": [{"name": "s", "mountPath": "/var/run/secrets"}],
            }
        )
        (error,) = check_group(spec)
        assert error.field == "spec.decode.volumeMounts" and "pool credential" in str(error)

    def test_a_cache_name_the_plugin_would_refuse_is_refused_here(self) -> None:
        """The node plugin mints the token for the cache name; one it refuses would fail every pod's start."""
        (error,) = check_group(group_spec(connector={"cacheNamespace": "team\nb"}))
        assert error.field == "spec.connector.cacheNamespace" and "printable" in str(error)
        assert check_group(group_spec(connector={"cacheNamespace": "b/qwen-7b"})) == []


class TestOneRuleForOperatorAndPlugin:
    def test_effective_quota_field_by_field(self) -> None:
        q = tenancy.Quota
        assert tenancy.effective_quota(q(bytes=5, pins=9), q(pins=2, leases=3), q(bytes=4, pins=20)) == q(
            bytes=4, pins=9, leases=3
        )
        # Without a ceiling a request is held to the pool's default, then the daemon's: never raised by the tenant.
        assert tenancy.effective_quota(q(pins=9, leases=5), q(pins=2)) == q(pins=2, leases=5)
        assert tenancy.effective_quota(q(pins=500000, leases=500000)) == q(pins=65536, leases=16384)
        assert tenancy.effective_quota(q(), q(), q(leases=8)) == q(leases=8)  # the ceiling is also the default
        assert tenancy.effective_quota(q()) == tenancy.DEFAULT_QUOTA

    def test_tenant_scope_is_the_operators_cache_scope(self) -> None:
        assert tenancy.tenant_scope("llm", "b/x") == "llm/b/x"
        long = tenancy.tenant_scope("n" * 63, "c" * 253)
        assert len(long) == tenancy.MAX_SCOPE and long != tenancy.tenant_scope("n" * 63, "c" * 252 + "d")
        with pytest.raises(ValueError):
            tenancy.tenant_scope("", "x")
