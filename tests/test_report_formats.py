"""replay --format html/junit/sarif --output: read back by Chromium, a JUnit parser and the SARIF 2.1.0 schema."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import jsonschema
import orjson
import pytest
from junitparser import Failure, JUnitXml
from playwright.sync_api import Browser, expect

from processor import cli
from tests.browser_support import browser, screenshot

__all__ = ["browser"]

DATA = Path(__file__).parent / "testdata"
BAD_LOG = DATA / "skill-fixtures" / "actions.bad.jsonl"
GOOD_LOG = DATA / "skill-fixtures" / "actions.good.jsonl"
SPANS = DATA / "readers" / "spans.otlp.jsonl"


def _replay(tmp_path: Path, fmt: str, *inputs: Path) -> tuple[int, Path]:
    out = tmp_path / f"report.{fmt}"
    code = cli.main(["replay", *map(str, inputs), "--format", fmt, "--output", str(out)])
    return code, out


def _json_report(tmp_path: Path, *inputs: Path) -> dict[str, Any]:
    code, out = _replay(tmp_path, "json", *inputs)
    assert code in (0, 1)
    report: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    return report


def test_html_report_opens_from_disk_and_shows_what_json_shows(tmp_path: Path, browser: Browser) -> None:
    expected = _json_report(tmp_path, BAD_LOG, SPANS)
    code, html = _replay(tmp_path, "html", BAD_LOG, SPANS)
    assert code == 1
    text = html.read_text(encoding="utf-8")
    assert "http://" not in text.split("<script>")[0] and "src=" not in text and "href=\"http" not in text
    page = browser.new_page()
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    try:
        page.goto(html.as_uri())
        expect(page.locator("h1")).to_have_text("Durable Check replay report")
        shown_sessions = {s.get_attribute("data-session") for s in page.locator("section.session").all()}
        assert shown_sessions == {s["session_id"] for s in expected["sessions"]}
        # Every violation of the JSON report is in the list of all violations, with its rule and session.
        rows = page.locator("table").last.locator("tbody tr")
        expect(rows).to_have_count(len(expected["violations"]))
        shown = sorted((r.locator("td").nth(1).inner_text().split(" ")[0], r.locator("td").nth(2).inner_text())
                       for r in rows.all())
        assert shown == sorted((v["rule"], v["session_id"]) for v in expected["violations"])
        # Inside each session, violations sit in its timeline.
        first = expected["violations"][0]
        section = page.locator(f"section.session[data-session='{first['session_id']}']")
        expect(section.locator(f"tr.violation-row[data-rule={first['rule']}]").first).to_be_visible()
        screenshot(page, "replay-report")
        assert requests == [html.as_uri()]  # nothing fetched: the file is all there is
    finally:
        page.close()


def test_html_report_counts_sessions_as_the_text_report_and_places_unreadable_lines(
        tmp_path: Path, browser: Browser) -> None:
    log = tmp_path / "mixed.jsonl"
    log.write_text('{"session_id":"s1","action_id":"a1","kind":"payment","status":"ok"}\n'
                   "not json\n"
                   '{"session_id":"s2","action_id":"b1","kind":"llm_call","status":"ok","result":"x"}\n',
                   encoding="utf-8")
    expected = _json_report(tmp_path, log)
    code, html = _replay(tmp_path, "html", log)
    assert code == 1
    page = browser.new_page()
    try:
        page.goto(html.as_uri())
        facts = page.locator("dl.facts")
        expect(facts.locator("dt", has_text="Sessions").locator("xpath=following-sibling::dd[1]")).to_have_text(
            str(len(expected["sessions"])))  # 2, as the text and JSON reports say: the unread line is no session
        shown = {s.get_attribute("data-session") for s in page.locator("section.session").all()}
        assert shown == {"s1", "s2"}
        # The malformed line is listed apart, by input and line, and not under any action.
        unread = page.locator("table", has=page.locator("caption", has_text="Lines that could not be read"))
        expect(unread.locator("tbody tr")).to_have_count(1)
        expect(unread.locator("tbody tr td").first).to_have_text(f"{log}:2")
        expect(page.locator("section.session tr.violation-row[data-rule=DS000]")).to_have_count(0)
        # Every violation says where its record was read.
        rows = page.locator("table").last.locator("tbody tr")
        assert sorted(r.locator("td").last.inner_text() for r in rows.all()) == [f"{log}:1", f"{log}:2"]
    finally:
        page.close()


def test_junit_report_reads_back(tmp_path: Path) -> None:
    expected = _json_report(tmp_path, BAD_LOG, GOOD_LOG)
    code, out = _replay(tmp_path, "junit", BAD_LOG, GOOD_LOG)
    assert code == 1
    xml = JUnitXml.fromfile(str(out))
    suites = {suite.name: suite for suite in xml}
    assert set(suites) == {str(BAD_LOG), str(GOOD_LOG)}
    failures: list[tuple[str, str]] = []
    for suite in suites.values():
        for case in suite:
            for result in case.result:
                if isinstance(result, Failure):
                    failures.append((result.type, case.name))
    # DS000 (a malformed line) has a session only when the line named one.
    assert sorted(failures) == sorted((v["rule"], v["session_id"]) for v in expected["violations"])
    good = suites[str(GOOD_LOG)]
    assert good.tests >= 1 and good.failures == 0


@pytest.mark.parametrize("inputs", [(BAD_LOG,), (BAD_LOG, SPANS), (GOOD_LOG,)])
def test_sarif_report_validates_against_the_schema(tmp_path: Path, inputs: tuple[Path, ...]) -> None:
    expected = _json_report(tmp_path, *inputs)
    _, out = _replay(tmp_path, "sarif", *inputs)
    doc = json.loads(out.read_text(encoding="utf-8"))
    schema = json.loads((DATA / "sarif-schema-2.1.0.json").read_text(encoding="utf-8"))
    jsonschema.validate(doc, schema, cls=jsonschema.Draft7Validator,
                        format_checker=jsonschema.Draft7Validator.FORMAT_CHECKER)
    results = doc["runs"][0]["results"]
    assert sorted((r["ruleId"], r["properties"]["session_id"]) for r in results) == sorted(
        (v["rule"], v["session_id"]) for v in expected["violations"])
    for result, violation in zip(results, expected["violations"], strict=True):
        if "line" in violation and violation.get("origin") == str(BAD_LOG):
            location = result["locations"][0]["physicalLocation"]
            assert location["artifactLocation"]["uri"] == str(BAD_LOG)
            assert location["region"]["startLine"] == violation["line"]
    rules = doc["runs"][0]["tool"]["driver"]["rules"]
    assert all(rules[r["ruleIndex"]]["id"] == r["ruleId"] for r in results)


def test_sarif_schema_rejects_what_it_should(tmp_path: Path) -> None:
    # The shipped schema is the real one: a document without runs does not pass.
    schema = json.loads((DATA / "sarif-schema-2.1.0.json").read_text(encoding="utf-8"))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"version": "2.1.0"}, schema, cls=jsonschema.Draft7Validator)


def test_output_to_an_unwritable_place_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["replay", str(BAD_LOG), "--format", "sarif", "--output", str(tmp_path / "no" / "such" / "x")])
    assert code == 2
    assert "--output" in capsys.readouterr().err


# -- whatever the ids hold (XML 1.0 forbids some characters) ------------------------------------

XML_ILLEGAL = ["\x01", "\x1b", "\x0c", "\ufffe", "\uffff", "\x00"]


def test_junit_report_is_well_formed_whatever_the_ids_hold(tmp_path: Path) -> None:
    log = tmp_path / "actions.jsonl"
    sessions = [f"s{i}-{char}-end" for i, char in enumerate(XML_ILLEGAL)] + ["plain-\t-é-session"]
    lines = [{"session_id": s, "action_id": f"pay-{char_index}\x02", "kind": "payment", "status": "ok"}
             for char_index, s in enumerate(sessions)]
    log.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    out = tmp_path / "report.xml"
    assert cli.main(["replay", str(log), "--format", "junit", "--output", str(out)]) == 1
    ET.parse(out)  # Python's own parser: not well-formed would raise
    xml = JUnitXml.fromfile(str(out))
    cases = [case for suite in xml for case in suite]
    assert len(cases) == len(sessions)
    names = [case.name for case in cases]
    assert len(set(names)) == len(sessions), "distinct sessions stay distinct"
    assert "plain-\t-é-session" in names, "legal characters are kept as they are"
    assert all(any(isinstance(r, Failure) for r in case.result) for case in cases)


def test_xml_text_replaces_what_xml_forbids() -> None:
    from processor.report_formats import xml_text

    assert xml_text("a\x01b") == "a\\u0001b"
    assert xml_text("\ud800") == "\\ud800"
    assert xml_text("ok\t\n\r é \U0001f600") == "ok\t\n\r é \U0001f600"
    document = ET.Element("x", name=xml_text("".join(XML_ILLEGAL) + "\ud800"))
    ET.fromstring(ET.tostring(document, encoding="unicode"))
