"""The pool-socket volume the operator writes, and the CSI node plugin's reading of it: one contract."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from maru_contracts.csi import DEFAULT_SOCKET_ROOT, DRIVER_NAME
from maru_operator.api.marupool import MaruPoolSpec
from maru_operator.builders.common import Owner
from maru_operator.builders.pool import build_agent_daemonset, pool_endpoint, socket_host_dir
from maru_operator.builders.poolsocket import pool_socket_mount, pool_socket_volume
from maru_operator.images import DEFAULT_POOL_IMAGE
from tests.support.specs import dax_spec, pool_spec

LONG_POOL = "a-very-long-pool-name." + "x" * 60  # a valid MaruPool name, too long for its socket directory
REPO = Path(__file__).resolve().parents[2]


def admission_init(spec: MaruPoolSpec, pool: str) -> dict[str, Any]:
    """The agent DaemonSet's init container that writes the pool's admission rule."""
    owner = Owner(kind="MaruPool", name=pool, uid="0c2f6a4e-5b1d-4e8f-9a7c-3d2b1e0f4a5c")
    pod = build_agent_daemonset(spec, owner, "maru-system")["spec"]["template"]["spec"]
    (init,) = [c for c in pod.get("initContainers", []) if c["name"] == "admission"]
    return init


def run_admission_init(spec: MaruPoolSpec, pool: str, root: Path) -> Path:
    """Run the init container's command as it is rendered, with the node's socket root at ``root``.

    Returns the pool's socket directory under ``root``."""
    init = admission_init(spec, pool)
    args = list(init["args"])
    host_dir = args[args.index("--dir") + 1]
    assert host_dir == socket_host_dir(spec, pool)
    local = root / Path(host_dir).name
    args[args.index("--dir") + 1] = str(local)
    assert init["command"][:2] == ["python", "-m"]
    env = {**os.environ, "PYTHONPATH": str(REPO / "connector")}
    result = subprocess.run(
        [sys.executable, *init["command"][1:], *args], capture_output=True, text=True, timeout=60, env=env, check=False
    )
    assert result.returncode == 0, result.stderr
    return local


def test_the_pool_default_socket_dir_is_the_drivers_default_root() -> None:
    assert MaruPoolSpec.model_validate({"backend": "shm", "size": "1Gi"}).daemon.socket_dir == DEFAULT_SOCKET_ROOT


@pytest.mark.parametrize("pool", ["pool", "pool.with.dots", LONG_POOL])
@pytest.mark.parametrize("socket_dir", ["/run/maru", "/var/run/maru/"])
def test_the_plugin_publishes_exactly_the_mounted_directory(tmp_path: Path, pool: str, socket_dir: str) -> None:
    """What the plugin publishes for the volume is the directory the pod mounts it at, which is where the
    connector's pool URL points."""
    from maru_csi.node import check_publish  # the plugin's own validation (needs the csi extra)
    from tests.support.csi import publish_request

    spec = pool_spec(daemon={"socketDir": socket_dir})
    volume, mount = pool_socket_volume(spec, pool), pool_socket_mount(spec, pool)
    assert volume["csi"]["driver"] == DRIVER_NAME and volume["csi"]["readOnly"] is True
    assert mount["name"] == volume["name"] and mount["readOnly"] is True
    assert mount["mountPath"] == socket_host_dir(spec, pool)
    assert pool_endpoint(spec, pool) == f"unix://{mount['mountPath']}/pool.sock"

    # The node, in a folder: the plugin's socket root stands for the pool's socketDir; the agent's init
    # container has written the pool's admission rule there.
    root = tmp_path / "root"
    run_admission_init(spec, pool, root)
    attributes = dict(volume["csi"]["volumeAttributes"])
    assert attributes.pop("socketDir").rstrip("/") == socket_dir.rstrip("/")
    request = publish_request("/var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/maru-socket/mount", "")
    request.volume_context.update(attributes)
    published = check_publish(request, root)
    assert Path(published.source).name == Path(mount["mountPath"]).name


def _publish_as(root: Path, directory: str, namespace: str) -> Any:
    from maru_csi.node import check_publish  # the plugin's own validation (needs the csi extra)
    from tests.support.csi import publish_request

    request = publish_request(
        "/var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/maru-socket/mount", directory, namespace=namespace
    )
    return check_publish(request, root)


@pytest.mark.parametrize("pool", ["shared", LONG_POOL])
def test_the_agent_writes_the_rule_the_plugin_admits_by(tmp_path: Path, pool: str) -> None:
    """allowedNamespaces -> the agent's init container -> the file beside the socket -> the plugin's check."""
    from maru_csi.node import CsiError

    spec = pool_spec(allowedNamespaces=["prod", "staging"])
    directory = run_admission_init(spec, pool, tmp_path).name
    assert _publish_as(tmp_path, directory, "prod").pod.startswith("prod/")
    with pytest.raises(CsiError) as info:
        _publish_as(tmp_path, directory, "llm")
    assert info.value.code.name == "PERMISSION_DENIED"
    for word in ("namespace llm", f"MaruPool {pool}", "spec.allowedNamespaces", "prod", "staging"):
        assert word in info.value.message

    # A pool with no allowedNamespaces: its rule says "every namespace", explicitly.
    open_spec = pool_spec()
    assert '"admit":"AllNamespaces"' in admission_init(open_spec, pool)["args"][-1]
    run_admission_init(open_spec, pool, tmp_path)
    for namespace in ("llm", "team-b"):
        assert _publish_as(tmp_path, directory, namespace).pool == directory


@pytest.mark.parametrize("backend", ["shm", "dax"])
def test_the_admission_init_container_writes_only_the_pools_directory(backend: str) -> None:
    """Root (the kubelet made the directory root-owned), no capability, no privilege, also with dax; it mounts
    the pool's socket directory and nothing else, and runs from the pool image."""
    spec = pool_spec() if backend == "shm" else dax_spec(allowedNamespaces=["llm"])
    init = admission_init(spec, "shared")
    assert init["image"] == DEFAULT_POOL_IMAGE  # the pool image, as the object names none
    assert init["volumeMounts"] == [{"name": "socket", "mountPath": socket_host_dir(spec, "shared")}]
    security = init["securityContext"]
    assert security["capabilities"] == {"drop": ["ALL"]} and security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True and "privileged" not in security
    assert init["resources"]["limits"]["memory"]


def test_a_changed_rule_rolls_the_agents() -> None:
    """The rule is in the pod template: changing allowedNamespaces changes it, so every node's agent rewrites
    its file (one node at a time); nothing else in the pool's children carries it."""
    before = admission_init(pool_spec(allowedNamespaces=["prod"]), "shared")
    after = admission_init(pool_spec(allowedNamespaces=["prod", "llm"]), "shared")
    assert before["args"] != after["args"] and '"namespaces":["llm","prod"]' in after["args"][-1]
