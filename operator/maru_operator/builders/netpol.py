"""NetworkPolicies of the operator's children: each pod may be reached, and may reach, only what it needs.

Who talks to whom (every other connection to or from these pods is refused once a CNI enforces them):

=====================  ==============================================  ======================================
pods                   may be reached by                               may reach
=====================  ==============================================  ======================================
vLLM (a group's)       its router, on the vLLM port (anyone, when the  DNS; the pool's metadata server (dax);
                       group has no router); scrapers (same port)      HTTPS anywhere (model downloads)
router (a group's)     anyone, on its API port; scrapers (metrics)     DNS; the API server (pod discovery);
                                                                       its group's vLLM pods; with
                                                                       decode-direct, the pool's metadata
                                                                       server (dax)
pool metadata (dax)    the pool's agents, the vLLM pods bound to the   nothing
                       pool and their decode-direct routers (RPC); the
                       operator, scrapers (metrics)
pool agent             the operator, scrapers (metrics)                dax: DNS, the pool's metadata server
pool events (a         the consumers spec.poolEvents.consumers names   DNS; the pool's metadata server (dax)
group's publisher)     (default: its namespace's pods), on 5557/5558
=====================  ==============================================  ======================================

Policies only add permissions, so a user can allow more with a policy of their own (weights from an
S3 endpoint on another port, an HTTP proxy, tracing), but never less than these. The kubelet's
probes come from the node, which common CNIs (Calico, Cilium, the kube-router family) always admit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from maru_operator.api.inferencegroup import InferenceGroupSpec
from maru_operator.api.marupool import MaruPoolSpec
from maru_operator.builders.common import (
    LABEL_COMPONENT,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_PART_OF,
    LABEL_POOL,
    MANAGED_BY,
    PART_OF,
    Object,
    Owner,
    labels,
    metadata,
    selector,
)
from maru_operator.builders.group import (
    DIRECT_METRICS_PORT,
    KV_EVENTS_PORT,
    ROUTER_APP,
    ROUTER_CONTAINER_PORT,
    ROUTER_METRICS_PORT,
    VLLM_APP,
    VLLM_PORT,
    PoolView,
    decode_direct,
    vllm_pods,
)
from maru_operator.builders.pool import APP as POOL_APP
from maru_operator.builders.pool import COMPONENT_AGENT, COMPONENT_METADATA, agent_name, metadata_name
from maru_operator.builders.poolevents import COMPONENT as COMPONENT_POOL_EVENTS
from maru_operator.builders.poolevents import EVENTS_PORT as POOL_EVENTS_PORT
from maru_operator.builders.poolevents import POOL_EVENTS_APP, pool_events_name, pool_events_pods
from maru_operator.builders.poolevents import REPLAY_PORT as POOL_EVENTS_REPLAY_PORT
from maru_operator.names import child_name, label_value

# Set on every namespace by the API server (since Kubernetes 1.22): selects a namespace by its name.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
# The operator's pod, as the chart labels it.
OPERATOR_POD = {LABEL_PART_OF: PART_OF, LABEL_COMPONENT: "operator"}
HTTPS_PORT = 443
DNS_PORT = 53


@dataclass(frozen=True)
class NetworkPolicyConfig:
    """Cluster facts the policies need; the chart passes them to the operator as flags."""

    enabled: bool = True
    # Where the operator runs (it reads the pool daemons' /status); None: the pool namespace.
    operator_namespace: str | None = None
    # Namespaces whose pods may scrape metrics ports (Prometheus).
    scrape_namespaces: tuple[str, ...] = ()
    # Where the API server's endpoints are, as the pods' traffic reaches them (after the Service's DNAT).
    api_server_cidrs: tuple[str, ...] = ("0.0.0.0/0", "::/0")
    api_server_ports: tuple[int, ...] = (443, 6443)


DEFAULT_NETWORK = NetworkPolicyConfig()


def _in_namespace(namespace: str) -> dict[str, Any]:
    return {"matchLabels": {NAMESPACE_NAME_LABEL: namespace}}


def _peer(pods: dict[str, str], namespace: str | None = None) -> Object:
    """Pods with ``pods`` labels, in ``namespace`` (None: the policy's own namespace)."""
    peer: Object = {"podSelector": {"matchLabels": dict(pods)}}
    if namespace is not None:
        peer["namespaceSelector"] = _in_namespace(namespace)
    return peer


def _tcp(*ports: int) -> list[Object]:
    return [{"protocol": "TCP", "port": port} for port in ports]


def _scrapers(config: NetworkPolicyConfig) -> list[Object]:
    return [{"namespaceSelector": _in_namespace(ns)} for ns in config.scrape_namespaces]


def _operator(config: NetworkPolicyConfig, pool_namespace: str) -> Object:
    return _peer(OPERATOR_POD, config.operator_namespace or pool_namespace)


def dns_egress() -> Object:
    """Name lookups, wherever the cluster's resolver is (kube-dns, NodeLocal DNSCache, OpenShift's)."""
    return {"ports": [{"protocol": "UDP", "port": DNS_PORT}, {"protocol": "TCP", "port": DNS_PORT}]}


def api_server_egress(config: NetworkPolicyConfig) -> Object:
    return {
        "to": [{"ipBlock": {"cidr": cidr}} for cidr in config.api_server_cidrs],
        "ports": _tcp(*config.api_server_ports),
    }


def _policy(
    owner: Owner,
    *,
    name: str,
    namespace: str,
    pod_labels: dict[str, str],
    select: dict[str, str],
    ingress: list[Object],
    egress: list[Object],
) -> Object:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(owner, name=name, namespace=namespace, labels=pod_labels),
        "spec": {
            "podSelector": {"matchLabels": dict(select)},
            # Both directions are isolated: an empty list then means "nothing".
            "policyTypes": ["Ingress", "Egress"],
            "ingress": ingress,
            "egress": egress,
        },
    }


# --- MaruPool -------------------------------------------------------------------------------------


def _pool_selector(owner: Owner, component: str) -> dict[str, str]:
    return selector(owner, app=POOL_APP, component=component)


def pool_clients(pool: str, app: str = VLLM_APP) -> dict[str, str]:
    """Labels of the vLLM pods (or, ``app``, the decode-direct routers and the pool events publishers) bound to
    ``pool``, in any namespace (the group builders set them)."""
    return {LABEL_NAME: app, LABEL_POOL: label_value(pool), LABEL_MANAGED_BY: MANAGED_BY}


def _client_namespaces(spec: MaruPoolSpec) -> dict[str, Any]:
    if spec.allowed_namespaces is None:
        return {}
    return {
        "matchExpressions": [{"key": NAMESPACE_NAME_LABEL, "operator": "In", "values": sorted(spec.allowed_namespaces)}]
    }


def build_metadata_policy(spec: MaruPoolSpec, owner: Owner, namespace: str, config: NetworkPolicyConfig) -> Object:
    """The metadata server (dax): RPC from the pool's agents and clients, metrics from the operator.

    Clients stay admitted: they send every lookup, write and read to the metadata server directly (one network
    round trip, the agent off the hot path), so narrowing the port to agents would take the pool away from
    them. The policy is a first fence, by namespace and pod labels, both of which a tenant chooses; the control
    is the credential: every connection is refused until its hello carries a token of this pool's key, and a
    tenant's ops reach only its own key scope.
    """
    agents = _peer(_pool_selector(owner, COMPONENT_AGENT))
    clients = [
        {"namespaceSelector": _client_namespaces(spec), "podSelector": {"matchLabels": pool_clients(owner.name, app)}}
        for app in (VLLM_APP, ROUTER_APP, POOL_EVENTS_APP)
    ]
    return _policy(
        owner,
        name=metadata_name(owner.name),
        namespace=namespace,
        pod_labels=labels(owner, app=POOL_APP, component=COMPONENT_METADATA),
        select=_pool_selector(owner, COMPONENT_METADATA),
        ingress=[
            {"from": [agents, *clients], "ports": _tcp(spec.daemon.metadata_port)},
            {"from": [_operator(config, namespace), *_scrapers(config)], "ports": _tcp(spec.daemon.metrics_port)},
        ],
        egress=[],
    )


def build_agent_policy(spec: MaruPoolSpec, owner: Owner, namespace: str, config: NetworkPolicyConfig) -> Object:
    """The node agents: metrics in; out only to the metadata server (dax). Clients use a Unix socket."""
    egress: list[Object] = []
    if spec.backend == "dax":
        egress = [
            dns_egress(),
            {"to": [_peer(_pool_selector(owner, COMPONENT_METADATA))], "ports": _tcp(spec.daemon.metadata_port)},
        ]
    return _policy(
        owner,
        name=agent_name(owner.name),
        namespace=namespace,
        pod_labels=labels(owner, app=POOL_APP, component=COMPONENT_AGENT),
        select=_pool_selector(owner, COMPONENT_AGENT),
        ingress=[{"from": [_operator(config, namespace), *_scrapers(config)], "ports": _tcp(spec.daemon.metrics_port)}],
        egress=egress,
    )


def build_pool_policies(spec: MaruPoolSpec, owner: Owner, namespace: str, config: NetworkPolicyConfig) -> list[Object]:
    if not config.enabled:
        return []
    policies = [build_agent_policy(spec, owner, namespace, config)]
    if spec.backend == "dax":
        policies.insert(0, build_metadata_policy(spec, owner, namespace, config))
    return policies


# --- InferenceGroup -------------------------------------------------------------------------------


def router_pods(owner: Owner) -> dict[str, str]:
    return selector(owner, app=ROUTER_APP, component="router")


def build_vllm_policy(
    spec: InferenceGroupSpec, owner: Owner, pool: PoolView | None, pool_namespace: str, config: NetworkPolicyConfig
) -> Object:
    """Kept while the group is unbound too: its running pods stay isolated (without a pool to reach)."""
    if spec.router.enabled and not spec.inference_pool.enabled:
        ingress = [{"from": [_peer(router_pods(owner))], "ports": _tcp(*_router_to_vllm_ports(spec, pool))}]
        if config.scrape_namespaces:
            ingress.append({"from": _scrapers(config), "ports": _tcp(VLLM_PORT)})
    else:
        # Without our router, or with a gateway fronting the group through its InferencePool (the gateway's
        # proxy and its endpoint picker, which reads the pods' /metrics, run wherever their installation put
        # them), whatever routes to the pods is the user's: the API port stays open.
        ingress = [{"ports": _tcp(VLLM_PORT)}]
        if decode_direct(spec, pool):
            ingress.append({"from": [_peer(router_pods(owner))], "ports": _tcp(KV_EVENTS_PORT)})
    egress = [dns_egress(), *_metadata_egress(pool, pool_namespace)]
    # Weights and tokenizers come from the Hugging Face Hub (or a mirror) over HTTPS.
    egress.append({"ports": _tcp(HTTPS_PORT)})
    return _policy(
        owner,
        name=child_name(owner.name, "vllm"),
        namespace=str(owner.namespace),
        pod_labels=labels(owner, app=VLLM_APP, component="vllm"),
        select=vllm_pods(owner),
        ingress=ingress,
        egress=egress,
    )


def _router_to_vllm_ports(spec: InferenceGroupSpec, pool: PoolView | None) -> tuple[int, ...]:
    """The API, and with decode-direct the engines' KV events, which maru-router reads."""
    return (VLLM_PORT, KV_EVENTS_PORT) if decode_direct(spec, pool) else (VLLM_PORT,)


def _metadata_egress(pool: PoolView | None, pool_namespace: str) -> list[Object]:
    """To a dax pool's metadata server: the agent's hello names it, and clients send it their lookups directly."""
    if pool is None or pool.spec.backend != "dax":
        return []
    metadata_pods = _pool_selector(Owner(kind="MaruPool", name=pool.name), COMPONENT_METADATA)
    return [{"to": [_peer(metadata_pods, pool_namespace)], "ports": _tcp(pool.spec.daemon.metadata_port)}]


def build_router_policy(
    owner: Owner, config: NetworkPolicyConfig, pool: PoolView | None = None, pool_namespace: str = ""
) -> Object:
    """``pool``: the pool a decode-direct router asks (its own metrics port too), None for vllm-router alone.

    Its vLLM peer is both roles: decode-direct requests go to decode (or to a less busy prefill,
    which loads from the pool too), and prefill then decode through
    vllm-router (or maru-router, when it learns the engines' key scheme or a pod's own cache holds a prompt
    beyond the pool); with ``pool``, maru-router also reads the engines' KV events."""
    ingress: list[Object] = [{"ports": _tcp(ROUTER_CONTAINER_PORT)}]
    if config.scrape_namespaces:
        metrics = (ROUTER_METRICS_PORT, DIRECT_METRICS_PORT) if pool is not None else (ROUTER_METRICS_PORT,)
        ingress.append({"from": _scrapers(config), "ports": _tcp(*metrics)})
    return _policy(
        owner,
        name=child_name(owner.name, "router"),
        namespace=str(owner.namespace),
        pod_labels=labels(owner, app=ROUTER_APP, component="router"),
        select=router_pods(owner),
        ingress=ingress,
        egress=[
            dns_egress(),
            api_server_egress(config),
            {
                "to": [_peer(vllm_pods(owner))],
                "ports": _tcp(*((VLLM_PORT, KV_EVENTS_PORT) if pool is not None else (VLLM_PORT,))),
            },
            *_metadata_egress(pool, pool_namespace),
        ],
    )


def build_pool_events_policy(spec: InferenceGroupSpec, owner: Owner, pool: PoolView, pool_namespace: str) -> Object:
    """The pool events publisher: its stream open only to the consumers the spec names (the group's own
    namespace by default: the stream says which prompts the group's tenants sent), and out only to DNS and a
    dax pool's metadata server; an shm pool is a unix socket, which no NetworkPolicy covers."""
    consumers = [c.to_peer() for c in spec.pool_events.consumers] or [{"podSelector": {}}]
    return _policy(
        owner,
        name=pool_events_name(owner.name),
        namespace=str(owner.namespace),
        pod_labels=labels(owner, app=POOL_EVENTS_APP, component=COMPONENT_POOL_EVENTS),
        select=pool_events_pods(owner),
        ingress=[{"from": consumers, "ports": _tcp(POOL_EVENTS_PORT, POOL_EVENTS_REPLAY_PORT)}],
        egress=[dns_egress(), *_metadata_egress(pool, pool_namespace)],
    )


def build_group_policies(
    spec: InferenceGroupSpec, owner: Owner, pool: PoolView | None, pool_namespace: str, config: NetworkPolicyConfig
) -> list[Object]:
    if not config.enabled:
        return []
    policies = [build_vllm_policy(spec, owner, pool, pool_namespace, config)]
    if spec.router.enabled:
        direct = pool if decode_direct(spec, pool) else None
        policies.append(build_router_policy(owner, config, direct, pool_namespace))
    if spec.pool_events.enabled and pool is not None:
        policies.append(build_pool_events_policy(spec, owner, pool, pool_namespace))
    return policies
