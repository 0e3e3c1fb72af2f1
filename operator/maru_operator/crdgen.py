"""Generate the CustomResourceDefinitions from the pydantic models (our controller-gen).

``python -m maru_operator.crdgen`` writes ``crds/`` and the chart's ``crds/``; ``--check`` exits
non-zero when either copy differs from what the models say. Pydantic's JSON schema is turned into
a *structural* OpenAPI v3 schema: references inlined, null branches of optional fields dropped,
``additionalProperties: false`` dropped (the API server prunes unknown fields instead), and every
property carrying a description.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from maru_operator.api import GROUP, VERSION, InferenceGroup, MaruPool
from maru_operator.api.common import LIST_MAP_KEYS, CustomResource

KINDS: tuple[type[CustomResource], ...] = (MaruPool, InferenceGroup)
REPO_ROOT = Path(__file__).resolve().parents[2]
OUTPUT_DIRS = (REPO_ROOT / "crds", REPO_ROOT / "charts" / "maru-operator" / "crds")
HEADER = "# Generated from the pydantic models in operator/maru_operator/api by `make crds`. Do not edit.\n"

# JSON-schema keywords that the Kubernetes structural schema does not accept or that add noise.
_DROPPED_KEYS = {"title", "additionalProperties", "$defs"}


# Marks, between _resolve and _normalise_defaults, a field whose default is None (absent unless set).
_ABSENT_BY_DEFAULT = "x-maru-absent-by-default"


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    """Inline ``$ref``s, collapse ``anyOf [X, null]`` to X, and drop keys Kubernetes refuses."""
    if isinstance(node, list):
        return [_resolve(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:
        target = copy.deepcopy(defs[node.pop("$ref").rsplit("/", 1)[-1]])
        # Sibling keys (the field's own description, default) win over the referenced model's.
        node = {**target, **node}
    if "allOf" in node and len(node["allOf"]) == 1:
        node = {**node.pop("allOf")[0], **node}
        return _resolve(node, defs)
    if "anyOf" in node:
        branches = [b for b in node["anyOf"] if b.get("type") != "null"]
        if len(branches) == 1:
            rest = {k: v for k, v in node.items() if k != "anyOf"}
            if rest.get("default", ...) is None:
                rest.pop("default")
                rest[_ABSENT_BY_DEFAULT] = True
            return _resolve({**branches[0], **rest}, defs)
    if node.get("x-kubernetes-int-or-string"):
        node.pop("anyOf", None)
        node.pop("type", None)
    if "const" in node:
        node["enum"] = [node.pop("const")]
    resolved = {k: _resolve(v, defs) for k, v in node.items() if k not in _DROPPED_KEYS}
    if resolved.get("type") == "object" and isinstance(node.get("additionalProperties"), dict):
        resolved["additionalProperties"] = _resolve(node["additionalProperties"], defs)
    items = resolved.get("items")
    if resolved.get("type") == "array" and isinstance(items, dict) and LIST_MAP_KEYS in items:
        # A list of a model that names its map keys (conditions: by type) merges item by item.
        items = dict(items)
        resolved["items"] = items
        resolved["x-kubernetes-list-type"] = "map"
        resolved["x-kubernetes-list-map-keys"] = list(items.pop(LIST_MAP_KEYS))
    return resolved


def _normalise_defaults(schema: dict[str, Any]) -> None:
    """Optional sub-objects default to ``{}``, so the API server fills their fields' own defaults.

    Pydantic leaves ``default_factory`` fields without a default in the JSON schema; without this an
    omitted ``spec.connector`` would reach the operator with no chunk size at all. Fields whose
    default is None (``secretKeyRef``: absent unless given) get no default.
    """
    required = set(schema.get("required", []))
    for name, prop in schema.get("properties", {}).items():
        absent = prop.pop(_ABSENT_BY_DEFAULT, False)
        if prop.get("type") == "object" and "properties" in prop and name not in required and not absent:
            prop["default"] = {}
        _normalise_defaults(prop)
    items = schema.get("items")
    if isinstance(items, dict):
        _normalise_defaults(items)


def openapi_schema(kind: type[CustomResource]) -> dict[str, Any]:
    """The structural openAPIV3Schema of one kind."""
    spec_model = kind.model_fields["spec"].annotation
    status_model = kind.model_fields["status"].annotation.__args__[0]  # type: ignore[union-attr]
    parts: dict[str, Any] = {}
    for name, model in (("spec", spec_model), ("status", status_model)):
        raw = model.model_json_schema(by_alias=True, mode="validation")  # type: ignore[union-attr]
        part = _resolve(raw, raw.get("$defs", {}))
        _normalise_defaults(part)
        parts[name] = part
    parts["spec"]["description"] = f"Desired state of the {kind.kind}."
    parts["status"]["description"] = f"Observed state of the {kind.kind}, written by the operator."
    return {
        "type": "object",
        "description": kind.description,
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "APIVersion of this object (maru.io/v1alpha1)."},
            "kind": {"type": "string", "description": f"Kind of this object ({kind.kind})."},
            "metadata": {"type": "object"},
            "spec": parts["spec"],
            "status": parts["status"],
        },
    }


# On each generated CRD: a digest of its spec, which the operator compares with its own at start to tell a
# CRD left behind by an upgrade (or ahead of it after a downgrade) from the one it was built with.
SCHEMA_HASH_ANNOTATION = f"{GROUP}/schema-hash"


def schema_hash(crd_spec: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(crd_spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def build_crd(kind: type[CustomResource]) -> dict[str, Any]:
    spec = crd_spec(kind)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": crd_name(kind),
            "labels": {"app.kubernetes.io/name": "maru-operator", "app.kubernetes.io/part-of": "maru"},
            "annotations": {SCHEMA_HASH_ANNOTATION: schema_hash(spec)},
        },
        "spec": spec,
    }


def crd_name(kind: type[CustomResource]) -> str:
    return f"{kind.plural}.{GROUP}"


def crd_spec(kind: type[CustomResource]) -> dict[str, Any]:
    columns = [dict(c, priority=int(c["priority"])) if "priority" in c else c for c in kind.printer_columns]
    return {
        "group": GROUP,
        "scope": kind.scope,
        "names": {
            "kind": kind.kind,
            "listKind": f"{kind.kind}List",
            "plural": kind.plural,
            "singular": kind.kind.lower(),
            "shortNames": list(kind.short_names),
            "categories": list(kind.categories),
        },
        "versions": [
            {
                "name": VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": openapi_schema(kind)},
                "subresources": {"status": {}},
                "additionalPrinterColumns": columns,
            }
        ],
    }


def render_crd(kind: type[CustomResource]) -> str:
    return HEADER + yaml.safe_dump(build_crd(kind), sort_keys=False, width=120)


def crd_filename(kind: type[CustomResource]) -> str:
    return f"{GROUP}_{kind.plural}.yaml"


def rendered_files() -> dict[str, str]:
    return {crd_filename(kind): render_crd(kind) for kind in KINDS}


def stale_files(output_dirs: tuple[Path, ...] = OUTPUT_DIRS) -> list[Path]:
    """Files that are missing or differ from what the models generate, plus strays."""
    expected = rendered_files()
    stale = []
    for out in output_dirs:
        for name, text in expected.items():
            path = out / name
            if not path.exists() or path.read_text() != text:
                stale.append(path)
        if out.exists():
            stale += [p for p in out.glob("*.yaml") if p.name not in expected]
    return stale


def write(output_dirs: tuple[Path, ...] = OUTPUT_DIRS) -> list[Path]:
    written = []
    for out in output_dirs:
        out.mkdir(parents=True, exist_ok=True)
        for name, text in rendered_files().items():
            path = out / name
            path.write_text(text)
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed CRDs are stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for path in stale:
            print(f"stale CRD: {path.relative_to(REPO_ROOT)} (run `make crds` and commit)", file=sys.stderr)
        return 1 if stale else 0
    for path in write():
        print(f"wrote {path.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
