"""The driver's two volumes as a pod asks for them: driver name, volume attributes and their rules.

* the **pool socket** volume (``pool``, optional ``socketDir``): the pool's socket directory, read-only;
* the **pool credential** volume (``pool``, ``cache``, optional ``quota`` and ``socketDir``): a small
  read-only tmpfs holding ``token``, the pool credential the plugin mints at publish for the cache
  ``cache`` in the pod's namespace (which the kubelet names, never the pod).

Shared by the operator (which writes the volume into vLLM pods) and the node plugin (which checks
what it is asked for), so the two can never disagree. No gRPC here: the operator image has none.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from maru_contracts import tenancy

DRIVER_NAME = "csi.maru.io"
# Where pool daemons create their socket directories on the node, one per pool: the default of a
# MaruPool's spec.daemon.socketDir, and of the plugin's --socket-root.
DEFAULT_SOCKET_ROOT = "/run/maru"
SOCKET_FILE = "pool.sock"

# volumeAttributes of the pod's csi volume.
ATTR_POOL = "pool"  # the pool's socket directory under the socket root (the MaruPool's name, or its short form)
ATTR_SOCKET_DIR = "socketDir"  # optional: the MaruPool's spec.daemon.socketDir, checked against the socket root
# The credential volume's: which cache of the pod's namespace the token is for, and the quota it asks for.
ATTR_CACHE = "cache"  # the group's cacheNamespace, or its name
ATTR_QUOTA = "quota"  # optional: bytes=N,pins=N,leases=N (maru_contracts.tenancy.Quota), capped by the pool
ATTRIBUTES = (ATTR_POOL, ATTR_SOCKET_DIR, ATTR_CACHE, ATTR_QUOTA)
CREDENTIAL_ONLY = (ATTR_CACHE, ATTR_QUOTA)
# The file the credential volume holds; the connector's pool_token_file names it.
TOKEN_FILE = "token"
# Under the socket root: each pool's minting material (key and quota policy), root-only. Never a pool's
# directory name (those are DNS-1123 names), so it can never be published into a pod.
CREDENTIALS_DIR = "_credentials"
MAX_CACHE = 253

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


def cache_error(value: str) -> str | None:
    """Why ``value`` is not a valid ``cache`` attribute, or None when it is."""
    if not value:
        return f"volumeAttributes.{ATTR_CACHE} is required for a credential: the group's cache name"
    if len(value) > MAX_CACHE or not value.isprintable():
        return (
            f"volumeAttributes.{ATTR_CACHE} must be 1 to {MAX_CACHE} printable characters "
            "(the group's spec.connector.cacheNamespace, or its name)"
        )
    return None


def credential_attributes(pool_dir: str, socket_dir: str, cache: str, quota: str = "") -> dict[str, str]:
    """The volumeAttributes of a credential volume: the token of ``cache`` (in the pod's namespace) for a pool;
    ``quota``: the group's request (``bytes=N,pins=N,leases=N``), empty for the pool's default."""
    attributes = volume_attributes(pool_dir, socket_dir)
    error = cache_error(cache)
    if error:
        raise ValueError(error)
    attributes[ATTR_CACHE] = cache
    if quota:
        attributes[ATTR_QUOTA] = quota
    return attributes


def volume_attributes(pool_dir: str, socket_dir: str) -> dict[str, str]:
    """The volumeAttributes naming one pool's socket directory."""
    error = pool_dir_error(pool_dir)
    if error:
        raise ValueError(error)
    return {ATTR_POOL: pool_dir, ATTR_SOCKET_DIR: socket_dir}


# The admission file the operator renders from a MaruPool's spec.allowedNamespaces and the plugin reads
# (maru_csi.admission) before it mints a credential for a pod's namespace.
ADMISSION_VERSION = 1
ADMIT_ALL = "AllNamespaces"
ADMIT_LISTED = "ListedNamespaces"


def admission_document(pool: str, allowed_namespaces: Sequence[str] | None, directory: str = "") -> dict[str, Any]:
    """The admission file's content for a MaruPool's name and its ``spec.allowedNamespaces``.

    ``directory``: the pool's socket directory name when it is not the pool's name (a long name's short
    form); the plugin checks the file against the directory that holds it.
    """
    document: dict[str, Any] = {"version": ADMISSION_VERSION, "pool": pool}
    if directory and directory != pool:
        document["directory"] = directory
    if allowed_namespaces is None:
        return {**document, "admit": ADMIT_ALL}
    if not allowed_namespaces:
        # The CRD requires at least one: an empty list would admit nobody, which is no pool at all.
        raise ValueError("allowedNamespaces, when set, lists at least one namespace")
    return {**document, "admit": ADMIT_LISTED, "namespaces": sorted(set(allowed_namespaces))}


def render_admission(document: dict[str, Any]) -> str:
    """The document as the init container passes and writes it: compact, keys sorted (stable in the pod spec)."""
    return json.dumps(document, sort_keys=True, separators=(",", ":"))


# The minting policy the operator renders into the plugin's init container (maru_csi.minting): the pool's
# default and largest tenant quotas. No secret in it.
POLICY_FIELDS = ("tenantQuota", "maxTenantQuota")


def minting_policy(default: tenancy.Quota, ceiling: tenancy.Quota) -> str:
    """The ``--policy`` argument the operator renders into the init container: no secret in it."""
    return json.dumps(
        {"tenantQuota": default.encode(), "maxTenantQuota": ceiling.encode()}, sort_keys=True, separators=(",", ":")
    )
