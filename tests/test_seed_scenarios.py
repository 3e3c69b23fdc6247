"""The five tests the state-and-durability seed demands, each a session built with the
OpenTelemetry SDK (durable.* attributes), encoded as OTLP, converted, and checked by the
engine with the shipped rule packs.

- crash between side effect and completion;
- retry after a transient failure;
- denied approval;
- a workflow resumed after a delay (clean when replayed, DS101 when the human is re-asked);
- duplicate event delivery.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Status, StatusCode

from processor.convert.options import ConvertOptions
from processor.convert.spans import SpanConverter
from processor.evaluate.engine import Engine, EngineOptions
from processor.evaluate.model import RuleSet
from processor.records import Action
from processor.violations import Violation
from tests._engine_util import T0, S, shipped

SESSION = "trip-2291"


class Agent:
    """One process of the agent: its own resource (service.instance.id) and tracer."""

    def __init__(self, instance: str) -> None:
        self.exporter = InMemorySpanExporter()
        provider = TracerProvider(resource=Resource.create({"service.name": "travel-agent",
                                                            "service.instance.id": instance}))
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracer = provider.get_tracer("seed-scenarios")

    def action(self, at_s: float, name: str, action_id: str, kind: str, *, error: bool = False,
               **attributes: Any) -> None:
        start = T0 + round(at_s * S)
        span = self.tracer.start_span(name, start_time=start)
        span.set_attributes({"durable.session.id": SESSION, "durable.action.id": action_id,
                             "durable.action.kind": kind, **attributes})
        if error:
            span.set_status(Status(StatusCode.ERROR))
        span.end(end_time=start + 200_000_000)

    def actions(self) -> list[Action]:
        request = encode_spans(self.exporter.get_finished_spans())
        result = SpanConverter(ConvertOptions()).convert(request, origin="otlp")
        assert result.rejected == []
        return result.actions


def check(packs: RuleSet, actions: Sequence[Action]) -> tuple[list[Violation], Engine]:
    engine = Engine(packs, EngineOptions())
    out = engine.submit_many(actions)
    out += engine.finish()
    return out, engine


def rules_of(violations: Sequence[Violation]) -> list[tuple[str, str, str]]:
    """(rule, action id, span id of the reported record) for each violation, sorted."""
    return sorted((v.rule, v.action_id, v.span_id) for v in violations)


def span_of(actions: Sequence[Action], action_id: str, instance: str) -> str:
    matches = [a for a in actions if a.record["action_id"] == action_id and a.record.get("instance") == instance]
    assert len(matches) == 1
    return str(matches[0].record["span_id"])


@pytest.fixture(scope="module")
def packs() -> RuleSet:
    return shipped()


RECORDED: Mapping[str, Any] = {"durable.result.recorded": True}


@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "unkeyed"])
def test_crash_between_side_effect_and_completion(packs: RuleSet, keyed: bool) -> None:
    key = {"durable.idempotency_key": "trip-2291-deposit"} if keyed else {}
    before = Agent("pod-a")
    before.action(0, "ask traveller", "ask-budget", "user_prompt", **RECORDED)
    before.action(5, "charge card", "pay-deposit", "payment", **key)
    # The process dies before it checkpoints the payment. A new instance recovers:
    after = Agent("pod-b")
    after.action(60, "ask traveller", "ask-budget", "user_prompt", **RECORDED, **{"durable.replayed": True})
    after.action(61, "charge card", "pay-deposit", "payment", **key)
    after.action(62, "checkpoint", "ckpt-1", "checkpoint")
    actions = before.actions() + after.actions()
    out, _ = check(packs, actions)
    first, second = span_of(actions, "pay-deposit", "pod-a"), span_of(actions, "pay-deposit", "pod-b")
    # The first payment was never checkpointed before the next action began, so recovery ran it
    # again. With the first run's idempotency key the second run is recognised and collapsed.
    expected = [("DS110", "pay-deposit", first)]
    if not keyed:
        # Without one it is a second charge: executed again instead of replayed, and unkeyed twice.
        expected += [("DS101", "pay-deposit", second), ("DS002", "pay-deposit", first),
                     ("DS002", "pay-deposit", second)]
    assert rules_of(out) == sorted(expected)
    services = {v.service for v in out}
    assert services == {"travel-agent"}


def test_retry_after_transient_failure_is_clean(packs: RuleSet) -> None:
    agent = Agent("pod-a")
    policy = {"durable.retry.retryable": True, "durable.retry.max_attempts": 3}
    agent.action(0, "search flights", "search", "external_read", error=True,
                 **policy, **{"durable.retry.attempt": 1})
    agent.action(2, "search flights", "search", "external_read",
                 **policy, **RECORDED, **{"durable.retry.attempt": 2})
    agent.action(3, "ask traveller", "pick", "user_prompt", **RECORDED)
    out, engine = check(packs, agent.actions())
    assert out == []
    assert engine.summary().sessions[0].actions_by_kind == {"external_read": 2, "user_prompt": 1}


def test_denied_approval_then_payment_of_that_plan(packs: RuleSet) -> None:
    agent = Agent("pod-a")
    agent.action(0, "request approval", "approve-v1", "approval",
                 **{"durable.workflow.state": "awaiting_approval", "durable.wait.timeout_s": 3600,
                    "durable.plan.version": "v1"})
    agent.action(30, "approval decided", "decision-v1", "approval",
                 **{"durable.approval.decision": "denied", "durable.plan.version": "v1"})
    agent.action(40, "charge card", "pay", "payment",
                 **{"durable.idempotency_key": "trip-2291-pay", "durable.plan.version": "v1"})
    agent.action(41, "checkpoint", "ckpt", "checkpoint")
    actions = agent.actions()
    out, _ = check(packs, actions)
    assert rules_of(out) == [("DS109", "pay", span_of(actions, "pay", "pod-a"))]


def _resumed_workflow(reask: bool) -> list[Action]:
    before = Agent("pod-a")
    before.action(0, "ask traveller", "ask-dates", "user_prompt", **RECORDED)
    before.action(5, "plan trip", "plan", "llm_call", **RECORDED, **{"durable.plan.version": "v1"})
    before.action(10, "request approval", "approve", "approval",
                  **{"durable.workflow.state": "awaiting_approval", "durable.wait.timeout_s": 86400,
                     "durable.plan.version": "v1"})
    # Hours later the approval arrives and a new instance resumes the workflow.
    delay = 3 * 3600
    after = Agent("pod-c")
    after.action(delay, "approval decided", "decision", "approval",
                 **{"durable.approval.decision": "granted", "durable.plan.version": "v1"})
    if reask:
        after.action(delay + 1, "ask traveller", "ask-dates", "user_prompt", **RECORDED)
    else:
        after.action(delay + 1, "ask traveller", "ask-dates", "user_prompt", **RECORDED, **{"durable.replayed": True})
    after.action(delay + 2, "plan trip", "plan", "llm_call", **RECORDED,
                 **{"durable.replayed": True, "durable.plan.version": "v1"})
    after.action(delay + 3, "book", "book", "write",
                 **{"durable.idempotency_key": "trip-2291-book", "durable.plan.version": "v1",
                    "durable.workflow.state": "executing"})
    after.action(delay + 4, "checkpoint", "ckpt", "checkpoint")
    return before.actions() + after.actions()


def test_workflow_resumed_after_delay_with_replayed_outcomes_is_clean(packs: RuleSet) -> None:
    out, engine = check(packs, _resumed_workflow(reask=False))
    assert out == []
    assert engine.summary().open_waits == []


def test_workflow_resumed_after_delay_that_reasks_the_human(packs: RuleSet) -> None:
    actions = _resumed_workflow(reask=True)
    out, _ = check(packs, actions)
    assert rules_of(out) == [("DS101", "ask-dates", span_of(actions, "ask-dates", "pod-c"))]
    assert out[0].kind == "user_prompt"


def test_duplicate_event_delivery_counts_once(packs: RuleSet) -> None:
    agent = Agent("pod-a")
    agent.action(0, "plan trip", "plan", "llm_call")  # no recorded result: DS001
    agent.action(1, "charge card", "pay", "payment")  # no key: DS002
    agent.action(2, "checkpoint", "ckpt", "checkpoint")
    once = agent.actions()
    single, _ = check(packs, once)
    assert sorted(v.rule for v in single) == ["DS001", "DS002"]
    # OTLP is at-least-once: the same export arrives again, interleaved and whole.
    twice = agent.actions()
    delivered = once[:2] + twice + once[2:]
    out, engine = check(packs, delivered)
    assert sorted(v.violation_id for v in out) == sorted(v.violation_id for v in single)
    assert engine.duplicates == len(twice)
    assert engine.summary().actions_evaluated == len(once)
