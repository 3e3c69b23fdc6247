"""Resolutions: a wait that fired unresolved and is resolved later clears its violation."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from processor.evaluate.engine import Engine, EngineOptions
from processor.records import Action
from processor.state.memory import MemoryStore
from processor.state.session import NO_GROUP, SessionState
from processor.violations import make_violation_id, record_identity
from tests._engine_util import T0, S, Spans, by_rule, rules_from, shipped

HEADER = "version: 1\nrules:\n"

# An absence per group (the action id), so that one group's resolution must not clear another's.
GROUPED = HEADER + """
  - id: G1
    name: reply-missing
    severity: error
    type: absence
    group_by: [record.action_id]
    first: record.kind == "request"
    then: record.kind == "reply"
    within: 10s
    message: "{{ record.action_id }} got no reply"
"""


def waiting(span: Spans, at_s: float, session: str = "s1", action_id: str = "w", timeout_s: int = 60) -> Action:
    return span(at_s, session=session, action_id=action_id, kind="approval",
                workflow_state="awaiting_approval", wait_timeout_s=timeout_s)


def test_ds107_fires_at_the_deadline_and_a_later_approval_resolves_it_once() -> None:
    span = Spans()
    wait = waiting(span, 0)
    engine = Engine(shipped(), EngineOptions(allowed_lateness_s=5))
    engine.submit(wait)
    fired = by_rule(engine.submit(span(70, session="other")), "DS107")  # watermark 65s: past the deadline
    assert [v.action_id for v in fired] == ["w"]
    assert fired[0].violation_id == make_violation_id("DS107", "s1", "w", record_identity(wait))
    assert engine.take_resolutions() == []

    engine.submit(span(100, action_id="d", kind="approval", approval_decision="granted"))
    engine.submit(span(110, session="other"))  # releases the approval
    assert engine.take_resolutions() == [fired[0].violation_id]
    assert engine.take_resolutions() == []

    # A second approval has nothing left to resolve.
    engine.submit(span(120, action_id="d2", kind="approval", approval_decision="granted"))
    engine.finish()
    assert engine.take_resolutions() == []
    summary = engine.summary()
    assert summary.waits_resolved_late == 1
    assert {s.session_id: s.waits_resolved_late for s in summary.sessions} == {"s1": 1, "other": 0}
    assert summary.to_json()["waits_resolved_late"] == 1
    assert "1 wait(s) resolved after their deadline" in summary.text_lines()[-1]


def test_the_record_that_fires_an_overdue_wait_can_resolve_it() -> None:
    span = Spans()
    # Lateness longer than the input: the session's own next record fires the wait, then resolves it.
    engine = Engine(shipped(), EngineOptions(allowed_lateness_s=3600))
    engine.submit_many([waiting(span, 0, timeout_s=10), span(30, action_id="d", approval_decision="denied")])
    fired = by_rule(engine.finish(), "DS107")
    assert [v.action_id for v in fired] == ["w"]
    assert engine.take_resolutions() == [fired[0].violation_id]


def test_a_wait_resolved_before_its_deadline_yields_no_resolution() -> None:
    span = Spans()
    engine = Engine(shipped(), EngineOptions(allowed_lateness_s=5))
    out = engine.submit_many([waiting(span, 0), span(30, action_id="d", approval_decision="granted"),
                              span(200, session="other")])
    out += engine.finish()
    assert by_rule(out, "DS107") == []
    assert engine.take_resolutions() == []
    assert engine.summary().waits_resolved_late == 0


def test_a_record_that_does_not_match_then_resolves_nothing() -> None:
    span = Spans()
    engine = Engine(shipped(), EngineOptions(allowed_lateness_s=5))
    engine.submit_many([waiting(span, 0), span(100, session="other")])
    # Still waiting (a wait state, another action): not a resolution.
    engine.submit_many([waiting(span, 110, action_id="w2", timeout_s=3600), span(200, session="other")])
    engine.finish()
    assert engine.take_resolutions() == []


def test_only_the_fired_wait_of_the_same_group_is_resolved(tmp_path: Path) -> None:
    rules = rules_from(tmp_path, GROUPED)
    span = Spans()
    engine = Engine(rules, EngineOptions(allowed_lateness_s=0))
    fired = engine.submit_many([span(0, action_id="a", kind="request"), span(1, action_id="b", kind="request"),
                                span(20, action_id="c", kind="tool_call")])
    ids = {v.action_id: v.violation_id for v in fired}
    assert sorted(ids) == ["a", "b"]
    engine.submit(span(30, action_id="b", kind="reply"))
    assert engine.take_resolutions() == [ids["b"]]
    engine.submit(span(31, action_id="c", kind="reply"))  # a group that never waited
    assert engine.take_resolutions() == []
    engine.submit(span(40, action_id="a", kind="reply"))
    assert engine.take_resolutions() == [ids["a"]]


def test_a_within_actions_wait_is_resolved_by_a_later_match(tmp_path: Path) -> None:
    span = Spans()
    engine = Engine(shipped(), EngineOptions(allowed_lateness_s=0))
    # DS110: a side effect followed by another action before any checkpoint.
    out = engine.submit_many([span(0, action_id="pay", kind="payment", idempotency_key="k-pay"),
                              span(1, action_id="next", kind="llm_call", result=None)])
    fired = by_rule(out, "DS110")
    assert [v.action_id for v in fired] == ["pay"]
    engine.submit(span(2, action_id="cp", kind="checkpoint"))
    assert engine.take_resolutions() == [fired[0].violation_id]


def test_fired_waits_are_bounded_per_session() -> None:
    span = Spans()
    engine = Engine(shipped(), EngineOptions(allowed_lateness_s=0, max_fired_waits_per_session=2))
    ids = []
    for n in range(3):
        # Each wait fires before the next one opens (DS107 keeps one wait per session).
        out = engine.submit_many([waiting(span, n * 100, action_id=f"w{n}", timeout_s=10),
                                  span(n * 100 + 50, session="other")])
        ids += [v.violation_id for v in by_rule(out, "DS107")]
    assert len(ids) == 3
    engine.submit(span(400, action_id="d", approval_decision="granted"))
    assert engine.take_resolutions() == ids[1:]  # the oldest was forgotten at the bound
    summary = engine.summary()
    assert (summary.fired_waits_dropped, summary.waits_resolved_late) == (1, 2)


def test_tracking_can_be_switched_off() -> None:
    span = Spans()
    engine = Engine(shipped(), EngineOptions(allowed_lateness_s=0, max_fired_waits_per_session=0))
    engine.submit_many([waiting(span, 0, timeout_s=10), span(50, session="other"),
                        span(60, action_id="d", approval_decision="granted")])
    assert engine.take_resolutions() == []
    with pytest.raises(ValueError, match="max_fired_waits_per_session"):
        EngineOptions(max_fired_waits_per_session=-1)


def test_a_fired_wait_survives_a_restart_on_the_same_store() -> None:
    store = MemoryStore()
    span = Spans()
    first = Engine(shipped(), EngineOptions(allowed_lateness_s=5), store=store)
    first.submit(waiting(span, 0))
    fired = by_rule(first.submit(span(70, session="other")), "DS107")
    assert len(fired) == 1
    second = Engine(shipped(), EngineOptions(allowed_lateness_s=5), store=store)
    second.submit_many([span(100, action_id="d", approval_decision="granted"), span(110, session="other")])
    assert second.take_resolutions() == [fired[0].violation_id]
    assert second.summary().waits_resolved_late == 1


def test_fired_waits_round_trip_through_plain_data() -> None:
    store = MemoryStore()
    span = Spans()
    engine = Engine(shipped(), EngineOptions(allowed_lateness_s=5), store=store)
    engine.submit_many([waiting(span, 0), span(70, session="other")])
    fired = by_rule(engine.submit(span(80, session="other")), "DS107") or []
    plain = orjson.loads(orjson.dumps(store.snapshot(engine.schema)))
    session_plain = plain["sessions"]["s1"]
    assert [(f["rule"], f["group"]) for f in session_plain["fired"]] == [("DS107", [NO_GROUP])]
    assert fired == []  # fired once, in the batch before
    restored = SessionState.from_plain(engine.schema, session_plain)
    assert restored.to_plain(engine.schema) == session_plain
    assert restored.fired is not None and restored.fired.entries[0][2] == session_plain["fired"][0]["violation_id"]

    # State written before fired waits existed has no such keys: it loads with none.
    older = {k: v for k, v in session_plain.items() if k not in ("fired", "resolved_late")}
    assert SessionState.from_plain(engine.schema, older).fired is None

    # A durable store rebuilds sessions from plain data: the resolution still comes.
    rebuilt = MemoryStore()
    restored_engine = Engine(shipped(), EngineOptions(allowed_lateness_s=5), store=rebuilt)
    rebuilt.save_session(SessionState.from_plain(restored_engine.schema, session_plain), restored_engine.schema)
    again = Engine(shipped(), EngineOptions(allowed_lateness_s=5), store=rebuilt)
    again.submit(span(100, action_id="d", approval_decision="granted"))
    again.finish()
    assert again.take_resolutions() == [session_plain["fired"][0]["violation_id"]]


def test_serve_resolution_after_a_wait_fired_by_the_clock() -> None:
    clock = [T0]
    engine = Engine(shipped(), EngineOptions(mode="serve", allowed_lateness_s=1), clock=lambda: clock[0])
    span = Spans()
    engine.submit(waiting(span, 0, timeout_s=60))
    fired = by_rule(engine.tick(T0 + 62 * S), "DS107")  # deadline + lateness passed on the clock
    assert [v.action_id for v in fired] == ["w"]
    clock[0] = T0 + 100 * S
    engine.submit(span(100, action_id="d", approval_decision="granted"))
    assert engine.take_resolutions() == []  # still held for the allowed lateness
    engine.tick(T0 + 102 * S)
    assert engine.take_resolutions() == [fired[0].violation_id]
