"""Action records: one attempt of one action of one session.

A record is a plain ``dict`` whose keys are the durable-sessions skill's field names,
so an action log line *is* a record and the checker's output can be read back by the
skill's own checker. Presence of a key is meaningful (``"result": null`` is recorded,
a missing ``result`` is not), which a dataclass could not express; a dict also keeps
conversion of a JSON line free.

What is not part of the skill's format (where the record came from, its event time
as an integer, whether its action id had to be made up) travels beside the record in
:class:`Action`.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Final, Literal, NamedTuple

Record = dict[str, Any]

REQUIRED_FIELDS: Final = ("session_id", "action_id", "kind", "status")

NONDETERMINISTIC_KINDS: Final = frozenset({"user_prompt", "llm_call", "external_read", "random", "clock"})
SIDE_EFFECT_KINDS: Final = frozenset({"write", "payment", "email", "notify", "deploy"})
NEVER_CACHEABLE_KINDS: Final = frozenset({"user_prompt"})

STATUSES: Final = ("ok", "error")
ON_FAILURE_VALUES: Final = ("ask_user", "abort", "compensate")
WORKFLOW_STATES: Final = (
    "planned",
    "awaiting_approval",
    "executing",
    "waiting_on_external",
    "retry_scheduled",
    "completed",
    "failed",
    "compensated",
)
WAIT_STATES: Final = frozenset({"awaiting_approval", "waiting_on_external"})
APPROVAL_DECISIONS: Final = ("granted", "denied")

# The JSON type each known field must have when present. ``null`` is accepted for
# every optional field (it means "present, no value"); required fields must be
# non-empty strings. ``bool`` is never accepted where an integer is asked for.
FieldType = Literal["str", "int", "number", "bool", "any", "str|int"]
FIELD_TYPES: Final[dict[str, FieldType]] = {
    "session_id": "str",
    "action_id": "str",
    "kind": "str",
    "status": "str",
    "result": "any",
    "result_ref": "str",
    "idempotency_key": "str",
    "replay": "str",
    "side_effects": "bool",
    "retryable": "bool",
    "max_attempts": "int",
    "attempts": "int",
    "cacheable": "bool",
    "cache_key": "str",
    "ttl_s": "int",
    "on_failure": "str",
    "replayed": "bool",
    "workflow_state": "str",
    "wait_timeout_s": "number",
    "plan_version": "str|int",
    "approval_decision": "str",
    "input_fingerprint": "str",
    "instance": "str",
    "time": "str",
    "trace_id": "str",
    "span_id": "str",
    "service": "str",
}

_FIELD_ORDER: Final = {name: index for index, name in enumerate(FIELD_TYPES)}

# Text fields are ids and short words: past this length a value is replaced by its bounded
# form (``bounded_text``), so what the engine, the view and the exporters keep per session
# does not grow with what a client sends. Distinct values stay distinct (a 128-bit digest).
IDENTITY_MAX_CHARS: Final = 256
# A metric label value (service.name) past this length: the same, with a 64-bit digest.
LABEL_MAX_CHARS: Final = 64
_BOUNDED_FIELDS: Final = frozenset(name for name, kind in FIELD_TYPES.items() if kind in ("str", "str|int"))


def bounded_text(value: str, limit: int = IDENTITY_MAX_CHARS) -> str:
    """``value`` if it is at most ``limit`` characters, else a readable prefix, ``~`` and a digest of the
    whole value, ``limit`` characters long at most. The same value always gives the same text (across
    restarts, replicas and builds), and the bounded form of a bounded form is itself."""
    if len(value) <= limit:
        return value
    size = 16 if limit >= IDENTITY_MAX_CHARS else 8
    digest = hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=size).hexdigest()
    return value[: limit - 2 * size - 1] + "~" + digest


def bound_identities(record: Record) -> None:
    """Replace, in place, every text field of the contract longer than IDENTITY_MAX_CHARS by its bounded form.

    One length test per field on the usual record (nothing allocated): it runs for every action."""
    long: list[str] | None = None
    for name, value in record.items():
        if type(value) is str and len(value) > IDENTITY_MAX_CHARS and name in _BOUNDED_FIELDS:
            if long is None:
                long = []
            long.append(name)
    if long is not None:
        for name in long:
            record[name] = bounded_text(record[name])
_TYPE_WORDS: Final[dict[FieldType, str]] = {
    "str": "a string",
    "int": "an integer",
    "number": "a number",
    "bool": "true or false",
    "any": "any value",
    "str|int": "a string or an integer",
}


def json_type_name(value: Any) -> str:
    """The JSON name of a Python value's type, for messages (never the value itself)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


# Integers are signed 64-bit downstream (state stores, OTLP, JSON readers).
INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1


def _beyond_int64(value: Any) -> bool:
    """A whole number (an integer, or a JSON integer too large that the parser gave as a float) past 64 bits."""
    if type(value) is int:
        return not INT64_MIN <= value <= INT64_MAX
    return type(value) is float and math.isfinite(value) and value.is_integer() and not INT64_MIN <= value <= INT64_MAX


def _has_type(value: Any, expected: FieldType) -> bool:
    if expected == "any":
        return True
    if expected == "str":
        return isinstance(value, str)
    if expected == "bool":
        return isinstance(value, bool)
    if expected == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if expected == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    # "str|int"
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


# The Python types a parsed value of each field type may have (a bool is never a number; an
# int of an "int" or "str|int" field must also be within 64 bits).
PYTHON_TYPES: Final[dict[FieldType, frozenset[type]]] = {
    "str": frozenset({str}),
    "int": frozenset({int}),
    "number": frozenset({int, float}),
    "bool": frozenset({bool}),
    "str|int": frozenset({str, int}),
}
_RANGED: Final = frozenset({"int", "str|int"})


def validate_record(record: Record) -> list[str]:
    """Problems that make a record unusable, as messages that name fields, not values.

    An empty string counts as a missing required field ("an empty key is no key").
    An empty list means the record is well-formed.
    """
    problems: list[str] = []
    missing = [f for f in REQUIRED_FIELDS if record.get(f) in (None, "")]
    if missing:
        problems.append("missing required field" + ("s " if len(missing) > 1 else " ") + ", ".join(missing))
    # The record's own fields (a few) rather than every known one; problems in FIELD_TYPES order.
    typed: list[tuple[int, str]] = []
    for name, value in record.items():
        expected = FIELD_TYPES.get(name)
        if expected is None or value is None or expected == "any":  # unknown, null, or anything goes
            continue
        kind = type(value)
        if kind in PYTHON_TYPES[expected] and (
            kind is not int or expected not in _RANGED or INT64_MIN <= value <= INT64_MAX
        ):
            continue  # the common case, said without a call
        if expected in _RANGED and _beyond_int64(value):
            problem = f"field {name} must be {_TYPE_WORDS[expected]} within the signed 64-bit range"
        elif not _has_type(value, expected):
            problem = f"field {name} must be {_TYPE_WORDS[expected]}, got {json_type_name(value)}"
        else:
            continue
        typed.append((_FIELD_ORDER[name], problem))
    if typed:
        typed.sort()
        problems.extend(message for _, message in typed)
    return problems


class SpanLinks(NamedTuple):
    """What a span says about its place in the trace, for linking it to other spans.

    The session and tool-call identity resolution (processor.evaluate.identity) reads it
    at ingest; the record itself never holds it.
    """

    # The parent span id (hex), "" for a root span.
    parent_span_id: str
    # False when no attribute named the session and the trace id stood in for it.
    session_named: bool
    # A tool span whose call id had to be made up: its tool name (the id may come from the LLM span).
    tool_name: str | None = None
    # An LLM span's output tool calls, in order: (tool name, call id).
    offered: tuple[tuple[str, str], ...] = ()
    # ROLE_ANNOTATED: durable.* attributes made it an action; ROLE_TOOL: a framework's tool span made
    # it one (one action per tool call: an annotated action inside the tool span is the call).
    role: int = 0
    # The checkpoint that records this action's outcome once its step completes (a LangGraph node's).
    covered_by: str = ""
    # The durable runtime's workflow the span runs in (a DBOS workflow id).
    workflow: str = ""
    # On the record of a durable runtime's completed step: the step's name, and when it began.
    step: str = ""
    step_start_ns: int = 0


# SpanLinks.covered_by of a model call that a durable runtime may record in a step beside its
# span, under the same parent (the OpenAI Agents SDK on DBOS): resolved once the parent arrives.
COVERED_BY_STEP_BESIDE: Final = "\x00step-beside"
ROLE_ANNOTATED: Final = 1
ROLE_TOOL: Final = 2
# A wait for approval of a deferred tool call that the framework decides by running the call or
# not in the session's next run (pydantic-ai); the identity stage derives the decision.
ROLE_DEFERRED: Final = 3


SourceKind = Literal["log", "span"]
# The origin of items read from standard input (its path on the command line is "-").
STDIN_ORIGIN: Final = "<stdin>"


@dataclass(slots=True)
class Action:
    """A record and where it came from.

    ``source`` says how records map to actions: an action log holds one record per
    action (a repeated id is a duplicate); spans hold one record per attempt (a
    repeated id may be a retry or a redelivery).
    """

    record: Record
    source: SourceKind
    # Where the record was read: "file:line" for logs, the input name for spans.
    origin: str = ""
    line: int | None = None
    # Event time in Unix nanoseconds (span start, or the record's `time`); None when unknown.
    time_ns: int | None = None
    # Arrival order within the run; breaks ties between equal event times.
    seq: int = 0
    # Identity of the delivered unit, for duplicate-delivery detection: (trace_id, span_id, event index).
    delivery_key: tuple[str, str, int] | None = None
    # True when the action id was made up (from a span id): it cannot be stable across a replay.
    synthetic_action_id: bool = False
    # Spans only: parent, whether a session was named, tool-call links (see SpanLinks).
    links: SpanLinks | None = None

    @property
    def session_id(self) -> str:
        return str(self.record.get("session_id", ""))

    @property
    def action_id(self) -> str:
        return str(self.record.get("action_id", ""))


@dataclass(slots=True)
class Malformed:
    """Input that could not become a record (DS000): a bad line, a span of the wrong shape."""

    message: str
    origin: str = ""
    line: int | None = None
    session_id: str = ""
    action_id: str = ""
    trace_id: str = ""
    span_id: str = ""
    source: SourceKind = "log"
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class SessionMark:
    """A span that is no action (an agent or workflow run): its place in the trace and the session it names.

    It reaches the engine's identity resolution only, so that the actions of its trace
    without a session attribute of their own join the session their nearest ancestor
    names. ``session_id`` is "" when the span names none.
    """

    trace_id: str
    span_id: str
    parent_span_id: str
    session_id: str
    time_ns: int | None = None
    # The durable runtime's workflow the span runs in (a DBOS workflow id), "" when none.
    workflow: str = ""
