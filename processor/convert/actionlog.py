"""One line of the durable-sessions skill's action log becomes an Action.

A line is a JSON object in the skill's field names, so the parsed dict *is* the
record; nothing is renamed or dropped (extra fields such as ``prompt`` or ``model``
ride along for the rules that want them).
"""

from __future__ import annotations

from typing import Any

import orjson

from processor.convert.timefmt import parse_rfc3339
from processor.records import Action, Malformed, json_type_name, validate_record


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
