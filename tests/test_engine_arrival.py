"""Condition rules run when a span is accepted; stateful rules wait for event-time order.

A condition rule reads one record alone, so the reordering buffer cannot change its verdict:
its violation comes back from the submit that accepted the span, not ``allowed_lateness``
later. A redelivered copy is skipped before that, and a span released after a restart does
not run its condition rules again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from processor.evaluate.engine import Engine, EngineOptions, EngineState
from processor.evaluate.model import RuleSet
from processor.records import Action
from processor.state.memory import MemoryStore
from processor.state.session import SessionState
from processor.state.sqlite import SqliteStore
from tests._engine_util import T0, S, Spans, rules_from, shipped
from tests.test_engine_ordering import _dump, _shuffled

LATENESS_S = 5.0
HEADER = "version: 1\nrules:\n"
# The wall clock of the serve tests: well after the spans' event times, as for a live agent.
NOW = T0 + 1000 * S


def _story(span: Spans) -> tuple[list[Action], Action]:
    """A re-executed action and an unkeyed payment, in one session."""
    done = span(0, action_id="a1")
    again = span(1, action_id="a1")  # the same kind, not replayed: DS101 (a sequence)
    other = span(2, action_id="a1", kind="llm_call", result=None)  # another kind, same id: DS009 (a sequence)
    pay = span(3, action_id="p1", kind="payment")  # no idempotency key: DS002 (a condition)
    return [done, again, other], pay


def _serve(store: Any = None, clock: list[int] | None = None) -> tuple[Engine, list[int]]:
    now = clock if clock is not None else [NOW]
    options = EngineOptions(mode="serve", allowed_lateness_s=LATENESS_S)
    return Engine(shipped(), options, store, clock=lambda: now[0]), now


def _rules(violations: list[Any]) -> list[tuple[str, str]]:
    return sorted((v.rule, v.action_id) for v in violations)


def _redelivered(action: Action) -> Action:
    return Action(record=dict(action.record), source="span", origin="again", time_ns=action.time_ns,
                  seq=action.seq + 100, delivery_key=action.delivery_key)


def test_a_condition_rule_reports_from_the_submit_that_accepts_the_span() -> None:
    engine, _ = _serve()
    span = Spans()
    sequence, pay = _story(span)
    assert engine.submit_many(sequence) == []  # the sequences wait in the buffer
    accepted = engine.submit(pay)
    assert _rules(accepted) == [("DS002", "p1")]  # no tick needed
    assert accepted[0].span_id == pay.record["span_id"]
    assert accepted[0].time_ns == T0 + 3 * S
    assert engine.submit(_redelivered(pay)) == []
    assert engine.duplicates == 1
    assert engine.tick(NOW + 4 * S) == []  # not yet the allowed lateness on the clock
    released = engine.tick(NOW + 5 * S)
    assert _rules(released) == [("DS009", "a1"), ("DS101", "a1")]
    # Released or not, the payment is not checked again, and a later copy is still a duplicate.
    assert engine.submit(_redelivered(pay)) == []
    assert engine.finish() == []
    assert engine.duplicates == 2
    summary = engine.summary()
    (session,) = summary.sessions
    assert session.actions_by_kind == {"tool_call": 2, "llm_call": 1, "payment": 1}
    assert session.violations_by_rule == {"DS002": 1, "DS009": 1, "DS101": 1}
    assert summary.violations_by_rule == {"DS002": 1, "DS009": 1, "DS101": 1}
    assert summary.actions_evaluated == 4
    # DS110 (a side effect with no checkpoint after it) waits for the session's next record.
    assert [(w.rule, w.action_id) for w in summary.open_waits] == [("DS110", "p1")]


def test_a_span_late_for_the_buffer_is_checked_once() -> None:
    engine, now = _serve()
    span = Spans()
    sequence, pay = _story(span)
    engine.submit_many([*sequence, span(60, action_id="later")])
    now[0] = NOW + 5 * S
    engine.tick(now[0])  # everything released: the watermark is at t=60s
    late = engine.submit(pay)  # behind the watermark: evaluated at once, conditions included
    assert engine.late == 1
    assert _rules(late) == [("DS002", "p1")]
    assert engine.summary().violations_by_rule["DS002"] == 1


def _condition_rules(ruleset: RuleSet) -> set[str]:
    return {rule.id for rule in ruleset.rules if rule.type == "condition"}


def test_replay_returns_condition_violations_on_acceptance_and_the_same_set_as_sorted() -> None:
    packs = shipped()
    conditions = _condition_rules(packs)
    dump = _dump(5, sessions=40)
    # The ordering dump is clean for condition rules: break a few records the way agents do.
    for number, item in enumerate(dump):
        if number % 4 == 0:
            item.record["cacheable"] = True  # DS006, DS007 (DS005 on a user_prompt)
        if number % 3 == 0:
            item.record.pop("idempotency_key", None)  # DS002 on a payment
    arrived = _shuffled(dump, 105)

    def key(violations: list[Any]) -> list[tuple[Any, ...]]:
        return sorted((v.violation_id, v.rule, v.session_id, v.action_id, v.time_ns, v.message) for v in violations)

    engine = Engine(packs, EngineOptions(allowed_lateness_s=LATENESS_S))
    collected = []
    for item in arrived:
        out = engine.submit(item)
        # What a submit returns of condition rules is about the span it accepted, and nothing else.
        assert {v.span_id for v in out if v.rule in conditions} <= {item.record["span_id"]}
        collected += out
    tail = engine.finish()
    assert not [v for v in tail if v.rule in conditions]
    collected += tail

    sorted_engine = Engine(packs, EngineOptions(allowed_lateness_s=LATENESS_S))
    expected = sorted_engine.submit_many(dump) + sorted_engine.finish()
    assert key(collected) == key(expected)
    # The dump trips condition rules and stateful ones.
    assert {"DS002", "DS005", "DS006", "DS007", "DS101", "DS107", "DS110"} <= {v.rule for v in expected}
    assert engine.summary().to_json() == sorted_engine.summary().to_json()


def test_a_buffered_span_does_not_run_its_conditions_again_after_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = SqliteStore(path)
    engine, now = _serve(store)
    span = Spans()
    sequence, pay = _story(span)
    first = engine.submit_many([*sequence, pay])
    assert _rules(first) == [("DS002", "p1")]
    store.close()  # the process stops with every span still in the buffer (committed)

    again = SqliteStore(path)
    restarted, _ = _serve(again, now)
    assert restarted.submit(_redelivered(pay)) == []  # a redelivery after the restart
    released = restarted.tick(NOW + 5 * S)
    assert _rules(released) == [("DS009", "a1"), ("DS101", "a1")]
    (session,) = restarted.summary().sessions
    assert session.actions_by_kind == {"tool_call": 2, "llm_call": 1, "payment": 1}
    assert session.violations_by_rule == {"DS002": 1, "DS009": 1, "DS101": 1}
    again.close()


def test_buffered_spans_saved_before_acceptance_checks_are_checked_at_release() -> None:
    """State written by a version that ran condition rules at release: its buffered spans were never checked."""
    now = [NOW]
    span = Spans()
    sequence, pay = _story(span)
    seed_store = MemoryStore()
    seeded, _ = _serve(seed_store, now)
    seeded.submit_many([*sequence, pay])
    plain = seed_store.snapshot(seeded.schema)
    assert [entry["conditions_done"] for entry in plain["engine"]["buffer"]] == [True] * 4
    # What the older version had written at this point: no marks, and nothing counted yet.
    for entry in plain["engine"]["buffer"]:
        del entry["conditions_done"]
    old = MemoryStore()
    old.save_engine(EngineState.from_plain(plain["engine"]))
    for session_plain in plain["sessions"].values():
        session_plain.update(kinds={}, violations=None)
        old.save_session(SessionState.from_plain(seeded.schema, session_plain), seeded.schema)

    upgraded, _ = _serve(old, now)
    released = upgraded.tick(NOW + 5 * S)
    assert _rules(released) == [("DS002", "p1"), ("DS009", "a1"), ("DS101", "a1")]
    (session,) = upgraded.summary().sessions
    assert session.actions_by_kind == {"tool_call": 2, "llm_call": 1, "payment": 1}
    assert session.violations_by_rule == {"DS002": 1, "DS009": 1, "DS101": 1}


def test_the_mark_round_trips_through_plain_data() -> None:
    store = MemoryStore()
    engine, _ = _serve(store)
    span = Spans()
    engine.submit(span(0))
    plain = store.snapshot(engine.schema)["engine"]
    state = EngineState.from_plain(plain)
    assert [item.conditions_done for item in state.buffer] == [True]
    assert state.to_plain() == plain


def test_an_engine_built_again_on_the_same_store_releases_with_its_own_rules(tmp_path: Path) -> None:
    repeat = """
  - id: Q1
    name: repeat
    severity: error
    type: sequence
    group_by: [record.action_id]
    first: record.status == "ok"
    then: record.kind == first.kind
    message: "{{ record.action_id }} again"
"""
    counted = """
  - id: C1
    name: two-calls
    severity: warning
    type: count
    condition: record.kind == "tool_call"
    threshold: 1
    window: 1h
    message: "{{ record.action_id }}"
"""
    store = MemoryStore()
    span = Spans()
    before = Engine(rules_from(tmp_path, HEADER + repeat, "before.yaml"), EngineOptions(), store)
    assert before.submit_many([span(0, action_id="a"), span(1, action_id="a")]) == []  # both buffered
    # Restarted with another rule set: a new stateful rule comes first in the session's layout.
    after = Engine(rules_from(tmp_path, HEADER + counted + repeat, "after.yaml"), EngineOptions(), store)
    assert _rules(after.finish()) == [("C1", "a"), ("Q1", "a")]
