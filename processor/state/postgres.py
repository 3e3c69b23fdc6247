"""The shared store: the same tables in PostgreSQL, for several serve replicas.

Each replica has a ``replica_id`` (by default the host name: the pod name in
Kubernetes). What it owns:

- **Sessions**, through ``session_owner(session_id, replica_id, lease_until)``. Before a
  request is journaled (and so acknowledged) its sessions are claimed in the journal's
  transaction, the rows locked ``FOR UPDATE``: a session held by another replica whose
  lease has not expired refuses the request ("retry later", and the Collector's
  load-balancing exporter retries it), so two replicas never evaluate one session at
  once. The refusal also asks the owner for the session (``wanted_by``): the owner,
  at its next maintenance, evaluates what it holds of it and hands it over
  (:meth:`PostgresStore.give_in_unit`), so that a session whose spans the Collector
  now routes elsewhere moves at once, not after its lease lapses. Every commit that
  saves a session checks, under the same lock, that this replica still owns it, and
  renews the lease (``lease_ttl_s``). A session whose lease expired is taken over by
  the next replica that gets a request for it; that replica loads the session's state
  as its last owner committed it.
- **Its engine-wide state and journal**, keyed by ``replica_id``.
- **A heartbeat** in ``replicas(replica_id, lease_until)``, renewed by :meth:`maintain`.
  A replica whose heartbeat expired is dead: the first live replica to notice adopts,
  in one transaction, its sessions, its journal (acknowledged requests not yet
  evaluated), the spans of its reordering buffer (they join the adopter's buffer as
  they were) and its undelivered outbox rows. Nothing it acknowledged is lost. Until
  then a request for one of its sessions is refused ("retry later"): the stopped
  replica's journal may hold older requests of that session, and they go first.

Leases are measured on the database's clock (``clock_timestamp()``), so replicas whose
clocks disagree still agree on who owns what.

A lost connection is a :class:`~processor.state.faults.StateUnavailable`: the receivers
answer "retry later", and the next operation reconnects (one attempt per operation;
the worker paces them with capped backoff).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from typing import Any, Final

import psycopg

from processor.errors import StateError
from processor.state.bufferrows import pack_arrivals, segment_spans, unpack_arrivals
from processor.state.compression import compress
from processor.state.faults import SessionOwnedElsewhere, postgres_error
from processor.state.sessionrows import dumps
from processor.state.sqlstore import TABLES, OutboxRow, SqlStateStore

log = logging.getLogger(__name__)

_TYPES: Final = {"INT": "BIGINT", "BLOB": "BYTEA", "SERIAL": "BIGSERIAL PRIMARY KEY"}
_OWNERSHIP: Final = (
    "CREATE TABLE IF NOT EXISTS replicas (replica_id TEXT PRIMARY KEY, lease_until TIMESTAMPTZ NOT NULL)",
    "CREATE TABLE IF NOT EXISTS session_owner ("
    " session_id TEXT PRIMARY KEY, replica_id TEXT NOT NULL, lease_until TIMESTAMPTZ NOT NULL)",
    "CREATE INDEX IF NOT EXISTS session_owner_by_replica ON session_owner (replica_id)",
    # A session another replica now receives (the Collector's ring changed): who asks for it, and
    # whether it was handed over (its new owner then loads the state its old owner committed).
    "ALTER TABLE session_owner ADD COLUMN IF NOT EXISTS wanted_by TEXT",
    "ALTER TABLE session_owner ADD COLUMN IF NOT EXISTS handed BOOLEAN NOT NULL DEFAULT FALSE",
    "CREATE INDEX IF NOT EXISTS session_owner_wanted ON session_owner (replica_id) WHERE wanted_by IS NOT NULL",
    # A lease ends this many seconds from now, on the database's clock.
    "CREATE OR REPLACE FUNCTION lease_end(seconds double precision) RETURNS timestamptz"
    " AS 'SELECT clock_timestamp() + make_interval(secs => $1)' LANGUAGE sql VOLATILE",
)
# Serialises schema creation between replicas starting at once.
_SCHEMA_LOCK: Final = 0x44555241


def default_replica_id() -> str:
    return socket.gethostname()


def redact(url: str) -> str:
    """The server's address as a log may show it: no password."""
    try:
        info = psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "(unparsable connection string)"
    host = info.get("host") or "localhost"
    port = info.get("port") or "5432"
    return f"{host}:{port}/{info.get('dbname') or ''}"


class PostgresStore(SqlStateStore):
    def __init__(
        self,
        url: str,
        *,
        replica_id: str | None = None,
        lease_ttl_s: float = 15.0,
        connect_timeout_s: float = 5.0,
        statement_timeout_s: float = 30.0,
    ) -> None:
        super().__init__(replica_id or default_replica_id())
        self._url = url
        self.where = redact(url)
        self.lease_ttl_s = lease_ttl_s
        self._connect_timeout_s = connect_timeout_s
        self._statement_timeout_s = statement_timeout_s
        self._conn: psycopg.Connection[Any] | None = None
        self._takeover = False
        self._registered = False
        try:
            self._connect()
            self._create_tables()
            self._load_timers()
        except psycopg.Error as exc:
            self.close()
            raise postgres_error(exc, self.where) from None

    # -- connection ------------------------------------------------------------------------

    def _connect(self) -> psycopg.Connection[Any]:
        if self._conn is not None and not self._conn.closed and not self._conn.broken:
            return self._conn
        if self._conn is not None:
            self.close()
        self._conn = psycopg.connect(
            self._url, autocommit=True, connect_timeout=max(1, round(self._connect_timeout_s)),
            options=f"-c statement_timeout={int(self._statement_timeout_s * 1000)}",
            application_name=f"durable-check {self.replica_id}"[:63],
        )
        return self._conn

    def _create_tables(self) -> None:
        self.begin()
        try:
            self.execute("SELECT pg_advisory_xact_lock(?)", (_SCHEMA_LOCK,))
            self.create_schema((*TABLES, *_OWNERSHIP), _TYPES, self.where)
            self.commit_transaction()
        except BaseException:
            self.rollback()
            raise

    # -- SqlStateStore ---------------------------------------------------------------------

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        conn = self._connect()
        return conn.execute(sql.replace("?", "%s"), tuple(params) if params else None)

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        conn = self._connect()
        with conn.cursor() as cursor:
            cursor.executemany(sql.replace("?", "%s"), rows)

    def begin(self) -> None:
        self.execute("BEGIN")

    def commit_transaction(self) -> None:
        self.execute("COMMIT")

    def rollback(self) -> None:
        conn = self._conn
        if conn is None or conn.closed or conn.broken:
            return
        try:
            if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                conn.execute("ROLLBACK")
        except psycopg.Error:
            log.warning("rolling back on the PostgreSQL server %s failed; reconnecting", self.where)
            self.close()

    def has_table(self, name: str) -> bool:
        found = self.execute("SELECT to_regclass(?) IS NOT NULL", (name,)).fetchone()
        return bool(found and found[0])

    def translate(self, exc: Exception) -> StateError | None:
        if isinstance(exc, psycopg.Error):
            return postgres_error(exc, self.where)
        return None

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except psycopg.Error:
                log.warning("closing the connection to %s failed", self.where)

    def insert_outbox_rows(self, rows: Sequence[OutboxRow]) -> dict[str, int]:
        """One statement for the unit's violations (a round trip each would be one per violation)."""
        if len(rows) <= 1:
            return super().insert_outbox_rows(rows)
        ids, replicas, sessions, created, bodies = (list(column) for column in zip(*rows, strict=True))
        found = self.execute(
            "INSERT INTO outbox (violation_id, replica_id, session_id, created_ns, body)"
            " SELECT * FROM unnest(?::text[], ?::text[], ?::text[], ?::bigint[], ?::bytea[])"
            " ON CONFLICT (violation_id) DO NOTHING RETURNING violation_id, seq",
            (ids, replicas, sessions, created, bodies),
        ).fetchall()
        return {str(violation_id): int(seq) for violation_id, seq in found}

    def owned_sessions_clause(self) -> tuple[str, tuple[Any, ...]]:
        return "session_id IN (SELECT session_id FROM session_owner WHERE replica_id = ?)", (self.replica_id,)

    # -- ownership ---------------------------------------------------------------------------

    def admit(self, session_ids: frozenset[str]) -> StateError | None:
        """Claim the request's sessions (inside the journal transaction); refuse when another live replica has one.

        The sessions are taken in sorted order up to the first that refuses the request;
        those taken before it stay taken in the transaction. A request of 512 spans names a
        few hundred sessions: whatever their number, this is one statement that locks their
        rows (in the order ``before_state_write`` locks them), one that claims the unowned
        ones, one that renews the leases, and one that looks for stored state of claimed
        sessions, rather than a round trip or two per session.
        """
        if not session_ids:
            return None
        me = self.replica_id
        ids = sorted(session_ids)
        rows = self.execute(
            "SELECT session_id, replica_id, lease_until > clock_timestamp(), handed FROM session_owner"
            " WHERE session_id = ANY(?) ORDER BY session_id FOR UPDATE", (ids,),
        ).fetchall()
        owners = {str(r[0]): (str(r[1]), bool(r[2])) for r in rows}
        handed = [str(r[0]) for r in rows if r[3] and str(r[1]) == me]
        unowned: list[str] = []
        renewed: list[str] = []  # in sorted order, as ``ids``
        stopped: dict[str, bool] = {}
        refused: StateError | None = None
        for session_id in ids:
            found = owners.get(session_id)
            if found is None:
                unowned.append(session_id)
                continue
            owner, live = found
            if owner != me:
                if live:
                    # Asked for, with every other session of the request another live replica holds:
                    # their owners hand them over at their next maintenance (give_in_unit).
                    self.execute(
                        "UPDATE session_owner SET wanted_by = ? WHERE session_id = ANY(?) AND replica_id <> ?"
                        " AND lease_until > clock_timestamp()", (me, ids, me),
                    )
                    refused = SessionOwnedElsewhere(
                        "a session of this request is held by another replica until it hands it over"
                    )
                    break
                if owner not in stopped:
                    stopped[owner] = self._stopped_unadopted(owner)
                if stopped[owner]:
                    # Its journal may hold older requests of this session: they go first, once adopted.
                    refused = SessionOwnedElsewhere(
                        "a session of this request belongs to a replica that stopped; its work is being adopted"
                    )
                    break
            renewed.append(session_id)
        claimed: list[str] = []
        if unowned:
            inserted = self._claim_all(unowned)
            lost = next((sid for sid in unowned if sid not in inserted), None)
            if lost is not None:
                # Another replica claimed it first: the walk stops there, and what it would not
                # have reached is given back.
                refused = SessionOwnedElsewhere("a session of this request was just claimed by another replica")
                beyond = [sid for sid in unowned if sid > lost and sid in inserted]
                if beyond:
                    self.execute("DELETE FROM session_owner WHERE session_id = ANY(?) AND replica_id = ?",
                                 (beyond, me))
                renewed = [sid for sid in renewed if sid < lost]
                claimed = [sid for sid in unowned if sid < lost]
            else:
                claimed = unowned
        if renewed:
            self.execute(
                # A request of its own for a session it now holds is answered.
                "UPDATE session_owner SET replica_id = ?, lease_until = lease_end(?),"
                " wanted_by = NULLIF(wanted_by, ?) WHERE session_id = ANY(?)",
                (me, self.lease_ttl_s, me, renewed),
            )
            if any(owners[sid][0] != me for sid in renewed):
                self._takeover = True  # a lease that expired under another replica
        if handed:
            # Handed over by its last owner: its state is loaded from what that owner committed.
            self.execute("UPDATE session_owner SET handed = FALSE WHERE session_id = ANY(?)", (handed,))
            self._takeover = True
        if claimed and not self._takeover and self.execute(
            "SELECT 1 FROM sessions WHERE session_id = ANY(?) LIMIT 1", (claimed,)
        ).fetchone():
            self._takeover = True  # state a replica that stopped left behind
        return refused

    def wanted_here(self) -> list[str]:
        """Sessions of this replica that another one asked for (its request for them was refused)."""
        rows = self.query("SELECT session_id FROM session_owner WHERE replica_id = ? AND wanted_by IS NOT NULL"
                          " AND wanted_by <> replica_id ORDER BY session_id", (self.replica_id,))
        return [str(r[0]) for r in rows]

    def give_in_unit(self, session_ids: Sequence[str]) -> None:
        """In the open unit, after their state is written: each session to the replica that asked for it.

        Its new owner's next request for it loads the state (``handed``). A session not asked
        for any more, or no longer this replica's, stays as it is.
        """
        me, ids = self.replica_id, sorted(session_ids)

        def op() -> None:
            self.execute(
                "UPDATE session_owner SET replica_id = wanted_by, wanted_by = NULL, handed = TRUE,"
                " lease_until = lease_end(?) WHERE session_id = ANY(?) AND replica_id = ? AND wanted_by IS NOT NULL"
                " AND wanted_by <> replica_id",
                (self.lease_ttl_s, ids, me),
            )

        self.in_unit(op)

    def _claim_all(self, session_ids: Sequence[str]) -> set[str]:
        """Take unowned sessions with a fresh lease, in one statement and in the order given; the
        ones taken (not those another replica claimed first)."""
        return {str(r[0]) for r in self.execute(
            "INSERT INTO session_owner (session_id, replica_id, lease_until)"
            " SELECT s, ?, lease_end(?) FROM unnest(?::text[]) AS s"
            " ON CONFLICT (session_id) DO NOTHING RETURNING session_id",
            (self.replica_id, self.lease_ttl_s, list(session_ids)),
        ).fetchall()}

    def _stopped_unadopted(self, replica: str) -> bool:
        row = self.execute(
            "SELECT lease_until < clock_timestamp() FROM replicas WHERE replica_id = ?", (replica,)
        ).fetchone()
        return row is not None and bool(row[0])

    def takeover_pending(self) -> bool:
        taken, self._takeover = self._takeover, False
        return taken

    def before_state_write(self, saved: Sequence[str], deleted: Sequence[str]) -> None:
        """Every session written must still be this replica's: checked under lock, leases renewed."""
        if not saved and not deleted:
            return
        me = self.replica_id
        ids = sorted({*saved, *deleted})
        rows = self.execute(
            "SELECT session_id, replica_id FROM session_owner WHERE session_id = ANY(?) ORDER BY session_id"
            " FOR UPDATE", (ids,),
        ).fetchall()
        owners = {str(r[0]): str(r[1]) for r in rows}
        moved = {sid: owner for sid, owner in owners.items() if owner != me}
        if moved:
            raise SessionOwnedElsewhere(
                f"{len(moved)} session(s) of this batch moved to another replica", moved=moved
            )
        missing = [sid for sid in saved if sid not in owners]
        # A claim lost to another replica raises, and the whole unit is rolled back with it.
        if missing and len(self._claim_all(missing)) < len(missing):
            raise SessionOwnedElsewhere("a session of this batch was claimed by another replica")
        if saved:
            self.execute(
                "UPDATE session_owner SET lease_until = lease_end(?) WHERE session_id = ANY(?) AND replica_id = ?",
                (self.lease_ttl_s, list(saved), me),
            )
        if deleted:
            self.execute("DELETE FROM session_owner WHERE session_id = ANY(?) AND replica_id = ?", (list(deleted), me))

    def maintain(self) -> bool:
        """Renew the heartbeat; adopt replicas whose heartbeat expired. True when this replica now owns more
        (or was itself adopted while it stalled): the owner rebuilds its engine and re-reads its journal."""
        me = self.replica_id
        adopted: list[str] = []
        lost = False

        def op() -> None:
            nonlocal lost
            renewed = self.execute(
                "UPDATE replicas SET lease_until = lease_end(?) WHERE replica_id = ?", (self.lease_ttl_s, me)
            ).rowcount
            if not renewed:
                lost = self._registered
                self.execute(
                    "INSERT INTO replicas (replica_id, lease_until) VALUES (?, lease_end(?))"
                    " ON CONFLICT (replica_id) DO UPDATE SET lease_until = excluded.lease_until",
                    (me, self.lease_ttl_s),
                )
            dead = self.execute(
                "SELECT replica_id FROM replicas WHERE lease_until < clock_timestamp() AND replica_id <> ?"
                " ORDER BY replica_id FOR UPDATE SKIP LOCKED", (me,),
            ).fetchall()
            for (replica,) in dead:
                self._adopt(str(replica))
                adopted.append(str(replica))

        self.write([op])
        self._registered = True
        for replica in adopted:
            log.warning("replica %s stopped renewing its lease; its sessions and accepted requests are adopted",
                        replica)
        if lost:
            log.warning("this replica's lease expired while it stalled; its work was adopted by another")
        return bool(adopted) or lost

    def _adopt(self, dead: str) -> None:
        me = self.replica_id
        self.execute(
            "UPDATE session_owner SET replica_id = ?, lease_until = lease_end(?) WHERE replica_id = ?",
            (me, self.lease_ttl_s, dead),
        )
        self.execute("UPDATE journal SET replica_id = ? WHERE replica_id = ?", (me, dead))
        # Its reordering buffer held acknowledged spans, already marked seen in their sessions: they
        # join this replica's buffer as they are (re-submitting them would take them for redeliveries).
        # Their arrival numbers are moved below this replica's own, keeping them unique.
        low = self.execute("SELECT coalesce(min(first_arrival), 0) FROM buffer_segments WHERE replica_id = ?",
                           (me,)).fetchone()
        high = self.execute("SELECT coalesce(max(last_arrival), 0) FROM buffer_segments WHERE replica_id = ?",
                            (dead,)).fetchone()
        offset = min(int(low[0]), 0) - int(high[0]) - 1
        top = self.execute("SELECT coalesce(max(segment), 0) FROM buffer_segments WHERE replica_id = ?",
                           (me,)).fetchone()
        moved = self.execute(
            "SELECT segment, arrivals, released, body FROM buffer_segments WHERE replica_id = ? ORDER BY segment",
            (dead,),
        ).fetchall()
        self.execute("DELETE FROM buffer_segments WHERE replica_id = ?", (dead,))
        for number, (segment, packed, released, body) in enumerate(moved, start=int(top[0]) + 1):
            arrivals = [a + offset for a in unpack_arrivals(bytes(packed))]
            spans = segment_spans(int(segment), bytes(body))
            for entry in spans:
                if type(entry) is list:  # a row, the arrival first (engine.buffered_rows)
                    entry[0] = int(entry[0]) + offset
                else:  # the object form of schema version 2
                    entry["arrival"] = int(entry["arrival"]) + offset
            self.execute(
                "INSERT INTO buffer_segments (replica_id, segment, first_arrival, last_arrival, arrivals, released,"
                " body) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (me, number, arrivals[0], arrivals[-1], pack_arrivals(arrivals), bytes(released),
                 compress(dumps(spans))),
            )
        self.execute("DELETE FROM engine WHERE replica_id = ?", (dead,))
        self.execute("DELETE FROM engine_traces WHERE replica_id = ?", (dead,))
        self.execute("UPDATE outbox SET replica_id = ? WHERE replica_id = ?", (me, dead))
        self.execute("DELETE FROM replicas WHERE replica_id = ?", (dead,))
