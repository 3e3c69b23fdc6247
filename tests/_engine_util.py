"""Helpers for the engine tests: records as spans or log lines, rule files, running an engine."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from processor.evaluate.engine import Engine, EngineOptions
from processor.evaluate.model import RuleSet
from processor.evaluate.rulefmt import load_rules
from processor.records import Action, Malformed
from processor.violations import Violation

T0 = 1_793_524_440_000_000_000  # 2026-11-01T09:14:00Z
S = 1_000_000_000


class Spans:
    """Builds span-sourced Actions of one trace with distinct span ids and increasing seq."""

    def __init__(self, trace_id: str = "5b8efff798038103d269b633813fc60c") -> None:
        self.trace_id = trace_id
        self.count = 0

    def __call__(self, at_s: float, session: str = "s1", **fields: Any) -> Action:
        self.count += 1
        span_id = f"{self.count:016x}"
        record: dict[str, Any] = {"session_id": session, "status": "ok", "trace_id": self.trace_id, "span_id": span_id}
        record.update(fields)
        record.setdefault("action_id", f"a{self.count}")
        record.setdefault("kind", "tool_call")
        return Action(
            record=record,
            source="span",
            origin="test",
            time_ns=T0 + round(at_s * S),
            seq=self.count,
            delivery_key=(self.trace_id, span_id, 0),
        )


def log_line(line: int, session: str = "s1", **fields: Any) -> Action:
    record: dict[str, Any] = {"session_id": session, "status": "ok"}
    record.update(fields)
    record.setdefault("action_id", f"l{line}")
    record.setdefault("kind", "tool_call")
    return Action(record=record, source="log", origin="actions.jsonl", line=line, seq=line)


def rules_from(tmp_path: Path, text: str, name: str = "rules.yaml") -> RuleSet:
    path = tmp_path / name
    path.write_text(text)
    return load_rules([path], include_shipped=False)


def shipped() -> RuleSet:
    return load_rules([])


def run(ruleset: RuleSet, items: Iterable[Action | Malformed], **options: Any) -> tuple[list[Violation], Engine]:
    engine = Engine(ruleset, EngineOptions(**options))
    out = engine.submit_many(items)
    out += engine.finish()
    return out, engine


def by_rule(violations: Iterable[Violation], rule: str) -> list[Violation]:
    return [v for v in violations if v.rule == rule]


def fired(violations: Iterable[Violation]) -> list[tuple[str, str, str]]:
    """(rule, session, action) of each violation, sorted: what a scenario is judged on."""
    return sorted((v.rule, v.session_id, v.action_id) for v in violations)
