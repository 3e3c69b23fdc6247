"""Store failures as clear errors: what went wrong and where, never a driver traceback.

Every failure of a durable store surfaces as :class:`processor.errors.StateError` (or a
subclass below). The serve worker answers the request that met it with a retryable
error (gRPC UNAVAILABLE, HTTP 503) instead of acknowledging it, and tries again on the
next request: a fault that clears (space freed, permissions fixed, the database back)
needs no restart. A fault found while opening the store (a corrupt file, a directory
that cannot be written) stops ``serve`` before it accepts anything, with a message
naming the file.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Final

from processor.errors import StateError
from processor.private_files import make_private_dirs


class StateCorrupt(StateError):
    """The state file fails its integrity check; serve refuses to start on it."""


class StateUnavailable(StateError):
    """The store cannot be reached or written for now (locked, full, read-only, connection lost)."""


class JournalFull(StateUnavailable):
    """The inbox journal holds its maximum of unprocessed requests; senders retry later."""


class SessionOwnedElsewhere(StateUnavailable):
    """Another replica holds the lease of a session in the request; the sender retries (after the lease moves).

    ``moved`` maps the sessions found owned by another replica to that replica.
    """

    def __init__(self, message: str, moved: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.moved = dict(moved or {})


_SQLITE_BUSY: Final = frozenset({"SQLITE_BUSY", "SQLITE_LOCKED"})
_SQLITE_CORRUPT: Final = frozenset({"SQLITE_CORRUPT", "SQLITE_NOTADB"})


def _code(exc: sqlite3.Error) -> str:
    name = getattr(exc, "sqlite_errorname", None)
    if isinstance(name, str):
        # Extended codes (SQLITE_IOERR_WRITE, SQLITE_READONLY_DIRECTORY) share the primary's prefix.
        for primary in ("SQLITE_BUSY", "SQLITE_LOCKED", "SQLITE_FULL", "SQLITE_READONLY", "SQLITE_CORRUPT",
                        "SQLITE_NOTADB", "SQLITE_CANTOPEN", "SQLITE_IOERR", "SQLITE_PERM"):
            if name == primary or name.startswith(primary + "_"):
                return primary
        return name
    return ""


def sqlite_error(exc: sqlite3.Error, path: str | Path, busy_timeout_s: float) -> StateError:
    """The StateError that says what an SQLite failure means for the operator."""
    code = _code(exc)
    where = str(path)
    if code in _SQLITE_BUSY:
        return StateUnavailable(
            f"the state database {where} stayed locked by another process for more than {busy_timeout_s:g}s"
        )
    if code == "SQLITE_FULL":
        return StateUnavailable(f"disk full at {where}")
    if code == "SQLITE_IOERR" and _disk_full(where):
        return StateUnavailable(f"disk full at {where}")
    if code in ("SQLITE_READONLY", "SQLITE_PERM"):
        return StateUnavailable(f"the state database {where} is read-only (check the permissions of the file and "
                                "its directory)")
    if code in _SQLITE_CORRUPT:
        return StateCorrupt(f"the state database {where} is corrupt ({code}); move it aside to start empty")
    if code == "SQLITE_CANTOPEN":
        return StateUnavailable(f"cannot open the state database {where} (missing directory or no permission)")
    if code == "SQLITE_IOERR":
        return StateUnavailable(f"I/O error on the state database {where}")
    return StateUnavailable(f"the state database {where} failed: {code or type(exc).__name__}")


def _disk_full(path: str) -> bool:
    try:
        stats = os.statvfs(os.path.dirname(os.path.abspath(path)) or ".")
    except OSError:
        return False
    return stats.f_bavail == 0


def check_state_directory(path: str | Path) -> None:
    """Refuse a state file whose directory cannot be created or written: say so before serving."""
    directory = Path(path).resolve().parent
    try:
        make_private_dirs(directory)
    except OSError as exc:
        raise StateUnavailable(f"cannot create the state directory {directory}: {exc.strerror or exc}") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise StateUnavailable(
            f"the state directory {directory} is not writable; the state database {path} and its write-ahead "
            "log need it"
        )


def postgres_error(exc: Exception, where: str) -> StateError:
    """The StateError for a PostgreSQL failure; ``where`` names the server without its password."""
    import psycopg

    if isinstance(exc, psycopg.errors.DiskFull):
        return StateUnavailable(f"disk full on the PostgreSQL server {where}")
    if isinstance(exc, psycopg.errors.ReadOnlySqlTransaction):
        return StateUnavailable(f"the PostgreSQL server {where} is read-only (a standby?)")
    if isinstance(exc, psycopg.errors.LockNotAvailable | psycopg.errors.DeadlockDetected):
        return StateUnavailable(f"a lock on the PostgreSQL server {where} was not granted in time")
    if isinstance(exc, psycopg.OperationalError):
        return StateUnavailable(f"lost the connection to the PostgreSQL server {where}")
    sqlstate = getattr(exc, "sqlstate", None) or type(exc).__name__
    return StateUnavailable(f"the PostgreSQL server {where} refused a state update ({sqlstate})")


def failure_kind(exc: StateError) -> str | None:
    """The ``durable_check_state_failures`` kind of a store failure (the messages of processor.state.faults);
    None for a refusal that is no failure of the store (journal full, a session held by another replica)."""
    if isinstance(exc, JournalFull | SessionOwnedElsewhere):
        return None
    if isinstance(exc, StateCorrupt):
        return "corrupt"
    text = str(exc)
    if "disk full" in text:
        return "full"
    if "locked by another process" in text or "lock on the PostgreSQL server" in text:
        return "locked"
    if "read-only" in text:
        return "read_only"
    if "lost the connection" in text:
        return "connection"
    return "other"
