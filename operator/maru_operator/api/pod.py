"""What users may put into the pods the operator runs: the Kubernetes pod fields real deployments need.

Each model mirrors its Kubernetes counterpart (same field names and meanings), restricted to what a
serving pod under Pod Security "restricted" may use: volumes are PVCs, emptyDirs, ConfigMaps, Secrets
and CSI inline volumes, never hostPath. The operator's own settings win where both would apply
(its labels, the pool socket volume); the checks in :mod:`maru_operator.validation` say so by field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field, WithJsonSchema, model_validator

from maru_operator.api.common import DNS1123_LABEL_PATTERN, DNS1123_SUBDOMAIN_PATTERN, KubeModel, Quantity

IntOrPercent = Annotated[
    Annotated[int, Field(ge=0)] | Annotated[str, Field(pattern=r"^[0-9]+%$")],
    WithJsonSchema({"x-kubernetes-int-or-string": True, "pattern": r"^([0-9]+%?)$"}),
]
"""A count or a percentage of replicas (``1`` or ``"25%"``), as in a Deployment's rollingUpdate."""

ResourceName = Annotated[str, Field(min_length=1, max_length=253, pattern=DNS1123_SUBDOMAIN_PATTERN)]

# Label keys: an optional DNS-subdomain prefix and a name of at most 63 characters; values at most 63.
LABEL_KEY_PATTERN = r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
# Label keys the operator sets on its pods (selectors and pod discovery depend on them).
RESERVED_LABEL_PREFIXES = ("app.kubernetes.io/", "maru.io/")


def _set_fields(model: KubeModel, fields: tuple[str, ...]) -> list[str]:
    """The camelCase names among ``fields`` that are set on ``model``."""
    return [f for f in fields if getattr(model, _snake(f)) is not None]


def _snake(camel: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in camel)


def _one_of(*fields: str, what: str) -> ConfigDict:
    """A CEL rule: exactly one of ``fields`` is set."""
    count = " + ".join(f"(has(self.{f}) ? 1 : 0)" for f in fields)
    return ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": f"{count} == 1",
                    "message": f"set exactly one of {', '.join(fields)} ({what})",
                    "reason": "FieldValueInvalid",
                }
            ]
        }
    )


def unique_by(*keys: str, what: str) -> dict[str, Any]:
    """Schema extras of a list whose items no two may share ``keys``: server-side apply merges these lists
    of a pod by those keys (env by name, ...), and the API server refuses to apply one with duplicates."""
    same = " && ".join(f"x.{k} == y.{k}" for k in keys)
    return {
        "x-kubernetes-validations": [
            {
                "rule": f"self.all(x, self.exists_one(y, {same}))",
                "message": f"{what}: each {'/'.join(keys)} at most once",
                "reason": "FieldValueDuplicate",
            }
        ]
    }


def check_unique(items: list[Any], keys: tuple[str, ...], what: str) -> None:
    """The models' side of :func:`unique_by`: ValueError naming the first repeated key."""
    seen: set[tuple[Any, ...]] = set()
    for item in items:
        key = tuple(getattr(item, _snake(k)) for k in keys)
        if key in seen:
            shown = ", ".join(f"{k}={v!r}" for k, v in zip(keys, key, strict=True))
            raise ValueError(f"{what}: {shown} appears more than once; each {'/'.join(keys)} at most once")
        seen.add(key)


# --- env -------------------------------------------------------------------------------------------


class KeySelector(KubeModel):
    """One key of a Secret or ConfigMap in the pod's namespace."""

    name: ResourceName = Field(description="Name of the Secret or ConfigMap.")
    key: str = Field(min_length=1, max_length=253, description="The key whose value is used.")
    optional: bool | None = Field(None, description="Start the pod even when the object or key is missing.")


class FieldSelector(KubeModel):
    """A field of the pod itself (the downward API), e.g. status.podIP or metadata.name."""

    field_path: str = Field(min_length=1, description="Path of the field, e.g. status.podIP.")
    api_version: str | None = Field(None, description="Version of the schema the path is written in (v1).")


class EnvVarSource(KubeModel):
    """Where an environment variable's value comes from: a Secret, a ConfigMap, or the pod."""

    model_config = _one_of("secretKeyRef", "configMapKeyRef", "fieldRef", what="the source of the value")

    secret_key_ref: KeySelector | None = Field(None, description="A key of a Secret, e.g. a gated model's HF_TOKEN.")
    config_map_key_ref: KeySelector | None = Field(None, description="A key of a ConfigMap.")
    field_ref: FieldSelector | None = Field(None, description="A field of the pod (downward API).")

    @model_validator(mode="after")
    def _exactly_one(self) -> EnvVarSource:
        # Mirrors the CEL rule, so objects built in Python obey what the API server enforces.
        if len(_set_fields(self, ("secretKeyRef", "configMapKeyRef", "fieldRef"))) != 1:
            raise ValueError("valueFrom: set exactly one of secretKeyRef, configMapKeyRef, fieldRef")
        return self


class EnvVar(KubeModel):
    """An environment variable: a literal value, or a value from a Secret, ConfigMap or the pod."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!(has(self.value) && has(self.valueFrom))",
                    "message": "set value or valueFrom, not both",
                    "reason": "FieldValueInvalid",
                }
            ]
        }
    )

    name: str = Field(min_length=1, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$", description="Variable name.")
    value: str | None = Field(None, description="Literal value. Secrets belong in a Secret: use valueFrom.")
    value_from: EnvVarSource | None = Field(None, description="Take the value from a Secret, ConfigMap or the pod.")

    @model_validator(mode="after")
    def _value_or_value_from(self) -> EnvVar:
        if self.value is not None and self.value_from is not None:
            raise ValueError(f"env {self.name}: valueFrom: set value or valueFrom, not both")
        return self

    def to_k8s(self) -> dict[str, Any]:
        if self.value_from is not None:
            return {"name": self.name, "valueFrom": self.value_from.model_dump(by_alias=True, exclude_none=True)}
        return {"name": self.name, "value": self.value or ""}


def _unique_env(env: list[EnvVar]) -> list[EnvVar]:
    check_unique(env, ("name",), "env")
    return env


EnvList = Annotated[list[EnvVar], AfterValidator(_unique_env), Field(json_schema_extra=unique_by("name", what="env"))]
"""Environment variables of one container: each name once (a repeated name is ambiguous, and cannot be applied)."""


# --- volumes ---------------------------------------------------------------------------------------


class PersistentVolumeClaimSource(KubeModel):
    """A PersistentVolumeClaim in the pod's namespace, e.g. a shared model cache."""

    claim_name: ResourceName = Field(description="Name of the PersistentVolumeClaim.")
    read_only: bool | None = Field(None, description="Mount it read-only.")


class EmptyDirSource(KubeModel):
    """Scratch space that lives as long as the pod; Memory: a tmpfs (e.g. a larger /dev/shm for NCCL)."""

    medium: Literal["", "Memory"] | None = Field(None, description="Memory for a tmpfs; empty for node disk.")
    size_limit: Quantity | None = Field(None, description="Maximum size, e.g. 16Gi (a tmpfs gets exactly this).")


class KeyToPath(KubeModel):
    """One key of a ConfigMap or Secret projected into a file."""

    key: str = Field(min_length=1, description="The key.")
    path: str = Field(min_length=1, pattern=r"^[^/].*$", description="Relative path of the file.")


class ConfigMapSource(KubeModel):
    """A ConfigMap's keys as files."""

    name: ResourceName = Field(description="Name of the ConfigMap.")
    items: list[KeyToPath] | None = Field(None, description="Only these keys, at these paths. Default: every key.")
    default_mode: int | None = Field(None, ge=0, le=0o777, description="Mode bits of the files (decimal, e.g. 420).")
    optional: bool | None = Field(None, description="Start the pod even when the ConfigMap is missing.")


class SecretSource(KubeModel):
    """A Secret's keys as files."""

    secret_name: ResourceName = Field(description="Name of the Secret.")
    items: list[KeyToPath] | None = Field(None, description="Only these keys, at these paths. Default: every key.")
    default_mode: int | None = Field(None, ge=0, le=0o777, description="Mode bits of the files (decimal, e.g. 256).")
    optional: bool | None = Field(None, description="Start the pod even when the Secret is missing.")


class CSISource(KubeModel):
    """An inline ephemeral volume of a CSI driver (e.g. a secrets-store or image driver)."""

    driver: str = Field(min_length=1, max_length=63, description="Name of the CSI driver.")
    read_only: bool | None = Field(None, description="Mount it read-only.")
    fs_type: str | None = Field(None, description="Filesystem type, when the driver needs one.")
    volume_attributes: dict[str, str] = Field(default_factory=dict, description="Driver-specific attributes.")


class Volume(KubeModel):
    """A volume of the pod: exactly one source. hostPath is not offered: serving pods stay 'restricted'."""

    model_config = _one_of("persistentVolumeClaim", "emptyDir", "configMap", "secret", "csi", what="the source")

    name: str = Field(max_length=63, pattern=DNS1123_LABEL_PATTERN, description="Volume name, used by volumeMounts.")
    persistent_volume_claim: PersistentVolumeClaimSource | None = Field(None, description="A PersistentVolumeClaim.")
    empty_dir: EmptyDirSource | None = Field(None, description="Scratch space or a tmpfs.")
    config_map: ConfigMapSource | None = Field(None, description="A ConfigMap's keys as files.")
    secret: SecretSource | None = Field(None, description="A Secret's keys as files.")
    csi: CSISource | None = Field(None, description="An inline CSI volume.")

    @model_validator(mode="after")
    def _exactly_one_source(self) -> Volume:
        sources = ("persistentVolumeClaim", "emptyDir", "configMap", "secret", "csi")
        if len(_set_fields(self, sources)) != 1:
            raise ValueError(f"volume {self.name}: set exactly one of {', '.join(sources)}")
        return self

    def to_k8s(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class VolumeMount(KubeModel):
    """Where the vLLM container sees a volume."""

    name: str = Field(max_length=63, pattern=DNS1123_LABEL_PATTERN, description="Name of a volume in volumes.")
    mount_path: str = Field(min_length=2, pattern=r"^/.*$", description="Absolute path in the container.")
    read_only: bool | None = Field(None, description="Mount it read-only.")
    sub_path: str | None = Field(None, pattern=r"^[^/].*$", description="A path inside the volume instead of its root.")

    def to_k8s(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


# --- placement and identity ------------------------------------------------------------------------


class LocalObjectReference(KubeModel):
    """An object in the pod's namespace, by name."""

    name: ResourceName = Field(description="Name of the object (e.g. a docker-registry Secret).")


class LabelSelectorRequirement(KubeModel):
    """key In/NotIn values, or key Exists/DoesNotExist."""

    key: str = Field(min_length=1, description="Label key.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(description="How key relates to values.")
    values: list[str] = Field(default_factory=list, description="Values for In and NotIn.")


class LabelSelector(KubeModel):
    """Which pods count, by their labels (all requirements must hold)."""

    match_labels: dict[str, str] = Field(default_factory=dict, description="Labels the pods must have.")
    match_expressions: list[LabelSelectorRequirement] = Field(default_factory=list, description="Further requirements.")


class TopologySpreadConstraint(KubeModel):
    """Spread pods over a topology (zones, nodes), as in a pod spec."""

    max_skew: int = Field(ge=1, description="Largest allowed difference of matching pods between two domains.")
    topology_key: str = Field(
        min_length=1, description="Node label whose values are the domains, e.g. topology.kubernetes.io/zone."
    )
    when_unsatisfiable: Literal["DoNotSchedule", "ScheduleAnyway"] = Field(
        description="DoNotSchedule keeps a pod pending rather than break the skew; ScheduleAnyway only prefers."
    )
    label_selector: LabelSelector | None = Field(
        None, description="The pods that count. Default: this role's (or the router's) pods of this group."
    )
    min_domains: int | None = Field(None, ge=1, description="Minimum number of domains (DoNotSchedule only).")
    match_label_keys: list[str] = Field(
        default_factory=list, description="Pod label keys whose values further select the pods counted."
    )

    def to_k8s(self, default_selector: dict[str, str]) -> dict[str, Any]:
        out = self.model_dump(by_alias=True, exclude_none=True, exclude_defaults=True)
        out.update(maxSkew=self.max_skew, topologyKey=self.topology_key, whenUnsatisfiable=self.when_unsatisfiable)
        out["labelSelector"] = (
            self.label_selector.model_dump(by_alias=True, exclude_defaults=True)
            if self.label_selector
            else {"matchLabels": dict(default_selector)}
        )
        return out


_POD_LABELS_RULE = {
    "rule": "self.all(k, !k.startsWith('app.kubernetes.io/') && !k.startsWith('maru.io/') && k != 'pod-template-hash')",
    "message": "app.kubernetes.io/*, maru.io/* and pod-template-hash labels are the operator's",
    "reason": "FieldValueForbidden",
}
LabelValue = Annotated[str, Field(max_length=63, pattern=LABEL_VALUE_PATTERN)]


class PodOptions(KubeModel):
    """Pod fields shared by the vLLM roles and the router."""

    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list,
        max_length=16,
        description="Secrets with credentials of a private registry.",
        json_schema_extra=unique_by("name", what="imagePullSecrets"),
    )
    priority_class_name: str | None = Field(
        None,
        max_length=253,
        pattern=DNS1123_SUBDOMAIN_PATTERN,
        description="PriorityClass of the pods, e.g. to keep serving pods from being preempted.",
    )
    topology_spread_constraints: list[TopologySpreadConstraint] = Field(
        default_factory=list,
        max_length=8,
        description="How the pods spread over zones or nodes.",
        json_schema_extra=unique_by("topologyKey", "whenUnsatisfiable", what="topologySpreadConstraints"),
    )
    pod_labels: dict[str, LabelValue] = Field(
        default_factory=dict,
        description="Extra labels of the pods (not app.kubernetes.io/* or maru.io/*).",
        json_schema_extra={"x-kubernetes-validations": [_POD_LABELS_RULE]},
    )
    pod_annotations: dict[str, str] = Field(default_factory=dict, description="Extra annotations of the pods.")

    @model_validator(mode="after")
    def _pod_labels_are_not_the_operators(self) -> PodOptions:
        for key in self.pod_labels:
            if key.startswith(RESERVED_LABEL_PREFIXES) or key == "pod-template-hash":
                raise ValueError(
                    f"podLabels: {key!r}: app.kubernetes.io/*, maru.io/* and pod-template-hash labels "
                    "are the operator's"
                )
        return self

    @model_validator(mode="after")
    def _list_keys_are_unique(self) -> PodOptions:
        check_unique(self.image_pull_secrets, ("name",), "imagePullSecrets")
        check_unique(
            self.topology_spread_constraints, ("topologyKey", "whenUnsatisfiable"), "topologySpreadConstraints"
        )
        return self


class RollingUpdate(KubeModel):
    """The pace of a rolling update. Unset values come from the role's replicas: a surge pod (1) starts
    before an old one stops, and an old one may stop first (1) only when the role has more than one, so a
    single-replica role is never left without a pod, and a larger one still rolls without a spare GPU."""

    max_surge: IntOrPercent | None = Field(
        None, description="Pods started above the desired count during an update. Default 1."
    )
    max_unavailable: IntOrPercent | None = Field(
        None,
        description="Pods that may be missing during an update. Default: 0 for one replica (1 when "
        "maxSurge is 0), else 1.",
    )


class RolloutStrategy(KubeModel):
    """How a role's pods are replaced when the spec changes (a Deployment's strategy)."""

    type: Literal["RollingUpdate", "Recreate"] = Field(
        "RollingUpdate", description="RollingUpdate replaces pods a few at a time; Recreate stops all first."
    )
    rolling_update: RollingUpdate = Field(
        default_factory=RollingUpdate, description="The pace of a RollingUpdate (ignored by Recreate)."
    )
