"""A session as rows: what a SQL store writes of a changed session, and how it reads one back.

Writing a session whole at every commit costs what the session holds, not what changed:
a session open for days carries thousands of delivery-key digests and dozens of groups,
and one more span changes a count, one digest and a group or two. So a session is
stored as three kinds of row:

- its **head** (``sessions``): counts by kind and by rule, activity time, fired waits,
  and where its digests start; small, and rewritten whenever the session changed;
- one row per **group** of a stateful rule (``session_groups``, keyed by session, rule
  and group key): only groups whose plain form changed, or that moved, are written;
- its delivery-key **digests** in chunks of :data:`SEEN_CHUNK` (``session_seen``): the
  digests only ever grow at the end and are forgotten at the front, so a commit
  rewrites the last chunk or two and deletes chunks wholly forgotten.

Groups of a rule are ordered, oldest first (the oldest is dropped at the rule's group
limit), and updating a group makes it the newest. Each group row carries an ``ord``
from a per-session counter that only grows; rows read in ``ord`` order give the
groups back in their order.

The store remembers, per session, what the database holds (:class:`Stored`): each
group row's ``ord`` and a 64-bit hash of its bytes, and the digests' extent. That is
the basis of the difference; it is updated only once a transaction committed, and a
session the store knows nothing of (new, or not loaded by this process) is written
whole after deleting whatever rows it may have. A hash collision (probability 2^-64
per changed group) would keep a group's previous row: the price of not holding every
row's bytes twice in memory.

All of this is plain data from :meth:`SessionState.to_plain`; nothing here knows how
a session keeps its state in memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

# Delivery-key digests per ``session_seen`` row (8 bytes each).
SEEN_CHUNK: Final = 64
# Head key saying where the session's digests start (absolute index of the oldest one held).
SEEN_BASE_KEY: Final = "seen_base"

_GroupId = tuple[str, str]


def dumps(value: Any) -> bytes:
    """Plain state as bytes; values a rule kept that JSON cannot hold become their text."""
    return orjson.dumps(value, default=str, option=orjson.OPT_NON_STR_KEYS)


@dataclass(slots=True)
class Stored:
    """What the database holds of one session."""

    # (rule id, group key text) -> (ord, hash of the row's body)
    groups: dict[_GroupId, tuple[int, int]] = field(default_factory=dict)
    next_ord: int = 0
    seen_base: int = 0
    seen_len: int = 0
    seen_last: int | None = None


@dataclass(slots=True)
class SessionRows:
    """The writes of one changed session, and what the database holds once they committed."""

    session_id: str
    head: bytes
    # Delete every group and digest row of the session first (the store did not know it).
    rewrite: bool
    put_groups: list[tuple[str, str, int, bytes]]  # rule id, group key text, ord, body
    gone_groups: list[_GroupId]
    put_seen: list[tuple[int, int, bytes]]  # chunk, absolute index of its first digest, packed digests
    # Delete the digest chunks numbered below this one (None: none to delete).
    seen_below: int | None
    stored: Stored


def session_rows(plain: Mapping[str, Any], before: Stored | None) -> SessionRows:
    """The rows to write for a session whose plain form is ``plain``, given what is stored (``before``)."""
    head = {k: v for k, v in plain.items() if k not in ("rules", "seen")}
    rewrite = before is None
    stored = Stored()
    put_groups: list[tuple[str, str, int, bytes]] = []
    old_groups = before.groups if before is not None else {}
    next_ord = before.next_ord if before is not None else 0
    for rule_id, groups in plain.get("rules", {}).items():
        last = -1
        for key, group_plain in groups:
            grp = dumps(key).decode()
            body = dumps(group_plain)
            digest = hash(body)
            had = old_groups.get((rule_id, grp))
            # Unchanged, and still after the rule's previous group: the stored row stands.
            if had is not None and had[1] == digest and had[0] > last:
                stored.groups[(rule_id, grp)] = had
                last = had[0]
                continue
            put_groups.append((rule_id, grp, next_ord, body))
            stored.groups[(rule_id, grp)] = (next_ord, digest)
            last = next_ord
            next_ord += 1
    stored.next_ord = next_ord
    gone = [gid for gid in old_groups if gid not in stored.groups]
    put_seen, seen_below = _seen_rows([int(d) for d in plain.get("seen") or ()], before, stored)
    head[SEEN_BASE_KEY] = stored.seen_base
    return SessionRows(str(plain["session_id"]), dumps(head), rewrite, put_groups, gone, put_seen,
                       seen_below, stored)


def _seen_rows(digests: list[int], before: Stored | None,
               stored: Stored) -> tuple[list[tuple[int, int, bytes]], int | None]:
    """Chunks to write and the chunk below which to delete; fills the digest fields of ``stored``.

    The digests at absolute index ``base + i`` never change once written: the list grows at
    its end and loses its oldest at the front, so what was written stays right.
    """
    n = len(digests)
    start = 0  # index into ``digests`` of the first one not stored yet
    base = before.seen_base if before is not None else 0
    below: int | None = None
    if before is not None and before.seen_len:
        found = -1
        for i in range(n - 1, -1, -1):
            if digests[i] == before.seen_last:
                found = i
                break
        forgotten = before.seen_len + (n - found - 1) - n
        if found >= 0 and forgotten >= 0:
            start = found + 1
            base = before.seen_base + forgotten
        else:
            # More arrived than are kept since the last write: all of them again, numbered after
            # every chunk written so far, which all go.
            base = -(-(before.seen_base + before.seen_len) // SEEN_CHUNK) * SEEN_CHUNK
        if base // SEEN_CHUNK > before.seen_base // SEEN_CHUNK:
            below = base // SEEN_CHUNK
    stored.seen_base = base
    stored.seen_len = n
    stored.seen_last = digests[-1] if digests else None
    rows: list[tuple[int, int, bytes]] = []
    if start < n:
        for chunk in range((base + start) // SEEN_CHUNK, (base + n - 1) // SEEN_CHUNK + 1):
            first = max(chunk * SEEN_CHUNK, base)
            end = min((chunk + 1) * SEEN_CHUNK, base + n)
            rows.append((chunk, first, pack(digests[first - base : end - base])))
    return rows, below


def pack(digests: Sequence[int]) -> bytes:
    return b"".join(d.to_bytes(8, "big") for d in digests)


def unpack(body: bytes) -> list[int]:
    return [int.from_bytes(body[i : i + 8], "big") for i in range(0, len(body), 8)]


def session_plain(head: bytes, groups: Iterable[tuple[str, str, int, bytes]],
                  chunks: Iterable[tuple[int, int, bytes]]) -> tuple[dict[str, Any], Stored]:
    """A session's plain form from its rows (groups in ``ord`` order, chunks in order), and what is stored."""
    plain: dict[str, Any] = orjson.loads(head)
    base = int(plain.pop(SEEN_BASE_KEY, 0))
    stored = Stored(seen_base=base)
    rules: dict[str, list[list[Any]]] = {}
    for rule_id, grp, ord_, body in groups:
        rules.setdefault(rule_id, []).append([orjson.loads(grp), orjson.loads(body)])
        stored.groups[(rule_id, grp)] = (ord_, hash(body))
        stored.next_ord = max(stored.next_ord, ord_ + 1)
    seen: list[int] = []
    for _, first, body in chunks:
        digests = unpack(body)
        skip = max(0, base - first)
        seen.extend(digests[skip:])
    plain["rules"] = rules
    plain["seen"] = seen
    stored.seen_len = len(seen)
    stored.seen_last = seen[-1] if seen else None
    return plain, stored
