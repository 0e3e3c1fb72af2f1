"""The router: decide per request, then decode alone or prefill then decode.

It composes four parts, each of one job:

* :mod:`.policy` (pure): the route a request takes, and how a prefill-then-decode request is run in each mode;
* :mod:`.directory`: the engines (given, or the upstream router's pods), what their own caches hold, their key
  revisions;
* :mod:`.scheme`: the engines' key scheme, learnt from the producers' handoffs (``kv_transfer_params``);
* :mod:`.relay`: bounded client bodies, requests relayed to engines and answers streamed back.

What stays here is the request's path through them: its body read and checked, its prompt tokenized (by the
engine's own ``/tokenize``) and keyed (:mod:`.prompt_keys`), the pool asked how many leading chunks it holds, and
the request sent where the policy says.

Any trouble finding the coverage (pool down or slow, tokenizer endpoint failing) sends the request through
prefill, as without this router: never an error of its own. The decision only affects speed, never the answer:
decode computes whatever it cannot load.

In front of another router (``upstream``: vllm-router, as the operator deploys it), a request that does not go to
decode alone is passed to that router untouched, and so is every serving path in :data:`UPSTREAM_PATHS`, never its
admin API. Each request this router sends goes to the engine of its role with the fewest of its requests in flight
(:mod:`.balance`); for engines whose KV events the router reads, an engine whose own cache holds more of the prompt
than the pool may take it while at most ``locality_slack`` requests busier than the least busy.

Clients are not trusted: a prompt of token ids longer than ``max_prompt_tokens`` is refused, long prompts are keyed
one at a time, off the event loop, and a lookup is cut into batches well under the pool daemon's frame limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from collections.abc import Callable
from typing import Any

from aiohttp import ClientError, ClientTimeout, web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from maru_contracts.config import MaruConnectorConfig
from maru_contracts.keys import KeyScheme
from maru_pool import guard
from maru_router import decide
from maru_router.balance import Prompt, direct_target
from maru_router.directory import EngineDirectory, Unreachable
from maru_router.limits import Limits
from maru_router.metrics import Metrics
from maru_router.policy import DIRECT, PD, Decision, Routing, Step, after_lookup, pd_step
from maru_router.prompt_keys import block_hashes, chunk_lookup_keys
from maru_router.relay import BodyReader, Relay, error, forwarded
from maru_router.revisions import Pairing
from maru_router.scheme import SchemeLearner

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
UNCOUNTED_PATHS = frozenset({"/health", "/metrics"})
Handler = Callable[[web.Request], Any]


class Router:
    def __init__(
        self,
        *,
        engines: EngineDirectory,
        connector: MaruConnectorConfig,
        routing: Routing | None = None,
        relearn_s: float = 60.0,
        limits: Limits | None = None,
    ) -> None:
        self.engines = engines
        self.metrics: Metrics = engines.metrics
        self.routing = routing or Routing()
        self.limits = limits or Limits()
        self.upstream = engines.upstream
        self.schemes = SchemeLearner(relearn_s)
        self.bodies = BodyReader(self.limits, self.metrics.buffered.set)
        self.relay = Relay(engines.engine_of, engines.raise_if_gone)
        self._long_lane = asyncio.Semaphore(1)
        self._pool = guard.PoolGuard(connector, "router", guard.Counters(), log)

    # ------------------------------------------------------------------ app

    def app(self, *, metrics: bool = True) -> web.Application:
        """The API; ``metrics``: ``GET /metrics`` here too (off when it has a port of its own: its counters would
        tell any client whether someone sent a prompt, and they name the engines' pods)."""
        app = web.Application(client_max_size=self.limits.max_body_bytes, middlewares=[self._count_in_progress])
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

    def metrics_app(self) -> web.Application:
        """``GET /metrics`` alone, for a metrics port of its own."""
        app = web.Application()
        app.router.add_get("/metrics", self.prometheus)
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
        self.engines.start(self.relay.open())

    async def _close(self, _: web.Application) -> None:
        await self.engines.close()
        await self.relay.close()
        self._pool.close()

    async def health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def prometheus(self, _: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.StreamResponse:
        decode = self.engines.decode
        return await self.relay.send(request, "GET", decode.urls[decode.pick()] + "/v1/models", forwarded(request))

    async def pass_through(self, request: web.Request) -> web.StreamResponse:
        """A serving path of the upstream router (:data:`UPSTREAM_PATHS`), untouched (method, query, body, content
        type); any other path is refused here and never reaches it."""
        if request.path not in UPSTREAM_PATHS.get(request.method, ()):
            log.warning("refused %s %s: not a path served to clients", request.method, request.path)
            return error(404, f"{request.method} {request.path}: not served by this router")
        raw = await self.bodies.read(request)
        if isinstance(raw, web.Response):
            return raw
        try:
            return await self._to_upstream(request, raw)
        finally:
            self.bodies.release(len(raw))

    async def _to_upstream(self, request: web.Request, raw: bytes) -> web.StreamResponse:
        assert self.upstream is not None
        self.metrics.upstream.inc()
        headers = forwarded(request)
        if request.content_type and raw:
            headers["Content-Type"] = request.headers.get("Content-Type", request.content_type)
        # The path as matched (decoded), not as sent: what was checked is what the upstream gets.
        url = self.upstream + request.path + (f"?{request.query_string}" if request.query_string else "")
        return await self.relay.send(request, request.method, url, headers, data=raw)

    # ------------------------------------------------------------------ requests

    @property
    def scheme(self) -> KeyScheme | None:
        return self.schemes.scheme

    async def serve(self, request: web.Request) -> web.StreamResponse:
        raw = await self.bodies.read(request)
        if isinstance(raw, web.Response):
            return raw
        headers = forwarded(request)
        # The body counts against --max-buffered-bytes until the decision: parsed and keyed, it takes several
        # times its size. What is relayed then is the engines' load, which they bound.
        try:
            admitted = await self._admit(request, raw, headers)
        finally:
            self.bodies.release(len(raw))
        if isinstance(admitted, web.Response):
            return admitted
        body, raw, decision = admitted
        self.metrics.requests.labels(decision.route, decision.reason).inc()
        try:
            if decision.route == DIRECT:
                return await self._direct(request, body, headers, decision)
            return await self._pd(request, body, raw, headers, decision)
        except Unreachable as gone:
            return await self._around(gone, request, raw)

    async def _direct(
        self, request: web.Request, body: dict[str, Any], headers: dict[str, str], decision: Decision
    ) -> web.StreamResponse:
        """One engine serves the covered prompt: chosen here, after the lookup, so the loads are read just before
        this request is counted. Mid-rollout, among the engines of the revision whose keys the pool found it under."""
        prefill, decode = self.engines.prefill, self.engines.decode
        among_d = self.engines.of_revision(decode, self.schemes.revision)
        among_p = self.engines.of_revision(prefill, self.schemes.revision)
        picks = (decode.pick(decision.prompt, among_d), prefill.pick(decision.prompt, among_p))
        role, i = direct_target(decode.loads, prefill.loads, to_prefill=self.routing.direct_to_prefill, picks=picks)
        engines = prefill if role == "prefill" else decode
        self.metrics.direct_targets.labels(role).inc()
        self.metrics.engine_requests.labels(role, engines.urls[i]).inc()
        _log(request, decision, role, engines.urls[i])
        with engines.hold(i) as url:
            return await self.relay.send(request, "POST", url + request.path, headers, body=body)

    async def _pd(
        self, request: web.Request, body: dict[str, Any], raw: bytes, headers: dict[str, str], decision: Decision
    ) -> web.StreamResponse:
        _log(request, decision, "pd", self.upstream or "-")
        pairing = self.engines.pairing()
        local = self._local_prefill(decision.prompt) if self.upstream is not None and pairing is None else None
        step = pd_step(
            mid_rollout=pairing is not None,
            upstream=self.upstream is not None,
            local_prefill=local is not None,
            may_refresh=self.routing.decode_direct and self.schemes.may_refresh(),
        )
        if step is Step.COHERENT:
            assert pairing is not None
            return await self._coherent(request, body, headers, decision.prompt, pairing)
        if step is Step.LOCAL_PREFILL:
            self.metrics.local_prefills.inc()
            return await self._prefill_then_decode(request, body, headers, decision.prompt, local)
        if step is Step.UPSTREAM:
            return await self._to_upstream(request, raw)
        if step is Step.REFRESH:
            self.schemes.claim_refresh()
            self.metrics.scheme_refreshes.inc()
            try:
                return await self._prefill_then_decode(request, body, headers, decision.prompt)
            finally:
                self.schemes.release()
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
            return error(400, "request body: JSON nested too deeply")
        except ValueError:  # an integer of more digits than Python converts
            return error(400, f"request body: an integer of more than {sys.get_int_max_str_digits()} digits")
        if not isinstance(body, dict):
            return error(400, "request body: must be a JSON object")
        ids = _token_ids(request.path, body)
        limit = self.limits.max_prompt_tokens
        if ids is not None and len(ids) > limit:
            return error(400, f"prompt: {len(ids)} token ids, more than the router's --max-prompt-tokens {limit}")
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
        caches = self.engines.caches
        decode_direct = self.routing.decode_direct
        if not decode_direct and not caches:
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
        if len(ids) > self.limits.max_prompt_tokens:  # a text prompt the engine tokenized (its own limit decides)
            return Decision(PD, "long", len(ids))
        need = decide.chunks_needed(len(ids), scheme.chunk_tokens, self.routing.min_coverage)
        salt = body.get("cache_salt")
        salt = salt if isinstance(salt, str) else None
        # Keying runs off the event loop; long prompts take turns, so they leave cores to everyone else's.
        lane = self._long_lane if len(ids) > LONG_PROMPT_TOKENS else contextlib.nullcontext()
        if need is None or not decode_direct:
            # Nothing to ask the pool for a skip; the engines' own caches may still hold the prompt.
            async with lane:
                hashes = await asyncio.to_thread(self._hashes, ids, scheme, salt) if caches else None
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
        return after_lookup(
            len(ids), need, chunks, Prompt(hashes, scheme.hash_block_size, chunks * scheme.chunk_tokens)
        )

    async def _around(self, gone: Unreachable, request: web.Request, raw: bytes) -> web.StreamResponse:
        """A pod taken from the upstream's list gave no answer (gone or stopping in a rollout, before the next look
        at the list): forget it and let the upstream router, whose discovery saw it go, serve the request."""
        log.warning(
            "engine %s unreachable (%s); forgetting it until the upstream lists it again, request passed "
            "to the upstream",
            gone.url,
            gone.why,
        )
        self.engines.forget(gone.url)
        return await self._to_upstream(request, raw)

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
        prefill, decode = self.engines.prefill, self.engines.decode
        if pairing.prefill:
            self.metrics.revision_requests.labels("paired").inc()
            i = prefill.pick(prompt, pairing.prefill)
            return await self._prefill_then_decode(request, body, headers, prompt, i)
        self.metrics.revision_requests.labels("single").inc()
        role, i = direct_target(decode.loads, prefill.loads, to_prefill=True)
        engines = prefill if role == "prefill" else decode
        self.metrics.engine_requests.labels(role, engines.urls[i]).inc()
        with engines.hold(i) as url:
            return await self.relay.send(request, "POST", url + request.path, headers, body=body)

    def _local_prefill(self, prompt: Prompt | None) -> int | None:
        """In front of another router: the prefill engine to run this prompt on here, because its own cache holds
        more of it than the pool gives every engine; None leaves the choice to that router."""
        if prompt is None or not self.engines.following:
            return None
        prefill = self.engines.prefill
        i = prefill.pick(prompt)
        return i if prefill.local_tokens(i, prompt) > prompt.pool_tokens else None

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
        decode = self.engines.decode
        url = decode.urls[decode.pick()] + "/tokenize"
        try:
            async with self.relay.session.post(
                url, json=query, headers=headers, timeout=ClientTimeout(total=10)
            ) as resp:
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
        prefill_engine: int | None = None,
    ) -> web.StreamResponse:
        prefill, decode = self.engines.prefill, self.engines.decode
        first = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_TRANSFER}
        first.pop("stream_options", None)  # vLLM refuses stream_options on a request that does not stream
        if "max_completion_tokens" in first:
            first["max_completion_tokens"] = 1
        i = prefill.pick(prompt) if prefill_engine is None else prefill_engine
        self.metrics.engine_requests.labels("prefill", prefill.urls[i]).inc()
        with prefill.hold(i) as engine:
            answer = await self.relay.exchange(engine + request.path, first, headers, engine)
        if isinstance(answer, web.Response):
            return answer
        status, data, content_type = answer
        if status != 200:
            return web.Response(body=data, status=status, content_type=content_type)
        try:
            params = json.loads(data).get("kv_transfer_params")
        except (ValueError, AttributeError, RecursionError):
            params = None
        revision = self.engines.revisions.get(engine)
        self.schemes.learn(params, revision)
        then = {**body, "kv_transfer_params": params}
        # Decode is chosen once prefill answered: its load then is what the generation meets. By load alone: the
        # pool now holds every full chunk prefill computed, so no decode engine holds much more of it. Mid-rollout,
        # among the prefill's own key revision: another's decode would look the prompt up under other keys.
        i = decode.pick(among=self.engines.of_revision(decode, revision))
        self.metrics.engine_requests.labels("decode", decode.urls[i]).inc()
        with decode.hold(i) as engine:
            return await self.relay.send(request, "POST", engine + request.path, headers, body=then)


class _TokenizeError(Exception):
    pass


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


def _text_only(message: object) -> bool:
    if not isinstance(message, dict):
        return False
    content = message.get("content")
    if content is None or isinstance(content, str):
        return True
    return isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content)
