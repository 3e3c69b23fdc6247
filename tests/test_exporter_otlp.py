"""Violation spans and metric pushes, received by real OTLP servers on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from exporters import OtlpConfig, OtlpMetricsConfig, OtlpMetricsExporter, OtlpSpanExporter
from exporters.otlp_spans import violation_span_ids
from exporters.resource import ResourceAttributesError, parse_resource_attributes, resource_attributes
from processor.configfmt import Duration
from processor.telemetry import Telemetry
from processor.violations import Violation
from tests.servers import HttpRecorder, OtlpGrpcReceiver, make_violation, wait_until

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"


@pytest.fixture
def receiver() -> Iterator[OtlpGrpcReceiver]:
    r = OtlpGrpcReceiver()
    yield r
    r.stop()


@pytest.fixture
def recorder() -> Iterator[HttpRecorder]:
    r = HttpRecorder()
    yield r
    r.stop()


def attrs(span: Span) -> dict[str, str]:
    return {kv.key: kv.value.string_value for kv in span.attributes}


def sample(telemetry: Telemetry, name: str, labels: dict[str, str]) -> float:
    return telemetry.registry.get_sample_value(name, labels) or 0.0


def check_span(span: Span, v: Violation) -> None:
    assert span.name == f"durable.violation {v.rule}"
    assert attrs(span) == {
        "durable.rule.id": v.rule,
        "durable.rule.name": v.name,
        "durable.rule.severity": v.severity,
        "durable.session.id": v.session_id,
        "durable.action.id": v.action_id,
        "durable.violation.id": v.violation_id,
        "durable.violation.message": v.message,
        "durable.action.kind": v.kind,
    }
    assert span.start_time_unix_nano == v.time_ns
    expected_code = Status.STATUS_CODE_ERROR if v.severity in ("critical", "error") else Status.STATUS_CODE_UNSET
    assert span.status.code == expected_code


def test_grpc_spans_join_the_trace_of_the_record(receiver: OtlpGrpcReceiver) -> None:
    telemetry = Telemetry()
    exporter = OtlpSpanExporter(
        OtlpConfig(endpoint=receiver.endpoint, insecure=True, headers={"X-Tenant": "team-a"}), telemetry)
    in_trace = make_violation(1, trace_id=TRACE, span_id=SPAN)
    warning = make_violation(2, trace_id=TRACE, span_id="b7ad6b7169203331", severity="warning")
    from_log = make_violation(3)
    exporter.export([in_trace, warning, from_log])
    exporter.shutdown(5.0)

    spans = {attrs(s)["durable.violation.id"]: s for s in receiver.spans()}
    assert set(spans) == {in_trace.violation_id, warning.violation_id, from_log.violation_id}
    for v in (in_trace, warning, from_log):
        check_span(spans[v.violation_id], v)
    assert spans[in_trace.violation_id].trace_id == bytes.fromhex(TRACE)
    assert spans[in_trace.violation_id].parent_span_id == bytes.fromhex(SPAN)
    assert spans[warning.violation_id].parent_span_id == bytes.fromhex("b7ad6b7169203331")
    # No trace: a trace of its own, derived from the violation id, and no parent.
    log_span = spans[from_log.violation_id]
    assert log_span.parent_span_id == b""
    assert len(log_span.trace_id) == 16 and any(log_span.trace_id)
    assert log_span.trace_id == violation_span_ids(from_log)[0]
    assert len({s.span_id for s in spans.values()}) == 3
    request = receiver.trace_requests[0]
    resource = {kv.key: kv.value.string_value for kv in request.resource_spans[0].resource.attributes}
    assert resource["service.name"] == "durable-check"
    assert receiver.metadata[0]["x-tenant"] == "team-a"
    assert sample(telemetry, "durable_check_exporter_sent_total", {"exporter": "otlp"}) == 3


def test_a_resent_violation_is_the_same_span(receiver: OtlpGrpcReceiver) -> None:
    v = make_violation(1, trace_id=TRACE, span_id=SPAN)
    for _ in range(2):  # two processes (a restart) sending the same violation
        exporter = OtlpSpanExporter(OtlpConfig(endpoint=receiver.endpoint, insecure=True), Telemetry())
        exporter.export([v])
        exporter.shutdown(5.0)
    first, second = receiver.spans()
    assert (first.trace_id, first.span_id, first.parent_span_id) == (
        second.trace_id, second.span_id, second.parent_span_id)


def test_one_exporter_sends_a_violation_once(receiver: OtlpGrpcReceiver) -> None:
    exporter = OtlpSpanExporter(OtlpConfig(endpoint=receiver.endpoint, insecure=True), Telemetry())
    v = make_violation(1, trace_id=TRACE, span_id=SPAN)
    exporter.export([v])
    wait_until(lambda: receiver.spans(), timeout_s=5, what="the first span")
    exporter.export([v, v])
    exporter.shutdown(5.0)
    assert len(receiver.spans()) == 1


def test_http_spans(recorder: HttpRecorder) -> None:
    recorder.response_body = ExportTraceServiceResponse().SerializeToString()
    exporter = OtlpSpanExporter(
        OtlpConfig(endpoint=recorder.url, protocol="http", headers={"Authorization": "Bearer t"}), Telemetry())
    v = make_violation(1, trace_id=TRACE, span_id=SPAN)
    exporter.export([v])
    exporter.shutdown(5.0)
    (received,) = recorder.snapshot()
    assert received.path == "/v1/traces"
    assert received.headers["Content-Type"] == "application/x-protobuf"
    assert received.headers["Authorization"] == "Bearer t"
    request = ExportTraceServiceRequest.FromString(received.body)
    (span,) = request.resource_spans[0].scope_spans[0].spans
    check_span(span, v)
    assert span.trace_id == bytes.fromhex(TRACE)
    assert span.parent_span_id == bytes.fromhex(SPAN)


def test_a_refusal_is_not_retried(receiver: OtlpGrpcReceiver) -> None:
    receiver.fail_with = grpc.StatusCode.INVALID_ARGUMENT
    telemetry = Telemetry()
    exporter = OtlpSpanExporter(OtlpConfig(endpoint=receiver.endpoint, insecure=True), telemetry)
    exporter.export([make_violation(1)])
    wait_until(lambda: sample(telemetry, "durable_check_exporter_dropped_total", {"exporter": "otlp"}) == 1,
               timeout_s=5, what="the refused batch to be dropped")
    exporter.shutdown(1.0)
    assert sample(telemetry, "durable_check_exporter_failures_total", {"exporter": "otlp"}) == 1


def metrics_by_name(request: ExportMetricsServiceRequest) -> dict[str, Any]:
    return {m.name: m for rm in request.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}


def pipeline_metrics() -> Telemetry:
    """The counters the pipeline would touch for a test session's two violations."""
    telemetry = Telemetry()
    telemetry.violations.labels("DS002", "critical", "booking-agent").inc(2)
    telemetry.actions.labels("payment", "ok", "booking-agent").inc(5)
    telemetry.oldest_open_wait_age.set(42.5)
    for seconds in (0.0002, 0.003, 0.003, 2.0):
        telemetry.evaluation_seconds.observe(seconds)
    return telemetry


def check_metrics(request: ExportMetricsServiceRequest) -> None:
    metrics = metrics_by_name(request)
    violations = metrics["durable_check_violations"]
    assert violations.sum.is_monotonic
    (point,) = violations.sum.data_points
    assert point.as_double == 2
    assert {kv.key: kv.value.string_value for kv in point.attributes} == {
        "rule": "DS002", "severity": "critical", "service": "booking-agent"}
    assert 0 < point.start_time_unix_nano <= point.time_unix_nano
    assert metrics["durable_check_oldest_open_wait_age_seconds"].gauge.data_points[0].as_double == 42.5
    (hist,) = metrics["durable_check_evaluation_seconds"].histogram.data_points
    assert hist.count == 4 and sum(hist.bucket_counts) == 4
    assert len(hist.bucket_counts) == len(hist.explicit_bounds) + 1
    assert hist.sum == pytest.approx(2.0062)
    # 0.003 twice falls in the (0.001, 0.005] bucket.
    assert hist.bucket_counts[list(hist.explicit_bounds).index(0.005)] == 2
    # Unlabelled, never touched: no data point invented.
    assert "durable_check_spans_received" not in metrics


def test_metrics_push_over_grpc(receiver: OtlpGrpcReceiver) -> None:
    telemetry = pipeline_metrics()
    exporter = OtlpMetricsExporter(
        OtlpMetricsConfig(endpoint=receiver.endpoint, insecure=True, interval=Duration(0.2)), telemetry)
    wait_until(lambda: len(receiver.metric_requests) >= 2, timeout_s=10, what="two periodic pushes")
    exporter.shutdown(5.0)
    check_metrics(receiver.metric_requests[-1])


def test_metrics_push_over_http_on_shutdown(recorder: HttpRecorder, tmp_path: Path) -> None:
    telemetry = pipeline_metrics()
    exporter = OtlpMetricsExporter(
        OtlpMetricsConfig(endpoint=recorder.url + "/", protocol="http", interval=Duration(3600)), telemetry)
    exporter.shutdown(5.0)  # the final push carries the last counts
    (received,) = recorder.snapshot()
    assert received.path == "/v1/metrics"
    check_metrics(ExportMetricsServiceRequest.FromString(received.body))
    assert sample(telemetry, "durable_check_exporter_sent_total", {"exporter": "otlp_metrics"}) > 0


def test_resource_attributes_follow_the_opentelemetry_environment_variables() -> None:
    defaults = resource_attributes({})
    assert defaults["service.name"] == "durable-check" and defaults["service.version"]
    assert "service.instance.id" not in defaults
    env = {"OTEL_RESOURCE_ATTRIBUTES": " service.instance.id=dc-1 , deployment.environment=prod%2Ceu ,team=a%3Db"}
    assert resource_attributes(env) == {**defaults, "service.instance.id": "dc-1",
                                        "deployment.environment": "prod,eu", "team": "a=b"}
    # OTEL_SERVICE_NAME wins over a service.name in OTEL_RESOURCE_ATTRIBUTES.
    env = {"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attributes", "OTEL_SERVICE_NAME": "checker-eu"}
    assert resource_attributes(env)["service.name"] == "checker-eu"
    assert resource_attributes({"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attributes"})["service.name"] == (
        "from-attributes")
    # One malformed entry: the variable is ignored as a whole, the error names the entry by position.
    assert resource_attributes({"OTEL_RESOURCE_ATTRIBUTES": "a=1,broken,b=2"}) == defaults
    with pytest.raises(ResourceAttributesError, match="entry 2 is not key=value"):
        parse_resource_attributes("a=1,broken")
    with pytest.raises(ResourceAttributesError, match="entry 1 has an empty key"):
        parse_resource_attributes("=1")
    with pytest.raises(ResourceAttributesError, match="entry 1 is not valid percent-encoded UTF-8"):
        parse_resource_attributes("a=%ff")


def test_replicas_are_told_apart_by_their_resource(receiver: OtlpGrpcReceiver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.instance.id=durable-check-1,k8s.pod.name=durable-check-1")
    spans = OtlpSpanExporter(OtlpConfig(endpoint=receiver.endpoint, insecure=True), Telemetry())
    spans.export([make_violation(1)])
    spans.shutdown(5.0)
    metrics = OtlpMetricsExporter(
        OtlpMetricsConfig(endpoint=receiver.endpoint, insecure=True, interval=Duration(3600)), pipeline_metrics())
    metrics.shutdown(5.0)
    expected = {"service.name": "durable-check", "service.instance.id": "durable-check-1",
                "k8s.pod.name": "durable-check-1"}
    for resource in (receiver.trace_requests[0].resource_spans[0].resource,
                     receiver.metric_requests[-1].resource_metrics[0].resource):
        got = {kv.key: kv.value.string_value for kv in resource.attributes}
        assert {k: got.get(k) for k in expected} == expected
        assert got["service.version"]


def test_span_delivery_is_confirmed_once_the_receiver_accepts(receiver: OtlpGrpcReceiver) -> None:
    receiver.fail_with = grpc.StatusCode.UNAVAILABLE
    telemetry = Telemetry()
    exporter = OtlpSpanExporter(OtlpConfig(endpoint=receiver.endpoint, insecure=True, initial_backoff=Duration(0.02),
                                           max_backoff=Duration(0.05), max_attempts=1000), telemetry)
    confirmed: list[list[str]] = []
    exporter.add_delivery_listener(lambda ids: confirmed.append(list(ids)))
    violation = make_violation(1)
    try:
        exporter.export([violation])
        wait_until(lambda: sample(telemetry, "durable_check_exporter_failures_total",
                                  {"exporter": "otlp"}) >= 2, timeout_s=5, what="refused attempts")
        assert confirmed == []
        receiver.fail_with = None
        wait_until(lambda: confirmed, timeout_s=5, what="the confirmation")
        assert confirmed == [[violation.violation_id]]
    finally:
        exporter.shutdown(2.0)
