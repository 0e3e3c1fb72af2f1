"""The operator run for real (kopf in a thread) against the API server emulator, the objects the tests apply,
and what they read back (conditions, writes, events)."""

from __future__ import annotations

import asyncio
import copy
import pathlib
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import yaml

from maru_localcluster.server import KubeEmulator
from maru_operator import handlers
from maru_operator.rbac import (
    bindings,
    cluster_role,
    lease_namespace_role,
    pool_namespace_role,
    router_cluster_role,
)

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


def http_get(url: str) -> tuple[int, str]:
    for _ in range(200):
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return resp.status, resp.read().decode()
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"{url} never answered")


def wait_event(kube: KubeEmulator, namespace: str, name: str, reason: str) -> dict[str, Any]:
    """The first Event with this reason on the object (Events are posted right after the status write)."""
    return kube.wait_until(
        lambda e: next(
            (
                ev
                for ev in e.list_objects("", "events", namespace)
                if ev.get("involvedObject", {}).get("name") == name and ev.get("reason") == reason
            ),
            None,
        ),
        message=f"an Event {reason} on {namespace}/{name}",
    )


def bind_documented_rbac(
    kube: KubeEmulator, namespaced: bool = False, account: str = "maru-operator", pool_namespace: str = POOL_NS
) -> str:
    """Grant the operator's ServiceAccount exactly what ``maru-operator rbac`` prints; its token."""
    if kube.get("clusterroles.rbac.authorization.k8s.io", "maru-operator") is None:
        kube.create(cluster_role(namespaced=namespaced))
        kube.create(lease_namespace_role())
        kube.create(router_cluster_role())
    if kube.get("roles.rbac.authorization.k8s.io", "maru-operator", pool_namespace) is None:
        kube.create(pool_namespace_role(pool_namespace))
    for binding in bindings(pool_namespace, account, "maru-operator"):
        binding["metadata"]["name"] = f"{account}-{binding['roleRef']['name']}"
        kube.create(binding)
    return kube.service_account_token(pool_namespace, account)


def on_loop(op: RunningOperator, coro: Any) -> Any:
    return asyncio.run_coroutine_threadsafe(coro, op._stop["loop"]).result(60)
