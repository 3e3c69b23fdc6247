"""Idle sessions' packed groups out of memory: a private temporary file that holds them.

Replay reads inputs of any length; what its idle sessions remember (the packed groups of
every action they completed, see ``SessionState.pack``) is what grows with the input once
everything else is bounded. Replay moves those bytes here and keeps a small reference in
their place; a session that comes back reads them again (``ColdBlob.read``) and they are
gone from the file.

The file is append-only until what was read back (dead bytes) outweighs what is still held
and passes ``compact_after_bytes``: then the live blobs are copied, in file order, into a
new file, and their references follow. So the file is at most about twice what it holds,
plus that threshold. Nothing here is durable: the file is unlinked when it is made and goes
with the process, as the rest of replay's state does.
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import IO, Final

from processor.errors import StateError
from processor.fileio import pwrite_all

log = logging.getLogger("durable_check.state")

COMPACT_AFTER_BYTES: Final = 64 << 20


class ColdBlob:
    """Where one blob is: its file's holder, offset and length. Read at most once."""

    __slots__ = ("home", "length", "offset")

    def __init__(self, home: ColdFile, offset: int, length: int) -> None:
        self.home = home
        self.offset = offset
        self.length = length

    def read(self) -> bytes:
        """The blob's bytes; the file forgets them."""
        return self.home.take(self)


class ColdFile:
    """Blobs in one temporary file. ``put`` returns None when the file cannot take one (a full
    disk): the caller keeps the bytes in memory, and nothing is lost."""

    def __init__(self, directory: str | None = None, *, compact_after_bytes: int = COMPACT_AFTER_BYTES) -> None:
        self._directory = directory
        self._compact_after = compact_after_bytes
        self._file: IO[bytes] | None = None
        self._end = 0
        self._live: set[ColdBlob] = set()
        self.live_bytes = 0
        self.dead_bytes = 0
        self._failed = False

    @property
    def blobs(self) -> int:
        return len(self._live)

    @property
    def file_bytes(self) -> int:
        return self._end

    def put(self, data: bytes) -> ColdBlob | None:
        if self._failed:
            return None
        try:
            if self._file is None:
                self._file = tempfile.TemporaryFile(dir=self._directory)  # noqa: SIM115 (closed by close())
            elif self.dead_bytes > max(self.live_bytes, self._compact_after):
                self._compact()
            pwrite_all(self._file.fileno(), data, self._end)
        except OSError as exc:
            # Replay goes on with the bytes in memory (it only uses more of it): said once.
            self._failed = True
            log.warning(
                "replay keeps idle sessions' groups in memory: their temporary file failed (%s)",
                exc.strerror or type(exc).__name__,
            )
            return None
        blob = ColdBlob(self, self._end, len(data))
        self._end += len(data)
        self._live.add(blob)
        self.live_bytes += len(data)
        return blob

    def take(self, blob: ColdBlob) -> bytes:
        if blob not in self._live or self._file is None:
            raise StateError("an idle session's groups were read back twice (an internal error)")
        try:
            data = os.pread(self._file.fileno(), blob.length, blob.offset)
        except OSError as exc:
            raise StateError(f"the temporary file of idle sessions' groups could not be read: {exc.strerror}") from exc
        if len(data) != blob.length:
            raise StateError("the temporary file of idle sessions' groups was cut short")
        self._live.discard(blob)
        self.live_bytes -= blob.length
        self.dead_bytes += blob.length
        return data

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _compact(self) -> None:
        """Copy the live blobs into a new file, in their order, and point their references there."""
        old = self._file
        assert old is not None
        new = tempfile.TemporaryFile(dir=self._directory)  # noqa: SIM115 (replaces the old one)
        try:
            end = 0
            moved: list[tuple[ColdBlob, int]] = []
            for blob in sorted(self._live, key=_offset):
                data = os.pread(old.fileno(), blob.length, blob.offset)
                if len(data) != blob.length:
                    raise OSError(0, "the file was cut short")
                pwrite_all(new.fileno(), data, end)
                moved.append((blob, end))
                end += blob.length
        except BaseException:
            new.close()
            raise
        # Only once every blob is copied: a failure above leaves the old file as it was.
        for blob, offset in moved:
            blob.offset = offset
        old.close()
        self._file = new
        self._end = end
        self.dead_bytes = 0


def _offset(blob: ColdBlob) -> int:
    return blob.offset

