"""The CXL pool example (``examples/pool-cxl.yaml``) on two emulated CXL nodes, as the operator renders it.

The "device" ``/dev/dax0.0`` is one file linked into both nodes' roots, so the two nodes share its
memory as CXL hosts do. The pool runs as rendered for CXL nodes: a metadata server Deployment behind
its Service, which the agents reach by its cluster DNS name, and a privileged agent per node mapping
the device. Prefill and decode land on different nodes, so KV crosses nodes through the shared memory.
A killed agent is restarted by the kubelet while vLLM answers, and the KV stored before is still there.

No chunkTokens roll here: the roll is the operator's and the same for both backends
(``test_shm_pool.py`` covers it), and restarting both engines would add about 70 s on two cores.
"""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from maru_localcluster.product import POOL_NAMESPACE, wait_ready
from tests.support.e2e import GROUP_NS, Deployment, deployed, example, skip_unless_local_cluster_runs, wait

from .traffic import complete, from_pool, prompt

skip_unless_local_cluster_runs()

pytestmark = pytest.mark.vllm

CHUNK = 256
DEVICE_BYTES = (128 << 20) + 4096  # header + 128 MiB, as a devdax region would be


@pytest.fixture(scope="module")
def dax(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    workdir = tmp_path_factory.mktemp("e2e-dax")
    device = workdir / "cxl-memory"
    with open(device, "wb") as fh:
        fh.truncate(DEVICE_BYTES)
    pool = example("examples/pool-cxl.yaml")
    pool["spec"]["size"] = "64Mi"  # the example's 256Gi cap, scaled to this machine
    group = example("examples/local/inferencegroup-tiny.yaml")
    group["spec"]["poolRef"]["name"] = pool["metadata"]["name"]
    # One engine per role, on different nodes: the test is about KV crossing nodes, not the fleet. Each engine
    # asks for over half a node's CPUs (the nodes report this machine's), so no node fits both, whichever
    # order the scheduler sees them in.
    group["spec"]["prefill"]["replicas"] = 1
    over_half = f"{(os.cpu_count() or 1) * 550}m"
    for role in ("prefill", "decode"):
        group["spec"][role]["resources"] = {
            **group["spec"][role]["resources"],
            "requests": {**group["spec"][role]["resources"]["requests"], "cpu": over_half},
        }
    nodes = [(f"cxl-node-{i}", {"maru.io/cxl": "true"}, {"/dev/dax0.0": device}) for i in (1, 2)]
    with deployed(tiny_model, workdir, nodes, [pool, group]) as d:
        wait_ready(d.cluster, "marupools.maru.io", "cxl-pool")
        wait_ready(d.cluster, "inferencegroups.maru.io", "tiny", GROUP_NS)
        yield d


def test_metadata_server_and_an_agent_per_node(dax: Deployment) -> None:
    status = dax.get("marupools.maru.io", "cxl-pool")["status"]
    assert status["nodeSummary"] == "2/2"
    agents = dax.cluster.kube.list("pods", POOL_NAMESPACE, labels="app.kubernetes.io/component=agent")
    assert sorted(p["spec"]["nodeName"] for p in agents) == ["cxl-node-1", "cxl-node-2"]
    (metadata,) = dax.cluster.kube.list("pods", POOL_NAMESPACE, labels="app.kubernetes.io/component=metadata")
    assert metadata["spec"]["securityContext"]["runAsUser"] == 65532
    # The metadata server (as UID 65532) and the agents read the pool key: every link is authenticated.
    assert "auth=on" in dax.cluster.pod_log(POOL_NAMESPACE, metadata["metadata"]["name"], "metadata")
    # Each agent reached the metadata server through its Service name (possibly after it came up)
    # and adopted the pool's epoch.
    for agent in agents:
        log = dax.cluster.pod_log(POOL_NAMESPACE, agent["metadata"]["name"], "agent")
        assert "metadata=tcp://cxl-pool-metadata.maru-system.svc:7400" in log and "pool epoch is now" in log, log
        assert "auth=on" in log and "refused this agent" not in log, log


def test_prefill_and_decode_share_kv_across_nodes(dax: Deployment) -> None:
    (prefill_pod,), (decode_pod,) = dax.pods("prefill"), dax.pods("decode")
    assert prefill_pod["spec"]["nodeName"] != decode_pod["spec"]["nodeName"]
    prefill, decode = dax.engine_url("prefill"), dax.engine_url("decode")
    long_prompt = prompt(2 * CHUNK + 40, seed=41)
    recomputed = complete(prefill, long_prompt)
    loaded = from_pool(decode)
    assert complete(dax.router_url, long_prompt) == recomputed
    moved = wait("decode to load from the pool", lambda: from_pool(decode) - loaded, dax)
    assert moved == 2 * CHUNK


def _pool_pods(d: Deployment, component: str) -> list[dict[str, Any]]:
    return [
        p
        for p in d.cluster.kube.list("pods", POOL_NAMESPACE, labels=f"app.kubernetes.io/component={component}")
        if not p["metadata"].get("deletionTimestamp")
    ]


def _status(d: Deployment, pod: dict[str, Any]) -> dict[str, Any]:
    """A pool daemon's ``/status``, at its pod's address (as the operator reads it)."""
    port = next(p["containerPort"] for p in pod["spec"]["containers"][0]["ports"] if p["name"] == "metrics")
    url = d.cluster.pod_url(pod["metadata"]["namespace"], pod["metadata"]["name"], port)
    with urllib.request.urlopen(f"{url}/status") as resp:
        return dict(json.loads(resp.read()))


def test_killing_a_pool_agent_restarts_it_while_vllm_answers(dax: Deployment) -> None:
    # The agent on decode's node: it maps the device and hands its descriptor to decode's connector.
    (decode_pod,) = dax.pods("decode")
    (agent,) = [p for p in _pool_pods(dax, "agent") if p["spec"]["nodeName"] == decode_pod["spec"]["nodeName"]]
    (metadata,) = _pool_pods(dax, "metadata")
    name = agent["metadata"]["name"]
    restarts = agent["status"]["containerStatuses"][0]["restartCount"]
    epoch = _status(dax, metadata)["epoch"]
    assert _status(dax, agent)["epoch"] == epoch
    prefill, decode = dax.engine_url("prefill"), dax.engine_url("decode")
    # KV stored before the kill: prefill computes the prompt and stores its chunks.
    stored = prompt(2 * CHUNK + 40, seed=51)
    expected = complete(prefill, stored)
    pid = dax.cluster.container_pid(POOL_NAMESPACE, name, "agent")
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    # Serving goes on, with the outputs the prefill engine computes alone.
    meanwhile = prompt(300, seed=52)
    assert complete(dax.router_url, meanwhile) == complete(prefill, meanwhile)

    def restarted() -> bool:
        status = dax.get("pods", name, POOL_NAMESPACE)["status"]["containerStatuses"][0]
        return status["restartCount"] > restarts and status["ready"]

    wait("the kubelet to restart the agent", restarted, dax)
    last = dax.get("pods", name, POOL_NAMESPACE)["status"]["containerStatuses"][0]["lastState"]["terminated"]
    assert last["exitCode"] == 128 + signal.SIGKILL, last
    wait_ready(dax.cluster, "marupools.maru.io", "cxl-pool")
    # The restarted agent mapped the device again and took the metadata server's epoch, the one the
    # stored chunks carry: the pool's memory outlived the agent's process.
    assert _status(dax, dax.get("pods", name, POOL_NAMESPACE))["epoch"] == epoch
    assert f"pool epoch is now {epoch} (was None)" in dax.cluster.pod_log(POOL_NAMESPACE, name, "agent")
    commits = _status(dax, metadata)["stats"]["commits"]
    loaded = from_pool(decode)
    assert complete(dax.router_url, stored) == expected
    moved = wait("decode to load the chunks stored before the kill", lambda: from_pool(decode) - loaded, dax)
    assert moved == 2 * CHUNK
    assert _status(dax, metadata)["stats"]["commits"] == commits  # loaded what was there, nothing stored anew
