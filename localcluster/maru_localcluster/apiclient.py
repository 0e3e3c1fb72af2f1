"""A small asyncio client of the API server for the node components (kubelet, kube-proxy).

They talk to the API server over HTTP as a real kubelet or kube-proxy does, with list + watch
informers that resume from the last resourceVersion and list again after a 410.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

import aiohttp

log = logging.getLogger(__name__)

JsonObj = dict[str, Any]


class ApiError(Exception):
    def __init__(self, status: int, body: Any) -> None:
        message = body.get("message") if isinstance(body, dict) else str(body)
        super().__init__(f"{status}: {message}")
        self.status = status
        self.body = body


class ApiClient:
    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> ApiClient:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=10))
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "use ApiClient as an async context manager"
        return self._session

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
        timeout: float = 30,
    ) -> Any:
        data = None if body is None else json.dumps(body)
        async with self.session.request(
            method,
            self.base_url + path,
            data=data,
            params=params,
            headers={"Content-Type": content_type},
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            text = await resp.text()
            try:
                payload: Any = json.loads(text) if text else None
            except ValueError:
                payload = text
            if resp.status >= 400:
                raise ApiError(resp.status, payload)
            return payload

    async def get(self, path: str, **params: str) -> JsonObj | None:
        try:
            return await self.request("GET", path, params=params or None)
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    async def create(self, path: str, body: JsonObj) -> JsonObj:
        return await self.request("POST", path, body)

    async def replace(self, path: str, body: JsonObj) -> JsonObj:
        return await self.request("PUT", path, body)

    async def merge_patch(self, path: str, patch: JsonObj) -> JsonObj:
        return await self.request("PATCH", path, patch, content_type="application/merge-patch+json")

    async def delete(self, path: str, options: JsonObj | None = None) -> JsonObj | None:
        try:
            return await self.request("DELETE", path, options or {})
        except ApiError as err:
            if err.status == 404:
                return None
            raise


class Informer:
    """Keeps ``objects`` (by ``namespace/name``) in step with the API server; ``changed`` fires on every change."""

    def __init__(
        self,
        client: ApiClient,
        path: str,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.client = client
        self.path = path
        self.params = {k: v for k, v in (("labelSelector", label_selector), ("fieldSelector", field_selector)) if v}
        self.objects: dict[str, JsonObj] = {}
        self.synced = asyncio.Event()
        self._on_change = on_change or (lambda: None)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @staticmethod
    def key(obj: JsonObj) -> str:
        meta = obj.get("metadata") or {}
        return f"{meta.get('namespace') or ''}/{meta.get('name')}"

    async def _run(self) -> None:
        rv = ""
        while True:
            try:
                if not rv:
                    listing = await self.client.request("GET", self.path, params=self.params)
                    self.objects = {self.key(o): o for o in listing.get("items") or []}
                    rv = listing["metadata"]["resourceVersion"]
                    self.synced.set()
                    self._on_change()
                rv = await self._watch(rv)
            except asyncio.CancelledError:
                raise
            except (TimeoutError, aiohttp.ClientError, OSError, ApiError, ValueError, KeyError) as err:
                log.debug("watch %s interrupted (%s); resuming", self.path, err)
                await asyncio.sleep(0.5)

    async def _watch(self, rv: str) -> str:
        params = {
            **self.params,
            "watch": "true",
            "resourceVersion": rv,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": "300",
        }
        async with self.client.session.get(
            self.client.base_url + self.path, params=params, timeout=aiohttp.ClientTimeout(total=None, sock_read=None)
        ) as resp:
            if resp.status >= 400:
                raise ApiError(resp.status, await resp.text())
            async for line in resp.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                obj = event.get("object") or {}
                kind = event.get("type")
                if kind == "ERROR":
                    return ""  # 410 Gone: list again
                new_rv = (obj.get("metadata") or {}).get("resourceVersion")
                if kind == "BOOKMARK":
                    rv = new_rv or rv
                    continue
                if kind == "DELETED":
                    self.objects.pop(self.key(obj), None)
                else:
                    self.objects[self.key(obj)] = obj
                rv = new_rv or rv
                self._on_change()
        return rv
