"""The API server of the local cluster, in its own thread and event loop, driven synchronously.

Tests (through ``tests/k8s/fixtures.py``) and the demo both use :class:`KubeEmulator`. Point clients
at ``url`` / ``kubeconfig``:

* kopf in-process: ``@kopf.on.login()`` returning ``kube.kopf_connection()``
  (or set ``KUBECONFIG=kube.kubeconfig`` and use ``kopf.login_with_kubeconfig``);
* ``kopf run`` / any subprocess: pass ``env=kube.env()`` (it sets ``KUBECONFIG``);
* kubectl: ``kube.kubectl('apply', '--validate=false', '-f', path)``;
* the kubernetes client: ``kube.api_client()``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import pathlib
import re
import subprocess
import threading
import uuid
from collections.abc import Callable, Collection, Iterator
from typing import Any, TypeVar

import aiohttp.test_utils
import yaml

from maru_localcluster import tools
from maru_localcluster.apiserver import ApiError, Emulator, Fault, JsonObj, RecordedRequest
from maru_localcluster.authz import Attributes, User

T = TypeVar("T")

DEFAULT_TIMEOUT = 30.0


def parse_resource(resource: str) -> tuple[str, str]:
    """``'deployments.apps'`` → ``('apps', 'deployments')``; ``'configmaps'`` → ``('', 'configmaps')``."""
    plural, _, group = resource.partition(".")
    return group, plural


class KubeEmulator:
    """A running emulator (its own thread and event loop) and a synchronous API to drive it from tests.

    Every method that touches the emulator's state runs on the emulator's loop, so watchers are
    notified exactly as for HTTP writes. Writes made here are not in the request log.
    """

    def __init__(self, workdir: pathlib.Path, *, validate_schemas: bool = True, **options: Any) -> None:
        self.workdir = workdir
        self._options = {"validate_schemas": validate_schemas, **options}  # Emulator's attributes
        self._loop: asyncio.AbstractEventLoop | None = None
        self._emulator: Emulator | None = None
        self._server: aiohttp.test_utils.RawTestServer | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="k8s-emulator", daemon=True)
        self._error: BaseException | None = None
        self.url = ""
        self.kubeconfig = workdir / "kubeconfig"

    # ---------------------------------------------------------------------------------------------
    # Lifecycle.

    def start(self) -> KubeEmulator:
        self._thread.start()
        if not self._ready.wait(DEFAULT_TIMEOUT) or self._error is not None:
            raise RuntimeError(f"the emulator did not start: {self._error!r}")
        tools.write_kubeconfig(self.url, self.kubeconfig)
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(DEFAULT_TIMEOUT)

    def __enter__(self) -> KubeEmulator:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # surfaced by start()
            self._error = e
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._emulator = Emulator(**self._options)
        async with self._emulator:
            self._server = aiohttp.test_utils.RawTestServer(
                self._emulator, host="127.0.0.1", port=None, shutdown_timeout=2
            )
            await self._server.start_server()
            self.url = str(self._server.make_url("")).rstrip("/")
            self._ready.set()
            await self._stop.wait()
            self._emulator.stop_watches()
            await asyncio.sleep(0)  # let the watch handlers see the end of their streams
            await self._server.close()

    # ---------------------------------------------------------------------------------------------
    # Running code on the emulator's loop.

    @property
    def emulator(self) -> Emulator:
        """The emulator object itself: touch it only via :meth:`call`, from its own loop."""
        assert self._emulator is not None
        return self._emulator

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the emulator's loop and return its result (or raise)."""
        assert self._loop is not None

        async def run() -> T:
            return fn(*args, **kwargs)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(DEFAULT_TIMEOUT)

    def wait_until(self, predicate: Callable[[Emulator], T], timeout: float = DEFAULT_TIMEOUT, message: str = "") -> T:
        """Wait until ``predicate(emulator)`` is truthy; it is re-checked after every change."""
        assert self._loop is not None
        emulator = self.emulator

        async def run() -> T:
            while True:
                # Subscribe before checking: a change between the check and the wait is not missed.
                changed = emulator.next_change()
                if result := predicate(emulator):
                    changed.cancel()
                    return result
                await changed

        future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(run(), timeout), self._loop)
        try:
            return future.result()
        except (TimeoutError, concurrent.futures.TimeoutError):
            raise AssertionError(f"timed out after {timeout}s waiting until {message or predicate}") from None

    def wait_for(
        self,
        resource: str,
        name: str,
        namespace: str | None = None,
        predicate: Callable[[JsonObj], Any] = bool,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> JsonObj:
        """Wait until the object exists and ``predicate(obj)`` holds; return the object."""
        group, plural = parse_resource(resource)

        def check(emulator: Emulator) -> JsonObj | None:
            obj = emulator.get_object(group, plural, namespace, name)
            return obj if obj is not None and predicate(obj) else None

        return self.wait_until(check, timeout, f"{resource} {namespace}/{name} satisfies {predicate}")

    def wait_gone(
        self, resource: str, name: str, namespace: str | None = None, timeout: float = DEFAULT_TIMEOUT
    ) -> None:
        group, plural = parse_resource(resource)
        self.wait_until(
            lambda e: e.get_object(group, plural, namespace, name) is None,
            timeout,
            f"{resource} {namespace}/{name} is gone",
        )

    # ---------------------------------------------------------------------------------------------
    # Objects (resource = "plural[.group]", as kubectl spells it).

    def get(self, resource: str, name: str, namespace: str | None = None) -> JsonObj | None:
        group, plural = parse_resource(resource)
        return self.call(self.emulator.get_object, group, plural, namespace, name)

    def list(
        self, resource: str, namespace: str | None = None, labels: str | None = None, fields: str | None = None
    ) -> list[JsonObj]:
        group, plural = parse_resource(resource)
        return self.call(self.emulator.list_objects, group, plural, namespace, labels, fields)

    def create(self, body: JsonObj, namespace: str | None = None, *, field_manager: str | None = None) -> JsonObj:
        def run(emulator: Emulator) -> JsonObj:
            rt = emulator.find_type(body["apiVersion"], body["kind"])
            ns = namespace or body.get("metadata", {}).get("namespace") or ("default" if rt.namespaced else None)
            return emulator.create_object(rt.group, rt.plural, ns, body, manager=field_manager)

        return self.call(run, self.emulator)

    def create_yaml(self, text: str, namespace: str | None = None) -> list[JsonObj]:
        return [self.create(doc, namespace) for doc in yaml.safe_load_all(text) if doc]

    def patch(
        self,
        resource: str,
        name: str,
        patch: Any,
        namespace: str | None = None,
        *,
        subresource: str | None = None,
        content_type: str = "application/merge-patch+json",
        field_manager: str | None = None,
    ) -> JsonObj:
        """A patch as ``field_manager`` (default ``localcluster``); see :meth:`apply` for server-side apply."""
        group, plural = parse_resource(resource)
        return self.call(
            self.emulator.patch_object,
            group,
            plural,
            namespace,
            name,
            patch,
            content_type,
            subresource=subresource,
            manager=field_manager,
        )

    def apply(self, body: JsonObj, field_manager: str, *, force: bool = False) -> JsonObj:
        """Server-side apply of ``body`` (a partial object naming apiVersion, kind, name) as ``field_manager``."""

        def run(emulator: Emulator) -> JsonObj:
            rt = emulator.find_type(body["apiVersion"], body["kind"])
            meta = body.get("metadata") or {}
            ns = (meta.get("namespace") or "default") if rt.namespaced else None
            return emulator.patch_object(
                rt.group,
                rt.plural,
                ns,
                meta["name"],
                body,
                "application/apply-patch+yaml",
                manager=field_manager,
                force=force,
            )

        return self.call(run, self.emulator)

    def patch_status(self, resource: str, name: str, status: JsonObj, namespace: str | None = None) -> JsonObj:
        return self.patch(resource, name, {"status": status}, namespace, subresource="status")

    def replace(
        self,
        resource: str,
        name: str,
        body: JsonObj,
        namespace: str | None = None,
        *,
        subresource: str | None = None,
        field_manager: str | None = None,
    ) -> JsonObj:
        group, plural = parse_resource(resource)
        return self.call(
            self.emulator.replace_object,
            group,
            plural,
            namespace,
            name,
            body,
            subresource=subresource,
            manager=field_manager,
        )

    def delete(
        self,
        resource: str,
        name: str,
        namespace: str | None = None,
        *,
        propagation: str | None = None,
        missing_ok: bool = False,
    ) -> JsonObj | None:
        group, plural = parse_resource(resource)
        try:
            return self.call(self.emulator.delete_object, group, plural, namespace, name, propagation=propagation)
        except ApiError as e:
            if missing_ok and e.code == 404:
                return None
            raise

    # ---------------------------------------------------------------------------------------------
    # Faults and the request log.

    def inject_fault(
        self,
        path_regex: str,
        status: int | None = 500,
        *,
        method: str | Collection[str] | None = None,
        times: int = 1,
        message: str = "injected fault",
        delay: float = 0.0,
        user: str | None = None,
    ) -> Fault:
        """Make the next ``times`` requests matching (method, path, user) fail with ``status``.

        ``delay``: answer only after that many seconds (a slow server); with ``status=None`` the request
        is then served as usual. ``user``: only requests with that user's token (``system:serviceaccount:
        NS:NAME``). ``method``: one or several.
        """
        fault = Fault(
            methods=_methods(method),
            path=re.compile(path_regex),
            status=status,
            times=times,
            message=message,
            delay=delay,
            user=user,
        )
        self.call(self.emulator.faults.append, fault)
        return fault

    def on_request(
        self,
        path_regex: str,
        action: Callable[[Emulator], Any],
        *,
        method: str | Collection[str] | None = None,
        times: int = 1,
        user: str | None = None,
    ) -> Fault:
        """Run ``action(emulator)`` on the emulator's loop just before the next ``times`` matching requests are
        served (then they are served as usual): a write that lands between a client's read and its write."""
        emulator = self.emulator
        fault = Fault(
            methods=_methods(method),
            path=re.compile(path_regex),
            status=None,
            times=times,
            action=lambda: action(emulator),
            user=user,
        )
        self.call(self.emulator.faults.append, fault)
        return fault

    def clear_faults(self) -> None:
        self.call(self.emulator.faults.clear)

    def drop_watches(self, path_regex: str | None = None) -> int:
        """Close the open watch streams (matching the path regex); returns how many were closed."""
        return self.call(self.emulator.drop_watches, path_regex)

    def open_watches(self) -> list[str]:
        return self.call(self.emulator.open_watches)

    def compact(self) -> int:
        """Forget the change history: watches resumed from before now get 410 Gone (see Emulator.compact)."""
        return self.call(self.emulator.compact)

    @property
    def requests(self) -> list[RecordedRequest]:
        return self.call(lambda: list(self.emulator.request_log))

    def mark(self) -> int:
        """A position in the request log, for :meth:`requests_since`."""
        return self.call(lambda: len(self.emulator.request_log))

    def requests_since(self, mark: int) -> list[RecordedRequest]:
        return self.call(lambda: list(self.emulator.request_log[mark:]))

    def writes_since(self, mark: int, path_regex: str | None = None) -> list[RecordedRequest]:
        pattern = re.compile(path_regex) if path_regex else None
        return [r for r in self.requests_since(mark) if r.is_write and (pattern is None or pattern.search(r.path))]

    # ---------------------------------------------------------------------------------------------
    # Clients.

    def env(self, **extra: str) -> dict[str, str]:
        """An environment for subprocesses (kopf run, kubectl, helm) pointing at the emulator."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_SERVICE")}
        env.update(KUBECONFIG=str(self.kubeconfig), HOME=str(self.workdir), **extra)
        return env

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        cmd = [
            str(tools.kubectl_path()),
            f"--kubeconfig={self.kubeconfig}",
            f"--cache-dir={self.workdir / 'kube-cache'}",
            *args,
        ]
        result = subprocess.run(cmd, capture_output=True, text=True, input=input, timeout=timeout, env=self.env())
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
        return result

    def api_client(self) -> Any:
        """A synchronous ``kubernetes.client.ApiClient`` for the emulator."""
        import kubernetes.client

        config = kubernetes.client.Configuration()
        config.host = self.url
        return kubernetes.client.ApiClient(config)

    def kopf_connection(self, token: str | None = None) -> Any:
        """A ``kopf.ConnectionInfo`` to return from an ``@kopf.on.login()`` handler (``token``: whose)."""
        import kopf

        return kopf.ConnectionInfo(
            server=self.url, default_namespace="default", token=token, scheme="Bearer" if token else None
        )

    # ---------------------------------------------------------------------------------------------
    # Identities (RBAC applies to requests that carry a token; see authz.py).

    def service_account_token(self, namespace: str, name: str) -> str:
        """A bearer token for ServiceAccount ``namespace/name``: its requests are held to RBAC."""
        token = f"sa-{namespace}-{name}-{uuid.uuid4().hex[:12]}"
        self.call(self.emulator.add_token, token, User.service_account(namespace, name))
        return token

    def kubeconfig_for(self, token: str, path: pathlib.Path) -> pathlib.Path:
        """A kubeconfig that sends ``token`` (for a subprocess that should run as that identity)."""
        return tools.write_kubeconfig(self.url, path, token=token)

    def allowed(
        self,
        token: str,
        verb: str,
        resource: str,
        namespace: str | None = None,
        subresource: str = "",
        name: str | None = None,
    ) -> bool:
        """Whether the token's user may ``verb`` ``resource`` ("plural[.group]"), as RBAC decides now."""
        group, plural = parse_resource(resource)
        user = self.call(lambda: self.emulator.tokens[token])
        attrs = Attributes(verb, group, plural, subresource, namespace, name)
        return self.call(self.emulator.authorizer.allowed, user, attrs)


def _methods(method: str | Collection[str] | None) -> frozenset[str] | None:
    if method is None:
        return None
    return frozenset([method.upper()] if isinstance(method, str) else (m.upper() for m in method))


@contextlib.contextmanager
def running_emulator(workdir: pathlib.Path, *, validate_schemas: bool = True, **options: Any) -> Iterator[KubeEmulator]:
    """An emulator for a block of code; ``options`` are Emulator attributes (e.g. event_log_size)."""
    handle = KubeEmulator(workdir, validate_schemas=validate_schemas, **options)
    with handle:
        yield handle
