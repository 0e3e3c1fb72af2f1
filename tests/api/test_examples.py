"""Every shipped example is accepted by the generated CRDs and by the operator's own models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from maru_operator.api import InferenceGroup, MaruPool
from maru_operator.crdvalidate import Validator

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("**/*.yaml"))
MODELS = {"MaruPool": MaruPool, "InferenceGroup": InferenceGroup}


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_the_promised_examples_exist() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"pool-shm.yaml", "pool-cxl.yaml", "inferencegroup.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_validates_against_crds(path: Path) -> None:
    validator = Validator.from_files((REPO / "crds").glob("*.yaml"))
    for doc in _docs(path):
        assert validator.knows(doc), f"{path.name}: unknown kind {doc.get('kind')}"
        assert validator.validate(doc) == []


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_parses_with_models(path: Path) -> None:
    for doc in _docs(path):
        MODELS[doc["kind"]].model_validate({"spec": doc["spec"]})


def test_inferencegroup_example_is_the_advertised_shape() -> None:
    (group,) = _docs(REPO / "examples" / "inferencegroup.yaml")
    spec = InferenceGroup.model_validate({"spec": group["spec"]}).spec
    assert (spec.prefill.replicas, spec.decode.replicas) == (1, 2)
    pools = {d["metadata"]["name"] for p in EXAMPLES for d in _docs(p) if d["kind"] == "MaruPool"
             and p.parent.name == "examples"}
    assert spec.pool_ref.name in pools
