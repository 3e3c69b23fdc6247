"""The action ids one replay has seen, for ``log_scope: file`` rules, in 16 bytes an id.

A repeated action id in an action log (DS009) can be any later line of the file, so every
id is remembered until the end of the input. As a dict of 128-bit keys that is about a
hundred bytes an id, and it was most of what replay of a long action log held. Here:

- the ids' 16-byte digests sit in 65,536 buckets by their first two bytes, each a
  ``bytearray`` of 16-byte entries: the digest's other 14 bytes and 2 bytes that say which
  kept tuple goes with it. A lookup is one C search of a bucket (about 15 entries at
  1,000,000 ids);
- the kept tuples themselves are few (a line's kind, for DS009), so each is held once and
  numbered; only tuples of strings, nulls, bytes and absent values are numbered, since
  equal tuples of other types may still differ for CEL (``(1,) == (True,)``);
- a tuple that cannot be numbered (a number, a list; or past 65,535 distinct ones) keeps
  its id in a plain dict beside them, as before.
"""

from __future__ import annotations

from typing import Any, Final

from processor.state.session import MISSING

DIGEST_BYTES: Final = 16
_BUCKETS: Final = 1 << 16
_ENTRY: Final = 16  # 14 bytes of digest, 2 of tuple number
_MAX_NUMBERED: Final = 1 << 16
_NUMBERABLE: Final = frozenset({str, bytes, type(None), type(MISSING)})


class FileIds:
    """Digests of (input, action id) and the tuple kept for each; ``get`` and ``put`` as a dict's."""

    __slots__ = ("_buckets", "_count", "_numbers", "_other", "_tuples")

    def __init__(self) -> None:
        self._buckets: list[bytearray | None] = [None] * _BUCKETS
        self._tuples: list[tuple[Any, ...]] = []
        self._numbers: dict[tuple[Any, ...], bytes] = {}  # a tuple -> its number in an entry
        self._other: dict[bytes, tuple[Any, ...]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def get(self, digest: bytes) -> tuple[Any, ...] | None:
        """The tuple kept for ``digest`` (16 bytes), or None when it was never put."""
        bucket = self._buckets[(digest[0] << 8) | digest[1]]
        if bucket is not None:
            rest = digest[2:]
            at = bucket.find(rest)
            while at >= 0:
                if not at % _ENTRY:
                    return self._tuples[bucket[at + 14] | (bucket[at + 15] << 8)]
                at = bucket.find(rest, at + 1)  # the bytes straddle two entries: look further
        if self._other:
            return self._other.get(digest)
        return None

    def put(self, digest: bytes, kept: tuple[Any, ...]) -> None:
        """Remember ``digest`` with ``kept``; ``digest`` must not be there yet (``get`` said None)."""
        if len(digest) != DIGEST_BYTES:
            raise ValueError(f"a digest is {DIGEST_BYTES} bytes, not {len(digest)}")
        suffix = self._suffix(kept)
        self._count += 1
        if suffix is None:
            self._other[digest] = kept
            return
        index = (digest[0] << 8) | digest[1]
        bucket = self._buckets[index]
        if bucket is None:
            bucket = self._buckets[index] = bytearray()
        bucket += digest[2:]
        bucket += suffix

    def setdefault(self, digest: bytes, kept: tuple[Any, ...]) -> None:
        if self.get(digest) is None:
            self.put(digest, kept)

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
