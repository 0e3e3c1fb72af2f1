"""The group's InferencePool: off by default, both roles' vLLM pods behind the endpoint picker named."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from pydantic import ValidationError

from maru_operator.builders.children import build_group_children
from maru_operator.builders.common import LABEL_MANAGED_BY, MANAGED_BY
from maru_operator.builders.group import (
    KV_REVISION_LABEL,
    LLMD_ROLE_LABEL,
    VLLM_PORT,
)
from maru_operator.builders.inferencepool import build_inference_pool
from maru_operator.crdvalidate import Validator
from tests.support.specs import GROUP_OWNER, group_spec, pool_view

PICKER = {"name": "qwen-epp", "port": {"number": 9002}}


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_off_by_default() -> None:
    assert build_inference_pool(group_spec(), GROUP_OWNER) is None


def test_the_pool_names_the_picker_and_the_vllm_port() -> None:
    spec = group_spec(inferencePool={"enabled": True, "endpointPicker": {**PICKER, "failureMode": "FailOpen"}})
    pool = build_inference_pool(spec, GROUP_OWNER)
    assert pool is not None
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["kind"] == "InferencePool"
    meta = pool["metadata"]
    assert (meta["name"], meta["namespace"]) == ("llama", "llm")
    assert meta["labels"][LABEL_MANAGED_BY] == MANAGED_BY
    (ref,) = meta["ownerReferences"]
    assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("InferenceGroup", "llama", "uid-group", True)
    assert pool["spec"]["targetPorts"] == [{"number": VLLM_PORT}]
    assert pool["spec"]["endpointPickerRef"] == {
        "kind": "Service",
        "name": "qwen-epp",
        "port": {"number": 9002},
        "failureMode": "FailOpen",
    }


def test_the_selector_takes_both_roles_and_not_the_router() -> None:
    """llm-d's picker pairs prefill and decode itself: it must see both roles' pods, each with its role and
    KV revision labels, and never the router's."""
    spec = group_spec(inferencePool={"enabled": True, "endpointPicker": PICKER})
    pool = build_inference_pool(spec, GROUP_OWNER)
    assert pool is not None
    selector = pool["spec"]["selector"]["matchLabels"]
    children = build_group_children(spec, GROUP_OWNER, pool_view())
    templates = {
        c["metadata"]["name"]: c["spec"]["template"]["metadata"]["labels"]
        for c in children
        if c["kind"] == "Deployment"
    }
    selected = {name for name, labels in templates.items() if _matches(selector, labels)}
    assert selected == {"llama-prefill", "llama-decode"}
    assert {templates[n][LLMD_ROLE_LABEL] for n in selected} == {"prefill", "decode"}
    assert len({templates[n][KV_REVISION_LABEL] for n in selected}) == 1


def test_another_group_of_the_namespace_is_not_selected() -> None:
    spec = group_spec(inferencePool={"enabled": True, "endpointPicker": PICKER})
    pool = build_inference_pool(spec, GROUP_OWNER)
    assert pool is not None
    other = GROUP_OWNER.__class__(kind="InferenceGroup", name="mistral", namespace="llm", uid="u2")
    for child in build_group_children(spec, other, pool_view()):
        if child["kind"] == "Deployment":
            assert not _matches(
                pool["spec"]["selector"]["matchLabels"], child["spec"]["template"]["metadata"]["labels"]
            )


GROUP: dict[str, Any] = {
    "apiVersion": "maru.io/v1alpha1",
    "kind": "InferenceGroup",
    "metadata": {"name": "g", "namespace": "llm"},
    "spec": {"model": {"name": "org/model"}, "poolRef": {"name": "p"}},
}


def _with(pool: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(GROUP)
    doc["spec"]["inferencePool"] = pool
    return doc


def test_enabled_without_a_picker_is_refused_naming_the_field() -> None:
    doc = _with({"enabled": True})
    errors = Validator.from_models().validate(doc)
    assert "spec.inferencePool.endpointPicker" in {e.field for e in errors}, [str(e) for e in errors]
    with pytest.raises(ValidationError, match=r"inferencePool\.endpointPicker: required when inferencePool\.enabled"):
        group_spec(inferencePool={"enabled": True})


@pytest.mark.parametrize(
    "picker, field",
    [
        ({"name": "Bad_Name", "port": {"number": 9002}}, "spec.inferencePool.endpointPicker.name"),
        ({"name": "epp", "port": {"number": 0}}, "spec.inferencePool.endpointPicker.port.number"),
        (
            {"name": "epp", "port": {"number": 9002}, "failureMode": "Retry"},
            "spec.inferencePool.endpointPicker.failureMode",
        ),
    ],
)
def test_a_wrong_picker_is_refused_naming_the_field(picker: dict[str, Any], field: str) -> None:
    errors = Validator.from_models().validate(_with({"enabled": True, "endpointPicker": picker}))
    assert field in {e.field for e in errors}, [str(e) for e in errors]
    with pytest.raises(ValidationError):
        group_spec(inferencePool={"enabled": True, "endpointPicker": picker})


def test_disabled_needs_no_picker() -> None:
    assert Validator.from_models().validate(_with({"enabled": False})) == []
    assert group_spec(inferencePool={"enabled": False}).inference_pool.endpoint_picker is None


def test_the_gateway_can_reach_the_pods() -> None:
    """With the router alone in front, only router pods may reach vLLM's port; a gateway's proxy and its endpoint
    picker (which reads the pods' /metrics) run in namespaces of their own installation: the port is open."""
    from maru_operator.builders.netpol import DEFAULT_NETWORK, build_vllm_policy

    def ingress(spec: Any) -> list[dict[str, Any]]:
        return build_vllm_policy(spec, GROUP_OWNER, pool_view(), "maru-system", DEFAULT_NETWORK)["spec"]["ingress"]

    assert all("from" in rule for rule in ingress(group_spec()))
    opened = ingress(group_spec(inferencePool={"enabled": True, "endpointPicker": PICKER}))
    assert opened[0] == {"ports": [{"protocol": "TCP", "port": VLLM_PORT}]}
    # The KV events stay the group's router's (decode-direct): only the API port is opened.
    assert all("from" in rule for rule in opened[1:])


def test_render_shows_the_inference_pool(tmp_path: Any) -> None:
    """``maru-operator render`` uses the same builder: a reviewer sees the InferencePool the cluster gets."""
    import yaml

    from maru_operator.render import render

    doc = _with({"enabled": True, "endpointPicker": PICKER})
    path = tmp_path / "group.yaml"
    path.write_text(yaml.safe_dump(doc))
    rendered = [d for d in yaml.safe_load_all(render([path], "maru-system")) if d]
    (pool,) = [d for d in rendered if d["kind"] == "InferencePool"]
    assert (pool["metadata"]["name"], pool["spec"]["endpointPickerRef"]["name"]) == ("g", "qwen-epp")
    assert not [
        d
        for d in yaml.safe_load_all(render([_write(tmp_path, GROUP)], "maru-system"))
        if d and d["kind"] == "InferencePool"
    ]


def _write(tmp_path: Any, doc: dict[str, Any]) -> Any:
    import yaml

    path = tmp_path / "plain.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path
