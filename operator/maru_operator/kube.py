"""The only module that talks to the Kubernetes API: create, get, list, patch, delete, events.

A small asyncio client over aiohttp using the credentials kopf logs in with (kubeconfig or the
in-cluster service account), so the operator shares one identity and never loads a second client
library's models. Responses are plain dicts, exactly as the server sent them.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import socket
import ssl
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

import aiohttp
import kopf

from maru_operator import metrics
from maru_operator.objects import Object
from maru_operator.ownership import FIELD_MANAGER

log = logging.getLogger("maru_operator.kube")


MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
# Lists of metadata only: what a check for objects gone needs, a fraction of the objects' size.
METADATA_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
# Items per list request: kube-apiserver answers a page in one etcd range read instead of one big one.
LIST_PAGE = 500
APPLY_PATCH = "application/apply-patch+yaml"
# Every write of the operator is recorded under one name in managedFields.
WRITE_PARAMS = {"fieldManager": FIELD_MANAGER}


@dataclass(frozen=True)
class Kind:
    prefix: str  # "api/v1" or "apis/<group>/<version>"
    plural: str
    namespaced: bool = True


KINDS: dict[str, Kind] = {
    "Deployment": Kind("apis/apps/v1", "deployments"),
    "DaemonSet": Kind("apis/apps/v1", "daemonsets"),
    "Service": Kind("api/v1", "services"),
    "ServiceAccount": Kind("api/v1", "serviceaccounts"),
    "Secret": Kind("api/v1", "secrets"),
    "Pod": Kind("api/v1", "pods"),
    "Event": Kind("api/v1", "events"),
    "RoleBinding": Kind("apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "NetworkPolicy": Kind("apis/networking.k8s.io/v1", "networkpolicies"),
    "PersistentVolumeClaim": Kind("api/v1", "persistentvolumeclaims"),
    "PodDisruptionBudget": Kind("apis/policy/v1", "poddisruptionbudgets"),
    "Lease": Kind("apis/coordination.k8s.io/v1", "leases"),
    "EndpointSlice": Kind("apis/discovery.k8s.io/v1", "endpointslices"),
    "MaruPool": Kind("apis/maru.io/v1alpha1", "marupools", namespaced=False),
    "InferenceGroup": Kind("apis/maru.io/v1alpha1", "inferencegroups"),
    # Optional: written only where the Gateway API Inference Extension's CRD is installed (:meth:`Kube.serves`).
    "InferencePool": Kind("apis/inference.networking.k8s.io/v1", "inferencepools"),
}


class ApiError(Exception):
    """A non-2xx answer; ``status`` is the HTTP code, ``reason`` the API's reason (AlreadyExists...)."""

    def __init__(self, status: int, reason: str, message: str, what: str) -> None:
        super().__init__(f"{what}: HTTP {status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


class Unreachable(Exception):
    """The API server did not answer at all."""


def path(kind: str, namespace: str | None = None, name: str | None = None, sub: str | None = None) -> str:
    k = KINDS[kind]
    parts = [k.prefix]
    if k.namespaced and namespace:
        parts += ["namespaces", quote(namespace, safe="")]
    parts.append(k.plural)
    if name:
        parts.append(quote(name, safe=""))
    if sub:
        parts.append(sub)
    return "/" + "/".join(parts)


def _write_temp(data: str | bytes, suffix: str) -> str:
    raw = base64.b64decode(data) if isinstance(data, str) else data
    fd, name = tempfile.mkstemp(suffix=suffix)
    with os.fdopen(fd, "wb") as f:
        f.write(raw)
    return name


def ssl_context(info: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
    if not info.server.startswith("https"):
        return False
    if info.insecure:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    else:
        ca_data = base64.b64decode(info.ca_data).decode() if isinstance(info.ca_data, str) else info.ca_data
        ctx = ssl.create_default_context(
            cafile=str(info.ca_path) if info.ca_path else None,
            cadata=ca_data.decode() if isinstance(ca_data, bytes) else ca_data,
        )
    cert = info.certificate_path or (info.certificate_data and _write_temp(info.certificate_data, ".crt"))
    key = info.private_key_path or (info.private_key_data and _write_temp(info.private_key_data, ".key"))
    if cert:
        ctx.load_cert_chain(str(cert), str(key) if key else None)
    return ctx


def login(**kwargs: Any) -> kopf.ConnectionInfo:
    """In-cluster service account first, then kubeconfig (KUBECONFIG or ~/.kube/config)."""
    settings = kwargs.pop("settings", None) or kopf.OperatorSettings()
    info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)
    if info is None:
        raise kopf.LoginError(
            "no Kubernetes credentials: not running in a pod and no kubeconfig (set KUBECONFIG or ~/.kube/config)"
        )
    return info


class Kube:
    """Async Kubernetes API client; one per operator process."""

    def __init__(self, info: kopf.ConnectionInfo, *, timeout: float = 30.0) -> None:
        self.info = info
        self.server = info.server.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=5)
        self._session: aiohttp.ClientSession | None = None
        self._closing: set[asyncio.Task[None]] = set()  # sessions of a replaced credential, closing
        self.identity = socket.gethostname()

    async def __aenter__(self) -> Kube:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": "maru-operator"}
        if self.info.token:
            headers["Authorization"] = f"{self.info.scheme or 'Bearer'} {self.info.token}"
        return headers

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            auth = None
            if self.info.username and self.info.password:
                auth = aiohttp.BasicAuth(self.info.username, self.info.password)
            connector = aiohttp.TCPConnector(ssl=ssl_context(self.info), limit=32)
            self._session = aiohttp.ClientSession(
                connector=connector, headers=self._headers(), auth=auth, timeout=self._timeout
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        url: str,
        *,
        body: Any = None,
        content_type: str = "application/json",
        params: dict[str, str] | None = None,
        what: str = "",
        accept: str | None = None,
    ) -> Any:
        try:
            return await self._request(
                method, url, body=body, content_type=content_type, params=params, what=what, accept=accept
            )
        except ApiError as err:
            if err.status != 401 or not self._relogin():
                raise
            # Service account tokens are rotated on disk; read the current one and try once more.
            return await self._request(
                method, url, body=body, content_type=content_type, params=params, what=what, accept=accept
            )

    def _relogin(self) -> bool:
        try:
            info = login()
        except Exception as err:  # a failed re-login leaves the 401 to be reported
            log.warning("re-login after HTTP 401 failed: %s", err)
            return False
        if info.token == self.info.token and info.certificate_data == self.info.certificate_data:
            return False
        self.info = info
        if self._session is not None and not self._session.closed:
            # Held until it ends: the loop keeps only a weak reference to a task.
            closing = asyncio.get_running_loop().create_task(self._session.close())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
        self._session = None
        return True

    async def _request(
        self,
        method: str,
        url: str,
        *,
        body: Any,
        content_type: str,
        params: dict[str, str] | None,
        what: str,
        accept: str | None = None,
    ) -> Any:
        full = self.server + url + (("?" + urlencode(params)) if params else "")
        data = json.dumps(body) if body is not None else None
        headers = {"Content-Type": content_type} if data is not None else {}
        if accept:
            headers["Accept"] = accept
        started = time.monotonic()
        try:
            async with self.session().request(method, full, data=data, headers=headers) as resp:
                text = await resp.text()
                metrics.API_REQUESTS.labels(method, str(resp.status)).inc()
                metrics.API_LATENCY.labels(method).observe(time.monotonic() - started)
                if resp.status >= 400:
                    try:
                        err = json.loads(text)
                        reason, message = err.get("reason", ""), err.get("message", text)
                    except ValueError:
                        reason, message = resp.reason or "", text[:200]
                    raise ApiError(resp.status, reason, message, what or f"{method} {url}")
                return json.loads(text) if text else None
        except (TimeoutError, aiohttp.ClientConnectionError, OSError) as exc:
            metrics.API_REQUESTS.labels(method, "error").inc()
            raise Unreachable(f"{method} {self.server}{url}: {exc.__class__.__name__}: {exc}") from exc

    # --- objects ----------------------------------------------------------------------------------

    async def get(self, kind: str, namespace: str | None, name: str) -> Object | None:
        try:
            return await self.request("GET", path(kind, namespace, name), what=f"get {kind} {namespace}/{name}")
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    async def list(
        self, kind: str, namespace: str | None, label_selector: dict[str, str] | str | None = None
    ) -> list[Object]:
        return (await self.list_with_version(kind, namespace, label_selector))[0]

    async def list_with_version(
        self,
        kind: str,
        namespace: str | None,
        label_selector: dict[str, str] | str | None = None,
        *,
        metadata_only: bool = False,
        page: int = LIST_PAGE,
    ) -> tuple[list[Object], str | None]:
        """The items, and the resourceVersion the list was taken at; the selector as a map or as text.

        Read in pages of ``page`` items. ``metadata_only``: each item is a PartialObjectMetadata (its
        ``metadata`` alone). A continue token that expired (410) starts the list over, once.
        """
        if isinstance(label_selector, dict):
            label_selector = ",".join(f"{k}={v}" for k, v in label_selector.items())
        base = {"labelSelector": label_selector} if label_selector else {}
        if page > 0:
            base["limit"] = str(page)
        for attempt in range(2):
            items: list[Object] = []
            version: str | None = None
            params = dict(base)
            try:
                while True:
                    result = (
                        await self.request(
                            "GET",
                            path(kind, namespace),
                            params=params or None,
                            what=f"list {kind} in {namespace}",
                            accept=METADATA_LIST if metadata_only else None,
                        )
                        or {}
                    )
                    meta = result.get("metadata") or {}
                    version = version or meta.get("resourceVersion")
                    items += result.get("items") or []
                    if not meta.get("continue"):
                        return items, version
                    params = {**base, "continue": meta["continue"]}
            except ApiError as err:
                if err.status != 410 or "continue" not in params or attempt:
                    raise
                log.info("list %s in %s: its continue token expired; listing again", kind, namespace)
        raise AssertionError("unreachable")

    async def watch(
        self,
        kind: str,
        namespace: str | None,
        label_selector: str,
        resource_version: str | None,
        *,
        timeout_seconds: int = 300,
    ) -> AsyncIterator[tuple[str, Object]]:
        """(type, object) of each watch event of ``kind`` in one namespace (None: all), from ``resource_version``
        on, until the server ends the watch (after ``timeout_seconds``). An expired version comes as an ``ERROR``
        event whose object is a Status with code 410: list again."""
        params = {"watch": "true", "allowWatchBookmarks": "true", "timeoutSeconds": str(timeout_seconds)}
        if label_selector:
            params["labelSelector"] = label_selector
        if resource_version:
            params["resourceVersion"] = resource_version
        url = f"{self.server}{path(kind, namespace)}?{urlencode(params)}"
        # No total timeout: a watch is meant to stay open; a silent connection is cut by the read timeout.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=timeout_seconds + 30)
        try:
            async with self.session().get(url, timeout=timeout) as resp:
                metrics.API_REQUESTS.labels("WATCH", str(resp.status)).inc()
                if resp.status >= 400:
                    text = await resp.text()
                    raise ApiError(resp.status, resp.reason or "", text[:200], f"watch {kind} in {namespace}")
                async for line in resp.content:
                    if line.strip():
                        event = json.loads(line)
                        yield event.get("type", ""), event.get("object") or {}
        except (TimeoutError, aiohttp.ClientConnectionError, OSError) as exc:
            metrics.API_REQUESTS.labels("WATCH", "error").inc()
            raise Unreachable(f"watch {kind} in {namespace}: {exc.__class__.__name__}: {exc}") from exc

    async def create(self, obj: Object) -> Object:
        meta = obj["metadata"]
        return await self.request(
            "POST",
            path(obj["kind"], meta.get("namespace")),
            body=obj,
            params=WRITE_PARAMS,
            what=f"create {obj['kind']} {meta.get('namespace', '')}/{meta.get('name', meta.get('generateName'))}",
        )

    async def apply(self, obj: Object, *, uid: str | None = None) -> Object:
        """Server-side apply of the whole desired ``obj``.

        The API server removes the fields this manager applied before and ``obj`` no longer sets, and
        leaves fields others set. Forced: a controller's desired state wins over hand edits of the
        fields it owns (drift correction); objects it does not control are never applied to.

        ``uid``: apply only to that very object. Without it an apply creates a missing object or merges into
        whatever holds the name; with it kube-apiserver answers 409 when the object is gone (an apply naming a
        uid never creates) and 422 when another object has the name (the uid is immutable).
        """
        meta = obj["metadata"]
        body = {**obj, "metadata": {**meta, "uid": uid}} if uid else obj
        return await self.request(
            "PATCH",
            path(obj["kind"], meta.get("namespace"), meta["name"]),
            body=body,
            content_type=APPLY_PATCH,
            params={**WRITE_PARAMS, "force": "true"},
            what=f"apply {obj['kind']} {meta.get('namespace', '')}/{meta['name']}",
        )

    async def patch(self, kind: str, namespace: str | None, name: str, patch: Object) -> Object:
        return await self.request(
            "PATCH",
            path(kind, namespace, name),
            body=patch,
            content_type=MERGE_PATCH,
            params=WRITE_PARAMS,
            what=f"patch {kind} {namespace}/{name}",
        )

    async def json_patch(self, kind: str, namespace: str | None, name: str, ops: list[Object]) -> Object:
        """A JSON patch (RFC 6902): its ``test`` operations make it conditional on what they name."""
        return await self.request(
            "PATCH",
            path(kind, namespace, name),
            body=ops,
            content_type=JSON_PATCH,
            params=WRITE_PARAMS,
            what=f"patch {kind} {namespace}/{name}",
        )

    async def patch_status(self, kind: str, namespace: str | None, name: str, status: Object) -> Object:
        return await self.request(
            "PATCH",
            path(kind, namespace, name, "status"),
            body={"status": status},
            content_type=MERGE_PATCH,
            params=WRITE_PARAMS,
            what=f"patch {kind} {namespace}/{name} status",
        )

    async def delete(self, kind: str, namespace: str | None, name: str, *, uid: str | None = None) -> None:
        """Delete (in the background); with ``uid``, only that very object, never a namesake created since."""
        body: Object = {"propagationPolicy": "Background"}
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            await self.request(
                "DELETE", path(kind, namespace, name), body=body, what=f"delete {kind} {namespace}/{name}"
            )
        except ApiError as err:
            if err.status != 404:
                raise

    async def event(self, involved: Object, *, type_: str, reason: str, message: str, now: str) -> None:
        """Record an Event on ``involved``; cluster-scoped objects' events go to ``default``, as kubectl expects."""
        meta = involved.get("metadata", {})
        namespace = meta.get("namespace") or "default"
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta.get('name', 'object')[:200]}.", "namespace": namespace},
            "involvedObject": {
                "apiVersion": involved.get("apiVersion"),
                "kind": involved.get("kind"),
                "name": meta.get("name"),
                "namespace": meta.get("namespace"),
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": "maru-operator"},
            "reportingComponent": "maru-operator",
            "reportingInstance": self.identity,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            await self.create(event)
        except (ApiError, Unreachable) as err:
            # An event is a courtesy to the reader; failing to post one must not fail the reconcile.
            log.warning("could not post event %s on %s %s: %s", reason, involved.get("kind"), meta.get("name"), err)

    async def serves(self, kind: str) -> bool:
        """Whether the API server serves ``kind`` now (its group/version's discovery lists it); False on a 404,
        which is what a group/version without any installed CRD answers. Other failures raise."""
        k = KINDS[kind]
        try:
            found = await self.request("GET", "/" + k.prefix, what=f"discover {k.prefix}") or {}
        except ApiError as err:
            if err.status == 404:
                return False
            raise
        return any(r.get("name") == k.plural for r in found.get("resources") or [])

    # --- start-up checks -------------------------------------------------------------------------

    async def preflight(self, namespace: str | None = None) -> None:
        """Raise with a one-line, actionable message when the API or the CRDs are missing.

        ``namespace``: where to look for InferenceGroups when the operator serves only some namespaces
        (it may have no right to list them cluster-wide).
        """
        try:
            await self.request("GET", "/version", what="get /version")
        except Unreachable as err:
            raise SystemExit(f"cannot reach the Kubernetes API server at {self.server}: {err.__cause__}") from None
        except ApiError as err:
            if err.status in (401, 403):
                raise SystemExit(f"the Kubernetes API server at {self.server} refused our credentials: {err}") from None
        for kind in ("MaruPool", "InferenceGroup"):
            try:
                await self.request("GET", path(kind, namespace), params={"limit": "1"}, what=f"list {kind}")
            except ApiError as err:
                if err.status == 404:
                    raise SystemExit(
                        f"the {kind} CRD is not installed on {self.server}: run `kubectl apply -f crds/` "
                        "(or install the Helm chart)"
                    ) from None
                if err.status == 403:
                    raise SystemExit(f"no permission to list {kind}s on {self.server}: {err.message}") from None
                raise


StatusFetcher = Callable[[str], Awaitable[dict[str, Any] | None]]


async def fetch_daemon_status(url: str, *, timeout: float = 1.0) -> dict[str, Any] | None:
    """GET a pool daemon's /status JSON; None when it does not answer in time (never raises)."""
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session,
            session.get(url) as resp,
        ):
            if resp.status != 200:
                return None
            data = await resp.json(content_type=None)
            return data if isinstance(data, dict) else None
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
        return None
