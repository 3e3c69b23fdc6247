"""OTLP spans become Actions.

The converter reads the protobuf messages as they arrived: it walks each span's
attribute list once, keeps the handful of keys some enabled profile wants, and
builds the record from those. It never turns a span into a dict of all its
attributes (that costs more than the rest of the conversion together), and it
never copies payloads (tool results, model replies) into records: presence is what
the rules need.

One record per span attempt (``source="span"``), plus one per span event named
``durable.action``. Spans no profile recognises (HTTP, database, agent containers)
are counted, not converted.

Serialized requests take a faster road for the usual span (``_convert_plain``: one
pass, nothing to explain or link); ``_convert_span`` is the general path and the
reference the tests compare it with.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Final

from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from processor.convert import frameworks
from processor.convert.classify import ToolClassifier
from processor.convert.links import lang_chain_call_id, offered_tool_calls
from processor.convert.options import ConvertOptions
from processor.convert.profiles import (
    CONTAINER,
    DURABLE_ATTRIBUTES,
    DURABLE_BY_KEY,
    DURABLE_EVENT_NAME,
    DURABLE_SESSION_KEY,
    HOST_NAME,
    IDENTITY_FIELDS,
    OI_OUTPUT_MESSAGES_PREFIX,
    OI_OUTPUT_VALUE,
    OI_SPAN_KIND,
    PROBE_FIELDS,
    PROCESS_PID,
    RESOURCE_KEYS,
    SERVICE_INSTANCE_ID,
    SERVICE_NAME,
    TL_COMPLETION_PREFIX,
    TYPE_WORDS,
    AnyValue,
    Verdict,
    enabled_profiles,
    text,
    type_word,
    typed,
)
from processor.convert.timefmt import format_rfc3339
from processor.convert.wire import MappedTracesData
from processor.records import (
    COVERED_BY_STEP_BESIDE,
    INT64_MAX,
    ROLE_ANNOTATED,
    ROLE_TOOL,
    Action,
    Malformed,
    Record,
    SessionMark,
    SpanLinks,
    bound_identities,
    bounded_text,
)

_STATUS_CODE_ERROR: Final = 2  # opentelemetry.proto.trace.v1.Status.STATUS_CODE_ERROR
_ZERO_TRACE_ID: Final = bytes(16)
_ZERO_SPAN_ID: Final = bytes(8)
_FIELD_RANK: Final = {attribute.field: rank for rank, attribute in enumerate(DURABLE_ATTRIBUTES)}
# Per durable.* key: (record field, the AnyValue field to try first, the expected type).
_DURABLE_SPECS: Final = {a.key: (a.field, PROBE_FIELDS[a.type], a.type) for a in DURABLE_ATTRIBUTES}
_NS_PER_S: Final = 1_000_000_000
# Span names are quoted in messages; a runaway name must not make a runaway message.
_NAME_LIMIT: Final = 200
# Distinct attribute orders remembered by _field_order; a bound against adversarial input.
_ORDERS_LIMIT: Final = 1024
# Records a framework's span implies (convert/frameworks.py) are numbered from here, past any event index.
_DERIVED_INDEX: Final = 1 << 24
# A span with more attributes than this is asked for each wanted key rather than walked (measured:
# a map lookup costs about half of what creating and hashing one key string does).
_WALK_KEYS_UP_TO: Final = 24
# The event name's bytes not followed by "." (see _may_hold_durable_events).
# Instrumentations whose model-call spans sit beside, not inside, the durable runtime's step that
# runs the call: OpenInference's for the OpenAI Agents SDK, whose spans follow the SDK's own trace
# while dbos-openai-agents runs each model call as a DBOS step under the same parent.
MODEL_CALLS_BESIDE_STEPS: Final = frozenset({"openinference.instrumentation.openai_agents"})
# Annotated kinds recorded inside a tool without being the tool's call.
_NOT_A_CALL: Final = frozenset({"checkpoint", "approval"})
_DURABLE_EVENT_NAME_ALONE: Final = re.compile(re.escape(DURABLE_EVENT_NAME.encode()) + rb"(?!\.)")


@dataclass(slots=True)
class ConvertResult:
    """What one request gave: actions in span order, spans that could not be converted, counts."""

    actions: list[Action] = field(default_factory=list)
    rejected: list[Malformed] = field(default_factory=list)
    spans_total: int = 0
    spans_not_actions: int = 0
    # Spans read by the general path rather than the one-pass reading of usual spans: a diagnostic
    # of how the result was reached, not part of it (results compare equal whatever the path).
    spans_general: int = field(default=0, compare=False)
    # Actions, rejected spans and session marks together, in span order (what a file reader yields).
    items: list[Action | Malformed | SessionMark] = field(default_factory=list)
    # ResourceSpans in the request (a message holding none holds nothing of OTLP).
    resource_spans: int = 0
    # Spans that are no action but name their session (for the actions of their trace).
    marks: list[SessionMark] = field(default_factory=list)


class _NeedsOfficialReading(Exception):
    """The mapped reading cannot tell this request as the official one would (see convert_serialized)."""


@dataclass(slots=True)
class _Resource:
    """What a ResourceSpans contributes to each of its spans, read once."""

    service: str | None
    instance: str | None
    # durable.* attributes on the resource: defaults for every action of the resource.
    defaults: dict[str, Any]
    problems: list[str]
    # Profile session keys (session.id, ...) set on the resource rather than the span.
    found: dict[str, AnyValue]
    # Whether some attribute of the resource names a session.
    names_session: bool = False


class SpanConverter:
    """Stateless apart from caches: one instance may serve every receiver."""

    def __init__(self, options: ConvertOptions | None = None) -> None:
        self.options = options if options is not None else ConvertOptions()
        self._classifier = ToolClassifier(self.options.tool_kinds)
        self._profiles = enabled_profiles(self.options)
        self._durable_keys = frozenset(DURABLE_BY_KEY) if self.options.durable else frozenset()
        wanted = set(self._durable_keys)
        for profile in self._profiles:
            wanted |= profile.keys
        self._frameworks = (
            self.options.framework_approvals or self.options.langgraph_checkpoints or self.options.dbos_steps
        )
        if self._frameworks:
            wanted |= frameworks.KEYS
        self._wanted = frozenset(wanted)
        self._wanted_keys = tuple(sorted(self._wanted))
        self._resource_wanted = frozenset(wanted | RESOURCE_KEYS)
        self._verdicts = tuple(profile.verdict for profile in self._profiles)
        self._session_keys = tuple(key for profile in self._profiles for key in profile.session_keys)
        self._action_id_keys = tuple(key for profile in self._profiles for key in profile.action_id_keys)
        # Indexed output keys (llm.output_messages.N.*, gen_ai.completion.N.*) say a reply was recorded.
        output_prefixes = []
        if self.options.openinference:
            output_prefixes.append(OI_OUTPUT_MESSAGES_PREFIX)
        if self.options.openllmetry:
            output_prefixes.append(TL_COMPLETION_PREFIX)
        self._output_prefixes = tuple(output_prefixes) if self.options.telemetry_is_log else ()
        self._scan_output_prefix = bool(self._output_prefixes)
        # An LLM span's output tool calls are read for linking tool spans to their call ids.
        self._link_tools = self.options.openinference
        self._read_prefixes = (OI_OUTPUT_MESSAGES_PREFIX,) if self.options.openinference else ()
        # Spans of one request mostly share their second: reuse its formatted prefix.
        self._last_second: tuple[int, str] = (-1, "")
        self._orders: dict[tuple[str, ...], tuple[str, ...]] = {}

    # -- public -------------------------------------------------------------------------

    def reads_attribute(self, key: str) -> bool:
        """Whether conversion ever looks at an attribute of this key (decoders may skip the rest)."""
        return (
            key in self._resource_wanted
            or key.startswith(self._output_prefixes + self._read_prefixes)
            or (self.options.framework_approvals and key in frameworks.EVENT_KEYS)
        )

    def convert(self, request: Any, origin: str = "", seq_start: int = 0) -> ConvertResult:
        """``request``: an ExportTraceServiceRequest or a TracesData (both hold resource_spans)."""
        out = ConvertResult()
        wanted = self._wanted
        spans_total = spans_not_actions = 0
        for resource_spans in request.resource_spans:
            out.resource_spans += 1
            resource = self._read_resource(resource_spans.resource)
            for scope_spans in resource_spans.scope_spans:
                beside = scope_spans.scope.name in MODEL_CALLS_BESIDE_STEPS
                for span in scope_spans.spans:
                    spans_total += 1
                    found: dict[str, AnyValue] = {}
                    for kv in span.attributes:
                        key = kv.key
                        if key in wanted:
                            found[key] = kv.value
                    if not self._convert_span(
                        span,
                        found,
                        mapped=False,
                        events=True,
                        resource=resource,
                        origin=origin,
                        seq_start=seq_start,
                        out=out,
                        beside_steps=beside,
                    ):
                        spans_not_actions += 1
        out.spans_total = spans_total
        out.spans_not_actions = spans_not_actions
        return out

    def convert_serialized(self, data: bytes, origin: str = "", seq_start: int = 0) -> ConvertResult:
        """``convert(ExportTraceServiceRequest.FromString(data))``, at a fraction of the cost.

        Raises DecodeError when, and only when, the official parser does. The bytes are
        read with span attributes as a map (see ``wire``). Two things send the request
        through the official parser instead: a span whose several problems must be told
        in attribute order, which a map does not keep; and a span with unknown fields,
        where a KeyValue carrying a field of its own may hide (the parser keeps such a
        map entry among the span's unknown fields rather than in the map).
        """
        try:
            request = MappedTracesData.FromString(data)
        except DecodeError:
            # What is malformed is the official parser's call.
            return self.convert(ExportTraceServiceRequest.FromString(data), origin, seq_start)
        try:
            return self._convert_mapped(request, origin, seq_start, _may_hold_durable_events(data))
        except _NeedsOfficialReading:
            return self.convert(ExportTraceServiceRequest.FromString(data), origin, seq_start)

    def _convert_mapped(self, request: Any, origin: str, seq_start: int, events: bool) -> ConvertResult:
        out = ConvertResult()
        wanted = self._wanted
        wanted_keys = self._wanted_keys
        unknown_fields = UnknownFieldSet
        spans_total = spans_not_actions = 0
        for resource_spans in request.resource_spans:
            out.resource_spans += 1
            resource = self._read_resource(resource_spans.resource)
            # A resource that names a session marks its spans; one with problems spoils them: both general.
            plain_resource = not (resource.names_session or resource.problems)
            for scope_spans in resource_spans.scope_spans:
                beside = scope_spans.scope.name in MODEL_CALLS_BESIDE_STEPS
                for span in scope_spans.spans:
                    spans_total += 1
                    if unknown_fields(span):
                        raise _NeedsOfficialReading
                    attributes = span.attributes
                    # The keys are compared in C; only the values wanted are fetched. Past a few
                    # dozen attributes, asking the map for each wanted key beats walking its keys.
                    keys: frozenset[str] | list[str]
                    if len(attributes) <= _WALK_KEYS_UP_TO:
                        keys = wanted.intersection(attributes)
                    else:
                        keys = [key for key in wanted_keys if key in attributes]
                    if not keys and plain_resource and not (events and len(span.events) > 0):
                        spans_not_actions += 1  # HTTP, database, ...: nothing any profile reads
                        continue
                    found = {key: attributes[key] for key in keys}
                    if plain_resource and not (events and len(span.events) > 0):
                        converted = self._convert_plain(span, found, resource, origin, seq_start, out)
                        if converted is not None:
                            spans_not_actions += not converted
                            continue
                    if not self._convert_span(
                        span,
                        found,
                        mapped=True,
                        events=events,
                        resource=resource,
                        origin=origin,
                        seq_start=seq_start,
                        out=out,
                        beside_steps=beside,
                    ):
                        spans_not_actions += 1
        out.spans_total = spans_total
        out.spans_not_actions = spans_not_actions
        return out

    def _convert_plain(  # noqa: PLR0917 - the per-span hot path: positional on purpose
        self, span: Any, found: dict[str, AnyValue], resource: _Resource, origin: str, seq_start: int,
        out: ConvertResult,
    ) -> bool | None:
        """``_convert_span`` for the usual span, in one pass: True (an action), False (no action),
        or None when the span needs the general path (a problem to tell, a framework's reading,
        OpenInference links, an output-prefix scan). Nothing is appended before it decides.

        The general path stays the reference: tests compare the two on random spans.
        """
        own: dict[str, Any] = {}
        marked = False
        if self._durable_keys:
            specs = _DURABLE_SPECS
            for key in self._durable_keys.intersection(found):
                field_name, probe, expected = specs[key]
                value = found[key]
                usual = getattr(value, probe)
                if not usual:
                    ok, usual = typed(value, expected)
                    if not ok:
                        return None  # a problem to tell
                own[field_name] = usual
                if field_name != "session_id":
                    marked = True
        if self._frameworks and not frameworks.KEYS.isdisjoint(found):
            return None
        verdict = self._verdict(found)
        if not (marked or verdict is not None):
            if found:
                self._mark_session(span, own, found, resource, out)
            return False
        if verdict is not None and (
            (self._link_tools and OI_SPAN_KIND in found)
            or (verdict.kind == "llm_call" and not verdict.result_recorded and self._scan_output_prefix)
        ):
            return None

        trace_id: bytes = span.trace_id
        span_id: bytes = span.span_id
        if len(trace_id) != 16 or trace_id == _ZERO_TRACE_ID or len(span_id) != 8 or span_id == _ZERO_SPAN_ID:
            return None
        defaults = resource.defaults
        merged = {**defaults, **own} if defaults else own
        kind = self._kind(merged, verdict)
        if not kind:
            return None

        session = own.get("session_id")
        if session:
            session, named = str(session), True
        else:
            session, named = self._session(own, found, resource, span)
        action_id = _first_text(own, found, self._action_id_keys)
        trace_hex = trace_id.hex()
        span_hex = span_id.hex()
        synthetic = not action_id
        if synthetic:
            action_id = f"span-{span_hex}"
        default_status = "error" if span.status.code == _STATUS_CODE_ERROR else "ok"
        role = _role(marked, own, verdict)
        record = self._record(session, action_id, kind, default_status=default_status, merged=merged, verdict=verdict)
        time_ns = self._place(record, span.start_time_unix_nano, trace_hex, span_hex, resource)
        action = Action(
            record,
            "span",
            origin,
            None,
            time_ns or None,
            seq_start + len(out.actions),
            (trace_hex, span_hex, 0),
            synthetic,
            # tuple.__new__ skips the NamedTuple's Python-level __new__: this runs for every action.
            tuple.__new__(SpanLinks, (span.parent_span_id.hex(), named, None, (), role, "", "", "", 0)),
        )
        out.actions.append(action)
        out.items.append(action)
        return True

    # -- resource -------------------------------------------------------------------------

    def _read_resource(self, resource: Any) -> _Resource:
        found: dict[str, AnyValue] = {}
        wanted = self._resource_wanted
        for kv in resource.attributes:
            if kv.key in wanted:
                found[kv.key] = kv.value
        defaults, problems, _ = self._durable_fields(found, "resource attribute")
        service = _text_of(found, SERVICE_NAME)
        instance = _text_of(found, SERVICE_INSTANCE_ID)
        if not instance:
            host = _text_of(found, HOST_NAME)
            pid = _text_of(found, PROCESS_PID)
            instance = f"{host}:{pid}" if host and pid else host
        names = bool(defaults.get("session_id")) or any(key in found for key in self._session_keys)
        service, instance = bounded_text(service), bounded_text(instance)
        return _Resource(service or None, instance or None, defaults, list(problems.values()), found, names)

    # -- spans ----------------------------------------------------------------------------

    def _durable_fields(self, found: dict[str, AnyValue], what: str) -> tuple[dict[str, Any], dict[str, str], bool]:
        """(record fields, type problems by attribute, whether an action attribute other than the session is set)."""
        fields: dict[str, Any] = {}
        problems: dict[str, str] = {}
        marked = False
        if not self.options.durable:
            return fields, problems, marked
        specs = _DURABLE_SPECS
        for key, value in found.items():
            spec = specs.get(key)
            if spec is None:
                continue
            field_name, probe, expected = spec
            if field_name != "session_id":
                marked = True
            usual = getattr(value, probe)
            if usual:
                fields[field_name] = usual
                continue
            ok, converted = typed(value, expected)
            if ok:
                fields[field_name] = converted
            else:
                problems[key] = f"{what} {key} must be {TYPE_WORDS[expected]}, got {type_word(value)}"
        return fields, problems, marked

    def _convert_span(
        self,
        span: Any,
        found: dict[str, AnyValue],
        *,
        mapped: bool,
        events: bool,
        resource: _Resource,
        origin: str,
        seq_start: int,
        out: ConvertResult,
        beside_steps: bool = False,
    ) -> bool:
        """Append the span's items to ``out``; False when it gave none (not an action).

        ``beside_steps``: the span's instrumentation traces model calls beside the durable
        runtime's step that runs them (see MODEL_CALLS_BESIDE_STEPS).

        ``found``: the span's attributes of the keys some profile reads; ``mapped``: the
        span comes from MappedTracesData (its attributes are a map); ``events``: false
        when no span of the request can hold a ``durable.action`` event.
        """
        out.spans_general += 1
        own: dict[str, Any]
        problems: dict[str, str]
        if self._durable_keys and not self._durable_keys.isdisjoint(found):
            own, problems, marked = self._durable_fields(found, "attribute")
            if mapped and len(problems) > 1:
                # Several problems are told in attribute order, which a map does not keep.
                raise _NeedsOfficialReading
        else:
            own, problems, marked = {}, {}, False

        verdict = self._verdict(found)

        reading = frameworks.NOTHING
        if self._frameworks and not frameworks.KEYS.isdisjoint(found):
            reading = frameworks.read(found, span, self.options)
            if reading.suppress_span:
                verdict = None

        has_events = events and self.options.durable and len(span.events) > 0
        if not (marked or verdict is not None or has_events or reading.derived):
            if found or resource.names_session:
                self._mark_session(span, own, found, resource, out, reading.workflow)
            return False

        appended = False
        session, named = self._session(own, found, resource, span)
        parent = bytes(span.parent_span_id).hex()
        if marked or verdict is not None:
            if (
                verdict is not None
                and verdict.kind == "llm_call"
                and not verdict.result_recorded
                and self._scan_output_prefix
                and _has_key_prefix(span.attributes, mapped, self._output_prefixes)
            ):
                verdict = Verdict(verdict.kind, verdict.tool_name, True)
            action_id = _first_text(own, found, self._action_id_keys)
            if verdict is not None and self._link_tools and OI_SPAN_KIND in found:
                links = self._links(span, mapped, verdict, parent, named, action_id)
                if links.tool_name is not None and (linked := lang_chain_call_id(found.get(OI_OUTPUT_VALUE))):
                    # LangChain's tool output names the call it answers.
                    action_id = linked
                    links = links._replace(tool_name=None)
            else:
                links = SpanLinks(parent, named)
            # One action per tool call: the identity stage lets an annotated action inside a
            # framework's tool span stand for the call.
            role = _role(marked, own, verdict)
            covered_by = reading.covered_by
            if beside_steps and not covered_by and verdict is not None and verdict.kind == "llm_call" and parent:
                covered_by = COVERED_BY_STEP_BESIDE  # recorded, if at all, by a step beside it
            if role or covered_by or reading.workflow:
                links = links._replace(role=role, covered_by=covered_by, workflow=reading.workflow)
            default_status = "error" if span.status.code == _STATUS_CODE_ERROR else "ok"
            item = self._build(
                span,
                resource=resource,
                origin=origin,
                own=own,
                problems=list(problems.values()) if problems else [],
                verdict=verdict,
                session=session,
                action_id=action_id,
                default_status=default_status,
                time_ns=span.start_time_unix_nano,
                index=0,
                seq=seq_start + len(out.actions),
            )
            if isinstance(item, Action):
                item.links = links
            _append(out, item)
            appended = True

        for number, derived in enumerate(reading.derived):
            item = self._build(
                span,
                resource=resource,
                origin=origin,
                own=derived.fields,
                problems=[],
                verdict=None,
                session=session,
                action_id=derived.fields["action_id"],
                default_status="ok",
                time_ns=derived.time_ns,
                index=_DERIVED_INDEX + number,
                seq=seq_start + len(out.actions),
            )
            if isinstance(item, Action) and (derived.step or derived.role or reading.workflow):
                item.links = SpanLinks(parent, named, role=derived.role, workflow=reading.workflow, step=derived.step,
                                       step_start_ns=span.start_time_unix_nano if derived.step else 0)
            _append(out, item)
            appended = True

        if not has_events:
            return appended
        # A mistyped durable.session.id on the span spoils the events that rely on it.
        session_problem = problems.get(DURABLE_SESSION_KEY)
        for index, event in enumerate(span.events, start=1):
            if event.name != DURABLE_EVENT_NAME:
                continue
            event_found: dict[str, AnyValue] = {}
            for kv in event.attributes:
                if kv.key in DURABLE_BY_KEY:
                    event_found[kv.key] = kv.value
            event_own, event_problems, _ = self._durable_fields(event_found, "event attribute")
            event_session = event_own.get("session_id") or session
            item = self._build(
                span,
                resource=resource,
                origin=origin,
                own=event_own,
                problems=([session_problem] if session_problem and "session_id" not in event_own else [])
                + list(event_problems.values()),
                verdict=None,
                session=event_session,
                action_id=event_own.get("action_id") or None,
                default_status="ok",
                time_ns=event.time_unix_nano or span.start_time_unix_nano,
                index=index,
                seq=seq_start + len(out.actions),
            )
            if isinstance(item, Action):
                item.links = SpanLinks(parent, named or "session_id" in event_own)
            _append(out, item)
            appended = True
        return appended

    @staticmethod
    def _links(  # noqa: PLR0917 - called once, on OpenInference spans only
        span: Any, mapped: bool, verdict: Verdict, parent: str, named: bool, action_id: str | None
    ) -> SpanLinks:
        """An OpenInference span's tool-call links, for the identity resolution at ingest."""
        if verdict.kind == "tool_call" and not action_id and verdict.tool_name:
            return SpanLinks(parent, named, tool_name=verdict.tool_name)
        if verdict.kind == "llm_call":
            offered = offered_tool_calls(span.attributes, mapped)
            if offered:
                return SpanLinks(parent, named, offered=offered)
        return SpanLinks(parent, named)

    def _mark_session(  # noqa: PLR0917
        self,
        span: Any,
        own: dict[str, Any],
        found: dict[str, AnyValue],
        resource: _Resource,
        out: ConvertResult,
        workflow: str = "",
    ) -> None:
        """A span that is no action (an agent or workflow run): a mark of its place in the trace and the
        session it names, if any, for the actions of its trace that name none."""
        session, named = self._session(own, found, resource, span)
        if len(span.trace_id) != 16 or len(span.span_id) != 8:
            return
        time_ns = span.start_time_unix_nano
        mark = SessionMark(
            bytes(span.trace_id).hex(),
            bytes(span.span_id).hex(),
            bytes(span.parent_span_id).hex(),
            bounded_text(session) if named else "",
            time_ns if 0 < time_ns <= INT64_MAX else None,
            workflow,
        )
        out.marks.append(mark)
        out.items.append(mark)

    def _session(
        self, own: dict[str, Any], found: dict[str, AnyValue], resource: _Resource, span: Any
    ) -> tuple[str, bool]:
        """(session, whether an attribute named it)."""
        session = own.get("session_id")
        if session:
            return str(session), True
        session = resource.defaults.get("session_id")
        if session:
            return str(session), True
        for key in self._session_keys:
            for source in (found, resource.found):
                value = source.get(key)
                if value is not None:
                    candidate = text(value)
                    if candidate:
                        return candidate, True
        # No session attribute on the span: the trace stands in until the identity
        # resolution at ingest finds the session another span of the trace names.
        return bytes(span.trace_id).hex(), False

    def _build(
        self,
        span: Any,
        *,
        resource: _Resource,
        origin: str,
        own: dict[str, Any],
        problems: list[str],
        verdict: Verdict | None,
        session: str,
        action_id: str | None,
        default_status: str,
        time_ns: int,
        index: int,
        seq: int,
    ) -> Action | Malformed:
        """The record of the span (``index`` 0) or of its ``index``-th event, or why there is none."""
        trace_id: bytes = span.trace_id
        span_id: bytes = span.span_id
        trace_hex = trace_id.hex()
        span_hex = span_id.hex()
        if resource.problems:
            problems = resource.problems + problems
        if len(trace_id) != 16 or trace_id == _ZERO_TRACE_ID:
            problems.append(f"trace id must be 16 bytes, not all zero (got {len(trace_id)} bytes)")
        if len(span_id) != 8 or span_id == _ZERO_SPAN_ID:
            problems.append(f"span id must be 8 bytes, not all zero (got {len(span_id)} bytes)")

        defaults = resource.defaults
        merged = {**defaults, **own} if defaults else own
        kind = self._kind(merged, verdict)
        if not kind:
            problems.append("no action kind: set durable.action.kind")

        if problems:
            name = span.name if len(span.name) <= _NAME_LIMIT else span.name[:_NAME_LIMIT] + "..."
            where = f'span "{name}" (trace {trace_hex or "(none)"}, span {span_hex or "(none)"}' + (
                f", event {index})" if index else ")"
            )
            return Malformed(
                f"{where}: " + "; ".join(problems),
                origin=origin,
                session_id=bounded_text(session),
                action_id=bounded_text(action_id or ""),
                trace_id=trace_hex,
                span_id=span_hex,
                source="span",
                extra={"event_index": index} if index else {},
            )

        synthetic = not action_id
        if not action_id:
            action_id = f"span-{span_hex}" if index == 0 else f"span-{span_hex}-{index}"
        record = self._record(session, action_id, kind, default_status=default_status, merged=merged, verdict=verdict)
        time_ns = self._place(record, time_ns, trace_hex, span_hex, resource)
        return Action(record, "span", origin, None, time_ns or None, seq, (trace_hex, span_hex, index), synthetic)

    def _verdict(self, found: dict[str, Any]) -> Verdict | None:
        """The first profile that recognises the span's attributes; a container (agent, chain) is none."""
        if not found:  # every profile's verdict starts from an attribute it reads
            return None
        telemetry_is_log = self.options.telemetry_is_log
        for profile_verdict in self._verdicts:
            verdict = profile_verdict(found, telemetry_is_log)
            if verdict is not None:
                return None if verdict.kind == CONTAINER else verdict
        return None

    def _place(self, record: Record, time_ns: int, trace_hex: str, span_hex: str, resource: Any) -> int:
        """Where and when the span happened, after its own fields; returns the event time (0: unknown)."""
        if time_ns > INT64_MAX:
            time_ns = 0  # OTLP times are unsigned; past the signed 64-bit range the time is unknown
        if time_ns:
            record["time"] = self._format_time(time_ns)
        record["trace_id"] = trace_hex
        record["span_id"] = span_hex
        if resource.service is not None:
            record["service"] = resource.service
        if resource.instance is not None:
            record["instance"] = resource.instance
        return time_ns

    def _kind(self, merged: dict[str, Any], verdict: Any) -> Any:
        """The action kind: durable.action.kind, else the profile's verdict (a tool call classified by name)."""
        kind = merged.get("kind") if merged else None
        if not kind and verdict is not None:
            kind = verdict.kind
            if kind == "tool_call" and verdict.tool_name:
                kind = self._classifier.classify(verdict.tool_name) or kind
        return kind

    def _record(
        self, session: str, action_id: Any, kind: Any, *, default_status: str, merged: dict[str, Any], verdict: Any
    ) -> Record:
        """The record of a span (or event): identity, kind and status first, then the merged fields."""
        if merged:
            record: Record = {
                "session_id": session,
                "action_id": action_id,
                "kind": kind,
                "status": merged.get("status") or default_status,
            }
            recorded = merged.get("result")
            if recorded is True or (recorded is None and verdict is not None and verdict.result_recorded):
                record["result"] = None
            for name in self._field_order(tuple(merged)):
                record[name] = merged[name]
            bound_identities(record)
            return record
        record = {"session_id": session, "action_id": action_id, "kind": kind, "status": default_status}
        if verdict is not None and verdict.result_recorded:
            record["result"] = None
        bound_identities(record)
        return record

    def _field_order(self, names: tuple[str, ...]) -> tuple[str, ...]:
        """The fields of ``names`` copied as they are, in the contract's order (records read the same
        whatever the attribute order). Spans of one instrumentation share a few orders: remembered."""
        try:
            return self._orders[names]
        except KeyError:
            pass
        order = tuple(sorted(set(names) - IDENTITY_FIELDS, key=_FIELD_RANK.__getitem__))
        if len(self._orders) >= _ORDERS_LIMIT:
            self._orders.clear()
        self._orders[names] = order
        return order

    def _format_time(self, time_ns: int) -> str:
        second, fraction = divmod(time_ns, _NS_PER_S)
        cached_second, prefix = self._last_second
        if cached_second != second:
            prefix = format_rfc3339(second * _NS_PER_S)[:-1]
            self._last_second = (second, prefix)
        if fraction:
            return prefix + "." + f"{fraction:09d}".rstrip("0") + "Z"
        return prefix + "Z"


def _may_hold_durable_events(data: bytes) -> bool:
    """False when no span event of the serialized request can be named ``durable.action``.

    The name is stored as its bytes, followed by the next field's tag or the end of the
    data, never by "." (0x2e is no valid tag: wire type 6). Where the bytes occur only
    followed by "." (attribute keys such as "durable.action.id"), no event has that
    name. One scan of the bytes costs far less than asking every span for its events.
    """
    return _DURABLE_EVENT_NAME_ALONE.search(data) is not None


def _role(marked: bool, own: dict[str, Any], verdict: Verdict | None) -> int:
    """SpanLinks.role: an annotated action that can stand for the tool call around it (not a
    checkpoint, wait or decision recorded inside the tool), or a framework's tool span."""
    if marked:
        annotated_call = own.get("kind") not in _NOT_A_CALL and "workflow_state" not in own
        return ROLE_ANNOTATED if annotated_call and "approval_decision" not in own else 0
    return ROLE_TOOL if verdict is not None and verdict.tool_name else 0


def _has_key_prefix(attributes: Any, mapped: bool, prefix: tuple[str, ...]) -> bool:
    """Whether some attribute key starts with ``prefix`` (a map iterates its keys; a list its KeyValues)."""
    if mapped:
        return any(key.startswith(prefix) for key in attributes)
    return any(kv.key.startswith(prefix) for kv in attributes)


def _text_of(found: dict[str, AnyValue], key: str) -> str:
    value = found.get(key)
    return (text(value) or "") if value is not None else ""


def _first_text(own: dict[str, Any], found: dict[str, AnyValue], keys: tuple[str, ...]) -> str | None:
    action_id = own.get("action_id")
    if action_id:
        return str(action_id)
    for key in keys:
        value = found.get(key)
        if value is not None:
            candidate = text(value)
            if candidate:
                return candidate
    return None


def _append(out: ConvertResult, item: Action | Malformed) -> None:
    # An Action's seq was given by _build: seq_start + the number of actions before it.
    if isinstance(item, Action):
        out.actions.append(item)
    else:
        out.rejected.append(item)
    out.items.append(item)
