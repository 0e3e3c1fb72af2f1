"""Shared test data: specs, owners, and a schema check of built objects."""

from __future__ import annotations

from typing import Any

import kubernetes_validate

from maru_operator.api.inferencegroup import InferenceGroupSpec
from maru_operator.api.marupool import MaruPoolSpec
from maru_operator.builders.common import Owner
from maru_operator.builders.group import PoolView

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
