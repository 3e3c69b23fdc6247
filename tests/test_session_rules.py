"""DS101-DS110 through the shipped packs and the real engine: a session that trips each, and a near miss."""

from __future__ import annotations

import pytest

from processor.evaluate.model import RuleSet
from tests._engine_util import T0, S, Spans, by_rule, run, shipped


@pytest.fixture(scope="module")
def packs() -> RuleSet:
    return shipped()


def test_ds101_reexecuted_after_resume(packs: RuleSet) -> None:
    span = Spans()
    first = span(0, action_id="ask", kind="user_prompt", result={"city": "Kyoto"}, instance="i-1")
    again = span(60, action_id="ask", kind="user_prompt", result={"city": "Osaka"}, instance="i-2")
    out, _ = run(packs, [first, again])
    hits = by_rule(out, "DS101")
    assert [(v.action_id, v.span_id) for v in hits] == [("ask", again.record["span_id"])]
    assert hits[0].kind == "user_prompt"
    assert "executed again" in hits[0].message


def test_ds101_near_miss_replayed_outcome_and_retry_after_failure(packs: RuleSet) -> None:
    span = Spans()
    items = [
        span(0, action_id="ask", kind="user_prompt", result={"city": "Kyoto"}),
        span(60, action_id="ask", kind="user_prompt", result={"city": "Kyoto"}, replayed=True),
        # A failed attempt followed by a successful one is a retry, not a re-execution.
        span(70, action_id="call", kind="llm_call", status="error", retryable=True, max_attempts=3, attempts=1),
        span(71, action_id="call", kind="llm_call", result_ref="blob://1", retryable=True, max_attempts=3, attempts=2),
    ]
    out, _ = run(packs, items)
    assert by_rule(out, "DS101") == []


def test_ds102_key_changes_between_attempts(packs: RuleSet) -> None:
    span = Spans()
    items = [
        span(0, action_id="pay", kind="payment", status="error", idempotency_key="pay-s1-a"),
        span(5, action_id="pay", kind="payment", idempotency_key="pay-s1-b"),
    ]
    out, _ = run(packs, items)
    assert [v.action_id for v in by_rule(out, "DS102")] == ["pay"]
    assert by_rule(out, "DS102")[0].span_id == items[1].record["span_id"]


def test_ds102_near_miss_same_key(packs: RuleSet) -> None:
    span = Spans()
    items = [
        span(0, action_id="pay", kind="payment", status="error", idempotency_key="pay-s1-pay"),
        span(5, action_id="pay", kind="payment", idempotency_key="pay-s1-pay"),
    ]
    out, _ = run(packs, items)
    assert by_rule(out, "DS102") == []


def test_ds103_time_derived_key(packs: RuleSet) -> None:
    span = Spans()
    out, _ = run(packs, [span(0, action_id="pay", kind="payment", idempotency_key="pay-2026-11-01-s1")])
    assert [v.action_id for v in by_rule(out, "DS103")] == ["pay"]


def test_ds103_near_miss_identity_key(packs: RuleSet) -> None:
    span = Spans()
    out, _ = run(packs, [span(0, action_id="pay", kind="payment", idempotency_key="pay-s1-pay")])
    assert by_rule(out, "DS103") == []


def test_ds104_key_reused_by_another_action(packs: RuleSet) -> None:
    span = Spans()
    items = [
        span(0, action_id="pay-1", kind="payment", idempotency_key="order-7"),
        span(5, action_id="pay-2", kind="payment", idempotency_key="order-7"),
    ]
    out, _ = run(packs, items)
    assert [v.action_id for v in by_rule(out, "DS104")] == ["pay-2"]


def test_ds104_near_miss_same_action_retried(packs: RuleSet) -> None:
    span = Spans()
    items = [
        span(0, action_id="pay-1", kind="payment", status="error", idempotency_key="order-7", input_fingerprint="f1"),
        span(5, action_id="pay-1", kind="payment", idempotency_key="order-7", input_fingerprint="f1"),
    ]
    out, _ = run(packs, items)
    assert by_rule(out, "DS104") == []


def test_ds105_cap_reached_then_no_escalation(packs: RuleSet) -> None:
    span = Spans()
    items = [
        span(0, action_id="fetch", status="error", retryable=True, max_attempts=3, attempts=3),
        span(10, action_id="next", kind="tool_call"),
    ]
    out, _ = run(packs, items)
    hits = by_rule(out, "DS105")
    assert [v.action_id for v in hits] == ["fetch"]
    # Reported on the exhausted action, its message from that action's fields.
    assert hits[0].span_id == items[0].record["span_id"]
    assert "used all 3 attempts" in hits[0].message


def test_ds105_near_miss_escalates_to_human(packs: RuleSet) -> None:
    span = Spans()
    items = [
        span(0, action_id="fetch", status="error", retryable=True, max_attempts=3, attempts=3),
        span(10, action_id="ask", kind="user_prompt", result={"go_on": True}),
    ]
    out, engine = run(packs, items)
    assert by_rule(out, "DS105") == []
    assert engine.summary().open_waits == []


def test_ds106_wait_without_timeout(packs: RuleSet) -> None:
    span = Spans()
    out, _ = run(packs, [span(0, action_id="approve", kind="approval", workflow_state="awaiting_approval")])
    assert [v.action_id for v in by_rule(out, "DS106")] == ["approve"]


def test_ds106_near_miss_with_timeout(packs: RuleSet) -> None:
    span = Spans()
    item = span(0, action_id="approve", kind="approval", workflow_state="awaiting_approval", wait_timeout_s=3600)
    out, _ = run(packs, [item])
    assert by_rule(out, "DS106") == []


def test_ds107_fires_at_deadline_with_nothing_after_it_in_the_session(packs: RuleSet) -> None:
    span = Spans()
    wait = span(0, session="s1", action_id="approve", kind="approval", workflow_state="awaiting_approval",
                wait_timeout_s=60)
    # Another session's traffic moves event time on; s1 itself stays silent.
    other = span(300, session="s2", action_id="x")
    out, _ = run(packs, [wait, other])
    hits = by_rule(out, "DS107")
    assert [(v.session_id, v.action_id) for v in hits] == [("s1", "approve")]
    assert hits[0].time_ns == T0 + 60 * S
    assert hits[0].details == {"deadline_unix_nano": T0 + 60 * S}
    assert "awaiting_approval past its 60s deadline" in hits[0].message


def test_ds107_near_miss_resolved_in_time(packs: RuleSet) -> None:
    span = Spans()
    items = [
        span(0, action_id="approve", kind="approval", workflow_state="awaiting_approval", wait_timeout_s=60),
        span(30, action_id="decide", kind="approval", approval_decision="granted", plan_version="v1"),
        span(300, session="s2", action_id="x"),
    ]
    out, engine = run(packs, items)
    assert by_rule(out, "DS107") == []
    assert engine.summary().open_waits == []


def test_ds108_executes_other_plan_than_approved(packs: RuleSet) -> None:
    span = Spans()
    items = [
        span(0, action_id="decide", kind="approval", approval_decision="granted", plan_version="v1"),
        span(10, action_id="pay", kind="payment", idempotency_key="pay-s1", plan_version="v2"),
    ]
    out, _ = run(packs, items)
    hits = by_rule(out, "DS108")
    assert [v.action_id for v in hits] == ["pay"]
    assert "approval was for plan v1" in hits[0].message


def test_ds108_near_miss_same_plan(packs: RuleSet) -> None:
    span = Spans()
    items = [
        span(0, action_id="decide", kind="approval", approval_decision="granted", plan_version="v1"),
        span(10, action_id="pay", kind="payment", idempotency_key="pay-s1", plan_version="v1"),
    ]
    out, _ = run(packs, items)
    assert by_rule(out, "DS108") == []


def test_ds109_denied_then_executed(packs: RuleSet) -> None:
    span = Spans()
    items = [
        span(0, action_id="decide", kind="approval", approval_decision="denied", plan_version="v1"),
        span(10, action_id="pay", kind="payment", idempotency_key="pay-s1", plan_version="v1"),
    ]
    out, _ = run(packs, items)
    assert [v.action_id for v in by_rule(out, "DS109")] == ["pay"]


def test_ds109_near_miss_granted_after_denial(packs: RuleSet) -> None:
    span = Spans()
    items = [
        span(0, action_id="decide-1", kind="approval", approval_decision="denied", plan_version="v1"),
        span(5, action_id="decide-2", kind="approval", approval_decision="granted", plan_version="v1"),
        span(10, action_id="pay", kind="payment", idempotency_key="pay-s1", plan_version="v1"),
    ]
    out, _ = run(packs, items)
    assert by_rule(out, "DS109") == []


def test_ds110_side_effect_then_next_action_without_checkpoint(packs: RuleSet) -> None:
    span = Spans()
    items = [
        span(0, action_id="pay", kind="payment", idempotency_key="pay-s1"),
        span(5, action_id="mail", kind="email", replay="skip"),
        span(6, action_id="ckpt", kind="checkpoint"),
    ]
    out, _ = run(packs, items)
    hits = by_rule(out, "DS110")
    assert [v.action_id for v in hits] == ["pay"]
    assert hits[0].span_id == items[0].record["span_id"]


def test_ds110_near_miss_checkpoint_between(packs: RuleSet) -> None:
    span = Spans()
    items = [
        span(0, action_id="pay", kind="payment", idempotency_key="pay-s1"),
        span(1, action_id="ckpt", kind="checkpoint"),
        span(5, action_id="next", kind="tool_call"),
    ]
    out, _ = run(packs, items)
    assert by_rule(out, "DS110") == []
