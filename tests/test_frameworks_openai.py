"""Three real OpenAI instrumentations, offline against a local fake OpenAI server, into serve and replay.

Each test drives the real ``openai`` client, instrumented by the real library, against
tests.fake_openai; the SDK's OTLP/HTTP exporter sends the spans to a running serve while
a second span processor writes the same spans to an OTLP/JSON dump that ``replay`` reads.
The verdicts must be equal, and the sessions, kinds and tool-call ids must be what the
framework's spans mean.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Tracer

from processor import cli
from tests._spans import otlp_json_from_request
from tests.convert_parity import assert_convert_agrees_with_replay
from tests.fake_openai import FakeOpenAI, ToolCall, fake_openai
from tests.serve_support import keys_of, read_jsonl, running, serve_config, wait_for

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "refund_payment",
            "description": "Refund an order.",
            "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}},
        },
    }
]
CALLS = (ToolCall("call_refund_1", "refund_payment", {"order_id": "42"}),)


class DumpExporter(SpanExporter):
    """Writes each export as one OTLP/JSON line, as the Collector's file exporter does."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self.path.open("ab") as out:
            out.write(otlp_json_from_request(encode_spans(spans)) + b"\n")
        return SpanExportResult.SUCCESS


@contextmanager
def instrumented(
    tmp_path: Path,
    instrumentor: BaseInstrumentor,
    monkeypatch: pytest.MonkeyPatch,
    extra: dict[str, Any] | None = None,
) -> Iterator[tuple[TracerProvider, FakeOpenAI]]:
    """A serve on loopback, a fake OpenAI server, and an instrumented provider exporting to both serve and a dump."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-fake")
    config = serve_config(tmp_path, extra)
    with running(config) as server, fake_openai(CALLS, answer="refunded") as model:
        provider = TracerProvider(resource=Resource.create({"service.name": "shop-agent"}))
        exporter = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{server.http_port}/v1/traces")
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=50))
        provider.add_span_processor(SimpleSpanProcessor(DumpExporter(tmp_path / "dump.otlp.jsonl")))
        instrumentor.instrument(tracer_provider=provider)
        try:
            yield provider, model
        finally:
            instrumentor.uninstrument()
            provider.shutdown()


def replay_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    capsys.readouterr()
    cli.main(["replay", "--format", "json", str(tmp_path / "dump.otlp.jsonl")])
    report: dict[str, Any] = orjson.loads(capsys.readouterr().out)
    assert_convert_agrees_with_replay(tmp_path / "dump.otlp.jsonl")
    return report


def same_verdicts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """Replay's report of the dump, after checking serve found exactly the same violations."""
    report = replay_report(tmp_path, capsys)
    served = keys_of(read_jsonl(tmp_path / "violations.jsonl"))
    assert served, "the run should break some durability rule (a refund without an idempotency key)"
    assert served == keys_of(report["violations"])
    return report


def kinds_by_session(report: dict[str, Any]) -> dict[str, dict[str, int]]:
    return {s["session_id"]: s["actions_by_kind"] for s in report["sessions"]}


def agent_turn(client: openai.OpenAI, prompt: str, run_tool: Callable[[Any], str]) -> None:
    """One agent run: ask, run the tool the model asks for, answer with its result."""
    messages: list[Any] = [{"role": "user", "content": prompt}]
    first = client.chat.completions.create(model="gpt-fake", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
    reply = first.choices[0].message
    messages.append(reply.model_dump(exclude_none=True))
    for call in reply.tool_calls or ():
        messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call)})
    client.chat.completions.create(model="gpt-fake", messages=messages, tools=TOOLS)  # type: ignore[arg-type]


# -- openai-v2 (OpenTelemetry contrib) with opentelemetry-util-genai ---------------------------


def v2_conversation(provider: TracerProvider, model: FakeOpenAI) -> None:
    """Two agent runs of one conversation through util-genai's handler: two traces."""
    from opentelemetry.util.genai.handler import TelemetryHandler

    handler = TelemetryHandler(tracer_provider=provider)
    client = openai.OpenAI(base_url=model.base_url)

    def run_tool(call: Any) -> str:
        with handler.tool(call.function.name, tool_call_id=call.id):
            return "refunded"

    # util-genai puts the conversation id on the invoke_agent span only.
    for prompt in ("refund order 42", "and tell me when it is done"):
        with handler.invoke_local_agent("openai", request_model="gpt-fake") as agent:
            agent.agent_name = "refunds"
            agent.conversation_id = "conv-v2"
            agent_turn(client, prompt, run_tool)


def test_openai_v2_conversation_over_two_traces_is_one_session(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor

    monkeypatch.setenv("OTEL_SEMCONV_STABILITY_OPT_IN", "gen_ai_latest_experimental")
    monkeypatch.setenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "span_only")
    with instrumented(tmp_path, OpenAIInstrumentor(), monkeypatch) as (provider, model):
        v2_conversation(provider, model)
    report = same_verdicts(tmp_path, capsys)

    assert list(kinds_by_session(report)) == ["conv-v2"]
    assert kinds_by_session(report)["conv-v2"] == {"llm_call": 4, "payment": 2}
    assert {v["session_id"] for v in report["violations"]} == {"conv-v2"}
    # The tool spans carry the model's own call id.
    assert {v["action_id"] for v in report["violations"] if v["kind"] == "payment"} == {"call_refund_1"}


def test_openai_v2_on_the_durable_store_while_serving_finds_what_replay_finds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite state: nothing is evaluated at shutdown, so the verdicts must come out while serving."""
    from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor

    extra = {"state": {"backend": "sqlite"}, "evaluate": {"allowed_lateness": "1s"}}
    with instrumented(tmp_path, OpenAIInstrumentor(), monkeypatch, extra) as (provider, model):
        v2_conversation(provider, model)
        provider.force_flush()
        expected = keys_of(replay_report(tmp_path, capsys)["violations"])
        assert expected and {session for _, session, _ in expected} == {"conv-v2"}
        assert wait_for(lambda: keys_of(read_jsonl(tmp_path / "violations.jsonl")) == expected, timeout_s=30.0)


# -- OpenInference openai --------------------------------------------------------------------


def test_openinference_openai_tool_spans_get_the_llm_spans_call_ids(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from openinference.instrumentation.openai import OpenAIInstrumentor

    with instrumented(tmp_path, OpenAIInstrumentor(), monkeypatch) as (provider, model):
        tracer = provider.get_tracer("shop-agent")
        client = openai.OpenAI(base_url=model.base_url)

        def run_tool(call: Any) -> str:
            # As the Agents SDK's OpenInference spans do: a TOOL span without tool_call.id.
            with tracer.start_as_current_span(call.function.name) as span:
                span.set_attribute("openinference.span.kind", "TOOL")
                span.set_attribute("tool.name", call.function.name)
                span.set_attribute("output.value", "refunded")
            return "refunded"

        # The session is named on the agent span only; its LLM and TOOL children name none.
        with _agent_span(tracer, {"openinference.span.kind": "AGENT", "session.id": "conv-oi"}):
            agent_turn(client, "refund order 42", run_tool)
    report = same_verdicts(tmp_path, capsys)

    assert kinds_by_session(report) == {"conv-oi": {"llm_call": 2, "payment": 1}}
    payments = [v for v in report["violations"] if v["kind"] == "payment"]
    assert payments and {v["action_id"] for v in payments} == {"call_refund_1"}
    assert all(not v.get("synthetic_action_id", False) for v in payments)


# -- OpenLLMetry (Traceloop) openai ----------------------------------------------------------


def test_openllmetry_openai_genai_names_and_association_properties(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from opentelemetry.instrumentation.openai import OpenAIInstrumentor

    monkeypatch.setenv("TRACELOOP_TRACE_CONTENT", "true")
    with instrumented(tmp_path, OpenAIInstrumentor(), monkeypatch) as (provider, model):
        tracer = provider.get_tracer("shop-agent")
        client = openai.OpenAI(base_url=model.base_url)
        session = {"traceloop.association.properties.session_id": "conv-tl"}

        def run_tool(call: Any) -> str:
            # What traceloop-sdk's @tool gives: a tool span with the association properties.
            attributes = {
                "traceloop.span.kind": "tool",
                "traceloop.entity.name": call.function.name,
                "traceloop.entity.output": "refunded",
                **session,
            }
            with _agent_span(tracer, attributes, name=f"{call.function.name}.tool"):
                return "refunded"

        # And @workflow: the workflow span names the session; the model calls inside name none.
        with _agent_span(tracer, {"traceloop.span.kind": "workflow", **session}, name="refunds.workflow"):
            agent_turn(client, "refund order 42", run_tool)
    report = same_verdicts(tmp_path, capsys)

    # Current OpenLLMetry sets no llm.request.type: its model calls are read by their GenAI names.
    assert kinds_by_session(report) == {"conv-tl": {"llm_call": 2, "payment": 1}}
    assert {v["session_id"] for v in report["violations"]} == {"conv-tl"}


@contextmanager
def _agent_span(tracer: Tracer, attributes: dict[str, Any], name: str = "agent run") -> Iterator[None]:
    with tracer.start_as_current_span(name) as span:
        for key, value in attributes.items():
            span.set_attribute(key, value)
        yield


def test_fake_server_hands_out_the_scripted_tool_calls_once_per_user_turn() -> None:
    with fake_openai(CALLS, answer="refunded") as model:
        client = openai.OpenAI(base_url=model.base_url, api_key="sk-fake")
        seen: list[str] = []
        agent_turn(client, "refund order 42", lambda call: seen.append(call.id) or "ok")
    assert seen == ["call_refund_1"]
    # Asked for the tool on the user's turn, answered in text once the tool result came back.
    assert [r["messages"][-1]["role"] for r in model.requests] == ["user", "tool"]
    assert model.reply(model.requests[1])["choices"][0]["message"]["content"] == "refunded"
