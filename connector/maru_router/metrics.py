"""maru-router's Prometheus metrics, on a registry of its own (``GET /metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from maru_contracts.router import IN_PROGRESS_METRIC


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
