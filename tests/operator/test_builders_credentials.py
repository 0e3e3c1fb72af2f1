"""The pool's key Secret and the groups' credential Secrets: shape, ownership, tokens, mounts."""

from __future__ import annotations

import base64
import os

import pytest

from maru_connector import tenancy
from maru_connector.config import MaruConnectorConfig
from maru_operator.builders.common import LABEL_MANAGED_BY, LABEL_POOL, MANAGED_BY, Owner
from maru_operator.builders.credentials import (
    build_group_credential,
    build_pool_key_secret,
    credential_name,
    pool_key,
    pool_key_name,
)
from maru_operator.builders.group import PoolView, build_group_children, build_role_deployment, cache_scope
from maru_operator.validation import check_group
from tests.operator.helpers import GROUP_OWNER, POOL_OWNER, assert_valid, container, group_spec, pool_spec
from tests.operator.test_builders_group import kv_config

KEY = os.urandom(32)
NS = "maru-system"


def bound_pool(key: bytes | None = KEY) -> PoolView:
    return PoolView(name="pool", spec=pool_spec(), key=key)


def token_of(secret: dict) -> str:
    return base64.b64decode(secret["data"]["token"]).decode()


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
    def test_owned_by_the_group_in_its_namespace(self) -> None:
        secret = build_group_credential(GROUP_OWNER, "pool", "llm/llama", KEY)
        assert_valid(secret)
        assert secret["metadata"]["name"] == credential_name("llama") == "llama-pool-credential"
        assert secret["metadata"]["namespace"] == "llm"
        (ref,) = secret["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("InferenceGroup", "llama", "uid-group",
                                                                          True)
        assert secret["metadata"]["labels"][LABEL_POOL] == "pool"

    def test_the_token_names_the_scope_under_the_pool_key(self) -> None:
        token = token_of(build_group_credential(GROUP_OWNER, "pool", "llm/llama", KEY))
        assert tenancy.verify(KEY, token) == tenancy.tenant("llm/llama")
        with pytest.raises(tenancy.BadToken):
            tenancy.verify(os.urandom(32), token)  # another pool's key refuses it
        assert KEY not in base64.b64decode(build_group_credential(GROUP_OWNER, "pool", "llm/llama", KEY)[
            "data"]["token"])  # the pool's key itself never leaves the release namespace

    def test_a_group_children_start_with_its_credential(self) -> None:
        children = build_group_children(group_spec(), GROUP_OWNER, bound_pool())
        assert children[0]["kind"] == "Secret"
        assert tenancy.verify(KEY, token_of(children[0])).scope == "llm/llama"
        assert "Secret" not in [c["kind"] for c in build_group_children(group_spec(), GROUP_OWNER, None)]

    def test_the_key_is_not_in_the_pool_views_repr(self) -> None:
        assert KEY.hex() not in repr(bound_pool()) and repr(KEY) not in repr(bound_pool())


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
        a_token = token_of(build_group_children(probe, a_owner, bound_pool())[0])
        assert tenancy.verify(KEY, a_token).scope == a_scope
        assert tenancy.KeyScope(a_scope)(b"k" * 32) != tenancy.KeyScope(b_scope)(b"k" * 32)
        # The connector's salt follows the scope too, so not even the client-side keys coincide.
        extra = kv_config(build_role_deployment(probe, "decode", a_owner, bound_pool()))["kv_connector_extra_config"]
        assert extra["maru_cache_namespace"] == "a/b/qwen-7b"


class TestMountedCredential:
    def test_vllm_pods_mount_it_and_the_connector_reads_it(self) -> None:
        for role in ("prefill", "decode"):
            dep = build_role_deployment(group_spec(), role, GROUP_OWNER, bound_pool())
            pod = dep["spec"]["template"]["spec"]
            volumes = {v["name"]: v for v in pod["volumes"]}
            assert volumes["maru-credential"]["secret"] == {"secretName": "llama-pool-credential", "defaultMode": 0o444,
                                                            "items": [{"key": "token", "path": "token"}]}
            assert {"name": "maru-credential", "mountPath": "/var/run/secrets/maru.io/pool", "readOnly": True} in \
                container(dep)["volumeMounts"]
            cfg = MaruConnectorConfig.from_extra_config(kv_config(dep)["kv_connector_extra_config"])
            assert cfg.pool_token_file == "/var/run/secrets/maru.io/pool/token"
            # The token is in no argument and no environment variable of the pod.
            token = token_of(build_group_credential(GROUP_OWNER, "pool", "llm/llama", KEY))
            assert token not in str(dep)

    def test_a_user_volume_cannot_take_its_name_or_path(self) -> None:
        with pytest.raises(ValueError, match="maru-credential"):
            group_spec(decode={"volumes": [{"name": "maru-credential", "emptyDir": {}}]})
        spec = group_spec(decode={"volumes": [{"name": "s", "emptyDir": {}}],
                                  "volumeMounts": [{"name": "s", "mountPath": "/var/run/secrets"}]})
        (error,) = check_group(spec)
        assert error.field == "spec.decode.volumeMounts" and "pool credential" in str(error)
