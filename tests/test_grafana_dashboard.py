"""The Grafana dashboard: every PromQL expression runs on a real Prometheus scraping our metrics,
every metric it names exists, and the chart ships it to the Grafana sidecar only when asked."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import httpx
import yaml

from exporters import PrometheusConfig, PrometheusExporter
from processor.telemetry import METRICS, Telemetry
from tests.servers import LOCALHOST, prometheus_server, query, wait_until

REPO = Path(__file__).resolve().parent.parent
DASHBOARD = REPO / "deploy/grafana/durable-check.json"
CHART = REPO / "deploy/helm/durable-check"
# What Grafana puts in place of its variables before the query reaches Prometheus.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__range": "5m", "$__interval": "15s", "$job": ".+"}


def _dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return loaded


def _expressions() -> list[tuple[str, str]]:
    return [(panel["title"], target["expr"]) for panel in _dashboard()["panels"] if panel["type"] != "row"
            for target in panel["targets"]]


def _grafana_expanded(expr: str) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"an unknown Grafana variable in {expr}"
    return expr


def _our_metric_names() -> set[str]:
    names = set()
    for spec in METRICS:
        if spec.type == "counter":
            names.add(spec.name + "_total")
        elif spec.type == "histogram":
            names.update(spec.name + suffix for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(spec.name)
    return names


def test_dashboard_covers_the_issue_and_names_only_our_metrics() -> None:
    dashboard = _dashboard()
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    used = set()
    for title, expr in _expressions():
        named = set(re.findall(r"\bdurable_check_[a-z_]+\b", expr))
        assert named, f"{title}: no durable_check metric in {expr}"
        unknown = named - _our_metric_names()
        assert not unknown, f"{title}: {unknown} not declared in processor/telemetry.py"
        used |= named
    # Violations, waits, spans in, evaluation latency, exporters, journal and outbox.
    for needed in ("durable_check_violations_total", "durable_check_open_waits",
                   "durable_check_oldest_open_wait_age_seconds", "durable_check_spans_received_total",
                   "durable_check_spans_rejected_total", "durable_check_spans_late_total",
                   "durable_check_spans_duplicate_total", "durable_check_evaluation_seconds_bucket",
                   "durable_check_exporter_failures_total", "durable_check_journal_depth",
                   "durable_check_outbox_pending", "durable_check_exporter_last_success_timestamp_seconds"):
        assert needed in used, needed


def test_every_expression_runs_on_a_real_prometheus(tmp_path: Path) -> None:
    telemetry = Telemetry()
    exporter = PrometheusExporter(PrometheusConfig(endpoint=f"{LOCALHOST}:0"), telemetry)
    try:
        telemetry.violations.labels("DS107", "critical", "travel-agent").inc(3)
        telemetry.open_waits.labels("awaiting_approval").set(2)
        telemetry.spans_received.labels("grpc").inc(100)
        telemetry.evaluation_seconds.observe(0.002)
        with prometheus_server(tmp_path / "prometheus", [f"{LOCALHOST}:{exporter.port}"], []) as prometheus:
            wait_until(lambda: len(query(prometheus.url, "durable_check_spans_received_total")) > 0,
                       timeout_s=30, what="the first scrape")
            telemetry.violations.labels("DS107", "critical", "travel-agent").inc(2)
            telemetry.spans_received.labels("grpc").inc(50)
            wait_until(lambda: query(prometheus.url, "durable_check_violations_total")[0]["value"][1] == "5",
                       timeout_s=30, what="a second scrape")
            for title, expr in _expressions():
                answer = httpx.get(f"{prometheus.url}/api/v1/query", params={"query": _grafana_expanded(expr)},
                                   timeout=10)
                body = answer.json()
                assert answer.status_code == 200 and body["status"] == "success", (title, expr, body)
            by_rule = query(prometheus.url, _grafana_expanded(next(
                e for t, e in _expressions() if t == "Violations in the range, by rule")))
            assert [(r["metric"]["rule"], float(r["value"][1]) > 0) for r in by_rule] == [("DS107", True)]
            waits = query(prometheus.url, _grafana_expanded(next(e for t, e in _expressions()
                                                                 if t == "Open waits by state")))
            assert waits[0]["metric"]["state"] == "awaiting_approval" and waits[0]["value"][1] == "2"
    finally:
        exporter.shutdown()


def _render(values: dict[str, Any]) -> dict[str, str]:
    with helm.Chart.load(str(CHART)) as chart:
        rendered: dict[str, str] = chart.render(values, name="example", namespace="default")
    return rendered


def test_chart_ships_the_dashboard_for_the_grafana_sidecar_only_when_enabled() -> None:
    assert not _render({}).get("durable-check/templates/grafana-dashboard.yaml", "").strip()
    text = _render({"grafanaDashboard": {"enabled": True}})["durable-check/templates/grafana-dashboard.yaml"]
    configmap = yaml.safe_load(text)
    assert configmap["kind"] == "ConfigMap"
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["durable-check.json"]) == _dashboard()
    assert (CHART / "files/grafana-dashboard.json").read_bytes() == DASHBOARD.read_bytes()


def test_dashboard_links_the_operator_view_where_waits_and_violations_are_drawn() -> None:
    dashboard = _dashboard()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["view_url"]["type"] == "textbox"
    assert variables["view_url"]["query"] == "http://127.0.0.1:4319"  # serve's default ui.endpoint
    assert {link["url"] for link in dashboard["links"]} == {"${view_url}/", "${view_url}/violations"}
    linked = {p["title"]: p["links"][0]["url"] for p in dashboard["panels"] if p.get("links")}
    assert linked["Open waits by state"] == linked["Oldest open wait"] == "${view_url}/"
    assert linked["Violations per second by rule"] == "${view_url}/violations"
