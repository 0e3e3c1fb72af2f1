"""Pool credentials and per-tenant key scopes: what the operator issues and the pool daemons check.

One definition for both sides, as :mod:`maru_connector.poolsize` is for sizes. Standard library only:
the operator, the pool daemon and the connector all import it.

A pool has a **key**: random bytes (at least :data:`MIN_KEY_BYTES`) that only the pool's daemons and
the operator read. A **token** names a principal and carries an HMAC of it under that key::

    maru1.<principal, base64url>.<HMAC-SHA256(key, "maru-pool-token/v1\\n" + principal), base64url>

Principals are ``tenant:<scope>`` (a group's engines; the scope is ``<namespace>/<cache name>``, which
the operator derives, never the group) and ``agent:<node>`` (a node agent, towards its metadata server).
The design is stateless: a daemon holds no list of tenants, any token the key signed is valid for as
long as the key is, and a token signed by another pool's key (or by none) is refused. Revoking one
token means rotating the key.

**Key scopes.** The daemon maps every key a tenant sends to ``blake2b(key, key=scope digest)`` before it
touches the index, so two tenants' identical keys are different chunks and a tenant cannot name a key of
another: isolation no longer depends on the salt a client mixes into its own keys.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from dataclasses import dataclass
from typing import Literal

TOKEN_VERSION = "maru1"
MIN_KEY_BYTES = 32
KEY_BYTES = 32  # what the operator generates
_MAC_CONTEXT = b"maru-pool-token/v1\n"
_SCOPE_PERSON = b"maru-scope-v1"

PrincipalKind = Literal["tenant", "agent", "anonymous"]
_SIGNED_KINDS = ("tenant", "agent")


class BadToken(ValueError):
    """A token that is malformed or not signed by this pool's key; the message never quotes the token."""


class BadKey(ValueError):
    """A pool key that is too short to sign with."""


@dataclass(frozen=True)
class Principal:
    """Who a connection speaks for, once its hello was verified."""

    kind: PrincipalKind
    name: str = ""

    @property
    def scope(self) -> str:
        """The key space of a tenant's chunks; agents and anonymous clients (no authentication) share ""."""
        return self.name if self.kind == "tenant" else ""

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}" if self.name else self.kind


ANONYMOUS = Principal("anonymous")


def tenant(scope: str) -> Principal:
    if not scope:
        raise ValueError("a tenant's scope must not be empty")
    return Principal("tenant", scope)


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


def _mac(key: bytes, principal: bytes) -> bytes:
    return hmac.new(key, _MAC_CONTEXT + principal, hashlib.sha256).digest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def issue(key: bytes, principal: Principal) -> str:
    """The token of ``principal`` under the pool key ``key``."""
    if principal.kind not in _SIGNED_KINDS:
        raise ValueError(f"only {', '.join(_SIGNED_KINDS)} principals get tokens, not {principal.kind}")
    body = str(principal).encode()
    return f"{TOKEN_VERSION}.{_b64(body)}.{_b64(_mac(check_key(key), body))}"


def verify(key: bytes, token: str) -> Principal:
    """The principal ``token`` speaks for; :class:`BadToken` when it is malformed or another key signed it."""
    parts = token.strip().split(".")
    if len(parts) != 3 or parts[0] != TOKEN_VERSION:
        raise BadToken(f"not a pool token (expected {TOKEN_VERSION}.<principal>.<signature>)")
    try:
        body, mac = _unb64(parts[1]), _unb64(parts[2])
    except (binascii.Error, ValueError):
        raise BadToken("not a pool token (its parts are not base64url)") from None
    if not hmac.compare_digest(mac, _mac(key, body)):
        raise BadToken("signed by another key: it was issued for another pool (or forged)")
    kind, sep, name = body.decode("utf-8", "replace").partition(":")
    if not sep or not name or kind not in _SIGNED_KINDS:
        raise BadToken(f"names no principal this pool knows (kinds: {', '.join(_SIGNED_KINDS)})")
    return Principal(kind, name)  # type: ignore[arg-type]


class KeyScope:
    """Maps a client's chunk keys into its tenant's key space (one keyed hash per key)."""

    def __init__(self, scope: str) -> None:
        self.scope = scope
        self._key = hashlib.blake2b(scope.encode(), digest_size=32, person=_SCOPE_PERSON).digest()

    def __call__(self, key: bytes) -> bytes:
        return hashlib.blake2b(key, digest_size=32, key=self._key).digest()

    def all(self, keys: list[bytes]) -> list[bytes]:
        return [self(k) for k in keys]
