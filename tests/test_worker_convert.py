"""serve's evaluator converts a protobuf request from its bytes as received, as replay does.

The receiver keeps the body it parsed; the worker reads it with span attributes as a map
(``SpanConverter.convert_serialized``) instead of walking the parsed request's attributes,
and reads a journaled request back the same way after a restart. Whatever the path, the
items must be those of the parsed request, the edge cases of the mapped reading included
(a repeated key, several problems told in attribute order, a KeyValue with a field of its own).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from processor.convert.spans import SpanConverter
from processor.receive.otlp_common import count_spans, parse_protobuf
from processor.receive.queue import Batch, IngestQueue
from processor.records import Action, Malformed
from processor.serve import build_pipeline, build_store
from processor.state.journal import JournalEntry
from processor.telemetry import Telemetry
from processor.worker import EvaluatorWorker, _Work
from tests._spans import SpanSpec, request
from tests.serve_support import serve_config


def _edge_request() -> ExportTraceServiceRequest:
    message = request(({"service.name": "agent"}, [
        SpanSpec("pay", {"durable.session.id": "s1", "durable.action.kind": "write", "durable.action.id": "a1"}),
        SpanSpec("w", {"durable.action.kind": "write", "durable.retry.attempt": "two", "durable.session.id": 5.5}),
        SpanSpec("k", {"durable.session.id": "s1", "durable.action.id": "a3"}),
        SpanSpec("plain", {"http.request.method": "GET"}),
    ]))
    spans = message.resource_spans[0].scope_spans[0].spans
    again = spans[0].attributes.add()  # repeated key: the last value counts
    again.key = "durable.action.kind"
    again.value.string_value = "payment"
    # A KeyValue with field 9 (unknown to OTLP): the official reading keeps the attribute.
    spans[2].attributes.add().MergeFromString(b"\n\x13durable.action.kind\x12\x07\n\x05write\x48\x01")
    return message


def _worker(tmp_path: Path, backend: str) -> tuple[EvaluatorWorker, Any]:
    state: dict[str, Any] = {"backend": backend}
    if backend == "sqlite":
        state["path"] = str(tmp_path / "state.db")
    config = serve_config(tmp_path, {"state": state})
    telemetry = Telemetry()
    store = build_store(config)
    pipeline = build_pipeline(config, telemetry, store)
    queue = IngestQueue(10, 1000, 1.0, telemetry)
    worker = EvaluatorWorker(queue, pipeline, store, converter=SpanConverter(config.convert), hold=None,
                             tick_interval_s=0.05, telemetry=telemetry)
    return worker, store


def _items(result: Any) -> list[Any]:
    """A conversion's items in the order the worker evaluates them."""
    return [*result.marks, *result.actions, *result.rejected]


def _summary(items: list[Any]) -> list[Any]:
    return [(type(i).__name__, i.record if isinstance(i, Action) else i.message if isinstance(i, Malformed) else i)
            for i in items]


def test_a_request_converts_from_its_bytes_as_from_its_parsed_form(tmp_path: Path) -> None:
    message = _edge_request()
    body = message.SerializeToString()
    expected = SpanConverter(serve_config(tmp_path).convert).convert(parse_protobuf(body), "otlp-grpc", 11)
    assert {type(i).__name__ for i in _items(expected)} == {"Action", "Malformed"}
    worker, store = _worker(tmp_path, "sqlite")
    try:
        worker._seq = 11
        as_received = Batch(request=parse_protobuf(body), span_count=count_spans(message), protocol="grpc",
                            origin="otlp-grpc", body=body)
        # OTLP/JSON: no bytes were received; the parsed request is converted.
        as_json = Batch(request=parse_protobuf(body), span_count=count_spans(message), protocol="http",
                        origin="otlp-grpc")
        (_, from_bytes, _, seq_a), (_, from_json, _, seq_b) = worker._convert([as_received, as_json])
        assert seq_a == 11
        assert _summary(from_bytes) == _summary(_items(expected))
        assert _summary(from_json) == _summary(
            _items(SpanConverter(serve_config(tmp_path).convert).convert(parse_protobuf(body), "otlp-grpc", seq_b)))
        # Read back from the journal after a restart: the same items, the same seqs.
        entry = JournalEntry(1, "request", "grpc", "otlp-grpc", 0, 11, [], len(body), body)
        read_back = worker._read_back(_Work(1, len(body), None, None, entry=entry))
        assert _summary(read_back) == _summary(_items(expected))
    finally:
        if store is not None:
            store.close()
