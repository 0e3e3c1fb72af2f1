"""README's cluster quickstart, read as a new user runs it: the order of its commands, and that every name it
uses is the one the chart, the examples and the operator actually create.

tests/chart/test_install.py runs the same install order (namespace and Pod Security label, then
`helm install` without --create-namespace, then the examples) against the API emulator.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from maru_operator.api.marupool import DEFAULT_SOCKET_DIR
from maru_operator.rbac import DEFAULT_LEASE_NAMESPACE, lease_name

REPO_ROOT = Path(__file__).resolve().parents[2]
README = (REPO_ROOT / "README.md").read_text()
QUICKSTART = README.split("## Quickstart on a cluster\n", 1)[1].split("\n## ", 1)[0]
VALUES = yaml.safe_load((REPO_ROOT / "charts" / "maru-operator" / "values.yaml").read_text())


def commands(text: str) -> list[str]:
    """The shell commands of the text's ```sh blocks, comments dropped, continuation lines joined."""
    out: list[str] = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #", 1)[0].strip()
            if line:
                out.append(" ".join(line.split()))
    return out


def example(name: str) -> dict:
    return yaml.safe_load((REPO_ROOT / "examples" / name).read_text())


def index_of(lines: list[str], start: str) -> int:
    return next(i for i, line in enumerate(lines) if line.startswith(start))


def test_the_namespace_and_its_pod_security_label_come_before_the_install() -> None:
    lines = commands(QUICKSTART)
    create = index_of(lines, "kubectl create namespace maru-system")
    label = index_of(lines, "kubectl label namespace maru-system pod-security.kubernetes.io/enforce=privileged")
    install = index_of(lines, "helm install maru-operator charts/maru-operator -n maru-system")
    assert create < label < install
    assert "--create-namespace" not in lines[install]
    assert lines[install + 1] == "kubectl -n maru-system rollout status deployment/maru-operator"


def test_the_images_step_builds_what_the_chart_pulls() -> None:
    (build,) = [line for line in commands(QUICKSTART) if line.startswith("make images")]
    assert "IMAGE_REGISTRY=" in build and "PUSH=1" in build
    assert "--set images.registry=" in QUICKSTART
    assert VALUES["images"]["registry"] in QUICKSTART


def test_pool_group_wait_and_request_use_the_examples_names() -> None:
    lines = commands(QUICKSTART)
    pool, group = example("pool-shm.yaml"), example("inferencegroup-shm.yaml")
    name, namespace = group["metadata"]["name"], group["metadata"]["namespace"]
    assert group["spec"]["poolRef"]["name"] == pool["metadata"]["name"]
    order = [
        "kubectl label node <your-gpu-node> " + "".join(f"{k}={v}" for k, v in pool["spec"]["nodeSelector"].items()),
        "kubectl apply -f examples/pool-shm.yaml",
        f"kubectl create namespace {namespace}",
        "kubectl apply -f examples/inferencegroup-shm.yaml",
        f"kubectl wait mpool/{pool['metadata']['name']} --for=condition=Ready",
        f"kubectl -n {namespace} wait ig/{name} --for=condition=Ready",
        f"kubectl -n {namespace} port-forward svc/{name} {group['spec']['router'].get('port', 8000)}:",
        "curl -s localhost:8000/v1/completions",
    ]
    positions = [index_of(lines, start) for start in order]
    assert positions == sorted(positions), order
    curl = lines[positions[-1]]
    assert f'"model": "{group["spec"]["model"]["servedModelName"]}"' in curl


@pytest.mark.parametrize("doc", ["README.md", "docs/gpu-cxl.md", "docs/operations.md"])
def test_uninstall_leaves_nothing_behind(doc: str) -> None:
    """Groups before pools, then the release, the leader Lease no release owns, the CRDs, the host state."""
    text = (REPO_ROOT / doc).read_text()
    lease = f"delete lease {lease_name('')}"
    assert lease in text, f"{doc} does not delete the leader Lease ({lease})"
    assert VALUES["leaseNamespace"] == DEFAULT_LEASE_NAMESPACE
    assert f"kubectl -n {DEFAULT_LEASE_NAMESPACE} delete lease" in text or "-n <leaseNamespace> delete lease" in text
    assert text.index("delete ig --all -A") < text.index("delete mpool --all") < text.index("helm uninstall")
    assert "delete -f crds/" in text
    # The pools' socket directories on the hosts: the CSI driver's socketRoot, every pool's socketDir.
    assert VALUES["csiDriver"]["socketRoot"] == DEFAULT_SOCKET_DIR
    flat = " ".join(text.split())  # a command may wrap in the prose
    assert f"rm -rf {DEFAULT_SOCKET_DIR}" in flat or f"`{DEFAULT_SOCKET_DIR}`" in flat
