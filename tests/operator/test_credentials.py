"""The operator issues pool keys and group credentials: created, owned, mounted, kept, re-issued, collected.

The operator for real (in-process kopf) against the API emulator, with its garbage collector.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from maru_connector import tenancy
from maru_connector.config import MaruConnectorConfig
from maru_localcluster.server import KubeEmulator
from tests.operator.conftest import (
    GROUP_NS,
    POOL_NS,
    RunningOperator,
    create_namespace,
    group,
    has_condition,
    settle,
)

pytestmark = pytest.mark.emulator

IG = "inferencegroups.maru.io"
MP = "marupools.maru.io"
DEPLOY = "deployments.apps"
DS = "daemonsets.apps"


def key_of(kube: KubeEmulator) -> bytes:
    secret = kube.wait_for("secrets", "local-shm-key", POOL_NS, lambda s: bool(s.get("data")))
    return base64.b64decode(secret["data"]["key"])


def token_in(kube: KubeEmulator, group_name: str, namespace: str, key: bytes | None = None) -> tenancy.Principal:
    """The principal the group's credential names, once it verifies under the pool key (the current one, or ``key``)."""
    key = key or key_of(kube)

    def signed(s: dict[str, Any]) -> bool:  # runs on the emulator's loop: no API calls in here
        try:
            tenancy.verify(key, base64.b64decode(s["data"]["token"]).decode())
        except (KeyError, tenancy.BadToken):
            return False
        return True

    secret = kube.wait_for("secrets", f"{group_name}-pool-credential", namespace, signed)
    return tenancy.verify(key, base64.b64decode(secret["data"]["token"]).decode())


def owner_of(obj: dict[str, Any]) -> tuple[str, str, str]:
    (ref,) = obj["metadata"]["ownerReferences"]
    assert ref["controller"] is True and ref["blockOwnerDeletion"] is True
    return ref["kind"], ref["name"], ref["uid"]


def test_the_pool_key_is_made_once_owned_by_the_pool_and_mounted_by_its_daemons(
    cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]
) -> None:
    secret = cluster.get("secrets", "local-shm-key", POOL_NS)
    assert secret is not None and owner_of(secret) == ("MaruPool", "local-shm", ready_pool["metadata"]["uid"])
    assert len(key_of(cluster)) == tenancy.KEY_BYTES
    ds = cluster.get(DS, "local-shm-agent", POOL_NS)
    assert ds is not None
    volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    assert volumes["pool-key"]["secret"]["secretName"] == "local-shm-key"
    # Reconciling again (a resync, a restart) keeps the key: nothing would verify the groups' tokens otherwise.
    before = key_of(cluster)
    cluster.patch(MP, "local-shm", {"metadata": {"labels": {"poke": "1"}}})
    settle(operator)
    assert key_of(cluster) == before


def test_a_group_gets_its_credential_mounted_and_named_in_the_connector_config(
    cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]
) -> None:
    body = cluster.create(group())
    assert token_in(cluster, "qwen", GROUP_NS) == tenancy.tenant(f"{GROUP_NS}/qwen")
    secret = cluster.get("secrets", "qwen-pool-credential", GROUP_NS)
    assert secret is not None and owner_of(secret) == ("InferenceGroup", "qwen", body["metadata"]["uid"])
    for role in ("prefill", "decode"):
        dep = cluster.wait_for(DEPLOY, f"qwen-{role}", GROUP_NS)
        pod = dep["spec"]["template"]["spec"]
        assert {v["name"]: v for v in pod["volumes"]}["maru-credential"]["secret"]["secretName"] == \
            "qwen-pool-credential"
        args = pod["containers"][0]["args"]
        extra = json.loads(args[args.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
        cfg = MaruConnectorConfig.from_extra_config(extra)
        mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "maru-credential")
        assert cfg.pool_token_file == f"{mount['mountPath']}/token"


def test_a_hand_deleted_credential_comes_back_and_the_group_takes_it_with_it(
    cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]
) -> None:
    cluster.create(group())
    first = token_in(cluster, "qwen", GROUP_NS)
    cluster.delete("secrets", "qwen-pool-credential", GROUP_NS)
    assert token_in(cluster, "qwen", GROUP_NS) == first  # drift corrected: the same (derived) token
    cluster.delete(IG, "qwen", GROUP_NS)
    cluster.wait_gone("secrets", "qwen-pool-credential", GROUP_NS)  # ownerReference: the garbage collector


def test_a_new_pool_key_reissues_every_credential(
    cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]
) -> None:
    cluster.create(group())
    old_key = key_of(cluster)
    token_in(cluster, "qwen", GROUP_NS, old_key)
    cluster.delete("secrets", "local-shm-key", POOL_NS)  # a rotation: the operator makes a new key
    fresh = cluster.wait_until(
        lambda e: (s := e.get_object("", "secrets", POOL_NS, "local-shm-key")) and s.get("data")
        and base64.b64decode(s["data"]["key"]) != old_key and s, message="a new pool key")
    new_key = base64.b64decode(fresh["data"]["key"])
    assert token_in(cluster, "qwen", GROUP_NS, new_key) == tenancy.tenant(f"{GROUP_NS}/qwen")


def test_another_namespace_cache_name_stays_in_the_group_namespace(
    cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]
) -> None:
    """A group in namespace "prober" that names llm's cache gets a credential for prober's scope only."""
    create_namespace(cluster, "prober")
    cluster.create(group())
    cluster.create(group(name="spy", namespace="prober", connector={"cacheNamespace": f"{GROUP_NS}/qwen"}))
    theirs = token_in(cluster, "qwen", GROUP_NS)
    spy = token_in(cluster, "spy", "prober")
    assert theirs.scope == f"{GROUP_NS}/qwen" and spy.scope == f"prober/{GROUP_NS}/qwen"
    # Two groups of one namespace that name the same cache share it, by design.
    cluster.create(group(name="qwen-canary", connector={"cacheNamespace": "qwen"}))
    assert token_in(cluster, "qwen-canary", GROUP_NS) == theirs


def test_a_credential_the_operator_does_not_control_is_never_taken_over(
    cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]
) -> None:
    mine = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "qwen-pool-credential", "namespace": GROUP_NS},
            "data": {"token": base64.b64encode(b"mine").decode()}}
    cluster.create(mine)
    cluster.create(group())
    ig = cluster.wait_for(IG, "qwen", GROUP_NS, lambda o: has_condition(o, "Ready", "False", "ChildConflict"))
    assert "Secret llm/qwen-pool-credential" in str(ig["status"]["conditions"])
    secret = cluster.get("secrets", "qwen-pool-credential", GROUP_NS)
    assert secret is not None and secret["data"] == mine["data"] and "ownerReferences" not in secret["metadata"]
