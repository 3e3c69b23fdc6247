"""OTLP/JSON (an ExportTraceServiceRequest or TracesData object) into the protobuf message.

``json_format.Parse`` is slow and rejects unknown fields; OTLP/JSON differs from the
proto3 JSON mapping anyway: trace and span ids are hex, not base64. This decoder
follows the OTLP rules — ids in hex, 64-bit integers as strings or numbers, enums as
integers (names are accepted too), lowerCamelCase keys (snake_case accepted), unknown
fields ignored — and produces the same message the protobuf encoding would, so one
converter serves both encodings and a span gives the same action either way.

A span that cannot be decoded is left out and reported by its path; the rest of the
request is kept.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Callable
from typing import Any, Final

from opentelemetry.proto.trace.v1 import trace_pb2

from processor.records import json_type_name

_MAX_DEPTH: Final = 64
_UINT64_MAX: Final = (1 << 64) - 1
_INT64_MIN: Final = -(1 << 63)
_INT64_MAX: Final = (1 << 63) - 1
_UINT32_MAX: Final = (1 << 32) - 1
_SPAN_KINDS: Final = {
    "SPAN_KIND_UNSPECIFIED": 0,
    "SPAN_KIND_INTERNAL": 1,
    "SPAN_KIND_SERVER": 2,
    "SPAN_KIND_CLIENT": 3,
    "SPAN_KIND_PRODUCER": 4,
    "SPAN_KIND_CONSUMER": 5,
}
_STATUS_CODES: Final = {"STATUS_CODE_UNSET": 0, "STATUS_CODE_OK": 1, "STATUS_CODE_ERROR": 2}


KeyFilter = Callable[[str], bool]


class OtlpJsonError(ValueError):
    """A part of the document is not OTLP/JSON; the message starts with its path."""


def _field(obj: dict[str, Any], camel: str, snake: str) -> Any:
    value = obj.get(camel)
    return obj.get(snake) if value is None else value


def _object(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise OtlpJsonError(f"{path}: must be an object, got {json_type_name(value)}")
    return value


def _array(obj: dict[str, Any], camel: str, snake: str, path: str) -> list[Any]:
    value = _field(obj, camel, snake)
    if value is None:
        return []
    if not isinstance(value, list):
        raise OtlpJsonError(f"{path}.{camel}: must be an array, got {json_type_name(value)}")
    return value


def _string(obj: dict[str, Any], camel: str, snake: str, path: str) -> str:
    value = _field(obj, camel, snake)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise OtlpJsonError(f"{path}.{camel}: must be a string, got {json_type_name(value)}")
    return value


def _integer(value: Any, path: str, low: int, high: int) -> int:
    if isinstance(value, bool):
        raise OtlpJsonError(f"{path}: must be an integer, got a boolean")
    if isinstance(value, str):
        try:
            number = int(value, 10)
        except ValueError:
            raise OtlpJsonError(f"{path}: must be an integer or a decimal string") from None
    elif isinstance(value, int):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    else:
        raise OtlpJsonError(f"{path}: must be an integer, got {json_type_name(value)}")
    if not low <= number <= high:
        raise OtlpJsonError(f"{path}: out of range")
    return number


def _int_field(obj: dict[str, Any], camel: str, snake: str, path: str, high: int = _UINT32_MAX) -> int:
    """An unsigned integer field (counts, flags, timestamps) in [0, high]."""
    value = _field(obj, camel, snake)
    return 0 if value is None else _integer(value, f"{path}.{camel}", 0, high)


def _enum(obj: dict[str, Any], camel: str, names: dict[str, int], path: str) -> int:
    value = obj.get(camel)
    if value is None:
        return 0
    if isinstance(value, str) and value in names:
        return names[value]
    return _integer(value, f"{path}.{camel}", 0, _UINT32_MAX)


def _id(obj: dict[str, Any], camel: str, snake: str, size: int, path: str) -> bytes:
    value = _string(obj, camel, snake, path)
    if not value:
        return b""
    if len(value) == size * 2:
        try:
            return bytes.fromhex(value)
        except ValueError:
            pass
    # Producers that follow the generic proto3 JSON mapping send base64; accept it too.
    try:
        decoded = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        decoded = b""
    if len(decoded) == size:
        return decoded
    raise OtlpJsonError(f"{path}.{camel}: must be {size * 2} hex digits")


def _any_value(target: Any, value: Any, path: str, depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise OtlpJsonError(f"{path}: values nested deeper than {_MAX_DEPTH} levels")
    obj = _object(value, path)
    if len(obj) == 1:
        # Fast path for the common single scalar; anything else takes the general loop.
        text = obj.get("stringValue")
        if isinstance(text, str):
            target.string_value = text
            return
        flag = obj.get("boolValue")
        if isinstance(flag, bool):
            target.bool_value = flag
            return
    for key, item in obj.items():
        if item is None:
            continue
        if key in ("stringValue", "string_value"):
            if not isinstance(item, str):
                raise OtlpJsonError(f"{path}.stringValue: must be a string, got {json_type_name(item)}")
            target.string_value = item
        elif key in ("boolValue", "bool_value"):
            if not isinstance(item, bool):
                raise OtlpJsonError(f"{path}.boolValue: must be true or false, got {json_type_name(item)}")
            target.bool_value = item
        elif key in ("intValue", "int_value"):
            target.int_value = _integer(item, f"{path}.intValue", _INT64_MIN, _INT64_MAX)
        elif key in ("doubleValue", "double_value"):
            target.double_value = _double(item, f"{path}.doubleValue")
        elif key in ("bytesValue", "bytes_value"):
            if not isinstance(item, str):
                raise OtlpJsonError(f"{path}.bytesValue: must be a base64 string, got {json_type_name(item)}")
            try:
                target.bytes_value = base64.b64decode(item, validate=True)
            except (binascii.Error, ValueError):
                raise OtlpJsonError(f"{path}.bytesValue: not valid base64") from None
        elif key in ("arrayValue", "array_value"):
            array = target.array_value
            array.SetInParent()
            for index, element in enumerate(_array(_object(item, f"{path}.arrayValue"), "values", "values", path)):
                _any_value(array.values.add(), element, f"{path}.arrayValue.values[{index}]", depth + 1)
        elif key in ("kvlistValue", "kvlist_value"):
            kvlist = target.kvlist_value
            kvlist.SetInParent()
            entries = _array(_object(item, f"{path}.kvlistValue"), "values", "values", path)
            _key_values(kvlist.values, entries, f"{path}.kvlistValue.values", depth + 1)
        # Anything else is a field from a newer OTLP version: ignored, as the spec asks.


def _double(value: Any, path: str) -> float:
    if isinstance(value, bool):
        raise OtlpJsonError(f"{path}: must be a number, got a boolean")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value in ("NaN", "Infinity", "-Infinity"):
        return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}[value]
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise OtlpJsonError(f"{path}: must be a number, got {json_type_name(value)}")


def _key_values(target: Any, entries: list[Any], path: str, depth: int = 0, keep: KeyFilter | None = None) -> None:
    for index, entry in enumerate(entries):
        where = f"{path}[{index}]"
        obj = _object(entry, where)
        key = obj.get("key")
        if not isinstance(key, str):
            raise OtlpJsonError(f"{where}.key: must be a string, got {json_type_name(key)}")
        if keep is not None and not keep(key):
            continue
        kv = target.add(key=key)
        value = obj.get("value")
        if value is not None:
            _any_value(kv.value, value, f"{where}.value", depth)


def _span(target: Any, obj: dict[str, Any], path: str, keep: KeyFilter | None) -> None:
    target.trace_id = _id(obj, "traceId", "trace_id", 16, path)
    target.span_id = _id(obj, "spanId", "span_id", 8, path)
    target.parent_span_id = _id(obj, "parentSpanId", "parent_span_id", 8, path)
    target.trace_state = _string(obj, "traceState", "trace_state", path)
    target.flags = _int_field(obj, "flags", "flags", path)
    target.name = _string(obj, "name", "name", path)
    target.kind = _enum(obj, "kind", _SPAN_KINDS, path)
    target.start_time_unix_nano = _int_field(obj, "startTimeUnixNano", "start_time_unix_nano", path, _UINT64_MAX)
    target.end_time_unix_nano = _int_field(obj, "endTimeUnixNano", "end_time_unix_nano", path, _UINT64_MAX)
    _key_values(target.attributes, _array(obj, "attributes", "attributes", path), f"{path}.attributes", keep=keep)
    target.dropped_attributes_count = _int_field(obj, "droppedAttributesCount", "dropped_attributes_count", path)
    for index, event_value in enumerate(_array(obj, "events", "events", path)):
        where = f"{path}.events[{index}]"
        event_obj = _object(event_value, where)
        event = target.events.add()
        event.time_unix_nano = _int_field(event_obj, "timeUnixNano", "time_unix_nano", where, _UINT64_MAX)
        event.name = _string(event_obj, "name", "name", where)
        _key_values(
            event.attributes, _array(event_obj, "attributes", "attributes", where), f"{where}.attributes", keep=keep
        )
        event.dropped_attributes_count = _int_field(
            event_obj, "droppedAttributesCount", "dropped_attributes_count", where
        )
    target.dropped_events_count = _int_field(obj, "droppedEventsCount", "dropped_events_count", path)
    for index, link_value in enumerate(_array(obj, "links", "links", path)):
        where = f"{path}.links[{index}]"
        link_obj = _object(link_value, where)
        link = target.links.add()
        link.trace_id = _id(link_obj, "traceId", "trace_id", 16, where)
        link.span_id = _id(link_obj, "spanId", "span_id", 8, where)
        link.trace_state = _string(link_obj, "traceState", "trace_state", where)
        link.flags = _int_field(link_obj, "flags", "flags", where)
        _key_values(
            link.attributes, _array(link_obj, "attributes", "attributes", where), f"{where}.attributes", keep=keep
        )
    target.dropped_links_count = _int_field(obj, "droppedLinksCount", "dropped_links_count", path)
    status = obj.get("status")
    if status is not None:
        status_obj = _object(status, f"{path}.status")
        target.status.message = _string(status_obj, "message", "message", f"{path}.status")
        target.status.code = _enum(status_obj, "code", _STATUS_CODES, f"{path}.status")


def decode_traces(document: Any, keep: KeyFilter | None = None) -> tuple[Any, list[str]]:
    """(TracesData, problems): spans that failed to decode are left out, one problem each.

    ``keep``, when given, says which attributes (by key) to decode; the others are
    skipped unread, so a value nobody looks at neither costs time nor spoils its span.

    Raises OtlpJsonError when the document's outer structure (not a single span) is wrong.
    """
    traces = trace_pb2.TracesData()
    problems: list[str] = []
    root = _object(document, "document")
    for rs_index, rs_value in enumerate(_array(root, "resourceSpans", "resource_spans", "document")):
        rs_path = f"resourceSpans[{rs_index}]"
        rs_obj = _object(rs_value, rs_path)
        resource_spans = traces.resource_spans.add()
        resource = rs_obj.get("resource")
        if resource is not None:
            res_obj = _object(resource, f"{rs_path}.resource")
            _key_values(
                resource_spans.resource.attributes,
                _array(res_obj, "attributes", "attributes", f"{rs_path}.resource"),
                f"{rs_path}.resource.attributes",
                keep=keep,
            )
        resource_spans.schema_url = _string(rs_obj, "schemaUrl", "schema_url", rs_path)
        for ss_index, ss_value in enumerate(_array(rs_obj, "scopeSpans", "scope_spans", rs_path)):
            ss_path = f"{rs_path}.scopeSpans[{ss_index}]"
            ss_obj = _object(ss_value, ss_path)
            scope_spans = resource_spans.scope_spans.add()
            scope = ss_obj.get("scope")
            if scope is not None:
                scope_obj = _object(scope, f"{ss_path}.scope")
                scope_spans.scope.name = _string(scope_obj, "name", "name", f"{ss_path}.scope")
                scope_spans.scope.version = _string(scope_obj, "version", "version", f"{ss_path}.scope")
            scope_spans.schema_url = _string(ss_obj, "schemaUrl", "schema_url", ss_path)
            for span_index, span_value in enumerate(_array(ss_obj, "spans", "spans", ss_path)):
                span_path = f"{ss_path}.spans[{span_index}]"
                try:
                    _span(scope_spans.spans.add(), _object(span_value, span_path), span_path, keep)
                except OtlpJsonError as exc:
                    del scope_spans.spans[-1]
                    name = span_value.get("name") if isinstance(span_value, dict) else None
                    named = f' (span "{name[:200]}")' if isinstance(name, str) and name else ""
                    problems.append(f"{exc}{named}")
    return traces, problems
