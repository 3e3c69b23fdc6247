"""SpanConverter: OTLP spans -> action records, per the durable.* convention and the profiles."""

from __future__ import annotations

import random
from typing import Any

import orjson
import pytest
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1 import trace_pb2

from processor.convert import (
    DEFAULT_TOOL_KINDS,
    ConvertOptions,
    SpanConverter,
    ToolKindRule,
    decode_traces,
    format_rfc3339,
    parse_rfc3339,
)
from processor.convert.profiles import DURABLE_ATTRIBUTES
from processor.records import Action, Malformed, validate_record
from tests._spans import TESTDATA, TRACE_A, TRACE_B, SpanSpec, check_golden, reference_request, request

CONVERT = TESTDATA / "convert"
PROFILES = ("durable", "genai", "openinference", "openllmetry")


def _fixture(name: str) -> bytes:
    return (CONVERT / f"{name}.otlp.json").read_bytes()


def _convert_json(document: bytes, options: ConvertOptions | None = None) -> list[Action | Malformed]:
    traces, problems = decode_traces(orjson.loads(document))
    assert problems == []
    result = SpanConverter(options).convert(traces, "fixture")
    return result.items


def _one(spans: list[SpanSpec], resource: dict[str, Any] | None = None, **options: Any) -> Action | Malformed:
    result = SpanConverter(ConvertOptions(**options)).convert(request((resource or {}, spans)), "test")
    items = result.items
    assert len(items) == 1, items
    return items[0]


def _action(spans: list[SpanSpec], resource: dict[str, Any] | None = None, **options: Any) -> Action:
    item = _one(spans, resource, **options)
    assert isinstance(item, Action), item
    return item


@pytest.mark.parametrize("profile", PROFILES)
def test_profile_golden(profile: str) -> None:
    items = _convert_json(_fixture(profile))
    check_golden(CONVERT / f"{profile}.golden.jsonl", items)
    for item in items:
        if isinstance(item, Action):
            assert validate_record(item.record) == []


@pytest.mark.parametrize("profile", PROFILES)
def test_json_and_protobuf_give_the_same_actions(profile: str) -> None:
    """Our OTLP/JSON decoder and protobuf's reference parser feed the converter the same spans."""
    from_json = _convert_json(_fixture(profile))
    proto = reference_request(_fixture(profile))
    wire = type(proto).FromString(proto.SerializeToString())
    result = SpanConverter().convert(wire, "fixture")
    assert result.items == from_json


def test_counts_of_spans_and_non_actions() -> None:
    traces, _ = decode_traces(orjson.loads(_fixture("genai")))
    result = SpanConverter().convert(traces)
    names = [span.name for rs in traces.resource_spans for ss in rs.scope_spans for span in ss.spans]
    assert result.spans_total == len(names)
    # invoke_agent, an unknown operation, create_agent and invoke_workflow are not actions.
    assert result.spans_not_actions == 4
    assert len(result.actions) == result.spans_total - result.spans_not_actions


def test_telemetry_is_log_counts_model_replies() -> None:
    plain = {
        item.record["span_id"]: item.record
        for item in _convert_json(_fixture("genai")) + _convert_json(_fixture("openinference"))
        if isinstance(item, Action)
    }
    options = ConvertOptions(telemetry_is_log=True)
    as_log = {
        item.record["span_id"]: item.record
        for item in _convert_json(_fixture("genai"), options) + _convert_json(_fixture("openinference"), options)
        if isinstance(item, Action)
    }
    gained = {span_id for span_id in as_log if "result" in as_log[span_id] and "result" not in plain[span_id]}
    # The GenAI chat span (gen_ai.output.messages), the OpenInference LLM span with flattened
    # llm.output_messages.N.* keys, and the one with output.value; nothing else changes.
    assert {plain[s]["kind"] for s in gained} == {"llm_call"}
    assert len(gained) == 3
    llm_without_output = [r for r in as_log.values() if r["kind"] == "llm_call" and "result" not in r]
    assert llm_without_output, "spans without a captured reply stay unrecorded"


def test_durable_wins_field_by_field_over_genai() -> None:
    action = _action(
        [
            SpanSpec(
                "execute_tool search_flights",
                {
                    "gen_ai.operation.name": "execute_tool",
                    "gen_ai.tool.name": "search_flights",
                    "gen_ai.tool.call.id": "call_9",
                    "gen_ai.tool.call.result": "payload that must not be copied",
                    "gen_ai.conversation.id": "conv-1",
                    "durable.action.kind": "payment",
                    "durable.result.recorded": False,
                    "durable.idempotency_key": "pay-1",
                },
            )
        ]
    )
    record = action.record
    assert record["kind"] == "payment"  # durable kind beats the tool-name classification
    assert record["action_id"] == "call_9"  # no durable.action.id: the GenAI call id fills it
    assert record["session_id"] == "conv-1"
    assert "result" not in record  # durable.result.recorded false beats the tool result
    assert record["idempotency_key"] == "pay-1"
    assert "payload" not in orjson.dumps(record).decode()


def test_tool_result_presence_is_recorded_without_payload() -> None:
    action = _action(
        [
            SpanSpec(
                "execute_tool run_report",
                {
                    "gen_ai.operation.name": "execute_tool",
                    "gen_ai.tool.name": "run_report",
                    "gen_ai.tool.call.result": "ACCOUNT-NUMBER-42",
                },
            )
        ]
    )
    assert action.record["kind"] == "tool_call"
    assert "result" in action.record and action.record["result"] is None
    assert "ACCOUNT-NUMBER-42" not in orjson.dumps(action.record).decode()


def _wrong_value(value_type: str) -> Any:
    return {"str": 7, "int": "SECRET-7", "number": "SECRET-7", "bool": "SECRET-yes", "str|int": True}[value_type]


@pytest.mark.parametrize("attribute", DURABLE_ATTRIBUTES, ids=lambda a: a.key)
def test_attribute_of_the_wrong_type_is_malformed(attribute: Any) -> None:
    attributes = {"durable.action.kind": "tool_call", attribute.key: _wrong_value(attribute.type)}
    item = _one([SpanSpec("step one", attributes, span_id="1111111111111111")])
    assert isinstance(item, Malformed)
    assert item.source == "span"
    assert item.trace_id == TRACE_A and item.span_id == "1111111111111111"
    assert '"step one"' in item.message and TRACE_A in item.message and "1111111111111111" in item.message
    assert attribute.key in item.message
    assert "must be" in item.message and "got" in item.message
    assert "SECRET" not in item.message


def test_whole_doubles_are_integers_fractions_are_not() -> None:
    action = _action([SpanSpec("s", {"durable.action.kind": "tool_call", "durable.retry.max_attempts": 3.0})])
    assert action.record["max_attempts"] == 3 and isinstance(action.record["max_attempts"], int)
    item = _one([SpanSpec("s", {"durable.action.kind": "tool_call", "durable.retry.max_attempts": 2.5})])
    assert isinstance(item, Malformed) and "durable.retry.max_attempts must be an integer, got a double" in item.message
    timeout = _action([SpanSpec("s", {"durable.action.kind": "approval", "durable.wait.timeout_s": 30})])
    assert timeout.record["wait_timeout_s"] == 30


@pytest.mark.parametrize(
    ("attributes", "resource", "expected"),
    [
        ({"durable.session.id": "d", "gen_ai.conversation.id": "g"}, {"durable.session.id": "r"}, "d"),
        ({"gen_ai.conversation.id": "g", "session.id": "o"}, {"durable.session.id": "r"}, "r"),
        ({"gen_ai.conversation.id": "g", "session.id": "o"}, {}, "g"),
        ({"gen_ai.conversation.id": "", "session.id": "o"}, {}, "o"),
        ({"traceloop.association.properties.session_id": "t", "session.id": "o"}, {}, "o"),
        ({"traceloop.association.properties.session_id": "t"}, {}, "t"),
        ({}, {"session.id": "resource-level"}, "resource-level"),
        ({}, {}, TRACE_A),
    ],
)
def test_session_fallback_order(attributes: dict[str, Any], resource: dict[str, Any], expected: str) -> None:
    action = _action([SpanSpec("s", {"durable.action.kind": "tool_call", **attributes})], resource)
    assert action.record["session_id"] == expected


@pytest.mark.parametrize(
    ("attributes", "expected", "synthetic"),
    [
        ({"durable.action.id": "d", "gen_ai.tool.call.id": "g", "tool_call.id": "o"}, "d", False),
        ({"gen_ai.tool.call.id": "g", "tool_call.id": "o", "tool.id": "t"}, "g", False),
        ({"tool_call.id": "o", "tool.id": "t"}, "o", False),
        ({"tool.id": "t"}, "t", False),
        ({"durable.action.id": ""}, "span-00f067aa0ba902b7", True),
        ({}, "span-00f067aa0ba902b7", True),
    ],
)
def test_action_id_fallback_order(attributes: dict[str, Any], expected: str, synthetic: bool) -> None:
    action = _action([SpanSpec("s", {"durable.action.kind": "tool_call", **attributes})])
    assert action.record["action_id"] == expected
    assert action.synthetic_action_id is synthetic


def test_status_from_durable_attribute_else_span_status() -> None:
    assert _action([SpanSpec("s", {"durable.action.kind": "write"}, error=True)]).record["status"] == "error"
    assert _action([SpanSpec("s", {"durable.action.kind": "write"})]).record["status"] == "ok"
    overridden = _action([SpanSpec("s", {"durable.action.kind": "write", "durable.action.status": "ok"}, error=True)])
    assert overridden.record["status"] == "ok"


def test_provenance_and_delivery_key() -> None:
    start = 1_793_524_440_123_456_789
    action = _action(
        [SpanSpec("s", {"durable.action.kind": "write"}, trace_id=TRACE_B, span_id="abcdef0123456789", start_ns=start)],
        {"service.name": "agent", "host.name": "node-1", "process.pid": 31},
    )
    record = action.record
    assert record["time"] == "2026-11-01T09:14:00.123456789Z"
    assert action.time_ns == start
    assert (record["trace_id"], record["span_id"]) == (TRACE_B, "abcdef0123456789")
    assert record["service"] == "agent"
    assert record["instance"] == "node-1:31"
    assert action.delivery_key == (TRACE_B, "abcdef0123456789", 0)
    assert action.source == "span"
    with_instance_id = _action(
        [SpanSpec("s", {"durable.action.kind": "write"})],
        {"service.instance.id": "pod-a", "host.name": "node-1", "process.pid": 31},
    )
    assert with_instance_id.record["instance"] == "pod-a"


def test_durable_action_events_are_records_of_their_own() -> None:
    result = SpanConverter().convert(
        request(
            (
                {"durable.session.id": "s-1", "service.name": "agent"},
                [
                    SpanSpec(
                        "long-running loop",
                        {"gen_ai.operation.name": "invoke_agent"},
                        span_id="2222222222222222",
                        events=[
                            ("log", 5, {}),
                            ("durable.action", 1_793_524_441_000_000_000, {"durable.action.kind": "checkpoint"}),
                            ("durable.action", 0, {"durable.action.kind": "write", "durable.action.id": "w1"}),
                        ],
                    )
                ],
            )
        )
    )
    assert result.rejected == []
    first, second = result.actions
    assert first.delivery_key == (TRACE_A, "2222222222222222", 2)
    assert first.record["action_id"] == "span-2222222222222222-2" and first.synthetic_action_id
    assert first.record["time"] == "2026-11-01T09:14:01Z"
    assert first.record["session_id"] == "s-1"
    assert second.delivery_key == (TRACE_A, "2222222222222222", 3)
    assert second.record["action_id"] == "w1" and not second.synthetic_action_id
    assert second.time_ns == 1_793_524_440_000_000_000  # no event time: the span's start
    assert result.spans_not_actions == 0


def test_events_rely_on_the_span_session() -> None:
    spans = [
        SpanSpec(
            "loop",
            {"durable.session.id": 12},
            events=[
                ("durable.action", 0, {"durable.action.kind": "checkpoint"}),
                ("durable.action", 0, {"durable.action.kind": "checkpoint", "durable.session.id": "own"}),
            ],
        )
    ]
    result = SpanConverter().convert(request(({}, spans)))
    (rejected,) = result.rejected
    assert "event 1" in rejected.message and "durable.session.id must be a string, got an integer" in rejected.message
    (action,) = result.actions
    assert action.record["session_id"] == "own" and action.delivery_key == (TRACE_A, "00f067aa0ba902b7", 2)


def test_resource_durable_attributes_are_defaults() -> None:
    result = SpanConverter().convert(
        request(
            (
                {"durable.session.id": "s-r", "durable.retry.max_attempts": 4, "durable.action.kind": "tool_call"},
                [
                    SpanSpec("a", {"durable.action.id": "x", "durable.retry.max_attempts": 2}),
                    SpanSpec("b", {"durable.action.id": "y", "durable.action.kind": "write"}),
                    SpanSpec("http", {"http.request.method": "GET"}),
                ],
            )
        )
    )
    first, second = (a.record for a in result.actions)
    assert (first["session_id"], first["kind"], first["max_attempts"]) == ("s-r", "tool_call", 2)
    assert (second["kind"], second["max_attempts"]) == ("write", 4)
    # Resource attributes fill actions; they do not turn every span into one.
    assert result.spans_not_actions == 1


def test_mistyped_resource_attribute_spoils_its_actions() -> None:
    item = _one([SpanSpec("a", {"durable.action.kind": "write"})], {"durable.cache.ttl_s": "SECRET"})
    assert isinstance(item, Malformed)
    assert "resource attribute durable.cache.ttl_s must be an integer, got a string" in item.message


def test_span_without_kind_but_with_durable_attributes_is_malformed() -> None:
    item = _one([SpanSpec("s", {"durable.idempotency_key": "k-1"})])
    assert isinstance(item, Malformed) and "no action kind" in item.message


def test_session_attribute_alone_is_not_an_action() -> None:
    result = SpanConverter().convert(request(({}, [SpanSpec("root", {"durable.session.id": "s-1"})])))
    assert (result.actions, result.rejected, result.spans_not_actions) == ([], [], 1)


@pytest.mark.parametrize(
    ("attributes", "kind"),
    [
        ({"gen_ai.operation.name": "chat"}, "llm_call"),
        ({"gen_ai.operation.name": "text_completion"}, "llm_call"),
        ({"gen_ai.operation.name": "generate_content"}, "llm_call"),
        ({"gen_ai.operation.name": "execute_tool"}, "tool_call"),
        ({"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "charge_card"}, "payment"),
        ({"gen_ai.operation.name": "retrieval"}, "external_read"),
        ({"gen_ai.operation.name": "search_memory"}, "external_read"),
        ({"gen_ai.operation.name": "create_memory"}, "write"),
        ({"gen_ai.operation.name": "delete_memory"}, "write"),
        ({"gen_ai.operation.name": "invoke_agent"}, None),
        ({"gen_ai.operation.name": "invoke_workflow"}, None),
        ({"gen_ai.operation.name": "create_agent"}, None),
        ({"openinference.span.kind": "LLM"}, "llm_call"),
        ({"openinference.span.kind": "TOOL", "tool.name": "send_email"}, "email"),
        ({"openinference.span.kind": "RETRIEVER"}, "external_read"),
        ({"openinference.span.kind": "AGENT"}, None),
        ({"openinference.span.kind": "CHAIN"}, None),
        ({"traceloop.span.kind": "task", "traceloop.entity.name": "notify_slack"}, "notify"),
        ({"traceloop.span.kind": "tool"}, "tool_call"),
        ({"traceloop.span.kind": "workflow"}, None),
        ({"llm.request.type": "completion"}, "llm_call"),
        ({"http.request.method": "POST", "db.system": "postgresql"}, None),
    ],
)
def test_profile_kinds(attributes: dict[str, Any], kind: str | None) -> None:
    result = SpanConverter().convert(request(({}, [SpanSpec("s", attributes)])))
    assert result.rejected == []
    if kind is None:
        assert (result.actions, result.spans_not_actions) == ([], 1)
    else:
        assert [a.record["kind"] for a in result.actions] == [kind]


def test_profiles_can_be_turned_off() -> None:
    spans = [
        SpanSpec("chat", {"gen_ai.operation.name": "chat"}, span_id="0000000000000001"),
        SpanSpec("llm", {"openinference.span.kind": "LLM"}, span_id="0000000000000002"),
        SpanSpec("task", {"traceloop.span.kind": "task"}, span_id="0000000000000003"),
        SpanSpec("d", {"durable.action.kind": "write"}, span_id="0000000000000004"),
    ]
    for flag, left_out in (
        ("genai", "0000000000000001"),
        ("openinference", "0000000000000002"),
        ("openllmetry", "0000000000000003"),
        ("durable", "0000000000000004"),
    ):
        switches: dict[str, Any] = {flag: False}
        options = ConvertOptions(**switches)
        result = SpanConverter(options).convert(request(({}, spans)))
        converted = {a.record["span_id"] for a in result.actions}
        assert left_out not in converted and len(converted) == 3, flag


def test_genai_precedes_openinference_when_both_are_present() -> None:
    action = _action([SpanSpec("s", {"gen_ai.operation.name": "chat", "openinference.span.kind": "TOOL"})])
    assert action.record["kind"] == "llm_call"
    # A container verdict is a verdict: the first profile that knows the span decides.
    spans = [SpanSpec("s", {"gen_ai.operation.name": "invoke_agent", "openinference.span.kind": "TOOL"})]
    result = SpanConverter().convert(request(({}, spans)))
    assert (result.actions, result.spans_not_actions) == ([], 1)
    # An operation GenAI does not know leaves the span to the next profile.
    action = _action([SpanSpec("s", {"gen_ai.operation.name": "evaluate", "openinference.span.kind": "TOOL"})])
    assert action.record["kind"] == "tool_call"


def test_custom_tool_kind_rules_first_match_wins() -> None:
    rules = (ToolKindRule("book_*", "payment"), ToolKindRule("*", "external_read"))
    spans = [SpanSpec("t", {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "Book_Seat"})]
    assert _action(spans, tool_kinds=rules).record["kind"] == "payment"
    spans = [SpanSpec("t", {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "charge_card"})]
    assert _action(spans, tool_kinds=rules).record["kind"] == "external_read"
    assert _action(spans, tool_kinds=()).record["kind"] == "tool_call"


def test_ten_thousand_attributes_convert_like_the_few_that_matter() -> None:
    wanted = {"durable.action.kind": "write", "durable.idempotency_key": "k", "gen_ai.conversation.id": "c"}
    noise = {f"app.attribute.{i}": f"value-{i}" for i in range(10_000)}
    big = _action([SpanSpec("s", {**noise, **wanted})])
    small = _action([SpanSpec("s", wanted)])
    assert big.record == small.record


def test_long_span_names_are_cut_in_messages() -> None:
    item = _one([SpanSpec("n" * 5000, {"durable.action.kind": 5})])
    assert isinstance(item, Malformed)
    assert len(item.message) < 400 and "durable.action.kind must be a string, got an integer" in item.message


def test_invalid_ids_are_malformed() -> None:
    traces = trace_pb2.TracesData()
    span = traces.resource_spans.add().scope_spans.add().spans.add()
    span.name = "bad ids"
    span.trace_id = b"\x00" * 16
    span.span_id = b"\x01\x02"
    kv = span.attributes.add()
    kv.key = "durable.action.kind"
    kv.value.string_value = "write"
    result = SpanConverter().convert(traces, "test")
    assert result.actions == []
    (item,) = result.rejected
    assert "trace id must be 16 bytes, not all zero" in item.message
    assert "span id must be 8 bytes, not all zero (got 2 bytes)" in item.message


def test_seq_numbers_continue_from_seq_start() -> None:
    spans = [SpanSpec(f"s{i}", {"durable.action.kind": "write"}, span_id=f"{i + 1:016x}") for i in range(3)]
    spans.insert(1, SpanSpec("bad", {"durable.action.kind": True}, span_id="00000000000000ff"))
    result = SpanConverter().convert(request(({}, spans)), seq_start=40)
    assert [a.seq for a in result.actions] == [40, 41, 42]
    assert len(result.rejected) == 1


def test_options_validate_names_each_problem() -> None:
    assert ConvertOptions().validate("convert") == []
    problems = ConvertOptions(
        tool_kinds=(
            ToolKindRule(" ", "write"),
            ToolKindRule("pay_[", "payment"),
            ToolKindRule("*x*", "shopping"),
            ToolKindRule("*X*", "write"),
        ),
    ).validate("convert")
    assert [(p.where, p.message.split(";")[0]) for p in problems] == [
        ("convert.tool_kinds[0].pattern", "empty pattern"),
        ("convert.tool_kinds[1].pattern", "'[' without a closing ']'"),
        ("convert.tool_kinds[2].kind", "unknown kind"),
        ("convert.tool_kinds[3].pattern", "same pattern as tool_kinds[2], which matches first"),
    ]
    off = ConvertOptions(durable=False, genai=False, openinference=False, openllmetry=False).validate("c")
    assert [p.where for p in off] == ["c"]


def test_default_tool_kinds_are_valid_and_documented() -> None:
    assert ConvertOptions(tool_kinds=DEFAULT_TOOL_KINDS).validate("x") == []
    docs = (TESTDATA.parent.parent / "docs" / "conventions.md").read_text(encoding="utf-8")
    for rule in DEFAULT_TOOL_KINDS:
        assert f"`{rule.pattern}`" in docs, rule.pattern


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2026-11-01T09:14:00Z", 1_793_524_440_000_000_000),
        ("2026-11-01t09:14:00.5z", 1_793_524_440_500_000_000),
        ("2026-11-01T10:14:00.123456789+01:00", 1_793_524_440_123_456_789),
        ("2026-11-01 09:14:00.1234567891-00:00", 1_793_524_440_123_456_789),
        ("2026-11-01", None),
        ("2026-02-30T00:00:00Z", None),
        ("2026-11-01T09:14:00", None),
        ("yesterday", None),
    ],
)
def test_parse_rfc3339(text: str, expected: int | None) -> None:
    assert parse_rfc3339(text) == expected


def test_format_rfc3339_round_trips() -> None:
    for time_ns in (0, 1_793_524_440_000_000_000, 1_793_524_440_100_000_000, 1_793_524_440_000_000_001):
        assert parse_rfc3339(format_rfc3339(time_ns)) == time_ns
    assert format_rfc3339(1_793_524_440_100_000_000) == "2026-11-01T09:14:00.1Z"


# -- convert_serialized: the mapped reading must answer as the official parser ------------------


def _both_readings(data: bytes, options: ConvertOptions | None = None) -> tuple[Any, Any]:
    """(convert of the official parse, convert_serialized) of the same bytes, as comparable tuples."""
    converter = SpanConverter(options)
    official = converter.convert(ExportTraceServiceRequest.FromString(data), "wire", 7)
    mapped = converter.convert_serialized(data, "wire", 7)

    def summary(result: Any) -> Any:
        return (result.items, result.spans_total, result.spans_not_actions, result.resource_spans)

    return summary(official), summary(mapped)


def _fixture_wire(name: str) -> bytes:
    return bytes(reference_request(_fixture(name)).SerializeToString())


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("telemetry_is_log", [False, True])
def test_serialized_requests_convert_as_parsed_ones(profile: str, telemetry_is_log: bool) -> None:
    official, mapped = _both_readings(_fixture_wire(profile), ConvertOptions(telemetry_is_log=telemetry_is_log))
    assert official[0], "the fixture converts to something"
    assert mapped == official


def test_a_repeated_attribute_key_keeps_its_last_value_in_both_readings() -> None:
    message = request(({}, [SpanSpec("pay", {"durable.action.kind": "write", "durable.action.id": "a1"})]))
    span = message.resource_spans[0].scope_spans[0].spans[0]
    again = span.attributes.add()
    again.key = "durable.action.kind"
    again.value.string_value = "payment"
    official, mapped = _both_readings(message.SerializeToString())
    assert mapped == official
    item = official[0][0]
    assert isinstance(item, Action) and item.record["kind"] == "payment"


@pytest.mark.parametrize("reverse", [False, True])
def test_several_problems_of_a_span_are_told_in_attribute_order(reverse: bool) -> None:
    attributes: dict[str, Any] = {"durable.action.kind": "write", "durable.retry.attempt": "two"}
    attributes["durable.session.id"] = 5.5
    if reverse:
        attributes = dict(reversed(attributes.items()))
    data = request(({}, [SpanSpec("w", attributes)])).SerializeToString()
    official, mapped = _both_readings(data)
    assert mapped == official
    item = official[0][0]
    assert isinstance(item, Malformed)
    positions = [item.message.index(key) for key in attributes if key != "durable.action.kind"]
    assert positions == sorted(positions)


def test_a_key_value_with_a_field_of_its_own_is_not_lost() -> None:
    """A KeyValue carrying a field OTLP does not define: the official reading keeps the attribute."""
    message = request(({}, [SpanSpec("w", {"durable.action.id": "a1"})]))
    entry = b"\n\x13durable.action.kind\x12\x07\n\x05write"
    # Field 9, varint 1: unknown to KeyValue, kept by the parser that reads it.
    message.resource_spans[0].scope_spans[0].spans[0].attributes.add().MergeFromString(entry + b"\x48\x01")
    data = message.SerializeToString()
    assert entry + b"\x48\x01" in data
    official, mapped = _both_readings(data)
    assert mapped == official
    item = official[0][0]
    assert isinstance(item, Action) and item.record["kind"] == "write"


def test_serialized_garbage_raises_as_the_official_parser_does() -> None:
    """Seeded mutations of real requests: the same DecodeError, or the same items."""
    rng = random.Random(20261129)
    seeds = [_fixture_wire(profile) for profile in PROFILES]
    compared = 0
    for _ in range(1500):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(data))
            if rng.random() < 0.6:
                data[at] = rng.randrange(256)
            else:
                del data[at : at + rng.randint(1, 6)]
        try:
            ExportTraceServiceRequest.FromString(bytes(data))
        except DecodeError:
            with pytest.raises(DecodeError):
                SpanConverter().convert_serialized(bytes(data))
            continue
        official, mapped = _both_readings(bytes(data))
        assert mapped == official
        compared += 1
    assert compared > 50, "too few mutations parsed to compare anything"


def test_spans_with_and_without_durable_action_events_convert_alike() -> None:
    # "durable.action.id" holds the event name's bytes followed by "."; a real event does not.
    keyed = SpanSpec("k", {"durable.action.kind": "write", "durable.action.id": "a1"})
    evented = SpanSpec(
        "e",
        {"durable.session.id": "s1"},
        span_id="00f067aa0ba902b8",
        events=[("durable.action", 1_793_524_441_000_000_000, {"durable.action.kind": "checkpoint"})],
    )
    for spans in ([keyed], [keyed, evented]):
        official, mapped = _both_readings(request(({}, spans)).SerializeToString())
        assert mapped == official
    assert [type(item) for item in official[0]] == [Action, Action]


def test_the_cached_timestamp_path_agrees_with_the_general_parser() -> None:
    """parse_rfc3339 answers common UTC forms from a per-second cache; mutations probe its edges."""
    from processor.convert.timefmt import _parse

    rng = random.Random(3339)
    samples = [
        "2026-11-02T09:14:00Z",
        "2026-11-02T09:14:00.5Z",
        "2026-11-02T09:14:00.123456789123Z",
        "2026-11-02t09:14:00z",
        "2026-11-02 09:14:00.000000000Z",
        "2026-02-30T09:14:00Z",
        "2026-11-02T09:14:60Z",
        "2026-11-02T09:14:00+01:00",
        "\u0662\u0660\u0662\u0666-11-02T09:14:00Z",
        "2026-11-02T09:14:00.\u0665Z",
        "2026-11-02T09:14:00.\u00b2Z",
    ]
    alphabet = "0123456789-:T.Zz+ t\u0665\u00b2\n"
    for _ in range(20_000):
        chars = list(rng.choice(samples))
        for _ in range(rng.randint(0, 3)):
            at = rng.randrange(len(chars) + 1)
            if rng.random() < 0.5 and at < len(chars):
                chars[at] = rng.choice(alphabet)
            elif rng.random() < 0.5:
                chars.insert(at, rng.choice(alphabet))
            elif at < len(chars):
                del chars[at]
        text = "".join(chars)
        assert parse_rfc3339(text) == _parse(text), text
        assert parse_rfc3339(text) == _parse(text), text  # the second answer comes from the cache
