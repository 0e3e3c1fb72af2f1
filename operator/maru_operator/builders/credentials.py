"""The pool's key and the groups' credentials: two Secrets the operator writes, and where pods mount them.

* ``<pool>-key`` (release namespace, owned by the MaruPool): random bytes the operator generates once. Only
  the operator and the pool's daemons read it; the daemons verify every client's hello against it.
* ``<group>-pool-credential`` (the group's namespace, owned by the group): the token of the group's cache
  scope under its pool's key (:mod:`maru_connector.tenancy`), mounted into the group's vLLM pods; the
  connector config names the file. A group's engines can read their own token and nothing else: the
  pool's key never leaves the release namespace.

A group's **quota** in its pool travels inside its token, signed (:func:`effective_quota`: the group's
``poolQuota``, else the pool's ``tenantQuota``, capped by the pool's ``maxTenantQuota``): the daemons learn
it at the engines' hello, with no tenant list and no restart. A group with no quota anywhere gets the token
it always had (``maru1``), which the daemons read as "the pool's defaults".

Tokens are derived, not stored anywhere else: the operator recomputes a group's from its pool's key on every
pass, so there is nothing to keep in sync and a new key re-issues every credential. The builders take the
key as an argument (None when rendering offline: the Secrets then carry no data).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from maru_connector import tenancy
from maru_connector.poolsize import parse_size
from maru_operator.api.marupool import MaruPoolSpec, TenantQuota
from maru_operator.builders.common import LABEL_POOL, Object, Owner, labels, metadata
from maru_operator.names import child_name, label_value

POOL_KEY_FIELD = "key"
TOKEN_FIELD = "token"

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


def credential_name(group: str) -> str:
    return child_name(group, "pool-credential")


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
    meta = metadata(owner, name=pool_key_name(owner.name), namespace=namespace,
                    labels=labels(owner, app="maru-pool", component="key"))
    return _secret(meta, POOL_KEY_FIELD, key)


def effective_quota(group: TenantQuota | None, pool: MaruPoolSpec) -> tenancy.Quota:
    """The quota signed into a group's token, field by field: the group's, else the pool's default, capped by
    the pool's ceiling (which is also the default where neither sets one); None: the daemon's default."""
    values: dict[str, int | None] = {}
    for name in tenancy.QUOTA_FIELDS:
        wanted = _field(group, name)
        if wanted is None:
            wanted = _field(pool.tenant_quota, name)
        ceiling = _field(pool.max_tenant_quota, name)
        values[name] = ceiling if wanted is None else wanted if ceiling is None else min(wanted, ceiling)
    return tenancy.Quota(**values)


def _field(quota: TenantQuota | None, name: str) -> int | None:
    value = getattr(quota, name) if quota is not None else None
    return parse_size(value) if isinstance(value, str) else value


def build_group_credential(
    owner: Owner, pool: str, scope: str, key: bytes | None, quota: tenancy.Quota = tenancy.DEFAULT_QUOTA
) -> Object:
    """The group's token for ``scope`` and ``quota`` under its pool's ``key`` (None: rendered without data)."""
    meta = metadata(owner, name=credential_name(owner.name), namespace=owner.namespace, labels={
        **labels(owner, app="vllm", component="pool-credential"), LABEL_POOL: label_value(pool)})
    token = tenancy.issue(key, tenancy.tenant(scope, quota)).encode() if key is not None else None
    return _secret(meta, TOKEN_FIELD, token)


def _secret_volume(name: str, secret: str, field: str, mode: int) -> Object:
    return {"name": name, "secret": {"secretName": secret, "defaultMode": mode,
                                     "items": [{"key": field, "path": field}]}}


def pool_key_volume(pool: str, *, reader_is_root: bool) -> Object:
    return _secret_volume(KEY_VOLUME, pool_key_name(pool), POOL_KEY_FIELD, ROOT_ONLY if reader_is_root
                          else NON_ROOT_READER)


def pool_key_mount() -> Object:
    return {"name": KEY_VOLUME, "mountPath": KEY_DIR, "readOnly": True}


def credential_volume(group: str) -> Object:
    return _secret_volume(CREDENTIAL_VOLUME, credential_name(group), TOKEN_FIELD, NON_ROOT_READER)


def credential_mount() -> Object:
    return {"name": CREDENTIAL_VOLUME, "mountPath": CREDENTIAL_DIR, "readOnly": True}
