"""The streaming, per-session, stateful rule engine that replay and serve both drive.

**Order.** Within a session, stateful rules (``sequence``, ``absence``, ``change``,
``count``) see records in event-time order (``time_ns``, then ``seq``, then arrival).
Action-log records (source ``log``) are one line per action in the order the agent
wrote them: they are evaluated at arrival. Spans are held in a reordering buffer and
released in order once the *watermark* passes them. The watermark is ``max event time
seen - allowed_lateness`` (never moving back); in serve it also moves with the clock: a
span buffered for ``allowed_lateness`` of wall time is released together with everything
not later than it. A span that arrives behind the watermark is *late*: counted and
evaluated at once, never dropped. A session whose buffer reaches
``max_buffered_per_session`` forces the watermark forward.

**Acceptance.** ``condition`` rules read one record alone, so order cannot change their
verdict: a span is counted (``actions_evaluated``, its session's actions by kind) and
its condition rules run when it is *accepted* (not a duplicate), and their violations
come back from the ``submit`` that accepted it; only the stateful rules wait for the
buffer. The violations of a run are the same as if everything ran at release; only
the moment condition violations are returned differs. A buffered span carries this
mark (``conditions_done``) into the store, so one released after a restart runs only
its stateful rules; a buffered span without the mark (state written before conditions
ran at acceptance) is counted and checked in full at its release.

**Duplicates.** A span's ``delivery_key`` (trace, span, event index) is remembered per
session (bounded); a second delivery is skipped before any rule and counted.

**Timers.** An absence wait with a time deadline fires when it passes unresolved:
before a later record of its session is evaluated (event-time order), and when the
session is silent: in replay once the watermark is past the deadline (at the end of
the input, once the deadline is not after the last event time); in serve once the
clock is past ``deadline + allowed_lateness`` and the wait was received at least
``allowed_lateness`` ago, so that a resolution delivered just after its wait, or a
dump of old spans sent live, raises no false alarm. The violation carries the
deadline as its time. Waits still pending at the end are *open waits*, not violations.

**Sessions.** A session ends after ``session_idle_timeout_s`` without records (event
time in replay, the clock in serve; checked in steps of 1/1024 of the timeout). A
session with a timed wait pending does not expire before the wait fires: the deadline
is what it is waiting for. Waits without a time deadline (``within_actions`` only) end
with the session and are listed, as still open, in its summary (replay keeps summaries
of ended sessions, serve does not). At ``max_sessions`` the least recently active
session is evicted (state dropped, counted, logged without ids or values). Per
session, each stateful rule keeps at most ``max_groups_per_rule`` groups (oldest
dropped first). Across sessions, past ``max_remembered_entries`` groups and delivery
keys, the least recently active sessions forget their oldest (open waits kept; see
``_trim_entries``).

**Keys and kept values** are fixed-size: a group key is the 64-bit digest of the
``group_by`` values (:func:`processor.state.session.group_key`), and a kept string that
``then`` only compares for equality is an 8-byte digest, turned back into the later
record's own value, or a value equal to nothing, when ``then`` reads it (see
:mod:`processor.evaluate.kept_digests`).

**Messages** render in the activation in which the rule fired. An absence fires when
its waiting record is gone: ``record`` and ``first`` are then both the fields kept from
it, and the engine keeps the fields the rule's message reads of ``record`` as well as
those its ``then`` reads of ``first``. For a malformed item, ``meta`` holds ``source``,
``line`` and ``problem``.

**Rules.** The semantics of each rule type are those of :mod:`processor.evaluate.model`.
Within one record, a stateful rule checks ``then`` against the existing state before
``first`` may open or replace it (a record is never its own "later record"). A rule
whose expression raises EvaluationError on a record does not fire on it; the error is
counted per rule (``summary().rule_errors``) and logged once per rule, without values.

**Resolutions.** An absence wait that fired is remembered (per session, at most
``max_fired_waits_per_session``, oldest forgotten first) with its violation id and kept
fields. A later record of the same rule and group that matches ``then`` against them
*resolves* it: the violation id is queued for :meth:`Engine.take_resolutions`, so that
exporters can clear the alert, and the session counts a wait resolved late.

**Routes.** Most rules cannot fire on most records, and their CEL *guards* (see
:class:`processor.evaluate.cel.Guard`) say so from a few fields: the record's kind,
status, a key's presence. Which rules to run on a record is computed once per record
*shape* (the source, the classes of guarded fields' values, the presence of the keys
guards and group keys test; not the record's other keys) and cached: a
condition whose guard refutes the record is not evaluated, a stateful rule whose
``first`` cannot match skips sessions that hold no state for it. A refuted expression
evaluates to false, never to an error, so routes change no verdict and no error count.
A buffered span keeps the route found at its acceptance for its release (in memory only).

**State** lives in live :class:`~processor.state.session.SessionState` objects that
the engine mutates; a :class:`~processor.state.base.StateStore` is handed the changed
ones at the end of every batch and commits them (see :mod:`processor.state.base`).
"""

from __future__ import annotations

import heapq
import logging
import math
import sys
import time
from bisect import bisect_right, insort
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from hashlib import blake2b as _blake2b
from itertools import repeat
from typing import TYPE_CHECKING, Any, Final, Literal, NamedTuple, Protocol, cast

from xxhash import xxh3_128_digest as _xxh3_128

from processor.errors import EvaluationError
from processor.evaluate.cel import CompiledExpression, references_when
from processor.evaluate.identity import IdentityResolver, IdentityState
from processor.evaluate.kept_digests import equality_only_fields
from processor.evaluate.model import Rule, RuleSet
from processor.records import (
    FIELD_TYPES,
    LABEL_MAX_CHARS,
    NONDETERMINISTIC_KINDS,
    SIDE_EFFECT_KINDS,
    Action,
    Malformed,
    SessionMark,
    bounded_text,
)
from processor.state.base import EngineStateLike, StateStore, TimerEntry
from processor.state.cold import ColdFile
from processor.state.file_ids import FileIds
from processor.state.memory import MemoryStore
from processor.state.session import (
    MISSING,
    NO_GROUP,
    CountState,
    FiredWaits,
    GroupKey,
    Provenance,
    RuleSchema,
    SequenceState,
    SessionState,
    StateKind,
    Wait,
    group_key,
    key_digest,
    prov_identity,
    value_digest,
)
from processor.summary import EngineSummary, OpenWait, SessionEnd, SessionSummary
from processor.violations import Violation, make_violation_id, record_identity

if TYPE_CHECKING:
    from processor.telemetry import Telemetry  # serve's; replay has none (prometheus_client is not loaded)

log = logging.getLogger(__name__)

_NS: Final = 1_000_000_000
# Event times are signed 64-bit nanoseconds (stores, OTLP, JSON readers); a deadline
# past either bound below means "never" in practice and must not overflow them.
_LATEST_NS: Final = 2**63 - 1
_MAX_WAIT_S: Final = 100 * 31_557_600  # a hundred Julian years
_MAX_WAIT_NS: Final = _MAX_WAIT_S * _NS
_NEVER: Final = -(1 << 62)
# Fields kept when an expression reads ``first`` as a whole: the record's known fields
# but not its payload.
_WHOLE_FIRST_FIELDS: Final = tuple(sorted(f for f in FIELD_TYPES if f != "result"))
_EMPTY: Final[Mapping[str, Any]] = {}
# Telemetry labels come from records; they are bounded so a stray value cannot explode cardinality.
_KNOWN_KINDS: Final = frozenset(NONDETERMINISTIC_KINDS | SIDE_EFFECT_KINDS | {"tool_call", "approval", "checkpoint"})
_MAX_SERVICE_LABELS: Final = 200
_EVICTION_LOG_INTERVAL_S: Final = 60.0
_KEPT_CACHE_MAX: Final = 50_000
# Kept-field tuples shared at once (see Engine._kept).
_KEPT_TUPLES_MAX: Final = 8192
_VIEWS_MAX: Final = 1024
_SHAREABLE_TYPES: Final = frozenset({str, type(None), type(MISSING)})
_SHAREABLE_DIGESTED: Final = _SHAREABLE_TYPES | {bytes}
_EXPIRY_BUCKETS: Final = 1024


@dataclass(frozen=True)
class EngineOptions:
    strict: bool = False
    allowed_lateness_s: float = 5.0
    # Sessions live for weeks: days, not minutes.
    session_idle_timeout_s: float = 7 * 86400
    # Bound on open sessions; the least recently active is evicted beyond it.
    max_sessions: int = 100_000
    mode: Literal["replay", "serve"] = "replay"
    # Bound on one session's records in the reordering buffer.
    max_buffered_per_session: int = 10_000
    # Bound on one stateful rule's groups within one session (oldest dropped first).
    max_groups_per_rule: int = 10_000
    # Bound on the delivery keys remembered per session for duplicate detection.
    max_seen_per_session: int = 10_000
    # Summaries of ended (expired, evicted) sessions kept for summary() in replay, whose report
    # lists every session; serve keeps none (it reports through telemetry).
    max_ended_sessions: int = 100_000
    # Absence waits that fired and may still be resolved later, per session (oldest forgotten first).
    max_fired_waits_per_session: int = 32
    # Bound on groups and delivery keys across all sessions: past it the least recently active
    # sessions forget their oldest, down to 95% of it (see Engine._trim_entries).
    max_remembered_entries: int = 2_000_000
    # A session idle this long (on the clock idle expiry reads) holds the groups of its
    # plain-valued rules packed (SessionState.pack), about a seventh of their memory; None: never.
    pack_idle_after_s: float | None = 60.0
    # Records between two looks for sessions to pack (at least the number of open sessions);
    # a look is also due once the clock has moved on by pack_idle_after_s.
    pack_every_records: int = 16_384
    # A session whose records carry no event time (an action log without times) has no idle
    # clock: it counts as idle once this many other sessions have had records since its last,
    # or sooner, once it and those sessions hold this many entries unpacked (long sessions each
    # bring back all their groups when they have a line again).
    pack_untimed_after_sessions: int = 1024
    pack_untimed_after_entries: int = 32_768

    def __post_init__(self) -> None:
        problems = []
        if self.mode not in ("replay", "serve"):
            problems.append("mode must be replay or serve")
        if not self.allowed_lateness_s >= 0:
            problems.append("allowed_lateness_s must be >= 0")
        if not self.session_idle_timeout_s > 0:
            problems.append("session_idle_timeout_s must be > 0")
        for name in (
            "max_sessions",
            "max_buffered_per_session",
            "max_groups_per_rule",
            "max_seen_per_session",
            "max_remembered_entries",
        ):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1")
        if self.pack_idle_after_s is not None and not self.pack_idle_after_s >= 0:
            problems.append("pack_idle_after_s must be >= 0")
        if self.pack_every_records < 1:
            problems.append("pack_every_records must be >= 1")
        for name in ("pack_untimed_after_sessions", "pack_untimed_after_entries"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0")
        for name in ("max_ended_sessions", "max_fired_waits_per_session"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0")
        if problems:
            raise ValueError("invalid engine options: " + "; ".join(problems))


# ---------------------------------------------------------------------------
# Compiled rule plans


class _Plan:
    """A rule prepared for the hot path: its attributes flattened, durations in ns."""

    __slots__ = (
        "compact",
        "condition",
        "condition_fn",
        "deadline",
        "digest_at",
        "field",
        "file_reads",
        "file_scope",
        "first",
        "first_fn",
        "first_names",
        "group_by",
        "group_fn",
        "id",
        "index",
        "keep_latest",
        "kind",
        "name",
        "needs_prov",
        "read_file_kept",
        "read_kept",
        "report_first",
        "rule",
        "severity",
        "tags",
        "then",
        "then_fn",
        "threshold",
        "views",
        "window_ns",
        "within_actions",
        "within_ns",
    )

    def __init__(self, rule: Rule, index: int) -> None:
        self.rule = rule
        self.index = index
        self.id = rule.id
        self.name = rule.name
        self.severity = rule.severity
        self.tags = rule.tags
        self.kind = rule.type
        self.condition = rule.condition
        # The compiled closures themselves: one call less than CompiledExpression.predicate.
        self.condition_fn = None if rule.condition is None else rule.condition.evaluate
        self.group_by = rule.group_by
        self.group_fn = rule.group_by[0].evaluate if len(rule.group_by) == 1 else None

        self.first = rule.first
        self.then = rule.then
        self.first_fn = None if rule.first is None else rule.first.evaluate
        # Kept-field tuples -> their ``first`` map (see Engine._first_view).
        self.views: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}
        self.then_fn = None if rule.then is None else rule.then.evaluate
        self.keep_latest = rule.keep == "latest"
        self.report_first = rule.report_on == "first"
        self.within_ns = None if rule.within_s is None else _wait_span_ns(rule.within_s)
        self.deadline = rule.deadline
        self.within_actions = rule.within_actions
        self.field = rule.field
        self.threshold = rule.threshold
        self.window_ns = None if rule.window_s is None else round(rule.window_s * _NS)
        kept = set(rule.first_fields)
        if rule.type == "absence":
            # An absence fires when the waiting record is long gone: its message reads the
            # kept fields as ``record`` too, so keep what the message reads of ``record``.
            # A payload (``result``) is never kept for a message.
            for part in rule.message.parts:
                if not isinstance(part, str):
                    kept.update(f for v, f in part.references if v == "record" and f and f != "result")
        if "*" in kept:
            self.first_names: tuple[str, ...] = _WHOLE_FIRST_FIELDS
        else:
            self.first_names = tuple(sorted(kept))
        self.read_kept = _kept_reader(self.first_names)
        # A violation may later be reported on the opening record, long after it is gone.
        self.needs_prov = rule.type == "absence" or (rule.type == "sequence" and self.report_first)
        self.compact = rule.type == "sequence" and self.within_ns is None and not self.report_first
        # Kept fields that ``then`` only tests or compares for equality, and nothing renders:
        # long strings there are kept as 8-byte digests (see processor.evaluate.kept_digests).
        digestible: frozenset[str] = frozenset()
        if rule.then is not None and rule.type in ("sequence", "absence") and "*" not in kept:
            # A fired absence renders its kept fields as ``record`` too.
            views = ("first", "record") if rule.type == "absence" else ("first",)
            rendered = {
                f for part in rule.message.parts if not isinstance(part, str) for v, f in part.references if v in views
            }
            if "*" not in rendered:
                digestible = equality_only_fields(rule.then.source) - rendered - _ENUMERATED_FIELDS
        self.digest_at = tuple(i for i, name in enumerate(self.first_names) if name in digestible)
        self.file_scope = rule.log_scope == "file"
        # A file-scope group holds action-log lines alone: a field ``then`` and the message read
        # only on spans is not kept there (DS009 keeps a line's kind, not its input fingerprint),
        # so the tuples it keeps are few and shared.
        self.read_file_kept = self.read_kept
        # The kept fields read there (None: all of them).
        self.file_reads: frozenset[str] | None = None
        if self.file_scope and "*" not in kept:
            read = _first_fields_read_on_logs(rule)
            if read is not None and not set(self.first_names) <= read:
                self.file_reads = read
                self.read_file_kept = _kept_reader(self.first_names, read)


def _first_fields_read_on_logs(rule: Rule) -> frozenset[str] | None:
    """The fields of ``first`` that ``then`` and the message can read on an action-log line; None: all."""
    expressions = [rule.then, *(p for p in rule.message.parts if not isinstance(p, str))]
    read: set[str] = set()
    for expression in expressions:
        if expression is None:
            continue
        if expression.tree is None:
            return None
        references = references_when(expression.tree, expression.constants, _ON_LOGS)
        fields = {f for v, f in references if v == "first"}
        if "*" in fields:
            return None
        read |= fields
    return frozenset(read)


_ON_LOGS: Final = {("meta", "source"): "log"}


def _kept_reader(
    names: tuple[str, ...], only: frozenset[str] | None = None
) -> Callable[[Mapping[str, Any]], tuple[Any, ...]]:
    """``record`` -> the values of ``names`` (MISSING where absent): rules keep one to three fields,
    read here without the iterators a general ``tuple(map(...))`` builds for every opened group.

    With ``only``, a name not in it reads as MISSING whatever the record holds."""
    if only is not None:
        return _some_kept_reader(names, only)
    if len(names) == 1:
        (a,) = names
        return lambda r: (r.get(a, MISSING),)
    if len(names) == 2:
        a, b = names
        return lambda r: (r.get(a, MISSING), r.get(b, MISSING))
    if len(names) == 3:
        a, b, c = names
        return lambda r: (r.get(a, MISSING), r.get(b, MISSING), r.get(c, MISSING))
    return lambda r: tuple(map(r.get, names, repeat(MISSING)))


def _some_kept_reader(names: tuple[str, ...], only: frozenset[str]) -> Callable[[Mapping[str, Any]], tuple[Any, ...]]:
    """``_kept_reader`` where a name not in ``only`` is MISSING: unrolled for two fields, DS009's case."""
    wanted = tuple(name in only for name in names)
    if len(names) == 2:
        a, b = names
        if wanted == (False, True):
            return lambda r: (MISSING, r.get(b, MISSING))
        if wanted == (True, False):
            return lambda r: (r.get(a, MISSING), MISSING)
    pairs = tuple(zip(names, wanted, strict=True))
    return lambda r: tuple([r.get(name, MISSING) if keep else MISSING for name, keep in pairs])


class _Handler(Protocol):
    """Runs one stateful rule type on a record (Engine._sequence, _absence, _change, _count)."""

    def __call__(
        self,
        plan: _Plan,
        action: Action,
        session: SessionState,
        key: GroupKey,
        out: list[Violation],
        *,
        first_possible: bool = True,
        then_possible: bool = True,
    ) -> None: ...


# A stateful rule on a route: (plan, handler, skip_when_empty, first_possible, then_possible,
# key_field: the record field that is the whole group key and is present, else None).
_StatefulStep = tuple[_Plan, _Handler, bool, bool, bool, str | None]


class _Route:
    """The rules a record can fire, given what their guards read of it (see Engine._route).

    ``conditions``: condition rules whose condition is not refuted. ``stateful``: stateful
    rules whose filter is not refuted, each with what its guards tell: whether the rule
    can skip a session that holds no state for it (``first`` refuted and the group key
    certain to evaluate), and whether ``first`` and ``then`` may match at all.
    """

    __slots__ = ("conditions", "stateful")

    def __init__(self, conditions: tuple[_Plan, ...], stateful: tuple[_StatefulStep, ...]) -> None:
        self.conditions = conditions
        self.stateful = stateful


# The entry budget of untimed sessions held unpacked grows to this at most (Engine._grow_untimed_budget).
_UNTIMED_BUDGET_MAX: Final = 1 << 40
# Distinct record shapes (values of guarded fields, keys present) remembered with their route.
_ROUTES_MAX: Final = 4096
# dict.get(classes, value, type(value)): a guarded field's value class, computed in C.
_class_of: Final = cast(Callable[[dict[str, str], Any, type], Any], dict.get)


# ---------------------------------------------------------------------------
# Engine-wide state (what a store persists besides sessions)


class _Buffered(NamedTuple):
    """A span waiting in the reordering buffer.

    A tuple ordered by (time, seq, arrival): the heap compares them in C, and the
    arrival number is unique, so the action itself is never compared.
    ``conditions_done``: the span was counted and its condition rules ran when it was
    accepted; its release runs only the stateful rules. ``route``: the rules found for it
    then (kept in memory only, to spare a second lookup; None after a restore).
    """

    time_ns: int
    seq: int
    arrival: int
    action: Action
    received_ns: int
    conditions_done: bool
    route: _Route | None


def _wait_span_ns(seconds: float) -> int:
    """A wait's length in nanoseconds: negative is none, anything past a hundred years (infinity too) is capped."""
    if seconds <= 0:
        return 0
    if seconds >= _MAX_WAIT_S:
        return _MAX_WAIT_NS
    return round(seconds * _NS)


def _buffered(action: Action, arrival: int, received_ns: int, conditions_done: bool) -> _Buffered:
    return _Buffered(action.time_ns or 0, action.seq, arrival, action, received_ns, conditions_done, None)


def _action_to_plain(action: Action) -> dict[str, Any]:
    return {
        "record": action.record,
        "source": action.source,
        "origin": action.origin,
        "line": action.line,
        "time_ns": action.time_ns,
        "seq": action.seq,
        "delivery_key": None if action.delivery_key is None else list(action.delivery_key),
        "synthetic_action_id": action.synthetic_action_id,
    }


def buffered_rows(items: Iterable[_Buffered]) -> list[tuple[int, list[Any]]]:
    """(arrival, row) of buffered spans as a durable store writes them: one array a span.

    The row is ``EngineState.to_plain``'s entry without its keys, in the order of
    :data:`BUFFER_ROW`: built in one step and dumped without a key per field, it costs a
    third of the entry (measured: 1.5 against 4.1 us a span, 488 against 628 bytes).
    :func:`buffer_row_plain` gives the entry back.
    """
    return [
        (b.arrival, [b.arrival, b.received_ns, b.conditions_done, a.record, a.source, a.origin, a.line, a.time_ns,
                     a.seq, a.delivery_key, a.synthetic_action_id])
        for b in items
        for a in (b.action,)
    ]


# The fields of a buffered span's row (buffered_rows), in order.
BUFFER_ROW: Final = ("arrival", "received_ns", "conditions_done", "record", "source", "origin", "line", "time_ns",
                     "seq", "delivery_key", "synthetic_action_id")


def buffer_row_plain(row: Sequence[Any]) -> dict[str, Any]:
    """The ``EngineState.to_plain`` entry of a buffered span's row (what ``from_plain`` reads)."""
    if len(row) != len(BUFFER_ROW):
        raise ValueError(f"a buffered span's row has {len(row)} fields, not {len(BUFFER_ROW)}")
    arrival, received_ns, conditions_done, record, source, origin, line, time_ns, seq, key, synthetic = row
    return {
        "action": {"record": record, "source": source, "origin": origin, "line": line, "time_ns": time_ns,
                   "seq": seq, "delivery_key": key, "synthetic_action_id": synthetic},
        "arrival": arrival,
        "received_ns": received_ns,
        "conditions_done": conditions_done,
    }


def _action_from_plain(plain: Mapping[str, Any]) -> Action:
    key = plain.get("delivery_key")
    return Action(
        record=dict(plain["record"]),
        source=plain["source"],
        origin=plain.get("origin", ""),
        line=plain.get("line"),
        time_ns=plain.get("time_ns"),
        seq=int(plain.get("seq", 0)),
        delivery_key=None if key is None else (str(key[0]), str(key[1]), int(key[2])),
        synthetic_action_id=bool(plain.get("synthetic_action_id", False)),
    )


_COUNTERS: Final = (
    "actions_seen",
    "actions_evaluated",
    "duplicates",
    "late",
    "malformed",
    "sessions_expired",
    "sessions_evicted",
    "groups_dropped",
    "waits_resolved_late",
    "fired_waits_dropped",
    "entries_dropped",
)


class EngineLoad(NamedTuple):
    sessions: int
    actions: int
    # Spans in the reordering window, and (serve) the wall time in ns by which the clock releases them all.
    window_spans: int
    window_release_ns: int | None


class EngineState(EngineStateLike):
    """Watermark, counters and the reordering buffer: the engine-wide part of the state."""

    def __init__(self) -> None:
        self.max_event_ns = _NEVER
        self.watermark_ns = _NEVER
        self.arrivals = 0
        self.counters: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self.violations_by_rule: dict[str, int] = {}
        self.rule_errors: dict[str, int] = {}
        self.buffer: list[_Buffered] = []
        # Serve: (received wall time, event time) of buffered spans in arrival order.
        self.received: deque[tuple[int, int]] = deque()
        # Sessions and tool-call ids resolved across a trace's spans, and the spans held for them.
        self.identity = IdentityState()
        # Buffer changes since a durable store last wrote them (None: nobody asked, nothing kept):
        # spans buffered, and arrival numbers of spans released.
        self.added: list[_Buffered] | None = None
        self.released: list[int] | None = None

    def to_plain(self, *, traces: bool = True) -> dict[str, Any]:
        """Plain data; ``traces=False`` leaves the identity state's traces out (written by change)."""
        return {
            "max_event_ns": self.max_event_ns,
            "watermark_ns": self.watermark_ns,
            "arrivals": self.arrivals,
            "counters": dict(self.counters),
            "violations_by_rule": dict(self.violations_by_rule),
            "rule_errors": dict(self.rule_errors),
            "buffer": [
                {
                    "action": _action_to_plain(b.action),
                    "arrival": b.arrival,
                    "received_ns": b.received_ns,
                    "conditions_done": b.conditions_done,
                }
                for b in sorted(self.buffer)
            ],
            "identity": self.identity.to_plain(traces=traces),
        }

    @classmethod
    def from_plain(cls, plain: Mapping[str, Any]) -> EngineState:
        state = cls()
        state.max_event_ns = int(plain["max_event_ns"])
        state.watermark_ns = int(plain["watermark_ns"])
        state.arrivals = int(plain["arrivals"])
        state.counters.update({k: int(v) for k, v in plain["counters"].items()})
        state.violations_by_rule = {str(k): int(v) for k, v in plain["violations_by_rule"].items()}
        state.rule_errors = {str(k): int(v) for k, v in plain["rule_errors"].items()}
        for entry in plain["buffer"]:
            # State written before conditions ran at acceptance has no such key: those spans
            # were neither counted nor checked yet, so their release does both.
            item = _buffered(
                _action_from_plain(entry["action"]),
                int(entry["arrival"]),
                int(entry["received_ns"]),
                bool(entry.get("conditions_done", False)),
            )
            state.buffer.append(item)
            state.received.append((item.received_ns, item.time_ns))
        heapq.heapify(state.buffer)
        state.identity = IdentityState.from_plain(plain.get("identity"))
        return state


def malformed_violation(plan: _Plan, item: Malformed, message: str) -> Violation:
    """The violation of a ``malformed`` rule on an item that could not become a record."""
    service = item.extra.get("service")
    return Violation(
        rule=plan.id,
        name=plan.name,
        severity=plan.severity,
        session_id=item.session_id,
        action_id=item.action_id,
        message=message,
        violation_id=make_violation_id(plan.id, item.session_id, item.action_id, record_identity(item)),
        time_ns=None,
        line=item.line,
        origin=item.origin,
        trace_id=item.trace_id,
        span_id=item.span_id,
        service=service if isinstance(service, str) else "",
        kind="",
        tags=plan.tags,
    )


def _delivery_digest(key: tuple[str, str, int]) -> bytes:
    # Stable across processes (str hashes are salted) and 64 bits (plain-data safe as an int);
    # kept packed, the form the session stores it in.
    raw = f"{key[0]}\x1f{key[1]}\x1f{key[2]}".encode("utf-8", "surrogatepass")
    return _blake2b(raw, digest_size=8).digest()


def _file_digest(origin: str, action_id: str) -> bytes:
    """A remembered (file, action id) pair as 16 bytes, whatever the length of the id.

    128 bits, not the 64 of a session's group keys: one file may name many millions of ids.
    """
    return _xxh3_128(f"{origin}\x1f{action_id}".encode("utf-8", "surrogatepass"))


# Kept strings at least this long are digested: an 8-byte bytes object is 41 bytes, a str of
# 8 ASCII characters 57.
_DIGEST_MIN_CHARS: Final = 8
# Fields whose values come from a small vocabulary (the conventions enumerate them): kept as
# values, interned, where a digest per group would cost more than the one shared string.
_ENUMERATED_FIELDS: Final = frozenset({"kind", "status", "workflow_state", "approval_decision", "on_failure", "replay"})


# One record's id is the key of several rules' groups and kept by several rules: the digests
# of recent strings are remembered, so that those groups share one digest object (as they
# shared the string) and the digest is computed once. Only strings: 1, 1.0 and True are
# one dict key but not one group key.
_MEMO_MAX: Final = 4096
_key_memo: dict[str, int] = {}
_value_memo: dict[str, bytes] = {}


def _memoized(memo: dict[str, Any], digest: Callable[[str], Any], value: str) -> Any:
    """``digest(value)``, remembered for the next record that repeats the value (bounded)."""
    found = memo.get(value)
    if found is None:
        if len(memo) >= _MEMO_MAX:
            memo.clear()
        found = memo[value] = digest(value)
    return found


def _key_of(value: Any) -> int:
    if type(value) is not str:
        return key_digest(value)
    return cast(int, _memoized(_key_memo, key_digest, value))


def _digest_of(value: str) -> bytes:
    return cast(bytes, _memoized(_value_memo, value_digest, value))


def _digest_kept(kept: tuple[Any, ...], at: tuple[int, ...]) -> tuple[Any, ...]:
    """``kept`` with its long strings at ``at`` replaced by their 8-byte digests.

    A tuple with a digest is its record's own (never shared): its other strings, short ones
    such as a kind, are interned so that every group does not hold a copy of its own.
    """
    values: list[Any] | None = None
    for i in at:
        value = kept[i]
        if type(value) is str and len(value) >= _DIGEST_MIN_CHARS:
            if values is None:
                values = list(kept)
            values[i] = _digest_of(value)
    if values is None:
        return kept
    for i, value in enumerate(values):
        if type(value) is str:
            values[i] = sys.intern(value)
    return tuple(values)


def _undigested_view(plan: _Plan, kept: tuple[Any, ...], record: Mapping[str, Any]) -> dict[str, Any]:
    """``first`` for ``then``: a digest becomes the record's own value when they match, else a
    string equal to no record's value, so equality and presence tests answer as the value would."""
    view = {n: v for n, v in zip(plan.first_names, kept, strict=True) if v is not MISSING}
    for i in plan.digest_at:
        stored = kept[i]
        if type(stored) is not bytes:
            continue
        name = plan.first_names[i]
        current = record.get(name)
        if type(current) is str and _digest_of(current) == stored:
            view[name] = current
        else:
            view[name] = "\x00digest:" + stored.hex()
    return view


def _same_value(a: Any, b: Any) -> bool:
    """CEL-like equality for ``change``: numbers compare as numbers, bool is not a number."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b, strict=True))
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    return bool(a == b)


def _str_field(record: Mapping[str, Any], name: str) -> str:
    value = record.get(name)
    return value if isinstance(value, str) else ""


# ---------------------------------------------------------------------------
# The engine


class Engine:
    """See the module docstring. Single-threaded: one caller drives submit/tick/finish."""

    def __init__(
        self,
        ruleset: RuleSet,
        options: EngineOptions = EngineOptions(),
        store: StateStore | None = None,
        telemetry: Telemetry | None = None,
        *,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self.options = options
        self._serve = options.mode == "serve"
        self._lateness_ns = round(options.allowed_lateness_s * _NS)
        self._idle_ns = round(options.session_idle_timeout_s * _NS)
        self._pack_idle_ns = None if options.pack_idle_after_s is None else round(options.pack_idle_after_s * _NS)
        # actions_seen and the clock at the last look for sessions to pack: a look is due after
        # enough records, or once the clock moved on by the idle time (a quiet serve's ticks).
        self._packed_at = 0
        self._packed_clock = 0
        # Sessions packed and their packed bytes, as the last packing pass found them.
        self._packed_count = (0, 0)
        # The entry budget of untimed sessions held unpacked (see _untimed_recent_from), and the
        # sessions packed for it alone that have not come back since: if many do, it is too small.
        self._untimed_budget = options.pack_untimed_after_entries
        self._packed_for_budget: list[SessionState] = []
        # Replay moves packed groups out of memory into a temporary file (made at the first pack);
        # serve keeps them: its sessions' groups are in its state store already.
        self._cold = None if self._serve else ColdFile()
        self._clock = clock
        self._telemetry = telemetry
        self.ruleset = ruleset  # as loaded, for readers such as the operator view (each rule's fix)
        self._lists = ruleset.lists

        active = ruleset.active(strict=options.strict)
        self._condition_plans = [_Plan(r, -1) for r in active if r.type == "condition" and r.condition is not None]
        self._malformed_plans = [_Plan(r, -1) for r in active if r.type == "malformed"]
        stateful = [r for r in active if r.stateful]
        self._stateful_plans = [_Plan(r, i) for i, r in enumerate(stateful)]
        self._plan_by_id = {p.id: p for p in self._stateful_plans}
        self._absence_indices = tuple(p.index for p in self._stateful_plans if p.kind == "absence")
        handlers: dict[str, _Handler] = {
            "sequence": self._sequence,
            "absence": self._absence,
            "change": self._change,
            "count": self._count,
        }
        # Each stateful rule with the method that runs its type.
        self._stateful_runs = [(plan, handlers[plan.kind]) for plan in self._stateful_plans]
        # Which rules may fire on a record depends only on what their guards read of it: the
        # values of a few fields, the keys present and the source. Records of one shape share
        # a route, computed once (see _route).
        literals: dict[str, set[str]] = {}
        present: set[str] = set()
        for plan in [*self._condition_plans, *self._stateful_plans]:
            for expression in (plan.condition, plan.first, plan.then):
                guard = None if expression is None else expression.guard
                if guard is not None:
                    for (variable, name), strings in guard.values.items():
                        if variable == "record":
                            literals.setdefault(name, set()).update(strings)
                    present.update(name for variable, name in guard.presence if variable == "record")
            # A route skips a group key only when the key's field is present (see _route).
            present.update(e.path[1] for e in plan.group_by if e.path is not None and e.path[0] == "record")
        self._guarded_fields = tuple(sorted(literals))
        # The only keys whose presence a route depends on: a record's other keys (a payload, a
        # model name) and their order do not make a shape of their own.
        self._presence_fields = tuple(sorted(present))
        # A guarded field's value enters a record's shape as its class: one of the literals it is
        # compared with, or else its type (any other string is ``str``). An id or a key compared
        # with a literal must not make every record a shape of its own.
        self._value_classes = tuple({s: s for s in literals[name]} for name in self._guarded_fields)
        self._routes: dict[tuple[Any, ...], _Route] = {}
        # The presence part of a shape by the record's keys in their order (a log's lines of one
        # kind repeat theirs): one lookup instead of a test per presence field. Each distinct
        # presence gets a small number (at most 2 ** len(presence fields) of them exist).
        self._presence_by_keys: dict[tuple[str, ...], int] = {}
        self._presence_ids: dict[tuple[bool, ...], int] = {}
        # ``log_scope: file`` rules on action-log lines: per rule, the groups of the whole input
        # file across its sessions, keyed by a fixed-size digest of (file, action id). Replay
        # only reads logs; this state is not the store's (a span never touches it).
        self._file_plans = tuple(p for p in self._stateful_plans if p.file_scope)
        self._file_groups: dict[int, FileIds] = {p.index: FileIds() for p in self._file_plans}
        self._no_kept: dict[int, tuple[Any, ...]] = {p.index: (MISSING,) * len(p.first_names) for p in self._file_plans}
        kinds = [cast(StateKind, p.kind) for p in self._stateful_plans]
        self.schema = RuleSchema(
            rule_ids=tuple(p.id for p in self._stateful_plans),
            kinds=tuple(kinds),
            first_names=tuple(p.first_names for p in self._stateful_plans),
            compact=tuple(p.compact for p in self._stateful_plans),
        )
        self._width = len(self._stateful_plans)
        self._max_seen = options.max_seen_per_session
        self._max_groups = options.max_groups_per_rule
        # Kept-field tuples and per-session kind counts repeat across sessions: share one copy.
        self._kept_cache: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        # The last kept tuple holding a digest (see _kept).
        self._last_digested: tuple[Any, ...] = ()
        self._kinds_cache: dict[Any, tuple[str | int, ...]] = {}
        # (id of a shared counts tuple, kind) -> the shared tuple after counting one more of kind.
        # Only shared tuples are keys, and the cache keeps them alive: an id cannot be reused.
        self._kinds_steps: dict[tuple[int, str], tuple[str | int, ...]] = {}

        # One activation and one meta dict, refilled for every record: evaluation never keeps them.
        self._meta: dict[str, Any] = {"source": "log", "synthetic_action_id": False, "line": 0, "time_ns": 0}
        self._act: dict[str, Any] = {"record": _EMPTY, "meta": self._meta, "lists": self._lists, "first": _EMPTY}

        self._store: StateStore = store if store is not None else MemoryStore()
        self._sessions: OrderedDict[str, SessionState] = OrderedDict()
        self._dirty: set[str] = set()
        self._deleted: set[str] = set()
        # Idle expiry in buckets of 1/1024 of the timeout (a session ends at most that late): a
        # session id sits in one bucket at most once, and is checked when its bucket has passed.
        # A list slot per session instead of a heap entry per session.
        self._expiry_width = max(1, self._idle_ns // _EXPIRY_BUCKETS)
        self._expiry_buckets: dict[int, list[str]] = {}
        self._expiry_keys: list[int] = []
        self._ended: deque[SessionSummary] = deque()
        self._ended_dropped = 0
        self._now_ns = 0
        # Serve: the wall time the record being evaluated arrived (None: it arrives now).
        self._received_ns: int | None = None
        self._wall_release_ns = _NEVER
        self._logged_errors: set[str] = set()
        self._last_eviction_log = 0.0
        self._evictions_unlogged = 0
        # Groups and delivery keys of all sessions, as last counted (see _count_entries).
        self._entries_total = 0
        self._last_trim_log = 0.0
        self._trimmed_unlogged = 0
        self._tm_entries_dropped: dict[str, int] = {}
        # Telemetry accumulated over a batch, flushed once per batch.
        self._tm_actions: dict[tuple[str, str, str], int] = {}
        self._tm_violations: dict[tuple[str, str, str], int] = {}
        self._tm_duplicates = 0
        self._tm_late = 0
        self._tm_evicted = 0
        self._tm_rule_errors: dict[str, int] = {}
        self._services: set[str] = set()
        # Violation ids of fired waits resolved since the last take_resolutions().
        self._resolutions: list[str] = []
        # The identity stage's output (actions with their sessions and call ids resolved), kept for
        # take_admitted() while a reader wants it: the operator view and the action exporters.
        self.keep_admitted = False
        self._admitted: list[Action] = []

        self._state = self._restore()
        self._identity = IdentityResolver(self._state.identity, self._lateness_ns)

    # -- restore ----------------------------------------------------------------

    def _restore(self) -> EngineState:
        loaded = self._store.load_engine()
        if isinstance(loaded, EngineState):
            state = loaded
            # Routes found by the engine that buffered these spans hold its rules, not this one's.
            state.buffer = [item._replace(route=None) for item in state.buffer]
        elif isinstance(loaded, dict):
            state = EngineState.from_plain(loaded)
        else:
            state = EngineState()
        for session in self._store.load_sessions(self.schema):
            self._sessions[session.session_id] = session
            session.buffered = 0
            session.entries = session.entry_count()
            self._entries_total += session.entries
            if session.activity_ns is not None:
                self._schedule_expiry(session.activity_ns + self._idle_ns, session.session_id)
        for item in state.buffer:
            holder = self._sessions.get(item.action.session_id)
            if holder is not None:
                holder.buffered += 1
        not_restored = self._store.sessions_not_restored()
        if not_restored and self._telemetry is not None:
            self._telemetry.sessions_not_restored.inc(not_restored)
        return state

    # -- public API ---------------------------------------------------------------

    @property
    def actions_seen(self) -> int:
        return self._state.counters["actions_seen"]

    @property
    def duplicates(self) -> int:
        return self._state.counters["duplicates"]

    @property
    def late(self) -> int:
        return self._state.counters["late"]

    @property
    def watermark_ns(self) -> int | None:
        wm = self._state.watermark_ns
        return None if wm == _NEVER else wm

    def take_admitted(self) -> list[Action]:
        """Actions the identity stage passed on since the last call (``keep_admitted`` on), in order.

        These are the records the rules evaluate: sessions and tool-call ids named elsewhere in
        the trace already filled in, whatever the reordering window then holds back.
        """
        taken = self._admitted
        self._admitted = []
        return taken

    def take_resolutions(self) -> list[str]:
        """Violation ids resolved since the last call (a fired wait that finally resolved), oldest first."""
        taken = self._resolutions
        self._resolutions = []
        return taken

    def submit(self, item: Action | Malformed) -> list[Violation]:
        """One item; returns the violations that became final (buffered spans may wait for the watermark)."""
        return self.submit_many((item,))

    def submit_many(self, items: Iterable[Action | Malformed | SessionMark]) -> list[Violation]:
        """The same as ``submit`` for each item, in order, with the batch work (commit, telemetry) done once."""
        out: list[Violation] = []
        if self._serve:
            self._now_ns = max(self._now_ns, self._clock())
        # Sessions and tool-call ids named elsewhere in the trace first (processor.evaluate.identity).
        keep = self.keep_admitted
        for item in self._identity.admit(items, self._now_ns):
            if isinstance(item, Action):
                if keep:
                    self._admitted.append(item)
                self._submit_action(item, out)
            else:
                self._submit_malformed(item, out)
        self._end_batch()
        return out

    def tick(self, now_ns: int) -> list[Violation]:
        """Serve's clock: release spans buffered for the allowed lateness, fire due timers, expire idle sessions.

        In replay time is the input's own; a tick only commits.
        """
        out: list[Violation] = []
        if self._serve:
            self._now_ns = max(self._now_ns, now_ns)
            for action in self._identity.release_due(self._now_ns):
                if self.keep_admitted:
                    self._admitted.append(action)
                self._submit_action(action, out)
            self._advance_wall(out)
        self._end_batch()
        return out

    def finish(self) -> list[Violation]:
        """End of input: release every buffered span in order, then fire what is due.

        Replay: deadlines not after the last event time fire; later ones stay open waits.
        Serve: the clock rule of ``tick`` applies at the latest time seen.
        """
        out: list[Violation] = []
        state = self._state
        if self._serve:
            self._now_ns = max(self._now_ns, self._clock())
        for action in self._identity.release_all():
            if self.keep_admitted:
                self._admitted.append(action)
            self._submit_action(action, out)
        while state.buffer:
            self._release_one(out)
        state.received.clear()
        if self._serve:
            self._advance_wall(out)
        else:
            state.watermark_ns = max(state.watermark_ns, state.max_event_ns)
            self._fire_due(state.max_event_ns, out)
        self._end_batch()
        return out

    # -- submission -----------------------------------------------------------------

    def _submit_action(self, action: Action, out: list[Violation]) -> None:
        state = self._state
        counters = state.counters
        counters["actions_seen"] += 1
        session_id = action.record.get("session_id", "")
        if type(session_id) is not str:
            session_id = str(session_id)
        sessions = self._sessions
        session = sessions.get(session_id)
        if session is None:
            session = self._session(session_id)
        else:
            if session.packed is not None:
                session.unpack()
            sessions.move_to_end(session_id)
            self._dirty.add(session_id)
        key = action.delivery_key
        if key is not None and session.check_seen_packed(_delivery_digest(key), self._max_seen):
            counters["duplicates"] += 1
            if action.source == "span":
                self._tm_duplicates += 1
            return
        t = action.time_ns
        if self._serve:
            self._note_activity(session, t)
        elif t is not None:
            activity = session.activity_ns
            if activity is None:
                self._schedule_expiry(t + self._idle_ns, session_id)
                session.activity_ns = t
            elif t > activity:
                session.activity_ns = t
        if t is None or action.source != "span":
            # Log lines are in the order the agent wrote them; an untimed span has no order to restore.
            if t is not None:
                self._observe_time(t, out)
            self._evaluate(action, session, out)
            return
        if t < state.watermark_ns:
            counters["late"] += 1
            self._tm_late += 1
            self._evaluate(action, session, out)
            return
        # Condition rules read the record alone: they run now, not when the buffer releases the
        # span (up to allowed_lateness later). Only the stateful rules need event-time order.
        route = self._accept(action, session, out)
        state.arrivals += 1
        # tuple.__new__ skips the Python-level __new__ of a NamedTuple: this runs for every span.
        item = tuple.__new__(_Buffered, (t, action.seq, state.arrivals, action, self._now_ns, True, route))
        heapq.heappush(state.buffer, item)
        if state.added is not None:
            state.added.append(item)
        if self._serve:
            state.received.append((self._now_ns, t))
        session.buffered += 1
        if t > state.max_event_ns:
            self._observe_time(t, out)
        limit = self.options.max_buffered_per_session
        while session.buffered > limit and state.buffer:
            # The bound forces the watermark forward: the oldest buffered span goes first.
            released = self._release_one(out)
            state.watermark_ns = max(state.watermark_ns, released)

    def log_session(self, session_id: str) -> bool:
        """The action-log lane: look ``session_id`` up as a record or a malformed line of it does
        (the least recently active sessions are trimmed first). False, with nothing done, when
        opening it would evict another session: the lane does not model eviction."""
        sessions = self._sessions
        session = sessions.get(session_id)
        if session is None:
            if len(sessions) >= self.options.max_sessions:
                return False
            self._session(session_id)
            return True
        if session.packed is not None:
            session.unpack()
        sessions.move_to_end(session_id)
        self._dirty.add(session_id)
        return True

    def log_session_rules(self, action: Action, out: list[Violation]) -> None:
        """The action-log lane: the session rules on an action-log line, in input order.

        The lane has counted the line, run its condition and file rules, and looked its session
        up (``log_session``); this is the rest of ``_submit_action`` for a log line: the clock
        (deadlines the watermark passed fire, in every session) and the session rules, by the
        same handlers. Idle expiry is not scheduled: the lane gives way before event times
        span the idle timeout, so no session could expire.
        """
        self._state.counters["actions_seen"] += 1
        session = self._sessions[action.record["session_id"]]
        t = action.time_ns
        if t is not None:
            activity = session.activity_ns
            if activity is None or t > activity:
                session.activity_ns = t  # what packing measures idleness by
            self._observe_time(t, out)
        self._evaluate(action, session, out, accepted=True, files=False)

    def end_log_batch(self) -> None:
        """The action-log lane: what the end of a batch of lines does (packing, the remembered-entries bound)."""
        self._end_batch()

    def _note_activity(self, session: SessionState, t: int | None) -> None:
        """What idle expiry measures: arrivals on the clock in serve, the latest event time in replay."""
        if self._serve:
            now = self._now_ns
            if session.activity_ns is None:
                self._schedule_expiry(now + self._idle_ns, session.session_id)
            session.activity_ns = now
        elif t is not None and (session.activity_ns is None or t > session.activity_ns):
            if session.activity_ns is None:
                self._schedule_expiry(t + self._idle_ns, session.session_id)
            session.activity_ns = t

    def _observe_time(self, t: int, out: list[Violation]) -> None:
        state = self._state
        if t > state.max_event_ns:
            state.max_event_ns = t
            candidate = t - self._lateness_ns
            if candidate > state.watermark_ns:
                state.watermark_ns = candidate
                self._advance(out)

    def _submit_malformed(self, item: Malformed, out: list[Violation]) -> None:
        self._state.counters["malformed"] += 1
        if item.action_id and item.source == "log":
            # The skill's checker counts an id even on a line it rejects for another field: a later
            # line with the same id repeats it. This line itself is DS000 alone.
            for plan in self._file_plans:
                groups = self._file_groups[plan.index]
                groups.setdefault(_file_digest(item.origin, item.action_id), self._no_kept[plan.index])
        session = self._session(item.session_id) if item.session_id else None
        if session is not None:
            self._note_activity(session, None)
        if not self._malformed_plans:
            return
        act = {
            "meta": {"source": item.source, "line": item.line or 0, "problem": item.message},
            "lists": self._lists,
        }
        for plan in self._malformed_plans:
            self._emit(malformed_violation(plan, item, plan.rule.message.render(act)), session, out)

    # -- ordering ---------------------------------------------------------------------

    def _advance(self, out: list[Violation]) -> None:
        """The watermark moved: release what it passed, fire timers behind it (replay), expire idle sessions."""
        state = self._state
        wm = state.watermark_ns
        buffer = state.buffer
        while buffer and buffer[0][0] <= wm:
            self._release_one(out)
        if not self._serve:
            # A deadline fires once the watermark is past it: a resolution at the deadline still counts.
            self._fire_due(wm - 1, out)
            self._expire(wm)

    def _advance_wall(self, out: list[Violation]) -> None:
        """Serve: what the clock releases and fires."""
        state = self._state
        now = self._now_ns
        received = state.received
        horizon = now - self._lateness_ns
        while received and received[0][0] <= horizon:
            _, t = received.popleft()
            self._wall_release_ns = max(self._wall_release_ns, t)
        state.watermark_ns = max(state.watermark_ns, self._wall_release_ns)
        buffer = state.buffer
        wm = state.watermark_ns
        while buffer and buffer[0][0] <= wm:
            self._release_one(out)
        self._fire_due(now, out)
        self._expire(now)

    def _release_one(self, out: list[Violation]) -> int:
        return self._release_item(heapq.heappop(self._state.buffer), out)

    def _release_item(self, item: _Buffered, out: list[Violation]) -> int:
        if self._state.released is not None:
            self._state.released.append(item.arrival)
        action = item.action
        session_id = action.session_id
        found = self._sessions.get(session_id)
        if found is None:
            # Its session was evicted while the span waited: it starts again.
            session = self._session(session_id)
            self._note_activity(session, action.time_ns)
        else:
            session = found
            if session.packed is not None:
                session.unpack()
            if session.buffered > 0:
                session.buffered -= 1
            self._sessions.move_to_end(session_id)
            self._dirty.add(session_id)
        self._received_ns = item.received_ns
        self._evaluate(action, session, out, accepted=item.conditions_done, route=item.route)
        self._received_ns = None
        return item.time_ns

    # -- sessions -----------------------------------------------------------------------

    def _session(self, session_id: str) -> SessionState:
        sessions = self._sessions
        session = sessions.get(session_id)
        if session is None:
            if len(sessions) >= self.options.max_sessions:
                self._evict_one()
            session = sessions[session_id] = SessionState(session_id)
            self._deleted.discard(session_id)
        else:
            if session.packed is not None:
                session.unpack()
            sessions.move_to_end(session_id)
        self._dirty.add(session_id)
        return session

    def _evict_one(self) -> None:
        _, victim = next(iter(self._sessions.items()))
        self._state.counters["sessions_evicted"] += 1
        self._tm_evicted += 1
        self._evictions_unlogged += 1
        self._end_session(victim, "evicted")
        now = time.monotonic()
        if now - self._last_eviction_log >= _EVICTION_LOG_INTERVAL_S:
            log.warning(
                "open-session bound (max_sessions=%d) reached: evicted %d least recently active session(s)"
                " and their state",
                self.options.max_sessions,
                self._evictions_unlogged,
            )
            self._last_eviction_log = now
            self._evictions_unlogged = 0

    def _schedule_expiry(self, due_ns: int, session_id: str) -> None:
        bucket = due_ns // self._expiry_width
        members = self._expiry_buckets.get(bucket)
        if members is None:
            self._expiry_buckets[bucket] = [session_id]
            heapq.heappush(self._expiry_keys, bucket)
        else:
            members.append(session_id)

    def _expire(self, clock_ns: int) -> None:
        keys = self._expiry_keys
        width = self._expiry_width
        sessions = self._sessions
        # A bucket is checked once every due time in it has passed.
        while keys and (keys[0] + 1) * width - 1 <= clock_ns:
            for session_id in self._expiry_buckets.pop(heapq.heappop(keys)):
                session = sessions.get(session_id)
                if session is None or session.activity_ns is None:
                    continue
                due = session.activity_ns + self._idle_ns
                pending = [w.fire_at for _, _, w in session.waits(self._absence_indices) if w.fire_at is not None]
                if pending:
                    due = max(due, max(pending) + 1)
                if session.buffered:
                    due = max(due, clock_ns + 1)
                if due > clock_ns:
                    self._schedule_expiry(due, session_id)
                    continue
                self._state.counters["sessions_expired"] += 1
                self._end_session(session, "expired")

    def _end_session(self, session: SessionState, end: SessionEnd) -> None:
        waits = session.waits(self._absence_indices)
        for index, key, wait in waits:
            self._forget_wait(session, self._stateful_plans[index], key, wait)
        if self.options.max_ended_sessions > 0 and not self._serve:
            self._ended.append(self._session_summary(session, end, waits))
            if len(self._ended) > self.options.max_ended_sessions:
                self._ended.popleft()
                self._ended_dropped += 1
        else:
            self._ended_dropped += 1
        del self._sessions[session.session_id]
        self._entries_total -= session.entries
        self._dirty.discard(session.session_id)
        self._deleted.add(session.session_id)

    # -- evaluation -------------------------------------------------------------------

    def _evaluate(
        self,
        action: Action,
        session: SessionState,
        out: list[Violation],
        *,
        accepted: bool = False,
        route: _Route | None = None,
        files: bool = True,
    ) -> None:
        """Run the rules on a record in its event-time turn; ``accepted``: counted and conditions run already;
        ``files``: run the file-scope rules too (the action-log lane runs its own)."""
        t = action.time_ns
        next_deadline = session.next_deadline_ns
        if next_deadline is not None and t is not None and next_deadline < t:
            self._fire_session_deadlines(session, t, out)
        record = action.record
        if not accepted:
            self._count_record(session, record)
        route = self._prepare(action, route)
        if not accepted:
            self._run_conditions(route, action, session, out)
        act = self._act
        for plan, handler, skip_when_empty, first_possible, then_possible, key_field in route.stateful:
            condition = plan.condition_fn
            if condition is not None:
                try:
                    if condition(act) is not True:
                        continue
                except EvaluationError:
                    self._rule_error(plan, "condition")
                    continue
            if plan.file_scope and action.source == "log":
                if files:
                    self._file_sequence(
                        plan, action, session, out, first_possible=first_possible, then_possible=then_possible
                    )
                continue
            if skip_when_empty:
                rules = session.rules
                if rules is None or rules[plan.index] is None:
                    fired = session.fired
                    if fired is None or plan.index not in fired.rules:
                        continue  # nothing to resolve or extend, and this record opens nothing
            if key_field is not None:
                # ``record.<field>`` of a field the route knows is present: the value is the key.
                key = _key_of(record[key_field])
                handler(plan, action, session, key, out, first_possible=first_possible, then_possible=then_possible)
                continue
            single = plan.group_fn
            try:
                if single is not None:
                    key = _key_of(single(act))
                elif plan.group_by:
                    key = group_key([e.evaluate(act) for e in plan.group_by])
                else:
                    key = NO_GROUP
            except EvaluationError:
                self._rule_error(plan, "group_by")
                continue
            handler(plan, action, session, key, out, first_possible=first_possible, then_possible=then_possible)
        act["record"] = _EMPTY
        act["first"] = _EMPTY

    def _accept(self, action: Action, session: SessionState, out: list[Violation]) -> _Route:
        """What a buffered span gets at once, whatever its order: counted once, and its condition rules run."""
        self._count_record(session, action.record)
        route = self._prepare(action)
        if route.conditions:
            self._run_conditions(route, action, session, out)
        self._act["record"] = _EMPTY
        return route

    def _count_record(self, session: SessionState, record: Mapping[str, Any]) -> None:
        self._state.counters["actions_evaluated"] += 1
        kind = record.get("kind")
        if type(kind) is not str:
            kind = ""
        kinds = session.kinds
        if type(kinds) is dict:  # the common case in replay, inline: this runs for every record
            kinds[kind] = kinds.get(kind, 0) + 1
        else:
            self._count_kind(session, kind)
        if self._telemetry is not None:
            label = (
                kind if kind in _KNOWN_KINDS else "other",
                _label_status(record.get("status")),
                self._service_label(record.get("service")),
            )
            self._tm_actions[label] = self._tm_actions.get(label, 0) + 1

    def _prepare(self, action: Action, route: _Route | None = None) -> _Route:
        """Fill the shared activation with the record, and find the rules it can fire (unless ``route`` is known)."""
        record = action.record
        source = action.source
        t = action.time_ns
        meta = self._meta
        meta["source"] = source
        meta["synthetic_action_id"] = action.synthetic_action_id
        meta["line"] = action.line or 0
        meta["time_ns"] = t or 0
        act = self._act
        act["record"] = record
        act["first"] = _EMPTY
        if route is not None:
            return route
        values = list(map(record.get, self._guarded_fields))
        keys = tuple(record)
        presence = self._presence_by_keys.get(keys)
        if presence is None:
            presence = self._presence_of(record, keys)
        try:
            shape = (source, presence, *map(_class_of, self._value_classes, values, map(type, values)))
            return self._routes[shape]
        except KeyError:
            return self._new_route(shape, record)
        except TypeError:  # an unhashable value in a guarded field: this record gets its own route
            return self._route(record)

    def _run_conditions(self, route: _Route, action: Action, session: SessionState, out: list[Violation]) -> None:
        act = self._act
        for plan in route.conditions:
            try:
                hit = plan.condition_fn(act)  # type: ignore[misc]  # condition plans have one
            except EvaluationError:
                self._rule_error(plan, "condition")
                continue
            if hit is True:
                self._emit(self._violation(plan, action, act, session), session, out)

    def _count_kind(self, session: SessionState, kind: str) -> None:
        """Count one action of ``kind`` in a session whose counts are still a tuple (``_count_record``
        counts in a dict itself); many sessions hold the same small counts, so share the tuples.

        Replay counts in a dict per session from the first action: its sessions live for one run,
        and sharing costs more CPU per record than the dicts' memory is worth there. serve keeps
        idle sessions for days, and shares until a session is busy (SessionState.count_kind).
        """
        kinds = session.kinds
        if not self._serve:
            own = session.kinds = session.kinds_dict()
            own[kind] = own.get(kind, 0) + 1
            return
        step = (id(kinds), kind)
        shared = self._kinds_steps.get(step)
        if shared is not None:
            session.kinds = shared
            return
        cache = self._kinds_cache
        counts = session.count_kind(sys.intern(kind))
        if counts is None:
            return
        shared = cache.get(counts)
        if shared is None:
            if len(cache) >= _KEPT_CACHE_MAX:
                return
            shared = cache[counts] = counts
        session.kinds = shared
        if type(kinds) is tuple and cache.get(kinds) is kinds and len(self._kinds_steps) < _KEPT_CACHE_MAX:
            self._kinds_steps[step] = shared

    def _presence_of(self, record: Mapping[str, Any], keys: tuple[str, ...]) -> int:
        """The number of the presence fields ``record`` has; remembered for its keys (bounded: a
        log whose every line orders its keys anew pays this test per record, as before)."""
        presence = tuple(map(record.__contains__, self._presence_fields))
        ids = self._presence_ids
        number = ids.get(presence)
        if number is None:
            number = ids[presence] = len(ids)
        if len(self._presence_by_keys) < _ROUTES_MAX:
            self._presence_by_keys[keys] = number
        return number

    def _new_route(self, shape: tuple[Any, ...], record: Mapping[str, Any]) -> _Route:
        routes = self._routes
        if len(routes) >= _ROUTES_MAX:
            routes.clear()  # shapes beyond the bound are unusual input: start over rather than grow
        route = routes[shape] = self._route(record)
        return route

    def _route(self, record: Mapping[str, Any]) -> _Route:
        """The rules this record can fire, from their guards.

        Guards read the record's keys, the values of ``_guarded_fields`` (only whether each is
        one of the literals it is compared with, another string, or of another type) and
        ``meta`` (whose only string field is the source): records equal in those share the route. Guards on
        ``first`` depend on state, so the activation here has no ``first`` (such atoms never
        refute). A refuted expression evaluates to false, never to an error, so skipping it
        changes nothing, rule error counts included.
        """
        act: dict[str, Any] = {"record": record, "meta": self._meta}

        def possible(expression: CompiledExpression | None) -> bool:
            guard = None if expression is None else expression.guard
            return guard is None or not guard.refuted(act)

        conditions = tuple(plan for plan in self._condition_plans if possible(plan.condition))
        stateful: list[_StatefulStep] = []
        for plan, handler in self._stateful_runs:
            if not possible(plan.condition):
                continue
            first_possible = plan.kind not in ("sequence", "absence") or possible(plan.first)
            then_possible = plan.kind not in ("sequence", "absence") or possible(plan.then)
            # Skipping must not skip a group_by error: only keys that cannot fail here allow it.
            key_certain = all(
                e.path is not None and e.path[0] in act and e.path[1] in act[e.path[0]] for e in plan.group_by
            )
            if plan.kind == "sequence" and plan.within_ns is None and not (first_possible or then_possible):
                # Nothing can open, fire or expire: the rule ignores this record, whatever the state.
                skip_when_empty = key_certain
                if key_certain and plan.condition is None:
                    continue
            else:
                skip_when_empty = key_certain and plan.kind in ("sequence", "absence") and not first_possible
            path = plan.group_by[0].path if len(plan.group_by) == 1 and key_certain else None
            key_field = path[1] if path is not None and path[0] == "record" else None
            stateful.append((plan, handler, skip_when_empty, first_possible, then_possible, key_field))
        return _Route(conditions, tuple(stateful))

    def _rule_error(self, plan: _Plan, where: str) -> None:
        errors = self._state.rule_errors
        errors[plan.id] = errors.get(plan.id, 0) + 1
        self._tm_rule_errors[plan.id] = self._tm_rule_errors.get(plan.id, 0) + 1
        if plan.id not in self._logged_errors:
            self._logged_errors.add(plan.id)
            log.warning(
                "rule %s: its %s failed on a record; the rule does not fire on such records (counted as rule errors)",
                plan.id,
                where,
            )

    def _predicate(self, plan: _Plan, expression: Any, act: Mapping[str, Any], where: str) -> bool:
        try:
            return expression.evaluate(act) is True
        except EvaluationError:
            self._rule_error(plan, where)
            return False

    def _kept(self, plan: _Plan, record: Mapping[str, Any]) -> tuple[Any, ...]:
        return self._shared(plan, plan.read_kept(record))

    def _shared(self, plan: _Plan, kept: tuple[Any, ...]) -> tuple[Any, ...]:
        """``kept`` as it is held: long strings ``then`` only compares digested, common tuples shared."""
        if plan.digest_at:
            digested = _digest_kept(kept, plan.digest_at)
            if digested is not kept:
                # A record's own tuple; rules that keep the same fields of it share it.
                last = self._last_digested
                if last == digested and all(map(_SHAREABLE_DIGESTED.__contains__, map(type, digested))):
                    return last
                self._last_digested = digested
                return digested
        cache = self._kept_cache
        try:
            shared = cache.get(kept)
        except TypeError:  # a list or map value: not shareable
            return kept
        if shared is not None:
            return shared
        # Only strings, null and absent values are shared: (1,) == (True,) == (1.0,), but CEL
        # tells them apart, and a tuple equal to a shared one then has the same types.
        if all(map(_SHAREABLE_TYPES.__contains__, map(type, kept))):
            if len(cache) >= _KEPT_TUPLES_MAX:
                # Start over rather than keep the first tuples for the whole run: those no group
                # holds any more (their sessions packed, ended) would pin their strings; the
                # common ones are shared again from their next record.
                cache.clear()
            cache[kept] = kept
        return kept

    def _first_view(self, plan: _Plan, kept: tuple[Any, ...]) -> dict[str, Any]:
        """``first`` as a map. Expressions never mutate it, so one kept tuple (often shared) has one view.

        Keyed by identity, not equality (``(1,) == (True,)``); the entry holds the tuple, so its id
        cannot be reused while the entry lives. A digested field reads as the current record's
        value when the digests match, else as a string no record holds (see kept_digests).
        """
        if plan.digest_at and any(type(kept[i]) is bytes for i in plan.digest_at):
            return _undigested_view(plan, kept, self._act["record"])
        views = plan.views
        entry = views.get(id(kept))
        if entry is not None and entry[0] is kept:
            return entry[1]
        view = {n: v for n, v in zip(plan.first_names, kept, strict=True) if v is not MISSING}
        if len(views) >= _VIEWS_MAX:
            views.clear()
        views[id(kept)] = (kept, view)
        return view

    def _put(self, plan: _Plan, session: SessionState, key: GroupKey, state: Any) -> None:
        dropped = session.put_group(plan.index, key, state, self._width, self._max_groups)
        if dropped is not None:
            self._state.counters["groups_dropped"] += 1
            if isinstance(dropped[1], Wait):
                self._unschedule(session, plan, dropped[0], dropped[1])

    def _sequence(
        self,
        plan: _Plan,
        action: Action,
        session: SessionState,
        key: GroupKey,
        out: list[Violation],
        *,
        first_possible: bool = True,
        then_possible: bool = True,
    ) -> None:
        act = self._act
        rules = session.rules
        slot = None if rules is None else rules[plan.index]
        # A rule with many groups holds a dict: read (and below add to) it directly.
        found = slot.get(key, MISSING) if type(slot) is dict else session.get_group(plan.index, key)
        t = action.time_ns
        if plan.compact:
            # Compact state: the kept fields alone (no window, no provenance to report on).
            if found is MISSING:
                if first_possible:
                    try:
                        opens = plan.first_fn(act) is True  # type: ignore[misc]  # sequences have first
                    except EvaluationError:
                        self._rule_error(plan, "first")
                        return
                    if opens:
                        kept = self._kept(plan, action.record)
                        if type(slot) is dict and len(slot) < self._max_groups:
                            slot[key] = kept  # a new group, the newest: what put_group does here
                            if session.changes is not None:
                                session.note_put(plan.index, key)
                        else:
                            self._put(plan, session, key, kept)
                return
            if then_possible:
                act["first"] = self._first_view(plan, found)
                if self._predicate(plan, plan.then, act, "then"):
                    self._emit(self._violation(plan, action, act, session), session, out)
                act["first"] = _EMPTY
            if plan.keep_latest and first_possible and self._predicate(plan, plan.first, act, "first"):
                self._put(plan, session, key, self._kept(plan, action.record))
            return
        opened: SequenceState | None = None if found is MISSING else found
        if opened is not None:
            within = plan.within_ns
            timed = opened.time_ns is not None and t is not None
            if within is not None and timed and t - opened.time_ns > within:  # type: ignore[operator]
                # The window passed: the opener no longer counts, and a new one may open.
                session.drop_group(plan.index, key)
                opened = None
            elif then_possible and (within is None or timed) and not (plan.report_first and opened.reported):
                act["first"] = self._first_view(plan, opened.first)
                if self._predicate(plan, plan.then, act, "then"):
                    if plan.report_first:
                        opened.reported = True
                        assert opened.prov is not None
                        self._emit(self._violation_at(plan, opened.prov, session, act), session, out)
                    else:
                        self._emit(self._violation(plan, action, act, session), session, out)
                act["first"] = _EMPTY
        if (opened is None or plan.keep_latest) and first_possible and self._predicate(plan, plan.first, act, "first"):
            prov = self._provenance(action, session) if plan.needs_prov else None
            self._put(plan, session, key, SequenceState(self._kept(plan, action.record), t, prov))

    def _file_sequence(
        self,
        plan: _Plan,
        action: Action,
        session: SessionState,
        out: list[Violation],
        *,
        first_possible: bool,
        then_possible: bool,
    ) -> None:
        """A ``log_scope: file`` sequence on an action-log line: its group is the file's, not the session's."""
        value = action.record.get("action_id")
        if type(value) is not str or not value:
            return
        groups = self._file_groups[plan.index]
        digest = _file_digest(action.origin, value)
        found = groups.get(digest)
        act = self._act
        if found is not None:
            if then_possible:
                act["first"] = self._first_view(plan, found)
                if self._predicate(plan, plan.then, act, "then"):
                    self._emit(self._violation(plan, action, act, session), session, out)
                act["first"] = _EMPTY
            return
        if first_possible and self._predicate(plan, plan.first, act, "first"):
            groups.put(digest, self._shared(plan, plan.read_file_kept(action.record)))

    def _absence(
        self,
        plan: _Plan,
        action: Action,
        session: SessionState,
        key: GroupKey,
        out: list[Violation],
        *,
        first_possible: bool = True,
        then_possible: bool = True,
    ) -> None:
        act = self._act
        found = session.get_group(plan.index, key)
        wait: Wait | None = None if found is MISSING else found
        fired = session.fired
        if then_possible and fired is not None and plan.index in fired.rules:
            self._resolve_fired(plan, session, key, fired)
        if wait is not None:
            resolved = False
            if then_possible:
                act["first"] = self._first_view(plan, wait.first)
                resolved = self._predicate(plan, plan.then, act, "then")
                act["first"] = _EMPTY
            if resolved:
                self._forget_wait(session, plan, key, wait)
                wait = None
            else:
                wait.actions += 1
                if plan.within_actions is not None and wait.actions >= plan.within_actions:
                    self._fire_wait(
                        plan, session, key, wait, out, time_ns=action.time_ns, details={"within_actions": wait.actions}
                    )
                    wait = None
        if (wait is None or plan.keep_latest) and first_possible and self._predicate(plan, plan.first, act, "first"):
            if wait is not None:
                self._forget_wait(session, plan, key, wait)
            self._open_wait(plan, action, act, session, key)

    def _open_wait(
        self, plan: _Plan, action: Action, act: Mapping[str, Any], session: SessionState, key: GroupKey
    ) -> None:
        started = action.time_ns
        deadline_ns: int | None = None
        if started is not None:
            spans: list[int] = []
            if plan.within_ns is not None:
                spans.append(plan.within_ns)
            if plan.deadline is not None:
                try:
                    seconds = plan.deadline.evaluate(act)
                except EvaluationError:
                    self._rule_error(plan, "deadline")
                    seconds = None
                if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and not math.isnan(seconds):
                    spans.append(_wait_span_ns(seconds))
            if spans:
                deadline_ns = min(started + min(spans), _LATEST_NS)
        workflow_state = _str_field(action.record, "workflow_state")
        wait = Wait(
            self._kept(plan, action.record),
            self._provenance(action, session),
            started,
            deadline_ns,
            received_ns=self._now_ns if self._received_ns is None else self._received_ns,
            state=workflow_state,
        )
        self._put(plan, session, key, wait)
        if deadline_ns is not None:
            if self._serve:
                wait.fire_at = min(max(deadline_ns, wait.received_ns) + self._lateness_ns, _LATEST_NS)
            else:
                wait.fire_at = deadline_ns
            self._store.put_timer(TimerEntry(wait.fire_at, session.session_id, plan.id, key))
            if session.next_deadline_ns is None or deadline_ns < session.next_deadline_ns:
                session.next_deadline_ns = deadline_ns

    def _forget_wait(self, session: SessionState, plan: _Plan, key: GroupKey, wait: Wait) -> None:
        if session.get_group(plan.index, key) is wait:
            session.drop_group(plan.index, key)
        self._unschedule(session, plan, key, wait)

    def _unschedule(self, session: SessionState, plan: _Plan, key: GroupKey, wait: Wait) -> None:
        """A wait is gone from the session: clear its timer."""
        if wait.fire_at is not None:
            self._store.remove_timer(session.session_id, plan.id, key)
            wait.fire_at = None

    def _fire_wait(
        self,
        plan: _Plan,
        session: SessionState,
        key: GroupKey,
        wait: Wait,
        out: list[Violation],
        *,
        time_ns: int | None,
        details: dict[str, Any],
    ) -> None:
        self._forget_wait(session, plan, key, wait)
        first = self._first_view(plan, wait.first)
        prov = wait.prov
        meta = {
            "source": "log" if isinstance(prov[1], int) else "span",
            "synthetic_action_id": False,
            "line": prov[2] or 0,
            "time_ns": prov[8] or 0,
        }
        # The waiting record itself is gone; messages of absence rules read its kept fields.
        act = {"record": first, "meta": meta, "lists": self._lists, "first": first}
        violation = self._violation_at(plan, prov, session, act, time_ns=time_ns, details=details)
        self._emit(violation, session, out)
        self._remember_fired(plan, session, key, wait.first, violation.violation_id)

    def _remember_fired(
        self, plan: _Plan, session: SessionState, key: GroupKey, first: tuple[Any, ...], violation_id: str
    ) -> None:
        """Keep a fired wait so that a later resolution can clear its violation (bounded per session)."""
        limit = self.options.max_fired_waits_per_session
        if limit == 0:
            return
        fired = session.fired
        if fired is None:
            fired = session.fired = FiredWaits()
        if fired.add((plan.index, key, violation_id, first), limit):
            self._state.counters["fired_waits_dropped"] += 1

    def _resolve_fired(self, plan: _Plan, session: SessionState, key: GroupKey, fired: FiredWaits) -> None:
        """The record resolves the fired waits of this rule and group whose ``then`` it matches."""
        act = self._act
        index = plan.index
        kept: list[tuple[int, GroupKey, str, tuple[Any, ...]]] = []
        resolved = 0
        for entry in fired.entries:
            if entry[0] == index and entry[1] == key:
                act["first"] = self._first_view(plan, entry[3])
                if self._predicate(plan, plan.then, act, "then"):
                    self._resolutions.append(entry[2])
                    resolved += 1
                    continue
            kept.append(entry)
        act["first"] = _EMPTY
        if resolved:
            fired.replace(kept)
            fired.resolved += resolved
            self._state.counters["waits_resolved_late"] += resolved
            self._dirty.add(session.session_id)

    def _fire_session_deadlines(self, session: SessionState, before_ns: int, out: list[Violation]) -> None:
        """Fire the session's waits whose deadline is before ``before_ns``, earliest first."""
        due: list[tuple[int, int, GroupKey, Wait]] = []
        remaining: int | None = None
        for index, key, wait in session.waits(self._absence_indices):
            deadline = wait.deadline_ns
            if deadline is None:
                continue
            if deadline < before_ns:
                due.append((deadline, index, key, wait))
            elif remaining is None or deadline < remaining:
                remaining = deadline
        session.next_deadline_ns = remaining
        due.sort(key=lambda entry: (entry[0], entry[1]))
        for deadline, index, key, wait in due:
            plan = self._stateful_plans[index]
            self._fire_wait(
                plan, session, key, wait, out, time_ns=deadline, details={"deadline_unix_nano": deadline}
            )

    def _fire_due(self, until_ns: int, out: list[Violation]) -> None:
        store = self._store
        next_due = store.next_due()
        if next_due is None or next_due > until_ns:
            return
        for entry in store.pop_due(until_ns):
            session = self._sessions.get(entry.session_id)
            plan = self._plan_by_id.get(entry.rule_id)
            if session is None or plan is None:
                continue
            wait = session.get_group(plan.index, entry.group)
            if not isinstance(wait, Wait) or wait.fire_at != entry.due_ns or wait.deadline_ns is None:
                continue
            wait.fire_at = None  # popped from the store already
            self._dirty.add(session.session_id)
            deadline = wait.deadline_ns
            self._fire_wait(
                plan, session, entry.group, wait, out, time_ns=deadline, details={"deadline_unix_nano": deadline}
            )

    def _change(
        self,
        plan: _Plan,
        action: Action,
        session: SessionState,
        key: GroupKey,
        out: list[Violation],
        *,
        first_possible: bool = True,
        then_possible: bool = True,
    ) -> None:
        act = self._act
        try:
            value = plan.field.evaluate(act)  # type: ignore[union-attr]  # change rules have a field
        except EvaluationError:
            self._rule_error(plan, "field")
            return
        first_value = session.get_group(plan.index, key)
        if first_value is MISSING:
            # A list literal comes back as a new list each time; a tuple holds the same for less.
            # A long string is only ever compared for equality: its digest answers that.
            if type(value) is str and len(value) >= _DIGEST_MIN_CHARS:
                self._put(plan, session, key, _digest_of(value))
            else:
                self._put(plan, session, key, tuple(value) if type(value) is list else value)
        elif type(first_value) is bytes:
            if type(value) is not str or _digest_of(value) != first_value:
                self._emit(self._violation(plan, action, act, session), session, out)
        elif not _same_value(first_value, value):
            self._emit(self._violation(plan, action, act, session), session, out)

    def _count(
        self,
        plan: _Plan,
        action: Action,
        session: SessionState,
        key: GroupKey,
        out: list[Violation],
        *,
        first_possible: bool = True,
        then_possible: bool = True,
    ) -> None:
        act = self._act
        window = plan.window_ns
        t = action.time_ns
        if window is not None and t is None:
            return  # an untimed record cannot be placed in a window
        found = session.get_group(plan.index, key)
        if found is MISSING:
            counted = CountState([] if window is not None else None)
            self._put(plan, session, key, counted)
        else:
            counted = found
        if window is not None and counted.times is not None and t is not None:
            times = counted.times
            insort(times, t)
            floor = t - window
            while times and times[0] < floor:
                times.pop(0)
            # threshold + 1 times are enough to tell a crossing.
            excess = len(times) - plan.threshold - 1
            if excess > 0:
                del times[:excess]
            number = bisect_right(times, t)
        else:
            counted.count += 1
            number = counted.count
        if number > plan.threshold:
            if not counted.above:
                counted.above = True
                self._emit(self._violation(plan, action, act, session), session, out)
        else:
            counted.above = False

    # -- violations ---------------------------------------------------------------------

    def _provenance(self, action: Action, session: SessionState) -> Provenance:
        record = action.record
        key = action.delivery_key
        return (
            action.action_id,
            key if key is not None else (action.line if action.line is not None else action.seq),
            action.line,
            action.origin,
            _str_field(record, "trace_id") or (key[0] if key else ""),
            _str_field(record, "span_id") or (key[1] if key else ""),
            _str_field(record, "service"),
            _str_field(record, "kind"),
            action.time_ns,
        )

    def _violation(self, plan: _Plan, action: Action, act: Mapping[str, Any], session: SessionState) -> Violation:
        return self._violation_at(plan, self._provenance(action, session), session, act)

    def _violation_at(
        self,
        plan: _Plan,
        prov: Provenance,
        session: SessionState,
        act: Mapping[str, Any],
        *,
        time_ns: int | None = None,
        details: dict[str, Any] | None = None,
    ) -> Violation:
        action_id, _, line, origin, trace_id, span_id, service, kind, record_time = prov
        session_id = session.session_id
        return Violation(
            rule=plan.id,
            name=plan.name,
            severity=plan.severity,
            session_id=session_id,
            action_id=action_id,
            message=plan.rule.message.render(act),
            violation_id=make_violation_id(plan.id, session_id, action_id, prov_identity(prov)),
            time_ns=time_ns if time_ns is not None else record_time,
            line=line,
            origin=origin,
            trace_id=trace_id,
            span_id=span_id,
            service=service,
            kind=kind,
            tags=plan.tags,
            details=details if details is not None else {},
        )

    def _emit(self, violation: Violation, session: SessionState | None, out: list[Violation]) -> None:
        out.append(violation)
        by_rule = self._state.violations_by_rule
        by_rule[violation.rule] = by_rule.get(violation.rule, 0) + 1
        if session is not None:
            counts = session.violations
            if counts is None:
                counts = session.violations = {}
            counts[violation.rule] = counts.get(violation.rule, 0) + 1
            self._dirty.add(session.session_id)
        if self._telemetry is not None:
            label = (violation.rule, violation.severity, self._service_label(violation.service))
            self._tm_violations[label] = self._tm_violations.get(label, 0) + 1

    # -- batches, telemetry ---------------------------------------------------------------

    def _service_label(self, value: Any) -> str:
        if not isinstance(value, str) or not value:
            return "unknown"
        label: str = value
        if len(label) > LABEL_MAX_CHARS:
            label = bounded_text(label, LABEL_MAX_CHARS)  # a readable prefix and a digest: still distinct
        if label in self._services:
            return label
        if len(self._services) >= _MAX_SERVICE_LABELS:
            return "other"
        self._services.add(label)
        return label

    def _end_batch(self) -> None:
        store = self._store
        sessions = self._sessions
        if self._pack_idle_ns is not None and (
            self._state.counters["actions_seen"] - self._packed_at >= max(self.options.pack_every_records,
                                                                          len(sessions))
            or self._pack_clock() - self._packed_clock >= self._pack_idle_ns
        ):
            self._pack_idle()
        for session_id in self._deleted:
            store.delete_session(session_id)
        self._deleted.clear()
        self._count_entries()
        for session_id in self._dirty:
            session = sessions.get(session_id)
            if session is not None:
                store.save_session(session, self.schema)
        self._dirty.clear()
        store.save_engine(self._state)
        store.commit()
        if self._telemetry is not None:
            self._flush_telemetry(self._telemetry)

    def _pack_clock(self) -> int:
        """The clock idle is measured on: arrivals on the wall clock in serve, event time in replay."""
        return self._now_ns if self._serve else self._state.max_event_ns

    def _pack_idle(self) -> None:
        """Pack the groups of the sessions idle for ``pack_idle_after_s`` (SessionState.pack).

        Long-lived sessions are idle most of their life, and what an idle session remembers
        (every completed action, every key) is most of replay's and serve's memory. A session
        is unpacked as soon as it is looked up again. Those changed in this batch, and those
        with spans in the reordering window, are left as they are: they are about to be read.
        A session with no event time (replay of an action log without times) is idle once
        ``pack_untimed_after_sessions`` other sessions have had records after its last one, or
        once it and those sessions hold the entry budget's entries unpacked (at first
        ``pack_untimed_after_entries``; see _grow_untimed_budget).
        """
        assert self._pack_idle_ns is not None
        self._packed_at = self._state.counters["actions_seen"]
        clock = self._packed_clock = self._pack_clock()
        horizon = clock - self._pack_idle_ns
        self._grow_untimed_budget()
        recent_from = self._untimed_recent_from()
        # Untimed sessions from here on are recent by their number: packed, they are packed for the budget.
        budget_from = len(self._sessions) - self.options.pack_untimed_after_sessions
        packed_for_budget = self._packed_for_budget
        dirty = self._dirty
        # Counted for self-telemetry as the pass goes: a session looked up again is unpacked and
        # moves to the end, so the packed ones are among those this pass reads.
        packed = held = 0
        # Least recently active first: the sessions are in the order of their last record.
        for position, session in enumerate(self._sessions.values()):
            if session.rules is None:
                continue
            if session.packed is not None:
                packed += 1
                held += session.packed_bytes()
                continue
            activity = session.activity_ns
            if activity is None:
                if position >= recent_from:
                    break  # the rest had records later than this many others
            elif activity > horizon:
                break  # the rest were active later
            if not session.buffered and session.session_id not in dirty and session.pack(self._cold):
                packed += 1
                held += session.packed_bytes()
                if activity is None and position >= budget_from:
                    packed_for_budget.append(session)
        self._packed_count = (packed, held)

    def _grow_untimed_budget(self) -> None:
        """Double the entry budget when more than a quarter of the sessions packed for it alone (and
        not back since the last look) have had records since: long sessions interleave, and
        packing them trades CPU for memory they take back. It never shrinks: at most, the number
        of sessions bounds what is held unpacked, as it does without the budget."""
        waiting = self._packed_for_budget
        if not waiting:
            return
        sessions = self._sessions
        still: list[SessionState] = []
        returned = 0
        for session in waiting:
            if sessions.get(session.session_id) is not session:
                continue  # ended or evicted
            if session.packed is None:
                returned += 1
            else:
                still.append(session)
        self._packed_for_budget = still
        if returned * 4 > len(waiting):
            self._untimed_budget = min(self._untimed_budget * 2, _UNTIMED_BUDGET_MAX)

    def _untimed_recent_from(self) -> int:
        """The position (least recently active first) from which a session without event time is
        recent, not idle: the last ``pack_untimed_after_sessions``, fewer when those hold more
        than the entry budget unpacked (``pack_untimed_after_entries`` at first; their counts as of
        their last batch)."""
        sessions = self._sessions
        limit = self.options.pack_untimed_after_sessions
        budget = self._untimed_budget
        recent = held = 0
        for session in reversed(sessions.values()):
            if recent >= limit:
                break
            if session.packed is None:
                held += session.entries
                if held > budget:
                    break
            recent += 1
        return len(sessions) - recent

    # -- the global bound on remembered entries -------------------------------------------

    def _count_entries(self) -> None:
        """Recount the sessions changed in this batch; past the bound, trim (before they are saved)."""
        sessions = self._sessions
        total = self._entries_total
        for session_id in self._dirty:
            session = sessions.get(session_id)
            if session is not None:
                count = session.entry_count()
                total += count - session.entries
                session.entries = count
        self._entries_total = total
        if total > self.options.max_remembered_entries:
            self._trim_entries()

    def _trim_entries(self) -> None:
        """The least recently active sessions forget their oldest entries until 95% of the bound is left.

        Delivery keys go first (a redelivery of an idle session's old span is the least likely
        use), then groups, oldest first within each rule. Open waits are kept: their deadline
        is an alarm still to raise, and ``max_groups_per_rule`` and ``max_sessions`` bound them.
        Trimming down to 95% rather than to the bound itself spaces the scans out.
        """
        bound = self.options.max_remembered_entries
        target = bound - bound // 20
        dropped_seen = dropped_groups = 0
        for session in self._sessions.values():  # least recently active first
            excess = self._entries_total - target
            if excess <= 0:
                break
            if not session.entries:
                continue
            gone = session.forget_seen(excess)
            dropped_seen += gone
            excess -= gone
            if excess > 0 and session.packed is not None:
                session.unpack()
            rules = session.rules
            if excess > 0 and rules is not None:
                for index in range(len(rules)):
                    for key, group in session.iter_groups(index):
                        if excess <= 0:
                            break
                        if isinstance(group, Wait):
                            continue
                        session.drop_group(index, key)
                        dropped_groups += 1
                        excess -= 1
                if all(slot is None for slot in rules):
                    session.rules = None
            count = session.entry_count()
            self._entries_total += count - session.entries
            session.entries = count
            self._dirty.add(session.session_id)
        dropped = dropped_seen + dropped_groups
        if not dropped:
            return
        self._state.counters["entries_dropped"] += dropped
        for what, n in (("delivery_key", dropped_seen), ("group", dropped_groups)):
            if n:
                self._tm_entries_dropped[what] = self._tm_entries_dropped.get(what, 0) + n
        self._trimmed_unlogged += dropped
        now = time.monotonic()
        if now - self._last_trim_log >= _EVICTION_LOG_INTERVAL_S:
            log.warning(
                "remembered-entry bound (max_remembered_entries=%d) reached: the least recently active sessions"
                " forgot %d group(s) and delivery key(s) since the last such message",
                bound,
                self._trimmed_unlogged,
            )
            self._last_trim_log = now
            self._trimmed_unlogged = 0

    @property
    def remembered_entries(self) -> int:
        """Groups and delivery keys held across all sessions, as of the last batch."""
        return self._entries_total

    def hand_over(self, session_ids: Collection[str]) -> tuple[list[Violation], list[str]]:
        """Sessions another replica now receives (a shared store): evaluate what is held of them, then let go.

        No later span of theirs comes here, so what the reordering window holds of them is
        evaluated now, in their own event-time order, and they are written as they stand and
        dropped from this engine. Their timers are not fired here: they move with the state,
        and the new owner fires them once it can know the wait was not resolved in time. A
        session of which the identity stage still holds a span stays (it is asked for again).
        Returns the violations found and the sessions let go; the caller commits them in one
        unit with the change of owner.
        """
        out: list[Violation] = []
        held = self._identity.holding(session_ids)
        going = {sid for sid in session_ids if sid not in held}
        if not going:
            return out, []
        buffer = self._state.buffer
        theirs = [item for item in buffer if item.action.session_id in going]
        if theirs:
            buffer[:] = [item for item in buffer if item.action.session_id not in going]
            heapq.heapify(buffer)
            for item in sorted(theirs):
                self._release_item(item, out)
        for session_id in going:
            if session_id in self._sessions:
                self._dirty.add(session_id)
        self._end_batch()
        for session_id in going:
            session = self._sessions.pop(session_id, None)
            if session is not None:
                self._entries_total -= session.entries
            self._store.forget_timers_of(session_id)
        return out, sorted(going)

    def holds_session(self, session_id: str) -> bool:
        """Whether the session is open here (not yet expired, evicted or ended)."""
        return session_id in self._sessions

    def _flush_telemetry(self, tm: Telemetry) -> None:
        for (kind, status, service), n in self._tm_actions.items():
            tm.actions.labels(kind=kind, status=status, service=service).inc(n)
        self._tm_actions.clear()
        for (rule, severity, service), n in self._tm_violations.items():
            tm.violations.labels(rule=rule, severity=severity, service=service).inc(n)
        self._tm_violations.clear()
        if self._tm_duplicates:
            tm.spans_duplicate.inc(self._tm_duplicates)
            self._tm_duplicates = 0
        if self._tm_late:
            tm.spans_late.inc(self._tm_late)
            self._tm_late = 0
        if self._tm_evicted:
            tm.sessions_evicted.inc(self._tm_evicted)
            self._tm_evicted = 0
        for what, n in self._tm_entries_dropped.items():
            tm.state_entries_dropped.labels(what=what).inc(n)
        self._tm_entries_dropped.clear()
        tm.state_entries.set(self._entries_total)
        for rule, n in self._tm_rule_errors.items():
            tm.rule_errors.labels(rule=rule).inc(n)
        self._tm_rule_errors.clear()
        tm.open_sessions.set(len(self._sessions))
        tm.sessions_packed.set(self._packed_count[0])
        tm.packed_bytes.set(self._packed_count[1])

    # -- summary --------------------------------------------------------------------------

    def _session_summary(
        self, session: SessionState, end: SessionEnd, waits: list[tuple[int, GroupKey, Wait]] | None = None
    ) -> SessionSummary:
        if waits is None:
            waits = session.waits(self._absence_indices)
        open_waits = [
            OpenWait(
                rule=self._stateful_plans[index].id,
                session_id=session.session_id,
                action_id=wait.prov[0],
                deadline_ns=wait.deadline_ns,
                started_ns=wait.started_ns,
                state=wait.state,
            )
            for index, _, wait in waits
        ]
        open_waits.sort(key=lambda w: (w.deadline_ns is None, w.deadline_ns or 0, w.rule, w.action_id))
        return SessionSummary(
            session_id=session.session_id,
            actions_by_kind=session.kinds_dict(),
            violations_by_rule=dict(session.violations or {}),
            open_waits=open_waits,
            end=end,
            waits_resolved_late=session.fired.resolved if session.fired is not None else 0,
        )

    def load(self) -> EngineLoad:
        """What the engine holds now (serve's status line): sessions, actions seen, the reordering window."""
        state = self._state
        release_by = None
        if self._serve and state.received:
            # The newest span leaves the window once it has waited the allowed lateness on the clock.
            release_by = state.received[-1][0] + self._lateness_ns
        return EngineLoad(len(self._sessions), state.counters["actions_seen"], len(state.buffer), release_by)

    def close(self) -> None:
        """Remove replay's temporary files, of idle sessions' groups and a file's action ids (both go with the
        process too)."""
        if self._cold is not None:
            self._cold.close()
        for groups in self._file_groups.values():
            groups.close()

    def summary(self) -> EngineSummary:
        """Per session (open ones, then ended ones still remembered) and totals."""
        state = self._state
        counters = state.counters
        sessions = [self._session_summary(s, "open") for s in self._sessions.values()]
        sessions.sort(key=lambda s: s.session_id)
        sessions.extend(self._ended)
        open_waits = [w for s in sessions if s.end == "open" for w in s.open_waits]
        return EngineSummary(
            sessions=sessions,
            actions_seen=counters["actions_seen"],
            actions_evaluated=counters["actions_evaluated"],
            duplicates=counters["duplicates"],
            late=counters["late"],
            malformed=counters["malformed"],
            violations_by_rule=dict(state.violations_by_rule),
            rule_errors=dict(state.rule_errors),
            open_waits=open_waits,
            sessions_expired=counters["sessions_expired"],
            sessions_evicted=counters["sessions_evicted"],
            groups_dropped=counters["groups_dropped"],
            waits_resolved_late=counters["waits_resolved_late"],
            fired_waits_dropped=counters["fired_waits_dropped"],
            ended_sessions_dropped=self._ended_dropped,
            watermark_ns=self.watermark_ns,
        )


def _label_status(value: Any) -> str:
    return value if value in ("ok", "error") else "other"
