"""At start the operator tells a CRD left behind by an upgrade (or ahead of it after a downgrade) from the one it
was built from: in its log, as a Warning Event on the CRD, and in a metric; and it goes on serving."""

from __future__ import annotations

import copy
import json
import pathlib
import signal
import subprocess
import sys
from typing import Any

import pytest

from maru_localcluster.server import KubeEmulator
from maru_operator.crdcheck import SCHEMA_HASH_ANNOTATION, STALE_REASON, UPGRADE_COMMAND, stale_crds
from maru_operator.crdgen import KINDS, build_crd
from tests.support.operator import GROUP_NS, POOL_NS, ROOT, create_namespace, has_condition, http_get, pool
from tests.support.pool import free_port

pytestmark = pytest.mark.emulator


def generated() -> list[dict[str, Any]]:
    return [build_crd(kind) for kind in KINDS]


def older(crd: dict[str, Any]) -> dict[str, Any]:
    """``crd`` as a release before this one had it: a field less, and its hash."""
    old = copy.deepcopy(crd)
    schema = old["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    del schema["properties"]["spec"]["properties"]["eviction"]
    old["metadata"]["annotations"][SCHEMA_HASH_ANNOTATION] = "0123456789abcdef"
    return old


def test_the_crds_this_build_generates_are_current() -> None:
    assert stale_crds(generated()) == []


def test_a_changed_or_unhashed_crd_is_stale_and_a_missing_one_is_left_to_the_preflight() -> None:
    pools, groups = generated()
    unhashed = copy.deepcopy(groups)
    del unhashed["metadata"]["annotations"]
    stale = stale_crds([older(pools), unhashed])
    assert [(s.name, s.found) for s in stale] == [
        ("marupools.maru.io", "0123456789abcdef"),
        ("inferencegroups.maru.io", None),
    ]
    assert UPGRADE_COMMAND in stale[0].message() and "no schema hash" in stale[1].message()
    assert stale_crds([groups]) == []


def test_the_operator_reports_a_stale_crd_and_serves_on(
    k8s_emulator: KubeEmulator, kube_controllers: Any, tmp_path: pathlib.Path
) -> None:
    cluster = k8s_emulator
    pools, groups = generated()
    cluster.create(older(pools))
    cluster.create(groups)
    for ns in (POOL_NS, GROUP_NS):
        create_namespace(cluster, ns)
    kube_controllers.add_node("node-1", {"maru.io/pool": "yes"})
    metrics = free_port()
    log_path = tmp_path / "operator.log"
    with log_path.open("w") as log:
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
                str(metrics),
                "--log-format",
                "json",
            ],
            env=cluster.env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        try:
            _, text = http_get(f"http://127.0.0.1:{metrics}/metrics")
            assert 'maru_operator_crd_stale{crd="marupools.maru.io"} 1.0' in text
            assert 'maru_operator_crd_stale{crd="inferencegroups.maru.io"} 0.0' in text
            # It serves on: the objects the old CRD still describes are reconciled.
            cluster.create(pool())
            cluster.wait_for(
                "marupools.maru.io", "local-shm", None, lambda o: has_condition(o, "Ready", "True"), timeout=60
            )
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    events = [e for e in cluster.list("events", "default") if e.get("reason") == STALE_REASON]
    assert [(e["involvedObject"]["kind"], e["involvedObject"]["name"], e["type"]) for e in events] == [
        ("CustomResourceDefinition", "marupools.maru.io", "Warning")
    ]
    assert UPGRADE_COMMAND in events[0]["message"]
    entries = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    stale = [e for e in entries if e.get("reason") == STALE_REASON]
    assert [(e.get("crd"), e["level"]) for e in stale] == [("marupools.maru.io", "ERROR")]
