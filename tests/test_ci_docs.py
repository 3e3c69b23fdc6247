"""Every example of docs/ci.md, run: the plugin's ini and test file, the waiver file, the baseline
commands, the GitHub Actions workflow (validated against its published schema), the GitLab job and
the pre-commit hooks. The examples are read from the page, so the page cannot drift from what works."""

from __future__ import annotations

import json
import re
import shlex
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from junitparser import Failure, JUnitXml

from processor import cli
from processor.configfmt import load_yaml_strict

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ci.md"
DATA = Path(__file__).parent / "testdata"
# SchemaStore's schema of GitHub Actions workflow files; see tests/testdata/README.md for its source.
WORKFLOW_SCHEMA = DATA / "github-workflow.json"
SARIF_SCHEMA = DATA / "sarif-schema-2.1.0.json"
_BLOCK = re.compile(r"<!-- (file|commands): (\S+) -->\n```\w*\n(.*?)```", re.DOTALL)
# A command of a CI script line, without the shell around it (`status=0; ... || status=$?`).
_COMMAND = re.compile(r"\b((?:pytest|durable-check) [^|;]*)")


def doc_blocks() -> dict[str, str]:
    return {name: body for _, name, body in _BLOCK.findall(DOC.read_text(encoding="utf-8"))}


def _yaml(name: str) -> Any:
    # The configuration loader: `on:` stays a key (YAML 1.1 would read it as true).
    return load_yaml_strict(doc_blocks()[name], f"docs/ci.md ({name})")


def _durable_check(command: str) -> int:
    argv = shlex.split(command)
    assert argv[0] == "durable-check"
    return cli.main(argv[1:])


def _command(line: str) -> str:
    found = _COMMAND.search(line)
    assert found, line
    return found.group(1).strip()


def test_the_page_holds_every_example() -> None:
    assert set(doc_blocks()) == {"pytest.ini", "test_checkout.py", "durable-waivers.yaml", "baseline",
                                 ".github/workflows/durable-check.yml", ".gitlab-ci.yml", ".pre-commit-config.yaml"}


def test_the_github_workflow_is_valid_by_its_published_schema() -> None:
    workflow = _yaml(".github/workflows/durable-check.yml")
    jsonschema.validate(workflow, json.loads(WORKFLOW_SCHEMA.read_text(encoding="utf-8")))
    # The schema is strict enough to catch a mistake a person makes.
    broken = {**workflow, "jobs": {"agent-tests": {**workflow["jobs"]["agent-tests"], "runs_on": "ubuntu-latest"}}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, json.loads(WORKFLOW_SCHEMA.read_text(encoding="utf-8")))


@pytest.mark.slow
def test_the_plugin_waivers_baseline_and_ci_recipes_run_as_written(pytester: pytest.Pytester,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    blocks = doc_blocks()
    pytester.makefile(".ini", pytest=blocks["pytest.ini"])
    pytester.makepyfile(test_checkout=blocks["test_checkout.py"])
    (pytester.path / "durable-waivers.yaml").write_text(blocks["durable-waivers.yaml"], encoding="utf-8")
    workflow = _yaml(".github/workflows/durable-check.yml")
    steps = workflow["jobs"]["agent-tests"]["steps"]
    runs = [step["run"] for step in steps if "run" in step]
    assert runs[0].startswith("pip install durable-check")

    # The workflow's test step: the plugin fails no test here (the keyless charge is waived or listed).
    pytest_argv = shlex.split(runs[1])
    assert pytest_argv[0] == "pytest"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider",
                                           *pytest_argv[1:], timeout=240)
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["*test_legacy_checkout: [[]waived] DS002 * at session legacy-3 action o-1-charge:*"
                                 "(waived: the legacy checkout is deduplicated by the payment provider (PAY-311); "
                                 "durable-waivers.yaml:2:5)"])
    result.stdout.fnmatch_lines(["*test_prototype_flow: [[]warning] DS002 * at session prototype-4 *"])
    assert "checkout-1" not in result.stdout.str().split("= durable-check =")[1].split("DS002")[0]
    assert (pytester.path / "spans.otlp").stat().st_size > 0
    assert "durable_check.waived.DS002" in _properties(pytester.path / "pytest.xml", "test_legacy_checkout")

    # Without the baseline the dump has findings; the baseline written from it accepts them all.
    assert cli.main(["replay", "spans.otlp"]) == 1
    write, check = blocks["baseline"].strip().splitlines()
    assert _durable_check(write) == 1 and (pytester.path / "durable-baseline.json").exists()
    assert _durable_check(check) == 0

    # The workflow's replay step writes SARIF with every finding suppressed, with its justification.
    assert _durable_check(runs[2]) == 0
    sarif = json.loads((pytester.path / "durable-check.sarif").read_text(encoding="utf-8"))
    jsonschema.validate(sarif, json.loads(SARIF_SCHEMA.read_text(encoding="utf-8")))
    results = sarif["runs"][0]["results"]
    assert results and all(r["suppressions"] for r in results)
    legacy = [r for r in results if r["ruleId"] == "DS002" and r["properties"]["session_id"] == "legacy-3"]
    assert [r["suppressions"][0]["justification"] for r in legacy] == [
        "the legacy checkout is deduplicated by the payment provider (PAY-311)"]
    upload = steps[-1]
    assert upload["uses"].startswith("github/codeql-action/upload-sarif@")
    assert upload["with"]["sarif_file"] == "durable-check.sarif"

    # The GitLab job: the same test command, and a JUnit report with no failure and the waived findings named.
    job = _yaml(".gitlab-ci.yml")["durable-check"]
    assert job["script"][0].startswith("pip install durable-check")
    commands = [_command(line) for line in job["script"][1:] if "pytest" in line or "durable-check " in line]
    assert commands[0] == runs[1]
    assert _durable_check(commands[1]) == 0
    report = pytester.path / "durable-check.xml"
    assert str(report.name) in job["artifacts"]["reports"]["junit"]
    cases = [case for suite in JUnitXml.fromfile(str(report)) for case in suite]
    assert cases and not any(isinstance(r, Failure) for case in cases for r in case.result)
    assert "durable-check.waived.DS002" in _properties(report, "legacy-3")


def _properties(junit: Path, case: str) -> set[str]:
    found = [c for c in ET.parse(junit).iter("testcase") if c.get("name") == case]
    assert found, f"no test case {case} in {junit.name}"
    return {str(p.get("name")) for c in found for p in c.iter("property")}


RULES = """version: 1
lists:
  risky_tools: [wire_transfer, delete_repo]
record_fields: [tool]
rules:
  - id: ACME001
    name: risky-tool-unkeyed
    severity: critical
    condition: >-
      record.kind == "tool_call" && has(record.tool) && record.tool in lists.risky_tools
      && !(has(record.idempotency_key) && record.idempotency_key != "")
    message: "{{ record.action_id }} ran a risky tool with no idempotency_key"
"""
RULE_TESTS = """rule_files: [acme.yaml]
tests:
  - name: a wire transfer with no key
    input:
      - {session_id: s1, action_id: a1, kind: tool_call, status: ok, tool: wire_transfer, result: 1}
    expect:
      - {rule: ACME001, action_id: a1, line: 1}
"""


def _hook_files(hook: dict[str, Any], root: Path) -> list[str]:
    names = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    return [n for n in names if re.search(hook["files"], n) and not re.search(hook.get("exclude", "^$"), n)]


def test_the_pre_commit_hooks_check_and_test_a_repositorys_rule_files(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    shipped = {h["id"]: h for h in load_yaml_strict((ROOT / ".pre-commit-hooks.yaml").read_text(), "hooks")}
    (local,) = _yaml(".pre-commit-config.yaml")["repos"]
    assert local["repo"] == "local"
    rules = tmp_path / "durable-rules"
    rules.mkdir()
    (rules / "acme.yaml").write_text(RULES, encoding="utf-8")
    (rules / "acme.test.yaml").write_text(RULE_TESTS, encoding="utf-8")
    (tmp_path / "deploy.yaml").write_text("not: a rule file\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    for hook in local["hooks"]:
        assert hook["entry"] == shipped[hook["id"]]["entry"]
        for definition in (hook, shipped[hook["id"]]):
            files = _hook_files(definition, tmp_path)
            expected = "durable-rules/acme.test.yaml" if "test" in hook["id"] else "durable-rules/acme.yaml"
            assert files == [expected]
        assert _durable_check(f"{hook['entry']} {shlex.join(files)}") == 0, capsys.readouterr()

    # A mistake in a rule file fails the hook, naming its place.
    (rules / "acme.yaml").write_text(RULES.replace("severity: critical", "severity: loud"), encoding="utf-8")
    check = next(h for h in local["hooks"] if h["id"] == "durable-check-rules")
    capsys.readouterr()
    assert _durable_check(f"{check['entry']} durable-rules/acme.yaml") != 0
    assert "durable-rules/acme.yaml:8:" in capsys.readouterr().out
