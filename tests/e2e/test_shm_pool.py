"""An shm pool and an InferenceGroup, applied as a user would, running as the operator renders them.

The local cluster runs every pod the operator writes: the pool agent with its memory-backed
``/dev/shm`` of exactly ``sizeLimit``, both vLLM roles with their kv-transfer-config, vllm-router
finding them through the API. The tests then change, break and remove what runs.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import signal
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from maru_contracts import tenancy
from maru_localcluster.cluster import processes_in
from maru_localcluster.product import POOL_NAMESPACE, wait_ready
from maru_operator import __version__
from maru_pool import PoolAuthError, PoolClient
from tests.support import images
from tests.support.e2e import GROUP_NS, Deployment, deployed, example, skip_unless_local_cluster_runs, wait

from .traffic import TIMEOUT_S, complete, counter, from_pool, health, prompt

skip_unless_local_cluster_runs()

pytestmark = pytest.mark.vllm

CHUNK = 256
# Image references a test tagged (a newer release's), removed with the module's cluster.
RELEASED: list[str] = []


@pytest.fixture(scope="module")
def shm(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    pool, group = example("examples/local/pool-shm.yaml"), example("examples/local/inferencegroup-tiny.yaml")
    # One engine per role: these tests change, break and address each role's pod (the demo shows two
    # prefill replicas sharing the pool).
    group["spec"]["prefill"]["replicas"] = 1
    # What the pool holds, as vLLM KV events (off by default), with the prompts' tokens (opt-in: they are the
    # tenants' prompts).
    group["spec"]["poolEvents"] = {"enabled": True, "tokenIds": True}
    with deployed(tiny_model, tmp_path_factory.mktemp("e2e-shm"), [("node-1", {}, {})], [pool, group]) as d:
        wait_ready(d.cluster, "marupools.maru.io", "local-shm")
        wait_ready(d.cluster, "inferencegroups.maru.io", "tiny", GROUP_NS)
        yield d
    images.untag(RELEASED)


def agent_pod(d: Deployment) -> dict[str, Any]:
    (pod,) = [
        p
        for p in d.cluster.kube.list("pods", POOL_NAMESPACE, labels="app.kubernetes.io/component=agent")
        if not p["metadata"].get("deletionTimestamp")
    ]
    return pod


def in_container(pid: int, path: str) -> Path:
    """``path`` as process ``pid`` sees it: below its root, with absolute links (``/var/run`` -> ``/run``) taken
    inside that root rather than this process's."""
    root = current = Path(f"/proc/{pid}/root")
    for part in Path(path).parts[1:]:
        current = current / part
        if current.is_symlink():
            target = os.readlink(current)
            current = root / target.lstrip("/") if target.startswith("/") else current.parent / target
    return current


def wait_for_more(d: Deployment, read: Any, before: float, what: str) -> float:
    """vLLM counts a request's prompt sources a scheduler step after answering: wait for the count."""
    return float(wait(what, lambda: read() > before and read(), d))


def test_kubectl_shows_pool_and_group_ready(shm: Deployment) -> None:
    out = shm.cluster.kubectl("get", "mpool,ig", "-A").stdout
    pool_row = next(line for line in out.splitlines() if "local-shm" in line and "marupool" in line)
    assert pool_row.split()[1:4] == ["shm", "1/1", "256Mi"], out
    group_row = next(line for line in out.splitlines() if "inferencegroup" in line)
    assert group_row.split()[3:6] == ["1/1", "1/1", "True"], out


def test_the_pool_serves_only_holders_of_the_group_credential(shm: Deployment, tmp_path: Path) -> None:
    """The agent runs with the pool key the operator made; its init container left the key for the CSI node plugin,
    which minted each vLLM pod's token at publish (no Secret in the group's namespace); a client on the node
    without one gets nothing (prefill and decode sharing KV, below, shows the credential works)."""
    assert shm.cluster.kube.list("secrets", GROUP_NS) == []
    key = base64.b64decode(shm.get("secrets", "local-shm-key", POOL_NAMESPACE)["data"]["key"])
    for role in ("prefill", "decode"):
        (pod,) = shm.pods(role)
        volume = {v["name"]: v for v in pod["spec"]["volumes"]}["maru-credential"]
        assert volume["csi"]["driver"] == "csi.maru.io" and volume["csi"]["volumeAttributes"]["cache"] == "tiny"
        # The token as the vLLM container sees it (the kubelet's mounts are in its own mount namespace).
        seen = [
            in_container(pid, "/var/run/secrets/maru.io/pool/token")
            for pid in processes_in(shm.cluster.pid_namespaces(pod))
        ]
        (token, *_) = [t for t in seen if t.exists()] or seen
        assert stat.S_IMODE(token.stat().st_mode) == 0o444
        assert tenancy.verify(key, token.read_text()) == tenancy.tenant(f"{GROUP_NS}/tiny")
    minting_file = shm.cluster.node_root(pod["spec"]["nodeName"]) / "run" / "maru" / "_credentials" / "local-shm.json"
    assert stat.S_IMODE(minting_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(minting_file.parent.stat().st_mode) == 0o700
    agent = agent_pod(shm)
    assert "auth=on" in shm.cluster.pod_log(POOL_NAMESPACE, agent["metadata"]["name"], "agent")
    # The socket's host path can exceed a Unix socket path's 107 bytes: reach it through a short link.
    link = Path(tempfile.mkdtemp(prefix="e2e-", dir="/tmp")) / "pool"
    link.symlink_to(shm.cluster.node_root(agent["spec"]["nodeName"]) / "run" / "maru" / "local-shm")
    try:
        stranger_key = tmp_path / "other.key"
        stranger_key.write_bytes(os.urandom(32))
        forged = tmp_path / "forged.token"
        forged.write_text(tenancy.issue(stranger_key.read_bytes(), tenancy.tenant(f"{GROUP_NS}/tiny")))
        for token, code in ((None, "unauthenticated"), (str(forged), "bad_token")):
            with pytest.raises(PoolAuthError, match=code):
                PoolClient(f"unix://{link}/pool.sock", timeout_s=10, token_file=token).lookup_prefix([b"k" * 32])
    finally:
        link.unlink()
        link.parent.rmdir()


def test_the_router_discovers_its_pods_within_its_role(shm: Deployment) -> None:
    # vllm-router lists and watches pods with its ServiceAccount's token: the API server authenticates
    # it and holds it to the Role the operator wrote (pods: get, list, watch in the group's namespace).
    # (A watch is logged with its user when it ends; the list before it is enough to tell who asks.)
    router = f"system:serviceaccount:{GROUP_NS}:tiny-router"
    requests = shm.cluster.kube.requests
    assert any(
        r.user == router and r.status == 200 and r.path == f"/api/v1/namespaces/{GROUP_NS}/pods" for r in requests
    ), [r for r in requests if r.user]
    # Pods are the only clients with tokens: no request of theirs was refused.
    refused = sorted({f"{r.method} {r.path} -> {r.status} ({r.user})" for r in requests if r.status in (401, 403)})
    assert not refused, refused


def test_pool_agent_is_not_the_first_pod_evicted(shm: Deployment) -> None:
    pod = agent_pod(shm)
    assert pod["status"]["qosClass"] != "BestEffort", pod["status"]
    assert pod["spec"]["priorityClassName"] == "system-node-critical"
    assert pod["spec"]["priority"] == 2000001000


def test_answers_equal_a_recompute_engine(shm: Deployment) -> None:
    prefill, decode = shm.engine_url("prefill"), shm.engine_url("decode")
    long_prompt = prompt(2 * CHUNK + 40, seed=11)
    before = from_pool(prefill)
    recomputed = complete(prefill, long_prompt)  # a prompt nobody stored yet: prefill computes all of it
    assert from_pool(prefill) == before
    loaded = from_pool(decode)
    assert complete(shm.router_url, long_prompt) == recomputed
    # Decode took the prompt's two whole chunks from the pool instead of computing them.
    assert wait_for_more(shm, lambda: from_pool(decode), loaded, "decode to load from the pool") - loaded == 2 * CHUNK


def test_exact_multiple_prompt_leaves_decode_alive(shm: Deployment) -> None:
    decode = shm.engine_url("decode")
    exact = prompt(2 * CHUNK, seed=12)
    first = complete(shm.router_url, exact)
    # Every chunk is in the pool now: decode reports a capped hit and computes the last block itself.
    assert complete(shm.router_url, exact) == first
    assert health(decode) == 200
    assert complete(shm.router_url, prompt(100, seed=13))


def test_a_repeated_long_prompt_goes_to_decode_alone_through_the_group_router(shm: Deployment) -> None:
    """The operator's router pod runs maru-router in front of vllm-router: once the pool holds a prompt,
    the prompt skips prefill, decode loads it from the pool, and the answer is the first one."""
    (router,) = shm.pods("router", ready_only=True)
    assert [c["name"] for c in router["spec"]["containers"]] == ["router", "vllm-router"]
    decisions = shm.cluster.pod_url(GROUP_NS, router["metadata"]["name"], 29001)
    prefill, decode = shm.engine_url("prefill"), shm.engine_url("decode")
    long_prompt = prompt(3 * CHUNK + 30, seed=14)
    first = complete(shm.router_url, long_prompt)  # cold: prefill then decode (prefill stores it)

    direct = counter(decisions, "maru_router_requests_total", route="direct", reason="covered")
    prefilled = counter(prefill, "vllm:request_success_total")
    loaded = from_pool(decode)
    assert complete(shm.router_url, long_prompt) == first
    assert counter(decisions, "maru_router_requests_total", route="direct", reason="covered") == direct + 1
    assert counter(prefill, "vllm:request_success_total") == prefilled  # prefill never saw the repeat
    # Decode took the three whole chunks from the pool and computed the tail itself.
    assert wait_for_more(shm, lambda: from_pool(decode), loaded, "decode to load from the pool") - loaded == 3 * CHUNK


def test_the_group_router_reads_what_each_prefill_pod_caches(shm: Deployment) -> None:
    """maru-router takes the pods vllm-router found (its worker list) as its engines and reads each one's KV
    events, which the operator has every engine publish: what a prefill pod's own cache holds beyond the pool
    can then choose its prefill."""
    (router,) = shm.pods("router", ready_only=True)
    decisions = shm.cluster.pod_url(GROUP_NS, router["metadata"]["name"], 29001)
    (pod,) = shm.pods("prefill", ready_only=True)
    as_listed = f"http://{pod['status']['podIP']}:8000"  # the pod as vllm-router lists it, not a door to it
    # The pod announces its key revision (its pod label's) where it says it publishes: once the router shows it,
    # it has asked the pod and subscribes. That revision is what it pairs prefill and decode by in a rollout.
    revision = pod["metadata"]["labels"]["maru.io/kv-revision"]
    wait(
        "the router to learn the prefill pod's key revision",
        lambda: counter(decisions, "maru_router_engine_revision", endpoint=as_listed, revision=revision) == 1,
        shm,
    )
    before = counter(decisions, "maru_router_engine_cached_blocks", endpoint=as_listed)
    seeds = iter(range(150, 10_000))

    def stored_and_seen() -> bool:
        # A store published before the subscription took hold is not seen: store again until one is.
        complete(shm.engine_url("prefill"), prompt(2 * CHUNK + 20, seed=next(seeds)))  # in the pod's own cache
        time.sleep(0.5)
        return counter(decisions, "maru_router_engine_cached_blocks", endpoint=as_listed) > before

    wait("the router to read the prefill pod's KV events", stored_and_seen, shm)


def test_the_group_publishes_what_the_pool_holds_as_vllm_kv_events(shm: Deployment) -> None:
    """The operator's pool events publisher streams the group's pool events in vLLM's own format: a consumer of
    vLLM's KV events (llm-d's indexer, Dynamo's router) decodes them with vLLM's classes."""
    import zmq
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    def publisher_ready() -> dict[str, Any] | None:
        pods = shm.cluster.kube.list(
            "pods", GROUP_NS, labels="app.kubernetes.io/instance=tiny,app.kubernetes.io/component=pool-events"
        )
        ready = [
            p
            for p in pods
            if any(
                c.get("type") == "Ready" and c.get("status") == "True"
                for c in (p.get("status") or {}).get("conditions") or []
            )
        ]
        return ready[0] if ready else None

    pod = wait("the pool events publisher to be ready", publisher_ready, shm)
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(shm.cluster.pod_url(GROUP_NS, pod["metadata"]["name"], 5557, scheme="tcp"))
    seeds = iter(range(500, 10_000))
    stored: list[BlockStored] = []
    sent: list[list[int]] = []

    def a_store_seen() -> bool:
        # Stores made before the subscription took hold are not sent to it: store again until one is seen.
        sent.append(prompt(2 * CHUNK + 9, seed=next(seeds)))
        complete(shm.router_url, sent[-1])
        while sock.poll(1000):
            _topic, _seq, payload = sock.recv_multipart()
            batch = msgspec.msgpack.decode(payload, type=KVEventBatch)
            stored.extend(e for e in batch.events if isinstance(e, BlockStored))
        return any(e.token_ids for e in stored)

    try:
        wait("a BlockStored with token ids from the pool events publisher", a_store_seen, shm)
    finally:
        sock.close(linger=0)
    for event in stored:
        assert event.medium == "MARU_POOL" and event.block_size == CHUNK, event
        assert event.block_hashes and all(isinstance(h, bytes) and len(h) == 16 for h in event.block_hashes)
        # What llm-d's and Dynamo's indexers key blocks by: each chunk's prompt tokens, or none at all.
        assert len(event.token_ids) in (0, CHUNK * len(event.block_hashes)), event
    # The chunks of a prompt sent here come with exactly that prompt's tokens (others may be earlier tests').
    ours = {tuple(p[i : i + CHUNK]) for p in sent for i in range(0, len(p) - CHUNK + 1, CHUNK)}
    tokenized = [
        [tuple(e.token_ids[i : i + CHUNK]) for i in range(0, len(e.token_ids), CHUNK)] for e in stored if e.token_ids
    ]
    assert any(all(c in ours for c in chunks) for chunks in tokenized), (sent, tokenized)


def test_killing_the_pool_agent_restarts_it_while_vllm_answers(shm: Deployment) -> None:
    pod = agent_pod(shm)
    name = pod["metadata"]["name"]
    restarts = pod["status"]["containerStatuses"][0]["restartCount"]
    pid = shm.cluster.container_pid(POOL_NAMESPACE, name, "agent")
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    # The pool is gone for now: the connector turns that into misses, and serving goes on.
    assert complete(shm.router_url, prompt(300, seed=21))

    def restarted() -> bool:
        status = shm.get("pods", name, POOL_NAMESPACE)["status"]["containerStatuses"][0]
        return status["restartCount"] > restarts and status["ready"]

    wait("the kubelet to restart the agent", restarted, shm)
    last = shm.get("pods", name, POOL_NAMESPACE)["status"]["containerStatuses"][0]["lastState"]["terminated"]
    assert last["exitCode"] == 128 + signal.SIGKILL, last
    wait_ready(shm.cluster, "marupools.maru.io", "local-shm")
    # And the pool carries KV again.
    decode = shm.engine_url("decode")
    again = prompt(2 * CHUNK + 7, seed=22)
    loaded = from_pool(decode)
    complete(shm.router_url, again)
    wait_for_more(shm, lambda: from_pool(decode), loaded, "decode to load from the restarted pool")


def test_an_operator_upgrade_moves_the_data_plane_only_when_asked_without_a_failed_request(shm: Deployment) -> None:
    """A newer operator (other default image tag) takes over: every vLLM pod and the pool daemon stay as they
    are. The group's opt-in (maru.io/data-plane-updates=auto), applied in one patch with a new chunk size, rolls
    both roles once, to the new images and the new chunk size, while a client sends requests through the router,
    none of which fails; the new pods then store and load 128-token chunks. (One roll serves both changes: each
    roll starts two engines, the slowest step of these tests.)"""
    before = {role: {p["metadata"]["uid"] for p in shm.pods(role)} for role in ("prefill", "decode")}
    agent = agent_pod(shm)["metadata"]["uid"]
    deployments = {
        d["metadata"]["name"]: d["metadata"]["generation"] for d in shm.cluster.kube.list("deployments.apps", GROUP_NS)
    }
    new_tag = "99.0.0"
    # The newer release's images, as its registry would hold them: the same builds under the new tag (the
    # router image keeps its own version). (Untagged when the module's cluster goes: later tests restart pods
    # of these images.)
    RELEASED.extend(images.retag({"operator", "pool", "vllm"}, new_tag))
    # helm upgrade to the newer release: its operator pod replaces the old one (one at a time: the Lease).
    shm.operator.upgrade("--set", f"images.tag={new_tag}", "--set", "maxRollingGroups=1")
    try:
        upgraded = shm.operator.wait_ready(image_tag=new_tag)
        wait(
            "the upgraded operator to hold the group's data plane",
            lambda: f"InferenceGroup {GROUP_NS}/tiny keeps its data plane" in shm.operator.log(upgraded),
            shm,
        )
        generation = shm.get("inferencegroups.maru.io", "tiny", GROUP_NS)["metadata"]["generation"]
        wait_ready(shm.cluster, "inferencegroups.maru.io", "tiny", GROUP_NS, generation=generation)
        assert {
            d["metadata"]["name"]: d["metadata"]["generation"]
            for d in shm.cluster.kube.list("deployments.apps", GROUP_NS)
        } == deployments
        assert {role: {p["metadata"]["uid"] for p in shm.pods(role)} for role in ("prefill", "decode")} == before
        assert agent_pod(shm)["metadata"]["uid"] == agent

        client = Client(shm.router_url)
        client.start()
        try:
            wait("the client's first answer", lambda: client.answered or client.failures, shm)
            shm.cluster.kubectl(
                "-n",
                GROUP_NS,
                "patch",
                "ig",
                "tiny",
                "--type",
                "merge",
                "-p",
                json.dumps(
                    {
                        "metadata": {"annotations": {"maru.io/data-plane-updates": "auto"}},
                        "spec": {"connector": {"chunkTokens": 128}},
                    }
                ),
            )

            def rolled() -> bool:
                for role in ("prefill", "decode"):
                    pods = shm.cluster.kube.list(
                        "pods", GROUP_NS, labels=f"app.kubernetes.io/instance=tiny,maru.io/role={role}"
                    )
                    ready = shm.pods(role, ready_only=True)
                    if {p["metadata"]["uid"] for p in pods} & before[role] or len(ready) != 1:
                        return False
                    if not ready[0]["spec"]["containers"][0]["image"].endswith(":" + new_tag):
                        return False
                return True

            wait("both roles to roll to the new images", rolled, shm)
            wait_ready(shm.cluster, "inferencegroups.maru.io", "tiny", GROUP_NS, generation=generation + 1)
            answered = client.answered
            wait("an answer from the new pods", lambda: client.answered > answered or client.failures, shm)
        finally:
            client.stop()
        print(f"operator upgrade: {client.answered} requests answered, {len(client.failures)} failed")
        assert client.answered > 0
        assert agent_pod(shm)["metadata"]["uid"] == agent  # the pool was not opted in
        assert not client.failures, (
            f"{len(client.failures)} of {client.answered + len(client.failures)} requests failed while the data "
            f"plane rolled: {client.failures}"
        )
        for role in ("prefill", "decode"):
            (pod,) = shm.pods(role)
            args = pod["spec"]["containers"][0]["args"]
            config = json.loads(args[args.index("--kv-transfer-config") + 1])
            assert config["kv_connector_extra_config"]["maru_kv_chunk_tokens"] == 128
        prefill, decode = shm.engine_url("prefill"), shm.engine_url("decode")
        long_prompt = prompt(3 * 128 + 50, seed=31)
        recomputed = complete(prefill, long_prompt)
        loaded = from_pool(decode)
        assert complete(shm.router_url, long_prompt) == recomputed
        assert (
            wait_for_more(shm, lambda: from_pool(decode), loaded, "decode to load 128-token chunks") - loaded == 3 * 128
        )
    finally:
        # The tests after this one run under the release they started with (helm rollback): it keeps the new
        # images (they run, and its data plane updates are manual).
        shm.operator.rollback()
        shm.operator.wait_ready(image_tag=__version__)


def test_an_autoscaled_role_drops_a_field_recreates_and_comes_back_after_revoked_access(shm: Deployment) -> None:
    """decode handed to an HPA (scaler: External): a pod annotation set then dropped is gone from its Deployment,
    a switch to Recreate leaves a strategy the API server takes, and after the pool's access is revoked (0 pods)
    and restored its replicas come back, although the HPA leaves a target at 0 alone (ScalingDisabled)."""

    def patch_group(spec: dict[str, Any]) -> None:
        shm.cluster.kubectl("-n", GROUP_NS, "patch", "ig", "tiny", "--type", "merge", "-p", json.dumps({"spec": spec}))

    def decode() -> dict[str, Any]:
        return shm.get("deployments.apps", "tiny-decode", GROUP_NS)

    def annotations() -> dict[str, str]:
        return decode()["spec"]["template"]["metadata"].get("annotations") or {}

    # A short grace and no drain (no preStop hook: nothing sends to decode while this test replaces it): Recreate
    # and the revocation wait for the old pods to be gone.
    patch_group(
        {
            "decode": {
                "scaler": "External",
                "podAnnotations": {"e2e.maru.io/extra": "1"},
                "termination": {"gracePeriodSeconds": 30, "drainSeconds": 0},
            }
        }
    )
    wait("decode's template to carry the annotation", lambda: "e2e.maru.io/extra" in annotations(), shm)
    shm.cluster.kubectl(
        "apply",
        "-f",
        "-",
        input=json.dumps(
            {
                "apiVersion": "autoscaling/v2",
                "kind": "HorizontalPodAutoscaler",
                "metadata": {"name": "tiny-decode", "namespace": GROUP_NS},
                "spec": {
                    "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "tiny-decode"},
                    "minReplicas": 1,
                    "maxReplicas": 1,
                },
            }
        ),
    )
    generation = shm.get("inferencegroups.maru.io", "tiny", GROUP_NS)["metadata"]["generation"]
    patch_group({"decode": {"podAnnotations": None, "strategy": {"type": "Recreate"}}})
    wait("decode to switch to Recreate", lambda: decode()["spec"]["strategy"]["type"] == "Recreate", shm)
    wait_ready(shm.cluster, "inferencegroups.maru.io", "tiny", GROUP_NS, generation=generation + 1)
    assert decode()["spec"]["strategy"] == {"type": "Recreate"}
    assert "lifecycle" not in decode()["spec"]["template"]["spec"]["containers"][0]  # drainSeconds 0: no hook
    assert "e2e.maru.io/extra" not in annotations()
    assert "maru.io/created-fields" not in (decode()["metadata"].get("annotations") or {})

    shm.cluster.kubectl(
        "-n",
        POOL_NAMESPACE,
        "patch",
        "mpool",
        "local-shm",
        "--type",
        "merge",
        "-p",
        json.dumps({"spec": {"allowedNamespaces": ["elsewhere"]}}),
    )
    wait("decode to be scaled to 0", lambda: decode()["spec"]["replicas"] == 0 and not shm.pods("decode"), shm)
    wait(
        "the autoscaler to stand aside",
        lambda: any(
            c.get("reason") == "ScalingDisabled"
            for c in (shm.get("horizontalpodautoscalers.autoscaling", "tiny-decode", GROUP_NS).get("status") or {}).get(
                "conditions"
            )
            or []
        ),
        shm,
    )
    shm.cluster.kubectl(
        "-n",
        POOL_NAMESPACE,
        "patch",
        "mpool",
        "local-shm",
        "--type",
        "merge",
        "-p",
        json.dumps({"spec": {"allowedNamespaces": None}}),
    )
    wait("decode's replicas to come back", lambda: decode()["spec"]["replicas"] == 1, shm)
    group = wait_ready(shm.cluster, "inferencegroups.maru.io", "tiny", GROUP_NS)
    assert not any(c["type"] == "Degraded" and c["reason"] == "ChildRefused" for c in group["status"]["conditions"])
    # The group's Ready can be read a moment before the pods list shows decode's new pod ready (seen once in CI).
    wait("decode's pod to be ready again", lambda: len(shm.pods("decode", ready_only=True)) == 1, shm)
    assert complete(shm.router_url, prompt(40, seed=7))


class Client(threading.Thread):
    """Requests through the group's router, one after another, until stopped; counts answers and failures."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.answered, self.failures = url, 0, []
        self._stop_flag = threading.Event()

    def run(self) -> None:
        for seed in itertools.count(100):
            if self._stop_flag.is_set():
                return
            try:
                complete(self.url, prompt(40 + seed % 200, seed=seed))
                self.answered += 1
            except (AssertionError, OSError) as err:
                self.failures.append(f"request {seed} at {time.strftime('%H:%M:%S')}: {type(err).__name__}: {err}")

    def stop(self) -> None:
        self._stop_flag.set()
        self.join(TIMEOUT_S + 10)


def test_deleting_the_group_stops_its_processes(shm: Deployment) -> None:
    pods = shm.cluster.kube.list("pods", GROUP_NS, labels="app.kubernetes.io/instance=tiny")
    spaces = set().union(*(shm.cluster.pid_namespaces(p) for p in pods))
    assert processes_in(spaces), "the group's containers should be running before the deletion"
    shm.cluster.kubectl("-n", GROUP_NS, "delete", "ig", "tiny", "--timeout=120s")
    wait(
        "the group's pods to go",
        lambda: not shm.cluster.kube.list("pods", GROUP_NS, labels="app.kubernetes.io/instance=tiny"),
        shm,
    )
    assert processes_in(spaces) == []
    assert not shm.cluster.kube.list("deployments.apps", GROUP_NS)
    # The pool is still there, and no longer held by the group.
    wait(
        "the pool to be released", lambda: shm.get("marupools.maru.io", "local-shm")["status"]["boundGroups"] == 0, shm
    )
