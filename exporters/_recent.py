"""The newest N ids an exporter delivered, in memory fixed when it is created.

Exporters remember the violation ids they wrote or sent so that a violation handed over
again (the outbox after a restart, a replay of the same input) is not written twice.
Kept as strings in an ordered dict, 100,000 ids cost about 17 MiB, and that memory
grows with traffic until the bound is reached (13 minutes at 125 violations a second),
which a long-running serve sees as RSS growth. :class:`RecentIds` keeps 16-byte digests
in two buffers allocated whole at creation (about 56 bytes an id at the default bound),
so what it costs is known at start and does not move afterwards:

- a ring of the digests in the order they were added, whose oldest is forgotten when
  a new one needs its place;
- a hash table of the same digests, for membership: linear probing, at most half full,
  slots by Python's seeded hash of the digest; a forgotten digest is removed by
  shifting the entries after it back, so no tombstones accumulate.

An id of 32 hex digits (what :func:`processor.violations.make_violation_id` gives) is
its own digest; any other string is digested with BLAKE2b (16 bytes). Two different ids
share a digest with probability about 2^-128 per pair.
"""

from __future__ import annotations

import hashlib
from typing import Final

_WIDTH: Final = 16
_EMPTY: Final = bytes(_WIDTH)
_HEX: Final = frozenset("0123456789abcdef")


def id_digest(value: str) -> bytes:
    """The 16 bytes an id is remembered as (never all zeros: that marks an empty slot)."""
    if len(value) == 2 * _WIDTH and _HEX.issuperset(value):
        digest = bytes.fromhex(value)
    else:
        digest = hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=_WIDTH).digest()
    return digest if digest != _EMPTY else b"\x01" + digest[1:]


class RecentIds:
    """Up to ``capacity`` ids, the oldest added forgotten first. Not thread-safe: callers lock."""

    __slots__ = ("_capacity", "_count", "_mask", "_next", "_ring", "_table")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self._capacity = capacity
        slots = 1 << max(3, (2 * capacity - 1).bit_length())  # at most half full
        self._mask = slots - 1
        self._table = bytearray(slots * _WIDTH)
        self._ring = bytearray(capacity * _WIDTH)
        self._next = 0  # the ring slot the next id goes to (the oldest one's, once full)
        self._count = 0

    @property
    def capacity(self) -> int:
        """How many ids are remembered at most (the newest)."""
        return self._capacity

    @property
    def nbytes(self) -> int:
        """Memory held by the two buffers."""
        return len(self._table) + len(self._ring)

    def __len__(self) -> int:
        return self._count

    def __contains__(self, value: object) -> bool:
        return isinstance(value, str) and self._slot_of(id_digest(value)) >= 0

    def add(self, value: str) -> bool:
        """Remember ``value``; False if it was remembered already (its place in the order stays)."""
        digest = id_digest(value)
        if self._slot_of(digest) >= 0:
            return False
        at = self._next * _WIDTH
        if self._count == self._capacity:
            self._remove(bytes(self._ring[at : at + _WIDTH]))
        else:
            self._count += 1
        self._ring[at : at + _WIDTH] = digest
        self._next = (self._next + 1) % self._capacity
        table, mask = self._table, self._mask
        slot = _home(digest, mask)
        while table[slot * _WIDTH : slot * _WIDTH + _WIDTH] != _EMPTY:
            slot = (slot + 1) & mask
        table[slot * _WIDTH : slot * _WIDTH + _WIDTH] = digest
        return True

    def _slot_of(self, digest: bytes) -> int:
        table, mask = self._table, self._mask
        slot = _home(digest, mask)
        while True:
            held = table[slot * _WIDTH : slot * _WIDTH + _WIDTH]
            if held == digest:
                return slot
            if held == _EMPTY:
                return -1
            slot = (slot + 1) & mask

    def _remove(self, digest: bytes) -> None:
        """Take ``digest`` out of the table, shifting back the entries whose probe passed its slot."""
        hole = self._slot_of(digest)
        if hole < 0:
            return
        table, mask = self._table, self._mask
        probe = hole
        while True:
            probe = (probe + 1) & mask
            held = bytes(table[probe * _WIDTH : probe * _WIDTH + _WIDTH])
            if held == _EMPTY:
                break
            home = _home(held, mask)
            # The entry at ``probe`` may move to the hole unless its home lies cyclically in (hole, probe].
            if (hole < home <= probe) if hole <= probe else (home > hole or home <= probe):
                continue
            table[hole * _WIDTH : hole * _WIDTH + _WIDTH] = held
            hole = probe
        table[hole * _WIDTH : hole * _WIDTH + _WIDTH] = _EMPTY


def _home(digest: bytes, mask: int) -> int:
    # Python's hash of bytes (SipHash, seeded per process): ids that differ in a few bytes, or are
    # chosen to collide, still spread over the table.
    return hash(digest) & mask
