"""The embedded durable store: one SQLite database file, in WAL mode, for one serve process.

It holds the engine's sessions, timers and engine-wide state, the inbox journal and
the outbox (see :mod:`processor.state.sqlstore`, :mod:`processor.state.journal`,
:mod:`processor.state.outbox`), so a request's journal entry, the state it produced and
the violations it found are committed in one transaction.

**Durability.** ``journal_mode=WAL`` lets a commit append to the write-ahead log
instead of rewriting pages. ``synchronous=FULL`` (the default) fsyncs the log at every
commit: an acknowledged request survives a power cut or a kernel crash, not only a
killed process. ``NORMAL`` skips that fsync (a killed process still loses nothing; a
power cut may lose the last commits, which were already acknowledged), so it is
offered only for disposable state. The cost of the fsync is shared: the worker
journals every request waiting in the queue in one transaction (group commit), and
evaluates them in another.

**Ownership.** One process per database file (an exclusive lock on ``<path>.lock``; a
second ``serve`` on the same file refuses to start). One connection, used only by the
evaluator thread (it is created by the thread that builds the pipeline and then handed
over; nothing else touches it).
``busy_timeout`` bounds how long a commit waits for a lock held by another process
(``durable-check`` run twice on one file, a backup tool): past it the commit fails with
a clear "locked" error and the request is answered "retry later".

**At open** the file is checked with ``PRAGMA quick_check``: a corrupt database stops
serve with a message naming the file instead of evaluating on damaged state.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final, Literal

from processor.errors import StateError
from processor.private_files import open_private
from processor.state.faults import StateCorrupt, StateUnavailable, check_state_directory, sqlite_error
from processor.state.sqlstore import TABLES, SqlStateStore

log = logging.getLogger(__name__)

Synchronous = Literal["full", "normal"]
LOCAL_REPLICA: Final = "local"
_TYPES: Final = {"INT": "INTEGER", "BLOB": "BLOB", "SERIAL": "INTEGER PRIMARY KEY AUTOINCREMENT"}


class SqliteStore(SqlStateStore):
    def __init__(
        self,
        path: str | Path,
        *,
        synchronous: Synchronous = "full",
        busy_timeout_s: float = 5.0,
        max_page_count: int | None = None,
    ) -> None:
        """Open (creating if needed) the database at ``path``; StateError names the file when it cannot."""
        super().__init__(LOCAL_REPLICA)
        self.path = Path(path)
        self.busy_timeout_s = busy_timeout_s
        check_state_directory(self.path)
        self._lock_fd = _lock_exclusively(self.path)
        try:
            # Created here, 0600 and never through a link: SQLite gives its -wal and -shm the database's mode.
            os.close(open_private(self.path, os.O_RDWR | os.O_CREAT))
        except OSError as exc:
            self._unlock()
            raise StateUnavailable(f"cannot open the state database {self.path}: {exc.strerror or exc}") from None
        try:
            # Autocommit mode: transactions are the explicit BEGIN IMMEDIATE ... COMMIT below.
            self._conn = sqlite3.connect(
                self.path, isolation_level=None, check_same_thread=False, timeout=busy_timeout_s
            )
        except sqlite3.Error as exc:
            self._unlock()
            raise sqlite_error(exc, self.path, busy_timeout_s) from None
        try:
            self._configure(synchronous, max_page_count)
            self._check_integrity()
            self._create_tables()
            self._load_timers()
        except sqlite3.Error as exc:
            self._conn.close()
            self._unlock()
            raise sqlite_error(exc, self.path, busy_timeout_s) from None
        except StateError:
            self._conn.close()
            self._unlock()
            raise

    def _configure(self, synchronous: Synchronous, max_page_count: int | None) -> None:
        conn = self._conn
        conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()
        if mode is None or str(mode[0]).lower() != "wal":
            raise StateError(f"the state database {self.path} cannot use write-ahead logging "
                             f"(journal mode {mode[0] if mode else 'unknown'}); is it on a network file system?")
        conn.execute(f"PRAGMA synchronous = {synchronous.upper()}")
        if max_page_count is not None:
            # A hard cap on the file's size: past it SQLite answers SQLITE_FULL, as a full disk would.
            conn.execute(f"PRAGMA max_page_count = {int(max_page_count)}")

    def _check_integrity(self) -> None:
        rows = self._conn.execute("PRAGMA quick_check").fetchall()
        if [tuple(r) for r in rows] != [("ok",)]:
            raise StateCorrupt(
                f"the state database {self.path} failed its integrity check ({len(rows)} problem(s)); "
                "move it aside (and its -wal file) to start with empty state"
            )

    def _create_tables(self) -> None:
        self.begin()
        try:
            self.create_schema(TABLES, _TYPES, str(self.path))
            self.commit_transaction()
        except BaseException:
            self.rollback()
            raise

    # -- SqlStateStore ---------------------------------------------------------------------

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        return self._conn.execute(sql, params)

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        self._conn.executemany(sql, rows)

    def begin(self) -> None:
        # IMMEDIATE takes the write lock now, so busy_timeout covers the whole transaction.
        self._conn.execute("BEGIN IMMEDIATE")

    def commit_transaction(self) -> None:
        self._conn.execute("COMMIT")

    def rollback(self) -> None:
        if self._conn.in_transaction:
            try:
                self._conn.execute("ROLLBACK")
            except sqlite3.Error:
                log.warning("rolling back the state database %s failed", self.path)

    def has_table(self, name: str) -> bool:
        found = self._conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,))
        return found.fetchone() is not None

    def translate(self, exc: Exception) -> StateError | None:
        if isinstance(exc, sqlite3.Error):
            return sqlite_error(exc, self.path, self.busy_timeout_s)
        return None

    def close(self) -> None:
        try:
            self._conn.close()
        except sqlite3.Error:
            log.warning("closing the state database %s failed", self.path)
        self._unlock()

    def _unlock(self) -> None:
        fd, self._lock_fd = self._lock_fd, -1
        if fd >= 0:
            os.close(fd)  # closing the descriptor releases the lock


def _lock_exclusively(path: Path) -> int:
    """One process per database: two would both write the engine state of the same replica.

    The lock is on ``<path>.lock``, held while the store is open; the kernel releases it
    when the process dies, however it dies.
    """
    lock_path = path.with_name(path.name + ".lock")
    try:
        fd = open_private(lock_path, os.O_RDWR | os.O_CREAT)
    except OSError as exc:
        raise StateUnavailable(f"cannot create the lock file {lock_path}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise StateUnavailable(
            f"the state database {path} is in use by another durable-check process; each process needs its own"
        ) from None
    return fd
