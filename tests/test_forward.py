"""Processor mode: spans go downstream unchanged but for their violations; an outage never blocks checking."""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from processor.config import parse_config
from processor.receive.forward import VIOLATION_RULES_ATTRIBUTE, Forwarder, redact_endpoint, split_resource_spans
from processor.telemetry import Telemetry
from tests.serve_support import (
    Recording,
    emit_durable_spans,
    make_request,
    read_jsonl,
    run_refund_agent,
    running,
    serve_config,
    spans_of,
    wait_for,
)
from tests.servers import HttpRecorder, OtlpGrpcReceiver


def _key(span: Any) -> tuple[str, str]:
    return bytes(span.trace_id).hex(), bytes(span.span_id).hex()


def _without_rules(span: Any) -> Any:
    copy = type(span)()
    copy.CopyFrom(span)
    for index in range(len(copy.attributes) - 1, -1, -1):
        if copy.attributes[index].key == VIOLATION_RULES_ATTRIBUTE:
            del copy.attributes[index]
    return copy


def _rules_attribute(span: Any) -> list[str] | None:
    for kv in span.attributes:
        if kv.key == VIOLATION_RULES_ATTRIBUTE:
            return [v.string_value for v in kv.value.array_value.values]
    return None


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _check_forwarded(sent: list[Any], received: list[Any], violations: list[dict[str, Any]]) -> int:
    """Every sent span arrived once, unchanged but for the violation attribute, which matches the violations."""
    expected_rules: dict[tuple[str, str], set[str]] = {}
    for doc in violations:
        if doc.get("span_id"):
            expected_rules.setdefault((doc["trace_id"], doc["span_id"]), set()).add(doc["rule"])
    by_key = {_key(span): span for span in received}
    assert len(by_key) == len(received), "a span was forwarded twice"
    assert set(by_key) == {_key(span) for span in sent}
    annotated = 0
    for original in sent:
        forwarded = by_key[_key(original)]
        assert _without_rules(forwarded) == original
        rules = _rules_attribute(forwarded)
        wanted = expected_rules.get(_key(original))
        assert (sorted(rules) if rules else None) == (sorted(wanted) if wanted else None)
        annotated += rules is not None
    return annotated


def test_grpc_forwarding_carries_spans_and_their_violations(tmp_path: Path) -> None:
    downstream = OtlpGrpcReceiver()
    try:
        config = serve_config(tmp_path, {
            "forward": {"endpoint": downstream.endpoint, "protocol": "grpc", "insecure": True,
                        "headers": {"x-tenant": "agents"}},
            "evaluate": {"allowed_lateness": "100ms"},
        })
        with running(config) as server:
            recording = Recording(OTLPSpanExporter(endpoint=f"127.0.0.1:{server.grpc_port}", insecure=True))
            run_refund_agent(recording.provider)
            emit_durable_spans(recording.provider, "s-forward")
            recording.shutdown()
            sent = len(recording.spans())
            # Forwarded while running, not only at shutdown.
            assert wait_for(lambda: len(downstream.spans()) == sent, timeout_s=20)
        annotated = _check_forwarded(
            spans_of(recording.request()), downstream.spans(), read_jsonl(tmp_path / "violations.jsonl")
        )
        assert annotated >= 3
        assert all(md.get("x-tenant") == "agents" for md in downstream.metadata)
    finally:
        downstream.stop()


def test_http_forwarding_posts_protobuf_to_v1_traces(tmp_path: Path) -> None:
    downstream = HttpRecorder()
    try:
        config = serve_config(tmp_path, {"forward": {"endpoint": downstream.url, "protocol": "http",
                                                     "headers": {"Authorization": "Bearer down"}}})
        sent = make_request(
            {"durable.session.id": "s-http-fwd", "durable.action.id": "p-1", "durable.action.kind": "payment"},
            {"durable.session.id": "s-http-fwd-2", "durable.action.id": "w-1", "durable.action.kind": "write",
             "durable.idempotency_key": "k"},
        )
        with running(config) as server:
            import httpx

            response = httpx.post(f"http://127.0.0.1:{server.http_port}/v1/traces", content=sent.SerializeToString(),
                                  headers={"Content-Type": "application/x-protobuf"})
            assert response.status_code == 200
        received = []
        for record in downstream.snapshot():
            assert record.path == "/v1/traces"
            assert record.headers["Content-Type"] == "application/x-protobuf"
            assert record.headers["Authorization"] == "Bearer down"
            received.extend(spans_of(trace_service_pb2.ExportTraceServiceRequest.FromString(record.body)))
        annotated = _check_forwarded(spans_of(sent), received, read_jsonl(tmp_path / "violations.jsonl"))
        assert annotated == 1  # the unkeyed payment; the keyed write trips nothing
    finally:
        downstream.stop()


def test_downstream_outage_never_blocks_checking(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = serve_config(tmp_path, {"forward": {
        "endpoint": f"127.0.0.1:{_closed_port()}", "insecure": True, "max_batch_spans": 10, "max_buffer_spans": 20,
        "max_attempts": 2, "initial_backoff": "50ms", "max_backoff": "100ms", "timeout": "500ms",
    }, "evaluate": {"allowed_lateness": "50ms"}})
    requests = [
        make_request(*[
            {"durable.session.id": f"s-out-{n}-{i}", "durable.action.id": f"p-{i}", "durable.action.kind": "payment",
             "durable.secret.payload": "do-not-log-me"}
            for i in range(10)
        ])
        for n in range(10)
    ]
    caplog.set_level(logging.WARNING, logger="processor.receive.forward")
    with running(config) as server, grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        export = channel.unary_unary(
            "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
            request_serializer=trace_service_pb2.ExportTraceServiceRequest.SerializeToString,
            response_deserializer=trace_service_pb2.ExportTraceServiceResponse.FromString,
        )
        started = time.monotonic()
        for message in requests:
            export(message, timeout=10)
        # Checking kept pace: every payment was evaluated while the downstream was down.
        assert wait_for(lambda: server.worker.processed_spans == 100, timeout_s=10)
        assert time.monotonic() - started < 10
        telemetry = server.telemetry
    found = {(d["rule"], d["session_id"]) for d in read_jsonl(tmp_path / "violations.jsonl")}
    assert {("DS002", f"s-out-{n}-{i}") for n in range(10) for i in range(10)} <= found
    dropped = telemetry.registry.get_sample_value("durable_check_forward_dropped_total")
    assert dropped == 100  # overflow and failed sends, all counted
    assert "dropped" in caplog.text
    assert "do-not-log-me" not in caplog.text


def test_retries_carry_a_batch_through_a_short_outage(tmp_path: Path) -> None:
    downstream = OtlpGrpcReceiver()
    downstream.fail_with = grpc.StatusCode.UNAVAILABLE
    config = parse_config(
        f"forward: {{endpoint: '{downstream.endpoint}', insecure: true, max_attempts: 10, initial_backoff: 50ms,"
        " max_backoff: 200ms, flush_interval: 10ms}\n", "forward.yaml",
    ).forward
    forwarder = Forwarder(config, Telemetry())
    forwarder.start()
    try:
        sent = make_request(*[{"n": i} for i in range(5)])
        forwarder.offer(sent.resource_spans)
        time.sleep(0.3)
        assert downstream.spans() == []
        downstream.fail_with = None
        assert wait_for(lambda: len(downstream.spans()) == 5, timeout_s=10)
    finally:
        forwarder.shutdown(5.0)
        downstream.stop()
    assert [_key(s) for s in downstream.spans()] == [_key(s) for s in spans_of(sent)]
    assert forwarder.sent_spans == 5


def test_large_resource_spans_are_split_into_batches() -> None:
    message = make_request(*[{"i": i} for i in range(25)])
    pieces = split_resource_spans(message.resource_spans[0], 10)
    assert [count for _, count in pieces] == [10, 10, 5]
    rejoined = [span for piece, _ in pieces for ss in piece.scope_spans for span in ss.spans]
    assert rejoined == spans_of(message)
    assert all(piece.resource == message.resource_spans[0].resource for piece, _ in pieces)


def test_credentials_in_the_endpoint_never_reach_the_log() -> None:
    assert redact_endpoint("https://user:secret@collector:4318/v1/traces") == "https://collector:4318/v1/traces"
    assert redact_endpoint("collector:4317") == "collector:4317"


def test_hold_forwards_early_rather_than_growing_past_its_bound() -> None:
    from processor.receive.forward import AnnotatingHold
    from processor.violations import Violation

    downstream = OtlpGrpcReceiver()
    config = parse_config(f"forward: {{endpoint: '{downstream.endpoint}', insecure: true, flush_interval: 10ms}}\n",
                          "f.yaml").forward
    forwarder = Forwarder(config, Telemetry())
    forwarder.start()
    try:
        hold = AnnotatingHold(forwarder, hold_s=3600.0, max_spans=4)
        first, second = make_request({"n": 1}, {"n": 2}), make_request({"n": 3}, {"n": 4}, {"n": 5})
        span = spans_of(first)[0]
        hold.add(first, now=0.0)
        hold.note([Violation(rule="DS002", name="unkeyed-side-effect", severity="critical", session_id="s",
                             action_id="a", message="m", violation_id="v", trace_id=_key(span)[0],
                             span_id=_key(span)[1])])
        hold.add(second, now=0.0)  # 5 spans held > 4: the first request goes on now, annotated
        assert wait_for(lambda: len(downstream.spans()) == 2, timeout_s=10)
        assert [_rules_attribute(s) for s in downstream.spans()] == [["DS002"], None]
        hold.release_due(now=1.0)
        time.sleep(0.3)  # longer than the forwarder's flush interval
        assert len(downstream.spans()) == 2  # the second is not due for an hour
        hold.release_all()
        assert wait_for(lambda: len(downstream.spans()) == 5, timeout_s=10)
    finally:
        forwarder.shutdown(5.0)
        downstream.stop()
