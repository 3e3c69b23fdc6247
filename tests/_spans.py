"""Helpers for the convert and reader tests: build OTLP requests, compare with golden files."""

from __future__ import annotations

import base64
import difflib
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1 import trace_pb2

from processor.records import Action, Malformed, SessionMark

TESTDATA = Path(__file__).parent / "testdata"

TRACE_A = "5b8efff798038103d269b633813fc60c"
TRACE_B = "0af7651916cd43dd8448eb211c80319c"


def set_value(target: Any, value: Any) -> None:
    """Fill an AnyValue from a Python value of the matching type."""
    if isinstance(value, bool):
        target.bool_value = value
    elif isinstance(value, int):
        target.int_value = value
    elif isinstance(value, float):
        target.double_value = value
    elif isinstance(value, str):
        target.string_value = value
    elif isinstance(value, bytes):
        target.bytes_value = value
    elif isinstance(value, list):
        target.array_value.SetInParent()
        for element in value:
            set_value(target.array_value.values.add(), element)
    else:
        raise TypeError(f"no AnyValue for {type(value).__name__}")


def add_attributes(target: Any, attributes: Mapping[str, Any]) -> None:
    for key, value in attributes.items():
        kv = target.add()
        kv.key = key
        set_value(kv.value, value)


@dataclass
class SpanSpec:
    name: str
    attributes: dict[str, Any] = field(default_factory=dict)
    trace_id: str = TRACE_A
    span_id: str = "00f067aa0ba902b7"
    start_ns: int = 1_793_524_440_000_000_000
    error: bool = False
    events: list[tuple[str, int, dict[str, Any]]] = field(default_factory=list)


def request(*resources: tuple[Mapping[str, Any], Sequence[SpanSpec]]) -> ExportTraceServiceRequest:
    """An ExportTraceServiceRequest: one ResourceSpans per (resource attributes, spans)."""
    out = ExportTraceServiceRequest()
    for resource_attributes, spans in resources:
        resource_spans = out.resource_spans.add()
        add_attributes(resource_spans.resource.attributes, resource_attributes)
        scope_spans = resource_spans.scope_spans.add()
        scope_spans.scope.name = "tests"
        for spec in spans:
            span = scope_spans.spans.add()
            span.name = spec.name
            span.trace_id = bytes.fromhex(spec.trace_id)
            span.span_id = bytes.fromhex(spec.span_id)
            span.start_time_unix_nano = spec.start_ns
            span.end_time_unix_nano = spec.start_ns + 1_000_000
            if spec.error:
                span.status.code = trace_pb2.Status.STATUS_CODE_ERROR
            add_attributes(span.attributes, spec.attributes)
            for event_name, event_ns, event_attributes in spec.events:
                event = span.events.add()
                event.name = event_name
                event.time_unix_nano = event_ns
                add_attributes(event.attributes, event_attributes)
    return out


def _ids_to_base64(node: Any) -> Any:
    if isinstance(node, dict):
        return {
            key: (
                base64.b64encode(bytes.fromhex(value)).decode()
                if key in ("traceId", "spanId", "parentSpanId") and isinstance(value, str)
                else _ids_to_base64(value)
            )
            for key, value in node.items()
        }
    if isinstance(node, list):
        return [_ids_to_base64(element) for element in node]
    return node


def reference_request(document: bytes) -> ExportTraceServiceRequest:
    """OTLP/JSON parsed by protobuf's own JSON parser (ids re-encoded: OTLP uses hex, proto3 JSON base64)."""
    message = ExportTraceServiceRequest()
    json_format.ParseDict(_ids_to_base64(orjson.loads(document)), message, ignore_unknown_fields=True)
    return message


def otlp_json_from_request(message: ExportTraceServiceRequest) -> bytes:
    """The OTLP/JSON form of a request: proto3 JSON with hex ids."""
    document = json_format.MessageToDict(message)

    def to_hex(node: Any) -> Any:
        if isinstance(node, dict):
            return {
                key: (
                    base64.b64decode(value).hex()
                    if key in ("traceId", "spanId", "parentSpanId") and isinstance(value, str)
                    else to_hex(value)
                )
                for key, value in node.items()
            }
        if isinstance(node, list):
            return [to_hex(element) for element in node]
        return node

    return orjson.dumps(to_hex(document))


def item_json(item: Action | Malformed) -> dict[str, Any]:
    """What the golden files hold of an item: everything but where in the file it was read."""
    if isinstance(item, Action):
        out: dict[str, Any] = {"record": item.record, "source": item.source, "time_ns": item.time_ns}
        if item.delivery_key is not None:
            out["delivery_key"] = list(item.delivery_key)
        if item.synthetic_action_id:
            out["synthetic_action_id"] = True
        if item.source == "log":
            out["line"] = item.line
        return out
    malformed: dict[str, Any] = {"malformed": item.message, "source": item.source}
    for name in ("session_id", "action_id", "trace_id", "span_id"):
        if getattr(item, name):
            malformed[name] = getattr(item, name)
    if item.source == "log":
        malformed["line"] = item.line
    return malformed


def golden_lines(items: Iterable[Action | Malformed | SessionMark]) -> list[str]:
    # Session marks only link a trace's spans; the golden files hold what became of each span.
    return [orjson.dumps(item_json(item)).decode() for item in items if not isinstance(item, SessionMark)]


def check_golden(path: Path, items: Iterable[Action | Malformed | SessionMark]) -> None:
    """Compare with the golden file; ``UPDATE_GOLDEN=1`` rewrites it instead."""
    actual = golden_lines(items)
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text("".join(line + "\n" for line in actual), encoding="utf-8")
        return
    assert path.exists(), f"{path.name} missing: run with UPDATE_GOLDEN=1 to create it"
    expected = path.read_text(encoding="utf-8").splitlines()
    if actual != expected:
        diff = "\n".join(difflib.unified_diff(expected, actual, "golden", "actual", lineterm=""))
        raise AssertionError(f"{path.name} differs (UPDATE_GOLDEN=1 rewrites it after review):\n{diff}")
