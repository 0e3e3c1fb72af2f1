"""Validate custom resources against the generated CRDs, as the API server would, without a cluster.

Three steps, in the API server's order: fill structural defaults, check the OpenAPI v3 schema,
then evaluate the ``x-kubernetes-validations`` CEL rules. Used by ``maru-operator validate`` (a
pre-flight for GitOps repositories) and by the tests that prove wrong specs are refused.
Every error names the field path and the rule; a value that misses a field's pattern is told, in words,
what the field takes (:data:`PATTERNS`), never the bare regular expression.
"""

from __future__ import annotations

import copy
import difflib
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from maru_contracts.poolsize import SIZE_PATTERN, parse_size
from maru_operator.api.common import (
    CONDITION_REASON_PATTERN,
    CONDITION_TYPE_PATTERN,
    DNS1123_LABEL_PATTERN,
    DNS1123_SUBDOMAIN_PATTERN,
    QUANTITY_PATTERN,
    FieldError,
)
from maru_operator.api.inferencegroup import ADAPTER_NAME_PATTERN, NO_WHITESPACE_PATTERN
from maru_operator.api.pod import LABEL_VALUE_PATTERN
from maru_operator.crdgen import KINDS, build_crd
from maru_operator.quantity import parse_quantity


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
        errors = _metadata_errors(obj.get("metadata"))
        defaulted = apply_defaults(schema, copy.deepcopy(obj))
        errors += list(_schema_errors(schema, defaulted, ""))
        if not errors:
            errors += list(_cel_errors(schema, defaulted, ""))
        return errors


def _metadata_errors(metadata: Any) -> list[FieldError]:
    """The API server's own checks of a custom resource's name and namespace, which no CRD schema carries."""
    if not isinstance(metadata, dict):
        return [FieldError("metadata", "Required value: an object with at least a name")]
    errors = []
    name = metadata.get("name")
    if not name:
        errors.append(FieldError("metadata.name", "Required value"))
    elif not isinstance(name, str) or len(name) > 253 or not re.fullmatch(DNS1123_SUBDOMAIN_PATTERN, name):
        errors.append(FieldError("metadata.name", explain_pattern(DNS1123_SUBDOMAIN_PATTERN, str(name))))
    namespace = metadata.get("namespace")
    if namespace is not None and (
        not isinstance(namespace, str) or len(namespace) > 63 or not re.fullmatch(DNS1123_LABEL_PATTERN, namespace)
    ):
        errors.append(FieldError("metadata.namespace", explain_pattern(DNS1123_LABEL_PATTERN, str(namespace))))
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
            yield FieldError(path, explain_pattern(schema["pattern"], value, schema.get("description")))
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
                close = difflib.get_close_matches(str(name), list(props), n=1, cutoff=0.75)
                hint = f"; did you mean {close[0]}?" if close else ""
                yield FieldError(_join(path, name), f"field not declared in schema{hint}")


def _cel_errors(schema: dict[str, Any], value: Any, path: str) -> Iterator[FieldError]:
    import celpy

    rules = schema.get("x-kubernetes-validations", [])
    if rules:
        env = celpy.Environment()
        activation = {"self": celpy.json_to_cel(value)}
        for rule in rules:
            if "oldSelf" in rule["rule"]:
                continue  # a transition rule: judged on updates alone, against the stored object, as in Kubernetes
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


# --- Patterns in words ------------------------------------------------------------------------------
#
# A regular expression tells a user nothing they can act on, so every pattern in the CRDs has an entry here
# (tests/api/test_validate_cli.py fails on one without): what a value of that form is called, its grammar
# as a sentence, and optionally a hint for the mistakes people make. Keyed by the pattern, not by the field,
# so every field sharing a grammar (ten quantity fields, twenty-one object names) is explained alike.


@dataclass(frozen=True)
class PatternRule:
    """What a pattern means: ``what`` names the form, ``grammar`` is a clause that defines it."""

    what: str
    grammar: str
    hint: Callable[[str], str | None] | None = None


def _hints(*rules: tuple[str, str]) -> Callable[[str], str | None]:
    compiled = [(re.compile(pattern), text) for pattern, text in rules]
    return lambda value: next((text for pattern, text in compiled if pattern.search(value)), None)


def _spell_bytes(count: int) -> str:
    """``count`` in the pool size grammar with the fewest characters (``1610612736`` -> ``1536Mi``)."""
    units = (
        [("", 1)]
        + [(s, 1024**i) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"), 1)]
        + [(s, 1000**i) for i, s in enumerate(("k", "M", "G", "T", "P", "E"), 1)]
    )
    return min((f"{count // factor}{suffix}" for suffix, factor in units if count % factor == 0), key=len)


def _size_refusal(value: str) -> str:
    try:
        parse_size(value)
    except ValueError as err:
        return str(err).split(": ", 1)[-1]
    return ""


def _size_hint(value: str) -> str | None:
    # The daemon's own refusal (maru-pool --size parses with parse_size): one set of hints for one grammar.
    # Its catch-all answer only restates the grammar, which the message gives anyway.
    reasons = [r for r in [_size_refusal(value)] if r and r != _size_refusal("?")]
    # Only plain notation (fractions, exponents, leading zeros) has an exact rewrite; 512m meant megabytes.
    if re.fullmatch(QUANTITY_PATTERN, value) and value[-1:] not in ("m", "u", "n"):
        exact = parse_quantity(value)
        if exact > 0 and exact == exact.to_integral_value():
            rewrite = _spell_bytes(int(exact))
            if re.fullmatch(SIZE_PATTERN, rewrite) and not any(rewrite in r for r in reasons):
                reasons.append(f"{value} is exactly {rewrite}")
    return "; ".join(reasons) or None


_SUBDOMAIN = (
    "lower-case letters, digits, '-' and '.', each dot-separated part starting and ending with a "
    "letter or digit, at most 253 characters"
)
_CASE_HINTS = (("[A-Z]", "upper-case letters are not allowed: use lower case"), ("_", "'_' is not allowed: use '-'"))

PATTERNS: dict[str, PatternRule] = {
    SIZE_PATTERN: PatternRule(
        "a pool size",
        "a pool size is a positive whole number of bytes (at most 18 digits, no leading zero, sign, fraction or "
        "exponent) with an optional suffix Ki, Mi, Gi, Ti, Pi, Ei (powers of 1024) or k, M, G, T, P, E (powers of "
        "1000), e.g. 64Gi or 500M",
        _size_hint,
    ),
    QUANTITY_PATTERN: PatternRule(
        "a Kubernetes quantity",
        "a quantity is a number without a sign (digits, optionally with a decimal point) with an optional suffix: "
        "Ki, Mi, Gi, Ti, Pi, Ei (powers of 1024), k, M, G, T, P, E (powers of 1000), m, u, n (thousandths, "
        "millionths, billionths) or an exponent such as e3, e.g. 16Gi, 500m or 2",
        _hints(
            (r"\s", "remove the spaces"),
            (r"^-", "a negative amount is not allowed here"),
            (r"[bB]$", "write the unit without B, e.g. 16Gi or 16G"),
            (r"^[0-9.]+[kmgtpe]i$", "suffixes are case-sensitive: Ki, Mi, Gi, Ti, Pi, Ei"),
            (r"^[0-9.]+K$", "decimal kilo is a lower-case k (Ki for 1024)"),
        ),
    ),
    DNS1123_LABEL_PATTERN: PatternRule(
        "a DNS label",
        "a DNS label is lower-case letters, digits and '-', starting and ending with a letter or digit, at most 63 "
        "characters, e.g. llm",
        _hints(*_CASE_HINTS),
    ),
    DNS1123_SUBDOMAIN_PATTERN: PatternRule(
        "a DNS subdomain name",
        f"a DNS subdomain name is {_SUBDOMAIN}, e.g. local-shm",
        _hints(*_CASE_HINTS),
    ),
    f"^$|{DNS1123_SUBDOMAIN_PATTERN}": PatternRule(
        "a PriorityClass name",
        f"a PriorityClass name is empty (no class) or a DNS subdomain name: {_SUBDOMAIN}, e.g. system-node-critical",
        _hints(*_CASE_HINTS),
    ),
    LABEL_VALUE_PATTERN: PatternRule(
        "a label value",
        "a label value is empty or at most 63 letters, digits, '-', '_' and '.', starting and ending with a letter "
        "or digit",
    ),
    CONDITION_TYPE_PATTERN: PatternRule(
        "a condition type",
        "a condition type is letters, digits, '-', '_' and '.', starting and ending with a letter or digit, with "
        "an optional DNS subdomain prefix and '/', e.g. Ready",
    ),
    CONDITION_REASON_PATTERN: PatternRule(
        "a condition reason",
        "a condition reason is CamelCase: a letter, then letters, digits, '_', ',' and ':', not ending with ',' "
        "or ':', e.g. PoolNotReady",
    ),
    ADAPTER_NAME_PATTERN: PatternRule(
        "a LoRA adapter name",
        "an adapter name is letters, digits, '.', '_' and '-', starting with a letter or digit, e.g. sql-lora",
    ),
    NO_WHITESPACE_PATTERN: PatternRule(
        "an adapter source",
        "an adapter source is a Hugging Face id or a path with no spaces, e.g. org/sql-lora",
        _hints((r"\s", "remove the spaces")),
    ),
    r"^/dev/[A-Za-z0-9._/-]+$": PatternRule(
        "a device path",
        "a device path is a path under /dev of letters, digits, '.', '_', '-' and '/', e.g. /dev/dax0.0",
    ),
    r"^/.*$": PatternRule("an absolute path", "an absolute path starts with /, e.g. /run/maru"),
    r"^[^/].*$": PatternRule("a relative path", "a relative path is not empty and does not start with /"),
    r"^[-._a-zA-Z][-._a-zA-Z0-9]*$": PatternRule(
        "an environment variable name",
        "an environment variable name is letters, digits, '_', '-' and '.', not starting with a digit, e.g. HF_TOKEN",
    ),
    r"^[A-Z][A-Z0-9_]*$": PatternRule(
        "a KV event medium",
        "a KV event medium is upper-case letters, digits and '_', starting with a letter, as vLLM names its media, "
        "e.g. MARU_POOL or CPU",
        _hints((r"[a-z]", "write it in capitals, as vLLM names its media")),
    ),
    r"^([0-9]+%?)$": PatternRule(
        "a count or a percentage",
        "a count or a percentage is a whole number or a whole percentage, e.g. 1 or 25%",
    ),
}


def explain_pattern(pattern: str, value: str, description: str | None = None) -> str:
    """Why ``value`` does not fit ``pattern``, in words: the form, the likely fix, the grammar."""
    rule = PATTERNS.get(pattern)
    if rule is None:
        # A pattern without an entry (a CRD from elsewhere via from_files): the field's own description is
        # the best words there are; the regex stays as the last resort.
        about = f" ({description.rstrip('.')})" if description else ""
        return f"Invalid value: \"{value}\": does not have the form this field takes{about}: must match '{pattern}'"
    hint = rule.hint(value) if rule.hint else None
    return f'Invalid value: "{value}" is not {rule.what}: ' + (f"{hint}; " if hint else "") + rule.grammar
