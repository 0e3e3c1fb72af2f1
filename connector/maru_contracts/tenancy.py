"""Pool credentials and per-tenant key scopes: what the operator issues and the pool daemons check.

One definition for both sides, as :mod:`maru_contracts.poolsize` is for sizes. Standard library only:
the operator, the pool daemon and the connector all import it.

A pool has a **key**: random bytes (at least :data:`MIN_KEY_BYTES`) that only the pool's daemons and
the operator read. A **token** names a principal and carries an HMAC of it under that key::

    maru1.<principal, base64url>.<HMAC-SHA256(key, "maru-pool-token/v1\\n" + principal), base64url>

Principals are ``tenant:<scope>`` (a group's engines; the scope is ``<namespace>/<cache name>``, which
the operator derives, never the group) and ``agent:<node>`` (a node agent, towards its metadata server).
The design is stateless: a daemon holds no list of tenants, any token the key signed is valid for as
long as the key is, and a token signed by another pool's key (or by none) is refused. Revoking one
token means rotating the key.

**Quotas travel in the token.** A tenant's token may carry its :class:`Quota` (bytes stored, pins and
write leases outstanding), signed with the principal, so the daemon learns each tenant's limits at its
hello with no configuration to reload and no tenant list to keep::

    maru2.<principal, base64url>.<quota, base64url>.<HMAC-SHA256(key, "maru-pool-token/v2\n" + principal
                                                                 + "\n" + quota), base64url>

The quota is ``bytes=N,pins=N,leases=N`` (each field optional, in that order). A ``maru1`` token, and a
field a ``maru2`` token leaves out, mean "the pool's default" (see ``maru_pool.quota``). A
token with no quota is still issued as ``maru1``, so credentials of pools without quotas stay as they
were. Changing the quota inside a token breaks its signature; like revocation, *lowering* a tenant's
quota binds a tenant that kept a copy of its old token only once the key is rotated.

**Key scopes.** The daemon maps every key a tenant sends to ``blake2b(key, key=scope digest)`` before it
touches the index, so two tenants' identical keys are different chunks and a tenant cannot name a key of
another: isolation no longer depends on the salt a client mixes into its own keys.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from dataclasses import dataclass, field
from typing import Literal

TOKEN_VERSION = "maru1"
QUOTA_TOKEN_VERSION = "maru2"  # a token that carries a quota
MIN_KEY_BYTES = 32
KEY_BYTES = 32  # what the operator generates
_MAC_CONTEXT = b"maru-pool-token/v1\n"
_MAC_CONTEXT_V2 = b"maru-pool-token/v2\n"
QUOTA_FIELDS = ("bytes", "pins", "leases")
# The pool daemons' defaults for a token that sets no pins or leases (and their default hard ceiling): see
# maru_pool.quota. Bytes default to three quarters of the pool, which only the daemon knows.
DAEMON_DEFAULTS: dict[str, int] = {"pins": 65536, "leases": 16384}
# Bounds of a quota field: positive, and no absurd numbers (2**63 bytes is far beyond any memory).
MAX_QUOTA_VALUE = 2**63 - 1
_SCOPE_PERSON = b"maru-scope-v1"

PrincipalKind = Literal["tenant", "agent", "anonymous"]
_SIGNED_KINDS = ("tenant", "agent")


class BadToken(ValueError):
    """A token that is malformed or not signed by this pool's key; the message never quotes the token."""


class BadKey(ValueError):
    """A pool key that is too short to sign with."""


@dataclass(frozen=True)
class Quota:
    """A tenant's limits; a field left None is the pool's default for it (the daemon resolves it).

    ``bytes``: pool memory the tenant's chunks take, stored or being written (in allocation units, so a
    one-byte chunk counts 4 KiB); ``pins``: read pins outstanding; ``leases``: write leases outstanding.
    """

    bytes: int | None = None
    pins: int | None = None
    leases: int | None = None

    def __post_init__(self) -> None:
        for name in QUOTA_FIELDS:
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_QUOTA_VALUE
            ):
                raise ValueError(f"quota {name} must be a whole number from 1 to {MAX_QUOTA_VALUE}, not {value!r}")

    @property
    def empty(self) -> bool:
        return all(getattr(self, name) is None for name in QUOTA_FIELDS)

    def encode(self) -> str:
        """The canonical text signed into a token: ``bytes=N,pins=N,leases=N``, set fields only."""
        return ",".join(f"{n}={getattr(self, n)}" for n in QUOTA_FIELDS if getattr(self, n) is not None)

    @classmethod
    def decode(cls, text: str) -> Quota:
        """The inverse of :meth:`encode`; ValueError for anything :meth:`encode` would not write."""
        values: dict[str, int] = {}
        for part in text.split(",") if text else []:
            name, sep, value = part.partition("=")
            if not sep or name not in QUOTA_FIELDS or name in values:
                raise ValueError(f"unknown or repeated quota field {name!r} (fields: {', '.join(QUOTA_FIELDS)})")
            if not value.isascii() or not value.isdigit() or value.startswith("0"):
                raise ValueError(f"quota {name}: {value!r} is not a positive whole number")
            values[name] = int(value)
        quota = cls(**values)
        if quota.encode() != text:
            raise ValueError("quota fields out of order")
        return quota

    def __str__(self) -> str:
        return self.encode() or "default"


DEFAULT_QUOTA = Quota()


@dataclass(frozen=True)
class Principal:
    """Who a connection speaks for, once its hello was verified.

    ``quota`` (tenants only) is what the token carried; it is not part of the principal's identity: two
    tokens of one tenant with different quotas speak for the same tenant.
    """

    kind: PrincipalKind
    name: str = ""
    quota: Quota = field(default=DEFAULT_QUOTA, compare=False)

    @property
    def scope(self) -> str:
        """The key space of a tenant's chunks; agents and anonymous clients (no authentication) share ""."""
        return self.name if self.kind == "tenant" else ""

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}" if self.name else self.kind


ANONYMOUS = Principal("anonymous")


def tenant(scope: str, quota: Quota = DEFAULT_QUOTA) -> Principal:
    if not scope:
        raise ValueError("a tenant's scope must not be empty")
    return Principal("tenant", scope, quota)


def agent(node: str) -> Principal:
    if not node:
        raise ValueError("an agent's node name must not be empty")
    return Principal("agent", node)


def check_key(key: bytes) -> bytes:
    if len(key) < MIN_KEY_BYTES:
        raise BadKey(
            f"holds {len(key)} bytes; a pool key needs at least {MIN_KEY_BYTES} "
            f"(make one with: head -c {KEY_BYTES} /dev/urandom > FILE)"
        )
    return key


def _mac(key: bytes, signed: bytes, context: bytes = _MAC_CONTEXT) -> bytes:
    return hmac.new(key, context + signed, hashlib.sha256).digest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    """Strict: only what :func:`_b64` writes. Lenient decoding drops stray characters and ignores trailing
    bits, so many texts would be one token (a token would not be its own identity in logs and caches)."""
    data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    if _b64(data) != text:
        raise ValueError("not canonical base64url")
    return data


def issue(key: bytes, principal: Principal) -> str:
    """The token of ``principal`` under the pool key ``key``."""
    if principal.kind not in _SIGNED_KINDS:
        raise ValueError(f"only {', '.join(_SIGNED_KINDS)} principals get tokens, not {principal.kind}")
    body = str(principal).encode()
    if principal.quota.empty:
        return f"{TOKEN_VERSION}.{_b64(body)}.{_b64(_mac(check_key(key), body))}"
    if principal.kind != "tenant":
        raise ValueError("only tenants have quotas")
    quota = principal.quota.encode().encode()
    mac = _mac(check_key(key), body + b"\n" + quota, _MAC_CONTEXT_V2)
    return f"{QUOTA_TOKEN_VERSION}.{_b64(body)}.{_b64(quota)}.{_b64(mac)}"


def verify(key: bytes, token: str) -> Principal:
    """The principal ``token`` speaks for; :class:`BadToken` when it is malformed or another key signed it."""
    parts = token.strip().split(".")
    versions = {TOKEN_VERSION: 3, QUOTA_TOKEN_VERSION: 4}  # a quota token has one part more
    if versions.get(parts[0]) != len(parts):
        raise BadToken(
            f"not a pool token (expected {TOKEN_VERSION}.<principal>.<signature> or "
            f"{QUOTA_TOKEN_VERSION}.<principal>.<quota>.<signature>)"
        )
    try:
        fields = [_unb64(p) for p in parts[1:]]
    except (binascii.Error, ValueError):
        raise BadToken("not a pool token (its parts are not canonical unpadded base64url)") from None
    body, mac = fields[0], fields[-1]
    # The quota is signed with the principal: a token whose quota was changed is a forgery.
    expected = _mac(key, body) if len(fields) == 2 else _mac(key, body + b"\n" + fields[1], _MAC_CONTEXT_V2)
    if not hmac.compare_digest(mac, expected):
        raise BadToken("signed by another key: it was issued for another pool (or forged)")
    kind, sep, name = body.decode("utf-8", "replace").partition(":")
    if not sep or not name or kind not in _SIGNED_KINDS:
        raise BadToken(f"names no principal this pool knows (kinds: {', '.join(_SIGNED_KINDS)})")
    quota = DEFAULT_QUOTA
    if len(fields) == 3:
        try:
            quota = Quota.decode(fields[1].decode("ascii"))
        except (UnicodeDecodeError, ValueError) as err:
            # Signed by this pool's key, so written by a newer operator: refuse rather than drop a limit.
            raise BadToken(f"carries a quota this pool daemon cannot read ({err}); upgrade the pool daemons") from None
        if kind != "tenant" and not quota.empty:
            raise BadToken("carries a quota, which only tenants have")
    return Principal(kind, name, quota)  # type: ignore[arg-type]


class KeyScope:
    """Maps a client's chunk keys into its tenant's key space (one keyed hash per key)."""

    def __init__(self, scope: str) -> None:
        self.scope = scope
        self._key = hashlib.blake2b(scope.encode(), digest_size=32, person=_SCOPE_PERSON).digest()

    def __call__(self, key: bytes) -> bytes:
        return hashlib.blake2b(key, digest_size=32, key=self._key).digest()

    def all(self, keys: list[bytes]) -> list[bytes]:
        return [self(k) for k in keys]


def effective_quota(requested: Quota, default: Quota = DEFAULT_QUOTA, ceiling: Quota = DEFAULT_QUOTA) -> Quota:
    """The quota signed into a tenant's token, field by field: the tenant's request, else the pool's
    default, capped by the pool's ceiling (which is also the value where neither sets one); None: the
    daemon's default.

    Where the pool sets no ceiling for a field, the pool's default is the ceiling (for pins and leases without
    one, the daemon's default): a tenant may ask for less than the pool gives it, never for more. Whoever
    writes a pod's volume attributes writes the request, so without this a pod would raise its own quota;
    raising one is the pool owner's call (``maxTenantQuota``). Bytes without a pool default or ceiling are as
    asked: the daemon holds them to the pool, and its memory does not grow with them.

    One rule for whoever signs tokens: the operator (which renders a group's request) and the CSI node
    plugin (which mints the token at publish and must hold any pod to its pool's policy).
    """
    values: dict[str, int | None] = {}
    for name in QUOTA_FIELDS:
        asked, pool_default, cap = getattr(requested, name), getattr(default, name), getattr(ceiling, name)
        wanted = pool_default if asked is None else asked
        if wanted is None:
            values[name] = cap
            continue
        if cap is None:
            cap = pool_default if pool_default is not None else DAEMON_DEFAULTS.get(name)
        values[name] = wanted if cap is None else min(wanted, cap)
    return Quota(**values)


MAX_SCOPE = 253
_SCOPE_HASH_LEN = 8


def tenant_scope(namespace: str, cache: str) -> str:
    """A tenant's key scope: ``<namespace>/<cache>``, hashed down to :data:`MAX_SCOPE` characters.

    The namespace always comes first, so a cache named ``B/x`` in namespace A is ``A/B/x``, never B's.
    The operator (status, connector salt) and the CSI node plugin (minting) must agree on it exactly.
    """
    if not namespace or not cache:
        raise ValueError("a tenant scope needs a namespace and a cache name")
    scope = f"{namespace}/{cache}"
    if len(scope) <= MAX_SCOPE:
        return scope
    digest = hashlib.sha256(scope.encode()).hexdigest()[:_SCOPE_HASH_LEN]
    return scope[: MAX_SCOPE - _SCOPE_HASH_LEN - 1] + "-" + digest
