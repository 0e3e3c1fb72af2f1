"""Generate docs/api.md from the CRD schemas (which are generated from the models).

``python -m maru_operator.apidocs`` writes the file; ``--check`` fails when it is stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from maru_operator.crdgen import KINDS, REPO_ROOT, openapi_schema

DOC_PATH = REPO_ROOT / "docs" / "api.md"


def _type_of(schema: dict[str, Any]) -> str:
    if schema.get("x-kubernetes-int-or-string"):
        return "int or quantity"
    kind = schema.get("type", "")
    if kind == "array":
        return f"[]{_type_of(schema.get('items', {}))}"
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return f"map[string]{_type_of(schema['additionalProperties'])}"
    return kind


def _rules(schema: dict[str, Any]) -> str:
    notes = []
    if "enum" in schema:
        notes.append("one of " + ", ".join(f"`{v}`" for v in schema["enum"]))
    if "default" in schema and schema["default"] != {}:
        notes.append(f"default `{schema['default']}`")
    for key, word in (
        ("minimum", "≥"),
        ("maximum", "≤"),
        ("minLength", "length ≥"),
        ("maxLength", "length ≤"),
        ("minItems", "items ≥"),
        ("maxItems", "items ≤"),
    ):
        if key in schema:
            notes.append(f"{word} {schema[key]}")
    if "pattern" in schema and "x-kubernetes-int-or-string" not in schema and schema.get("type") == "string":
        notes.append(f"pattern `{schema['pattern']}`")
    return "; ".join(notes).replace("|", "\\|")


def _rows(schema: dict[str, Any], prefix: str) -> list[str]:
    rows = []
    required = set(schema.get("required", []))
    for name, prop in schema.get("properties", {}).items():
        path = f"{prefix}.{name}" if prefix else name
        description = " ".join(prop.get("description", "").split()).replace("|", "\\|")
        for rule in prop.get("x-kubernetes-validations", []):
            description += f" Rule: {rule['message']}."
        mark = " (required)" if name in required else ""
        rows.append(f"| `{path}`{mark} | {_type_of(prop)} | {description} | {_rules(prop)} |")
        rows += _rows(prop, path)
        if isinstance(prop.get("items"), dict):
            rows += _rows(prop["items"], f"{path}[]")
    return rows


def render() -> str:
    out = [
        "# API reference (maru.io/v1alpha1)",
        "",
        "Generated from the models in `operator/maru_operator/api` by `python -m maru_operator.apidocs`.",
        "Do not edit by hand.",
    ]
    for kind in KINDS:
        schema = openapi_schema(kind)
        out += ["", f"## {kind.kind}", "", kind.description, ""]
        out.append(
            f"Scope: {kind.scope}. Short name: `{', '.join(kind.short_names)}`. Category: `{kind.categories[0]}`."
        )
        for part in ("spec", "status"):
            sub = schema["properties"][part]
            out += ["", f"### {kind.kind} {part}", "", "| field | type | description | rules |", "|---|---|---|---|"]
            out += _rows(sub, part)
            for rule in sub.get("x-kubernetes-validations", []):
                rule_text = rule["rule"].replace("|", "\\|")
                out.append(f"| `{part}` | rule | {rule['message']} | `{rule_text}` |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if docs/api.md is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not DOC_PATH.exists() or DOC_PATH.read_text() != text:
            print("stale: docs/api.md (run `make crds` and commit)", file=sys.stderr)
            return 1
        return 0
    Path(DOC_PATH).parent.mkdir(parents=True, exist_ok=True)
    DOC_PATH.write_text(text)
    print(f"wrote {DOC_PATH.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
