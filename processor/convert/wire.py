"""A reading of serialized OTLP trace exports built for conversion.

``TracesData`` and ``ExportTraceServiceRequest`` share their wire format (field 1:
repeated ResourceSpans). This module declares a twin of ``TracesData`` that differs
in one field: ``Span.attributes`` is a ``map<string, AnyValue>`` instead of a
``repeated KeyValue``. On the wire the two are the same bytes (a map entry is a
message with the key as field 1 and the value as field 2, which is what a KeyValue
is), and a map keeps the last value of a repeated key, as reading the list in order
does. What changes is the cost of reading: the parser builds each span's attribute
table in C, so finding the dozen keys conversion cares about among a span's
attributes no longer means wrapping every KeyValue in a Python object.

Everything else (resources, scopes, events, links, status) keeps its official
message type, so the parser validates exactly what the official one does.
"""

from __future__ import annotations

from typing import Any, Final

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from opentelemetry.proto.trace.v1 import trace_pb2

_OFFICIAL_PACKAGE: Final = "opentelemetry.proto.trace.v1"
_PACKAGE: Final = "durablecheck.convert.wire.v1"
_FILE: Final = "durablecheck/convert/wire/v1/trace.proto"
_ANY_VALUE: Final = ".opentelemetry.proto.common.v1.AnyValue"


def _renamed(message: descriptor_pb2.DescriptorProto) -> None:
    """Point references to the official trace messages at their twins in this package."""
    prefix = f".{_OFFICIAL_PACKAGE}."
    for field in message.field:
        if field.type_name.startswith(prefix):
            field.type_name = f".{_PACKAGE}." + field.type_name[len(prefix) :]
    for nested in message.nested_type:
        _renamed(nested)


def _build_message_class() -> Any:
    pool = descriptor_pool.Default()
    try:
        return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.TracesData"))
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    trace_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name = _FILE
    proto.package = _PACKAGE
    proto.ClearField("options")
    for message in proto.message_type:
        _renamed(message)
    (span,) = [message for message in proto.message_type if message.name == "Span"]
    entry = span.nested_type.add()
    entry.name = "AttributesEntry"
    entry.options.map_entry = True
    key = entry.field.add()
    key.name, key.number, key.label, key.type = "key", 1, key.LABEL_OPTIONAL, key.TYPE_STRING
    value = entry.field.add()
    value.name, value.number, value.label, value.type = "value", 2, value.LABEL_OPTIONAL, value.TYPE_MESSAGE
    value.type_name = _ANY_VALUE
    (attributes,) = [field for field in span.field if field.name == "attributes"]
    attributes.type_name = f".{_PACKAGE}.Span.AttributesEntry"
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.TracesData"))


# Parses a serialized ExportTraceServiceRequest or TracesData; spans' attributes are a map.
MappedTracesData: Final[Any] = _build_message_class()
