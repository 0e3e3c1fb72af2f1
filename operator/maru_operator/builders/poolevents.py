"""The group's pool events publisher: what the pool holds for the group, as vLLM KV events over ZMQ.

``maru-pool events`` (``maru_pool.publisher``) is a tenant's client of the pool: with the group's
credential it follows the group's own event log in the daemon (stored, removed, cleared) and republishes it
in vLLM's KV event wire format, so a KV-aware router that consumes vLLM's events (llm-d's indexer, Dynamo's
KV router) sees the pool as one more tier every engine of the group can load from.

It runs from the group's vLLM image (which has the connector and its ZMQ and msgpack dependencies, and is on
the pool's nodes already), with the decode pods' pool socket and credential volumes, on the pool's nodes and,
with an shm pool, beside decode (each node's shm pool holds what that node's pods stored). One replica: a
consumer subscribes to one stream, and two publishers would announce the same chunks twice.

Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

from maru_operator.api.inferencegroup import InferenceGroupSpec
from maru_operator.builders.common import (
    LABEL_POOL,
    Object,
    Owner,
    labels,
    metadata,
    restricted_container_security,
    restricted_pod_security,
    selector,
)
from maru_operator.builders.group import (
    PoolView,
    connector_config,
    discovery_selector,
    pool_access,
    pool_placement,
)
from maru_operator.builders.scratch import scratch_env, scratch_mounts, scratch_volumes
from maru_operator.images import DEFAULT_VLLM_IMAGE
from maru_operator.names import child_name, label_value

POOL_EVENTS_APP = "maru-pool-events"
COMPONENT = "pool-events"
EVENTS_PORT = 5557  # where vLLM engines publish theirs too: what a consumer of vLLM's events expects
REPLAY_PORT = 5558  # vLLM's replay socket convention: a consumer that missed batches asks for them here
# spec.poolEvents.curve: the Secret's keys, and where the publisher reads them.
CURVE_SECRET_KEY = "server-secret-key"
CURVE_CLIENTS = "client-public-keys"
CURVE_VOLUME = "events-curve"
CURVE_DIR = "/etc/maru/events-curve"


def pool_events_name(group: str) -> str:
    return child_name(group, COMPONENT)


def pool_events_labels(owner: Owner, pool: PoolView) -> dict[str, str]:
    """The pool's label admits the pod to the pool's metadata server (dax), as it does the engines."""
    return {**labels(owner, app=POOL_EVENTS_APP, component=COMPONENT), LABEL_POOL: label_value(pool.name)}


def pool_events_pods(owner: Owner) -> dict[str, str]:
    return selector(owner, app=POOL_EVENTS_APP, component=COMPONENT)


def pool_events_args(spec: InferenceGroupSpec, owner: Owner, pool: PoolView) -> list[str]:
    """``maru-pool events`` for the group's tenant: its pool URL and token as the engines have them, and the
    group's chunk size as the events' block size."""
    cfg = connector_config(spec, owner, pool)
    args = ["events", "--pool", cfg.pool_url]
    if cfg.pool_token_file:
        args += ["--token-file", cfg.pool_token_file]
    args += ["--block-size", str(cfg.chunk_tokens), "--medium", spec.pool_events.medium,
             "--topic", events_topic(spec, owner),
             "--publish", f"tcp://*:{EVENTS_PORT}", "--replay", f"tcp://*:{REPLAY_PORT}"]  # fmt: skip
    if spec.pool_events.token_ids:
        args.append("--token-ids")
    if spec.pool_events.curve is not None:
        args += ["--curve-secret-key-file", f"{CURVE_DIR}/{CURVE_SECRET_KEY}",
                 "--curve-clients-file", f"{CURVE_DIR}/{CURVE_CLIENTS}"]  # fmt: skip
    return args


def _curve_volumes(spec: InferenceGroupSpec) -> tuple[list[Object], list[Object]]:
    """The CURVE Secret as a whole directory, not subPath files: the kubelet updates a directory in place, so an
    added or revoked consumer key reaches the running publisher."""
    if spec.pool_events.curve is None:
        return [], []
    volume = {
        "name": CURVE_VOLUME,
        "secret": {
            "secretName": spec.pool_events.curve.secret_name,
            "defaultMode": 0o440,
            "items": [
                {"key": CURVE_SECRET_KEY, "path": CURVE_SECRET_KEY},
                {"key": CURVE_CLIENTS, "path": CURVE_CLIENTS},
            ],
        },
    }
    return [volume], [{"name": CURVE_VOLUME, "mountPath": CURVE_DIR, "readOnly": True}]


def events_topic(spec: InferenceGroupSpec, owner: Owner) -> str:
    """``kv@<source>@<model>``: the topic llm-d's indexer reads a stream's source and model from (the group stands
    for the pool tier it publishes, the model is the name clients ask for)."""
    return f"kv@{owner.name}@{spec.model.served_model_name or spec.model.name}"


def _tcp_probe(**extra: int) -> dict[str, Any]:
    return {"tcpSocket": {"port": "kv-events"}, "periodSeconds": 10, "timeoutSeconds": 3, **extra}


def build_pool_events_deployment(spec: InferenceGroupSpec, owner: Owner, pool: PoolView | None) -> Object | None:
    if not spec.pool_events.enabled or pool is None:
        return None
    volumes, mounts = pool_access(spec, pool, owner.name)
    curve_volumes, curve_mounts = _curve_volumes(spec)
    pod_labels = pool_events_labels(owner, pool)
    container = {
        "name": "events",
        "image": spec.image or DEFAULT_VLLM_IMAGE,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["maru-pool"],
        "args": pool_events_args(spec, owner, pool),
        "env": scratch_env(set()),
        "ports": [
            {"name": "kv-events", "containerPort": EVENTS_PORT, "protocol": "TCP"},
            {"name": "replay", "containerPort": REPLAY_PORT, "protocol": "TCP"},
        ],
        "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
        # The port opens once the publisher reached the pool; a publisher that lost it exits and restarts.
        "startupProbe": _tcp_probe(failureThreshold=30),
        "readinessProbe": _tcp_probe(failureThreshold=3),
        "livenessProbe": _tcp_probe(failureThreshold=6),
        "volumeMounts": [*mounts, *curve_mounts, *scratch_mounts()],
        "securityContext": restricted_container_security(),
    }
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,  # it reads the pool, never the API
        "enableServiceLinks": False,
        "securityContext": restricted_pod_security(),
        "containers": [container],
        "volumes": [*volumes, *curve_volumes, *scratch_volumes()],
        **pool_placement(pool, near=discovery_selector(owner, "decode")),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(owner, name=pool_events_name(owner.name), namespace=owner.namespace, labels=pod_labels),
        "spec": {
            "replicas": 1,
            # Never two at once: a consumer would see each chunk announced twice, by publishers it cannot tell apart.
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": pool_events_pods(owner)},
            "template": {"metadata": {"labels": pod_labels}, "spec": pod_spec},
        },
    }


def build_pool_events_service(spec: InferenceGroupSpec, owner: Owner, pool: PoolView | None) -> Object | None:
    if not spec.pool_events.enabled or pool is None:
        return None
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(
            owner, name=pool_events_name(owner.name), namespace=owner.namespace, labels=pool_events_labels(owner, pool)
        ),
        "spec": {
            "type": "ClusterIP",
            "selector": pool_events_pods(owner),
            "ports": [
                {"name": "kv-events", "port": EVENTS_PORT, "targetPort": "kv-events", "protocol": "TCP"},
                {"name": "replay", "port": REPLAY_PORT, "targetPort": "replay", "protocol": "TCP"},
            ],
        },
    }


def build_pool_events_children(spec: InferenceGroupSpec, owner: Owner, pool: PoolView | None) -> list[Object]:
    children = [build_pool_events_deployment(spec, owner, pool), build_pool_events_service(spec, owner, pool)]
    return [c for c in children if c is not None]
