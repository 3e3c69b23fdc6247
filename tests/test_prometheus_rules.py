"""The shipped Prometheus alert rules: promtool checks and unit tests, and a real
Prometheus that scrapes the exporter and fires them."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from exporters import PrometheusConfig, PrometheusExporter, WebhookConfig, WebhookExporter
from processor.telemetry import STATE_FAILURE_KINDS, Telemetry
from tests.servers import (
    LOCALHOST,
    free_port,
    make_violation,
    prometheus_server,
    query,
    require_binary,
    wait_until,
)

CONFIG = Path(__file__).resolve().parent.parent / "config"
RULES = CONFIG / "prometheus-alerts.yaml"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    binary = require_binary("promtool")
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.servers
def test_promtool_check_rules() -> None:
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@pytest.mark.servers
def test_promtool_test_rules() -> None:
    result = promtool("test", "rules", str(CONFIG / "prometheus-alerts.test.yaml"))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.servers
def test_example_scrape_config_is_valid() -> None:
    result = promtool("check", "config", str(CONFIG / "prometheus-scrape.example.yaml"))
    assert result.returncode == 0, result.stdout + result.stderr


def alerts(prometheus_url: str) -> dict[str, list[dict[str, Any]]]:
    response = httpx.get(f"{prometheus_url}/api/v1/alerts", timeout=5)
    response.raise_for_status()
    by_name: dict[str, list[dict[str, Any]]] = {}
    for alert in response.json()["data"]["alerts"]:
        by_name.setdefault(alert["labels"]["alertname"], []).append(alert)
    return by_name


@pytest.mark.servers
def test_shipped_rules_fire_on_scraped_metrics(tmp_path: Path) -> None:
    telemetry = Telemetry()
    exporter = PrometheusExporter(PrometheusConfig(endpoint=f"{LOCALHOST}:0"), telemetry)
    # A webhook whose endpoint is down and whose queue holds one item: it will drop.
    webhook = WebhookExporter(WebhookConfig(url=f"http://{LOCALHOST}:{free_port()}/", max_queue=1), telemetry)
    try:
        # A test session's first critical violation (the series appears at 1), a warning,
        # and a wait open for two days.
        telemetry.violations.labels("DS002", "critical", "booking-agent").inc()
        telemetry.violations.labels("DS001", "warning", "booking-agent").inc()
        telemetry.oldest_open_wait_age.set(2 * 86400)
        with prometheus_server(tmp_path / "prometheus", [f"{LOCALHOST}:{exporter.port}"], [RULES]) as prometheus:
            # The exporter's drop counter starts at zero; once Prometheus has that, drop.
            wait_until(lambda: query(prometheus.url, 'durable_check_exporter_dropped_total{exporter="webhook"}'),
                       timeout_s=30, what="the zero drop counter to be scraped")
            webhook.export([make_violation(i) for i in range(3)])

            def fired() -> dict[str, list[dict[str, Any]]] | None:
                found = alerts(prometheus.url)
                wanted = ("DurableCheckCriticalViolation", "DurableCheckExporterDropping", "DurableCheckStuckWait")
                return found if all(name in found for name in wanted) else None

            found = wait_until(fired, timeout_s=45, interval_s=0.5, what="the shipped alerts")
            (critical,) = found["DurableCheckCriticalViolation"]
            assert critical["state"] == "firing"
            assert critical["labels"]["rule"] == "DS002"
            assert critical["labels"]["service"] == "booking-agent"
            assert critical["labels"]["severity"] == "critical"
            assert "DS002" in critical["annotations"]["summary"]
            (dropping,) = found["DurableCheckExporterDropping"]
            assert dropping["state"] == "firing"
            assert dropping["labels"]["exporter"] == "webhook"
            # The stuck wait holds for 15 minutes before it fires: pending now.
            (stuck,) = found["DurableCheckStuckWait"]
            assert stuck["state"] == "pending"
            # A warning-level violation alone does not alert; nothing else is wrong (the
            # dead webhook's failures may have started DurableCheckExporterFailing's 10 m).
            others = set(found) - {"DurableCheckCriticalViolation", "DurableCheckExporterDropping",
                                   "DurableCheckStuckWait"}
            assert others <= {"DurableCheckExporterFailing"}
            for alert in found.get("DurableCheckExporterFailing", []):
                assert alert["state"] == "pending"
    finally:
        webhook.shutdown(0.5)
        exporter.shutdown()


@pytest.mark.servers
def test_state_store_and_journal_alerts_on_scraped_metrics(tmp_path: Path) -> None:
    """The state alerts against a real Prometheus scraping the metrics as a replica exposes them."""
    telemetry = Telemetry()
    exporter = PrometheusExporter(PrometheusConfig(endpoint=f"{LOCALHOST}:0"), telemetry)
    try:
        # As the durable runner does: every failure kind born at zero, the outbox counted per exporter.
        for kind in STATE_FAILURE_KINDS:
            telemetry.state_failures.labels(kind)
        telemetry.outbox_pending.labels("webhook").set(500)
        telemetry.journal_bytes.set(300 * 1024 * 1024)
        target = f"{LOCALHOST}:{exporter.port}"
        with prometheus_server(tmp_path / "prometheus", [target], [RULES]) as prometheus:
            wait_until(lambda: query(prometheus.url, 'durable_check_state_failures_total{kind="full"}'),
                       timeout_s=30, what="the zero failure counter to be scraped")
            # The disk fills: two failed commits; a lock wait, which alone alerts only when it lasts.
            telemetry.state_failures.labels("full").inc(2)
            telemetry.state_failures.labels("locked").inc()

            def fired() -> dict[str, list[dict[str, Any]]] | None:
                found = alerts(prometheus.url)
                wanted = ("DurableCheckStateStoreFailing", "DurableCheckStateStoreErrors",
                          "DurableCheckJournalFilling", "DurableCheckOutboxPending")
                return found if all(name in found for name in wanted) else None

            found = wait_until(fired, timeout_s=45, interval_s=0.5, what="the state alerts")
            (failing,) = found["DurableCheckStateStoreFailing"]
            assert failing["state"] == "firing"
            assert failing["labels"]["kind"] == "full"
            assert failing["labels"]["instance"] == target
            assert failing["labels"]["severity"] == "critical"
            # Those that must last are pending: the lock wait, the journal and the outbox backlog.
            (errors,) = found["DurableCheckStateStoreErrors"]
            assert (errors["state"], errors["labels"]["kind"]) == ("pending", "locked")
            (journal,) = found["DurableCheckJournalFilling"]
            assert journal["state"] == "pending"
            assert journal["annotations"]["summary"] == (
                f"The journal of Durable Check at {target} holds 300MiB not yet evaluated")
            (outbox,) = found["DurableCheckOutboxPending"]
            assert (outbox["state"], outbox["labels"]["exporter"]) == ("pending", "webhook")
    finally:
        exporter.shutdown()
