"""Who is asking, and may they: bearer tokens, RBAC, and the admission checks that depend on them.

kube-apiserver authorizes every request against the Roles, ClusterRoles and their bindings stored in
it, and two admission checks look at the requester's rights too:

* RBAC's escalation prevention: a Role or ClusterRole may grant only what its writer holds (or has
  ``escalate``), a binding may reference only a role whose rights its writer holds (or has ``bind``);
* OwnerReferencesPermissionEnforcement (on in OpenShift and many hardened clusters): changing an
  object's ownerReferences needs ``delete`` on the object, and setting ``blockOwnerDeletion`` needs
  ``update`` on the owner's ``finalizers`` subresource.

Two kinds of bearer tokens are accepted: static ones registered on the emulator
(:meth:`Emulator.add_token`), and service account tokens issued by the TokenRequest API
(``POST .../serviceaccounts/<name>/token``, :class:`TokenIssuer`), which the kubelet mounts into pods
as kube-apiserver's are: signed, expiring, bound to a pod, and void once the pod or the
ServiceAccount is gone. A request with any other token gets 401. A request without any token acts
as a cluster admin, so clients that do not care about RBAC (most tests, kubectl, helm, the local
cluster's own components) work unchanged. Not modelled: impersonation, aggregated ClusterRoles,
non-resource URL rules (discovery and health endpoints are open to every authenticated user), the
issuer's public keys (OIDC discovery): tokens are signed with a per-server secret (HS256).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

JsonObj = dict[str, Any]
RBAC = "rbac.authorization.k8s.io"


@dataclasses.dataclass(frozen=True)
class User:
    name: str
    groups: tuple[str, ...] = ("system:authenticated",)

    @classmethod
    def service_account(cls, namespace: str, name: str) -> User:
        return cls(
            f"system:serviceaccount:{namespace}:{name}",
            ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"),
        )


@dataclasses.dataclass(frozen=True)
class Attributes:
    """One RBAC question: may the user ``verb`` ``resource[/subresource]`` (named ``name``) in ``namespace``."""

    verb: str
    group: str
    resource: str
    subresource: str = ""
    namespace: str | None = None
    name: str | None = None

    @property
    def full_resource(self) -> str:
        return f"{self.resource}/{self.subresource}" if self.subresource else self.resource

    def denial(self, user: User) -> str:
        where = f' in the namespace "{self.namespace}"' if self.namespace else " at the cluster scope"
        return (
            f'User "{user.name}" cannot {self.verb} resource "{self.full_resource}" in API group "{self.group}"{where}'
        )


def rule_covers(rule: JsonObj, attrs: Attributes) -> bool:
    def has(field: str, value: str) -> bool:
        values = rule.get(field) or []
        return "*" in values or value in values

    resources = rule.get("resources") or []
    resource_ok = (
        "*" in resources
        or attrs.full_resource in resources
        or (attrs.subresource and f"{attrs.resource}/*" in resources)
    )
    names = rule.get("resourceNames") or []
    return (
        has("apiGroups", attrs.group)
        and bool(resource_ok)
        and has("verbs", attrs.verb)
        and (not names or attrs.name in names)
    )


class Authorizer:
    """RBAC over the objects stored in the emulator (``list_objects`` reads them)."""

    def __init__(self, list_objects: Callable[..., list[JsonObj]], get_object: Callable[..., JsonObj | None]) -> None:
        self._list = list_objects
        self._get = get_object

    def rules_of(self, ref: JsonObj, namespace: str | None) -> list[JsonObj]:
        """The rules of the role a binding's ``roleRef`` names."""
        if ref.get("kind") == "ClusterRole":
            role = self._get(RBAC, "clusterroles", None, ref.get("name", ""))
        else:
            role = self._get(RBAC, "roles", namespace, ref.get("name", "")) if namespace else None
        return list((role or {}).get("rules") or [])

    def rules_for(self, user: User, namespace: str | None) -> Iterator[JsonObj]:
        """Every rule that applies to ``user`` in ``namespace`` (cluster-wide ones included)."""
        for binding in self._list(RBAC, "clusterrolebindings"):
            if _binds(binding, user):
                yield from self.rules_of(binding.get("roleRef") or {}, None)
        if namespace:
            for binding in self._list(RBAC, "rolebindings", namespace):
                if _binds(binding, user):
                    yield from self.rules_of(binding.get("roleRef") or {}, namespace)

    def allowed(self, user: User, attrs: Attributes) -> bool:
        return any(rule_covers(rule, attrs) for rule in self.rules_for(user, attrs.namespace))

    def holds_all(self, user: User, rules: Iterable[JsonObj], namespace: str | None) -> list[str]:
        """The rights among ``rules`` that ``user`` lacks in ``namespace`` (escalation prevention)."""
        missing = []
        for rule in rules:
            for group in rule.get("apiGroups") or [""]:
                for resource in rule.get("resources") or []:
                    base, _, sub = resource.partition("/")
                    for verb in rule.get("verbs") or []:
                        for name in rule.get("resourceNames") or [None]:
                            attrs = Attributes(verb, group, base, sub, namespace, name)
                            if not self.allowed(user, attrs):
                                missing.append(f'{{APIGroups:["{group}"], Resources:["{resource}"], Verbs:["{verb}"]}}')
        return missing


def _binds(binding: JsonObj, user: User) -> bool:
    for subject in binding.get("subjects") or []:
        kind = subject.get("kind")
        if kind == "ServiceAccount":
            if user.name == f"system:serviceaccount:{subject.get('namespace')}:{subject.get('name')}":
                return True
        elif (kind == "User" and subject.get("name") == user.name) or (
            kind == "Group" and subject.get("name") in user.groups
        ):
            return True
    return False


# --------------------------------------------------------------------------------------------------
# Service account tokens


API_AUDIENCE = "https://kubernetes.default.svc.cluster.local"  # also the issuer, as in kube-apiserver
# kube-apiserver's --service-account-extend-token-expiration: the kubelet's default projected token
# (3607 s) is valid for a year, so pods whose token file is not refreshed keep working.
LEGACY_EXPIRATION = 3607
EXTENDED_EXPIRATION = 365 * 24 * 3600


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class TokenIssuer:
    """Signs and checks service account tokens (JWTs shaped like kube-apiserver's bound tokens)."""

    def __init__(self) -> None:
        self._key = secrets.token_bytes(32)

    def issue(self, account: JsonObj, audiences: list[str], expiration: int, pod: JsonObj | None) -> tuple[str, int]:
        """A token for ``account`` (a ServiceAccount object), bound to ``pod`` if given; (token, expiry)."""
        meta = account["metadata"]
        now = int(time.time())
        lifetime = EXTENDED_EXPIRATION if expiration == LEGACY_EXPIRATION and pod is not None else expiration
        private: JsonObj = {
            "namespace": meta["namespace"],
            "serviceaccount": {"name": meta["name"], "uid": meta.get("uid")},
        }
        if pod is not None:
            private["pod"] = {"name": pod["metadata"]["name"], "uid": pod["metadata"].get("uid")}
            if lifetime != expiration:
                private["warnafter"] = now + expiration
        claims = {
            "aud": audiences or [API_AUDIENCE],
            "iss": API_AUDIENCE,
            "iat": now,
            "nbf": now,
            "exp": now + lifetime,
            "sub": f"system:serviceaccount:{meta['namespace']}:{meta['name']}",
            "kubernetes.io": private,
        }
        header = _b64(json.dumps({"alg": "HS256", "kid": "local", "typ": "JWT"}).encode())
        body = _b64(json.dumps(claims, separators=(",", ":")).encode())
        signature = _b64(hmac.new(self._key, f"{header}.{body}".encode(), hashlib.sha256).digest())
        return f"{header}.{body}.{signature}", now + lifetime

    def claims(self, token: str) -> JsonObj | None:
        """The claims of a token this issuer signed, unexpired and meant for the API server; else None."""
        parts = token.split(".")
        if len(parts) != 3:
            return None
        expected = _b64(hmac.new(self._key, f"{parts[0]}.{parts[1]}".encode(), hashlib.sha256).digest())
        if not hmac.compare_digest(expected, parts[2]):
            return None
        try:
            claims = json.loads(_unb64(parts[1]))
        except ValueError:
            return None
        if (
            not isinstance(claims, dict)
            or claims.get("exp", 0) < time.time()
            or API_AUDIENCE not in (claims.get("aud") or [])
        ):
            return None
        return claims
