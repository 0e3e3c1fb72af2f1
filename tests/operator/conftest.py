"""Fixtures: the operator running for real (in-process kopf) against the Kubernetes API emulator."""

from __future__ import annotations

import asyncio
import copy
import pathlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml

from tests.k8s.fixtures import KubeEmulator, k8s_emulator, kube_controllers

__all__ = ["k8s_emulator", "kube_controllers"]

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRDS = ROOT / "crds"
POOL_NS = "maru-system"
GROUP_NS = "llm"

SHM_POOL: dict[str, Any] = {
    "apiVersion": "maru.io/v1alpha1",
    "kind": "MaruPool",
    "metadata": {"name": "local-shm"},
    "spec": {"backend": "shm", "size": "1Gi", "nodeSelector": {"maru.io/pool": "yes"}},
}

GROUP: dict[str, Any] = {
    "apiVersion": "maru.io/v1alpha1",
    "kind": "InferenceGroup",
    "metadata": {"name": "qwen", "namespace": GROUP_NS},
    "spec": {
        "model": {"name": "Qwen/Qwen2.5-0.5B-Instruct", "servedModelName": "qwen"},
        "poolRef": {"name": "local-shm"},
        "prefill": {"replicas": 1},
        "decode": {"replicas": 2},
    },
}


def pool(name: str = "local-shm", **spec: Any) -> dict[str, Any]:
    body = copy.deepcopy(SHM_POOL)
    body["metadata"]["name"] = name
    body["spec"].update(spec)
    return body


def group(name: str = "qwen", namespace: str = GROUP_NS, pool_name: str = "local-shm", **spec: Any) -> dict[str, Any]:
    body = copy.deepcopy(GROUP)
    body["metadata"].update(name=name, namespace=namespace)
    body["spec"]["poolRef"]["name"] = pool_name
    for key, value in spec.items():
        body["spec"][key] = value
    return body


def install_crds(kube: KubeEmulator) -> None:
    for path in sorted(CRDS.glob("*.yaml")):
        kube.create(yaml.safe_load(path.read_text()))


def create_namespace(kube: KubeEmulator, name: str) -> None:
    if kube.get("namespaces", name) is None:
        kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})


def prepare(kube: KubeEmulator, controllers: Any) -> KubeEmulator:
    install_crds(kube)
    for ns in (POOL_NS, GROUP_NS):
        create_namespace(kube, ns)
    controllers.add_node("node-1", {"maru.io/pool": "yes"})
    return kube


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


class StubStats:
    """Stands in for the pool daemons' /status: answers per URL, or not at all."""

    def __init__(self) -> None:
        self.answers: dict[str, dict[str, Any] | None] = {}
        self.default: dict[str, Any] | None = None
        self.calls: list[str] = []

    async def __call__(self, url: str) -> dict[str, Any] | None:
        self.calls.append(url)
        return self.answers.get(url, self.default)


class RunningOperator:
    """The operator in a thread, as ``maru-operator run`` runs it; ``token``: a ServiceAccount's, held to RBAC."""

    def __init__(self, kube: KubeEmulator, stats: StubStats, token: str | None = None, **config: Any) -> None:
        from maru_operator import handlers

        self.kube = kube
        self.stats = stats
        self.runtime = handlers.configure(
            handlers.Config(
                pool_namespace=POOL_NS,
                connection=kube.kopf_connection(token),
                fetch_status=stats,
                **config,
            )
        )
        self._stop: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._main, name="operator", daemon=True)
        self._ready = threading.Event()
        self.error: BaseException | None = None

    def _main(self) -> None:
        import kopf

        from maru_operator import handlers

        async def run() -> None:
            self._stop["flag"] = asyncio.Event()
            self._stop["loop"] = asyncio.get_running_loop()
            self._ready.set()
            settings = kopf.OperatorSettings()
            settings.peering.standalone = True
            namespaces = self.runtime.config.namespaces
            await kopf.operator(
                settings=settings,
                stop_flag=self._stop["flag"],
                clusterwide=not namespaces,
                namespaces=namespaces,
                standalone=True,
                memo=handlers.memo(self.runtime),
            )

        try:
            asyncio.run(run())
        except BaseException as err:  # surfaced by stop()
            self.error = err

    def start(self) -> RunningOperator:
        self._thread.start()
        assert self._ready.wait(30)
        return self

    def stop(self) -> None:
        if "loop" in self._stop and self._thread.is_alive():
            self._stop["loop"].call_soon_threadsafe(self._stop["flag"].set)
        self._thread.join(30)
        assert not self._thread.is_alive(), "the operator did not stop"

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the operator's loop (to read its queue or cache safely)."""

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._stop["loop"]).result(30)

    def idle(self) -> bool:
        queue = self.runtime.queue
        return bool(queue is not None and self.call(queue.idle))


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


def settle(op: RunningOperator, *, resync: bool = True, quiet_polls: int = 5) -> None:
    """Enqueue every owner (as the resync timer would) and wait until the queue stays idle."""
    import time

    if resync:

        def enqueue_all() -> None:
            for key in op.runtime.store.owners("MaruPool") + op.runtime.store.owners("InferenceGroup"):
                op.runtime.enqueue(key)

        op.call(enqueue_all)
    quiet = 0
    for _ in range(2000):
        quiet = quiet + 1 if op.idle() else 0
        if quiet >= quiet_polls:
            return
        time.sleep(0.02)
    raise AssertionError("the operator never went idle")


def object_writes(kube: KubeEmulator, mark: int) -> list[Any]:
    """Writes since ``mark``, but leader election's: the Lease's renewals (a leader renews every few seconds)
    and the Events on the Lease (``maru-operator[-instance].<suffix>``: who became or stopped being leader)."""
    return [
        r
        for r in kube.writes_since(mark)
        if "/leases/" not in r.path
        and not r.path.endswith("/leases")
        and not (r.path.endswith("/events") and (r.created or "").startswith("maru-operator"))
    ]


def has_condition(obj: dict[str, Any], type_: str, status: str, reason: str | None = None) -> bool:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return c.get("status") == status and (reason is None or c.get("reason") == reason)
    return False


def condition_of(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return c
    raise AssertionError(f"no {type_} condition in {obj.get('status')}")


def fake_agent_pod(kube: KubeEmulator, pool_name: str, node: str, ip: str) -> None:
    """An agent pod as the DaemonSet controller and kubelet would leave it: scheduled, Ready, with an IP."""
    ds = kube.get("daemonsets.apps", f"{pool_name}-agent", POOL_NS)
    assert ds is not None
    name = f"{pool_name}-agent-{node}"
    labels = ds["spec"]["template"]["metadata"]["labels"]
    kube.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": POOL_NS, "labels": labels},
            "spec": {"nodeName": node, "containers": [{"name": "agent", "image": "x"}]},
        }
    )
    # Status is the kubelet's to write, through the status subresource (a create drops it).
    kube.patch_status("pods", name, {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}, POOL_NS)
