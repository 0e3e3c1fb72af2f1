"""Shared test data: specs, owners, and a schema check of built objects."""

from __future__ import annotations

import json
import os
from typing import Any

import kubernetes_validate

from maru_contracts import tenancy
from maru_csi import minting
from maru_operator.api.inferencegroup import InferenceGroupSpec
from maru_operator.api.marupool import MaruPoolSpec
from maru_operator.builders.common import Owner
from maru_operator.builders.group import PoolView, build_role_deployment
from maru_operator.builders.pool import build_agent_daemonset

KEY = os.urandom(32)  # a pool key
NS = "maru-system"  # the pools' namespace

K8S_VERSION = "1.33"


def pool_spec(**fields: Any) -> MaruPoolSpec:
    body = {"backend": "shm", "size": "4Gi", "nodeSelector": {"maru.io/pool": "yes"}}
    body.update(fields)
    return MaruPoolSpec.model_validate(body)


def dax_spec(**fields: Any) -> MaruPoolSpec:
    body = {"backend": "dax", "devices": ["/dev/dax0.0", "/dev/dax1.0"], "nodeSelector": {"maru.io/cxl": "true"}}
    body.update(fields)
    return MaruPoolSpec.model_validate(body)


def group_spec(**fields: Any) -> InferenceGroupSpec:
    body: dict[str, Any] = {"model": {"name": "Qwen/Qwen2.5-7B-Instruct"}, "poolRef": {"name": "pool"}}
    body.update(fields)
    return InferenceGroupSpec.model_validate(body)


POOL_OWNER = Owner(kind="MaruPool", name="pool", uid="uid-pool", generation=1)
GROUP_OWNER = Owner(kind="InferenceGroup", name="llama", namespace="llm", uid="uid-group", generation=3)


def pool_view(**fields: Any) -> PoolView:
    return PoolView(name="pool", spec=pool_spec(**fields))


def assert_valid(obj: dict[str, Any]) -> None:
    """The object passes the Kubernetes OpenAPI schema, strictly (unknown fields fail)."""
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def container(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]["containers"][0]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def kv_config(dep: dict) -> dict:
    return json.loads(flag(container(dep)["args"], "--kv-transfer-config"))


def minted_token(spec: InferenceGroupSpec, owner: Owner, pool: PoolView, key: bytes = KEY) -> str:
    """The token the CSI node plugin mints for a vLLM pod of the group: from the pod's credential volume as the
    operator renders it and the pool policy its agent's init container is given, through the plugin's code."""
    dep = build_role_deployment(spec, "decode", owner, pool)
    attributes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}["maru-credential"]["csi"][
        "volumeAttributes"
    ]
    init = next(
        c
        for c in build_agent_daemonset(pool.spec, POOL_OWNER, NS, key)["spec"]["template"]["spec"]["initContainers"]
        if c["name"] == "credentials"
    )
    default, ceiling = minting.parse_policy(init["args"][init["args"].index("--policy") + 1], "--policy")
    assert init["args"][init["args"].index("--pool") + 1] == attributes["pool"]
    material = minting.Material(attributes["pool"], key, default, ceiling)
    token, _ = material.mint(
        owner.namespace or "", attributes["cache"], tenancy.Quota.decode(attributes.get("quota", ""))
    )
    return token


NOW = "2026-01-01T00:00:00Z"


def deployment(replicas: int, ready: int, generation: int = 1, observed: int = 1) -> dict[str, Any]:
    return {
        "metadata": {"name": "d", "generation": generation},
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": observed,
            "replicas": replicas,
            "updatedReplicas": replicas,
            "readyReplicas": ready,
            "availableReplicas": ready,
        },
    }


def pool_body(ready: bool = True, **spec: Any) -> dict[str, Any]:
    status = "True" if ready else "False"
    return {
        "metadata": {"name": "pool"},
        "spec": {"backend": "shm", "size": "1Gi", **spec},
        "status": {"conditions": [{"type": "Ready", "status": status, "reason": "X", "message": "m"}]},
    }
