"""A session as a base and deltas: what a SQL store writes of a changed session, and how it reads one back.

Writing a session whole at every commit costs what the session holds, not what changed:
a session open for days carries thousands of delivery-key digests and its rules'
groups, and one more span changes a count, a digest and a rule or two. So a session
is stored as one *base* row (``sessions``: the whole session, in the form it was
always written in) and *delta* rows (``session_deltas``), one per commit that changed it:

- the head (counts by kind and by rule, activity time, fired waits), which is small;
- the groups of each rule whose groups changed (a rule's groups as one list, in their
  order: the oldest is dropped at the rule's limit, an update makes a group the
  newest), and the rules that no longer have any;
- the delivery-key digests added, and how many of the oldest were forgotten.

A commit writes one row per changed session either way; a delta holds what changed.
Once a session's deltas together outweigh its base (or after :data:`MAX_DELTAS` of
them), the next commit writes a new base and deletes the deltas: the bytes written
stay within about twice what changed, and a restart replays few deltas per session.
A session smaller than :data:`WHOLE_BELOW` is written whole: young sessions change
most of what they hold at every commit.

Why a rule, not a group, is the unit: finding the changed groups means serializing
each group on its own, a Python-level step per group, and a long session holds
thousands; measured, that cost more CPU than writing the session whole. A rule's
groups are serialized in one call, compared by hash, and embedded as they are
(``orjson.Fragment``) in the delta or the base.

The store remembers, per session, what the database holds (:class:`Stored`): a 64-bit
hash of each rule's serialized groups and the digests' extent. It changes only once a
transaction committed; a session the store knows nothing of (new, or not loaded by
this process) is written as a new base, deleting any deltas it may have. A hash
collision (probability 2^-64 per changed rule) would leave that rule's change
unwritten: the price of not holding every rule's bytes twice in memory.

Everything here is plain data from :meth:`SessionState.to_plain`; nothing knows how a
session keeps its state in memory.
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

_NOT_HEAD: Final = frozenset({"rules", "seen"})


def dumps(value: Any) -> bytes:
    """Plain state as bytes; values a rule kept that JSON cannot hold become their text."""
    return orjson.dumps(value, default=str, option=orjson.OPT_NON_STR_KEYS)


@dataclass(slots=True)
class Stored:
    """What the database holds of one session: base and deltas together."""

    # rule id -> hash of the serialized list of its groups
    rules: dict[str, int] = field(default_factory=dict)
    seen_len: int = 0
    seen_last: int | None = None
    base_bytes: int = 0
    delta_bytes: int = 0
    deltas: int = 0
    # Written whole while small: ``rules`` is empty and nothing is known of them.
    whole: bool = False


@dataclass(slots=True)
class SessionWrite:
    """The row one commit writes for one changed session, and what is stored once it committed."""

    session_id: str
    # True: ``body`` is a new base (and the session's deltas are deleted); False: a delta.
    base: bool
    body: bytes
    groups: int  # groups written (in the base, or in the rules a delta rewrites)
    stored: Stored
    # A base must delete deltas: the session has some, or the store does not know it.
    may_have_deltas: bool = True


def session_write(plain: Mapping[str, Any], before: Stored | None) -> SessionWrite:
    """The row to write for a session whose plain form is ``plain``, given what is stored (``before``)."""
    session_id = str(plain["session_id"])
    may_have_deltas = before is None or before.deltas > 0
    digests = plain.get("seen") or ()
    rules = plain.get("rules", {})
    if before is None or before.whole:
        body = dumps(plain)
        if len(body) < WHOLE_BELOW:
            stored = Stored(base_bytes=len(body), whole=True, seen_len=len(digests),
                            seen_last=int(digests[-1]) if digests else None)
            return SessionWrite(session_id, True, body, sum(len(g) for g in rules.values()), stored, may_have_deltas)
        before = None  # grown past it: written again below as a base whose rules are known
    stored = Stored(seen_len=len(digests), seen_last=int(digests[-1]) if digests else None)
    fragments: dict[str, orjson.Fragment] = {}
    changed: dict[str, orjson.Fragment] = {}
    changed_groups = 0
    changed_bytes = 0  # a lower bound of the delta's size: past the budget, a base without trying
    for rule_id, groups in rules.items():
        # One serialization per rule (its groups in order): cheap to compare, cheap to embed.
        body = dumps(groups)
        digest = hash(body)
        stored.rules[rule_id] = digest
        fragments[rule_id] = orjson.Fragment(body)
        if before is None or before.rules.get(rule_id) != digest:
            changed[rule_id] = fragments[rule_id]
            changed_groups += len(groups)
            changed_bytes += len(body)
    head = {k: v for k, v in plain.items() if k not in _NOT_HEAD}
    added = _digests_added(list(digests), before)
    if (before is not None and added is not None and before.deltas < MAX_DELTAS
            and before.delta_bytes + changed_bytes <= max(before.base_bytes, MIN_DELTA_BUDGET)):
        new_digests, forgotten = added
        dropped = [rule_id for rule_id in before.rules if rule_id not in stored.rules]
        delta = dumps({"head": head, "rules": changed, "drop": dropped, "seen": new_digests, "forget": forgotten})
        if before.delta_bytes + len(delta) <= max(before.base_bytes, MIN_DELTA_BUDGET):
            stored.base_bytes = before.base_bytes
            stored.delta_bytes = before.delta_bytes + len(delta)
            stored.deltas = before.deltas + 1
            return SessionWrite(session_id, False, delta, changed_groups, stored)
    # A new base: the session as a whole, in the form it has always been stored in.
    body = dumps({**head, "rules": fragments, "seen": digests})
    stored.base_bytes = len(body)
    return SessionWrite(session_id, True, body, sum(len(g) for g in rules.values()), stored, may_have_deltas)


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
    rules: dict[str, Any] = dict(plain.get("rules", {}))
    seen: list[int] = [int(d) for d in plain.get("seen") or ()]
    for body in deltas:
        delta = orjson.loads(body)
        stored.delta_bytes += len(body)
        stored.deltas += 1
        for key in [k for k in plain if k not in _NOT_HEAD]:
            del plain[key]
        plain.update(delta["head"])
        rules.update(delta["rules"])
        for rule_id in delta["drop"]:
            rules.pop(rule_id, None)
        seen.extend(int(d) for d in delta["seen"])
        del seen[: int(delta["forget"])]
    plain["rules"] = rules
    plain["seen"] = seen
    stored.rules = {rule_id: hash(dumps(groups)) for rule_id, groups in rules.items()}
    stored.seen_len = len(seen)
    stored.seen_last = seen[-1] if seen else None
    return plain, stored
