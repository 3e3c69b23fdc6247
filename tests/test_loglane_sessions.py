"""The action-log lane with session rules gives the full engine's report exactly.

With every shipped pack (the default) the lane runs the session rules (sequence, change,
count, absence) on the engine's own handlers and state, a line at a time, while it runs the
condition and file rules as generated code. Violations a session rule reports on an earlier
line (a wait that fires at its deadline, or when the next action is not what it waited for)
are merged into the report's order when it is written.

Each test compares the lane (replay as users get it) with ``--full-engine`` on the same
input: random logs of the shape the session rules read (keys, waits, approvals, plan
versions, attempts, times that go back and forth), text and JSON, one input or two, several
allowed latenesses; then, on the engine's API, the bounds the lane shares with the engine
(groups per rule, fired waits per session, remembered entries).
"""

from __future__ import annotations

import io
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Final

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from processor import cli
from processor.evaluate.engine import Engine, EngineOptions
from processor.evaluate.loglane import LogLane
from processor.evaluate.rulefmt import load_rules
from processor.pipeline import Pipeline
from processor.receive.files import read_batches
from processor.report import Report, render_text, write_json
from tests.test_skill_parity import _odd_line

_EXAMPLES: Final = int(os.environ.get("LANE_EXAMPLES", "60"))
_BASE_S: Final = 1_767_225_600  # 2026-01-01T00:00:00Z


def _time(offset_s: int) -> str:
    seconds = _BASE_S + offset_s
    hours, rest = divmod(seconds % 86_400, 3600)
    day = 1 + (seconds - _BASE_S) // 86_400
    return f"2026-01-{day:02d}T{hours:02d}:{rest // 60:02d}:{rest % 60:02d}Z"


_session_record = st.fixed_dictionaries(
    {
        "session_id": st.sampled_from(["s1", "s2", "s3"]),
        "action_id": st.sampled_from(["a1", "a2", "a3", "a4"]),
        "kind": st.sampled_from(["payment", "email", "llm_call", "user_prompt", "approval", "checkpoint",
                                 "tool_call", "write"]),
        "status": st.sampled_from(["ok", "ok", "error", "OK"]),
    },
    optional={
        # Times a few minutes apart, within the hour: deadlines pass in the middle of the log;
        # they go back as well as forward (logs are not sorted by time).
        "time": st.integers(0, 5400).map(_time),
        "workflow_state": st.sampled_from(["awaiting_approval", "waiting_on_external", "executing", "completed",
                                           "planned", "paused"]),
        "wait_timeout_s": st.sampled_from([0, 60, 600, 3000, None]),
        "approval_decision": st.sampled_from(["granted", "denied", None, "maybe"]),
        "plan_version": st.sampled_from([1, 2, "1", "v2", None]),
        "idempotency_key": st.sampled_from(["k1", "k2", "", None, "2026-01-01T00:00:00Z"]),
        "input_fingerprint": st.sampled_from(["f1", "f2", ""]),
        "replayed": st.booleans(),
        "side_effects": st.booleans(),
        "retryable": st.booleans(),
        "attempts": st.integers(0, 4),
        "max_attempts": st.sampled_from([1, 2, 3, None]),
        "on_failure": st.sampled_from(["ask_user", "abort", "", "retry"]),
        "result": st.just({"ok": True}),
    },
)
_session_line = st.one_of(*[_session_record.map(orjson.dumps)] * 6, _odd_line)
_session_logs = st.lists(_session_line, min_size=1, max_size=40)


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _both(args: list[str], capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> str:
    """The lane's report (which must not have given way) and the engine's are the same."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="durable_check.replay"):
        lane = _run(["replay", *args], capsys)
    assert not [r for r in caplog.records if "running the full engine" in r.getMessage()]
    engine = _run(["replay", "--full-engine", *args], capsys)
    assert lane == engine
    assert lane[0] in (0, 1), lane[2]
    return lane[1]


def _write(directory: str, name: str, lines: list[bytes]) -> str:
    path = Path(directory) / name
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return str(path)


def test_the_shipped_packs_together_run_in_the_lane() -> None:
    lane = LogLane(Engine(load_rules([])))
    assert lane.usable, lane.reason
    assert lane._session_rules and lane._late_possible
    # Every condition is generated code, DS103's call of timeDerived included; the session
    # rules read orjson's dict, and so does the generated check.
    assert lane._generated.fallback == 0
    assert lane._typed is None and lane._decode is None


def _odd_values_log() -> list[bytes]:
    """Lines with fields no rule names whose values orjson refuses or reads otherwise (a typed
    decoder that skips such fields would take them), among lines that open, repeat and wait in
    several sessions."""
    def line(session: str, action: str, kind: str, offset_s: int, extra: bytes = b"", **fields: Any) -> bytes:
        record: dict[str, Any] = {"session_id": session, "action_id": action, "kind": kind, "status": "ok",
                                  "time": _time(offset_s), **fields}
        raw = orjson.dumps(record)
        return raw[:-1] + b"," + extra + b"}" if extra else raw

    return [
        line("s1", "a1", "payment", 0, idempotency_key="k1"),
        line("s1", "a1", "payment", 5, b'"model":"\\ud800"', idempotency_key="k1"),  # a lone surrogate
        line("s2", "a2", "payment", 6, idempotency_key="k2"),
        line("s2", "a2", "payment", 7, b'"model":"\xff"', idempotency_key="k2"),  # not UTF-8
        line("s1", "a3", "tool_call", 8, b'"model":1e400'),  # infinity for orjson: refused
        line("s1", "a3", "tool_call", 9, b'"model":123456789012345678901234567890'),  # a float for orjson
        line("s3", "w1", "approval", 10, b'"cost":[1,{"x":null}]', workflow_state="awaiting_approval",
             wait_timeout_s=60),
        line("s2", "a2", "payment", 20, b'"note":"\\u00e9t\\u00e9"', idempotency_key="k-changed"),
        line("s3", "a9", "llm_call", 200, b'"model":"m"'),
        line("s1", "a1", "payment", 210, b'"model":"\\ud83d\\ude00"', idempotency_key="k1", replayed=True),
        line("s2", "a4", "payment", 220, b'"result":123456789012345678901234567890', idempotency_key="2026-01-01"),
    ]


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_lines_orjson_refuses_or_reads_otherwise_give_the_engine_report(
    fmt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    lines = _odd_values_log()
    assert b"\\ud800" in lines[1] and bytes([0xFF]) in lines[3]
    log = _write(str(tmp_path), "odd.jsonl", lines)
    out = _both(["--format", fmt, log], capsys, caplog)
    # The refused lines are malformed (DS000), the others are judged, the session rules included.
    for rule in ("DS000", "DS101", "DS102", "DS103", "DS107"):
        assert rule in out, rule


@pytest.mark.parametrize("lateness", [[], ["--allowed-lateness", "0s"], ["--allowed-lateness", "1h"]],
                         ids=["default-lateness", "lateness-0", "lateness-1h"])
@pytest.mark.parametrize("fmt", ["text", "json"])
@settings(max_examples=_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=_session_logs, split=st.integers(0, 40))
def test_every_pack_gives_the_engine_report(
    lines: list[bytes], split: int, *, fmt: str, lateness: list[str], capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Random logs, read as one input and as two (sessions continue across them)."""
    with tempfile.TemporaryDirectory() as directory:
        whole = _write(directory, "actions.jsonl", lines)
        _both(["--format", fmt, *lateness, whole], capsys, caplog)
        cut = min(split, len(lines))
        first = _write(directory, "first.jsonl", lines[:cut])
        second = _write(directory, "second.jsonl", lines[cut:])
        _both(["--format", fmt, *lateness, first, second], capsys, caplog)


def _waits_log() -> list[bytes]:
    """Waits that fire every way there is, among lines of other sessions, with condition-rule
    violations on the same lines as session-rule ones."""
    def line(session: str, action: str, kind: str, offset_s: int | None, **fields: Any) -> bytes:
        record: dict[str, Any] = {"session_id": session, "action_id": action, "kind": kind, "status": "ok"}
        if offset_s is not None:
            record["time"] = _time(offset_s)
        record.update(fields)
        return orjson.dumps(record)

    lines = [
        # s1: a wait with a 60 s deadline that passes while other sessions write (the watermark fires it).
        line("s1", "w1", "approval", 0, workflow_state="awaiting_approval", wait_timeout_s=60),
        # s2: an exhausted action whose next action does not escalate (DS105 at the next line of s2).
        line("s2", "p1", "payment", 10, status="error", attempts=3, max_attempts=3, idempotency_key="k-p1"),
        line("s3", "e1", "email", 20),  # DS002 (no key) on a line between
        line("s2", "p2", "payment", 30),  # DS105 on p1 (line 2) fires here; DS002 on this line
        line("s3", "e2", "email", 200),  # the watermark passes s1's deadline: DS107 on line 1
        # s1's wait is resolved after it fired: a late resolution.
        line("s1", "w1", "approval", 210, approval_decision="granted"),
        # s3: a wait whose deadline is after the last event time: it stays open.
        line("s3", "w3", "approval", 220, workflow_state="waiting_on_external", wait_timeout_s=3000),
        # s2: the same key for another action (DS104) and a changed key (DS102) on one line.
        line("s2", "p1", "payment", 230, idempotency_key="k-other"),
        line("s2", "p3", "payment", 240, idempotency_key="k-other"),
        # s1: a wait whose deadline passes before the session's own next line, earlier in time
        # than the latest event (fired by the session's next record), then its next line.
        line("s1", "w4", "approval", 100, workflow_state="awaiting_approval", wait_timeout_s=60),
        line("s1", "x1", "tool_call", 300),
        b"{broken",
        line("s1", "x2", "llm_call", None),  # an untimed line
    ]
    return lines


@pytest.mark.parametrize("fmt", ["text", "json"])
@pytest.mark.parametrize("lateness", ["5s", "0s", "1h"])
def test_waits_that_fire_late_are_reported_in_the_engines_order(
    fmt: str, lateness: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    log = _write(str(tmp_path), "waits.jsonl", _waits_log())
    out = _both(["--format", fmt, "--allowed-lateness", lateness, log], capsys, caplog)
    if fmt == "json":
        report = orjson.loads(out)
        rules = {(v["line"], v["rule"]) for v in report["violations"]}
        assert {(2, "DS105"), (1, "DS107"), (10, "DS107")} <= rules
        assert [w["action_id"] for w in report["open_waits"]] == ["w3"]
        lines = [(v["line"], v["rule"]) for v in report["violations"]]
        assert lines == sorted(lines, key=lambda entry: entry[0])  # in line order, late ones merged in
        if lateness != "1h":
            assert report["waits_resolved_late"] == 1


def _engine_report(path: str, options: EngineOptions, fmt: str) -> tuple[str, dict[str, int]]:
    """The engine's report of ``path`` and its counters."""
    ruleset = load_rules([])
    pipeline = Pipeline(Engine(ruleset, options))
    report = Report([path])
    for batch in read_batches(path, None, lambda: None):  # type: ignore[arg-type,return-value]
        report.tally(batch.actions, batch.malformed)
        report.add(pipeline.process(batch.items))
    report.add(pipeline.finish())
    report.summary = pipeline.engine.summary()
    counters = dict(pipeline.engine._state.counters)
    try:
        if fmt == "text":
            return render_text(report), counters
        out = io.StringIO()
        write_json(report, out)
        return out.getvalue(), counters
    finally:
        report.close()
        pipeline.engine.close()


def _lane_report(path: str, options: EngineOptions, fmt: str, stretch: int | None = None) -> str:
    lane = LogLane(Engine(load_rules([]), options), fmt)
    assert lane.usable
    if stretch is not None:
        lane.stretch = stretch
    report = Report([path])
    try:
        lane.run([path], None, report, set())
        out = io.StringIO()
        if fmt == "text":
            lane.write_text(out)
        else:
            lane.write_json(out)
    finally:
        lane.close()
    return out.getvalue()


_BOUNDS: Final = {
    "groups-and-fired-waits": EngineOptions(mode="replay", max_groups_per_rule=3, max_fired_waits_per_session=1),
    "remembered-entries": EngineOptions(mode="replay", max_remembered_entries=1000),
}


@pytest.mark.parametrize("stretch", [None, 1000], ids=["stretch-default", "stretch-1000"])
@pytest.mark.parametrize("bound", sorted(_BOUNDS))
@pytest.mark.parametrize("fmt", ["text", "json"])
def test_the_engines_bounds_hold_in_the_lane_as_in_the_engine(
    fmt: str, bound: str, stretch: int | None, tmp_path: Path
) -> None:
    """Groups per rule, fired waits per session and remembered entries: past each bound the
    lane forgets what the engine forgets. It runs the same state, with batches ended at the
    same lines (where the remembered entries are trimmed), whatever length of stretch it reads
    lines by."""
    lines: list[bytes] = []
    for n in range(6000):
        session = f"s{n % 40}"
        record: dict[str, Any] = {"session_id": session, "action_id": f"a{n % 300}", "kind": "payment",
                                  "status": "ok", "idempotency_key": f"k{n % 500}", "time": _time(n // 10)}
        if n % 11 == 0:
            record.update(kind="approval", workflow_state="awaiting_approval", wait_timeout_s=5)
        if n % 13 == 0:
            record.update(approval_decision="granted")
        lines.append(orjson.dumps(record))
    path = _write(str(tmp_path), "bounded.jsonl", lines)
    options = _BOUNDS[bound]
    engine_out, counters = _engine_report(path, options, fmt)
    assert _lane_report(path, options, fmt, stretch) == engine_out
    if bound == "remembered-entries":
        assert counters["entries_dropped"] > 0
    else:
        assert counters["groups_dropped"] > 0
        assert counters["fired_waits_dropped"] > 0


@pytest.mark.parametrize("ids_in_memory", [16_384, 256])
@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_files_ids_move_out_of_the_dict_and_still_find_repeats(fmt: str, ids_in_memory: int, tmp_path: Path) -> None:
    """Past a bound a file's ids leave the dict for FileIds (5 bytes an id in memory, its entries
    on disk past ``ids_in_memory``): repeats of ids seen before the move (short ones and ones
    long enough to be keyed by their digest), after it, and after a malformed line that named
    an id, are all still found; a second input starts with its own ids."""
    def line(n: int, action: str) -> bytes:
        return orjson.dumps({"session_id": f"s{n % 5}", "action_id": action, "kind": "llm_call", "status": "ok"})

    long_id = "x" * 40
    lines = [line(n, f"a{n}") for n in range(300)]
    lines += [line(1, long_id), b'{"session_id": "s1", "action_id": "m1", "kind": 3}']
    lines += [line(n, f"a{n}") for n in (5, 150, 299)]  # repeats of ids put before the move
    lines += [line(n, f"b{n}") for n in range(300)]
    lines += [line(2, long_id), line(3, "m1"), line(4, "b7"), line(4, "b299")]
    first = _write(str(tmp_path), "first.jsonl", lines)
    second = _write(str(tmp_path), "second.jsonl", [line(0, "a5"), line(0, "a5")])
    options = EngineOptions(mode="replay")

    def lane_report(ids_in_dict: int) -> tuple[str, int]:
        lane = LogLane(Engine(load_rules([]), options), fmt)
        lane.ids_in_dict = ids_in_dict
        lane.ids_in_memory = ids_in_memory
        lane.stretch = 64  # the bound is looked at after each stretch of lines
        report = Report([first, second])
        try:
            lane.run([first, second], None, report, set())
            out = io.StringIO()
            if fmt == "text":
                lane.write_text(out)
            else:
                lane.write_json(out)
            return out.getvalue(), lane.ids_moved
        finally:
            lane.close()
            # With few entries in memory, the moved ids' older blocks were on disk.
            assert (lane.ids_on_disk > 0) is (lane.ids_moved > 0 and ids_in_memory < 500)

    engine = Engine(load_rules([]), options)
    pipeline = Pipeline(engine)
    report = Report([first, second])
    for path in (first, second):
        for batch in read_batches(path, None, lambda: None):  # type: ignore[arg-type,return-value]
            report.tally(batch.actions, batch.malformed)
            report.add(pipeline.process(batch.items))
    report.add(pipeline.finish())
    report.summary = engine.summary()
    if fmt == "text":
        expected = render_text(report)
    else:
        out = io.StringIO()
        write_json(report, out)
        expected = out.getvalue()
    assert lane_report(100) == (expected, 1)  # the first input's ids moved; the second's are few
    assert lane_report(1 << 20) == (expected, 0)
    assert report.violations_by_rule["DS009"] == 8
