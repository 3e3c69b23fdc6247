"""What the engine reports about the sessions it saw: replay's report prints these."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from processor.convert.timefmt import format_rfc3339

SessionEnd = Literal["open", "expired", "evicted"]
# Sessions (and open waits) listed in the text report; the JSON report lists every one.
TEXT_MAX_SESSIONS = 200


@dataclass(frozen=True, slots=True)
class OpenWait:
    """A wait not resolved and not yet past its deadline (or with no time deadline at all)."""

    rule: str
    session_id: str
    action_id: str
    # Event time (Unix ns) the wait ends at; None when only ``within_actions`` bounds it.
    deadline_ns: int | None
    started_ns: int | None
    # workflow_state of the waiting record, "" when it has none.
    state: str = ""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rule": self.rule, "session_id": self.session_id, "action_id": self.action_id}
        if self.deadline_ns is not None:
            out["deadline_unix_nano"] = self.deadline_ns
        if self.started_ns is not None:
            out["started_unix_nano"] = self.started_ns
        if self.state:
            out["state"] = self.state
        return out


@dataclass(slots=True)
class SessionSummary:
    session_id: str
    actions_by_kind: dict[str, int]
    violations_by_rule: dict[str, int]
    open_waits: list[OpenWait]
    # "expired": idle longer than the timeout; "evicted": dropped at the open-session bound.
    # Waits listed for an ended session were still open when it ended.
    end: SessionEnd = "open"
    # Waits of this session that fired at their deadline and were resolved later (their alert cleared).
    waits_resolved_late: int = 0

    @property
    def actions(self) -> int:
        return sum(self.actions_by_kind.values())

    @property
    def violations(self) -> int:
        return sum(self.violations_by_rule.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "end": self.end,
            "actions": self.actions,
            "actions_by_kind": dict(sorted(self.actions_by_kind.items())),
            "violations": self.violations,
            "violations_by_rule": dict(sorted(self.violations_by_rule.items())),
            "open_waits": [w.to_json() for w in self.open_waits],
            "waits_resolved_late": self.waits_resolved_late,
        }


@dataclass(slots=True)
class EngineSummary:
    """Per-session summaries (open sessions, then ended ones the engine still remembers) and totals.

    ``actions_seen`` counts every Action submitted, duplicates included;
    ``actions_evaluated`` those that reached the rules (counted when accepted: a span
    still in the reordering buffer is counted, and its condition rules ran). ``rule_errors`` counts, per rule,
    records on which one of the rule's expressions failed at run time (the rule did not
    fire on them). ``ended_sessions_dropped`` counts ended sessions whose summary was
    not kept (the list of ended sessions is bounded). ``waits_resolved_late`` counts
    waits that fired and were resolved by a later record (their violation resolved);
    ``fired_waits_dropped`` fired waits forgotten at the per-session bound (a later
    resolution of those goes unnoticed).
    """

    sessions: list[SessionSummary] = field(default_factory=list)
    actions_seen: int = 0
    actions_evaluated: int = 0
    duplicates: int = 0
    late: int = 0
    malformed: int = 0
    violations_by_rule: dict[str, int] = field(default_factory=dict)
    rule_errors: dict[str, int] = field(default_factory=dict)
    open_waits: list[OpenWait] = field(default_factory=list)
    sessions_expired: int = 0
    sessions_evicted: int = 0
    # Groups of a stateful rule dropped at the per-session bound (oldest first).
    groups_dropped: int = 0
    ended_sessions_dropped: int = 0
    waits_resolved_late: int = 0
    fired_waits_dropped: int = 0
    watermark_ns: int | None = None

    @property
    def violations(self) -> int:
        return sum(self.violations_by_rule.values())

    def to_json(self, *, sessions: bool = True) -> dict[str, Any]:
        """The totals and, unless ``sessions`` is False, the list of session summaries."""
        out: dict[str, Any] = {
            "actions_seen": self.actions_seen,
            "actions_evaluated": self.actions_evaluated,
            "duplicates": self.duplicates,
            "late": self.late,
            "malformed": self.malformed,
            "violations_by_rule": dict(sorted(self.violations_by_rule.items())),
            "rule_errors": dict(sorted(self.rule_errors.items())),
            "open_waits": [w.to_json() for w in self.open_waits],
            "sessions_expired": self.sessions_expired,
            "sessions_evicted": self.sessions_evicted,
            "groups_dropped": self.groups_dropped,
            "ended_sessions_dropped": self.ended_sessions_dropped,
            "waits_resolved_late": self.waits_resolved_late,
            "fired_waits_dropped": self.fired_waits_dropped,
        }
        if sessions:
            out["sessions"] = [s.to_json() for s in self.sessions]
        return out

    def text_lines(self, max_sessions: int = TEXT_MAX_SESSIONS) -> list[str]:
        """Replay's text report: a line per session (those with violations or open waits first), then totals."""
        ranked = sorted(self.sessions, key=lambda s: (not (s.violations or s.open_waits), s.session_id))
        lines = [_session_line(s) for s in ranked[:max_sessions]]
        if len(ranked) > max_sessions:
            lines.append(f"... {len(ranked) - max_sessions} more session(s): see the JSON report")
        for wait in self.open_waits[:max_sessions]:
            until = f"until {format_rfc3339(wait.deadline_ns)}" if wait.deadline_ns is not None else "with no deadline"
            state = f" in {wait.state}" if wait.state else ""
            lines.append(f"open wait: {wait.rule} session {wait.session_id} action {wait.action_id}{state} {until}")
        if len(self.open_waits) > max_sessions:
            lines.append(f"... {len(self.open_waits) - max_sessions} more open wait(s): see the JSON report")
        totals = [f"{len(self.sessions)} session(s)", f"{self.actions_evaluated} action(s) evaluated"]
        for label, number in (
            ("duplicate deliveries skipped", self.duplicates),
            ("late span(s)", self.late),
            ("malformed", self.malformed),
            ("open wait(s)", len(self.open_waits)),
            ("wait(s) resolved after their deadline", self.waits_resolved_late),
            ("session(s) expired", self.sessions_expired),
            ("session(s) evicted", self.sessions_evicted),
        ):
            if number:
                totals.append(f"{number} {label}")
        lines.append("sessions: " + ", ".join(totals))
        if self.rule_errors:
            errors = ", ".join(f"{rule}×{n}" for rule, n in sorted(self.rule_errors.items()))
            lines.append(f"rule errors (expression failed on a record; the rule did not fire): {errors}")
        return lines


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{name or '-'}×{n}" for name, n in sorted(counts.items()))


def _session_line(session: SessionSummary) -> str:
    text = f"session {session.session_id}"
    if session.end != "open":
        text += f" ({session.end})"
    text += f": {session.actions} action(s)"
    if session.actions_by_kind:
        text += f" [{_counts(session.actions_by_kind)}]"
    if session.violations:
        text += f", {session.violations} violation(s) [{_counts(session.violations_by_rule)}]"
    if session.open_waits:
        text += f", {len(session.open_waits)} open wait(s)"
    if session.waits_resolved_late:
        text += f", {session.waits_resolved_late} wait(s) resolved after their deadline"
    return text
