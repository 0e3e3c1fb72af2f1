"""Prometheus metrics of the operator: reconciles, their errors and durations, API calls, queue depth, and each
group's decode traffic (is disaggregation working?)."""

from __future__ import annotations

import contextlib

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.exposition import MetricsHandler

from maru_common.boundedhttp import BoundedHttpServer
from maru_operator.traffic import DecodeReads

RECONCILES = Counter("maru_operator_reconciles_total", "Reconciles run, by kind and result.", ["kind", "result"])
RECONCILE_SECONDS = Histogram(
    "maru_operator_reconcile_duration_seconds",
    "Time one reconcile took, by kind.",
    ["kind"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
WRITES = Counter("maru_operator_child_writes_total", "Writes to children, by kind and verb.", ["kind", "verb"])
STATUS_WRITES = Counter("maru_operator_status_writes_total", "Status patches, by kind.", ["kind"])
API_REQUESTS = Counter(
    "maru_operator_api_requests_total", "Kubernetes API requests, by method and code.", ["method", "code"]
)
API_LATENCY = Histogram("maru_operator_api_request_duration_seconds", "Kubernetes API latency, by method.", ["method"])
QUEUE_DEPTH = Gauge("maru_operator_workqueue_depth", "Objects waiting to be reconciled.")
LEADER = Gauge("maru_operator_leader", "1 while this replica holds the leader Lease and reconciles, else 0.")
CRD_STALE = Gauge(
    "maru_operator_crd_stale",
    "1 while the CRD on the cluster differs from the one this operator was built from (checked at start), else 0.",
    ["crd"],
)

# Per group, over the operator's --disaggregation-window (from the pool daemons' decode counters).
GROUP_DECODE_TOKENS = Gauge(
    "maru_operator_group_decode_prompt_tokens",
    "Decode prompt tokens (whole chunks) over the disaggregation window, by source: pool (loaded from the pool) "
    "or computed (decode computed them itself).",
    ["namespace", "group", "source"],
)
GROUP_DECODE_POOL_SHARE = Gauge(
    "maru_operator_group_decode_pool_share",
    "Share (0 to 1) of decode prompt tokens loaded from the pool over the disaggregation window; absent without "
    "decode traffic.",
    ["namespace", "group"],
)
GROUP_HANDOFF_WAITS = Gauge(
    "maru_operator_group_handoff_waits",
    "Decode lookups that waited for chunks their prefill announced, over the disaggregation window.",
    ["namespace", "group"],
)
GROUP_HANDOFF_TIMEOUTS = Gauge(
    "maru_operator_group_handoff_timeouts",
    "Handoff waits that ran out with announced chunks missing, over the disaggregation window.",
    ["namespace", "group"],
)
GROUP_DISAGGREGATION = Gauge(
    "maru_operator_group_disaggregation_active",
    "The group's DisaggregationActive condition: 1 True, 0 False, -1 Unknown.",
    ["namespace", "group"],
)
_CONDITION_VALUE = {"True": 1, "False": 0, "Unknown": -1}


def set_group_traffic(namespace: str, group: str, reads: DecodeReads | None, status: str) -> None:
    """The group's decode traffic in the window (None: not judged yet) and its condition's status."""
    GROUP_DISAGGREGATION.labels(namespace, group).set(_CONDITION_VALUE[status])
    if reads is None:
        return
    GROUP_DECODE_TOKENS.labels(namespace, group, "pool").set(reads.pool)
    GROUP_DECODE_TOKENS.labels(namespace, group, "computed").set(reads.computed)
    GROUP_HANDOFF_WAITS.labels(namespace, group).set(reads.handoff_waits)
    GROUP_HANDOFF_TIMEOUTS.labels(namespace, group).set(reads.handoff_timeouts)
    if reads.tokens:
        GROUP_DECODE_POOL_SHARE.labels(namespace, group).set(reads.pool / reads.tokens)
    else:
        with contextlib.suppress(KeyError):
            GROUP_DECODE_POOL_SHARE.remove(namespace, group)


def forget_group(namespace: str, group: str) -> None:
    """A deleted group's series go with it."""
    for gauge in (GROUP_DECODE_POOL_SHARE, GROUP_HANDOFF_WAITS, GROUP_HANDOFF_TIMEOUTS, GROUP_DISAGGREGATION):
        with contextlib.suppress(KeyError):
            gauge.remove(namespace, group)
    for source in ("pool", "computed"):
        with contextlib.suppress(KeyError):
            GROUP_DECODE_TOKENS.remove(namespace, group, source)


def serve(port: int, addr: str = "0.0.0.0") -> BoundedHttpServer:
    """Serve ``/metrics`` on ``addr:port`` (0: a free port) until the process ends, from a fixed pool of threads.

    Not prometheus_client's ``start_http_server``: it starts a thread per connection and waits on it with no
    deadline, so idle connections from any pod the NetworkPolicy lets in would exhaust the operator's pids.
    """
    server = BoundedHttpServer(addr, port, MetricsHandler, name="maru-operator-metrics")
    server.start()
    return server
