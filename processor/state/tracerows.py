"""What recent traces named (the engine's identity state), one row per trace, written by difference.

The engine remembers, per recent trace, the session it names, its ancestors, the tool
calls it requested and the spans held until the session is known: thousands of traces
at full rate (they are kept for twice the allowed lateness), a megabyte of plain data.
Kept inside the engine's row it was written whole at every commit, twenty times a
second. Each trace is now a row of ``engine_traces``; a commit writes the traces the
engine changed and deletes those it forgot.

A trace's plain form is cached by the engine until the trace changes, so "unchanged"
is "the same object as the one written". Traces are ordered (the least recently
touched is forgotten first) and a touched trace becomes the newest, so, as for a
session's groups (:mod:`processor.state.sessionrows`), each row carries a position
from a counter that only grows, and a trace is rewritten when it moved.

Comparing every recent trace at every commit still cost a pass over thousands of them
in Python, most of a commit's cost when commits are frequent and small (serve's evaluator
paced at 3,000 spans/s spent 14% more CPU per span with it). The engine therefore also notes
which traces it changed and forgot since the last write (``IdentityState.take_changes``):
when the changed ones are the newest, as they are when every change touches its trace,
:meth:`StoredTraces.plan_changes` writes exactly what :meth:`StoredTraces.plan` would,
from those alone. A trace changed in place (its held spans released by the clock) is
not the newest; that commit compares them all.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from processor.state.sessionrows import dumps


@dataclass(slots=True)
class TraceWrite:
    puts: list[tuple[str, int, bytes]] = field(default_factory=list)  # trace id, position, body
    gone: list[str] = field(default_factory=list)
    stored: dict[str, tuple[int, object]] = field(default_factory=dict)
    next_ord: int = 0
    # True: ``stored`` holds the traces written only (plan_changes); the others stay as they are.
    partial: bool = False

    def put(self, trace_id: str, plain: Any) -> int:
        """Write ``trace_id`` as the newest row; returns its position."""
        position = self.next_ord
        self.puts.append((trace_id, position, dumps(plain)))
        self.stored[trace_id] = (position, plain)
        self.next_ord += 1
        return position


class StoredTraces:
    """Per trace id, the position of its row and the plain object written (None: read at a start)."""

    def __init__(self) -> None:
        self._traces: dict[str, tuple[int, object]] = {}
        self._next = 0

    def load(self, rows: Iterable[tuple[str, int]]) -> None:
        self._traces = {str(trace_id): (int(ord_), None) for trace_id, ord_ in rows}
        self._next = max((o for o, _ in self._traces.values()), default=-1) + 1

    def plan(self, traces: Sequence[Sequence[Any]]) -> TraceWrite:
        """The writes that make the rows hold ``traces`` ([trace id, plain] in the engine's order)."""
        write = TraceWrite(next_ord=self._next)
        old = self._traces
        last = -1
        for trace_id, plain in traces:
            had = old.get(trace_id)
            if had is not None and had[1] is plain and had[0] > last:
                write.stored[trace_id] = had
                last = had[0]
                continue
            last = write.put(trace_id, plain)
        write.gone = [trace_id for trace_id in old if trace_id not in write.stored]
        return write

    def plan_changes(self, changed: Sequence[Sequence[Any]], forgotten: Iterable[str]) -> TraceWrite:
        """What :meth:`plan` writes, from the traces changed since the last write and those forgotten.

        ``changed``: [trace id, plain] of the traces changed, which are the newest, in order. The
        others are unchanged, in the order of their rows, and their plain objects are those
        written: :meth:`plan` would keep them and write these as the newest rows, as here.
        """
        write = TraceWrite(next_ord=self._next, partial=True)
        for trace_id, plain in changed:
            write.put(trace_id, plain)
        write.gone = [t for t in forgotten if t in self._traces and t not in write.stored]
        return write

    def apply(self, write: TraceWrite) -> None:
        """The transaction that wrote ``write`` committed."""
        if write.partial:
            for trace_id in write.gone:
                del self._traces[trace_id]
            self._traces.update(write.stored)
        else:
            self._traces = write.stored
        self._next = write.next_ord
