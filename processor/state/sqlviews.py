"""The operator view's read model on the SQLite and PostgreSQL stores (see processor.state.views).

Writes go through the state store's own connection inside its unit of work, so the
rows change in the same transaction as the session state they describe. Reads use a
second connection (read-only for SQLite, which WAL lets run beside the writer), so a
page never waits for the evaluator and the evaluator never waits for a page.
Every list is read through an index and bounded by LIMIT; pages deeper than
``MAX_OFFSET`` are refused by the API.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Callable, Sequence
from typing import Any, Final

import orjson

from processor.records import Action
from processor.state.sqlstore import SqlStateStore
from processor.state.views import (
    DEFAULT_BOUNDS,
    MAX_ACTIONS_PER_SESSION,
    MAX_VIOLATIONS,
    WAIT_STATES,
    ViewBounds,
    ViewStore,
    ViolationFilter,
    WaitSummary,
    _deltas,
    _SessionDelta,
    _wait_row,
    action_row,
    wait_json,
)
from processor.violations import Violation

_DDL: Final = (
    "CREATE TABLE IF NOT EXISTS view_sessions (session_id TEXT PRIMARY KEY, replica_id TEXT NOT NULL,"
    " first_ns {INT}, last_ns {INT}, actions {INT} NOT NULL, violations {INT} NOT NULL, state TEXT NOT NULL,"
    " state_ns {INT} NOT NULL, service TEXT NOT NULL, trace_id TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS view_waits (session_id TEXT PRIMARY KEY, state TEXT NOT NULL,"
    " action_id TEXT NOT NULL, kind TEXT NOT NULL, since_ns {INT}, deadline_ns {INT},"
    " service TEXT NOT NULL, trace_id TEXT NOT NULL)",
    "CREATE INDEX IF NOT EXISTS view_sessions_by_activity ON view_sessions (last_ns)",
    "CREATE INDEX IF NOT EXISTS view_waits_by_deadline ON view_waits (deadline_ns)",
    "CREATE INDEX IF NOT EXISTS view_waits_by_since ON view_waits (since_ns)",
    "CREATE TABLE IF NOT EXISTS view_actions (session_id TEXT NOT NULL, identity TEXT NOT NULL,"
    " time_ns {INT} NOT NULL, seq {INT} NOT NULL, body {BLOB} NOT NULL, PRIMARY KEY (session_id, identity))",
    "CREATE INDEX IF NOT EXISTS view_actions_in_order ON view_actions (session_id, time_ns, seq)",
    "CREATE TABLE IF NOT EXISTS view_violations (violation_id TEXT PRIMARY KEY, session_id TEXT NOT NULL,"
    " rule TEXT NOT NULL, severity TEXT NOT NULL, created_ns {INT} NOT NULL, body {BLOB} NOT NULL)",
    "CREATE INDEX IF NOT EXISTS view_violations_recent ON view_violations (created_ns, violation_id)",
    "CREATE INDEX IF NOT EXISTS view_violations_by_rule ON view_violations (rule, created_ns, violation_id)",
    "CREATE INDEX IF NOT EXISTS view_violations_by_severity ON view_violations (severity, created_ns, violation_id)",
    "CREATE INDEX IF NOT EXISTS view_violations_by_session ON view_violations (session_id, created_ns, violation_id)",
    "CREATE TABLE IF NOT EXISTS view_rule_counts (rule TEXT NOT NULL, severity TEXT NOT NULL,"
    " n {INT} NOT NULL, PRIMARY KEY (rule, severity))",
)
_SQLITE_TYPES: Final = {"INT": "INTEGER", "BLOB": "BLOB"}
_PG_TYPES: Final = {"INT": "BIGINT", "BLOB": "BYTEA"}
# Serializes table creation between replicas starting together (another key than the store's).
_PG_VIEWS_LOCK: Final = 0x44435657
_CHUNK: Final = 500
_PRUNE_EVERY: Final = 1000
# Sessions without activity (event time) for this long leave the view with their actions and waits.
DEFAULT_RETENTION_S: Final = 7 * 86400.0
_SESSION_COLUMNS: Final = "session_id, first_ns, last_ns, actions, violations, state, state_ns, service, trace_id"


class SqlViews(ViewStore):
    """The read model in the state database; ``reader`` opens the read connection."""

    def __init__(self, store: SqlStateStore, reader: Callable[[], Any], *, postgres: bool,
                 retention_s: float = DEFAULT_RETENTION_S, bounds: ViewBounds = DEFAULT_BOUNDS,
                 prune_every: int = _PRUNE_EVERY) -> None:
        self._store = store
        self._retention_ns = int(retention_s * 1e9)
        self._bounds = bounds
        self._prune_every = prune_every
        # Rows and sessions this process added since the bounds were last checked: past 1% of
        # a bound they are checked again, so the tables overshoot a bound by at most about 1%
        # (times the replicas writing them) instead of by 1,000 writes of traffic.
        self._added_actions = 0
        self._added_sessions = 0
        self._postgres = postgres
        self._writes = 0
        types = _PG_TYPES if postgres else _SQLITE_TYPES

        def create() -> None:
            if postgres:
                store.execute("SELECT pg_advisory_xact_lock(?)", (_PG_VIEWS_LOCK,))
            for statement in _DDL:
                store.execute(statement.format(**types))

        store.write([create])
        self._read_lock = threading.Lock()
        self._reader_factory = reader
        self._reader: Any = None

    # -- writes, on the evaluator's thread -----------------------------------------------

    def record(self, actions: Sequence[Action], violations: Sequence[Violation], now_ns: int) -> None:
        if not actions and not violations:
            return

        def op() -> None:
            self._write(actions, violations, now_ns)

        try:
            self._store.in_unit(op)
        except RuntimeError:  # no unit open: a transaction of its own
            self._store.write([op])

    def _write(self, actions: Sequence[Action], violations: Sequence[Violation], now_ns: int) -> None:
        store = self._store
        # waits_only: sessions' states and open waits alone, no row per violation or action.
        fresh = [] if self.waits_only else self._fresh(violations)
        if fresh:
            store.executemany(
                "INSERT INTO view_violations (violation_id, session_id, rule, severity, created_ns, body)"
                " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (violation_id) DO NOTHING",
                [(v.violation_id, v.session_id, v.rule, v.severity, now_ns, orjson.dumps(v.to_json(), default=str))
                 for v in fresh],
            )
            counts: dict[tuple[str, str], int] = {}
            for v in fresh:
                counts[(v.rule, v.severity)] = counts.get((v.rule, v.severity), 0) + 1
            store.executemany(
                "INSERT INTO view_rule_counts (rule, severity, n) VALUES (?, ?, ?)"
                " ON CONFLICT (rule, severity) DO UPDATE SET n = view_rule_counts.n + excluded.n",
                [(rule, severity, n) for (rule, severity), n in counts.items()],
            )
        if actions and not self.waits_only:
            self._added_actions += len(actions)
            store.executemany(
                "INSERT INTO view_actions (session_id, identity, time_ns, seq, body) VALUES (?, ?, ?, ?, ?)"
                " ON CONFLICT (session_id, identity) DO NOTHING",
                [(a.session_id, row["identity"], a.time_ns if a.time_ns is not None else 0, a.seq,
                  orjson.dumps(row)) for a, row in ((a, action_row(a)) for a in actions)],
            )
        # After the actions: a session past its bound of kept actions drops its oldest here.
        deltas = _deltas(actions, fresh)
        if deltas:
            self._write_sessions(deltas)
        self._writes += 1
        if self._writes % self._prune_every == 0:
            self._prune_violations()
            self._prune_sessions(now_ns)
            self._prune_to_bounds()
        elif (self._added_actions > self._bounds.max_actions // 100
              or self._added_sessions > self._bounds.max_sessions // 100):
            self._prune_to_bounds()

    def _fresh(self, violations: Sequence[Violation]) -> list[Violation]:
        """The violations not yet in the view (a request evaluated again after a crash finds them again)."""
        if not violations:
            return []
        known: set[str] = set()
        ids = list({v.violation_id for v in violations})
        for i in range(0, len(ids), _CHUNK):
            chunk = ids[i:i + _CHUNK]
            marks = ", ".join("?" * len(chunk))
            rows = self._store.execute(
                f"SELECT violation_id FROM view_violations WHERE violation_id IN ({marks})", chunk  # noqa: S608
            ).fetchall()
            known.update(str(r[0]) for r in rows)
        out: list[Violation] = []
        for v in violations:
            if v.violation_id not in known:
                known.add(v.violation_id)
                out.append(v)
        return out

    def _write_sessions(self, deltas: dict[str, _SessionDelta]) -> None:
        store = self._store
        current: dict[str, tuple[Any, ...]] = {}
        ids = list(deltas)
        for i in range(0, len(ids), _CHUNK):
            chunk = ids[i:i + _CHUNK]
            marks = ", ".join("?" * len(chunk))
            statement = f"SELECT {_SESSION_COLUMNS} FROM view_sessions WHERE session_id IN ({marks})"  # noqa: S608
            for row in store.execute(statement, chunk).fetchall():
                current[str(row[0])] = tuple(row)
        upserts: list[tuple[Any, ...]] = []
        waits_put: list[tuple[Any, ...]] = []
        waits_gone: list[tuple[str]] = []
        crowded: list[str] = []
        for sid, d in deltas.items():
            old = current.get(sid)
            self._added_sessions += old is None
            first, last, n_actions, n_violations, state, state_ns, service, trace_id = (
                old[1:] if old is not None else (None, None, 0, 0, "", -1, "", "")
            )
            if d.first_ns is not None:
                first = d.first_ns if first is None else min(int(first), d.first_ns)
                last = d.last_ns if last is None else max(int(last), d.last_ns or 0)
            n_actions = int(n_actions) + d.actions
            if n_actions > MAX_ACTIONS_PER_SESSION and d.actions and not self.waits_only:
                crowded.append(sid)
            if d.state_action is not None and d.state_ns >= int(state_ns):
                before = str(state)
                state, state_ns = d.state, d.state_ns
                if d.state in WAIT_STATES:
                    if before != d.state:
                        w = _wait_row(d)
                        waits_put.append((sid, w["state"], w["action_id"], w["kind"], w["since_ns"],
                                          w["deadline_ns"], w["service"], w["trace_id"]))
                else:
                    waits_gone.append((sid,))
            upserts.append((sid, store.replica_id, first, last, n_actions, int(n_violations) + d.violations,
                            state, state_ns, service or d.service, trace_id or d.trace_id))
        store.executemany(
            f"INSERT INTO view_sessions (replica_id, {_SESSION_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"  # noqa: S608
            " ON CONFLICT (session_id) DO UPDATE SET replica_id = excluded.replica_id,"
            " first_ns = excluded.first_ns, last_ns = excluded.last_ns, actions = excluded.actions,"
            " violations = excluded.violations, state = excluded.state, state_ns = excluded.state_ns,"
            " service = excluded.service, trace_id = excluded.trace_id",
            [(u[1], u[0], *u[2:]) for u in upserts],
        )
        if waits_put:
            store.executemany(
                "INSERT INTO view_waits (session_id, state, action_id, kind, since_ns, deadline_ns, service, trace_id)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (session_id) DO UPDATE SET state = excluded.state,"
                " action_id = excluded.action_id, kind = excluded.kind, since_ns = excluded.since_ns,"
                " deadline_ns = excluded.deadline_ns, service = excluded.service, trace_id = excluded.trace_id",
                waits_put,
            )
        if waits_gone:
            store.executemany("DELETE FROM view_waits WHERE session_id = ?", waits_gone)
        for sid in crowded:
            # Keep the newest actions of a long session; the oldest go first.
            kept = int(store.execute("SELECT count(*) FROM view_actions WHERE session_id = ?", (sid,)).fetchone()[0])
            if kept > MAX_ACTIONS_PER_SESSION:
                store.execute(
                    "DELETE FROM view_actions WHERE session_id = ? AND identity IN (SELECT identity FROM view_actions"
                    " WHERE session_id = ? ORDER BY time_ns, seq LIMIT ?)",
                    (sid, sid, kept - MAX_ACTIONS_PER_SESSION),
                )

    def _prune_sessions(self, now_ns: int) -> None:
        """Forget sessions idle longer than the retention: the view's tables stay bounded over months."""
        cutoff = now_ns - self._retention_ns
        old = "SELECT session_id FROM view_sessions WHERE last_ns < ?"
        self._store.execute(f"DELETE FROM view_actions WHERE session_id IN ({old})", (cutoff,))  # noqa: S608
        self._store.execute(f"DELETE FROM view_waits WHERE session_id IN ({old})", (cutoff,))  # noqa: S608
        self._store.execute("DELETE FROM view_sessions WHERE last_ns < ?", (cutoff,))

    def _prune_to_bounds(self) -> None:
        """Past ``max_sessions`` or ``max_actions``, the least recently active sessions (event time) leave.

        The oldest sessions are read through the activity index, a chunk at a time, until enough
        have been taken: the cost is that of the rows removed (and two counts), not of the
        sessions kept. A session's kept rows are taken as min(actions, MAX_ACTIONS_PER_SESSION)
        from its summary row (a delivery seen twice counts twice: at worst a few rows more go).
        Called every ``prune_every`` writes, and once this process added 1% of a bound since.
        """
        store = self._store
        bounds = self._bounds
        self._added_actions = self._added_sessions = 0
        sessions = int(store.execute("SELECT count(*) FROM view_sessions").fetchone()[0])
        excess_sessions = sessions - bounds.max_sessions
        excess_rows = int(store.execute("SELECT count(*) FROM view_actions").fetchone()[0]) - bounds.max_actions
        if excess_sessions <= 0 and excess_rows <= 0:
            return
        # NULL (no event time) is the oldest on both databases.
        oldest = "SELECT session_id, actions FROM view_sessions ORDER BY last_ns NULLS FIRST LIMIT ? OFFSET ?"
        gone: list[str] = []
        while excess_sessions > 0 or excess_rows > 0:
            rows = store.execute(oldest, (_CHUNK, len(gone))).fetchall()
            for session_id, actions in rows:
                gone.append(str(session_id))
                excess_sessions -= 1
                excess_rows -= min(int(actions), MAX_ACTIONS_PER_SESSION)
                if excess_sessions <= 0 and excess_rows <= 0:
                    break
            if len(rows) < _CHUNK:
                break
        self._forget(gone)

    def _forget(self, session_ids: list[str]) -> None:
        """The sessions leave the view with their actions and waits (their violations stay, bounded apart)."""
        store = self._store
        for i in range(0, len(session_ids), _CHUNK):
            chunk = session_ids[i:i + _CHUNK]
            marks = ", ".join("?" * len(chunk))
            for table in ("view_actions", "view_waits", "view_sessions"):
                store.execute(f"DELETE FROM {table} WHERE session_id IN ({marks})", chunk)  # noqa: S608

    def _prune_violations(self) -> None:
        rows = self._store.execute(
            "SELECT created_ns FROM view_violations ORDER BY created_ns DESC LIMIT 1 OFFSET ?", (MAX_VIOLATIONS,)
        ).fetchall()
        if rows:
            self._store.execute("DELETE FROM view_violations WHERE created_ns <= ?", (int(rows[0][0]),))

    # -- reads, on the web view's threads --------------------------------------------------

    def _rows(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        with self._read_lock:
            if self._reader is None:
                self._reader = self._reader_factory()
            statement = sql.replace("?", "%s") if self._postgres else sql
            try:
                return list(self._reader.execute(statement, tuple(params)).fetchall())
            except Exception:
                # A broken connection is opened again at the next read; the error goes to the caller.
                with contextlib.suppress(Exception):
                    self._reader.close()
                self._reader = None
                raise

    def waiting(self, now_ns: int, limit: int, offset: int) -> tuple[list[dict[str, Any]], int]:
        total = int(self._rows("SELECT count(*) FROM view_waits")[0][0])
        expired = int(self._rows("SELECT count(*) FROM view_waits WHERE deadline_ns <= ?", (now_ns,))[0][0])
        columns = "session_id, state, action_id, kind, since_ns, deadline_ns, service, trace_id"
        rows: list[Any] = []
        if offset < expired:
            rows += self._rows(
                f"SELECT {columns} FROM view_waits WHERE deadline_ns <= ?"  # noqa: S608
                " ORDER BY deadline_ns, session_id LIMIT ? OFFSET ?", (now_ns, limit, offset))
        if len(rows) < limit:
            rows += self._rows(
                f"SELECT {columns} FROM view_waits WHERE deadline_ns IS NULL OR deadline_ns > ?"  # noqa: S608
                " ORDER BY since_ns, session_id LIMIT ? OFFSET ?",
                (now_ns, limit - len(rows), max(0, offset - expired)))
        names = columns.split(", ")
        return [wait_json(dict(zip(names, r, strict=True)), now_ns) for r in rows], total

    def violations(self, where: ViolationFilter, limit: int, offset: int) -> list[dict[str, Any]]:
        clauses: list[str] = []
        params: list[Any] = []
        for column, value in (("rule", where.rule), ("severity", where.severity), ("session_id", where.session_id)):
            if value:
                clauses.append(f"{column} = ?")
                params.append(value)
        condition = " AND ".join(clauses) if clauses else "1 = 1"
        rows = self._rows(
            f"SELECT body, created_ns FROM view_violations WHERE {condition}"  # noqa: S608 - columns are constants
            " ORDER BY created_ns DESC, violation_id DESC LIMIT ? OFFSET ?", (*params, limit, offset))
        return [{**orjson.loads(bytes(r[0])), "created_ns": int(r[1])} for r in rows]

    def rule_counts(self) -> list[dict[str, Any]]:
        rows = self._rows("SELECT rule, severity, n FROM view_rule_counts ORDER BY n DESC, rule, severity")
        return [{"rule": str(r[0]), "severity": str(r[1]), "count": int(r[2])} for r in rows]

    def session(self, session_id: str) -> dict[str, Any] | None:
        rows = self._rows(f"SELECT replica_id, {_SESSION_COLUMNS} FROM view_sessions WHERE session_id = ?",  # noqa: S608
                          (session_id,))
        if not rows:
            return None
        names = ["replica_id", *_SESSION_COLUMNS.split(", ")]
        out = dict(zip(names, rows[0], strict=True))
        out.pop("state_ns")
        waits = self._rows("SELECT state, action_id, kind, since_ns, deadline_ns FROM view_waits WHERE session_id = ?",
                           (session_id,))
        out["wait"] = (dict(zip(("state", "action_id", "kind", "since_ns", "deadline_ns"), waits[0], strict=True))
                       if waits else None)
        return out

    def session_actions(self, session_id: str) -> list[dict[str, Any]]:
        rows = self._rows("SELECT body FROM view_actions WHERE session_id = ? ORDER BY time_ns, seq",
                          (session_id,))
        return [orjson.loads(bytes(r[0])) for r in rows]

    def wait_summary(self, now_ns: int) -> WaitSummary:
        rows = self._rows(
            "SELECT state, count(*), sum(CASE WHEN deadline_ns <= ? THEN 1 ELSE 0 END), min(since_ns)"
            " FROM view_waits GROUP BY state", (now_ns,))
        oldest = [int(r[3]) for r in rows if r[3] is not None]
        return WaitSummary(
            {str(r[0]): int(r[1]) for r in rows},
            {str(r[0]): int(r[2]) for r in rows if r[2]},
            min(oldest) if oldest else None,
        )

    def session_count(self) -> int:
        return int(self._rows("SELECT count(*) FROM view_sessions")[0][0])

    def close(self) -> None:
        with self._read_lock:
            if self._reader is not None:
                with contextlib.suppress(Exception):
                    self._reader.close()
                self._reader = None


def views_for(store: SqlStateStore, retention_s: float = DEFAULT_RETENTION_S,
              bounds: ViewBounds = DEFAULT_BOUNDS, prune_every: int = _PRUNE_EVERY) -> SqlViews:
    """The read model on a SQLite or PostgreSQL store, with its own read connection.

    ``prune_every``: writes between two prunings (retention, bounds); tests make it small.
    """
    from processor.state.sqlite import SqliteStore

    if isinstance(store, SqliteStore):
        path = store.path

        def sqlite_reader() -> sqlite3.Connection:
            conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False,
                                   timeout=5.0)
            conn.execute("PRAGMA query_only = ON")
            return conn

        return SqlViews(store, sqlite_reader, postgres=False, retention_s=retention_s, bounds=bounds,
                        prune_every=prune_every)
    from processor.state.postgres import PostgresStore

    if isinstance(store, PostgresStore):
        import psycopg

        url = store._url  # the same server; the view reads on a connection of its own

        def pg_reader() -> Any:
            return psycopg.connect(url, autocommit=True, connect_timeout=5,
                                   options="-c statement_timeout=5000 -c default_transaction_read_only=on",
                                   application_name="durable-check view")

        return SqlViews(store, pg_reader, postgres=True, retention_s=retention_s, bounds=bounds,
                        prune_every=prune_every)
    raise TypeError(f"no read model for {type(store).__name__}")
