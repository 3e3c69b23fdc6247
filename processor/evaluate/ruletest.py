"""Unit tests for rules, written in YAML and run through the real engine (``durable-check rules test``).

A test file names the rule files under test and lists test cases; each case feeds
records to a fresh :class:`~processor.evaluate.engine.Engine` and compares the
violations (and, optionally, the waits left open) with what it expects::

    rule_files: [durable-sessions.yaml]      # relative to this file
    include_shipped: false                   # default: only the files named
    tests:
      - name: a prompt with no recorded answer
        strict: false                        # run strict-only rules too
        input_format: actions                # actions (log lines) | spans
        input:
          - {session_id: s1, action_id: a1, kind: user_prompt, status: ok}
          - 'not json'                       # actions only: a raw line
        expect:
          - {rule: DS001, action_id: a1, line: 1}
          - {rule: DS000, line: 2}
        only_rules: [DS001, DS000]           # optional: compare only these rules
        expect_open_waits: []                # optional: compared exactly when given

With ``input_format: spans`` every item is ``{record: {...}}`` plus optional span
facts: ``time`` (RFC 3339) or ``at`` (a duration after the test's ``start``, default
2026-01-01T00:00:00Z), ``trace_id``, ``span_id``, ``event_index`` and
``synthetic_action_id``. Items without a time are one second apart; a span id is made
up per item unless given (repeat one to model a redelivery).

Expected violations match on the keys they give (``rule`` always; ``action_id``,
``session_id``, ``line``, ``severity``, ``message`` when present), each against a
different actual violation. A case fails on a missing or unexpected violation, on a
wrong set of open waits, and when a rule's expression failed at run time on the input.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import orjson
import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from processor.convert.actionlog import parse_line
from processor.convert.timefmt import format_rfc3339, parse_rfc3339
from processor.errors import Problem, RuleFormatError
from processor.evaluate.engine import Engine, EngineOptions
from processor.evaluate.model import RuleSet, SourcePos
from processor.evaluate.rulefmt import (
    _YAML_TAG,
    MAX_FILE_BYTES,
    RULE_ID_PATTERN,
    _compose,
    _Context,
    _Problems,
    _SourceFile,
    _tag_word,
    load_rules,
)
from processor.records import REQUIRED_FIELDS, Action, Malformed, validate_record
from processor.summary import OpenWait
from processor.violations import SEVERITIES, Violation

MAX_TESTS: Final = 1_000
MAX_INPUT_ITEMS: Final = 10_000
MAX_EXPECTED: Final = 10_000
# Bound on the YAML nodes one record may hold: aliases can make a small file a huge value.
MAX_RECORD_NODES: Final = 10_000
DEFAULT_START: Final = "2026-01-01T00:00:00Z"
DEFAULT_TRACE_ID: Final = "4bf92f3577b34da6a3ce929d0e0e4736"

TOP_KEYS: Final = ("rule_files", "include_shipped", "tests")
TEST_KEYS: Final = ("name", "strict", "input_format", "input", "expect", "expect_open_waits", "only_rules", "start")
EXPECT_KEYS: Final = ("rule", "action_id", "session_id", "line", "severity", "message")
WAIT_KEYS: Final = ("rule", "action_id", "session_id")
SPAN_KEYS: Final = ("record", "time", "at", "trace_id", "span_id", "event_index", "synthetic_action_id")


@dataclass(frozen=True, slots=True)
class Expected:
    """One expected violation or open wait; None means "any"."""

    rule: str
    pos: SourcePos
    action_id: str | None = None
    session_id: str | None = None
    line: int | None = None
    severity: str | None = None
    message: str | None = None

    def matches(self, violation: Violation) -> bool:
        return (
            violation.rule == self.rule
            and (self.action_id is None or violation.action_id == self.action_id)
            and (self.session_id is None or violation.session_id == self.session_id)
            and (self.line is None or violation.line == self.line)
            and (self.severity is None or violation.severity == self.severity)
            and (self.message is None or violation.message == self.message)
        )

    def matches_wait(self, wait: OpenWait) -> bool:
        return (
            wait.rule == self.rule
            and (self.action_id is None or wait.action_id == self.action_id)
            and (self.session_id is None or wait.session_id == self.session_id)
        )

    def describe(self) -> str:
        parts = [f"rule: {self.rule}"]
        for name in ("session_id", "action_id", "line", "severity", "message"):
            value = getattr(self, name)
            if value is not None:
                parts.append(f"{name}: {value!r}" if name == "message" else f"{name}: {value}")
        return "{" + ", ".join(parts) + "}"


@dataclass(slots=True)
class RuleTestCase:
    name: str
    pos: SourcePos
    strict: bool
    items: list[Action | Malformed]
    expect: list[Expected]
    expect_open_waits: list[Expected] | None
    only_rules: frozenset[str] | None
    # Where each rule id the case names is written, to report ids no loaded rule has.
    named_rules: list[tuple[str, SourcePos]] = field(default_factory=list)


@dataclass(slots=True)
class RuleTestFile:
    path: str
    rule_files: list[Path]
    include_shipped: bool
    cases: list[RuleTestCase]


@dataclass(slots=True)
class CaseResult:
    case: RuleTestCase
    missing: list[Expected] = field(default_factory=list)
    unexpected: list[Violation] = field(default_factory=list)
    missing_waits: list[Expected] = field(default_factory=list)
    unexpected_waits: list[OpenWait] = field(default_factory=list)
    rule_errors: dict[str, int] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not (self.missing or self.unexpected or self.missing_waits or self.unexpected_waits or self.rule_errors)


@dataclass(slots=True)
class FileResult:
    path: str
    problems: list[Problem] = field(default_factory=list)
    cases: list[CaseResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems and all(c.passed for c in self.cases)


# ---------------------------------------------------------------------------
# Decoding a test file


def _plain(ctx: _Context, node: Node, budget: list[int]) -> tuple[bool, Any]:
    """A YAML node as a JSON-like value (timestamps stay text; only true/false are booleans)."""
    budget[0] -= 1
    if budget[0] < 0:
        if budget[0] == -1:
            ctx.error(node, f"a record may hold at most {MAX_RECORD_NODES} values")
        return False, None
    if isinstance(node, MappingNode):
        out: dict[str, Any] = {}
        ok = True
        for key_node, value_node in node.value:
            if not isinstance(key_node, ScalarNode) or key_node.tag != _YAML_TAG + "str":
                ctx.error(key_node, "record keys must be strings")
                ok = False
                continue
            if key_node.value in out:
                ctx.error(key_node, f"duplicate key {key_node.value}")
                ok = False
                continue
            good, value = _plain(ctx, value_node, budget)
            ok = ok and good
            out[key_node.value] = value
        return ok, out
    if isinstance(node, SequenceNode):
        items = []
        ok = True
        for item in node.value:
            good, value = _plain(ctx, item, budget)
            ok = ok and good
            items.append(value)
        return ok, items
    assert isinstance(node, ScalarNode)
    tag = node.tag[len(_YAML_TAG) :] if node.tag.startswith(_YAML_TAG) else node.tag
    if tag in {"str", "timestamp"}:
        return True, node.value
    if tag == "null":
        return True, None
    if tag == "bool":
        if str(node.value).lower() in ("true", "false"):
            return True, str(node.value).lower() == "true"
        ctx.error(node, f"write true or false, or quote {node.value!r} to make it a string")
        return False, None
    if tag == "int":
        return True, ctx.integer(node, "an integer", minimum=-(2**63), maximum=2**63 - 1)
    if tag == "float":
        try:
            return True, float(yaml.constructor.SafeConstructor().construct_yaml_float(node))
        except (ValueError, yaml.YAMLError):
            ctx.error(node, "not a number")
            return False, None
    ctx.error(node, f"unsupported YAML value tagged {node.tag}")
    return False, None


def _expected_list(ctx: _Context, node: Node, what: str, keys: Sequence[str]) -> list[Expected] | None:
    if isinstance(node, ScalarNode) and node.tag == _YAML_TAG + "null":
        return []
    if not isinstance(node, SequenceNode):
        ctx.error(node, f"{what} must be a list, got {_tag_word(node)}")
        return None
    if len(node.value) > MAX_EXPECTED:
        ctx.error(node, f"{what} has more than {MAX_EXPECTED} items")
        return None
    out: list[Expected] = []
    ok = True
    for item in node.value:
        entries = ctx.mapping(item, f"an item of {what}", keys)
        if entries is None:
            ok = False
            continue
        if "rule" not in entries:
            ctx.error(item, f"an item of {what} needs a rule")
            ok = False
            continue
        rule = ctx.string(entries["rule"][1], "rule")
        if rule is not None and not RULE_ID_PATTERN.match(rule):
            ctx.error(entries["rule"][1], f"{rule!r} is not a rule id")
            rule = None
        values: dict[str, Any] = {}
        for name in ("action_id", "session_id", "message"):
            if name in entries:
                values[name] = ctx.string(entries[name][1], name, allow_empty=True)
                ok = ok and values[name] is not None
        if "line" in entries:
            values["line"] = ctx.integer(entries["line"][1], "line", minimum=1, maximum=MAX_INPUT_ITEMS)
            ok = ok and values["line"] is not None
        if "severity" in entries:
            values["severity"] = ctx.choice(entries["severity"][1], "severity", SEVERITIES)
            ok = ok and values["severity"] is not None
        if rule is None:
            ok = False
            continue
        out.append(Expected(rule=rule, pos=ctx.src.pos(item), **values))
    return out if ok else None


def _start_ns(ctx: _Context, node: Node | None) -> int | None:
    text = DEFAULT_START if node is None else ctx.string(node, "start")
    if text is None:
        return None
    parsed = parse_rfc3339(text)
    if parsed is None:
        ctx.error(
            node if node is not None else ctx.src.file_pos(), f"start must be an RFC 3339 time like {DEFAULT_START}"
        )
    return parsed


def _action_items(ctx: _Context, node: SequenceNode, origin: str) -> list[Action | Malformed] | None:
    """Each item is a record (a mapping) or a raw line (a string), read as an action log line."""
    items: list[Action | Malformed] = []
    ok = True
    for index, item in enumerate(node.value):
        line = index + 1
        if isinstance(item, ScalarNode) and item.tag == _YAML_TAG + "str":
            raw = item.value.encode("utf-8")
        elif isinstance(item, MappingNode):
            good, record = _plain(ctx, item, [MAX_RECORD_NODES])
            if not good:
                ok = False
                continue
            raw = orjson.dumps(record)
        else:
            ctx.error(
                item, f"an input line must be a record (a mapping) or a raw line (a string), got {_tag_word(item)}"
            )
            ok = False
            continue
        parsed = parse_line(raw, origin, line, seq=line)
        if parsed is not None:
            items.append(parsed)
    return items if ok else None


def _span_items(ctx: _Context, node: SequenceNode, origin: str, start_ns: int) -> list[Action | Malformed] | None:
    """Each item is ``{record: {...}}`` with optional span facts (see the module docstring)."""
    items: list[Action | Malformed] = []
    ok = True
    for index, item in enumerate(node.value):
        entries = ctx.mapping(item, "a span input item", SPAN_KEYS)
        if entries is None:
            ok = False
            continue
        if "record" not in entries:
            ctx.error(item, "a span input item needs record: {...}")
            ok = False
            continue
        good, record = _plain(ctx, entries["record"][1], [MAX_RECORD_NODES])
        if not good or not isinstance(record, dict):
            if good:
                ctx.error(entries["record"][1], "record must be a mapping")
            ok = False
            continue
        time_ns: int | None = start_ns + index * 1_000_000_000
        if "time" in entries and "at" in entries:
            ctx.error(entries["at"][0], "give time or at, not both")
            ok = False
            continue
        if "time" in entries:
            text = ctx.string(entries["time"][1], "time")
            time_ns = parse_rfc3339(text) if text is not None else None
            if time_ns is None:
                ctx.error(entries["time"][1], "time must be an RFC 3339 time like 2026-01-01T00:05:00Z")
                ok = False
                continue
        elif "at" in entries:
            offset = ctx.duration(entries["at"][1], "at", allow_zero=True)
            if offset is None:
                ok = False
                continue
            time_ns = start_ns + round(offset * 1_000_000_000)
        elif isinstance(record.get("time"), str):
            time_ns = parse_rfc3339(record["time"]) or time_ns
        trace_id = DEFAULT_TRACE_ID
        span_id = f"{index + 1:016x}"
        event_index = 0
        synthetic = False
        if "trace_id" in entries:
            trace_id = ctx.string(entries["trace_id"][1], "trace_id") or trace_id
        if "span_id" in entries:
            span_id = ctx.string(entries["span_id"][1], "span_id") or span_id
        if "event_index" in entries:
            event_index = ctx.integer(entries["event_index"][1], "event_index", minimum=0, maximum=1_000_000) or 0
        if "synthetic_action_id" in entries:
            synthetic = bool(ctx.boolean(entries["synthetic_action_id"][1], "synthetic_action_id"))
        missing = [name for name in REQUIRED_FIELDS if record.get(name) in (None, "")]
        if missing:
            # The span converter always fills these in (or says the span has no kind): a
            # span record without them models no span at all.
            ctx.error(
                entries["record"][1],
                f"input item {index + 1}: a span record needs {', '.join(REQUIRED_FIELDS)} "
                f"(missing: {', '.join(missing)})",
            )
            ok = False
            continue
        problems = validate_record(record)
        if problems:
            items.append(
                Malformed(
                    "; ".join(problems),
                    origin=origin,
                    session_id=record["session_id"] if isinstance(record.get("session_id"), str) else "",
                    action_id=record["action_id"] if isinstance(record.get("action_id"), str) else "",
                    trace_id=trace_id,
                    span_id=span_id,
                    source="span",
                )
            )
            continue
        if time_ns is not None and "time" not in record:
            # Spans carry their start time; the record shows it the way the span converter writes it.
            record["time"] = format_rfc3339(time_ns)
        items.append(
            Action(
                record=record,
                source="span",
                origin=origin,
                time_ns=time_ns,
                seq=index + 1,
                delivery_key=(trace_id, span_id, event_index),
                synthetic_action_id=synthetic,
            )
        )
    return items if ok else None


def _case_label(node: Node, index: int) -> str:
    """``test "name"``, read leniently so that every problem of the test can be labelled."""
    if isinstance(node, MappingNode):
        for key, value in node.value:
            if isinstance(key, ScalarNode) and key.value == "name" and isinstance(value, ScalarNode) and value.value:
                return f'test "{value.value}"'
    return f"test #{index + 1}"


def _parse_case(ctx: _Context, node: Node, index: int, file_name: str) -> RuleTestCase | None:
    ctx.label = _case_label(node, index)
    entries = ctx.mapping(node, "a test", TEST_KEYS)
    if entries is None:
        return None
    before = ctx.problems.count()
    name = ctx.string(entries["name"][1], "name") if "name" in entries else None
    if name is None and "name" not in entries:
        ctx.error(node, "missing key name")
    strict = ctx.boolean(entries["strict"][1], "strict") if "strict" in entries else False
    input_format = (
        ctx.choice(entries["input_format"][1], "input_format", ("actions", "spans"))
        if "input_format" in entries
        else "actions"
    )
    start_ns = _start_ns(ctx, entries["start"][1] if "start" in entries else None)
    items: list[Action | Malformed] | None = None
    if "input" not in entries:
        ctx.error(node, "missing key input")
    else:
        input_node = entries["input"][1]
        if not isinstance(input_node, SequenceNode):
            ctx.error(input_node, f"input must be a list, got {_tag_word(input_node)}")
        elif len(input_node.value) > MAX_INPUT_ITEMS:
            ctx.error(input_node, f"input has more than {MAX_INPUT_ITEMS} items")
        else:
            origin = f"{file_name}#{index + 1}"
            if input_format == "spans" and start_ns is not None:
                items = _span_items(ctx, input_node, origin, start_ns)
            elif input_format == "actions":
                items = _action_items(ctx, input_node, origin)
    expect = _expected_list(ctx, entries["expect"][1], "expect", EXPECT_KEYS) if "expect" in entries else []
    waits = (
        _expected_list(ctx, entries["expect_open_waits"][1], "expect_open_waits", WAIT_KEYS)
        if "expect_open_waits" in entries
        else None
    )
    only: frozenset[str] | None = None
    named: list[tuple[str, SourcePos]] = []
    if "only_rules" in entries:
        listed = ctx.string_list(entries["only_rules"][1], "only_rules", limit=1_000)
        if listed is not None:
            only = frozenset(text for text, _ in listed)
            named.extend((text, ctx.src.pos(item)) for text, item in listed)
    named.extend((e.rule, e.pos) for e in (*(expect or ()), *(waits or ())))
    if ctx.problems.count() != before or name is None or items is None or expect is None:
        return None
    return RuleTestCase(
        name=name,
        pos=ctx.src.pos(node),
        strict=bool(strict),
        items=items,
        expect=expect,
        expect_open_waits=waits,
        only_rules=only,
        named_rules=named,
    )


def load_test_file(path: str | Path) -> RuleTestFile:
    """Decode a test file strictly; raises RuleFormatError listing every problem (file:line:col)."""
    path = Path(path)
    display = str(path)
    problems = _Problems()
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES * 8:
            raise RuleFormatError([Problem(display, f"test file is {size} bytes; at most {MAX_FILE_BYTES * 8}")])
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise RuleFormatError([Problem(display, f"cannot read test file: {exc.strerror or exc}")]) from None
    except UnicodeDecodeError as exc:
        raise RuleFormatError([Problem(display, f"not UTF-8 text (byte {exc.start})")]) from None
    src = _SourceFile(display, text, shipped=False)
    root = _compose(src, problems)
    ctx = _Context(src, problems)
    result = RuleTestFile(display, [], False, [])
    if root is None:
        if not problems.count():
            problems.add(src.file_pos(), "empty test file: expected rule_files and tests")
        raise RuleFormatError(problems.final())
    top = ctx.mapping(root, "a rule test file", TOP_KEYS)
    if top is not None:
        for key in ("rule_files", "tests"):
            if key not in top:
                ctx.error(root, f"missing key {key}")
        if "rule_files" in top:
            listed = ctx.string_list(top["rule_files"][1], "rule_files", limit=100)
            if listed is not None:
                result.rule_files = [path.parent / text for text, _ in listed]
        if "include_shipped" in top:
            result.include_shipped = bool(ctx.boolean(top["include_shipped"][1], "include_shipped"))
        if "tests" in top:
            tests = top["tests"][1]
            if not isinstance(tests, SequenceNode):
                ctx.error(tests, f"tests must be a list, got {_tag_word(tests)}")
            elif len(tests.value) > MAX_TESTS:
                ctx.error(tests, f"more than {MAX_TESTS} tests in one file")
            else:
                names: dict[str, SourcePos] = {}
                for index, node in enumerate(tests.value):
                    label = _case_label(node, index)
                    if label in names:
                        problems.add(src.pos(node), f"{label}: duplicate test name (first at {names[label]})")
                        continue
                    names[label] = src.pos(node)
                    case = _parse_case(_Context(src, problems), node, index, path.name)
                    if case is not None:
                        result.cases.append(case)
    if problems.count():
        raise RuleFormatError(problems.final())
    return result


# ---------------------------------------------------------------------------
# Running


def run_case(ruleset: RuleSet, case: RuleTestCase) -> CaseResult:
    engine = Engine(ruleset, EngineOptions(strict=case.strict))
    actual = engine.submit_many(case.items)
    actual.extend(engine.finish())
    summary = engine.summary()
    only = case.only_rules
    if only is not None:
        actual = [v for v in actual if v.rule in only]
    result = CaseResult(case, rule_errors=dict(summary.rule_errors))
    unmatched = list(actual)
    for expected in case.expect:
        for i, violation in enumerate(unmatched):
            if expected.matches(violation):
                del unmatched[i]
                break
        else:
            result.missing.append(expected)
    result.unexpected = unmatched
    if case.expect_open_waits is not None:
        waits = [w for w in summary.open_waits if only is None or w.rule in only]
        for expected in case.expect_open_waits:
            for i, wait in enumerate(waits):
                if expected.matches_wait(wait):
                    del waits[i]
                    break
            else:
                result.missing_waits.append(expected)
        result.unexpected_waits = waits
    return result


def run_test_file(path: str | Path) -> FileResult:
    """Load and run one test file; problems with the file or its rule files are reported, not raised."""
    result = FileResult(str(path))
    try:
        test_file = load_test_file(path)
    except RuleFormatError as exc:
        result.problems = exc.problems
        return result
    try:
        ruleset = load_rules(test_file.rule_files, include_shipped=test_file.include_shipped)
    except RuleFormatError as exc:
        result.problems = exc.problems
        return result
    # A misspelt id would make a case pass vacuously (only_rules filtering everything out).
    known = ruleset.by_id()
    for case in test_file.cases:
        for rule_id, where in case.named_rules:
            if rule_id not in known:
                result.problems.append(Problem(str(where), f'test "{case.name}": no loaded rule has id {rule_id}'))
    if result.problems:
        return result
    result.cases = [run_case(ruleset, case) for case in test_file.cases]
    return result


def _describe_violation(violation: Violation) -> str:
    parts = [f"rule: {violation.rule}", f"session_id: {violation.session_id}", f"action_id: {violation.action_id}"]
    if violation.line is not None:
        parts.append(f"line: {violation.line}")
    parts.append(f"message: {violation.message!r}")
    return "{" + ", ".join(parts) + "}"


def _describe_wait(wait: OpenWait) -> str:
    text = f"{{rule: {wait.rule}, session_id: {wait.session_id}, action_id: {wait.action_id}"
    if wait.deadline_ns is not None:
        text += f", deadline: {format_rfc3339(wait.deadline_ns)}"
    return text + "}"


def format_result(result: FileResult) -> str:
    """promtool-style text: SUCCESS, or each failing test with what was missing and unexpected."""
    lines = [f"Unit Testing: {result.path}"]
    if result.problems:
        lines.append("  FAILED:")
        lines.extend(f"    {problem}" for problem in result.problems)
        return "\n".join(lines) + "\n"
    failed = [c for c in result.cases if not c.passed]
    if not failed:
        lines.append(f"  SUCCESS ({len(result.cases)} tests)")
        return "\n".join(lines) + "\n"
    lines.append(f"  FAILED: {len(failed)} of {len(result.cases)} tests")
    for case_result in failed:
        case = case_result.case
        lines.append(f'    test "{case.name}" at {case.pos}:')
        if case_result.missing:
            lines.append("      missing violations (expected, not found):")
            lines.extend(f"        - {e.describe()}" for e in case_result.missing)
        if case_result.unexpected:
            lines.append("      unexpected violations (found, not expected):")
            lines.extend(f"        - {_describe_violation(v)}" for v in case_result.unexpected)
        if case_result.missing_waits:
            lines.append("      missing open waits:")
            lines.extend(f"        - {e.describe()}" for e in case_result.missing_waits)
        if case_result.unexpected_waits:
            lines.append("      unexpected open waits:")
            lines.extend(f"        - {_describe_wait(w)}" for w in case_result.unexpected_waits)
        if case_result.rule_errors:
            lines.append("      rules whose expressions failed at run time on this input:")
            lines.extend(
                f"        - {rule}: {count} record{'s' if count != 1 else ''}"
                for rule, count in sorted(case_result.rule_errors.items())
            )
    return "\n".join(lines) + "\n"


def expand_test_paths(paths: Sequence[str | Path]) -> list[Path]:
    """Files named, with directories expanded to their ``*.test.yaml`` files."""
    out: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            out.extend(sorted(path.glob("*.test.yaml")))
        else:
            out.append(path)
    return out
