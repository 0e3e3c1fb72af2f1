"""Types shared by both kinds: Kubernetes-shaped building blocks and the CRD metadata carrier."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema
from pydantic.alias_generators import to_camel

GROUP = "maru.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

# Kubernetes' own quantity grammar (apimachinery resource.Quantity), without a sign.
QUANTITY_PATTERN = (
    r"^(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
DNS1123_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS1123_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"

Quantity = Annotated[
    str,
    Field(pattern=QUANTITY_PATTERN),
    WithJsonSchema({"type": "string", "pattern": QUANTITY_PATTERN}),
]
"""A quantity written as a string (``64Gi``)."""

IntOrQuantity = Annotated[
    Annotated[int, Field(ge=0)] | Annotated[str, Field(pattern=QUANTITY_PATTERN)],
    WithJsonSchema({"x-kubernetes-int-or-string": True, "pattern": QUANTITY_PATTERN}),
]
"""A quantity as users write them in pod resources: ``1`` or ``"16Gi"``."""


@dataclass(frozen=True)
class FieldError:
    """One reason an object is refused: the field path (``spec.connector.chunkTokens``) and the rule."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class KubeModel(BaseModel):
    """Base of every API model: camelCase on the wire, unknown fields refused."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=False,
    )


class Toleration(KubeModel):
    """A pod toleration, as in a pod spec's tolerations."""

    key: str | None = Field(None, description="Taint key to tolerate; empty with operator Exists means all.")
    operator: Literal["Exists", "Equal"] = Field("Equal", description="How the key relates to the value.")
    value: str | None = Field(None, description="Taint value to match when the operator is Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to tolerate; empty means all effects."
    )
    toleration_seconds: int | None = Field(
        None, ge=0, description="How long a NoExecute taint is tolerated before eviction."
    )


class ResourceRequirements(KubeModel):
    """Compute resources of a container, as in a container's resources."""

    requests: dict[str, IntOrQuantity] = Field(
        default_factory=dict, description="Minimum resources, e.g. {cpu: 4, memory: 32Gi}."
    )
    limits: dict[str, IntOrQuantity] = Field(
        default_factory=dict, description="Maximum resources; GPUs go here, e.g. {nvidia.com/gpu: 1}."
    )


# metav1.Condition's rules (k8s.io/apimachinery/pkg/apis/meta/v1 types.go), as API conventions ask of
# every condition.
CONDITION_TYPE_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$"
)
CONDITION_REASON_PATTERN = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"
# Marks a model whose lists merge item by item by these keys; crdgen turns it into x-kubernetes-list-type:
# map and x-kubernetes-list-map-keys on every list of the model.
LIST_MAP_KEYS = "x-maru-list-map-keys"


class Condition(KubeModel):
    """A status condition in the standard Kubernetes shape (metav1.Condition).

    A list of conditions holds one per type: a map keyed by ``type`` to server-side apply and to
    ``kubectl``, as metav1.Condition lists are.
    """

    model_config = ConfigDict(extra="ignore", json_schema_extra={LIST_MAP_KEYS: ["type"]})

    type: str = Field(description="Condition type, e.g. Ready.", pattern=CONDITION_TYPE_PATTERN, max_length=316)
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    # Optional here (the operator always sets one): a hand-written status in an example may leave it out.
    reason: str | None = Field(
        None,
        description="CamelCase reason for the last transition.",
        pattern=CONDITION_REASON_PATTERN,
        min_length=1,
        max_length=1024,
    )
    message: str = Field("", description="Human-readable detail: what is wrong and what to do.", max_length=32768)
    last_transition_time: str | None = Field(
        None, description="When the status last changed (RFC 3339).", json_schema_extra={"format": "date-time"}
    )
    observed_generation: int | None = Field(None, description="Generation the condition was computed from.", ge=0)


class CustomResource(KubeModel):
    """Carries the CRD-level facts of one kind next to its model."""

    kind: ClassVar[str]
    plural: ClassVar[str]
    scope: ClassVar[Literal["Namespaced", "Cluster"]]
    short_names: ClassVar[list[str]]
    categories: ClassVar[list[str]] = ["maru"]
    printer_columns: ClassVar[list[dict[str, Any]]]
    description: ClassVar[str]
