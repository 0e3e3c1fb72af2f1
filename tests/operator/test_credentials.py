"""The operator makes pool keys, and leaves the groups' credentials to the CSI node plugin: no Secret outside its
own namespace, every vLLM pod names a credential volume, a new key reaches the nodes.

The operator for real (in-process kopf) against the API emulator, with its garbage collector.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from maru_contracts import tenancy
from maru_contracts.config import MaruConnectorConfig
from maru_localcluster.server import KubeEmulator
from maru_operator.builders.pool import KEY_DIGEST_ANNOTATION, key_digest
from tests.support.operator import GROUP_NS, POOL_NS, RunningOperator, create_namespace, group, has_condition, settle

pytestmark = pytest.mark.emulator

IG = "inferencegroups.maru.io"
MP = "marupools.maru.io"
DEPLOY = "deployments.apps"
DS = "daemonsets.apps"


def key_of(kube: KubeEmulator) -> bytes:
    secret = kube.wait_for("secrets", "local-shm-key", POOL_NS, lambda s: bool(s.get("data")))
    return base64.b64decode(secret["data"]["key"])


def owner_of(obj: dict[str, Any]) -> tuple[str, str, str]:
    (ref,) = obj["metadata"]["ownerReferences"]
    assert ref["controller"] is True and ref["blockOwnerDeletion"] is True
    return ref["kind"], ref["name"], ref["uid"]


def agent_key_digest(kube: KubeEmulator, key: bytes) -> dict[str, Any]:
    return kube.wait_for(
        DS,
        "local-shm-agent",
        POOL_NS,
        lambda d: (
            d["spec"]["template"]["metadata"].get("annotations", {}).get(KEY_DIGEST_ANNOTATION) == key_digest(key)
        ),
    )


def test_the_pool_key_is_made_once_owned_by_the_pool_and_mounted_by_its_daemons(
    cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]
) -> None:
    secret = cluster.get("secrets", "local-shm-key", POOL_NS)
    assert secret is not None and owner_of(secret) == ("MaruPool", "local-shm", ready_pool["metadata"]["uid"])
    assert len(key_of(cluster)) == tenancy.KEY_BYTES
    ds = agent_key_digest(cluster, key_of(cluster))
    volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    assert volumes["pool-key"]["secret"]["secretName"] == "local-shm-key"
    # The init container that copies it to the node for the CSI node plugin.
    assert "credentials" in [c["name"] for c in ds["spec"]["template"]["spec"]["initContainers"]]
    # Reconciling again (a resync, a restart) keeps the key: nothing would verify the groups' tokens otherwise.
    before = key_of(cluster)
    cluster.patch(MP, "local-shm", {"metadata": {"labels": {"poke": "1"}}})
    settle(operator)
    assert key_of(cluster) == before


def test_a_group_gets_a_credential_volume_and_no_secret(
    cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]
) -> None:
    cluster.create(group(connector={"cacheNamespace": "shared"}))
    for role in ("prefill", "decode"):
        dep = cluster.wait_for(DEPLOY, f"qwen-{role}", GROUP_NS)
        pod = dep["spec"]["template"]["spec"]
        volume = {v["name"]: v for v in pod["volumes"]}["maru-credential"]
        assert volume["csi"]["driver"] == "csi.maru.io" and volume["csi"]["readOnly"] is True
        assert volume["csi"]["volumeAttributes"]["cache"] == "shared"
        assert volume["csi"]["volumeAttributes"]["pool"] == "local-shm"
        args = pod["containers"][0]["args"]
        extra = json.loads(args[args.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
        cfg = MaruConnectorConfig.from_extra_config(extra)
        mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "maru-credential")
        assert cfg.pool_token_file == f"{mount['mountPath']}/token"
        assert cfg.cache_namespace == f"{GROUP_NS}/shared"  # the scope the plugin mints: the kubelet's namespace
    settle(operator)
    assert cluster.list("secrets", GROUP_NS) == []


def test_no_secret_request_outside_the_operators_namespace(
    cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]
) -> None:
    """Not one read, list, watch or write of a Secret anywhere but the pool (release) namespace."""
    create_namespace(cluster, "team-b")
    cluster.create(group())
    cluster.create(group(name="other", namespace="team-b"))
    for namespace, name in ((GROUP_NS, "qwen"), ("team-b", "other")):
        cluster.wait_for(DEPLOY, f"{name}-decode", namespace)
    settle(operator)
    secrets = [r for r in cluster.requests if "/secrets" in r.path and r.status != 401]
    assert secrets, "the pool key is read and written"
    own = f"/api/v1/namespaces/{POOL_NS}/"
    outside = sorted({f"{r.method} {r.path}" for r in secrets if not r.path.startswith(own)})
    assert outside == []


def test_a_new_pool_key_rolls_the_agents_to_the_nodes(
    cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]
) -> None:
    """A rotation (the key Secret deleted): the namespaced Secret watch sees it, a new key is made, and the agents'
    template changes, so each node's init container writes the new key for the node plugin."""
    old_key = key_of(cluster)
    agent_key_digest(cluster, old_key)
    cluster.delete("secrets", "local-shm-key", POOL_NS)
    fresh = cluster.wait_until(
        lambda e: (
            (s := e.get_object("", "secrets", POOL_NS, "local-shm-key"))
            and s.get("data")
            and base64.b64decode(s["data"]["key"]) != old_key
            and s
        ),
        message="a new pool key",
    )
    agent_key_digest(cluster, base64.b64decode(fresh["data"]["key"]))


def test_a_secret_of_the_old_credential_name_is_left_alone(
    cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]
) -> None:
    """Earlier versions wrote ``<group>-pool-credential``; a Secret of that name is no child any more: no conflict,
    never touched (those the operator wrote go with their group, by their ownerReference)."""
    mine = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "qwen-pool-credential", "namespace": GROUP_NS},
        "data": {"token": base64.b64encode(b"mine").decode()},
    }
    cluster.create(mine)
    cluster.create(group())
    ig = cluster.wait_for(IG, "qwen", GROUP_NS, lambda o: has_condition(o, "Ready", "True"))
    assert "ChildConflict" not in str(ig["status"]["conditions"])
    secret = cluster.get("secrets", "qwen-pool-credential", GROUP_NS)
    assert secret is not None and secret["data"] == mine["data"] and "ownerReferences" not in secret["metadata"]


def test_the_key_watch_lists_again_after_a_gap(
    cluster: KubeEmulator, operator: RunningOperator, ready_pool: dict[str, Any]
) -> None:
    """The operator's own watch of its namespace's Secrets: a dropped stream resumed from a compacted version
    (410) lists again, and a key deleted meanwhile is still noticed and made anew."""
    old_key = key_of(cluster)
    cluster.wait_until(
        lambda e: any(f"/namespaces/{POOL_NS}/secrets" in p for p in e.open_watches()), message="the Secrets watch"
    )
    # Just before the operator watches again: the key goes and the history with it, so no DELETED event is left
    # to resume from; only a list shows the key is gone.
    gap = cluster.on_request(
        f"/namespaces/{POOL_NS}/secrets$",
        lambda e: (e.delete_object("", "secrets", POOL_NS, "local-shm-key"), e.compact()),
        method="GET",
    )
    assert cluster.drop_watches(f"/namespaces/{POOL_NS}/secrets") >= 1
    fresh = cluster.wait_until(
        lambda e: (
            (s := e.get_object("", "secrets", POOL_NS, "local-shm-key"))
            and s.get("data")
            and base64.b64decode(s["data"]["key"]) != old_key
            and s
        ),
        message="a new pool key",
    )
    agent_key_digest(cluster, base64.b64decode(fresh["data"]["key"]))
    assert cluster.call(lambda: gap.hits) == 1
    cluster.wait_until(
        lambda e: any(f"/namespaces/{POOL_NS}/secrets" in p for p in e.open_watches()),
        message="the Secrets watch, again",
    )
