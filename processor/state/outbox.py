"""The transactional outbox: a violation is recorded with the state that found it, then delivered.

Violations found while evaluating a batch are inserted in the same transaction as the
state commit (or, with :meth:`Outbox.add_now`, in a small transaction of their own just
before it, so that they go out without waiting for the state to be written), keyed by
``violation_id`` (``ON CONFLICT DO NOTHING``: a violation
already recorded is never recorded, nor delivered, again). For every configured
exporter a row in ``outbox_pending`` says it still has to get it. After the commit the
:class:`Dispatcher` hands the new violations to the exporters; a pending row is
deleted when its exporter confirms delivery, in a later transaction.

After a crash every pending row is handed over again. Exporters are idempotent on the
violation id (the JSONL exporter reads back the ids it wrote, webhooks carry an
Idempotency-Key, Alertmanager alerts carry the id among their labels), so a violation
handed over twice is written, sent or alerted once.

An exporter confirms delivery when it offers ``add_delivery_listener(callback)``
(called with the delivered violation ids, from the exporter's own thread): every
exporter that delivers violations somewhere does (JSONL once the lines are written,
OTLP spans and webhooks once the endpoint accepted the request, Alertmanager once it
accepted the alerts), so a violation still waiting in an exporter's retry queue when
the process dies is pending in the outbox and handed over again after the restart. An
exporter without it (the metrics exporters, which are no violation sinks) is taken as
delivered once ``export()`` returns. A confirmation is let go only once the
transaction deleting its pending row commits. Handed-over rows not confirmed within
``redeliver_after_s`` are handed over again (an exporter that gave up on them after
its retries, or dropped them from its full queue), once that exporter's own queue is
empty, a bounded number per round.

The pending rows per exporter are published as ``durable_check_outbox_pending``.

Delivered rows are kept (``keep_delivered`` newest) so that a violation found again
later is still recognised as already emitted; pending rows per exporter are bounded
(``max_pending``), the oldest dropped and counted, as an exporter's own queue would.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, Final

import orjson

from processor.errors import StateError
from processor.state.sessionrows import dumps
from processor.state.sqlstore import SqlStateStore
from processor.telemetry import Telemetry
from processor.violations import Violation

log = logging.getLogger(__name__)

DEFAULT_KEEP_DELIVERED: Final = 100_000
DEFAULT_MAX_PENDING: Final = 100_000
# Rows handed over again per exporter and round (the exporter's queue is bounded too).
REDELIVER_BATCH: Final = 1000
# Placeholders per IN (...) list.
_IN_LIST: Final = 500
_COUNT_PENDING: Final = (
    "SELECT p.exporter, count(*) FROM outbox_pending p JOIN outbox o ON o.seq = p.seq"
    " WHERE o.replica_id = ? GROUP BY p.exporter"
)


# Every field of a violation, in declaration order: the stored body is the dataclass as a map.
_VIOLATION_FIELDS: Final = tuple(f.name for f in dataclasses.fields(Violation))


def violation_to_bytes(violation: Violation) -> bytes:
    # What dataclasses.asdict gives, without its deep copy (orjson writes tuples as lists and reads
    # nested maps as they are): the copy cost more than the rest of recording a violation.
    return dumps({name: getattr(violation, name) for name in _VIOLATION_FIELDS})


def violation_from_bytes(body: bytes) -> Violation:
    plain: dict[str, Any] = orjson.loads(body)
    plain["tags"] = tuple(plain.get("tags") or ())
    return Violation(**plain)


class Outbox:
    """The outbox table of a store, for a fixed list of exporter names."""

    def __init__(
        self,
        store: SqlStateStore,
        exporters: Sequence[str],
        *,
        keep_delivered: int = DEFAULT_KEEP_DELIVERED,
        max_pending: int = DEFAULT_MAX_PENDING,
        telemetry: Telemetry | None = None,
    ) -> None:
        self._store = store
        self.exporters = tuple(exporters)
        self.keep_delivered = keep_delivered
        self.max_pending = max_pending
        self._telemetry = telemetry
        # exporter -> rows of this replica it has not confirmed; kept by difference, recounted on prune.
        self.pending_counts: dict[str, int] = dict.fromkeys(self.exporters, 0)
        self._publish()

    def _publish(self) -> None:
        if self._telemetry is not None:
            for name, count in self.pending_counts.items():
                self._telemetry.outbox_pending.labels(name).set(count)

    def _counts(self, rows: Sequence[Sequence[Any]]) -> dict[str, int]:
        counts = dict.fromkeys(self.exporters, 0)
        for name, count in rows:
            if name in counts:
                counts[name] = int(count)
        return counts

    def refresh_counts(self) -> None:
        """Recount the pending rows per exporter (at start, after adopting another replica's work)."""
        self.pending_counts = self._counts(self._store.query(_COUNT_PENDING, (self._store.replica_id,)))
        self._publish()

    def _added(self, rows: int) -> None:
        for name in self.exporters:
            self.pending_counts[name] += rows
        self._publish()

    def add_in_unit(
        self, violations: Sequence[Violation], recorded: Callable[[list[tuple[int, Violation]]], None]
    ) -> None:
        """Record ``violations`` in the open unit; ``recorded`` gets the new ones once committed."""
        if not violations:
            return
        fresh: list[tuple[int, Violation]] = []

        def op() -> None:
            fresh[:] = self._insert(violations)

        def committed() -> None:
            self._added(len(fresh))
            recorded(list(fresh))

        self._store.in_unit(op, committed)

    def add_now(self, violations: Sequence[Violation]) -> list[tuple[int, Violation]]:
        """Record ``violations`` in a transaction of their own, at once (inside a unit too: the unit's own
        changes stay for its commit); returns the new ones. StateError on failure (rolled back)."""
        if not violations:
            return []
        store = self._store
        try:
            store.begin()
            fresh = self._insert(violations)
            store.commit_transaction()
        except StateError:
            store.rollback()
            raise
        except Exception as exc:
            store.rollback()
            translated = store.translate(exc)
            if translated is None:
                raise
            raise translated from None
        self._added(len(fresh))
        return fresh

    def _insert(self, violations: Sequence[Violation]) -> list[tuple[int, Violation]]:
        """Insert the rows (a violation already recorded is not recorded again); the new ones with their seq."""
        store = self._store
        now = time.time_ns()
        inserted = store.insert_outbox_rows([
            (v.violation_id, store.replica_id, v.session_id, now, violation_to_bytes(v)) for v in violations
        ])
        fresh: list[tuple[int, Violation]] = []
        for violation in violations:
            seq = inserted.pop(violation.violation_id, None)  # popped: a repeat in this batch is not new
            if seq is not None:
                fresh.append((seq, violation))
        if fresh and self.exporters:
            store.executemany(
                "INSERT INTO outbox_pending (exporter, seq) VALUES (?, ?) ON CONFLICT DO NOTHING",
                [(name, seq) for seq, _ in fresh for name in self.exporters],
            )
        return fresh

    def delivered_in_unit(self, exporter: str, seqs: Sequence[int], after: Callable[[], None] | None = None) -> None:
        """Delete ``exporter``'s pending rows ``seqs`` in the open unit; ``after`` runs once committed."""
        if not seqs:
            return
        rows = [(exporter, seq) for seq in seqs]

        def committed() -> None:
            if exporter in self.pending_counts:
                self.pending_counts[exporter] = max(0, self.pending_counts[exporter] - len(rows))
                self._publish()
            if after is not None:
                after()

        self._store.in_unit(lambda: self._store.executemany(
            "DELETE FROM outbox_pending WHERE exporter = ? AND seq = ?", rows), committed)

    def prune_in_unit(self) -> None:
        """Bound the table: forget the oldest delivered rows, and pending rows past ``max_pending``.

        Also recounts the pending rows (the counts kept by difference are exact again once committed)."""
        store = self._store
        counted: dict[str, int] = {}
        dropped_by: dict[str, int] = {}

        def op() -> None:
            dropped_by.clear()  # the unit may run again after a failed attempt
            for name in self.exporters:
                cut = store.execute(
                    "SELECT seq FROM outbox_pending WHERE exporter = ? ORDER BY seq DESC LIMIT 1 OFFSET ?",
                    (name, self.max_pending),
                ).fetchone()
                if cut is not None:
                    dropped = store.execute(
                        "DELETE FROM outbox_pending WHERE exporter = ? AND seq <= ?", (name, int(cut[0]))
                    ).rowcount
                    dropped_by[name] = dropped
                    log.error("outbox: exporter %s has more than %d undelivered violations; dropped the %d oldest",
                              name, self.max_pending, dropped)
            cut = store.execute(
                "SELECT seq FROM outbox WHERE replica_id = ? ORDER BY seq DESC LIMIT 1 OFFSET ?",
                (store.replica_id, self.keep_delivered),
            ).fetchone()
            if cut is not None:
                store.execute(
                    "DELETE FROM outbox WHERE replica_id = ? AND seq <= ?"
                    " AND NOT EXISTS (SELECT 1 FROM outbox_pending p WHERE p.seq = outbox.seq)",
                    (store.replica_id, int(cut[0])),
                )
            counted.clear()
            counted.update(self._counts(store.execute(_COUNT_PENDING, (store.replica_id,)).fetchall()))

        def committed() -> None:
            self.pending_counts = dict(counted)
            self._publish()
            if self._telemetry is not None:
                # Counted where exporters count what they give up on: the drop alert sees it.
                for name, dropped in dropped_by.items():
                    self._telemetry.exporter_dropped.labels(name).inc(dropped)

        store.in_unit(op, committed)

    def forget_unknown_exporters(self) -> None:
        """Pending rows of exporters no longer configured would wait forever: drop them (own transaction)."""
        store = self._store
        names = self.exporters

        def op() -> None:
            marks = ", ".join("?" for _ in names)
            condition = f"exporter NOT IN ({marks})" if names else "1 = 1"
            # Only placeholders are formatted into the statement; the names are parameters.
            statement = (
                f"DELETE FROM outbox_pending WHERE {condition} AND seq IN"  # noqa: S608
                " (SELECT seq FROM outbox WHERE replica_id = ?)"
            )
            dropped = store.execute(statement, (*names, store.replica_id)).rowcount
            if dropped:
                log.warning("outbox: dropped %d undelivered violation(s) of exporters no longer configured", dropped)

        store.write([op])

    def pending(self, exporter: str, after_seq: int = 0, limit: int = 1000) -> list[tuple[int, Violation]]:
        rows = self._store.query(
            "SELECT o.seq, o.body FROM outbox_pending p JOIN outbox o ON o.seq = p.seq"
            " WHERE p.exporter = ? AND o.replica_id = ? AND p.seq > ? ORDER BY p.seq LIMIT ?",
            (exporter, self._store.replica_id, after_seq, limit),
        )
        return [(int(seq), violation_from_bytes(bytes(body))) for seq, body in rows]

    def pending_rows(self, exporter: str, seqs: Sequence[int]) -> list[tuple[int, Violation]]:
        """Those of ``seqs`` still pending for ``exporter``, oldest first."""
        out: list[tuple[int, Violation]] = []
        ordered = sorted(seqs)
        for start in range(0, len(ordered), _IN_LIST):
            chunk = ordered[start:start + _IN_LIST]
            marks = ", ".join("?" for _ in chunk)
            # Only placeholders are formatted into the statement; the values are parameters.
            statement = (
                "SELECT o.seq, o.body FROM outbox_pending p JOIN outbox o ON o.seq = p.seq"  # noqa: S608
                f" WHERE p.exporter = ? AND o.replica_id = ? AND p.seq IN ({marks}) ORDER BY p.seq"
            )
            rows = self._store.query(statement, (exporter, self._store.replica_id, *chunk))
            out.extend((int(seq), violation_from_bytes(bytes(body))) for seq, body in rows)
        return out

    def recorded_ids(self) -> set[str]:
        """Every violation id in the outbox (tests, debugging)."""
        return {str(r[0]) for r in self._store.query("SELECT violation_id FROM outbox")}


class Dispatcher:
    """Hands outbox rows to the exporters and collects their confirmations; driven by the evaluator thread."""

    def __init__(self, outbox: Outbox, exporters: Sequence[Any], *, redeliver_after_s: float = 60.0) -> None:
        self._outbox = outbox
        self._exporters = {e.name: e for e in exporters}
        self.redeliver_after_s = redeliver_after_s
        # exporter -> violation id -> (seq, monotonic time handed over)
        self._in_flight: dict[str, dict[str, tuple[int, float]]] = {name: {} for name in self._exporters}
        self._lock = threading.Lock()
        # Confirmations not yet committed; appended by exporter threads, removed once their deletion commits.
        self._confirmed: collections.deque[tuple[str, list[str]]] = collections.deque()
        self._confirming: set[str] = set()
        for name, exporter in self._exporters.items():
            listen = getattr(exporter, "add_delivery_listener", None)
            if callable(listen):
                listen(self._listener(name))
                self._confirming.add(name)
        # Until every pending row is handed over again at start, nothing counts as delivered.
        self._resumed = False
        for name, exporter in self._exporters.items():
            hold_for = getattr(exporter, "hold_for", None)
            if callable(hold_for):
                # An exporter keeping copies (JSONL rotation) keeps those another exporter still owes.
                others = self._confirming - {name}
                hold_for(self._undelivered_by(others) if others else None)

    def _undelivered_by(self, names: set[str]) -> Callable[[Collection[str]], set[str] | None]:
        def undelivered(violation_ids: Collection[str]) -> set[str] | None:
            """Those of the ids pending for one of ``names``: handed over and not confirmed."""
            if not self._resumed:
                return None  # the pending rows are not all handed over yet: nothing is known delivered
            flights = [self._in_flight[name] for name in names]
            # Membership tests only (never iterating a dict the evaluator thread changes).
            return {vid for vid in violation_ids if any(vid in flight for flight in flights)}
        return undelivered

    def _listener(self, name: str) -> Callable[[Sequence[str]], None]:
        def delivered(violation_ids: Sequence[str]) -> None:
            with self._lock:
                self._confirmed.append((name, list(violation_ids)))

        return delivered

    def hand_over(self, rows: Sequence[tuple[int, Violation]], only: str | None = None) -> None:
        """Give ``rows`` to every exporter (or just ``only``); exporters never raise into the caller."""
        if not rows:
            return
        now = time.monotonic()
        targets = [(name, e) for name, e in self._exporters.items() if only is None or name == only]
        # Every exporter's flight first: JSONL rotating while it writes these asks what the others owe.
        for name, _ in targets:
            flight = self._in_flight[name]
            for seq, violation in rows:
                flight[violation.violation_id] = (seq, now)
        for name, exporter in targets:
            exporter.export([v for _, v in rows])
            if name not in self._confirming:
                # It offers no confirmation: taken into its own hands is as delivered as it gets.
                with self._lock:
                    self._confirmed.append((name, [v.violation_id for _, v in rows]))

    def confirmations_in_unit(self) -> int:
        """Delete the pending rows of confirmed deliveries in the open unit; returns how many.

        The confirmations are let go only once that unit commits: after a failed commit
        the next unit deletes them again.
        """
        with self._lock:
            batches = list(self._confirmed)
        if not batches:
            return 0
        by_exporter: dict[str, list[int]] = {}
        settled: list[tuple[str, str, int]] = []
        for name, ids in batches:
            flight = self._in_flight.get(name, {})
            for violation_id in ids:
                entry = flight.get(violation_id)
                if entry is not None:
                    by_exporter.setdefault(name, []).append(entry[0])
                    settled.append((name, violation_id, entry[0]))

        def committed() -> None:
            with self._lock:
                for _ in batches:
                    self._confirmed.popleft()
            for name, violation_id, seq in settled:
                flight = self._in_flight.get(name, {})
                # Handed over again meanwhile under another seq (cannot happen for one id), keep that.
                if flight.get(violation_id, (seq, 0.0))[0] == seq:
                    flight.pop(violation_id, None)

        names = list(by_exporter)
        if not names:
            # Nothing of these is in flight any more (handed over before a restart of the dispatcher).
            committed()
            return 0
        for index, name in enumerate(names):
            self._outbox.delivered_in_unit(name, by_exporter[name], committed if index == len(names) - 1 else None)
        return len(settled)

    def has_confirmations(self) -> bool:
        with self._lock:
            return bool(self._confirmed)

    def resume(self) -> int:
        """Hand over every pending row (at start, after a rebuild); returns how many rows."""
        self._resumed = False
        self._outbox.refresh_counts()
        total = 0
        for name in self._exporters:
            self._in_flight[name].clear()
            after = 0
            while True:
                rows = self._outbox.pending(name, after)
                if not rows:
                    break
                self.hand_over(rows, only=name)
                total += len(rows)
                after = rows[-1][0]
        self._resumed = True
        return total

    def redeliver_overdue(self) -> int:
        """Hand over again what was handed over long ago and never confirmed (an exporter that gave up on it
        after its retries, or dropped it from a full queue); returns how many rows.

        An exporter still working through its own queue is left alone (what it holds is not lost, and
        more would only push its oldest out), and at most ``REDELIVER_BATCH`` rows go per round.
        """
        cutoff = time.monotonic() - self.redeliver_after_s
        total = 0
        for name in self._confirming:
            if _backlog(self._exporters[name]):
                continue
            flight = self._in_flight[name]
            overdue = sorted(seq for seq, at in flight.values() if at <= cutoff)[:REDELIVER_BATCH]
            if not overdue:
                continue
            again = self._outbox.pending_rows(name, overdue)
            # Rows no longer pending (confirmed meanwhile, or dropped at the bound) are not waited for.
            gone = set(overdue) - {seq for seq, _ in again}
            for violation_id in [vid for vid, (seq, _) in flight.items() if seq in gone]:
                del flight[violation_id]
            self.hand_over(again, only=name)
            total += len(again)
        return total


def _backlog(exporter: Any) -> int:
    """Items an exporter still holds in its retry queue (0 for one without a queue)."""
    queue = getattr(exporter, "queue", None)
    depth = getattr(queue, "depth", 0)
    return depth if isinstance(depth, int) else 0
