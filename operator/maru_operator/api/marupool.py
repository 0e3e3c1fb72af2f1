"""MaruPool: a pool of shared memory that carries KV cache between prefill and decode.

Cluster-scoped, because the memory belongs to nodes, not to a namespace; ``allowedNamespaces``
says who may bind to it.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import ConfigDict, Field, WithJsonSchema, model_validator

from maru_contracts.poolsize import SIZE_PATTERN
from maru_operator.api.common import (
    DNS1123_LABEL_PATTERN,
    DNS1123_SUBDOMAIN_PATTERN,
    CustomResource,
    KubeModel,
    ResourceRequirements,
    Toleration,
)
from maru_operator.api.common import Condition as Condition
from maru_operator.api.pod import LocalObjectReference, check_unique, unique_by

DevicePath = Annotated[str, Field(pattern=r"^/dev/[A-Za-z0-9._/-]+$", max_length=255)]
NamespaceName = Annotated[str, Field(pattern=DNS1123_LABEL_PATTERN, max_length=63)]
# The one size grammar of the pool: the daemon's --size parses exactly what this pattern accepts.
PoolSize = Annotated[
    str,
    Field(pattern=SIZE_PATTERN),
    WithJsonSchema({"type": "string", "pattern": SIZE_PATTERN}),
]
PriorityClassName = Annotated[str, Field(pattern=f"^$|{DNS1123_SUBDOMAIN_PATTERN}", max_length=253)]

DEFAULT_SOCKET_DIR = "/run/maru"
DEFAULT_PRIORITY_CLASS = "system-node-critical"


class EvictionSpec(KubeModel):
    """What the pool does when it is full."""

    policy: Literal["LRU", "None"] = Field(
        "LRU",
        description=(
            "LRU evicts the least recently used chunk that no reader has pinned. None refuses new "
            "chunks when full (stores are skipped, serving goes on)."
        ),
    )
    lease_seconds: int = Field(
        30,
        ge=1,
        le=3600,
        description=(
            "How long a writer's allocation or a reader's pin lives without being renewed. A client "
            "that dies mid-write leaks its space for at most this long."
        ),
    )


MAX_QUOTA_COUNT = 1 << 20


class TenantQuota(KubeModel):
    """Limits of one tenant (an InferenceGroup's cache) in the pool; a field not set falls back to the next level.

    Enforced by the pool daemons, which read it from the group's pool credential (the operator signs it into
    the token): a store past a limit is skipped and a load past it is a miss, never an error in vLLM.
    """

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "has(self.bytes) || has(self.pins) || has(self.leases)",
                    "message": "set at least one of bytes, pins, leases",
                    "reason": "FieldValueRequired",
                }
            ]
        }
    )

    bytes: PoolSize | None = Field(
        None,
        description=(
            "Pool memory the tenant's chunks may take, stored or being written, e.g. 16Gi (the pool size grammar; "
            "each chunk counts in 4 KiB units). Past it, its own least recently used chunks are evicted for its "
            "new ones, or the store is skipped. At most the pool: a larger value means the whole pool. Default: "
            "three quarters of the pool, so no single tenant can leave the others less than a quarter."
        ),
    )
    pins: int | None = Field(
        None,
        ge=1,
        le=MAX_QUOTA_COUNT,
        description="Read pins the tenant may hold at once (a pin keeps a chunk while it is loaded or a request "
        "that hit it waits); past it a load is a miss. Default: 65536.",
    )
    leases: int | None = Field(
        None,
        ge=1,
        le=MAX_QUOTA_COUNT,
        description="Write leases the tenant may hold at once (one per chunk being stored); past it a store is "
        "skipped. Default: 16384.",
    )

    @model_validator(mode="after")
    def _something_set(self) -> TenantQuota:
        if self.bytes is None and self.pins is None and self.leases is None:
            raise ValueError("set at least one of bytes, pins, leases")
        return self


class PoolDaemonSpec(KubeModel):
    """The pool daemons: the only pods that touch the memory device."""

    image: str | None = Field(
        None,
        min_length=1,
        description="Pool daemon image. Unset: the operator's default, <registry>/maru-pool:<the operator's "
        "version> (the chart's images values, or the operator's --pool-image and --image-registry, "
        "choose the registry or the whole reference).",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="Pull policy of the pool daemon image."
    )
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list,
        max_length=16,
        description="Secrets with credentials of a private registry, in the operator's namespace (where the pool "
        "daemons run), e.g. the chart's imagePullSecrets.",
        json_schema_extra=unique_by("name", what="imagePullSecrets"),
    )
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements,
        description=(
            "Resources of each pool daemon container. The shm agent's memory request is derived from size "
            "(the pool file lives in its memory-backed /dev/shm, which is charged to the pod) unless set "
            "here, and may not be set lower. Any limit set makes the daemons Guaranteed QoS (the last pods "
            "evicted): each request equals its limit, and a limit not set equals its request (the cpu "
            "request's default, 100m, when neither is set; memory as derived above)."
        ),
    )
    priority_class_name: PriorityClassName = Field(
        DEFAULT_PRIORITY_CLASS,
        description=(
            "PriorityClass of the pool daemons: an evicted agent takes its node's cache with it. "
            "system-node-critical by default; clusters that keep the system classes to kube-system "
            "(a ResourceQuota, as on GKE) need a class of their own here. Empty: no class."
        ),
    )
    socket_dir: str = Field(
        DEFAULT_SOCKET_DIR,
        pattern=r"^/.*$",
        description=(
            "Host directory holding the node agent's Unix socket; vLLM pods mount it to reach the pool. "
            "Must be an absolute path."
        ),
    )
    metadata_port: int = Field(7400, ge=1, le=65535, description="Port of the pool-wide metadata server.")
    metrics_port: int = Field(9400, ge=1, le=65535, description="Port serving /metrics and /status.")

    @model_validator(mode="after")
    def _pull_secrets_are_unique(self) -> PoolDaemonSpec:
        check_unique(self.image_pull_secrets, ("name",), "daemon.imagePullSecrets")
        return self


class MaruPoolSpec(KubeModel):
    """Desired state of a MaruPool."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.backend != 'shm' || has(self.size)",
                    "message": "size is required when backend is shm",
                    "fieldPath": ".size",
                    "reason": "FieldValueRequired",
                },
                {
                    "rule": "self.backend == 'dax' || !has(self.devices) || size(self.devices) == 0",
                    "message": "devices may only be set when backend is dax",
                    "fieldPath": ".devices",
                    "reason": "FieldValueForbidden",
                },
            ]
        }
    )

    backend: Literal["dax", "shm"] = Field(
        description=(
            "dax: CXL memory exposed as devdax character devices, shared by the selected nodes. "
            "shm: shared memory (a file in /dev/shm) on each selected node, for single-node pools "
            "and trials."
        )
    )
    size: PoolSize | None = Field(
        None,
        description=(
            "Pool memory per node, e.g. 64Gi. Required for shm; for dax an optional cap on how much of "
            "each device the pool uses. A whole number of bytes with an optional suffix Ki, Mi, Gi, Ti, Pi, "
            "Ei or k, M, G, T, P, E (no fractions, exponents or m); the pool daemon parses exactly this."
        ),
    )
    devices: list[DevicePath] = Field(
        default_factory=list,
        max_length=64,
        description="Devdax device paths such as /dev/dax0.0 (dax only). Empty: use every devdax device found.",
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict,
        description="Labels of the nodes that carry the pool memory. Empty selects every node.",
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Tolerations of the pool daemons, as in a pod spec."
    )
    eviction: EvictionSpec = Field(default_factory=EvictionSpec, description="Behaviour when the pool is full.")
    allowed_namespaces: list[NamespaceName] | None = Field(
        None,
        min_length=1,
        description="Namespaces whose InferenceGroups may bind to this pool. Unset: every namespace.",
    )
    daemon: PoolDaemonSpec = Field(default_factory=PoolDaemonSpec, description="The pool daemons.")
    tenant_quota: TenantQuota | None = Field(
        None,
        description=(
            "Default quota of every InferenceGroup bound to this pool (each group's cache is a tenant), for "
            "the fields its spec.poolQuota does not set. Unset fields: the daemon's defaults (bytes three "
            "quarters of the pool, 65536 pins, 16384 leases). A change re-issues the groups' credentials; "
            "engines pick it up when they reconnect, the daemons are not restarted."
        ),
    )
    max_tenant_quota: TenantQuota | None = Field(
        None,
        description=(
            "Ceiling of any group's quota, whatever its spec.poolQuota asks (a group's namespace owner writes "
            "that field; the pool's owner writes this one). A field set here and in no default is also the "
            "default. Unset fields: the tenantQuota, then the daemon's defaults for pins and leases, so a group "
            "may lower its quota but not raise it; bytes without either: the pool. The daemons' hard ceiling on "
            "pins and leases is raised to what this policy grants."
        ),
    )

    @model_validator(mode="after")
    def _cross_field_rules(self) -> MaruPoolSpec:
        # Mirrors the CEL rules above, so objects built in Python obey what the API server enforces.
        if self.backend == "shm" and self.size is None:
            raise ValueError("size: size is required when backend is shm")
        if self.backend != "dax" and self.devices:
            raise ValueError("devices: devices may only be set when backend is dax")
        return self


class PoolNodeStatus(KubeModel):
    """One node's share of the pool."""

    model_config = ConfigDict(extra="ignore")

    node: str = Field(description="Node name.")
    device: str = Field("", description="Device or shm file backing the pool on this node.")
    capacity: str = Field("", description="Pool memory on this node.")
    ready: bool = Field(False, description="Whether this node's agent serves clients.")


class MaruPoolStatus(KubeModel):
    """Observed state of a MaruPool."""

    model_config = ConfigDict(extra="ignore")

    observed_generation: int | None = Field(None, description="Generation the status was computed from.")
    conditions: list[Condition] = Field(default_factory=list, description="Ready, Degraded, InUse.")
    nodes_desired: int = Field(0, description="Nodes selected for the pool.")
    nodes_ready: int = Field(0, description="Nodes whose agent is ready.")
    node_summary: str = Field("", description="nodesReady/nodesDesired, for kubectl get.")
    nodes: list[PoolNodeStatus] = Field(default_factory=list, description="Per-node entries.")
    capacity: str = Field("", description="Total pool memory, as a quantity.")
    used: str = Field("", description="Memory held by stored chunks, as a quantity.")
    capacity_bytes: int = Field(0, description="Total pool memory in bytes.")
    used_bytes: int = Field(0, description="Memory held by stored chunks in bytes.")
    endpoint: str = Field("", description="URL vLLM pods use to reach the node agent, e.g. unix:///run/maru/pool.sock.")
    bound_groups: int = Field(0, description="InferenceGroups bound to this pool.")


class MaruPool(CustomResource):
    """A shared memory pool for KV cache, provisioned on the nodes that carry the memory."""

    kind: ClassVar[str] = "MaruPool"
    plural: ClassVar[str] = "marupools"
    scope: ClassVar[Literal["Namespaced", "Cluster"]] = "Cluster"
    short_names: ClassVar[list[str]] = ["mpool"]
    description: ClassVar[str] = (
        "MaruPool is a pool of shared memory (CXL devdax or shm) that carries the KV cache from prefill "
        "to decode. The operator runs its daemons on the selected nodes and reports capacity and use."
    )
    printer_columns: ClassVar[list[dict[str, str]]] = [
        {"name": "Backend", "type": "string", "jsonPath": ".spec.backend"},
        {"name": "Nodes", "type": "string", "jsonPath": ".status.nodeSummary", "description": "ready/desired"},
        {"name": "Capacity", "type": "string", "jsonPath": ".status.capacity"},
        {"name": "Used", "type": "string", "jsonPath": ".status.used"},
        {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]

    spec: MaruPoolSpec
    status: MaruPoolStatus | None = None
