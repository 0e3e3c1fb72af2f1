"""The product deployed on the local cluster as a user deploys it (helm install of the chart, kubectl apply of the
examples), every pod from the images this checkout built, for the end-to-end tests: one cluster per test module,
shared by its tests."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from maru_localcluster.cluster import LocalCluster
from maru_localcluster.product import (
    OperatorRelease,
    create_namespace,
    prefilled_claim,
    wait_for,
    why_not_ready,
)
from tests.required import require_local_cluster, require_vllm
from tests.support import images

REPO = Path(__file__).resolve().parents[2]

# The claim examples/local/inferencegroup-tiny.yaml mounts as its model cache, and the model's folder in it.
MODEL_CLAIM = "tiny-model"
MODEL_FOLDER = "tiny-llama"

GROUP_NS = "llm"


def skip_unless_local_cluster_runs() -> None:
    """Module-level skip with the reason, a failure under MARU_REQUIRE_LOCAL_CLUSTER=1 (as CI runs)."""
    __tracebackhide__ = True
    require_local_cluster("the end-to-end tests")
    require_vllm("the end-to-end tests")


def example(path: str) -> dict[str, Any]:
    (doc,) = [d for d in yaml.safe_load_all((REPO / path).read_text()) if d]
    return doc


@dataclass
class Deployment:
    cluster: LocalCluster
    operator: OperatorRelease
    group: str = "tiny"

    def pods(self, role: str, *, ready_only: bool = False) -> list[dict[str, Any]]:
        pods = self.cluster.kube.list(
            "pods", GROUP_NS, labels=f"app.kubernetes.io/instance={self.group},maru.io/role={role}"
        )
        pods = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        if ready_only:
            pods = [
                p
                for p in pods
                if any(
                    c.get("type") == "Ready" and c.get("status") == "True"
                    for c in (p.get("status") or {}).get("conditions") or []
                )
            ]
        return pods

    def engine_url(self, role: str) -> str:
        """An engine reached directly at its pod's address (the router's view of it), through a door."""
        (pod,) = self.pods(role, ready_only=True)
        return self.cluster.pod_url(GROUP_NS, pod["metadata"]["name"], 8000)

    @property
    def router_url(self) -> str:
        """The group's Service (its ClusterIP, through a door from this machine)."""
        return self.cluster.service_url(GROUP_NS, self.group)

    def get(self, resource: str, name: str, namespace: str | None = None) -> dict[str, Any]:
        obj = self.cluster.kube.get(resource, name, namespace)
        assert obj is not None, f"{resource} {name} does not exist"
        return obj

    def explain(self) -> str:
        return why_not_ready(self.cluster) + "\n--- operator\n" + self.operator.log_tail()


def wait(what: str, check: Callable[[], Any], deployment: Deployment) -> Any:
    """Poll ``check`` until it returns something truthy, for as long as the cluster makes progress
    (``product.wait_for``); the failure shows the cluster's state and the operator's last lines."""
    return wait_for(what, check, deployment.cluster, explain=deployment.explain)


@contextlib.contextmanager
def deployed(
    tiny_model: Path,
    workdir: Path,
    nodes: list[tuple[str, dict[str, str], dict[str, Path]]],
    manifests: list[dict[str, Any]],
) -> Iterator[Deployment]:
    """A local cluster with ``nodes``, the chart installed (its operator pod Ready), and ``manifests`` applied."""
    # Every pod runs from the images `make images` built (the session's one build), under the references the
    # operator renders; a pod naming any other image fails to pull.
    images.build()
    cluster = LocalCluster()
    logs = workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with cluster:
        for name, labels, devices in nodes:
            cluster.add_node(name, labels, devices=devices)
        try:
            # As a user installs it: the chart (CRDs, RBAC, the operator's Deployment from its image).
            operator = OperatorRelease(cluster).install()
            create_namespace(cluster, GROUP_NS)
            # The examples' groups read the model from this claim (their modelCache), as the demo's do.
            prefilled_claim(cluster, GROUP_NS, MODEL_CLAIM, tiny_model, MODEL_FOLDER)
            operator.wait_ready()
            cluster.kubectl("apply", "--validate=false", "-f", "-", input=yaml.safe_dump_all(manifests))
            yield Deployment(cluster, operator)
        finally:
            # Kept for whoever reads a failure (pytest keeps the last runs' temporary folders).
            cluster.collect_logs(logs)
