"""The NetworkPolicies the product ships, evaluated on the pods it renders: serving works, nothing else does.

A small cluster is built from the real renders: the chart (helm, with a scrape namespace) and every
example through ``maru-operator render`` (with the group bound to each example pool in turn), plus the
pods around them: kube-dns, a Prometheus, a tenant's unrelated pod, a pod in another namespace that
copies a vLLM pod's labels, the API server and the internet. Each flow serving needs must be allowed,
and each flow nobody needs must be refused (the evaluator says which side refuses).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from maru_localcluster.netpol import Endpoint, Network
from maru_localcluster.podsecurity import pod_template
from tests.security.renders import POOL_NAMESPACE, chart_render, examples_bound_to_each_pool

GROUP_NS = "llm"  # the example group's namespace, allowed by the dax example pool
MONITORING = "monitoring"
NAMESPACES = {POOL_NAMESPACE: {}, GROUP_NS: {}, "kube-system": {}, MONITORING: {}, "elsewhere": {}}

API_SERVER = Endpoint("api-server", "192.0.2.1")
INTERNET = Endpoint("hf-hub", "203.0.113.80")
CLIENT = Endpoint("client-outside", "203.0.113.7")
DNS = Endpoint("kube-dns", "198.51.100.250", "kube-system", {"k8s-app": "kube-dns"}, {"dns": 53})
PROMETHEUS = Endpoint("prometheus", "198.51.100.251", MONITORING, {"app": "prometheus"})
NEIGHBOUR = Endpoint("neighbour", "198.51.100.252", GROUP_NS, {"app": "debug"})
STRANGER = Endpoint("stranger", "198.51.100.253", "elsewhere", {"app": "curl"})

_ips = (f"198.51.100.{i}" for i in itertools.count(1))


def _endpoint(obj: dict[str, Any]) -> Endpoint:
    meta, spec = pod_template(obj)  # type: ignore[misc]
    ports = {p["name"]: p["containerPort"] for c in spec["containers"] for p in c.get("ports") or [] if "name" in p}
    return Endpoint(obj["metadata"]["name"], next(_ips), obj["metadata"]["namespace"], meta.get("labels") or {}, ports)


class World:
    def __init__(self, objects: list[dict[str, Any]]) -> None:
        self.net = Network(objects, NAMESPACES)
        self.pods = {o["metadata"]["name"]: _endpoint(o) for o in objects if pod_template(o) is not None}

    def __getitem__(self, name: str) -> Endpoint:
        return self.pods[name]

    def allowed(self, src: Endpoint, dst: Endpoint, port: int, protocol: str = "TCP") -> None:
        refused = self.net.why_refused(src, dst, port, protocol)
        assert refused is None, f"{src} -> {dst}:{port} must work: {refused}"

    def refused(self, src: Endpoint, dst: Endpoint, port: int, protocol: str = "TCP") -> None:
        assert not self.net.allows(src, dst, port, protocol), f"{src} -> {dst}:{port} must be refused"


@pytest.fixture(scope="module")
def chart(helm: Path) -> list[dict[str, Any]]:
    return chart_render(
        helm,
        "--set",
        f"networkPolicy.scrapeNamespaces={{{MONITORING}}}",
        "--set",
        "networkPolicy.apiServer.cidrs={192.0.2.0/24}",
    )


@pytest.fixture(scope="module")
def worlds(chart: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> dict[str, World]:
    """Pool name -> the chart and the examples, the group bound to that pool."""
    flags = ("--scrape-namespace", MONITORING, "--api-server-cidr", "192.0.2.0/24")
    rendered = examples_bound_to_each_pool(tmp_path_factory.mktemp("netpol"), *flags)
    return {pool: World(chart + objects) for pool, objects in rendered.items()}


@pytest.fixture(params=["cxl-pool", "local-shm"])
def world(request: pytest.FixtureRequest, worlds: dict[str, World]) -> World:
    return worlds[request.param]


def test_every_pod_is_isolated_both_ways(world: World) -> None:
    for pod in world.pods.values():
        assert world.net.isolated(pod) == (True, True), f"{pod} has no NetworkPolicy for one direction"


def test_clients_reach_the_router_and_only_its_api_port(world: World) -> None:
    router = world["qwen-7b-router"]
    for client in (CLIENT, STRANGER, NEIGHBOUR):
        world.allowed(client, router, 8000)
        world.refused(client, router, 29000)


def test_the_router_reaches_prefill_and_decode_and_the_api_server(world: World) -> None:
    router = world["qwen-7b-router"]
    for role in ("qwen-7b-prefill", "qwen-7b-decode"):
        world.allowed(router, world[role], 8000)
        world.allowed(router, world[role], 5557)  # maru-router reads the engines' KV events (decode-direct)
        world.refused(router, world[role], 9999)
    world.allowed(router, API_SERVER, 6443)
    world.allowed(router, API_SERVER, 443)
    world.allowed(router, DNS, 53, "UDP")
    world.refused(router, INTERNET, 443)
    world.refused(router, Endpoint("elsewhere", "203.0.113.99"), 6443)  # not in the API server's range


def test_nobody_else_reaches_vllm(world: World) -> None:
    for role in ("qwen-7b-prefill", "qwen-7b-decode"):
        for intruder in (CLIENT, STRANGER, NEIGHBOUR):
            world.refused(intruder, world[role], 8000)
            world.refused(intruder, world[role], 5557)


def test_vllm_reaches_dns_and_model_downloads_only(world: World) -> None:
    for role in ("qwen-7b-prefill", "qwen-7b-decode"):
        vllm = world[role]
        world.allowed(vllm, DNS, 53, "UDP")
        world.allowed(vllm, DNS, 53)
        world.allowed(vllm, INTERNET, 443)
        world.refused(vllm, INTERNET, 80)
        world.refused(vllm, API_SERVER, 6443)
        world.refused(vllm, NEIGHBOUR, 8000)
        world.refused(vllm, world["qwen-7b-router"], 8000)
        world.refused(vllm, world["maru-operator"], 9090)


def test_dax_clients_and_agents_reach_the_metadata_server(worlds: dict[str, World]) -> None:
    world = worlds["cxl-pool"]
    metadata, agent = world["cxl-pool-metadata"], world["cxl-pool-agent"]
    # The router too: with decode-direct it asks the pool what it holds of each prompt.
    for client in (world["qwen-7b-prefill"], world["qwen-7b-decode"], world["qwen-7b-router"], agent):
        world.allowed(client, metadata, 7400)
        world.refused(client, metadata, 9400)
    world.allowed(agent, DNS, 53, "UDP")
    # The metadata server answers; it never opens a connection itself.
    world.refused(metadata, DNS, 53, "UDP")
    world.refused(metadata, agent, 9400)


def test_only_the_pools_clients_reach_its_metadata_server(worlds: dict[str, World]) -> None:
    world = worlds["cxl-pool"]
    metadata = world["cxl-pool-metadata"]
    impostor = Endpoint("impostor", "198.51.100.240", "elsewhere", world["qwen-7b-decode"].labels)
    # allowedNamespaces of the example pool is [llm]: a copy of a vLLM pod's labels elsewhere gets nothing.
    router = world["qwen-7b-router"]
    router_elsewhere = Endpoint("router-elsewhere", "198.51.100.241", "elsewhere", router.labels)
    for intruder in (impostor, router_elsewhere, STRANGER, NEIGHBOUR, world["local-shm-agent"], CLIENT):
        world.refused(intruder, metadata, 7400)


def test_the_shm_group_needs_no_network_to_its_pool(worlds: dict[str, World]) -> None:
    world = worlds["local-shm"]
    # No metadata server: clients use the agent's Unix socket; the agent opens no connection at all.
    for role in ("qwen-7b-prefill", "qwen-7b-decode"):
        world.refused(world[role], world["cxl-pool-metadata"], 7400)
        world.refused(world[role], world["local-shm-agent"], 9400)
    world.refused(world["local-shm-agent"], DNS, 53, "UDP")


def test_the_operator_reaches_the_api_server_and_pool_status(world: World) -> None:
    operator = world["maru-operator"]
    world.allowed(operator, API_SERVER, 6443)
    world.allowed(operator, DNS, 53, "UDP")
    world.allowed(operator, world["local-shm-agent"], 9400)
    world.allowed(operator, world["cxl-pool-agent"], 9400)
    world.allowed(operator, world["cxl-pool-metadata"], 9400)
    world.refused(operator, world["cxl-pool-metadata"], 7400)
    world.refused(operator, world["qwen-7b-decode"], 8000)
    world.refused(operator, INTERNET, 443)


def test_prometheus_scrapes_every_metrics_port(world: World) -> None:
    for name, port in [
        ("maru-operator", 9090),
        ("qwen-7b-router", 29000),
        ("qwen-7b-router", 29001),
        ("qwen-7b-prefill", 8000),
        ("qwen-7b-decode", 8000),
        ("cxl-pool-metadata", 9400),
        ("cxl-pool-agent", 9400),
        ("local-shm-agent", 9400),
    ]:
        world.allowed(PROMETHEUS, world[name], port)
    world.refused(PROMETHEUS, world["cxl-pool-metadata"], 7400)
    for name, port in [("maru-operator", 9090), ("cxl-pool-agent", 9400), ("local-shm-agent", 9400)]:
        world.refused(STRANGER, world[name], port)


def test_the_csi_node_plugin_has_no_network(world: World) -> None:
    plugin = world["maru-operator-csi-node"]
    for other in (STRANGER, PROMETHEUS, world["maru-operator"]):
        world.refused(other, plugin, 9809)
    world.refused(plugin, API_SERVER, 6443)
    world.refused(plugin, DNS, 53, "UDP")


def test_without_scrape_namespaces_nothing_scrapes(helm: Path, tmp_path: Path) -> None:
    """The defaults: metrics ports are open to the operator alone."""
    objects = chart_render(helm) + examples_bound_to_each_pool(tmp_path)["cxl-pool"]
    world = World(objects)
    for name, port in [
        ("maru-operator", 9090),
        ("qwen-7b-router", 29000),
        ("qwen-7b-decode", 8000),
        ("cxl-pool-metadata", 9400),
        ("cxl-pool-agent", 9400),
    ]:
        world.refused(PROMETHEUS, world[name], port)
    world.allowed(world["maru-operator"], world["cxl-pool-metadata"], 9400)
    world.allowed(world["qwen-7b-router"], API_SERVER, 6443)  # the default range is every address


def test_a_group_without_router_is_open_on_its_api_port_only(tmp_path: Path) -> None:
    from tests.security.renders import operator_render

    (tmp_path / "g.yaml").write_text("""
apiVersion: maru.io/v1alpha1
kind: InferenceGroup
metadata: {name: solo, namespace: llm}
spec:
  model: {name: m}
  poolRef: {name: local-shm}
  router: {enabled: false}
""")
    objects = operator_render([tmp_path / "g.yaml"])
    assert {o["metadata"]["name"] for o in objects if o["kind"] == "NetworkPolicy"} == {"solo-vllm"}
    world = World(objects)
    world.allowed(STRANGER, world["solo-prefill"], 8000)
    world.refused(STRANGER, world["solo-prefill"], 9000)


def test_the_pool_events_publisher_serves_only_its_consumers_and_reaches_only_its_pool(tmp_path: Path) -> None:
    from tests.security.renders import EXAMPLES, operator_render

    def render(events: str) -> World:
        (tmp_path / "g.yaml").write_text(f"""
apiVersion: maru.io/v1alpha1
kind: InferenceGroup
metadata: {{name: pub, namespace: llm}}
spec:
  model: {{name: m}}
  poolRef: {{name: cxl-pool}}
  poolEvents: {events}
""")
        return World(operator_render([EXAMPLES / "pool-cxl.yaml", tmp_path / "g.yaml"], "--api-server-cidr",
                                     "192.0.2.0/24"))  # fmt: skip

    world = render("{enabled: true}")
    publisher = world["pub-pool-events"]
    assert world.net.isolated(publisher) == (True, True)
    # The stream tells which prompts the group's tenants sent: by default only its own namespace reads it.
    world.allowed(NEIGHBOUR, publisher, 5557)
    world.allowed(NEIGHBOUR, publisher, 5558)
    for outsider in (STRANGER, CLIENT, PROMETHEUS):
        world.refused(outsider, publisher, 5557)
        world.refused(outsider, publisher, 5558)
    world.refused(NEIGHBOUR, publisher, 8000)
    # Out: the pool's metadata server (its lookups and event reads) and DNS, nothing else.
    world.allowed(publisher, world["cxl-pool-metadata"], 7400)
    world.allowed(publisher, DNS, 53, "UDP")
    for elsewhere, port in ((INTERNET, 443), (API_SERVER, 6443), (world["pub-decode"], 8000), (NEIGHBOUR, 8000)):
        world.refused(publisher, elsewhere, port)
    copycat = Endpoint("copycat", "198.51.100.242", "elsewhere", publisher.labels)  # outside allowedNamespaces
    world.refused(copycat, world["cxl-pool-metadata"], 7400)
    # A KV-aware router installed elsewhere is named in the spec: it, and only it, gets in.
    world = render(
        "{enabled: true, consumers: [{namespaceSelector: {matchLabels: "
        "{kubernetes.io/metadata.name: elsewhere}}, podSelector: {matchLabels: {app: curl}}}]}"
    )
    publisher = world["pub-pool-events"]
    world.allowed(STRANGER, publisher, 5557)
    world.allowed(STRANGER, publisher, 5558)
    other = Endpoint("other-in-elsewhere", "198.51.100.243", "elsewhere", {"app": "debug"})
    for outsider in (NEIGHBOUR, other, CLIENT):
        world.refused(outsider, publisher, 5557)


def test_policies_can_be_turned_off(tmp_path: Path, helm: Path) -> None:
    from tests.security.renders import EXAMPLES, operator_render

    assert not [o for o in operator_render([EXAMPLES], "--no-network-policies") if o["kind"] == "NetworkPolicy"]
    chart = chart_render(helm, "--set", "networkPolicy.enabled=false")
    assert not [o for o in chart if o["kind"] == "NetworkPolicy"]
    operator = next(o for o in chart if o["kind"] == "Deployment")
    assert "--no-network-policies" in operator["spec"]["template"]["spec"]["containers"][0]["args"]


def _cilium_selects(selector: dict[str, Any], namespace: str, labels: dict[str, str]) -> bool:
    """A Cilium endpointSelector (matchLabels only) on a pod; ``k8s:`` keys are the pod's own, the namespace
    is ``k8s:io.kubernetes.pod.namespace``."""
    assert set(selector) == {"matchLabels"}, selector
    pod = {**{f"k8s:{k}": v for k, v in labels.items()}, "k8s:io.kubernetes.pod.namespace": namespace}
    return all(pod.get(k if k.startswith("k8s:") else f"k8s:{k}") == v for k, v in selector["matchLabels"].items())


def test_on_cilium_the_operator_and_the_routers_reach_the_kube_apiserver_entity(helm: Path, tmp_path: Path) -> None:
    """Cilium never matches an ipBlock to an API server on the nodes: with networkPolicy.apiServer.cilium the
    chart allows Cilium's kube-apiserver entity to exactly the pods that talk to the API server."""
    assert not [o for o in chart_render(helm) if o["apiVersion"].startswith("cilium.io/")]
    chart = chart_render(
        helm, "--set", "networkPolicy.apiServer.cilium=true", "--set-json", "networkPolicy.apiServer.ports=[6443]"
    )
    (policy,) = [o for o in chart if o["apiVersion"].startswith("cilium.io/")]
    assert policy["apiVersion"] == "cilium.io/v2" and policy["kind"] == "CiliumClusterwideNetworkPolicy"
    # The Kubernetes policies stay: Cilium allows what any policy selecting a pod allows.
    assert [o for o in chart if o["kind"] == "NetworkPolicy"]
    children = examples_bound_to_each_pool(tmp_path)
    pods = [o for o in chart + [c for cs in children.values() for c in cs] if pod_template(o) is not None]
    reach = set()
    for pod in pods:
        meta, _ = pod_template(pod)  # type: ignore[misc]
        for spec in policy["specs"]:
            if not _cilium_selects(spec["endpointSelector"], pod["metadata"]["namespace"], meta.get("labels") or {}):
                continue
            for rule in spec["egress"]:
                ports = [p for to in rule["toPorts"] for p in to["ports"]]
                if rule["toEntities"] == ["kube-apiserver"] and ports == [{"port": "6443", "protocol": "TCP"}]:
                    reach.add((pod["kind"], pod["metadata"]["name"]))
    routers = {
        ("Deployment", o["metadata"]["name"])
        for cs in children.values()
        for o in cs
        if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-router")
    }
    assert routers
    assert reach == {("Deployment", "maru-operator")} | routers
