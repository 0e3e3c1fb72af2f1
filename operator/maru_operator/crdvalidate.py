"""Validate custom resources against the generated CRDs, as the API server would, without a cluster.

Three steps, in the API server's order: fill structural defaults, check the OpenAPI v3 schema,
then evaluate the ``x-kubernetes-validations`` CEL rules. Used by ``maru-operator validate`` (a
pre-flight for GitOps repositories) and by the tests that prove wrong specs are refused.
Every error names the field path and the rule.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml

from maru_operator.api.common import FieldError
from maru_operator.crdgen import KINDS, build_crd


class Validator:
    """Validates objects of the kinds described by a set of CRDs."""

    def __init__(self, crds: Iterable[dict[str, Any]]) -> None:
        self._schemas: dict[tuple[str, str], dict[str, Any]] = {}
        for crd in crds:
            spec = crd["spec"]
            for version in spec["versions"]:
                api_version = f"{spec['group']}/{version['name']}"
                self._schemas[(api_version, spec["names"]["kind"])] = version["schema"]["openAPIV3Schema"]

    @classmethod
    def from_models(cls) -> Validator:
        return cls(build_crd(kind) for kind in KINDS)

    @classmethod
    def from_files(cls, paths: Iterable[Path]) -> Validator:
        docs = [d for p in paths for d in yaml.safe_load_all(p.read_text()) if d]
        return cls(d for d in docs if d.get("kind") == "CustomResourceDefinition")

    def knows(self, obj: dict[str, Any]) -> bool:
        return (obj.get("apiVersion"), obj.get("kind")) in self._schemas

    def validate(self, obj: dict[str, Any]) -> list[FieldError]:
        """All errors of ``obj``; an empty list means the API server would accept it."""
        key = (obj.get("apiVersion"), obj.get("kind"))
        schema = self._schemas.get(key)  # type: ignore[arg-type]
        if schema is None:
            return [FieldError("kind", f"no CRD serves apiVersion={key[0]} kind={key[1]}")]
        errors = []
        if not (obj.get("metadata") or {}).get("name"):
            errors.append(FieldError("metadata.name", "Required value"))
        defaulted = apply_defaults(schema, copy.deepcopy(obj))
        errors += list(_schema_errors(schema, defaulted, ""))
        if not errors:
            errors += list(_cel_errors(schema, defaulted, ""))
        return errors


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Fill defaults the way the API server does: only into objects that are present."""
    if isinstance(value, dict):
        for name, prop in schema.get("properties", {}).items():
            if name not in value and "default" in prop:
                value[name] = copy.deepcopy(prop["default"])
            if name in value:
                value[name] = apply_defaults(prop, value[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name in list(value):
                if name not in schema.get("properties", {}):
                    value[name] = apply_defaults(extra, value[name])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        value = [apply_defaults(schema["items"], item) for item in value]
    return value


def _join(path: str, name: str | int) -> str:
    if isinstance(name, int):
        return f"{path}[{name}]"
    return f"{path}.{name}" if path else name


_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
}


def _schema_errors(schema: dict[str, Any], value: Any, path: str) -> Iterator[FieldError]:
    if schema.get("x-kubernetes-int-or-string"):
        if isinstance(value, bool) or not isinstance(value, int | str):
            yield FieldError(path, "Invalid value: must be an integer or a string")
            return
    elif "type" in schema:
        expected = _TYPES[schema["type"]]
        if (isinstance(value, bool) and schema["type"] != "boolean") or not isinstance(value, expected):
            yield FieldError(path, f"Invalid value: must be of type {schema['type']}")
            return
    if "enum" in schema and value not in schema["enum"]:
        allowed = ", ".join(f'"{v}"' for v in schema["enum"])
        yield FieldError(path, f'Unsupported value: "{value}": supported values: {allowed}')
    if isinstance(value, str):
        if "pattern" in schema and not re.search(schema["pattern"], value):
            yield FieldError(path, f"Invalid value: \"{value}\": must match '{schema['pattern']}'")
        if "minLength" in schema and len(value) < schema["minLength"]:
            yield FieldError(path, f"Invalid value: must be at least {schema['minLength']} characters")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            yield FieldError(path, f"Too long: may not be more than {schema['maxLength']} characters")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            yield FieldError(path, f"Invalid value: {value}: must be greater than or equal to {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            yield FieldError(path, f"Invalid value: {value}: must be less than or equal to {schema['maximum']}")
    if isinstance(value, list):
        if "minItems" in schema and len(value) < schema["minItems"]:
            yield FieldError(path, f"Invalid value: must have at least {schema['minItems']} items")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            yield FieldError(path, f"Too many: must have at most {schema['maxItems']} items")
        for i, item in enumerate(value):
            yield from _schema_errors(schema.get("items", {}), item, _join(path, i))
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for name in schema.get("required", []):
            if name not in value:
                yield FieldError(_join(path, name), "Required value")
        extra = schema.get("additionalProperties")
        for name, item in value.items():
            if name in props:
                yield from _schema_errors(props[name], item, _join(path, name))
            elif isinstance(extra, dict):
                yield from _schema_errors(extra, item, _join(path, name))
            elif props and path:
                # The API server would prune it silently; refusing it is kinder than losing a typo.
                yield FieldError(_join(path, name), "field not declared in schema")


def _cel_errors(schema: dict[str, Any], value: Any, path: str) -> Iterator[FieldError]:
    import celpy

    rules = schema.get("x-kubernetes-validations", [])
    if rules:
        env = celpy.Environment()
        activation = {"self": celpy.json_to_cel(value)}
        for rule in rules:
            field = path + rule.get("fieldPath", "")
            try:
                result = env.program(env.compile(rule["rule"])).evaluate(activation)
            except celpy.CELEvalError as err:
                # The API server refuses the object too when a rule cannot be evaluated.
                yield FieldError(field, f"Invalid value: rule {rule['rule']!r} failed to evaluate: {err.args[0]}")
                continue
            if not bool(result):
                yield FieldError(field, f"Invalid value: {rule.get('message', rule['rule'])}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for name, item in value.items():
            if name in props:
                yield from _cel_errors(props[name], item, _join(path, name))
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            yield from _cel_errors(schema["items"], item, _join(path, i))
