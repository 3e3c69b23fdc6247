"""The inbox journal: a request is written down before it is acknowledged.

Serve with a durable store acknowledges an OTLP request once its bytes are in the
journal, committed: from then on the request is the checker's responsibility, crash or
not. The evaluator consumes entries in order; the transaction that commits the state
they produced also deletes them (that is "done"), so after a crash exactly the entries
whose effects were not committed are evaluated again.

Appends are group commits: the worker journals every request waiting in the queue in
one transaction, so many requests share one fsync. A request journaled whose
acknowledgement never reached the client (a crash in between) comes back as the
client's retry; the engine's duplicate detection (a span's delivery key) absorbs it.

A request's bytes are stored as a zstd frame (``processor.state.compression``): the journal
writes every request once more than the network carried it, and compressed that costs
several times less disk and write-ahead log. Rows of schema version 3, stored as they
came, are read as they are.

The journal is bounded (``max_bytes`` of unprocessed requests, counted as received, not
as stored): past the bound a request is refused with :class:`~processor.state.faults.JournalFull`, which the
receivers answer as "retry later". What it holds is published as
``durable_check_journal_depth`` (requests) and ``durable_check_journal_bytes``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

import orjson

from processor.errors import StateError
from processor.state.compression import COMPRESSED_SUFFIX, DamagedBody, compress, decompress
from processor.state.faults import JournalFull
from processor.state.sqlstore import SqlStateStore, UnitOp
from processor.telemetry import Telemetry

# The kind of body: an OTLP ExportTraceServiceRequest (the only kind so far).
EntryKind = Literal["otlp"]

DEFAULT_MAX_BYTES: Final = 256 * 1024 * 1024


@dataclass(slots=True)
class NewEntry:
    """A request to journal: its protocol-buffer bytes and what is needed to evaluate it again the same way."""

    body: bytes
    protocol: str
    origin: str
    received_ns: int
    # The seq the converter gave its first action: a replay converts with the same seqs.
    seq_base: int
    # Spans the receiver could not decode (OTLP/JSON), reported as malformed records.
    problems: list[str] = field(default_factory=list)
    # Sessions the request touches (a shared store claims them before acknowledging).
    session_ids: frozenset[str] = frozenset()
    kind: EntryKind = "otlp"


@dataclass(frozen=True, slots=True)
class JournalEntry:
    id: int
    kind: EntryKind
    protocol: str
    origin: str
    received_ns: int
    seq_base: int
    problems: list[str]
    size: int
    body: bytes
    # Why the stored request cannot be read back (its body is damaged, or of a kind this build
    # does not know); ``body`` is then empty and the entry is skipped when evaluated.
    damaged: str | None = None


class Journal:
    """The journal of one replica, in its store's database."""

    def __init__(
        self, store: SqlStateStore, *, max_bytes: int = DEFAULT_MAX_BYTES, telemetry: Telemetry | None = None
    ) -> None:
        self._store = store
        self._telemetry = telemetry
        self.max_bytes = max_bytes
        self.pending_bytes = 0
        self.pending_count = 0
        self.refresh()

    def refresh(self) -> None:
        """Recount what is pending (at start, and after another replica's entries were adopted)."""
        rows = self._store.query(
            "SELECT count(*), coalesce(sum(size), 0) FROM journal WHERE replica_id = ?", (self._store.replica_id,)
        )
        self.pending_count = int(rows[0][0])
        self.pending_bytes = int(rows[0][1])
        self._publish()

    def _publish(self) -> None:
        if self._telemetry is not None:
            self._telemetry.journal_depth.set(self.pending_count)
            self._telemetry.journal_bytes.set(self.pending_bytes)

    def append(
        self,
        entries: Sequence[NewEntry],
        admit: Callable[[NewEntry], StateError | None] | None = None,
        also: Sequence[UnitOp] = (),
    ) -> list[int | StateError]:
        """Journal ``entries`` in one transaction: for each, its id, or why it was refused.

        ``admit`` runs inside the transaction before an entry is written (a shared store
        claims the entry's sessions there) and refuses it by returning an error. Raises
        StateError (nothing journaled) when the transaction fails.
        """
        outcome: list[int | StateError] = []
        added_bytes = 0
        # Compressed once, outside the transaction (which may run again after a conflict).
        stored = [compress(entry.body) for entry in entries]

        def op() -> None:
            nonlocal added_bytes
            outcome.clear()
            added_bytes = 0
            for index, entry in enumerate(entries):
                size = len(entry.body)
                # An empty journal takes any request, so one larger than the bound still gets through.
                if self.pending_bytes + added_bytes > 0 and self.pending_bytes + added_bytes + size > self.max_bytes:
                    outcome.append(JournalFull(
                        f"the inbox journal holds {self.pending_bytes + added_bytes} bytes of requests not yet "
                        f"evaluated (bound {self.max_bytes})"
                    ))
                    continue
                refused = admit(entry) if admit is not None else None
                if refused is not None:
                    outcome.append(refused)
                    continue
                row = self._store.execute(
                    "INSERT INTO journal (replica_id, kind, protocol, origin, received_ns, seq_base, problems, size,"
                    " body) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING id",
                    (self._store.replica_id, entry.kind + COMPRESSED_SUFFIX, entry.protocol, entry.origin,
                     entry.received_ns, entry.seq_base, orjson.dumps(entry.problems).decode(), size,
                     stored[index]),
                ).fetchone()
                outcome.append(int(row[0]))
                added_bytes += size

        self._store.write([op, *also])
        self.pending_bytes += added_bytes
        self.pending_count += sum(1 for o in outcome if isinstance(o, int))
        self._publish()
        return outcome

    def pending(self, after_id: int = 0, limit: int = 256) -> list[JournalEntry]:
        """Entries not yet done, oldest first, with ids above ``after_id`` (one that cannot be read
        back says why in ``damaged``)."""
        rows = self._store.query(
            "SELECT id, kind, protocol, origin, received_ns, seq_base, problems, size, body FROM journal"
            " WHERE replica_id = ? AND id > ? ORDER BY id LIMIT ?",
            (self._store.replica_id, after_id, limit),
        )
        out: list[JournalEntry] = []
        for r in rows:
            damaged: str | None = None
            try:
                body = _stored_body(str(r[1]), int(r[7]), bytes(r[8]))
            except DamagedBody as exc:
                body, damaged = b"", str(exc)
            out.append(JournalEntry(int(r[0]), "otlp", str(r[2]), str(r[3]), int(r[4]), int(r[5]),
                                    list(orjson.loads(r[6])), int(r[7]), body, damaged))
        return out

    def done_in_unit(self, entries: Sequence[tuple[int, int]]) -> None:
        """Delete ``entries`` (id, size) in the open unit of work: done exactly when the state they produced
        is committed."""
        if not entries:
            return
        ids = [(entry_id,) for entry_id, _ in entries]
        size = sum(entry_size for _, entry_size in entries)

        def op() -> None:
            self._store.executemany("DELETE FROM journal WHERE id = ?", ids)

        def after() -> None:
            self.pending_bytes = max(0, self.pending_bytes - size)
            self.pending_count = max(0, self.pending_count - len(ids))
            self._publish()

        self._store.in_unit(op, after)


def _stored_body(kind: str, size: int, stored: bytes) -> bytes:
    """A request's bytes from its row: unpacked when its kind says so (schema 4), else as stored."""
    if kind == "otlp" + COMPRESSED_SUFFIX:
        return decompress(stored, size)
    if kind == "otlp":
        return stored
    raise DamagedBody(f"its kind {kind!r} is not one this build can evaluate")
