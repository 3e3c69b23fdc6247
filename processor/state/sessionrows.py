"""A session as a base and deltas: what a SQL store writes of a changed session, and how it reads one back.

Writing a session whole at every commit costs what the session holds, not what changed:
a session open for days carries thousands of delivery-key digests and its rules'
groups, and one more span changes a count, a digest and a group or two. So a session
is stored as one *base* row (``sessions``: the whole session, in the form it was
always written in) and *delta* rows (``session_deltas``), one per commit that changed it:

- the head (counts by kind and by rule, activity time, fired waits), which is small;
- the groups put and dropped of each rule whose groups never change in place (compact
  sequence groups, change values: ``RuleSchema.by_group``), as the session noted them
  (``SessionState.take_changes``): a group put is now the newest, in the order written;
- every group of each other rule whose groups changed (a wait's or a count's state
  changes in place, unnoted: such a rule is serialized in one call, compared by hash
  with what is stored, and written as one list when it differs), and the rules that no
  longer have any;
- the delivery-key digests added, and how many of the oldest were forgotten.

A commit writes one row per changed session either way; a delta holds what changed.
Once a session's deltas together outweigh its base (or after :data:`MAX_DELTAS` of
them), the next commit writes a new base and deletes the deltas: the bytes written
stay within about twice what changed, and a restart replays few deltas per session.
A session the store knows nothing of (new, or not loaded by this process), or whose
changes were not noted since it was last written, is written as a new base.

The store remembers, per session, what the database holds (:class:`Stored`): a 64-bit
hash of the serialized groups of each rule written whole, and the digests' extent. It
changes only once a transaction committed. A hash collision (probability 2^-64 per
changed rule) would leave that rule's change unwritten: the price of not holding
every rule's bytes twice in memory.

Everything here is plain data from :class:`SessionState` (``to_plain``, ``head_plain``,
``changes_to_plain``); nothing knows how a session keeps its state in memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

from processor.state.session import group_key_from_plain

# A new base after this many deltas, whatever their size (bounds the replay at a restart).
MAX_DELTAS: Final = 32
# Deltas may together reach this many bytes before a base is rewritten, however small the base.
MIN_DELTA_BUDGET: Final = 4096

_NOT_HEAD: Final = frozenset({"rules", "seen"})


def dumps(value: Any) -> bytes:
    """Plain state as bytes; values a rule kept that JSON cannot hold become their text."""
    return orjson.dumps(value, default=str, option=orjson.OPT_NON_STR_KEYS)


@dataclass(slots=True)
class Stored:
    """What the database holds of one session: base and deltas together."""

    # rule id -> hash of the serialized list of its groups (the rules written whole; at a load, all)
    rules: dict[str, int] = field(default_factory=dict)
    seen_len: int = 0
    seen_last: int | None = None
    base_bytes: int = 0
    delta_bytes: int = 0
    deltas: int = 0


@dataclass(slots=True)
class SessionWrite:
    """The row one commit writes for one changed session, and what is stored once it committed."""

    session_id: str
    # True: ``body`` is a new base (and the session's deltas are deleted); False: a delta.
    base: bool
    body: bytes
    groups: int  # groups written (in the base, or in the rules and groups a delta writes)
    stored: Stored
    # A base must delete deltas: the session has some, or the store does not know it.
    may_have_deltas: bool = True


@dataclass(slots=True)
class SessionChange:
    """What changed in a session since its last write, as plain data."""

    head: dict[str, Any]  # SessionState.head_plain
    # The rules written whole, each with all its groups, and the groups put ([key, group]) or
    # dropped ([key, None]) of the rules tracked by group (SessionState.changes_to_plain).
    whole: dict[str, list[list[Any]]]
    groups: dict[str, list[list[Any]]]
    by_group: frozenset[str]  # the ids of every rule tracked by group in the writer's rule set
    digests: list[int]


def session_base(plain: Mapping[str, Any], before: Stored | None, by_group: frozenset[str]) -> SessionWrite:
    """A new base for a session whose plain form is ``plain``, given what is stored (``before``)."""
    digests = plain.get("seen") or ()
    rules = plain.get("rules", {})
    stored = Stored(seen_len=len(digests), seen_last=int(digests[-1]) if digests else None)
    fragments: dict[str, orjson.Fragment] = {}
    for rule_id, groups in rules.items():
        # One serialization per rule, embedded as it is; hashed when the rule is written whole.
        body = dumps(groups)
        fragments[rule_id] = orjson.Fragment(body)
        if rule_id not in by_group:
            stored.rules[rule_id] = hash(body)
    body = dumps({**{k: v for k, v in plain.items() if k not in _NOT_HEAD}, "rules": fragments, "seen": digests})
    stored.base_bytes = len(body)
    return SessionWrite(str(plain["session_id"]), True, body, sum(len(g) for g in rules.values()), stored,
                        before is None or before.deltas > 0)


def session_delta(change: SessionChange, before: Stored) -> SessionWrite | None:
    """The delta row of ``change`` over what is stored; None when a new base is due instead
    (the deltas at their count or size budget, or digests gone that no delta can say)."""
    if before.deltas >= MAX_DELTAS:
        return None
    added = _digests_added(change.digests, before)
    if added is None:
        return None
    budget = max(before.base_bytes, MIN_DELTA_BUDGET)
    stored = Stored(seen_len=len(change.digests), seen_last=change.digests[-1] if change.digests else None)
    rewritten: dict[str, orjson.Fragment] = {}
    groups = 0
    for rule_id, rule_groups in change.whole.items():
        body = dumps(rule_groups)
        digest = hash(body)
        stored.rules[rule_id] = digest
        if before.rules.get(rule_id) != digest:
            rewritten[rule_id] = orjson.Fragment(body)
            groups += len(rule_groups)
    dropped = [r for r in before.rules if r not in stored.rules and r not in change.by_group]
    groups += sum(len(g) for g in change.groups.values())
    new_digests, forgotten = added
    delta = dumps({"head": change.head, "rules": rewritten, "drop": dropped, "groups": change.groups,
                   "seen": new_digests, "forget": forgotten})
    if before.delta_bytes + len(delta) > budget:
        return None
    stored.base_bytes = before.base_bytes
    stored.delta_bytes = before.delta_bytes + len(delta)
    stored.deltas = before.deltas + 1
    return SessionWrite(str(change.head["session_id"]), False, delta, groups, stored)


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
    # Rules that deltas changed by group, keyed while the deltas are applied: rule id -> key -> entry.
    keyed: dict[str, dict[Any, list[Any]]] = {}
    seen: list[int] = [int(d) for d in plain.get("seen") or ()]
    for body in deltas:
        delta = orjson.loads(body)
        stored.delta_bytes += len(body)
        stored.deltas += 1
        for name in [k for k in plain if k not in _NOT_HEAD]:
            del plain[name]
        plain.update(delta["head"])
        for rule_id, groups in delta["rules"].items():
            keyed.pop(rule_id, None)
            rules[rule_id] = groups
        for rule_id in delta["drop"]:
            keyed.pop(rule_id, None)
            rules.pop(rule_id, None)
        for rule_id, changed in (delta.get("groups") or {}).items():
            by_key = keyed.get(rule_id)
            if by_key is None:
                by_key = keyed[rule_id] = {group_key_from_plain(e[0]): e for e in rules.get(rule_id, ())}
            for group_key, group in changed:
                # Named: it leaves its place; put: it is the newest.
                digest = group_key_from_plain(group_key)
                by_key.pop(digest, None)
                if group is not None:
                    by_key[digest] = [group_key, group]
        seen.extend(int(d) for d in delta["seen"])
        del seen[: int(delta["forget"])]
    for rule_id, by_key in keyed.items():
        if by_key:
            rules[rule_id] = list(by_key.values())
        else:
            rules.pop(rule_id, None)
    plain["rules"] = rules
    plain["seen"] = seen
    stored.rules = {rule_id: hash(dumps(groups)) for rule_id, groups in rules.items()}
    stored.seen_len = len(seen)
    stored.seen_last = seen[-1] if seen else None
    return plain, stored
