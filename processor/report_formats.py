"""Replay's reports for people and CI systems: a self-contained HTML file, JUnit XML and SARIF 2.1.0.

- **html**: one file with the summary, every session's timeline and the violations;
  the operator view's own stylesheet and script are inlined, and the data is embedded
  as JSON, so it opens from disk with no network.
- **junit**: a test suite per input, a test case per session seen in it, a failure per
  violation (Jenkins, GitLab and most CI systems read it).
- **sarif**: one run; a result per violation, with the file and line for action-log
  input (GitHub code scanning shows them at the line).

Sessions are known to these reports through the read model replay fills
(processor.state.views.MemoryViews).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET  # writing XML only, never parsing it
from collections import defaultdict
from typing import Any, Final, TextIO

import orjson

from processor._version import __version__
from processor.evaluate.model import RuleSet
from processor.operate.app import asset, rules_json
from processor.records import STDIN_ORIGIN
from processor.report import Report
from processor.state.views import MemoryViews
from processor.violations import Violation
from processor.waivers import is_waived, waiver_of

SARIF_SCHEMA: Final = "https://json.schemastore.org/sarif-2.1.0.json"
_SARIF_LEVEL: Final = {"critical": "error", "error": "error", "warning": "warning", "info": "note"}
# What XML 1.0 forbids in a document (control characters, lone surrogates, U+FFFE, U+FFFF):
# one such character written raw makes a CI system reject the whole report.
_NOT_XML: Final = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def xml_text(text: str) -> str:
    """``text`` with every character XML 1.0 forbids written as ``\\uXXXX``, so distinct ids stay distinct."""
    return _NOT_XML.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _sessions_by_input(report: Report, views: MemoryViews) -> dict[str, list[str]]:
    """Per input, the sessions with an action in it (in first-seen order)."""
    out: dict[str, dict[str, None]] = {name: {} for name in report.inputs}
    for sid in views.session_ids():
        for action in views.session_actions(sid):
            out.setdefault(action["origin"], {})[sid] = None
    return {name: list(ids) for name, ids in out.items()}


def write_html(report: Report, views: MemoryViews, rules: RuleSet, out: TextIO) -> None:
    violations = [v.to_json() for v in report.ordered()]
    sessions = [{"session_id": sid, "actions": views.session_actions(sid)} for sid in views.session_ids() if sid]
    known = {s["session_id"] for s in sessions}
    # A session known only from its violations still gets its section; a line that could not be read
    # (DS000, no session) is no session: the report lists it apart, by input and line.
    sessions += [{"session_id": sid, "actions": []} for sid in dict.fromkeys(v["session_id"] for v in violations)
                 if sid and sid not in known]
    data = {
        "inputs": report.inputs,
        "summary": {"actions": report.actions, "malformed": report.malformed, "duplicates": report.duplicates},
        "sessions": sessions,
        "violations": violations,
        "rules": rules_json(rules),
    }
    # With every "<" escaped no record text can end or confuse the script element; JSON.parse reads it back.
    embedded = orjson.dumps(data).decode().replace("<", "\\u003c")
    script = asset("view.js").replace("</", "<\\/")
    out.write(
        "<!doctype html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
        "style-src 'unsafe-inline'; script-src 'unsafe-inline'\">\n"
        "<title>Durable Check replay report</title>\n"
        f"<style>\n{asset('view.css')}\n</style>\n</head>\n<body>\n"
        "<header><span class=\"brand\">Durable Check</span></header>\n"
        "<main id=\"main\" tabindex=\"-1\"></main>\n"
        f"<script type=\"application/json\" id=\"report-data\">{embedded}</script>\n"
        f"<script>\n{script}\n</script>\n</body>\n</html>\n"
    )


def write_junit(report: Report, views: MemoryViews, out: TextIO) -> None:
    by_session: dict[str, list[Violation]] = defaultdict(list)
    for v in report.ordered():
        by_session[v.session_id].append(v)
    suites = ET.Element("testsuites", name="durable-check")
    placed: set[str] = set()
    groups = _sessions_by_input(report, views)
    for name in report.inputs:
        sessions = groups.get(name, [])
        suite = ET.SubElement(suites, "testsuite", name=xml_text(name))
        failures = 0
        for sid in sessions:
            # A session met in several inputs carries its failures in the first.
            found = by_session.get(sid, []) if sid not in placed else []
            placed.add(sid)
            case = ET.SubElement(suite, "testcase", name=xml_text(sid), classname=xml_text(name))
            _add_findings(case, found)
            failures += 1 if any(not is_waived(v) for v in found) else 0
        suite.set("tests", str(len(sessions)))
        suite.set("failures", str(failures))
        suite.set("errors", "0")
    # Violations of sessions no input listed (malformed lines, DS000) go to a suite of their own.
    rest = [sid for sid in by_session if sid not in placed]
    if rest:
        failing = sum(1 for sid in rest if any(not is_waived(v) for v in by_session[sid]))
        suite = ET.SubElement(suites, "testsuite", name="(records without a session)", tests=str(len(rest)),
                              failures=str(failing), errors="0")
        for sid in rest:
            case = ET.SubElement(suite, "testcase", name=xml_text(sid) or "(no session)", classname="durable-check")
            _add_findings(case, by_session[sid])
    ET.indent(suites)
    out.write('<?xml version="1.0" encoding="UTF-8"?>\n')
    out.write(ET.tostring(suites, encoding="unicode"))
    out.write("\n")


def _add_findings(case: ET.Element, found: list[Violation]) -> None:
    """A failure per finding; a waived one is a property of the test case instead (it does not fail it)."""
    waived = [(v, mark) for v in found if (mark := waiver_of(v)) is not None]
    if waived:
        properties = ET.SubElement(case, "properties")
        for v, mark in waived:
            ET.SubElement(properties, "property", name=f"durable-check.waived.{xml_text(v.rule)}",
                          value=xml_text(f"{v.message} (waived: {mark.get('reason', '')}; {mark.get('by', '')})"))
    for v in found:
        if not is_waived(v):
            failure = ET.SubElement(case, "failure", message=_failure_message(v), type=xml_text(v.rule))
            failure.text = _failure_text(v)


def _failure_message(v: Violation) -> str:
    return xml_text(f"{v.rule} {v.name}: {v.message}"[:1000])


def _failure_text(v: Violation) -> str:
    where = f"{v.origin}:{v.line}" if v.line is not None else (v.origin or "")
    parts = [f"rule {v.rule} ({v.severity})", f"action {v.action_id}" if v.action_id else "", where,
             f"trace {v.trace_id} span {v.span_id}" if v.trace_id else ""]
    return xml_text("\n".join(p for p in parts if p))


def write_sarif(report: Report, rules: RuleSet, out: TextIO) -> None:
    by_id = rules.by_id()
    used: dict[str, int] = {}
    descriptors: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for v in report.ordered():
        if v.rule not in used:
            used[v.rule] = len(descriptors)
            rule = by_id.get(v.rule)
            descriptor: dict[str, Any] = {"id": v.rule, "name": v.name or v.rule,
                                          "defaultConfiguration": {"level": _SARIF_LEVEL.get(v.severity, "warning")}}
            if rule is not None:
                descriptor["shortDescription"] = {"text": rule.name}
                descriptor["fullDescription"] = {"text": rule.description.strip() or rule.name}
                fixes = (rule.fix_for(True), rule.fix_for(False))
                descriptor["help"] = {"text": (f"Spans: {fixes[0]} Action logs: {fixes[1]}" if fixes[0] != fixes[1]
                                               else fixes[0]) or rule.name}
            descriptors.append(descriptor)
        result: dict[str, Any] = {
            "ruleId": v.rule,
            "ruleIndex": used[v.rule],
            "level": _SARIF_LEVEL.get(v.severity, "warning"),
            "message": {"text": v.message},
            "partialFingerprints": {"durableCheckViolationId/v1": v.violation_id},
            "properties": {"session_id": v.session_id, "action_id": v.action_id, "severity": v.severity},
        }
        if v.origin and v.origin != STDIN_ORIGIN and v.line is not None:
            result["locations"] = [{"physicalLocation": {"artifactLocation": {"uri": v.origin},
                                                         "region": {"startLine": max(1, v.line)}}}]
        elif v.origin:
            result["locations"] = [{"physicalLocation": {"artifactLocation": {"uri": v.origin}},
                                    "logicalLocations": [{"name": v.session_id, "kind": "session"}]}]
        if v.trace_id:
            result["properties"].update(trace_id=v.trace_id, span_id=v.span_id)
        mark = waiver_of(v)
        if mark is not None:
            # Accepted by the operator's waiver file or baseline, outside the analysed input.
            result["suppressions"] = [{"kind": "external", "status": "accepted",
                                       "justification": mark.get("reason", ""),
                                       "properties": {"waived_by": mark.get("by", "")}}]
        results.append(result)
    doc = {
        "$schema": SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [{
            "tool": {"driver": {"name": "durable-check", "version": __version__, "rules": descriptors}},
            "artifacts": [{"location": {"uri": name}} for name in report.inputs if name != STDIN_ORIGIN],
            "results": results,
        }],
    }
    out.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode())
    out.write("\n")
