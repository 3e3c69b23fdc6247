"""The webhook exporter against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest

from exporters import WebhookConfig, WebhookExporter, violation_document
from processor.configfmt import Duration
from processor.telemetry import Telemetry
from tests.servers import HttpRecorder, make_violation, wait_until


@pytest.fixture
def recorder() -> Iterator[HttpRecorder]:
    r = HttpRecorder()
    yield r
    r.stop()


def fast(url: str, **kwargs: object) -> WebhookConfig:
    """Short backoff so retries happen within a test."""
    return WebhookConfig(url=url, initial_backoff=Duration(0.02), max_backoff=Duration(0.2), **kwargs)  # type: ignore[arg-type]


def sample(telemetry: Telemetry, name: str) -> float:
    return telemetry.registry.get_sample_value(name, {"exporter": "webhook"}) or 0.0


def test_one_violation_per_request_keyed_by_its_id(recorder: HttpRecorder) -> None:
    telemetry = Telemetry()
    exporter = WebhookExporter(fast(recorder.url + "/hooks/durable", headers={"Authorization": "Bearer s3"}),
                               telemetry)
    violations = [make_violation(i) for i in range(3)]
    exporter.export(violations)
    exporter.shutdown(5.0)
    received = recorder.snapshot()
    assert [r.headers["Idempotency-Key"] for r in received] == [v.violation_id for v in violations]
    for r, v in zip(received, violations, strict=True):
        assert r.path == "/hooks/durable"
        assert r.headers["Content-Type"] == "application/json"
        assert r.headers["Authorization"] == "Bearer s3"
        assert r.json() == {"violations": [violation_document(v)]}
    assert sample(telemetry, "durable_check_exporter_sent_total") == 3


def test_batches_carry_a_stable_key(recorder: HttpRecorder) -> None:
    exporter = WebhookExporter(fast(recorder.url, batch_size=3), Telemetry())
    violations = [make_violation(i) for i in range(3)]
    exporter.export(violations)
    exporter.shutdown(5.0)
    (received,) = recorder.snapshot()
    assert [d["violation_id"] for d in received.json()["violations"]] == [v.violation_id for v in violations]
    expected_key = hashlib.sha256("\x1f".join(v.violation_id for v in violations).encode()).hexdigest()[:32]
    assert received.headers["Idempotency-Key"] == expected_key


@pytest.mark.parametrize("status", ["400", "404", "422"])
def test_client_errors_are_not_retried(recorder: HttpRecorder, status: str) -> None:
    recorder.mode = status
    telemetry = Telemetry()
    exporter = WebhookExporter(fast(recorder.url), telemetry)
    exporter.export([make_violation(1)])
    wait_until(lambda: sample(telemetry, "durable_check_exporter_dropped_total") == 1, timeout_s=5,
               what="the refused violation to be dropped")
    exporter.shutdown(1.0)
    assert len(recorder.snapshot()) == 1
    assert sample(telemetry, "durable_check_exporter_failures_total") == 1


@pytest.mark.parametrize("status", ["408", "429", "500", "503"])
def test_retryable_statuses_are_retried(recorder: HttpRecorder, status: str) -> None:
    recorder.mode = status
    exporter = WebhookExporter(fast(recorder.url), Telemetry())
    exporter.export([make_violation(1)])
    wait_until(lambda: len(recorder.snapshot()) >= 2, timeout_s=5, what="a retry")
    recorder.mode = "ok"
    wait_until(lambda: any(r.status == 200 for r in recorder.snapshot()), timeout_s=5, what="the delivery")
    exporter.shutdown(1.0)
    assert [r.status for r in recorder.snapshot()].count(200) == 1


def test_retry_after_is_honoured(recorder: HttpRecorder) -> None:
    recorder.mode = "429"
    recorder.retry_after = "1"
    exporter = WebhookExporter(WebhookConfig(url=recorder.url, initial_backoff=Duration(0.01),
                                             max_backoff=Duration(5.0)), Telemetry())
    exporter.export([make_violation(1)])
    wait_until(lambda: len(recorder.snapshot()) >= 1, timeout_s=5, what="the first attempt")
    recorder.mode = "ok"
    wait_until(lambda: len(recorder.snapshot()) >= 2, timeout_s=5, what="the retry")
    exporter.shutdown(1.0)
    first, second = recorder.snapshot()[:2]
    # The server asked for a second; backoff alone would have retried after ~10 ms.
    assert second.at - first.at >= 0.9


def test_retry_after_is_capped_by_max_backoff(recorder: HttpRecorder) -> None:
    recorder.mode = "503"
    recorder.retry_after = "3600"
    exporter = WebhookExporter(fast(recorder.url), Telemetry())
    exporter.export([make_violation(1)])
    # An hour asked for, max_backoff 0.2 s: several retries arrive within seconds.
    wait_until(lambda: len(recorder.snapshot()) >= 3, timeout_s=10, what="capped retries")
    exporter.shutdown(1.0)


def test_retries_are_bounded(recorder: HttpRecorder) -> None:
    recorder.mode = "500"
    telemetry = Telemetry()
    exporter = WebhookExporter(fast(recorder.url, max_attempts=3), telemetry)
    exporter.export([make_violation(1)])
    wait_until(lambda: sample(telemetry, "durable_check_exporter_dropped_total") == 1, timeout_s=5,
               what="the violation to be given up")
    exporter.shutdown(1.0)
    assert len(recorder.snapshot()) == 3
    assert sample(telemetry, "durable_check_exporter_failures_total") == 3


def test_delivery_is_confirmed_only_once_the_endpoint_accepts(recorder: HttpRecorder) -> None:
    """What serve's outbox waits for before it counts a violation delivered."""
    recorder.mode = "503"
    exporter = WebhookExporter(fast(recorder.url, max_attempts=1000), Telemetry())
    confirmed: list[list[str]] = []
    exporter.add_delivery_listener(lambda ids: confirmed.append(list(ids)))
    violation = make_violation(1)
    try:
        exporter.export([violation])
        wait_until(lambda: len(recorder.snapshot()) >= 2, timeout_s=5, what="retried failures")
        assert confirmed == []
        recorder.mode = "ok"
        wait_until(lambda: confirmed, timeout_s=5, what="the confirmation")
        assert confirmed == [[violation.violation_id]]
        sent = len(recorder.snapshot())
        # Handed over again (an outbox after a restart of its dispatcher): confirmed at once, not sent again.
        exporter.export([violation])
        assert confirmed == [[violation.violation_id], [violation.violation_id]]
        assert len(recorder.snapshot()) == sent
    finally:
        exporter.shutdown(2.0)
