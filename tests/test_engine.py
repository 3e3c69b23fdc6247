"""The engine's rule semantics, timers, duplicates, sessions, state and telemetry, on small rule files."""

from __future__ import annotations

import logging
from pathlib import Path

import orjson
import pytest

from processor.evaluate.engine import Engine, EngineOptions, EngineState
from processor.evaluate.model import RuleSet
from processor.records import Action, Malformed
from processor.state.memory import MemoryStore
from processor.state.session import SessionState, key_digest
from processor.telemetry import Telemetry
from processor.violations import make_violation_id, record_identity
from tests._engine_util import T0, S, Spans, log_line, rules_from, run

HEADER = "version: 1\nrules:\n"


def test_condition_rule_violation_carries_the_record_provenance(tmp_path: Path) -> None:
    rules = rules_from(tmp_path, HEADER + """
  - id: X1
    name: payment-seen
    severity: warning
    tags: [money]
    condition: record.kind == "payment"
    message: "{{ record.kind }} {{ record.action_id }} from {{ meta.source }}"
""")
    span = Spans()
    pay = span(3, action_id="p1", kind="payment", service="billing")
    out, _ = run(rules, [span(0), pay, log_line(7, kind="payment", action_id="p2")])
    # A condition rule fires when its span is accepted, before the log line that arrived after it.
    assert [(v.action_id, v.span_id, v.line) for v in out] == [
        ("p1", pay.record["span_id"], None),
        ("p2", "", 7),
    ]
    span_v, line_v = out
    assert span_v.message == "payment p1 from span"
    assert span_v.trace_id == span.trace_id
    assert span_v.service == "billing"
    assert span_v.kind == "payment"
    assert span_v.time_ns == T0 + 3 * S
    assert span_v.tags == ("money",)
    assert span_v.severity == "warning"
    assert span_v.violation_id == make_violation_id("X1", "s1", "p1", record_identity(pay))
    assert line_v.origin == "actions.jsonl"
    assert line_v.message == "payment p2 from log"


def test_malformed_goes_to_malformed_rule_only(tmp_path: Path) -> None:
    rules = rules_from(tmp_path, HEADER + """
  - id: M0
    name: malformed
    severity: error
    type: malformed
    message: "bad: {{ meta.problem }}"
  - id: X1
    name: anything
    severity: info
    condition: "true"
    message: "x"
""")
    bad = Malformed("missing required field kind", origin="a.jsonl", line=4, session_id="s1", action_id="a9")
    out, engine = run(rules, [bad])
    assert [(v.rule, v.session_id, v.action_id, v.line, v.message) for v in out] == [
        ("M0", "s1", "a9", 4, "bad: missing required field kind")
    ]
    assert out[0].violation_id == make_violation_id("M0", "s1", "a9", "line:a.jsonl:4")
    summary = engine.summary()
    assert summary.malformed == 1
    assert summary.actions_seen == 0
    assert summary.sessions[0].violations_by_rule == {"M0": 1}


SEQUENCE = HEADER + """
  - id: Q1
    name: repeat
    severity: error
    type: sequence
    group_by: [record.action_id]
    first: record.status == "ok"
    then: record.kind == first.kind
    message: "{{ record.action_id }} again after {{ first.kind }}"
"""


def test_sequence_fires_on_every_later_match_and_never_on_its_opener(tmp_path: Path) -> None:
    rules = rules_from(tmp_path, SEQUENCE)
    lines = [log_line(1, action_id="a"), log_line(2, action_id="a"), log_line(3, action_id="a"),
             log_line(4, action_id="b", status="error"), log_line(5, action_id="b")]
    out, _ = run(rules, lines)
    assert [(v.action_id, v.line) for v in out] == [("a", 2), ("a", 3)]
    assert out[0].message == "a again after tool_call"


def test_sequence_within_drops_a_stale_opener(tmp_path: Path) -> None:
    rules = rules_from(tmp_path, SEQUENCE.replace("    then:", "    within: 10s\n    then:"))
    span = Spans()
    items = [span(0, action_id="a"), span(5, action_id="a"), span(30, action_id="a"), span(35, action_id="a")]
    out, _ = run(rules, items)
    # 5s after the opener fires; 30s does not (and opens anew); 35s is 5s after that.
    assert [v.span_id for v in out] == [items[1].record["span_id"], items[3].record["span_id"]]


def test_sequence_report_on_first_reports_the_opener_once(tmp_path: Path) -> None:
    rules = rules_from(tmp_path, HEADER + """
  - id: Q2
    name: effect-not-checkpointed
    severity: warning
    type: sequence
    first: record.kind == "payment"
    then: record.kind != "checkpoint"
    report_on: first
    message: "{{ first.action_id }} then {{ record.action_id }}"
""")
    span = Spans()
    pay = span(0, action_id="pay", kind="payment")
    out, _ = run(rules, [pay, span(1, action_id="x"), span(2, action_id="y")])
    assert [(v.action_id, v.span_id, v.time_ns) for v in out] == [("pay", pay.record["span_id"], T0)]
    assert out[0].message == "pay then x"


def test_sequence_keep_latest_replaces_the_opener(tmp_path: Path) -> None:
    rules = rules_from(tmp_path, HEADER + """
  - id: Q3
    name: plan-changed
    severity: error
    type: sequence
    keep: latest
    first: has(record.plan_version) && record.kind == "approval"
    then: has(record.plan_version) && record.kind == "payment" && record.plan_version != first.plan_version
    message: "approved {{ first.plan_version }}, ran {{ record.plan_version }}"
""")
    lines = [log_line(1, kind="approval", plan_version="v1"), log_line(2, kind="approval", plan_version="v2"),
             log_line(3, kind="payment", plan_version="v2"), log_line(4, kind="payment", plan_version="v1")]
    out, _ = run(rules, lines)
    assert [(v.line, v.message) for v in out] == [(4, "approved v2, ran v1")]


ABSENCE = HEADER + """
  - id: W1
    name: wait-expired
    severity: error
    type: absence
    first: has(record.workflow_state) && record.workflow_state == "awaiting_approval"
    deadline: record.wait_timeout_s
    then: has(record.approval_decision)
    message: "{{ record.action_id }} waited {{ record.wait_timeout_s }}s"
"""


def test_absence_deadline_fires_in_replay_when_the_watermark_passes_it(tmp_path: Path) -> None:
    rules = rules_from(tmp_path, ABSENCE)
    span = Spans()
    wait = span(0, action_id="w", workflow_state="awaiting_approval", wait_timeout_s=60)
    engine = Engine(rules, EngineOptions(allowed_lateness_s=5))
    assert engine.submit(wait) == []
    assert engine.submit(span(64, session="other")) == []  # watermark 59s: not yet
    fired = engine.submit(span(66, session="other"))  # watermark 61s: past the deadline
    assert [(v.rule, v.session_id, v.action_id) for v in fired] == [("W1", "s1", "w")]
    assert fired[0].time_ns == T0 + 60 * S
    assert fired[0].details == {"deadline_unix_nano": T0 + 60 * S}
    assert fired[0].message == "w waited 60s"
    assert fired[0].violation_id == make_violation_id("W1", "s1", "w", record_identity(wait))
    assert engine.finish() == []


def test_absence_resolution_at_the_deadline_counts_and_later_one_does_not(tmp_path: Path) -> None:
    rules = rules_from(tmp_path, ABSENCE)
    span = Spans()
    items = [
        span(0, session="a", action_id="w", workflow_state="awaiting_approval", wait_timeout_s=60),
        span(60, session="a", approval_decision="granted"),
        span(0, session="b", action_id="w", workflow_state="awaiting_approval", wait_timeout_s=60),
        span(61, session="b", approval_decision="granted"),
    ]
    out, _ = run(rules, items)
    assert [(v.session_id, v.time_ns) for v in out] == [("b", T0 + 60 * S)]


def test_absence_pending_at_end_is_an_open_wait(tmp_path: Path) -> None:
    rules = rules_from(tmp_path, ABSENCE)
    span = Spans()
    items = [span(0, action_id="w", workflow_state="awaiting_approval", wait_timeout_s=600), span(100, action_id="z")]
    out, engine = run(rules, items)
    assert out == []
    summary = engine.summary()
    assert [(w.rule, w.action_id, w.deadline_ns, w.state) for w in summary.open_waits] == [
        ("W1", "w", T0 + 600 * S, "awaiting_approval")
    ]
    assert summary.sessions[0].open_waits == summary.open_waits


def test_absence_deadline_at_the_last_event_time_fires_at_finish(tmp_path: Path) -> None:
    rules = rules_from(tmp_path, ABSENCE)
    span = Spans()
    out, _ = run(rules, [span(0, action_id="w", workflow_state="awaiting_approval", wait_timeout_s=60),
                         span(60, session="other")])
    assert [v.action_id for v in out] == ["w"]


def test_absence_within_actions(tmp_path: Path) -> None:
    rules = rules_from(tmp_path, HEADER + """
  - id: W2
    name: no-escalation
    severity: error
    type: absence
    first: record.status == "error"
    then: record.kind == "user_prompt"
    within_actions: 2
    message: "{{ record.action_id }} not escalated"
""")
    lines = [log_line(1, action_id="f", status="error"), log_line(2), log_line(3), log_line(4, kind="user_prompt")]
    out, _ = run(rules, lines)
    assert [(v.action_id, v.line, v.details, v.message) for v in out] == [
        ("f", 1, {"within_actions": 2}, "f not escalated")
    ]
    resolved, _ = run(rules, [log_line(1, action_id="f", status="error"), log_line(2), log_line(3, kind="user_prompt")])
    assert resolved == []
    # Untimed: at the end it is an open wait with no deadline.
    _, open_engine = run(rules, [log_line(1, action_id="f", status="error")])
    assert [(w.action_id, w.deadline_ns) for w in open_engine.summary().open_waits] == [("f", None)]


def test_a_later_record_of_the_session_fires_an_overdue_wait_before_it_is_evaluated(tmp_path: Path) -> None:
    rules = rules_from(tmp_path, ABSENCE)
    span = Spans()
    items = [span(0, action_id="w", workflow_state="awaiting_approval", wait_timeout_s=10),
             span(11, approval_decision="granted")]
    # Lateness longer than the whole input: only the session's own next record can tell.
    engine = Engine(rules, EngineOptions(allowed_lateness_s=3600))
    assert engine.submit_many(items) == []
    fired = engine.finish()
    assert [(v.action_id, v.time_ns) for v in fired] == [("w", T0 + 10 * S)]


def test_change_rule(tmp_path: Path) -> None:
    rules = rules_from(tmp_path, HEADER + """
  - id: C1
    name: key-changed
    severity: critical
    type: change
    group_by: [record.action_id]
    condition: has(record.idempotency_key)
    field: record.idempotency_key
    message: "{{ record.action_id }}"
""")
    lines = [log_line(1, action_id="a", idempotency_key="k1"), log_line(2, action_id="a", idempotency_key="k1"),
             log_line(3, action_id="a", idempotency_key="k2"), log_line(4, action_id="b", idempotency_key="k2"),
             log_line(5, action_id="a")]
    out, _ = run(rules, lines)
    assert [v.line for v in out] == [3]


def test_count_rule_fires_once_per_crossing(tmp_path: Path) -> None:
    rules = rules_from(tmp_path, HEADER + """
  - id: N1
    name: storm
    severity: warning
    type: count
    group_by: [record.action_id]
    condition: record.status == "error"
    threshold: 2
    window: 10s
    message: "{{ record.action_id }}"
""")
    span = Spans()
    times = [0, 1, 2, 3, 4, 30, 31, 32]
    items = [span(t, action_id="a", status="error") for t in times]
    out, _ = run(rules, items)
    # Crossing at the 3rd error (t=2); still above until the window empties; crossing again at t=32.
    assert [v.time_ns for v in out] == [T0 + 2 * S, T0 + 32 * S]


def test_expression_error_is_counted_not_fatal(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rules = rules_from(tmp_path, HEADER + """
  - id: E1
    name: reads-missing
    severity: info
    condition: record.attempts > 1
    message: "x"
""")
    with caplog.at_level(logging.WARNING):
        out, engine = run(rules, [log_line(1), log_line(2, attempts=2), log_line(3)])
    assert [v.line for v in out] == [2]
    assert engine.summary().rule_errors == {"E1": 2}
    assert "E1" in caplog.text


def test_duplicate_delivery_is_skipped_and_counted(tmp_path: Path) -> None:
    rules = rules_from(tmp_path, SEQUENCE)
    span = Spans()
    first = span(0, action_id="a")
    copy = Action(record=dict(first.record), source="span", origin="again", time_ns=first.time_ns,
                  seq=99, delivery_key=first.delivery_key)
    tm = Telemetry()
    engine = Engine(rules, EngineOptions(), telemetry=tm)
    out = engine.submit_many([first, copy])
    out += engine.finish()
    assert out == []
    assert (engine.duplicates, engine.actions_seen) == (1, 2)
    assert engine.summary().actions_evaluated == 1
    assert tm.registry.get_sample_value("durable_check_spans_duplicate_total") == 1


def test_late_span_is_counted_and_still_evaluated(tmp_path: Path) -> None:
    rules = rules_from(tmp_path, SEQUENCE)
    span = Spans()
    tm = Telemetry()
    engine = Engine(rules, EngineOptions(allowed_lateness_s=5), telemetry=tm)
    opener = span(0, action_id="a")
    ahead = span(100, session="other")
    late = span(1, action_id="a")
    out = engine.submit_many([opener, ahead, late]) + engine.finish()
    assert engine.late == 1
    assert [v.span_id for v in out] == [late.record["span_id"]]
    assert tm.registry.get_sample_value("durable_check_spans_late_total") == 1


def test_telemetry_counts_actions_and_violations(tmp_path: Path) -> None:
    rules = rules_from(tmp_path, SEQUENCE)
    tm = Telemetry()
    engine = Engine(rules, EngineOptions(), telemetry=tm)
    engine.submit_many([log_line(1, action_id="a", service="agent"), log_line(2, action_id="a", service="agent"),
                        log_line(3, kind="made-up-kind")])
    get = tm.registry.get_sample_value
    assert get("durable_check_actions_total", {"kind": "tool_call", "status": "ok", "service": "agent"}) == 2
    assert get("durable_check_actions_total", {"kind": "other", "status": "ok", "service": "unknown"}) == 1
    assert get("durable_check_violations_total", {"rule": "Q1", "severity": "error", "service": "agent"}) == 1
    assert get("durable_check_open_sessions") == 1


def test_serve_releases_by_clock_and_fires_only_after_lateness(tmp_path: Path) -> None:
    rules = rules_from(tmp_path, ABSENCE)
    clock = [T0]
    engine = Engine(rules, EngineOptions(mode="serve", allowed_lateness_s=5), clock=lambda: clock[0])
    span = Spans()
    wait = span(0, action_id="w", workflow_state="awaiting_approval", wait_timeout_s=10)
    assert engine.submit(wait) == []
    assert engine.tick(T0 + 4 * S) == []  # still buffered: not yet allowed_lateness old
    assert engine.summary().open_waits == []
    assert engine.tick(T0 + 5 * S) == []  # released: the wait is open
    assert [w.action_id for w in engine.summary().open_waits] == ["w"]
    assert engine.tick(T0 + 14 * S) == []  # deadline 10s + lateness 5s not passed
    fired = engine.tick(T0 + 15 * S)
    assert [(v.action_id, v.time_ns) for v in fired] == [("w", T0 + 10 * S)]


def test_serve_old_dump_sent_live_raises_no_false_alarm(tmp_path: Path) -> None:
    rules = rules_from(tmp_path, ABSENCE)
    now = T0 + 86400 * S  # the spans are a day old
    clock = [now]
    engine = Engine(rules, EngineOptions(mode="serve", allowed_lateness_s=5), clock=lambda: clock[0])
    span = Spans()
    engine.submit(span(0, action_id="w", workflow_state="awaiting_approval", wait_timeout_s=10))
    clock[0] = now + 1 * S
    assert engine.tick(clock[0]) == []
    engine.submit(span(8, approval_decision="granted"))
    assert engine.tick(now + 60 * S) == []
    assert engine.summary().open_waits == []
    # Unresolved, the same old wait fires only once it was received allowed_lateness ago.
    other = Engine(rules, EngineOptions(mode="serve", allowed_lateness_s=5), clock=lambda: clock[0])
    clock[0] = now
    other.submit(Spans()(0, action_id="w", workflow_state="awaiting_approval", wait_timeout_s=10))
    assert other.tick(now + 4 * S) == []
    assert [v.action_id for v in other.tick(now + 5 * S)] == ["w"]


def test_idle_session_expires_in_replay_and_keeps_its_summary(tmp_path: Path) -> None:
    rules = rules_from(tmp_path, SEQUENCE)
    span = Spans()
    items = [span(0, session="old", action_id="a"), span(7200, session="new", action_id="b"),
             span(7300, session="old", action_id="a")]
    out, engine = run(rules, items, session_idle_timeout_s=3600, allowed_lateness_s=1)
    # The old session ended before its action came back: its state is gone, nothing repeats.
    assert out == []
    summary = engine.summary()
    assert summary.sessions_expired == 1
    ends = sorted((s.session_id, s.end, s.actions) for s in summary.sessions)
    assert ends == [("new", "open", 1), ("old", "expired", 1), ("old", "open", 1)]


def test_session_with_a_pending_deadline_does_not_expire_before_it(tmp_path: Path) -> None:
    rules = rules_from(tmp_path, ABSENCE)
    span = Spans()
    items = [span(0, session="s1", action_id="w", workflow_state="awaiting_approval", wait_timeout_s=7200),
             span(5000, session="s2"), span(9000, session="s2")]
    out, engine = run(rules, items, session_idle_timeout_s=3600, allowed_lateness_s=1)
    assert [(v.session_id, v.time_ns) for v in out] == [("s1", T0 + 7200 * S)]
    assert engine.summary().sessions_expired >= 1


def test_max_sessions_evicts_least_recently_active(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rules = rules_from(tmp_path, SEQUENCE)
    tm = Telemetry()
    engine = Engine(rules, EngineOptions(max_sessions=2), telemetry=tm)
    with caplog.at_level(logging.WARNING):
        engine.submit_many([log_line(1, session="a", action_id="x"), log_line(2, session="b"),
                            log_line(3, session="a"), log_line(4, session="c"),
                            log_line(5, session="b", action_id="x")])
    summary = engine.summary()
    assert summary.sessions_evicted == 2  # b (idle longest) when c came, then a when b came back
    assert sorted(s.session_id for s in summary.sessions if s.end == "open") == ["b", "c"]
    assert tm.registry.get_sample_value("durable_check_sessions_evicted_total") == 2
    assert "max_sessions=2" in caplog.text
    assert "x" not in caplog.text.replace("max_sessions", "")


def test_restart_on_the_same_store_resumes_waits_and_dedupe(tmp_path: Path) -> None:
    rules = rules_from(tmp_path, ABSENCE)
    store = MemoryStore()
    span = Spans()
    wait = span(0, action_id="w", workflow_state="awaiting_approval", wait_timeout_s=60)
    first = Engine(rules, EngineOptions(), store=store)
    first.submit(wait)
    second = Engine(rules, EngineOptions(), store=store)
    assert second.submit(wait) == []  # a redelivery after the restart
    assert second.duplicates == 1
    fired = second.submit(span(100, session="other")) + second.finish()
    assert [v.action_id for v in fired] == ["w"]


def test_state_round_trips_through_plain_data(tmp_path: Path) -> None:
    rules = rules_from(tmp_path, ABSENCE + SEQUENCE.removeprefix(HEADER))
    store = MemoryStore()
    engine = Engine(rules, EngineOptions(), store=store)
    span = Spans()
    engine.submit_many([span(0, action_id="w", workflow_state="awaiting_approval", wait_timeout_s=60),
                        span(1, action_id="a"), span(2, action_id="b", status="error")])
    snapshot = store.snapshot(engine.schema)
    blob = orjson.dumps(snapshot)
    plain = orjson.loads(blob)
    restored = {sid: SessionState.from_plain(engine.schema, s) for sid, s in plain["sessions"].items()}
    assert {sid: s.to_plain(engine.schema) for sid, s in restored.items()} == plain["sessions"]
    state = EngineState.from_plain(plain["engine"])
    assert orjson.loads(orjson.dumps(state.to_plain())) == plain["engine"]
    assert len(state.buffer) == 3  # all within the lateness: still buffered
    assert plain["timers"] == []  # the wait opens only once released


def test_buffer_bound_forces_the_watermark(tmp_path: Path) -> None:
    rules = rules_from(tmp_path, SEQUENCE)
    span = Spans()
    engine = Engine(rules, EngineOptions(allowed_lateness_s=3600, max_buffered_per_session=2))
    out = engine.submit_many([span(0, action_id="a"), span(1, action_id="a"), span(2, action_id="a")])
    # The third span pushed the first out of the buffer (the watermark moved to it); it opened the sequence.
    assert out == []
    assert engine.watermark_ns == T0
    assert engine.summary().actions_evaluated == 3  # every span is counted when accepted
    out = engine.finish()
    assert len(out) == 2


def test_group_bound_drops_the_oldest_group(tmp_path: Path) -> None:
    rules = rules_from(tmp_path, SEQUENCE)
    lines = [log_line(1, action_id="a"), log_line(2, action_id="b"), log_line(3, action_id="c"),
             log_line(4, action_id="a"), log_line(5, action_id="c")]
    out, engine = run(rules, lines, max_groups_per_rule=2)
    # c pushed a out, so a came back as a new opener (pushing b out); only c repeats.
    assert [v.line for v in out] == [5]
    assert engine.summary().groups_dropped == 2


def test_strict_only_rules_run_only_in_strict_mode(tmp_path: Path) -> None:
    rules: RuleSet = rules_from(tmp_path, HEADER + """
  - id: S1
    name: strict
    severity: info
    strict_only: true
    condition: "true"
    message: "x"
""")
    assert run(rules, [log_line(1)])[0] == []
    assert len(run(rules, [log_line(1)], strict=True)[0]) == 1


def test_restart_under_other_rules_keeps_the_state_of_rules_that_remain(tmp_path: Path) -> None:
    store = MemoryStore()
    both = rules_from(tmp_path, ABSENCE + SEQUENCE.removeprefix(HEADER), name="both.yaml")
    first = Engine(both, EngineOptions(), store=store)
    first.submit_many([log_line(1, action_id="a"), log_line(2, action_id="w", workflow_state="awaiting_approval")])
    only_sequence = rules_from(tmp_path, SEQUENCE, name="only.yaml")
    second = Engine(only_sequence, EngineOptions(), store=store)
    out = second.submit(log_line(3, action_id="a"))
    assert [(v.rule, v.line) for v in out] == [("Q1", 3)]
    assert second.summary().open_waits == []  # W1 is gone, and its wait with it


def test_engine_options_are_validated() -> None:
    with pytest.raises(ValueError, match="allowed_lateness_s must be >= 0; max_sessions must be >= 1"):
        EngineOptions(allowed_lateness_s=-1, max_sessions=0)


def test_serve_session_expires_by_the_clock(tmp_path: Path) -> None:
    rules = rules_from(tmp_path, SEQUENCE)
    clock = [T0]
    engine = Engine(rules, EngineOptions(mode="serve", session_idle_timeout_s=600), clock=lambda: clock[0])
    engine.submit(log_line(1, action_id="a"))
    assert engine.tick(T0 + 599 * S) == []
    assert engine.summary().sessions_expired == 0
    engine.tick(T0 + 601 * S)
    summary = engine.summary()
    assert summary.sessions_expired == 1
    assert summary.sessions == []  # serve keeps no summaries of ended sessions
    clock[0] = T0 + 700 * S
    assert engine.submit(log_line(2, action_id="a")) == []  # a new session: nothing to repeat


def test_summary_text_and_json(tmp_path: Path) -> None:
    rules = rules_from(tmp_path, ABSENCE + SEQUENCE.removeprefix(HEADER))
    span = Spans()
    items = [span(0, session="quiet", action_id="q"),
             span(1, session="busy", action_id="w", workflow_state="awaiting_approval", wait_timeout_s=600),
             span(2, session="busy", action_id="w", kind="tool_call")]
    _, engine = run(rules, [*items, items[0]])
    summary = engine.summary()
    lines = summary.text_lines()
    assert lines[0] == "session busy: 2 action(s) [tool_call×2], 1 violation(s) [Q1×1], 1 open wait(s)"
    assert lines[1] == "session quiet: 1 action(s) [tool_call×1]"
    assert lines[2] == "open wait: W1 session busy action w in awaiting_approval until 2026-11-01T09:24:01Z"
    assert lines[3] == "sessions: 2 session(s), 3 action(s) evaluated, 1 duplicate deliveries skipped, 1 open wait(s)"
    doc = orjson.loads(orjson.dumps(summary.to_json()))
    assert doc["violations_by_rule"] == {"Q1": 1}
    assert doc["duplicates"] == 1
    assert doc["open_waits"] == [{"rule": "W1", "session_id": "busy", "action_id": "w",
                                  "deadline_unix_nano": T0 + 601 * S, "started_unix_nano": T0 + S,
                                  "state": "awaiting_approval"}]
    assert [s["session_id"] for s in doc["sessions"]] == ["busy", "quiet"]


def test_memory_store_timers() -> None:
    from processor.state.base import TimerEntry

    store = MemoryStore()
    store.put_timer(TimerEntry(30, "s1", "W1", "a"))
    store.put_timer(TimerEntry(10, "s2", "W1", ("x", 1)))
    store.put_timer(TimerEntry(20, "s1", "W2", ""))
    store.put_timer(TimerEntry(40, "s1", "W1", "a"))  # moves the first timer
    store.remove_timer("s1", "W2", "")
    assert (store.next_due(), store.timer_count()) == (10, 2)
    assert store.pop_due(35) == [TimerEntry(10, "s2", "W1", ("x", 1))]
    assert store.pop_due(35) == []
    store.delete_session("s1")
    assert (store.next_due(), store.timer_count()) == (None, 0)
    for n in range(200):  # lazy deletion stays bounded
        store.put_timer(TimerEntry(n, "s3", "W1", "k"))
    assert store.timer_count() == 1
    assert store.pop_due(1_000) == [TimerEntry(199, "s3", "W1", "k")]


def test_session_state_layout_round_trips(tmp_path: Path) -> None:
    rules = rules_from(tmp_path, SEQUENCE)
    engine = Engine(rules, EngineOptions())
    schema = engine.schema
    session = SessionState("s")
    for n in range(70):  # past the packed delivery-key set
        assert session.check_seen(n * 7919, limit=1000) is False
    assert session.check_seen(7919, limit=1000) is True
    session.count_kind("write")
    session.count_kind("write")
    session.count_kind("email")
    session.put_group(0, key_digest("a"), ("tool_call",), schema.width, 10)
    session.put_group(0, key_digest("b"), ("write",), schema.width, 10)
    session.drop_group(0, key_digest("a"))
    plain = orjson.loads(orjson.dumps(session.to_plain(schema)))
    back = SessionState.from_plain(schema, plain)
    assert back.to_plain(schema) == plain
    assert back.kinds_dict() == {"write": 2, "email": 1}
    assert back.get_group(0, key_digest("b")) == ("write",)
    assert back.check_seen(69 * 7919, limit=1000) is True
