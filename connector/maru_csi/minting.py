"""What the CSI node plugin mints pool credentials from: the pool's key and quota policy, on each pool node.

A vLLM pod's pool credential (the token of ``tenant:<namespace>/<cache>``, :mod:`maru_contracts.tenancy`)
is minted by the node plugin when the kubelet publishes the pod's credential volume, not issued by the
operator as a Secret in the pod's namespace. So the operator reads and writes Secrets only in its own
namespace (the pools' keys), and the namespace in a token comes from the kubelet, never from the pod.

The pool's agent DaemonSet brings the material to each pool node: its init container ``credentials``
(``python -m maru_csi.minting``, root with every capability dropped) reads the pool key from
the key Secret it mounts and writes ``<socket root>/_credentials/<pool>.json``, atomically, mode 0600 in a
0700 directory. ``_credentials`` can never be a pool's directory (pool directories are DNS-1123 names), so
it is never published into a pod. The plugin reads the file only when it and its directory are owned by
root (or the plugin's own user) and closed to group and others: anything else may have been written, or
read, by someone other than the pool's infrastructure.

The file::

    {"version": 1, "pool": "cxl-pool", "key": "<base64>", "tenantQuota": "pins=64",
     "maxTenantQuota": "bytes=1073741824"}

``tenantQuota`` and ``maxTenantQuota`` are the MaruPool's, resolved to numbers by the operator
(``bytes=N,pins=N,leases=N``, empty for none): the default of a group that asks for nothing, and the
ceiling no pod's request passes.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import stat
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from maru_common.cmdline import OneLineParser
from maru_common.files import replace_file
from maru_contracts import tenancy
from maru_contracts.csi import CREDENTIALS_DIR, POLICY_FIELDS, pool_dir_error

VERSION = 1
FIELDS = ("version", "pool", "key", "tenantQuota", "maxTenantQuota")
# A key and two quotas; anything larger is not a file the init container wrote.
MAX_BYTES = 4 << 10


class MintingError(Exception):
    """The pool's minting material is missing, unsafe or malformed: no credential is minted until it is fixed.

    Messages never quote the key.
    """


@dataclass(frozen=True)
class Material:
    """A pool's key and quota policy, as its agent's init container wrote them on this node."""

    pool: str
    key: bytes = field(repr=False)  # never in a log line
    default: tenancy.Quota = tenancy.DEFAULT_QUOTA  # the pool's tenantQuota
    ceiling: tenancy.Quota = tenancy.DEFAULT_QUOTA  # the pool's maxTenantQuota

    def mint(self, namespace: str, cache: str, requested: tenancy.Quota = tenancy.DEFAULT_QUOTA) -> tuple[str, str]:
        """(token, scope) of the cache ``cache`` in ``namespace``, its quota the request capped by the pool."""
        scope = tenancy.tenant_scope(namespace, cache)
        quota = tenancy.effective_quota(requested, self.default, self.ceiling)
        return tenancy.issue(self.key, tenancy.tenant(scope, quota)), scope

    def quota_for(self, requested: tenancy.Quota) -> tenancy.Quota:
        return tenancy.effective_quota(requested, self.default, self.ceiling)


def material_path(socket_root: str, pool: str) -> str:
    return os.path.join(socket_root, CREDENTIALS_DIR, f"{pool}.json")


def _quota(doc: dict[str, Any], name: str, where: str) -> tenancy.Quota:
    value = doc.get(name, "")
    if not isinstance(value, str):
        raise MintingError(f"{where}: {name} is not a quota text (bytes=N,pins=N,leases=N)")
    try:
        return tenancy.Quota.decode(value)
    except ValueError as err:
        raise MintingError(f"{where}: {name} {value!r}: {err}") from None


def parse_policy(text: str, where: str) -> tuple[tenancy.Quota, tenancy.Quota]:
    try:
        doc = json.loads(text)
    except ValueError as err:
        raise MintingError(f"{where} is not JSON ({err})") from None
    if not isinstance(doc, dict) or set(doc) - set(POLICY_FIELDS):
        raise MintingError(f"{where} is not an object of {', '.join(POLICY_FIELDS)}")
    return _quota(doc, "tenantQuota", where), _quota(doc, "maxTenantQuota", where)


def parse(text: str | bytes, where: str) -> Material:
    """Read a minting file strictly; anything unexpected is a :class:`MintingError`."""
    try:
        doc = json.loads(text)
    except ValueError:
        raise MintingError(f"{where} is not JSON") from None  # the parser's message could quote the key
    if not isinstance(doc, dict):
        raise MintingError(f"{where} is not a JSON object")
    if doc.get("version") != VERSION:
        raise MintingError(f"{where} has version {doc.get('version')!r}; this plugin reads version {VERSION}")
    if set(doc) != set(FIELDS):
        raise MintingError(f"{where} has fields {sorted(doc)}, not {sorted(FIELDS)}")
    pool = doc["pool"]
    if not isinstance(pool, str) or pool_dir_error(pool):
        raise MintingError(f"{where} names no pool directory")
    try:
        key = tenancy.check_key(base64.b64decode(doc["key"], validate=True))
    except (TypeError, binascii.Error, ValueError) as err:
        reason = str(err) if isinstance(err, tenancy.BadKey) else "not base64"
        raise MintingError(f"{where}: key {reason}") from None
    return Material(pool, key, _quota(doc, "tenantQuota", where), _quota(doc, "maxTenantQuota", where))


def _trusted(st: os.stat_result) -> bool:
    return st.st_uid in (0, os.geteuid()) and not st.st_mode & 0o077


def read(socket_root: str, pool: str) -> Material:
    """The minting material of ``pool`` on this node; :class:`MintingError` when it is missing or unsafe.

    The directory is opened (never followed if it is a link) and checked through that descriptor, and the file
    is opened relative to it: what was checked is what is read, even if ``_credentials`` is swapped for a link
    in between.
    """
    directory = os.path.join(socket_root, CREDENTIALS_DIR)
    path = material_path(socket_root, pool)
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise MintingError(
            f"{directory} is missing: the pool's agent on this node writes it before it starts "
            "(an agent rendered by an older operator does not)"
        ) from None
    except OSError as err:
        raise MintingError(
            f"{directory} cannot be opened as a directory ({os.strerror(err.errno or 0)}): only a "
            "root-owned directory closed to group and others, not a link, is trusted"
        ) from None
    try:
        dst = os.fstat(dir_fd)
        if not stat.S_ISDIR(dst.st_mode) or not _trusted(dst):
            raise MintingError(
                f"{directory} is owned by uid {dst.st_uid} with mode {stat.filemode(dst.st_mode)}: "
                "only a root-owned directory closed to group and others is trusted"
            )
        try:
            fd = os.open(
                os.path.basename(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd
            )
        except FileNotFoundError:
            raise MintingError(
                f"{path} is missing: the pool's agent on this node writes it before it starts "
                "(an agent rendered by an older operator does not)"
            ) from None
        except OSError as err:
            raise MintingError(f"{path} cannot be opened ({os.strerror(err.errno or 0)})") from None
    finally:
        os.close(dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise MintingError(f"{path} is not a regular file")
        if not _trusted(st):
            raise MintingError(
                f"{path} is owned by uid {st.st_uid} with mode {stat.filemode(st.st_mode)}: only a "
                "root-owned file closed to group and others is trusted"
            )
        if st.st_size > MAX_BYTES:
            raise MintingError(f"{path} is larger than {MAX_BYTES} bytes")
        data = os.read(fd, MAX_BYTES + 1)
    finally:
        os.close(fd)
    material = parse(data, path)
    if material.pool != pool:
        raise MintingError(f"{path} is pool {material.pool!r}'s, not {pool!r}'s")
    return material


def render(pool: str, key: bytes, default: tenancy.Quota, ceiling: tenancy.Quota) -> str:
    doc = {
        "version": VERSION,
        "pool": pool,
        "key": base64.b64encode(key).decode(),
        "tenantQuota": default.encode(),
        "maxTenantQuota": ceiling.encode(),
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def write(socket_root: str, pool: str, key: bytes, default: tenancy.Quota, ceiling: tenancy.Quota) -> str:
    """Write the pool's minting file atomically (a reader sees the old file or the new one), 0600 in 0700."""
    text = render(pool, key, default, ceiling)
    parse(text, "the minting document")  # never write what the plugin would refuse
    directory = os.path.join(socket_root, CREDENTIALS_DIR)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    # The kubelet creates a hostPath directory 0755: close it before the key goes in.
    os.chmod(directory, 0o700)
    path = material_path(socket_root, pool)
    return replace_file(os.path.dirname(path), os.path.basename(path), text + "\n", 0o600)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m maru_csi.minting --socket-root DIR --pool NAME --key-file FILE --policy JSON``."""
    parser = OneLineParser(prog="maru-minting", description="Write a pool's credential minting material on this node.")
    parser.add_argument("--socket-root", required=True, help="the pools' socket root on the node (the plugin's)")
    parser.add_argument("--pool", required=True, help="the pool's directory name under the socket root")
    parser.add_argument("--key-file", required=True, help="the pool key (the mounted key Secret)")
    parser.add_argument("--policy", required=True, help="the pool's tenantQuota and maxTenantQuota (JSON)")
    args = parser.parse_args(argv)
    error = pool_dir_error(args.pool)
    if error:
        parser.error(f"--pool: {error}")
    try:
        default, ceiling = parse_policy(args.policy, "--policy")
        with open(args.key_file, "rb") as fh:
            key = tenancy.check_key(fh.read())
    except MintingError as err:
        parser.error(str(err))
    except OSError as err:
        parser.error(f"--key-file {args.key_file}: {err.strerror}")
    except tenancy.BadKey as err:
        parser.error(f"--key-file {args.key_file} {err}")
    path = write(args.socket_root, args.pool, key, default, ceiling)
    print(f"maru-minting wrote {path}: pool {args.pool}, tenantQuota {default}, maxTenantQuota {ceiling}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
