"""A small shop agent built with pydantic-ai's FunctionModel (no network), recorded as an OTLP/JSON dump."""

from __future__ import annotations

from pathlib import Path

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.models.instrumented import InstrumentationSettings

import durable_check
from tests._spans import otlp_json_from_request


def shop_agent(*, extra_charge: bool = False) -> Agent[None, str]:
    """Charges a card (a payment with no idempotency key: DS002); with ``extra_charge``, also a deposit."""
    calls = [ToolCallPart("charge_card", {"amount": 10})]
    if extra_charge:
        calls.append(ToolCallPart("charge_deposit", {"amount": 5}))

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        return ModelResponse(parts=list(calls) if len(messages) == 1 else [TextPart("done")])

    agent: Agent[None, str] = Agent(FunctionModel(model), name="shop")

    @agent.tool_plain
    def charge_card(amount: int) -> str:
        durable_check.set_action("payment")
        return "charged"

    @agent.tool_plain
    def charge_deposit(amount: int) -> str:
        durable_check.set_action("payment")
        return "held"

    return agent


def record_shop_run(path: Path, *, extra_charge: bool = False, session: str = "order-1") -> None:
    """Run the shop agent once and write its spans to ``path`` as OTLP/JSON (new trace and span ids each run)."""
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    Agent.instrument_all(InstrumentationSettings(tracer_provider=provider))
    try:
        shop_agent(extra_charge=extra_charge).run_sync("buy", conversation_id=session)
    finally:
        Agent.instrument_all(False)
        provider.shutdown()
    path.write_bytes(otlp_json_from_request(encode_spans(memory.get_finished_spans())) + b"\n")
