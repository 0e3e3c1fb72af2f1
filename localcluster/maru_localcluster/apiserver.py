"""A Kubernetes API emulator for tests, served over real HTTP on loopback.

It subclasses ``kmock.KubernetesEmulator`` (for its handler lifecycle) but replaces its request
parsing and object store with ones that behave like a real kube-apiserver where our operator,
kopf, kubectl and helm can tell the difference: uids, a global resourceVersion, generation,
creationTimestamp, the status and scale subresources, finalizers and deletionTimestamp,
label/field selectors, watches resumable from a resourceVersion without gaps (410 once compacted),
CRD registration with discovery (short names, categories, printer columns as server-side Tables),
ownerReference garbage collection, namespace termination, the server-side defaults of the
built-in workload kinds (``defaults.py``), CRD schema pruning, defaulting, validation and CEL rules
(switchable; an update may keep an unchanged top-level field that no longer validates, as
validation ratcheting allows), strict field validation when asked (kubectl's default),
merge/strategic-merge/JSON patches, server-side apply with field ownership in managedFields
(``fieldmanager.py``: removal of fields a manager stops applying, conflicts and force), ``metadata.uid``
in a write as a precondition (with kube-apiserver's 409 and 422 answers), dry runs,
history compaction on demand (watches resumed from before it get 410 Gone), bearer-token
authentication (registered tokens, and service account tokens from the TokenRequest API) with RBAC
from the stored roles and bindings, escalation prevention and
OwnerReferencesPermissionEnforcement (``authz.py``; requests without a token act as an admin), and the
protobuf bodies kubectl's ``create`` generators and helm send.

Not emulated: admission webhooks, impersonation, pagination (lists are never chunked), foreground
deletion (treated as background), watch bookmarks, CRD version conversion (all versions share one
storage), protobuf bodies of kinds other than Namespace/ConfigMap/Secret/ServiceAccount/DeleteOptions,
and every controller and kubelet (they live in ``controllers.py``, ``scheduler.py`` and ``kubelet.py``;
``simcontrollers.py`` only fakes status and EndpointSlices for tests that run no pods).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import contextvars
import copy
import dataclasses
import datetime
import itertools
import json
import re
import time
import traceback
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import jsonschema
import kmock
import yaml
from typing_extensions import override

from maru_localcluster import authz, defaults, fieldmanager, protobuf, validation

try:
    import orjson as _orjson
except ImportError:  # the plain copy below does the same, slower
    _orjson = None  # type: ignore[assignment]

JsonObj = dict[str, Any]
# A mutating admission step (the local cluster's ServiceAccount and Priority plugins are such steps):
# (resource type, new object, old object or None on create) -> the object to store; raise ApiError to refuse.
Admission = Callable[["ResourceType", JsonObj, "JsonObj | None"], JsonObj]
# Serves GET pods/<name>/log: (pod, query) -> the log text, or None when there is none.
PodLogReader = Callable[[JsonObj, dict[str, str]], "str | None"]

# The fieldValidation of the request being served (Strict, Warn or Ignore; only Strict acts).
_FIELD_VALIDATION: contextvars.ContextVar[str] = contextvars.ContextVar("field_validation", default="Ignore")
# Who writes (managedFields): the request's fieldManager, else its User-Agent up to the first '/'.
DIRECT_MANAGER = "localcluster"
_FIELD_MANAGER: contextvars.ContextVar[str] = contextvars.ContextVar("field_manager", default=DIRECT_MANAGER)
_FIELD_MANAGER_GIVEN: contextvars.ContextVar[bool] = contextvars.ContextVar("field_manager_given", default=True)
# Who sent the request being served (by bearer token); None: no token, a cluster admin (see authz.py).
_USER: contextvars.ContextVar[authz.User | None] = contextvars.ContextVar("user", default=None)
_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_DNS1123_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1035_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_LABEL_NAME_RE = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


def label_errors(labels: Any) -> list[str]:
    """What kube-apiserver would reject in a label map (keys: [prefix/]name, values: <=63 chars)."""
    errors = []
    for key, value in (labels or {}).items():
        prefix, _, name = key.rpartition("/")
        if (
            (prefix and (len(prefix) > 253 or not _NAME_RE.match(prefix)))
            or len(name) > 63
            or not _LABEL_NAME_RE.match(name)
        ):
            errors.append(
                f'metadata.labels: Invalid value: "{key}": name part must consist of alphanumeric '
                f"characters, '-', '_' or '.', at most 63, with an optional DNS subdomain prefix"
            )
        if not isinstance(value, str) or len(value) > 63 or (value and not _LABEL_NAME_RE.match(value)):
            errors.append(
                f'metadata.labels: Invalid value: "{value}": a valid label must be an empty string '
                f"or consist of at most 63 alphanumeric characters, '-', '_' or '.', and must "
                f"start and end with an alphanumeric character"
            )
    return errors


_ABSENT = object()
_ALL_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]


class ApiError(Exception):
    """An error rendered as a Kubernetes ``Status`` body."""

    def __init__(self, code: int, reason: str, message: str, details: JsonObj | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details or {}

    def status(self) -> JsonObj:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "details": self.details,
            "code": self.code,
        }


def _not_found(rt: ResourceType, name: str) -> ApiError:
    resource = f"{rt.plural}.{rt.group}" if rt.group else rt.plural
    return ApiError(
        404, "NotFound", f'{resource} "{name}" not found', {"name": name, "group": rt.group, "kind": rt.plural}
    )


@dataclasses.dataclass
class ResourceType:
    group: str
    versions: list[str]
    plural: str
    singular: str
    kind: str
    namespaced: bool
    short_names: list[str] = dataclasses.field(default_factory=list)
    categories: list[str] = dataclasses.field(default_factory=list)
    status: bool = False  # has the /status subresource
    scale: JsonObj | None = None  # the /scale subresource's paths, as in a CRD
    schemas: dict[str, JsonObj] = dataclasses.field(default_factory=dict)  # version -> openAPIV3Schema
    custom: bool = False  # served because of a CRD
    columns: dict[str, list[JsonObj]] = dataclasses.field(default_factory=dict)  # additionalPrinterColumns

    @property
    def key(self) -> tuple[str, str]:
        return (self.group, self.plural)

    @property
    def storage_version(self) -> str:
        return self.versions[0]

    def api_version(self, version: str | None = None) -> str:
        version = version or self.storage_version
        return f"{self.group}/{version}" if self.group else version

    def discovery(self) -> list[JsonObj]:
        main = {
            "name": self.plural,
            "singularName": self.singular,
            "namespaced": self.namespaced,
            "kind": self.kind,
            "verbs": list(_ALL_VERBS),
        }
        if self.short_names:
            main["shortNames"] = list(self.short_names)
        if self.categories:
            main["categories"] = list(self.categories)
        result = [main]
        if self.status:
            result.append(
                {
                    "name": f"{self.plural}/status",
                    "singularName": "",
                    "namespaced": self.namespaced,
                    "kind": self.kind,
                    "verbs": ["get", "patch", "update"],
                }
            )
        if self.scale:
            result.append(
                {
                    "name": f"{self.plural}/scale",
                    "singularName": "",
                    "namespaced": self.namespaced,
                    "group": "autoscaling",
                    "version": "v1",
                    "kind": "Scale",
                    "verbs": ["get", "patch", "update"],
                }
            )
        return result


def _builtin(
    group: str,
    version: str,
    plural: str,
    kind: str,
    namespaced: bool = True,
    *,
    short: Iterable[str] = (),
    cats: Iterable[str] = (),
    status: bool = False,
    scale: JsonObj | None = None,
) -> ResourceType:
    return ResourceType(
        group=group,
        versions=[version],
        plural=plural,
        singular=kind.lower(),
        kind=kind,
        namespaced=namespaced,
        short_names=list(short),
        categories=list(cats),
        status=status,
        scale=scale,
    )


_SCALE = {
    "specReplicasPath": ".spec.replicas",
    "statusReplicasPath": ".status.replicas",
    "labelSelectorPath": ".spec.selector",
}


BUILTIN_RESOURCES: list[ResourceType] = [
    _builtin("", "v1", "namespaces", "Namespace", False, short=["ns"], status=True),
    _builtin("", "v1", "nodes", "Node", False, short=["no"], status=True),
    _builtin("", "v1", "pods", "Pod", short=["po"], cats=["all"], status=True),
    _builtin("", "v1", "services", "Service", short=["svc"], cats=["all"], status=True),
    _builtin("", "v1", "endpoints", "Endpoints", short=["ep"]),
    _builtin("", "v1", "configmaps", "ConfigMap", short=["cm"]),
    _builtin("", "v1", "secrets", "Secret"),
    _builtin("", "v1", "serviceaccounts", "ServiceAccount", short=["sa"]),
    _builtin("", "v1", "events", "Event", short=["ev"]),
    _builtin("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", short=["pvc"], status=True),
    _builtin("events.k8s.io", "v1", "events", "Event", short=["ev"]),
    _builtin("apps", "v1", "deployments", "Deployment", short=["deploy"], cats=["all"], status=True, scale=_SCALE),
    _builtin("apps", "v1", "daemonsets", "DaemonSet", short=["ds"], cats=["all"], status=True),
    _builtin("apps", "v1", "statefulsets", "StatefulSet", short=["sts"], cats=["all"], status=True, scale=_SCALE),
    _builtin("apps", "v1", "replicasets", "ReplicaSet", short=["rs"], cats=["all"], status=True, scale=_SCALE),
    _builtin("batch", "v1", "jobs", "Job", cats=["all"], status=True),
    _builtin("rbac.authorization.k8s.io", "v1", "roles", "Role"),
    _builtin("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding"),
    _builtin("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", False),
    _builtin("rbac.authorization.k8s.io", "v1", "clusterrolebindings", "ClusterRoleBinding", False),
    _builtin("coordination.k8s.io", "v1", "leases", "Lease"),
    _builtin(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        False,
        short=["crd", "crds"],
        cats=["api-extensions"],
        status=True,
    ),
    _builtin("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", short=["pdb"], status=True),
    _builtin("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", short=["netpol"]),
    _builtin("discovery.k8s.io", "v1", "endpointslices", "EndpointSlice"),
    _builtin("scheduling.k8s.io", "v1", "priorityclasses", "PriorityClass", False, short=["pc"]),
    _builtin("storage.k8s.io", "v1", "csidrivers", "CSIDriver", False),
    _builtin("storage.k8s.io", "v1", "storageclasses", "StorageClass", False, short=["sc"]),
    _builtin(
        "autoscaling",
        "v2",
        "horizontalpodautoscalers",
        "HorizontalPodAutoscaler",
        short=["hpa"],
        cats=["all"],
        status=True,
    ),
]

# Strategic-merge-patch keys of lists merged element-wise (the rest are replaced, as in k8s).
_SMP_MERGE_KEYS: dict[str, str] = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "imagePullSecrets": "name",
    "conditions": "type",
    "ownerReferences": "uid",
    "hostAliases": "ip",
    "topologySpreadConstraints": "topologyKey",
    "resourceClaims": "name",
}
_SMP_PRIMITIVE_MERGE = {"finalizers"}


# -------------------------------------------------------------------------------------------------
# Selectors


@dataclasses.dataclass(frozen=True)
class _Req:
    key: str
    op: str  # '=', '!=', 'in', 'notin', 'exists', '!'
    values: tuple[str, ...] = ()


def parse_label_selector(text: str | None) -> list[_Req]:
    if not text:
        return []
    reqs: list[_Req] = []
    # Commas inside "in (a,b)" must not split the requirements.
    for part in re.split(r",(?![^()]*\))", text):
        part = part.strip()
        if not part:
            continue
        if m := re.fullmatch(r"([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)", part):
            values = tuple(v.strip() for v in m.group(3).split(",") if v.strip())
            reqs.append(_Req(m.group(1), m.group(2), values))
        elif m := re.fullmatch(r"([\w./-]+)\s*(==|=|!=)\s*([\w.-]*)", part):
            reqs.append(_Req(m.group(1), "!=" if m.group(2) == "!=" else "=", (m.group(3),)))
        elif m := re.fullmatch(r"!\s*([\w./-]+)", part):
            reqs.append(_Req(m.group(1), "!"))
        elif m := re.fullmatch(r"[\w./-]+", part):
            reqs.append(_Req(part, "exists"))
        else:
            raise ApiError(400, "BadRequest", f"unable to parse requirement: {part!r}")
    return reqs


def parse_field_selector(text: str | None) -> list[_Req]:
    if not text:
        return []
    reqs: list[_Req] = []
    for part in text.split(","):
        if m := re.fullmatch(r"\s*([\w.]+)\s*(==|=|!=)\s*(.*?)\s*", part):
            reqs.append(_Req(m.group(1), "!=" if m.group(2) == "!=" else "=", (m.group(3),)))
        elif part.strip():
            raise ApiError(400, "BadRequest", f"invalid field selector: {part!r}")
    return reqs


def _match_reqs(values: dict[str, str], reqs: list[_Req]) -> bool:
    for r in reqs:
        present = r.key in values
        val = values.get(r.key)
        if r.op == "=":
            ok = present and val == r.values[0]
        elif r.op == "!=":
            ok = not present or val != r.values[0]
        elif r.op == "in":
            ok = present and val in r.values
        elif r.op == "notin":
            ok = not present or val not in r.values
        elif r.op == "exists":
            ok = present
        else:
            ok = not present
        if not ok:
            return False
    return True


def _field_value(obj: JsonObj, path: str) -> str | None:
    cur: Any = obj
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    if cur is None:
        return None
    if isinstance(cur, bool):
        return "true" if cur else "false"
    return str(cur)


def match_selectors(obj: JsonObj, labels: list[_Req], fields: list[_Req]) -> bool:
    if labels and not _match_reqs(obj.get("metadata", {}).get("labels") or {}, labels):
        return False
    if fields:
        values = {r.key: v for r in fields if (v := _field_value(obj, r.key)) is not None}
        # A missing field compares as an empty string, as kube-apiserver does for e.g. spec.nodeName.
        values = {r.key: values.get(r.key, "") for r in fields}
        if not _match_reqs(values, fields):
            return False
    return True


# -------------------------------------------------------------------------------------------------
# Patching


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return _clone(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            result.pop(k, None)
        else:
            result[k] = merge_patch(result.get(k), v)
    return result


def _smp_list_key(field: str, items: list[Any]) -> str | None:
    if field == "ports":
        # Container ports merge by containerPort, Service ports by port.
        return "containerPort" if any(isinstance(i, dict) and "containerPort" in i for i in items) else "port"
    return _SMP_MERGE_KEYS.get(field)


def strategic_merge_patch(target: Any, patch: Any, field: str = "") -> Any:
    """A strategic merge patch with the patch strategies of the fields our kinds use."""
    if not isinstance(patch, dict):
        return _clone(patch)
    if patch.get("$patch") == "replace":
        return {k: _clone(v) for k, v in patch.items() if k != "$patch"}
    if patch.get("$patch") == "delete":
        return None
    result = dict(target) if isinstance(target, dict) else {}
    retain = patch.get("$retainKeys")
    for k, v in patch.items():
        if k in ("$patch", "$retainKeys") or k.startswith("$setElementOrder/"):
            continue
        if k.startswith("$deleteFromPrimitiveList/"):
            name = k.split("/", 1)[1]
            result[name] = [x for x in result.get(name) or [] if x not in v]
            continue
        if v is None:
            result.pop(k, None)
        elif isinstance(v, list):
            result[k] = _smp_list(result.get(k), v, k)
        else:
            merged = strategic_merge_patch(result.get(k), v, k)
            if merged is None:
                result.pop(k, None)
            else:
                result[k] = merged
    if isinstance(retain, list):
        result = {k: v for k, v in result.items() if k in retain}
    return result


def _smp_list(current: Any, patch: list[Any], field: str) -> list[Any]:
    current = list(current) if isinstance(current, list) else []
    if field in _SMP_PRIMITIVE_MERGE:
        return current + [x for x in patch if x not in current]
    key = _smp_list_key(field, patch + current)
    if key is None or not all(isinstance(x, dict) for x in patch):
        return [x for x in _clone(patch) if not (isinstance(x, dict) and x.get("$patch"))]
    if any(isinstance(x, dict) and x.get("$patch") == "replace" for x in patch):
        return [x for x in _clone(patch) if not x.get("$patch")]
    result = [x for x in current]
    for item in patch:
        idx = next((i for i, x in enumerate(result) if isinstance(x, dict) and x.get(key) == item.get(key)), None)
        if item.get("$patch") == "delete":
            if idx is not None:
                result.pop(idx)
        elif idx is None:
            result.append(strategic_merge_patch({}, item, field))
        else:
            result[idx] = strategic_merge_patch(result[idx], item, field)
    return result


# -------------------------------------------------------------------------------------------------
# Schemas


def _to_jsonschema(schema: Any) -> Any:
    """Translate OpenAPI v3 structural-schema quirks into plain JSON Schema."""
    if isinstance(schema, list):
        return [_to_jsonschema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _to_jsonschema(v) for k, v in schema.items()}
    if out.pop("x-kubernetes-int-or-string", False):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if out.pop("nullable", False) and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    # OpenAPI's "format" values are not all JSON Schema formats; k8s does not enforce most of them.
    out.pop("format", None)
    return out


_BODY_SCHEMAS: dict[int, tuple[JsonObj, Any]] = {}  # id(a CRD version's schema) -> (it, its body's JSON Schema)


def _body_jsonschema(schema: JsonObj) -> Any:
    """The JSON Schema of a custom resource's body (all but metadata), translated once per stored schema."""
    cached = _BODY_SCHEMAS.get(id(schema))
    if cached is None or cached[0] is not schema:
        body = {**schema, "properties": {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}}
        if len(_BODY_SCHEMAS) >= 64:  # the schemas of emulators long gone (a test session starts many)
            _BODY_SCHEMAS.clear()
        cached = _BODY_SCHEMAS[id(schema)] = (schema, _to_jsonschema(body))
    return cached[1]


def _schema_errors(body: JsonObj, schema: JsonObj, old_body: JsonObj | None) -> list[tuple[list[Any], str]]:
    """(path, message) of each error of a custom resource's ``body`` against its version's ``schema``, by path.

    On an update (``old_body``) only the top-level fields it changes are validated: ratcheting drops the errors
    under the others (and at the root) anyway, and a status write need not walk the whole spec's schema.
    """
    translated = _body_jsonschema(schema)
    if old_body is None:
        found = [
            (list(e.absolute_path), e.message) for e in jsonschema.Draft202012Validator(translated).iter_errors(body)
        ]
    else:
        props = translated.get("properties") or {}
        found = [
            ([key, *e.absolute_path], e.message)
            for key, value in body.items()
            if key in props and old_body.get(key, _ABSENT) != value
            for e in jsonschema.Draft202012Validator(props[key]).iter_errors(value)
        ]
    return sorted(found, key=lambda f: f[0])


def prune(obj: Any, schema: JsonObj | None) -> Any:
    """Drop the fields the structural schema does not know, as kube-apiserver does."""
    if not schema or (schema.get("x-kubernetes-preserve-unknown-fields") and "properties" not in schema):
        return obj
    if isinstance(obj, dict):
        props = schema.get("properties")
        addl = schema.get("additionalProperties")
        preserve = schema.get("x-kubernetes-preserve-unknown-fields", False)
        if props is None and addl is None:
            return obj if preserve or schema.get("type") != "object" else {}
        result = {}
        for k, v in obj.items():
            if props is not None and k in props:
                result[k] = prune(v, props[k])
            elif isinstance(addl, dict):
                result[k] = prune(v, addl)
            elif addl is True or preserve:
                result[k] = v
        return result
    if isinstance(obj, list) and isinstance(schema.get("items"), dict):
        return [prune(x, schema["items"]) for x in obj]
    return obj


def apply_defaults(obj: Any, schema: JsonObj | None) -> None:
    """Fill in the schema's defaults for absent fields, in place, as kube-apiserver does."""
    if not schema:
        return
    if isinstance(obj, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in obj and "default" in sub:
                obj[key] = _clone(sub["default"])
            if key in obj:
                apply_defaults(obj[key], sub)
        addl = schema.get("additionalProperties")
        if isinstance(addl, dict):
            for key, value in obj.items():
                if key not in (schema.get("properties") or {}):
                    apply_defaults(value, addl)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for item in obj:
            apply_defaults(item, schema["items"])


_CEL_PROGRAMS: dict[str, Any] = {}


def _cel_quantity_library() -> dict[str, Any]:
    """Kubernetes' CEL quantity library (k8s.io/apiserver pkg/cel/library/quantity.go, in CRD rules since 1.29):
    ``quantity(s)`` and the comparisons of two quantities; a string that is no quantity fails the rule."""
    from celpy import celtypes

    from maru_operator.quantity import parse_quantity

    class Quantity(celtypes.StringType):
        """A parsed quantity (its value kept exactly, as a Decimal)."""

        value: Any

    def quantity(text: Any) -> Quantity:
        q = Quantity(str(text))
        q.value = parse_quantity(str(text))
        return q

    def compare(a: Quantity, b: Quantity) -> int:
        return (a.value > b.value) - (a.value < b.value)

    return {
        "quantity": quantity,
        "compareTo": lambda a, b: celtypes.IntType(compare(a, b)),
        "isLessThan": lambda a, b: celtypes.BoolType(compare(a, b) < 0),
        "isGreaterThan": lambda a, b: celtypes.BoolType(compare(a, b) > 0),
    }


def _cel_program(rule: str) -> Any:
    import celpy  # imported lazily: only CRDs with x-kubernetes-validations need it

    if rule not in _CEL_PROGRAMS:
        env = celpy.Environment()
        _CEL_PROGRAMS[rule] = env.program(env.compile(rule), functions=_cel_quantity_library())
    return _CEL_PROGRAMS[rule]


# (rule, JSON of the value it judged) -> whether it held. A rule is a pure function of its value: the many objects
# of one kind that share a part (every group's role with the same options) have it judged once. Transition rules
# (oldSelf) are not remembered. Cleared when full.
_CEL_OUTCOMES: dict[tuple[str, str], bool] = {}
CEL_OUTCOMES_MAX = 8192


def _cel_passes(rule: str, value: Any, old: Any) -> bool:
    import celpy

    key = None if "oldSelf" in rule else (rule, json.dumps(value, sort_keys=True, separators=(",", ":")))
    if key is not None and key in _CEL_OUTCOMES:
        return _CEL_OUTCOMES[key]
    activation = {"self": celpy.json_to_cel(value)}
    if key is None:
        activation["oldSelf"] = celpy.json_to_cel(old)
    try:
        result = _cel_program(rule).evaluate(activation)
    except Exception as e:  # a rule that cannot be evaluated fails, as in Kubernetes
        result = e
    passed = result is True or (isinstance(result, celpy.celtypes.BoolType) and bool(result))
    if key is not None:
        if len(_CEL_OUTCOMES) >= CEL_OUTCOMES_MAX:
            _CEL_OUTCOMES.clear()
        _CEL_OUTCOMES[key] = passed
    return passed


def check_cel_rules(
    obj: Any, schema: JsonObj | None, old: Any = None, path: str = "", *, skip_unchanged: bool = False
) -> list[JsonObj]:
    """Evaluate ``x-kubernetes-validations`` (CEL) rules; returns Status causes for the failures.

    Transition rules (those using ``oldSelf``) are checked only on updates, as in Kubernetes.
    ``skip_unchanged``: the rules under a field of ``obj`` equal to the old one are not evaluated (an update's
    ratcheting drops their failures anyway); ``obj``'s own rules always are.
    """
    if not schema or obj is None:
        return []

    causes: list[JsonObj] = []
    if isinstance(obj, dict):
        props = schema.get("properties") or {}
        for key, value in obj.items():
            if skip_unchanged and isinstance(old, dict) and old.get(key, _ABSENT) == value:
                continue
            sub = props.get(key) or (
                schema.get("additionalProperties") if isinstance(schema.get("additionalProperties"), dict) else None
            )
            old_value = old.get(key) if isinstance(old, dict) else None
            causes += check_cel_rules(value, sub, old_value, f"{path}.{key}" if path else key)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(obj):
            causes += check_cel_rules(item, schema["items"], None, f"{path}[{i}]")
    for rule in schema.get("x-kubernetes-validations") or []:
        text = rule["rule"]
        if "oldSelf" in text and old is None:
            continue
        if not _cel_passes(text, obj, old):
            field = path + (rule.get("fieldPath") or "")
            causes.append(
                {
                    "reason": rule.get("reason", "FieldValueInvalid"),
                    "message": rule.get("message") or f"failed rule: {text}",
                    "field": field.lstrip(".") or "<root>",
                }
            )
    return causes


def _dropped_fields(before: Any, after: Any, path: str = "") -> list[str]:
    if isinstance(before, dict) and isinstance(after, dict):
        result = []
        for k, v in before.items():
            sub = f"{path}.{k}" if path else k
            result += [sub] if k not in after else _dropped_fields(v, after[k], sub)
        return result
    if isinstance(before, list) and isinstance(after, list):
        return [
            f
            for i, (b, a) in enumerate(zip(before, after, strict=False))
            for f in _dropped_fields(b, a, f"{path}[{i}]")
        ]
    return []


def _json_path(path: Iterable[Any]) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out.lstrip(".")


# -------------------------------------------------------------------------------------------------
# Requests: recording and fault injection


@dataclasses.dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str
    query: dict[str, str]
    content_type: str
    timestamp: float  # time.monotonic()
    status: int | None = None
    user: str | None = None  # who sent it (by bearer token); None: no token
    created: str | None = None  # the name of the object a create made (with generateName, the server's pick)

    @property
    def is_write(self) -> bool:
        return self.method in ("POST", "PUT", "PATCH", "DELETE")

    @property
    def is_watch(self) -> bool:
        return self.query.get("watch") in ("true", "1")


@dataclasses.dataclass
class Fault:
    """What happens to the next ``times`` requests matching (method, path, user).

    In order: wait ``delay`` seconds (a slow server), run ``action`` (a write landing between a
    client's read and its write), then answer ``status`` as a Status body, or, with ``status`` None,
    serve the request as usual.
    """

    methods: frozenset[str] | None  # None: any method
    path: re.Pattern[str]
    status: int | None
    times: int  # how many more requests it applies to
    message: str = "injected fault"
    hits: int = 0
    delay: float = 0.0
    action: Callable[[], None] | None = None
    user: str | None = None  # only this user's requests (by bearer token); None: anyone's

    def matches(self, method: str, path: str, user: str | None = None) -> bool:
        return (
            (self.methods is None or method in self.methods)
            and bool(self.path.search(path))
            and (self.user is None or self.user == user)
        )


@dataclasses.dataclass(eq=False)
class _Watcher:
    rt: ResourceType
    version: str
    namespace: str | None
    labels: list[_Req]
    fields: list[_Req]
    path: str
    queue: asyncio.Queue[JsonObj | None] = dataclasses.field(default_factory=asyncio.Queue)


@dataclasses.dataclass
class _LoggedEvent:
    rv: int
    type: str
    rt_key: tuple[str, str]
    obj: JsonObj
    old: JsonObj | None


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _clone(value: Any) -> Any:
    """A deep copy of JSON (dicts, lists and immutable scalars).

    Every read and write of the emulator copies objects; this is several times cheaper than copy.deepcopy,
    which at a few thousand objects was most of the emulator's time in the operator's scale benchmark.
    Through orjson where it is installed: its round trip is another 3-4x cheaper. What it cannot encode
    (integers beyond 64 bits, keys that are not strings) is copied here.
    """
    if _orjson is not None and isinstance(value, (dict, list)):
        try:
            return _orjson.loads(_orjson.dumps(value))
        except _orjson.JSONEncodeError:
            pass
    return _copy_json(value)


def _copy_json(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_json(v) for v in value]
    return value


StoreKey = tuple[str, str, str | None, str]  # (group, plural, namespace, name)


class _Store(dict[StoreKey, JsonObj]):
    """The objects by key, with the keys of each resource type at hand: a list reads its own type's
    objects instead of every object of the cluster (tens of thousands in a scale test)."""

    def __init__(self) -> None:
        super().__init__()
        self._types: dict[tuple[str, str], dict[StoreKey, None]] = collections.defaultdict(dict)

    def of_type(self, key: tuple[str, str]) -> dict[StoreKey, None]:
        return self._types.get(key) or {}

    def __setitem__(self, key: StoreKey, value: JsonObj) -> None:
        super().__setitem__(key, value)
        self._types[key[:2]][key] = None

    def __delitem__(self, key: StoreKey) -> None:
        super().__delitem__(key)
        self._types[key[:2]].pop(key, None)

    def pop(self, key: StoreKey, *default: Any) -> Any:  # type: ignore[override]
        if key in self:
            self._types[key[:2]].pop(key, None)
        return super().pop(key, *default)


@attrs.define(kw_only=True)
class Emulator(kmock.KubernetesEmulator):
    """The emulator; all state lives in, and is changed on, the event loop that serves it."""

    validate_schemas: bool = True  # validate & prune custom resources against their CRD's schema
    event_log_size: int = 10000  # watch resumption older than this many changes gets 410 Gone
    # Pods bound to a node are deleted in two steps, as kube-apiserver does: DELETE sets
    # deletionTimestamp and the node's kubelet removes the object (grace 0) once its containers
    # stopped. Only for a cluster that runs kubelets: without one, such pods would never go.
    graceful_pod_deletion: bool = False
    admission: list[Admission] = attrs.field(factory=list)  # run on every write, after defaulting
    service_ip_allocator: Callable[[], str] | None = None  # clusterIPs from here instead of 10.96.0.0/12
    pod_log_reader: PodLogReader | None = None  # serves pods/<name>/log (kubectl logs)

    _types: dict[tuple[str, str], ResourceType] = attrs.field(factory=dict, init=False)
    _store: _Store = attrs.field(factory=lambda: _Store(), init=False)
    _uids: dict[str, tuple[str, str, str | None, str]] = attrs.field(factory=dict, init=False)
    _rv: int = attrs.field(default=0, init=False)
    _log: collections.deque[_LoggedEvent] = attrs.field(factory=collections.deque, init=False)
    _log_floor: int = attrs.field(default=0, init=False)  # the newest rv that fell out of the log
    _watchers: set[_Watcher] = attrs.field(factory=set, init=False)
    faults: list[Fault] = attrs.field(factory=list, init=False)
    request_log: list[RecordedRequest] = attrs.field(factory=list, init=False)
    _stopping: bool = attrs.field(default=False, init=False)
    tokens: dict[str, authz.User] = attrs.field(factory=dict, init=False)  # bearer token -> user
    token_issuer: authz.TokenIssuer = attrs.field(factory=authz.TokenIssuer, init=False)
    authorizer: authz.Authorizer = attrs.field(init=False)
    _change_waiters: list[asyncio.Future[None]] = attrs.field(factory=list, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for rt in BUILTIN_RESOURCES:
            self._types[rt.key] = copy.deepcopy(rt)
        for ns in ("default", "kube-system", "kube-public", "kube-node-lease"):
            self.create_object("", "namespaces", None, {"metadata": {"name": ns}})
        self.authorizer = authz.Authorizer(self.list_objects, self.get_object)

    def add_token(self, token: str, user: authz.User) -> None:
        """Requests carrying ``Authorization: Bearer <token>`` are ``user``'s, held to RBAC."""
        self.tokens[token] = user

    def authenticate(self, token: str) -> authz.User | None:
        """The user of a bearer token: a registered one, or a service account token this server issued
        whose ServiceAccount (and bound pod) still exist as they were; None otherwise."""
        if token in self.tokens:
            return self.tokens[token]
        claims = self.token_issuer.claims(token)
        if claims is None:
            return None
        private = claims.get("kubernetes.io") or {}
        namespace, account = private.get("namespace"), private.get("serviceaccount") or {}
        sa = self.get_object("", "serviceaccounts", namespace, account.get("name", ""))
        if sa is None or sa["metadata"].get("uid") != account.get("uid"):
            return None
        if bound := private.get("pod"):
            pod = self.get_object("", "pods", namespace, bound.get("name", ""))
            if pod is None or pod["metadata"].get("uid") != bound.get("uid"):
                return None
        return authz.User.service_account(namespace, account["name"])

    def request_token(self, namespace: str, account: str, request: JsonObj) -> JsonObj:
        """The TokenRequest API (``POST serviceaccounts/<name>/token``): a token for the ServiceAccount."""
        sa = self.get_object("", "serviceaccounts", namespace, account)
        if sa is None:
            raise _not_found(self.resource_type("", "serviceaccounts"), account)
        spec = dict(request.get("spec") or {})
        expiration = int(spec.get("expirationSeconds") or 3600)
        if expiration < 600:
            raise ApiError(
                422,
                "Invalid",
                "TokenRequest.authentication.k8s.io is invalid: spec.expirationSeconds: "
                "Invalid value: may not specify a duration less than 10 minutes",
            )
        pod = None
        if ref := spec.get("boundObjectRef"):
            if ref.get("kind") != "Pod":
                raise ApiError(422, "Invalid", f"cannot bind a token to a {ref.get('kind')}: only Pods are supported")
            pod = self.get_object("", "pods", namespace, ref.get("name", ""))
            if pod is None or (ref.get("uid") and pod["metadata"].get("uid") != ref["uid"]):
                raise ApiError(404, "NotFound", f'pods "{ref.get("name")}" not found (or its uid differs)')
        audiences = list(spec.get("audiences") or [])
        token, expiry = self.token_issuer.issue(sa, audiences, expiration, pod)
        stamp = datetime.datetime.fromtimestamp(expiry, tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "metadata": {"name": account, "namespace": namespace, "creationTimestamp": _now()},
            "spec": {**spec, "audiences": audiences or [authz.API_AUDIENCE], "expirationSeconds": expiration},
            "status": {"token": token, "expirationTimestamp": stamp},
        }

    # ---------------------------------------------------------------------------------------------
    # Public, synchronous API (call it on the emulator's loop; the fixture marshals calls there).

    @property
    def resource_version(self) -> int:
        return self._rv

    def resource_type(self, group: str, plural: str) -> ResourceType:
        try:
            return self._types[(group, plural)]
        except KeyError:
            raise ApiError(
                404, "NotFound", f"the server could not find the requested resource ({plural}.{group})"
            ) from None

    def resource_types(self) -> list[ResourceType]:
        return list(self._types.values())

    def find_type(self, api_version: str, kind: str) -> ResourceType:
        group = api_version.rpartition("/")[0] if "/" in api_version else ""
        for rt in self._types.values():
            if rt.group == group and rt.kind == kind:
                return rt
        raise ApiError(404, "NotFound", f'no matches for kind "{kind}" in version "{api_version}"')

    def get_object(self, group: str, plural: str, namespace: str | None, name: str) -> JsonObj | None:
        rt = self.resource_type(group, plural)
        obj = self._store.get((group, plural, namespace if rt.namespaced else None, name))
        return _clone(obj) if obj is not None else None

    def list_objects(
        self,
        group: str,
        plural: str,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> list[JsonObj]:
        rt = self.resource_type(group, plural)
        labels, fields = parse_label_selector(label_selector), parse_field_selector(field_selector)
        return [_clone(o) for o in self._iter(rt, namespace) if match_selectors(o, labels, fields)]

    def create_object(
        self,
        group: str,
        plural: str,
        namespace: str | None,
        body: JsonObj,
        *,
        dry_run: bool = False,
        manager: str | None = None,
        managed: list[fieldmanager.Entry] | None = None,
    ) -> JsonObj:
        """Create ``body``; ``managed``: the field owners when the create is an apply (else an Update)."""
        rt = self.resource_type(group, plural)
        obj = _clone(body)
        meta = obj.setdefault("metadata", {})
        obj["apiVersion"] = rt.api_version(_version_of(obj, rt))
        obj["kind"] = rt.kind
        if rt.namespaced:
            namespace = namespace or meta.get("namespace")
            if not namespace:
                raise ApiError(400, "BadRequest", "the namespace of the object is not specified")
            if meta.get("namespace") not in (None, namespace):
                raise ApiError(
                    400,
                    "BadRequest",
                    "the namespace of the provided object does not match the namespace sent on the request",
                )
            meta["namespace"] = namespace
            ns = self._store.get(("", "namespaces", None, namespace))
            if ns is None:
                raise ApiError(
                    404, "NotFound", f'namespaces "{namespace}" not found', {"name": namespace, "kind": "namespaces"}
                )
            if ns["metadata"].get("deletionTimestamp"):
                raise ApiError(
                    403,
                    "Forbidden",
                    f"unable to create new content in namespace {namespace} because it is being terminated",
                )
        else:
            namespace = None
            meta.pop("namespace", None)
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        name = meta.get("name")
        if not name:
            raise _invalid(rt, "", "metadata.name", "name or generateName is required")
        if rt.key in (("", "services"), ("", "namespaces")):
            # Services need an RFC 1035 label (a DNS name), namespaces an RFC 1123 label: no dots.
            pattern = _DNS1035_RE if rt.plural == "services" else _DNS1123_LABEL_RE
            if not pattern.match(name) or len(name) > 63:
                raise _invalid(
                    rt,
                    name,
                    "metadata.name",
                    f'Invalid value: "{name}": a DNS label must consist '
                    f"of at most 63 lower case alphanumeric characters "
                    f"or '-'" + (", start with a letter" if rt.plural == "services" else ""),
                )
        elif not _NAME_RE.match(name) or len(name) > 253:
            raise _invalid(
                rt,
                name,
                "metadata.name",
                f'Invalid value: "{name}": a lowercase RFC 1123 '
                f"subdomain must consist of lower case alphanumeric "
                f"characters, '-' or '.'",
            )
        key = (rt.group, rt.plural, namespace, name)
        if key in self._store:
            resource = f"{rt.plural}.{rt.group}" if rt.group else rt.plural
            raise ApiError(
                409,
                "AlreadyExists",
                f'{resource} "{name}" already exists',
                {"name": name, "group": rt.group, "kind": rt.plural},
            )
        for fld in (
            "uid",
            "resourceVersion",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "managedFields",
            "selfLink",
        ):
            meta.pop(fld, None)
        if rt.status and rt.key != ("", "nodes"):  # status is the controllers' to write (kubelet's for nodes)
            obj.pop("status", None)
        for ref in meta.get("ownerReferences") or []:
            if not ref.get("uid"):
                raise _invalid(rt, name, "metadata.ownerReferences.uid", 'Invalid value: "": uid must not be empty')
        self._admit_requester(rt, obj, None)
        obj = self._admit(rt, obj, None, name)
        meta = obj["metadata"]
        if managed is None:
            # After defaulting, as kube-apiserver: its decoder defaults the body before the create handler's
            # field manager sees it (k8s.io/apiserver pkg/endpoints/handlers create.go createHandler:
            # scope.FieldManager.UpdateNoErrors on the decoded, defaulted object), so the server's defaults
            # (a Deployment's strategy, a container's terminationMessagePath) are owned by the creator.
            managed = fieldmanager.track_update(
                None, obj, self._shape(rt, obj), manager or _FIELD_MANAGER.get(), obj["apiVersion"]
            )
        self._set_managed(meta, managed, [])
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = _now()
        meta["generation"] = 1
        if dry_run:
            meta["resourceVersion"] = str(self._rv)
            return obj
        self._rv += 1
        meta["resourceVersion"] = str(self._rv)
        self._store[key] = obj
        self._uids[meta["uid"]] = key
        self._emit("ADDED", rt, obj, None)
        if rt.key == ("apiextensions.k8s.io", "customresourcedefinitions"):
            self._register_crd(obj)
        refs = meta.get("ownerReferences") or []
        if refs and not any(r.get("uid") in self._uids for r in refs):
            # Created after every owner went (a controller acting on a stale cache): the create succeeds and
            # the garbage collector deletes it soon after, as kube-controller-manager's does.
            try:
                asyncio.get_running_loop().call_soon(self._collect_orphan, key, meta["uid"])
            except RuntimeError:  # driven without a loop (a unit test of the store): at once
                self._collect_orphan(key, meta["uid"])
        return _clone(obj)

    def replace_object(
        self,
        group: str,
        plural: str,
        namespace: str | None,
        name: str,
        body: JsonObj,
        *,
        subresource: str | None = None,
        dry_run: bool = False,
        manager: str | None = None,
    ) -> JsonObj:
        rt = self.resource_type(group, plural)
        key = (rt.group, rt.plural, namespace if rt.namespaced else None, name)
        old = self._store.get(key)
        if old is None:
            raise _not_found(rt, name)
        body = _clone(body)
        want_rv = (body.get("metadata") or {}).get("resourceVersion")
        if rt.custom and not want_rv and subresource is None:
            # As kube-apiserver: custom resources have no unconditional updates.
            raise _invalid(rt, name, "metadata.resourceVersion", "Invalid value: 0x0: must be specified for an update")
        want_uid = (body.get("metadata") or {}).get("uid")
        if want_uid and want_uid != old["metadata"]["uid"]:
            # As kube-apiserver: an update's uid is a storage precondition.
            raise ApiError(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {_qualified(rt)} "{name}": '
                f"Precondition failed: UID in precondition: {want_uid}, UID in object "
                f"meta: {old['metadata']['uid']}",
                {"name": name, "group": rt.group, "kind": rt.plural},
            )
        if want_rv and want_rv != old["metadata"]["resourceVersion"]:
            raise ApiError(
                409,
                "Conflict",
                f"Operation cannot be fulfilled on {rt.plural}.{rt.group} "
                f'"{name}": the object has been modified; please apply your '
                f"changes to the latest version and try again",
                {"name": name, "group": rt.group, "kind": rt.plural},
            )
        return self._commit(rt, key, old, body, subresource, dry_run, manager)

    def patch_object(
        self,
        group: str,
        plural: str,
        namespace: str | None,
        name: str,
        patch: Any,
        content_type: str = "application/merge-patch+json",
        *,
        subresource: str | None = None,
        dry_run: bool = False,
        manager: str | None = None,
        force: bool = False,
    ) -> JsonObj:
        rt = self.resource_type(group, plural)
        key = (rt.group, rt.plural, namespace if rt.namespaced else None, name)
        old = self._store.get(key)
        ctype = content_type.split(";")[0].strip()
        manager = manager or _FIELD_MANAGER.get()
        if ctype == "application/apply-patch+yaml" and subresource is None:
            return self._apply(rt, key, old, patch, manager, force=force, dry_run=dry_run)
        if old is None:
            raise _not_found(rt, name)
        if ctype == "application/merge-patch+json":
            new = merge_patch(old, patch)
        elif ctype == "application/strategic-merge-patch+json":
            if rt.custom:
                # kube-apiserver has no patch strategies for custom resources.
                raise ApiError(
                    415,
                    "UnsupportedMediaType",
                    "the body of the request was in an unknown "
                    "format - accepted media types include: "
                    "application/json-patch+json, "
                    "application/merge-patch+json, "
                    "application/apply-patch+yaml",
                )
            new = strategic_merge_patch(old, patch)
        elif ctype == "application/json-patch+json":
            try:
                new = jsonpatch.apply_patch(old, patch)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
                raise ApiError(
                    422, "Invalid", f"the server rejected our request due to an error in our request: {e}"
                ) from None
        elif ctype == "application/apply-patch+yaml":
            new = merge_patch(old, patch)  # an apply to the status subresource: no field ownership kept
        else:
            raise ApiError(415, "UnsupportedMediaType", f"unsupported patch type: {ctype}")
        if not isinstance(new, dict):
            raise ApiError(400, "BadRequest", "the patch did not produce an object")
        new.setdefault("metadata", {})
        _check_uid(rt, name, new["metadata"], old)
        if new["metadata"].get("resourceVersion") not in (None, old["metadata"]["resourceVersion"]):
            raise ApiError(
                409,
                "Conflict",
                f"Operation cannot be fulfilled on {rt.plural}.{rt.group} "
                f'"{name}": the object has been modified; please apply your '
                f"changes to the latest version and try again",
            )
        return self._commit(rt, key, old, new, subresource, dry_run, manager)

    def _apply(
        self,
        rt: ResourceType,
        key: tuple[str, str, str | None, str],
        old: JsonObj | None,
        config: Any,
        manager: str,
        *,
        force: bool,
        dry_run: bool,
    ) -> JsonObj:
        """Server-side apply: merge the partial ``config``, drop what this manager no longer sets."""
        name = key[3]
        if not isinstance(config, dict):
            raise ApiError(400, "BadRequest", "the applied configuration must be an object")
        if not _FIELD_MANAGER_GIVEN.get():
            raise ApiError(400, "BadRequest", "PATCH with apply needs a fieldManager: use ?fieldManager=NAME")
        meta = config.get("metadata") or {}
        if meta.get("name") not in (None, name):
            raise ApiError(400, "BadRequest", "the name of the applied object does not match the URL")
        if old is not None and meta.get("resourceVersion") not in (None, old["metadata"]["resourceVersion"]):
            raise ApiError(
                409,
                "Conflict",
                f"Operation cannot be fulfilled on {rt.plural}.{rt.group} "
                f'"{name}": the object has been modified; please apply your '
                f"changes to the latest version and try again",
            )
        if meta.get("uid") and old is None:
            # As kube-apiserver's patcher: an apply naming a uid never creates (that object is gone).
            raise ApiError(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {_qualified(rt)} "{name}": uid '
                f"mismatch: the provided object specified uid {meta['uid']}, and no "
                f"existing object was found",
                {"name": name, "group": rt.group, "kind": rt.plural},
            )
        if old is not None:
            _check_uid(rt, name, meta, old)
        api_version = rt.api_version(_version_of(config, rt))
        try:
            merged, entries = fieldmanager.apply(
                old, config, self._shape(rt, config), manager, api_version, force=force
            )
        except fieldmanager.TypedPatchError as e:
            # kube-apiserver answers 500 here (the config cannot be turned into a typed object).
            raise ApiError(
                500,
                "InternalError",
                f"failed to create typed patch object ({key[2] or ''}/{name}; {api_version}, Kind={rt.kind}): {e}",
            ) from None
        except fieldmanager.ConflictError as e:
            causes = [
                {"reason": "FieldManagerConflict", "message": f'conflict with "{m}"', "field": fieldmanager.dotted(p)}
                for m, p in e.conflicts
            ]
            raise ApiError(
                409, "Conflict", e.message, {"name": name, "group": rt.group, "kind": rt.kind, "causes": causes}
            ) from None
        if old is None:
            # An apply that creates is authorized as a create too, as kube-apiserver does.
            self._authorize(authz.Attributes("create", rt.group, rt.plural, "", key[2], name), rt)
            return self.create_object(rt.group, rt.plural, key[2], merged, dry_run=dry_run, managed=entries)
        return self._commit(rt, key, old, merged, None, dry_run, manager, entries)

    def _authorize(self, attrs: authz.Attributes, rt: ResourceType) -> None:
        user = _USER.get()
        if user is not None and not self.authorizer.allowed(user, attrs):
            what = f"{rt.plural}.{rt.group}" if rt.group else rt.plural
            named = f' "{attrs.name}"' if attrs.name else ""
            raise ApiError(
                403,
                "Forbidden",
                f"{what}{named} is forbidden: {attrs.denial(user)}",
                {"name": attrs.name or "", "group": rt.group, "kind": rt.plural},
            )

    def _admit_requester(self, rt: ResourceType, obj: JsonObj, old: JsonObj | None) -> None:
        """The admission checks that depend on who writes (see authz.py); a cluster admin passes."""
        user = _USER.get()
        if user is None:
            return
        meta = obj.get("metadata") or {}
        namespace = meta.get("namespace") if rt.namespaced else None
        what = f"{rt.plural}.{rt.group}" if rt.group else rt.plural
        old_refs = ((old or {}).get("metadata") or {}).get("ownerReferences") or []
        refs = meta.get("ownerReferences") or []
        if old is not None and refs != old_refs:
            # OwnerReferencesPermissionEnforcement: who may change ownership may delete the object.
            self._authorize(authz.Attributes("delete", rt.group, rt.plural, "", namespace, meta.get("name")), rt)
        for ref in refs:
            if not ref.get("blockOwnerDeletion") or any(
                r.get("uid") == ref.get("uid") and r.get("blockOwnerDeletion") for r in old_refs
            ):
                continue
            try:
                owner = self.find_type(ref.get("apiVersion", ""), ref.get("kind", ""))
            except ApiError:
                continue
            attrs = authz.Attributes(
                "update",
                owner.group,
                owner.plural,
                "finalizers",
                namespace if owner.namespaced else None,
                ref.get("name"),
            )
            if not self.authorizer.allowed(user, attrs):
                raise ApiError(
                    403,
                    "Forbidden",
                    f'{what} "{meta.get("name")}" is forbidden: '
                    f"cannot set blockOwnerDeletion if an ownerReference refers to a "
                    f"resource you can't set finalizers on: {attrs.denial(user)}",
                )
        if rt.group == authz.RBAC and rt.plural in ("roles", "clusterroles"):
            escalate = authz.Attributes("escalate", rt.group, rt.plural, "", namespace, meta.get("name"))
            missing = (
                []
                if self.authorizer.allowed(user, escalate)
                else self.authorizer.holds_all(user, obj.get("rules") or [], namespace)
            )
            if missing:
                raise ApiError(
                    403,
                    "Forbidden",
                    f'{what} "{meta.get("name")}" is forbidden: '
                    f'user "{user.name}" is attempting to grant RBAC permissions not '
                    f"currently held: " + "; ".join(missing),
                )
        elif rt.group == authz.RBAC and rt.plural in ("rolebindings", "clusterrolebindings"):
            ref = obj.get("roleRef") or {}
            role_plural = "clusterroles" if ref.get("kind") == "ClusterRole" else "roles"
            # Checked in the binding's namespace, whatever the role's kind (Kubernetes' BindingAuthorized): a
            # RoleBinding may name a ClusterRole that its writer may bind in that namespace.
            bind = authz.Attributes("bind", rt.group, role_plural, "", namespace, ref.get("name"))
            rules = list(self.authorizer.rules_of(ref, namespace))
            if not self.authorizer.allowed(user, bind) and self.authorizer.holds_all(user, rules, namespace):
                raise ApiError(
                    403,
                    "Forbidden",
                    f'{what} "{meta.get("name")}" is forbidden: '
                    f'user "{user.name}" may not bind {ref.get("kind")} '
                    f'"{ref.get("name")}": it holds rights the user does not',
                )

    def _shape(self, rt: ResourceType, obj: JsonObj) -> fieldmanager.Shape:
        return fieldmanager.root_shape(rt.schemas.get(_version_of(obj, rt)) if rt.custom else None)

    @staticmethod
    def _set_managed(meta: JsonObj, entries: list[fieldmanager.Entry], before: list[fieldmanager.Entry]) -> None:
        rendered = fieldmanager.render_entries(entries, before, _now())
        if rendered:
            meta["managedFields"] = rendered
        else:
            meta.pop("managedFields", None)

    def delete_object(
        self,
        group: str,
        plural: str,
        namespace: str | None,
        name: str,
        *,
        propagation: str | None = None,
        preconditions: JsonObj | None = None,
        dry_run: bool = False,
        grace_period: int | None = None,
    ) -> JsonObj:
        rt = self.resource_type(group, plural)
        key = (rt.group, rt.plural, namespace if rt.namespaced else None, name)
        old = self._store.get(key)
        if old is None:
            raise _not_found(rt, name)
        pre = preconditions or {}
        if (pre.get("uid") and pre["uid"] != old["metadata"]["uid"]) or (
            pre.get("resourceVersion") and pre["resourceVersion"] != old["metadata"]["resourceVersion"]
        ):
            raise ApiError(409, "Conflict", f'Precondition failed for {rt.plural} "{name}"')
        if dry_run:
            return _clone(old)
        if propagation == "Orphan":
            self._orphan_dependents(old["metadata"]["uid"])
        return self._delete(rt, key, grace_period)

    def next_change(self) -> asyncio.Future[None]:
        """A future resolved at the next change of any object (or :meth:`poke`)."""
        future = asyncio.get_running_loop().create_future()
        self._change_waiters.append(future)
        return future

    def poke(self) -> None:
        """Wake up whoever waits for a change, e.g. after a test changed what controllers report."""
        waiters, self._change_waiters = self._change_waiters, []
        for future in waiters:
            if not future.done():
                future.set_result(None)

    def _collect_orphan(self, key: tuple[str, str, str | None, str], uid: str) -> None:
        obj = self._store.get(key)
        if obj is None or obj["metadata"]["uid"] != uid or obj["metadata"].get("deletionTimestamp"):
            return
        refs = obj["metadata"].get("ownerReferences") or []
        if refs and not any(r.get("uid") in self._uids for r in refs):
            self._delete(self._types[(key[0], key[1])], key)

    def collect_garbage(self) -> None:
        """Delete the objects whose owners are all gone (k8s does this in the background)."""
        while True:
            victims = []
            for key, obj in list(self._store.items()):
                refs = obj["metadata"].get("ownerReferences") or []
                if refs and obj["metadata"].get("deletionTimestamp") is None:
                    alive = [r for r in refs if r.get("uid") in self._uids]
                    if not alive:
                        victims.append(key)
                    elif len(alive) < len(refs):
                        rt = self._types[(key[0], key[1])]
                        self._commit_internal(
                            rt, key, {**obj, "metadata": {**obj["metadata"], "ownerReferences": alive}}
                        )
            if not victims:
                return
            for key in victims:
                if key in self._store:
                    self._delete(self._types[(key[0], key[1])], key)

    # ---------------------------------------------------------------------------------------------
    # Internals of the store.

    def _iter(self, rt: ResourceType, namespace: str | None) -> Iterator[JsonObj]:
        for key in list(self._store.of_type(rt.key)):
            if (namespace is None or key[2] == namespace) and key in self._store:
                yield self._store[key]

    def _admit(self, rt: ResourceType, obj: JsonObj, old: JsonObj | None, name: str) -> JsonObj:
        if rt.key == ("apiextensions.k8s.io", "customresourcedefinitions"):
            _check_crd(obj)
        if errors := label_errors((obj.get("metadata") or {}).get("labels")):
            raise ApiError(
                422,
                "Invalid",
                f'{rt.kind} "{name}" is invalid: ' + "; ".join(errors),
                {
                    "name": name,
                    "group": rt.group,
                    "kind": rt.kind,
                    "causes": [
                        {"reason": "FieldValueInvalid", "field": "metadata.labels", "message": e} for e in errors
                    ],
                },
            )
        if not rt.custom:
            if rt.key == ("", "services") and self.service_ip_allocator is not None:
                _allocate_cluster_ip(obj, old, self.service_ip_allocator)
            defaults.apply(rt.group, rt.plural, obj, old)
            self._validate_builtin(rt, obj, old, name)
        for step in self.admission:
            obj = step(rt, obj, old)
        if rt.custom and self.validate_schemas:
            version = _version_of(obj, rt)
            schema = rt.schemas.get(version)
            if schema:
                # apiVersion, kind and metadata are never pruned, whatever the schema lists.
                kept = {k: obj[k] for k in ("apiVersion", "kind", "metadata") if k in obj}
                pruned = {**prune(obj, schema), **kept}
                if _FIELD_VALIDATION.get() == "Strict" and (dropped := _dropped_fields(obj, pruned)):
                    # kubectl apply asks for strict field validation by default (--validate=strict).
                    raise ApiError(
                        400,
                        "BadRequest",
                        f'{rt.kind} in version "{version}" cannot be handled as '
                        f"a {rt.kind}: strict decoding error: " + ", ".join(f'unknown field "{f}"' for f in dropped),
                    )
                obj = pruned
                body_schema = {
                    **schema,
                    "properties": {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"},
                }
                checked = {k: v for k, v in obj.items() if k != "metadata"}
                apply_defaults(checked, body_schema)
                obj = {**checked, "metadata": obj.get("metadata", {})}
                old_body = None if old is None else {k: v for k, v in old.items() if k != "metadata"}
                causes = [
                    {"reason": "FieldValueInvalid", "message": message, "field": _json_path(at) or "<root>"}
                    for at, message in _schema_errors(checked, schema, old_body)
                ]
                causes += check_cel_rules(checked, body_schema, old_body, skip_unchanged=old_body is not None)
                if old_body is not None:
                    # Validation ratcheting (GA in 1.33), coarsely: an update may keep a top-level field
                    # (spec, status) that no longer validates as long as it does not change it, so a
                    # status write never fails on a spec stored before a stricter schema. (The CEL rules under
                    # such a field are not even evaluated: a status write costs its status' rules alone.)
                    causes = [
                        c
                        for c in causes
                        if checked.get(top := re.split(r"[.\[]", c["field"])[0], _ABSENT) != old_body.get(top, _ABSENT)
                    ]
                if causes:
                    msg = "; ".join(f"{c['field']}: {c['message']}" for c in causes)
                    raise ApiError(
                        422,
                        "Invalid",
                        f'{rt.kind}.{rt.group} "{name}" is invalid: {msg}',
                        {"name": name, "group": rt.group, "kind": rt.kind, "causes": causes},
                    )
        return obj

    def _validate_builtin(self, rt: ResourceType, obj: JsonObj, old: JsonObj | None, name: str) -> None:
        """kube-apiserver's validation (422), then its validating admission (403), of a built-in kind's write."""
        causes: list[validation.Cause] = []
        if rt.key == ("apps", "deployments"):
            causes = validation.deployment_strategy(obj.get("spec") or {})
        elif rt.key == ("", "persistentvolumeclaims") and old is not None:
            causes = validation.pvc_update(obj, old)
        if causes:
            what = f"{rt.kind}.{rt.group}" if rt.group else rt.kind
            raise ApiError(
                422,
                "Invalid",
                f'{what} "{name}" is invalid: ' + "; ".join(f"{f}: {m}" for f, m in causes),
                {
                    "name": name,
                    "group": rt.group,
                    "kind": rt.kind,
                    "causes": [
                        {"reason": "FieldValue" + m.split(":", 1)[0], "field": f, "message": m} for f, m in causes
                    ],
                },
            )
        if rt.key == ("", "persistentvolumeclaims") and old is not None:
            denied = validation.pvc_resize(obj, old, lambda g, p, ns, n: self._store.get((g, p, ns, n)))
            if denied:
                raise ApiError(
                    403,
                    "Forbidden",
                    f'persistentvolumeclaims "{name}" is forbidden: {denied}',
                    {"name": name, "kind": "persistentvolumeclaims"},
                )

    def _commit(
        self,
        rt: ResourceType,
        key: tuple[str, str, str | None, str],
        old: JsonObj,
        body: JsonObj,
        subresource: str | None,
        dry_run: bool,
        manager: str | None = None,
        managed: list[fieldmanager.Entry] | None = None,
    ) -> JsonObj:
        """Store ``body`` as the new state of ``old``; ``managed``: field owners after an apply."""
        name = key[3]
        if subresource == "status":
            if not rt.status:
                raise ApiError(
                    404, "NotFound", f"the server could not find the requested resource ({rt.plural}/status)"
                )
            new = _clone(old)
            if "status" in body:
                new["status"] = body["status"]
            else:
                new.pop("status", None)
            if rt.key == ("apps", "deployments"):
                # k8s.io/kubernetes pkg/registry/apps/deployment/strategy.go deploymentStatusStrategy
                # PrepareForUpdate resets only the spec and labels: the deployment controller's UpdateStatus sets
                # deployment.kubernetes.io/revision this way, without a new generation.
                annotations = (body.get("metadata") or {}).get("annotations")
                if annotations:
                    new["metadata"]["annotations"] = annotations
                else:
                    new["metadata"].pop("annotations", None)
        elif subresource not in (None, "scale"):
            raise ApiError(
                404, "NotFound", f"the server could not find the requested resource ({rt.plural}/{subresource})"
            )
        else:
            new = body
            if rt.status:
                if "status" in old:
                    new["status"] = _clone(old["status"])
                else:
                    new.pop("status", None)
        meta = new.setdefault("metadata", {})
        old_meta = old["metadata"]
        for fld in (
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "generation",
            "resourceVersion",
            "name",
            "namespace",
        ):
            if fld in old_meta:
                meta[fld] = old_meta[fld]
            else:
                meta.pop(fld, None)
        new["apiVersion"] = rt.api_version(_version_of(new, rt) if "apiVersion" in new else None)
        new["kind"] = rt.kind
        given = meta.get("managedFields")
        if given == [{}]:
            managed = []  # the documented reset: a list holding one empty entry clears all ownership
        elif managed is None and given is not None and given != old_meta.get("managedFields"):
            # A client that changes managedFields sets them (as kubectl's client-side-apply upgrade does).
            managed = [fieldmanager.Entry.parse(e) for e in given if isinstance(e, dict)]
        elif managed is None:
            managed = fieldmanager.track_update(
                old, new, self._shape(rt, new), manager or _FIELD_MANAGER.get(), new["apiVersion"], subresource or ""
            )
        if subresource is None:
            self._admit_requester(rt, new, old)
        new = self._admit(rt, new, old, name)
        self._set_managed(new["metadata"], managed, fieldmanager.entries_of(old))
        if dry_run:
            return new
        return self._commit_internal(rt, key, new, status_write=subresource == "status")

    def _commit_internal(
        self, rt: ResourceType, key: tuple[str, str, str | None, str], new: JsonObj, *, status_write: bool = False
    ) -> JsonObj:
        old = self._store[key]
        if _strip_volatile(new, rt) != _strip_volatile(old, rt) or (
            # k8s.io/kubernetes pkg/registry/apps/deployment/strategy.go PrepareForUpdate: a Deployment's
            # generation also moves when only its annotations change.
            rt.key == ("apps", "deployments")
            and not status_write
            and new["metadata"].get("annotations") != old["metadata"].get("annotations")
        ):
            new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
        if new == old:
            return _clone(old)  # a no-op write changes nothing and notifies nobody
        meta = new["metadata"]
        if meta.get("deletionTimestamp") and not meta.get("finalizers") and not self._kubelet_pending(rt, new):
            self._store[key] = new
            return self._remove(rt, key)
        self._rv += 1
        meta["resourceVersion"] = str(self._rv)
        self._store[key] = new
        self._emit("MODIFIED", rt, new, old)
        if rt.key == ("apiextensions.k8s.io", "customresourcedefinitions"):
            self._register_crd(new)
        return _clone(new)

    def _kubelet_pending(self, rt: ResourceType, obj: JsonObj) -> bool:
        """A terminating pod whose kubelet has not yet confirmed that its containers stopped."""
        return (
            self.graceful_pod_deletion
            and rt.key == ("", "pods")
            and bool(obj["metadata"].get("deletionGracePeriodSeconds"))
        )

    def _terminate_pod(
        self, key: tuple[str, str, str | None, str], obj: JsonObj, grace_period: int | None
    ) -> JsonObj | None:
        """The first step of a graceful pod deletion; None when the pod can go right away."""
        meta = obj["metadata"]
        if not (obj.get("spec") or {}).get("nodeName") or (obj.get("status") or {}).get("phase") in (
            "Succeeded",
            "Failed",
        ):
            return None
        grace = grace_period
        if grace is None:
            grace = meta.get("deletionGracePeriodSeconds") or (obj.get("spec") or {}).get(
                "terminationGracePeriodSeconds", 30
            )
        grace = max(0, int(grace))
        if grace == 0:
            if meta.get("finalizers") and meta.get("deletionGracePeriodSeconds"):
                # Removed as soon as the last finalizer goes, no longer waiting for the kubelet.
                self._commit_internal(
                    self._types[key[:2]], key, {**obj, "metadata": {**meta, "deletionGracePeriodSeconds": 0}}
                )
            return None
        if meta.get("deletionTimestamp") and meta.get("deletionGracePeriodSeconds", grace + 1) <= grace:
            return _clone(obj)  # already terminating with a grace period at least as short
        new = _clone(obj)
        when = datetime.datetime.now(tz=datetime.UTC) + datetime.timedelta(seconds=grace)
        new["metadata"]["deletionTimestamp"] = when.strftime("%Y-%m-%dT%H:%M:%SZ")
        new["metadata"]["deletionGracePeriodSeconds"] = grace
        self._rv += 1
        new["metadata"]["resourceVersion"] = str(self._rv)
        self._store[key] = new
        self._emit("MODIFIED", self._types[key[:2]], new, obj)
        return _clone(new)

    def _delete(
        self, rt: ResourceType, key: tuple[str, str, str | None, str], grace_period: int | None = None
    ) -> JsonObj:
        obj = self._store[key]
        if self.graceful_pod_deletion and rt.key == ("", "pods"):
            terminating = self._terminate_pod(key, obj, grace_period)
            if terminating is not None:
                return terminating
            obj = self._store[key]
        if rt.key == ("", "namespaces"):
            self._terminate_namespace(key[3])
            if key not in self._store:  # removed when its last object went away
                return _clone(obj)
            obj = self._store[key]
            if any(ns == key[3] for (_, _, ns, _) in self._store):
                return _clone(obj)  # Terminating until its objects' finalizers are done
            return self._remove(rt, key)
        if obj["metadata"].get("finalizers"):
            if obj["metadata"].get("deletionTimestamp"):
                return _clone(obj)
            new = _clone(obj)
            new["metadata"]["deletionTimestamp"] = _now()
            new["metadata"]["deletionGracePeriodSeconds"] = 0
            self._rv += 1
            new["metadata"]["resourceVersion"] = str(self._rv)
            new["metadata"]["generation"] = obj["metadata"].get("generation", 1) + 1
            self._store[key] = new
            self._emit("MODIFIED", rt, new, obj)
            return _clone(new)
        return self._remove(rt, key)

    def _remove(self, rt: ResourceType, key: tuple[str, str, str | None, str]) -> JsonObj:
        obj = self._store.pop(key)
        self._uids.pop(obj["metadata"]["uid"], None)
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        self._emit("DELETED", rt, obj, obj)
        if rt.key == ("apiextensions.k8s.io", "customresourcedefinitions"):
            self._unregister_crd(obj)
        self.collect_garbage()
        ns_key = ("", "namespaces", None, key[2])
        if key[2] is not None and ns_key in self._store:
            ns = self._store[ns_key]
            if ns["metadata"].get("deletionTimestamp") and not any(n == key[2] for (_, _, n, _) in self._store):
                self._remove(self._types[("", "namespaces")], ns_key)
        return _clone(obj)

    def _terminate_namespace(self, name: str) -> None:
        key = ("", "namespaces", None, name)
        ns = self._store[key]
        if not ns["metadata"].get("deletionTimestamp"):
            new = _clone(ns)
            new["metadata"]["deletionTimestamp"] = _now()
            new["status"] = {"phase": "Terminating"}
            self._rv += 1
            new["metadata"]["resourceVersion"] = str(self._rv)
            self._store[key] = new
            self._emit("MODIFIED", self._types[("", "namespaces")], new, ns)
        for k in [k for k in self._store if k[2] == name]:
            if k in self._store and not self._store[k]["metadata"].get("deletionTimestamp"):
                self._delete(self._types[(k[0], k[1])], k)

    def _orphan_dependents(self, uid: str) -> None:
        for key, obj in list(self._store.items()):
            refs = obj["metadata"].get("ownerReferences") or []
            if any(r.get("uid") == uid for r in refs):
                kept = [r for r in refs if r.get("uid") != uid]
                meta = {**obj["metadata"], "ownerReferences": kept}
                if not kept:
                    del meta["ownerReferences"]
                self._commit_internal(self._types[(key[0], key[1])], key, {**obj, "metadata": meta})

    def _emit(self, type_: str, rt: ResourceType, obj: JsonObj, old: JsonObj | None) -> None:
        # ``old`` is a version no longer stored, and nothing changes a stored version in place once it is
        # replaced: the log keeps it as it is. ``obj`` is stored, so the log keeps a copy.
        event = _LoggedEvent(self._rv, type_, rt.key, _clone(obj), old)
        self._log.append(event)
        while len(self._log) > self.event_log_size:
            self._log_floor = self._log.popleft().rv
        for w in list(self._watchers):
            if w.rt.key == rt.key and (out := _watch_event(w, event)) is not None:
                w.queue.put_nowait(out)
        self.poke()

    def _register_crd(self, crd: JsonObj) -> None:
        spec = crd["spec"]
        names = spec["names"]
        served = [v for v in spec["versions"] if v.get("served", True)]
        storage = [v["name"] for v in served if v.get("storage")]
        versions = storage + [v["name"] for v in served if v["name"] not in storage]
        self._types[(spec["group"], names["plural"])] = ResourceType(
            group=spec["group"],
            versions=versions,
            plural=names["plural"],
            singular=names.get("singular") or names["kind"].lower(),
            kind=names["kind"],
            namespaced=spec.get("scope", "Namespaced") == "Namespaced",
            short_names=list(names.get("shortNames") or []),
            categories=list(names.get("categories") or []),
            status=any("status" in (v.get("subresources") or {}) for v in served),
            scale=next((v["subresources"]["scale"] for v in served if "scale" in (v.get("subresources") or {})), None),
            schemas={v["name"]: (v.get("schema") or {}).get("openAPIV3Schema") or {} for v in served},
            columns={v["name"]: list(v.get("additionalPrinterColumns") or []) for v in served},
            custom=True,
        )
        status = {
            "acceptedNames": {k: v for k, v in names.items()},
            "storedVersions": storage,
            "conditions": [
                {
                    "type": "NamesAccepted",
                    "status": "True",
                    "reason": "NoConflicts",
                    "message": "no conflicts found",
                    "lastTransitionTime": _now(),
                },
                {
                    "type": "Established",
                    "status": "True",
                    "reason": "InitialNamesAccepted",
                    "message": "the initial names have been accepted",
                    "lastTransitionTime": _now(),
                },
            ],
        }
        key = ("apiextensions.k8s.io", "customresourcedefinitions", None, crd["metadata"]["name"])
        current = self._store[key]
        if (current.get("status") or {}).get("acceptedNames") != status["acceptedNames"]:
            self._commit_internal(self._types[key[:2]], key, {**current, "status": status})

    def _unregister_crd(self, crd: JsonObj) -> None:
        spec = crd["spec"]
        rt = self._types.pop((spec["group"], spec["names"]["plural"]), None)
        if rt is not None:
            for key in [k for k in self._store if k[:2] == rt.key]:
                obj = self._store.pop(key)
                self._uids.pop(obj["metadata"]["uid"], None)
                self._rv += 1
                obj["metadata"]["resourceVersion"] = str(self._rv)
                self._emit("DELETED", rt, obj, obj)
            for w in [w for w in self._watchers if w.rt.key == rt.key]:
                w.queue.put_nowait(None)

    # ---------------------------------------------------------------------------------------------
    # HTTP.

    @override
    async def __call__(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        # kmock's own request parsing and object store are bypassed: its path parser fails on
        # some valid paths (e.g. /api/v1/namespaces) and its store lacks what this class adds.
        await raw.read()
        method, path = raw.method.upper(), raw.path
        query = dict(raw.query)
        ctype = raw.headers.get("Content-Type", "")
        index = len(self.request_log)
        self.request_log.append(RecordedRequest(method, path, query, ctype, time.monotonic()))
        try:
            response = await self._dispatch(raw, method, path, query, ctype)
        except ApiError as e:
            response = _json_response(e.status(), e.code)
        except Exception as e:  # a bug in the emulator: make it visible to the client
            err = ApiError(500, "InternalError", f"{e!r}", {"traceback": traceback.format_exc()})
            response = _json_response(err.status(), 500)
        user = _USER.get()
        created = None
        if method == "POST" and response.status == 201 and isinstance(response, aiohttp.web.Response):
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                created = json.loads(response.body)["metadata"]["name"]  # type: ignore[arg-type]
        self.request_log[index] = dataclasses.replace(
            self.request_log[index], status=response.status, user=user.name if user else None, created=created
        )
        return response

    def _take_fault(self, method: str, path: str, user: str | None = None) -> Fault | None:
        for fault in self.faults:
            if fault.times > 0 and fault.matches(method, path, user):
                fault.times -= 1
                fault.hits += 1
                return fault
        return None

    async def _dispatch(
        self, raw: aiohttp.web.BaseRequest, method: str, path: str, query: dict[str, str], ctype: str
    ) -> aiohttp.web.StreamResponse:
        auth = raw.headers.get("Authorization", "")
        user = self.authenticate(auth.removeprefix("Bearer ").strip()) if auth else None
        if fault := self._take_fault(method, path, user.name if user else None):
            if fault.delay:
                await asyncio.sleep(fault.delay)
            if fault.action is not None:
                fault.action()
            if fault.status is not None:
                reason = {
                    409: "Conflict",
                    429: "TooManyRequests",
                    500: "InternalError",
                    503: "ServiceUnavailable",
                    504: "Timeout",
                }.get(fault.status, "Unknown")
                details = {"retryAfterSeconds": 1} if fault.status in (429, 503) else {}
                return _json_response(ApiError(fault.status, reason, fault.message, details).status(), fault.status)
        if auth:
            if user is None:
                raise ApiError(401, "Unauthorized", "Unauthorized")
            _USER.set(user)
        if method == "GET" and (doc := self._serve_discovery(path, raw)):
            return doc
        segs = [s for s in path.split("/") if s]
        parsed = self._parse_path(segs)
        if parsed is None:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")
        rt, version, namespace, name, subresource = parsed
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method) or (
            ("delete" if name else "deletecollection")
            if method == "DELETE"
            else "get"
            if name
            else "watch"
            if query.get("watch") in ("true", "1")
            else "list"
        )
        self._authorize(
            authz.Attributes(verb, rt.group, rt.plural, subresource or "", namespace if rt.namespaced else None, name),
            rt,
        )
        body: Any = None
        if method in ("POST", "PUT", "PATCH", "DELETE") and "protobuf" in ctype:
            try:
                body = protobuf.decode(await raw.read())
            except protobuf.ProtobufError as e:
                # Clients that can, fall back to JSON on a 415.
                raise ApiError(
                    415,
                    "UnsupportedMediaType",
                    f"the body of the request was in an unknown "
                    f"format - accepted media types include: "
                    f"application/json, application/yaml ({e})",
                ) from None
        elif method in ("POST", "PUT", "PATCH", "DELETE"):
            text = await raw.text()
            if text.strip():
                try:
                    body = _load_yaml(text) if "yaml" in ctype else json.loads(text)
                except (ValueError, yaml.YAMLError) as e:
                    raise ApiError(400, "BadRequest", f"unable to decode the body: {e}") from None
        # Each request is served in its own task, so the context variable is per request.
        _FIELD_VALIDATION.set(query.get("fieldValidation", "Ignore"))
        agent = raw.headers.get("User-Agent", "").split("/", 1)[0].strip()
        _FIELD_MANAGER.set(query.get("fieldManager") or agent or "unknown")
        _FIELD_MANAGER_GIVEN.set(bool(query.get("fieldManager")))
        return await self._serve_resource(
            raw, method, path, query, ctype, body, rt, version, namespace, name, subresource
        )

    async def _serve_resource(
        self,
        raw: aiohttp.web.BaseRequest,
        method: str,
        path: str,
        query: dict[str, str],
        ctype: str,
        body: Any,
        rt: ResourceType,
        version: str,
        namespace: str | None,
        name: str | None,
        subresource: str | None,
    ) -> aiohttp.web.StreamResponse:
        dry_run = query.get("dryRun") == "All" or (isinstance(body, dict) and "All" in (body.get("dryRun") or []))

        if subresource == "scale" and name is not None:
            return _json_response(self._serve_scale(rt, namespace, name, method, body, ctype, dry_run))
        if method == "GET" and name is None:
            if query.get("watch") in ("true", "1"):
                return await self._serve_watch_stream(raw, rt, version, namespace, query)
            labels = parse_label_selector(query.get("labelSelector"))
            fields = parse_field_selector(query.get("fieldSelector"))
            found = sorted(
                (o for o in self._iter(rt, namespace) if match_selectors(o, labels, fields)), key=_list_order
            )
            page, list_meta = _page(found, query, str(self._rv))
            if _wants_metadata(raw):
                return _json_response(
                    {
                        "apiVersion": "meta.k8s.io/v1",
                        "kind": "PartialObjectMetadataList",
                        "metadata": list_meta,
                        "items": [
                            {
                                "apiVersion": "meta.k8s.io/v1",
                                "kind": "PartialObjectMetadata",
                                "metadata": _clone(o["metadata"]),
                            }
                            for o in page
                        ],
                    }
                )
            items = [_at_version(_clone(o), rt, version) for o in page]
            if _wants_table(raw, rt, version):
                return _json_response(_table(rt, version, items, query, list_meta["resourceVersion"]))
            return _json_response(
                {"apiVersion": rt.api_version(version), "kind": f"{rt.kind}List", "metadata": list_meta, "items": items}
            )
        if method == "GET":
            obj = self.get_object(rt.group, rt.plural, namespace, name) if name else None
            if obj is not None and subresource == "log" and rt.key == ("", "pods") and self.pod_log_reader:
                text = self.pod_log_reader(obj, query)
                if text is None:
                    raise ApiError(400, "BadRequest", f'container of pod "{name}" has no log (yet)')
                return aiohttp.web.Response(text=text, content_type="text/plain")
            if obj is None or subresource not in (None, "status"):
                raise _not_found(rt, name or "")
            if _wants_table(raw, rt, version):
                return _json_response(_table(rt, version, [obj], query, obj["metadata"]["resourceVersion"]))
            return _json_response(_at_version(obj, rt, version))
        if method == "POST" and subresource == "token" and rt.key == ("", "serviceaccounts") and name:
            return _json_response(
                self.request_token(namespace or "default", name, body if isinstance(body, dict) else {}), 201
            )
        if method == "POST" and name is None:
            if not isinstance(body, dict):
                raise ApiError(400, "BadRequest", "the request body must be an object")
            obj = self.create_object(rt.group, rt.plural, namespace, body, dry_run=dry_run)
            return _json_response(_at_version(obj, rt, version), 201)
        if method == "PUT" and name is not None:
            if not isinstance(body, dict):
                raise ApiError(400, "BadRequest", "the request body must be an object")
            if (body.get("metadata") or {}).get("name") not in (None, name):
                raise ApiError(400, "BadRequest", "the name of the object does not match the URL")
            obj = self.replace_object(
                rt.group, rt.plural, namespace, name, body, subresource=subresource, dry_run=dry_run
            )
            return _json_response(_at_version(obj, rt, version))
        if method == "PATCH" and name is not None:
            obj = self.patch_object(
                rt.group,
                rt.plural,
                namespace,
                name,
                body,
                ctype,
                subresource=subresource,
                dry_run=dry_run,
                force=query.get("force") == "true",
            )
            return _json_response(_at_version(obj, rt, version))
        if method == "DELETE" and name is not None:
            opts = body if isinstance(body, dict) else {}
            grace = opts.get("gracePeriodSeconds", query.get("gracePeriodSeconds"))
            obj = self.delete_object(
                rt.group,
                rt.plural,
                namespace,
                name,
                propagation=opts.get("propagationPolicy") or query.get("propagationPolicy"),
                preconditions=opts.get("preconditions"),
                dry_run=dry_run,
                grace_period=None if grace is None else int(grace),
            )
            return _json_response(_at_version(obj, rt, version))
        if method == "DELETE":
            labels = parse_label_selector(query.get("labelSelector"))
            fields = parse_field_selector(query.get("fieldSelector"))
            victims = [_clone(o) for o in self._iter(rt, namespace) if match_selectors(o, labels, fields)]
            for o in victims:
                key = (rt.group, rt.plural, o["metadata"].get("namespace"), o["metadata"]["name"])
                if key in self._store and not dry_run:
                    self._delete(rt, key)
            return _json_response(
                {
                    "apiVersion": rt.api_version(version),
                    "kind": f"{rt.kind}List",
                    "metadata": {"resourceVersion": str(self._rv)},
                    "items": [_at_version(o, rt, version) for o in victims],
                }
            )
        raise ApiError(
            405,
            "MethodNotAllowed",
            f"the server does not allow this method on the requested resource ({method} {path})",
        )

    def _serve_scale(
        self, rt: ResourceType, namespace: str | None, name: str, method: str, body: Any, ctype: str, dry_run: bool
    ) -> JsonObj:
        if not rt.scale:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({rt.plural}/scale)")
        obj = self.get_object(rt.group, rt.plural, namespace, name)
        if obj is None:
            raise _not_found(rt, name)
        scale = _scale_of(obj, rt.scale)
        if method == "GET":
            return scale
        if method == "PUT":
            wanted = body
        elif method == "PATCH" and "json-patch" in ctype:
            wanted = jsonpatch.apply_patch(scale, body)
        elif method == "PATCH":
            wanted = merge_patch(scale, body)
        else:
            raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed on {rt.plural}/scale")
        replicas = ((wanted or {}).get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or replicas < 0:
            raise ApiError(422, "Invalid", "spec.replicas: must be a non-negative integer")
        patch: JsonObj = {}
        cur = patch
        parts = rt.scale["specReplicasPath"].strip(".").split(".")
        for part in parts[:-1]:
            cur = cur.setdefault(part, {})
        cur[parts[-1]] = replicas
        # As kube-apiserver's scale handler (k8s.io/kubernetes pkg/registry/apps/deployment/storage
        # ScaleREST.Update, with k8s.io/apiserver pkg/endpoints/handlers/fieldmanager ScaleHandler): the write's
        # managedFields entry names the subresource, and takes spec.replicas from whoever owned it.
        updated = self.patch_object(rt.group, rt.plural, namespace, name, patch, dry_run=dry_run, subresource="scale")
        return _scale_of(updated, rt.scale)

    def _parse_path(self, segs: list[str]) -> tuple[ResourceType, str, str | None, str | None, str | None] | None:
        if len(segs) >= 2 and segs[0] == "api":
            group, version, rest = "", segs[1], segs[2:]
        elif len(segs) >= 3 and segs[0] == "apis":
            group, version, rest = segs[1], segs[2], segs[3:]
        else:
            return None
        if rest and rest[0] == "watch":  # the legacy /watch/ prefix
            rest = rest[1:]
        namespace = None
        if len(rest) >= 3 and rest[0] == "namespaces" and not (group == "" and rest[2] in ("status", "finalize")):
            namespace, rest = rest[1], rest[2:]
        if not rest or len(rest) > 3:
            return None
        rt = self._types.get((group, rest[0]))
        if rt is None or version not in rt.versions:
            raise ApiError(
                404, "NotFound", f"the server could not find the requested resource ({rest[0]}.{group}/{version})"
            )
        if namespace is not None and not rt.namespaced:
            return None
        name = rest[1] if len(rest) > 1 else None
        subresource = rest[2] if len(rest) > 2 else None
        return rt, version, namespace, name, subresource

    async def _serve_watch_stream(
        self, raw: aiohttp.web.BaseRequest, rt: ResourceType, version: str, namespace: str | None, query: dict[str, str]
    ) -> aiohttp.web.StreamResponse:
        watcher = _Watcher(
            rt=rt,
            version=version,
            namespace=namespace,
            path=raw.path,
            labels=parse_label_selector(query.get("labelSelector")),
            fields=parse_field_selector(query.get("fieldSelector")),
        )
        rv_text = query.get("resourceVersion") or ""
        # The backlog and the subscription are taken with no await in between, so no change is lost.
        backlog: list[JsonObj] = []
        if rv_text in ("", "0") or query.get("sendInitialEvents") == "true":
            for obj in self._iter(rt, namespace):
                if match_selectors(obj, watcher.labels, watcher.fields):
                    backlog.append({"type": "ADDED", "object": _at_version(_clone(obj), rt, version)})
            if query.get("sendInitialEvents") == "true":
                backlog.append(
                    {
                        "type": "BOOKMARK",
                        "object": {
                            "kind": rt.kind,
                            "apiVersion": rt.api_version(version),
                            "metadata": {
                                "resourceVersion": str(self._rv),
                                "annotations": {"k8s.io/initial-events-end": "true"},
                            },
                        },
                    }
                )
        else:
            try:
                since = int(rv_text)
            except ValueError:
                raise ApiError(400, "BadRequest", f"invalid resourceVersion: {rv_text}") from None
            if since < self._log_floor:
                backlog.append(
                    {
                        "type": "ERROR",
                        "object": ApiError(
                            410, "Expired", f"too old resource version: {since} ({self._log_floor})"
                        ).status(),
                    }
                )
            else:
                for event in self._log:
                    if (
                        event.rv > since
                        and event.rt_key == rt.key
                        and (out := _watch_event(watcher, event)) is not None
                    ):
                        backlog.append(out)
        for item in backlog:
            watcher.queue.put_nowait(item)
        gone = bool(backlog) and backlog[-1]["type"] == "ERROR"
        if not gone:
            self._watchers.add(watcher)
        response = aiohttp.web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        timeout = float(query["timeoutSeconds"]) if query.get("timeoutSeconds") else None
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        try:
            await response.prepare(raw)
            while not self._stopping:
                if gone and watcher.queue.empty():
                    break
                remaining = None if deadline is None else deadline - asyncio.get_running_loop().time()
                if remaining is not None and remaining <= 0:
                    break
                try:
                    item = await asyncio.wait_for(watcher.queue.get(), timeout=remaining)
                except TimeoutError:
                    break
                if item is None:  # dropped by a test or the resource went away
                    break
                await response.write(json.dumps(item).encode() + b"\n")
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self._watchers.discard(watcher)
        return response

    def drop_watches(self, path_regex: str | None = None) -> int:
        """End the open watch streams (of paths matching the regex), as a flaky network would."""
        pattern = re.compile(path_regex) if path_regex else None
        dropped = 0
        for w in list(self._watchers):
            if pattern is None or pattern.search(w.path):
                w.queue.put_nowait(None)
                self._watchers.discard(w)
                dropped += 1
        return dropped

    def open_watches(self) -> list[str]:
        return [w.path for w in self._watchers]

    def compact(self) -> int:
        """Forget the change history now, as etcd compaction does: a watch resumed from any earlier
        resourceVersion gets 410 Gone, and the client must list again (seeing no DELETED events for
        what went away meanwhile). Returns the resourceVersion compacted to."""
        self._log.clear()
        self._log_floor = self._rv
        return self._rv

    def stop_watches(self) -> None:
        self._stopping = True
        self.drop_watches()

    # ---------------------------------------------------------------------------------------------
    # Discovery.

    def _serve_discovery(self, path: str, raw: aiohttp.web.BaseRequest) -> aiohttp.web.Response | None:
        path = path.rstrip("/") or "/"
        host = raw.host
        if path == "/version":
            return _json_response(
                {
                    "major": "1",
                    "minor": "35",
                    "gitVersion": "v1.35.0",
                    "gitCommit": "0" * 40,
                    "gitTreeState": "clean",
                    "buildDate": "2026-01-01T00:00:00Z",
                    "goVersion": "go1.25.0",
                    "compiler": "gc",
                    "platform": "linux/amd64",
                }
            )
        if path == "/":
            return _json_response(
                {
                    "paths": sorted(
                        {
                            "/api",
                            "/api/v1",
                            "/apis",
                            "/version",
                            "/openapi/v2",
                            "/openapi/v3",
                            "/healthz",
                            "/readyz",
                            "/livez",
                        }
                        | {f"/apis/{g}" for g in self._groups()}
                    )
                }
            )
        if path in ("/healthz", "/readyz", "/livez"):
            return aiohttp.web.Response(text="ok")
        if path == "/openapi/v2":
            # An empty protobuf message is a valid, empty OpenAPI v2 document: kubectl then derives
            # patch strategies from its compiled-in types and uses merge patches for custom resources.
            return aiohttp.web.Response(
                body=b"", content_type="application/com.github.proto-openapi.spec.v2.v1.0+protobuf"
            )
        if path == "/openapi/v3":
            return _json_response({"paths": {}})
        if path.startswith("/openapi/"):
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        # Aggregated discovery is not served: clients accept plain lists and do the legacy walk.
        if path == "/api":
            return _json_response(
                {
                    "kind": "APIVersions",
                    "versions": ["v1"],
                    "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": host}],
                }
            )
        if path == "/apis":
            return _json_response(
                {"kind": "APIGroupList", "apiVersion": "v1", "groups": [self._group_doc(g) for g in self._groups()]}
            )
        segs = path.strip("/").split("/")
        if segs == ["api", "v1"]:
            return self._resource_list("", "v1")
        if len(segs) == 2 and segs[0] == "apis":
            if segs[1] not in self._groups():
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            return _json_response({"kind": "APIGroup", "apiVersion": "v1", **self._group_doc(segs[1])})
        if len(segs) == 3 and segs[0] == "apis":
            return self._resource_list(segs[1], segs[2])
        return None

    def _groups(self) -> dict[str, list[str]]:
        groups: dict[str, list[str]] = {}
        for rt in self._types.values():
            if rt.group:
                versions = groups.setdefault(rt.group, [])
                versions.extend(v for v in rt.versions if v not in versions)
        return groups

    def _group_doc(self, group: str) -> JsonObj:
        versions = [{"groupVersion": f"{group}/{v}", "version": v} for v in self._groups()[group]]
        return {"name": group, "versions": versions, "preferredVersion": versions[0]}

    def _resource_list(self, group: str, version: str) -> aiohttp.web.Response:
        rts = [rt for rt in self._types.values() if rt.group == group and version in rt.versions]
        if not rts:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        gv = f"{group}/{version}" if group else version
        return _json_response(
            {
                "kind": "APIResourceList",
                "apiVersion": "v1",
                "groupVersion": gv,
                "resources": list(itertools.chain.from_iterable(rt.discovery() for rt in rts)),
            }
        )


# -------------------------------------------------------------------------------------------------
# Helpers.


def _load_yaml(text: str) -> Any:
    """A YAML body; most clients (apply patches included) send JSON, which is YAML and parses far faster."""
    if text.lstrip()[:1] in ("{", "["):
        try:
            return json.loads(text)
        except ValueError:
            pass
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def _json_response(body: Any, status: int = 200) -> aiohttp.web.Response:
    return aiohttp.web.Response(body=json.dumps(body).encode(), status=status, content_type="application/json")


def _allocate_cluster_ip(service: JsonObj, old: JsonObj | None, allocate: Callable[[], str]) -> None:
    spec = service.get("spec")
    if not isinstance(spec, dict) or spec.get("type") == "ExternalName" or spec.get("clusterIP") is not None:
        return
    kept = ((old or {}).get("spec") or {}).get("clusterIP")
    spec["clusterIP"] = kept or allocate()


def _version_of(obj: JsonObj, rt: ResourceType) -> str:
    api_version = obj.get("apiVersion") or ""
    version = api_version.rpartition("/")[2]
    return version if version in rt.versions else rt.storage_version


def _at_version(obj: JsonObj, rt: ResourceType, version: str) -> JsonObj:
    # All versions of a CRD share one storage; conversion is the identity ("None" strategy).
    obj["apiVersion"] = rt.api_version(version)
    return obj


def _strip_volatile(obj: JsonObj, rt: ResourceType) -> JsonObj:
    excluded = {"metadata", "status"} if rt.status else {"metadata"}
    return {k: v for k, v in obj.items() if k not in excluded}


def _watch_event(w: _Watcher, event: _LoggedEvent) -> JsonObj | None:
    """The event as this watcher sees it: objects entering or leaving its selection are added/deleted."""

    def visible(obj: JsonObj | None) -> bool:
        return (
            obj is not None
            and (w.namespace is None or obj["metadata"].get("namespace") == w.namespace)
            and match_selectors(obj, w.labels, w.fields)
        )

    now, before = visible(event.obj), visible(event.old)
    if event.type == "MODIFIED" and now and not before:
        type_ = "ADDED"
    elif event.type == "MODIFIED" and before and not now:
        type_ = "DELETED"
    elif now or (event.type == "DELETED" and before):
        type_ = event.type
    else:
        return None
    # The logged copy is never changed and the stream only serializes it: a shallow copy takes the version.
    return {"type": type_, "object": {**event.obj, "apiVersion": w.rt.api_version(w.version)}}


def _scale_of(obj: JsonObj, paths: JsonObj) -> JsonObj:
    spec = json_path(obj, paths["specReplicasPath"])
    status = json_path(obj, paths.get("statusReplicasPath", ".status.replicas"))
    selector = json_path(obj, paths["labelSelectorPath"]) if paths.get("labelSelectorPath") else []
    sel = selector[0] if selector else None
    if isinstance(sel, dict):  # a LabelSelector: Scale carries it in its string form
        sel = ",".join(f"{k}={v}" for k, v in (sel.get("matchLabels") or {}).items())
    meta = obj["metadata"]
    return {
        "kind": "Scale",
        "apiVersion": "autoscaling/v1",
        "metadata": {
            k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp") if k in meta
        },
        "spec": {"replicas": spec[0] if spec else 0},
        "status": {"replicas": status[0] if status else 0, **({"selector": sel} if sel else {})},
    }


def _list_order(obj: JsonObj) -> tuple[str, str]:
    return obj["metadata"].get("namespace") or "", obj["metadata"]["name"]


def _page(found: list[JsonObj], query: dict[str, str], rv: str) -> tuple[list[JsonObj], JsonObj]:
    """One page of a list (``limit``, ``continue``) and the list's metadata, as kube-apiserver pages them.

    The continue token holds the resourceVersion the list began at and the last key served; the next page
    starts after that key. kube-apiserver serves every page from the snapshot of the first; here later pages
    see the objects as they are now, which a client that keeps the first page's resourceVersion cannot tell
    from objects changed right after the list (both are newer than it).
    """
    token = query.get("continue")
    if token:
        try:
            start = json.loads(base64.urlsafe_b64decode(token.encode()))
            rv, after = str(start["rv"]), tuple(start["after"])
        except (ValueError, KeyError, TypeError) as err:
            raise ApiError(400, "BadRequest", f"continue key is not valid: {err}") from None
        found = [o for o in found if _list_order(o) > after]
    meta: JsonObj = {"resourceVersion": rv}
    try:
        limit = int(query.get("limit") or 0)
    except ValueError:
        raise ApiError(400, "BadRequest", f"limit: invalid value {query.get('limit')!r}: not an integer") from None
    if limit > 0 and len(found) > limit:
        last = _list_order(found[limit - 1])
        meta["continue"] = base64.urlsafe_b64encode(json.dumps({"rv": rv, "after": last}).encode()).decode()
        meta["remainingItemCount"] = len(found) - limit
        found = found[:limit]
    return found, meta


def _wants_metadata(raw: aiohttp.web.BaseRequest) -> bool:
    """Whether the client asked for metadata only (``as=PartialObjectMetadataList;g=meta.k8s.io;v=v1``)."""
    accept = raw.headers.get("Accept", "")
    return "as=PartialObjectMetadataList" in accept and "g=meta.k8s.io" in accept


def _wants_table(raw: aiohttp.web.BaseRequest, rt: ResourceType, version: str) -> bool:
    # Only custom resources with printer columns get server-side tables: for everything else,
    # kubectl's own fallback printing (NAME, AGE) is what a table of ours would show anyway.
    return "as=Table" in raw.headers.get("Accept", "") and bool(rt.columns.get(version))


def json_path(obj: Any, path: str) -> list[Any]:
    """The small JSONPath subset printer columns use: ``.a.b``, ``[0]``, ``[*]``, ``[?(@.k=="v")]``."""
    tokens = re.findall(r'\.([\w-]+)|\[(\d+|\*)\]|\[\?\(@\.([\w.-]+)\s*==\s*["\']([^"\']*)["\']\)\]', path)
    values = [obj]
    for key, index, filter_key, filter_value in tokens:
        nxt: list[Any] = []
        for v in values:
            if key and isinstance(v, dict) and key in v:
                nxt.append(v[key])
            elif index == "*" and isinstance(v, list):
                nxt.extend(v)
            elif index and index != "*" and isinstance(v, list) and int(index) < len(v):
                nxt.append(v[int(index)])
            elif filter_key and isinstance(v, list):
                nxt.extend(x for x in v if _field_value(x, filter_key) == filter_value)
        values = nxt
    return values


def _age(timestamp: str) -> str:
    then = datetime.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    s = max(0, int((datetime.datetime.now(tz=datetime.UTC) - then).total_seconds()))
    if s < 120:
        return f"{s}s"
    if s < 600:
        return f"{s // 60}m{s % 60}s" if s % 60 else f"{s // 60}m"
    if s < 3 * 3600:
        return f"{s // 60}m"
    if s < 48 * 3600:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


def _table(rt: ResourceType, version: str, objs: list[JsonObj], query: dict[str, str], rv: str) -> JsonObj:
    """A meta.k8s.io/v1 Table built from the CRD's additionalPrinterColumns, as kube-apiserver does."""
    columns = rt.columns[version]
    defs = [
        {
            "name": "Name",
            "type": "string",
            "format": "name",
            "priority": 0,
            "description": "Name must be unique within a namespace.",
        }
    ]
    defs += [
        {
            "name": c["name"],
            "type": c.get("type", "string"),
            "format": c.get("format", ""),
            "description": c.get("description", ""),
            "priority": c.get("priority", 0),
        }
        for c in columns
    ]
    include = query.get("includeObject", "Metadata")
    rows = []
    for obj in objs:
        cells: list[Any] = [obj["metadata"]["name"]]
        for col in columns:
            found = json_path(obj, col["jsonPath"])
            value = found[0] if found else None
            if value is not None and col.get("type") == "date":
                value = _age(value)
            cells.append(value)
        row: JsonObj = {"cells": cells}
        if include == "Object":
            row["object"] = _at_version(obj, rt, version)
        elif include != "None":
            row["object"] = {
                "kind": "PartialObjectMetadata",
                "apiVersion": "meta.k8s.io/v1",
                "metadata": obj["metadata"],
            }
        rows.append(row)
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": rv},
        "columnDefinitions": defs,
        "rows": rows,
    }


def _qualified(rt: ResourceType) -> str:
    """``deployments.apps``, ``services``: how kube-apiserver names a resource in its messages."""
    return f"{rt.plural}.{rt.group}" if rt.group else rt.plural


def _check_uid(rt: ResourceType, name: str, meta: JsonObj, old: JsonObj) -> None:
    """A patch (apply or not) that names another uid than the object's: 422, as ValidateObjectMetaUpdate."""
    uid = meta.get("uid")
    if uid and uid != old["metadata"]["uid"]:
        raise _invalid(rt, name, "metadata.uid", f'Invalid value: "{uid}": field is immutable')


def _invalid(rt: ResourceType, name: str, field: str, message: str) -> ApiError:
    return ApiError(
        422,
        "Invalid",
        f'{rt.kind} "{name}" is invalid: {field}: {message}',
        {
            "name": name,
            "group": rt.group,
            "kind": rt.kind,
            "causes": [{"reason": "FieldValueInvalid", "message": message, "field": field}],
        },
    )


def _check_crd(crd: JsonObj) -> None:
    spec = crd.get("spec") or {}
    name = crd.get("metadata", {}).get("name", "")
    rt = BUILTIN_RESOURCES[[r.plural for r in BUILTIN_RESOURCES].index("customresourcedefinitions")]
    names = spec.get("names") or {}
    if not spec.get("group") or not names.get("plural") or not names.get("kind"):
        raise _invalid(rt, name, "spec", "group, names.plural and names.kind are required")
    if name != f"{names['plural']}.{spec['group']}":
        raise _invalid(rt, name, "metadata.name", 'must be spec.names.plural+"."+spec.group')
    if spec.get("scope") not in ("Namespaced", "Cluster"):
        raise _invalid(rt, name, "spec.scope", 'Unsupported value: must be "Cluster" or "Namespaced"')
    versions = spec.get("versions") or []
    if sum(1 for v in versions if v.get("storage")) != 1:
        raise _invalid(rt, name, "spec.versions", "must have exactly one version marked as storage version")
