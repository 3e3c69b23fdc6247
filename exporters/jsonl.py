"""Violations as JSON lines, written once each, in size-rotated files.

Each line is ``Violation.to_json()`` plus ``time`` (RFC 3339). Writing a local file is
synchronous: when ``export()`` returns the lines are in the file (and on disk, per the
fsync policy). A failed write (disk full, permissions) is counted, logged and kept in
a bounded retry queue; it never raises into the pipeline. Delivery listeners are told
the ids once their lines are in the file, so serve's outbox keeps a violation whose
write failed until a retry wrote it, across a crash too.

A violation is written once: the ids written are remembered (the newest
``dedupe_ids`` of them, as fixed-size digests in memory allocated at start: see
``exporters._recent``), and on start they are read back from the file and its rotated
copies (newest first, as far back as those ids go), so a restart that re-evaluates the
same input does not write a line twice.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import orjson

from exporters._recent import RecentIds
from exporters.base import (
    RetryPolicy,
    RetryQueue,
    SendResult,
    Undelivered,
    describe_error,
    json_default,
    tell_listeners,
    violation_document,
)
from exporters.config import JsonlConfig
from processor.errors import ConfigError, Problem
from processor.private_files import make_private_dirs, open_private
from processor.records import Action
from processor.telemetry import Telemetry
from processor.violations import Violation

log = logging.getLogger("durable_check.exporters")

FsyncMode = Literal["always", "batch", "never"]
# A retry of a failed write re-tries all of these at once.
_RETRY_BATCH = 1000
# Seconds between looks at the held rotated copies outside rotation.
_SETTLE_INTERVAL_S = 1.0


def dumps_line(document: dict[str, Any]) -> bytes:
    return orjson.dumps(document, default=json_default, option=orjson.OPT_APPEND_NEWLINE | orjson.OPT_NON_STR_KEYS)


class RotatingFile:
    """An append-only file rotated by size: ``path`` -> ``path.1`` -> ... -> ``path.keep``.

    Writes are unbuffered so that a failed write is known at once; a line torn by a
    failed write is cut off again before the next write, so the file only ever holds
    whole lines.
    """

    def __init__(
        self, path: Path, max_size: int, keep: int, fsync: FsyncMode, *,
        on_removed: Callable[[int, int], None] | None = None, hold_max_size: int = 0,
    ) -> None:
        self.path = path
        # Told how many lines a rotation removed with a copy, and how many of them other
        # exporters had not delivered yet: never silently.
        self.on_removed = on_removed
        self.max_size = max_size
        self.keep = keep
        self.fsync = fsync
        # Copies past ``keep`` that hold violations not delivered elsewhere are kept, up to
        # this many bytes in all; ``undelivered(ids)`` says which ids other exporters still owe.
        self.hold_max_size = hold_max_size
        self.undelivered: Undelivered | None = None
        # (device, inode) of a held copy -> its ids still owed elsewhere (a copy keeps its
        # inode across renames; the set only shrinks, and is bounded by the others' queues).
        self._owed: dict[tuple[int, int], set[str]] = {}
        self._fd: int | None = None
        self._size = 0
        self._regular = True
        self.lines_written = 0

    def _numbered(self, index: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{index}")

    def rotated_paths(self) -> list[Path]:
        """The rotated copies, newest first: ``path.1`` … ``path.<keep>``, then the held ones past it."""
        paths = [self._numbered(i) for i in range(1, self.keep + 1)]
        index = self.keep + 1
        while self._numbered(index).exists():
            paths.append(self._numbered(index))
            index += 1
        return paths

    def held_bytes(self) -> int:
        """Bytes in the copies kept past ``rotate_keep`` for violations not delivered elsewhere."""
        return sum(_size_of(p) for p in self.rotated_paths()[self.keep:])

    def _open(self) -> int:
        if self._fd is None:
            make_private_dirs(self.path.parent)
            self.cut_torn_tail()
            fd = open_private(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            info = os.fstat(fd)
            self._size = info.st_size
            # A device or pipe (say /dev/stdout) is neither rotated nor fsynced.
            self._regular = stat.S_ISREG(info.st_mode)
            self._fd = fd
        return self._fd

    def looks_owned(self) -> bool:
        """Whether the file can be ours: absent, empty, a stream, or JSON lines (a first byte ``{``).

        Serve truncates and rotates its JSONL files; a file that holds anything else
        (the state database named twice, a log of another program) is never touched.
        """
        if not self.path.is_file():
            return True  # absent, or a stream (never opened for reading: a FIFO would block)
        try:
            with os.fdopen(open_private(self.path, os.O_RDONLY), "rb") as f:
                first = f.read(1)
        except FileNotFoundError:
            return True
        return first in (b"", b"{")

    def cut_torn_tail(self) -> bool:
        """Drop a last line without its newline (a crash mid-write); True if one was cut."""
        if not self.path.is_file() or not self.looks_owned():
            return False  # absent, a device or pipe, or not a JSONL file: nothing of ours to cut
        try:
            with os.fdopen(open_private(self.path, os.O_RDWR), "rb+") as f:
                size = f.seek(0, os.SEEK_END)
                if size == 0:
                    return False
                f.seek(size - 1)
                if f.read(1) == b"\n":
                    return False
                # Walk back in bounded chunks to the last newline.
                pos = size
                while pos > 0:
                    step = min(65536, pos)
                    pos -= step
                    f.seek(pos)
                    chunk = f.read(step)
                    idx = chunk.rfind(b"\n")
                    if idx >= 0:
                        f.truncate(pos + idx + 1)
                        return True
                f.truncate(0)
                return True
        except FileNotFoundError:
            return False

    def write_lines(self, lines: Sequence[bytes]) -> None:
        """Append whole lines, rotating before a line that would overflow the size bound.

        On OSError, ``lines_written`` tells how many of ``lines`` made it into the file
        (whole), so the caller does not write those again.
        """
        self.lines_written = 0
        chunk: list[bytes] = []
        chunk_size = 0
        fd = self._open()
        for line in lines:
            pending = self._size + chunk_size
            if self._regular and self.max_size > 0 and pending > 0 and pending + len(line) > self.max_size:
                self._write(fd, chunk)
                chunk, chunk_size = [], 0
                self._rotate()
                fd = self._open()
            chunk.append(line)
            chunk_size += len(line)
            if self.fsync == "always":
                self._write(fd, chunk)
                self._sync(fd)
                chunk, chunk_size = [], 0
        if chunk:
            self._write(fd, chunk)
        if self.fsync == "batch":
            self._sync(fd)

    def _sync(self, fd: int) -> None:
        if self._regular:
            os.fsync(fd)

    def _write(self, fd: int, chunk: list[bytes]) -> None:
        if not chunk:
            return
        data = b"".join(chunk)
        view = memoryview(data)
        try:
            while view:
                written = os.write(fd, view)
                view = view[written:]
        except OSError:
            # Cut the torn line so the file keeps whole lines only; if even that fails,
            # reopen (and re-measure) on the next attempt.
            try:
                os.ftruncate(fd, self._size)
            except OSError:
                self.close()
            raise
        self._size += len(data)
        self.lines_written += len(chunk)

    def _rotate(self) -> None:
        self.close()
        holding = self.hold_max_size > 0 and self.undelivered is not None
        if self.keep == 0 and not holding:
            removed = _count_lines(self.path)
            self.path.unlink(missing_ok=True)
            self._removed(removed, 0)
        else:
            # Shift every copy one up, held ones included: path -> path.1 -> path.2 …
            chain = [self.path, *self.rotated_paths()]
            for copy in chain[1:]:
                if copy.exists() and not copy.is_file():
                    # Never move or remove what is not a copy of ours; the write is retried.
                    raise OSError(errno.EEXIST, "a rotated copy is not a regular file", str(copy))
            for index in range(len(chain) - 1, -1, -1):
                if chain[index].exists():
                    os.replace(chain[index], self._numbered(index + 1))
            self._settle(holding)
        if self.fsync != "never":
            self._fsync_dir()

    def settle_held(self) -> None:
        """Let go of the held copies nothing is owed from any more (also done at every rotation)."""
        holding = self.hold_max_size > 0 and self.undelivered is not None
        if len(self.rotated_paths()) <= self.keep:
            return
        self._settle(holding)
        if self.fsync != "never":
            self._fsync_dir()

    def _removed(self, lines: int, owed: int) -> None:
        if lines and self.on_removed is not None:
            self.on_removed(lines, owed)

    def _settle(self, holding: bool) -> None:
        """Remove the copies past ``keep`` that nothing is owed from (or, past the bound, the oldest
        anyway), then number the rest on from ``keep + 1``."""
        past = self.rotated_paths()[self.keep:]
        kept: list[Path] = []
        for copy in past:
            if holding and self._still_owed(copy):
                kept.append(copy)
            else:
                self._remove(copy, 0)
        # Oldest first, until what is held fits its bound.
        total = sum(_size_of(p) for p in kept)
        while kept and total > self.hold_max_size:
            oldest = kept.pop()
            total -= _size_of(oldest)
            owed = self._owed.get(_file_key(oldest))
            # Not looked at yet (before serve's outbox could tell): none of its lines is known delivered.
            self._remove(oldest, len(owed) if owed is not None else -1)
        for index, copy in enumerate(kept, start=self.keep + 1):
            if copy != self._numbered(index):
                os.replace(copy, self._numbered(index))

    def _remove(self, copy: Path, owed: int) -> None:
        """Remove a copy; ``owed`` of its lines were not delivered elsewhere (-1: all of them, as far as known)."""
        key = _file_key(copy)
        removed = _count_lines(copy)
        copy.unlink(missing_ok=True)
        self._owed.pop(key, None)
        self._removed(removed, removed if owed < 0 else owed)

    def _still_owed(self, copy: Path) -> bool:
        """Whether another exporter has not delivered some violation in ``copy`` yet. The file is
        read once; after that only the ids still owed are kept and asked about."""
        assert self.undelivered is not None
        key = _file_key(copy)
        known = self._owed.get(key)
        owed = self.undelivered(known if known is not None else _violation_ids(copy))
        if owed is None:
            return True  # cannot be told yet: keep it, and read it again when it can
        if owed:
            self._owed[key] = owed
        else:
            self._owed.pop(key, None)
        return bool(owed)

    def _fsync_dir(self) -> None:
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                if self.fsync != "never":
                    self._sync(fd)
            finally:
                os.close(fd)


def _size_of(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _file_key(path: Path) -> tuple[int, int]:
    try:
        info = path.stat()
    except FileNotFoundError:
        return (-1, -1)
    return (info.st_dev, info.st_ino)


def _violation_ids(path: Path) -> set[str]:
    """The violation ids in a JSONL file."""
    return set(_iter_violation_ids(path))


def _iter_violation_ids(path: Path) -> Iterator[str]:
    """The violation ids in a JSONL file in line order, read line by line (a line is bounded by what we write)."""
    try:
        f = path.open("rb")
    except FileNotFoundError:
        return
    with f:
        for raw in f:
            try:
                doc = orjson.loads(raw)
            except orjson.JSONDecodeError:
                continue
            vid = doc.get("violation_id") if isinstance(doc, dict) else None
            if isinstance(vid, str):
                yield vid


def _count_lines(path: Path) -> int:
    """Lines in a file about to be removed (0 if absent); read in bounded chunks."""
    try:
        with path.open("rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    except FileNotFoundError:
        return 0


class JsonlExporter:
    """Writes violations (and, optionally, action records) as JSON lines."""

    name = "jsonl"
    wants_actions: bool

    def __init__(self, cfg: JsonlConfig, telemetry: Telemetry) -> None:
        self._telemetry = telemetry
        self._lock = threading.Lock()
        self._file = RotatingFile(Path(cfg.path), cfg.rotate_max_size, cfg.rotate_keep, cfg.fsync,
                                  on_removed=self._rotated_away("violations"),
                                  hold_max_size=cfg.rotate_hold_max_size)
        self._actions_file: RotatingFile | None = None
        if cfg.actions and cfg.actions_path:
            self._actions_file = RotatingFile(Path(cfg.actions_path), cfg.rotate_max_size, cfg.rotate_keep, cfg.fsync,
                                              on_removed=self._rotated_away("actions"))
        self._written = RecentIds(cfg.dedupe_ids)
        self._settled_at = time.monotonic()
        try:
            self._load_written()
        except OSError as exc:
            problem = Problem("exporters.jsonl.path", f"cannot read {cfg.path}: {describe_error(exc)}")
            raise ConfigError([problem]) from exc
        policy = RetryPolicy(cfg.max_attempts, 1.0, 30.0)
        self._listeners: list[Callable[[Sequence[str]], None]] = []
        self._queue: RetryQueue[Violation] = RetryQueue(
            self.name, telemetry, self._write_queued, lambda v: v.violation_id,
            max_queue=cfg.max_queue, batch_size=_RETRY_BATCH, policy=policy,
        )
        self.wants_actions = bool(cfg.actions and cfg.actions_path)
        self._actions_queue: RetryQueue[tuple[int, bytes]] | None = None
        self._action_seq = itertools.count()
        if self._actions_file is not None:
            self._actions_queue = RetryQueue(
                "jsonl_actions", telemetry, self._write_queued_actions, lambda item: str(item[0]),
                max_queue=cfg.max_queue, batch_size=_RETRY_BATCH, policy=policy,
            )

    def _rotated_away(self, output: str) -> Callable[[int, int], None]:
        def removed(lines: int, owed: int) -> None:
            self._telemetry.jsonl_lines_rotated_away.labels(output).inc(lines)
            if owed:
                log.warning("exporter jsonl: rotation removed a held %s file with %d lines, %d of them not yet "
                            "delivered by another exporter (exporters.jsonl.rotate_hold_max_size bounds what is "
                            "held)", output, lines, owed)
            else:
                log.warning("exporter jsonl: rotation removed the oldest %s file with %d lines "
                            "(exporters.jsonl.rotate_keep / rotate_max_size bound what is kept)", output, lines)
        return removed

    def hold_for(self, undelivered: Undelivered | None) -> None:
        """Keep rotated copies holding violations that ``undelivered`` says other exporters still owe
        (up to ``rotate_hold_max_size``); ``None``: no other exporter delivers violations."""
        with self._lock:
            self._file.undelivered = undelivered

    def held_bytes(self) -> int:
        """Bytes of rotated copies kept past ``rotate_keep`` for violations not delivered elsewhere."""
        with self._lock:
            return self._file.held_bytes()

    # -- start: what was written before ------------------------------------------------

    def _load_written(self) -> None:
        outputs = (("exporters.jsonl.path", self._file), ("exporters.jsonl.actions_path", self._actions_file))
        for where, output in outputs:
            if output is not None and not output.looks_owned():
                raise ConfigError([Problem(where, f"{output.path} holds something other than JSON lines; "
                                                  "refusing to append to, cut or rotate it")])
        if self._file.cut_torn_tail():
            log.warning("exporter jsonl: cut a torn last line (an interrupted write) from the output file")
        # Only the newest dedupe_ids ids are kept: the files are read newest first and no further
        # back than that (a full history, rotate_keep copies of rotate_max_size, is about
        # 800,000 lines at the defaults; each start read it all), then remembered oldest first.
        wanted = self._written.capacity
        distinct: set[str] = set()
        newest_first: list[list[str]] = []
        for path in [self._file.path, *self._file.rotated_paths()]:
            if len(distinct) >= wanted:
                break
            if not path.is_file():
                continue  # absent, or a device (/dev/stdout) that holds nothing to read back
            taken: list[str] = []
            # A file's last ids only, in memory bounded by what is still wanted (ids are written once each).
            for vid in reversed(deque(_iter_violation_ids(path), maxlen=wanted - len(distinct))):
                if vid not in distinct:
                    distinct.add(vid)
                    taken.append(vid)
                    if len(distinct) >= wanted:
                        break
            newest_first.append(taken)
        for taken in reversed(newest_first):
            for vid in reversed(taken):
                self._remember(vid)

    def _remember(self, violation_id: str) -> None:
        self._written.add(violation_id)

    def add_delivery_listener(self, listener: Callable[[Sequence[str]], None]) -> None:
        """``listener(violation_ids)`` once their lines are in the file (and synced, per ``fsync``),
        including ids written before; retried writes tell it from the retry worker's thread."""
        self._listeners.append(listener)
        self._queue.add_delivery_listener(listener)

    def _tell_written(self, violation_ids: list[str]) -> None:
        tell_listeners(self._listeners, violation_ids, self.name)

    @property
    def queue(self) -> RetryQueue[Violation]:
        """Violations whose write failed, waiting for a retry."""
        return self._queue

    def has_written(self, violation_id: str) -> bool:
        """Whether ``violation_id`` is among the ids remembered as written."""
        with self._lock:
            return violation_id in self._written

    def written_count(self) -> int:
        """How many written ids are remembered (at most ``dedupe_ids``)."""
        with self._lock:
            return len(self._written)

    # -- writing -----------------------------------------------------------------------

    def _write(self, violations: Sequence[Violation]) -> int:
        """Write the violations not yet written; the count written. Raises OSError."""
        with self._lock:
            fresh: list[Violation] = []
            seen: set[str] = set()
            for v in violations:
                if v.violation_id not in self._written and v.violation_id not in seen:
                    seen.add(v.violation_id)
                    fresh.append(v)
            if not fresh:
                return 0
            try:
                self._file.write_lines([dumps_line(violation_document(v)) for v in fresh])
            finally:
                # Lines already in the file (before a failed rotation, say) count as written.
                for v in fresh[:self._file.lines_written]:
                    self._remember(v.violation_id)
            return len(fresh)

    def _settle_now_and_then(self) -> None:
        """Held copies whose violations were delivered elsewhere meanwhile go within a second of
        the next export, not only at the next rotation (at most one look a second: it stats files)."""
        now = time.monotonic()
        if now - self._settled_at < _SETTLE_INTERVAL_S:
            return
        self._settled_at = now
        try:
            with self._lock:
                self._file.settle_held()
        except OSError as exc:  # the lines are written; a copy not let go now is looked at again later
            log.warning("exporter jsonl: could not let go of a held rotated copy (%s)", describe_error(exc))

    def _write_queued(self, violations: list[Violation]) -> SendResult:
        try:
            self._write(violations)
        except OSError as exc:
            return SendResult.retry(describe_error(exc))
        return SendResult.success()

    def export(self, violations: Sequence[Violation]) -> None:
        if not violations:
            return
        try:
            if self._queue.depth:
                # Earlier lines wait for a retry: keep the file in export order.
                self._queue.put(violations)
                return
            written = self._write(violations)
            self._settle_now_and_then()
            if written:
                self._telemetry.exporter_sent.labels(self.name).inc(written)
            self._telemetry.exporter_last_success.labels(self.name).set_to_current_time()
            # Every one of them is in the file now: just written, or skipped as written before.
            self._tell_written([v.violation_id for v in violations])
        except OSError as exc:
            self._telemetry.exporter_failures.labels(self.name).inc()
            log.warning("exporter jsonl: write failed (%s); keeping %d violations for retry",
                        describe_error(exc), len(violations))
            self._queue.put(violations)
        except Exception:
            self._telemetry.exporter_failures.labels(self.name).inc()
            log.exception("exporter jsonl: unexpected error; %d violations not written", len(violations))

    def resolve(self, violation_ids: Sequence[str]) -> None:
        """A JSONL file records what was found; a cleared condition writes nothing."""

    def _write_actions(self, lines: Sequence[bytes]) -> None:
        assert self._actions_file is not None
        with self._lock:
            self._actions_file.write_lines(lines)

    def _write_queued_actions(self, items: list[tuple[int, bytes]]) -> SendResult:
        try:
            self._write_actions([line for _, line in items])
        except OSError as exc:
            return SendResult.retry(describe_error(exc))
        return SendResult.success()

    def export_actions(self, actions: Sequence[Action]) -> None:
        if self._actions_queue is None or not actions:
            return
        items: list[tuple[int, bytes]] = []
        try:
            items = [(next(self._action_seq), dumps_line(a.record)) for a in actions]
            if self._actions_queue.depth:
                self._actions_queue.put(items)
                return
            self._write_actions([line for _, line in items])
            self._telemetry.exporter_sent.labels("jsonl_actions").inc(len(items))
            self._telemetry.exporter_last_success.labels("jsonl_actions").set_to_current_time()
        except OSError as exc:
            self._telemetry.exporter_failures.labels("jsonl_actions").inc()
            log.warning("exporter jsonl: action write failed (%s); keeping %d records for retry",
                        describe_error(exc), len(actions))
            self._actions_queue.put(items)
        except Exception:
            self._telemetry.exporter_failures.labels("jsonl_actions").inc()
            log.exception("exporter jsonl: unexpected error; %d action records not written", len(actions))

    def shutdown(self, timeout_s: float = 5.0) -> None:
        queues: list[RetryQueue[Any]] = [self._queue]
        if self._actions_queue is not None:
            queues.append(self._actions_queue)
        for queue in queues:
            queue.shutdown(timeout_s / len(queues))
        with self._lock:
            for f in (self._file, self._actions_file):
                if f is None:
                    continue
                try:
                    f.close()
                except OSError as exc:
                    log.warning("exporter jsonl: closing a file failed (%s)", describe_error(exc))
