"""A wait that expired in silence raises an alert; when it finally resolves, the alert ends.

The whole path runs for real: the engine with the shipped rules, the pipeline, the
Alertmanager exporter and a real Alertmanager on 127.0.0.1.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from exporters import AlertmanagerConfig, AlertmanagerExporter
from processor.configfmt import Duration
from processor.evaluate.engine import Engine, EngineOptions
from processor.evaluate.rulefmt import load_rules
from processor.pipeline import Pipeline
from processor.records import Action
from processor.telemetry import Telemetry
from tests.servers import alertmanager_server, wait_until

SECOND = 1_000_000_000


def _alerts(url: str, *, active: bool) -> dict[str, dict[str, Any]]:
    params = {"active": str(active).lower(), "silenced": "false", "inhibited": "false"}
    response = httpx.get(f"{url}/api/v2/alerts", params=params, timeout=5)
    response.raise_for_status()
    return {a["labels"]["violation_id"]: a for a in response.json() if a["labels"].get("rule") == "DS107"}


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[str]:
    with alertmanager_server(tmp_path / "alertmanager") as am:
        yield am.url


def _span(seq: int, time_ns: int, **fields: Any) -> Action:
    record = {"session_id": "s-wait", "status": "ok", "trace_id": "ab" * 16, "span_id": f"{seq:016x}", **fields}
    return Action(record=record, source="span", time_ns=time_ns, seq=seq, delivery_key=("ab" * 16, f"{seq:016x}", 0))


@pytest.mark.servers
def test_an_expired_wait_alerts_and_its_late_approval_ends_the_alert(alertmanager: str) -> None:
    telemetry = Telemetry()
    exporter = AlertmanagerExporter(
        AlertmanagerConfig(url=alertmanager, resend_interval=Duration(1.0), resolve_after=Duration(0)), telemetry
    )
    engine = Engine(load_rules([]), EngineOptions(allowed_lateness_s=0.0, mode="replay"))
    pipeline = Pipeline(engine, [exporter], telemetry)
    t0 = time.time_ns() - 600 * SECOND
    try:
        waiting = _span(1, t0, action_id="approve-1", kind="approval", result=None,
                        workflow_state="awaiting_approval", wait_timeout_s=60, plan_version="v1")
        # Something else happens in the session two minutes later: the wait is overdue.
        later = _span(2, t0 + 120 * SECOND, action_id="read-1", kind="external_read", result=None)
        fired = pipeline.process([waiting, later])
        [expired] = [v for v in fired if v.rule == "DS107"]
        assert expired.action_id == "approve-1"
        wait_until(lambda: expired.violation_id in _alerts(alertmanager, active=True), timeout_s=15,
                   what="the DS107 alert in Alertmanager")

        # The approval finally arrives: the condition clears and the alert must end.
        approved = _span(3, t0 + 180 * SECOND, action_id="approve-1", kind="approval", result=None,
                         approval_decision="granted", plan_version="v1", workflow_state="completed")
        assert [v.rule for v in pipeline.process([approved])] == []

        def ended() -> bool:
            return expired.violation_id not in _alerts(alertmanager, active=True)

        wait_until(ended, timeout_s=15, what="the DS107 alert resolved")
        assert engine.take_resolutions() == []  # handed over once, not again
    finally:
        exporter.shutdown(2.0)


def test_a_wait_resolved_in_time_hands_no_resolution() -> None:
    handed: list[list[str]] = []

    class Recorder:
        name = "recorder"
        wants_actions = False

        def export(self, violations: Any) -> None:
            pass

        def resolve(self, violation_ids: Any) -> None:
            handed.append(list(violation_ids))

        def export_actions(self, actions: Any) -> None:
            pass

        def shutdown(self, timeout_s: float = 5.0) -> None:
            pass

    engine = Engine(load_rules([]), EngineOptions(allowed_lateness_s=0.0, mode="replay"))
    pipeline = Pipeline(engine, [Recorder()])
    t0 = 1_790_000_000 * SECOND
    waiting = _span(1, t0, action_id="approve-1", kind="approval", result=None,
                    workflow_state="awaiting_approval", wait_timeout_s=60, plan_version="v1")
    approved = _span(2, t0 + 30 * SECOND, action_id="approve-1", kind="approval", result=None,
                     approval_decision="granted", plan_version="v1", workflow_state="completed")
    assert [v.rule for v in pipeline.process([waiting, approved])] == []
    pipeline.finish()
    assert handed == []
