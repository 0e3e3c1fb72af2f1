"""The CRDs are generated from the models, fresh, structural and accepted by Kubernetes' schemas."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from maru_operator import crdgen

REPO = Path(__file__).resolve().parents[2]
CRD_FILES = sorted((REPO / "crds").glob("*.yaml"))


def _load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def test_committed_crds_are_fresh() -> None:
    stale = crdgen.stale_files()
    assert stale == [], f"regenerate with `make crds`: {stale}"


def test_stale_check_notices_an_edit(tmp_path: Path) -> None:
    crdgen.write((tmp_path,))
    assert crdgen.stale_files((tmp_path,)) == []
    victim = tmp_path / "maru.io_marupools.yaml"
    victim.write_text(victim.read_text().replace("shortNames", "shortNamez"))
    (tmp_path / "stray.yaml").write_text("{}\n")
    assert sorted(p.name for p in crdgen.stale_files((tmp_path,))) == ["maru.io_marupools.yaml", "stray.yaml"]


def test_chart_copy_is_identical() -> None:
    chart = REPO / "charts" / "maru-operator" / "crds"
    assert [p.name for p in CRD_FILES] == sorted(p.name for p in chart.glob("*.yaml"))
    for path in CRD_FILES:
        assert (chart / path.name).read_bytes() == path.read_bytes()


@pytest.mark.parametrize("path", CRD_FILES, ids=lambda p: p.name)
def test_kubernetes_validate_strict_accepts(path: Path) -> None:
    kubernetes_validate.validate(_load(path), "1.33", strict=True)


def _walk(schema: dict[str, Any], path: str):
    yield path, schema
    for name, prop in schema.get("properties", {}).items():
        yield from _walk(prop, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")


@pytest.mark.parametrize("path", CRD_FILES, ids=lambda p: p.name)
def test_schema_is_structural_and_documented(path: Path) -> None:
    crd = _load(path)
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for where, node in _walk(schema, ""):
        assert "$ref" not in node and "allOf" not in node and "anyOf" not in node, where
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{where} has no type"
        if node.get("type") == "object" and "properties" in node:
            assert "additionalProperties" not in node, f"{where}: properties and additionalProperties"
        parts = where.strip(".").split(".")
        if where and "metadata" not in parts[:1] and not where.endswith(("[]", "{}")):
            assert node.get("description"), f"{where} has no description"


@pytest.mark.parametrize(
    ("kind", "short", "scope"),
    [("MaruPool", "mpool", "Cluster"), ("InferenceGroup", "ig", "Namespaced")],
)
def test_names_scope_and_status_subresource(kind: str, short: str, scope: str) -> None:
    crd = next(c for c in map(_load, CRD_FILES) if c["spec"]["names"]["kind"] == kind)
    assert crd["spec"]["group"] == "maru.io"
    assert crd["spec"]["scope"] == scope
    assert crd["spec"]["names"]["shortNames"] == [short]
    assert crd["spec"]["names"]["categories"] == ["maru"]
    version = crd["spec"]["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = {c["name"] for c in version["additionalPrinterColumns"]}
    assert {"Ready", "Age"} <= columns


def test_groups_show_whether_disaggregation_is_active() -> None:
    """`kubectl get ig` has a DISAGG column: the DisaggregationActive condition's status, beside READY."""
    from maru_operator.conditions import DISAGGREGATION_ACTIVE

    crd = next(c for c in map(_load, CRD_FILES) if c["spec"]["names"]["kind"] == "InferenceGroup")
    columns = crd["spec"]["versions"][0]["additionalPrinterColumns"]
    names = [c["name"] for c in columns]
    disagg = columns[names.index("Disagg")]
    assert names.index("Disagg") == names.index("Ready") + 1 and "priority" not in disagg
    assert disagg == {
        "name": "Disagg",
        "type": "string",
        "jsonPath": f'.status.conditions[?(@.type=="{DISAGGREGATION_ACTIVE}")].status',
    }


def test_omitted_sections_get_their_defaults() -> None:
    from maru_operator.crdvalidate import Validator, apply_defaults

    crd = next(c for c in map(_load, CRD_FILES) if c["spec"]["names"]["kind"] == "InferenceGroup")
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    obj = {"spec": {"model": {"name": "m"}, "poolRef": {"name": "p"}}}
    filled = apply_defaults(schema, obj)
    assert filled["spec"]["connector"] == {"chunkTokens": 256, "blockSize": 16, "rpcTimeoutMs": 500}
    assert filled["spec"]["prefill"]["replicas"] == 1
    assert filled["spec"]["router"]["enabled"] is True
    assert (
        Validator.from_models().validate(
            {"apiVersion": "maru.io/v1alpha1", "kind": "InferenceGroup", "metadata": {"name": "x"}, **obj}
        )
        == []
    )


def test_api_reference_is_fresh() -> None:
    from maru_operator import apidocs

    assert apidocs.DOC_PATH.read_text() == apidocs.render(), "regenerate with `make crds`"
