"""The operator view's read model: the same answers in memory, in SQLite and in PostgreSQL (shared by replicas)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest

from processor.records import Action
from processor.state.postgres import PostgresStore
from processor.state.sqlite import SqliteStore
from processor.state.sqlstore import SqlStateStore
from processor.state.sqlviews import views_for
from processor.state.views import MAX_ACTIONS_PER_SESSION, MemoryViews, ViewBounds, ViewStore, ViolationFilter
from processor.violations import Violation
from tests.pg_support import fresh_database, pg_server

__all__ = ["pg_server"]

S = 10**9
T0 = 1_800_000_000 * S
_seq = iter(range(10**9))


def act(session: str, action: str, kind: str, state: str | None = None, at_s: float = 0, **extra: Any) -> Action:
    record: dict[str, Any] = {"session_id": session, "action_id": action, "kind": kind, "status": "ok", **extra}
    if state:
        record["workflow_state"] = state
    n = next(_seq)
    span = f"{n + 1:016x}"
    return Action(record=record, source="span", time_ns=T0 + int(at_s * S), seq=n,
                  delivery_key=(f"{n + 1:032x}", span, 0))


def violation(session: str, action: str, rule: str = "DS002", severity: str = "critical") -> Violation:
    return Violation(rule=rule, name="x", severity=severity, session_id=session, action_id=action,  # type: ignore[arg-type]
                     message=f"{rule} on {action}", violation_id=f"{rule}-{session}-{action}", time_ns=T0)


class Fixture:
    """A read model and how to write one batch to it (inside a unit of work on SQL stores)."""

    def __init__(self, views: ViewStore, store: SqlStateStore | None) -> None:
        self.views = views
        self.store = store

    def record(self, actions: list[Action], violations: Sequence[Violation] = ()) -> None:
        if self.store is None:
            self.views.record(actions, list(violations), time.time_ns())
            return
        with self.store.unit():
            self.views.record(actions, list(violations), time.time_ns())


def _fixture(backend: str, request: pytest.FixtureRequest, tmp_path: Path, **bounded: Any) -> Iterator[Fixture]:
    if backend == "memory":
        yield Fixture(MemoryViews(bounded.get("bounds", ViewBounds())), None)
        return
    store: SqlStateStore
    if backend == "sqlite":
        store = SqliteStore(tmp_path / "state.db", synchronous="normal")
    else:
        store = PostgresStore(fresh_database(request.getfixturevalue("pg_server")), replica_id="r1")
    views = views_for(store, **bounded)
    try:
        yield Fixture(views, store)
    finally:
        views.close()
        store.close()


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def model(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Fixture]:
    yield from _fixture(request.param, request, tmp_path)


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def small(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Fixture]:
    """A read model that keeps 3 sessions and 10 action rows (on SQL stores checked once 1% of a bound
    was added: here at every write, with the periodic pruning 1,000 writes away)."""
    yield from _fixture(request.param, request, tmp_path, bounds=ViewBounds(max_sessions=3, max_actions=10))


def waiting(f: Fixture, now_ns: int = T0 + 10 * S) -> list[tuple[str, str, bool]]:
    items, total = f.views.waiting(now_ns, 50, 0)
    assert total == len(items)
    return [(w["session_id"], w["state"], w["expired"]) for w in items]


def test_waits_come_and_go_with_the_latest_state(model: Fixture) -> None:
    model.record([act("s1", "plan", "tool_call", "planned", 0),
                  act("s1", "approve", "approval", "awaiting_approval", 1, wait_timeout_s=5),
                  act("s2", "call", "external_read", "waiting_on_external", 0.5),
                  act("s3", "retry", "tool_call", "retry_scheduled", 2, wait_timeout_s=3600)])
    # s1's deadline (6 s) has passed at 10 s: expired first; then the oldest.
    assert waiting(model) == [("s1", "awaiting_approval", True), ("s2", "waiting_on_external", False),
                              ("s3", "retry_scheduled", False)]
    items, _ = model.views.waiting(T0 + 10 * S, 50, 0)
    s1 = items[0]
    assert s1["deadline_ns"] == T0 + 6 * S and s1["since_ns"] == T0 + S and s1["time_left_s"] == -4.0
    assert items[1]["deadline_ns"] is None and items[1]["time_left_s"] is None
    # Pages: offset and limit across the expired and the waiting.
    assert [w["session_id"] for w in model.views.waiting(T0 + 10 * S, 2, 1)[0]] == ["s2", "s3"]
    # An older record arriving late does not undo the newer state.
    model.record([act("s3", "retry", "tool_call", "executing", 1)])
    assert ("s3", "retry_scheduled", False) in waiting(model)
    model.record([act("s1", "approve", "approval", "executing", 7, approval_decision="granted")])
    assert [w[0] for w in waiting(model)] == ["s2", "s3"]
    session = model.views.session("s1")
    assert session is not None and session["state"] == "executing" and session["wait"] is None
    assert session["actions"] == 3 and session["first_ns"] == T0 and session["last_ns"] == T0 + 7 * S


def test_a_read_model_for_the_gauges_alone_keeps_the_same_waits_and_no_actions_or_violations(
    model: Fixture,
) -> None:
    """What serve keeps when the view is not served: the open-wait gauges read the same waits."""
    model.views.waits_only = True
    model.record([act("s1", "approve", "approval", "awaiting_approval", 1, wait_timeout_s=5),
                  act("s2", "call", "external_read", "waiting_on_external", 0.5),
                  act("s3", "pay", "payment", "executing", 0.7)],
                 [violation("s3", "pay")])
    assert waiting(model) == [("s1", "awaiting_approval", True), ("s2", "waiting_on_external", False)]
    summary = model.views.wait_summary(T0 + 10 * S)
    assert summary.by_state == {"awaiting_approval": 1, "waiting_on_external": 1}
    assert summary.expired_by_state == {"awaiting_approval": 1} and summary.oldest_since_ns == T0 + S // 2
    model.record([act("s1", "approve", "approval", "executing", 7, approval_decision="granted")])
    assert waiting(model) == [("s2", "waiting_on_external", False)]
    # No row per action or per violation: that is the view's, and what made it cost.
    assert model.views.session_actions("s3") == [] and model.views.session_actions("s1") == []
    assert model.views.violations(ViolationFilter(), 50, 0) == [] and model.views.rule_counts() == []


def test_violations_are_kept_once_filtered_and_counted(model: Fixture) -> None:
    model.record([act("s1", "pay", "payment")], [violation("s1", "pay")])
    model.record([], [violation("s1", "pay"), violation("s2", "ask", "DS005", "critical"),
                      violation("s2", "call", "DS003", "error")])
    everything = model.views.violations(ViolationFilter(), 50, 0)
    assert sorted(v["violation_id"] for v in everything) == ["DS002-s1-pay", "DS003-s2-call", "DS005-s2-ask"]
    assert [v["rule"] for v in model.views.violations(ViolationFilter(rule="DS003"), 50, 0)] == ["DS003"]
    critical = model.views.violations(ViolationFilter(severity="critical"), 50, 0)
    assert {v["rule"] for v in critical} == {"DS002", "DS005"}
    assert [v["action_id"] for v in model.views.violations(ViolationFilter(session_id="s1"), 50, 0)] == ["pay"]
    assert len(model.views.violations(ViolationFilter(), 2, 0)) == 2
    assert len(model.views.violations(ViolationFilter(), 2, 2)) == 1
    counts = {(c["rule"], c["severity"]): c["count"] for c in model.views.rule_counts()}
    assert counts == {("DS002", "critical"): 1, ("DS005", "critical"): 1, ("DS003", "error"): 1}
    session = model.views.session("s2")
    assert session is not None and session["violations"] == 2


def test_actions_in_order_without_payload_and_bounded(model: Fixture) -> None:
    model.record([act("s1", "b", "payment", at_s=2, idempotency_key="secret-key-123", result={"card": "4111"}),
                  act("s1", "a", "llm_call", at_s=1, attempts=2)])
    rows = model.views.session_actions("s1")
    assert [(r["action_id"], r["keyed"], r["attempt"]) for r in rows] == [("a", False, 2), ("b", True, None)]
    stored = orjson.dumps(rows)
    assert b"secret-key-123" not in stored and b"4111" not in stored
    # A delivery seen again is not a second action row.
    again = rows[0]
    assert again["identity"].startswith("span:")
    model.record([act("s2", f"x{i}", "tool_call", at_s=i) for i in range(MAX_ACTIONS_PER_SESSION + 5)])
    kept = model.views.session_actions("s2")
    assert len(kept) == MAX_ACTIONS_PER_SESSION
    assert kept[0]["action_id"] == "x5" and kept[-1]["action_id"] == f"x{MAX_ACTIONS_PER_SESSION + 4}"
    assert model.views.session_count() == 2


def test_a_long_session_keeps_its_newest_actions_by_event_time_whatever_the_arrival_order(model: Fixture) -> None:
    import random

    n = MAX_ACTIONS_PER_SESSION + 40
    times = list(range(n))
    random.Random(7).shuffle(times)  # late and early spans mixed, as a collector delivers them
    for start in range(0, n, 60):
        model.record([act("long", f"x{t}", "tool_call", at_s=t) for t in times[start:start + 60]])
    kept = [r["action_id"] for r in model.views.session_actions("long")]
    assert kept == [f"x{t}" for t in range(40, n)]


def test_a_failed_unit_leaves_no_rows_and_a_restart_keeps_them(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "state.db", synchronous="normal")
    views = views_for(store)
    with store.unit():
        views.record([act("kept", "w", "approval", "awaiting_approval", 0, wait_timeout_s=60)], [], T0)

    class Boom(Exception):
        pass

    with pytest.raises(Boom), store.unit():
        views.record([act("lost", "w", "approval", "awaiting_approval", 0)], [violation("lost", "w")], T0)
        raise Boom
    store.reset()
    assert [w["session_id"] for w in views.waiting(T0, 10, 0)[0]] == ["kept"]
    assert views.violations(ViolationFilter(), 10, 0) == []
    views.close()
    store.close()
    reopened = SqliteStore(tmp_path / "state.db", synchronous="normal")
    again = views_for(reopened)
    try:
        assert [w["session_id"] for w in again.waiting(T0, 10, 0)[0]] == ["kept"]
    finally:
        again.close()
        reopened.close()


def test_replicas_on_postgres_each_see_every_session(pg_server: str) -> None:
    url = fresh_database(pg_server)
    stores = [PostgresStore(url, replica_id=name) for name in ("replica-a", "replica-b")]
    views = [views_for(s) for s in stores]
    try:
        for store, view, session in zip(stores, views, ("s-a", "s-b"), strict=True):
            with store.unit():
                view.record([act(session, "w", "approval", "awaiting_approval", 0, wait_timeout_s=60)],
                            [violation(session, "w", "DS106", "warning")], T0)
        for view in views:
            assert {w["session_id"] for w in view.waiting(T0, 10, 0)[0]} == {"s-a", "s-b"}
            assert {v["session_id"] for v in view.violations(ViolationFilter(), 10, 0)} == {"s-a", "s-b"}
            assert view.rule_counts() == [{"rule": "DS106", "severity": "warning", "count": 2}]
            found = view.session("s-b")
            assert found is not None and found["replica_id"] == "replica-b"
    finally:
        for view in views:
            view.close()
        for store in stores:
            store.close()


def test_idle_sessions_leave_the_sql_view_after_the_retention(tmp_path: Path) -> None:
    from processor.state.sqlviews import _PRUNE_EVERY

    store = SqliteStore(tmp_path / "state.db", synchronous="normal")
    views = views_for(store, retention_s=60)
    try:
        with store.unit():
            views.record([act("old", "w", "approval", "awaiting_approval", 0)], [], T0)
        later = T0 + 1000 * S
        with store.unit():
            for i in range(_PRUNE_EVERY - 1):
                views.record([act("new", f"a{i}", "tool_call", "executing", 1000)], [], later)
        assert views.session("old") is None and views.session_actions("old") == []
        assert views.waiting(later, 10, 0) == ([], 0)
        found = views.session("new")
        assert found is not None and found["actions"] == _PRUNE_EVERY - 1
    finally:
        views.close()
        store.close()


def _stories(f: Fixture, sessions: list[str]) -> dict[str, int]:
    """The sessions the view still knows, with their kept action rows."""
    return {s: len(f.views.session_actions(s)) for s in sessions if f.views.session(s) is not None}


def test_the_view_keeps_its_bounds_whatever_the_traffic(small: Fixture) -> None:
    names = [f"s{i}" for i in range(6)]
    small.record([act("s0", "w", "approval", "awaiting_approval", 0, wait_timeout_s=60)],
                 [violation("s0", "w", "DS106", "warning")])
    for i in range(1, 5):
        small.record([act(names[i], f"a{j}", "tool_call", at_s=10 * i + j) for j in range(4)])
    # Five sessions: the sessions bound (3) sends the two least recently active away, then the
    # action bound (10 rows) the oldest of the three left (12 rows): s3 and s4 stay, whole.
    assert _stories(small, names) == {"s3": 4, "s4": 4}
    assert small.views.session_count() == 2
    assert waiting(small, T0 + 100 * S) == []  # s0's wait left with it
    # Its violation stays: violations are bounded apart (the newest MAX_VIOLATIONS) and counted since the start.
    assert [v["session_id"] for v in small.views.violations(ViolationFilter(), 10, 0)] == ["s0"]
    assert small.views.rule_counts() == [{"rule": "DS106", "severity": "warning", "count": 1}]
    # A session seen again is active again: it stays, and the least recently active one goes.
    small.record([act("s3", "later", "tool_call", at_s=60)])
    assert _stories(small, names) == {"s3": 5, "s4": 4}
    small.record([act("s5", f"x{j}", "tool_call", at_s=61 + j) for j in range(2)])
    assert _stories(small, names) == {"s3": 5, "s5": 2}
    small.record([act("s4", "back", "tool_call", at_s=70)])
    assert _stories(small, names) == {"s3": 5, "s4": 1, "s5": 2}  # a new story: its old rows are gone


def test_the_view_bounds_are_configuration_checked_with_their_paths() -> None:
    from processor.config import ONE_SESSION_ACTIONS, UiConfig

    assert ONE_SESSION_ACTIONS == MAX_ACTIONS_PER_SESSION
    problems = UiConfig(max_sessions=0, max_actions=ONE_SESSION_ACTIONS - 1).validate("ui")
    assert [(p.where, p.message) for p in problems] == [
        ("ui.max_sessions", "must be at least 1"),
        ("ui.max_actions", f"must be at least {ONE_SESSION_ACTIONS} (one session's kept actions)"),
    ]
    assert UiConfig().validate("ui") == []


def test_serve_builds_its_view_with_the_configured_bounds(tmp_path: Path) -> None:
    """ui.max_sessions and ui.max_actions reach the view serve attaches (memory state: bounded at each batch)."""
    from processor.operate.server import attach_views
    from processor.serve import build_pipeline
    from processor.telemetry import Telemetry
    from tests.serve_support import serve_config

    config = serve_config(tmp_path, {"state": {"backend": "memory"},
                                     "ui": {"endpoint": "127.0.0.1:0", "max_sessions": 3,
                                            "max_actions": MAX_ACTIONS_PER_SESSION}})
    pipeline = build_pipeline(config, Telemetry())
    try:
        views = attach_views(config, pipeline, None)
        for i in range(4):  # 4 sessions of 200 actions: the sessions bound keeps 3, the action bound 2
            pipeline.evaluate([act(f"s{i}", f"a{j}", "tool_call", at_s=i * 1000 + j) for j in range(200)])
        assert {f"s{i}": len(views.session_actions(f"s{i}")) for i in range(4)
                if views.session(f"s{i}") is not None} == {"s2": 200, "s3": 200}
        assert not views.waits_only
        # Not served (no ui.endpoint): the same bounds, the gauges' part alone.
        unserved = attach_views(serve_config(tmp_path, {"state": {"backend": "memory"},
                                                        "ui": {"max_sessions": 3}}), pipeline, None)
        assert unserved.waits_only
    finally:
        for exporter in pipeline.exporters:
            exporter.shutdown()
