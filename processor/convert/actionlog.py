"""One line of the durable-sessions skill's action log becomes an Action.

A line is a JSON object in the skill's field names, so the parsed dict *is* the
record; nothing is renamed or dropped (extra fields such as ``prompt`` or ``model``
ride along for the rules that want them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final, NamedTuple

import orjson

from processor.convert.timefmt import parse_rfc3339
from processor.records import (
    FIELD_TYPES,
    IDENTITY_MAX_CHARS,
    INT64_MAX,
    INT64_MIN,
    PYTHON_TYPES,
    REQUIRED_FIELDS,
    Action,
    Malformed,
    bound_identities,
    bounded_text,
    json_type_name,
    validate_record,
)

# The Python types orjson gives for each typed field, from the table validate_record reads:
# a record passes well_formed exactly when validate_record finds nothing.
_ACCEPTED: Final[dict[str, frozenset[type]]] = {
    name: PYTHON_TYPES[kind] for name, kind in FIELD_TYPES.items() if kind != "any"
}


def well_formed(record: dict[str, Any]) -> bool:
    """Whether ``validate_record`` finds nothing in a parsed object: the required fields are
    non-empty strings and every known field has its type (or is null). The check every
    well-formed line pays, so it is written for speed; validate_record says what is wrong."""
    for name in REQUIRED_FIELDS:
        value = record.get(name)
        if type(value) is not str or not value:
            return False
    accepted = _ACCEPTED
    for name, value in record.items():
        types = accepted.get(name)
        if types is not None and value is not None:
            kind = type(value)
            # An int past 64 bits (orjson gives up to 2**64-1) goes to validate_record's message.
            if kind not in types or (kind is int and not INT64_MIN <= value <= INT64_MAX):
                return False
            if kind is str and len(value) > IDENTITY_MAX_CHARS:
                return False  # parsed_line replaces it by its bounded form
    return True


# A typed line is decoded in C by msgspec (types checked while parsing) into a struct: one
# attribute per known field, ``UNSET`` when absent. What the strict decoder accepts is a
# subset of what ``orjson.loads`` + ``well_formed`` accept, with the same values:
# - no field outside the known ones and those the caller names (``forbid_unknown_fields``), so
#   every value is decoded in full, none skipped: a string must be valid UTF-8 without lone
#   surrogates, a number must fit a double, as orjson demands;
# - required fields are non-empty strings, typed fields their type or null (a bool is never
#   an int, a float never an int), integers within 64 bits, as ``well_formed`` demands;
# - a repeated key keeps its last value, as with orjson; if any of its values has the wrong
#   type the line is refused (the general path then judges the last one).
# One difference remains, in values nobody types: an integer beyond 64 bits inside an ``any``
# field (``result``, a named extra) stays an int where orjson gives a float. A caller may
# read such a field with ``has()`` only (the action-log lane checks this before using it).
# The lenient decoder takes other fields too, skipping their values without the checks
# above: a line it accepts is exact only once ``orjson.loads`` has accepted it as well.
# Only lines of at most TYPED_LINE_MAX_BYTES are given to them: such a line cannot nest past
# orjson's limit of 1,024 levels (each level takes two bytes), so all refuse the same depths
# whatever the Python version's recursion limit.
TYPED_LINE_MAX_BYTES: Final = 2_000


class TypedDecoders(NamedTuple):
    """``strict(raw)`` / ``lenient(raw)`` give a typed line or raise ValueError or RecursionError."""

    strict: Callable[[bytes], Any]
    lenient: Callable[[bytes], Any]  # exact once orjson.loads accepts the same line
    unset: Any  # an absent field's value


def typed_decoder(extra_fields: Iterable[str] = ()) -> TypedDecoders:
    """Decoders of typed lines of at most TYPED_LINE_MAX_BYTES (longer lines take the general path).

    ``extra_fields``: names outside FIELD_TYPES the caller reads; they take any JSON value.
    The struct's attributes are the known fields then the extras; an absent one is ``unset``,
    a null one ``None``.
    """
    from typing import Annotated, Union

    import msgspec

    # A value, not a type alias: annotated so that a compiled build (mypyc) keeps it as one.
    int64: Any = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]
    # A text longer than IDENTITY_MAX_CHARS is refused here: the general path bounds it (parsed_line).
    text: Any = Annotated[str, msgspec.Meta(max_length=IDENTITY_MAX_CHARS)]
    types: dict[str, Any] = {
        "str": text,
        "int": int64,
        "number": Union[int64, float],  # noqa: UP007 (a runtime type expression for msgspec)
        "bool": bool,
        "str|int": Union[text, int64],  # noqa: UP007
    }
    unset = msgspec.UnsetType
    fields: list[Any] = [(name, Annotated[str, msgspec.Meta(min_length=1, max_length=IDENTITY_MAX_CHARS)])
                         for name in REQUIRED_FIELDS]
    for name, word in FIELD_TYPES.items():
        if name in REQUIRED_FIELDS:
            continue
        kind = Any if word == "any" else Union[types[word], None]  # noqa: UP007
        fields.append((name, Union[kind, unset], msgspec.UNSET))  # noqa: UP007
    for name in sorted(set(extra_fields) - set(FIELD_TYPES)):
        fields.append((name, Union[Any, unset], msgspec.UNSET))  # noqa: UP007
    strict = msgspec.defstruct("TypedLine", fields, forbid_unknown_fields=True, gc=False)
    # The same attributes, the same class of value for generated code: a subclass.
    lenient = msgspec.defstruct("OpenTypedLine", [], bases=(strict,), forbid_unknown_fields=False, gc=False)
    return TypedDecoders(msgspec.json.Decoder(strict).decode, msgspec.json.Decoder(lenient).decode, msgspec.UNSET)


def _id_or_empty(record: dict[str, Any], name: str) -> str:
    value = record.get(name)
    return bounded_text(value) if isinstance(value, str) else ""


def parse_line(raw: bytes, origin: str, line: int, seq: int = 0) -> Action | Malformed | None:
    """``raw`` is one physical line (its newline optional); ``line`` is 1-based.

    Returns None for a blank line or a comment (first non-blank character ``#``).
    """
    stripped = raw.strip()
    if not stripped or stripped[:1] == b"#":
        return None
    try:
        parsed = orjson.loads(stripped)
    except orjson.JSONDecodeError as exc:
        return unparsed_line(raw, stripped, exc, origin, line)
    return parsed_line(parsed, origin, line, seq)


def unparsed_line(
    raw: bytes, stripped: bytes, error: orjson.JSONDecodeError, origin: str, line: int
) -> Malformed | None:
    """``parse_line(raw)`` when ``orjson.loads(stripped)`` raised ``error`` (``stripped`` is ``raw.strip()``):
    the same item, without parsing again."""
    if not stripped or stripped[:1] == b"#":
        return None
    return Malformed(_json_problem(raw, error), origin=origin, line=line, source="log")


def _json_problem(raw: bytes, exc: orjson.JSONDecodeError) -> str:
    if "UTF-8" in exc.msg:
        return "line is not valid UTF-8"
    # orjson's column counts from the stripped text; report it on the physical line.
    column = exc.colno + (len(raw) - len(raw.lstrip()))
    return f"not valid JSON ({exc.msg}) at column {column}"


def parsed_line(parsed: Any, origin: str, line: int, seq: int = 0) -> Action | Malformed:
    """``parse_line`` after the JSON parse: what a line whose text parsed as ``parsed`` becomes."""
    if not isinstance(parsed, dict):
        return Malformed(
            f"a line must be a JSON object, got {json_type_name(parsed)}", origin=origin, line=line, source="log"
        )
    problems = validate_record(parsed)
    if problems:
        return Malformed(
            "; ".join(problems),
            origin=origin,
            line=line,
            session_id=_id_or_empty(parsed, "session_id"),
            action_id=_id_or_empty(parsed, "action_id"),
            source="log",
        )
    bound_identities(parsed)
    when = parsed.get("time")
    return Action(
        record=parsed,
        source="log",
        origin=origin,
        line=line,
        time_ns=parse_rfc3339(when) if isinstance(when, str) else None,
        seq=seq,
    )


def parse_lines(
    raw_lines: Sequence[bytes], origin: str, first_line: int, seq: int, out: list[Action | Malformed]
) -> int:
    """``parse_line`` over consecutive lines, appending to ``out``; returns the next ``seq``.

    The same items as calling parse_line line by line (``seq`` counting actions), at a
    fraction of the cost: a well-formed line takes one orjson call, one pass over its
    fields and the Action; anything else (blank, comment, bad JSON, a problem) goes
    through parse_line for its message.
    """
    loads = orjson.loads
    decode_error = orjson.JSONDecodeError
    append = out.append
    number = first_line - 1
    # Agents write many lines a second: a time equal to the previous line's is parsed once.
    last_when: str | None = None
    last_t: int | None = None
    for raw in raw_lines:
        number += 1
        try:
            record = loads(raw)
        except decode_error:
            record = None
        if type(record) is dict and well_formed(record):
            when = record.get("time")
            if type(when) is str:
                if when != last_when:
                    last_when, last_t = when, parse_rfc3339(when)
                t = last_t
            else:
                t = None
            append(Action(record, "log", origin, number, t, seq))
            seq += 1
            continue
        item = parse_line(raw, origin, number, seq)
        if item is not None:
            if isinstance(item, Action):
                seq += 1
            append(item)
    return seq
