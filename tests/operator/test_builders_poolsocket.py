"""The pool-socket volume the operator writes, and the CSI node plugin's reading of it: one contract."""

from __future__ import annotations

from pathlib import Path

import pytest

from maru_connector.csi.contract import DEFAULT_SOCKET_ROOT, DRIVER_NAME
from maru_operator.api.marupool import MaruPoolSpec
from maru_operator.builders.pool import pool_endpoint, socket_host_dir
from maru_operator.builders.poolsocket import pool_socket_mount, pool_socket_volume
from tests.operator.helpers import pool_spec

LONG_POOL = "a-very-long-pool-name." + "x" * 60  # a valid MaruPool name, too long for its socket directory


def test_the_pool_default_socket_dir_is_the_drivers_default_root() -> None:
    assert MaruPoolSpec.model_validate({"backend": "shm", "size": "1Gi"}).daemon.socket_dir == DEFAULT_SOCKET_ROOT


@pytest.mark.parametrize("pool", ["pool", "pool.with.dots", LONG_POOL])
@pytest.mark.parametrize("socket_dir", ["/run/maru", "/var/run/maru/"])
def test_the_plugin_publishes_exactly_the_mounted_directory(tmp_path: Path, pool: str, socket_dir: str) -> None:
    """What the plugin publishes for the volume is the directory the pod mounts it at, which is where the
    connector's pool URL points."""
    from maru_connector.csi.node import check_publish  # the plugin's own validation (needs the csi extra)
    from tests.csi.harness import publish_request

    spec = pool_spec(daemon={"socketDir": socket_dir})
    volume, mount = pool_socket_volume(spec, pool), pool_socket_mount(spec, pool)
    assert volume["csi"]["driver"] == DRIVER_NAME and volume["csi"]["readOnly"] is True
    assert mount["name"] == volume["name"] and mount["readOnly"] is True
    assert mount["mountPath"] == socket_host_dir(spec, pool)
    assert pool_endpoint(spec, pool) == f"unix://{mount['mountPath']}/pool.sock"

    # The node, in a folder: the plugin's socket root stands for the pool's socketDir.
    root = tmp_path / "root"
    (root / Path(mount["mountPath"]).name).mkdir(parents=True)
    attributes = dict(volume["csi"]["volumeAttributes"])
    assert attributes.pop("socketDir").rstrip("/") == socket_dir.rstrip("/")
    request = publish_request("/var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/maru-socket/mount", "")
    request.volume_context.update(attributes)
    published = check_publish(request, root)
    assert Path(published.source).name == Path(mount["mountPath"]).name
