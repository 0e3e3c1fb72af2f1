"""values.schema.json: generated from values.yaml, closes every object, refuses wrong values by name."""

from __future__ import annotations

import importlib.util
import json
from types import ModuleType
from typing import Any

import jsonschema
import pytest
import yaml

from tests.support.chart import CHART, CUSTOM_VALUES

SCHEMA_FILE = CHART / "values.schema.json"
VALUES_FILE = CHART / "values.yaml"


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("values_schema", CHART / "hack" / "values_schema.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generator() -> ModuleType:
    return load_generator()


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return json.loads(SCHEMA_FILE.read_text())


def walk(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every (dotted path, sub-schema) of the chart's own values, sections included."""
    out = []
    for name, prop in schema.get("properties", {}).items():
        out.append((path + name, prop))
        out += walk(prop, path + name + ".")
    return out


def test_schema_is_fresh(generator: ModuleType) -> None:
    assert SCHEMA_FILE.read_text() == generator.render(), (
        "values.schema.json is stale: run python charts/maru-operator/hack/values_schema.py"
    )


def test_every_object_is_closed(schema: dict[str, Any]) -> None:
    def check(node: Any, where: str) -> None:
        if isinstance(node, list):
            for i, item in enumerate(node):
                check(item, f"{where}[{i}]")
            return
        if not isinstance(node, dict):
            return
        types = node.get("type")
        types = types if isinstance(types, list) else [types]
        if "object" in types and "properties" in node:
            assert node.get("additionalProperties") is False, f"{where} is open"
        if "object" in types and "properties" not in node:
            # Maps (labels, annotations, quantities): values are typed, keys are free.
            assert isinstance(node.get("additionalProperties"), dict), f"{where} is an untyped object"
        for key, value in node.items():
            if key == "properties":
                for name, prop in value.items():
                    check(prop, f"{where}.{name}")
            elif key != "enum":
                check(value, f"{where}/{key}")

    check(schema, "values")


def test_every_value_is_documented_with_an_example(schema: dict[str, Any], generator: ModuleType) -> None:
    docs = generator.value_docs(VALUES_FILE.read_text())
    for path, prop in walk(schema):
        assert prop.get("description"), f"{path} has no description in values.yaml"
        if "properties" not in prop:  # a leaf: the value users set
            assert docs[path].example, f"{path} has no example in values.yaml"


def test_every_key_of_values_yaml_is_in_the_schema(schema: dict[str, Any]) -> None:
    known = {path for path, _ in walk(schema)}
    sections = {path for path, prop in walk(schema) if "properties" in prop}

    def keys(node: dict[str, Any], prefix: str = "") -> list[str]:
        out = []
        for key, value in node.items():
            out.append(prefix + key)
            if prefix + key in sections:
                out += keys(value, prefix + key + ".")
        return out

    assert set(keys(yaml.safe_load(VALUES_FILE.read_text()))) <= known


def test_optional_keys_are_shown_commented_out(schema: dict[str, Any], generator: ModuleType) -> None:
    """Schema keys without a default in values.yaml must still appear, commented out, with prose."""
    values = yaml.safe_load(VALUES_FILE.read_text())
    docs = generator.value_docs(VALUES_FILE.read_text())
    missing = []
    for path, _ in walk(schema):
        node: Any = values
        for part in path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            missing.append(path)
            assert f"# {path.rsplit('.', 1)[-1]}:" in VALUES_FILE.read_text(), path
            assert docs[path].text, path
    assert sorted(missing) == ["global", "image.digest", "podDisruptionBudget.minAvailable"]


def merged(base: Any, override: Any) -> Any:
    """Values as Helm merges them: maps key by key, everything else replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        return {k: merged(base.get(k), override[k]) if k in override else base[k] for k in base | override}
    return override


@pytest.mark.parametrize("overrides", [None, CUSTOM_VALUES], ids=["default", "custom"])
def test_values_files_satisfy_the_schema(schema: dict[str, Any], overrides) -> None:
    values = yaml.safe_load(VALUES_FILE.read_text())
    if overrides:
        values = merged(values, yaml.safe_load(overrides.read_text()))
    jsonschema.Draft7Validator(schema).validate(values)
    # The same validator refuses a typo, so the pass above means something.
    with pytest.raises(jsonschema.ValidationError, match="tagg"):
        jsonschema.Draft7Validator(schema).validate(merged(values, {"image": {"tagg": "x"}}))


def test_docs_parser_reads_comments_and_examples(generator: ModuleType) -> None:
    text = (
        "# Section prose.\n"
        "outer:\n"
        "  # The inner value.\n"
        "  # Example: inner: 3\n"
        "  inner: 1\n"
        "\n"
        "  # An optional value.\n"
        "  # Example:\n"
        "  # optional:\n"
        "  #   nested: true\n"
        "\n"
        "# No example here.\n"
        "plain: x\n"
    )
    docs = generator.value_docs(text)
    assert docs["outer"] == generator.KeyDoc("Section prose.", False)
    assert docs["outer.inner"] == generator.KeyDoc("The inner value.", True)
    assert docs["outer.optional"] == generator.KeyDoc("An optional value.", True)
    assert docs["plain"] == generator.KeyDoc("No example here.", False)
    assert "outer.nested" not in docs and "nested" not in docs


# Wrong values, and the words helm's error must contain so the user finds the value at fault.
WRONG_VALUES = [
    pytest.param(["--set", "imag.tag=0.2.0"], ["imag"], id="typo-top-level"),
    pytest.param(["--set", "image.tagg=0.2.0"], ["/image", "tagg"], id="typo-nested"),
    pytest.param(["--set", "serviceMonitor.enable=true"], ["/serviceMonitor", "enable"], id="typo-section"),
    pytest.param(["--set", "resources.limts.cpu=1"], ["/resources", "limts"], id="typo-kubernetes-object"),
    pytest.param(
        ["--set-json", 'tolerations=[{"key":"a","operater":"Exists"}]'],
        ["/tolerations/0", "operater"],
        id="typo-in-list-item",
    ),
    pytest.param(["--set", "livenessProbe.port=http"], ["/livenessProbe/port", "integer"], id="wrong-type"),
    pytest.param(["--set", "metrics.port=70000"], ["/metrics/port"], id="out-of-range"),
    pytest.param(["--set-string", "rbac.create=yes"], ["/rbac/create", "boolean"], id="string-for-bool"),
    pytest.param(["--set", "logLevel=verbose"], ["/logLevel", "debug"], id="bad-enum"),
    pytest.param(["--set", "logLevel=warning"], ["/logLevel"], id="unsupported-level"),
    pytest.param(["--set", "workers=0"], ["/workers"], id="below-minimum"),
    pytest.param(["--set", "image.pullPolicy=Sometimes"], ["/image/pullPolicy", "IfNotPresent"], id="bad-enum-2"),
    pytest.param(["--set", "watchNamespaces={LLM_Serving}"], ["/watchNamespaces/0"], id="bad-namespace"),
    pytest.param(["--set", "watchNamespaces=llm-serving"], ["/watchNamespaces", "array"], id="string-for-list"),
    pytest.param(["--set", "image.digest=latest"], ["/image/digest"], id="bad-digest"),
    pytest.param(["--set", "podDisruptionBudget.minAvailable=half"], ["/podDisruptionBudget/minAvailable"], id="pdb"),
    pytest.param(["--set", "serviceMonitor.interval=30"], ["/serviceMonitor/interval"], id="bad-duration"),
    pytest.param(
        ["--set-json", 'securityContext={"privileged":"no"}'], ["/securityContext/privileged"], id="k8s-wrong-type"
    ),
]


@pytest.mark.tools
@pytest.mark.parametrize(("args", "words"), WRONG_VALUES)
def test_wrong_values_are_refused_by_name(run_helm, template_args, args: list[str], words: list[str]) -> None:
    result = run_helm(*template_args(*args))
    assert result.returncode != 0, f"helm accepted {args}"
    assert "schema" in result.stderr
    for word in words:
        assert word in result.stderr, result.stderr


# The repository's YAML style, as ruff's for Python: 120 columns; no "---" required at the top.
YAMLLINT_CONFIG = "{extends: default, rules: {line-length: {max: 120}, document-start: disable}}"


def test_yamllint_values_and_examples() -> None:
    from yamllint import linter
    from yamllint.config import YamlLintConfig

    config = YamlLintConfig(YAMLLINT_CONFIG)
    files = [VALUES_FILE, CHART / "Chart.yaml", CUSTOM_VALUES, *sorted((CHART.parents[1] / "examples").glob("*.yaml"))]
    problems = [
        f"{path.name}:{p.line}:{p.column} {p.message}"
        for path in files
        for p in linter.run(path.read_text(), config, str(path))
    ]
    assert not problems, "\n".join(problems)
    # The linter does flag what it should, so a pass means something.
    assert list(linter.run("key: value   \n", config))
