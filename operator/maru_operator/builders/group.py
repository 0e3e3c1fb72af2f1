"""Children of an InferenceGroup: prefill and decode vLLM Deployments, and the router in front.

Both roles get their ``--kv-transfer-config`` from :func:`maru_contracts.config.kv_transfer_config_json`,
built from one spec, so prefill and decode can never disagree on chunk size, pool or key namespace.
Both mount the group's pool credential (:mod:`.credentials`), the token of the group's cache scope, which
the CSI node plugin mints when the pod starts.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from maru_contracts.config import KVRole, MaruConnectorConfig, kv_transfer_config_json
from maru_contracts.router import IN_PROGRESS_METRIC
from maru_contracts.tenancy import tenant_scope
from maru_contracts.topics import events_topic
from maru_operator.api.common import Toleration
from maru_operator.api.inferencegroup import InferenceGroupSpec, RoleSpec
from maru_operator.api.marupool import MaruPoolSpec
from maru_operator.api.pod import PodOptions
from maru_operator.builders.common import (
    LABEL_INSTANCE,
    LABEL_NAME,
    LABEL_POOL,
    LABEL_ROLE,
    NONROOT_UID,
    Object,
    Owner,
    labels,
    metadata,
    restricted_container_security,
    restricted_pod_security,
    selector,
)
from maru_operator.builders.credentials import (
    CREDENTIAL_VOLUME,
    TOKEN_FILE,
    credential_mount,
    credential_volume,
)
from maru_operator.builders.disruption import build_disruption_budget
from maru_operator.builders.lifecycle import (
    TEMPLATE_HASH,
    VLLM_COMMAND,
    pre_stop,
    rolling_update,
    shm_volume,
    template_hash,
    with_ephemeral_request,
)
from maru_operator.builders.modelcache import (
    model_cache_env,
    model_cache_ephemeral_bytes,
    model_cache_volume,
    replaced_by_user,
)
from maru_operator.builders.pool import pool_endpoint, socket_host_dir
from maru_operator.builders.poolsocket import SOCKET_VOLUME, pool_socket_mount, pool_socket_volume
from maru_operator.builders.resources import ROUTER, VLLM_PER_RANK, ResourceDefault, scaled, with_defaults
from maru_operator.builders.scaling import desired_replicas, external_annotations
from maru_operator.builders.scratch import scratch_env, scratch_mounts, scratch_volumes
from maru_operator.images import DEFAULT_ROUTER_IMAGE, DEFAULT_VLLM_IMAGE
from maru_operator.names import child_name, label_value, short_hash
from maru_operator.rbac import router_role_name

Role = Literal["prefill", "decode"]

VLLM_APP = "vllm"
ROUTER_APP = "vllm-router"
VLLM_PORT = 8000
ROUTER_CONTAINER_PORT = 8000
ROUTER_METRICS_PORT = 29000
# With decode-direct, maru-router takes the router's API port and vllm-router moves behind it, in the same pod.
UPSTREAM_PORT = 8001
DIRECT_METRICS_PORT = 29001
# With decode-direct, every engine publishes its prefix cache's stores and evictions (vLLM's KV events) here, for
# maru-router to send a prompt to the pod whose own cache holds more of it than the pool. vLLM binds only a
# wildcard address; the router reads it at the pod's address.
KV_EVENTS_PORT = 5557
# How often maru-router takes the pods vllm-router found as its own engines.
FOLLOW_WORKERS_SECONDS = 5
# How long a deleted vLLM or router pod keeps serving, however idle (its preStop hook's least wait): its clients
# stop sending to it within this. maru-router, the slowest, drops a vLLM pod at its next look at vllm-router's
# workers; kube-proxy (the router pods' Service) and vllm-router's pod watch take seconds on a busy node.
STOP_SENDING_SECONDS = 2 * FOLLOW_WORKERS_SECONDS

# maru-router imports vLLM (and torch) for its block hashing: a Python process of some hundred MiB.
DIRECT_ROUTER = ResourceDefault(request=512 * 2**20, limit=2 * 2**30, cpu_millis=100)

# Prefill loads what any replica stored and stores the rest, so the pool is one prefix cache for the
# whole fleet: a document one prefill replica read is a hit on every other. Decode only loads: its
# prefill has stored (or is storing, and says so in the handoff) every chunk of the prompt, so a
# decode-side store would only duplicate them.
KV_ROLES: dict[Role, KVRole] = {"prefill": "kv_both", "decode": "kv_consumer"}

# Chunk keys derive from vLLM's block hashes. With the xxhash block-hash options vLLM seeds every chain
# from PYTHONHASHSEED, randomly when it is unset, so engines would never agree on a key; sha256 (the
# default) uses a fixed seed. Setting one value on every engine keeps keys shared whichever option
# a user picks in extraArgs.
HASH_SEED_ENV = "PYTHONHASHSEED"
HASH_SEED = "0"


@dataclass(frozen=True)
class PoolView:
    """What a group needs to know about its pool."""

    name: str
    spec: MaruPoolSpec

    @property
    def endpoint(self) -> str:
        return pool_endpoint(self.spec, self.name)


def role_name(group: str, role: str) -> str:
    return child_name(group, role)


def router_name(group: str) -> str:
    return child_name(group, "router")


def service_name(group: str) -> str:
    """The group's front door is named after the group: ``http://<group>.<namespace>.svc``."""
    return child_name(group)


def cache_name(spec: InferenceGroupSpec, group: str) -> str:
    """The group's cache within its namespace: its cacheNamespace, else its name."""
    return spec.connector.cache_namespace or group


def cache_scope(spec: InferenceGroupSpec, owner: Owner) -> str:
    """The group's key scope in the pool: ``<namespace>/<cacheNamespace, or the group's name>``.

    The namespace comes from the group's own metadata and always comes first, so ``cacheNamespace: B/x``
    in namespace A is the scope ``A/B/x``, never B's: groups of one namespace share KV by naming the same
    cacheNamespace, groups of two namespaces never do. The group's token names this scope and the pool
    keys every chunk by it; the connector's salt is the same string. Hashed down to 253 characters, as the
    CSI node plugin does when it mints the token (one function: :func:`maru_contracts.tenancy.tenant_scope`).
    """
    return tenant_scope(owner.namespace or "", cache_name(spec, owner.name))


def pool_credential_volume(spec: InferenceGroupSpec, group: str, pool: PoolView) -> Object:
    """The credential volume of every pod of the group that talks to its pool: its cache's token, minted at publish."""
    return credential_volume(socket_host_dir(pool.spec, pool.name), cache_name(spec, group), spec.pool_quota)


def connector_config(
    spec: InferenceGroupSpec, owner: Owner, pool: PoolView, role: Role | None = None
) -> MaruConnectorConfig:
    """The connector's config; ``role`` decode also gets prefill's TP size when it differs from its own
    (the chunks it loads hold prefill's head ranges; equal sizes render exactly as before)."""
    writer_tp = spec.prefill.tensor_parallel_size
    return MaruConnectorConfig(
        pool_url=pool.endpoint,
        chunk_tokens=spec.connector.chunk_tokens,
        cache_namespace=cache_scope(spec, owner),
        pool_token_file=TOKEN_FILE,
        rpc_timeout_ms=spec.connector.rpc_timeout_ms,
        writer_tp=writer_tp if role == "decode" and writer_tp != spec.decode.tensor_parallel_size else None,
    )


def vllm_args(spec: InferenceGroupSpec, role: Role, owner: Owner, pool: PoolView) -> list[str]:
    role_spec: RoleSpec = getattr(spec, role)
    model = spec.model
    args = [
        model.name,
        "--port",
        str(VLLM_PORT),
        "--served-model-name",
        model.served_model_name or model.name,
        "--tensor-parallel-size",
        str(role_spec.tensor_parallel_size),
        "--block-size",
        str(spec.connector.block_size),
        "--dtype",
        model.dtype,
    ]
    if model.revision:
        args += ["--revision", model.revision]
    if model.max_model_len:
        args += ["--max-model-len", str(model.max_model_len)]
    if model.adapters:
        # Both roles load the same adapters: decode reads what prefill stored under each adapter's keys.
        args += [
            "--enable-lora",
            "--max-loras",
            str(len(model.adapters)),
            "--lora-modules",
            *(f"{a.name}={a.source}" for a in model.adapters),
        ]
    args += ["--kv-transfer-config", kv_transfer_config_json(KV_ROLES[role], connector_config(spec, owner, pool, role))]
    if decode_direct(spec, pool):
        # The topic names the engine's key revision: maru-router, reading where the engine publishes, pairs
        # prefill and decode by it during a rollout that changes the keys.
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{KV_EVENTS_PORT}",
            "topic": events_topic(kv_revision(spec, owner, pool)),
        }
        args += ["--kv-events-config", json.dumps(events, separators=(",", ":"))]
    return args + list(role_spec.extra_args)


def pool_node_affinity(pool: MaruPoolSpec) -> dict[str, Any] | None:
    """Required affinity to the nodes that carry the pool: elsewhere there is no socket to reach."""
    if not pool.node_selector:
        return None
    expressions = [{"key": k, "operator": "In", "values": [v]} for k, v in sorted(pool.node_selector.items())]
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": expressions}]}
        }
    }


def pool_placement(
    pool: PoolView, *, near: dict[str, str] | None = None, tolerations: Sequence[Toleration] = ()
) -> dict[str, Any]:
    """``affinity`` and ``tolerations`` of a pod that uses the pool's socket: on the pool's nodes, tolerating
    their taints (and ``tolerations``); with an shm pool, preferably beside the pods ``near`` selects, since
    each node's shm pool holds only what that node's pods stored."""
    out: dict[str, Any] = {}
    affinity = pool_node_affinity(pool.spec) or {}
    if pool.spec.backend == "shm" and near is not None:
        affinity["podAffinity"] = {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 100,
                    "podAffinityTerm": {
                        "labelSelector": {"matchLabels": dict(near)},
                        "topologyKey": "kubernetes.io/hostname",
                    },
                }
            ]
        }
    if affinity:
        out["affinity"] = affinity
    merged: list[dict[str, Any]] = []
    for t in [*pool.spec.tolerations, *tolerations]:
        dumped = t.model_dump(by_alias=True, exclude_none=True)
        if dumped not in merged:
            merged.append(dumped)
    if merged:
        out["tolerations"] = merged
    return out


def _resources(spec: InferenceGroupSpec, role_spec: RoleSpec) -> dict[str, Any]:
    given = {k: v for k, v in role_spec.resources.model_dump(by_alias=True).items() if v}
    return with_ephemeral_request(
        with_defaults(given, scaled(VLLM_PER_RANK, role_spec.tensor_parallel_size)), model_cache_ephemeral_bytes(spec)
    )


PROBE_PERIOD_SECONDS = 10
# Beyond the startup budget, for scheduling, image pull and the gap between a pod's start and its probe.
PROGRESS_MARGIN_SECONDS = 600


def _probe(path: str, port: str, **extra: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": PROBE_PERIOD_SECONDS,
        "timeoutSeconds": 5,
        **extra,
    }


def role_env(role_spec: RoleSpec) -> list[dict[str, Any]]:
    """The vLLM container's env: the hash seed every engine must share, the user's, then the cache locations
    the user did not set (the model cache first). Each name appears once (server-side apply keys env by
    name)."""
    env = [{"name": HASH_SEED_ENV, "value": HASH_SEED}]
    env += [e.to_k8s() for e in role_spec.env if e.name != HASH_SEED_ENV]
    if not replaced_by_user(role_spec):
        env += [{"name": k, "value": v} for k, v in model_cache_env().items()]
    return env + scratch_env({e["name"] for e in env})


def role_volumes(
    spec: InferenceGroupSpec, role_spec: RoleSpec, pool: PoolView, group: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(pod volumes, vLLM container mounts): the operator's, then the user's.

    A user mount at /dev/shm replaces the operator's (a larger tmpfs for NCCL, say), one at the model
    cache's path replaces the cache, and one at a scratch directory (``$HOME``, ``/tmp``) replaces that
    emptyDir; the pool socket and the pool credential cannot be replaced (the semantic checks refuse a
    mount there).
    """
    taken = {m.mount_path.rstrip("/") for m in role_spec.volume_mounts}
    # NCCL and vLLM's worker processes exchange tensors in /dev/shm; the runtime default is 64Mi.
    operator = [
        (pool_socket_volume(pool.spec, pool.name), pool_socket_mount(pool.spec, pool.name)),
        (pool_credential_volume(spec, group, pool), credential_mount()),
        shm_volume(role_spec),
        *([] if replaced_by_user(role_spec) else [model_cache_volume(spec, group)]),
        *zip(scratch_volumes(), scratch_mounts(), strict=True),
    ]
    kept = [
        (v, m) for v, m in operator if v["name"] in (SOCKET_VOLUME, CREDENTIAL_VOLUME) or m["mountPath"] not in taken
    ]
    volumes = [v for v, _ in kept] + [v.to_k8s() for v in role_spec.volumes]
    mounts = [m for _, m in kept] + [m.to_k8s() for m in role_spec.volume_mounts]
    return volumes, mounts


def apply_pod_options(template: dict[str, Any], options: PodOptions, own_pods: dict[str, str]) -> None:
    """Add the user's pod options to a pod template; ``own_pods``: labels selecting these pods.

    The operator's labels win over the user's (selectors and pod discovery depend on them).
    """
    meta, pod = template["metadata"], template["spec"]
    meta["labels"] = {**options.pod_labels, **meta["labels"]}
    if options.pod_annotations:
        meta["annotations"] = dict(options.pod_annotations)
    if options.image_pull_secrets:
        pod["imagePullSecrets"] = [s.model_dump() for s in options.image_pull_secrets]
    if options.priority_class_name:
        pod["priorityClassName"] = options.priority_class_name
    if options.topology_spread_constraints:
        pod["topologySpreadConstraints"] = [c.to_k8s(own_pods) for c in options.topology_spread_constraints]


def rollout(role_spec: RoleSpec, replicas: int) -> dict[str, Any]:
    """The Deployment's strategy and progress deadline: a slow model load must not count as stuck."""
    strategy = role_spec.strategy
    out: dict[str, Any] = {"type": strategy.type}
    if strategy.type == "RollingUpdate":
        out["rollingUpdate"] = rolling_update(role_spec, replicas)
    return {"strategy": out, "progressDeadlineSeconds": role_spec.startup_timeout_seconds + PROGRESS_MARGIN_SECONDS}


def role_labels(owner: Owner, role: str, pool: str) -> dict[str, str]:
    return {**labels(owner, app=VLLM_APP, component=role, role=role), LABEL_POOL: label_value(pool)}


# The role as llm-d's scheduler and LeaderWorkerSet's DisaggregatedSet select it, beside our own maru.io/role.
LLMD_ROLE_LABEL = "llm-d.ai/role"
# What the pool keys of a pod depend on: pods of two roles may be paired only when theirs are equal (an old
# prefill and a new decode mid-rollout would store and look up different keys).
KV_REVISION_LABEL = "maru.io/kv-revision"


def kv_revision(spec: InferenceGroupSpec, owner: Owner, pool: PoolView) -> str:
    """A hash of everything the chunk keys derive from: the model, its revision and dtype, the block and
    chunk sizes, the cache scope and the connector's own settings (the same for both roles)."""
    model = spec.model
    parts = [
        model.name,
        model.revision or "",
        model.dtype,
        str(spec.connector.block_size),
        connector_config(spec, owner, pool).model_dump_json(),
    ]
    return short_hash("\0".join(parts))


def vllm_pods(owner: Owner) -> dict[str, str]:
    """The group's vLLM pods of both roles (not the router's): what their NetworkPolicy selects, and what an
    InferencePool's endpoint picker chooses among."""
    return {LABEL_NAME: VLLM_APP, LABEL_INSTANCE: owner.instance}


def discovery_selector(owner: Owner, role: str) -> dict[str, str]:
    """Labels the router uses to find this group's pods of one role (and nothing else)."""
    return {LABEL_NAME: VLLM_APP, LABEL_INSTANCE: owner.instance, LABEL_ROLE: role}


def build_role_deployment(
    spec: InferenceGroupSpec,
    role: Role,
    owner: Owner,
    pool: PoolView,
    observed: Mapping[str, int | None] | None = None,
) -> Object:
    """The vLLM Deployment of one role; ``observed``: each role Deployment's replicas now (for a ratio)."""
    role_spec: RoleSpec = getattr(spec, role)
    pod_labels = role_labels(owner, role, pool.name)
    volumes, mounts = role_volumes(spec, role_spec, pool, owner.name)
    replicas = desired_replicas(spec, role, observed or {})
    container: dict[str, Any] = {
        "name": "vllm",
        "image": spec.image or DEFAULT_VLLM_IMAGE,
        "imagePullPolicy": spec.image_pull_policy,
        "command": list(VLLM_COMMAND),
        "args": vllm_args(spec, role, owner, pool),
        "env": role_env(role_spec),
        "ports": [
            {"name": "http", "containerPort": VLLM_PORT, "protocol": "TCP"},
            *(
                [{"name": "kv-events", "containerPort": KV_EVENTS_PORT, "protocol": "TCP"}]
                if decode_direct(spec, pool)
                else []
            ),
        ],
        "resources": _resources(spec, role_spec),
        "volumeMounts": mounts,
        # Loading weights can take many minutes; liveness only starts once the server answered once.
        "startupProbe": _probe(
            "/health", "http", failureThreshold=-(-role_spec.startup_timeout_seconds // PROBE_PERIOD_SECONDS)
        ),
        "readinessProbe": _probe("/health", "http", failureThreshold=3),
        "livenessProbe": _probe("/health", "http", failureThreshold=6),
        # vLLM's caches and temporary files go to emptyDirs (scratch_env points them there).
        "securityContext": restricted_container_security(),
    }
    if lifecycle := pre_stop(role_spec.termination, VLLM_PORT, min_wait=STOP_SENDING_SECONDS):
        container["lifecycle"] = lifecycle
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        # fsGroup: the model cache claim's files are the pods' to write, whoever created its root; only when
        # the root's group differs is it changed (a recursive chown of a model cache takes minutes).
        "securityContext": {
            **restricted_pod_security(),
            "fsGroup": NONROOT_UID,
            "fsGroupChangePolicy": "OnRootMismatch",
        },
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": role_spec.termination.grace_period_seconds,
    }
    if role_spec.service_account_name:
        pod_spec["serviceAccountName"] = role_spec.service_account_name
    # An shm pool is one independent pool per node: decode finds prefill's KV only on prefill's node.
    near = discovery_selector(owner, "prefill") if role == "decode" else None
    pod_spec.update(pool_placement(pool, near=near, tolerations=role_spec.tolerations))
    if role_spec.node_selector:
        pod_spec["nodeSelector"] = dict(role_spec.node_selector)
    template = {
        "metadata": {
            "labels": {**pod_labels, LLMD_ROLE_LABEL: role, KV_REVISION_LABEL: kv_revision(spec, owner, pool)}
        },
        "spec": pod_spec,
    }
    apply_pod_options(template, role_spec, discovery_selector(owner, role))
    meta = metadata(owner, name=role_name(owner.name, role), namespace=owner.namespace, labels=pod_labels)
    meta["annotations"] = {TEMPLATE_HASH: template_hash(template), **external_annotations(spec, role)}
    deployment_spec: dict[str, Any] = {
        "selector": {"matchLabels": selector(owner, app=VLLM_APP, component=role)},
        **rollout(role_spec, role_spec.replicas if replicas is None else replicas),
        "template": template,
    }
    if replicas is not None:
        deployment_spec = {"replicas": replicas, **deployment_spec}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": deployment_spec}


def build_role_disruption_budget(spec: InferenceGroupSpec, role: Role, owner: Owner, pool: PoolView) -> Object | None:
    return build_disruption_budget(
        owner,
        role,
        getattr(spec, role).disruption_budget,
        role_labels(owner, role, pool.name),
        selector(owner, app=VLLM_APP, component=role),
    )


def _router_labels(owner: Owner) -> dict[str, str]:
    return labels(owner, app=ROUTER_APP, component="router", role="router")


def build_router_service_account(spec: InferenceGroupSpec, owner: Owner) -> Object | None:
    if not spec.router.enabled:
        return None
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": metadata(
            owner, name=router_name(owner.name), namespace=owner.namespace, labels=_router_labels(owner)
        ),
    }


def router_binding_name(group: str) -> str:
    # Not the router's own name, which the RoleBinding of earlier versions had: a binding's roleRef cannot
    # change, so the new one is a new object and the old one (and its Role) is pruned.
    return child_name(group, "router-pods")


def build_router_role_binding(spec: InferenceGroupSpec, owner: Owner) -> Object | None:
    """The router discovers prefill and decode pods by label: read-only pods, this namespace only, through the
    instance's routers' ClusterRole, which the operator may bind but does not hold (see maru_operator.rbac)."""
    if not spec.router.enabled:
        return None
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": metadata(
            owner, name=router_binding_name(owner.name), namespace=owner.namespace, labels=_router_labels(owner)
        ),
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": router_role_name(owner.operator_instance),
        },
        "subjects": [{"kind": "ServiceAccount", "name": router_name(owner.name), "namespace": owner.namespace}],
    }


def _selector_args(flag: str, match: dict[str, str]) -> list[str]:
    return [flag, *(f"{k}={v}" for k, v in match.items())]


def decode_direct(spec: InferenceGroupSpec, pool: PoolView | None) -> bool:
    """Whether the router pod runs maru-router in front of vllm-router: it needs the pool to ask it."""
    return spec.router.enabled and spec.router.decode_direct.enabled and pool is not None


def router_args(spec: InferenceGroupSpec, owner: Owner, port: int = ROUTER_CONTAINER_PORT) -> list[str]:
    """vllm-router 0.1.17 in P/D mode, finding workers by Kubernetes label selectors."""
    return [
        "--host",
        "0.0.0.0",
        "--port",
        str(port),
        "--vllm-pd-disaggregation",
        "--policy",
        spec.router.policy,
        "--service-discovery",
        "--service-discovery-namespace",
        str(owner.namespace),
        "--service-discovery-port",
        str(VLLM_PORT),
        *_selector_args("--prefill-selector", discovery_selector(owner, "prefill")),
        *_selector_args("--decode-selector", discovery_selector(owner, "decode")),
        "--prometheus-host",
        "0.0.0.0",
        "--prometheus-port",
        str(ROUTER_METRICS_PORT),
    ]


def _router_resources(spec: InferenceGroupSpec, default: ResourceDefault) -> dict[str, Any]:
    given = {k: v for k, v in spec.router.resources.model_dump(by_alias=True).items() if v}
    return with_defaults(given, default)


def vllm_router_container(spec: InferenceGroupSpec, owner: Owner, *, port: int, port_name: str) -> dict[str, Any]:
    """vllm-router: the whole router, or (decode-direct) the prefill-then-decode path behind maru-router."""
    container: dict[str, Any] = {
        "name": "router" if port_name == "http" else "vllm-router",
        "image": spec.router.image or DEFAULT_ROUTER_IMAGE,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["vllm-router"],
        "args": router_args(spec, owner, port),
        "ports": [
            {"name": port_name, "containerPort": port, "protocol": "TCP"},
            {"name": "metrics", "containerPort": ROUTER_METRICS_PORT, "protocol": "TCP"},
        ],
        "resources": _router_resources(spec, ROUTER),
        "readinessProbe": _probe("/readiness", port_name, failureThreshold=3),
        "livenessProbe": _probe("/liveness", port_name, failureThreshold=6),
        "securityContext": restricted_container_security(),
    }
    if spec.router.env:
        container["env"] = [e.to_k8s() for e in spec.router.env]
    return container


def role_url(owner: Owner, role: Role) -> str:
    """A role's Service, as maru-router reaches it (the namespace's search path is not needed)."""
    return f"http://{role_name(owner.name, role)}.{owner.namespace}.svc:{VLLM_PORT}"


def maru_router_args(spec: InferenceGroupSpec, owner: Owner, pool: PoolView) -> list[str]:
    """maru-router in front of vllm-router (``--upstream``), with the engines' connector config to reach the
    pool; the role Services carry its decode-direct requests and the requests that teach it the key scheme."""
    extra = connector_config(spec, owner, pool).to_extra_config()
    return [
        "--host",
        "0.0.0.0",
        "--port",
        str(ROUTER_CONTAINER_PORT),
        "--metrics-port",
        str(DIRECT_METRICS_PORT),
        "--upstream",
        f"http://127.0.0.1:{UPSTREAM_PORT}",
        "--prefill",
        role_url(owner, "prefill"),
        "--decode",
        role_url(owner, "decode"),
        "--connector-config",
        json.dumps(extra, sort_keys=True, separators=(",", ":")),
        "--min-coverage",
        repr(spec.router.decode_direct.min_coverage),
        # The pods vllm-router found, each asked where it publishes its KV events: a prompt a prefill pod holds
        # beyond the pool gets its prefill there (the rest stays vllm-router's).
        "--follow-upstream-workers",
        str(FOLLOW_WORKERS_SECONDS),
        "--discover-kv-events",
        *(["--direct-to-prefill", "on"] if spec.router.decode_direct.to_prefill else []),
    ]


def maru_router_container(spec: InferenceGroupSpec, owner: Owner, pool: PoolView) -> dict[str, Any]:
    """maru-router, from the engines' image: it keys prompts with vLLM's own hashing and the connector's code,
    under the engines' hash seed, and reaches the pool through the same socket and credential."""
    env = [{"name": HASH_SEED_ENV, "value": HASH_SEED}]
    env += [e.to_k8s() for e in spec.router.env if e.name != HASH_SEED_ENV]
    env += scratch_env({e["name"] for e in env})
    return {
        "name": "router",
        "image": spec.image or DEFAULT_VLLM_IMAGE,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["maru-router"],
        "args": maru_router_args(spec, owner, pool),
        "env": env,
        "ports": [
            {"name": "http", "containerPort": ROUTER_CONTAINER_PORT, "protocol": "TCP"},
            {"name": "direct-metrics", "containerPort": DIRECT_METRICS_PORT, "protocol": "TCP"},
        ],
        "resources": _router_resources(spec, DIRECT_ROUTER),
        # vLLM's import takes seconds on a busy node before the port opens.
        "startupProbe": _probe("/health", "http", failureThreshold=30),
        "readinessProbe": _probe("/health", "http", failureThreshold=3),
        "livenessProbe": _probe("/health", "http", failureThreshold=6),
        "volumeMounts": [*pool_access(spec, pool, owner.name)[1], *scratch_mounts()],
        "securityContext": restricted_container_security(),
    }


def pool_access(spec: InferenceGroupSpec, pool: PoolView, group: str) -> tuple[list[Object], list[Object]]:
    """(volumes, mounts) of the pool socket and the pool credential, exactly as the decode engines have them."""
    volumes, mounts = role_volumes(spec, spec.decode, pool, group)
    wanted = (SOCKET_VOLUME, CREDENTIAL_VOLUME)
    return [v for v in volumes if v["name"] in wanted], [m for m in mounts if m["name"] in wanted]


API_ACCESS_VOLUME = "kube-api-access"
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def api_access_volume() -> Object:
    """The volume Kubernetes' ServiceAccount admission adds to every container when a pod does not opt out:
    a bound token, the cluster's CA and the namespace, for one container alone."""
    return {
        "name": API_ACCESS_VOLUME,
        "projected": {
            "defaultMode": 0o644,
            "sources": [
                {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
                {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                {
                    "downwardAPI": {
                        "items": [
                            {"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}
                        ]
                    }
                },
            ],
        },
    }


def _router_pod_labels(owner: Owner, pool: PoolView | None) -> dict[str, str]:
    """With decode-direct the router is a client of its pool too: the pool's label admits it there (dax)."""
    if pool is None:
        return _router_labels(owner)
    return {**_router_labels(owner), LABEL_POOL: label_value(pool.name)}


def build_router_deployment(spec: InferenceGroupSpec, owner: Owner, pool: PoolView | None = None) -> Object | None:
    """The router pod: vllm-router alone, or (decode-direct, with a pool) maru-router in front of it."""
    if not spec.router.enabled:
        return None
    direct = pool if decode_direct(spec, pool) else None
    pod_labels = _router_pod_labels(owner, direct)
    pod_spec: dict[str, Any] = {
        "serviceAccountName": router_name(owner.name),
        "terminationGracePeriodSeconds": spec.router.termination.grace_period_seconds,
        "enableServiceLinks": False,
        "securityContext": restricted_pod_security(),
    }
    if direct is None:
        pod_spec["containers"] = [vllm_router_container(spec, owner, port=ROUTER_CONTAINER_PORT, port_name="http")]
    else:
        # Only vllm-router reads the API (pod discovery): maru-router, which parses every client's request,
        # gets no token.
        upstream = vllm_router_container(spec, owner, port=UPSTREAM_PORT, port_name="upstream")
        upstream["volumeMounts"] = [{"name": API_ACCESS_VOLUME, "mountPath": SERVICE_ACCOUNT_DIR, "readOnly": True}]
        pod_spec["automountServiceAccountToken"] = False
        front = maru_router_container(spec, owner, direct)
        # Both containers wait for maru-router's requests to finish: maru-router, so none is cut; vllm-router, so
        # the ones maru-router relays through it still find it listening. vllm-router alone (no maru-router)
        # finishes its own requests after SIGTERM, within the grace period.
        lifecycle = pre_stop(
            spec.router.termination, DIRECT_METRICS_PORT, IN_PROGRESS_METRIC, min_wait=STOP_SENDING_SECONDS
        )
        if lifecycle:
            front["lifecycle"], upstream["lifecycle"] = lifecycle, copy.deepcopy(lifecycle)
        pod_spec["containers"] = [front, upstream]
        pod_spec["volumes"] = [*pool_access(spec, direct, owner.name)[0], *scratch_volumes(), api_access_volume()]
        # Its lookups see the pool of its own node: decode's, where decode-direct requests are served.
        pod_spec.update(pool_placement(direct, near=discovery_selector(owner, "decode")))
    template = {"metadata": {"labels": pod_labels}, "spec": pod_spec}
    apply_pod_options(template, spec.router, selector(owner, app=ROUTER_APP, component="router"))
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(owner, name=router_name(owner.name), namespace=owner.namespace, labels=pod_labels),
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": selector(owner, app=ROUTER_APP, component="router")},
            "template": template,
        },
    }


def build_role_service(spec: InferenceGroupSpec, role: Role, owner: Owner, pool: PoolView | None) -> Object | None:
    """A role's ClusterIP Service, for maru-router only (vllm-router finds pods itself): decode-direct requests
    go to decode's, and the requests that teach maru-router the key scheme to prefill's, then decode's."""
    if not decode_direct(spec, pool):
        return None
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(
            owner,
            name=role_name(owner.name, role),
            namespace=owner.namespace,
            labels=labels(owner, app=VLLM_APP, component=role, role=role),
        ),
        "spec": {
            "type": "ClusterIP",
            "selector": selector(owner, app=VLLM_APP, component=role),
            "ports": [{"name": "http", "port": VLLM_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def build_router_service(spec: InferenceGroupSpec, owner: Owner) -> Object | None:
    if not spec.router.enabled:
        return None
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(
            owner, name=service_name(owner.name), namespace=owner.namespace, labels=_router_labels(owner)
        ),
        "spec": {
            "type": spec.router.service_type,
            "selector": selector(owner, app=ROUTER_APP, component="router"),
            "ports": [{"name": "http", "port": spec.router.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def router_endpoint(spec: InferenceGroupSpec, owner: Owner) -> str:
    if not spec.router.enabled:
        return ""
    return f"http://{service_name(owner.name)}.{owner.namespace}.svc:{spec.router.port}"


def build_router_children(spec: InferenceGroupSpec, owner: Owner, pool: PoolView | None = None) -> list[Object]:
    """The router's objects; ``pool``: the group's pool, which decode-direct needs (None: vllm-router alone)."""
    children = [
        build_router_service_account(spec, owner),
        build_router_role_binding(spec, owner),
        build_router_service(spec, owner),
        build_role_service(spec, "prefill", owner, pool),
        build_role_service(spec, "decode", owner, pool),
        build_router_deployment(spec, owner, pool),
        build_disruption_budget(
            owner,
            "router",
            spec.router.disruption_budget,
            _router_labels(owner),
            selector(owner, app=ROUTER_APP, component="router"),
        )
        if spec.router.enabled
        else None,
    ]
    return [c for c in children if c is not None]
