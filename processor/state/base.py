"""The StateStore interface: where the engine's state lives between records and across restarts.

The engine keeps every open session as a live :class:`~processor.state.session.SessionState`
in memory (their number is bounded by ``max_sessions``) and mutates it on its hot path;
a store is told what changed and decides how and when to make it durable.

Call pattern (all calls come from the engine's single thread):

- At start: :meth:`load_engine` once, then :meth:`load_sessions` once; the engine
  rebuilds its indexes from what they return. Timers already in the store stay there.
- While records flow: :meth:`put_timer` / :meth:`remove_timer` as waits open and close,
  :meth:`next_due` and :meth:`pop_due` to fire them. These are on the hot path (a
  ``next_due`` per released record): a durable store answers them from an in-memory
  index loaded at open and writes timer changes at the next :meth:`commit`.
- After every batch (``submit_many``, ``tick``, ``finish``): :meth:`save_session` for
  each session changed since the last commit, :meth:`delete_session` for each session
  dropped (idle expiry, eviction), :meth:`save_engine` with the engine-wide state,
  then :meth:`commit`. ``commit`` is the group-commit boundary: after it returns, a
  restart must see everything handed over before it, and nothing from a later batch
  half-applied. A store that cannot commit raises :class:`processor.errors.StateError`.

Every piece of state is plain data once converted: ``SessionState.to_plain(schema)``,
``EngineState.to_plain()`` and timer entries are made of str, int (at most 64 bits),
float, bool, None, list and dict, and ``orjson.dumps`` serializes them. Conversion is
the store's choice and happens at ``save_*`` or ``commit`` time: the in-memory store
keeps the live objects and never converts. A durable store rebuilds objects with
``SessionState.from_plain(schema, plain)`` and ``EngineState.from_plain(plain)``.
Group keys in timers are hashable; in plain form a tuple key becomes a list
(:func:`processor.state.session.group_key_from_plain` turns it back).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, NamedTuple

from processor.state.session import GroupKey, RuleSchema, SessionState


class TimerEntry(NamedTuple):
    """A timer: when it is due, and the wait it fires (session, stateful rule id, group key).

    ``due_ns`` is in the engine's timer clock: event time in replay, wall time in serve.
    A session, rule and group have at most one timer; putting another replaces it.
    """

    due_ns: int
    session_id: str
    rule_id: str
    group: GroupKey


class EngineStateLike(ABC):
    """The engine-wide state a store persists: watermark, counters and the reordering buffer."""

    @abstractmethod
    def to_plain(self) -> dict[str, Any]:
        """Plain data (see the module docstring)."""


class StateStore(ABC):
    """Persistence for the engine's sessions, timers and engine-wide state. See the module docstring."""

    @abstractmethod
    def load_engine(self) -> dict[str, Any] | EngineStateLike | None:
        """The engine-wide state saved last (plain, or the live object a memory store kept); None when empty."""

    @abstractmethod
    def save_engine(self, state: EngineStateLike) -> None:
        """Remember the engine-wide state as of the next commit (call ``state.to_plain()`` to persist it)."""

    @abstractmethod
    def load_sessions(self, schema: RuleSchema) -> Iterator[SessionState]:
        """Every saved session, least recently active first (the engine rebuilds its LRU in this order)."""

    def sessions_not_restored(self) -> int:
        """Sessions the last ``load_sessions`` found stored but could not read back (skipped, not raised)."""
        return 0

    @abstractmethod
    def save_session(self, session: SessionState, schema: RuleSchema) -> None:
        """Remember a changed session as of the next commit (``session.to_plain(schema)`` to persist it)."""

    @abstractmethod
    def delete_session(self, session_id: str) -> None:
        """Forget a session and every timer of it."""

    def forget_timers_of(self, session_id: str) -> None:  # noqa: B027 - only a shared store hands sessions over
        """A session handed to another replica: its timers leave this replica's index (not the shared state)."""

    @abstractmethod
    def put_timer(self, entry: TimerEntry) -> None:
        """Set (or move) the timer of ``(session_id, rule_id, group)``."""

    @abstractmethod
    def remove_timer(self, session_id: str, rule_id: str, group: GroupKey) -> None:
        """Clear a timer; clearing one that is not set is not an error."""

    @abstractmethod
    def next_due(self) -> int | None:
        """The earliest ``due_ns`` of all timers, or None when there are none."""

    @abstractmethod
    def pop_due(self, until_ns: int) -> list[TimerEntry]:
        """Remove and return every timer with ``due_ns <= until_ns``, earliest first (ties: any fixed order)."""

    @abstractmethod
    def timer_count(self) -> int:
        """How many timers are set."""

    @abstractmethod
    def commit(self) -> None:
        """Group-commit boundary: make everything handed over since the last commit durable, atomically."""

    def close(self) -> None:  # noqa: B027 - optional hook: stores with resources override it
        """Release resources (files, connections). The engine does not call it; its owner does."""
