"""Unit tests for rules (rules/*.test.yaml) and the `durable-check rules` command."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path

import pytest

from processor.cli import main
from processor.errors import RuleFormatError
from processor.evaluate.ruletest import format_result, load_test_file, run_test_file

REPO = Path(__file__).resolve().parents[1]
SHIPPED_TESTS = sorted((REPO / "rules").glob("*.test.yaml"))
RULETEST_DATA = REPO / "tests" / "testdata" / "ruletest"


@pytest.mark.parametrize("path", SHIPPED_TESTS, ids=[p.name for p in SHIPPED_TESTS])
def test_shipped_rule_tests_pass(path: Path) -> None:
    result = run_test_file(path)
    assert result.passed, format_result(result)
    assert len(result.cases) >= 10


def test_shipped_tests_exist_for_both_packs() -> None:
    assert [p.name for p in SHIPPED_TESTS] == ["durable-sessions.test.yaml", "session-checks.test.yaml"]


def test_every_shipped_rule_is_tripped_and_near_missed() -> None:
    """Each shipped rule has a test expecting it, and a "near miss" test named for it that expects none of it."""
    expected_rules: set[str] = set()
    near_missed: set[str] = set()
    for path in SHIPPED_TESTS:
        for case in load_test_file(path).cases:
            expected_rules.update(e.rule for e in case.expect)
            if "near miss" in case.name:
                named = {word for word in case.name.replace(",", " ").split() if word.startswith("DS")}
                assert named, case.name
                assert not named & {e.rule for e in case.expect}, case.name
                near_missed |= named
    shipped = {f"DS00{i}" for i in range(10)} | {f"DS1{i:02d}" for i in range(1, 12)} | {"DS114"}
    assert shipped <= expected_rules
    assert shipped <= near_missed


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_rules_test_passes_on_the_shipped_tests() -> None:
    code, out, _ = _cli("rules", "test", str(REPO / "rules"))
    assert code == 0
    assert out.count("SUCCESS") == 2 and "FAILED" not in out


def test_rules_test_fails_with_a_clear_diff() -> None:
    path = RULETEST_DATA / "wrong.test.yaml"
    code, out, _ = _cli("rules", "test", str(path))
    assert code == 1
    assert f"Unit Testing: {path}\n  FAILED: 3 of 4 tests\n" in out
    assert (
        f'    test "expects the wrong rule" at {path}:4:5:\n'
        "      missing violations (expected, not found):\n"
        "        - {rule: DS002, action_id: a1}\n"
        "      unexpected violations (found, not expected):\n"
        "        - {rule: DS001, session_id: s1, action_id: a1, line: 1, message: 'user_prompt a1 succeeded"
    ) in out
    assert "        - {rule: DS001, action_id: a2, line: 1}\n" in out
    assert "        - {rule: DS001, session_id: s1, action_id: a2, line: 2, message: " in out
    assert (
        f'    test "forgets an open wait" at {path}:17:5:\n'
        "      unexpected open waits:\n"
        "        - {rule: DS107, session_id: s1, action_id: w1, deadline: 2026-01-01T01:00:00Z}\n"
    ) in out
    assert '"right answer"' not in out
    assert out.endswith("1 of 1 test file FAILED\n")


def test_a_rule_that_errors_at_run_time_fails_its_test() -> None:
    result = run_test_file(RULETEST_DATA / "runtime-error.test.yaml")
    [case] = result.cases
    assert not case.passed
    assert (case.missing, case.unexpected, case.rule_errors) == ([], [], {"ACME001": 1})
    assert "        - ACME001: 1 record\n" in format_result(result)


def test_malformed_test_file_reports_every_problem() -> None:
    path = RULETEST_DATA / "malformed.test.yaml"
    with pytest.raises(RuleFormatError) as caught:
        load_test_file(path)
    assert [str(p) for p in caught.value.problems] == [
        f'{path}:3:5: test "bad keys": missing key input',
        f"{path}:4:19: test \"bad keys\": input_format must be one of actions, spans, got 'logs'",
        f'{path}:5:5: test "bad keys": unknown key inputs in a test (did you mean input?)',
        f'{path}:7:25: test "bad keys": unknown key lines in an item of expect (did you mean line?)',
        f'{path}:11:9: test "bad span item": a span input item needs record: {{...}}',
        f'{path}:11:10: test "bad span item": unknown key session_id in a span input item',
        f"{path}:13:13: test \"bad span item\": at: bad duration 'soon': "
        "want a duration such as 90s, 5m, 2h, 7d or 1h30m",
    ]
    code, out, _ = _cli("rules", "test", str(path))
    assert code == 1 and f"{path}:3:5: " in out


def test_rule_test_input_shapes(tmp_path: Path) -> None:
    """Raw lines become DS000, YAML-only values are refused, spans are deduplicated by span id."""
    (tmp_path / "r.yaml").write_text(
        "version: 1\nrules:\n  - {id: T1, name: t, severity: info, condition: 'record.kind == \"x\"', message: m}\n",
        encoding="utf-8",
    )
    (tmp_path / "t.test.yaml").write_text(
        "rule_files: [r.yaml]\n"
        "include_shipped: true\n"
        "tests:\n"
        "  - name: raw\n"
        '    input: [\'{"session_id": "s", "action_id": "a", "kind": "x", "status": "ok"}\', \'oops\']\n'
        "    expect: [{rule: T1, line: 1}, {rule: DS000, line: 2}]\n"
        "  - name: spans\n"
        "    input_format: spans\n"
        "    only_rules: [T1]\n"
        "    input:\n"
        "      - {record: {session_id: s, action_id: a, kind: x, status: ok}, span_id: '01'}\n"
        "      - {record: {session_id: s, action_id: a, kind: x, status: ok}, span_id: '01'}\n"
        "      - {record: {session_id: s, action_id: a, kind: x, status: ok}, span_id: '02',\n"
        "         time: '2026-01-01T00:00:09Z'}\n"
        "    expect: [{rule: T1, action_id: a}, {rule: T1, action_id: a}]\n",
        encoding="utf-8",
    )
    result = run_test_file(tmp_path / "t.test.yaml")
    assert result.passed, format_result(result)

    (tmp_path / "bad.test.yaml").write_text(
        "rule_files: [r.yaml]\ntests:\n  - name: yes-no\n    input:\n"
        "      - {session_id: s, action_id: a, kind: x, status: ok, cacheable: yes}\n"
        "  - name: yes-no\n    input: []\n",
        encoding="utf-8",
    )
    with pytest.raises(RuleFormatError) as caught:
        load_test_file(tmp_path / "bad.test.yaml")
    bad = tmp_path / "bad.test.yaml"
    assert [str(p) for p in caught.value.problems] == [
        f"{bad}:5:71: test \"yes-no\": write true or false, or quote 'yes' to make it a string",
        f'{bad}:6:5: test "yes-no": duplicate test name (first at {bad}:3:5)',
    ]


def test_rule_files_with_problems_fail_the_test_file(tmp_path: Path) -> None:
    (tmp_path / "r.yaml").write_text("version: 1\nrules:\n  - {id: T1}\n", encoding="utf-8")
    (tmp_path / "t.test.yaml").write_text("rule_files: [r.yaml]\ntests: []\n", encoding="utf-8")
    result = run_test_file(tmp_path / "t.test.yaml")
    assert not result.passed
    assert [str(p) for p in result.problems] == [
        f"{tmp_path / 'r.yaml'}:3:5: rule T1: missing keys name, severity, message",
        f"{tmp_path / 'r.yaml'}:3:5: rule T1: missing key type (one of condition, malformed, sequence, absence, "
        "change, count; only a rule with `condition` alone may leave it out)",
    ]


# -- rules check / list -------------------------------------------------------------------


def test_rules_check_ok() -> None:
    code, out, err = _cli("rules", "check", str(REPO / "rules"))
    assert (code, err) == (0, "")
    # Shipped packs are named as the loader names them in every message.
    assert out == "rules/durable-sessions.yaml: SUCCESS: 10 rules\nrules/session-checks.yaml: SUCCESS: 13 rules\n"


def test_rules_check_checks_test_files_named_with_the_rules() -> None:
    code, out, _ = _cli("rules", "check", *sorted(str(p) for p in (REPO / "rules").glob("*.yaml")))
    assert code == 0
    assert f"{REPO / 'rules' / 'session-checks.test.yaml'}: SUCCESS: a valid rule test file\n" in out
    bad = RULETEST_DATA / "malformed.test.yaml"
    code, out, _ = _cli("rules", "check", str(REPO / "rules" / "durable-sessions.yaml"), str(bad))
    assert code == 1
    assert out.splitlines()[1] == f'  {bad}:3:5: test "bad keys": missing key input'
    assert out.endswith("7 problems found\n")


def test_rules_check_reports_every_problem_and_exits_1() -> None:
    bad = REPO / "tests" / "testdata" / "rulefmt" / "several.bad.yaml"
    code, out, _ = _cli("rules", "check", str(bad))
    assert code == 1
    lines = out.splitlines()
    assert lines[0] == "FAILED:"
    assert lines[-1] == "6 problems found"
    assert f"  {bad}:9:14: rule ACME023 (Bad_Name): enabled must be true or false, got 'on'" in out


def test_rules_check_unreadable_exits_2(tmp_path: Path) -> None:
    code, out, err = _cli("rules", "check", str(tmp_path / "nope.yaml"))
    assert (code, out) == (2, "")
    assert err == f"durable-check: cannot read {tmp_path / 'nope.yaml'}: No such file or directory\n"
    code, _, err = _cli("rules", "check", str(tmp_path))
    assert (code, err) == (2, f"durable-check: no rule files (*.yaml, *.yml; tests excluded) in {tmp_path}\n")
    code, _, err = _cli("rules", "test", str(tmp_path))
    assert (code, err) == (2, f"durable-check: no rule test files (*.test.yaml) in {tmp_path}\n")
    code, _, err = _cli("rules", "test", str(tmp_path / "missing.test.yaml"))
    assert code == 2 and "cannot read" in err


def test_rules_check_alone_without_shipped_packs(tmp_path: Path) -> None:
    user = tmp_path / "team.yaml"
    user.write_text("version: 1\noverrides:\n  - id: DS008\n    enabled: true\n", encoding="utf-8")
    assert _cli("rules", "check", str(user))[0] == 0
    code, out, _ = _cli("rules", "check", "--no-shipped", str(user))
    assert code == 1
    assert f"{user}:3:9: override DS008: no rule has id DS008" in out


def test_rules_list_after_overrides(tmp_path: Path) -> None:
    user = tmp_path / "team.yaml"
    user.write_text("version: 1\noverrides:\n  - id: DS007\n    enabled: false\n", encoding="utf-8")
    code, out, _ = _cli("rules", "list", str(user))
    assert code == 0
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert len(rows) == 23
    assert rows["DS007"].endswith("no (disabled)")
    assert rows["DS008"].endswith("strict only")
    assert rows["DS002"].split()[1:4] == ["unkeyed-side-effect", "condition", "critical"]


def test_console_script_runs_rules_test() -> None:
    """The installed entry point's module form, in a child process: nothing depends on the test runner."""
    proc = subprocess.run(
        [sys.executable, "-m", "processor.cli", "rules", "test", "rules/durable-sessions.test.yaml"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("Unit Testing: rules/durable-sessions.test.yaml\n  SUCCESS (")


def test_rule_ids_a_test_names_must_exist(tmp_path: Path) -> None:
    (tmp_path / "t.test.yaml").write_text(
        "rule_files: []\ninclude_shipped: true\ntests:\n"
        "  - name: typo\n    input: []\n    only_rules: [DS0001]\n    expect: [{rule: DS999}]\n",
        encoding="utf-8",
    )
    result = run_test_file(tmp_path / "t.test.yaml")
    path = tmp_path / "t.test.yaml"
    assert [str(p) for p in result.problems] == [
        f'{path}:6:18: test "typo": no loaded rule has id DS0001',
        f'{path}:7:14: test "typo": no loaded rule has id DS999',
    ]
    assert not result.passed


def test_a_span_record_without_required_fields_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "r.yaml").write_text(
        "version: 1\nrules:\n  - {id: T1, name: t, severity: info, condition: 'record.kind == \"x\"', message: m}\n",
        encoding="utf-8",
    )
    path = tmp_path / "t.test.yaml"
    path.write_text(
        "rule_files: [r.yaml]\n"
        "tests:\n"
        "  - name: half-span\n"
        "    input_format: spans\n"
        "    only_rules: [T1]\n"
        "    input:\n"
        "      - {record: {session_id: s, action_id: a, kind: x, status: ok}}\n"
        "      - {record: {session_id: s, kind: x}}\n"
        "    expect: [{rule: T1, action_id: a}]\n",
        encoding="utf-8",
    )
    with pytest.raises(RuleFormatError) as caught:
        load_test_file(path)
    assert [str(p) for p in caught.value.problems] == [
        f'{path}:8:18: test "half-span": input item 2: a span record needs session_id, action_id, kind, status '
        "(missing: action_id, status)"
    ]
