"""Reconcile one owner: read the snapshot, build the desired children, apply the difference, write status.

Every reconcile computes the whole desired state from the spec, so running it twice changes nothing,
and a child edited or deleted by hand is put back on the next pass. The controller holds the operator's
settings and hands each owner to its reconciler: :mod:`maru_operator.pools` and :mod:`maru_operator.groups`,
which share the child applier (:mod:`maru_operator.applier`), the status writer
(:mod:`maru_operator.statuswriter`) and what the pools' daemons report (:mod:`maru_operator.telemetry`).
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from maru_operator.applier import ChildApplier
from maru_operator.builders.netpol import NetworkPolicyConfig
from maru_operator.cache import Key, Store
from maru_operator.dataplane import DataPlane, Updates
from maru_operator.groups import GroupReconciler
from maru_operator.images import DEFAULT_IMAGES, ImageDefaults
from maru_operator.kube import Kube, StatusFetcher, fetch_daemon_status
from maru_operator.optionalkinds import OptionalKind
from maru_operator.pools import PoolReconciler
from maru_operator.rollouts import RolloutPacer
from maru_operator.rollouts import summary as rollout_summary
from maru_operator.statuswriter import StatusWriter
from maru_operator.telemetry import PoolTelemetry
from maru_operator.traffic import DEFAULT_WINDOW_S

log = logging.getLogger("maru_operator.controller")


# The most often a pool's use (which changes with traffic) is written to its status, and how often a
# pool is looked at without events: its daemons' memory use changes silently.
DEFAULT_USAGE_INTERVAL = 30.0


def utcnow() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Controller:
    kube: Kube
    store: Store
    pool_namespace: str
    fetch_status: StatusFetcher = fetch_daemon_status
    clock: Callable[[], str] = utcnow
    network: NetworkPolicyConfig = field(default_factory=NetworkPolicyConfig)
    pacer: RolloutPacer = field(default_factory=RolloutPacer)
    images: ImageDefaults = DEFAULT_IMAGES  # what pools and groups that name no image get
    # Whether a default image change (an operator upgrade) moves running data planes (see maru_operator.dataplane).
    data_plane_updates: Updates = "manual"
    usage_interval: float = DEFAULT_USAGE_INTERVAL
    monotonic: Callable[[], float] = time.monotonic
    # How far back a group's DisaggregationActive condition looks (the operator's --disaggregation-window).
    disaggregation_window: float = DEFAULT_WINDOW_S
    # Puts an owner on the work queue (the handlers' queue); a pool's poll wakes the groups it has news for.
    wake: Callable[[Key], None] | None = None
    # Whether the API serves InferencePools (the Gateway API Inference Extension's CRD), for groups asking one.
    inference_pools: OptionalKind = field(default_factory=lambda: OptionalKind("InferencePool"))
    # Whether the operator reads the pods of a role that is not ready, to say why (--read-pods; RBAC opt-in).
    read_pods: bool = False

    def __post_init__(self) -> None:
        self.store.summarize("Deployment", rollout_summary)
        self.data_plane = DataPlane(self.images, self.data_plane_updates)
        self.applier = ChildApplier(self.kube, self.store)
        self.status = StatusWriter(self.kube, self.store, self.clock)
        self.telemetry = PoolTelemetry(self.disaggregation_window, self.wake)
        shared = {
            "kube": self.kube,
            "store": self.store,
            "applier": self.applier,
            "status": self.status,
            "telemetry": self.telemetry,
            "pool_namespace": self.pool_namespace,
            "network": self.network,
            "data_plane": self.data_plane,
            "usage_interval": self.usage_interval,
            "clock": self.clock,
            "monotonic": self.monotonic,
        }
        self.pools = PoolReconciler(fetch_status=self.fetch_status, **shared)
        self.groups = GroupReconciler(
            pacer=self.pacer, inference_pools=self.inference_pools, read_pods=self.read_pods, **shared
        )

    async def reconcile(self, key: Hashable) -> float | None:
        assert isinstance(key, tuple)
        if key[0] == "MaruPool":
            return await self.pools.reconcile(key[2])
        if key[0] == "InferenceGroup":
            return await self.groups.reconcile(key[1], key[2])
        return None
