"""Replay's report, as text (the reference checker's shape) or as one JSON object."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

from processor.records import Action, Malformed
from processor.violations import Violation


@dataclass
class Report:
    inputs: list[str]
    actions: int = 0
    malformed: int = 0
    violations: list[Violation] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)
    summary: Any = None

    def count(self, items: Iterable[Action | Malformed]) -> None:
        for item in items:
            if isinstance(item, Action):
                self.actions += 1
            else:
                self.malformed += 1

    def add(self, violations: Iterable[Violation]) -> None:
        self.violations.extend(violations)

    def ordered(self) -> list[Violation]:
        """Input order: by input, then line (logs) or time (spans), then rule id."""
        position = {name: i for i, name in enumerate(self.inputs)}

        def key(v: Violation) -> tuple[int, int, int, str, str]:
            origin_index = position.get(v.origin, len(position))
            line = v.line if v.line is not None else 0
            return (origin_index, line, v.time_ns or 0, v.session_id, v.rule)

        return sorted(self.violations, key=key)


def _where(v: Violation, several_inputs: bool) -> str:
    if v.line is not None:
        prefix = f"{v.origin}: " if several_inputs and v.origin else ""
        return f"{prefix}line {v.line} [{v.action_id or '-'}]"
    parts = [f"session {v.session_id or '-'}", f"action {v.action_id or '-'}"]
    if v.trace_id:
        parts.append(f"trace {v.trace_id} span {v.span_id}")
    return " ".join(parts)


def render_text(report: Report) -> str:
    several = len(report.inputs) > 1
    lines = [f"{_where(v, several)}: {v.rule} {v.name}: {v.message}" for v in report.ordered()]
    lines.extend(_summary_text(report.summary))
    for problem in report.unreadable:
        lines.append(f"unreadable: {problem}")
    total = len(report.violations)
    by_rule = Counter(v.rule for v in report.violations)
    rules = ", ".join(f"{rule}×{n}" for rule, n in sorted(by_rule.items()))
    if total:
        lines.append(f"FAIL: {total} violation(s) in {report.actions} action(s) [{rules}]")
    else:
        lines.append(f"OK: {report.actions} action(s), no violations")
    return "\n".join(lines) + "\n"


def _summary_text(summary: Any) -> list[str]:
    if summary is None or not hasattr(summary, "text_lines"):
        return []
    lines: list[str] = summary.text_lines()
    return lines


def render_json(report: Report) -> str:
    doc: dict[str, Any] = {
        "inputs": report.inputs,
        "actions": report.actions,
        "malformed": report.malformed,
        "violations": [v.to_json() for v in report.ordered()],
        "unreadable": report.unreadable,
    }
    if report.summary is not None and hasattr(report.summary, "to_json"):
        doc.update(report.summary.to_json())
    return orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode() + "\n"
