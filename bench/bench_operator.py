"""Operator at scale, and under steady traffic, against the Kubernetes API emulator.

The operator runs as a real subprocess (``python -m maru_operator run``) against the emulator over
HTTP on loopback, with the simulated Deployment/DaemonSet controllers writing status.

* Scale: 200 and 1,000 InferenceGroups (``--groups``) and one pool, each size with a fresh emulator
  and operator. Measures the time from the first create until every group has all its children and a
  Ready status, the operator's CPU time and peak RSS (VmHWM of the process), the emulator's CPU time
  (it runs in this process, on the same cores), the API requests by verb, and the writes made once
  converged (must be zero). Targets on a 2-core machine: 200 groups in <= 10 s, 1,000 in <= 60 s, peak
  RSS <= 200 MB. Saved under "operator", by size.
* Steady traffic: one pool whose daemon reports a different memory use on every look (in-flight
  leases under traffic), against the same pool with constant use (the baseline, same process).
  Measures pool status writes, pod lists and daemon polls per second. Target: status writes at most
  one per ``--pool-usage-interval`` (default 30 s), plus the first use seen. Saved under
  "operator_steady_traffic".
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from results import merge_results  # noqa: E402

from maru_localcluster.apiserver import StoreKey  # noqa: E402
from maru_localcluster.server import KubeEmulator, running_emulator  # noqa: E402
from maru_localcluster.simcontrollers import KubeControllers  # noqa: E402
from maru_operator.cli import tune_gc  # noqa: E402

# Converge time targets by number of groups (others: 60 s per 1,000 groups, at least 10 s).
TARGET_SECONDS = {200: 10.0, 1000: 60.0}
TARGET_RSS_MB = 200.0
# A size that has not converged this long after its creates is reported as not converged.
CONVERGE_DEADLINE = 600.0
NS = "bench"
POOL_NS = "maru-system"
# Resource types, as the emulator keys them (group, plural).
DEPLOYMENTS, DAEMONSETS = ("apps", "deployments"), ("apps", "daemonsets")
SERVICES, NODES = ("", "services"), ("", "nodes")


class FastControllers(KubeControllers):
    """The simulated controllers, looking only at what changed since their last pass.

    The stock pass recomputes every Deployment and every Service's endpoints on every change, and finds a
    Service's Deployments by scanning all of them: O(objects x changes), which at thousands of objects
    would dominate what this benchmark means to measure, the operator. Here the changes are read from the
    emulator's change log and selectors are answered from label indexes, so a pass costs what changed.
    Status is still written through the emulator, so the operator sees ordinary watch events; everything
    is looked at again when the log no longer reaches back to the last pass or a node changed.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rv = 0  # the newest change looked at
        # Deployments by their pod template's labels, Services by one of their selector's labels (the rarest
        # when they were seen): a selector's matches are found without scanning every object.
        self._labels: dict[StoreKey, dict[str, str]] = {}
        self._by_label: dict[tuple[str, str, str], set[StoreKey]] = collections.defaultdict(set)
        self._selectors: dict[StoreKey, tuple[dict[str, str], tuple[str, str, str]]] = {}
        self._svc_by_label: dict[tuple[str, str, str], set[StoreKey]] = collections.defaultdict(set)
        self._label_uses: collections.Counter[tuple[str, str, str]] = collections.Counter()

    def _changes(self, emulator: Any) -> dict[tuple[str, str], set[StoreKey]] | None:
        """The keys changed since the last pass, by resource type; None when all must be looked at."""
        if self._rv == 0 or emulator._log_floor > self._rv:
            self._rv = emulator._rv
            return None
        changed: dict[tuple[str, str], set[StoreKey]] = collections.defaultdict(set)
        for event in reversed(emulator._log):
            if event.rv <= self._rv:
                break
            meta = event.obj["metadata"]
            changed[event.rt_key].add((*event.rt_key, meta.get("namespace"), meta["name"]))
        self._rv = emulator._rv
        return changed

    def reconcile(self, emulator: Any) -> None:
        changes = self._changes(emulator)
        store = emulator._store
        if changes is None:
            changes = {rt: set(store.of_type(rt)) for rt in (DEPLOYMENTS, DAEMONSETS, SERVICES)}
        elif changes.get(NODES):
            changes[DAEMONSETS] = set(store.of_type(DAEMONSETS))  # where they run, how many are ready
        services: set[StoreKey] = set(changes.get(SERVICES, ()))
        for key in changes.get(DEPLOYMENTS, ()):
            services |= self._services_of(key)  # as the Deployment was
            obj = store.get(key)
            self._index_deployment(key, obj)
            if obj is None:
                continue
            services |= self._services_of(key)  # as it is
            self._write(emulator, "deployments", obj, self._deployment_status(obj))
        if changes.get(DAEMONSETS):
            nodes = [
                n
                for n in emulator._iter(emulator.resource_type("", "nodes"), None)
                if not n["metadata"].get("deletionTimestamp")
            ]
            for key in changes[DAEMONSETS]:
                if (obj := store.get(key)) is not None:
                    self._write(emulator, "daemonsets", obj, self._daemonset_status(obj, nodes))
        for key in sorted(services, key=str):
            svc = store.get(key)
            self._index_service(key, svc)
            if svc is not None:
                self.sync_endpoint_slice(emulator, svc)

    def _index_deployment(self, key: StoreKey, obj: dict[str, Any] | None) -> None:
        for k, v in self._labels.pop(key, {}).items():
            self._by_label[(key[2] or "", k, v)].discard(key)
        if obj is not None:
            labels = dict(((obj.get("spec") or {}).get("template") or {}).get("metadata", {}).get("labels") or {})
            self._labels[key] = labels
            for k, v in labels.items():
                self._by_label[(key[2] or "", k, v)].add(key)

    def _index_service(self, key: StoreKey, svc: dict[str, Any] | None) -> None:
        old = self._selectors.pop(key, None)
        if old is not None:
            self._svc_by_label[old[1]].discard(key)
            for k, v in old[0].items():
                self._label_uses[(key[2] or "", k, v)] -= 1
        selector = dict(((svc or {}).get("spec") or {}).get("selector") or {})
        if svc is None or not selector:
            return
        pairs = [(key[2] or "", k, v) for k, v in sorted(selector.items())]
        for pair in pairs:
            self._label_uses[pair] += 1
        rarest = min(pairs, key=lambda p: self._label_uses[p])
        self._selectors[key] = (selector, rarest)
        self._svc_by_label[rarest].add(key)

    def _services_of(self, deployment: StoreKey) -> set[StoreKey]:
        """The Services whose selector the Deployment's pod template labels match."""
        labels = self._labels.get(deployment) or {}
        ns = deployment[2] or ""
        found = set()
        for k, v in labels.items():
            for svc in self._svc_by_label.get((ns, k, v), ()):
                if self._selectors[svc][0].items() <= labels.items():
                    found.add(svc)
        return found

    def _members(self, emulator: Any, svc: dict[str, Any]) -> list[bool]:
        selector = (svc.get("spec") or {}).get("selector") or {}
        ns = svc["metadata"]["namespace"]
        pairs = [(ns, k, v) for k, v in selector.items()]
        candidates = min((self._by_label.get(p, set()) for p in pairs), key=len) if pairs else set()
        members: list[bool] = []
        for key in sorted(candidates):
            if selector.items() <= self._labels[key].items():
                status = emulator._store[key].get("status") or {}
                ready = int(status.get("readyReplicas") or 0)
                members += [i < ready for i in range(int(status.get("replicas") or 0))]
        return members


class Convergence:
    """Whether every group is Ready and has its Deployments, looking only at what changed since the last look.

    Runs on the emulator's loop (its CPU time is counted as the emulator's): counting the whole store ten
    times a second was over a tenth of that time at 1,000 groups. The changes are read from the emulator's
    change log; the store is counted whole only when the log no longer reaches back to the last look.
    """

    def __init__(self, groups: int) -> None:
        self.groups = groups
        self._rv = 0  # the newest change looked at
        self._ready: set[str] = set()
        self._deployments: set[str] = set()

    def converged(self, emulator: Any) -> bool:
        # Ready includes the router Service's endpoints; the role Services vary with the spec.
        if self._rv == 0 or emulator._log_floor > self._rv:
            self._ready = {
                o["metadata"]["name"] for o in self._objects(emulator, "maru.io", "inferencegroups") if is_ready(o)
            }
            self._deployments = {o["metadata"]["name"] for o in self._objects(emulator, "apps", "deployments")}
        else:
            news = []
            for event in reversed(emulator._log):
                if event.rv <= self._rv:
                    break
                news.append(event)
            for event in reversed(news):
                if event.obj["metadata"].get("namespace") != NS:
                    continue
                name = event.obj["metadata"]["name"]
                gone = event.type == "DELETED"
                if event.rt_key == ("maru.io", "inferencegroups"):
                    (self._ready.add if is_ready(event.obj) and not gone else self._ready.discard)(name)
                elif event.rt_key == DEPLOYMENTS:
                    (self._deployments.discard if gone else self._deployments.add)(name)
        self._rv = emulator._rv
        return len(self._ready) == self.groups and len(self._deployments) == 3 * self.groups

    @staticmethod
    def _objects(emulator: Any, group: str, plural: str) -> Any:
        # Read in place: listing (deep copies) would cost more than everything the operator does.
        return emulator._iter(emulator.resource_type(group, plural), NS)


def rss_kb(pid: int, field: str) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc/<pid>/stat."""
    import os

    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def is_ready(obj: dict[str, Any]) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (obj.get("status") or {}).get("conditions") or []
    )


def group(i: int) -> dict[str, Any]:
    return {
        "apiVersion": "maru.io/v1alpha1",
        "kind": "InferenceGroup",
        "metadata": {"name": f"model-{i:03d}", "namespace": NS},
        "spec": {
            "model": {"name": f"org/model-{i}"},
            "poolRef": {"name": "bench-pool"},
            "prefill": {"replicas": 1},
            "decode": {"replicas": 2},
        },
    }


def setup(kube: KubeEmulator, controllers: KubeControllers) -> None:
    import yaml

    for path in sorted((ROOT / "crds").glob("*.yaml")):
        kube.create(yaml.safe_load(path.read_text()))
    for ns in (NS, POOL_NS):
        kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    for n in range(4):
        controllers.add_node(f"node-{n}", {"maru.io/pool": "yes"})


def operator_command(profile: pathlib.Path | None, tag: str) -> list[str]:
    """``python -m maru_operator``, under cProfile when ``profile`` names a folder (one file per run)."""
    if profile is None:
        return [sys.executable, "-m", "maru_operator"]
    profile.mkdir(parents=True, exist_ok=True)
    return [sys.executable, "-m", "cProfile", "-o", str(profile / f"operator-{tag}.prof"), "-m", "maru_operator"]


def run(groups: int, workers: int, profile: pathlib.Path | None = None) -> dict[str, Any]:
    with (
        tempfile.TemporaryDirectory() as tmp,
        running_emulator(pathlib.Path(tmp)) as kube,
        FastControllers(kube) as controllers,
    ):
        setup(kube, controllers)
        log_path = pathlib.Path(tmp) / "operator.log"
        log = open(log_path, "w")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(
            [
                *operator_command(profile, f"{groups}"),
                "run",
                "--pool-namespace",
                POOL_NS,
                "--liveness",
                "",
                "--metrics-port",
                "0",
                "--workers",
                str(workers),
            ],
            env=kube.env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        peak = {"rss": 0}
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.2):
                try:
                    peak["rss"] = max(peak["rss"], rss_kb(proc.pid, "VmRSS"))
                except OSError:
                    return

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            kube.create(
                {
                    "apiVersion": "maru.io/v1alpha1",
                    "kind": "MaruPool",
                    "metadata": {"name": "bench-pool"},
                    "spec": {"backend": "shm", "size": "8Gi", "nodeSelector": {"maru.io/pool": "yes"}},
                }
            )
            kube.wait_for("marupools.maru.io", "bench-pool", None, is_ready, timeout=60)
            mark = kube.mark()
            cpu_before, emulator_before = cpu_seconds(proc.pid), cpu_seconds(os.getpid())
            started = time.monotonic()
            for i in range(groups):
                kube.create(group(i))
            created = time.monotonic() - started

            progress = Convergence(groups)
            deadline, done = time.monotonic() + CONVERGE_DEADLINE, True
            while not kube.call(progress.converged, kube.emulator):
                if proc.poll() is not None:
                    raise RuntimeError("the operator exited")
                if time.monotonic() > deadline:
                    done = False  # reported as such, with what it had done by then
                    break
                time.sleep(0.1)
            elapsed = time.monotonic() - started
            operator_cpu = cpu_seconds(proc.pid) - cpu_before
            emulator_cpu = cpu_seconds(os.getpid()) - emulator_before
            requests = kube.requests_since(mark)
            # Converged: let it run through a resync-free quiet spell; nothing may be written (but the
            # leader Lease's renewals).
            time.sleep(3.0)
            idle_mark = kube.mark()
            time.sleep(3.0)
            idle_writes = len([r for r in kube.writes_since(idle_mark) if "/leases" not in r.path])
            peak_hwm = rss_kb(proc.pid, "VmHWM")
        except BaseException:
            log.flush()
            print(log_path.read_text()[-5000:], file=sys.stderr)
            raise
        finally:
            stop.set()
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()
            if profile is not None:
                shutil.copy(log_path, profile / f"operator-{groups}.log")
    counts = collections.Counter(r.method for r in requests if not r.is_watch)
    target = target_seconds(groups)
    rss_mb = max(peak_hwm, peak["rss"]) / 1024
    return {
        "groups": groups,
        "workers": workers,
        "create_seconds": round(created, 2),
        "converged": done,
        "converge_seconds": round(elapsed, 2) if done else None,
        "operator_cpu_seconds": round(operator_cpu, 2),
        "emulator_cpu_seconds": round(emulator_cpu, 2),
        "peak_rss_mb": round(rss_mb, 1),
        "api_requests": sum(counts.values()),
        "api_requests_by_method": dict(sorted(counts.items())),
        "writes_per_group": round(sum(v for k, v in counts.items() if k != "GET") / groups, 2),
        "idle_writes": idle_writes,
        "target_seconds": target,
        "target_rss_mb": TARGET_RSS_MB,
        "meets_targets": done and elapsed <= target and rss_mb <= TARGET_RSS_MB and idle_writes == 0,
    }


def target_seconds(groups: int) -> float:
    return TARGET_SECONDS.get(groups, max(10.0, 60.0 * groups / 1000))


class DaemonStub:
    """A pool daemon's /status on loopback: constant use, or different use on every request (traffic)."""

    def __init__(self, changing: bool) -> None:
        import http.server

        stub = self
        self.polls = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                stub.polls += 1
                used = 4096 * stub.polls if changing else 1 << 20
                body = json.dumps({"capacity_bytes": 8 << 30, "used_bytes": used}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def traffic_run(changing: bool, seconds: float, interval: float) -> dict[str, Any]:
    """One pool, its daemon answering on loopback; status writes, pod lists and daemon polls per second."""
    daemon = DaemonStub(changing)
    with (
        tempfile.TemporaryDirectory() as tmp,
        running_emulator(pathlib.Path(tmp)) as kube,
        FastControllers(kube) as controllers,
    ):
        setup(kube, controllers)
        log_path = pathlib.Path(tmp) / "operator.log"
        log = open(log_path, "w")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "maru_operator",
                "run",
                "--pool-namespace",
                POOL_NS,
                "--liveness",
                "",
                "--metrics-port",
                "0",
                "--pool-usage-interval",
                str(interval),
            ],
            env=kube.env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        try:
            kube.create(
                {
                    "apiVersion": "maru.io/v1alpha1",
                    "kind": "MaruPool",
                    "metadata": {"name": "bench-pool"},
                    "spec": {
                        "backend": "shm",
                        "size": "8Gi",
                        "nodeSelector": {"maru.io/pool": "yes"},
                        "daemon": {"metricsPort": daemon.port},
                    },
                }
            )
            ds = kube.wait_for("daemonsets.apps", "bench-pool-agent", POOL_NS, timeout=60)
            # The agent pod as the DaemonSet controller and kubelet leave it, reachable on loopback.
            labels = ds["spec"]["template"]["metadata"]["labels"]
            kube.create(
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": "bench-pool-agent-0", "namespace": POOL_NS, "labels": labels},
                    "spec": {"nodeName": "node-0", "containers": [{"name": "agent", "image": "x"}]},
                }
            )
            kube.patch_status(
                "pods",
                "bench-pool-agent-0",
                {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
                POOL_NS,
            )
            # The first use reaches status when the pool is next looked at (at the latest after one interval).
            kube.wait_for(
                "marupools.maru.io",
                "bench-pool",
                None,
                lambda o: is_ready(o) and o.get("status", {}).get("used"),
                timeout=interval + 30,
            )
            mark, polls = kube.mark(), daemon.polls
            time.sleep(seconds)
            requests = kube.requests_since(mark)
            polls = daemon.polls - polls
        except BaseException:
            log.flush()
            print(log_path.read_text()[-5000:], file=sys.stderr)
            raise
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()
            daemon.close()
    writes = sum(1 for r in requests if r.method == "PATCH" and r.path.endswith("/marupools/bench-pool/status"))
    lists = sum(1 for r in requests if r.method == "GET" and r.path.endswith("/pods") and not r.is_watch)
    return {
        "seconds": seconds,
        "status_writes": writes,
        "status_writes_per_second": round(writes / seconds, 3),
        "pod_lists_per_second": round(lists / seconds, 3),
        "daemon_polls_per_second": round(polls / seconds, 3),
    }


def steady_traffic(seconds: float, interval: float) -> dict[str, Any]:
    traffic = traffic_run(True, seconds, interval)
    baseline = traffic_run(False, seconds, interval)
    allowed = int(seconds // interval) + 1
    return {
        "pool_usage_interval_seconds": interval,
        "changing_usage": traffic,
        "constant_usage_baseline": baseline,
        "bound_status_writes": allowed,
        "meets_targets": traffic["status_writes"] <= allowed,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", default="200,1000", help="sizes to converge, comma-separated (each its own run)")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--traffic-seconds", type=float, default=40.0, help="length of the steady-traffic window")
    parser.add_argument("--pool-usage-interval", type=float, default=30.0)
    parser.add_argument("--no-save", action="store_true", help="print only, do not touch bench/results.json")
    parser.add_argument("--no-traffic", action="store_true", help="skip the steady-traffic part")
    parser.add_argument(
        "--profile",
        type=pathlib.Path,
        default=None,
        help="run the operator under cProfile, its profiles and logs into this folder",
    )
    args = parser.parse_args()
    sizes = [int(n) for n in args.groups.split(",") if n.strip()]
    # The emulator stands in for kube-apiserver (Go) in this process; its store is tens of thousands of dicts the
    # collector would walk over and over, a cost no real API server has. The operator tunes its own (maru-operator
    # run does); this process gets the same, so the emulator's CPU time measures the requests it serves.
    tune_gc()
    traffic_ok = args.no_traffic or steady_traffic_report(args)
    results = {str(n): run(n, args.workers, args.profile) for n in sizes}
    rows = [
        ("converge (all Ready, all children)", "converge_seconds", "s"),
        ("  target", "target_seconds", "s"),
        ("operator CPU time while converging", "operator_cpu_seconds", "s"),
        ("emulator CPU time (this process)", "emulator_cpu_seconds", "s"),
        ("operator peak RSS", "peak_rss_mb", "MB"),
        ("API requests (non-watch)", "api_requests", ""),
        ("writes per group", "writes_per_group", ""),
        ("writes once converged (3 s)", "idle_writes", ""),
        ("meets targets", "meets_targets", ""),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"{'InferenceGroups':<{width}}" + "".join(f"{n:>14}" for n in results))
    for label, key, unit in rows:
        cells = (f"{r[key]} {unit}".rstrip() for r in results.values())
        print(f"{label:<{width}}" + "".join(f"{c:>14}" for c in cells))
    for n, r in results.items():
        print(f"{n} groups, requests by verb: {json.dumps(r['api_requests_by_method'])}")
    met = all(r["meets_targets"] for r in results.values())
    if not args.no_save:
        merge_results("operator", {"sizes": results, "target_rss_mb": TARGET_RSS_MB, "meets_targets": met})
    return 0 if met and traffic_ok else 1


def steady_traffic_report(args: argparse.Namespace) -> bool:
    traffic = steady_traffic(args.traffic_seconds, args.pool_usage_interval)
    changing, constant = traffic["changing_usage"], traffic["constant_usage_baseline"]
    print(f"steady traffic, {args.traffic_seconds:.0f} s, --pool-usage-interval {args.pool_usage_interval:.0f}:")
    print(f"{'':<26}{'changing use':>14}{'constant use':>14}")
    for label, field in (
        ("pool status writes/s", "status_writes_per_second"),
        ("pod lists/s", "pod_lists_per_second"),
        ("daemon polls/s", "daemon_polls_per_second"),
    ):
        print(f"{label:<26}{changing[field]:>14}{constant[field]:>14}")
    print(
        f"status writes {changing['status_writes']} (bound {traffic['bound_status_writes']}); "
        f"meets target: {traffic['meets_targets']}\n"
    )
    if not args.no_save:
        merge_results("operator_steady_traffic", traffic)
    return bool(traffic["meets_targets"])


if __name__ == "__main__":
    sys.exit(main())
