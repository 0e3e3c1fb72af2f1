"""Who is asking, and may they: bearer tokens, RBAC, and the admission checks that depend on them.

kube-apiserver authorizes every request against the Roles, ClusterRoles and their bindings stored in
it, and two admission checks look at the requester's rights too:

* RBAC's escalation prevention: a Role or ClusterRole may grant only what its writer holds (or has
  ``escalate``), a binding may reference only a role whose rights its writer holds (or has ``bind``);
* OwnerReferencesPermissionEnforcement (on in OpenShift and many hardened clusters): changing an
  object's ownerReferences needs ``delete`` on the object, and setting ``blockOwnerDeletion`` needs
  ``update`` on the owner's ``finalizers`` subresource.

Tokens are registered on the emulator (:meth:`Emulator.add_token`); a request with an unknown token
gets 401. A request without any token acts as a cluster admin, so clients that do not care about RBAC
(most tests, kubectl, helm) work unchanged. Not modelled: impersonation, aggregated ClusterRoles,
non-resource URL rules (discovery and health endpoints are open to every authenticated user).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

JsonObj = dict[str, Any]
RBAC = 'rbac.authorization.k8s.io'


@dataclasses.dataclass(frozen=True)
class User:
    name: str
    groups: tuple[str, ...] = ('system:authenticated',)

    @classmethod
    def service_account(cls, namespace: str, name: str) -> User:
        return cls(f'system:serviceaccount:{namespace}:{name}',
                   ('system:serviceaccounts', f'system:serviceaccounts:{namespace}', 'system:authenticated'))


@dataclasses.dataclass(frozen=True)
class Attributes:
    """One RBAC question: may the user ``verb`` ``resource[/subresource]`` (named ``name``) in ``namespace``."""

    verb: str
    group: str
    resource: str
    subresource: str = ''
    namespace: str | None = None
    name: str | None = None

    @property
    def full_resource(self) -> str:
        return f'{self.resource}/{self.subresource}' if self.subresource else self.resource

    def denial(self, user: User) -> str:
        where = f' in the namespace "{self.namespace}"' if self.namespace else ' at the cluster scope'
        return (f'User "{user.name}" cannot {self.verb} resource "{self.full_resource}" in API group '
                f'"{self.group}"{where}')


def rule_covers(rule: JsonObj, attrs: Attributes) -> bool:
    def has(field: str, value: str) -> bool:
        values = rule.get(field) or []
        return '*' in values or value in values

    resources = rule.get('resources') or []
    resource_ok = ('*' in resources or attrs.full_resource in resources
                   or (attrs.subresource and f'{attrs.resource}/*' in resources))
    names = rule.get('resourceNames') or []
    return (has('apiGroups', attrs.group) and bool(resource_ok) and has('verbs', attrs.verb)
            and (not names or attrs.name in names))


class Authorizer:
    """RBAC over the objects stored in the emulator (``list_objects`` reads them)."""

    def __init__(self, list_objects: Callable[..., list[JsonObj]], get_object: Callable[..., JsonObj | None]) -> None:
        self._list = list_objects
        self._get = get_object

    def rules_of(self, ref: JsonObj, namespace: str | None) -> list[JsonObj]:
        """The rules of the role a binding's ``roleRef`` names."""
        if ref.get('kind') == 'ClusterRole':
            role = self._get(RBAC, 'clusterroles', None, ref.get('name', ''))
        else:
            role = self._get(RBAC, 'roles', namespace, ref.get('name', '')) if namespace else None
        return list((role or {}).get('rules') or [])

    def rules_for(self, user: User, namespace: str | None) -> Iterator[JsonObj]:
        """Every rule that applies to ``user`` in ``namespace`` (cluster-wide ones included)."""
        for binding in self._list(RBAC, 'clusterrolebindings'):
            if _binds(binding, user):
                yield from self.rules_of(binding.get('roleRef') or {}, None)
        if namespace:
            for binding in self._list(RBAC, 'rolebindings', namespace):
                if _binds(binding, user):
                    yield from self.rules_of(binding.get('roleRef') or {}, namespace)

    def allowed(self, user: User, attrs: Attributes) -> bool:
        return any(rule_covers(rule, attrs) for rule in self.rules_for(user, attrs.namespace))

    def holds_all(self, user: User, rules: Iterable[JsonObj], namespace: str | None) -> list[str]:
        """The rights among ``rules`` that ``user`` lacks in ``namespace`` (escalation prevention)."""
        missing = []
        for rule in rules:
            for group in rule.get('apiGroups') or ['']:
                for resource in rule.get('resources') or []:
                    base, _, sub = resource.partition('/')
                    for verb in rule.get('verbs') or []:
                        for name in rule.get('resourceNames') or [None]:
                            attrs = Attributes(verb, group, base, sub, namespace, name)
                            if not self.allowed(user, attrs):
                                missing.append(f'{{APIGroups:["{group}"], Resources:["{resource}"], '
                                               f'Verbs:["{verb}"]}}')
        return missing


def _binds(binding: JsonObj, user: User) -> bool:
    for subject in binding.get('subjects') or []:
        kind = subject.get('kind')
        if kind == 'ServiceAccount':
            if user.name == f'system:serviceaccount:{subject.get("namespace")}:{subject.get("name")}':
                return True
        elif (kind == 'User' and subject.get('name') == user.name) or (
                kind == 'Group' and subject.get('name') in user.groups):
            return True
    return False
