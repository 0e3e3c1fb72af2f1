"""Wrong specs are refused with a message naming the field — by the CRD (as the API server would)
and by the operator's models (so nothing slips through objects built in Python either)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from pydantic import ValidationError

from maru_operator.api import InferenceGroup, MaruPool
from maru_operator.crdvalidate import Validator

POOL: dict[str, Any] = {
    "apiVersion": "maru.io/v1alpha1",
    "kind": "MaruPool",
    "metadata": {"name": "p"},
    "spec": {"backend": "shm", "size": "1Gi"},
}
GROUP: dict[str, Any] = {
    "apiVersion": "maru.io/v1alpha1",
    "kind": "InferenceGroup",
    "metadata": {"name": "g", "namespace": "llm"},
    "spec": {"model": {"name": "org/model"}, "poolRef": {"name": "p"}},
}


def _set(doc: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    *parents, leaf = dotted.split("/")
    node = doc
    for part in parents:
        node = node.setdefault(part, {})
    if value is _DELETE:
        node.pop(leaf)
    else:
        node[leaf] = value
    return doc


_DELETE = object()

# (base, where to change it, the bad value, the field path the error must name)
WRONG = [
    (POOL, "spec/backend", _DELETE, "spec.backend"),
    (POOL, "spec/backend", "nvme", "spec.backend"),
    (POOL, "spec/size", _DELETE, "spec.size"),
    (POOL, "spec/size", "lots", "spec.size"),
    (POOL, "spec/size", "-4Gi", "spec.size"),
    (_set(POOL, "spec/backend", "dax"), "spec/devices", ["dax0.0"], "spec.devices[0]"),
    (POOL, "spec/devices", ["/dev/dax0.0"], "spec.devices"),
    (POOL, "spec/eviction", {"leaseSeconds": 0}, "spec.eviction.leaseSeconds"),
    (POOL, "spec/eviction", {"policy": "FIFO"}, "spec.eviction.policy"),
    (POOL, "spec/allowedNamespaces", [], "spec.allowedNamespaces"),
    (POOL, "spec/allowedNamespaces", ["Bad_NS"], "spec.allowedNamespaces[0]"),
    (POOL, "spec/tolerations", [{"key": "k", "operator": "Maybe"}], "spec.tolerations[0].operator"),
    (POOL, "spec/daemon", {"socketDir": "run/maru"}, "spec.daemon.socketDir"),
    (GROUP, "spec/model/name", "", "spec.model.name"),
    (GROUP, "spec/poolRef", _DELETE, "spec.poolRef"),
    (GROUP, "spec/poolRef/name", "Bad_Name", "spec.poolRef.name"),
    (GROUP, "spec/prefill", {"replicas": -1}, "spec.prefill.replicas"),
    (GROUP, "spec/decode", {"tensorParallelSize": 0}, "spec.decode.tensorParallelSize"),
    (GROUP, "spec/connector", {"chunkTokens": 100}, "spec.connector.chunkTokens"),
    (GROUP, "spec/poolEvents", {"enabled": True, "medium": "maru pool"}, "spec.poolEvents.medium"),
    (GROUP, "spec/poolEvents", {"enabled": True, "consumers": [{}]}, "spec.poolEvents.consumers[0]"),
    (GROUP, "spec/poolEvents", {"enabled": True, "curve": {"secretName": "Keys!"}}, "spec.poolEvents.curve.secretName"),
    (GROUP, "spec/connector", {"chunkTokens": 0}, "spec.connector.chunkTokens"),
    (GROUP, "spec/connector", {"blockSize": 24}, "spec.connector.blockSize"),
    (GROUP, "spec/decode", {"extraArgs": ["--kv-transfer-config={}"]}, "spec.decode.extraArgs"),
    (GROUP, "spec/prefill", {"extraArgs": ["--block-size", "32"]}, "spec.prefill.extraArgs"),
    # vLLM's parser reads these as the operator's flags too (the models also catch abbreviations).
    (GROUP, "spec/decode", {"extraArgs": ["-tp", "2"]}, "spec.decode.extraArgs"),
    (GROUP, "spec/decode", {"extraArgs": ["--kv_transfer_config={}"]}, "spec.decode.extraArgs"),
    (GROUP, "spec/prefill", {"extraArgs": ["--kv-transfer-config.kv_role=kv_both"]}, "spec.prefill.extraArgs"),
    (
        GROUP,
        "spec/prefill",
        {"env": [{"name": "T", "value": "x", "valueFrom": {"fieldRef": {"fieldPath": "a"}}}]},
        "spec.prefill.env[0]",
    ),
    (GROUP, "spec/prefill", {"env": [{"name": "T", "valueFrom": {}}]}, "spec.prefill.env[0].valueFrom"),
    (GROUP, "spec/prefill", {"volumeMounts": [{"name": "cache", "mountPath": "/c"}]}, "spec.prefill.volumeMounts"),
    (GROUP, "spec/decode", {"volumes": [{"name": "dshm", "emptyDir": {}}]}, "spec.decode.volumes"),
    # The scratch directories of the read-only root are the operator's volumes too.
    (GROUP, "spec/decode", {"volumes": [{"name": "tmp", "emptyDir": {}}]}, "spec.decode.volumes"),
    (GROUP, "spec/prefill", {"volumes": [{"name": "home", "emptyDir": {}}]}, "spec.prefill.volumes"),
    # Server-side apply keys these lists by name (or key): a repeated key cannot be applied.
    (GROUP, "spec/prefill", {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}, "spec.prefill.env"),
    (GROUP, "spec/router", {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "1"}]}, "spec.router.env"),
    (GROUP, "spec/decode", {"imagePullSecrets": [{"name": "r"}, {"name": "r"}]}, "spec.decode.imagePullSecrets"),
    (
        GROUP,
        "spec/decode",
        {
            "topologySpreadConstraints": [
                {"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"},
                {"maxSkew": 2, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"},
            ]
        },
        "spec.decode.topologySpreadConstraints",
    ),
    (
        GROUP,
        "spec/decode",
        {"volumes": [{"name": "v", "emptyDir": {}, "secret": {"secretName": "s"}}]},
        "spec.decode.volumes[0]",
    ),
    (GROUP, "spec/decode", {"volumes": [{"name": "v", "hostPath": {"path": "/"}}]}, "spec.decode.volumes[0].hostPath"),
    (GROUP, "spec/router", {"podLabels": {"app.kubernetes.io/name": "x"}}, "spec.router.podLabels"),
    (GROUP, "spec/prefill", {"strategy": {"type": "Blue"}}, "spec.prefill.strategy.type"),
    (GROUP, "spec/prefill", {"startupTimeoutSeconds": 5}, "spec.prefill.startupTimeoutSeconds"),
    (
        GROUP,
        "spec/prefill",
        {"resources": {"limits": {"nvidia.com/gpu": "one"}}},
        "spec.prefill.resources.limits.nvidia.com/gpu",
    ),
    (GROUP, "spec/router", {"policy": "fastest"}, "spec.router.policy"),
    (GROUP, "spec/router", {"port": 70000}, "spec.router.port"),
    (GROUP, "spec/model/dtype", "fp8e4", "spec.model.dtype"),
    (GROUP, "spec/prefill", {"env": [{"name": "1BAD", "value": "x"}]}, "spec.prefill.env[0].name"),
    (GROUP, "spec/prefil", {"replicas": 2}, "spec.prefil"),
]
MODELS = {"MaruPool": MaruPool, "InferenceGroup": InferenceGroup}


def _id(case: tuple[Any, ...]) -> str:
    base, where, value, _ = case
    return f"{base['kind']}:{where}={'<deleted>' if value is _DELETE else value}"


def test_the_list_is_long_enough() -> None:
    assert len(WRONG) >= 15


def test_the_bases_are_valid() -> None:
    validator = Validator.from_models()
    for base in (POOL, GROUP):
        assert validator.validate(base) == []
        MODELS[base["kind"]].model_validate({"spec": base["spec"]})


@pytest.mark.parametrize("case", WRONG, ids=[_id(c) for c in WRONG])
def test_crd_refuses_and_names_the_field(case: tuple[Any, ...]) -> None:
    base, where, value, field = case
    errors = Validator.from_models().validate(_set(base, where, value))
    assert errors, "the CRD accepted a wrong spec"
    assert field in {e.field for e in errors}, f"no error names {field}: {[str(e) for e in errors]}"


@pytest.mark.parametrize("case", WRONG, ids=[_id(c) for c in WRONG])
def test_models_refuse_and_name_the_field(case: tuple[Any, ...]) -> None:
    base, where, value, field = case
    doc = _set(base, where, value)
    with pytest.raises(ValidationError) as caught:
        MODELS[doc["kind"]].model_validate({"spec": doc["spec"]})
    leaf = field.rsplit(".", 1)[-1].split("[")[0]
    text = str(caught.value)
    assert leaf in text, f"the error does not name {leaf}: {text}"
