"""parse_line: the durable-sessions skill's action-log lines become Actions or Malformed items."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from processor.convert import parse_line
from processor.convert.actionlog import parse_lines
from processor.records import FIELD_TYPES, REQUIRED_FIELDS, Action, Malformed

SEEDS = Path(__file__).parent / "testdata" / "readers"


@pytest.mark.parametrize("raw", [b"", b"\n", b"   \t \r\n", b"# comment\n", b"   # indented comment"])
def test_blank_and_comment_lines_are_skipped(raw: bytes) -> None:
    assert parse_line(raw, "log.jsonl", 3, 0) is None


def test_a_record_is_the_parsed_object() -> None:
    raw = b'{"session_id":"s","action_id":"a1","kind":"llm_call","status":"ok","model":"main","result":null}\n'
    item = parse_line(raw, "log.jsonl", 7, 12)
    assert isinstance(item, Action)
    assert item.record == {
        "session_id": "s",
        "action_id": "a1",
        "kind": "llm_call",
        "status": "ok",
        "model": "main",
        "result": None,
    }
    assert list(item.record) == ["session_id", "action_id", "kind", "status", "model", "result"]
    assert (item.source, item.origin, item.line, item.seq) == ("log", "log.jsonl", 7, 12)
    assert item.time_ns is None and item.delivery_key is None and not item.synthetic_action_id


@pytest.mark.parametrize(
    ("time", "expected"),
    [
        ("2026-11-01T09:14:00Z", 1_793_524_440_000_000_000),
        ("2026-11-01T10:14:00.000000250+01:00", 1_793_524_440_000_000_250),
        ("not a time", None),
        (1_793_524_440, None),
    ],
)
def test_time_ns_comes_from_an_rfc3339_time(time: object, expected: int | None) -> None:
    import orjson

    record = {"session_id": "s", "action_id": "a", "kind": "clock", "status": "ok", "time": time}
    item = parse_line(orjson.dumps(record), "f", 1, 0)
    if isinstance(time, str):
        assert isinstance(item, Action) and item.time_ns == expected
    else:
        assert isinstance(item, Malformed) and "field time must be a string, got an integer" in item.message


def test_invalid_json_names_the_column_of_the_physical_line() -> None:
    item = parse_line(b'   {"session_id": "s", nope}', "f.jsonl", 4, 0)
    assert isinstance(item, Malformed)
    assert (item.origin, item.line, item.source) == ("f.jsonl", 4, "log")
    assert item.message.startswith("not valid JSON (") and item.message.endswith("at column 24")


def test_invalid_utf8_is_malformed() -> None:
    item = parse_line(b'{"session_id":"s\xff","action_id":"a","kind":"x","status":"ok"}', "f", 2, 0)
    assert isinstance(item, Malformed) and item.message == "line is not valid UTF-8"


@pytest.mark.parametrize(("raw", "word"), [(b"[1, 2]", "an array"), (b'"text"', "a string"), (b"42", "an integer")])
def test_not_an_object(raw: bytes, word: str) -> None:
    item = parse_line(raw, "f", 1, 0)
    assert isinstance(item, Malformed) and item.message == f"a line must be a JSON object, got {word}"


def test_missing_and_mistyped_fields_are_named_without_values() -> None:
    item = parse_line(b'{"session_id":"s-1","kind":"write","status":"ok","max_attempts":"SECRET-3"}', "f", 9, 0)
    assert isinstance(item, Malformed)
    assert "missing required field action_id" in item.message
    assert "field max_attempts must be an integer, got a string" in item.message
    assert "SECRET" not in item.message
    assert (item.session_id, item.action_id) == ("s-1", "")


def test_empty_required_field_counts_as_missing() -> None:
    item = parse_line(b'{"session_id":"","action_id":"a","kind":"x","status":"ok"}', "f", 1, 0)
    assert isinstance(item, Malformed) and item.message == "missing required field session_id"


def test_the_skill_fixture_lines_parse() -> None:
    """Every line of the reader fixture gets the verdict its content calls for."""
    lines = (SEEDS / "actions.jsonl").read_bytes().split(b"\n")
    verdicts = [parse_line(raw, "actions.jsonl", number, 0) for number, raw in enumerate(lines, start=1)]
    kinds = ["-" if v is None else type(v).__name__ for v in verdicts]
    assert kinds == [
        "-",
        "Action",
        "Action",
        "-",
        "-",
        "-",
        "Action",
        "Malformed",
        "Malformed",
        "Malformed",
        "Malformed",
        "Malformed",
        "Action",
        "Malformed",
        "Action",
        "-",
    ]
    for verdict in verdicts:
        if isinstance(verdict, Action):
            assert all(verdict.record.get(field) for field in REQUIRED_FIELDS)


def _lines_for_parse_lines() -> list[bytes]:
    """Lines of every kind parse_line tells apart, each field of each type, good and bad."""
    base = {"session_id": "s", "action_id": "a", "kind": "write", "status": "ok"}
    samples: list[Any] = ["text", "", 0, 3, -1, 2.5, 4.0, True, False, None, [1], {"k": 1}]
    lines = [
        b"",
        b"   ",
        b"# a comment",
        b"  # indented comment",
        b"\xef\xbb\xbf" + orjson.dumps(base),
        orjson.dumps(base) + b"\r",
        b"\t" + orjson.dumps(base) + b" \x0c",
        b"{not json",
        b'{"session_id": "s",}',
        b"\xff\xfe",
        b"[1, 2]",
        b"42",
        b'"a string"',
        b"null",
        orjson.dumps(base) + b" trailing",
        orjson.dumps({**base, "time": "2026-11-01T09:14:00.25Z"}),
        orjson.dumps({**base, "time": "2026-11-01T10:14:00+01:00"}),
        orjson.dumps({**base, "time": "yesterday"}),
        orjson.dumps({**base, "time": 1_793_524_440}),
        orjson.dumps({**base, "prompt": "extra fields ride along", "nested": {"deep": [1, 2]}}),
    ]
    for name in REQUIRED_FIELDS:
        lines.append(orjson.dumps({k: v for k, v in base.items() if k != name}))
    for name in FIELD_TYPES:
        for value in samples:
            lines.append(orjson.dumps({**base, name: value}))
    return lines


def test_parse_lines_gives_what_parse_line_gives_line_by_line() -> None:
    lines = _lines_for_parse_lines()
    expected: list[Action | Malformed] = []
    seq = 5
    for number, raw in enumerate(lines, start=10):
        item = parse_line(raw, "log.jsonl", number, seq)
        if item is not None:
            seq += isinstance(item, Action)
            expected.append(item)
    out: list[Action | Malformed] = []
    next_seq = parse_lines(lines, "log.jsonl", 10, 5, out)
    assert out == expected
    assert next_seq == seq
    kinds = {type(item) for item in out}
    assert kinds == {Action, Malformed}, "the sample holds both good and bad lines"
