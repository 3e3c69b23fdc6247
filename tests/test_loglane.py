"""The action-log lane gives the full engine's report exactly (processor.evaluate.loglane).

Every test runs ``replay`` twice on the same input, once as users get it (the lane, where
it applies) and once with ``--full-engine``, and compares what they print and return:
random logs of the skill's shape in default and strict mode, text and JSON; rule files
whose expressions the generator translates and ones it refuses (their closures run inside
the lane), with rule errors; several inputs; and the inputs the lane gives up on (a
session that would expire or be evicted), where replay starts again on the engine.
"""

from __future__ import annotations

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
from processor.evaluate.cel import Environment, compile_expression, python_source
from processor.evaluate.cel._codegen import SourceContext
from processor.evaluate.functions import time_derived
from processor.evaluate.loglane import LogLane, _check_source
from tests.test_skill_parity import _logs, _odd_line, _record

# Rules the lane must run exactly: translated ones, refused ones (macros, calls, absent
# fields read without has()), ones that fail on some records, a message with every kind of hole.
EXTRA_RULES = """
version: 1
record_fields: [prompt]
rules:
  - id: X001
    name: refused-macro
    severity: warning
    condition: '[1, 2].exists(n, has(record.attempts) && record.attempts == n)'
    message: "{{ record.action_id }} attempts {{ has(record.attempts) ? string(record.attempts) : 'none' }}"
  - id: X002
    name: fails-without-has
    severity: warning
    condition: 'record.attempts > 2'
    message: "{{ record.attempts }} / {{ record.max_attempts }} of {{ record.kind }} at line {{ meta.line }}"
  - id: X003
    name: translated-ordering
    severity: info
    condition: >-
      has(record.ttl_s) && record.ttl_s != null && record.ttl_s >= 50 && record.kind in lists.nondeterministic
    message: "ttl {{ record.ttl_s }} {{ record.cacheable }} {{ record.result }}"
  - id: X004
    name: strings-and-literals
    severity: error
    condition: >-
      record.status == "error" && record.kind != "write" && !(has(record.replay) && record.replay == "skip")
      && record.session_id + "/" + record.action_id != "s1/a1"
    message: "{{ record.session_id + ':' + record.action_id }} {{ meta.source }}"
  - id: X005
    name: matches-runs-its-closure
    severity: warning
    condition: 'record.action_id.matches("^b[0-9]$") && has(record.prompt)'
    message: "prompt {{ record.prompt }}"
"""


# Examples per differential test (LANE_EXAMPLES raises them for a longer local run).
_EXAMPLES = int(os.environ.get("LANE_EXAMPLES", "60"))


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _both(args: list[str], capsys: pytest.CaptureFixture[str], *, readable: bool = True) -> tuple[int, str, str]:
    lane = _run(["replay", *args], capsys)
    engine = _run(["replay", "--full-engine", *args], capsys)
    assert lane == engine
    if readable:
        assert lane[0] in (0, 1), lane[2]  # a report, not a usage error both sides share
        assert lane[1]
    return lane


def _write(directory: str, name: str, lines: list[bytes]) -> str:
    path = Path(directory) / name
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return str(path)


@pytest.mark.parametrize("mode", [[], ["--strict"]], ids=["default", "strict"])
@pytest.mark.parametrize("fmt", ["text", "json"])
@settings(max_examples=_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=_logs)
def test_the_skill_pack_gives_the_engine_report(
    lines: list[bytes], mode: list[str], fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with tempfile.TemporaryDirectory() as directory:
        path = _write(directory, "actions.jsonl", lines)
        _both(["--pack", "durable-sessions", "--format", fmt, *mode, path], capsys)


def test_a_violation_names_its_trace_span_and_service_as_the_engine_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Typed lines read trace_id, span_id and service as attributes (an absent one is the
    decoder's marker), parsed lines as dict entries: both give the engine's violations, field
    for field, whether each is absent, null, empty or set."""
    import itertools

    absent = object()
    values = {"trace_id": [absent, None, "", "4bf92f3577b34da6a3ce929d0e0e4736"],
              "span_id": [absent, None, "", "00f067aa0ba902b7"],
              "service": [absent, None, "", "booker"]}
    lines: list[bytes] = []
    for n, chosen in enumerate(itertools.product(*values.values())):
        record: dict[str, Any] = {"session_id": "s1", "action_id": f"a{n}", "kind": "payment", "status": "ok",
                                  "result": {"id": n}}  # DS002: no idempotency key
        record.update((name, value) for name, value in zip(values, chosen, strict=True) if value is not absent)
        lines.append(orjson.dumps(record))
        lines.append(orjson.dumps({**record, "action_id": f"b{n}", "prompt": "p"}))  # a field no rule reads
    path = _write(str(tmp_path), "traced.jsonl", lines)
    for fmt in ("json", "text"):
        _both(["--pack", "durable-sessions", "--format", fmt, path], capsys)
    _, out, _ = _run(["replay", "--pack", "durable-sessions", "--format", "json", path], capsys)
    violations = orjson.loads(out)["violations"]
    assert len(violations) == len(lines)
    named = [v for v in violations if v.get("trace_id") and v.get("service")]
    assert len(named) == 2 * 4  # a trace and a service set: the span id absent, null, empty or set
    assert sorted(v["span_id"] for v in named) == ["", "", "", "", "", "", "00f067aa0ba902b7", "00f067aa0ba902b7"]


# Lines with whitespace around them (a cut line often ends in a space): parse_line strips them,
# so does the lane, whatever the JSON inside (valid, cut, a comment, nothing).
_pads = st.sampled_from([b" ", b"\t", b"\x0c", b"  \x0b", b"\r"])
_padded_logs = st.lists(
    st.tuples(_pads, st.one_of(_record.map(orjson.dumps), _odd_line), _pads).map(lambda t: t[0] + t[1] + t[2]),
    min_size=1, max_size=25,
)


@pytest.mark.parametrize("fmt", ["text", "json"])
@settings(max_examples=_EXAMPLES // 2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=_padded_logs)
def test_lines_with_whitespace_around_them_read_as_the_engine_reads_them(
    lines: list[bytes], fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with tempfile.TemporaryDirectory() as directory:
        path = _write(directory, "padded.jsonl", lines)
        # Named: a file that starts with a control character is not taken for an action log on sight.
        _both(["--pack", "durable-sessions", "--input-format", "actions", "--format", fmt, path], capsys)


_times = st.sampled_from(["2026-11-01T09:14:00Z", "2026-11-01T09:14:00.5Z", "2026-11-02T00:00:00+02:00", "soon"])
_timed = st.tuples(_record, _times).map(lambda pair: orjson.dumps({**pair[0], "time": pair[1]}))
_more = st.lists(st.one_of(_timed, _record.map(orjson.dumps)), min_size=1, max_size=20)


@pytest.mark.parametrize("fmt", ["text", "json"])
@settings(max_examples=_EXAMPLES * 2 // 3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(first=_more, second=_logs)
def test_translated_and_refused_rules_over_two_inputs(
    first: list[bytes], second: list[bytes], fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with tempfile.TemporaryDirectory() as directory:
        rules = Path(directory) / "extra.yaml"
        rules.write_text(EXTRA_RULES, encoding="utf-8")
        one = _write(directory, "one.jsonl", first)
        two = _write(directory, "two.jsonl", second)
        _both(["--pack", "durable-sessions", "--rules", str(rules), "--format", fmt, one, two], capsys)


def test_rule_errors_are_counted_and_logged_once_as_by_the_engine(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    rules = tmp_path / "extra.yaml"
    rules.write_text(EXTRA_RULES, encoding="utf-8")
    records = [{"session_id": "s1", "action_id": f"a{n}", "kind": "tool_call", "status": "ok"} for n in range(5)]
    records[2]["attempts"] = 3
    log = _write(str(tmp_path), "a.jsonl", [orjson.dumps(r) for r in records])
    with caplog.at_level(logging.WARNING):
        code, out, _ = _both(["--pack", "durable-sessions", "--rules", str(rules), "--format", "json", log], capsys)
    report = orjson.loads(out)
    assert report["rule_errors"] == {"X002": 4}
    assert [v["rule"] for v in report["violations"]] == ["X002"]
    assert code == 1
    assert sum("rule X002" in r.getMessage() for r in caplog.records) == 2  # once per run: lane, then engine


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_report_of_several_spooled_blocks_is_the_engine_report(
    fmt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Thousands of violations: the lane's spool holds several blocks (JSON_BLOCK each) and
    copies them out in pieces; the document is the engine's, byte for byte."""
    from processor.report import JSON_BLOCK

    lines: list[bytes] = []
    for n in range(3 * JSON_BLOCK):
        if n % 7 == 0:
            lines.append(b'{"action_id": "cut-%d", "kind": "payment"' % n)  # DS000, not valid JSON
        else:
            lines.append(orjson.dumps({"session_id": f"s{n % 13}", "action_id": f"a{n}", "kind": "payment",
                                       "status": "ok", "result": {"n": n}}))  # DS002: no idempotency key
    path = _write(str(tmp_path), "many.jsonl", lines)
    code, out, _ = _both(["--pack", "durable-sessions", "--format", fmt, path], capsys)
    assert code == 1
    if fmt == "json":
        document = orjson.loads(out)
        assert len(document["violations"]) == len(lines)
        assert [v["line"] for v in document["violations"]] == list(range(1, len(lines) + 1))
        # Nested where the document's list is: four spaces before each violation's brace.
        listed = out[out.index('"violations": [') : out.index('"unreadable"')]
        assert listed.count("\n    {\n") == len(lines)


def test_the_skill_pack_is_generated_code_through_and_through() -> None:
    from processor.evaluate.engine import Engine
    from processor.evaluate.rulefmt import load_rules

    lane = LogLane(Engine(load_rules([], packs=["durable-sessions"])))
    assert lane.usable
    assert not lane._session_rules
    assert lane._generated.fallback == 0  # every expression of the skill's pack is generated code
    assert lane._typed is not None  # and its lines are read typed


def test_a_log_spanning_the_idle_timeout_goes_back_to_the_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """Sessions idle past the timeout expire in the engine's summary: the lane gives up, replay starts over."""
    def line(session: str, action: str, kind: str, time: str) -> bytes:
        return orjson.dumps({"session_id": session, "action_id": action, "kind": kind, "status": "ok", "time": time})

    lines = [
        line("s1", "a1", "llm_call", "2026-01-01T00:00:00Z"),
        line("s2", "a2", "llm_call", "2026-03-01T00:00:00Z"),
        b"{broken",
        line("s1", "a1", "payment", "2026-03-01T00:00:01Z"),
    ]
    log = _write(str(tmp_path), "a.jsonl", lines)
    with caplog.at_level(logging.INFO, logger="durable_check.replay"):
        code, out, _ = _both(["--pack", "durable-sessions", "--format", "json", log], capsys)
    assert any("idle timeout" in r.getMessage() for r in caplog.records)
    report = orjson.loads(out)
    assert report["sessions_expired"] == 1
    assert sorted(v["rule"] for v in report["violations"]) == ["DS000", "DS001", "DS001", "DS002", "DS009"]
    assert code == 1


def test_more_sessions_than_the_bound_make_the_lane_give_up(tmp_path: Path) -> None:
    """The engine evicts past max_sessions (and says so in its summary): the lane does not model it."""
    from processor.evaluate.engine import Engine, EngineOptions
    from processor.evaluate.loglane import LaneAborted
    from processor.evaluate.rulefmt import load_rules
    from processor.report import Report

    lines = [
        orjson.dumps({"session_id": f"s{n}", "action_id": f"a{n}", "kind": "payment", "status": "ok"}) for n in range(4)
    ]
    log = _write(str(tmp_path), "a.jsonl", lines)
    engine = Engine(load_rules([], packs=["durable-sessions"]), EngineOptions(max_sessions=2))
    lane = LogLane(engine)
    try:
        with pytest.raises(LaneAborted, match="max_sessions"):
            lane.run([log], None, Report([log]), set())
    finally:
        lane.close()


def test_an_unreadable_input_is_said_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = _write(
        str(tmp_path), "a.jsonl", [b'{"session_id": "s", "action_id": "a", "kind": "llm_call", "status": "ok"}']
    )
    code, out, err = _both(
        ["--pack", "durable-sessions", good, str(tmp_path / "missing.jsonl")], capsys, readable=False
    )
    assert code == 2
    assert err.count("missing.jsonl") == 1
    assert out.rstrip().splitlines()[-1].startswith("ERROR: 1 input(s) could not be read")


# -- the generated source ------------------------------------------------------------


_ENV = Environment(
    variables={"record": "map", "meta": "map", "lists": "map", "first": "map"},
    constants={"lists": {"kinds": ["llm_call", "payment"]}},
)
_CONTEXT = SourceContext(maps={}, meta={"source": ("'log'", frozenset({str}))})


def test_a_rule_cannot_inject_code_through_a_literal() -> None:
    """String literals reach the source through repr(): quotes and newlines stay data."""
    from processor.evaluate.loglane import _RECORD

    source = "record.kind == \"');\\nimport os  #\" || record.status == '\\\\n\\\"'"
    expression = compile_expression(source, _ENV)
    assert expression.tree is not None
    context = SourceContext(maps={"record": _RECORD}, meta={})
    written = python_source(expression.tree, expression.constants, context)
    for record in (
        {"kind": "');\nimport os  #", "status": "x"},
        {"kind": "k", "status": '\\n"'},
        {"kind": "k", "status": "ok"},
    ):
        value = eval(compile(f"lambda r: {written.code}", "<test>", "eval"))(record)
        assert value is expression.evaluate({"record": record})


@pytest.mark.parametrize(
    "source",
    [
        "__import__('os').system('true')",
        "().__class__.__bases__[0]",
        "open('/etc/passwd')",
    ],
)
def test_generated_code_is_checked_before_it_is_compiled(source: str) -> None:
    import ast

    with pytest.raises(AssertionError):
        _check_source(ast.parse(f"def check(r, line, t, hits):\n    return {source}\n"), {"r", "line", "t", "hits"})


_values: st.SearchStrategy[Any] = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.floats(-3, 3, allow_nan=False),
    st.sampled_from(["", "llm_call", "payment", "x"]),
)
_EXPRESSIONS = [
    "has(record.attempts) && record.attempts != null && record.attempts > 1",
    "record.kind in lists.kinds || (has(record.retryable) && record.retryable == true)",
    "has(record.ttl_s) && record.ttl_s == 1",
    "has(record.prompt) && record.prompt in lists.kinds",
    "!(has(record.result) && record.result == null) && record.status != 'ok'",
    "meta.source == 'log' || record.attempts > 5",
    "meta.source == 'span' && record.attempts > 5",
    "has(record.wait_timeout_s) && record.wait_timeout_s != null && record.wait_timeout_s >= 1.5",
    "record.kind == 'payment' ? has(record.idempotency_key) : record.status == 'ok'",
    "meta.source == 'span' ? record.attempts > 1 : record.kind in lists.kinds",
    "meta.source == 'log' ? has(record.retryable) && record.retryable == true : record.attempts > 1",
]


@pytest.mark.parametrize("source", _EXPRESSIONS)
@settings(max_examples=150, deadline=None)
@given(
    fields=st.fixed_dictionaries(
        {"kind": st.sampled_from(["llm_call", "payment", "tool_call"]), "status": st.sampled_from(["ok", "error"])},
        optional={"attempts": st.one_of(st.none(), st.integers(-2, 9)),
                  "retryable": st.one_of(st.none(), st.booleans()),
                  "ttl_s": st.one_of(st.none(), st.integers(-1, 3)), "prompt": _values, "result": _values,
                  "wait_timeout_s": st.one_of(st.none(), st.integers(0, 3), st.floats(0, 3, allow_nan=False))},
    )
)  # fmt: skip
def test_generated_expressions_equal_their_closures(source: str, fields: dict[str, Any]) -> None:
    """On validated records (typed fields of their type or null), the source and the closure agree."""
    from processor.evaluate.loglane import _META, _RECORD

    record = {"session_id": "s", "action_id": "a", **fields}
    expression = compile_expression(source, _ENV)
    assert expression.tree is not None
    context = SourceContext(maps={"record": _RECORD}, meta=dict(_META))
    written = python_source(expression.tree, expression.constants, context)
    function = eval(compile(f"lambda r, line, t: {written.code}", "<test>", "eval"), dict(context.constants))
    activation = {"record": record, "meta": {"source": "log", "line": 1, "time_ns": 0, "synthetic_action_id": False},
                  "lists": {"kinds": ["llm_call", "payment"]}}  # fmt: skip
    assert function(record, 1, None) is expression.evaluate(activation)


_DS103 = ("has(record.idempotency_key) && record.idempotency_key != null"
          " && timeDerived(record.idempotency_key, meta.time_ns)")


def _with_functions() -> Environment:
    from processor.evaluate.functions import RULE_FUNCTIONS

    return Environment(variables={"record": "map", "meta": "map"}, functions=RULE_FUNCTIONS)


@settings(max_examples=300, deadline=None)
@given(
    key=st.one_of(st.none(), st.sampled_from(["", "k-1", "2026-11-01", "o-1793524440", "20261101"]),
                  st.text(max_size=30)),
    t=st.one_of(st.none(), st.sampled_from([1_793_524_440_000_000_000]), st.integers(0, 2**63 - 1)),
)
def test_a_rule_function_in_generated_code_equals_its_closure(key: str | None, t: int | None) -> None:
    """DS103's condition is generated code that calls timeDerived with the line's time (0 when it has none)."""
    from processor.evaluate.loglane import _FUNCTIONS, _META, _RECORD

    expression = compile_expression(_DS103, _with_functions())
    assert expression.tree is not None
    context = SourceContext(maps={"record": _RECORD}, meta=dict(_META), functions=_FUNCTIONS)
    written = python_source(expression.tree, expression.constants, context)
    assert "_timeDerived(" in written.code
    function = eval(compile(f"lambda r, line, t: {written.code}", "<test>", "eval"),
                    {"_timeDerived": time_derived, **context.constants})  # fmt: skip
    record: dict[str, Any] = {"session_id": "s", "action_id": "a", "kind": "payment", "status": "ok"}
    if key is not None:
        record["idempotency_key"] = key
    activation = {"record": record, "meta": {"source": "log", "line": 1, "time_ns": t or 0}}
    assert function(record, 1, t) is expression.evaluate(activation)


@pytest.mark.parametrize(
    "source",
    [
        "timeDerived(record.result, meta.time_ns)",  # an argument of any type
        "has(record.idempotency_key) && timeDerived(record.idempotency_key, meta.time_ns)",  # may be null
        "timeDerived(record.kind, meta.line) && record.kind.startsWith('p')",  # a method call
    ],
)
def test_calls_the_generator_cannot_prove_keep_their_closure(source: str) -> None:
    from processor.evaluate.cel import Unsupported
    from processor.evaluate.loglane import _FUNCTIONS, _META, _RECORD

    expression = compile_expression(source, _with_functions())
    assert expression.tree is not None
    context = SourceContext(maps={"record": _RECORD}, meta=dict(_META), functions=_FUNCTIONS)
    with pytest.raises(Unsupported):
        python_source(expression.tree, expression.constants, context)
    # Without the function in the context, the call itself is refused.
    plain = compile_expression(_DS103, _with_functions())
    assert plain.tree is not None
    with pytest.raises(Unsupported):
        python_source(plain.tree, plain.constants, SourceContext(maps={"record": _RECORD}, meta=dict(_META)))


def _lane_then_engine_log(directory: Path, fmt: str) -> str:
    """A log whose first stretches are violations (written out by the lane) and whose last line
    spans the idle timeout, so the lane gives up after writing and replay starts over on the engine.
    A JSON report's violations are written once the first block is read: for it the log is longer
    than a block (1 MiB)."""
    count = 3 * 1024 if fmt == "text" else 12 * 1024
    lines = [
        orjson.dumps({"session_id": f"s{n % 7}", "action_id": f"a{n}", "kind": "payment", "status": "ok",
                      "time": "2026-01-01T00:00:00Z"})
        for n in range(count)
    ]
    lines.append(orjson.dumps({"session_id": "s1", "action_id": "late", "kind": "payment", "status": "ok",
                               "time": "2026-03-01T00:00:00Z"}))
    return _write(str(directory), "a.jsonl", lines)


def _replay_process(args: list[str], stdout: Any) -> int:
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "processor.cli", "replay", *args], stdout=stdout,
                          stderr=subprocess.DEVNULL, check=False, timeout=120).returncode


@pytest.mark.parametrize("fmt", ["text", "json"])
@pytest.mark.parametrize("where", ["stdout-file", "stdout-appended", "stdout-pipe", "output-option"])
def test_a_report_written_into_its_file_is_cut_back_when_the_lane_gives_up(tmp_path: Path, where: str,
                                                                           fmt: str) -> None:
    """The lane writes a report's violations straight into a regular file it may cut back (not one
    opened for appending, not a pipe): what it wrote before giving up is gone, and the file holds
    what was there before and the full engine's report, byte for byte."""
    import subprocess

    log = _lane_then_engine_log(tmp_path, fmt)
    options = ["--format", fmt, "--pack", "durable-sessions"]
    expected = tmp_path / "engine.txt"
    with expected.open("wb") as handle:
        assert _replay_process([*options, "--full-engine", log], handle) == 1
    assert expected.stat().st_size > 3 * 1024 * 100  # the lane had a stretch's lines to write first
    report = tmp_path / "report.txt"
    report.write_bytes(b"kept before the report\n")
    prefix = b"kept before the report\n"
    if where == "output-option":
        assert _replay_process([*options, log, "--output", str(report)], None) == 1
        prefix = b""  # --output replaces the file
    elif where == "stdout-pipe":
        done = subprocess.run([*_cli(), "replay", *options, log], capture_output=True,
                              check=False, timeout=120)
        assert done.returncode == 1
        report.write_bytes(prefix + done.stdout)
    else:
        with report.open("ab" if where == "stdout-appended" else "r+b") as handle:
            handle.seek(0, os.SEEK_END)
            assert _replay_process([*options, log], handle) == 1
    assert report.read_bytes() == prefix + expected.read_bytes()


def _cli() -> list[str]:
    import sys

    return [sys.executable, "-m", "processor.cli"]


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_the_lane_writes_into_the_report_file_and_undo_cuts_it_back(tmp_path: Path, fmt: str) -> None:
    """The mechanism itself: violations reach the file while the lane runs, and undo leaves the file as it began."""
    import argparse

    from processor.cmd_replay import _ReportFile
    from processor.evaluate.engine import Engine
    from processor.evaluate.loglane import LaneAborted
    from processor.evaluate.rulefmt import load_rules
    from processor.report import Report

    log = _lane_then_engine_log(tmp_path, fmt)
    out = tmp_path / "out.txt"
    args = argparse.Namespace(output=str(out), inputs=[log], format=fmt)
    report_file = _ReportFile.open(args)
    assert report_file is not None
    lane = LogLane(Engine(load_rules([], packs=["durable-sessions"])), fmt)
    lane.write_into(report_file.buffer, report_file.reread if fmt == "json" else None)
    try:
        with pytest.raises(LaneAborted, match="idle timeout"):
            lane.run([log], None, Report([log]), set())
        report_file.buffer.flush()
        # Text: three stretches of lines were written before it gave up; JSON: the first block's violations.
        assert out.stat().st_size > (3 * 1024 * 100 if fmt == "text" else 1 << 20)
        report_file.undo()
        assert out.stat().st_size == 0
    finally:
        lane.close()
        report_file.out.close()
    # Reading an input and writing the report into the same file keeps the spool (read first, written after).
    assert _ReportFile.open(argparse.Namespace(output=log, inputs=[log], format="text")) is None


def test_action_ids_with_control_and_non_ascii_characters_are_escaped_as_the_engine_escapes_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A violation's place in the text report names the action id, escaped where the report escapes;
    the lane writes the usual place itself (no span), and must escape it the same way."""
    odd = ["a\x1b[31m", "caf\u00e9", "a\u2028b", "tab\there", "plain", "nul\x00l", "\u00e9\x07"]
    lines = [
        orjson.dumps({"session_id": "s1", "action_id": action_id, "kind": "payment", "status": "ok"})
        for action_id in odd
    ]
    lines.append(orjson.dumps({"session_id": "s1", "action_id": "with-span", "kind": "payment", "status": "ok",
                               "trace_id": "0af7651916cd43dd8448eb211c80319c", "span_id": "b7ad6b7169203331"}))
    log = _write(str(tmp_path), "a.jsonl", lines)
    code, out, _ = _both(["--pack", "durable-sessions", log], capsys)
    assert code == 1
    assert "\x1b" not in out and "\x07" not in out and "\x00" not in out
    assert "[caf\u00e9]" in out  # printable non-ASCII is kept as it is


def _payments(first: int, count: int, pad: int) -> list[bytes]:
    """Unkeyed payments (one violation each), ``pad`` characters of payload a line."""
    return [
        orjson.dumps({"session_id": f"s{n % 5}", "action_id": f"a{n}", "kind": "payment", "status": "ok",
                      "time": "2026-01-01T00:00:00Z", "result": {"note": "x" * pad}})
        for n in range(first, first + count)
    ]


def _keyed(count: int) -> list[bytes]:
    return [
        orjson.dumps({"session_id": "s1", "action_id": f"k{n}", "kind": "payment", "status": "ok",
                      "idempotency_key": f"k{n}", "time": "2026-01-01T00:00:00Z"})
        for n in range(count)
    ]


# Logs whose first part makes the JSON report's head be estimated right, too short (the list is
# moved towards the end), or too long (moved towards the start). The estimate is made when the
# first block of lines (1 MiB) ends, from the share of the log's bytes it held.
_JSON_PLACEMENTS: Final = {
    "estimated-right": lambda: _payments(0, 12_000, 40),
    # Long lines first: about 1,000 lines are expected, there are 10,520: a digit more.
    "head-longer": lambda: _payments(0, 520, 2_000) + _payments(520, 10_000, 10),
    # Short lines first: about 25,000 lines are expected, there are 9,800: a digit less.
    "head-shorter": lambda: _payments(0, 9_500, 10) + _payments(9_500, 300, 6_000),
    # Malformed lines after the estimate: the malformed count has two digits, not one.
    "malformed-later": lambda: _payments(0, 20_000, 10) + [b'{"session_id": "s1", "kind": 3}'] * 60,
    # Fewer violations than a JSON block: held until the run ends, then placed after the exact head.
    "few-violations": lambda: _payments(0, 100, 10) + _keyed(3_000),
    # None: the report is its head alone, nothing written before it.
    "no-violations": lambda: _keyed(3_000),
}


@pytest.mark.parametrize("placement", sorted(_JSON_PLACEMENTS))
@pytest.mark.parametrize("where", ["stdout-file", "output-option"])
def test_a_json_report_written_into_its_file_is_the_engines_whatever_its_head_came_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, placement: str, where: str
) -> None:
    """The lane writes a JSON report's violations list into the report's file after a head whose
    counts it estimates; the file then holds the full engine's report byte for byte, the list
    moved (in whichever direction) when the head came out another length."""
    import sys

    from processor import cli

    log = _write(str(tmp_path), "a.jsonl", _JSON_PLACEMENTS[placement]())
    engine = tmp_path / "engine.json"
    found = 0 if placement == "no-violations" else 1
    assert cli.main(["replay", "--format", "json", "--pack", "durable-sessions", "--full-engine", log,
                     "--output", str(engine)]) == found
    report = tmp_path / "report.json"
    prefix = b""
    caplog.set_level(logging.DEBUG, logger="durable_check.replay")
    if where == "output-option":
        report.write_bytes(b"replaced\n" * 2_000_000)  # longer than the report: nothing of it is left
        assert cli.main(["replay", "--format", "json", "--pack", "durable-sessions", log,
                         "--output", str(report)]) == found
    else:
        prefix = b"kept before the report\n"
        report.write_bytes(prefix)
        with report.open("r+b") as handle:
            handle.seek(0, os.SEEK_END)
            monkeypatch.setattr("sys.stdout", open(handle.fileno(), "w", encoding="utf-8", closefd=False))  # noqa: SIM115
            try:
                assert cli.main(["replay", "--format", "json", "--pack", "durable-sessions", log]) == found
            finally:
                sys.stdout.flush()
    assert report.read_bytes() == prefix + engine.read_bytes()
    moves = [record.getMessage() for record in caplog.records if "moving its" in record.getMessage()]
    if placement in ("estimated-right", "few-violations", "no-violations"):
        assert moves == []
    else:
        assert len(moves) == 1
        direction = "longer" if placement in ("head-longer", "malformed-later") else "shorter"
        assert f"bytes {direction} than estimated" in moves[0]



@pytest.mark.parametrize("fmt", ["text", "json"])
def test_overlong_ids_are_bounded_as_the_engine_bounds_them(
    tmp_path: Path, fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Lines short enough for the typed decoder (a 300-character id) and far longer ones (200,000):
    the lane reports them under the same bounded ids as the engine."""
    from processor.records import IDENTITY_MAX_CHARS, bounded_text

    ids = ["k" * 300, "m" * 200_000, "n" * (IDENTITY_MAX_CHARS - 4)]
    lines = [orjson.dumps({"session_id": f"s-{i}-{long}", "action_id": f"pay-{long}", "kind": "payment",
                           "status": "ok", "cache_key": long}) for i, long in enumerate(ids)]
    lines += [orjson.dumps({"session_id": "short", "action_id": "pay-1", "kind": "payment", "status": "ok"})]
    log = _write(str(tmp_path), "a.jsonl", lines)
    code, out, _ = _both(["--pack", "durable-sessions", "--format", fmt, log], capsys)
    assert code == 1
    assert "m" * (IDENTITY_MAX_CHARS + 1) not in out and "k" * 300 not in out
    for i, long in enumerate(ids):
        assert bounded_text(f"s-{i}-{long}") in out
    assert f"s-2-{ids[2]}" in out  # at the limit: kept as it is
