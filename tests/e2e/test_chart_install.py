"""`helm install` on the local cluster: the chart's operator Deployment runs as a pod, from the operator image
`make images` built, under the reference the chart renders, as the chart's ServiceAccount and within its RBAC,
and reconciles a MaruPool whose daemon runs from the pool image.

tests/chart/test_install.py checks the same install against the API emulator alone, with the operator run
as a process; here nothing of the operator comes from this machine's files. The chart's CSI node plugin
DaemonSet is left out (``csiDriver.enabled=false``): its sidecars (node-driver-registrar, livenessprobe) are
upstream images no registry here serves; each kubelet runs the plugin itself, from the pool image.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from maru_localcluster.cluster import LocalCluster
from maru_localcluster.product import POOL_NAMESPACE, OperatorRelease, wait_ready
from tests.support import imagecheck, images
from tests.support.e2e import REPO, skip_unless_local_cluster_runs

skip_unless_local_cluster_runs()


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    images.build()
    with LocalCluster() as c:
        c.add_node("node-1")
        yield c


def running_image(pod: dict[str, Any]) -> tuple[str, str]:
    """(the image reference, the image ID) the kubelet reports for the pod's first container."""
    status = pod["status"]["containerStatuses"][0]
    return status["image"], status["imageID"]


def test_the_chart_runs_the_operator_from_its_image_and_it_reconciles_a_pool(cluster: LocalCluster) -> None:
    built = images.build()
    release = OperatorRelease(cluster).install()
    pod = release.wait_ready()
    assert running_image(pod) == (built.product["operator"], "sha256:" + imagecheck.image_id(built.product["operator"]))
    assert pod["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True

    cluster.kubectl("apply", "-f", str(REPO / "examples" / "local" / "pool-shm.yaml"))
    wait_ready(cluster, "marupools.maru.io", "local-shm")
    (agent,) = cluster.kube.list("pods", POOL_NAMESPACE, labels="app.kubernetes.io/component=agent")
    assert running_image(agent) == (built.product["pool"], "sha256:" + imagecheck.image_id(built.product["pool"]))

    # The operator pod did all of it as the chart's ServiceAccount: never refused, never restarted.
    log = cluster.pod_log(POOL_NAMESPACE, pod["metadata"]["name"])
    assert "MaruPool local-shm" in log, log[-3000:]
    assert " 403" not in log and "Forbidden" not in log, log[-3000:]
    pod = cluster.kube.get("pods", pod["metadata"]["name"], POOL_NAMESPACE)
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0


def test_the_node_s_csi_plugin_runs_from_the_pool_image(cluster: LocalCluster) -> None:
    """The chart's CSI node plugin is `maru-csi` of the pool image: each kubelet runs it from the image's own root
    filesystem (the chart's DaemonSet needs upstream sidecar images no registry here serves). The other tests of
    this tier mount its volumes into every vLLM pod, so its mounts do reach the kubelet."""
    node_folder = str(cluster.workdir)
    plugins = [
        int(entry.name)
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit()
        and _cmdline(entry).startswith("/usr/bin/python3 /usr/local/bin/maru-csi ")
        and node_folder in _cmdline(entry)
    ]
    assert len(plugins) == 1, plugins
    root = Path(f"/proc/{plugins[0]}/root")
    assert os.readlink(root) != "/"
    assert (root / "usr/local/bin/maru-csi").is_file()
    assert not (root / str(REPO).lstrip("/")).exists()  # nothing of this checkout in its root


def _cmdline(entry: Path) -> str:
    try:
        return (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
