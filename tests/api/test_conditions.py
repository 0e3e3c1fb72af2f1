"""status.conditions as Kubernetes API conventions ask (metav1.Condition): a map keyed by type, RFC 3339
transition times, CamelCase reasons; in the models, in the generated CRDs, and in the validated status."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from maru_operator import crdgen
from maru_operator.api import InferenceGroup, MaruPool
from maru_operator.api.common import CONDITION_REASON_PATTERN, Condition


@pytest.mark.parametrize("kind", [MaruPool, InferenceGroup], ids=["MaruPool", "InferenceGroup"])
def test_crd_conditions_are_a_map_keyed_by_type(kind: type) -> None:
    schema = crdgen.openapi_schema(kind)["properties"]["status"]["properties"]["conditions"]
    assert schema["type"] == "array"
    assert schema["x-kubernetes-list-type"] == "map"
    assert schema["x-kubernetes-list-map-keys"] == ["type"]
    item = schema["items"]
    assert "type" in item["required"]  # a map key must be required
    assert item["properties"]["lastTransitionTime"]["format"] == "date-time"
    assert item["properties"]["reason"]["pattern"] == "^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"
    assert not any(k.startswith("x-maru") for k in item)  # the model's marker stays out of the CRD


@pytest.mark.parametrize("reason", ["Ready", "PoolNotFound", "Reason_1", "a:b,c"])
def test_reasons_the_pattern_takes(reason: str) -> None:
    assert re.match(CONDITION_REASON_PATTERN, reason)
    Condition(type="Ready", status="True", reason=reason)


@pytest.mark.parametrize("reason", ["", "1Starts", "has space", "ends,", "dash-ed"])
def test_reasons_the_pattern_refuses(reason: str) -> None:
    with pytest.raises(ValidationError, match="reason"):
        Condition(type="Ready", status="True", reason=reason)
