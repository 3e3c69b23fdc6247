"""A session as a base and deltas: what a SQL store writes of a changed session, and how it reads one back.

Writing a session whole at every commit costs what the session holds, not what changed:
a session open for days carries thousands of delivery-key digests and dozens of groups,
and one more span changes a count, a digest and a group or two. Writing a row per
group instead costs a row per group: most commits of a young session create groups,
so a busy commit would write tens of thousands of small rows. So a session is stored
as one *base* row (``sessions``: the whole session, as it was written whole before)
and *delta* rows (``session_deltas``), one per commit that changed it:

- the head (counts by kind and by rule, activity time, fired waits), which is small;
- the groups whose plain form changed: ``set`` (in place) or ``move`` (to the newest
  end: groups of a rule are ordered oldest first, the oldest is dropped at the rule's
  limit, and an update makes a group the newest), and ``drop`` for groups gone;
- the delivery-key digests added, and how many of the oldest were forgotten.

A commit writes one row per changed session either way; a delta holds what changed.
Once a session's deltas together outweigh its base (or after :data:`MAX_DELTAS` of
them), the next commit writes a new base and deletes the deltas: the bytes written
stay within about twice what changed, and a restart replays few deltas per session.

The store remembers, per session, what the database holds (:class:`Stored`): each
group's position and a 64-bit hash of its plain form's bytes, and the digests'
extent. That is the basis of the difference; it changes only once a transaction
committed, and a session the store knows nothing of (new, or not loaded by this
process) is written as a new base, deleting any deltas it may have. A hash collision
(probability 2^-64 per changed group) would leave that group's change unwritten: the
price of not holding every group's bytes twice in memory.

Everything here is plain data from :meth:`SessionState.to_plain`; nothing knows how a
session keeps its state in memory. Group bodies are serialized once, for the hash,
and embedded as they are (``orjson.Fragment``) in the row.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

# A new base after this many deltas, whatever their size (bounds the replay at a restart).
MAX_DELTAS: Final = 32
# Deltas may together reach this many bytes before a base is rewritten, however small the base.
MIN_DELTA_BUDGET: Final = 4096
# A session smaller than this is written whole (one serialization, no per-group bookkeeping):
# young sessions change most of what they hold at every commit, and a delta would not be smaller.
WHOLE_BELOW: Final = 8192

_GroupId = tuple[str, str]
_NOT_HEAD: Final = frozenset({"rules", "seen"})


def dumps(value: Any) -> bytes:
    """Plain state as bytes; values a rule kept that JSON cannot hold become their text."""
    return orjson.dumps(value, default=str, option=orjson.OPT_NON_STR_KEYS)


@dataclass(slots=True)
class Stored:
    """What the database holds of one session: base and deltas together."""

    # (rule id, group key as JSON text) -> (position, hash of the group's plain bytes)
    groups: dict[_GroupId, tuple[int, int]] = field(default_factory=dict)
    next_ord: int = 0
    seen_len: int = 0
    seen_last: int | None = None
    base_bytes: int = 0
    delta_bytes: int = 0
    deltas: int = 0
    # Written whole while small: ``groups`` is empty and nothing is known of them.
    whole: bool = False


@dataclass(slots=True)
class SessionWrite:
    """The row one commit writes for one changed session, and what is stored once it committed."""

    session_id: str
    # True: ``body`` is a new base (and the session's deltas are deleted); False: a delta.
    base: bool
    body: bytes
    groups: int  # groups written (in the base, or changed in the delta)
    stored: Stored


def session_write(plain: Mapping[str, Any], before: Stored | None) -> SessionWrite:
    """The row to write for a session whose plain form is ``plain``, given what is stored (``before``)."""
    if before is None or (before.whole and before.base_bytes < WHOLE_BELOW):
        body = dumps(plain)
        if len(body) < WHOLE_BELOW:
            digests = plain.get("seen") or ()
            stored = Stored(base_bytes=len(body), whole=True, seen_len=len(digests),
                            seen_last=int(digests[-1]) if digests else None)
            groups = sum(len(g) for g in plain.get("rules", {}).values())
            return SessionWrite(str(plain["session_id"]), True, body, groups, stored)
        before = None  # grown past it: written again below as a base whose groups are known
    elif before.whole:
        before = None
    stored = Stored()
    old = before.groups if before is not None else {}
    next_ord = before.next_ord if before is not None else 0
    rules_out: dict[str, list[list[Any]]] = {}
    changed_set: list[list[Any]] = []
    changed_move: list[list[Any]] = []
    walked: list[tuple[_GroupId, int]] = []  # every group, in order, with its hash
    changed_bytes = 0  # a lower bound of the delta's size: past the budget, a base without trying
    for rule_id, groups in plain.get("rules", {}).items():
        last = -1
        out = rules_out[rule_id] = []
        for key, group_plain in groups:
            grp = dumps(key).decode()
            body = dumps(group_plain)
            digest = hash(body)
            fragment = orjson.Fragment(body)
            out.append([orjson.Fragment(grp), fragment])
            walked.append(((rule_id, grp), digest))
            had = old.get((rule_id, grp))
            if had is not None and had[0] > last:
                # Still in its place (after the rule's previous group): changed in place, or not at all.
                stored.groups[(rule_id, grp)] = (had[0], digest)
                last = had[0]
                if had[1] != digest:
                    changed_set.append([rule_id, orjson.Fragment(grp), fragment])
                    changed_bytes += len(body)
                continue
            changed_move.append([rule_id, orjson.Fragment(grp), fragment])
            changed_bytes += len(body)
            stored.groups[(rule_id, grp)] = (next_ord, digest)
            last = next_ord
            next_ord += 1
    stored.next_ord = next_ord
    head = {k: v for k, v in plain.items() if k not in _NOT_HEAD}
    digests = [int(d) for d in plain.get("seen") or ()]
    stored.seen_len = len(digests)
    stored.seen_last = digests[-1] if digests else None
    added = _digests_added(digests, before)
    session_id = str(plain["session_id"])
    if (before is not None and added is not None and before.deltas < MAX_DELTAS
            and before.delta_bytes + changed_bytes <= max(before.base_bytes, MIN_DELTA_BUDGET)):
        dropped = [[rule_id, orjson.Fragment(grp)] for rule_id, grp in old if (rule_id, grp) not in stored.groups]
        new_digests, forgotten = added
        delta = dumps({"head": head, "set": changed_set, "move": changed_move, "drop": dropped,
                       "seen": new_digests, "forget": forgotten})
        if before.delta_bytes + len(delta) <= max(before.base_bytes, MIN_DELTA_BUDGET):
            stored.base_bytes = before.base_bytes
            stored.delta_bytes = before.delta_bytes + len(delta)
            stored.deltas = before.deltas + 1
            return SessionWrite(session_id, False, delta, len(changed_set) + len(changed_move), stored)
    # A new base: the session as a whole, in the form it has always been stored in.
    body = dumps({**head, "rules": rules_out, "seen": digests})
    stored.base_bytes = len(body)
    # Positions restart in base order (what a load rebuilds), so later deltas compare against it.
    stored.groups = {gid: (position, digest) for position, (gid, digest) in enumerate(walked)}
    stored.next_ord = len(walked)
    return SessionWrite(session_id, True, body, len(walked), stored)


def _digests_added(digests: list[int], before: Stored | None) -> tuple[list[int], int] | None:
    """The digests added since ``before`` and how many of the oldest were forgotten; None when unknown.

    Digests only grow at the end and are forgotten at the front, and are unique, so the
    last one stored marks where the new ones start.
    """
    if before is None:
        return None
    n = len(digests)
    if not before.seen_len:
        return digests, 0
    for i in range(n - 1, -1, -1):
        if digests[i] == before.seen_last:
            forgotten = before.seen_len + (n - i - 1) - n
            return (digests[i + 1 :], forgotten) if forgotten >= 0 else None
    return None  # more arrived than are kept since the last write: a new base says it


def session_plain(base: bytes, deltas: Iterable[bytes]) -> tuple[dict[str, Any], Stored]:
    """A session's plain form from its base and its deltas (in order), and what is stored."""
    plain: dict[str, Any] = orjson.loads(base)
    stored = Stored(base_bytes=len(base))
    rules: dict[str, dict[str, list[Any]]] = {
        rule_id: {dumps(key).decode(): [key, state] for key, state in groups}
        for rule_id, groups in plain.get("rules", {}).items()
    }
    seen: list[int] = [int(d) for d in plain.get("seen") or ()]
    for body in deltas:
        delta = orjson.loads(body)
        stored.delta_bytes += len(body)
        stored.deltas += 1
        for key in [k for k in plain if k not in _NOT_HEAD]:
            del plain[key]
        plain.update(delta["head"])
        for rule_id, key, state in delta["set"]:
            rules.setdefault(rule_id, {})[dumps(key).decode()] = [key, state]
        for rule_id, key, state in delta["move"]:
            groups = rules.setdefault(rule_id, {})
            text = dumps(key).decode()
            groups.pop(text, None)
            groups[text] = [key, state]
        for rule_id, key in delta["drop"]:
            rules.get(rule_id, {}).pop(dumps(key).decode(), None)
        seen.extend(int(d) for d in delta["seen"])
        del seen[: int(delta["forget"])]
    plain["rules"] = {rule_id: list(groups.values()) for rule_id, groups in rules.items() if groups}
    plain["seen"] = seen
    position = 0
    for rule_id, groups in rules.items():
        for text, (_, state) in groups.items():
            stored.groups[(rule_id, text)] = (position, hash(dumps(state)))
            position += 1
    stored.next_ord = position
    stored.seen_len = len(seen)
    stored.seen_last = seen[-1] if seen else None
    return plain, stored
