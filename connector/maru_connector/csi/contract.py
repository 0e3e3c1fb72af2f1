"""The pool-socket volume as a pod asks for it: driver name, volume attributes and their rules.

Shared by the operator (which writes the volume into vLLM pods) and the node plugin (which checks
what it is asked for), so the two can never disagree. No gRPC here: the operator image has none.
"""

from __future__ import annotations

import re

DRIVER_NAME = "csi.maru.io"
# Where pool daemons create their socket directories on the node, one per pool: the default of a
# MaruPool's spec.daemon.socketDir, and of the plugin's --socket-root.
DEFAULT_SOCKET_ROOT = "/run/maru"
SOCKET_FILE = "pool.sock"

# volumeAttributes of the pod's csi volume.
ATTR_POOL = "pool"  # the pool's socket directory under the socket root (the MaruPool's name, or its short form)
ATTR_SOCKET_DIR = "socketDir"  # optional: the MaruPool's spec.daemon.socketDir, checked against the socket root
ATTRIBUTES = (ATTR_POOL, ATTR_SOCKET_DIR)

# What the kubelet adds to volume_context when the CSIDriver has podInfoOnMount: true.
POD_INFO_PREFIX = "csi.storage.k8s.io/"
POD_NAME = POD_INFO_PREFIX + "pod.name"
POD_NAMESPACE = POD_INFO_PREFIX + "pod.namespace"
POD_SERVICE_ACCOUNT = POD_INFO_PREFIX + "serviceAccount.name"
EPHEMERAL = POD_INFO_PREFIX + "ephemeral"

# One path component: a DNS-1123 name of at most 63 characters (MaruPool names up to 63 characters
# are used as they are; longer ones are shortened by the operator to a DNS-1035 label). It can never
# be "." or ".." and never holds a "/", so it cannot leave the socket root.
POOL_DIR = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
MAX_POOL_DIR = 63


def pool_dir_error(value: str) -> str | None:
    """Why ``value`` is not a valid ``pool`` attribute, or None when it is."""
    if not value:
        return f"volumeAttributes.{ATTR_POOL} is required: the pool's socket directory name"
    if len(value) > MAX_POOL_DIR or not POOL_DIR.match(value):
        return (
            f"volumeAttributes.{ATTR_POOL} {value!r} is not a pool directory name: at most {MAX_POOL_DIR} "
            "lower-case letters, digits, '-' and '.', starting and ending with a letter or digit"
        )
    return None


def volume_attributes(pool_dir: str, socket_dir: str) -> dict[str, str]:
    """The volumeAttributes naming one pool's socket directory."""
    error = pool_dir_error(pool_dir)
    if error:
        raise ValueError(error)
    return {ATTR_POOL: pool_dir, ATTR_SOCKET_DIR: socket_dir}
