"""Pacing of pod-template changes across groups (maru_operator.rollouts): the limit holds with several workers
checking at the same moment, and only a rollout in progress takes a slot, not a group that is merely unhealthy.

The operator runs as a kopf process against the API emulator; what rolled when is read from a watch on the
Deployments, event by event, never from timing.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from maru_localcluster.server import KubeEmulator
from maru_operator.builders.common import LABEL_COMPONENT
from maru_operator.builders.lifecycle import TEMPLATE_HASH
from maru_operator.cache import Store
from maru_operator.rollouts import PACING_ANNOTATION, REVISION, RolloutPacer, rolling, summary
from tests.support.operator import GROUP_NS, RunningOperator, StubStats, group, has_condition, pool, settle

IG = "inferencegroups.maru.io"
MP = "marupools.maru.io"
DEPLOY = "deployments.apps"
ROLES = ("prefill", "decode")

# --- the pacer alone, on a cache filled by hand


_versions = itertools.count(1)


def _deployment(
    group_name: str, role: str, template: str, *, replicas: int = 1, generation: int = 2, **status: int
) -> dict[str, Any]:
    """A role Deployment as the cache holds it: its template rolled to every replica unless ``status`` says
    otherwise (the controller's counts; ``pods``: status.replicas)."""
    pods = status.pop("pods", replicas)
    counts = {"observedGeneration": 2, "replicas": pods, "updatedReplicas": replicas, "availableReplicas": replicas}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": f"{group_name}-{role}",
            "namespace": GROUP_NS,
            "uid": f"uid-{group_name}-{role}",
            "resourceVersion": str(next(_versions)),
            "generation": generation,
            "labels": {LABEL_COMPONENT: role},
            "annotations": {TEMPLATE_HASH: template, REVISION: "2"},
            "ownerReferences": [
                {
                    "apiVersion": "maru.io/v1alpha1",
                    "kind": "InferenceGroup",
                    "name": group_name,
                    "uid": f"uid-{group_name}",
                    "controller": True,
                }
            ],
        },
        "spec": {"replicas": replicas},
        "status": {**counts, **status},
    }


def _cache(*deployments: dict[str, Any]) -> Store:
    store = Store()
    store.summarize("Deployment", summary)
    for name in {d["metadata"]["ownerReferences"][0]["name"] for d in deployments}:
        store.put(
            {
                "apiVersion": "maru.io/v1alpha1",
                "kind": "InferenceGroup",
                "metadata": {"name": name, "namespace": GROUP_NS, "uid": f"uid-{name}"},
            }
        )
    for d in deployments:
        store.put(d)
    return store


def _key(name: str) -> tuple[str, str, str]:
    return ("InferenceGroup", GROUP_NS, name)


def test_a_group_let_through_holds_its_slot_before_the_cache_shows_it_rolling() -> None:
    """Two workers check one after the other before either's apply is back: the second waits."""
    store = _cache(_deployment("a", "decode", "old"), _deployment("b", "decode", "old"))
    pacer = RolloutPacer(max_groups=1)
    assert pacer.held(_key("a"), [_deployment("a", "decode", "new")], store) == []
    assert pacer.held(_key("b"), [_deployment("b", "decode", "new")], store) == [("Deployment", GROUP_NS, "b-decode")]
    # a's apply lands and the deployment controller starts on it: a is rolling, b still waits.
    store.put(_deployment("a", "decode", "new", generation=3))
    assert pacer.held(_key("b"), [_deployment("b", "decode", "new")], store) != []
    # a's new template reached its replica: the slot is b's.
    store.put(_deployment("a", "decode", "new", generation=2))
    assert pacer.held(_key("b"), [_deployment("b", "decode", "new")], store) == []
    assert set(pacer.reserved) == {_key("b")}


def test_a_reservation_ends_at_its_deadline() -> None:
    now = [0.0]
    store = _cache(_deployment("a", "decode", "old"), _deployment("b", "decode", "old"))
    pacer = RolloutPacer(max_groups=1, clock=lambda: now[0])
    assert pacer.held(_key("a"), [_deployment("a", "decode", "new")], store) == []  # its apply never lands
    assert pacer.held(_key("b"), [_deployment("b", "decode", "new")], store) != []
    now[0] = 10_000.0
    assert pacer.held(_key("b"), [_deployment("b", "decode", "new")], store) == []


def test_a_freed_slot_wakes_the_group_held_longest() -> None:
    woken: list[tuple[str, str, str]] = []
    store = _cache(*(_deployment(n, "decode", "old") for n in "abc"))
    pacer = RolloutPacer(max_groups=1, wake=woken.append)
    assert pacer.held(_key("a"), [_deployment("a", "decode", "new")], store) == []
    store.put(_deployment("a", "decode", "new", generation=3))
    assert pacer.held(_key("c"), [_deployment("c", "decode", "new")], store) != []
    assert pacer.held(_key("b"), [_deployment("b", "decode", "new")], store) != []
    assert woken == []
    # a's rollout ends; its Deployment's event brings a back, with nothing left to change.
    store.put(_deployment("a", "decode", "new", generation=2))
    pacer.held(_key("a"), [_deployment("a", "decode", "new")], store)
    assert woken == [_key("c")]
    assert pacer.held(_key("c"), [_deployment("c", "decode", "new")], store) == []
    assert list(pacer.queued) == [_key("b")]


def test_a_group_deleted_while_held_is_not_woken() -> None:
    woken: list[tuple[str, str, str]] = []
    store = _cache(*(_deployment(n, "decode", "old") for n in "abc"))
    pacer = RolloutPacer(max_groups=1, wake=woken.append)
    assert pacer.held(_key("a"), [_deployment("a", "decode", "new")], store) == []
    store.put(_deployment("a", "decode", "new", generation=3))
    for name in ("c", "b"):
        assert pacer.held(_key(name), [_deployment(name, "decode", "new")], store) != []
    gone = store.get(_key("c"))
    assert gone is not None
    store.remove(gone)
    store.put(_deployment("a", "decode", "new", generation=2))
    pacer.held(_key("a"), [_deployment("a", "decode", "new")], store)
    assert woken == [_key("b")] and list(pacer.queued) == [_key("b")]


def test_only_a_template_short_of_its_replicas_is_rolling() -> None:
    # A pod down, or a scale-up whose pods wait for a GPU: every pod has the newest template.
    assert not rolling(_deployment("a", "decode", "t", replicas=2, readyReplicas=1, availableReplicas=1))
    assert not rolling(_deployment("a", "decode", "t", replicas=3, availableReplicas=2))
    # A new template still short of a replica, or with pods of the old one left, or not seen yet.
    assert rolling(_deployment("a", "decode", "t", replicas=2, updatedReplicas=1))
    assert rolling(_deployment("a", "decode", "t", replicas=1, pods=2))
    assert rolling(_deployment("a", "decode", "t", generation=3))


def test_a_group_out_of_pacing_is_never_held_and_holds_no_other() -> None:
    store = _cache(_deployment("a", "decode", "t", generation=3), _deployment("b", "decode", "old"))
    off = store.get(_key("a"))
    assert off is not None
    off["metadata"]["annotations"] = {PACING_ANNOTATION: "off"}
    store.put(off)
    pacer = RolloutPacer(max_groups=1)
    assert pacer.held(_key("b"), [_deployment("b", "decode", "new")], store) == []
    store.put(_deployment("b", "decode", "new", generation=3))
    assert pacer.held(_key("a"), [_deployment("a", "decode", "newer")], store) == []


# --- the operator


def _new_template(dep: dict[str, Any] | None) -> bool:
    assert dep is not None
    return any(e["name"] == "NEW" for e in dep["spec"]["template"]["spec"]["containers"][0].get("env") or [])


def _change(cluster: KubeEmulator, name: str) -> None:
    env = {"env": [{"name": "NEW", "value": "1"}]}
    cluster.patch(IG, name, {"spec": {role: env for role in ROLES}}, GROUP_NS)


def _group_of(dep: dict[str, Any]) -> str | None:
    name, labels = dep["metadata"]["name"], dep["metadata"].get("labels") or {}
    if labels.get(LABEL_COMPONENT) not in ROLES:
        return None
    return name.rsplit("-", 1)[0]


def _settled(dep: dict[str, Any]) -> bool:
    """The newest template on every replica (as the deployment controller reports it)."""
    st, want = dep.get("status") or {}, int(dep["spec"].get("replicas", 1))
    updated = int(st.get("updatedReplicas") or 0)
    return (
        int(st.get("observedGeneration") or 0) >= int(dep["metadata"].get("generation") or 0)
        and updated >= want
        and int(st.get("replicas") or 0) <= updated
    )


class DeploymentWatch:
    """Every version of every Deployment, in the order the API server stored them (a watch from now)."""

    def __init__(self, cluster: KubeEmulator) -> None:
        self.events: list[dict[str, Any]] = []
        self._opened = threading.Event()
        self._url = f"{cluster.url}/apis/apps/v1/deployments?watch=true&timeoutSeconds=600"
        self._thread = threading.Thread(target=self._read, daemon=True)

    def _read(self) -> None:
        try:
            with urllib.request.urlopen(self._url) as stream:
                self._opened.set()
                for line in stream:
                    self.events.append(json.loads(line))
        except OSError:
            pass  # the emulator stopped

    def __enter__(self) -> DeploymentWatch:
        self._thread.start()
        assert self._opened.wait(30)
        return self

    def __exit__(self, *_: object) -> None:
        pass  # a daemon thread; the stream ends with the emulator

    def replay_until(self, done: set[str], attempts: int = 300) -> int:
        """The most groups rolling at once, once the events read so far show ``done`` all rolled."""
        for _ in range(attempts):
            most, rolled = self.most_rolling_at_once()
            if rolled >= done:
                return most
            time.sleep(0.1)
        raise AssertionError(f"the watch never showed {sorted(done - rolled)} rolled")

    def most_rolling_at_once(self) -> tuple[int, set[str]]:
        """Replaying the events: the most groups with a new template not yet on every replica at the same time,
        and the groups whose new template reached every replica."""
        state: dict[str, dict[str, Any]] = {}
        most, done = 0, set()
        for event in list(self.events):
            dep = event["object"]
            if event["type"] not in ("ADDED", "MODIFIED") or _group_of(dep) is None:
                continue
            state[dep["metadata"]["name"]] = dep
            by_group: dict[str, list[dict[str, Any]]] = {}
            for d in state.values():
                by_group.setdefault(_group_of(d) or "", []).append(d)
            now = {g for g, ds in by_group.items() if any(_new_template(d) and not _settled(d) for d in ds)}
            most = max(most, len(now))
            done |= {g for g, ds in by_group.items() if all(_new_template(d) and _settled(d) for d in ds)}
        return most, done


def _operator(cluster: KubeEmulator, stats: StubStats, limit: int, workers: int) -> RunningOperator:
    return RunningOperator(cluster, stats, resync_seconds=3600, workers=workers, max_rolling_groups=limit).start()


def _ready_groups(cluster: KubeEmulator, stats: StubStats, names: list[str], limit: int) -> None:
    """The pool and ``names`` created and Ready under an operator that then stops."""
    first = _operator(cluster, stats, limit, workers=4)
    try:
        cluster.create(pool())
        cluster.wait_for(MP, "local-shm", None, lambda o: has_condition(o, "Ready", "True"))
        for name in names:
            cluster.create(group(name))
        for name in names:
            cluster.wait_for(IG, name, GROUP_NS, lambda o: has_condition(o, "Ready", "True"), timeout=60)
        settle(first)
    finally:
        first.stop()


@pytest.mark.parametrize("limit", [1, 2])
def test_every_group_changing_at_once_rolls_at_most_the_limit(
    cluster: KubeEmulator, kube_controllers: Any, stats: StubStats, limit: int
) -> None:
    """All groups' templates change together (the groups edited while no operator runs, as an upgrade finds
    them); the operator starts with 8 workers that reconcile them all at once. New pods become ready only
    when the test lets them, one wave at a time, so every rollout lasts until the next wave is looked at."""
    names = [f"g{i}" for i in range(8)]
    _ready_groups(cluster, stats, names, limit)
    for name in names:
        _change(cluster, name)
    released: set[str] = set()

    def readiness(obj: dict[str, Any]) -> bool:
        return obj.get("kind") != "Deployment" or not _new_template(obj) or _group_of(obj) in released

    kube_controllers.set_readiness(readiness)

    def wave(emulator: Any) -> set[str] | None:
        """The groups started and not released, once every other group waits in the queue (the wave decided)."""
        started, queued = set(), set()
        for n in set(names) - released:
            if _new_template(emulator.get_object("apps", "deployments", GROUP_NS, f"{n}-decode")):
                started.add(n)
            elif has_condition(
                emulator.get_object("maru.io", "inferencegroups", GROUP_NS, n) or {},
                "Progressing",
                "True",
                "RolloutQueued",
            ):
                queued.add(n)
        return started if started and len(released | started | queued) == len(names) else None

    with DeploymentWatch(cluster) as watch:
        operator = _operator(cluster, stats, limit, workers=8)
        try:
            while len(released) < len(names):
                started = cluster.wait_until(wave, timeout=60, message="the next groups roll")
                assert len(started) <= limit, f"{sorted(started)} rolled together (at most {limit})"
                released |= started
                kube_controllers.set_readiness(readiness)  # looked at again: these may finish
            for name in names:
                cluster.wait_for(IG, name, GROUP_NS, lambda o: has_condition(o, "Progressing", "False"), timeout=60)
        finally:
            operator.stop()
        assert watch.replay_until(set(names)) <= limit


@pytest.fixture
def operator_of_3(cluster: KubeEmulator, stats: StubStats) -> Iterator[RunningOperator]:
    running = _operator(cluster, stats, limit=3, workers=4)
    try:
        yield running
    finally:
        running.stop()


def _roll(cluster: KubeEmulator, name: str) -> None:
    _change(cluster, name)
    for role in ROLES:
        cluster.wait_for(DEPLOY, f"{name}-{role}", GROUP_NS, lambda o: _new_template(o) and _settled(o), timeout=60)


def _readiness_but(names: set[str]) -> Callable[[dict[str, Any]], bool]:
    return lambda obj: _group_of(obj) not in names


def test_unhealthy_groups_do_not_hold_a_template_change(
    cluster: KubeEmulator, kube_controllers: Any, operator_of_3: RunningOperator
) -> None:
    """Three groups rolled a change and then lost a pod: nothing is left to roll, and a fourth group's change
    goes through (it used to wait for their pods, for ever)."""
    cluster.create(pool())
    cluster.wait_for(MP, "local-shm", None, lambda o: has_condition(o, "Ready", "True"))
    names = ["a", "b", "c", "d"]
    for name in names:
        cluster.create(group(name))
        cluster.wait_for(IG, name, GROUP_NS, lambda o: has_condition(o, "Ready", "True"), timeout=60)
    for name in ("a", "b", "c"):
        _roll(cluster, name)
    kube_controllers.set_readiness(_readiness_but({"a", "b", "c"}))
    for name in ("a", "b", "c"):
        cluster.wait_for(IG, name, GROUP_NS, lambda o: has_condition(o, "Ready", "False"), timeout=60)
    settle(operator_of_3)
    _change(cluster, "d")
    for role in ROLES:
        cluster.wait_for(DEPLOY, f"d-{role}", GROUP_NS, _new_template, timeout=60)


def test_a_group_out_of_pacing_neither_waits_nor_holds(
    cluster: KubeEmulator, kube_controllers: Any, stats: StubStats
) -> None:
    """With one slot: a group annotated maru.io/rollout-pacing=off rolls a change whose pods never become ready
    and holds no slot; a paced group's rollout that does not finish holds the slot, and the group out of
    pacing still rolls."""
    operator = _operator(cluster, stats, limit=1, workers=4)
    try:
        cluster.create(pool())
        cluster.wait_for(MP, "local-shm", None, lambda o: has_condition(o, "Ready", "True"))
        for name in ("a", "b", "c"):
            body = group(name)
            if name == "a":
                body["metadata"]["annotations"] = {PACING_ANNOTATION: "off"}
            cluster.create(body)
            cluster.wait_for(IG, name, GROUP_NS, lambda o: has_condition(o, "Ready", "True"), timeout=60)
        settle(operator)
        kube_controllers.set_readiness(lambda obj: not (_group_of(obj) in ("a", "b") and _new_template(obj)))
        _change(cluster, "a")
        cluster.wait_for(DEPLOY, "a-decode", GROUP_NS, lambda o: _new_template(o) and not _settled(o))
        _change(cluster, "b")  # a holds no slot: b rolls, and its rollout does not finish either
        cluster.wait_for(DEPLOY, "b-decode", GROUP_NS, lambda o: _new_template(o) and not _settled(o))
        _change(cluster, "c")
        cluster.wait_for(IG, "c", GROUP_NS, lambda o: has_condition(o, "Progressing", "True", "RolloutQueued"))
        cluster.patch(IG, "c", {"metadata": {"annotations": {PACING_ANNOTATION: "off"}}}, GROUP_NS)
        cluster.wait_for(DEPLOY, "c-decode", GROUP_NS, _new_template)
    finally:
        operator.stop()
