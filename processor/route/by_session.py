"""Spans regrouped by session, the session set on their resource: the first tier of a two-tier topology.

Not every span names its session; the identity stage (processor.evaluate.identity) gives
the others the session their trace names, which needs the spans of a trace together.
A first tier receives whole traces (the Collector routes it by trace id), resolves each
span's session with the same :class:`IdentityResolver` the checker uses, and sends the
spans on with ``durable.session.id`` on their resource, one ResourceSpans per session.
A second Collector hop, routing by that resource attribute, then brings every span of a
session to one evaluator, whatever trace it came in.

A span goes on once all the actions it gave are resolved: at once when it names its
session, else when a span of its trace names one, or when it has waited the allowed
lateness (event time, or wall time through :meth:`SessionSplitter.release_due`) and
keeps the trace id as its session, as the checker would. Spans that give no action and
spans that name no session at all (rejected, or no agent span) go on at once, their
resource untouched: they route to the empty key, and their evaluation needs no session
state. What is held is bounded by the identity stage's own bounds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from processor.convert.profiles import DURABLE_SESSION_KEY
from processor.convert.spans import SpanConverter
from processor.evaluate.identity import IdentityResolver, IdentityState
from processor.records import Action, Malformed, SessionMark

ROUTING_ATTRIBUTE: Final = DURABLE_SESSION_KEY

SpanKey = tuple[str, str]


@dataclass(slots=True)
class _Placed:
    """A span as it arrived, with the resource and scope it came under."""

    resource: Any
    resource_schema: str
    scope: Any
    scope_schema: str
    span: Any


@dataclass(slots=True)
class _Waiting:
    """A span whose actions are not all resolved yet."""

    copies: list[_Placed]
    pending: int
    session: str | None = None


@dataclass(slots=True)
class _Out:
    """Spans ready to go, in order, each with its session (None: none named, resource untouched)."""

    spans: list[tuple[str | None, _Placed]] = field(default_factory=list)


class SessionSplitter:
    """Resolves each span's session and regroups spans per session. One thread at a time."""

    def __init__(self, converter: SpanConverter, lateness_ns: int, state: IdentityState | None = None) -> None:
        self._converter = converter
        self._resolver = IdentityResolver(state if state is not None else IdentityState(), lateness_ns)
        self._waiting: dict[SpanKey, _Waiting] = {}
        self._seq = 0

    @property
    def held_spans(self) -> int:
        return len(self._waiting)

    def to_plain(self) -> dict[str, Any]:
        """What the splitter holds, as plain data (spans as hex of their OTLP bytes), for a store to keep
        across a restart; :meth:`from_plain` gives a splitter that goes on as this one would."""
        return {
            "seq": self._seq,
            "identity": self._resolver.state.to_plain(),
            "waiting": [
                [trace_id, span_id, waiting.pending, waiting.session,
                 [[p.resource.SerializeToString().hex(), p.resource_schema, p.scope.SerializeToString().hex(),
                   p.scope_schema, p.span.SerializeToString().hex()] for p in waiting.copies]]
                for (trace_id, span_id), waiting in self._waiting.items()
            ],
        }

    @classmethod
    def from_plain(cls, converter: SpanConverter, lateness_ns: int, plain: Mapping[str, Any]) -> SessionSplitter:
        splitter = cls(converter, lateness_ns, IdentityState.from_plain(plain["identity"]))
        splitter._seq = int(plain["seq"])
        for trace_id, span_id, pending, session, copies in plain["waiting"]:
            placed = [
                _Placed(resource_pb2.Resource.FromString(bytes.fromhex(resource)), str(resource_schema),
                        common_pb2.InstrumentationScope.FromString(bytes.fromhex(scope)), str(scope_schema),
                        trace_pb2.Span.FromString(bytes.fromhex(span)))
                for resource, resource_schema, scope, scope_schema, span in copies
            ]
            splitter._waiting[(str(trace_id), str(span_id))] = _Waiting(
                placed, int(pending), None if session is None else str(session))
        return splitter

    def admit(self, request: Any, now_ns: int) -> list[Any]:
        """``request``: an ExportTraceServiceRequest. The ResourceSpans ready to send on, per session."""
        result = self._converter.convert(request, "route", self._seq)
        self._seq += len(result.actions)
        placed: dict[SpanKey, _Placed] = {}
        order: list[SpanKey] = []
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    key = (bytes(span.trace_id).hex(), bytes(span.span_id).hex())
                    order.append(key)
                    placed[key] = _Placed(resource_spans.resource, resource_spans.schema_url,
                                          scope_spans.scope, scope_spans.schema_url, span)
        out = _Out()
        actions_of: dict[SpanKey, int] = {}
        direct: dict[SpanKey, str | None] = {}
        for item in result.items:
            if isinstance(item, Action) and item.delivery_key is not None:
                key = (item.delivery_key[0], item.delivery_key[1])
                actions_of[key] = actions_of.get(key, 0) + 1
            elif isinstance(item, (SessionMark, Malformed)):
                direct[(item.trace_id, item.span_id)] = item.session_id or None
        for key in order:
            count = actions_of.get(key, 0)
            if count:
                waiting = self._waiting.get(key)
                if waiting is None:  # a redelivery of a held span waits with it
                    self._waiting[key] = _Waiting([placed[key]], count)
                else:
                    waiting.copies.append(placed[key])
                    waiting.pending += count
            else:
                out.spans.append((direct.get(key), placed[key]))
        self._released(self._resolver.admit(result.items, now_ns), out)
        return _grouped(out)

    def release_due(self, now_ns: int) -> list[Any]:
        """What has waited the allowed lateness of wall time for its session, with the trace id as session."""
        out = _Out()
        self._released(self._resolver.release_due(now_ns), out)
        return _grouped(out)

    def release_all(self) -> list[Any]:
        """End of input: everything held, as it is."""
        out = _Out()
        self._released(self._resolver.release_all(), out)
        return _grouped(out)

    def _released(self, items: Iterable[Action | Malformed], out: _Out) -> None:
        for item in items:
            if not isinstance(item, Action) or item.delivery_key is None:
                continue
            key = (item.delivery_key[0], item.delivery_key[1])
            waiting = self._waiting.get(key)
            if waiting is None:
                continue
            if waiting.session is None:
                # A span's events may name sessions of their own; the span goes with its first action's.
                waiting.session = item.session_id
            waiting.pending -= 1
            if waiting.pending <= 0:
                del self._waiting[key]
                out.spans.extend((waiting.session, copy) for copy in waiting.copies)


def _grouped(out: _Out) -> list[Any]:
    """One ResourceSpans per (session, resource), one ScopeSpans per scope, in arrival order."""
    by_resource: dict[tuple[str | None, bytes, str], Any] = {}
    scopes: dict[tuple[str | None, bytes, str, bytes, str], Any] = {}
    grouped: list[Any] = []
    for session, placed in out.spans:
        resource_bytes = placed.resource.SerializeToString(deterministic=True)
        resource_key = (session, resource_bytes, placed.resource_schema)
        target = by_resource.get(resource_key)
        if target is None:
            target = trace_pb2.ResourceSpans(resource=_with_session(placed.resource, session),
                                             schema_url=placed.resource_schema)
            by_resource[resource_key] = target
            grouped.append(target)
        scope_key = (*resource_key, placed.scope.SerializeToString(deterministic=True), placed.scope_schema)
        scope = scopes.get(scope_key)
        if scope is None:
            scope = target.scope_spans.add(scope=placed.scope, schema_url=placed.scope_schema)
            scopes[scope_key] = scope
        scope.spans.append(placed.span)
    return grouped


def _with_session(resource: Any, session: str | None) -> Any:
    copy = resource_pb2.Resource()
    copy.CopyFrom(resource)
    if session is None:
        return copy
    for index in range(len(copy.attributes) - 1, -1, -1):
        if copy.attributes[index].key == ROUTING_ATTRIBUTE:
            del copy.attributes[index]
    copy.attributes.append(common_pb2.KeyValue(key=ROUTING_ATTRIBUTE,
                                               value=common_pb2.AnyValue(string_value=session)))
    return copy
