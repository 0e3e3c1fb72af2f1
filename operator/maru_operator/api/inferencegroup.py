"""InferenceGroup: one model served by prefill and decode vLLM pods bound to a MaruPool."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, model_validator

from maru_contracts.config import DEFAULT_CHUNK_TOKENS
from maru_operator.api.common import (
    DNS1123_SUBDOMAIN_PATTERN,
    Condition,
    CustomResource,
    KubeModel,
    Quantity,
    ResourceRequirements,
    Toleration,
)
from maru_operator.api.marupool import TenantQuota
from maru_operator.api.pod import (
    EnvList,
    IntOrPercent,
    LabelSelector,
    PodOptions,
    ResourceName,
    RolloutStrategy,
    Volume,
    VolumeMount,
)
from maru_operator.vllmflags import cel_owned_flags_rule, settings

# Flags the operator derives from the spec; letting extraArgs set them again would let
# prefill and decode disagree, which is the failure this product exists to prevent.
OPERATOR_OWNED_FLAGS = (
    "--kv-transfer-config",
    "--model",
    "--served-model-name",
    "--revision",
    "--tensor-parallel-size",
    "--block-size",
    "--port",
    "--dtype",
)

# A best-effort first line at admission (CEL cannot know argparse's abbreviations); the model's
# validator below reads the arguments as vLLM does and is authoritative. An absent list is not
# defaulted, and CEL errors on a missing field: the rule guards with has().
_EXTRA_ARGS_RULE = cel_owned_flags_rule(OPERATOR_OWNED_FLAGS)


# The adapter's fields: words for both are in crdvalidate.PATTERNS.
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
NO_WHITESPACE_PATTERN = r"^\S+$"


class LoRAAdapter(KubeModel):
    """A LoRA adapter both roles serve beside the base model (vLLM's ``--lora-modules name=source``)."""

    name: str = Field(
        min_length=1,
        max_length=128,
        pattern=ADAPTER_NAME_PATTERN,
        description="Name clients send as the model to use this adapter; letters, digits, '.', '_', '-'.",
    )
    source: str = Field(
        min_length=1,
        max_length=512,
        pattern=NO_WHITESPACE_PATTERN,
        description="Hugging Face id (org/name) or a path the engine reads, e.g. one inside the model cache "
        "volume. Part of every KV cache key of the requests served through it.",
    )


class ModelSpec(KubeModel):
    """The model both roles serve."""

    name: str = Field(
        min_length=1,
        max_length=512,
        description="Hugging Face model id (org/name) or a path inside the image, e.g. Qwen/Qwen2.5-7B-Instruct.",
    )
    revision: str | None = Field(
        None, max_length=128, description="Model revision (branch, tag or commit). Part of the cache key."
    )
    served_model_name: str | None = Field(
        None, min_length=1, max_length=256, description="Name clients send in requests. Default: model.name."
    )
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = Field(
        "auto", description="Weights and KV dtype passed to vLLM. Part of the cache key."
    )
    max_model_len: int | None = Field(None, ge=1, description="Context length limit passed to vLLM.")
    adapters: list[LoRAAdapter] = Field(
        default_factory=list,
        max_length=64,
        description="LoRA adapters served beside the model (vLLM --enable-lora --lora-modules). The pool never "
        "shares KV between two adapters, nor between an adapter and the base model.",
    )

    @model_validator(mode="after")
    def _adapter_names_are_distinct(self) -> ModelSpec:
        names = [a.name for a in self.adapters]
        served = self.served_model_name or self.name
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"adapters: the name {name!r} is used twice; each adapter needs its own name")
            if name == served:
                raise ValueError(
                    f"adapters: the name {name!r} is the served model's name; clients could not ask for the base model"
                )
        return self


class PoolRef(KubeModel):
    """Which MaruPool carries this group's KV cache."""

    name: str = Field(
        min_length=1, max_length=253, pattern=DNS1123_SUBDOMAIN_PATTERN, description="Name of the MaruPool."
    )


DEFAULT_MODEL_CACHE_SIZE = "200Gi"
MODEL_CACHE_PATH = "/var/cache/maru/models"


# The claim the operator created only grows: kube-apiserver refuses any other change of a claim's spec (422,
# ValidatePersistentVolumeClaimUpdate), so the group's spec refuses it up front, naming the field. Growth still
# needs a bound claim and a StorageClass that expands (else the group's status says the claim was refused).
_OWN_CLAIM = "has(self.claimName) || has(oldSelf.claimName) || "
_CLAIM_RULES = [
    {
        "rule": _OWN_CLAIM + "(has(self.accessMode) ? self.accessMode : '') == "
        "(has(oldSelf.accessMode) ? oldSelf.accessMode : '')",
        "message": "accessMode of the group's model cache claim cannot change once it exists (a claim's access modes "
        "are immutable): delete the claim <group>-model-cache, or use another claim (claimName)",
        "fieldPath": ".accessMode",
        "reason": "FieldValueForbidden",
    },
    {
        "rule": _OWN_CLAIM + "(has(self.storageClassName) ? self.storageClassName : '') == "
        "(has(oldSelf.storageClassName) ? oldSelf.storageClassName : '')",
        "message": "storageClassName of the group's model cache claim cannot change once it exists (a claim's class is "
        "immutable): delete the claim <group>-model-cache, or use another claim (claimName)",
        "fieldPath": ".storageClassName",
        "reason": "FieldValueForbidden",
    },
    {
        "rule": _OWN_CLAIM + "!has(self.size) || !has(oldSelf.size) || "
        "!quantity(string(self.size)).isLessThan(quantity(string(oldSelf.size)))",
        "message": "size of the group's model cache claim can only grow (a claim never shrinks)",
        "fieldPath": ".size",
        "reason": "FieldValueForbidden",
    },
]


class ModelCacheClaim(KubeModel):
    """A PersistentVolumeClaim holding the Hugging Face hub cache, shared by every vLLM pod of the group."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _CLAIM_RULES})

    claim_name: str | None = Field(
        None,
        max_length=253,
        pattern=DNS1123_SUBDOMAIN_PATTERN,
        description="An existing claim in the group's namespace (e.g. one several groups share, or one filled "
        "ahead of time); the operator then creates none. Unset: the operator creates "
        "<group>-model-cache, owned by the group (deleted with it).",
    )
    size: Quantity = Field(
        DEFAULT_MODEL_CACHE_SIZE,
        description="Size of the claim the operator creates; room for every revision of the model the group "
        "will serve. It can grow later where the StorageClass allows expansion.",
    )
    storage_class_name: str | None = Field(
        None,
        max_length=253,
        description="StorageClass of the claim the operator creates. Unset: the cluster's "
        "default class. It must offer the access mode below.",
    )
    access_mode: Literal["ReadWriteMany", "ReadWriteOnce", "ReadOnlyMany"] = Field(
        "ReadWriteMany",
        description="ReadWriteMany (NFS, CephFS, a cloud file store): every pod of the group, on any node, reads "
        "one copy and the first to start downloads it. ReadWriteOnce only works while all the "
        "group's pods share one node. ReadOnlyMany: a pre-filled claim (set claimName).",
    )


class ModelCacheEmptyDir(KubeModel):
    """A per-pod cache: every pod downloads the model again, into node storage bounded by ``sizeLimit``."""

    size_limit: Quantity = Field(
        description="Node storage one pod's download may take; the kubelet evicts the pod beyond it. Also "
        "requested as ephemeral-storage, so the scheduler picks a node with the room.",
    )


class ModelCacheSpec(KubeModel):
    """Where vLLM keeps downloaded weights (``HF_HUB_CACHE``). Exactly one of the two; default a claim."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!(has(self.persistentVolumeClaim) && has(self.emptyDir))",
                    "message": "set one of persistentVolumeClaim and emptyDir",
                    "reason": "FieldValueForbidden",
                }
            ]
        }
    )

    persistent_volume_claim: ModelCacheClaim | None = Field(
        None,
        description="A claim shared by the group's pods (the default, with its defaults, when emptyDir is not set).",
    )
    empty_dir: ModelCacheEmptyDir | None = Field(
        None,
        description="A per-pod emptyDir instead: only for small models or a model baked into the image.",
    )

    @model_validator(mode="after")
    def _one_kind(self) -> ModelCacheSpec:
        if self.persistent_volume_claim is not None and self.empty_dir is not None:
            raise ValueError("modelCache: set one of persistentVolumeClaim and emptyDir")
        return self

    @property
    def claim(self) -> ModelCacheClaim | None:
        """The claim to mount, None for an emptyDir."""
        if self.empty_dir is not None:
            return None
        return self.persistent_volume_claim or ModelCacheClaim()


class Termination(KubeModel):
    """How a vLLM or router pod stops: it first drains (the requests it serves finish), then gets SIGTERM."""

    grace_period_seconds: int = Field(
        600,
        ge=1,
        le=86400,
        description="terminationGracePeriodSeconds: the whole budget from the pod's deletion to SIGKILL, "
        "drain included.",
    )
    drain_seconds: int = Field(
        570,
        ge=0,
        le=86400,
        description="How long the preStop hook waits for the requests in flight to finish (vLLM's "
        "num_requests_running and num_requests_waiting at 0; maru-router's requests in progress) "
        "before the server gets SIGTERM; 0: no drain. At most gracePeriodSeconds; keep ~30 s for the "
        "server's own shutdown.",
    )

    @model_validator(mode="after")
    def _drain_fits(self) -> Termination:
        if self.drain_seconds > self.grace_period_seconds:
            raise ValueError("termination.drainSeconds: must not exceed termination.gracePeriodSeconds")
        return self


class DisruptionBudget(KubeModel):
    """A PodDisruptionBudget of the role: how many of its pods a node drain may evict at once."""

    enabled: bool = Field(True, description="Render a PodDisruptionBudget for this role.")
    max_unavailable: IntOrPercent = Field(
        1,
        description="Pods of the role a voluntary disruption (a node drain) may take down at once.",
    )


# Volumes the operator adds to every vLLM pod (the pool socket, the pool credential, /dev/shm, the model
# cache, the scratch directories of a read-only root); a user's volume may not take their names.
RESERVED_VOLUMES = ("maru-socket", "maru-credential", "dshm", "model-cache", "home", "tmp")
DEFAULT_STARTUP_SECONDS = 1800


class RoleSpec(PodOptions):
    """One role's vLLM pods (prefill or decode)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": _EXTRA_ARGS_RULE,
                    "message": "extraArgs must not set flags the operator derives from the spec: "
                    + ", ".join(OPERATOR_OWNED_FLAGS),
                    "fieldPath": ".extraArgs",
                    "reason": "FieldValueForbidden",
                },
                {
                    "rule": "!has(self.volumeMounts) || self.volumeMounts.all(m, has(self.volumes) && "
                    "self.volumes.exists(v, v.name == m.name))",
                    "message": "every volumeMounts[].name must name one of volumes",
                    "fieldPath": ".volumeMounts",
                    "reason": "FieldValueNotFound",
                },
                {
                    "rule": "!has(self.volumes) || self.volumes.all(v, "
                    + " && ".join(f"v.name != '{n}'" for n in RESERVED_VOLUMES)
                    + ")",
                    "message": "volume names " + ", ".join(RESERVED_VOLUMES) + " are the operator's",
                    "fieldPath": ".volumes",
                    "reason": "FieldValueForbidden",
                },
            ]
        }
    )

    replicas: int = Field(
        1,
        ge=0,
        le=1024,
        description="Number of vLLM pods of this role. With scaler External: only the count the Deployment "
        "is created with; the autoscaler sets it from then on.",
    )
    scaler: Literal["Operator", "External"] = Field(
        "Operator",
        description="Who sets the role Deployment's spec.replicas. Operator: replicas, always (a manual "
        "`kubectl scale` is put back). External: an HPA, KEDA or `kubectl scale deployment "
        "<group>-<role>` does, and the operator never writes it after the create.",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, le=64, description="GPUs one vLLM instance shards the model over (--tensor-parallel-size)."
    )
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements,
        description="Resources of each vLLM container; request tensorParallelSize GPUs in limits.",
    )
    extra_args: list[str] = Field(
        default_factory=list, max_length=128, description="Extra vLLM command-line arguments, e.g. --max-num-seqs=64."
    )
    env: EnvList = Field(
        default_factory=list,
        max_length=128,
        description="Extra environment variables, literal or from a Secret, ConfigMap or the pod "
        "(e.g. HF_TOKEN from a Secret for a gated model).",
    )
    volumes: list[Volume] = Field(
        default_factory=list,
        max_length=32,
        description="Extra volumes of the pods: a model-cache PVC, a larger /dev/shm (emptyDir, medium Memory), "
        "ConfigMaps, Secrets, CSI inline volumes.",
    )
    volume_mounts: list[VolumeMount] = Field(
        default_factory=list,
        max_length=32,
        description="Where the vLLM container mounts volumes. A mount at /dev/shm, /tmp or /home/maru replaces "
        "the operator's emptyDir there.",
    )
    service_account_name: str | None = Field(
        None,
        max_length=253,
        pattern=DNS1123_SUBDOMAIN_PATTERN,
        description="ServiceAccount of the vLLM pods (e.g. for workload identity to a model store). Its token "
        "is not mounted unless a projected volume asks for it.",
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Extra node labels for this role, on top of the pool's nodes."
    )
    tolerations: list[Toleration] = Field(default_factory=list, description="Tolerations of this role's pods.")
    strategy: RolloutStrategy = Field(
        default_factory=RolloutStrategy,
        description="How pods are replaced on a change. Default: RollingUpdate with maxSurge 1, and "
        "maxUnavailable 0 for a single replica (the old pod serves until its replacement is ready: "
        "never a role without pods) or 1 for more (the update goes on when no spare GPU is free).",
    )
    shm_size: Quantity | None = Field(
        None,
        description="Size of the pod's /dev/shm (a memory-backed emptyDir, counted in the container's memory). "
        "Default: 1Gi per tensor-parallel rank (vLLM's worker queues and NCCL's shared-memory "
        "transport). A volumeMount at /dev/shm replaces it.",
    )
    termination: Termination = Field(
        default_factory=Termination,
        description="Draining and the grace period of a stopping pod.",
    )
    disruption_budget: DisruptionBudget = Field(
        default_factory=DisruptionBudget,
        description="The role's PodDisruptionBudget.",
    )
    startup_timeout_seconds: int = Field(
        DEFAULT_STARTUP_SECONDS,
        ge=60,
        le=86400,
        description="How long a vLLM pod may take to download and load the model before it is restarted; the "
        "Deployment's progress deadline is derived from it, so a slow load is not reported as stuck.",
    )

    @model_validator(mode="after")
    def _no_operator_owned_flags(self) -> RoleSpec:
        for setting in settings(self.extra_args):
            if setting.flag in OPERATOR_OWNED_FLAGS:
                raise ValueError(
                    f"extraArgs: {setting.spelling!r} sets {setting.flag}, which the operator derives "
                    "from the spec (vLLM reads underscores, aliases, dotted keys and abbreviations "
                    "as that flag)"
                )
        return self

    @model_validator(mode="after")
    def _volumes_add_up(self) -> RoleSpec:
        names = {v.name for v in self.volumes}
        for mount in self.volume_mounts:
            if mount.name not in names:
                raise ValueError(f"volumeMounts: {mount.name!r} names none of volumes")
        for name in names & set(RESERVED_VOLUMES):
            raise ValueError(f"volumes: {name!r} is the name of a volume the operator adds")
        return self


class ConnectorSpec(KubeModel):
    """How KV cache is cut into pool chunks. Shared by both roles by construction."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.chunkTokens % self.blockSize == 0",
                    "message": "chunkTokens must be a positive multiple of blockSize",
                    "fieldPath": ".chunkTokens",
                    "reason": "FieldValueInvalid",
                }
            ]
        }
    )

    chunk_tokens: int = Field(
        DEFAULT_CHUNK_TOKENS, ge=1, le=65536, description="Tokens per pool chunk; a multiple of blockSize."
    )
    block_size: Literal[1, 8, 16, 32, 64, 128] = Field(
        16, description="vLLM KV block size (--block-size). vLLM's CPU backend needs 128."
    )
    cache_namespace: str | None = Field(
        None,
        max_length=253,
        description="The group's cache within its namespace: groups of one namespace that set the same value share "
        "KV. Always inside the group's own namespace: the pool keys every chunk by <namespace>/<cacheNamespace> "
        "from the credential the operator issues, so 'B/x' in namespace A is A/B/x and groups of different "
        "namespaces never share KV. Default: the group's name.",
    )
    rpc_timeout_ms: int = Field(
        500,
        ge=1,
        le=60000,
        description="Per-call timeout of the connector towards the pool; a slower answer counts as a miss "
        "(serving goes on). Raise it where the pool's node is CPU-starved.",
    )

    @model_validator(mode="after")
    def _chunk_holds_whole_blocks(self) -> ConnectorSpec:
        if self.chunk_tokens % self.block_size:
            raise ValueError("chunkTokens: chunkTokens must be a positive multiple of blockSize")
        return self


class DecodeDirect(KubeModel):
    """Send a prompt the pool already holds to decode alone, without a prefill round trip.

    The router pod then runs ``maru-router`` (from the vLLM image: it keys prompts with vLLM's own hashing)
    in front of vllm-router: it asks the pool how much of each prompt it holds and sends a covered one to
    the decode role; every other request goes to vllm-router unchanged.
    """

    enabled: bool = Field(
        True,
        description="Run maru-router in front of vllm-router. false: the router pod is vllm-router alone, and "
        "every request goes through prefill then decode.",
    )
    min_coverage: float = Field(
        1.0,
        ge=0.01,
        le=1.0,
        description="Share of a prompt's full chunks the pool must hold for decode alone to serve it, from 0.01 "
        "to 1.0. 1.0: "
        "all of them (decode computes only the last partial chunk). Lower values send partly "
        "cached prompts to decode too, which then computes the rest itself.",
    )
    to_prefill: bool = Field(
        False,
        description="Let a prefill pod serve a covered prompt alone when it has fewer of the router's requests in "
        "flight than every decode pod (prefill pods load from the pool as decode does), so both roles "
        "serve pool hits. Off: prefill stays free for prompts the pool lacks, and decoding never shares "
        "a step with a long prefill; the router does not see the prefills vllm-router sends.",
    )


class RouterSpec(PodOptions):
    """The router in front of the group (vllm-router in prefill/decode mode, behind maru-router by default)."""

    enabled: bool = Field(True, description="Run a router Deployment and Service for this group.")
    replicas: int = Field(1, ge=1, le=64, description="Router pods.")
    image: str | None = Field(
        None,
        min_length=1,
        description="Router image. Unset: the operator's default, <registry>/vllm-router:<the vllm-router "
        "release it was built for> (the chart's images values, or the operator's --router-image and "
        "--image-registry, choose the registry or the whole reference).",
    )
    policy: Literal["round_robin", "random", "cache_aware", "power_of_two"] = Field(
        "round_robin", description="How the router picks a decode pod."
    )
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field(
        "ClusterIP", description="Type of the router Service."
    )
    port: int = Field(8000, ge=1, le=65535, description="Port of the router Service (OpenAI-compatible API).")
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements, description="Resources of each router container."
    )
    env: EnvList = Field(default_factory=list, max_length=64, description="Environment variables of the router.")
    termination: Termination = Field(
        default_factory=Termination,
        description="Draining and the grace period of a stopping router pod: as long as the generations it "
        "relays may take, so a rollout or a node drain cuts no stream.",
    )
    disruption_budget: DisruptionBudget = Field(
        default_factory=DisruptionBudget,
        description="The router's PodDisruptionBudget.",
    )
    decode_direct: DecodeDirect = Field(
        default_factory=DecodeDirect,
        description="Decode-direct routing: prompts the pool already holds skip prefill. Needs the group's "
        "pool: the router pod then runs on the pool's nodes and mounts its socket and credential.",
    )


class EndpointPickerPort(KubeModel):
    """A port of the endpoint picker's Service."""

    number: int = Field(ge=1, le=65535, description="Port number.")


class EndpointPicker(KubeModel):
    """The endpoint picker (an ext-proc Service, e.g. llm-d's inference scheduler) the gateway asks which pod
    serves each request: the InferencePool's ``spec.endpointPickerRef``."""

    name: str = Field(
        min_length=1,
        max_length=253,
        pattern=DNS1123_SUBDOMAIN_PATTERN,
        description="Name of the endpoint picker's Service, in the group's namespace.",
    )
    port: EndpointPickerPort = Field(description="The Service's port the gateway reaches the picker on (gRPC).")
    failure_mode: Literal["FailOpen", "FailClose"] = Field(
        "FailClose",
        description="What the gateway does when the picker does not answer: FailClose refuses the request, "
        "FailOpen sends it to a pod of the pool the picker did not choose (which, for a P/D group, "
        "may be a prefill pod serving the whole request itself).",
    )


class InferencePoolSpec(KubeModel):
    """An InferencePool (Gateway API Inference Extension, inference.networking.k8s.io/v1) for the group.

    It selects both roles' vLLM pods, so a gateway with an endpoint picker (llm-d's, which pairs prefill and
    decode by the pods' llm-d.ai/role label) can front the group instead of the group's router. Written only
    where the InferencePool CRD is installed; elsewhere the InferencePoolReady condition says so.
    """

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!self.enabled || has(self.endpointPicker)",
                    "message": "endpointPicker is required when enabled is true",
                    "fieldPath": ".endpointPicker",
                    "reason": "FieldValueRequired",
                }
            ]
        }
    )

    enabled: bool = Field(False, description="Write an InferencePool named after the group.")
    endpoint_picker: EndpointPicker | None = Field(
        None,
        description="The endpoint picker the InferencePool names; required when enabled.",
    )

    @model_validator(mode="after")
    def _picker_when_enabled(self) -> InferencePoolSpec:
        if self.enabled and self.endpoint_picker is None:
            raise ValueError("inferencePool.endpointPicker: required when inferencePool.enabled is true")
        return self


class PoolEventsConsumer(KubeModel):
    """Who may connect to the stream, as a NetworkPolicy ``from`` peer: pods by their labels (in the group's
    namespace), every pod of the namespaces a namespaceSelector selects, or both (those pods in those
    namespaces). An empty selector selects everything of its kind."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "has(self.podSelector) || has(self.namespaceSelector)",
                    "message": "set podSelector, namespaceSelector or both",
                    "reason": "FieldValueRequired",
                }
            ]
        }
    )

    pod_selector: LabelSelector | None = Field(None, description="The consumer's pods, by label.")
    namespace_selector: LabelSelector | None = Field(
        None,
        description="The consumer's namespaces, by label (kubernetes.io/metadata.name selects one by name).",
    )

    @model_validator(mode="after")
    def _a_selector(self) -> PoolEventsConsumer:
        if self.pod_selector is None and self.namespace_selector is None:
            raise ValueError("poolEvents.consumers: set podSelector, namespaceSelector or both")
        return self

    def to_peer(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True, exclude_defaults=True)


class PoolEventsCurve(KubeModel):
    """ZMQ CURVE for the stream: both ports admit only the consumers whose public keys the Secret lists."""

    secret_name: ResourceName = Field(
        description="A Secret in the group's namespace with server-secret-key (the publisher's CURVE secret key, "
        "Z85, 40 characters) and client-public-keys (the admitted consumers' public keys, one a line, "
        "optionally followed by a name). Edits reach the running publisher within the kubelet's sync "
        "period; a consumer whose key is removed cannot connect again.",
    )


class PoolEventsSpec(KubeModel):
    """Publish what the pool holds for this group as vLLM KV events, for a KV-aware router of your own.

    A Deployment ``<group>-pool-events`` runs ``maru-pool events`` with the group's pool credential and publishes
    the group's pool events (stored on commit, removed on eviction, cleared on flush) over ZMQ in vLLM's KV
    event format, behind a Service of the same name: ``tcp://<group>-pool-events.<namespace>.svc:5557`` (and a
    replay socket on 5558), so llm-d's KV cache indexer, Dynamo's KV router or any consumer of vLLM's events can
    treat the pool as one more tier.
    """

    enabled: bool = Field(False, description="Run the group's pool events publisher and its Service.")
    medium: str = Field(
        "MARU_POOL",
        min_length=1,
        max_length=32,
        pattern=r"^[A-Z][A-Z0-9_]*$",
        description="The events' medium: MARU_POOL names the pool as a tier of its own; CPU makes a consumer "
        "configured only for vLLM's media count it as a CPU tier.",
    )
    consumers: list[PoolEventsConsumer] = Field(
        default_factory=list,
        max_length=32,
        description="Who may connect to the stream and its replay socket (the NetworkPolicy's ingress). Empty: "
        "only pods in the group's namespace.",
    )
    token_ids: bool = Field(
        False,
        description="Publish each stored chunk's prompt tokens in BlockStored.token_ids. Off: they are the "
        "tenants' prompts; every consumer reads the same stream, so turn this on only where each "
        "consumer may read every prompt (llm-d's and Dynamo's indexers key by block hash and need "
        "none).",
    )
    curve: PoolEventsCurve | None = Field(
        None,
        description="Authenticate consumers with ZMQ CURVE. Unset: any pod the consumers admit may read.",
    )


class ReplicaRatio(KubeModel):
    """Prefill:decode pods to keep when an autoscaler scales one role: the other follows."""

    prefill: int = Field(ge=1, le=64, description="Prefill pods per ``decode`` decode pods.")
    decode: int = Field(ge=1, le=64, description="Decode pods per ``prefill`` prefill pods.")


class InferenceGroupSpec(KubeModel):
    """Desired state of an InferenceGroup."""

    model: ModelSpec = Field(description="The model both roles serve.")
    pool_ref: PoolRef = Field(description="The MaruPool that carries KV cache from prefill to decode.")
    image: str | None = Field(
        None,
        min_length=1,
        description="vLLM image with the Maru connector installed. Unset: the operator's default, "
        "<registry>/vllm-maru:<the operator's version> (the chart's images values, or the operator's "
        "--vllm-image and --image-registry, choose the registry or the whole reference).",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="Pull policy of the vLLM image."
    )
    prefill: RoleSpec = Field(default_factory=RoleSpec, description="Prefill pods: store prompt KV.")
    decode: RoleSpec = Field(default_factory=RoleSpec, description="Decode pods: load prompt KV, generate.")
    connector: ConnectorSpec = Field(default_factory=ConnectorSpec, description="KV chunking, shared by both roles.")
    model_cache: ModelCacheSpec = Field(
        default_factory=ModelCacheSpec,
        description="Where the pods keep downloaded weights. Default: a ReadWriteMany PersistentVolumeClaim the "
        "operator creates, shared by every pod of the group, so a model is downloaded once, not once "
        "per pod.",
    )
    replica_ratio: ReplicaRatio | None = Field(
        None,
        description="Keep prefill:decode at this ratio while an autoscaler scales one role (scaler External on "
        "exactly one of them): the operator sets the other role's replicas to "
        "ceil(scaled role's replicas x its share), at least 1.",
    )
    router: RouterSpec = Field(default_factory=RouterSpec, description="The router in front of the group.")
    inference_pool: InferencePoolSpec = Field(
        default_factory=InferencePoolSpec,
        description="An InferencePool for a gateway with an endpoint picker to front the group (off by default; "
        "needs the Gateway API Inference Extension's CRDs).",
    )
    pool_events: PoolEventsSpec = Field(
        default_factory=PoolEventsSpec,
        description="Publish what the pool holds for this group as vLLM KV events (off by default), for a "
        "KV-aware router such as llm-d's or Dynamo's.",
    )
    pool_quota: TenantQuota | None = Field(
        None,
        description=(
            "This group's quota in its pool (bytes, pins, write leases), enforced by the pool daemons: another "
            "group's flood cannot evict this one's chunks while it stays within its share, and this group cannot "
            "take the whole pool. Fields not set: the MaruPool's tenantQuota, then the daemon's defaults. Capped "
            "by the MaruPool's maxTenantQuota (unset: by those defaults, so raising a quota is the pool owner's "
            "call). Groups sharing a cacheNamespace share one quota: set the same value."
        ),
    )

    @model_validator(mode="after")
    def _ratio_follows_one_scaled_role(self) -> InferenceGroupSpec:
        if self.replica_ratio is None:
            return self
        external = [r for r in ("prefill", "decode") if getattr(self, r).scaler == "External"]
        if len(external) != 1:
            raise ValueError(
                "replicaRatio: needs scaler External on exactly one of prefill and decode (the role "
                f"an autoscaler scales; the other follows), found {len(external)}"
            )
        return self


class RoleStatus(KubeModel):
    """Observed replicas of one role."""

    model_config = ConfigDict(extra="ignore")

    desired: int = Field(0, description="Replicas asked for.")
    ready: int = Field(0, description="Replicas ready to serve.")
    summary: str = Field("", description="ready/desired, for kubectl get.")


class PoolUsage(KubeModel):
    """A group's use of its pool, from the pool daemons' /status (summed over nodes for shm pools)."""

    model_config = ConfigDict(extra="ignore")

    used: str = Field("", description="Pool memory this group's chunks take, as a quantity.")
    used_bytes: int = Field(0, description="Pool memory this group's chunks take, in bytes.")
    quota: str = Field("", description="The byte quota the daemons enforce (per node for shm pools).")
    quota_bytes: int = Field(0, description="The byte quota in bytes.")
    chunks: int = Field(0, description="Chunks stored.")
    pins: int = Field(0, description="Read pins held now.")
    leases: int = Field(0, description="Write leases held now.")
    evictions_by_others: int = Field(
        0, description="This group's chunks evicted to make room for other groups' (since the daemons started)."
    )
    quota_refusals: int = Field(0, description="Stores skipped and loads missed because the group was at its quota.")


class InferenceGroupStatus(KubeModel):
    """Observed state of an InferenceGroup."""

    model_config = ConfigDict(extra="ignore")

    observed_generation: int | None = Field(None, description="Generation the status was computed from.")
    conditions: list[Condition] = Field(
        default_factory=list,
        description="PoolBound, Ready, Progressing, Degraded, DisaggregationActive; InferencePoolReady with "
        "spec.inferencePool.enabled.",
    )
    prefill: RoleStatus = Field(default_factory=RoleStatus, description="Prefill replicas.")
    decode: RoleStatus = Field(default_factory=RoleStatus, description="Decode replicas.")
    router: RoleStatus = Field(default_factory=RoleStatus, description="Router replicas.")
    endpoint: str = Field("", description="URL of the group's OpenAI-compatible API (the router Service).")
    pool_endpoint: str = Field("", description="Pool URL written into the connector config of both roles.")
    pool_usage: PoolUsage | None = Field(
        None,
        description="This group's use of its pool against its quota, as the pool daemons last reported it "
        "(refreshed at the pool's usage interval).",
    )


class InferenceGroup(CustomResource):
    """One model served by prefill and decode vLLM pods sharing KV through a MaruPool."""

    kind: ClassVar[str] = "InferenceGroup"
    plural: ClassVar[str] = "inferencegroups"
    scope: ClassVar[Literal["Namespaced", "Cluster"]] = "Namespaced"
    short_names: ClassVar[list[str]] = ["ig"]
    description: ClassVar[str] = (
        "InferenceGroup serves one model with prefill and decode vLLM pods that pass KV cache through a "
        "MaruPool, behind a router. The operator writes both roles' connector config from one spec."
    )
    printer_columns: ClassVar[list[dict[str, str]]] = [
        {"name": "Model", "type": "string", "jsonPath": ".spec.model.name", "priority": "1"},
        {"name": "Pool", "type": "string", "jsonPath": ".spec.poolRef.name"},
        {"name": "Prefill", "type": "string", "jsonPath": ".status.prefill.summary"},
        {"name": "Decode", "type": "string", "jsonPath": ".status.decode.summary"},
        {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
        # Whether decode is loading what prefill stored (the DisaggregationActive condition): a group can be
        # Ready while every request is computed twice.
        {
            "name": "Disagg",
            "type": "string",
            "jsonPath": '.status.conditions[?(@.type=="DisaggregationActive")].status',
        },
        {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint", "priority": "1"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]

    spec: InferenceGroupSpec
    status: InferenceGroupStatus | None = None
