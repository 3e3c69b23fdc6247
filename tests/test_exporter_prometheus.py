"""The scrape endpoint, scraped by a real Prometheus; and docs/telemetry.md in step with the code."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from exporters import ExportersConfig, PrometheusConfig, PrometheusExporter, build_exporters
from processor.errors import ConfigError
from processor.listener_config import AuthConfig, TLSConfig
from processor.telemetry import METRICS, Telemetry, render_markdown
from tests.pki_support import make_pki
from tests.servers import LOCALHOST, prometheus_server, query, wait_until

ROOT = Path(__file__).resolve().parent.parent
UNBOUNDED_LABELS = {"session", "session_id", "action", "action_id", "trace_id", "span_id", "violation_id"}


@pytest.fixture
def telemetry() -> Telemetry:
    return Telemetry()


@pytest.fixture
def endpoint(telemetry: Telemetry) -> Iterator[PrometheusExporter]:
    exporter = PrometheusExporter(PrometheusConfig(endpoint=f"{LOCALHOST}:0"), telemetry)
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


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.mark.servers
def test_prometheus_scrapes_over_tls_with_a_bearer_token(tmp_path: Path, pki: dict[str, Path]) -> None:
    """The scrape endpoint takes the listeners' TLS and token settings; a real Prometheus scrapes it with both."""
    telemetry = Telemetry()
    count_test_session(telemetry)
    token = "scrape-token-1"
    cfg = PrometheusConfig(endpoint=f"{LOCALHOST}:0",
                           tls=TLSConfig(cert_file=str(pki["server_cert"]), key_file=str(pki["server_key"])),
                           auth=AuthConfig(bearer_token=token))
    exporter = PrometheusExporter(cfg, telemetry)
    try:
        target = f"{LOCALHOST}:{exporter.port}"
        url = f"https://{target}/metrics"
        trust = ssl.create_default_context(cafile=str(pki["ca"]))
        assert httpx.get(url, verify=trust, timeout=5).status_code == 401
        wrong = httpx.get(url, verify=trust, headers={"Authorization": "Bearer nope"}, timeout=5)
        assert wrong.status_code == 401
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://{target}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=5)
        good = httpx.get(url, verify=trust, headers={"Authorization": f"Bearer {token}"}, timeout=5)
        assert good.status_code == 200 and "durable_check_violations_total" in good.text
        tls = {"ca_file": str(pki["ca"])}
        jobs = {
            "with-token": {"scheme": "https", "tls_config": tls,
                           "authorization": {"type": "Bearer", "credentials": token},
                           "static_configs": [{"targets": [target]}]},
            "without-token": {"scheme": "https", "tls_config": dict(tls), "static_configs": [{"targets": [target]}]},
        }
        with prometheus_server(tmp_path / "prometheus", [], [], jobs) as prometheus:
            result = wait_until(
                lambda: query(prometheus.url, 'durable_check_violations_total{rule="DS002"}'),
                timeout_s=30, what="Prometheus to scrape over TLS with the token",
            )
            assert {r["metric"]["job"] for r in result} == {"with-token"}
            refused = wait_until(lambda: query(prometheus.url, 'up{job="without-token"} == 0'),
                                 timeout_s=30, what="the scrape without a token to fail")
            assert refused[0]["metric"]["instance"] == target
    finally:
        exporter.shutdown()
