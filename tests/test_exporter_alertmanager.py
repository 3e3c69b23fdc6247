"""Violations as alerts, received, kept alive and resolved by a real Alertmanager."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from exporters import AlertmanagerConfig, AlertmanagerExporter
from exporters.alertmanager import format_time
from processor.configfmt import Duration
from processor.telemetry import Telemetry
from tests.servers import HttpRecorder, alertmanager_server, make_violation, wait_until

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"


def parse_time(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def am_alerts(url: str) -> dict[str, dict[str, Any]]:
    """Alerts Alertmanager holds as active, by violation id."""
    response = httpx.get(f"{url}/api/v2/alerts", params={"active": "true", "silenced": "false",
                                                          "inhibited": "false"}, timeout=5)
    response.raise_for_status()
    return {a["labels"]["violation_id"]: a for a in response.json()
            if a["labels"].get("alertname") == "DurableCheckViolation"}


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[str]:
    with alertmanager_server(tmp_path / "alertmanager") as am:
        yield am.url


def sample(telemetry: Telemetry, name: str) -> float:
    return telemetry.registry.get_sample_value(name, {"exporter": "alertmanager"}) or 0.0


@pytest.mark.servers
def test_alerts_are_received_kept_alive_and_resolved(alertmanager: str) -> None:
    telemetry = Telemetry()
    exporter = AlertmanagerExporter(AlertmanagerConfig(
        url=alertmanager, resend_interval=Duration(1.0), resolve_after=Duration(0),
        trace_url_template="https://tracing.example/trace/{trace_id}",
    ), telemetry)
    try:
        now_ns = time.time_ns()
        traced = make_violation(1, trace_id=TRACE, span_id=SPAN, time_ns=now_ns - 60_000_000_000)
        from_log = make_violation(2, rule="DS107", severity="error", time_ns=now_ns - 30_000_000_000)
        exporter.export([traced, from_log])

        def both() -> dict[str, dict[str, Any]] | None:
            found = am_alerts(alertmanager)
            return found if len(found) == 2 else None

        got = wait_until(both, timeout_s=15, what="both alerts in Alertmanager")

        alert = got[traced.violation_id]
        assert alert["labels"] == {
            "alertname": "DurableCheckViolation", "rule": "DS002", "rule_name": "unkeyed-side-effect",
            "severity": "critical", "service": "booking-agent", "session": "s-test",
            "violation_id": traced.violation_id,
        }
        assert alert["annotations"]["description"] == traced.message
        assert alert["annotations"]["trace_id"] == TRACE
        assert alert["annotations"]["action_id"] == traced.action_id
        assert alert["annotations"]["trace_url"] == f"https://tracing.example/trace/{TRACE}"
        assert alert["generatorURL"] == f"https://tracing.example/trace/{TRACE}"
        assert "DS002" in alert["annotations"]["summary"]
        assert alert["status"]["state"] == "active"
        # startsAt is the violation's time, to the millisecond.
        assert alert["startsAt"].startswith(format_time((traced.time_ns or 0) / 1e9)[:23])
        first_end = parse_time(alert["endsAt"])
        assert "trace_url" not in got[from_log.violation_id]["annotations"]

        # Re-sent every second: still active well past the first endsAt (now + 3 s), with
        # startsAt unchanged and endsAt moved on.
        wait_until(lambda: time.time() > first_end + 1.5, timeout_s=10, what="the first endsAt to pass")
        later = am_alerts(alertmanager)
        assert set(later) == {traced.violation_id, from_log.violation_id}
        assert later[traced.violation_id]["startsAt"] == alert["startsAt"]
        assert parse_time(later[traced.violation_id]["endsAt"]) > first_end

        exporter.resolve([traced.violation_id])
        wait_until(lambda: traced.violation_id not in am_alerts(alertmanager),
                   timeout_s=15, what="the resolved alert to end")
        assert from_log.violation_id in am_alerts(alertmanager)
        assert exporter.active_ids() == [from_log.violation_id]
    finally:
        exporter.shutdown(5.0)
    assert sample(telemetry, "durable_check_exporter_dropped_total") == 0
    assert sample(telemetry, "durable_check_exporter_sent_total") >= 4


@pytest.mark.servers
def test_alerts_resolve_after_quiet_period(alertmanager: str) -> None:
    exporter = AlertmanagerExporter(AlertmanagerConfig(
        url=alertmanager, resend_interval=Duration(1.0), resolve_after=Duration(1.0)), Telemetry())
    try:
        v = make_violation(5, time_ns=time.time_ns())
        exporter.export([v])
        wait_until(lambda: v.violation_id in am_alerts(alertmanager), timeout_s=15, what="the alert")
        wait_until(lambda: v.violation_id not in am_alerts(alertmanager), timeout_s=15,
                   what="the alert to be resolved after resolve_after")
        assert exporter.active_ids() == []
    finally:
        exporter.shutdown(5.0)


def test_a_refused_alert_is_dropped_not_retried() -> None:
    recorder = HttpRecorder()
    recorder.mode = "400"
    telemetry = Telemetry()
    exporter = AlertmanagerExporter(AlertmanagerConfig(url=recorder.url, resend_interval=Duration(1.0)), telemetry)
    try:
        exporter.export([make_violation(1)])
        wait_until(lambda: sample(telemetry, "durable_check_exporter_dropped_total") == 1, timeout_s=5,
                   what="the refused alert to be dropped")
        assert exporter.active_ids() == []
        assert len(recorder.snapshot()) == 1
        assert recorder.snapshot()[0].path == "/api/v2/alerts"
    finally:
        exporter.shutdown(1.0)
        recorder.stop()


def test_active_alerts_are_bounded() -> None:
    recorder = HttpRecorder()
    telemetry = Telemetry()
    exporter = AlertmanagerExporter(
        AlertmanagerConfig(url=recorder.url, resend_interval=Duration(60.0), max_active=2), telemetry)
    try:
        violations = [make_violation(i) for i in range(3)]
        exporter.export(violations)
        assert exporter.active_ids() == [v.violation_id for v in violations[1:]]
        assert sample(telemetry, "durable_check_exporter_dropped_total") == 1
        wait_until(lambda: recorder.snapshot(), timeout_s=5, what="the alerts to be posted")
        posted = [a["labels"]["violation_id"] for r in recorder.snapshot() for a in r.json()]
        assert sorted(posted) == sorted(v.violation_id for v in violations[1:])
    finally:
        exporter.shutdown(1.0)
        recorder.stop()


def test_alerts_wait_out_an_outage() -> None:
    recorder = HttpRecorder()
    recorder.mode = "503"
    telemetry = Telemetry()
    exporter = AlertmanagerExporter(AlertmanagerConfig(
        url=recorder.url, resend_interval=Duration(60.0), initial_backoff=Duration(0.05),
        max_backoff=Duration(0.2), max_attempts=1000), telemetry)
    try:
        start = time.monotonic()
        exporter.export([make_violation(1), make_violation(2)])
        assert time.monotonic() - start < 1.0  # queued, not sent inline
        wait_until(lambda: sample(telemetry, "durable_check_exporter_failures_total") >= 3, timeout_s=5,
                   what="failed attempts")
        assert sample(telemetry, "durable_check_exporter_queue_depth") == 2
        recorder.mode = "ok"
        wait_until(lambda: any(r.status == 200 for r in recorder.snapshot()), timeout_s=5, what="the delivery")
        exporter.resolve([make_violation(1).violation_id])
        wait_until(lambda: sum(r.status == 200 for r in recorder.snapshot()) >= 2, timeout_s=5,
                   what="the resolution")
    finally:
        exporter.shutdown(1.0)
        recorder.stop()
    delivered = [r.json() for r in recorder.snapshot() if r.status == 200]
    # First the two alerts, once; then the resolution of one, with endsAt in the past.
    assert sorted(a["labels"]["violation_id"] for a in delivered[0]) == sorted(
        make_violation(i).violation_id for i in (1, 2))
    (resolution,) = delivered[1]
    assert resolution["labels"]["violation_id"] == make_violation(1).violation_id
    assert parse_time(resolution["endsAt"]) <= time.time()
    assert sample(telemetry, "durable_check_exporter_dropped_total") == 0
    assert sample(telemetry, "durable_check_exporter_queue_depth") == 0


@pytest.mark.servers
def test_delivery_is_confirmed_once_alertmanager_accepts_the_alert(alertmanager: str) -> None:
    recorder = HttpRecorder()
    recorder.mode = "503"
    telemetry = Telemetry()
    # The exporter first talks to a failing endpoint: nothing is confirmed.
    failing = AlertmanagerExporter(AlertmanagerConfig(
        url=recorder.url, initial_backoff=Duration(0.02), max_backoff=Duration(0.05), max_attempts=1000,
    ), telemetry)
    confirmed: list[list[str]] = []
    failing.add_delivery_listener(lambda ids: confirmed.append(list(ids)))
    violation = make_violation(7)
    try:
        failing.export([violation])
        wait_until(lambda: len(recorder.snapshot()) >= 2, timeout_s=5, what="retried failures")
        assert confirmed == []
    finally:
        failing.shutdown(1.0)
        recorder.stop()
    exporter = AlertmanagerExporter(AlertmanagerConfig(url=alertmanager, resend_interval=Duration(60)), telemetry)
    exporter.add_delivery_listener(lambda ids: confirmed.append(list(ids)))
    try:
        exporter.export([violation])
        wait_until(lambda: confirmed, timeout_s=10, what="the confirmation")
        assert confirmed == [[violation.violation_id]]
        assert violation.violation_id in am_alerts(alertmanager)
        # Handed over again while active and delivered: confirmed at once.
        exporter.export([violation])
        assert confirmed == [[violation.violation_id], [violation.violation_id]]
    finally:
        exporter.shutdown(2.0)
