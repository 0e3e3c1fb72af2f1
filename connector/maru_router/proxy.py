"""The router's HTTP side: decide per request, then decode alone or prefill then decode.

The key scheme (namespace fingerprints, block and chunk size, hash) is learnt from the producers'
handoffs (``kv_transfer_params``): half of an engine's namespace is only known once its workers
registered their KV caches, so only the engine can say it. Until a prefill has answered once,
and for any prompt keyed under a scheme no engine uses any more, requests take the prefill path,
whose answer teaches the scheme in use.

Any trouble finding the coverage (pool down or slow, tokenizer endpoint failing) sends the
request through prefill, as without this router: never an error of its own.

In front of another router (``upstream``: vllm-router, as the operator deploys it), a request that does
not go to decode alone is passed to that router untouched, and so is every other path (its
``/workers``, say): its pod discovery and policies keep choosing prefill and decode. Since that router
consumes prefill's answers, the key scheme is learnt by running the prefill-then-decode path here,
through the ``prefill`` and ``decode`` URLs, whenever no scheme is known or the one known is older than
``relearn_s``: one request at a time, about one per period, so a rollout that changes the engines' keys
is followed.

Each request this router sends goes to the engine of its role with the fewest of its requests in
flight (:mod:`.balance`); a covered prompt may go to a prefill engine when decode is busier. For engines
whose KV events the router reads (``kv_events``, :mod:`.locality`), an engine whose own cache holds more of
the prompt than the pool may take it while at most ``locality_slack`` requests busier than the least busy.

Engines whose key revision is known (announced as their KV events' topic, or given, :mod:`.revisions`) are
paired coherently through a rollout that changes their keys: while they span more than one revision, every
request not served by one engine alone runs prefill then decode here, even in front of another router, with a
decode of the prefill's own revision (or, when no revision has engines of both roles, on one engine alone), and
a covered prompt goes to an engine of the revision whose keys found it.

Clients are not trusted (the API port is open to anyone the group serves): in front of another router only the
serving paths in :data:`UPSTREAM_PATHS` are passed on, never its admin API; bodies are bounded in size and in the
time they take to arrive, and freed at once when a client aborts; a prompt of token ids longer than
``max_prompt_tokens`` is refused, and long prompts are keyed one at a time, off the event loop; a lookup is cut
into batches well under the pool daemon's frame limit; error bodies name no internal URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import (
    ClientConnectorError,
    ClientError,
    ClientSession,
    ClientTimeout,
    ConnectionTimeoutError,
    TCPConnector,
    web,
)
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from maru_contracts.config import MaruConnectorConfig
from maru_contracts.handoff import HANDOFF_KEY_SCHEME
from maru_contracts.keys import KeyScheme
from maru_pool import guard
from maru_router import decide, limits
from maru_router.balance import Endpoints, Prompt, direct_target
from maru_router.locality import EngineCache, Subscriber, announced_endpoint
from maru_router.prompt_keys import block_hashes, chunk_lookup_keys
from maru_router.revisions import Pairing, pairable, revision_of

log = logging.getLogger("maru.router")

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
# What vllm-router 0.1.17 (and vLLM's own P/D proxies) ask of prefill: keep the KV for a remote decode.
PREFILL_TRANSFER = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Chat fields that change the tokens of the rendered prompt: /tokenize must see them as the engine does.
CHAT_TEMPLATE_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "documents",
)
DIRECT, PD = "direct", "pd"
DISCOVERY_RETRY_S = 5.0  # how often to ask an engine not yet answering where it publishes its KV events
# Client headers the engines may need (an --api-key, request ids, tracing); nothing else is passed on.
FORWARDED_HEADERS = ("Authorization", "X-Request-Id", "traceparent", "tracestate")
# In front of another router, the only paths passed to it besides completions and chat: its serving API. Never its
# admin API (vllm-router's /add_worker, /remove_worker, /workers, /flush_cache, /get_loads...: a client could take
# every engine out of rotation), nor its stateful ones (/v1/responses/{id} would hand out another client's answer).
UPSTREAM_PATHS: dict[str, frozenset[str]] = {
    "GET": frozenset({"/v1/models", "/version", "/readiness", "/liveness", "/get_model_info"}),
    "POST": frozenset({"/v1/embeddings", "/v1/rerank"}),
}
# Prompts longer than this are keyed one at a time: a few of them cannot take every core from the short ones.
LONG_PROMPT_TOKENS = 32 << 10
# Keys per pool lookup: ~270 KiB frames, far under the daemon's --max-frame (16 MiB by default), so a long prompt
# is looked up in several round trips rather than in one frame the daemon refuses (and the pool client then backs
# off, sending every client's prompts through prefill).
LOOKUP_BATCH_KEYS = 4096
# Client requests being served (the drain hook's gauge; the operator renders the hook with this name).
IN_PROGRESS_METRIC = "maru_router_requests_in_progress"
UNCOUNTED_PATHS = frozenset({"/health", "/metrics"})
Handler = Callable[[web.Request], Any]


@dataclass(frozen=True)
class Decision:
    route: str  # DIRECT or PD
    # covered | no_key_scheme | short | unsupported | cold | pool_error | tokenize_error | keying_error | disabled
    # | long (a tokenized prompt over max_prompt_tokens: not keyed)
    reason: str
    prompt_tokens: int = 0
    chunks_hit: int = 0
    prompt: Prompt | None = None  # for the choice of engine by locality, when the prompt was hashed


class Metrics:
    """The router's counters, on its own registry (``GET /metrics``)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "maru_router_requests",
            "Requests by route: decode alone (direct) or prefill then decode (pd), and why.",
            ["route", "reason"],
            registry=self.registry,
        )
        self.lookups = Counter(
            "maru_router_coverage_lookups", "Prompts whose coverage was asked of the pool.", registry=self.registry
        )
        self.fallbacks = Counter(
            "maru_router_fallbacks",
            "Requests sent through prefill because their coverage could not be known (pool or tokenizer trouble).",
            ["reason"],
            registry=self.registry,
        )
        self.upstream = Counter(
            "maru_router_upstream_requests",
            "Requests passed untouched to the upstream router (prefill then decode there, or another path).",
            registry=self.registry,
        )
        self.scheme_refreshes = Counter(
            "maru_router_scheme_refreshes",
            "Prefill-then-decode requests run by this router to learn the engines' key scheme (upstream mode).",
            registry=self.registry,
        )
        self.direct_targets = Counter(
            "maru_router_direct_targets",
            "Requests served by one engine alone (route direct), by the role of that engine: decode, or a prefill "
            "engine less busy than every decode engine.",
            ["role"],
            registry=self.registry,
        )
        self.engine_requests = Counter(
            "maru_router_engine_requests",
            "Requests this router sent to each engine URL, by role (prefill, decode, or a covered prompt's direct).",
            ["role", "endpoint"],
            registry=self.registry,
        )
        self.cached_blocks = Gauge(
            "maru_router_engine_cached_blocks",
            "Blocks an engine's own prefix cache holds, as its KV events said (engines whose events are read).",
            ["endpoint"],
            registry=self.registry,
        )
        self.event_resets = Gauge(
            "maru_router_kv_event_resets",
            "Times the router dropped what it knew of an engine's cache: a gap in its KV events (a lost batch, "
            "an engine restart) or an unreadable batch.",
            ["endpoint"],
            registry=self.registry,
        )
        self.local_prefills = Counter(
            "maru_router_local_prefills",
            "Prefill-then-decode requests this router ran itself in front of the upstream router, because a "
            "prefill engine's own cache held more of the prompt than the pool.",
            registry=self.registry,
        )
        self.revision_requests = Counter(
            "maru_router_revision_requests",
            "Requests run here because the engines span more than one key revision (a rollout): prefill then "
            "decode within one revision (paired), or on one engine alone when no revision has both roles (single).",
            ["path"],
            registry=self.registry,
        )
        self.engine_revision = Gauge(
            "maru_router_engine_revision",
            "1 for each engine URL and the key revision it announced (its KV events' topic) or was given.",
            ["endpoint", "revision"],
            registry=self.registry,
        )
        self.buffered = Gauge(
            "maru_router_buffered_request_bytes",
            "Bytes of request bodies being read, parsed or keyed now (at most --max-buffered-bytes; 503 beyond).",
            registry=self.registry,
        )
        self.in_progress = Gauge(
            IN_PROGRESS_METRIC,
            "Client requests being served now, the probes and /metrics aside (a stopping pod's preStop hook "
            "waits for 0).",
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "maru_router_in_flight_requests",
            "Requests this router has in flight on each engine URL (what it balances by).",
            ["role", "endpoint"],
            registry=self.registry,
        )


class Router:
    def __init__(
        self,
        *,
        prefill: Sequence[str],
        decode: Sequence[str],
        connector: MaruConnectorConfig,
        min_coverage: float = 1.0,
        decode_direct: bool = True,
        direct_to_prefill: bool = True,
        upstream: str | None = None,
        relearn_s: float = 60.0,
        kv_events: Mapping[str, str] | None = None,
        discover_kv_events: bool = False,
        locality_slack: int = 1,
        follow_workers_s: float | None = None,
        engine_revisions: Mapping[str, str] | None = None,
        max_body_bytes: int = limits.MAX_BODY_BYTES,
        max_prompt_tokens: int = limits.MAX_PROMPT_TOKENS,
        header_timeout_s: float = limits.HEADER_TIMEOUT_S,
        body_timeout_s: float = limits.BODY_TIMEOUT_S,
        max_buffered_bytes: int = limits.MAX_BUFFERED_BYTES,
    ) -> None:
        if relearn_s <= 0:
            raise ValueError(f"router: relearn_s must be > 0, got {relearn_s}")
        for name, value in (
            ("--max-body-bytes", max_body_bytes),
            ("--max-prompt-tokens", max_prompt_tokens),
            ("--header-timeout", header_timeout_s),
            ("--body-timeout", body_timeout_s),
            ("--max-buffered-bytes", max_buffered_bytes),
        ):
            if value <= 0:
                raise ValueError(f"router: {name} must be > 0, got {value}")
        self.max_body_bytes = max_body_bytes
        self.max_prompt_tokens = max_prompt_tokens
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        if max_buffered_bytes < max_body_bytes:
            raise ValueError(
                f"router: --max-buffered-bytes {max_buffered_bytes} is under --max-body-bytes "
                f"{max_body_bytes}: no body at the limit could be read"
            )
        self.max_buffered_bytes = max_buffered_bytes
        self._buffered = 0  # bytes of the bodies being read, parsed or keyed now
        self._long_lane = asyncio.Semaphore(1)
        if follow_workers_s is not None and (follow_workers_s <= 0 or not upstream):
            raise ValueError("router: following the upstream's workers needs --upstream and a period > 0")
        self.follow_workers_s = follow_workers_s
        self._given_revisions = {u.rstrip("/"): r for u, r in (engine_revisions or {}).items()}
        self.revisions: dict[str, str] = dict(self._given_revisions)  # engine URL -> key revision
        self._scheme_revision: str | None = None  # the revision of the prefill that taught the key scheme
        self.discover_kv_events = discover_kv_events
        decide.chunks_needed(1, 1, min_coverage)  # validates min_coverage now, not on the first request
        self.upstream = upstream.rstrip("/") if upstream else None
        self.relearn_s = relearn_s
        self._learnt_at = 0.0  # time.monotonic() of the last handoff that carried a key scheme
        self._refreshing = False  # a request is learning the scheme through prefill here (upstream mode)
        self.min_coverage = min_coverage
        self.decode_direct = decode_direct
        self.direct_to_prefill = direct_to_prefill
        self.scheme: KeyScheme | None = None
        self.metrics = Metrics()
        known = {u.rstrip("/") for u in (*prefill, *decode)}
        unknown = sorted(set(kv_events or {}) - known)
        if unknown:
            raise ValueError(f"router: --kv-events names {unknown[0]}, which is neither a --prefill nor a --decode URL")
        # Discovering: every engine may turn out to publish, so each has a cache from the start (empty: by load).
        # Following the upstream's workers, the URLs given are Services (a different pod each connection): their
        # events are not one cache's, so only the pods found later are asked.
        followed = known if discover_kv_events and follow_workers_s is None else set(kv_events or {})
        self.caches = {url: EngineCache() for url in followed}
        self._undiscovered = sorted(followed - set(kv_events or {}))
        self._discoveries: dict[str, asyncio.Task[None]] = {}
        self._subscribers = {
            url: Subscriber(url, endpoint, self.caches[url], self._cache_gauge(url))
            for url, endpoint in (kv_events or {}).items()
        }
        self._background: list[asyncio.Task[None]] = []
        self.prefill = Endpoints("prefill", prefill, self._gauge("prefill"), caches=self.caches, slack=locality_slack)
        self.decode = Endpoints("decode", decode, self._gauge("decode"), caches=self.caches, slack=locality_slack)
        self._pool = guard.PoolGuard(connector, "router", guard.Counters())
        self._session: ClientSession | None = None

    # ------------------------------------------------------------------ app

    def app(self, *, metrics: bool = True) -> web.Application:
        """The API; ``metrics``: ``GET /metrics`` here too (off when it has a port of its own: its counters would
        tell any client whether someone sent a prompt, and they name the engines' pods)."""
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._count_in_progress])
        app.router.add_post(COMPLETIONS, self.serve)
        app.router.add_post(CHAT, self.serve)
        app.router.add_get("/health", self.health)
        if metrics:
            app.router.add_get("/metrics", self.prometheus)
        if self.upstream is None:
            app.router.add_get("/v1/models", self.models)
        else:
            app.router.add_route("*", "/{tail:.*}", self.pass_through)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    @web.middleware
    async def _count_in_progress(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in UNCOUNTED_PATHS:
            return await handler(request)
        self.metrics.in_progress.inc()
        try:
            return await handler(request)
        finally:
            self.metrics.in_progress.dec()

    async def _open(self, _: web.Application) -> None:
        # No total deadline: a long generation streams for as long as it takes. No cap on connections
        # either: every request in flight holds one to an engine, and the engines bound their own load.
        self._session = ClientSession(
            timeout=ClientTimeout(total=None, sock_connect=10), connector=TCPConnector(limit=0)
        )
        for subscriber in self._subscribers.values():
            subscriber.start()
        self._revision_gauges()
        for url in self._undiscovered:
            self._start_discovery(url)
        if self.follow_workers_s is not None:
            self._background.append(asyncio.get_running_loop().create_task(self._follow_workers()))

    async def _close(self, _: web.Application) -> None:
        tasks = [*self._background, *self._discoveries.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for subscriber in self._subscribers.values():
            await subscriber.close()
        if self._session is not None:
            await self._session.close()
        self._pool.close()

    def _gauge(self, role: str) -> Callable[[str, int], None]:
        return lambda url, n: self.metrics.in_flight.labels(role, url).set(n)

    async def _discover(self, url: str) -> None:
        """Ask the engine at ``url`` where it publishes its KV events (``GET /kv_event_sources``) until it
        answers, then follow them; an engine that publishes none is chosen for by load."""
        while True:
            try:
                async with self.session.get(url + "/kv_event_sources", timeout=ClientTimeout(total=5)) as resp:
                    sources = await resp.json(content_type=None) if resp.status == 200 else None
                if resp.status in (200, 404):
                    break
            except (ClientError, TimeoutError, ValueError):
                pass  # not up yet
            await asyncio.sleep(DISCOVERY_RETRY_S)
        revision = revision_of(sources)
        if revision is not None and url not in self._given_revisions:
            self.revisions[url] = revision
            log.info("engine %s runs key revision %s", url, revision)
            self._revision_gauges()
        endpoint = announced_endpoint(url, sources)
        if endpoint is None:
            log.info("engine %s publishes no KV events over ZMQ (one engine core): chosen for by load", url)
            return
        subscriber = Subscriber(url, endpoint, self.caches[url], self._cache_gauge(url))
        self._subscribers[url] = subscriber
        subscriber.start()

    def _start_discovery(self, url: str) -> None:
        self._discoveries[url] = asyncio.get_running_loop().create_task(self._discover(url))

    async def _follow_workers(self) -> None:
        """Take the engines the upstream router found (vllm-router's ``GET /workers``: its pod discovery) as this
        router's own, every ``follow_workers_s``: pods by their addresses instead of the role Services, so an
        engine's own cache can be chosen for."""
        assert self.upstream is not None and self.follow_workers_s is not None
        while True:
            try:
                async with self.session.get(self.upstream + "/workers", timeout=ClientTimeout(total=5)) as resp:
                    data = await resp.json(content_type=None) if resp.status == 200 else None
                await self._take_workers(data)
            except (ClientError, TimeoutError, ValueError) as err:
                log.debug("upstream worker list unavailable: %s", err)
            await asyncio.sleep(self.follow_workers_s)

    def _revision_gauges(self) -> None:
        self.metrics.engine_revision.clear()
        for url in {*self.prefill.urls, *self.decode.urls}:
            if url in self.revisions:
                self.metrics.engine_revision.labels(url, self.revisions[url]).set(1)

    async def _take_workers(self, data: object) -> None:
        workers = data.get("workers") if isinstance(data, dict) else None
        if not isinstance(workers, list):
            return
        found: dict[str, list[str]] = {"prefill": [], "decode": []}
        for w in workers:
            if isinstance(w, dict) and w.get("is_healthy") and isinstance(w.get("url"), str):
                found.get(str(w.get("worker_type")), []).append(w["url"].rstrip("/"))
        changed = self.prefill.replace(sorted(found["prefill"])) | self.decode.replace(sorted(found["decode"]))
        if not changed:
            return
        log.info("following the upstream's workers: prefill %s, decode %s", self.prefill.urls, self.decode.urls)
        now = {*self.prefill.urls, *self.decode.urls}
        for url in [u for u in self.revisions if u not in now and u not in self._given_revisions]:
            self.revisions.pop(url)
        self._revision_gauges()
        for url in [u for u in self.caches if u not in now]:
            self.caches.pop(url)
            if url in self._discoveries:
                self._discoveries.pop(url).cancel()
            if url in self._subscribers:
                await self._subscribers.pop(url).close()
        if self.discover_kv_events:
            for url in sorted(now - set(self.caches)):
                self.caches[url] = EngineCache()
                self._start_discovery(url)

    def _cache_gauge(self, url: str) -> Callable[[], None]:
        cache = self.caches[url]

        def update() -> None:
            self.metrics.cached_blocks.labels(url).set(len(cache.blocks))
            self.metrics.event_resets.labels(url).set(cache.resets)

        return update

    @property
    def session(self) -> ClientSession:
        assert self._session is not None, "the app is not started"
        return self._session

    async def health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def prometheus(self, _: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    def metrics_app(self) -> web.Application:
        """``GET /metrics`` alone, for a metrics port of its own."""
        app = web.Application()
        app.router.add_get("/metrics", self.prometheus)
        return app

    async def models(self, request: web.Request) -> web.StreamResponse:
        url = self.decode.urls[self.decode.pick()]
        return await self._relay(request, "GET", url + "/v1/models", None, _forwarded(request))

    async def pass_through(self, request: web.Request) -> web.StreamResponse:
        """A serving path of the upstream router (:data:`UPSTREAM_PATHS`), untouched (method, query, body, content
        type); any other path is refused here and never reaches it."""
        if request.path not in UPSTREAM_PATHS.get(request.method, ()):
            log.warning("refused %s %s: not a path served to clients", request.method, request.path)
            return _error(404, f"{request.method} {request.path}: not served by this router")
        raw = await self._read_body(request)
        if isinstance(raw, web.Response):
            return raw
        try:
            return await self._to_upstream(request, raw)
        finally:
            self._unbuffer(len(raw))

    async def _to_upstream(self, request: web.Request, raw: bytes) -> web.StreamResponse:
        assert self.upstream is not None
        self.metrics.upstream.inc()
        headers = _forwarded(request)
        if request.content_type and raw:
            headers["Content-Type"] = request.headers.get("Content-Type", request.content_type)
        # The path as matched (decoded), not as sent: what was checked is what the upstream gets.
        url = self.upstream + request.path + (f"?{request.query_string}" if request.query_string else "")
        return await self._relay(request, request.method, url, None, headers, data=raw)

    async def _read_body(self, request: web.Request) -> bytes | web.Response:
        """The request's body, at most ``max_body_bytes``, all in within ``body_timeout_s``, and counted against
        ``max_buffered_bytes`` (the caller gives its length back with :meth:`_unbuffer`); else the 413, 408 or 503
        to answer."""
        limit = self.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            return _error(413, f"request body: {request.content_length} bytes, more than --max-body-bytes {limit}")
        body, taken = bytearray(), False
        try:
            async with asyncio.timeout(self.body_timeout_s):
                while chunk := await request.content.readany():
                    if self._buffered + len(chunk) > self.max_buffered_bytes:
                        # Many large bodies at once (each within the limit) would add up past the pod's memory.
                        log.warning("refused a request body: %d bytes of bodies in flight", self._buffered)
                        return _error(
                            503,
                            f"router busy: request bodies in flight over --max-buffered-bytes "
                            f"{self.max_buffered_bytes}; retry",
                        )
                    self._buffer(len(chunk))
                    body += chunk
                    if len(body) > limit:
                        return _error(413, f"request body: more than --max-body-bytes {limit}")
            taken = True
            return bytes(body)
        except TimeoutError:
            return _error(408, f"request body: not all in within --body-timeout {self.body_timeout_s:g} s")
        except BaseException as err:
            # A client that went away: the error sits on the request's stream and its traceback holds this frame
            # (a cycle only the collector frees, which large buffers and few objects rarely wake). Each aborted
            # upload kept its bytes until then: free them now (the finally below), and cut the traceback.
            err.__traceback__ = None
            raise
        finally:
            if not taken:
                self._unbuffer(len(body))
            body.clear()

    def _buffer(self, n: int) -> None:
        self._buffered += n
        self.metrics.buffered.set(self._buffered)

    def _unbuffer(self, n: int) -> None:
        self._buffer(-n)

    def _needs_scheme(self) -> bool:
        return self.scheme is None or time.monotonic() - self._learnt_at >= self.relearn_s

    def claim_refresh(self) -> bool:
        """Whether this request should learn the key scheme through prefill here (upstream mode): one at a
        time, so requests arriving meanwhile keep the upstream router's choice of engines."""
        if self._refreshing or not self._needs_scheme():
            return False
        self._refreshing = True
        return True

    # ------------------------------------------------------------------ requests

    async def serve(self, request: web.Request) -> web.StreamResponse:
        raw = await self._read_body(request)
        if isinstance(raw, web.Response):
            return raw
        headers = _forwarded(request)
        # The body counts against --max-buffered-bytes until the decision: parsed and keyed, it takes several
        # times its size. What is relayed then is the engines' load, which they bound.
        try:
            admitted = await self._admit(request, raw, headers)
        finally:
            self._unbuffer(len(raw))
        if isinstance(admitted, web.Response):
            return admitted
        body, raw, decision = admitted
        self.metrics.requests.labels(decision.route, decision.reason).inc()
        pairing = self._pairing()
        if decision.route == DIRECT:
            # Chosen here, after the lookup: the loads are read just before this request is counted. Mid-rollout,
            # among the engines of the revision whose keys the pool found the prompt under.
            among_d = self._of_revision(self.decode, self._scheme_revision)
            among_p = self._of_revision(self.prefill, self._scheme_revision)
            picks = (self.decode.pick(decision.prompt, among_d), self.prefill.pick(decision.prompt, among_p))
            role, i = direct_target(
                self.decode.loads, self.prefill.loads, to_prefill=self.direct_to_prefill, picks=picks
            )
            engines = self.prefill if role == "prefill" else self.decode
            self.metrics.direct_targets.labels(role).inc()
            self.metrics.engine_requests.labels(role, engines.urls[i]).inc()
            _log(request, decision, role, engines.urls[i])
            try:
                with engines.hold(i) as url:
                    return await self._relay(request, "POST", url + request.path, body, headers)
            except _Unreachable as gone:
                return await self._around(gone, request, raw)
        _log(request, decision, "pd", self.upstream or "-")
        if pairing is not None:
            try:
                return await self._coherent(request, body, headers, decision.prompt, pairing)
            except _Unreachable as gone:
                return await self._around(gone, request, raw)
        if self.upstream is not None:
            local = self._local_prefill(decision.prompt)
            if local is not None:
                self.metrics.local_prefills.inc()
                try:
                    return await self._prefill_then_decode(request, body, headers, decision.prompt, local)
                except _Unreachable as gone:
                    return await self._around(gone, request, raw)
            if not (self.decode_direct and self.claim_refresh()):
                return await self._to_upstream(request, raw)
            self.metrics.scheme_refreshes.inc()
            try:
                return await self._prefill_then_decode(request, body, headers, decision.prompt)
            except _Unreachable as gone:
                return await self._around(gone, request, raw)
            finally:
                self._refreshing = False
        return await self._prefill_then_decode(request, body, headers, decision.prompt)

    async def _admit(
        self, request: web.Request, raw: bytes, headers: dict[str, str]
    ) -> tuple[dict[str, Any], bytes, Decision] | web.Response:
        """The request's body checked and parsed, with the raw bytes to pass on and the route; or the 400."""
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = None
        except RecursionError:
            return _error(400, "request body: JSON nested too deeply")
        except ValueError:  # an integer of more digits than Python converts
            return _error(400, f"request body: an integer of more than {sys.get_int_max_str_digits()} digits")
        if not isinstance(body, dict):
            return _error(400, "request body: must be a JSON object")
        ids = _token_ids(request.path, body)
        if ids is not None and len(ids) > self.max_prompt_tokens:
            return _error(
                400,
                f"prompt: {len(ids)} token ids, more than the router's --max-prompt-tokens {self.max_prompt_tokens}",
            )
        if "kv_transfer_params" in body:
            # Only the router sets them: a client's would steer the engine's KV transfer (NIXL acts on them).
            del body["kv_transfer_params"]
            raw = json.dumps(body).encode()
        return body, raw, await self.decide(request.path, body, headers)

    async def decide(self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Decision:
        """Decode alone when the pool holds enough of the prompt; anything unknown means prefill.

        With engines' KV events read, the prompt is hashed even when it cannot skip prefill (decode-direct
        off, too short for a chunk): the choice of engine within a role weighs what each holds of it.
        """
        scheme = self.scheme
        if not self.decode_direct and not self.caches:
            return Decision(PD, "disabled")
        if scheme is None:
            return Decision(PD, "no_key_scheme")
        try:
            ids = await self._prompt_ids(path, body, headers or {})
        except _TokenizeError as err:
            log.warning("coverage unknown, prefill path: tokenize failed: %s", err)
            self.metrics.fallbacks.labels("tokenize_error").inc()
            return Decision(PD, "tokenize_error")
        if ids is None:
            return Decision(PD, "unsupported")
        if len(ids) > self.max_prompt_tokens:  # a text prompt the engine tokenized (its own length limit decides)
            return Decision(PD, "long", len(ids))
        need = decide.chunks_needed(len(ids), scheme.chunk_tokens, self.min_coverage)
        salt = body.get("cache_salt")
        salt = salt if isinstance(salt, str) else None
        # Keying runs off the event loop; long prompts take turns, so they leave cores to everyone else's.
        lane = self._long_lane if len(ids) > LONG_PROMPT_TOKENS else contextlib.nullcontext()
        if need is None or not self.decode_direct:
            # Nothing to ask the pool for a skip; the engines' own caches may still hold the prompt.
            async with lane:
                hashes = await asyncio.to_thread(self._hashes, ids, scheme, salt) if self.caches else None
            prompt = Prompt(hashes, scheme.hash_block_size, 0) if hashes else None
            return Decision(PD, "short" if need is None else "disabled", len(ids), prompt=prompt)
        self.metrics.lookups.inc()
        try:
            async with lane:
                hashes, ok, n = await asyncio.to_thread(self._coverage, ids, scheme, salt)
        except Exception:  # a prompt the hashing could not key must still be served, through prefill
            log.exception("coverage unknown, prefill path: keying the prompt failed")
            self.metrics.fallbacks.labels("keying_error").inc()
            return Decision(PD, "keying_error", len(ids))
        if not ok or n is None:
            self.metrics.fallbacks.labels("pool_error").inc()
            return Decision(PD, "pool_error", len(ids), prompt=Prompt(hashes, scheme.hash_block_size, 0))
        chunks = n // len(scheme.fingerprints)
        prompt = Prompt(hashes, scheme.hash_block_size, chunks * scheme.chunk_tokens)
        if chunks >= need:
            return Decision(DIRECT, "covered", len(ids), chunks, prompt)
        return Decision(PD, "cold", len(ids), chunks, prompt)

    async def _around(self, gone: _Unreachable, request: web.Request, raw: bytes) -> web.StreamResponse:
        """A pod taken from the upstream's list could not be reached (gone in a rollout, before the next look at
        the list): forget it and let the upstream router, whose discovery saw it go, serve the request."""
        log.warning(
            "engine %s unreachable (%s); forgetting it until the upstream lists it again, request passed "
            "to the upstream",
            gone.url,
            gone.why,
        )
        self.prefill.replace([u for u in self.prefill.urls if u != gone.url])
        self.decode.replace([u for u in self.decode.urls if u != gone.url])
        return await self._to_upstream(request, raw)

    def _pairing(self) -> Pairing | None:
        """The coherent pairs while the engines of known key revision span more than one (None: any pair)."""
        if not self.revisions:
            return None
        return pairable(self.prefill.urls, self.decode.urls, self.revisions)

    def _of_revision(self, engines: Endpoints, revision: str | None) -> list[int] | None:
        """Mid-rollout, the engines of key ``revision`` (None: any engine, as when the engines share one
        revision; a role with none of it gets None too, and its engine misses and computes: slower, never
        wrong)."""
        if revision is None or self._pairing() is None:
            return None
        of = [i for i, u in enumerate(engines.urls) if self.revisions.get(u) == revision]
        return of or None

    async def _coherent(
        self,
        request: web.Request,
        body: dict[str, Any],
        headers: dict[str, str],
        prompt: Prompt | None,
        pairing: Pairing,
    ) -> web.StreamResponse:
        """A request not served by one engine alone while the engines span key revisions: prefill then decode
        here within one revision, or, when no revision has engines of both roles, one engine computes it all."""
        if pairing.prefill:
            self.metrics.revision_requests.labels("paired").inc()
            i = self.prefill.pick(prompt, pairing.prefill)
            return await self._prefill_then_decode(request, body, headers, prompt, i)
        self.metrics.revision_requests.labels("single").inc()
        role, i = direct_target(self.decode.loads, self.prefill.loads, to_prefill=True)
        engines = self.prefill if role == "prefill" else self.decode
        self.metrics.engine_requests.labels(role, engines.urls[i]).inc()
        with engines.hold(i) as url:
            return await self._relay(request, "POST", url + request.path, body, headers)

    def _local_prefill(self, prompt: Prompt | None) -> int | None:
        """In front of another router: the prefill engine to run this prompt on here, because its own cache holds
        more of it than the pool gives every engine; None leaves the choice to that router."""
        if prompt is None or self.follow_workers_s is None:
            return None
        i = self.prefill.pick(prompt)
        return i if self.prefill.local_tokens(i, prompt) > prompt.pool_tokens else None

    def _hashes(self, ids: list[int], scheme: KeyScheme, salt: str | None) -> list[bytes] | None:
        try:
            return block_hashes(ids, scheme, salt)
        except Exception:  # locality is a preference: a prompt that cannot be hashed is chosen for by load
            log.exception("hashing the prompt for locality failed; choosing its engine by load")
            return None

    def _coverage(self, ids: list[int], scheme: KeyScheme, salt: str | None) -> tuple[list[bytes], bool, int | None]:
        hashes = block_hashes(ids, scheme, salt)
        keys = chunk_lookup_keys(ids, scheme, salt, hashes)
        n = 0
        for start in range(0, len(keys), LOOKUP_BATCH_KEYS):
            batch = keys[start : start + LOOKUP_BATCH_KEYS]
            ok, hit = self._pool.call("lookup", lambda client, k: client.lookup_prefix(k), batch)
            if not ok or hit is None:
                return hashes, False, None
            n += hit
            if hit < len(batch):
                break
        return hashes, True, n

    async def _prompt_ids(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> list[int] | None:
        """The prompt's token ids as the engine will see them; None for what the router cannot key."""
        if path == COMPLETIONS:
            ids = _token_ids(path, body)
            if ids is not None:
                return ids
            prompt = _one_prompt(body)
            if isinstance(prompt, str) and "prompt_embeds" not in body:
                query = {"prompt": prompt, "add_special_tokens": body.get("add_special_tokens", True)}
                return await self._tokenize({"model": body.get("model"), **query}, headers)
            return None  # batches, embeddings
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(_text_only(m) for m in messages):
            return None  # images, audio: vLLM hashes their features into the blocks
        query = {k: body[k] for k in CHAT_TEMPLATE_FIELDS if k in body}
        return await self._tokenize({"model": body.get("model"), "messages": messages, **query}, headers)

    async def _tokenize(self, query: dict[str, Any], headers: dict[str, str]) -> list[int]:
        """The engine's own tokenizer and chat template, through its ``/tokenize`` endpoint."""
        url = self.decode.urls[self.decode.pick()] + "/tokenize"
        try:
            async with self.session.post(url, json=query, headers=headers, timeout=ClientTimeout(total=10)) as resp:
                data = await resp.json(content_type=None)
                if resp.status != 200:
                    raise _TokenizeError(f"{url}: HTTP {resp.status}")
        except (ClientError, TimeoutError, ValueError) as err:
            raise _TokenizeError(f"{url}: {type(err).__name__}: {err}") from None
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(tokens, list):
            raise _TokenizeError(f"{url}: no tokens in the answer")
        return tokens

    async def _prefill_then_decode(
        self,
        request: web.Request,
        body: dict[str, Any],
        headers: dict[str, str],
        prompt: Prompt | None = None,
        prefill: int | None = None,
    ) -> web.StreamResponse:
        first = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_TRANSFER}
        first.pop("stream_options", None)  # vLLM refuses stream_options on a request that does not stream
        if "max_completion_tokens" in first:
            first["max_completion_tokens"] = 1
        i = self.prefill.pick(prompt) if prefill is None else prefill
        self.metrics.engine_requests.labels("prefill", self.prefill.urls[i]).inc()
        with self.prefill.hold(i) as engine:
            url = engine + request.path
            try:
                async with self.session.post(url, json=first, headers=headers) as resp:
                    data = await resp.read()
                    if resp.status != 200:
                        return web.Response(body=data, status=resp.status, content_type=resp.content_type)
            except (ClientError, TimeoutError) as err:
                self._raise_if_gone(engine, err)
                log.warning("prefill %s failed: %s: %s", url, type(err).__name__, err)
                return _error(502, f"prefill failed: {type(err).__name__}")
        try:
            params = json.loads(data).get("kv_transfer_params")
        except (ValueError, AttributeError, RecursionError):
            params = None
        revision = self.revisions.get(engine)
        self._learn(params, revision)
        then = {**body, "kv_transfer_params": params}
        # Decode is chosen once prefill answered: its load then is what the generation meets. By load alone: the
        # pool now holds every full chunk prefill computed, so no decode engine holds much more of it. Mid-rollout,
        # among the prefill's own key revision: another's decode would look the prompt up under other keys.
        i = self.decode.pick(among=self._of_revision(self.decode, revision))
        self.metrics.engine_requests.labels("decode", self.decode.urls[i]).inc()
        with self.decode.hold(i) as engine:
            return await self._relay(request, "POST", engine + request.path, then, headers)

    def _learn(self, params: object, revision: str | None = None) -> None:
        """Take the key scheme a producer (of key ``revision``, when known) announced with its handoff."""
        if not isinstance(params, dict) or HANDOFF_KEY_SCHEME not in params:
            return
        try:
            scheme = KeyScheme.from_params(params[HANDOFF_KEY_SCHEME])
        except ValueError as err:
            log.warning("ignoring a producer's handoff: %s", err)
            return
        self._learnt_at = time.monotonic()
        self._scheme_revision = revision
        if scheme != self.scheme:
            log.info(
                "key scheme learnt from prefill: chunk_tokens=%d hash_block_size=%d hash=%s tp=%d",
                scheme.chunk_tokens,
                scheme.hash_block_size,
                scheme.hash_algo,
                len(scheme.fingerprints),
            )
            self.scheme = scheme

    async def _relay(
        self,
        request: web.Request,
        method: str,
        url: str,
        body: Any,
        headers: dict[str, str],
        data: bytes | None = None,
    ) -> web.StreamResponse:
        """Send ``body`` (JSON) or ``data`` (bytes as they came) upstream and pass the answer back as it comes
        (server-sent events included)."""
        payload: dict[str, Any] = {"data": data} if data is not None else {"json": body}
        # Which engine this is, looked up before sending: a connect that times out takes 10 s, long enough for the
        # next look at the upstream's workers to drop a pod gone in a rollout from the lists.
        engine = next((u for u in (*self.prefill.urls, *self.decode.urls) if url.startswith(u + "/")), None)
        try:
            async with self.session.request(method, url, headers=headers, **payload) as resp:
                if "text/event-stream" not in resp.headers.get("Content-Type", ""):
                    data = await resp.read()
                    return web.Response(body=data, status=resp.status, content_type=resp.content_type)
                out = web.StreamResponse(status=resp.status, headers={"Content-Type": resp.headers["Content-Type"]})
                await out.prepare(request)
                async for piece in resp.content.iter_any():
                    await out.write(piece)
                await out.write_eof()
                return out
        except (ClientError, TimeoutError) as err:
            if engine is not None:
                self._raise_if_gone(engine, err)
            log.warning("upstream %s failed: %s: %s", url, type(err).__name__, err)
            # The URL stays in the log: a client is not told where the engines are.
            return _error(502, f"upstream failed: {type(err).__name__}")

    def _raise_if_gone(self, engine: str, err: BaseException) -> None:
        """Following the upstream's pods, a connection that could not be made means the pod may be gone: the caller
        hands the request to the upstream instead of answering 502. Nothing was sent, so nothing runs twice."""
        if self.follow_workers_s is not None and isinstance(err, (ClientConnectorError, ConnectionTimeoutError)):
            raise _Unreachable(engine, f"{type(err).__name__}: {err}")


class _TokenizeError(Exception):
    pass


class _Unreachable(Exception):
    def __init__(self, url: str, why: str) -> None:
        super().__init__(url)
        self.url, self.why = url, why


def _log(request: web.Request, decision: Decision, target: str, endpoint: str) -> None:
    """One line per request; ``target``: the role of the engine serving it alone, or pd."""
    log.info(
        "route=%s reason=%s target=%s endpoint=%s path=%s prompt_tokens=%d chunks_hit=%d",
        decision.route,
        decision.reason,
        target,
        endpoint,
        request.path,
        decision.prompt_tokens,
        decision.chunks_hit,
    )


def _one_prompt(body: dict[str, Any]) -> object:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return prompt[0]  # a batch of one
    return prompt


def _token_ids(path: str, body: dict[str, Any]) -> list[int] | None:
    """A completion's prompt when given as token ids (the router keys these itself); None otherwise."""
    if path != COMPLETIONS:
        return None
    prompt = _one_prompt(body)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt
    return None


def _forwarded(request: web.Request) -> dict[str, str]:
    return {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}


def _text_only(message: object) -> bool:
    if not isinstance(message, dict):
        return False
    content = message.get("content")
    if content is None or isinstance(content, str):
        return True
    return isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "router_error", "code": status}}, status=status)
