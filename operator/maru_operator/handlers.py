"""Thin kopf glue: watch events feed the cache and wake the right owner; the work queue does the rest.

One operator run is a :class:`Runtime` (settings, cache, API client, controller, queue, tasks), built by the CLI
or a test and handed to kopf as the run's ``memo``: the kopf handlers at the end of this module only pass their
events to it, and nothing lives at module level.

Level-based, as kopf's own reconciliation guide recommends: no create/update handlers and no diffs.
An event of an owner, of any child it owns (by ownerReference), or of the pool a group is bound to
only enqueues the owner's key; a periodic resync lists everything afresh and enqueues every owner (the
timer), so state that changes without an event (a pool's used memory) and lost events are covered too.
No kopf finalizer or annotation is put on user objects; the only finalizer is the pool's in-use protection.

Scope: the API server selects what is watched. Children by ``app.kubernetes.io/managed-by``; owners and
children by the operator instance (``maru.io/operator-instance``): an operator started with
``--instance NAME`` serves only objects labelled with NAME, the default instance only unlabelled ones,
so two installations never reconcile the same objects. Within one instance, replicas elect a leader
with a Lease (:mod:`maru_operator.leader`); only the leader's work queue runs. The Lease of an instance
is in one namespace for the whole cluster (``--lease-namespace``, ``default``), not in the release's:
two releases given the same instance by mistake contend for the same Lease, so they never both lead.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import socket
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import kopf

from maru_operator import metrics
from maru_operator.api.common import GROUP, VERSION
from maru_operator.builders.common import LABEL_MANAGED_BY, MANAGED_BY, instance_selector
from maru_operator.builders.netpol import NetworkPolicyConfig
from maru_operator.cache import RESYNC_SECONDS, SERVICE_NAME_LABEL, Key, Store, key_of, not_newer, owner_key
from maru_operator.controller import DEFAULT_USAGE_INTERVAL, Controller
from maru_operator.dataplane import Updates
from maru_operator.images import DEFAULT_IMAGES, ImageDefaults
from maru_operator.kube import ApiError, Kube, StatusFetcher, fetch_daemon_status, login
from maru_operator.leader import LeaderElector, LeaseSettings
from maru_operator.rbac import DEFAULT_LEASE_NAMESPACE, lease_name
from maru_operator.rollouts import DEFAULT_MAX_GROUPS, RolloutPacer
from maru_operator.traffic import DEFAULT_WINDOW_S

log = logging.getLogger("maru_operator.handlers")

DEFAULT_POOL_NAMESPACE = "maru-system"
CHILD_RESOURCES = (
    ("apps", "v1", "deployments"),
    ("apps", "v1", "daemonsets"),
    ("", "v1", "services"),
    ("", "v1", "serviceaccounts"),
    ("rbac.authorization.k8s.io", "v1", "rolebindings"),
    ("networking.k8s.io", "v1", "networkpolicies"),
    ("", "v1", "persistentvolumeclaims"),
    ("policy", "v1", "poddisruptionbudgets"),
    # Optional (groups' spec.inferencePool): where its CRD is missing kopf warns once and watches it from the
    # moment the CRD is installed; the controller writes none until discovery serves it (maru_operator.optionalkinds).
    ("inference.networking.k8s.io", "v1", "inferencepools"),
)
# The pools' keys, in the pool namespace and nowhere else: watched there alone (:func:`watch_kind`), not by
# kopf, which watches every kind in every namespace it serves, so the operator needs no Secret rights beyond
# its own namespace. Only the operator's (the label selector), never a user's Secret.
WATCH_BACKOFF = 2.0
# The children (and router Services' EndpointSlices) the operator watches itself (:func:`watch_kind`), as
# client-go's informers do, instead of through kopf: kopf runs each event through its handler machinery (a
# worker task per object, causes, loggers), several times what the event costs the cache, and a fleet's
# children send most of the events (at a thousand groups that machinery was a third of the operator's CPU
# time). The InferencePools stay kopf's: their CRD may be missing, and kopf watches them from when it appears.
WATCHED_KINDS = (
    "Deployment",
    "DaemonSet",
    "Service",
    "ServiceAccount",
    "RoleBinding",
    "NetworkPolicy",
    "PersistentVolumeClaim",
    "PodDisruptionBudget",
    "EndpointSlice",
)
# The router Services' EndpointSlices: the EndpointSlice controller copies a Service's labels onto them,
# so the same server-side selector finds exactly the slices of the operator's Services.
ENDPOINT_SLICES = ("discovery.k8s.io", "v1", "endpointslices")
OURS = {LABEL_MANAGED_BY: MANAGED_BY}


def owner_selector(instance: str) -> str:
    """The MaruPools and InferenceGroups an operator instance serves."""
    return instance_selector(instance)


def child_selector(instance: str) -> str:
    """The children an operator instance watches: made by the operator, for this instance's owners."""
    return f"{LABEL_MANAGED_BY}={MANAGED_BY},{instance_selector(instance)}"


def default_pool_namespace() -> str:
    return os.environ.get("POD_NAMESPACE") or DEFAULT_POOL_NAMESPACE


def operator_namespace() -> str | None:
    """Where this operator's pod runs (the chart sets POD_NAMESPACE); None outside a pod."""
    return os.environ.get("POD_NAMESPACE") or None


@dataclass
class Config:
    pool_namespace: str = field(default_factory=default_pool_namespace)
    workers: int = 8
    resync_seconds: float = RESYNC_SECONDS
    usage_interval: float = DEFAULT_USAGE_INTERVAL
    disaggregation_window: float = DEFAULT_WINDOW_S  # how far back DisaggregationActive looks
    fetch_status: StatusFetcher = fetch_daemon_status
    connection: kopf.ConnectionInfo | None = None
    namespaces: list[str] = field(default_factory=list)  # empty: every namespace
    network: NetworkPolicyConfig = field(default_factory=NetworkPolicyConfig)
    images: ImageDefaults = DEFAULT_IMAGES
    max_rolling_groups: int = DEFAULT_MAX_GROUPS  # groups rolling their vLLM pods at once (0: no bound)
    data_plane_updates: Updates = "manual"  # whether new default images move running data planes
    read_pods: bool = False  # read unready roles' pods to say why (--read-pods; an RBAC opt-in)
    instance: str = ""  # which objects this operator serves (see the module docstring)
    leader_election: bool = True
    lease_namespace: str = DEFAULT_LEASE_NAMESPACE
    lease_seconds: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0
    # This replica's name in the Lease: the pod name (the hostname) and a random suffix.
    identity: str = field(default_factory=lambda: f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}")


@dataclass
class Runtime:
    """One operator run: its settings, cache, API client, controller, work queue and tasks. The CLI (or a test)
    builds it and hands it to kopf as the run's ``memo``; the kopf handlers below only pass events to it."""

    config: Config
    store: Store
    kube: Kube | None = None
    controller: Controller | None = None
    queue: Any = None
    resync_task: asyncio.Task[None] | None = None
    elector_task: asyncio.Task[None] | None = None
    watch_tasks: list[asyncio.Task[None]] = field(default_factory=list)
    pool_fingerprints: dict[str, Any] = field(default_factory=dict)
    # owner -> digest of its last watch event without status (see _desired_part)
    seen: dict[Key, Any] = field(default_factory=dict)

    def enqueue(self, key: Key | None) -> None:
        if key is not None and self.queue is not None:
            self.queue.add(key)

    def login(self, **kwargs: Any) -> kopf.ConnectionInfo:
        if self.config.connection is None:
            self.config.connection = login(**kwargs)
        return self.config.connection

    async def start(self, settings: kopf.OperatorSettings) -> None:
        from maru_operator.workqueue import WorkQueue

        # Our own writes explain themselves in Events; kopf's per-handler events would only add noise.
        settings.posting.level = logging.WARNING
        settings.persistence.diffbase_storage = NoDiffBase()
        # Re-list and resume well before API servers or load balancers cut idle watches.
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330
        settings.watching.reconnect_backoff = 1.0
        settings.networking.error_backoffs = [0.5, 1, 2, 4, 8]
        # The API server selects what is streamed: never every Deployment or Service in the cluster, and
        # only the owners (and their children) of this operator instance. Server-side watch selectors are
        # kopf >= 1.45 (hence the pin kopf>=1.45,<2).
        config = self.config
        for plural in ("marupools", "inferencegroups"):
            settings.watching.label_selectors[GROUP, VERSION, plural] = owner_selector(config.instance)
        for group, version, plural in (*CHILD_RESOURCES, ENDPOINT_SLICES):
            settings.watching.label_selectors[group, version, plural] = child_selector(config.instance)
        if config.connection is None:
            config.connection = login(settings=settings)
        self.kube = Kube(config.connection)
        self.controller = Controller(
            kube=self.kube,
            store=self.store,
            pool_namespace=config.pool_namespace,
            fetch_status=config.fetch_status,
            usage_interval=config.usage_interval,
            network=config.network,
            pacer=RolloutPacer(config.max_rolling_groups, wake=self.enqueue),
            images=config.images,
            data_plane_updates=config.data_plane_updates,
            disaggregation_window=config.disaggregation_window,
            read_pods=config.read_pods,
            wake=self.enqueue,
        )
        self.queue = WorkQueue(self.controller.reconcile, workers=config.workers)
        # Leader or not: like kopf's watches, it keeps the cache warm for a replica that may lead next.
        selector = child_selector(config.instance)
        watches = [("Secret", config.pool_namespace)] + [
            (kind, ns) for kind in WATCHED_KINDS for ns in (config.namespaces or [None])
        ]
        self.watch_tasks = [
            asyncio.create_task(
                watch_kind(self.kube, self.store, kind, ns, selector, self.gone[kind]),
                name=f"maru-watch-{kind}-{ns or 'all'}",
            )
            for kind, ns in watches
        ]
        log.info(
            "operator started: instance %s, pools' daemons go to namespace %s, %d workers, resync every %.0fs",
            config.instance or "(default)",
            config.pool_namespace,
            config.workers,
            config.resync_seconds,
        )
        if not config.leader_election:
            await self.lead()
            return
        lease = LeaseSettings(
            namespace=config.lease_namespace,
            name=lease_name(config.instance),
            identity=config.identity,
            lease_seconds=config.lease_seconds,
            renew_deadline=config.renew_deadline,
            retry_period=config.retry_period,
            release_namespace=config.pool_namespace,
        )
        log.info("waiting to lead: Lease %s/%s, identity %s", lease.namespace, lease.name, lease.identity)
        elector = LeaderElector(self.kube, lease, on_lead=self.lead, on_lose=self.follow)
        self.elector_task = asyncio.create_task(elector.run(), name="maru-leader-election")

    async def lead(self) -> None:
        """This replica reconciles: list everything afresh, start the workers and the resync timer."""
        assert self.kube is not None and self.queue is not None
        metrics.LEADER.set(1)
        await self.prime(self.kube, self.config.namespaces)
        self.queue.start()
        self.resync_task = asyncio.create_task(self.resync(self.config.resync_seconds), name="maru-resync")

    async def follow(self) -> None:
        """This replica stops reconciling at once (another may take over); its watches keep the cache warm."""
        metrics.LEADER.set(0)
        if self.resync_task is not None:
            self.resync_task.cancel()
            await asyncio.gather(self.resync_task, return_exceptions=True)
            self.resync_task = None
        if self.queue is not None:
            await self.queue.stop()

    async def prime(self, kube: Kube, namespaces: list[str]) -> None:
        """Observe everything once before the first reconcile (kopf's watches fill in the rest).

        Without it, a restarted operator would reconcile groups before its child watches have listed and
        try to create children that exist (writes nonetheless).
        """
        await self.relist(kube, namespaces)
        for key in self.store.owners("MaruPool") + self.store.owners("InferenceGroup"):
            self.enqueue(key)

    async def relist(self, kube: Kube, namespaces: list[str], *, metadata_only: bool = False) -> None:
        """Make the cache what the API has: list every kind the operator watches, forget what is gone.

        After a watch gap ending in 410 Gone, kopf lists again but sends no DELETED event for what
        went away meanwhile; without this, a group deleted in the gap would hold its pool's finalizer
        forever. An object is forgotten only when the list is newer than the cached copy.

        Lists are paged. ``metadata_only`` (the resync): the lists carry metadata alone, which is all that
        finding the gone needs; the few objects the cache lacks or holds older than listed are read whole.
        """
        instance = self.config.instance
        for kind in (*PRIMED_KINDS, *self.served_optional_kinds()):
            selector = owner_selector(instance) if kind in ("MaruPool", "InferenceGroup") else child_selector(instance)
            scopes: list[str | None] = [None] if not namespaces or kind == "MaruPool" else list(namespaces)
            if kind == "Secret":
                scopes = [self.config.pool_namespace]  # the pools' keys; the operator reads no other namespace's
            for namespace in scopes:
                try:
                    items, version = await kube.list_with_version(
                        kind, namespace, selector, metadata_only=metadata_only
                    )
                except Exception as err:  # the watches and the next resync catch up
                    log.warning("could not list %ss (%s); relying on the watch until the next resync", kind, err)
                    continue
                listed = set()
                for item in items:
                    # List items come without kind and apiVersion (or as PartialObjectMetadata): the cache keys on
                    # kind.
                    item["kind"] = kind
                    key = key_of(item)
                    listed.add(key)
                    if metadata_only:
                        await self.refresh(kube, key, item)
                    else:
                        self.store.put(item)
                for key in self.store.keys(kind, namespace):
                    cached = self.store.get(key)
                    if key not in listed and cached is not None and not_newer(cached, version):
                        log.info("%s %s is gone (not in a fresh list); forgetting it", kind, "/".join(key[1:]))
                        await self.gone[kind](type="DELETED", body=cached)

    def served_optional_kinds(self) -> tuple[str, ...]:
        """The optional child kinds discovery last said the API serves: listed like the others (never listed where
        their CRD is missing, which would only fail)."""
        controller = self.controller
        return ("InferencePool",) if controller is not None and controller.groups.inference_pools.known_served else ()

    async def refresh(self, kube: Kube, key: Key, listed: dict[str, Any]) -> None:
        """Read an object whole when a metadata list shows it newer than (or missing from) the cache."""
        cached = self.store.get(key)
        if cached is not None and not_newer(listed, cached.get("metadata", {}).get("resourceVersion")):
            return
        try:
            obj = await kube.get(key[0], key[1] or None, key[2])
        except Exception as err:  # the watch delivers it, or the next resync tries again
            log.warning("could not read %s %s (%s)", key[0], "/".join(key[1:]), err)
            return
        if obj is not None:
            obj.setdefault("kind", key[0])
            self.store.put(obj)

    async def cleanup(self) -> None:
        if self.elector_task is not None:
            # Stops reconciling and gives the Lease up, so another replica takes over at once.
            self.elector_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.elector_task
        await self.follow()
        for task in self.watch_tasks:
            task.cancel()
        await asyncio.gather(*self.watch_tasks, return_exceptions=True)
        self.watch_tasks = []
        if self.kube is not None:
            await self.kube.close()

    def probe(self) -> dict[str, Any]:
        queue = self.queue
        return {"idle": bool(queue and queue.idle()), "processed": queue.processed if queue else 0}

    async def resync(self, every: float) -> None:
        """The timer: the cache is listed afresh and every owner is looked at regularly, events or not."""
        while True:
            await asyncio.sleep(every)
            if self.kube is not None:
                await self.relist(self.kube, self.config.namespaces, metadata_only=True)
            for key in self.store.owners("MaruPool") + self.store.owners("InferenceGroup"):
                self.enqueue(key)

    def changed_beyond_status(self, key: Key, body: dict[str, Any]) -> bool:
        """False for an event that changes only status since the last event of this owner.

        Such an event is a status write (the operator's own, usually): reconciling on it would make
        every status write trigger the next. Compared with the previous *event*, not the cache, which
        the operator's own reads and writes also fill.
        """
        # A digest, not the part itself: a copy of every owner's spec held for this alone was several KB per group.
        part = hashlib.blake2b(
            json.dumps(_desired_part(body), sort_keys=True, default=str).encode(), digest_size=16
        ).digest()
        if self.seen.get(key) == part:
            return False
        self.seen[key] = part
        return True

    async def pool_event(self, type: str | None, body: kopf.Body, **_: Any) -> None:
        obj = dict(body)
        name = obj.get("metadata", {}).get("name", "")
        if type == "DELETED":
            self.store.remove(obj)
            self.pool_fingerprints.pop(name, None)
            self.seen.pop(key_of(obj), None)
        else:
            self.store.put(obj)
            if self.changed_beyond_status(key_of(obj), obj):
                self.enqueue(key_of(obj))
        fingerprint = _pool_fingerprint(obj) if type != "DELETED" else None
        if self.pool_fingerprints.get(name) != fingerprint:
            if fingerprint is not None:
                self.pool_fingerprints[name] = fingerprint
            for group in self.store.groups_of_pool(name):
                self.enqueue(group)

    async def group_event(self, type: str | None, body: kopf.Body, **_: Any) -> None:
        obj = dict(body)
        key = key_of(obj)
        before = self.store.get(key)
        # A status write that met 404 has dropped the group already: its last state is the event's.
        old_pool = ((before or (obj if type == "DELETED" else {})).get("spec") or {}).get("poolRef", {}).get("name")
        new_pool = (obj.get("spec") or {}).get("poolRef", {}).get("name")
        if type == "DELETED":
            self.store.remove(key)
            self.seen.pop(key, None)
            new_pool = None
        else:
            self.store.put(obj)
            if self.changed_beyond_status(key, obj):
                self.enqueue(key)
        # A pool counts its groups and waits for them before it may be deleted.
        if before is None or type == "DELETED" or old_pool != new_pool:
            for pool in {old_pool, new_pool} - {None}:
                self.enqueue(("MaruPool", "", pool))

    async def child_event(self, type: str | None, body: kopf.Body, **_: Any) -> None:
        obj = dict(body)
        if "kind" not in obj:
            return
        # The echo of our own write (its answer is cached already), an object a relist put here, or a version
        # older than one of those (a create's event arriving after the answer of the write that followed it):
        # whoever cached the newer version has looked at it, so it wakes nobody.
        echo = type != "DELETED" and self.store.holds_since(obj)
        if type == "DELETED":
            self.store.remove(obj)
        elif not echo:
            self.store.put(obj)
        owner = owner_key(obj)
        if not echo:
            self.enqueue(owner)

    async def slice_event(self, type: str | None, body: kopf.Body, **_: Any) -> None:
        """A router Service's endpoints changed: its group's Ready depends on them."""
        obj = dict(body)
        obj.setdefault("kind", "EndpointSlice")
        if type == "DELETED":
            self.store.remove(obj)
        else:
            self.store.put(obj)
        meta = obj.get("metadata", {})
        self.enqueue(
            self.store.owner(
                ("Service", meta.get("namespace") or "", (meta.get("labels") or {}).get(SERVICE_NAME_LABEL, ""))
            )
        )

    @property
    def gone(self) -> dict[str, Callable[..., Awaitable[None]]]:
        """What a DELETED event of each kind runs: a relist that finds an object gone runs the same."""
        return {
            "MaruPool": self.pool_event,
            "InferenceGroup": self.group_event,
            "EndpointSlice": self.slice_event,
            "InferencePool": self.child_event,
            **{k: self.child_event for k in PRIMED_KINDS if k not in ("MaruPool", "InferenceGroup", "EndpointSlice")},
        }


def configure(config: Config) -> Runtime:
    """A runtime for one operator run; kopf gets it as the run's memo (:func:`memo`)."""
    return Runtime(config=config, store=Store())


def memo(runtime: Runtime) -> kopf.Memo:
    """What kopf hands every handler of this run: the runtime they pass events to."""
    return kopf.Memo(runtime=runtime)


class NoDiffBase(kopf.DiffBaseStorage):
    """No diff base: the operator has no create/update handlers, only event handlers.

    kopf builds each event's "essence" (a deep copy of the whole object) to diff it for change
    handlers; with none registered that was a third of the operator's CPU at a few hundred groups.
    """

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> Any:
        return {}

    def fetch(self, *, body: kopf.Body) -> None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: Any) -> None:
        return None


PRIMED_KINDS = (
    "MaruPool",
    "InferenceGroup",
    "Deployment",
    "DaemonSet",
    "Service",
    "ServiceAccount",
    "RoleBinding",
    "NetworkPolicy",
    "Secret",
    "EndpointSlice",
    "PersistentVolumeClaim",
    "PodDisruptionBudget",
)


def _desired_part(body: dict[str, Any]) -> Any:
    """The object without what status writes change (status, resourceVersion, managedFields)."""
    meta = {k: v for k, v in (body.get("metadata") or {}).items() if k not in ("resourceVersion", "managedFields")}
    return {**{k: v for k, v in body.items() if k != "status"}, "metadata": meta}


def _pool_fingerprint(body: dict[str, Any]) -> Any:
    """What groups depend on: the pool's spec, whether it is going away, whether it is ready or degraded."""
    health = [
        (c.get("type"), c.get("status"), c.get("message"))
        for c in (body.get("status") or {}).get("conditions") or []
        if c.get("type") in ("Ready", "Degraded")
    ]
    return repr((body.get("spec"), bool(body.get("metadata", {}).get("deletionTimestamp")), health))


async def watch_kind(
    kube: Kube,
    store: Store,
    kind: str,
    namespace: str | None,
    selector: str,
    on_event: Callable[..., Awaitable[None]],
) -> None:
    """Keep the cache's objects of ``kind`` (in ``namespace``, None: all) current, as an informer does.

    List, then watch from the list's version; the watch resumes from the last version it saw, and an
    expired one (410) lists again, forgetting what is gone. Each object goes to ``on_event`` as kopf would
    pass it (``type``, ``body``). Errors are logged and retried: the resync catches up meanwhile.
    """
    where = namespace or "all namespaces"
    version: str | None = None
    while True:
        try:
            if version is None:
                items, version = await kube.list_with_version(kind, namespace, selector)
                listed = set()
                for item in items:
                    item["kind"] = kind
                    listed.add(key_of(item))
                    await on_event(type="ADDED", body=item)
                for key in store.keys(kind, namespace):
                    cached = store.get(key)
                    if key not in listed and cached is not None and not_newer(cached, version):
                        await on_event(type="DELETED", body=cached)
            async for type_, obj in kube.watch(kind, namespace, selector, version):
                if type_ == "ERROR":
                    log.info("watch of %ss in %s expired (%s); listing again", kind, where, obj.get("message", ""))
                    version = None
                    break
                version = (obj.get("metadata") or {}).get("resourceVersion") or version
                if type_ != "BOOKMARK":
                    obj["kind"] = kind
                    await on_event(type=type_, body=obj)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # the next list or watch, or the resync, catches up
            if isinstance(err, ApiError) and err.status == 410:
                version = None  # expired: list again (some servers answer so rather than with an ERROR event)
            log.warning("watch of %ss in %s failed (%s); again in %.0fs", kind, where, err, WATCH_BACKOFF)
            await asyncio.sleep(WATCH_BACKOFF)


# kopf's handlers: each passes its event to the run's runtime (kopf's memo), and nothing else.


@kopf.on.login(retries=3)
def on_login(memo: kopf.Memo, **kwargs: Any) -> kopf.ConnectionInfo:
    return memo.runtime.login(**kwargs)


@kopf.on.startup()
async def on_startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    await memo.runtime.start(settings)


@kopf.on.cleanup()
async def on_cleanup(memo: kopf.Memo, **_: Any) -> None:
    await memo.runtime.cleanup()


@kopf.on.probe(id="queue")
def queue_probe(memo: kopf.Memo, **_: Any) -> dict[str, Any]:
    return memo.runtime.probe()


@kopf.on.event(GROUP, VERSION, "marupools")
async def pool_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await memo.runtime.pool_event(type=type, body=body)


@kopf.on.event(GROUP, VERSION, "inferencegroups")
async def group_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await memo.runtime.group_event(type=type, body=body)


# Kopf watches only the children the operator does not watch itself (see WATCHED_KINDS).
@kopf.on.event("inference.networking.k8s.io", "v1", "inferencepools", labels=OURS, id="child-inferencepools")
async def inference_pool_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await memo.runtime.child_event(type=type, body=body)
