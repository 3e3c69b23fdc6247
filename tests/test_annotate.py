"""durable_check.annotate through the real OpenTelemetry SDK and the real converter."""

from __future__ import annotations

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from durable_check import annotate
from processor.convert.spans import SpanConverter
from processor.evaluate.engine import Engine, EngineOptions
from tests._engine_util import shipped


@pytest.fixture
def traced() -> tuple[TracerProvider, InMemorySpanExporter]:
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    return provider, memory


def records(memory: InMemorySpanExporter) -> list[dict[str, object]]:
    result = SpanConverter().convert(encode_spans(memory.get_finished_spans()), "test")
    assert result.rejected == []
    return [a.record for a in result.actions]


def test_current_span_setters_fill_the_record(traced: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    provider, memory = traced
    with provider.get_tracer("t").start_as_current_span("charge"):
        annotate.set_session("s1")
        annotate.set_action("payment", action_id="pay-1", result_ref="ledger/7", input_fingerprint="fp")
        annotate.set_idempotency_key("s1-pay-1")
        annotate.set_retry(attempt=2, max_attempts=3)
        annotate.set_on_failure("compensate")
        annotate.set_plan(4, state="executing")
    [record] = records(memory)
    expected = {
        "session_id": "s1", "action_id": "pay-1", "kind": "payment", "status": "ok", "result_ref": "ledger/7",
        "idempotency_key": "s1-pay-1", "retryable": True, "max_attempts": 3, "attempts": 2,
        "on_failure": "compensate", "workflow_state": "executing", "plan_version": 4, "input_fingerprint": "fp",
    }
    assert {k: record[k] for k in expected} == expected


def test_wait_decision_checkpoint_are_actions_the_rules_read(
    traced: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, memory = traced
    annotate.awaiting_approval("send_email", "c1", timeout_s=600, session_id="s2", tracer_provider=provider)
    annotate.approval_decision("c1", "denied", tool="send_email", session_id="s2", tracer_provider=provider)
    with annotate.action("send", "email", action_id="mail-1", session_id="s2", idempotency_key="k1",
                         plan_version="c1", tracer_provider=provider):
        pass
    annotate.checkpoint("ck-1", session_id="s2", tracer_provider=provider)
    found = records(memory)
    assert [(r["action_id"], r["kind"]) for r in found] == [
        ("approval:send_email:c1", "approval"), ("approval:send_email:c1:decision", "approval"),
        ("mail-1", "email"), ("ck-1", "checkpoint"),
    ]
    assert found[0]["workflow_state"] == "awaiting_approval" and found[0]["wait_timeout_s"] == 600
    assert found[1]["approval_decision"] == "denied" and found[1]["plan_version"] == "c1"
    engine = Engine(shipped(), EngineOptions())
    from processor.convert.spans import SpanConverter as Converter

    actions = Converter().convert(encode_spans(memory.get_finished_spans()), "test").actions
    out = engine.submit_many(actions) + engine.finish()
    assert [(v.rule, v.action_id) for v in out] == [("DS109", "mail-1")]


def test_a_wait_without_deadline_is_reported(traced: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    provider, memory = traced
    annotate.waiting("webhook-1", timeout_s=None, session_id="s3", tracer_provider=provider)
    actions = SpanConverter().convert(encode_spans(memory.get_finished_spans()), "test").actions
    engine = Engine(shipped(), EngineOptions())
    assert [v.rule for v in engine.submit_many(actions) + engine.finish()] == ["DS106"]


@pytest.mark.parametrize(("call", "message"), [
    (lambda: annotate.set_session(""), "session_id must be a non-empty string"),
    (lambda: annotate.set_retry(attempt=0, max_attempts=3), "attempt must be an integer >= 1"),
    (lambda: annotate.waiting("w", timeout_s=float("nan")), "timeout_s must be a positive"),
    (lambda: annotate.approval_decision("c", "maybe"), "decision must be granted or denied"),  # type: ignore[arg-type]
    (lambda: annotate.set_on_failure("retry"), "on_failure must be"),  # type: ignore[arg-type]
])
def test_mistakes_fail_at_the_call(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()  # type: ignore[operator]
