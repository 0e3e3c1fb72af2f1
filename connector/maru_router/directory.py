"""The engines a router sends to: who they are, what their own caches hold, which key revision each runs.

* **Roles**: the prefill and decode URLs given, or, following another router in front of the same engines
  (``follow_workers_s``: vllm-router's ``GET /workers``, its pod discovery), the pods it lists, by address.
* **Caches**: for engines whose KV events are read (given, or ``discover_kv_events``: asked where they publish),
  what each engine's own prefix cache holds (:mod:`.locality`).
* **Revisions**: the key revision each engine runs, given or announced as its KV events' topic
  (:mod:`.revisions`): while the engines span more than one, prefill and decode are paired within one.

Nothing here routes a request: the router asks for engines, the directory answers from what it has seen.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence

from aiohttp import ClientConnectionError, ClientError, ClientPayloadError, ClientSession, ClientTimeout

from maru_router.balance import Endpoints
from maru_router.locality import EngineCache, Subscriber, announced_endpoint
from maru_router.metrics import Metrics
from maru_router.revisions import Pairing, pairable, revision_of

log = logging.getLogger("maru.router")

DISCOVERY_RETRY_S = 5.0  # how often to ask an engine not yet answering where it publishes its KV events


class Unreachable(Exception):
    """A followed pod gave no answer (gone, or going, in a rollout): it could not be connected to, or it closed the
    connection before answering. Nothing reached the client, and a completion changes nothing but an engine's
    cache, so the request may run again elsewhere."""

    def __init__(self, url: str, why: str) -> None:
        super().__init__(url)
        self.url, self.why = url, why


class EngineDirectory:
    def __init__(
        self,
        *,
        prefill: Sequence[str],
        decode: Sequence[str],
        metrics: Metrics,
        kv_events: Mapping[str, str] | None = None,
        discover_kv_events: bool = False,
        locality_slack: int = 1,
        follow_workers_s: float | None = None,
        upstream: str | None = None,
        engine_revisions: Mapping[str, str] | None = None,
    ) -> None:
        if follow_workers_s is not None and (follow_workers_s <= 0 or not upstream):
            raise ValueError("router: following the upstream's workers needs --upstream and a period > 0")
        known = {u.rstrip("/") for u in (*prefill, *decode)}
        unknown = sorted(set(kv_events or {}) - known)
        if unknown:
            raise ValueError(f"router: --kv-events names {unknown[0]}, which is neither a --prefill nor a --decode URL")
        self.metrics = metrics
        self.upstream = upstream.rstrip("/") if upstream else None
        self.follow_workers_s = follow_workers_s
        self.discover_kv_events = discover_kv_events
        self._given_revisions = {u.rstrip("/"): r for u, r in (engine_revisions or {}).items()}
        self.revisions: dict[str, str] = dict(self._given_revisions)  # engine URL -> key revision
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
        self._session: ClientSession | None = None
        self.prefill = Endpoints("prefill", prefill, self._gauge("prefill"), caches=self.caches, slack=locality_slack)
        self.decode = Endpoints("decode", decode, self._gauge("decode"), caches=self.caches, slack=locality_slack)

    # ------------------------------------------------------------------ lifecycle

    def start(self, session: ClientSession) -> None:
        """Read the engines' KV events, ask the others where they publish, follow the upstream's workers."""
        self._session = session
        for subscriber in self._subscribers.values():
            subscriber.start()
        self._revision_gauges()
        for url in self._undiscovered:
            self._start_discovery(url)
        if self.follow_workers_s is not None:
            self._background.append(asyncio.get_running_loop().create_task(self._follow_workers()))

    async def close(self) -> None:
        tasks = [*self._background, *self._discoveries.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for subscriber in self._subscribers.values():
            await subscriber.close()

    # ------------------------------------------------------------------ questions

    def pairing(self) -> Pairing | None:
        """The coherent pairs while the engines of known key revision span more than one (None: any pair)."""
        if not self.revisions:
            return None
        return pairable(self.prefill.urls, self.decode.urls, self.revisions)

    def of_revision(self, engines: Endpoints, revision: str | None) -> list[int] | None:
        """Mid-rollout, the engines of key ``revision`` (None: any engine, as when the engines share one
        revision; a role with none of it gets None too, and its engine misses and computes: slower, never
        wrong)."""
        if revision is None or self.pairing() is None:
            return None
        of = [i for i, u in enumerate(engines.urls) if self.revisions.get(u) == revision]
        return of or None

    @property
    def following(self) -> bool:
        """Whether the engines are the upstream router's pods (by address), not the role Services."""
        return self.follow_workers_s is not None

    def engine_of(self, url: str) -> str | None:
        """The engine a request URL goes to (looked up before sending: a connect that times out takes 10 s, long
        enough for the next look at the upstream's workers to drop a pod gone in a rollout from the lists)."""
        return next((u for u in (*self.prefill.urls, *self.decode.urls) if url.startswith(u + "/")), None)

    def raise_if_gone(self, engine: str | None, err: BaseException) -> None:
        """Following the upstream's pods, a connection that failed before the answer means the pod may be gone or
        stopping (refused, reset, closed without an answer, cut mid-answer: a pod deleted since the last look at
        the upstream's list): the caller hands the request to the upstream instead of answering 502."""
        if engine is not None and self.following and isinstance(err, (ClientConnectionError, ClientPayloadError)):
            raise Unreachable(engine, f"{type(err).__name__}: {err}")

    def forget(self, url: str) -> None:
        """Drop an engine from both roles until the upstream lists it again."""
        self.prefill.replace([u for u in self.prefill.urls if u != url])
        self.decode.replace([u for u in self.decode.urls if u != url])

    # ------------------------------------------------------------------ discovery

    @property
    def session(self) -> ClientSession:
        assert self._session is not None, "the directory is not started"
        return self._session

    def _gauge(self, role: str) -> Callable[[str, int], None]:
        return lambda url, n: self.metrics.in_flight.labels(role, url).set(n)

    def _cache_gauge(self, url: str) -> Callable[[], None]:
        cache = self.caches[url]

        def update() -> None:
            self.metrics.cached_blocks.labels(url).set(len(cache.blocks))
            self.metrics.event_resets.labels(url).set(cache.resets)

        return update

    def _revision_gauges(self) -> None:
        self.metrics.engine_revision.clear()
        for url in {*self.prefill.urls, *self.decode.urls}:
            if url in self.revisions:
                self.metrics.engine_revision.labels(url, self.revisions[url]).set(1)

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
                await self.take_workers(data)
            except (ClientError, TimeoutError, ValueError) as err:
                log.debug("upstream worker list unavailable: %s", err)
            await asyncio.sleep(self.follow_workers_s)

    async def take_workers(self, data: object) -> None:
        """The upstream's answer to ``GET /workers``: its healthy workers become this router's engines."""
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
