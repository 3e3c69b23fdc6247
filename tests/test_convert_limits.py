"""Values at and past the 64-bit limits: times, counts and timeouts from logs and spans."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import orjson
import pytest

from processor import cli
from processor.convert import SpanConverter, parse_line
from processor.convert.actionlog import parse_lines
from processor.convert.timefmt import parse_rfc3339
from processor.records import Action, Malformed
from tests._engine_util import T0, Spans, rules_from, run
from tests._spans import SpanSpec, request

INT64_MAX = 2**63 - 1


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0000-01-01T00:00:00Z", None),
        ("0001-01-01T00:00:00Z", None),
        ("9999-12-31T23:59:59Z", None),
        ("1677-09-21T00:12:43.145224191Z", None),
        ("1677-09-21T00:12:43.145224192Z", -(2**63)),
        ("2262-04-11T23:47:16.854775807Z", INT64_MAX),
        ("2262-04-11T23:47:16.854775808Z", None),
        ("2262-04-11T23:47:17+00:00", None),
        ("2262-04-12T00:17:16+00:30", INT64_MAX - 854_775_807),
        ("\uff12\uff10\uff12\uff16-11-01T09:14:00Z", None),  # full-width digits
        ("2026-11-01T09:14:00Z", T0),
    ],
)
def test_times_outside_the_64_bit_range_are_unknown(text: str, expected: int | None) -> None:
    assert parse_rfc3339(text) == expected


def _log_line(**fields: Any) -> bytes:
    return orjson.dumps({"session_id": "s", "action_id": "a", "kind": "retry", "status": "ok", **fields})


@pytest.mark.parametrize("when", ["0000-01-01T00:00:00Z", "9999-12-31T23:59:59Z", "0001-01-01T00:00:00Z"])
def test_an_extreme_log_time_is_an_action_without_a_time(when: str) -> None:
    item = parse_line(_log_line(time=when), "log", 1)
    assert isinstance(item, Action) and item.time_ns is None


@pytest.mark.parametrize("number", [b"18446744073709551615", b"100000000000000000000", b"9223372036854775808"])
def test_log_integers_past_64_bits_are_malformed_in_both_parsers(number: bytes) -> None:
    raw = _log_line(attempts=0).replace(b'"attempts":0', b'"attempts":' + number)
    item = parse_line(raw, "log", 1)
    assert isinstance(item, Malformed)
    assert item.message == "field attempts must be an integer within the signed 64-bit range"
    out: list[Action | Malformed] = []
    parse_lines([raw], "log", 1, 0, out)
    assert [type(i) for i in out] == [Malformed] and out[0].message == item.message


def test_the_largest_64_bit_integer_is_kept() -> None:
    item = parse_line(_log_line(attempts=INT64_MAX), "log", 1)
    assert isinstance(item, Action) and item.record["attempts"] == INT64_MAX


def _span_item(attributes: dict[str, Any], start_ns: int = T0) -> Action | Malformed:
    spec = SpanSpec("step", {"durable.action.kind": "approval", **attributes}, start_ns=start_ns)
    (item,) = SpanConverter().convert(request(({}, [spec])), "test").items
    return item


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_span_numbers_are_malformed(value: float) -> None:
    item = _span_item({"durable.wait.timeout_s": value})
    assert isinstance(item, Malformed)
    assert "durable.wait.timeout_s must be a number, got a non-finite double (NaN or infinity)" in item.message


@pytest.mark.parametrize("value", [1e300, -1e300, 2.0**63])
def test_whole_doubles_past_64_bits_are_not_integers(value: float) -> None:
    item = _span_item({"durable.retry.attempt": value})
    assert isinstance(item, Malformed)
    assert "durable.retry.attempt must be an integer, got a double beyond the 64-bit integer range" in item.message


def test_the_largest_whole_double_below_2_63_is_an_integer() -> None:
    value = math.nextafter(2.0**63, 0)
    item = _span_item({"durable.retry.attempt": value})
    assert isinstance(item, Action) and item.record["attempts"] == int(value)


def test_a_span_start_past_the_signed_range_has_no_time() -> None:
    item = _span_item({}, start_ns=2**64 - 10**7)
    assert isinstance(item, Action) and item.time_ns is None and "time" not in item.record


WAIT_RULE = """\
version: 1
rules:
  - id: X001
    name: wait-deadline
    severity: error
    type: absence
    first: has(record.workflow_state) && record.workflow_state == "awaiting_approval"
    deadline: record.wait_timeout_s
    then: has(record.approval_decision)
    message: "{{ record.action_id }} waited too long"
"""


@pytest.mark.parametrize("timeout", [1e300, 7.4e9, 2**64 - 1, math.inf])
def test_huge_wait_timeouts_cap_the_deadline_inside_64_bits(tmp_path: Path, timeout: float) -> None:
    span = Spans()
    items = [
        span(0, action_id="w", workflow_state="awaiting_approval", wait_timeout_s=timeout),
        span(10, action_id="later"),
    ]
    violations, engine = run(rules_from(tmp_path, WAIT_RULE), items, allowed_lateness_s=0.0, mode="replay")
    assert violations == []
    (wait,) = engine.summary().open_waits
    assert wait.deadline_ns is not None and T0 < wait.deadline_ns <= INT64_MAX
    assert wait.deadline_ns == T0 + 100 * 31_557_600 * 10**9


def test_a_wait_near_the_end_of_time_stops_at_the_largest_time(tmp_path: Path) -> None:
    span = Spans()
    late = span(0, action_id="w", workflow_state="awaiting_approval", wait_timeout_s=1e300)
    late.time_ns = INT64_MAX - 10
    for mode in ("replay", "serve"):
        _, engine = run(rules_from(tmp_path, WAIT_RULE), [late], allowed_lateness_s=5.0, mode=mode)
        (wait,) = engine.summary().open_waits
        assert wait.deadline_ns == INT64_MAX


def test_replay_json_survives_extreme_times_and_timeouts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "extreme.jsonl"
    records = [
        {"session_id": "s", "action_id": "w", "kind": "approval_request", "status": "ok",
         "workflow_state": "awaiting_approval", "wait_timeout_s": 1e300, "time": "2026-11-01T09:14:00Z"},
        {"session_id": "s", "action_id": "t1", "kind": "tool_call", "status": "ok", "time": "9999-12-31T23:59:59Z"},
        {"session_id": "s", "action_id": "t2", "kind": "tool_call", "status": "ok", "time": "0000-01-01T00:00:00Z"},
        {"session_id": "s", "action_id": "t3", "kind": "tool_call", "status": "ok", "time": "0001-01-01T00:00:00Z"},
    ]  # fmt: skip
    log.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    code = cli.main(["replay", "--format", "json", str(log)])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    report = orjson.loads(captured.out)
    assert report["malformed"] == 0
    assert code in (0, 1)
    code = cli.main(["convert", "-o", str(tmp_path / "out.jsonl"), str(log)])
    assert code == 0 and "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("number", [b"NaN", b"Infinity", b"-Infinity", b"1e400"])
def test_non_finite_log_numbers_are_not_json(number: bytes) -> None:
    raw = _log_line(wait_timeout_s=0).replace(b'"wait_timeout_s":0', b'"wait_timeout_s":' + number)
    item = parse_line(raw, "log", 1)
    assert isinstance(item, Malformed) and item.message.startswith("not valid JSON (")
