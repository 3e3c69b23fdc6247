"""Violations as spans, in the trace of the record that tripped them.

Each violation becomes one span named ``durable.violation <rule>``, a child of the
span that tripped the rule (``parent_span_id = violation.span_id``), so a tracing UI
shows it right where the fault is. Its span id is derived from the violation id, so
sending it again yields the same span, not a second one. A violation without a trace
(from an action log) gets a trace id derived from its violation id.

The request is built from the OTLP protobuf messages directly rather than through the
SDK's span exporter: the SDK exporter takes ``ReadableSpan`` objects and would accept
explicit ids, but it retries on its own (blocking, with its own backoff) inside
``export()``, which would fight with this exporter's bounded queue, and it does not
tell a retryable failure from a permanent one.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

from exporters.base import QueuedViolationExporter, SendResult
from exporters.config import OtlpConfig
from exporters.otlp_transport import OtlpTransport
from exporters.resource import resource_attributes
from processor._version import __version__
from processor.records import Action
from processor.telemetry import Telemetry
from processor.violations import Violation

SCOPE_NAME = "durable-check"
_ERROR_SEVERITIES = frozenset({"critical", "error"})


def _derived(label: str, violation_id: str, size: int) -> bytes:
    digest = hashlib.sha256(f"{label}:{violation_id}".encode()).digest()[:size]
    # The all-zero id is invalid in OTLP; a digest that starts so is vanishingly rare
    # but must still not produce one.
    return digest if any(digest) else b"\x01" + digest[1:]


def _hex_id(text: str, size: int) -> bytes | None:
    """A hex trace or span id of the right length, or None if it is not one."""
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        return None
    return raw if len(raw) == size and any(raw) else None


def violation_span_ids(violation: Violation) -> tuple[bytes, bytes, bytes]:
    """``(trace_id, span_id, parent_span_id)`` of the violation's span (parent may be empty)."""
    trace_id = _hex_id(violation.trace_id, 16) if violation.trace_id else None
    parent = _hex_id(violation.span_id, 8) if trace_id is not None and violation.span_id else None
    if trace_id is None:
        trace_id = _derived("trace", violation.violation_id, 16)
    return trace_id, _derived("span", violation.violation_id, 8), parent or b""


def _attr(key: str, value: str) -> KeyValue:
    return KeyValue(key=key, value=AnyValue(string_value=value))


def violation_span(violation: Violation, now_ns: int) -> Span:
    trace_id, span_id, parent = violation_span_ids(violation)
    when = violation.time_ns if violation.time_ns is not None else now_ns
    attributes = [
        _attr("durable.rule.id", violation.rule),
        _attr("durable.rule.name", violation.name),
        _attr("durable.rule.severity", violation.severity),
        _attr("durable.session.id", violation.session_id),
        _attr("durable.action.id", violation.action_id),
        _attr("durable.violation.id", violation.violation_id),
        _attr("durable.violation.message", violation.message),
    ]
    if violation.kind:
        attributes.append(_attr("durable.action.kind", violation.kind))
    status = (
        Status(code=Status.STATUS_CODE_ERROR, message=violation.message)
        if violation.severity in _ERROR_SEVERITIES else Status(code=Status.STATUS_CODE_UNSET)
    )
    return Span(
        trace_id=trace_id,
        span_id=span_id,
        parent_span_id=parent,
        name=f"durable.violation {violation.rule}",
        kind=Span.SPAN_KIND_INTERNAL,
        start_time_unix_nano=when,
        end_time_unix_nano=when,
        attributes=attributes,
        status=status,
    )


def build_request(
    violations: Sequence[Violation], now_ns: int | None = None, resource: Mapping[str, str] | None = None,
) -> ExportTraceServiceRequest:
    """One resource (the checker itself; ``resource_attributes()`` unless given) holding one span per violation."""
    now = now_ns if now_ns is not None else time.time_ns()
    attributes = resource if resource is not None else resource_attributes()
    resource_message = Resource(attributes=[_attr(k, v) for k, v in sorted(attributes.items())])
    scope = InstrumentationScope(name=SCOPE_NAME, version=__version__)
    spans = [violation_span(v, now) for v in violations]
    return ExportTraceServiceRequest(
        resource_spans=[ResourceSpans(resource=resource_message, scope_spans=[ScopeSpans(scope=scope, spans=spans)])]
    )


class OtlpSpanExporter(QueuedViolationExporter):
    name = "otlp"

    def __init__(self, cfg: OtlpConfig, telemetry: Telemetry) -> None:
        self._resource = resource_attributes()
        self._transport = OtlpTransport(
            self.name, telemetry,
            endpoint=cfg.endpoint, protocol=cfg.protocol, insecure=cfg.insecure,
            headers=cfg.headers, timeout_s=float(cfg.timeout), signal="traces",
        )
        self._start_queue(telemetry, max_queue=cfg.max_queue, batch_size=cfg.batch_size, policy=cfg.retry_policy())

    def _send(self, violations: list[Violation]) -> SendResult:
        return self._transport.send(build_request(violations, resource=self._resource))

    def _close(self) -> None:
        self._transport.close()

    def resolve(self, violation_ids: Sequence[str]) -> None:
        """A span records that a violation happened; its clearing is not a span."""

    def export_actions(self, actions: Sequence[Action]) -> None:
        """Actions are already spans where they came from spans."""
