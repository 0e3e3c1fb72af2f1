"""Generate the chart's values.schema.json.

    python charts/maru-operator/hack/values_schema.py          # write values.schema.json
    python charts/maru-operator/hack/values_schema.py --check  # exit 1 when the file is stale

The types, enums and bounds of the chart's own values are declared below; every description is
read from the comment above the key in values.yaml (the text before its "Example:"), so values.yaml
stays the one place where values are documented. Values that are Kubernetes objects (resources,
affinity, tolerations, security contexts, env vars, pull secrets) use the strict JSON schemas of
Kubernetes 1.33 shipped by the ``kubernetes-validate`` package, copied into ``definitions``.
Every object is closed with ``additionalProperties: false``, so a misspelt key fails ``helm install``.
The output is JSON schema draft-07, which both Helm 3 and Helm 4 evaluate.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
from pathlib import Path
from typing import Any, NamedTuple

CHART_DIR = Path(__file__).resolve().parents[1]
VALUES_FILE = CHART_DIR / "values.yaml"
SCHEMA_FILE = CHART_DIR / "values.schema.json"
KUBERNETES_VERSION = "1.33.0"

# JSON pointer prefix of the copied Kubernetes definitions inside the generated schema.
_DEFS = "#/definitions/"
# Keywords dropped from the copied Kubernetes schemas: prose, formats Helm 3's validator does not
# know, and Kubernetes-only extensions. Types, enums, required keys and closed objects are kept.
_DROPPED_KEYWORDS = {"description", "format", "default"}

DNS1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DURATION = r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$"


# --- small constructors for the chart's own values -------------------------------------------


def string(**extra: Any) -> dict[str, Any]:
    return {"type": "string", **extra}


def boolean() -> dict[str, Any]:
    return {"type": "boolean"}


def integer(minimum: int | None = None, maximum: int | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    if minimum is not None:
        schema["minimum"] = minimum
    if maximum is not None:
        schema["maximum"] = maximum
    return schema


def port() -> dict[str, Any]:
    return integer(1, 65535)


def enum(*choices: str) -> dict[str, Any]:
    return {"type": "string", "enum": list(choices)}


def obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "additionalProperties": False, "properties": properties}
    if required:
        schema["required"] = required
    return schema


def string_map() -> dict[str, Any]:
    """Labels or annotations: string keys to string values."""
    return {"type": "object", "additionalProperties": {"type": "string"}}


def kube(name: str) -> dict[str, Any]:
    """A Kubernetes type, e.g. ``io.k8s.api.core.v1.Toleration``."""
    return {"$ref": _DEFS + name}


def kube_list(name: str) -> dict[str, Any]:
    return {"type": "array", "items": kube(name)}


CORE = "io.k8s.api.core.v1."
# An absolute host path other than "/" (a trailing "/" is allowed).
ABSOLUTE_PATH = r"^/.*[^/]/?$"
IMAGE_TAG = r"^$|^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$"
# A registry host (optionally with a port) and path, lower case; no scheme, no tag. The operator's
# --image-registry accepts the same (maru_operator.images.REGISTRY_PATTERN; a test keeps them equal).
IMAGE_REGISTRY = r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?(:[0-9]+)?(/[a-z0-9]+([._-]+[a-z0-9]+)*)*/?$"
# A whole image reference, or empty.
IMAGE_REFERENCE = r"^$|^[a-z0-9][^\s]*$"
# An IPv4 or IPv6 address range in CIDR notation (the shape only; the API server checks the rest).
CIDR = r"^([0-9]{1,3}(\.[0-9]{1,3}){3}|[0-9A-Fa-f:]*:[0-9A-Fa-f:.]*)/[0-9]{1,3}$"
PULL_POLICY = ("Always", "IfNotPresent", "Never")
INT_OR_PERCENT = {
    "oneOf": [
        {"type": "integer", "minimum": 0},
        {"type": "string", "pattern": r"^[0-9]+%$"},
    ]
}

# A sidecar's image: repository (empty: the chart's default for it), tag, pull policy.
IMAGE = obj(
    {"repository": string(), "tag": string(pattern=IMAGE_TAG), "pullPolicy": enum(*PULL_POLICY)},
    required=["repository", "pullPolicy"],
)

# The chart's values. Keys marked "commented out" in values.yaml are optional and have no default.
VALUES: dict[str, Any] = obj(
    {
        "nameOverride": string(maxLength=63),
        "fullnameOverride": string(maxLength=63),
        # Helm gives a subchart its parent's `global` values; open, as the parent decides them.
        "global": {"type": "object", "additionalProperties": {}},
        "images": obj(
            {
                "registry": string(pattern=IMAGE_REGISTRY),
                "tag": string(pattern=IMAGE_TAG),
                "pool": string(pattern=IMAGE_REFERENCE),
                "vllm": string(pattern=IMAGE_REFERENCE),
                "router": string(pattern=IMAGE_REFERENCE),
            },
            required=["registry"],
        ),
        "image": obj(
            {
                "repository": string(),
                "tag": string(pattern=IMAGE_TAG),
                "digest": string(pattern=r"^sha256:[a-f0-9]{64}$"),
                "pullPolicy": enum(*PULL_POLICY),
            },
            required=["repository", "pullPolicy"],
        ),
        "imagePullSecrets": kube_list(CORE + "LocalObjectReference"),
        "watchNamespaces": {
            "type": "array",
            "uniqueItems": True,
            "items": string(pattern=DNS1123_LABEL, maxLength=63),
        },
        "instance": string(pattern=r"^$|^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$"),
        "leaseNamespace": string(pattern=DNS1123_LABEL, maxLength=63),
        "logLevel": enum("info", "debug"),
        "workers": integer(1, 256),
        "maxRollingGroups": integer(0, 10000),
        "dataPlaneUpdates": enum("manual", "auto"),
        "readPods": boolean(),
        "resyncSeconds": {"type": "number", "minimum": 1, "maximum": 86400},
        "poolUsageIntervalSeconds": {"type": "number", "minimum": 1, "maximum": 86400},
        "extraArgs": {"type": "array", "items": string(minLength=1)},
        "extraEnv": kube_list(CORE + "EnvVar"),
        "livenessProbe": obj(
            {
                "enabled": boolean(),
                "port": port(),
                "initialDelaySeconds": integer(0),
                "periodSeconds": integer(1),
                "timeoutSeconds": integer(1),
                "failureThreshold": integer(1),
            },
            required=["enabled", "port"],
        ),
        "readinessProbe": obj(
            {
                "enabled": boolean(),
                "initialDelaySeconds": integer(0),
                "periodSeconds": integer(1),
                "timeoutSeconds": integer(1),
                "failureThreshold": integer(1),
            },
            required=["enabled"],
        ),
        "networkPolicy": obj(
            {
                "enabled": boolean(),
                "scrapeNamespaces": {
                    "type": "array",
                    "uniqueItems": True,
                    "items": string(pattern=DNS1123_LABEL, maxLength=63),
                },
                "apiServer": obj(
                    {
                        "cidrs": {"type": "array", "minItems": 1, "items": string(pattern=CIDR)},
                        "ports": {"type": "array", "minItems": 1, "items": port()},
                        "cilium": boolean(),
                    },
                    required=["cidrs", "ports"],
                ),
            },
            required=["enabled", "apiServer"],
        ),
        "metrics": obj(
            {
                "port": port(),
                "service": obj({"enabled": boolean(), "annotations": string_map()}, required=["enabled"]),
            },
            required=["port", "service"],
        ),
        "serviceMonitor": obj(
            {
                "enabled": boolean(),
                "interval": string(pattern=DURATION),
                "scrapeTimeout": string(pattern=DURATION),
                "labels": string_map(),
                "namespace": string(pattern=r"^$|" + DNS1123_LABEL, maxLength=63),
            },
            required=["enabled"],
        ),
        "podMonitors": obj(
            {
                "enabled": boolean(),
                "interval": string(pattern=DURATION),
                "scrapeTimeout": string(pattern=DURATION),
                "labels": string_map(),
                "namespace": string(pattern=r"^$|" + DNS1123_LABEL, maxLength=63),
            },
            required=["enabled", "interval", "scrapeTimeout"],
        ),
        "prometheusRule": obj(
            {
                "enabled": boolean(),
                "labels": string_map(),
                "namespace": string(pattern=r"^$|" + DNS1123_LABEL, maxLength=63),
            },
            required=["enabled"],
        ),
        "grafanaDashboard": obj(
            {
                "enabled": boolean(),
                "labels": string_map(),
                "annotations": string_map(),
                "namespace": string(pattern=r"^$|" + DNS1123_LABEL, maxLength=63),
            },
            required=["enabled"],
        ),
        "replicas": integer(1, 5),
        "podDisruptionBudget": obj(
            {"enabled": boolean(), "maxUnavailable": INT_OR_PERCENT, "minAvailable": INT_OR_PERCENT},
            required=["enabled"],
        ),
        "serviceAccount": obj(
            {"create": boolean(), "name": string(maxLength=253), "annotations": string_map()},
            required=["create"],
        ),
        "rbac": obj({"create": boolean()}, required=["create"]),
        "resources": kube(CORE + "ResourceRequirements"),
        "nodeSelector": string_map(),
        "tolerations": kube_list(CORE + "Toleration"),
        "affinity": kube(CORE + "Affinity"),
        "topologySpreadConstraints": kube_list(CORE + "TopologySpreadConstraint"),
        "priorityClassName": string(maxLength=253),
        "podAnnotations": string_map(),
        "podLabels": string_map(),
        "commonLabels": string_map(),
        "podSecurityContext": kube(CORE + "PodSecurityContext"),
        "securityContext": kube(CORE + "SecurityContext"),
        "csiDriver": obj(
            {
                "enabled": boolean(),
                "socketRoot": string(pattern=ABSOLUTE_PATH),
                "kubeletDir": string(pattern=ABSOLUTE_PATH),
                "image": obj(
                    {"repository": string(), "tag": string(pattern=IMAGE_TAG), "pullPolicy": enum(*PULL_POLICY)},
                    required=["pullPolicy"],
                ),
                "registrar": obj(
                    {"image": IMAGE, "resources": kube(CORE + "ResourceRequirements")}, required=["image"]
                ),
                "livenessProbe": obj(
                    {"port": port(), "image": IMAGE, "resources": kube(CORE + "ResourceRequirements")},
                    required=["port", "image"],
                ),
                "resources": kube(CORE + "ResourceRequirements"),
                "nodeSelector": string_map(),
                "affinity": kube(CORE + "Affinity"),
                "tolerations": kube_list(CORE + "Toleration"),
                "priorityClassName": string(maxLength=253),
            },
            required=["enabled", "socketRoot", "kubeletDir", "image", "registrar", "livenessProbe"],
        ),
    },
    required=[
        "image",
        "instance",
        "logLevel",
        "workers",
        "resyncSeconds",
        "poolUsageIntervalSeconds",
        "replicas",
        "livenessProbe",
        "readinessProbe",
        "metrics",
        "networkPolicy",
        "serviceAccount",
        "rbac",
    ],
)


# --- Kubernetes definitions -------------------------------------------------------------------


def kubernetes_definitions(version: str = KUBERNETES_VERSION) -> dict[str, Any]:
    """The strict (closed-object) definitions that kubernetes-validate ships for ``version``."""
    import kubernetes_validate  # a dev dependency: only the generator and the tests need it

    path = (
        Path(kubernetes_validate.__file__).parent
        / "kubernetes-json-schema"
        / f"v{version}-local-strict"
        / "_definitions.json"
    )
    return json.loads(path.read_text())["$defs"]


def _clean(node: Any) -> Any:
    """Copy one Kubernetes schema node, keeping validation keywords and rewriting ``$ref``s."""
    if isinstance(node, list):
        return [_clean(item) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROPPED_KEYWORDS or key.startswith("x-kubernetes-"):
            continue
        if key == "$ref":
            out[key] = _DEFS + value.rsplit("/", 1)[-1]
        elif key == "properties":
            out[key] = {name: _clean(prop) for name, prop in value.items()}
        else:
            out[key] = _clean(value)
    return out


def _refs(node: Any) -> set[str]:
    if isinstance(node, list):
        return set().union(*(_refs(item) for item in node)) if node else set()
    if not isinstance(node, dict):
        return set()
    found = {node["$ref"].rsplit("/", 1)[-1]} if "$ref" in node else set()
    return found.union(*(_refs(value) for value in node.values()))


def closure(root: Any, available: dict[str, Any]) -> dict[str, Any]:
    """Every definition ``root`` references, directly or through other definitions, cleaned."""
    picked: dict[str, Any] = {}
    pending = sorted(_refs(root))
    while pending:
        name = pending.pop()
        if name in picked:
            continue
        picked[name] = _clean(available[name])
        pending.extend(sorted(_refs(picked[name]) - picked.keys()))
    return dict(sorted(picked.items()))


# --- descriptions from values.yaml ------------------------------------------------------------

_KEY_LINE = re.compile(r"^(?P<indent> *)(?:# )?(?P<key>[A-Za-z][A-Za-z0-9]*):(?: |$)")


class KeyDoc(NamedTuple):
    text: str  # the comment above the key, up to its "Example" line
    example: bool  # whether the comment shows an example


def value_docs(text: str) -> dict[str, KeyDoc]:
    """Map ``a.b.c`` to the comment above that key in values.yaml.

    Keys commented out (optional keys without a default) are found too: the first ``# key:`` line
    right after an "Example:" line. Later lines of a multi-line example are not keys of their own.
    """
    docs: dict[str, KeyDoc] = {}
    stack: list[tuple[int, str]] = []  # (indent, key) of the enclosing sections
    comment: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            comment = []
            continue
        commented = stripped.startswith("#")
        match = _KEY_LINE.match(line)
        if match and commented and (not comment or comment[-1] != "Example:"):
            match = None  # prose or an example's body, not an optional key
        if match:
            indent = len(match["indent"])
            while stack and stack[-1][0] >= indent:
                stack.pop()
            path = ".".join([*(k for _, k in stack), match["key"]])
            prose = list(itertools.takewhile(lambda c: not c.startswith("Example"), comment))
            doc = KeyDoc(" ".join(prose).strip(), len(prose) < len(comment))
            if commented:
                docs.setdefault(path, doc)
                comment.append("(example body)")
            else:
                docs[path] = doc
                stack.append((indent, match["key"]))
                comment = []
            continue
        if commented:
            body = stripped.lstrip("#").strip()
            if body and not set(body) <= set("+-| ") and not body.startswith("| "):
                comment.append(body)
    return docs


def _describe(schema: dict[str, Any], docs: dict[str, str], prefix: str = "") -> None:
    for name, prop in schema.get("properties", {}).items():
        path = f"{prefix}{name}"
        if path not in docs:
            raise SystemExit(f"values.yaml documents no key {path!r}; add it (commented out if optional)")
        prop["description"] = docs[path].text
        _describe(prop, docs, path + ".")


def generate() -> dict[str, Any]:
    values = json.loads(json.dumps(VALUES))
    _describe(values, value_docs(VALUES_FILE.read_text()))
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": "Values of the maru-operator chart",
        **values,
        "definitions": closure(values, kubernetes_definitions()),
    }


def render() -> str:
    return json.dumps(generate(), indent=2, sort_keys=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when values.schema.json is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not SCHEMA_FILE.exists() or SCHEMA_FILE.read_text() != text:
            print(f"{SCHEMA_FILE.name} is stale: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    SCHEMA_FILE.write_text(text)
    print(f"wrote {SCHEMA_FILE.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
