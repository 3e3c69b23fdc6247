"""The per-session violation cap forgets the sessions the engine ended (memory bounded by open sessions)."""

from __future__ import annotations

import time
from pathlib import Path

from processor.records import Action
from processor.serve import build_pipeline
from processor.telemetry import Telemetry
from processor.violation_caps import CAP_RULE, CapLimits, ViolationCaps
from processor.violations import Violation
from tests.serve_support import serve_config

_SECOND = 1_000_000_000
_T0 = 1_790_000_000 * _SECOND


def _violation(session_id: str, n: int) -> Violation:
    return Violation(rule="DS002", name="unkeyed-side-effect", severity="critical", session_id=session_id,
                     action_id=f"a{n}", message="m", violation_id=f"{session_id}-{n}")


def test_retain_forgets_the_counts_of_sessions_that_are_gone() -> None:
    caps = ViolationCaps(CapLimits(per_request=100, per_session=2, max_sessions=100))
    assert [v.rule for v in caps.apply([_violation("a", n) for n in range(4)])] == ["DS002", "DS002", CAP_RULE]
    caps.apply([_violation("b", 0)])
    assert caps.retain(lambda session_id: session_id == "a") == 1
    assert len(caps) == 1
    # "a" is still counted: capped; "b" starts again: reported.
    assert caps.apply([_violation("a", 9)]) == []
    assert [v.rule for v in caps.apply([_violation("b", n) for n in range(1, 4)])] == ["DS002", "DS002", CAP_RULE]


def _payment(session_id: str, action_id: str, at_ns: int) -> Action:
    record = {"session_id": session_id, "action_id": action_id, "kind": "payment", "status": "ok",
              "result": {"ok": True}}
    return Action(record=record, source="span", origin="test", time_ns=at_ns)


def test_a_session_the_engine_expired_is_forgotten_by_the_cap_and_counted_afresh(tmp_path: Path) -> None:
    config = serve_config(tmp_path, {"evaluate": {
        "session_idle_timeout": "10s", "allowed_lateness": "0s", "max_violations_per_session": 1,
        "include_shipped_rules": True,
    }})
    pipeline = build_pipeline(config, Telemetry())
    try:
        first = pipeline.evaluate([_payment("s1", "p1", _T0), _payment("s1", "p2", _T0 + 1)])  # capped in there
        assert [v.rule for v in first] == ["DS002", CAP_RULE]
        assert pipeline.forget_ended_sessions() == 0  # s1 is open: its count stays
        # serve's clock is the wall clock: past the idle timeout and the session's deadlines, s1 expires.
        now = time.time_ns()
        for minute in (1, 2, 3):
            pipeline.capped(pipeline.engine.tick(now + minute * 60 * _SECOND))
        assert not pipeline.engine.holds_session("s1")
        assert pipeline.forget_ended_sessions() == 1
        assert pipeline.caps is not None and len(pipeline.caps) == 0
        # The same id again is a new session to the engine, and to the cap.
        again = pipeline.evaluate([_payment("s1", "p3", now + 181 * _SECOND)])
        assert [v.rule for v in again] == ["DS002"]
    finally:
        for exporter in pipeline.exporters:
            exporter.shutdown()
