"""The mapped reading's one-pass conversion of usual spans against the general path, on random requests.

``SpanConverter.convert`` (the official parse, every span through the general path) is the
reference; ``convert_serialized`` takes the one-pass path for the spans it can. Both must
give the same items, records with the same fields in the same order, the same counts.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from processor.convert import ConvertOptions, SpanConverter
from processor.convert.spans import ConvertResult
from processor.records import Action
from tests._spans import add_attributes

# Keys of every profile, framework keys, and keys no profile reads.
_KEYS = (
    "durable.session.id",
    "durable.action.id",
    "durable.action.kind",
    "durable.action.status",
    "durable.result.recorded",
    "durable.result_ref",
    "durable.idempotency_key",
    "durable.retry.retryable",
    "durable.retry.max_attempts",
    "durable.retry.attempt",
    "durable.cache.cacheable",
    "durable.cache.ttl_s",
    "durable.wait.timeout_s",
    "durable.plan.version",
    "durable.workflow.state",
    "gen_ai.operation.name",
    "gen_ai.conversation.id",
    "gen_ai.tool.name",
    "gen_ai.tool.call.id",
    "gen_ai.tool.call.result",
    "gen_ai.output.messages",
    "openinference.span.kind",
    "session.id",
    "tool.name",
    "tool_call.id",
    "output.value",
    "llm.output_messages.0.message.tool_calls.0.tool_call.id",
    "llm.output_messages.0.message.tool_calls.0.tool_call.function.name",
    "traceloop.span.kind",
    "traceloop.entity.name",
    "traceloop.association.properties.session_id",
    "llm.request.type",
    "gen_ai.completion.0.content",
    "final_result",
    "metadata",
    "http.request.method",
    "db.system.name",
    "server.port",
)
_WORDS = (
    "chat", "execute_tool", "invoke_agent", "retrieval", "create_memory", "LLM", "TOOL", "AGENT", "tool",
    "workflow", "task", "completion", "payment", "write", "checkpoint", "llm_call", "ok", "error",
    "charge_card", "search_flights", "s-1", "s-2", "a-1", "a-2", "",
)
_VALUES = st.one_of(
    st.sampled_from(_WORDS),
    st.booleans(),
    st.integers(min_value=-3, max_value=5),
    st.sampled_from([0.0, 2.0, 2.5, float("nan"), 1e30]),
)
_SPAN_IDS = st.sampled_from([bytes.fromhex("00f067aa0ba902b7"), bytes.fromhex("00f067aa0ba902b8"), bytes(8), b"\x01"])
_TRACE_IDS = st.sampled_from([bytes.fromhex("5b8efff798038103d269b633813fc60c"), bytes(16), b"\x02" * 3])
_TIMES = st.sampled_from([0, 1_793_524_440_000_000_000, 1_793_524_440_123_456_789, 2**64 - 1])
_SPAN = st.fixed_dictionaries(
    {
        "attributes": st.dictionaries(st.sampled_from(_KEYS), _VALUES, max_size=8),
        "trace_id": _TRACE_IDS,
        "span_id": _SPAN_IDS,
        "parent": st.sampled_from([b"", bytes.fromhex("00f067aa0ba902b6")]),
        "start": _TIMES,
        "error": st.booleans(),
        "event": st.one_of(st.none(), st.dictionaries(st.sampled_from(_KEYS[:6]), _VALUES, max_size=3)),
        # Attributes no profile reads: past a few dozen, the reading asks for wanted keys instead of walking.
        "padding": st.sampled_from([0, 40]),
    }
)
_RESOURCE = st.dictionaries(
    st.sampled_from(("service.name", "service.instance.id", "host.name", "process.pid", *_KEYS[:4], "session.id")),
    _VALUES,
    max_size=3,
)
_REQUESTS = st.lists(st.tuples(_RESOURCE, st.lists(_SPAN, max_size=6)), min_size=1, max_size=3)


def _request(resources: list[tuple[dict[str, Any], list[dict[str, Any]]]]) -> ExportTraceServiceRequest:
    message = ExportTraceServiceRequest()
    for resource_attributes, spans in resources:
        resource_spans = message.resource_spans.add()
        add_attributes(resource_spans.resource.attributes, resource_attributes)
        scope = resource_spans.scope_spans.add()
        for spec in spans:
            span = scope.spans.add()
            span.name = "span"
            span.trace_id = spec["trace_id"]
            span.span_id = spec["span_id"]
            span.parent_span_id = spec["parent"]
            span.start_time_unix_nano = spec["start"]
            if spec["error"]:
                span.status.code = 2
            add_attributes(span.attributes, {f"app.noise.{n}": n for n in range(spec.get("padding", 0))})
            add_attributes(span.attributes, spec["attributes"])
            if spec["event"] is not None:
                event = span.events.add()
                event.name = "durable.action"
                event.time_unix_nano = 1_793_524_441_000_000_000
                add_attributes(event.attributes, spec["event"])
    return message


def _comparable(result: ConvertResult) -> Any:
    items = [
        (item, list(item.record.items()), item.links) if isinstance(item, Action) else (item,)
        for item in result.items
    ]
    return items, result.spans_total, result.spans_not_actions, result.resource_spans, len(result.actions)


_OPTIONS = st.builds(
    ConvertOptions,
    durable=st.booleans(),
    genai=st.booleans(),
    openinference=st.booleans(),
    openllmetry=st.booleans(),
    telemetry_is_log=st.booleans(),
    framework_approvals=st.booleans(),
    langgraph_checkpoints=st.booleans(),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(resources=_REQUESTS, options=_OPTIONS)
def test_the_one_pass_path_converts_as_the_general_path(
    resources: list[tuple[dict[str, Any], list[dict[str, Any]]]], options: ConvertOptions
) -> None:
    message = _request(resources)
    converter = SpanConverter(options)
    general = converter.convert(message, "wire", 3)
    mapped = converter.convert_serialized(message.SerializeToString(), "wire", 3)
    assert _comparable(mapped) == _comparable(general)


def test_usual_spans_take_the_one_pass_path() -> None:
    """Spans of the GenAI and durable shapes are converted without the general path."""
    message = _request(
        [
            (
                {"service.name": "agent"},
                [
                    {"attributes": {"gen_ai.operation.name": "chat", "gen_ai.conversation.id": "s-1"},
                     "trace_id": bytes.fromhex("5b8efff798038103d269b633813fc60c"),
                     "span_id": bytes.fromhex("00f067aa0ba902b7"), "parent": b"", "start": 1, "error": False,
                     "event": None},
                    {"attributes": {"durable.action.kind": "payment", "durable.retry.attempt": 2,
                                    "durable.session.id": "s-1"},
                     "trace_id": bytes.fromhex("5b8efff798038103d269b633813fc60c"),
                     "span_id": bytes.fromhex("00f067aa0ba902b8"), "parent": b"", "start": 1, "error": True,
                     "event": None},
                    {"attributes": {"http.request.method": "GET"},
                     "trace_id": bytes.fromhex("5b8efff798038103d269b633813fc60c"),
                     "span_id": bytes.fromhex("00f067aa0ba902b9"), "parent": b"", "start": 1, "error": False,
                     "event": None},
                ],
            )
        ]
    )
    result = SpanConverter().convert_serialized(message.SerializeToString(), "wire")
    assert result.spans_general == 0
    assert [a.record["kind"] for a in result.actions] == ["llm_call", "payment"]
    assert [a.record["status"] for a in result.actions] == ["ok", "error"]
    assert result.spans_not_actions == 1

    # A problem to tell (an attempt count that is text) is the general path's to say.
    problem = _request(
        [
            (
                {"service.name": "agent"},
                [
                    {"attributes": {"durable.action.kind": "payment", "durable.retry.attempt": "two",
                                    "durable.session.id": "s-1"},
                     "trace_id": bytes.fromhex("5b8efff798038103d269b633813fc60c"),
                     "span_id": bytes.fromhex("00f067aa0ba902ba"), "parent": b"", "start": 1, "error": False,
                     "event": None},
                ],
            )
        ]
    )
    assert SpanConverter().convert_serialized(problem.SerializeToString(), "wire").spans_general == 1
