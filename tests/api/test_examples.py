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
    assert {"pool-shm.yaml", "pool-cxl.yaml", "inferencegroup.yaml", "inferencegroup-shm.yaml"} <= names


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
    pools = {
        d["metadata"]["name"]
        for p in EXAMPLES
        for d in _docs(p)
        if d["kind"] == "MaruPool" and p.parent.name == "examples"
    }
    assert spec.pool_ref.name in pools


def _by_folder() -> dict[Path, list[dict[str, Any]]]:
    """Folder of examples (examples/, examples/local/) -> its documents."""
    out: dict[Path, list[dict[str, Any]]] = {}
    for path in EXAMPLES:
        out.setdefault(path.parent, []).extend(_docs(path))
    return out


@pytest.mark.parametrize("folder", sorted(_by_folder()), ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_group_binds_a_pool_of_its_folder_and_every_pool_has_a_group(folder: Path) -> None:
    """Applied together, a folder's examples come up: no group ends PoolNotFound (or NamespaceNotAllowed),
    and every pool a user may start from has a group that uses it."""
    docs = _by_folder()[folder]
    pools = {
        d["metadata"]["name"]: MaruPool.model_validate({"spec": d["spec"]}).spec
        for d in docs
        if d["kind"] == "MaruPool"
    }
    groups = [d for d in docs if d["kind"] == "InferenceGroup"]
    bound: set[str] = set()
    for group in groups:
        ref = group["spec"]["poolRef"]["name"]
        where = f"{folder.name}: InferenceGroup {group['metadata']['name']}"
        assert ref in pools, f"{where} binds {ref}, which no example in {folder.name}/ defines ({sorted(pools)})"
        allowed = pools[ref].allowed_namespaces
        assert not allowed or group["metadata"]["namespace"] in allowed, f"{where}: {ref} does not allow its namespace"
        bound.add(ref)
    assert bound == set(pools), f"pools of {folder.name}/ without a group: {sorted(set(pools) - bound)}"


def test_the_quickstart_labels_the_nodes_the_example_pools_select() -> None:
    """README's quickstart labels nodes with exactly the labels examples/pool-*.yaml select."""
    readme = (REPO / "README.md").read_text()
    quickstart = readme.split("## Quickstart on a cluster", 1)[1].split("\n## ", 1)[0]
    for path in sorted((REPO / "examples").glob("pool-*.yaml")):
        (pool,) = _docs(path)
        for key, value in pool["spec"]["nodeSelector"].items():
            assert f"{key}={value}" in quickstart, f"{path.name} selects {key}={value}; the quickstart never labels it"
