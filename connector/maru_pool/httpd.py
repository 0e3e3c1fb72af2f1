"""HTTP side of a pool daemon: Prometheus ``/metrics``, ``/healthz`` and a ``/status`` JSON document.

Metrics are read from the role's stats at scrape time (a custom collector), so there is one source
of truth and no counter to keep in step. The operator reads ``/status`` of the metadata server (or of
``serve``) to fill in a MaruPool's capacity and use.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from maru_common.boundedhttp import BoundedHttpServer

from .units import join_host_port, split_host_port

log = logging.getLogger(__name__)

# stats name -> help text; counters get a ``_total`` suffix, everything else is a gauge.
COUNTERS = {
    "evictions": "Committed chunks evicted (least recently used) to make room.",
    "hits": "Keys found by prefix lookups.",
    "misses": "Keys looked up but not found (including those after the first miss of a lookup).",
    "read_misses": "Reads of keys that were not committed (evicted since the lookup, or never stored).",
    "lease_expiries": "Write leases and read pins reclaimed because their client did not finish in time.",
    "disconnect_releases": "Write leases and read pins given back because their client's connection closed.",
    "orphans": "Chunks refused because the chunk before them in their prompt is not stored (never hit).",
    "errors": "Failed requests: malformed, stale epoch, lost commits, chunks that failed their checksum.",
    "commits": "Chunks committed.",
    "heartbeat_failures": "Agent heartbeats to the metadata server that failed.",
    "auth_refusals": "Requests refused for want of a valid credential: no hello, a bad token, a forbidden op.",
    "connection_refusals": "Connections refused at accept: over --max-connections or --max-connections-per-peer.",
}
GAUGES = {
    "capacity_bytes": "Bytes of pool memory for chunks.",
    "used_bytes": "Bytes allocated to chunks (being written or committed).",
    "chunks": "Committed chunks.",
    "writing": "Chunks being written (under a write lease).",
    "pins": "Read pins held by clients.",
    "epoch": "Epoch of the pool index; changes on every daemon restart.",
    "agents_ready": "Node agents that sent a heartbeat recently.",
    "metadata_connected": "1 when this agent's last heartbeat reached the metadata server.",
    "connections": "Client connections open now (verified or not).",
}
# Per tenant (label ``tenant``: its key scope, "" without authentication), from the stats' ``tenants`` list.
TENANT_GAUGES = {
    "used_bytes": "Bytes of pool memory the tenant's chunks take, stored or being written.",
    "quota_bytes": "The tenant's byte quota (its token's, else the pool default; at most the pool).",
    "chunks": "The tenant's committed chunks.",
    "pins": "Read pins the tenant holds.",
    "quota_pins": "The tenant's pin quota (absent: unlimited).",
    "leases": "Write leases the tenant holds.",
    "quota_leases": "The tenant's write lease quota (absent: unlimited).",
}


def _tenant_metrics(tenants: list[dict[str, Any]]) -> Iterator[Metric]:
    for name, help_text in TENANT_GAUGES.items():
        family = GaugeMetricFamily(f"maru_pool_tenant_{name}", help_text, labels=["tenant"])
        for t in tenants:
            if t.get(name) is not None:
                family.add_metric([t["tenant"]], t[name])
        yield family
    evictions = CounterMetricFamily(
        "maru_pool_tenant_evictions",
        "The tenant's chunks evicted; by=other: for another tenant's chunks (what its quota protects it from), "
        "by=self: for its own (pool full, or at its byte quota).",
        labels=["tenant", "by"],
    )
    refusals = CounterMetricFamily(
        "maru_pool_tenant_quota_refusals",
        "Requests refused because the tenant was at its quota (kind: bytes, leases, pins).",
        labels=["tenant", "kind"],
    )
    for t in tenants:
        if "evictions_by_others" not in t:
            continue  # a tenant that only looked up: no account yet
        evictions.add_metric([t["tenant"], "other"], t["evictions_by_others"])
        evictions.add_metric([t["tenant"], "self"], t["evictions_by_self"])
        for kind, count in sorted(t["refused"].items()):
            refusals.add_metric([t["tenant"], kind], count)
    yield evictions
    yield refusals
    yield from _reader_metrics([t for t in tenants if "readers" in t])


def _reader_metrics(tenants: list[dict[str, Any]]) -> Iterator[Metric]:
    """What each tenant's readers asked the pool for and found (see readers.py)."""
    lookups = CounterMetricFamily(
        "maru_pool_tenant_lookups",
        "Lookups by the reader's role (decode, prefill; unknown: a client that does not say, e.g. an older one).",
        labels=["tenant", "role"],
    )
    tokens = CounterMetricFamily(
        "maru_pool_tenant_prompt_tokens",
        "Prompt tokens in whole chunks that readers looked up, by role: source=pool were in the pool, "
        "source=computed were not (asked minus found: the engine computes them itself). A handoff counts when "
        "its wait ends. For decode, computed tokens are the prefill work done twice.",
        labels=["tenant", "role", "source"],
    )
    waits = CounterMetricFamily(
        "maru_pool_tenant_handoff_waits",
        "Lookups that found fewer chunks than their prefill announced, and so waited for them in the daemon.",
        labels=["tenant"],
    )
    timeouts = CounterMetricFamily(
        "maru_pool_tenant_handoff_timeouts",
        "Handoff waits that ended at the reader's deadline with announced chunks still missing (evicted, never "
        "committed, or stored under other keys).",
        labels=["tenant"],
    )
    for t in tenants:
        name, r = t["tenant"], t["readers"]
        for role, count in sorted(r["lookups"].items()):
            lookups.add_metric([name, role], count)
        for role, by_source in sorted(r["prompt_tokens"].items()):
            for source, count in sorted(by_source.items()):
                tokens.add_metric([name, role, source], count)
        waits.add_metric([name], r["handoff_waits"])
        timeouts.add_metric([name], r["handoff_timeouts"])
    yield from (lookups, tokens, waits, timeouts)


class _StatsCollector:
    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        for name, value in self._stats().items():
            if name == "tenants":
                yield from _tenant_metrics(value)
            elif name in COUNTERS:
                yield CounterMetricFamily(f"maru_pool_{name}", COUNTERS[name], value=value)
            elif name in GAUGES:
                yield GaugeMetricFamily(f"maru_pool_{name}", GAUGES[name], value=value)


class HttpEndpoint:
    """Serve metrics and status on ``host:port`` from a few background threads; port 0 picks a free port.

    The threads are a fixed pool with deadlines (:mod:`maru_common.boundedhttp`): idle or slow connections
    to this port cannot take the threads the daemon needs for its tenants.
    """

    def __init__(
        self,
        address: str,
        *,
        stats: Callable[[], dict[str, Any]],
        status: Callable[[], dict[str, Any]],
        healthy: Callable[[], bool] = lambda: True,
    ) -> None:
        host, port = split_host_port(address, what=f"--metrics-addr {address}")
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_StatsCollector(stats))

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, CONTENT_TYPE_LATEST, generate_latest(registry))
                elif path == "/healthz":
                    ok = healthy()
                    self._send(200 if ok else 503, "text/plain", b"ok\n" if ok else b"unhealthy\n")
                elif path == "/status":
                    body = json.dumps(status(), sort_keys=True).encode()
                    self._send(200, "application/json", body)
                else:
                    self._send(404, "text/plain", b"try /metrics, /healthz or /status\n")

            def _send(self, code: int, ctype: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("http: " + format, *args)

        self._server = BoundedHttpServer(host, port, Handler, name="maru-pool-http")
        bound_host, bound_port = self._server.server_address[:2]
        self.address = join_host_port(str(bound_host), int(bound_port))

    def start(self) -> None:
        self._server.start()

    def close(self) -> None:
        self._server.close()
