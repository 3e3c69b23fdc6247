"""What the SQLite and PostgreSQL stores share: the tables, plain-data conversion, and units of work.

The engine hands a store its changed sessions, timers and engine-wide state at the
end of every batch and calls ``commit()``. A durable store keeps those changes pending
in memory and writes them in one transaction. Timers are answered from an in-memory
index (a :class:`~processor.state.memory.MemoryStore` used only for its timer heap)
loaded at open, because the engine asks for the next due timer once per record.

**Units of work.** Serve wants more than the engine's state in one transaction: the
inbox journal entries that produced it are marked done, and the violations found go
into the outbox, so that a crash either keeps all of it or none. Inside
``with store.unit():`` the engine's ``commit()`` only stages its changes; operations
added with :meth:`SqlStateStore.in_unit` run in the same transaction when the unit
ends. Outside a unit ``commit()`` writes at once, as the interface says.

**After a failed write** (disk full, lost connection, a session taken by another
replica) the transaction is rolled back, but the engine's live objects are already
ahead of the database. :attr:`SqlStateStore.stale` is then true; the owner calls
:meth:`reset` and builds a new engine on the store, which loads the last committed
state. The inbox journal still holds the requests whose effects were lost, and they
are evaluated again.

Every statement is written with ``?`` placeholders; the PostgreSQL store rewrites them.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from abc import abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson

from processor.errors import StateError
from processor.state.base import EngineStateLike, StateStore, TimerEntry
from processor.state.bufferrows import BufferSegments, BufferWrite, live_entries
from processor.state.memory import MemoryStore
from processor.state.session import GroupKey, RuleSchema, SessionState, group_key_from_plain, group_key_to_plain
from processor.state.sessionrows import (
    SessionChange,
    SessionWrite,
    Stored,
    dumps,
    session_base,
    session_delta,
    session_plain,
)
from processor.state.tracerows import StoredTraces, TraceWrite

log = logging.getLogger(__name__)

# 5: a session delta may carry a rule's groups put and dropped (sessionrows, "groups"), which a
# build that reads version 4 would skip; version 4's rows are read as they are (a version 4
# database needs no change but its version number).
# 4: journal request bodies and buffer segment bodies are zstd frames (processor.state.compression);
# version 3's, stored as they were, are read as they are (a version 3 database needs no change but
# its version number, and a build that reads version 3 only refuses a version 4 database).
# 3: a buffered span is stored as an array of its fields (engine.buffered_rows); 2 stored it as
# an object, still read as it is (a version 2 database needs no change but its version number).
# 2: a session is a base and deltas (processor.state.sessionrows), the reordering buffer is in
# segments (processor.state.bufferrows), recent traces are rows (processor.state.tracerows);
# 1 kept each session whole (a base without deltas, as it is), each buffered span in a row and
# the traces in the engine row (read as they are), and is migrated at open.
SCHEMA_VERSION: Final = 5
# Logged at a start that skipped unreadable sessions (a count, never ids); bench.recovery reads it.
NOT_RESTORED_LOG: Final = "%d session(s) could not be restored from the state store"

# Column types per dialect: {INT} 64-bit integer, {BLOB} bytes, {SERIAL} auto-increasing key.
TABLES: Final = (
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS engine (replica_id TEXT PRIMARY KEY, body {BLOB} NOT NULL)",
    # The reordering buffer, one segment per commit that buffered spans (processor.state.bufferrows):
    # a commit writes the spans that came in one row and marks those released in a bitmap,
    # instead of a row per span in and out.
    "CREATE TABLE IF NOT EXISTS buffer_segments ("
    " replica_id TEXT NOT NULL, segment {INT} NOT NULL, first_arrival {INT} NOT NULL, last_arrival {INT} NOT NULL,"
    " arrivals {BLOB} NOT NULL, released {BLOB} NOT NULL, body {BLOB} NOT NULL, PRIMARY KEY (replica_id, segment))",
    # A session as a base row and delta rows (processor.state.sessionrows): a commit writes
    # what changed of a session, not all it holds.
    "CREATE TABLE IF NOT EXISTS sessions ("
    " session_id TEXT PRIMARY KEY, touched {INT} NOT NULL, body {BLOB} NOT NULL)",
    # What recent traces named (the engine's identity state), a row per trace (processor.state.tracerows).
    "CREATE TABLE IF NOT EXISTS engine_traces ("
    " replica_id TEXT NOT NULL, trace_id TEXT NOT NULL, ord {INT} NOT NULL, body {BLOB} NOT NULL,"
    " PRIMARY KEY (replica_id, trace_id))",
    "CREATE TABLE IF NOT EXISTS session_deltas ("
    " session_id TEXT NOT NULL, touched {INT} NOT NULL, body {BLOB} NOT NULL, PRIMARY KEY (session_id, touched))",
    "CREATE TABLE IF NOT EXISTS timers ("
    " session_id TEXT NOT NULL, rule_id TEXT NOT NULL, grp TEXT NOT NULL, due_ns {INT} NOT NULL,"
    " PRIMARY KEY (session_id, rule_id, grp))",
    # The inbox journal: requests accepted (acknowledged) and not yet evaluated.
    "CREATE TABLE IF NOT EXISTS journal ("
    " id {SERIAL}, replica_id TEXT NOT NULL, kind TEXT NOT NULL, protocol TEXT NOT NULL,"
    " origin TEXT NOT NULL, received_ns {INT} NOT NULL, seq_base {INT} NOT NULL,"
    " problems TEXT NOT NULL, size {INT} NOT NULL, body {BLOB} NOT NULL)",
    "CREATE INDEX IF NOT EXISTS journal_by_replica ON journal (replica_id, id)",
    # The transactional outbox: every violation found, once, and per exporter what is still to deliver.
    "CREATE TABLE IF NOT EXISTS outbox ("
    " seq {SERIAL}, violation_id TEXT NOT NULL UNIQUE, replica_id TEXT NOT NULL,"
    " session_id TEXT NOT NULL, created_ns {INT} NOT NULL, body {BLOB} NOT NULL)",
    "CREATE TABLE IF NOT EXISTS outbox_pending ("
    " exporter TEXT NOT NULL, seq {INT} NOT NULL, PRIMARY KEY (exporter, seq))",
    "CREATE INDEX IF NOT EXISTS outbox_pending_by_seq ON outbox_pending (seq)",
    "CREATE INDEX IF NOT EXISTS outbox_by_replica ON outbox (replica_id, seq)",
)

_TimerId = tuple[str, str, GroupKey]
UnitOp = Callable[[], None]
# An outbox row as inserted: violation id, replica id, session id, created (ns), body.
OutboxRow = tuple[str, str, str, int, bytes]


@dataclass(slots=True)
class RowsWritten:
    """Session rows one transaction wrote (what a commit cost)."""

    bases: int = 0
    deltas: int = 0
    # Groups in the rows written: every group of a base, the changed ones of a delta.
    groups: int = 0
    bytes: int = 0
    deleted_sessions: int = 0


def group_text(group: GroupKey) -> str:
    return dumps(group_key_to_plain(group)).decode()


class SqlStateStore(StateStore):
    """A StateStore on a SQL database; subclasses provide the connection and the dialect."""

    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self._timer_index = MemoryStore()
        # Live objects until the write: converted once per transaction, not once per engine batch.
        self._pending_sessions: dict[str, SessionState | None] = {}
        self._schema: RuleSchema | None = None
        self._pending_timers: dict[_TimerId, int | None] = {}
        self._pending_engine: EngineStateLike | None = None
        # Which buffered spans the database holds, in which segment.
        self._buffer = BufferSegments()
        self._traces = StoredTraces()
        self._storing_traces: TraceWrite | None = None
        self._deferring = False
        self._unit_ops: list[UnitOp] = []
        self._unit_after: list[UnitOp] = []
        self._touched = itertools.count(1)
        # Per session, what the database holds (the basis of writing only what changed), and the
        # changes to it that the transaction being written makes (applied once it committed).
        self._stored: dict[str, Stored] = {}
        self._not_restored = 0  # sessions the last load_sessions skipped
        self._storing: dict[str, Stored | None] = {}
        # The ids of the rules whose groups are written by group (RuleSchema.by_group), for this schema.
        self._by_group_schema: RuleSchema | None = None
        self._by_group: frozenset[str] = frozenset()
        self.rows_written = RowsWritten()
        self.stale = False

    # -- the dialect and the connection ---------------------------------------------------

    @abstractmethod
    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        """Run one statement; returns a cursor (``fetchall()``, ``rowcount``). Driver errors propagate."""

    @abstractmethod
    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        """Run one statement for each row."""

    @abstractmethod
    def begin(self) -> None:
        """Start a write transaction."""

    @abstractmethod
    def commit_transaction(self) -> None:
        """Make the transaction durable."""

    @abstractmethod
    def rollback(self) -> None:
        """Abandon the transaction; never raises."""

    @abstractmethod
    def has_table(self, name: str) -> bool:
        """True when the database has a table of that name."""

    @abstractmethod
    def translate(self, exc: Exception) -> StateError | None:
        """The StateError for a driver error, or None when ``exc`` is not one."""

    def create_schema(self, statements: Iterable[str], column_types: Mapping[str, str], where: str) -> None:
        """Create the tables that are missing and check the schema version, inside the caller's transaction.

        ``column_types`` fills the dialect's ``{INT}``, ``{BLOB}`` and ``{SERIAL}``; ``where`` names
        the database in the error.
        """
        for statement in statements:
            self.execute(statement.format(**column_types))
        found = self.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        if found is None:
            self.execute("INSERT INTO meta (key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        elif int(found[0]) == 1:
            self._migrate_whole_sessions(where)
        elif int(found[0]) in (2, 3, 4):
            # What changed is how new rows are written (version 3: buffered spans; 4: journal and
            # buffer bodies compressed; 5: session deltas by group); the older rows are read as they are.
            self.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),))
            log.warning("the state database %s was migrated from schema version %s to %d", where, found[0],
                        SCHEMA_VERSION)
        elif int(found[0]) != SCHEMA_VERSION:
            raise StateError(f"the state database {where} has schema version {found[0]}, which this build "
                             f"cannot read (it reads version {SCHEMA_VERSION} and migrates versions 1 to 4): run the "
                             "durable-check release that wrote it, or move the database aside to start with "
                             "empty state")

    def _migrate_whole_sessions(self, where: str) -> None:
        """Version 1: a session whole in its ``sessions`` row is a base without deltas, as it is;
        its reordering buffer's rows become segments (same transaction)."""
        if self.has_table("engine_buffer"):
            self._migrate_buffer_rows()
        self.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),))
        log.warning("the state database %s was migrated from schema version 1 to %d", where, SCHEMA_VERSION)

    def _migrate_buffer_rows(self) -> None:
        """Version 1 kept a row per buffered span: each replica's become one segment."""
        by_replica: dict[str, list[tuple[int, dict[str, Any]]]] = {}
        for replica, arrival, body in self.execute("SELECT replica_id, arrival, body FROM engine_buffer").fetchall():
            by_replica.setdefault(str(replica), []).append((int(arrival), orjson.loads(bytes(body))))
        for replica, spans in by_replica.items():
            self.insert_segment(replica, BufferSegments().plan((), spans))
        self.execute("DROP TABLE engine_buffer")

    def insert_segment(self, replica_id: str, write: BufferWrite) -> None:
        if write.insert is not None:
            self.execute(
                "INSERT INTO buffer_segments (replica_id, segment, first_arrival, last_arrival, arrivals, released,"
                " body) VALUES (?, ?, ?, ?, ?, ?, ?)", (replica_id, *write.insert),
            )

    def owned_sessions_clause(self) -> tuple[str, tuple[Any, ...]]:
        """A WHERE condition on ``session_id`` selecting the sessions this store loads (all, for one replica)."""
        return "1 = 1", ()

    def before_state_write(self, saved: Sequence[str], deleted: Sequence[str]) -> None:
        """Runs first in every write transaction (ownership checks of a shared store)."""

    def admit(self, session_ids: frozenset[str]) -> StateError | None:
        """Inside the journal transaction, before a request is journaled: may this replica take it?

        A shared store claims the sessions here and refuses a request for a session
        another live replica holds. One replica owns everything: always yes.
        """
        return None

    def takeover_pending(self) -> bool:
        """True when sessions were claimed whose state this replica does not hold: rebuild the engine."""
        return False

    def wanted_here(self) -> list[str]:
        """Sessions of this replica that another replica asked for (a shared store); none with one replica."""
        return []

    def give_in_unit(self, session_ids: Sequence[str]) -> None:
        """Hand sessions to the replicas that asked for them, in the open unit (a shared store)."""

    def forget_timers_of(self, session_id: str) -> None:
        """A session handed to another replica: its timers leave this replica's index, not the database."""
        self._timer_index.delete_session(session_id)

    def insert_outbox_rows(self, rows: Sequence[OutboxRow]) -> dict[str, int]:
        """Insert outbox rows in the open transaction, skipping a violation already recorded (or
        earlier in ``rows``); the seq of each row inserted, by violation id."""
        inserted: dict[str, int] = {}
        for row in rows:
            found = self.execute(
                "INSERT INTO outbox (violation_id, replica_id, session_id, created_ns, body)"
                " VALUES (?, ?, ?, ?, ?) ON CONFLICT (violation_id) DO NOTHING RETURNING seq", row,
            ).fetchone()
            if found is not None:
                inserted[row[0]] = int(found[0])
        return inserted

    def maintain(self) -> bool:
        """Periodic upkeep (a shared store renews its lease and adopts dead replicas' work).

        True when the engine must be rebuilt because this replica now owns more.
        """
        return False

    # -- transactions ----------------------------------------------------------------------

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        """Rows of a read (outside or inside a transaction); StateError on failure."""
        try:
            return list(self.execute(sql, params).fetchall())
        except Exception as exc:
            translated = self.translate(exc)
            if translated is None:
                raise
            raise translated from None

    def write(self, ops: Sequence[UnitOp] = ()) -> None:
        """One transaction: the pending engine changes, then ``ops``. StateError on failure (rolled back)."""
        sessions = self._pending_sessions
        timers = self._pending_timers
        engine = self._pending_engine
        self._pending_sessions = {}
        self._pending_timers = {}
        self._pending_engine = None
        try:
            self.begin()
            self.before_state_write(
                [sid for sid, body in sessions.items() if body is not None],
                [sid for sid, body in sessions.items() if body is None],
            )
            buffered = self._write_state(sessions, timers, engine)
            for op in ops:
                op()
            self.commit_transaction()
            for sid, held in self._storing.items():
                if held is None:
                    self._stored.pop(sid, None)
                else:
                    self._stored[sid] = held
            self._storing = {}
            if buffered is not None:
                self._buffer.apply(buffered)
            if self._storing_traces is not None:
                self._traces.apply(self._storing_traces)
                self._storing_traces = None
        except StateError:
            self._storing = {}
            self._storing_traces = None
            self.rollback()
            self.stale = True
            raise
        except Exception as exc:
            self._storing = {}
            self._storing_traces = None
            self.rollback()
            translated = self.translate(exc)
            if translated is None:
                raise
            self.stale = True
            raise translated from None

    def _write_state(self, sessions: dict[str, SessionState | None], timers: dict[_TimerId, int | None],
                     engine: EngineStateLike | None) -> BufferWrite | None:
        """Write the pending changes; returns the buffer's writes, for its index once committed."""
        written = RowsWritten()
        deleted = [(sid,) for sid, body in sessions.items() if body is None]
        if deleted:
            for table in ("sessions", "session_deltas", "timers"):
                self.executemany(f"DELETE FROM {table} WHERE session_id = ?", deleted)  # noqa: S608 - constants
            written.deleted_sessions = len(deleted)
        schema = self._schema
        changed = [self._session_row(live, schema) for live in sessions.values() if live is not None] \
            if schema is not None else []
        self._write_sessions(changed, written)
        self._storing = {sid: None for sid, body in sessions.items() if body is None}
        self._storing.update((w.session_id, w.stored) for w in changed)
        self.rows_written = written
        removed = [(sid, rule, group_text(group)) for (sid, rule, group), due in timers.items() if due is None]
        if removed:
            self.executemany("DELETE FROM timers WHERE session_id = ? AND rule_id = ? AND grp = ?", removed)
        put = [(sid, rule, group_text(group), due) for (sid, rule, group), due in timers.items() if due is not None]
        if put:
            self.executemany(
                "INSERT INTO timers (session_id, rule_id, grp, due_ns) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (session_id, rule_id, grp) DO UPDATE SET due_ns = excluded.due_ns",
                put,
            )
        return self._write_engine(engine) if engine is not None else None

    def _session_row(self, live: SessionState, schema: RuleSchema) -> SessionWrite:
        """A delta of what the session noted since its last write, or a new base when that is due."""
        if schema is not self._by_group_schema:
            self._by_group_schema = schema
            self._by_group = frozenset(schema.rule_ids[i] for i in range(schema.width) if schema.by_group(i))
        changes = live.take_changes()  # noting starts (again) here, whatever is written
        before = self._stored.get(live.session_id)
        if changes is not None and before is not None:
            whole, groups = live.changes_to_plain(schema, changes)
            change = SessionChange(live.head_plain(schema), whole, groups, self._by_group, live.seen_digests())
            delta = session_delta(change, before)
            if delta is not None:
                return delta
        return session_base(live.to_plain(schema), before, self._by_group)

    def _write_sessions(self, changed: Sequence[SessionWrite], written: RowsWritten) -> None:
        """One row per changed session: a delta, or a new base that replaces its deltas."""
        bases = [(w.session_id, next(self._touched), w.body) for w in changed if w.base]
        folded = [(w.session_id,) for w in changed if w.base and w.may_have_deltas]
        if folded:
            self.executemany("DELETE FROM session_deltas WHERE session_id = ?", folded)
        if bases:
            self.executemany(
                "INSERT INTO sessions (session_id, touched, body) VALUES (?, ?, ?)"
                " ON CONFLICT (session_id) DO UPDATE SET touched = excluded.touched, body = excluded.body",
                bases,
            )
        deltas = [(w.session_id, next(self._touched), w.body) for w in changed if not w.base]
        if deltas:
            self.executemany("INSERT INTO session_deltas (session_id, touched, body) VALUES (?, ?, ?)", deltas)
        written.bases += len(bases)
        written.deltas += len(deltas)
        written.groups += sum(w.groups for w in changed)
        written.bytes += sum(len(w.body) for w in changed)

    def _write_engine(self, engine: EngineStateLike) -> BufferWrite | None:
        from processor.evaluate.engine import EngineState

        buffered: BufferWrite | None = None
        if isinstance(engine, EngineState):
            head, gone, added = _split_engine_state(engine, self._buffer)
            buffered = self._buffer.plan(gone, added)
            if buffered.deletes:
                self.executemany("DELETE FROM buffer_segments WHERE replica_id = ? AND segment = ?",
                                 [(self.replica_id, segment) for segment in buffered.deletes])
            if buffered.updates:
                self.executemany("UPDATE buffer_segments SET released = ? WHERE replica_id = ? AND segment = ?",
                                 [(bitmap, self.replica_id, segment) for segment, bitmap in buffered.updates])
            self.insert_segment(self.replica_id, buffered)
            self._write_traces(engine)
            body = dumps(head)
        else:
            body = dumps(engine.to_plain())
        self.execute(
            "INSERT INTO engine (replica_id, body) VALUES (?, ?)"
            " ON CONFLICT (replica_id) DO UPDATE SET body = excluded.body",
            (self.replica_id, body),
        )
        return buffered

    def _write_traces(self, engine: Any) -> None:
        """Write the identity state's traces that changed (the engine's head leaves them out).

        The engine notes the traces it changes and forgets once asked to, so a commit converts
        and compares those, not the thousands of recent traces; the first write after a
        (re)build, and one where a trace changed without becoming the newest (its row would
        be out of order), compare them all.
        """
        identity = engine.identity
        write: TraceWrite | None = None
        if identity.touched is None:
            identity.track_changes()
        else:
            changed, forgotten = identity.take_changes()
            if changed is not None:
                write = self._traces.plan_changes(changed, forgotten)
        if write is None:
            write = self._traces.plan(identity.to_plain()["traces"])
        if write.gone:
            self.executemany("DELETE FROM engine_traces WHERE replica_id = ? AND trace_id = ?",
                             [(self.replica_id, trace_id) for trace_id in write.gone])
        if write.puts:
            self.executemany(
                "INSERT INTO engine_traces (replica_id, trace_id, ord, body) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (replica_id, trace_id) DO UPDATE SET ord = excluded.ord, body = excluded.body",
                [(self.replica_id, *put) for put in write.puts],
            )
        self._storing_traces = write

    @contextlib.contextmanager
    def unit(self) -> Iterator[None]:
        """Everything the engine commits inside, and every :meth:`in_unit` op, in one transaction at the end."""
        if self._deferring:
            raise RuntimeError("units of work do not nest")
        self._deferring = True
        self._unit_ops = []
        self._unit_after = []
        try:
            yield
        except BaseException:
            self._deferring = False
            self._unit_ops = []
            self._unit_after = []
            self._drop_pending()
            raise
        self._deferring = False
        ops, self._unit_ops = self._unit_ops, []
        after, self._unit_after = self._unit_after, []
        self.write(ops)
        for callback in after:
            callback()

    def in_unit(self, op: UnitOp, after: UnitOp | None = None) -> None:
        """Run ``op`` (statements through :meth:`execute`) inside the current unit's transaction,
        and ``after`` once that transaction is committed."""
        if not self._deferring:
            raise RuntimeError("in_unit needs an open unit of work")
        self._unit_ops.append(op)
        if after is not None:
            self._unit_after.append(after)

    def _drop_pending(self) -> None:
        self._pending_sessions = {}
        self._pending_timers = {}
        self._pending_engine = None
        self.stale = True

    def reset(self) -> None:
        """Forget what was not committed and reload the timer index; then build a new engine on the store."""
        self._pending_sessions = {}
        self._pending_timers = {}
        self._pending_engine = None
        self._stored = {}  # the engine built next loads its sessions, and this with them
        self._load_timers()
        self.stale = False

    def _load_timers(self) -> None:
        index = MemoryStore()
        clause, params = self.owned_sessions_clause()
        # The clause is a constant of the store class; values are parameters.
        statement = f"SELECT session_id, rule_id, grp, due_ns FROM timers WHERE {clause}"  # noqa: S608
        for session_id, rule_id, grp, due in self.query(statement, params):
            group = group_key_from_plain(orjson.loads(grp))
            index.put_timer(TimerEntry(int(due), str(session_id), str(rule_id), group))
        self._timer_index = index
        self._buffer = BufferSegments()
        self._buffer.load(self.query("SELECT segment, arrivals, released FROM buffer_segments WHERE replica_id = ?",
                                     (self.replica_id,)))
        self._traces = StoredTraces()
        self._traces.load(self.query("SELECT trace_id, ord FROM engine_traces WHERE replica_id = ?",
                                     (self.replica_id,)))
        top = self.query("SELECT max(touched) FROM sessions UNION ALL SELECT max(touched) FROM session_deltas")
        start = max((int(row[0]) for row in top if row[0] is not None), default=0) + 1
        self._touched = itertools.count(start)

    # -- StateStore ------------------------------------------------------------------------

    def load_engine(self) -> dict[str, Any] | EngineStateLike | None:
        return self.engine_plain(self.replica_id)

    def engine_plain(self, replica_id: str) -> dict[str, Any] | None:
        """A replica's engine-wide state as plain data, its reordering buffer put back together."""
        rows = self.query("SELECT body FROM engine WHERE replica_id = ?", (replica_id,))
        buffered = self.query("SELECT segment, body, released FROM buffer_segments WHERE replica_id = ?",
                              (replica_id,))
        if not rows and not buffered:
            return None
        if rows:
            loaded: dict[str, Any] = orjson.loads(bytes(rows[0][0]))
        else:
            # Spans adopted from a stopped replica before this one ever committed its own state.
            from processor.evaluate.engine import EngineState

            loaded = EngineState().to_plain()
        from processor.evaluate.engine import buffer_row_plain

        loaded["buffer"] = [*loaded.get("buffer", ()),
                            *(buffer_row_plain(e) if type(e) is list else e for e in live_entries(buffered))]
        traces = self.query("SELECT trace_id, body FROM engine_traces WHERE replica_id = ? ORDER BY ord", (replica_id,))
        if traces and isinstance(loaded.get("identity"), dict):
            identity = loaded["identity"]
            identity["traces"] = [*identity.get("traces", ()), *([str(t), orjson.loads(bytes(b))] for t, b in traces)]
        return loaded

    def save_engine(self, state: EngineStateLike) -> None:
        self._pending_engine = state

    def load_sessions(self, schema: RuleSchema) -> Iterator[SessionState]:
        clause, params = self.owned_sessions_clause()
        # The clause is a constant of the store class; values are parameters.
        bases = self.query(f"SELECT session_id, touched, body FROM sessions WHERE {clause}", params)  # noqa: S608
        deltas: dict[str, list[bytes]] = {}
        touched: dict[str, int] = {}
        for sid, when, body in self.query(
            f"SELECT session_id, touched, body FROM session_deltas WHERE {clause}"  # noqa: S608
            " ORDER BY session_id, touched", params,
        ):
            deltas.setdefault(str(sid), []).append(bytes(body))
            touched[str(sid)] = int(when)
        # Least recently written first: the engine rebuilds its LRU in this order.
        order = sorted(bases, key=lambda row: touched.get(str(row[0]), int(row[1])))
        self._stored = {}
        skipped = 0
        for sid, _, base in order:
            session_id = str(sid)
            try:
                plain, stored = session_plain(bytes(base), deltas.pop(session_id, ()))
                session = SessionState.from_plain(schema, plain)
                session.track_changes()  # what the store holds is known: the next write is a delta
            except (ValueError, KeyError, TypeError, IndexError):
                # One unreadable session must not keep every other from starting (ids are not logged).
                skipped += 1
                continue
            self._stored[session_id] = stored
            yield session
        self._not_restored = skipped
        if skipped:
            log.error(NOT_RESTORED_LOG, skipped)

    def sessions_not_restored(self) -> int:
        return self._not_restored

    def save_session(self, session: SessionState, schema: RuleSchema) -> None:
        self._schema = schema
        self._pending_sessions[session.session_id] = session

    def delete_session(self, session_id: str) -> None:
        self._pending_sessions[session_id] = None
        self._timer_index.delete_session(session_id)
        for timer_id in [t for t in self._pending_timers if t[0] == session_id]:
            del self._pending_timers[timer_id]

    def put_timer(self, entry: TimerEntry) -> None:
        self._timer_index.put_timer(entry)
        self._pending_timers[(entry.session_id, entry.rule_id, entry.group)] = entry.due_ns

    def remove_timer(self, session_id: str, rule_id: str, group: GroupKey) -> None:
        self._timer_index.remove_timer(session_id, rule_id, group)
        self._pending_timers[(session_id, rule_id, group)] = None

    def next_due(self) -> int | None:
        return self._timer_index.next_due()

    def pop_due(self, until_ns: int) -> list[TimerEntry]:
        popped = self._timer_index.pop_due(until_ns)
        for entry in popped:
            self._pending_timers[(entry.session_id, entry.rule_id, entry.group)] = None
        return popped

    def timer_count(self) -> int:
        return self._timer_index.timer_count()

    def commit(self) -> None:
        if self._deferring:
            return  # the unit writes it, together with the journal and the outbox
        self.write()

    def move_journal_entries(self, entry_ids: Sequence[int], owner: str) -> None:
        """Give journaled requests to the replica that now owns their sessions (own transaction)."""
        if not entry_ids:
            return
        rows = [(owner, entry_id, self.replica_id) for entry_id in entry_ids]
        statement = "UPDATE journal SET replica_id = ? WHERE id = ? AND replica_id = ?"
        self.write([lambda: self.executemany(statement, rows)])

    # -- small key-value metadata ------------------------------------------------------------

    def meta_get(self, key: str) -> str | None:
        rows = self.query("SELECT value FROM meta WHERE key = ?", (key,))
        return str(rows[0][0]) if rows else None

    def meta_put(self, key: str, value: str) -> None:
        """Inside a transaction (a unit op or ``write``)."""
        self.execute(
            "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            (key, value),
        )


def _split_engine_state(
    state: Any, stored: BufferSegments
) -> tuple[dict[str, Any], list[int], list[tuple[int, list[Any]]]]:
    """The engine-wide state without its buffer, the arrivals released since the last write, and
    the rows of the spans buffered since then (only those are converted).

    The engine notes what it buffers and releases once asked to (``added``/``released``), so a
    write costs what changed, not the whole buffer; the first write after a (re)build compares
    the buffer with what the database holds, once.
    """
    from processor.evaluate.engine import buffered_rows

    buffer = state.buffer
    state.buffer = []
    try:
        head: dict[str, Any] = state.to_plain(traces=False)  # the traces: _write_traces
    finally:
        state.buffer = buffer
    if state.added is None or state.released is None:
        arrivals = {item.arrival for item in buffer}
        held = stored.live_arrivals()
        gone = [a for a in held if a not in arrivals]
        fresh = [item for item in buffer if item.arrival not in held]
    else:
        # Released arrivals that were never stored (buffered and released between two writes)
        # are not found in the segments and cost nothing.
        gone = state.released
        released = set(gone)
        fresh = [item for item in state.added if item.arrival not in released]
    state.added = []
    state.released = []
    # The new spans only, each as the engine's row of it (buffered_rows).
    return head, gone, buffered_rows(fresh)
