"""The rule-file format: strict loading with file:line:col, overrides, the shipped packs' verdicts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from processor.convert.actionlog import parse_line
from processor.errors import RuleFormatError
from processor.evaluate.engine import Engine, EngineOptions
from processor.evaluate.model import RuleSet
from processor.evaluate.rulefmt import (
    MAX_EXPRESSION_CHARS,
    MAX_FILE_BYTES,
    MAX_RULES_PER_FILE,
    lint,
    load_rules,
    parse_duration,
    shipped_rule_files,
    shipped_rules_dir,
)
from processor.violations import Violation

TESTDATA = Path(__file__).parent / "testdata"
BAD_FILES = sorted((TESTDATA / "rulefmt").glob("*.bad.yaml"))
REPO = Path(__file__).resolve().parents[1]


def _expected_problems(path: Path) -> list[str]:
    """From the sibling .err file, else from the file's ``# expect:`` header lines."""
    err = path.with_name(path.name + ".err")
    if err.exists():
        return [line for line in err.read_text(encoding="utf-8").splitlines() if line]
    return [
        line.split("# expect: ", 1)[1]
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.startswith("# expect: ")
    ]


@pytest.mark.parametrize("path", BAD_FILES, ids=[p.name for p in BAD_FILES])
def test_bad_file_gives_its_expected_problems(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = _expected_problems(path)
    assert expected, f"{path.name} states no expected problem"
    monkeypatch.chdir(path.parent)
    assert [str(p) for p in lint([path.name])] == expected
    with pytest.raises(RuleFormatError) as caught:
        load_rules([path.name])
    assert [str(p) for p in caught.value.problems] == expected
    for line in expected:
        assert line in str(caught.value)


def test_every_bad_file_problem_names_a_place() -> None:
    for path in BAD_FILES:
        for line in _expected_problems(path):
            assert re.match(rf"^{re.escape(path.name)}:\d+:\d+: ", line), line


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


RULE = """\
  - id: {id}
    name: {name}
    severity: info
    condition: {condition}
    message: hit
"""


def test_several_files_all_problems_in_file_order(tmp_path: Path) -> None:
    a = _write(tmp_path, "a.yaml", "version: 1\nrules:\n" + RULE.format(id="X1", name="one", condition="record.nope"))
    b = _write(tmp_path, "b.yaml", "version: 3\nrules:\n" + RULE.format(id="X2", name="two", condition="(("))
    problems = [str(p) for p in lint([a, b], include_shipped=False)]
    assert problems == [
        f"{a}:6:23: rule X1 (one): condition: 'record' has no field 'nope'",
        f"{b}:1:10: unsupported version '3': this release reads version 1",
        f"{b}:6:18: rule X2 (two): condition: expression ended early: expected a value, a name, '(' , '[' or '{{'",
    ]


def test_duplicate_id_across_files_names_both_places(tmp_path: Path) -> None:
    a = _write(tmp_path, "a.yaml", "version: 1\nrules:\n" + RULE.format(id="X1", name="one", condition="true"))
    b = _write(
        tmp_path,
        "b.yaml",
        "version: 1\nrules:\n"
        + RULE.format(id="X0", name="zero", condition="true")
        + RULE.format(id="X1", name="again", condition="true"),
    )
    problems = [str(p) for p in lint([a, b], include_shipped=False)]
    assert problems == [f"{b}:8:9: rule X1 (again): duplicate id X1: already used at {a}:3:9"]


def test_list_redeclared_in_another_file(tmp_path: Path) -> None:
    user = _write(tmp_path, "u.yaml", "version: 1\nlists:\n  side_effecting: [refund]\nrules: []\n")
    problems = [str(p) for p in lint([user])]
    assert problems == [
        f"{user}:3:3: list side_effecting is already declared at "
        "rules/durable-sessions.yaml:13:3; lists cannot be redeclared"
    ]


def _column_of(text: str, needle: str) -> tuple[int, int]:
    index = text.index(needle)
    line = text.count("\n", 0, index) + 1
    return line, index - (text.rfind("\n", 0, index) + 1) + 1


CONDITION_STYLES = {
    "plain": "condition: record.kind == 'x' && record.bogus_field == 1\n",
    "plain-multiline": "condition: record.kind == 'x'\n      && record.bogus_field == 1\n",
    "folded-strip": "condition: >-\n      record.kind == 'x'\n      && record.bogus_field == 1\n",
    "folded-keep-indented": "condition: >\n      record.kind == 'x'\n\n        &&   record.bogus_field == 1\n",
    "literal": "condition: |\n      record.kind == 'x' &&\n      record.bogus_field == 1\n",
    "literal-strip-indicator": "condition: |2-\n       record.kind == 'x' &&\n         record.bogus_field == 1\n",
    "double-quoted": 'condition: "record.kind == \\"x\\" \\t && record.bogus_field == 1"\n',
    "double-quoted-multiline": "condition: \"record.kind == 'x'\n      && record.bogus_field == 1\"\n",
    "single-quoted": "condition: 'record.kind == ''x'' && record.bogus_field == 1'\n",
    "header-comment": "condition: >- # why this rule exists\n      record.kind == 'x' && record.bogus_field == 1\n",
}


@pytest.mark.parametrize("style", sorted(CONDITION_STYLES))
def test_cel_error_is_placed_where_it_is_in_the_file(style: str, tmp_path: Path) -> None:
    text = (
        "version: 1\nrules:\n  - id: X1\n    name: placed\n    severity: info\n    "
        + CONDITION_STYLES[style]
        + "    message: hit\n"
    )
    path = _write(tmp_path, "r.yaml", text)
    line, col = _column_of(text, "bogus_field")
    problems = lint([path], include_shipped=False)
    assert [str(p) for p in problems] == [
        f"{path}:{line}:{col}: rule X1 (placed): condition: 'record' has no field 'bogus_field'"
    ]


def test_cel_error_inside_a_message_hole_in_a_folded_scalar(tmp_path: Path) -> None:
    text = (
        "version: 1\nrules:\n  - id: X1\n    name: msg\n    severity: info\n    condition: 'true'\n"
        "    message: >-\n      first line {{ record.kind }}\n      then {{ record.kind + record.bogus_field }} end\n"
    )
    path = _write(tmp_path, "r.yaml", text)
    line, col = _column_of(text, "bogus_field")
    assert [str(p) for p in lint([path], include_shipped=False)] == [
        f"{path}:{line}:{col}: rule X1 (msg): message: 'record' has no field 'bogus_field'"
    ]


def test_first_read_whole_is_refused(tmp_path: Path) -> None:
    text = (
        "version: 1\nrules:\n  - id: X1\n    name: whole\n    severity: info\n    type: sequence\n"
        "    first: 'true'\n    then: size(first) > 2\n    message: hit\n"
    )
    path = _write(tmp_path, "r.yaml", text)
    line, col = _column_of(text, "first) > 2")
    assert [str(p) for p in lint([path], include_shipped=False)] == [
        f"{path}:{line}:{col}: rule X1 (whole): then: read first field by field (first.kind): "
        "a group keeps only the fields its rule reads"
    ]


def test_first_fields_are_what_then_and_message_read(tmp_path: Path) -> None:
    text = (
        "version: 1\nrules:\n  - id: X1\n    name: kept\n    severity: info\n    type: sequence\n"
        "    group_by: [record.action_id]\n    first: record.status == 'ok'\n"
        "    then: record.kind != first.kind\n    message: 'was {{ first.plan_version }}'\n"
    )
    ruleset = load_rules([_write(tmp_path, "r.yaml", text)], include_shipped=False)
    rule = ruleset.by_id()["X1"]
    assert rule.first_fields == frozenset({"kind", "plan_version"})
    assert len(rule.group_by) == 1
    shipped = load_rules([]).by_id()
    assert shipped["DS009"].first_fields == frozenset({"kind", "input_fingerprint"})
    assert shipped["DS001"].first_fields == frozenset()


def test_rule_keys_decode_into_the_model(tmp_path: Path) -> None:
    text = """\
version: 1
rules:
  - id: ACME-7
    name: slow-approval
    description: |
      Two lines
      of description.
    severity: warning
    enabled: false
    tags: [approval, team.payments]
    type: absence
    condition: record.kind == "approval"
    group_by: [record.action_id, record.plan_version]
    first: has(record.workflow_state)
    then: has(record.approval_decision)
    within: 1h30m
    deadline: record.wait_timeout_s
    within_actions: 3
    message: "{{ record.action_id }} waits"
  - id: ACME-8
    name: burst
    severity: info
    type: count
    threshold: 5
    window: 90s
    message: burst
  - id: ACME-9
    name: seq
    severity: critical
    type: sequence
    strict_only: true
    first: "true"
    then: "true"
    keep: latest
    report_on: first
    within: 7d
    message: seq
"""
    rules = load_rules([_write(tmp_path, "r.yaml", text)], include_shipped=False).by_id()
    absence = rules["ACME-7"]
    assert (absence.type, absence.severity, absence.enabled, absence.tags) == (
        "absence",
        "warning",
        False,
        ("approval", "team.payments"),
    )
    assert absence.description == "Two lines\nof description."
    assert absence.within_s == 5400.0 and absence.within_actions == 3
    assert absence.deadline is not None and absence.condition is not None and len(absence.group_by) == 2
    assert (absence.pos.line, absence.pos.col) == (3, 5)
    count = rules["ACME-8"]
    assert (count.threshold, count.window_s, count.condition) == (5, 90.0, None)
    seq = rules["ACME-9"]
    assert (seq.keep, seq.report_on, seq.within_s, seq.strict_only) == ("latest", "first", 7 * 86400.0, True)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90.0), ("5m", 300.0), ("2h", 7200.0), ("7d", 604800.0), ("1w", 604800.0), ("1h30m", 5400.0),
     ("1.5h", 5400.0), ("250ms", 0.25), ("1m30s500ms", 90.5)],
)  # fmt: skip
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "5", "5 m", "m", "1h1h", "30m1h", "0s", "-5m", "401d", "5M", "1h 30m"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


# -- overrides ------------------------------------------------------------------------


def _run(ruleset: RuleSet, path: Path, *, strict: bool) -> list[Violation]:
    engine = Engine(ruleset, EngineOptions(strict=strict))
    out: list[Violation] = []
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, 1):
            item = parse_line(raw, path.name, number, seq=number)
            if item is not None:
                out.extend(engine.submit(item))
    out.extend(engine.finish())
    return out


BAD_LOG = TESTDATA / "skill-fixtures" / "actions.bad.jsonl"
GOOD_LOG = TESTDATA / "skill-fixtures" / "actions.good.jsonl"
SKILL_VERDICTS = [(4, "DS001"), (5, "DS001"), (6, "DS002"), (7, "DS003"), (8, "DS004"), (9, "DS005"),
                  (10, "DS006"), (10, "DS007"), (12, "DS009"), (13, "DS000")]  # fmt: skip


def test_override_disables_and_regrades(tmp_path: Path) -> None:
    user = _write(
        tmp_path,
        "team.yaml",
        "version: 1\noverrides:\n  - id: DS008\n    enabled: false\n  - id: DS001\n    severity: warning\n",
    )
    ruleset = load_rules([user])
    rules = ruleset.by_id()
    assert rules["DS008"].enabled is False
    assert rules["DS001"].severity == "warning"
    verdicts = _run(ruleset, BAD_LOG, strict=True)
    assert sorted((v.line, v.rule) for v in verdicts) == sorted(SKILL_VERDICTS)
    assert {v.severity for v in verdicts if v.rule == "DS001"} == {"warning"}


def test_override_turns_a_strict_only_rule_on_everywhere(tmp_path: Path) -> None:
    user = _write(tmp_path, "team.yaml", "version: 1\noverrides:\n  - id: DS008\n    strict_only: false\n")
    verdicts = _run(load_rules([user]), BAD_LOG, strict=False)
    assert (11, "DS008") in {(v.line, v.rule) for v in verdicts}


def test_override_twice_is_an_error(tmp_path: Path) -> None:
    a = _write(tmp_path, "a.yaml", "version: 1\noverrides:\n  - id: DS007\n    enabled: false\n")
    b = _write(tmp_path, "b.yaml", "version: 1\noverrides:\n  - id: DS007\n    severity: info\n")
    assert [str(p) for p in lint([a, b])] == [f"{b}:3:9: override DS007: DS007 is already overridden at {a}:3:9"]


def test_override_of_a_user_rule(tmp_path: Path) -> None:
    a = _write(tmp_path, "a.yaml", "version: 1\nrules:\n" + RULE.format(id="ACME1", name="one", condition="true"))
    b = _write(tmp_path, "b.yaml", "version: 1\noverrides:\n  - id: ACME1\n    severity: critical\n")
    assert load_rules([a, b]).by_id()["ACME1"].severity == "critical"


# -- the shipped packs ------------------------------------------------------------------


def test_shipped_rules_dir_in_a_checkout() -> None:
    assert shipped_rules_dir() == REPO / "rules"
    assert [p.name for p in shipped_rule_files()] == ["durable-sessions.yaml", "session-checks.yaml"]


def test_shipped_packs_hold_the_contract_ids() -> None:
    ruleset = load_rules([])
    ids = [r.id for r in ruleset.rules]
    assert ids == [f"DS00{i}" for i in range(10)] + [f"DS1{i:02d}" for i in range(1, 13)] + ["DS114"]
    names = {r.id: r.name for r in ruleset.rules}
    assert names["DS000"] == "malformed-record" and names["DS009"] == "duplicate-action-id"
    assert names["DS105"] == "retry-cap-not-escalated" and names["DS110"] == "checkpoint-lags-side-effect"
    assert [r.id for r in ruleset.rules if r.strict_only] == ["DS008"]
    assert all(r.enabled for r in ruleset.rules)
    assert all(r.description and r.message.source for r in ruleset.rules)


def test_a_shipped_pack_named_by_path_is_loaded_once() -> None:
    ruleset = load_rules([REPO / "rules" / "durable-sessions.yaml", REPO / "rules"])
    assert len(ruleset.rules) == 23


def test_without_shipped_packs_only_the_files_named(tmp_path: Path) -> None:
    user = _write(tmp_path, "a.yaml", "version: 1\nrules:\n" + RULE.format(id="ACME1", name="one", condition="true"))
    assert [r.id for r in load_rules([user], include_shipped=False).rules] == ["ACME1"]


def test_strict_only_rules_can_be_left_out() -> None:
    assert "DS008" not in load_rules([], strict_only_ok=False).by_id()
    assert "DS008" in load_rules([]).by_id()


@pytest.mark.parametrize("strict", [False, True])
def test_skill_fixture_verdicts(strict: bool) -> None:
    ruleset = load_rules([])
    assert _run(ruleset, GOOD_LOG, strict=strict) == []
    expected = SKILL_VERDICTS + ([(11, "DS008")] if strict else [])
    assert sorted((v.line, v.rule) for v in _run(ruleset, BAD_LOG, strict=strict)) == sorted(expected)


def test_skill_fixture_messages_say_what_recovery_would_do() -> None:
    verdicts = {(v.line, v.rule): v for v in _run(load_rules([]), BAD_LOG, strict=True)}
    assert verdicts[(4, "DS001")].message.startswith(
        "user_prompt b01 succeeded with no recorded result: recovery would ask the human the same question again"
    )
    assert "would perform it again" in verdicts[(6, "DS002")].message
    assert verdicts[(12, "DS009")].message.startswith("action id b02 is used again (first as llm_call, now as clock)")
    assert verdicts[(13, "DS000")].message.startswith("missing required field action_id: recovery cannot replay")
    assert verdicts[(6, "DS002")].severity == "critical" and verdicts[(9, "DS005")].severity == "critical"


# -- bounds -------------------------------------------------------------------------------


def test_file_size_is_bounded(tmp_path: Path) -> None:
    path = _write(tmp_path, "big.yaml", "version: 1\nrules: []\n" + "#" * MAX_FILE_BYTES)
    [problem] = lint([path], include_shipped=False)
    assert str(problem).startswith(f"{path}:1:1: file is ")


def test_expression_length_is_bounded(tmp_path: Path) -> None:
    long_condition = " || ".join(["record.kind == 'x'"] * (MAX_EXPRESSION_CHARS // 10))
    path = _write(
        tmp_path, "r.yaml", "version: 1\nrules:\n" + RULE.format(id="X1", name="long", condition=long_condition)
    )
    [problem] = lint([path], include_shipped=False)
    assert f"at most {MAX_EXPRESSION_CHARS} are allowed" in str(problem)
    assert str(problem).startswith(f"{path}:6:16: rule X1 (long): condition is ")


def test_rules_per_file_are_bounded(tmp_path: Path) -> None:
    body = "".join(
        f"  - {{id: X{i}, name: r, severity: info, condition: 'true', message: m}}\n"
        for i in range(MAX_RULES_PER_FILE + 1)
    )
    path = _write(tmp_path, "many.yaml", "version: 1\nrules:\n" + body)
    assert [str(p) for p in lint([path], include_shipped=False)] == [
        f"{path}:3:3: {MAX_RULES_PER_FILE + 1} rules in one file; at most {MAX_RULES_PER_FILE} are allowed"
    ]


def test_unreadable_and_non_utf8_files(tmp_path: Path) -> None:
    missing = tmp_path / "missing.yaml"
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"version: 1\nrules: []\n\xff\xfe")
    problems = [str(p) for p in lint([missing, binary], include_shipped=False)]
    assert problems == [
        f"{missing}: cannot read rule file: No such file or directory",
        f"{binary}: not UTF-8 text (byte 21)",
    ]


def test_yaml_aliases_do_not_expand_into_rules(tmp_path: Path) -> None:
    text = "version: 1\nlists:\n  a: &a [x, y]\n  b: [*a, *a]\nrules: []\n"
    path = _write(tmp_path, "alias.yaml", text)
    # The aliased node is one node: its problem is said once, not once per alias.
    assert [str(p) for p in lint([path], include_shipped=False)] == [
        f"{path}:3:6: an item of list b must be a string, got a list",
    ]


def test_a_duplicate_id_is_reported_even_when_either_rule_has_other_problems(tmp_path: Path) -> None:
    rule = "  - id: X1\n    name: {name}\n    severity: {severity}\n    type: condition\n    condition: 'true'\n"
    rule += "    message: m\n"
    text = "version: 1\nrules:\n" + rule.format(name="one", severity="loud") + rule.format(name="two", severity="info")
    path = _write(tmp_path, "dup.yaml", text)
    found = [str(p) for p in lint([path], include_shipped=False)]
    assert f"{path}:9:9: rule X1 (two): duplicate id X1: already used at {path}:3:9" in found
    assert any("severity" in p and ":5:" in p for p in found)
    swapped = "version: 1\nrules:\n" + rule.format(name="one", severity="info")
    swapped += rule.format(name="two", severity="loud")
    path.write_text(swapped, encoding="utf-8")
    found = [str(p) for p in lint([path], include_shipped=False)]
    assert f"{path}:9:9: rule X1 (two): duplicate id X1: already used at {path}:3:9" in found
    assert any("severity" in p and ":11:" in p for p in found)


def test_constant_deadline_and_message_types(tmp_path: Path) -> None:
    text = (
        "version: 1\nrules:\n  - id: X1\n    name: wait\n    severity: info\n    type: absence\n"
        "    first: 'true'\n    then: 'false'\n    deadline: 600\n    message: 5\n"
    )
    path = _write(tmp_path, "r.yaml", text)
    assert [str(p) for p in lint([path], include_shipped=False)] == [
        f"{path}:10:14: rule X1 (wait): message must be a string, got an integer"
    ]
    path.write_text(text.replace("message: 5", "message: waited"), encoding="utf-8")
    rule = load_rules([path], include_shipped=False).by_id()["X1"]
    assert rule.deadline is not None and rule.deadline.evaluate({}) == 600


def test_record_fields_declare_fields_beyond_the_convention(tmp_path: Path) -> None:
    rule = RULE.format(id="ACME1", name="big-payment", condition="has(record.amount_gbp) && record.amount_gbp > 1000")
    undeclared = _write(tmp_path, "a.yaml", "version: 1\nrules:\n" + rule)
    text = undeclared.read_text(encoding="utf-8")
    line, col = _column_of(text, "amount_gbp")
    second = text.splitlines()[line - 1].index("amount_gbp", col) + 1  # both uses are told
    assert [str(p) for p in lint([undeclared])] == [
        f"{undeclared}:{line}:{col}: rule ACME1 (big-payment): condition: 'record' has no field 'amount_gbp'",
        f"{undeclared}:{line}:{second}: rule ACME1 (big-payment): condition: 'record' has no field 'amount_gbp'",
    ]
    declared = _write(tmp_path, "b.yaml", "version: 1\nrecord_fields: [amount_gbp, kind, 9lives]\nrules:\n" + rule)
    assert [str(p) for p in lint([declared])] == [
        f"{declared}:2:29: record_fields: kind is a field of the convention already; list only your own fields",
        f"{declared}:2:35: record_fields: '9lives' is not a valid name "
        "(letters, digits and _, not starting with a digit)",
    ]
    declared.write_text("version: 1\nrecord_fields: [amount_gbp]\nrules:\n" + rule, encoding="utf-8")
    log = _write(
        tmp_path,
        "log.jsonl",
        '{"session_id":"s","action_id":"a1","kind":"payment","status":"ok","result":1,"idempotency_key":"k1",'
        '"amount_gbp":2180}\n'
        '{"session_id":"s","action_id":"a2","kind":"payment","status":"ok","result":1,"idempotency_key":"k2",'
        '"amount_gbp":20}\n',
    )
    verdicts = _run(load_rules([declared]), log, strict=False)
    assert [(v.rule, v.action_id) for v in verdicts] == [("ACME1", "a1")]


def test_a_condition_reports_every_unknown_name_field_and_function(tmp_path: Path) -> None:
    condition = 'record.kindd == "x" && nosuchfn(record.kind) && record.statuss == "ok" && nope'
    path = _write(tmp_path, "r.yaml", "version: 1\nrules:\n" + RULE.format(id="X1", name="many", condition=condition))
    problems = [str(p) for p in lint([path], include_shipped=False)]
    column = 16  # where the condition's value starts on its line
    assert problems == [
        f"{path}:6:{column + condition.index('kindd')}: rule X1 (many): condition: 'record' has no field 'kindd'"
        " (did you mean 'kind'?)",
        f"{path}:6:{column + condition.index('nosuchfn')}: rule X1 (many): condition: unknown function 'nosuchfn'",
        f"{path}:6:{column + condition.index('statuss')}: rule X1 (many): condition: 'record' has no field 'statuss'"
        " (did you mean 'status'?)",
        f"{path}:6:{column + condition.index('nope')}: rule X1 (many): condition: undeclared reference to 'nope'",
    ]
