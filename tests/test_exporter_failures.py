"""Failure isolation: a dead, slow or failing endpoint never blocks the pipeline or another
exporter, the retry queue stays bounded, and nothing is sent twice once it recovers."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import grpc
import pytest

from exporters import (
    Exporter,
    JsonlConfig,
    JsonlExporter,
    OtlpConfig,
    OtlpSpanExporter,
    WebhookConfig,
    WebhookExporter,
)
from processor.configfmt import Duration
from processor.telemetry import Telemetry
from processor.violations import Violation
from tests.servers import HttpRecorder, OtlpGrpcReceiver, free_port, make_violation, wait_until

# Generous: export() queues and returns; anything near this bound means it blocked.
EXPORT_BOUND_S = 1.0


def timed_export(exporter: Exporter, violations: Sequence[Violation]) -> float:
    start = time.monotonic()
    exporter.export(violations)
    return time.monotonic() - start


def sample(telemetry: Telemetry, name: str, exporter: str) -> float:
    return telemetry.registry.get_sample_value(name, {"exporter": exporter}) or 0.0


def webhook_config(url: str, timeout_s: float = 2.0, **kwargs: object) -> WebhookConfig:
    return WebhookConfig(url=url, timeout=Duration(timeout_s), initial_backoff=Duration(0.05),
                         max_backoff=Duration(0.2), max_attempts=10_000, **kwargs)  # type: ignore[arg-type]


def test_down_then_slow_then_500_then_recovered() -> None:
    port = free_port()
    telemetry = Telemetry()
    max_queue = 50
    # The slow phase answers after the client's timeout of 1 s.
    exporter = WebhookExporter(webhook_config(f"http://127.0.0.1:{port}/hook", timeout_s=1.0, max_queue=max_queue),
                               telemetry)
    queue = exporter.queue
    durations: list[float] = []
    violations = [make_violation(i) for i in range(30)]
    recorder: HttpRecorder | None = None
    try:
        # Down: nothing listens on the port.
        for v in violations[:10]:
            durations.append(timed_export(exporter, [v]))
        wait_until(lambda: sample(telemetry, "durable_check_exporter_failures_total", "webhook") >= 3,
                   timeout_s=10, what="failures against the dead endpoint")

        # Slow: answers only after the client's timeout.
        recorder = HttpRecorder(port)
        recorder.slow_s = 1.5
        recorder.mode = "slow"
        for v in violations[10:20]:
            durations.append(timed_export(exporter, [v]))
        wait_until(lambda: sum(r.mode == "slow" for r in recorder.snapshot()) >= 2, timeout_s=10,
                   what="requests to the slow endpoint")

        # 500 for a while; the pipeline exports some violations again meanwhile.
        recorder.mode = "500"
        for v in violations[20:]:
            durations.append(timed_export(exporter, [v]))
        durations.append(timed_export(exporter, violations[:5]))
        wait_until(lambda: sum(r.mode == "500" for r in recorder.snapshot()) >= 3, timeout_s=10,
                   what="500 answers")
        assert queue.depth <= max_queue

        # Recovered.
        recorder.mode = "ok"
        wait_until(lambda: queue.depth == 0, timeout_s=20, what="the backlog to drain")
        durations.append(timed_export(exporter, violations[10:12]))  # already delivered: not again
        exporter.shutdown(5.0)

        received = recorder.snapshot()
        delivered = Counter(r.headers["Idempotency-Key"] for r in received if r.mode == "ok")
        assert set(delivered) == {v.violation_id for v in violations}
        assert max(delivered.values()) == 1, "a violation was sent twice after recovery"
        # Requests whose answer was lost (slow) were sent again with the same key: a
        # receiver that honours Idempotency-Key sees each violation once.
        assert {r.headers["Idempotency-Key"] for r in received} == set(delivered)
    finally:
        exporter.shutdown(1.0)
        if recorder is not None:
            recorder.stop()
    assert max(durations) < EXPORT_BOUND_S
    assert queue.max_depth_seen <= max_queue
    assert sample(telemetry, "durable_check_exporter_dropped_total", "webhook") == 0
    assert sample(telemetry, "durable_check_exporter_sent_total", "webhook") == len(violations)
    assert sample(telemetry, "durable_check_exporter_queue_depth", "webhook") == 0


def test_a_full_queue_drops_the_oldest_and_counts_it(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="durable_check.exporters")
    port = free_port()
    telemetry = Telemetry()
    exporter = WebhookExporter(webhook_config(f"http://127.0.0.1:{port}/", max_queue=5), telemetry)
    violations = [make_violation(i) for i in range(12)]
    exporter.export(violations)  # one call: all queued before the worker takes any
    assert exporter.queue.depth == 5
    assert sample(telemetry, "durable_check_exporter_dropped_total", "webhook") == 7
    assert sample(telemetry, "durable_check_exporter_queue_depth", "webhook") == 5
    wait_until(lambda: sample(telemetry, "durable_check_exporter_failures_total", "webhook") >= 1,
               timeout_s=10, what="a failed attempt against the dead endpoint")
    recorder = HttpRecorder(port)
    try:
        wait_until(lambda: exporter.queue.depth == 0, timeout_s=10, what="the queue to drain")
        exporter.shutdown(2.0)
        keys = [r.headers["Idempotency-Key"] for r in recorder.snapshot() if r.mode == "ok"]
        assert keys == [v.violation_id for v in violations[7:]]
    finally:
        recorder.stop()
    assert exporter.queue.max_depth_seen <= 5
    # The drop and the failures were logged, without any payload.
    messages = [r.getMessage() for r in caplog.records]
    assert any("queue full" in m and "dropped 7" in m for m in messages)
    assert any("delivery failed" in m for m in messages)
    for m in messages:
        for v in violations:
            assert v.violation_id not in m and v.session_id not in m and v.message not in m


def test_a_dead_endpoint_does_not_hold_up_other_exporters(tmp_path: Path) -> None:
    telemetry = Telemetry()
    healthy = HttpRecorder()
    slow = HttpRecorder()
    slow.mode = "slow"
    slow.slow_s = 2.0
    exporters: list[Exporter] = [
        WebhookExporter(webhook_config(f"http://127.0.0.1:{free_port()}/"), telemetry),  # dead
        OtlpSpanExporter(OtlpConfig(endpoint=f"127.0.0.1:{free_port()}", insecure=True, timeout=Duration(0.3),
                                    initial_backoff=Duration(0.05), max_backoff=Duration(0.2)), telemetry),
        WebhookExporter(WebhookConfig(url=slow.url, timeout=Duration(5.0)), telemetry),  # slow but answers
        JsonlExporter(JsonlConfig(path=str(tmp_path / "v.jsonl")), telemetry),
    ]
    healthy_exporter = WebhookExporter(webhook_config(healthy.url), telemetry)
    exporters.append(healthy_exporter)
    violations = [make_violation(i) for i in range(20)]
    durations = []
    try:
        for v in violations:  # as the pipeline does: every exporter in turn
            for exporter in exporters:
                durations.append(timed_export(exporter, [v]))
        wait_until(lambda: len(healthy.snapshot()) == len(violations), timeout_s=10,
                   what="the healthy webhook to get everything")
        assert len((tmp_path / "v.jsonl").read_text().splitlines()) == len(violations)
        start = time.monotonic()
        for exporter in exporters:
            exporter.shutdown(0.5)
        # Each gives up at its own timeout; the slow one may finish its in-flight request.
        assert time.monotonic() - start < 0.5 * len(exporters) + 2.5
    finally:
        healthy.stop()
        slow.stop()
    assert max(durations) < EXPORT_BOUND_S
    # What the dead ones still held at shutdown is counted, not silently lost.
    assert sample(telemetry, "durable_check_exporter_dropped_total", "otlp") > 0
    assert sample(telemetry, "durable_check_exporter_sent_total", "jsonl") == len(violations)


def test_grpc_unavailable_then_recovered_sends_each_span_once() -> None:
    receiver = OtlpGrpcReceiver()
    receiver.fail_with = grpc.StatusCode.UNAVAILABLE
    telemetry = Telemetry()
    exporter = OtlpSpanExporter(OtlpConfig(endpoint=receiver.endpoint, insecure=True, batch_size=4,
                                           initial_backoff=Duration(0.05), max_backoff=Duration(0.2)), telemetry)
    try:
        violations = [make_violation(i, trace_id="4bf92f3577b34da6a3ce929d0e0e4736", span_id=f"{i + 1:016x}")
                      for i in range(10)]
        exporter.export(violations[:6])
        wait_until(lambda: sample(telemetry, "durable_check_exporter_failures_total", "otlp") >= 2,
                   timeout_s=10, what="UNAVAILABLE answers")
        exporter.export(violations)  # again, plus new ones
        receiver.fail_with = None
        wait_until(lambda: exporter.queue.depth == 0, timeout_s=10, what="the backlog to drain")
        exporter.shutdown(2.0)
        ids = Counter(kv.value.string_value for s in receiver.spans() for kv in s.attributes
                      if kv.key == "durable.violation.id")
        assert set(ids) == {v.violation_id for v in violations}
        assert max(ids.values()) == 1
    finally:
        exporter.shutdown(1.0)
        receiver.stop()
