"""The operator view's read model: open waits, recent violations and session timelines.

The engine's own state is shaped for evaluation (groups, timers, kept fields), not for
questions such as "which sessions wait, oldest first". This module keeps a small read
model beside it, fed with every batch's actions and violations:

- ``view_sessions``: one row per session: first and last event time, counts, its latest
  workflow state;
- ``view_waits``: one row per session whose latest workflow state is a wait
  (``awaiting_approval``, ``waiting_on_external``, ``retry_scheduled``), with since when
  and its deadline; the row goes when a later state arrives;
- ``view_actions``: per session its last :data:`MAX_ACTIONS_PER_SESSION` actions, only the
  fields the view shows (kind, status, workflow state, attempt, key present or not);
- ``view_violations`` and ``view_rule_counts``: recent violations (the newest
  :data:`MAX_VIOLATIONS`) and counts by rule and severity since the store was created.

Whatever the traffic, the model holds at most :class:`ViewBounds` sessions and action
rows (``ui.max_sessions``, ``ui.max_actions``): past either, the least recently active
sessions leave with their actions and wait, as idle ones do after the retention.

On a SQL store the rows are written in the same transaction as the session state
(``SqlStateStore.in_unit``), so a crash keeps both or neither; reads use a connection of
their own, so the web view never waits on the evaluator's connection. On PostgreSQL the
tables are shared: every replica writes the rows of the sessions it owns, and every
replica's view shows all of them. :class:`MemoryViews` serves the in-memory state
(tests, replay, ``state.backend: memory``).

No payload goes in: only record fields the contract names, never result values or keys.
"""

from __future__ import annotations

import heapq
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from processor.records import Action
from processor.violations import Violation, record_identity

WAIT_STATES: Final = frozenset({"awaiting_approval", "waiting_on_external", "retry_scheduled"})
MAX_ACTIONS_PER_SESSION: Final = 500
MAX_VIOLATIONS: Final = 200_000
DEFAULT_MAX_SESSIONS: Final = 100_000
DEFAULT_MAX_ACTIONS: Final = 1_000_000
MAX_PAGE: Final = 200
# Pages deeper than this are refused: a bounded scan per request, whatever the store holds.
MAX_OFFSET: Final = 10_000


@dataclass(slots=True, frozen=True)
class ViewBounds:
    """How much the read model keeps, whatever the traffic (least recently active sessions leave first).

    Without them a week of churn (sessions kept for the idle timeout, up to
    MAX_ACTIONS_PER_SESSION actions each) grows the view's tables by the traffic, not by configuration.
    """

    max_sessions: int = DEFAULT_MAX_SESSIONS
    max_actions: int = DEFAULT_MAX_ACTIONS


DEFAULT_BOUNDS: Final = ViewBounds()


@dataclass(slots=True, frozen=True)
class ViolationFilter:
    rule: str = ""
    severity: str = ""
    session_id: str = ""


def _text(value: Any, limit: int = 200) -> str:
    if type(value) is not str:
        return ""
    return value if len(value) <= limit else value[:limit]


def action_row(action: Action) -> dict[str, Any]:
    """The fields of one action the view shows: no payload, and the key's presence, not its value."""
    get = action.record.get
    attempt = get("attempts")
    key = get("idempotency_key")
    return {
        "identity": record_identity(action),
        "time_ns": action.time_ns,
        "seq": action.seq,
        "action_id": _text(get("action_id")),
        "kind": _text(get("kind")),
        "status": _text(get("status")),
        "workflow_state": _text(get("workflow_state")),
        "attempt": attempt if type(attempt) is int else None,
        "keyed": bool(key) or get("replay") == "skip",
        "trace_id": _text(get("trace_id"), 64),
        "span_id": _text(get("span_id"), 32),
        "line": action.line,
        "origin": _text(action.origin, 300),
    }


def _deadline_ns(action: Action) -> int | None:
    timeout = action.record.get("wait_timeout_s")
    if action.time_ns is None or isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout < 0:
        return None
    return action.time_ns + int(timeout * 1e9)


@dataclass(slots=True)
class _SessionDelta:
    """What one batch changes in one session's summary row."""

    session_id: str
    first_ns: int | None = None
    last_ns: int | None = None
    actions: int = 0
    violations: int = 0
    service: str = ""
    trace_id: str = ""
    # The latest record (by event time) that carries a workflow state.
    state: str = ""
    state_ns: int = -1
    state_action: Action | None = None


def _deltas(actions: Sequence[Action], violations: Sequence[Violation]) -> dict[str, _SessionDelta]:
    out: dict[str, _SessionDelta] = {}
    for action in actions:
        rec = action.record
        sid = rec.get("session_id", "")
        if type(sid) is not str:
            sid = action.session_id
        d = out.get(sid)
        if d is None:
            d = out[sid] = _SessionDelta(sid, service=_text(rec.get("service")),
                                         trace_id=_text(rec.get("trace_id"), 64))
        d.actions += 1
        t = action.time_ns
        if t is not None:
            if d.first_ns is None or t < d.first_ns:
                d.first_ns = t
            if d.last_ns is None or t > d.last_ns:
                d.last_ns = t
        state = rec.get("workflow_state")
        if state and type(state) is str:
            at = t if t is not None else -1
            if at >= d.state_ns:
                d.state, d.state_ns, d.state_action = state[:64], at, action
    for v in violations:
        d = out.get(v.session_id)
        if d is None:
            d = out[v.session_id] = _SessionDelta(v.session_id)
        d.violations += 1
    return out


def wait_json(row: dict[str, Any], now_ns: int) -> dict[str, Any]:
    deadline = row.get("deadline_ns")
    row = dict(row)
    row["expired"] = deadline is not None and deadline <= now_ns
    row["time_left_s"] = None if deadline is None else round((deadline - now_ns) / 1e9, 3)
    return row


@dataclass(slots=True, frozen=True)
class WaitSummary:
    """The open waits at one instant: by workflow state, those past their deadline, the oldest."""

    by_state: dict[str, int]
    expired_by_state: dict[str, int]
    # When the longest-open wait began (expired ones included), None when nothing waits.
    oldest_since_ns: int | None

    @classmethod
    def of(cls, rows: Iterable[tuple[str, int | None, int | None]], now_ns: int) -> WaitSummary:
        """From (state, since, deadline) of each open wait."""
        by_state: dict[str, int] = {}
        expired: dict[str, int] = {}
        oldest: int | None = None
        for state, since, deadline in rows:
            by_state[state] = by_state.get(state, 0) + 1
            if deadline is not None and deadline <= now_ns:
                expired[state] = expired.get(state, 0) + 1
            if since is not None and (oldest is None or since < oldest):
                oldest = since
        return cls(by_state, expired, oldest)


class ViewStore(ABC):
    """Writes (from the evaluator's thread) and reads (from the web view's threads) of the read model.

    ``waits_only``: keep only what the open-wait gauges read (each session's latest state and
    its open wait), not the actions and violations the view's pages list. serve sets it when
    the view is not served: writing a row per action cost about a third of its evaluator's
    time (docs/performance.md, "The read model's cost when the view is off").
    """

    waits_only: bool = False

    @abstractmethod
    def record(self, actions: Sequence[Action], violations: Sequence[Violation], now_ns: int) -> None:
        """Take one batch's actions and violations (on a SQL store: inside the batch's transaction)."""

    @abstractmethod
    def waiting(self, now_ns: int, limit: int, offset: int) -> tuple[list[dict[str, Any]], int]:
        """Open waits, expired ones first (earliest deadline first), then oldest first; and their total."""

    @abstractmethod
    def violations(self, where: ViolationFilter, limit: int, offset: int) -> list[dict[str, Any]]:
        """Recent violations, newest first."""

    @abstractmethod
    def rule_counts(self) -> list[dict[str, Any]]:
        """Violations by rule and severity, most first."""

    @abstractmethod
    def session(self, session_id: str) -> dict[str, Any] | None:
        """The session's summary row, or None when the view does not know it."""

    @abstractmethod
    def session_actions(self, session_id: str) -> list[dict[str, Any]]:
        """The session's kept actions in event-time order (arrival order for ties)."""

    @abstractmethod
    def session_count(self) -> int:
        """Sessions in the read model."""

    @abstractmethod
    def wait_summary(self, now_ns: int) -> WaitSummary:
        """What ``waiting`` lists, counted: the open-wait gauges read this, so they agree with it."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the read connection."""


class MemoryViews(ViewStore):
    """The read model in memory: bounded (least recently active sessions go first)."""

    def __init__(self, bounds: ViewBounds = DEFAULT_BOUNDS) -> None:
        self._lock = threading.Lock()
        self._bounds = bounds
        self._action_rows = 0  # every session's kept actions together
        self._sessions: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._actions: dict[str, OrderedDict[str, dict[str, Any]]] = {}
        # Per session, its kept rows by event order (time, seq, identity): the oldest is dropped
        # past MAX_ACTIONS_PER_SESSION without scanning the session's rows for it.
        self._order: dict[str, list[tuple[int, int, str]]] = {}
        self._waits: dict[str, dict[str, Any]] = {}
        self._violations: deque[dict[str, Any]] = deque(maxlen=MAX_VIOLATIONS)
        self._seen: set[str] = set()
        self._counts: dict[tuple[str, str], int] = {}

    def record(self, actions: Sequence[Action], violations: Sequence[Violation], now_ns: int) -> None:
        # waits_only: sessions' states and open waits alone, no row per violation or action.
        fresh = [] if self.waits_only else [v for v in violations if v.violation_id not in self._seen]
        with self._lock:
            for d in _deltas(actions, fresh).values():
                self._apply(d)
            for action in () if self.waits_only else actions:
                kept = self._actions.setdefault(action.session_id, OrderedDict())
                row = action_row(action)
                if kept.setdefault(row["identity"], row) is not row:
                    continue  # a delivery seen again
                self._action_rows += 1
                order = self._order.setdefault(action.session_id, [])
                heapq.heappush(order, (*_action_order(row), row["identity"]))
                if len(kept) > MAX_ACTIONS_PER_SESSION:
                    del kept[heapq.heappop(order)[2]]
                    self._action_rows -= 1
            for v in fresh:
                if len(self._violations) == self._violations.maxlen:
                    self._seen.discard(self._violations[0]["violation_id"])
                self._seen.add(v.violation_id)
                self._violations.append({**v.to_json(), "created_ns": now_ns})
                key = (v.rule, v.severity)
                self._counts[key] = self._counts.get(key, 0) + 1
            bounds = self._bounds
            while self._sessions and (len(self._sessions) > bounds.max_sessions
                                      or self._action_rows > bounds.max_actions):
                sid, _ = self._sessions.popitem(last=False)
                self._action_rows -= len(self._actions.pop(sid, ()))
                self._order.pop(sid, None)
                self._waits.pop(sid, None)

    def _apply(self, d: _SessionDelta) -> None:
        row = self._sessions.pop(d.session_id, None)
        if row is None:
            row = {"session_id": d.session_id, "first_ns": d.first_ns, "last_ns": d.last_ns, "actions": 0,
                   "violations": 0, "state": "", "state_ns": -1, "service": d.service, "trace_id": d.trace_id}
        row["actions"] += d.actions
        row["violations"] += d.violations
        if d.first_ns is not None:
            row["first_ns"] = d.first_ns if row["first_ns"] is None else min(row["first_ns"], d.first_ns)
            row["last_ns"] = d.last_ns if row["last_ns"] is None else max(row["last_ns"], d.last_ns or 0)
        row["service"] = row["service"] or d.service
        row["trace_id"] = row["trace_id"] or d.trace_id
        self._sessions[d.session_id] = row  # most recently active last
        if d.state_action is not None and d.state_ns >= row["state_ns"]:
            before = row["state"]
            row["state"], row["state_ns"] = d.state, d.state_ns
            if d.state in WAIT_STATES:
                old = self._waits.get(d.session_id)
                if old is None or before != d.state:
                    self._waits[d.session_id] = _wait_row(d)
            else:
                self._waits.pop(d.session_id, None)

    def waiting(self, now_ns: int, limit: int, offset: int) -> tuple[list[dict[str, Any]], int]:
        with self._lock:
            rows = list(self._waits.values())
        rows.sort(key=lambda w: _wait_order(w, now_ns))
        return [wait_json(w, now_ns) for w in rows[offset:offset + limit]], len(rows)

    def violations(self, where: ViolationFilter, limit: int, offset: int) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        skipped = 0
        with self._lock:
            for v in reversed(self._violations):
                if (where.rule and v["rule"] != where.rule) or (where.severity and v["severity"] != where.severity) \
                        or (where.session_id and v["session_id"] != where.session_id):
                    continue
                if skipped < offset:
                    skipped += 1
                    continue
                out.append(v)
                if len(out) >= limit:
                    break
        return out

    def rule_counts(self) -> list[dict[str, Any]]:
        with self._lock:
            items = list(self._counts.items())
        return _counts_json(items)

    def session(self, session_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._sessions.get(session_id)
            return _session_json(dict(row), self._waits.get(session_id)) if row is not None else None

    def session_actions(self, session_id: str) -> list[dict[str, Any]]:
        with self._lock:
            rows = list(self._actions.get(session_id, {}).values())
        return sorted(rows, key=_action_order)

    def session_count(self) -> int:
        with self._lock:
            return len(self._sessions)

    def wait_summary(self, now_ns: int) -> WaitSummary:
        with self._lock:
            rows = [(w["state"], w.get("since_ns"), w.get("deadline_ns")) for w in self._waits.values()]
        return WaitSummary.of(rows, now_ns)

    def session_ids(self) -> list[str]:
        """Every session held, least recently active first (replay's reports list them all)."""
        with self._lock:
            return list(self._sessions)


def _wait_row(d: _SessionDelta) -> dict[str, Any]:
    action = d.state_action
    assert action is not None
    return {
        "session_id": d.session_id,
        "state": d.state,
        "action_id": _text(action.record.get("action_id")),
        "kind": _text(action.record.get("kind")),
        "since_ns": action.time_ns,
        "deadline_ns": _deadline_ns(action),
        "service": d.service,
        "trace_id": _text(action.record.get("trace_id"), 64),
    }


def _wait_order(w: dict[str, Any], now_ns: int) -> tuple[int, int, int]:
    deadline = w.get("deadline_ns")
    if deadline is not None and deadline <= now_ns:
        return (0, deadline, 0)
    since = w.get("since_ns")
    return (1, since if since is not None else 0, 0)


def _action_order(row: dict[str, Any]) -> tuple[int, int]:
    t = row.get("time_ns")
    return (t if t is not None else 0, int(row.get("seq") or 0))


def _session_json(row: dict[str, Any], wait: dict[str, Any] | None) -> dict[str, Any]:
    row.pop("state_ns", None)
    row["wait"] = wait
    return row


def _counts_json(items: list[tuple[tuple[str, str], int]]) -> list[dict[str, Any]]:
    items.sort(key=lambda kv: (-kv[1], kv[0]))
    return [{"rule": rule, "severity": severity, "count": n} for (rule, severity), n in items]
