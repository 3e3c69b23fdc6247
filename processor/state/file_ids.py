"""The action ids one replay has seen, for ``log_scope: file`` rules: 5 bytes an id in memory.

A repeated action id in an action log (DS009) can be any later line of the file, so every
id is remembered until the end of the input. Held whole, that is 16 bytes of digest an id at
the least, and what replay of a long action log held grew with it. Here:

- each id's *entry* (its 16-byte digest, and 2 bytes that say which kept tuple goes with
  it) is appended to a log of entries, numbered in blocks of 128. The newest entries are in
  memory (``memory_entries``, about 300 KB); older ones are written to a private
  temporary file, unlinked when it is made, which goes with the process;
- in memory, each id has a 5-byte *fingerprint* in one of 16,384 buckets chosen by the
  digest's first 14 bits: 2 more bytes of the digest and the 3-byte number of the block that
  holds its entry. A lookup is one C search of its bucket; only a fingerprint that matches
  reads that block (128 entries, 2.3 KB, one ``pread`` when it is on disk) and compares
  whole digests. An id not seen before matches another's 30-bit fingerprint once in about
  1,070 lookups at 1,000,000 ids (one needless read), once in 107 at 10,000,000;
- the kept tuples themselves are few (a line's kind, for DS009), so each is held once and
  numbered; only tuples of strings, nulls, bytes and absent values are numbered, since
  equal tuples of other types may still differ for CEL (``(1,) == (True,)``);
- a tuple that cannot be numbered (a number, a list; or past 65,535 distinct ones) keeps
  its id in a plain dict beside them.

If the temporary file cannot be written (a full disk), the entries stay in memory: replay
then uses more of it, and nothing is lost; a warning says so once.
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import IO, Any, Final

from processor.errors import StateError
from processor.fileio import pwrite_all
from processor.state.session import MISSING

log = logging.getLogger("durable_check.state")

DIGEST_BYTES: Final = 16
_ENTRY: Final = DIGEST_BYTES + 2  # the digest, then the kept tuple's number
_BLOCK: Final = 128  # entries a block: what one fingerprint match reads
_BLOCK_BYTES: Final = _BLOCK * _ENTRY
_BUCKETS: Final = 1 << 14  # by the digest's first 14 bits
_PRINT: Final = 5  # 2 bytes of the digest, 3 of block number
_MAX_BLOCKS: Final = 1 << 24
_MAX_NUMBERED: Final = 1 << 16
_NUMBERABLE: Final = frozenset({str, bytes, type(None), type(MISSING)})
# Entries kept in memory before they are written out together: 128 blocks, 295 KB.
MEMORY_ENTRIES: Final = 128 * _BLOCK


class FileIds:
    """Digests of (input, action id) and the tuple kept for each; ``get`` and ``put`` as a dict's.

    ``memory_entries`` (rounded up to whole blocks): the newest entries held in memory before
    they are written to the temporary file in ``directory`` (the system's by default)."""

    __slots__ = (
        "_block_bytes",
        "_buckets",
        "_count",
        "_directory",
        "_entries",
        "_failed",
        "_file",
        "_memory_blocks",
        "_numbers",
        "_other",
        "_pending",
        "_tuples",
        "_written",
        "disk_reads",
    )

    def __init__(self, *, memory_entries: int = MEMORY_ENTRIES, directory: str | None = None) -> None:
        self._buckets: list[bytearray | None] = [None] * _BUCKETS
        self._pending = bytearray()  # entries from block ``_written`` on, not yet in the file
        self._memory_blocks = max(1, -(-memory_entries // _BLOCK))
        self._written = 0  # blocks in the file
        self._entries = 0  # entries appended (the next one's number)
        self._block_bytes = (0).to_bytes(3, "little")  # the number of the block being filled
        self._directory = directory
        self._file: IO[bytes] | None = None
        self._failed = False
        self._tuples: list[tuple[Any, ...]] = []
        self._numbers: dict[tuple[Any, ...], bytes] = {}  # a tuple -> its number in an entry
        self._other: dict[bytes, tuple[Any, ...]] = {}
        self._count = 0
        self.disk_reads = 0  # blocks read back from the file (a diagnostic)

    def __len__(self) -> int:
        return self._count

    @property
    def file_bytes(self) -> int:
        """Bytes of entries in the temporary file."""
        return self._written * _BLOCK_BYTES

    def get(self, digest: bytes) -> tuple[Any, ...] | None:
        """The tuple kept for ``digest`` (16 bytes), or None when it was never put."""
        bucket = self._buckets[(digest[0] << 6) | (digest[1] >> 2)]
        if bucket is not None:
            fingerprint = digest[2:4]
            searched = -1
            at = bucket.find(fingerprint)
            while at >= 0:
                if not at % _PRINT:
                    block = int.from_bytes(bucket[at + 2 : at + 5], "little")
                    if block != searched:  # ids of one block are in the bucket together
                        number = self._entry_number(digest, block)
                        if number is not None:
                            return self._tuples[number]
                        searched = block  # another id with this fingerprint: there may be more
                at = bucket.find(fingerprint, at + 1)  # or the bytes straddle two fingerprints
        if self._other:
            return self._other.get(digest)
        return None

    def put(self, digest: bytes, kept: tuple[Any, ...]) -> None:
        """Remember ``digest`` with ``kept``; ``digest`` must not be there yet (``get`` said None)."""
        if len(digest) != DIGEST_BYTES:
            raise ValueError(f"a digest is {DIGEST_BYTES} bytes, not {len(digest)}")
        suffix = self._suffix(kept)
        self._count += 1
        if suffix is None or self._entries >= _MAX_BLOCKS * _BLOCK:
            self._other[digest] = kept
            return
        index = (digest[0] << 6) | (digest[1] >> 2)
        bucket = self._buckets[index]
        if bucket is None:
            bucket = self._buckets[index] = bytearray()
        bucket += digest[2:4]
        bucket += self._block_bytes
        pending = self._pending
        pending += digest
        pending += suffix
        self._entries += 1
        if not self._entries % _BLOCK:
            self._block_bytes = (self._entries // _BLOCK).to_bytes(3, "little")
            if len(pending) >= self._memory_blocks * _BLOCK_BYTES and not self._failed:
                self._write_pending()

    def setdefault(self, digest: bytes, kept: tuple[Any, ...]) -> None:
        if self.get(digest) is None:
            self.put(digest, kept)

    def close(self) -> None:
        """Remove the temporary file (it also goes with the process)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def _entry_number(self, digest: bytes, block: int) -> int | None:
        """The kept tuple's number in ``digest``'s entry in ``block``; None: not there."""
        start = (block - self._written) * _BLOCK_BYTES
        if start >= 0:
            data: bytes | bytearray = self._pending
            end = start + _BLOCK_BYTES
        else:
            data = self._read_block(block)
            start, end = 0, len(data)
        at = data.find(digest, start, end)
        while at >= 0:
            if not (at - start) % _ENTRY:
                return data[at + 16] | (data[at + 17] << 8)
            at = data.find(digest, at + 1, end)
        return None

    def _read_block(self, block: int) -> bytes:
        assert self._file is not None
        self.disk_reads += 1
        try:
            data = os.pread(self._file.fileno(), _BLOCK_BYTES, block * _BLOCK_BYTES)
        except OSError as exc:
            raise StateError(f"the temporary file of a replay's action ids could not be read: {exc.strerror}") from exc
        if len(data) != _BLOCK_BYTES:
            raise StateError("the temporary file of a replay's action ids was cut short")
        return data

    def _write_pending(self) -> None:
        """Move the pending entries (whole blocks) to the file; on failure keep them in memory."""
        try:
            if self._file is None:
                self._file = tempfile.TemporaryFile(dir=self._directory)  # noqa: SIM115 (closed by close())
            pwrite_all(self._file.fileno(), bytes(self._pending), self._written * _BLOCK_BYTES)
        except OSError as exc:
            self._failed = True
            log.warning(
                "replay keeps a file's action ids in memory: their temporary file failed (%s)",
                exc.strerror or type(exc).__name__,
            )
            return
        self._written += len(self._pending) // _BLOCK_BYTES
        self._pending = bytearray()

    def _suffix(self, kept: tuple[Any, ...]) -> bytes | None:
        """The 2 bytes that number ``kept`` in an entry, given on first sight; None when it cannot have them."""
        if not _NUMBERABLE.issuperset(map(type, kept)):
            return None
        suffix = self._numbers.get(kept)
        if suffix is not None or len(self._tuples) >= _MAX_NUMBERED:
            return suffix
        suffix = len(self._tuples).to_bytes(2, "little")
        self._tuples.append(kept)
        self._numbers[kept] = suffix
        return suffix
