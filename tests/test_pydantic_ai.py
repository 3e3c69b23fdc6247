"""A real pydantic-ai agent, run offline, traced, exported as OTLP and converted."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic_ai import Agent
from pydantic_ai.models.instrumented import InstrumentationSettings
from pydantic_ai.models.test import TestModel

from processor.convert import SpanConverter, decode_traces
from tests._spans import otlp_json_from_request


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    Agent.instrument_all(InstrumentationSettings(tracer_provider=provider))
    try:
        yield memory
    finally:
        Agent.instrument_all(False)
        provider.shutdown()


def _booking_agent() -> Agent[None, str]:
    agent: Agent[None, str] = Agent(TestModel(), name="booker")

    @agent.tool_plain
    def check_visa(country: str) -> str:
        return "visa not required"

    @agent.tool_plain
    def book_seat(seat: str) -> str:
        # The tool knows it moves money; the framework does not.
        trace.get_current_span().set_attribute("durable.action.kind", "payment")
        return "booked"

    @agent.tool_plain
    def search_flights(destination: str) -> str:
        return "3 quotes"

    return agent


def _request(memory: InMemorySpanExporter) -> ExportTraceServiceRequest:
    request = encode_spans(memory.get_finished_spans())
    return ExportTraceServiceRequest.FromString(request.SerializeToString())


def test_pydantic_ai_spans_become_actions(exporter: InMemorySpanExporter) -> None:
    agent = _booking_agent()
    agent.run_sync("Book me a seat to Kyoto", conversation_id="conv-1")
    agent.run_sync("And back again", conversation_id="conv-2")
    spans = exporter.get_finished_spans()
    names = [span.name for span in spans]
    assert names.count("invoke_agent booker") == 2

    result = SpanConverter().convert(_request(exporter), "pydantic-ai")
    assert result.rejected == []
    assert result.spans_total == len(spans)
    # Only the two invoke_agent roots are containers; every model call and tool call is an action.
    assert result.spans_not_actions == 2

    by_session: dict[str, list[dict[str, object]]] = {}
    for action in result.actions:
        by_session.setdefault(action.session_id, []).append(action.record)
    assert set(by_session) == {"conv-1", "conv-2"}

    for session, records in by_session.items():
        kinds = sorted(str(r["kind"]) for r in records)
        chats = [r for r in records if r["kind"] == "llm_call"]
        assert len(chats) == len([s for s in spans if s.name == "chat test"]) // 2, session
        # Telemetry is not the log by default: the model replies are not recorded results.
        assert all("result" not in r for r in chats)
        tools = {r["action_id"]: r for r in records if r["kind"] != "llm_call"}
        assert kinds.count("llm_call") == len(chats)
        assert tools["pyd_ai_tool_call_id__check_visa"]["kind"] == "tool_call"
        assert tools["pyd_ai_tool_call_id__book_seat"]["kind"] == "payment"
        assert tools["pyd_ai_tool_call_id__search_flights"]["kind"] == "external_read"
        for record in tools.values():
            assert "result" in record and record["result"] is None  # gen_ai.tool.call.result was present
            assert record["status"] == "ok"
            assert record["instance"] and record["service"] == "unknown_service:python"


def test_pydantic_ai_spans_convert_the_same_from_otlp_json(exporter: InMemorySpanExporter) -> None:
    import orjson

    _booking_agent().run_sync("Book me a seat", conversation_id="conv-json")
    proto = _request(exporter)
    from_proto = SpanConverter().convert(proto, "run")
    traces, problems = decode_traces(orjson.loads(otlp_json_from_request(proto)))
    assert problems == []
    from_json = SpanConverter().convert(traces, "run")
    assert from_json.items == from_proto.items
    assert len(from_proto.actions) >= 4


def test_a_tool_retry_gives_an_error_attempt(exporter: InMemorySpanExporter) -> None:
    from pydantic_ai import ModelRetry

    agent: Agent[None, str] = Agent(TestModel(), name="retrier")
    calls = {"n": 0}

    @agent.tool_plain(retries=2)
    def flaky_lookup(key: str) -> str:
        calls["n"] += 1
        if calls["n"] == 1:
            raise ModelRetry("try again")
        return "found"

    agent.run_sync("look it up", conversation_id="conv-retry")
    result = SpanConverter().convert(_request(exporter), "run")
    attempts = [a.record for a in result.actions if a.record["kind"] == "external_read"]
    assert [r["status"] for r in attempts] == ["error", "ok"]
    assert len({r["span_id"] for r in attempts}) == 2
