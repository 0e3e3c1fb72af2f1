"""What the chart ships for monitoring: PodMonitors that select the pods the operator renders, alert rules
and a dashboard whose every expression parses and reads only metrics the code exports, each alert with its
runbook in docs/operations.md."""

from __future__ import annotations

import json
import re
from functools import cache, partial
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from tests.chart.promql import PromQLError, metrics_of
from tests.support.chart import CHART, NAMESPACE, RELEASE, REPO_ROOT, find, one

pytestmark = pytest.mark.tools

RULES_FILE = CHART / "files" / "prometheus-rules.yaml"
DASHBOARD_FILE = CHART / "files" / "grafana-dashboard.json"
OPERATIONS = REPO_ROOT / "docs" / "operations.md"
ALL_ON = ("--set", "podMonitors.enabled=true,prometheusRule.enabled=true,grafanaDashboard.enabled=true")
DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d))+$")


def _families(registry: Any) -> set[str]:
    """Every series name a prometheus_client registry exposes, children or not."""
    suffixes = {
        "counter": ("_total",),
        "histogram": ("_bucket", "_sum", "_count"),
        "gauge": ("",),
        "summary": ("_sum", "_count", ""),
    }
    return {family.name + suffix for family in registry.collect() for suffix in suffixes.get(family.type, ("",))}


@cache
def exported_metrics() -> frozenset[str]:
    """The series the operator, the pool daemons, maru-router, the connector and vLLM itself export, read off
    their own exporters (not a list kept by hand)."""
    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

    import maru_operator.metrics  # noqa: F401  (registers the operator's metrics on the default registry)
    from maru_connector.vllm.stats import MaruPromMetrics
    from maru_pool import httpd
    from maru_router.metrics import Metrics

    names = {n for n in _families(REGISTRY) if n.startswith("maru_operator_")}
    names |= _families(Metrics().registry)
    # The pool daemon's collector, given one of every statistic and a tenant that looked up and stored.
    tenant = {
        "tenant": "ns/cache",
        **dict.fromkeys(httpd.TENANT_GAUGES, 1),
        "evictions_by_others": 0,
        "evictions_by_self": 0,
        "refused": {},
        "readers": {"lookups": {}, "prompt_tokens": {}, "handoff_waits": 0, "handoff_timeouts": 0},
    }
    stats = {**dict.fromkeys(httpd.COUNTERS, 1), **dict.fromkeys(httpd.GAUGES, 1), "tenants": [tenant]}
    pool = CollectorRegistry(auto_describe=False)
    pool.register(httpd._StatsCollector(lambda: stats))
    names |= _families(pool)
    connector = CollectorRegistry()
    types = {cls: partial(cls, registry=connector) for cls in (Counter, Gauge, Histogram)}
    MaruPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["engine"], {0: ["0"]})
    names |= _families(connector)
    return frozenset(names)


def rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES_FILE.read_text())["groups"] for rule in group["rules"]]


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD_FILE.read_text())
    return [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]


def test_the_exporters_are_read() -> None:
    """Guards the catalogue: one series of each exporter is in it, and nothing it lists is invented."""
    names = exported_metrics()
    for name in (
        "maru_operator_reconciles_total",
        "maru_pool_used_bytes",
        "maru_pool_tenant_prompt_tokens_total",
        "maru_router_fallbacks_total",
        "vllm:maru_connector_hook_errors_total",
        "vllm:maru_connector_load_seconds_bucket",
    ):
        assert name in names
    assert "maru_pool_no_such_thing" not in names


def test_the_parser_refuses_what_prometheus_would() -> None:
    for bad in (
        "rate(maru_pool_hits_total)",
        "sum(rate(maru_pool_hits_total[5m])",
        "frate(x[5m])",
        'x{a~"b"}',
        "histogram_quantile(x_bucket)",
        "sum by (a) x",
    ):
        with pytest.raises(PromQLError):
            metrics_of(bad)
    assert metrics_of('sum by (le) (rate(a_bucket{x="y"}[5m])) / on(le) b > bool 1') == {"a_bucket", "b"}


def test_alert_rules_are_well_formed() -> None:
    seen = set()
    for rule in rules():
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert re.fullmatch(r"Maru[A-Za-z]+", rule["alert"]) and rule["alert"] not in seen
        seen.add(rule["alert"])
        assert "for" not in rule or DURATION.match(rule["for"]), rule["alert"]
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert {"summary", "description", "runbook_url"} <= set(rule["annotations"])
        metrics_of(rule["expr"])  # raises on what does not parse


@pytest.mark.parametrize("where", ["rules", "dashboard"])
def test_every_metric_named_is_exported(where: str) -> None:
    """A renamed or dropped metric must not leave an alert that never fires or a panel that stays empty."""
    exprs = [r["expr"] for r in rules()] if where == "rules" else dashboard_exprs()
    assert exprs
    unknown = {(name, expr) for expr in exprs for name in metrics_of(expr) if name not in exported_metrics()}
    assert not unknown, f"{where} read metrics nothing exports: {sorted(unknown)}"


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes."""
    headings = re.findall(r"^#+ (.+)$", markdown, flags=re.MULTILINE)
    return {re.sub(r"[^a-z0-9 _-]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_alert_has_its_runbook_entry() -> None:
    anchors = _anchors(OPERATIONS.read_text())
    for rule in rules():
        url = rule["annotations"]["runbook_url"]
        assert url.startswith("https://github.com/maru-pd/maru-pd/blob/main/docs/operations.md#"), url
        assert url.rsplit("#", 1)[1] in anchors, f"docs/operations.md has no section for {rule['alert']}"


def test_monitoring_objects_are_off_by_default(default_objects: list[dict[str, Any]]) -> None:
    assert not [o for o in default_objects if o["kind"] in {"PodMonitor", "PrometheusRule", "ConfigMap"}]


def test_rule_and_dashboard_objects_carry_the_files(render) -> None:
    objects = render(*ALL_ON, "--set", "prometheusRule.labels.release=prom")
    rule = one(objects, "PrometheusRule")
    assert rule["metadata"]["namespace"] == NAMESPACE and rule["metadata"]["labels"]["release"] == "prom"
    assert rule["spec"] == yaml.safe_load(RULES_FILE.read_text())
    dashboard = one(objects, "ConfigMap", f"{RELEASE}-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["maru.json"]) == json.loads(DASHBOARD_FILE.read_text())


def _workloads(pool_namespace: str) -> list[dict[str, Any]]:
    """The operator's rendering of the examples: the pods it would run for their pools and groups."""
    from maru_operator.render import load_documents, render_objects

    paths = [
        REPO_ROOT / "examples" / name
        for name in ("pool-cxl.yaml", "inferencegroup.yaml", "pool-shm.yaml", "inferencegroup-shm.yaml")
    ]
    objects = render_objects(load_documents(paths), pool_namespace, warn=lambda _msg: None)
    return [o for o in objects if o["kind"] in {"Deployment", "DaemonSet"}]


def _selects(monitor: dict[str, Any], workload: dict[str, Any]) -> bool:
    spec = monitor["spec"]
    namespaces = spec["namespaceSelector"]
    in_namespace = namespaces.get("any") or workload["metadata"]["namespace"] in namespaces.get("matchNames", [])
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return bool(in_namespace) and spec["selector"]["matchLabels"].items() <= labels.items()


def _ports(workload: dict[str, Any]) -> set[str]:
    return {p["name"] for c in workload["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}


@pytest.mark.parametrize("watch", [False, True], ids=["all-namespaces", "watchNamespaces"])
def test_pod_monitors_scrape_every_pod_the_operator_runs(render, watch: bool) -> None:
    """Each PodMonitor selects pods the operator renders, by their labels, on ports they have; and every
    metrics port of those pods is scraped by one of them."""
    extra = ("--set-json", 'watchNamespaces=["llm","default"]') if watch else ()
    monitors = find(render(*ALL_ON, *extra), "PodMonitor")
    assert {m["metadata"]["name"] for m in monitors} == {f"{RELEASE}-{n}" for n in ("pool", "vllm", "router")}
    workloads = _workloads(NAMESPACE)
    scraped: set[tuple[str, str]] = set()
    for monitor in monitors:
        selected = [w for w in workloads if _selects(monitor, w)]
        assert selected, f"{monitor['metadata']['name']} selects no pod the operator renders"
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert endpoint["path"] == "/metrics"
            having = [w for w in selected if endpoint["port"] in _ports(w)]
            assert having, f"{monitor['metadata']['name']}: no selected pod has a port {endpoint['port']}"
            scraped |= {(w["metadata"]["name"], endpoint["port"]) for w in having}
    for workload in workloads:
        for port in _ports(workload) & {"metrics", "direct-metrics"}:
            assert (workload["metadata"]["name"], port) in scraped, f"{workload['metadata']['name']}:{port}"
    vllm = [w for w in workloads if w["spec"]["template"]["metadata"]["labels"].get("maru.io/role") == "decode"]
    assert vllm and all((w["metadata"]["name"], "http") in scraped for w in vllm)
