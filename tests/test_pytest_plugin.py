"""The pytest plugin in a pytest subprocess against real agents (pydantic-ai, LangGraph, the Agents SDK), offline."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent

# The agent tests a team would write: the same agent charging a card with and without an
# idempotency key, one run per framework; the model is pydantic-ai's FunctionModel or the
# local fake OpenAI server (tests/fake_openai.py).
AGENT_TESTS = '''
import pytest
from opentelemetry import trace
from pydantic_ai import Agent
from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import FunctionModel

from durable_check import annotate
from tests.framework_support import run_program

Agent.instrument_all(True)  # the global tracer provider, the one the plugin watches


def charge(session, key):
    with annotate.action("charge card", "payment", action_id="pay", session_id=session, idempotency_key=key):
        return "charged"


def run_function_model(session, key=None):
    def model(messages, info):
        if len(messages) == 1:
            return ModelResponse(parts=[ToolCallPart("place_order", {"amount": 10})])
        return ModelResponse(parts=[TextPart("done")])

    agent = Agent(FunctionModel(model), name="shop")

    @agent.tool_plain
    def place_order(amount: int) -> str:
        return charge(session, key)

    assert agent.run_sync("buy", conversation_id=session).output == "done"


class GlobalProvider:
    provider = trace.get_tracer_provider()


def run_framework(framework, session, key=None):
    run_program(framework, GlobalProvider(), [("place_order", {"order": "o-1"})],
                {"place_order": lambda order: charge(session, key)}, session=session)


def test_pydantic_ai_charges_without_a_key():
    run_function_model("shop-1")


def test_pydantic_ai_charges_with_a_key():
    run_function_model("shop-2", key="shop-2-charge")


@pytest.mark.parametrize("framework", ["langgraph", "agents-sdk"])
def test_framework_charges_without_a_key(framework):
    run_framework(framework, f"{framework}-1")


@pytest.mark.parametrize("framework", ["langgraph", "agents-sdk"])
def test_framework_charges_with_a_key(framework):
    run_framework(framework, f"{framework}-2", key=f"{framework}-2-charge")


def test_waived_charge():
    run_function_model("refund-1")


def test_plain_code():
    assert 1 + 1 == 2
'''

INI = "[pytest]\ndurable_check_fail_on = critical\n"
WAIVERS = "waivers:\n  - rule: DS002\n    session: refund-*\n    reason: refunds are keyed by the provider\n"


@pytest.fixture
def project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makeini(INI)
    pytester.makepyfile(test_agent=AGENT_TESTS)
    (pytester.path / "waivers.yaml").write_text(WAIVERS, encoding="utf-8")
    return pytester


def _run(project: pytest.Pytester, *args: str) -> pytest.RunResult:
    return project.runpytest_subprocess("-p", "no:cacheprovider", *args,
                                        timeout=240)


@pytest.mark.slow
def test_a_charge_without_a_key_fails_with_ds002_named_at_the_test_in_every_framework(
        project: pytest.Pytester) -> None:
    result = _run(project, "--durable-check", "--durable-check-waivers", "waivers.yaml",
                  "--junitxml", "junit.xml", "-rA")
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed") == 3 and outcomes.get("passed") == 5, result.stdout.str()
    for failing, session in [("test_pydantic_ai_charges_without_a_key", "shop-1"),
                             ("test_framework_charges_without_a_key[langgraph]", "langgraph-1"),
                             ("test_framework_charges_without_a_key[agents-sdk]", "agents-sdk-1")]:
        pattern = failing.replace("[", "[[]")  # fnmatch reads [ as a character class
        result.stdout.fnmatch_lines([f"FAILED test_agent.py::{pattern} - *"])
        # The failure names the test and, under it, the rule, the session and the action.
        result.stdout.fnmatch_lines([
            f"Durable Check: 1 finding(s) at or above critical in test_agent.py::{pattern}",
            f"  DS002 unkeyed-side-effect (critical) at session {session} action pay: payment pay succeeded *"])
    # The waived finding passes and is said to be waived, with its reason and where the waiver is.
    result.stdout.fnmatch_lines(["*test_waived_charge: [[]waived] DS002 unkeyed-side-effect (critical) at session "
                                 "refund-1 action pay: *(waived: refunds are keyed by the provider; "
                                 "waivers.yaml:2:5)"])
    result.stdout.fnmatch_lines(["*= durable-check =*", "*8 test(s) checked: * 3 failing, 1 waived"])

    cases = {case.get("name"): case for case in ET.parse(project.path / "junit.xml").iter("testcase")}
    props = {c: [(p.get("name"), p.get("value")) for p in case.iter("property")] for c, case in cases.items()}
    assert ("durable_check.DS002" in [n for n, _ in props["test_pydantic_ai_charges_without_a_key"]])
    assert cases["test_pydantic_ai_charges_without_a_key"].find("failure") is not None
    assert [n for n, _ in props["test_waived_charge"] if "DS002" in n] == ["durable_check.waived.DS002"]
    assert cases["test_waived_charge"].find("failure") is None
    assert not [n for n, _ in props["test_pydantic_ai_charges_with_a_key"] if "DS002" in n]
    assert props["test_plain_code"] == []


@pytest.mark.slow
def test_off_the_plugin_changes_nothing(project: pytest.Pytester) -> None:
    # The plugin is loaded but not asked for: the keyless charges pass, nothing is checked or written.
    off = _run(project, "--junitxml", "off.xml")
    off.assert_outcomes(passed=8)
    # (The session header lists the installed plugin among the others; nothing after it names it.)
    assert "durable-check" not in off.stdout.str().split("collected", 1)[1]
    assert not list(ET.parse(project.path / "off.xml").iter("property"))


def test_the_marker_and_the_fixture(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makeini("[pytest]\ndurable_check = true\n")
    pytester.makepyfile(test_marked='''
import pytest
from opentelemetry import trace
from durable_check import annotate


def charge(session, key=None):
    with annotate.action("charge card", "payment", action_id="pay", session_id=session, idempotency_key=key):
        pass


def ask(session):
    with annotate.action("ask", "user_prompt", action_id="ask", session_id=session) as span:
        annotate.set_action("user_prompt", result_recorded=True, span=span)


@pytest.mark.durable_check(fail_on="never")
def test_listed_not_failed():
    charge("s-1")


def test_asserts_on_its_findings(durable_findings):
    charge("s-2")
    assert durable_findings.rules == {"DS002"}
    charge("s-2b", key="k")
    assert durable_findings.rules == {"DS002"}


@pytest.mark.durable_check(packs=["session-checks"])
def test_only_the_session_checks_pack():
    charge("s-3")


def test_fails_by_default():
    charge("s-4")
''')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider",
                                           timeout=120)
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(["FAILED test_marked.py::test_fails_by_default - *"])
    result.stdout.fnmatch_lines(["*test_listed_not_failed: [[]warning] DS002*",
                                 "*test_asserts_on_its_findings: [[]warning] DS002 * at session s-2 action pay*"])
    assert "test_only_the_session_checks_pack: [warning] DS002" not in result.stdout.str()


def test_a_baseline_written_by_one_run_accepts_its_findings_in_the_next(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makeini("[pytest]\ndurable_check = true\n")
    test = """
from durable_check import annotate


def test_charges():
    with annotate.action("charge card", "payment", action_id="pay", session_id="s-1"):
        pass
"""
    pytester.makepyfile(test_charge=test)
    args = ("-p", "no:cacheprovider")
    first = pytester.runpytest_subprocess(*args, "--durable-check-write-baseline", "baseline.json", timeout=120)
    first.assert_outcomes(failed=1)
    assert (pytester.path / "baseline.json").exists()
    again = pytester.runpytest_subprocess(*args, "--durable-check-baseline", "baseline.json", timeout=120)
    again.assert_outcomes(passed=1)
    again.stdout.fnmatch_lines(["*test_charges: [[]waived] DS002 * (waived: in the baseline; baseline.json)"])
    # A second keyless charge is new: the baseline counted one.
    pytester.makepyfile(test_charge=test + """
    with annotate.action("charge card", "payment", action_id="pay-2", session_id="s-1"):
        pass
""")
    new = pytester.runpytest_subprocess(*args, "--durable-check-baseline", "baseline.json", timeout=120)
    new.assert_outcomes(failed=1)
    new.stdout.fnmatch_lines(["  DS002 unkeyed-side-effect (critical) at session s-1 action pay-2: *"])


def test_a_bad_setting_is_one_clear_error(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makeini("[pytest]\ndurable_check = true\ndurable_check_fail_on = loud\n")
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider",
                                           timeout=120)
    assert result.ret != 0
    assert "durable_check_fail_on: 'loud' is not one of critical, error, warning, info, never" in result.stderr.str()
    assert "Traceback" not in result.stderr.str()

    # A mistake in the waiver file is named at its place, before any test runs.
    pytester.makeini("[pytest]\ndurable_check = true\ndurable_check_waivers = waivers.yaml\n")
    (pytester.path / "waivers.yaml").write_text("waivers:\n  - rule: DS002\n    reasn: x\n", encoding="utf-8")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider",
                                           timeout=120)
    assert result.ret != 0
    assert "waivers.yaml:3:5: waivers[0].reasn: unknown key (did you mean 'reason'?)" in result.stderr.str()
    assert "Traceback" not in result.stderr.str()
