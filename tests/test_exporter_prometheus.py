"""The scrape endpoint, scraped by a real Prometheus; and docs/telemetry.md in step with the code."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from exporters import ExportersConfig, PrometheusConfig, PrometheusExporter, build_exporters
from processor.errors import ConfigError
from processor.telemetry import METRICS, Telemetry, render_markdown
from tests.servers import LOCALHOST, prometheus_server, query, wait_until

ROOT = Path(__file__).resolve().parent.parent
UNBOUNDED_LABELS = {"session", "session_id", "action", "action_id", "trace_id", "span_id", "violation_id"}


@pytest.fixture
def telemetry() -> Telemetry:
    return Telemetry()


@pytest.fixture
def endpoint(telemetry: Telemetry) -> Iterator[PrometheusExporter]:
    exporter = PrometheusExporter(f"{LOCALHOST}:0", telemetry)
    yield exporter
    exporter.shutdown()


def count_test_session(telemetry: Telemetry) -> None:
    """What the pipeline counts for a test session: five actions, two violations."""
    telemetry.actions.labels("payment", "ok", "booking-agent").inc(3)
    telemetry.actions.labels("user_prompt", "ok", "booking-agent").inc(2)
    telemetry.violations.labels("DS002", "critical", "booking-agent").inc()
    telemetry.violations.labels("DS001", "error", "booking-agent").inc()
    telemetry.spans_received.labels("grpc").inc(5)


def test_metrics_are_served_on_metrics_path(telemetry: Telemetry, endpoint: PrometheusExporter) -> None:
    count_test_session(telemetry)
    base = f"http://{LOCALHOST}:{endpoint.port}"
    response = httpx.get(f"{base}/metrics")
    assert response.status_code == 200
    assert ('durable_check_violations_total{rule="DS002",service="booking-agent",severity="critical"} 1.0'
            in response.text)
    assert 'durable_check_actions_total{kind="payment",service="booking-agent",status="ok"} 3.0' in response.text
    assert httpx.get(f"{base}/nope").status_code == 404
    assert "/metrics" in httpx.get(f"{base}/").text


def test_a_taken_port_is_a_config_error(endpoint: PrometheusExporter) -> None:
    cfg = ExportersConfig(prometheus=PrometheusConfig(endpoint=f"{LOCALHOST}:{endpoint.port}"))
    with pytest.raises(ConfigError) as info:
        build_exporters(cfg, Telemetry())
    assert "exporters.prometheus.endpoint" in str(info.value)


def test_no_metric_has_an_unbounded_label() -> None:
    for spec in METRICS:
        assert not UNBOUNDED_LABELS & set(spec.labels), spec.name


def test_telemetry_doc_is_generated_from_the_code() -> None:
    committed = (ROOT / "docs" / "telemetry.md").read_text()
    assert committed == render_markdown(), "regenerate: python -m processor.telemetry > docs/telemetry.md"


@pytest.mark.servers
def test_prometheus_scrapes_the_endpoint(tmp_path: Path, telemetry: Telemetry, endpoint: PrometheusExporter) -> None:
    count_test_session(telemetry)
    target = f"{LOCALHOST}:{endpoint.port}"
    with prometheus_server(tmp_path / "prometheus", [target], []) as prometheus:
        result = wait_until(
            lambda: query(prometheus.url, 'durable_check_violations_total{rule="DS002"}'),
            timeout_s=30, what="Prometheus to scrape the violations counter",
        )
        assert result[0]["metric"]["job"] == "durable-check"
        assert result[0]["metric"]["severity"] == "critical"
        assert float(result[0]["value"][1]) == 1.0

        # The pipeline counts more; the next scrapes see it.
        telemetry.violations.labels("DS002", "critical", "booking-agent").inc(4)
        wait_until(
            lambda: [r for r in query(prometheus.url, 'durable_check_violations_total{rule="DS002"}')
                     if float(r["value"][1]) == 5.0],
            timeout_s=30, what="the incremented counter",
        )
        up = query(prometheus.url, 'up{job="durable-check"}')
        assert float(up[0]["value"][1]) == 1.0
        # No scraped series carries a session, action or trace id.
        series = query(prometheus.url, '{__name__=~"durable_check_.*"}')
        assert series
        for s in series:
            assert not UNBOUNDED_LABELS & set(s["metric"]), s["metric"]
