"""What the engine remembers about one session, as live objects that convert to plain data.

The engine mutates these objects in place on its hot path; a store that persists them
calls :meth:`SessionState.to_plain` (a dict of str/int/float/bool/None/list/dict that
``orjson`` serializes) and rebuilds them with :meth:`SessionState.from_plain`.

Per stateful rule a session holds one *group state* per group key (the values of the
rule's ``group_by`` expressions; ``""`` when it has none):

- ``sequence``: :class:`SequenceState`, or for a rule that needs neither the opener's
  time nor its provenance just the tuple of its kept fields (see ``RuleSchema.compact``);
- ``absence``: :class:`Wait`, an unresolved wait and its deadline;
- ``change``: the first value seen, as it is (plain form ``{"value": ...}``);
- ``count``: :class:`CountState`, recent matching times.

Besides its groups, a session remembers the absence waits that already *fired* (their
violation went out) and may still be resolved by a later record: :class:`FiredWaits`,
None until a wait of the session fires.

Memory per idle session is what bounds how many sessions fit, so the layout is compact:
``rules`` is a list indexed by rule (None where a rule never touched the session), a
rule with few groups holds a flat (key, state, key, state, ...) tuple instead of a dict,
and the delivery-key digests of a small session are packed into one ``bytes``.

An idle session may hold the groups of its plain-valued rules (compact sequences, change
values) *packed*: one marshalled and compressed bytes object instead of a dict, ints and
tuples per group, about a seventh of the memory (:meth:`SessionState.pack`). The engine
packs sessions idle for a while and unpacks one as soon as anything reads it; the plain
form unpacks first.

Group keys are 64-bit digests of the ``group_by`` values (:func:`group_key`), whatever
the length of an id; a kept string that a rule only compares for equality may be held
as its 8-byte digest (a ``bytes``; the engine decides which, see
``processor.evaluate.kept_digests``). Plain data written before digests, with raw keys,
is digested as it loads (:func:`group_key_from_plain`).

Kept fields of the opening record (``first``) are a tuple aligned with the rule's
``first_fields`` in sorted order, :data:`MISSING` standing for an absent field; the
plain form is a dict of the present fields, so a rule file that changes
``first_fields`` between runs still restores what it can.
"""

from __future__ import annotations

import marshal
import sys
import zlib
from array import array
from bisect import bisect_left
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, cast

import orjson
from xxhash import xxh3_64_digest as _xxh3_bytes
from xxhash import xxh3_64_intdigest as _xxh3_int

from processor.state.cold import ColdBlob, ColdFile

StateKind = Literal["sequence", "absence", "change", "count"]

# A group key: a scalar, or a tuple of scalars for several group_by expressions.
GroupKey = Hashable


class _Missing:
    """An absent field, distinct from a field present with value null."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "MISSING"

    def __reduce__(self) -> str:
        return "MISSING"


MISSING: Final = _Missing()

# Up to this many groups of one rule are a flat tuple in a session (a dict beyond).
SMALL_GROUPS: Final = 8
# Past this many actions of one kind a session counts kinds in a dict (a tuple is rebuilt per count).
BUSY_COUNT: Final = 16
# Up to this many delivery-key digests are packed in one bytes object (8 bytes each).
SEEN_PACKED_MAX: Final = 64
# What stands for MISSING in a packed slot: marshal holds no object of ours, and no record
# value (JSON or OTLP) is ever an Ellipsis.
_PACKED_MISSING: Final = Ellipsis
# The marshal format written and read in this process only (packed groups are never persisted).
_MARSHAL_VERSION: Final = 4
# zlib's fastest level: it takes 40% off marshal's bytes (64-bit keys and digests written with
# a type byte and a length each), for about 50 us a session packed.
_PACK_LEVEL: Final = 1
_LITTLE_ENDIAN: Final = sys.byteorder == "little"

# Provenance of a record a violation may later be reported on (sequence ``report_on:
# first`` and absence): what a Violation needs when the record itself is long gone.
# (action_id, identity source, line, origin, trace_id, span_id, service, kind, time_ns); the
# identity source is the delivery key of a span or the line (else seq) of a log record, from
# which :func:`prov_identity` rebuilds ``record_identity`` without keeping the string.
Provenance = tuple[str, tuple[str, str, int] | int, int | None, str, str, str, str, str, int | None]


def prov_identity(prov: Provenance) -> str:
    """``processor.violations.record_identity`` of the record the provenance was taken from."""
    source = prov[1]
    if isinstance(source, int):
        return f"line:{prov[3]}:{source}"
    trace_id, span_id, index = source
    return f"span:{trace_id}:{span_id}:{index}"


def key_digest(value: Any) -> int:
    """The group key of one ``group_by`` value: a 64-bit digest, whatever the value's length.

    XXH3-64 of the value's canonical bytes: stable across processes and versions (state is
    persisted; a restart must find the same groups), where ``hash()`` of a str is salted.
    """
    if type(value) is str:
        return _xxh3_int(value.encode("utf-8", "surrogatepass"))
    return _xxh3_int(_canonical(value))


def group_key(values: Sequence[Any]) -> int:
    """The group key from the evaluated ``group_by`` values (one or several): a 64-bit digest."""
    if len(values) == 1:
        return key_digest(values[0])
    # Each part length-prefixed, so that ("ab", "c") and ("a", "bc") differ.
    parts = [_canonical(v) for v in values]
    return _xxh3_int(b"\x00tuple:" + b"".join(len(p).to_bytes(4, "big") + p for p in parts))


def _canonical(value: Any) -> bytes:
    """The bytes a group_by value is digested from: equal CEL values give equal bytes.

    A string is its UTF-8; other values carry a tag after a NUL, which no id starts with.
    Numbers compare as numbers in CEL (``1 == 1.0``), so an integral double is its integer;
    a bool is not a number. A list or map is its canonical JSON.
    """
    if type(value) is str:
        return value.encode("utf-8", "surrogatepass")
    if value is None:
        return b"\x00null"
    if isinstance(value, bool):
        return b"\x00true" if value else b"\x00false"
    if isinstance(value, int):
        return b"\x00int:%d" % value
    if isinstance(value, float):
        if value.is_integer():
            return b"\x00int:%d" % int(value)
        return b"\x00double:" + repr(value).encode()
    if isinstance(value, str):
        return str(value).encode("utf-8", "surrogatepass")
    # The text of earlier versions' key for such a value, so a migrated key finds its group.
    text = "\x00json:" + orjson.dumps(value, option=orjson.OPT_SORT_KEYS, default=str).decode()
    return text.encode("utf-8", "surrogatepass")


# A rule without group_by has one group per session.
NO_GROUP: Final = key_digest("")


def group_key_to_plain(key: GroupKey) -> Any:
    """A digest key is written as a one-element list: earlier versions wrote the raw value
    (a scalar, or a list of two or more for several group_by values), which is read back
    and digested."""
    return [key] if type(key) is int else (list(key) if isinstance(key, tuple) else key)


def group_key_from_plain(value: Any) -> GroupKey:
    if type(value) is list:
        if len(value) == 1 and type(value[0]) is int:
            return value[0]
        return group_key(value)  # a raw key of several group_by values (earlier versions)
    return key_digest(value)  # a raw scalar key (earlier versions)


def value_digest(value: str) -> bytes:
    """An equality-only kept string as 8 bytes (see ``processor.evaluate.kept_digests``)."""
    return _xxh3_bytes(value.encode("utf-8", "surrogatepass"))


@dataclass(frozen=True, slots=True)
class RuleSchema:
    """How the engine's stateful rules are laid out in a session's state.

    ``rule_ids[i]``, ``kinds[i]`` and ``first_names[i]`` describe the stateful rule at
    index ``i`` (the engine's order). Plain data names rules by id, so state written
    under one rule set is read back under another: rules that no longer exist are
    dropped, new ones start empty.
    """

    rule_ids: tuple[str, ...]
    kinds: tuple[StateKind, ...]
    first_names: tuple[tuple[str, ...], ...]
    # Sequence rules that need neither the opener's time nor its provenance keep just the
    # kept-fields tuple as a group's state (no SequenceState object).
    compact: tuple[bool, ...] = ()

    @property
    def width(self) -> int:
        return len(self.rule_ids)

    def is_compact(self, index: int) -> bool:
        return index < len(self.compact) and self.compact[index]

    def index_of(self, rule_id: str) -> int | None:
        try:
            return self.rule_ids.index(rule_id)
        except ValueError:
            return None

    def by_group(self, index: int) -> bool:
        """True when the rule's group states are never changed in place (compact sequence groups,
        change values): a group changes only by being put or dropped, which the session notes, so a
        store can write the groups that changed rather than the rule's whole list."""
        kind = self.kinds[index]
        return kind == "change" or (kind == "sequence" and self.is_compact(index))


# The key of a kept-fields map naming the fields held as digests (no field name has a "#").
DIGESTED_KEY: Final = "#digests"


def first_to_plain(names: tuple[str, ...], values: tuple[Any, ...]) -> dict[str, Any]:
    plain = {n: v for n, v in zip(names, values, strict=True) if v is not MISSING}
    digested = [n for n, v in plain.items() if type(v) is bytes]
    if digested:
        for name in digested:
            plain[name] = plain[name].hex()
        plain[DIGESTED_KEY] = digested
    return plain


def first_from_plain(names: tuple[str, ...], plain: Mapping[str, Any]) -> tuple[Any, ...]:
    digested = plain.get(DIGESTED_KEY)
    if not digested:
        return tuple(plain.get(n, MISSING) for n in names)
    return tuple(
        bytes.fromhex(plain[n]) if n in digested and n in plain else plain.get(n, MISSING) for n in names
    )


def _prov_to_plain(prov: Provenance | None) -> list[Any] | None:
    return None if prov is None else list(prov)


def _prov_from_plain(value: Any) -> Provenance | None:
    if value is None:
        return None
    action_id, source, line, origin, trace_id, span_id, service, kind, time_ns = value
    if not isinstance(source, int):
        source = (str(source[0]), str(source[1]), int(source[2]))
    return (action_id, source, line, origin, trace_id, span_id, service, kind, time_ns)


class SequenceState:
    """An opened sequence: the opening record's kept fields and time."""

    __slots__ = ("first", "prov", "reported", "time_ns")

    def __init__(
        self, first: tuple[Any, ...], time_ns: int | None, prov: Provenance | None, reported: bool = False
    ) -> None:
        self.first = first
        self.time_ns = time_ns
        self.prov = prov
        # report_on first: the opener was already reported; it is reported once.
        self.reported = reported

    def to_plain(self, names: tuple[str, ...]) -> dict[str, Any]:
        return {
            "first": first_to_plain(names, self.first),
            "time_ns": self.time_ns,
            "prov": _prov_to_plain(self.prov),
            "reported": self.reported,
        }

    @classmethod
    def from_plain(cls, names: tuple[str, ...], plain: Mapping[str, Any]) -> SequenceState:
        return cls(
            first_from_plain(names, plain["first"]),
            plain["time_ns"],
            _prov_from_plain(plain["prov"]),
            bool(plain["reported"]),
        )


class Wait:
    """An unresolved absence wait.

    ``deadline_ns`` is event time (None: no time deadline, only ``within_actions``);
    ``fire_at`` is the key of its timer in the store (the deadline in replay, a wall
    time in serve; None when no timer is set); ``received_ns`` is the wall time the
    opening record arrived (serve: a wait younger than the allowed lateness never fires).
    """

    __slots__ = ("actions", "deadline_ns", "fire_at", "first", "prov", "received_ns", "started_ns", "state")

    def __init__(
        self,
        first: tuple[Any, ...],
        prov: Provenance,
        started_ns: int | None,
        deadline_ns: int | None,
        *,
        received_ns: int,
        state: str,
        actions: int = 0,
        fire_at: int | None = None,
    ) -> None:
        self.first = first
        self.prov = prov
        self.started_ns = started_ns
        self.deadline_ns = deadline_ns
        self.received_ns = received_ns
        # workflow_state of the opening record ("" when it has none): the open_waits gauge label.
        self.state = state
        # Later records of the group that did not resolve the wait.
        self.actions = actions
        self.fire_at = fire_at

    def to_plain(self, names: tuple[str, ...]) -> dict[str, Any]:
        return {
            "first": first_to_plain(names, self.first),
            "prov": _prov_to_plain(self.prov),
            "started_ns": self.started_ns,
            "deadline_ns": self.deadline_ns,
            "received_ns": self.received_ns,
            "state": self.state,
            "actions": self.actions,
            "fire_at": self.fire_at,
        }

    @classmethod
    def from_plain(cls, names: tuple[str, ...], plain: Mapping[str, Any]) -> Wait:
        prov = _prov_from_plain(plain["prov"])
        if prov is None:
            raise ValueError("a wait without provenance")
        return cls(
            first_from_plain(names, plain["first"]),
            prov,
            plain["started_ns"],
            plain["deadline_ns"],
            received_ns=int(plain["received_ns"]),
            state=str(plain["state"]),
            actions=int(plain["actions"]),
            fire_at=plain["fire_at"],
        )


class CountState:
    """Matching records of a group: their times (windowed) or their number, and whether the threshold is crossed."""

    __slots__ = ("above", "count", "times")

    def __init__(self, times: list[int] | None = None, count: int = 0, above: bool = False) -> None:
        # Windowed counts keep at most threshold + 1 times, sorted: enough to tell a crossing.
        self.times = times
        self.count = count
        self.above = above

    def to_plain(self, names: tuple[str, ...]) -> dict[str, Any]:
        return {"times": self.times, "count": self.count, "above": self.above}

    @classmethod
    def from_plain(cls, names: tuple[str, ...], plain: Mapping[str, Any]) -> CountState:
        times = plain["times"]
        return cls(None if times is None else [int(t) for t in times], int(plain["count"]), bool(plain["above"]))


# A fired wait: (rule index, group key, violation id, kept first fields).
FiredEntry = tuple[int, GroupKey, str, tuple[Any, ...]]


class SeenDigests:
    """Many delivery-key digests in 16 bytes each: a sorted array for membership, a queue for age.

    A dict and a deque of Python ints cost about 90 bytes a digest; a long session holds
    up to ``max_seen_per_session`` of them. Membership is a binary search, an insertion
    a move of at most that many 8-byte words. The age queue is consumed from ``start``
    and compacted once half of it is consumed.
    """

    __slots__ = ("order", "sorted", "start")

    def __init__(self, digests: Iterable[int]) -> None:
        self.order = array("Q", digests)
        self.sorted = array("Q", sorted(set(self.order)))
        self.start = 0

    @classmethod
    def from_bytes(cls, order: bytes, members: bytes) -> SeenDigests:
        """Read back from the machine-order bytes of ``order[start:]`` and ``sorted`` (SessionState.pack)."""
        digests = cls(())
        digests.order.frombytes(order)
        digests.sorted.frombytes(members)
        return digests

    def __len__(self) -> int:
        return len(self.order) - self.start

    def digests(self) -> list[int]:
        """Oldest first."""
        return self.order[self.start :].tolist()

    def check(self, digest: int, limit: int) -> bool:
        members = self.sorted
        at = bisect_left(members, digest)
        if at < len(members) and members[at] == digest:
            return True
        members.insert(at, digest)
        self.order.append(digest)
        if len(self) > limit:
            self.forget_oldest(len(self) - limit)
        return False

    def forget_oldest(self, count: int) -> int:
        """Forget up to ``count`` of the oldest digests; returns how many went."""
        gone = min(count, len(self))
        members, order = self.sorted, self.order
        for at in range(self.start, self.start + gone):
            index = bisect_left(members, order[at])
            if index < len(members) and members[index] == order[at]:
                del members[index]
        self.start += gone
        if self.start * 2 >= len(order):
            del order[: self.start]
            self.start = 0
        return gone


class FiredWaits:
    """Absence waits of one session that fired unresolved: a later resolution clears their violation.

    ``entries`` holds ``(rule index, group key, violation id, kept first fields)``, oldest
    first (bounded by the engine); ``rules`` the indices of the rules with an entry (every
    record of the session asks; entries change rarely); ``resolved`` counts the session's
    waits resolved after their deadline.
    """

    __slots__ = ("entries", "resolved", "rules")

    def __init__(self, entries: list[FiredEntry] | None = None, resolved: int = 0) -> None:
        self.entries: list[FiredEntry] = entries if entries is not None else []
        self.rules: set[int] = {entry[0] for entry in self.entries}
        self.resolved = resolved

    def add(self, entry: FiredEntry, limit: int) -> bool:
        """Remember one more fired wait; True when the oldest was forgotten to stay within ``limit``."""
        entries = self.entries
        entries.append(entry)
        self.rules.add(entry[0])
        if len(entries) <= limit:
            return False
        del entries[: len(entries) - limit]
        self.rules = {e[0] for e in entries}
        return True

    def replace(self, entries: list[FiredEntry]) -> None:
        self.entries = entries
        self.rules = {entry[0] for entry in entries}


_STATE_CLASSES: Final[dict[StateKind, Any]] = {
    "sequence": SequenceState,
    "absence": Wait,
    "count": CountState,
}


def _slot_pairs(slot: Any) -> Iterable[tuple[GroupKey, Any]]:
    """A rule's slot as its (key, state) pairs in order: a flat tuple while small, a dict past it."""
    if type(slot) is tuple:
        return zip(slot[::2], slot[1::2], strict=True)
    return cast("dict[GroupKey, Any]", slot).items()


# States that are our own objects, never packed (see SessionState.pack).
_STATE_OBJECTS: Final = (SequenceState, Wait, CountState)


class SessionState:
    """One open session.

    ``rules`` maps a stateful rule's index (see :class:`RuleSchema`) to its groups;
    rules that never touched the session have no entry, and a session no stateful rule
    touched has ``rules`` None (most of the memory of an idle session is its groups).
    ``seen`` is the bounded, insertion-ordered set of delivery-key digests (duplicate
    delivery). ``activity_ns`` is what idle expiry measures: the latest event time in
    replay, the latest arrival wall time in serve (None: no timed record yet).
    """

    __slots__ = (
        "activity_ns",
        "buffered",
        "changes",
        "entries",
        "fired",
        "kinds",
        "next_deadline_ns",
        "packed",
        "rules",
        "seen",
        "session_id",
        "violations",
    )

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        # Actions by kind, flattened (kind, count, kind, count, ...): a tuple is half a small dict.
        # A busy session (see count_kind) holds a dict instead: counting is then one dict update.
        self.kinds: tuple[str | int, ...] | dict[str, int] = ()
        self.violations: dict[str, int] | None = None
        self.rules: list[Any] | None = None
        # Delivery-key digests, oldest first: 8 bytes each packed in a bytes while few,
        # an insertion-ordered dict beyond SEEN_PACKED_MAX.
        self.seen: bytes | SeenDigests | None = None
        self.activity_ns: int | None = None
        # Records of this session in the engine's reordering buffer (bounded per session).
        self.buffered = 0
        # A lower bound of the earliest wait deadline (None: no timed wait); refreshed lazily.
        self.next_deadline_ns: int | None = None
        # Waits that fired and may still be resolved (None: none ever fired in this session).
        self.fired: FiredWaits | None = None
        # entry_count() as the engine's global bound last counted it (not persisted).
        self.entries = 0
        # Groups put or dropped since a durable store last wrote the session (None: no store
        # asked, nothing noted): rule index -> {key: True (put: it is now among the newest, in
        # this order) or False (dropped)}. See track_changes.
        self.changes: dict[int, dict[GroupKey, bool]] | None = None
        # The groups of plain-valued rules, packed while the session is idle (see pack): the
        # compressed marshalled (rule index, slot) pairs, or in replay where they are in its
        # temporary file (processor.state.cold); the entries they hold; whether the session's
        # delivery-key digests are among them. The packed slots are None.
        self.packed: tuple[bytes | ColdBlob, int, bool] | None = None

    # Groups of one rule live in its slot of ``rules``: None (no group), a flat tuple
    # (key, state, key, state, ...) while there are at most SMALL_GROUPS of them, else a
    # dict from key to state. Either way the oldest group comes first.

    def get_group(self, index: int, key: GroupKey) -> Any:
        """The state of a group, or MISSING when the group has none."""
        if self.packed is not None:
            self.unpack()
        rules = self.rules
        if rules is None:
            return MISSING
        slot = rules[index]
        if slot is None:
            return MISSING
        if type(slot) is tuple:
            for at in range(0, len(slot), 2):
                if slot[at] == key:
                    return slot[at + 1]
            return MISSING
        return slot.get(key, MISSING)

    def put_group(self, index: int, key: GroupKey, state: Any, width: int, limit: int) -> tuple[GroupKey, Any] | None:
        """Set a group's state (it becomes the newest); returns the oldest group, dropped when ``limit`` is reached."""
        if self.packed is not None:
            self.unpack()
        rules = self.rules
        if rules is None:
            rules = self.rules = [None] * width
        if self.changes is not None:
            self.note_put(index, key)
        slot = rules[index]
        if slot is None:
            rules[index] = (key, state)
            return None
        dropped: tuple[GroupKey, Any] | None = None
        if type(slot) is tuple:
            for at in range(0, len(slot), 2):
                if slot[at] == key:
                    rules[index] = (*slot[:at], *slot[at + 2 :], key, state)
                    return None
            if len(slot) // 2 >= limit:
                dropped = (slot[0], slot[1])
                slot = slot[2:]
                if self.changes is not None:
                    self._note_dropped(index, dropped[0])
            if len(slot) // 2 < SMALL_GROUPS:
                rules[index] = (*slot, key, state)
            else:
                groups = dict(zip(slot[::2], slot[1::2], strict=True))
                groups[key] = state
                rules[index] = groups
            return dropped
        if key in slot:
            del slot[key]
        elif len(slot) >= limit:
            oldest = next(iter(slot))
            dropped = (oldest, slot.pop(oldest))
            if self.changes is not None:
                self._note_dropped(index, oldest)
        slot[key] = state
        return dropped

    def drop_group(self, index: int, key: GroupKey) -> None:
        if self.packed is not None:
            self.unpack()
        rules = self.rules
        if rules is None:
            return
        slot = rules[index]
        if slot is None:
            return
        if type(slot) is tuple:
            for at in range(0, len(slot), 2):
                if slot[at] == key:
                    rules[index] = (*slot[:at], *slot[at + 2 :]) or None
                    if self.changes is not None:
                        self._note_dropped(index, key)
                    return
            return
        if slot.pop(key, MISSING) is MISSING:
            return
        if self.changes is not None:
            self._note_dropped(index, key)
        if len(slot) <= SMALL_GROUPS // 2:
            rules[index] = tuple(x for pair in slot.items() for x in pair) or None

    def pack(self, cold: ColdFile | None = None) -> int:
        """Hold the groups of every rule whose group states are plain values (compact sequence
        groups' kept fields, change values) as one marshalled bytes object, compressed; returns
        how many groups were packed (0: none). Wait, count and full sequence states stay as
        they are: timers and the session's summary read waits, and they change in place.

        Nothing reads a packed slot: every method that reads or changes groups unpacks first,
        and the engine unpacks a session as it looks it up. The plain form is unchanged.
        With ``cold`` (replay) the bytes go to its file and the session keeps where they are,
        and its delivery-key digests go with them (the methods that read those unpack first).
        """
        rules = self.rules
        if rules is None or self.packed is not None:
            return 0
        slots: list[tuple[int, Any]] = []
        count = 0
        for index, slot in enumerate(rules):
            if slot is None:
                continue
            out: list[Any] = []
            for key, state in _slot_pairs(slot):
                if isinstance(state, _STATE_OBJECTS):
                    break  # a slot holds states of one kind: this rule's stay objects
                out.append(key)
                if type(state) is tuple and MISSING in state:
                    out.append(tuple(_PACKED_MISSING if v is MISSING else v for v in state))
                else:
                    out.append(state)
            else:
                slots.append((index, (type(slot) is tuple, out)))
                count += len(out) // 2
        if not slots:
            return 0
        seen = self.seen if cold is not None else None
        seen_plain: bytes | tuple[bytes, bytes] | None = None
        if type(seen) is bytes:
            seen_plain = seen
        elif seen is not None:
            digests = cast(SeenDigests, seen)
            seen_plain = (digests.order[digests.start :].tobytes(), digests.sorted.tobytes())
        try:
            packed = marshal.dumps((slots, seen_plain), _MARSHAL_VERSION)
        except ValueError:
            return 0  # a value marshal does not take (none of the plain forms has one): nothing is packed
        compressed = zlib.compress(packed, _PACK_LEVEL)
        blob = None if cold is None else cold.put(compressed)
        if blob is None and seen_plain is not None:
            # The file did not take them: the digests stay as they are, the groups packed in memory.
            return self.pack()
        entries = count + (0 if seen is None else self.seen_count())
        self.packed = (compressed if blob is None else blob, entries, seen_plain is not None)
        if seen_plain is not None:
            self.seen = None
        for index, _ in slots:
            rules[index] = None
        return count

    def packed_bytes(self) -> int:
        """The compressed bytes of the packed groups (in memory, or in replay's file); 0 when not packed."""
        packed = self.packed
        if packed is None:
            return 0
        held = packed[0]
        return len(held) if type(held) is bytes else cast(ColdBlob, held).length

    def unpack(self) -> None:
        """Put the packed groups back in their slots, in their order (see :meth:`pack`)."""
        packed = self.packed
        if packed is None:
            return
        held = packed[0]
        data = held if type(held) is bytes else cast(ColdBlob, held).read()
        self.packed = None
        rules = self.rules
        assert rules is not None
        # Bytes this process marshalled itself (pack); never read from an input or a file.
        slots, seen_plain = marshal.loads(zlib.decompress(data))  # noqa: S302
        if type(seen_plain) is bytes:
            self.seen = seen_plain
        elif seen_plain is not None:
            self.seen = SeenDigests.from_bytes(*seen_plain)
        for index, (flat, out) in slots:
            for at in range(1, len(out), 2):
                state = out[at]
                if type(state) is tuple and _PACKED_MISSING in state:
                    out[at] = tuple(MISSING if v is _PACKED_MISSING else v for v in state)
            rules[index] = tuple(out) if flat else dict(zip(out[::2], out[1::2], strict=True))

    def track_changes(self) -> None:
        """From now on, note every group put or dropped (a durable store writes what changed)."""
        if self.changes is None:
            self.changes = {}

    def take_changes(self) -> dict[int, dict[GroupKey, bool]] | None:
        """The groups put and dropped since the last call (None: not tracked until now); noting
        starts again from here."""
        changes = self.changes
        self.changes = {}
        return changes

    def note_put(self, index: int, key: GroupKey) -> None:
        """A group was set (by put_group, or by the engine adding to a rule's dict itself): it is the newest."""
        self._note(index, key, True)

    def _note_dropped(self, index: int, key: GroupKey) -> None:
        self._note(index, key, False)

    def _note(self, index: int, key: GroupKey, put: bool) -> None:
        # Last noted last: a put is then the newest group when the delta is applied; a drop
        # deletes its key wherever it stands, so moving it does no harm.
        changes = self.changes
        assert changes is not None
        noted = changes.get(index)
        if noted is None:
            changes[index] = {key: put}
        else:
            noted.pop(key, None)
            noted[key] = put

    def iter_groups(self, index: int) -> list[tuple[GroupKey, Any]]:
        if self.packed is not None:
            self.unpack()
        rules = self.rules
        slot = rules[index] if rules is not None else None
        if slot is None:
            return []
        return list(_slot_pairs(slot))

    def count_kind(self, kind: str) -> tuple[str | int, ...] | None:
        """Count one action of ``kind``; returns the new counts while they are a tuple (the caller
        may share equal tuples), None once the session counts in a dict (past ``BUSY_COUNT``)."""
        kinds = self.kinds
        if type(kinds) is dict:
            kinds[kind] = kinds.get(kind, 0) + 1
            return None
        assert isinstance(kinds, tuple)
        try:
            # Counts are ints and kinds strings: only a kind's own slot can be equal to it.
            at = kinds.index(kind)
        except ValueError:
            self.kinds = (*kinds, kind, 1)
            return self.kinds
        count = cast(int, kinds[at + 1]) + 1
        if count > BUSY_COUNT:
            self.kinds = self.kinds_dict()
            self.kinds[kind] = count
            return None
        self.kinds = (*kinds[: at + 1], count, *kinds[at + 2 :])
        return self.kinds

    def kinds_dict(self) -> dict[str, int]:
        kinds = self.kinds
        if isinstance(kinds, dict):
            return dict(kinds)
        return {cast(str, kinds[at]): cast(int, kinds[at + 1]) for at in range(0, len(kinds), 2)}

    def check_seen(self, digest: int, limit: int) -> bool:
        """True when ``digest`` was seen before; otherwise remember it (at most ``limit``, oldest forgotten)."""
        return self.check_seen_packed(digest.to_bytes(8, "big"), limit)

    def check_seen_packed(self, packed: bytes, limit: int) -> bool:
        """:meth:`check_seen` for a digest already packed in 8 big-endian bytes (the engine's form)."""
        if self.packed is not None and self.packed[2]:
            self.unpack()
        seen = self.seen
        if seen is None:
            self.seen = packed
            return False
        if type(seen) is bytes:
            at = seen.find(packed)
            while at != -1:
                if at % 8 == 0:
                    return True
                at = seen.find(packed, at + 1)
            if len(seen) < SEEN_PACKED_MAX * 8:
                self.seen = seen + packed
                return False
            seen = self.seen = SeenDigests(self.seen_digests())
        assert isinstance(seen, SeenDigests)
        return seen.check(int.from_bytes(packed, "big"), limit)

    def entry_count(self) -> int:
        """Groups of every rule plus delivery-key digests: what the global bound counts."""
        packed = self.packed
        count = 0 if packed is None else packed[1]
        rules = self.rules
        if rules is not None:
            for slot in rules:
                if slot is not None:
                    count += len(slot) // 2 if type(slot) is tuple else len(slot)
        return count + self.seen_count()

    def seen_count(self) -> int:
        """The delivery-key digests held in memory (not those packed with the groups)."""
        seen = self.seen
        if seen is None:
            return 0
        return len(seen) // 8 if type(seen) is bytes else len(seen)

    def forget_seen(self, limit: int) -> int:
        """Forget up to ``limit`` of the oldest delivery-key digests; returns how many went."""
        if self.packed is not None and self.packed[2]:
            self.unpack()
        seen = self.seen
        if seen is None or limit <= 0:
            return 0
        if type(seen) is bytes:
            gone = min(limit, len(seen) // 8)
            self.seen = seen[gone * 8 :] or None
            return gone
        assert isinstance(seen, SeenDigests)
        gone = seen.forget_oldest(limit)
        if not len(seen):
            self.seen = None
        return gone

    def seen_digests(self) -> list[int]:
        if self.packed is not None and self.packed[2]:
            self.unpack()
        seen = self.seen
        if seen is None:
            return []
        if isinstance(seen, bytes):
            # Big-endian words, read in one step (a store asks for them at every commit of the session).
            words = array("Q", seen)
            if _LITTLE_ENDIAN:
                words.byteswap()
            return words.tolist()
        return seen.digests()

    def waits(self, indices: Iterable[int] | None = None) -> list[tuple[int, GroupKey, Wait]]:
        """Every open wait of the session: (rule index, group key, wait); ``indices``: the absence rules, if known."""
        out: list[tuple[int, GroupKey, Wait]] = []
        rules = self.rules
        if rules:
            # Read in place, not unpacked: a packed slot holds no wait (see pack).
            for index in range(len(rules)) if indices is None else indices:
                slot = rules[index]
                if slot is None:
                    continue
                for key, state in _slot_pairs(slot):
                    if isinstance(state, Wait):
                        out.append((index, key, state))
        return out

    def to_plain(self, schema: RuleSchema) -> dict[str, Any]:
        if self.packed is not None:
            self.unpack()
        rules: dict[str, list[list[Any]]] = {}
        slots = self.rules
        if slots is not None:
            # Plain forms of kept tuples met in this call: rules that keep the same fields of one
            # record share its tuple (Engine._kept).
            kept_plain: _KeptPlain = {}
            for index, slot in enumerate(slots):
                if slot:
                    rules[schema.rule_ids[index]] = _groups_to_plain(schema, index, slot, kept_plain)
        plain = self.head_plain(schema)
        plain["rules"] = rules
        plain["seen"] = self.seen_digests()
        return plain

    def head_plain(self, schema: RuleSchema) -> dict[str, Any]:
        """The plain form without its rules and delivery-key digests: counts, activity, fired waits."""
        plain: dict[str, Any] = {
            "session_id": self.session_id,
            "kinds": self.kinds_dict(),
            "violations": self.violations,
            "activity_ns": self.activity_ns,
        }
        fired = self.fired
        if fired is not None:
            # Written only when a wait ever fired: state saved before fired waits existed reads the same.
            plain["fired"] = [
                {
                    "rule": schema.rule_ids[index],
                    "group": group_key_to_plain(key),
                    "violation_id": violation_id,
                    "first": first_to_plain(schema.first_names[index], first),
                }
                for index, key, violation_id, first in fired.entries
            ]
            plain["resolved_late"] = fired.resolved
        return plain

    def changes_to_plain(
        self, schema: RuleSchema, changes: Mapping[int, Mapping[GroupKey, bool]]
    ) -> tuple[dict[str, list[list[Any]]], dict[str, list[list[Any]]]]:
        """What a store writes of the rules after :meth:`take_changes` gave ``changes``.

        Returns (every group of each rule whose groups may change in place, as :meth:`to_plain`
        has them; for the rules tracked by group (``RuleSchema.by_group``), the groups put or
        dropped: ``[key, group]`` of a group put, in the order they became the newest, and
        ``[key, None]`` of one dropped).
        """
        if self.packed is not None:
            self.unpack()
        whole: dict[str, list[list[Any]]] = {}
        changed: dict[str, list[list[Any]]] = {}
        slots = self.rules
        kept_plain: _KeptPlain = {}
        if slots is not None:
            for index, slot in enumerate(slots):
                if slot and not schema.by_group(index):
                    whole[schema.rule_ids[index]] = _groups_to_plain(schema, index, slot, kept_plain)
        for index, noted in changes.items():
            if not noted or not schema.by_group(index):
                continue
            names = schema.first_names[index]
            kind = schema.kinds[index]
            out: list[list[Any]] = []
            for key, put in noted.items():
                state = self.get_group(index, key) if put else MISSING
                if state is MISSING:
                    out.append([group_key_to_plain(key), None])
                elif type(state) is tuple:
                    out.append([group_key_to_plain(key), _compact_to_plain(names, state, kept_plain)])
                else:
                    out.append([group_key_to_plain(key), _group_to_plain(kind, names, state)])
            changed[schema.rule_ids[index]] = out
        return whole, changed

    @classmethod
    def from_plain(cls, schema: RuleSchema, plain: Mapping[str, Any]) -> SessionState:
        state = cls(str(plain["session_id"]))
        state.kinds = tuple(x for k, v in plain["kinds"].items() for x in (str(k), int(v)))
        violations = plain.get("violations")
        state.violations = None if not violations else {str(k): int(v) for k, v in violations.items()}
        for rule_id, groups in plain.get("rules", {}).items():
            index = schema.index_of(rule_id)
            if index is None:
                continue
            kind = schema.kinds[index]
            names = schema.first_names[index]
            compact = schema.is_compact(index)
            for key, group_plain in groups:
                group = _group_from_plain(kind, names, compact, group_plain)
                state.put_group(index, group_key_from_plain(key), group, schema.width, len(groups) + 1)
        digests = plain.get("seen") or []
        if len(digests) <= SEEN_PACKED_MAX:
            state.seen = b"".join(int(d).to_bytes(8, "big") for d in digests) or None
        else:
            state.seen = SeenDigests(map(int, digests))
        state.activity_ns = plain.get("activity_ns")
        fired_plain = plain.get("fired")
        if fired_plain is not None or plain.get("resolved_late"):
            entries: list[FiredEntry] = []
            for entry in fired_plain or ():
                index = schema.index_of(str(entry["rule"]))
                if index is None or schema.kinds[index] != "absence":
                    continue
                first = first_from_plain(schema.first_names[index], entry["first"])
                entries.append((index, group_key_from_plain(entry["group"]), str(entry["violation_id"]), first))
            state.fired = FiredWaits(entries, int(plain.get("resolved_late") or 0))
        deadlines = [w.deadline_ns for _, _, w in state.waits() if w.deadline_ns is not None]
        state.next_deadline_ns = min(deadlines) if deadlines else None
        return state


_KeptPlain = dict[int, tuple[tuple[Any, ...], tuple[str, ...], dict[str, Any]]]


def _groups_to_plain(schema: RuleSchema, index: int, slot: Any, kept_plain: _KeptPlain) -> list[list[Any]]:
    """A rule's groups (its slot, not empty) as ``[key, group]`` in their order."""
    pairs = _slot_pairs(slot)
    names = schema.first_names[index]
    kind = schema.kinds[index]
    if kind == "sequence":
        return [
            [[key] if type(key) is int else group_key_to_plain(key),
             _compact_to_plain(names, state, kept_plain) if type(state) is tuple
             else _group_to_plain(kind, names, state)]
            for key, state in pairs
        ]
    return [[group_key_to_plain(key), _group_to_plain(kind, names, state)] for key, state in pairs]


def _compact_to_plain(
    names: tuple[str, ...], kept: tuple[Any, ...],
    seen: _KeptPlain,
) -> dict[str, Any]:
    """``_group_to_plain`` of a compact sequence group (its kept tuple), once per tuple and names in ``seen``.

    ``seen`` holds the tuple itself, so its id is not reused while the entry lives; the
    result may be shared by several groups of the plain form, which is only serialized.
    """
    entry = seen.get(id(kept))
    if entry is not None and entry[0] is kept and entry[1] == names:
        return entry[2]
    plain = {"first": first_to_plain(names, kept), "time_ns": None, "prov": None, "reported": False}
    seen[id(kept)] = (kept, names, plain)
    return plain


def _group_to_plain(kind: StateKind, names: tuple[str, ...], state: Any) -> dict[str, Any]:
    if kind == "change":
        # A string first value is held as its digest (it is only compared for equality).
        return {"digest": state.hex()} if type(state) is bytes else {"value": state}
    if isinstance(state, tuple):
        return {"first": first_to_plain(names, state), "time_ns": None, "prov": None, "reported": False}
    plain: dict[str, Any] = state.to_plain(names)
    return plain


def _group_from_plain(kind: StateKind, names: tuple[str, ...], compact: bool, plain: Mapping[str, Any]) -> Any:
    if kind == "change":
        return bytes.fromhex(plain["digest"]) if "digest" in plain else plain["value"]
    if kind == "sequence" and compact:
        return first_from_plain(names, plain["first"])
    return _STATE_CLASSES[kind].from_plain(names, plain)
