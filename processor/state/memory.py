"""The in-memory StateStore: replay and tests. Nothing survives the process.

It keeps the engine's live objects as they are (no conversion to plain data), so its
cost on the hot path is a dict assignment per changed session and a heap push per timer.
An engine built again on the same store instance resumes where the first one stopped,
which is how tests exercise restore without a database.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from typing import Any

from processor.state.base import EngineStateLike, StateStore, TimerEntry
from processor.state.session import GroupKey, RuleSchema, SessionState

_TimerId = tuple[str, str, GroupKey]


class MemoryStore(StateStore):
    def __init__(self) -> None:
        self._engine: EngineStateLike | None = None
        self._sessions: dict[str, SessionState] = {}
        # The layout the kept sessions were saved under (an engine on other rules converts them).
        self._schema: RuleSchema | None = None
        # Heap of (due, tie-breaker, id); an entry is live only while _timers[id] == due
        # (removal and replacement are lazy, checked when the entry reaches the top).
        self._heap: list[tuple[int, int, _TimerId]] = []
        self._timers: dict[_TimerId, int] = {}
        self._by_session: dict[str, set[_TimerId]] = {}
        self._tie = itertools.count()

    def load_engine(self) -> EngineStateLike | None:
        return self._engine

    def save_engine(self, state: EngineStateLike) -> None:
        self._engine = state

    def load_sessions(self, schema: RuleSchema) -> Iterator[SessionState]:
        # Least recently active first; sessions never timed keep their first-saved order.
        sessions = sorted(self._sessions.values(), key=lambda s: (s.activity_ns is not None, s.activity_ns or 0))
        saved_under = self._schema
        if saved_under is not None and saved_under != schema:
            sessions = [SessionState.from_plain(schema, s.to_plain(saved_under)) for s in sessions]
            self._sessions = {s.session_id: s for s in sessions}
            self._schema = schema
        return iter(sessions)

    def save_session(self, session: SessionState, schema: RuleSchema) -> None:
        self._schema = schema
        self._sessions[session.session_id] = session

    def delete_session(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)
        for timer_id in self._by_session.pop(session_id, ()):
            self._timers.pop(timer_id, None)

    def put_timer(self, entry: TimerEntry) -> None:
        timer_id = (entry.session_id, entry.rule_id, entry.group)
        self._timers[timer_id] = entry.due_ns
        self._by_session.setdefault(entry.session_id, set()).add(timer_id)
        heapq.heappush(self._heap, (entry.due_ns, next(self._tie), timer_id))

    def remove_timer(self, session_id: str, rule_id: str, group: GroupKey) -> None:
        timer_id = (session_id, rule_id, group)
        if self._timers.pop(timer_id, None) is not None:
            self._forget(timer_id)

    def _forget(self, timer_id: _TimerId) -> None:
        ids = self._by_session.get(timer_id[0])
        if ids is not None:
            ids.discard(timer_id)
            if not ids:
                del self._by_session[timer_id[0]]

    def _drop_stale(self) -> None:
        heap = self._heap
        timers = self._timers
        while heap and timers.get(heap[0][2]) != heap[0][0]:
            heapq.heappop(heap)
        # Lazy deletion must not let dead entries outgrow the live ones without bound.
        if len(heap) > 64 and len(heap) > 4 * len(timers):
            self._heap = [(due, next(self._tie), tid) for tid, due in timers.items()]
            heapq.heapify(self._heap)

    def next_due(self) -> int | None:
        self._drop_stale()
        return self._heap[0][0] if self._heap else None

    def pop_due(self, until_ns: int) -> list[TimerEntry]:
        out: list[TimerEntry] = []
        while True:
            self._drop_stale()
            heap = self._heap
            if not heap or heap[0][0] > until_ns:
                return out
            due, _, timer_id = heapq.heappop(heap)
            del self._timers[timer_id]
            self._forget(timer_id)
            out.append(TimerEntry(due, *timer_id))

    def timer_count(self) -> int:
        return len(self._timers)

    def commit(self) -> None:
        """Nothing to flush: the live objects are the state."""

    def snapshot(self, schema: RuleSchema) -> dict[str, Any]:
        """Everything as plain data (what a durable store would write); for tests and debugging."""
        engine = self._engine.to_plain() if self._engine is not None else None
        return {
            "engine": engine,
            "sessions": {sid: s.to_plain(schema) for sid, s in self._sessions.items()},
            "timers": sorted(
                ([due, *tid[:2], tid[2]] for tid, due in self._timers.items()),
                key=lambda entry: (entry[0], entry[1], entry[2]),
            ),
        }
