"""Pods run from the images `make images` built, as a node runs them: the image's own root filesystem, its
config's entrypoint, cmd, user, environment and working directory; an image that was not built is a pull
error; a defect planted in an image (a removed dependency, a root or unknown USER) fails the pod.

The images are the session's one build (tests.support.images), under the references the chart and
the operator render.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from maru_localcluster.cluster import LocalCluster
from tests.required import require_local_cluster
from tests.support import imagecheck, images

require_local_cluster("the local cluster's image tests")

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> images.Built:
    return images.build(tmp_path_factory)


@pytest.fixture(scope="module")
def cluster(built: images.Built) -> Iterator[LocalCluster]:
    with LocalCluster(crashloop_base_s=1.0) as c:
        c.add_node("node-1")
        yield c


def wait(check: Callable[[], Any], what: str, timeout: float = 90) -> Any:
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return result


def run_pod(cluster: LocalCluster, name: str, container: dict[str, Any], **spec: Any) -> dict[str, Any]:
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"restartPolicy": "Never", "containers": [{"name": "main", **container}], **spec},
    }
    cluster.kubectl("apply", "--validate=false", "-f", "-", input=yaml.safe_dump(body))
    return body


def status_of(cluster: LocalCluster, name: str) -> dict[str, Any]:
    pod = cluster.kube.get("pods", name, "default") or {}
    return (pod.get("status") or {}).get("containerStatuses", [{}])[0]


def finished(cluster: LocalCluster, name: str) -> tuple[str, str]:
    pod = wait(
        lambda: (
            (p := cluster.kube.get("pods", name, "default"))
            and (p.get("status") or {}).get("phase") in ("Succeeded", "Failed")
            and p
        ),
        f"pod {name} to finish",
    )
    return pod["status"]["phase"], cluster.pod_log("default", name)


def waiting_reason(cluster: LocalCluster, name: str, reasons: set[str]) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        waiting = status_of(cluster, name).get("state", {}).get("waiting") or {}
        return waiting if waiting.get("reason") in reasons else None

    return wait(check, f"pod {name} waiting with {reasons}")


def image_id(ref: str) -> str:
    return "sha256:" + json.loads(imagecheck.buildah("inspect", "--type", "image", ref))["FromImageID"]


def working_containers() -> set[str]:
    for _ in range(10):
        try:
            out = imagecheck.buildah("containers", "--all", "--noheading", "--format", "{{.ContainerName}}")
            return {n for n in out.split() if n.startswith("maru-lc-")}
        except RuntimeError:  # a container removed while buildah listed them ("container not known")
            time.sleep(0.5)
    raise AssertionError("buildah containers kept failing")


def test_the_image_s_entrypoint_runs_as_its_user(cluster: LocalCluster, built: images.Built) -> None:
    ref = built.product["pool"]
    run_pod(cluster, "entrypoint", {"image": ref})  # no command, no args: the image's entrypoint and cmd
    phase, log = finished(cluster, "entrypoint")
    assert phase == "Succeeded", log
    assert "usage: maru-pool" in log.lower()
    assert status_of(cluster, "entrypoint")["imageID"] == image_id(ref)


def test_the_container_sees_the_image_s_files_config_and_nothing_of_this_machine(
    cluster: LocalCluster, built: images.Built
) -> None:
    ref = built.product["operator"]
    config = imagecheck.config(ref)
    script = textwrap.dedent(
        f"""
        import json, os, sys, maru_operator
        def writable(path):
            try:
                open(path, "w").close()
                return True
            except OSError:
                return False
        print(json.dumps({{
            "ids": [os.getuid(), os.getgid()],
            "env": dict(os.environ),
            "cwd": os.getcwd(),
            "python": sys.executable,
            "package": maru_operator.__file__,
            "checkout": os.path.exists({str(REPO)!r}),
            "root_writable": writable("/tmp/x"),
            "volume_writable": writable("/scratch/x"),
        }}))
        """
    )
    run_pod(
        cluster,
        "inside",
        {
            "image": ref,
            "command": ["python", "-c", script],
            "securityContext": {"readOnlyRootFilesystem": True, "runAsNonRoot": True},
            "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
        },
        securityContext={"fsGroup": 65532},
        volumes=[{"name": "scratch", "emptyDir": {}}],
    )
    phase, log = finished(cluster, "inside")
    assert phase == "Succeeded", log
    seen = json.loads(log.strip().splitlines()[-1])
    assert config["User"] == "65532:65532" and seen["ids"] == [65532, 65532]
    image_env = dict(item.split("=", 1) for item in config["Env"])
    assert {k: seen["env"][k] for k in image_env} == image_env
    assert seen["env"]["HOME"] == "/nonexistent"  # the image's passwd entry for its user
    assert seen["cwd"] == (config.get("WorkingDir") or "/")
    assert seen["python"].startswith("/usr/") and seen["package"].startswith("/usr/")
    assert not seen["checkout"], "the container sees this machine's checkout"
    assert not seen["root_writable"] and seen["volume_writable"]


def test_exec_probes_get_the_container_s_configured_environment(cluster: LocalCluster, built: images.Built) -> None:
    """As `runc exec`: not what PID 1's /proc/PID/environ holds now, which a program can overwrite (vllm-router
    sets its process title over it). Without the image's PATH, python3 resolves to /bin/python3 in a merged-/usr
    image and misses /usr/local's packages: the router's drain hook failed so."""
    run_pod(
        cluster,
        "probed",
        {
            "image": built.product["pool"],
            "command": ["sh", "-c", "exec env -i sleep 600"],  # PID 1 with an empty environ
            "readinessProbe": {"exec": {"command": ["python3", "-c", "import maru_pool"]}, "periodSeconds": 1},
        },
    )
    wait(lambda: status_of(cluster, "probed").get("ready"), "the exec probe to pass")
    cluster.kubectl("delete", "pod", "probed", "--grace-period=1", "--wait=false")


def test_an_image_that_was_not_built_is_an_image_pull_error(cluster: LocalCluster) -> None:
    ref = "ghcr.io/maru-pd/maru-pool:0.0.0-never-built"
    run_pod(cluster, "missing", {"image": ref})
    waiting = waiting_reason(cluster, "missing", {"ErrImagePull", "ImagePullBackOff"})
    assert ref in waiting["message"]
    waiting_reason(cluster, "missing", {"ImagePullBackOff"})
    cluster.kubectl("delete", "pod", "missing", "--wait=false")


@pytest.fixture
def planted(built: images.Built) -> Iterator[Callable[..., str]]:
    """Copies of the pool image with one defect each, under references of their own."""
    made: list[str] = []

    def plant(name: str, *, remove: str = "", user: str = "") -> str:
        container = imagecheck.buildah("from", "--pull-never", "--quiet", built.product["pool"]).strip()
        try:
            if remove:
                root = imagecheck.buildah("mount", container).strip()
                subprocess.run(["rm", "-rf", f"{root}/{remove.lstrip('/')}"], check=True)
            if user:
                imagecheck.buildah("config", "--user", user, container)
            ref = f"{images.REGISTRY}/planted:{name}"
            imagecheck.buildah("commit", "--quiet", container, ref)
            made.append(ref)
            return ref
        finally:
            imagecheck.buildah("rm", container)

    yield plant
    for ref in made:
        imagecheck.buildah("rmi", ref)


def test_defects_planted_in_an_image_fail_its_pod(cluster: LocalCluster, planted: Callable[..., str]) -> None:
    site = "usr/local/lib/python3.11/dist-packages"
    run_pod(cluster, "no-dep", {"image": planted("no-prometheus", remove=f"{site}/prometheus_client")})
    phase, log = finished(cluster, "no-dep")
    assert phase == "Failed" and "No module named 'prometheus_client'" in log, log

    # What the operator renders for its pods: runAsNonRoot, so a root image must not start.
    non_root = {"securityContext": {"runAsNonRoot": True}}
    run_pod(cluster, "root-user", {"image": planted("root", user="0:0"), **non_root})
    waiting = waiting_reason(cluster, "root-user", {"CreateContainerConfigError"})
    assert "image will run as root" in waiting["message"]
    run_pod(cluster, "named-user", {"image": planted("named", user="maru"), **non_root})
    waiting = waiting_reason(cluster, "named-user", {"CreateContainerConfigError"})
    assert "non-numeric user (maru)" in waiting["message"]
    run_pod(cluster, "no-such-user", {"image": planted("unknown", user="nobody-here")})
    waiting = waiting_reason(cluster, "no-such-user", {"CreateContainerError"})
    assert "unable to find user nobody-here" in waiting["message"]
    # Gone before the planted images are: a pod's retry checks its image out each time.
    cluster.kubectl("delete", "pod", "no-dep", "root-user", "named-user", "no-such-user", "--grace-period=1")


def test_working_containers_go_with_their_containers(cluster: LocalCluster, built: images.Built) -> None:
    before = working_containers()
    run_pod(cluster, "sleeper", {"image": built.product["pool"], "command": ["sleep", "600"]})
    wait(lambda: status_of(cluster, "sleeper").get("state", {}).get("running"), "sleeper to run")
    mine = working_containers() - before
    assert len(mine) == 1 and next(iter(mine)).startswith(f"maru-lc-{cluster.nodes['node-1'].pid}-"), mine
    cluster.kubectl("delete", "pod", "sleeper", "--grace-period=1")
    try:
        wait(lambda: not (mine & working_containers()), "the sleeper's working container to be removed")
    except AssertionError as err:
        raise AssertionError(f"{err}\n{cluster.component_log('kubelet-node-1')[-3000:]}") from None
