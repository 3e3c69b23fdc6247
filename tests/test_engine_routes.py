"""Guards and routes: skipping rules a record cannot fire changes no verdict, error count or state."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from processor.evaluate.cel import Environment, compile_expression
from processor.evaluate.engine import Engine, EngineOptions
from processor.state.memory import MemoryStore
from tests._engine_util import Spans, log_line, rules_from, run, shipped

HEADER = "version: 1\nlists:\n  money: [payment, refund]\nrules:\n"

ENV = Environment(variables={"record": "map", "meta": "map", "first": "map"},
                  constants={"lists": {"money": ["payment", "refund"]}})


def refuted(source: str, record: dict[str, Any], source_kind: str = "span") -> bool | None:
    """None when the expression has no guard at all."""
    guard = compile_expression(source, ENV).guard
    if guard is None:
        return None
    return guard.refuted({"record": record, "meta": {"source": source_kind}})


@pytest.mark.parametrize(
    ("source", "record", "expected"),
    [
        ('record.kind == "payment"', {"kind": "write"}, True),
        ('record.kind == "payment"', {"kind": "payment"}, False),
        ('record.kind == "payment"', {}, False),  # an error, not false: never refuted
        ('record.kind == "payment"', {"kind": 3}, False),  # not a string: left to the expression
        ('"payment" == record.kind', {"kind": "write"}, True),
        ("record.kind in lists.money", {"kind": "write"}, True),
        ("record.kind in lists.money", {"kind": "refund"}, False),
        ('record.kind in ["a", "b"]', {"kind": "c"}, True),
        ("has(record.x) && record.x > 1", {}, True),
        ("has(record.x) && record.x > 1", {"x": 0}, False),
        ('has(record.x) || record.kind == "a"', {"kind": "b"}, True),
        ('has(record.x) || record.kind == "a"', {"kind": "a"}, False),
        ('has(record.x) || record.y > 1', {}, None),  # one unknown disjunct: no guard
        ("!has(record.x)", {"x": 1}, True),
        ("!has(record.x)", {}, False),
        ('record.kind != "a"', {"kind": "a"}, True),
        ('record.kind != "a"', {"kind": "b"}, False),
        ("!(record.kind in lists.money)", {"kind": "refund"}, True),
        ("!(record.kind in lists.money)", {"kind": "write"}, False),
        ("!(record.kind in lists.money)", {"kind": 1}, False),
        ("!(has(record.x) && has(record.y))", {"x": 1, "y": 2}, None),  # De Morgan is not applied
        ('meta.source == "span" && has(record.x)', {"x": 1}, False),
        ('meta.source == "log" && has(record.x)', {"x": 1}, True),
        ('first.kind == "a" && has(record.x)', {"x": 1}, False),  # first is absent here: unknown
        ("record.kind", {"kind": "a"}, None),
    ],
)
def test_guards_refute_only_what_is_certainly_false(source: str, record: dict[str, Any], expected: bool | None) -> None:
    assert refuted(source, record) is expected
    if expected:
        # Refuted means the expression itself evaluates to false there, not to an error.
        activation = {"record": record, "meta": {"source": "span"}, "first": {}}
        assert compile_expression(source, ENV).evaluate(activation) is False


def test_field_path_marks_a_plain_field_read() -> None:
    assert compile_expression("record.action_id", ENV).path == ("record", "action_id")
    assert compile_expression("string(record.plan_version)", ENV).path is None
    assert compile_expression("lists.money", ENV).path is None


def test_rule_errors_are_counted_as_before_when_rules_are_skipped(tmp_path: Path) -> None:
    rules = rules_from(tmp_path, HEADER + """
  - id: E1
    name: error-in-filter
    severity: warning
    type: sequence
    condition: record.attempts > 1
    group_by: [record.action_id]
    first: record.kind == "payment"
    then: record.kind == "refund"
    message: "x"
  - id: E2
    name: error-in-key
    severity: warning
    type: absence
    group_by: [record.plan_version]
    first: record.kind == "payment"
    then: record.kind == "refund"
    within_actions: 1
    message: "x"
""")
    # No attempts (E1's filter fails) and no plan_version (E2's key fails): both count an error on
    # every record, even those whose kind their guards rule out.
    out, engine = run(rules, [log_line(1, kind="write"), log_line(2, kind="payment"), log_line(3, kind="read")])
    assert out == []
    assert engine.summary().rule_errors == {"E1": 3, "E2": 3}


def test_records_of_one_shape_share_a_route_and_unhashable_values_still_work(tmp_path: Path) -> None:
    rules = rules_from(tmp_path, HEADER + """
  - id: C1
    name: money-kind
    severity: warning
    condition: record.kind in lists.money && record.status == "ok"
    message: "{{ record.action_id }}"
""")
    items = [log_line(1, kind="payment"), log_line(2, kind="payment", status="error"), log_line(3, kind="write"),
             log_line(4, kind=["payment"]), log_line(5, kind="refund"), log_line(6, kind="payment")]
    out, _ = run(rules, items)
    assert [v.action_id for v in out] == ["l1", "l5", "l6"]


def test_a_sequence_with_state_still_sees_records_its_guards_allow(tmp_path: Path) -> None:
    rules = rules_from(tmp_path, HEADER + """
  - id: Q1
    name: refund-after-payment
    severity: warning
    type: sequence
    first: record.kind == "payment"
    then: record.kind == "refund"
    message: "{{ record.action_id }} after {{ first.action_id }}"
""")
    items = [log_line(1, kind="write"), log_line(2, kind="payment"), log_line(3, kind="write"),
             log_line(4, kind="refund"), log_line(5, kind="refund")]
    out, _ = run(rules, items)
    assert [v.message for v in out] == ["l4 after l2", "l5 after l2"]


def test_kept_fields_keep_their_type(tmp_path: Path) -> None:
    # (1,) == (True,): a cache of kept fields keyed by equality alone would hand one group the other's value.
    rules = rules_from(tmp_path, HEADER + """
  - id: T1
    name: flagged-then-repeated
    severity: warning
    type: sequence
    group_by: [record.action_id]
    first: has(record.replayed)
    then: first.replayed == true
    message: "{{ record.action_id }}"
""")
    items = [log_line(1, action_id="a", replayed=1), log_line(2, action_id="b", replayed=True),
             log_line(3, action_id="a"), log_line(4, action_id="b")]
    out, _ = run(rules, items)
    assert [v.line for v in out] == [4]


class Unrouted(Engine):
    """The engine with every rule on every record: what routes must agree with."""

    def _route(self, record: Any) -> Any:
        route = super()._route(record)
        route.conditions = tuple(self._condition_plans)
        route.stateful = tuple((plan, handler, False, True, True, None) for plan, handler in self._stateful_runs)
        return route


def test_shipped_packs_give_the_same_verdicts_with_and_without_routes() -> None:
    rng = random.Random(7)
    span = Spans()
    menu: list[dict[str, Any]] = [
        {"kind": "payment", "idempotency_key": "k", "plan_version": "v2"},
        {"kind": "payment", "plan_version": "v1", "side_effects": True},
        {"kind": "approval", "approval_decision": "granted", "plan_version": "v1"},
        {"kind": "approval", "approval_decision": "denied", "plan_version": "v2"},
        {"kind": "llm_call"},
        {"kind": "user_prompt", "result": None},
        {"kind": "approval", "workflow_state": "awaiting_approval", "wait_timeout_s": 30},
        {"kind": "tool_call", "status": "error", "retryable": True, "attempts": 3, "max_attempts": 3},
        {"kind": "tool_call", "workflow_state": "executing", "plan_version": "v2"},
        {"kind": "external_read", "cacheable": True},
        {"kind": "checkpoint"},
        {"kind": "write", "status": "OK", "replayed": True},
    ]
    items = []
    for n in range(600):
        fields = dict(rng.choice(menu))
        action_id = f"a{rng.randrange(40)}"
        items.append(span(n * 3 + rng.random(), session=f"s{rng.randrange(4)}", action_id=action_id, **fields))
    routed, routed_engine = run(shipped(), items, allowed_lateness_s=5, strict=True)
    reference = Unrouted(shipped(), EngineOptions(allowed_lateness_s=5, strict=True))
    expected = reference.submit_many(items) + reference.finish()
    assert [(v.rule, v.violation_id, v.message) for v in routed] == [
        (v.rule, v.violation_id, v.message) for v in expected
    ]
    assert routed_engine.summary().to_json() == reference.summary().to_json()
    assert routed_engine.take_resolutions() == reference.take_resolutions()
    assert {v.rule for v in routed} >= {"DS001", "DS002", "DS009", "DS101", "DS107", "DS108", "DS110"}


def test_a_busy_session_counts_kinds_past_the_shared_tuples() -> None:
    from processor.state.session import BUSY_COUNT, SessionState

    span = Spans()
    items = [span(n, action_id=f"a{n}", kind="tool_call" if n % 3 else "llm_call", result=None) for n in range(60)]
    store = MemoryStore()
    engine = Engine(shipped(), EngineOptions(), store=store)
    engine.submit_many(items)
    engine.finish()
    counts = {"tool_call": 40, "llm_call": 20}
    assert engine.summary().sessions[0].actions_by_kind == counts
    assert max(counts.values()) > BUSY_COUNT
    plain = store.snapshot(engine.schema)["sessions"]["s1"]
    assert plain["kinds"] == counts
    restored = SessionState.from_plain(engine.schema, plain)
    restored.count_kind("llm_call")
    assert restored.kinds_dict() == {"tool_call": 40, "llm_call": 21}


def test_a_field_of_many_values_compared_with_a_literal_does_not_multiply_shapes(tmp_path: Path) -> None:
    rules = rules_from(tmp_path, HEADER + """
  - id: K1
    name: key-set
    severity: warning
    condition: has(record.idempotency_key) && record.idempotency_key != "" && record.kind == "payment"
    message: "{{ record.action_id }}"
""")
    items = [log_line(n, kind="payment", idempotency_key=f"key-{n}") for n in range(1, 101)]
    items.append(log_line(101, kind="payment", idempotency_key=""))
    out, engine = run(rules, items)
    assert len(out) == 100
    # Every key is "a string other than the literal": one shape, plus the empty key's.
    assert len(engine._routes) == 2


def test_payload_keys_and_their_order_do_not_make_shapes() -> None:
    """Records that differ only in keys no guard reads, or in key order, share one route."""
    rng = random.Random(3)
    items = []
    for n in range(1, 401):
        payload = {f"extra_{rng.randrange(1000)}": n for _ in range(rng.randrange(4))}
        fields: dict[str, Any] = {"kind": "llm_call", "result": None, **payload}
        keys = list(fields)
        rng.shuffle(keys)
        items.append(log_line(n, **{key: fields[key] for key in keys}))
    out, engine = run(shipped(), items)
    assert out == []
    assert len(engine._routes) == 1
    # The same records through the engine that runs every rule on every record: the same verdicts.
    flawed = [log_line(n, kind="llm_call", **{f"p{n % 7}": 1}) for n in range(1, 50)]
    routed, _ = run(shipped(), flawed)
    reference = Unrouted(shipped(), EngineOptions())
    expected = reference.submit_many(flawed) + reference.finish()
    assert [(v.rule, v.violation_id) for v in routed] == [(v.rule, v.violation_id) for v in expected]
    assert {v.rule for v in routed} == {"DS001"}
