"""Prometheus metrics of the operator: reconciles, their errors and durations, API calls, queue depth."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter("maru_operator_reconciles_total", "Reconciles run, by kind and result.", ["kind", "result"])
RECONCILE_SECONDS = Histogram(
    "maru_operator_reconcile_duration_seconds", "Time one reconcile took, by kind.", ["kind"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
WRITES = Counter("maru_operator_child_writes_total", "Writes to children, by kind and verb.", ["kind", "verb"])
STATUS_WRITES = Counter("maru_operator_status_writes_total", "Status patches, by kind.", ["kind"])
API_REQUESTS = Counter("maru_operator_api_requests_total", "Kubernetes API requests, by method and code.",
                       ["method", "code"])
API_LATENCY = Histogram("maru_operator_api_request_duration_seconds", "Kubernetes API latency, by method.",
                        ["method"])
QUEUE_DEPTH = Gauge("maru_operator_workqueue_depth", "Objects waiting to be reconciled.")
LEADER = Gauge("maru_operator_leader", "1 while this replica holds the leader Lease and reconciles, else 0.")
