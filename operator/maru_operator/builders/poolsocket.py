"""How a vLLM pod reaches its pool: the pool's socket directory as an inline CSI volume.

The pool daemon on each node listens in ``<socketDir>/<pool>/pool.sock``. A hostPath volume would
hand that directory to the pod, but Pod Security ``baseline`` and ``restricted`` forbid hostPath, so
the pod names an inline ephemeral volume of the chart's CSI driver (``csi.maru.io``) instead: the
kubelet asks the driver's node plugin to bind-mount the directory, read-only, into the pod.
``restricted`` admits ``csi`` volumes, and the pod needs no privilege to use the socket.

The volume is mounted at the host path of the directory, so the pool URL the connector is given
(``status.endpoint`` of the MaruPool) is valid inside the pod as on the node.
"""

from __future__ import annotations

from pathlib import PurePosixPath

from maru_contracts.csi import DRIVER_NAME, volume_attributes
from maru_operator.api.marupool import MaruPoolSpec
from maru_operator.builders.common import Object
from maru_operator.builders.pool import socket_host_dir

SOCKET_VOLUME = "maru-socket"


def pool_socket_volume(spec: MaruPoolSpec, pool: str) -> Object:
    """The pod volume: the pool's socket directory, published by the CSI driver, read-only."""
    directory = PurePosixPath(socket_host_dir(spec, pool))
    return {
        "name": SOCKET_VOLUME,
        "csi": {
            "driver": DRIVER_NAME,
            # The driver publishes read-only only: clients connect to the socket, never write the directory.
            "readOnly": True,
            "volumeAttributes": volume_attributes(directory.name, str(directory.parent)),
        },
    }


def pool_socket_mount(spec: MaruPoolSpec, pool: str) -> Object:
    """The container's mount of :func:`pool_socket_volume`, at the directory's path on the node."""
    return {"name": SOCKET_VOLUME, "mountPath": socket_host_dir(spec, pool), "readOnly": True}
