"""One line of the durable-sessions skill's action log becomes an Action.

A line is a JSON object in the skill's field names, so the parsed dict *is* the
record; nothing is renamed or dropped (extra fields such as ``prompt`` or ``model``
ride along for the rules that want them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import orjson

from processor.convert.timefmt import parse_rfc3339
from processor.records import (
    FIELD_TYPES,
    INT64_MAX,
    INT64_MIN,
    REQUIRED_FIELDS,
    Action,
    Malformed,
    json_type_name,
    validate_record,
)

# The Python types orjson gives for each typed field, from the same table validate_record
# reads: a record passes this check exactly when validate_record finds nothing.
_PYTHON_TYPES: Final[dict[str, tuple[type, ...]]] = {
    "str": (str,),
    "int": (int,),
    "number": (int, float),
    "bool": (bool,),
    "str|int": (str, int),
}
_ACCEPTED: Final[dict[str, frozenset[type]]] = {
    name: frozenset(_PYTHON_TYPES[kind]) for name, kind in FIELD_TYPES.items() if kind != "any"
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
    return True


def _id_or_empty(record: dict[str, Any], name: str) -> str:
    value = record.get(name)
    return value if isinstance(value, str) else ""


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
        if "UTF-8" in exc.msg:
            message = "line is not valid UTF-8"
        else:
            # orjson's column counts from the stripped text; report it on the physical line.
            column = exc.colno + (len(raw) - len(raw.lstrip()))
            message = f"not valid JSON ({exc.msg}) at column {column}"
        return Malformed(message, origin=origin, line=line, source="log")
    return parsed_line(parsed, origin, line, seq)


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
    for raw in raw_lines:
        number += 1
        try:
            record = loads(raw)
        except decode_error:
            record = None
        if type(record) is dict and well_formed(record):
            when = record.get("time")
            append(Action(record, "log", origin, number, parse_rfc3339(when) if type(when) is str else None, seq))
            seq += 1
            continue
        item = parse_line(raw, origin, number, seq)
        if item is not None:
            if isinstance(item, Action):
                seq += 1
            append(item)
    return seq
