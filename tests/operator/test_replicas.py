"""Several operators at once, as real processes: replicas elect one leader; installations never share objects."""

from __future__ import annotations

import pathlib
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from maru_localcluster.apiserver import Fault
from maru_localcluster.server import KubeEmulator
from tests.support.operator import (
    GROUP_NS,
    POOL_NS,
    ROOT,
    bind_documented_rbac,
    create_namespace,
    group,
    has_condition,
    object_writes,
    pool,
)

pytestmark = pytest.mark.emulator

IG = "inferencegroups.maru.io"
DS = "daemonsets.apps"
DEPLOY = "deployments.apps"
LEASE_NS = "default"  # the Lease of an instance, for every release
# Short, so a test sees expiry and takeover in seconds (the defaults are 15/10/2), with 4 s between a
# stuck leader's renew deadline and its Lease's expiry: the step-down must reach the API server before
# the standby's takeover, and 1 s of margin was too little for a process starved on a loaded machine.
FAST_LEASE = ("--lease-seconds", "6", "--renew-deadline", "2", "--retry-period", "0.3")


class Processes:
    def __init__(self, kube: KubeEmulator, tmp: pathlib.Path) -> None:
        self.kube, self.tmp = kube, tmp
        self.running: dict[str, tuple[subprocess.Popen[bytes], pathlib.Path]] = {}

    def start(self, name: str, *args: str, token: str | None = None) -> None:
        env = self.kube.env()
        if token:
            env["KUBECONFIG"] = str(self.kube.kubeconfig_for(token, self.tmp / f"{name}.kubeconfig"))
        log = self.tmp / f"{name}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "maru_operator", "run", "--liveness", "", "--metrics-port", "0", *args],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        self.running[name] = (proc, log)

    def stop(self, name: str, sig: int = signal.SIGTERM) -> None:
        proc, _ = self.running[name]
        if proc.poll() is None:
            proc.send_signal(sig)
            proc.wait(30)

    def log(self, name: str) -> str:
        return self.running[name][1].read_text()

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{log.read_text()[-3000:]}" for n, (_, log) in self.running.items())

    def identity(self, name: str, timeout: float = 60.0) -> str:
        """The replica's identity in the Lease, once its log names it (a loaded machine starts one late)."""
        deadline = time.monotonic() + timeout
        while (found := re.search(r"identity (\S+)", self.log(name))) is None:
            assert time.monotonic() < deadline, self.logs()
            time.sleep(0.1)
        return found.group(1)


@pytest.fixture
def processes(cluster: KubeEmulator, tmp_path: pathlib.Path) -> Iterator[Processes]:
    procs = Processes(cluster, tmp_path)
    try:
        yield procs
    finally:
        for name in list(procs.running):
            procs.stop(name)


def writers(kube: KubeEmulator, mark: int) -> set[str | None]:
    return {r.user for r in object_writes(kube, mark)}


def test_replicas_elect_one_leader_and_hand_over(cluster: KubeEmulator, processes: Processes) -> None:
    accounts = {r: f"system:serviceaccount:{POOL_NS}:operator-{r}" for r in "ab"}
    for replica in accounts:
        token = bind_documented_rbac(cluster, account=f"operator-{replica}")
        processes.start(replica, "--pool-namespace", POOL_NS, *FAST_LEASE, token=token)
    try:
        cluster.create(pool())
        cluster.create(group())
        cluster.wait_for(IG, "qwen", GROUP_NS, lambda o: has_condition(o, "Ready", "True"), timeout=60)
        lease = cluster.wait_for("leases.coordination.k8s.io", "maru-operator", LEASE_NS)
        time.sleep(1.0)  # the last status writes land
        active = writers(cluster, 0) - {None}
        assert len(active) == 1, f"both replicas reconciled: {active}"
        (leader,) = [r for r, user in accounts.items() if user in active]
        standby = "b" if leader == "a" else "a"

        # The leader stops (a rolling update, a drain): it gives the Lease up, the standby takes over.
        processes.stop(leader)
        cluster.wait_for(
            "leases.coordination.k8s.io",
            "maru-operator",
            LEASE_NS,
            lambda o: o["spec"].get("holderIdentity") not in (None, lease["spec"]["holderIdentity"]),
            timeout=10,
        )
        mark = cluster.mark()
        cluster.patch(IG, "qwen", {"spec": {"decode": {"replicas": 1}}}, GROUP_NS)
        cluster.wait_for(DEPLOY, "qwen-decode", GROUP_NS, lambda d: d["spec"]["replicas"] == 1, timeout=30)
        assert writers(cluster, mark) - {None} == {accounts[standby]}
        handed = cluster.get("leases.coordination.k8s.io", "maru-operator", LEASE_NS)
        assert handed is not None and handed["spec"]["leaseTransitions"] >= 1
    except AssertionError:
        raise AssertionError(processes.logs()) from None


def test_a_leader_stuck_in_a_renewal_steps_down_before_a_standby_takes_over(
    cluster: KubeEmulator, processes: Processes
) -> None:
    """Each renewal is bounded by the renew deadline: a leader whose renewal hangs stops reconciling in time."""
    accounts = {r: f"system:serviceaccount:{POOL_NS}:operator-{r}" for r in "ab"}
    for replica in accounts:
        token = bind_documented_rbac(cluster, account=f"operator-{replica}")
        processes.start(replica, "--pool-namespace", POOL_NS, *FAST_LEASE, token=token)
    try:
        cluster.create(pool())
        cluster.create(group())
        cluster.wait_for(IG, "qwen", GROUP_NS, lambda o: has_condition(o, "Ready", "True"), timeout=60)
        replica_of = {processes.identity(r): r for r in accounts}

        def stepped_down(emulator: Any) -> list[dict[str, Any]]:
            return [
                e
                for e in emulator.list_objects("", "events", LEASE_NS)
                if e.get("reason") == "LeaderElection"
                and e["involvedObject"]["name"] == "maru-operator"
                and "stopped leading" in e["message"]
            ]

        at_takeover: list[bool] = []

        def hang_the_leader(emulator: Any) -> tuple[dict[str, Any], str, Fault]:
            """On the API server's loop, so the leader cannot change between the look and the faults."""
            lease = emulator.get_object("coordination.k8s.io", "leases", LEASE_NS, "maru-operator")
            leader = replica_of[lease["spec"]["holderIdentity"]]
            standby = "b" if leader == "a" else "a"
            path = re.compile(r"/leases/maru-operator$")
            before = len(stepped_down(emulator))  # under load, leadership may have moved during start-up
            # What the API server holds when the standby first writes the Lease (to take it over)...
            emulator.faults.append(
                Fault(
                    methods=frozenset({"PATCH"}),
                    path=path,
                    status=None,
                    times=10_000,
                    user=accounts[standby],
                    action=lambda: at_takeover.append(len(stepped_down(emulator)) > before),
                )
            )
            # ... once the leader's renewals hang: the server takes them and never answers.
            hung = Fault(
                methods=frozenset({"PATCH"}), path=path, status=None, times=10_000, delay=3600, user=accounts[leader]
            )
            emulator.faults.append(hung)
            return lease, standby, hung

        first, standby, hung = cluster.call(hang_the_leader, cluster.emulator)
        taken = cluster.wait_for(
            "leases.coordination.k8s.io",
            "maru-operator",
            LEASE_NS,
            lambda o: o["spec"].get("holderIdentity") not in (None, first["spec"]["holderIdentity"]),
            timeout=60,
        )
        assert cluster.call(lambda: hung.hits) >= 1
        assert at_takeover and at_takeover[0], "the standby took the Lease over while the leader still led"
        assert any(
            e["type"] == "Normal" and e["message"] == f"{first['spec']['holderIdentity']} stopped leading"
            for e in cluster.call(stepped_down, cluster.emulator)
        )

        # Only the new leader acts on a change now.
        mark = cluster.mark()
        cluster.patch(IG, "qwen", {"spec": {"decode": {"replicas": 1}}}, GROUP_NS)
        cluster.wait_for(DEPLOY, "qwen-decode", GROUP_NS, lambda d: d["spec"]["replicas"] == 1, timeout=30)
        assert writers(cluster, mark) - {None} == {accounts[standby]}
        assert taken["spec"]["leaseTransitions"] >= 1
    except AssertionError:
        raise AssertionError(processes.logs()) from None


def test_a_leader_that_dies_is_replaced_after_its_lease_expires(cluster: KubeEmulator, processes: Processes) -> None:
    processes.start("a", "--pool-namespace", POOL_NS, *FAST_LEASE)
    cluster.create(pool())
    lease = cluster.wait_for(
        "leases.coordination.k8s.io", "maru-operator", LEASE_NS, lambda o: o["spec"].get("holderIdentity"), timeout=30
    )
    processes.start("b", "--pool-namespace", POOL_NS, *FAST_LEASE)
    processes.stop("a", signal.SIGKILL)  # no chance to give the Lease up
    taken = cluster.wait_for(
        "leases.coordination.k8s.io",
        "maru-operator",
        LEASE_NS,
        lambda o: o["spec"].get("holderIdentity") != lease["spec"]["holderIdentity"],
        timeout=30,
    )
    assert taken["spec"]["leaseTransitions"] == 1
    cluster.create(group())
    cluster.wait_for(IG, "qwen", GROUP_NS, lambda o: has_condition(o, "Ready", "True"), timeout=30)


def test_two_installations_never_reconcile_the_same_objects(cluster: KubeEmulator, processes: Processes) -> None:
    """A default release and one with --instance team-b, each with its own namespace for pool daemons."""
    create_namespace(cluster, "team-b-system")
    create_namespace(cluster, "team-b")
    processes.start("default", "--pool-namespace", POOL_NS, *FAST_LEASE)
    processes.start("team-b", "--pool-namespace", "team-b-system", "--instance", "team-b", *FAST_LEASE)
    labelled = {"maru.io/operator-instance": "team-b"}
    pool_b = pool("pool-b")
    pool_b["metadata"]["labels"] = labelled
    group_b = group("qwen-b", namespace="team-b", pool_name="pool-b")
    group_b["metadata"]["labels"] = labelled
    for obj in (pool(), group(), pool_b, group_b):
        cluster.create(obj)
    try:
        cluster.wait_for(IG, "qwen", GROUP_NS, lambda o: has_condition(o, "Ready", "True"), timeout=60)
        cluster.wait_for(IG, "qwen-b", "team-b", lambda o: has_condition(o, "Ready", "True"), timeout=60)
        # Each pool's daemons run in its own installation's namespace, and only there.
        assert cluster.get(DS, "local-shm-agent", POOL_NS) is not None
        assert cluster.get(DS, "local-shm-agent", "team-b-system") is None
        assert cluster.get(DS, "pool-b-agent", "team-b-system") is not None
        assert cluster.get(DS, "pool-b-agent", POOL_NS) is None
        # Children carry their owner's instance: the installation that serves them watches them.
        decode = cluster.get(DEPLOY, "qwen-b-decode", "team-b")
        assert decode is not None and decode["metadata"]["labels"]["maru.io/operator-instance"] == "team-b"
        assert "maru.io/operator-instance" not in decode["spec"]["template"]["metadata"]["labels"]
        # Each instance has its own Lease, where every release looks for it.
        assert cluster.get("leases.coordination.k8s.io", "maru-operator-team-b", LEASE_NS) is not None
        assert {lease["metadata"]["name"] for lease in cluster.list("leases.coordination.k8s.io", LEASE_NS)} == {
            "maru-operator",
            "maru-operator-team-b",
        }
        # No fight: once converged, nothing is written back and forth.
        time.sleep(1.5)
        mark = cluster.mark()
        time.sleep(2.0)
        assert object_writes(cluster, mark) == []
    except AssertionError:
        raise AssertionError(processes.logs()) from None


def test_two_releases_of_one_instance_in_two_namespaces_never_both_lead(
    cluster: KubeEmulator, processes: Processes
) -> None:
    """The chart refuses a second release of an instance at install time only (and not under ``helm template``):
    at run time, both releases contend for the one Lease of the instance, wherever they run."""
    create_namespace(cluster, "other-system")
    users = {}
    for name, namespace in (("a", POOL_NS), ("b", "other-system")):
        token = bind_documented_rbac(cluster, account=f"operator-{name}", pool_namespace=namespace)
        users[name] = f"system:serviceaccount:{namespace}:operator-{name}"
        processes.start(name, "--pool-namespace", namespace, *FAST_LEASE, token=token)
    try:
        cluster.create(pool())
        cluster.create(group())
        cluster.wait_for(IG, "qwen", GROUP_NS, lambda o: has_condition(o, "Ready", "True"), timeout=60)
        time.sleep(1.5)  # the last status writes land
        active = writers(cluster, 0) - {None}
        assert len(active) == 1, f"both releases reconciled: {active}"
        (leader,) = [n for n, user in users.items() if user in active]
        namespace, other = (POOL_NS, "other-system") if leader == "a" else ("other-system", POOL_NS)
        assert cluster.get(DS, "local-shm-agent", namespace) is not None
        assert cluster.get(DS, "local-shm-agent", other) is None
        lease = cluster.get("leases.coordination.k8s.io", "maru-operator", LEASE_NS)
        assert lease is not None and lease["metadata"]["annotations"]["maru.io/release-namespace"] == namespace
        # No fight: once converged, nothing is written back and forth.
        mark = cluster.mark()
        time.sleep(2.0)
        assert object_writes(cluster, mark) == []
        # The standby says why it waits: another release serves its instance.
        standby = "b" if leader == "a" else "a"
        assert f"held by a replica of the release in namespace {namespace}" in processes.log(standby)
    except AssertionError:
        raise AssertionError(processes.logs()) from None


def test_a_leader_whose_priming_outlasts_the_renew_deadline_leads_once_and_reconciles(
    cluster: KubeEmulator, processes: Processes
) -> None:
    """Starting to lead lists every watched kind afresh; on a large cluster or a slow API server that takes longer
    than the renew deadline. The leader renews meanwhile, in its own task, and priming is never cut short: bounding
    it by the deadline made the leader drop the Lease, take it again and prime again, forever, without reconciling."""
    delay = 5.0  # each list of RoleBindings priming makes: well past the 2 s renew deadline of FAST_LEASE
    roles = r"^/apis/rbac\.authorization\.k8s\.io/v1/rolebindings$"
    slow = cluster.inject_fault(roles, None, method="GET", times=10_000, delay=delay)
    cluster.create(pool())
    cluster.create(group())
    processes.start("a", "--pool-namespace", POOL_NS, *FAST_LEASE)
    try:

        def leadership(emulator: Any) -> list[str]:
            return [
                e["message"]
                for e in emulator.list_objects("", "events", LEASE_NS)
                if e.get("reason") == "LeaderElection"
            ]

        def ready_or_stepped_down(emulator: Any) -> bool:
            ig = emulator.get_object("maru.io", "inferencegroups", GROUP_NS, "qwen")
            return (ig is not None and has_condition(ig, "Ready", "True")) or any(
                m.endswith("stopped leading") for m in leadership(emulator)
            )

        # Either way, the first sign ends the wait: reconciled, or stepped down (the livelock's first turn).
        cluster.wait_until(ready_or_stepped_down, timeout=120)
        assert cluster.call(lambda: slow.hits) >= 1
        assert [m.split()[-2:] for m in cluster.call(leadership, cluster.emulator)] == [["became", "leader"]]
        assert has_condition(cluster.get(IG, "qwen", GROUP_NS) or {}, "Ready", "True")
        assert processes.log("a").count("became the leader") == 1
        # The Lease was renewed while priming waited on its list: renewals that reached the API server after the
        # list did and before it could be answered (the server holds it ``delay`` seconds).
        requests = cluster.requests_since(0)
        lists = [
            r
            for r in requests
            if r.method == "GET" and re.search(roles, r.path) and not r.is_watch and "labelSelector" in r.query
        ]
        renewals = [
            r for r in requests if r.method == "PATCH" and r.path.endswith("/leases/maru-operator") and r.status == 200
        ]
        assert lists and any(
            any(r.timestamp > listed.timestamp and r.timestamp < listed.timestamp + delay for r in renewals)
            for listed in lists
        )
    except (AssertionError, TimeoutError):
        raise AssertionError(processes.logs()) from None
