"""Children of a MaruPool: the pool daemons, the only pods that touch the pool memory.

backend ``dax``: one metadata server (Deployment + Service) holding the index and allocator of the
shared CXL memory, and an agent DaemonSet that maps the devices on each selected node and hands the
mapping to local vLLM pods over a Unix socket. backend ``shm``: every node's memory is separate, so
each node runs a self-contained ``maru-pool serve``; a pool-wide metadata server would hand out
offsets of memory it does not own.

Every daemon gets the pool's key (:mod:`.credentials`) and authenticates each client's hello with it.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import PurePosixPath
from typing import Any

from maru_contracts.csi import CREDENTIALS_DIR, admission_document, minting_policy, render_admission
from maru_contracts.poolsize import format_size, parse_size, pool_memory_bytes
from maru_contracts.tenancy import DAEMON_DEFAULTS
from maru_operator.api.marupool import MaruPoolSpec
from maru_operator.builders.common import (
    Object,
    Owner,
    labels,
    metadata,
    restricted_container_security,
    restricted_pod_security,
    selector,
)
from maru_operator.builders.credentials import (
    KEY_FILE,
    build_pool_key_secret,
    pool_key_mount,
    pool_key_volume,
    quota_of,
)
from maru_operator.builders.resources import (
    CPU,
    INDEX_BYTES_PER_POOL_BYTE,
    MEMORY,
    METADATA_UNSIZED_LIMIT,
    POOL_DAEMON,
    ResourceDefault,
    plus,
    with_defaults,
)
from maru_operator.images import DEFAULT_POOL_IMAGE
from maru_operator.names import MAX_NAME, child_name

APP = "maru-pool"
COMPONENT_AGENT = "agent"
COMPONENT_METADATA = "metadata"
SOCKET_FILE = "pool.sock"
SHM_FILE = "/dev/shm/maru-pool"
# A daemon's own memory besides the pool: interpreter and index (an idle `maru-pool serve` holds
# ~15 MiB), with room for a large index.
DAEMON_MEMORY = 64 << 20


def agent_name(pool: str) -> str:
    return child_name(pool, "agent")


def metadata_name(pool: str) -> str:
    return child_name(pool, "metadata")


def socket_host_dir(spec: MaruPoolSpec, pool: str) -> str:
    """Host directory of this pool's socket: one per pool, so two pools on a node never collide.

    Long pool names are shortened: a Unix socket path must fit in 107 bytes (``sun_path``).
    """
    return f"{spec.daemon.socket_dir.rstrip('/')}/{pool_dir_name(pool)}"


def pool_dir_name(pool: str) -> str:
    """The pool's socket directory under the socket root: its name, or the short form of a long one.

    The admission rule names it too: the CSI plugin checks the rule against the directory that holds it.
    """
    return pool if len(pool) <= MAX_NAME else child_name(pool)


def pool_endpoint(spec: MaruPoolSpec, pool: str) -> str:
    """The URL clients on a pool node use (status.endpoint, and the connector's pool URL)."""
    return f"unix://{socket_host_dir(spec, pool)}/{SOCKET_FILE}"


def metadata_url(spec: MaruPoolSpec, pool: str, namespace: str) -> str:
    return f"tcp://{metadata_name(pool)}.{namespace}.svc:{spec.daemon.metadata_port}"


def _eviction_args(spec: MaruPoolSpec) -> list[str]:
    return ["--lease-seconds", str(spec.eviction.lease_seconds), "--eviction", spec.eviction.policy.lower()]


def _ceiling_args(spec: MaruPoolSpec) -> list[str]:
    """The daemons' hard ceiling on one tenant's pins and leases (their defaults unless the pool's quota policy
    grants more): a token minted under the policy is never held below what it says."""
    policy = (quota_of(spec.tenant_quota), quota_of(spec.max_tenant_quota))
    args = []
    for name, floor in DAEMON_DEFAULTS.items():
        granted = max([floor, *(getattr(q, name) for q in policy if getattr(q, name) is not None)])
        if granted > floor:
            args += [f"--max-tenant-{name}", str(granted)]
    return args


# Every daemon verifies hellos against the pool key: clients, agents' heartbeats, the metadata server's peers.
AUTH_ARGS = ["--auth-key-file", KEY_FILE]


def _pool_owner_labels(owner: Owner, component: str) -> dict[str, str]:
    return labels(owner, app=APP, component=component)


def shm_volume_bytes(spec: MaruPoolSpec) -> int:
    """Size of the shm agent's memory-backed /dev/shm: the pool file, header included, in whole pages.

    A kubelet mounts a ``medium: Memory`` emptyDir as a tmpfs of exactly ``sizeLimit``; sized to the
    pool alone, the daemon's reservation of header + pool fails with ENOSPC and the agent crash-loops.
    """
    assert spec.size, "the CRD requires size for shm"
    return pool_memory_bytes(parse_size(spec.size))


def daemon_memory(spec: MaruPoolSpec, *, agent: bool) -> int:
    """The least memory a pool daemon can run in: its own, plus the pool file for an shm agent (tmpfs
    pages are charged to the pod that writes them). ``check_pool`` refuses resources below it."""
    return DAEMON_MEMORY + (shm_volume_bytes(spec) if agent and spec.backend == "shm" else 0)


def memory_default(spec: MaruPoolSpec, component: str) -> ResourceDefault:
    """A pool daemon's memory when ``spec.daemon.resources`` names none.

    The shm agent holds the pool itself: its memory-backed /dev/shm is charged to the container, so
    request and limit include the whole pool file. Without that request the pod would be the first
    evicted under memory pressure, taking the node's cache with it. The metadata server's index grows
    with the pool.
    """
    if component == COMPONENT_AGENT:
        return plus(POOL_DAEMON, shm_volume_bytes(spec)) if spec.backend == "shm" else POOL_DAEMON
    if not spec.size:
        return replace(POOL_DAEMON, limit=METADATA_UNSIZED_LIMIT)
    size = parse_size(spec.size)
    return replace(POOL_DAEMON, limit=POOL_DAEMON.limit + int(size * INDEX_BYTES_PER_POOL_BYTE))


def _resources(spec: MaruPoolSpec, component: str) -> dict[str, Any]:
    """The user's resources with the defaults filled in; with any limit set, the pod is Guaranteed.

    Guaranteed (the last class the kubelet evicts) needs a limit equal to the request for both cpu
    and memory. A limit the user set becomes the request; a missing one takes the request (the user's
    or the default): with only a memory limit, the default cpu request alone made the pod Burstable.
    """
    given = {k: v for k, v in spec.daemon.resources.model_dump(by_alias=True).items() if v}
    result = with_defaults(given, memory_default(spec, component))
    if spec.daemon.resources.limits:
        requests, limits = result.get("requests", {}), result.get("limits", {})
        for kind in (CPU, MEMORY):
            if kind in limits:
                requests[kind] = limits[kind]
            elif kind in requests:
                limits[kind] = requests[kind]
        result["requests"], result["limits"] = requests, limits
    return result


def _priority(spec: MaruPoolSpec) -> dict[str, Any]:
    name = spec.daemon.priority_class_name
    return {"priorityClassName": name} if name else {}


def _tolerations(spec: MaruPoolSpec) -> list[dict[str, Any]]:
    return [t.model_dump(by_alias=True, exclude_none=True) for t in spec.tolerations]


def _ports(spec: MaruPoolSpec, *, rpc: bool) -> list[dict[str, Any]]:
    ports = [{"name": "metrics", "containerPort": spec.daemon.metrics_port, "protocol": "TCP"}]
    if rpc:
        ports.insert(0, {"name": "rpc", "containerPort": spec.daemon.metadata_port, "protocol": "TCP"})
    return ports


def _status_probe(spec: MaruPoolSpec) -> dict[str, Any]:
    return {
        "httpGet": {"path": "/status", "port": "metrics"},
        "periodSeconds": 10,
        "timeoutSeconds": 2,
        "failureThreshold": 3,
    }


def build_metadata_deployment(spec: MaruPoolSpec, owner: Owner, namespace: str) -> Object | None:
    """The pool-wide metadata server (dax only): index, allocator, eviction and leases."""
    if spec.backend != "dax":
        return None
    args = [
        "metadata",
        "--listen",
        f"tcp://0.0.0.0:{spec.daemon.metadata_port}",
        "--metrics-addr",
        f"0.0.0.0:{spec.daemon.metrics_port}",
        *_eviction_args(spec),
        *_ceiling_args(spec),
        *AUTH_ARGS,
    ]
    if spec.size:
        args += ["--size", spec.size]
    pod_labels = _pool_owner_labels(owner, COMPONENT_METADATA)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(owner, name=metadata_name(owner.name), namespace=namespace, labels=pod_labels),
        "spec": {
            "replicas": 1,
            # Two metadata servers would allocate the same memory twice: never run old and new together.
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector(owner, app=APP, component=COMPONENT_METADATA)},
            "template": {
                "metadata": {"labels": pod_labels},
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    **_priority(spec),
                    **_pull_secrets(spec),
                    # The metadata server needs no host access at all.
                    "securityContext": restricted_pod_security(),
                    "tolerations": _tolerations(spec),
                    "volumes": [pool_key_volume(owner.name, reader_is_root=False)],
                    "containers": [
                        {
                            "name": "metadata",
                            "image": spec.daemon.image or DEFAULT_POOL_IMAGE,
                            "imagePullPolicy": spec.daemon.image_pull_policy,
                            "command": ["maru-pool"],
                            "args": args,
                            "ports": _ports(spec, rpc=True),
                            "resources": _resources(spec, COMPONENT_METADATA),
                            "volumeMounts": [pool_key_mount()],
                            "readinessProbe": _status_probe(spec),
                            "livenessProbe": {**_status_probe(spec), "failureThreshold": 6},
                            "securityContext": restricted_container_security(),
                        }
                    ],
                },
            },
        },
    }


def build_metadata_service(spec: MaruPoolSpec, owner: Owner, namespace: str) -> Object | None:
    """Where the agents reach the metadata server (dax only)."""
    if spec.backend != "dax":
        return None
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(
            owner,
            name=metadata_name(owner.name),
            namespace=namespace,
            labels=_pool_owner_labels(owner, COMPONENT_METADATA),
        ),
        "spec": {
            "type": "ClusterIP",
            "selector": selector(owner, app=APP, component=COMPONENT_METADATA),
            "ports": [
                {"name": "rpc", "port": spec.daemon.metadata_port, "targetPort": "rpc", "protocol": "TCP"},
                {"name": "metrics", "port": spec.daemon.metrics_port, "targetPort": "metrics", "protocol": "TCP"},
            ],
        },
    }


def _agent_args(spec: MaruPoolSpec, pool: str, namespace: str) -> list[str]:
    listen = pool_endpoint(spec, pool)
    metrics = f"0.0.0.0:{spec.daemon.metrics_port}"
    if spec.backend == "shm":
        assert spec.size, "the CRD requires size for shm"
        return [
            "serve",
            "--listen",
            listen,
            "--size",
            spec.size,
            "--shm-path",
            SHM_FILE,
            "--metrics-addr",
            metrics,
            *_eviction_args(spec),
            *_ceiling_args(spec),
            *AUTH_ARGS,
        ]
    args = [
        "agent",
        "--listen",
        listen,
        "--metadata",
        metadata_url(spec, pool, namespace),
        "--metrics-addr",
        metrics,
        *AUTH_ARGS,
    ]
    for device in spec.devices:
        args += ["--device", device]
    return args


def _agent_security(spec: MaruPoolSpec) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod, container) security contexts of the agent.

    The agent runs as UID 0 with every capability dropped: the kubelet creates the socket hostPath
    directory owned by root, and only its owner may create the socket there without
    CAP_DAC_OVERRIDE. With dax it must also open /dev/daxX.Y, which a container's device cgroup
    denies unless the container is privileged (or a device plugin grants the device); privileged
    is therefore set for dax only, and no other pod of the product is privileged.
    """
    pod = {"runAsUser": 0, "runAsGroup": 0, "seccompProfile": {"type": "RuntimeDefault"}}
    if spec.backend == "dax":
        container = {"privileged": True, "readOnlyRootFilesystem": True}
    else:
        container = {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": False,
        }
    return pod, container


# The init container that writes the pool's admission rule beside its socket: tiny, and done in a second.
ADMISSION_RESOURCES = {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "64Mi"}}


def admission_init_container(spec: MaruPoolSpec, pool: str) -> Object:
    """Writes ``<socket dir>/admission.json`` from ``spec.allowedNamespaces`` before the agent starts.

    The CSI node plugin publishes the socket directory only to pods this rule admits. It comes from the
    MaruPool through this pod spec, so the plugin needs no API access, and it is written by root into a
    directory pods get read-only, so no tenant can forge it. A changed rule changes the pod template: the
    agents roll, one node at a time, and each node's agent rewrites the file as it starts.
    """
    return {
        "name": "admission",
        "image": spec.daemon.image or DEFAULT_POOL_IMAGE,
        "imagePullPolicy": spec.daemon.image_pull_policy,
        "command": ["python", "-m", "maru_csi.admission"],
        "args": [
            "--dir",
            socket_host_dir(spec, pool),
            "--document",
            render_admission(admission_document(pool, spec.allowed_namespaces, pool_dir_name(pool))),
        ],
        "resources": ADMISSION_RESOURCES,
        "volumeMounts": [{"name": "socket", "mountPath": socket_host_dir(spec, pool)}],
        # Root to write the root-owned directory the kubelet created; nothing else, also with dax.
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": False,
        },
    }


CREDENTIALS_VOLUME = "credentials"
# On the agent's pod template: a digest of the pool key (never the key), so a new key (a rotation) rolls the
# agents and each rewrites its node's minting file; the key Secret volume alone would update only the daemon.
KEY_DIGEST_ANNOTATION = "maru.io/pool-key-digest"


def credentials_host_dir(spec: MaruPoolSpec) -> str:
    """Where each pool node keeps the pools' minting material: beside the socket directories, root only."""
    return f"{spec.daemon.socket_dir.rstrip('/')}/{CREDENTIALS_DIR}"


def key_digest(key: bytes) -> str:
    return hashlib.blake2b(key, digest_size=12, person=b"maru-key-digest").hexdigest()


def credentials_init_container(spec: MaruPoolSpec, pool: str) -> Object:
    """Writes ``<socket root>/_credentials/<pool>.json``: the pool key and quota policy the CSI node plugin
    mints the groups' credentials from (:mod:`maru_csi.minting`).

    The key comes from the key Secret this pod mounts, never through the pod spec; the policy (the pool's
    ``tenantQuota`` and ``maxTenantQuota``) is rendered into the arguments, so a changed policy rolls the
    agents and each node's file follows. The file is 0600 in a 0700 directory, as root.
    """
    directory = PurePosixPath(socket_host_dir(spec, pool))
    return {
        "name": "credentials",
        "image": spec.daemon.image or DEFAULT_POOL_IMAGE,
        "imagePullPolicy": spec.daemon.image_pull_policy,
        "command": ["python", "-m", "maru_csi.minting"],
        "args": [
            "--socket-root",
            str(directory.parent),
            "--pool",
            directory.name,
            "--key-file",
            KEY_FILE,
            "--policy",
            minting_policy(quota_of(spec.tenant_quota), quota_of(spec.max_tenant_quota)),
        ],
        "resources": ADMISSION_RESOURCES,
        "volumeMounts": [{"name": CREDENTIALS_VOLUME, "mountPath": credentials_host_dir(spec)}, pool_key_mount()],
        # Root to write the root-owned directory the kubelet created (and close it to others); nothing else.
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": False,
        },
    }


def build_agent_daemonset(spec: MaruPoolSpec, owner: Owner, namespace: str, key: bytes | None = None) -> Object:
    """The per-node daemon: ``maru-pool agent`` (dax) or a self-contained ``maru-pool serve`` (shm).

    ``key``: the pool's key, whose digest on the pod template rolls the agents when it changes (None: offline).
    """
    pool = owner.name
    host_dir = socket_host_dir(spec, pool)
    volumes: list[dict[str, Any]] = [
        {"name": "socket", "hostPath": {"path": host_dir, "type": "DirectoryOrCreate"}},
        {"name": CREDENTIALS_VOLUME, "hostPath": {"path": credentials_host_dir(spec), "type": "DirectoryOrCreate"}},
        pool_key_volume(pool, reader_is_root=True),
    ]
    mounts: list[dict[str, Any]] = [{"name": "socket", "mountPath": host_dir}, pool_key_mount()]
    if spec.backend == "dax":
        for index, device in enumerate(spec.devices):
            volumes.append({"name": f"dax-{index}", "hostPath": {"path": device, "type": "CharDevice"}})
            mounts.append({"name": f"dax-{index}", "mountPath": device})
    else:
        # The pool file lives in the pod's own memory-backed /dev/shm (the container runtime's default
        # is 64Mi), which holds exactly the file: header and pool. Clients get the file over the socket
        # (fd passing), so they never need this path.
        volumes.append(
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": format_size(shm_volume_bytes(spec))}}
        )
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    pod_labels = _pool_owner_labels(owner, COMPONENT_AGENT)
    pod_security, container_security = _agent_security(spec)
    container: dict[str, Any] = {
        "name": "agent",
        "image": spec.daemon.image or DEFAULT_POOL_IMAGE,
        "imagePullPolicy": spec.daemon.image_pull_policy,
        "command": ["maru-pool"],
        "args": _agent_args(spec, pool, namespace),
        "env": [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
        "ports": _ports(spec, rpc=False),
        "resources": _resources(spec, COMPONENT_AGENT),
        "volumeMounts": mounts,
        "readinessProbe": _status_probe(spec),
        "livenessProbe": {**_status_probe(spec), "failureThreshold": 6},
        "securityContext": container_security,
    }
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        **_priority(spec),
        **_pull_secrets(spec),
        "securityContext": pod_security,
        "tolerations": _tolerations(spec),
        "initContainers": [admission_init_container(spec, pool), credentials_init_container(spec, pool)],
        "containers": [container],
        "volumes": volumes,
    }
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    template_meta: dict[str, Any] = {"labels": pod_labels}
    if key is not None:
        template_meta["annotations"] = {KEY_DIGEST_ANNOTATION: key_digest(key)}
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": metadata(owner, name=agent_name(pool), namespace=namespace, labels=pod_labels),
        "spec": {
            "selector": {"matchLabels": selector(owner, app=APP, component=COMPONENT_AGENT)},
            # One node at a time: a restarting agent drops that node's cache, never the whole pool's.
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": {"metadata": template_meta, "spec": pod_spec},
        },
    }


def _pull_secrets(spec: MaruPoolSpec) -> dict[str, Any]:
    secrets = [s.model_dump() for s in spec.daemon.image_pull_secrets]
    return {"imagePullSecrets": secrets} if secrets else {}


def build_pool_children(spec: MaruPoolSpec, owner: Owner, namespace: str, key: bytes | None = None) -> list[Object]:
    """Every child the pool needs, in creation order; ``key`` is the pool's (None: rendered without it)."""
    children = [
        build_pool_key_secret(owner, namespace, key),
        build_metadata_service(spec, owner, namespace),
        build_metadata_deployment(spec, owner, namespace),
        build_agent_daemonset(spec, owner, namespace, key),
    ]
    return [c for c in children if c is not None]
