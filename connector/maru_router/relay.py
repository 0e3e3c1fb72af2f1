"""The router's HTTP plumbing: client bodies read within bounds, requests relayed to engines and answers streamed
back, errors that name no internal URL.

Clients are not trusted (the API port is open to anyone the group serves): bodies are bounded in size and in the
time they take to arrive, counted against one budget for all clients together, and freed at once when a client
aborts; only a few client headers are passed on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector, web

from maru_router.limits import Limits

log = logging.getLogger("maru.router")

# Client headers the engines may need (an --api-key, request ids, tracing); nothing else is passed on.
FORWARDED_HEADERS = ("Authorization", "X-Request-Id", "traceparent", "tracestate")


def forwarded(request: web.Request) -> dict[str, str]:
    return {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}


def error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "router_error", "code": status}}, status=status)


class BodyReader:
    """Request bodies, each at most ``max_body_bytes`` and all in within ``body_timeout_s``, all of them together at
    most ``max_buffered_bytes`` (``gauge`` is told the total)."""

    def __init__(self, limits: Limits, gauge: Callable[[int], None]) -> None:
        self.limits = limits
        self.buffered = 0  # bytes of the bodies being read, parsed or keyed now
        self._gauge = gauge

    async def read(self, request: web.Request) -> bytes | web.Response:
        """The request's body, counted until the caller gives its length back with :meth:`release`; else the 413,
        408 or 503 to answer."""
        limit, budget = self.limits.max_body_bytes, self.limits.max_buffered_bytes
        if request.content_length is not None and request.content_length > limit:
            return error(413, f"request body: {request.content_length} bytes, more than --max-body-bytes {limit}")
        body, taken = bytearray(), False
        try:
            async with asyncio.timeout(self.limits.body_timeout_s):
                while chunk := await request.content.readany():
                    if self.buffered + len(chunk) > budget:
                        # Many large bodies at once (each within the limit) would add up past the pod's memory.
                        log.warning("refused a request body: %d bytes of bodies in flight", self.buffered)
                        return error(
                            503, f"router busy: request bodies in flight over --max-buffered-bytes {budget}; retry"
                        )
                    self._add(len(chunk))
                    body += chunk
                    if len(body) > limit:
                        return error(413, f"request body: more than --max-body-bytes {limit}")
            taken = True
            return bytes(body)
        except TimeoutError:
            return error(408, f"request body: not all in within --body-timeout {self.limits.body_timeout_s:g} s")
        except BaseException as err:
            # A client that went away: the error sits on the request's stream and its traceback holds this frame
            # (a cycle only the collector frees, which large buffers and few objects rarely wake). Each aborted
            # upload kept its bytes until then: free them now (the finally below), and cut the traceback.
            err.__traceback__ = None
            raise
        finally:
            if not taken:
                self.release(len(body))
            body.clear()

    def release(self, n: int) -> None:
        self._add(-n)

    def _add(self, n: int) -> None:
        self.buffered += n
        self._gauge(self.buffered)


class Relay:
    """Sends requests to engines (or the upstream router) and passes their answers back as they come.

    ``engine_of`` names the engine a URL belongs to, and ``on_failure(engine, err)`` may raise instead of the 502
    (a followed pod gone: the caller takes the request elsewhere); it is called only while nothing of the answer
    has reached the client."""

    def __init__(
        self,
        engine_of: Callable[[str], str | None],
        on_failure: Callable[[str | None, BaseException], None],
    ) -> None:
        self._engine_of = engine_of
        self._on_failure = on_failure
        self._session: ClientSession | None = None

    def open(self) -> ClientSession:
        # No total deadline: a long generation streams for as long as it takes. No cap on connections
        # either: every request in flight holds one to an engine, and the engines bound their own load.
        self._session = ClientSession(
            timeout=ClientTimeout(total=None, sock_connect=10), connector=TCPConnector(limit=0)
        )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> ClientSession:
        assert self._session is not None, "the app is not started"
        return self._session

    async def send(
        self,
        request: web.Request,
        method: str,
        url: str,
        headers: dict[str, str],
        *,
        body: Any = None,
        data: bytes | None = None,
    ) -> web.StreamResponse:
        """Send ``body`` (JSON) or ``data`` (bytes as they came) and pass the answer back as it comes (server-sent
        events included)."""
        payload: dict[str, Any] = {"data": data} if data is not None else {"json": body}
        engine = self._engine_of(url)
        out: web.StreamResponse | None = None
        try:
            async with self.session.request(method, url, headers=headers, **payload) as resp:
                if "text/event-stream" not in resp.headers.get("Content-Type", ""):
                    answer = await resp.read()
                    return web.Response(body=answer, status=resp.status, content_type=resp.content_type)
                out = web.StreamResponse(status=resp.status, headers={"Content-Type": resp.headers["Content-Type"]})
                await out.prepare(request)
                async for piece in resp.content.iter_any():
                    await out.write(piece)
                await out.write_eof()
                return out
        except (ClientError, TimeoutError) as err:
            if out is None or not out.prepared:  # once the client has part of an answer, it cannot be run again
                self._on_failure(engine, err)
            log.warning("upstream %s failed: %s: %s", url, type(err).__name__, err)
            # The URL stays in the log: a client is not told where the engines are.
            return error(502, f"upstream failed: {type(err).__name__}")

    async def exchange(
        self, url: str, body: dict[str, Any], headers: dict[str, str], engine: str
    ) -> tuple[int, bytes, str | None] | web.Response:
        """POST ``body`` to ``engine`` and read the whole answer: (status, bytes, content type), or the 502."""
        try:
            async with self.session.post(url, json=body, headers=headers) as resp:
                return resp.status, await resp.read(), resp.content_type
        except (ClientError, TimeoutError) as err:
            self._on_failure(engine, err)
            log.warning("prefill %s failed: %s: %s", url, type(err).__name__, err)
            return error(502, f"prefill failed: {type(err).__name__}")
