"""The reordering buffer as rows: one *segment* per commit that buffered spans, and which of them left.

Every span of a session with stateful rules waits in the engine's reordering buffer for
the allowed lateness, so at full rate a durable store would insert, and a few seconds
later delete, one row per span: as many rows as spans, twice, beside the journal. A
commit instead writes the spans it buffered as one segment row (one document holding
each span's row, an array of its fields in the engine's order, ``engine.buffered_rows``;
their arrival numbers packed beside), and records releases in the
segment's bitmap; a segment whose spans all left is deleted. At 25,000 spans/s and a
commit every 50 ms that is one insert, a bitmap update or two and a delete per commit.

Arrival numbers only grow within a replica, so the segments of one replica cover
disjoint ranges of them, and an arrival is found by bisection (spans adopted from a
stopped replica are renumbered below this replica's own, still disjoint). The store
keeps the index (:class:`BufferSegments`) in memory and changes it only once a
transaction committed (:meth:`BufferSegments.apply`).

A segment's body is stored as a zstd frame (since schema version 4, :mod:`processor.state.compression`):
the rows repeat the same keys, sessions and origins, and the body is read only after a
restart. A body of version 3 or earlier, the JSON itself, is read as it is.
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from processor.errors import StateError
from processor.state.compression import DamagedBody, compress, decompress_segment


def pack_arrivals(arrivals: Sequence[int]) -> bytes:
    return array("q", arrivals).tobytes()


def unpack_arrivals(packed: bytes) -> array[int]:
    values = array("q")
    values.frombytes(packed)
    return values


def is_released(bitmap: bytes | bytearray, index: int) -> bool:
    return bool(bitmap[index >> 3] & (1 << (index & 7)))


@dataclass(slots=True)
class Segment:
    segment: int
    arrivals: array[int]  # increasing
    released: bytearray  # bit i: arrivals[i] left the buffer
    live: int  # spans still buffered


@dataclass(slots=True)
class BufferWrite:
    """What one transaction writes of the buffer; :meth:`BufferSegments.apply` once it committed."""

    # (segment, first arrival, last arrival, packed arrivals, released bitmap, body) of the new segment
    insert: tuple[int, int, int, bytes, bytes, bytes] | None = None
    updates: list[tuple[int, bytes]] = field(default_factory=list)  # (segment, released bitmap)
    deletes: list[int] = field(default_factory=list)
    # Segments changed: the new bitmap and live count; the new segment itself.
    changed: dict[int, tuple[bytearray, int]] = field(default_factory=dict)
    new: Segment | None = None

    @property
    def empty(self) -> bool:
        return self.insert is None and not self.updates and not self.deletes


class BufferSegments:
    """The segments a replica's buffer is stored in: which arrival is in which, and what was released."""

    def __init__(self) -> None:
        self._segments: dict[int, Segment] = {}
        # First arrival of each segment, increasing, and the segment it starts (for bisection).
        self._starts: list[int] = []
        self._ids: list[int] = []
        self._next = 1

    def load(self, rows: Iterable[tuple[int, bytes, bytes]]) -> None:
        """Index the stored segments: (segment, packed arrivals, released bitmap)."""
        self._segments = {}
        for segment, packed, released in rows:
            arrivals = unpack_arrivals(bytes(packed))
            bitmap = bytearray(released)
            live = sum(1 for i in range(len(arrivals)) if not is_released(bitmap, i))
            self._segments[int(segment)] = Segment(int(segment), arrivals, bitmap, live)
        self._reindex()
        self._next = max(self._segments, default=0) + 1

    def _reindex(self) -> None:
        ordered = sorted((s.arrivals[0], s.segment) for s in self._segments.values() if len(s.arrivals))
        self._starts = [first for first, _ in ordered]
        self._ids = [segment for _, segment in ordered]

    def live_arrivals(self) -> set[int]:
        """Arrival numbers of every span the segments still hold (the first write after a rebuild compares)."""
        out: set[int] = set()
        for s in self._segments.values():
            out.update(a for i, a in enumerate(s.arrivals) if not is_released(s.released, i))
        return out

    def holds(self, arrival: int) -> bool:
        found = self._find(arrival)
        return found is not None and not is_released(found[0].released, found[1])

    def _find(self, arrival: int) -> tuple[Segment, int] | None:
        at = bisect.bisect_right(self._starts, arrival) - 1
        if at < 0:
            return None
        segment = self._segments[self._ids[at]]
        index = bisect.bisect_left(segment.arrivals, arrival)
        if index < len(segment.arrivals) and segment.arrivals[index] == arrival:
            return segment, index
        return None

    def plan(self, gone: Iterable[int], added: Sequence[tuple[int, Any]]) -> BufferWrite:
        """The writes that record ``gone`` arrivals as released and store ``added`` spans (arrival, row)."""
        write = BufferWrite()
        for arrival in gone:
            found = self._find(arrival)
            if found is None:
                continue
            segment, index = found
            bitmap, live = write.changed.get(segment.segment, (None, segment.live))
            if bitmap is None:
                bitmap = bytearray(segment.released)
            if is_released(bitmap, index):
                continue
            bitmap[index >> 3] |= 1 << (index & 7)
            write.changed[segment.segment] = (bitmap, live - 1)
        for segment_id, (bitmap, live) in write.changed.items():
            if live == 0:
                write.deletes.append(segment_id)
            else:
                write.updates.append((segment_id, bytes(bitmap)))
        if added:
            spans = sorted(added, key=lambda item: item[0])
            arrivals = array("q", (a for a, _ in spans))
            released = bytearray((len(spans) + 7) // 8)
            body = compress(orjson.dumps([plain for _, plain in spans], default=str, option=orjson.OPT_NON_STR_KEYS))
            write.new = Segment(self._next, arrivals, released, len(spans))
            write.insert = (self._next, arrivals[0], arrivals[-1], arrivals.tobytes(), bytes(released), body)
        return write

    def apply(self, write: BufferWrite) -> None:
        """The transaction that wrote ``write`` committed."""
        for segment_id, (bitmap, live) in write.changed.items():
            if live == 0:
                self._segments.pop(segment_id, None)
            else:
                segment = self._segments[segment_id]
                segment.released = bitmap
                segment.live = live
        if write.new is not None:
            self._segments[write.new.segment] = write.new
            self._next = write.new.segment + 1
        if write.deletes or write.new is not None:
            self._reindex()


def entry_arrival(entry: Any) -> int:
    """A stored span's arrival number: from its row (an array, the arrival first; schema 3) or
    from an entry of the object form schema 2 wrote."""
    return int(entry[0]) if type(entry) is list else int(entry["arrival"])


def segment_spans(segment: int, body: bytes) -> list[Any]:
    """Every span a stored segment body holds, as stored (rows, or entries of the older object form)."""
    try:
        spans: list[Any] = orjson.loads(decompress_segment(bytes(body)))
    except (DamagedBody, orjson.JSONDecodeError) as exc:
        raise StateError(f"the reordering buffer's segment {segment} is damaged: {exc}") from None
    return spans


def live_entries(rows: Iterable[tuple[int, bytes, bytes]]) -> list[Any]:
    """The buffered spans still held by stored segments (segment, body, released bitmap), in arrival
    order, as they are stored (rows, or entries of the older object form)."""
    out: list[Any] = []
    for segment, body, released in rows:
        bitmap = bytes(released)
        out.extend(e for i, e in enumerate(segment_spans(int(segment), body)) if not is_released(bitmap, i))
    out.sort(key=entry_arrival)
    return out
