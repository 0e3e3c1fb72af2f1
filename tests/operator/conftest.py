"""Fixtures: the operator running for real (in-process kopf) against the Kubernetes API emulator."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.k8s.fixtures import KubeEmulator, k8s_emulator, kube_controllers
from tests.support.operator import RunningOperator, StubStats, has_condition, pool, prepare

__all__ = ["k8s_emulator", "kube_controllers"]


@pytest.fixture
def cluster(k8s_emulator: KubeEmulator, kube_controllers: Any) -> KubeEmulator:
    """An emulated cluster with our CRDs, two namespaces and one pool node, controllers running."""
    return prepare(k8s_emulator, kube_controllers)


@pytest.fixture
def pod_controllers(k8s_emulator: KubeEmulator) -> Iterator[Any]:
    """Simulated controllers that also keep Pod objects (scheduled, with IPs, Ready per readiness)."""
    from maru_localcluster.simcontrollers import KubeControllers

    with KubeControllers(k8s_emulator, pods=True) as controllers:
        prepare(k8s_emulator, controllers)
        yield controllers


@pytest.fixture
def stats() -> StubStats:
    return StubStats()


@pytest.fixture
def operator(cluster: KubeEmulator, stats: StubStats) -> Iterator[RunningOperator]:
    running = RunningOperator(cluster, stats, resync_seconds=3600, workers=4).start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def ready_pool(cluster: KubeEmulator, operator: RunningOperator) -> dict[str, Any]:
    """The pool ``local-shm``, created and Ready (with the operator running)."""
    cluster.create(pool())
    return cluster.wait_for("marupools.maru.io", "local-shm", None, lambda o: has_condition(o, "Ready", "True"))
