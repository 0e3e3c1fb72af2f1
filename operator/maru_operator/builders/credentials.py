"""The pool's key, and where a group's pods get their pool credential.

* ``<pool>-key`` (release namespace, owned by the MaruPool): random bytes the operator generates once. Only
  the operator and the pool's daemons read it; the daemons verify every client's hello against it, and the
  agents' init container copies it, with the pool's quota policy, to the node for the CSI node plugin
  (:mod:`maru_csi.minting`).
* A group's **credential** is no Secret: its vLLM pods name a credential volume of the CSI driver
  (:func:`credential_volume`), and the node plugin mints the token of ``tenant:<pod namespace>/<cache>``
  (:mod:`maru_contracts.tenancy`) when the kubelet publishes it. The namespace comes from the kubelet, the
  cache name and the group's ``poolQuota`` from the volume's attributes, and the pool's ``maxTenantQuota``
  caps what they ask for. So the operator reads and writes Secrets in its own namespace only, and the pool's
  key never leaves the release namespace and the pool nodes' root-only files.

A group's **quota** in its pool travels inside its token, signed (:func:`maru_contracts.tenancy.effective_quota`:
the group's ``poolQuota``, else the pool's ``tenantQuota``, capped by the pool's ``maxTenantQuota``): the
daemons learn it at the engines' hello, with no tenant list and no restart.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import PurePosixPath
from typing import Any

from maru_contracts import tenancy
from maru_contracts.csi import DRIVER_NAME, credential_attributes
from maru_contracts.csi import TOKEN_FILE as TOKEN_FIELD
from maru_contracts.poolsize import parse_size
from maru_operator.api.marupool import MaruPoolSpec, TenantQuota
from maru_operator.builders.common import Object, Owner, labels, metadata
from maru_operator.names import child_name

POOL_KEY_FIELD = "key"

KEY_VOLUME = "pool-key"
KEY_DIR = "/etc/maru/pool-key"
KEY_FILE = f"{KEY_DIR}/{POOL_KEY_FIELD}"

CREDENTIAL_VOLUME = "maru-credential"
CREDENTIAL_DIR = "/var/run/secrets/maru.io/pool"
TOKEN_FILE = f"{CREDENTIAL_DIR}/{TOKEN_FIELD}"

# Secret volume files are owned by root. A root reader (the node agents) gets 0400; a non-root one (vLLM,
# the metadata server: UID 65532, alone in its container) needs the file world-readable inside its own
# pod, since fsGroup would also make the kubelet chown the pod's other volumes (the pool socket's).
ROOT_ONLY = 0o400
NON_ROOT_READER = 0o444


def pool_key_name(pool: str) -> str:
    return child_name(pool, "key")


def pool_key(secret: Object | None) -> bytes | None:
    """The key a pool key Secret holds; None when it holds none a daemon would accept."""
    value = ((secret or {}).get("data") or {}).get(POOL_KEY_FIELD)
    if not isinstance(value, str):
        return None
    try:
        key = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None
    return key if len(key) >= tenancy.MIN_KEY_BYTES else None


def _secret(meta: dict[str, Any], field: str, value: bytes | None) -> Object:
    secret: Object = {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque"}
    if value is not None:
        secret["data"] = {field: base64.b64encode(value).decode()}
    return secret


def build_pool_key_secret(owner: Owner, namespace: str, key: bytes | None) -> Object:
    """The pool's key, next to its daemons; ``key`` None: rendered without data (offline)."""
    meta = metadata(
        owner,
        name=pool_key_name(owner.name),
        namespace=namespace,
        labels=labels(owner, app="maru-pool", component="key"),
    )
    return _secret(meta, POOL_KEY_FIELD, key)


def quota_of(quota: TenantQuota | None) -> tenancy.Quota:
    """A quota of the API (sizes as quantities) as numbers; None: nothing set."""
    if quota is None:
        return tenancy.DEFAULT_QUOTA
    return tenancy.Quota(**{name: _field(quota, name) for name in tenancy.QUOTA_FIELDS})


def effective_quota(group: TenantQuota | None, pool: MaruPoolSpec) -> tenancy.Quota:
    """The quota signed into a group's token: the one rule (:func:`maru_contracts.tenancy.effective_quota`) the
    node plugin applies at publish, over the group's ``poolQuota`` and the pool's policy."""
    return tenancy.effective_quota(quota_of(group), quota_of(pool.tenant_quota), quota_of(pool.max_tenant_quota))


def _field(quota: TenantQuota, name: str) -> int | None:
    value = getattr(quota, name)
    return parse_size(value) if isinstance(value, str) else value


def _secret_volume(name: str, secret: str, field: str, mode: int) -> Object:
    return {
        "name": name,
        "secret": {"secretName": secret, "defaultMode": mode, "items": [{"key": field, "path": field}]},
    }


def pool_key_volume(pool: str, *, reader_is_root: bool) -> Object:
    return _secret_volume(
        KEY_VOLUME, pool_key_name(pool), POOL_KEY_FIELD, ROOT_ONLY if reader_is_root else NON_ROOT_READER
    )


def pool_key_mount() -> Object:
    return {"name": KEY_VOLUME, "mountPath": KEY_DIR, "readOnly": True}


def credential_volume(socket_dir: str, cache: str, quota: TenantQuota | None) -> Object:
    """The pod volume holding its pool credential: a read-only tmpfs the CSI node plugin fills at publish.

    ``socket_dir``: the pool's socket directory on the nodes (which pool, under which socket root);
    ``cache``: the group's cache name (``cacheNamespace``, else its name), whose scope in the pod's namespace
    the token names; ``quota``: the group's ``poolQuota``, as asked for (the plugin caps it by the pool's
    ceiling, so a change of the pool's policy re-mints tokens without rolling the groups' pods).
    """
    directory = PurePosixPath(socket_dir)
    attributes = credential_attributes(directory.name, str(directory.parent), cache, quota_of(quota).encode())
    return {"name": CREDENTIAL_VOLUME, "csi": {"driver": DRIVER_NAME, "readOnly": True, "volumeAttributes": attributes}}


def credential_mount() -> Object:
    return {"name": CREDENTIAL_VOLUME, "mountPath": CREDENTIAL_DIR, "readOnly": True}
