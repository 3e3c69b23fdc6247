"""Waivers and baselines: accepted findings stay in every report, marked waived, and fail nothing."""

from __future__ import annotations

import datetime
import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import jsonschema
import orjson
import pytest
from junitparser import Failure, JUnitXml
from playwright.sync_api import Browser

from processor import cli
from tests.agent_runs import record_shop_run
from tests.browser_support import browser
from tests.serve_support import read_jsonl, running, serve_config, wait_for

__all__ = ["browser"]

DATA = Path(__file__).parent / "testdata"
SARIF_SCHEMA = DATA / "sarif-schema-2.1.0.json"
# One payment with no idempotency key (DS002), one question cached for everyone (DS005).
LOG_LINES = [
    {"session_id": "checkout-7", "action_id": "pay-1", "kind": "payment", "status": "ok", "result": {"id": "ch_1"}},
    {"session_id": "checkout-7", "action_id": "ask-1", "kind": "user_prompt", "status": "ok", "result": "yes",
     "cacheable": True, "cache_key": "k", "ttl_s": 60},
]


def _log(tmp_path: Path) -> Path:
    path = tmp_path / "actions.jsonl"
    path.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in LOG_LINES))
    return path


def _waivers(tmp_path: Path, *entries: str) -> Path:
    path = tmp_path / "waivers.yaml"
    path.write_text("waivers:\n" + "".join(entries), encoding="utf-8")
    return path


WAIVE_DS002 = "  - rule: DS002\n    session: checkout-*\n    reason: the provider dedupes charges by order id\n"
WAIVE_DS005 = "  - rule: DS005\n    action: ask-*\n    reason: a shared consent question\n"


def _replay(tmp_path: Path, fmt: str, *argv: str) -> tuple[int, str]:
    out = tmp_path / f"report.{fmt}"
    code = cli.main(["replay", "--format", fmt, "--output", str(out), *argv])
    return code, out.read_text(encoding="utf-8")


def test_without_waivers_both_findings_fail_the_run(tmp_path: Path) -> None:
    code, text = _replay(tmp_path, "json", str(_log(tmp_path)))
    assert code == 1
    assert sorted(v["rule"] for v in json.loads(text)["violations"]) == ["DS002", "DS005"]


def test_waived_findings_are_shown_as_waived_in_every_report_and_fail_nothing(tmp_path: Path) -> None:
    log = _log(tmp_path)
    waivers = _waivers(tmp_path, WAIVE_DS002, WAIVE_DS005)
    argv = [str(log), "--waivers", str(waivers)]

    code, text = _replay(tmp_path, "text", *argv)
    assert code == 0
    assert f"(waived: the provider dedupes charges by order id; {waivers}:2:5)" in text
    assert f"(waived: a shared consent question; {waivers}:5:5)" in text
    assert text.splitlines()[-1] == "OK: 2 action(s), no violations; 2 waived"

    code, text = _replay(tmp_path, "json", *argv)
    report = json.loads(text)
    assert code == 0 and report["waived"] == 2
    marks = {v["rule"]: v["details"]["waived"] for v in report["violations"]}
    assert marks["DS002"] == {"reason": "the provider dedupes charges by order id", "by": f"{waivers}:2:5"}

    code, text = _replay(tmp_path, "sarif", *argv)
    sarif = json.loads(text)
    jsonschema.validate(sarif, json.loads(SARIF_SCHEMA.read_text(encoding="utf-8")))
    suppressed = {r["ruleId"]: r["suppressions"] for r in sarif["runs"][0]["results"]}
    assert suppressed["DS002"] == [{"kind": "external", "status": "accepted",
                                    "justification": "the provider dedupes charges by order id",
                                    "properties": {"waived_by": f"{waivers}:2:5"}}]

    code, _ = _replay(tmp_path, "junit", *argv)
    xml = JUnitXml.fromfile(str(tmp_path / "report.junit"))
    cases = [case for suite in xml for case in suite]
    assert code == 0 and [case.name for case in cases] == ["checkout-7"]
    assert not any(isinstance(r, Failure) for case in cases for r in case.result)
    properties = {p.get("name"): p.get("value") for p in ET.parse(tmp_path / "report.junit").iter("property")}
    assert "waived: a shared consent question" in properties["durable-check.waived.DS005"]

    code, text = _replay(tmp_path, "html", *argv)
    assert code == 0 and '"waived":{"reason":"the provider dedupes charges by order id"' in text


def test_a_waiver_covers_only_what_its_patterns_name(tmp_path: Path) -> None:
    other = "  - rule: DS002\n    session: refund-*\n    reason: refunds only\n"
    code, text = _replay(tmp_path, "json", str(_log(tmp_path)), "--waivers", str(_waivers(tmp_path, other,
                                                                                          WAIVE_DS005)))
    report = json.loads(text)
    assert code == 1 and report["waived"] == 1
    assert [v["rule"] for v in report["violations"] if "details" not in v] == ["DS002"]


def test_an_expired_waiver_stops_waiving_and_says_where_it_is(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                                               ) -> None:
    yesterday = (datetime.datetime.now(datetime.UTC).date() - datetime.timedelta(days=1)).isoformat()
    tomorrow = (datetime.datetime.now(datetime.UTC).date() + datetime.timedelta(days=1)).isoformat()
    waivers = _waivers(tmp_path, WAIVE_DS002 + f"    expires: {yesterday}\n",
                       WAIVE_DS005 + f"    expires: {tomorrow}\n")
    with caplog.at_level("WARNING", logger="durable_check.waivers"):
        code, text = _replay(tmp_path, "json", str(_log(tmp_path)), "--waivers", str(waivers))
    report = json.loads(text)
    assert code == 1 and report["waived"] == 1
    assert [v["rule"] for v in report["violations"] if "details" not in v] == ["DS002"]
    assert f"waiver at {waivers}:2:5 for DS002 expired on {yesterday}" in caplog.text


@pytest.mark.parametrize(("entry", "expected"), [
    ("  - rule: DS002\n    reason: x\n    sesion: a\n",
     ":4:5: waivers[0].sesion: unknown key (did you mean 'session'?)"),
    ("  - rule: DS002\n    session: a\n", ":2:5: waivers[0].reason: is required"),
    ("  - rule: DS002\n    reason: x\n    expires: next week\n", ":4:5: waivers[0].expires: not a date"),
    ("  - rule: ds2\n    reason: x\n", ":2:5: waivers[0].rule: not a rule id"),
    ("  - rule: DS002\n    reason: [x\n", "invalid YAML"),
])
def test_a_bad_waiver_file_is_one_clear_error_naming_the_place(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                               entry: str, expected: str) -> None:
    waivers = _waivers(tmp_path, entry)
    code = cli.main(["replay", str(_log(tmp_path)), "--waivers", str(waivers)])
    err = capsys.readouterr().err
    assert code == 2 and expected in err and "Traceback" not in err
    assert str(waivers) in err


def _replay_json(*argv: str) -> tuple[int, dict[str, Any]]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["replay", "--format", "json", *argv])
    return code, json.loads(out.getvalue())


@pytest.mark.slow
def test_a_baseline_survives_recording_the_same_run_again_and_still_catches_a_new_flaw(tmp_path: Path) -> None:
    first, again, changed = tmp_path / "first.jsonl", tmp_path / "again.jsonl", tmp_path / "changed.jsonl"
    record_shop_run(first)
    record_shop_run(again)
    record_shop_run(changed, extra_charge=True)
    ids = [{(v["trace_id"], v["span_id"]) for v in _replay_json(str(p))[1]["violations"]} for p in (first, again)]
    assert ids[0] and not ids[0] & ids[1], "the second recording has its own trace and span ids"

    baseline = tmp_path / "baseline.json"
    code, today = _replay_json(str(first), "--write-baseline", str(baseline))
    assert code == 1 and today["violations"] and baseline.exists()
    assert "span" not in baseline.read_text(encoding="utf-8").replace("span-*", "")

    code, report = _replay_json(str(again), "--baseline", str(baseline))
    assert code == 0 and report["waived"] == len(today["violations"])

    code, report = _replay_json(str(changed), "--baseline", str(baseline))
    new = [v for v in report["violations"] if "details" not in v or "waived" not in v["details"]]
    assert code == 1 and {v["rule"] for v in new} >= {"DS002"}
    assert all(v["kind"] == "payment" for v in new if v["rule"] == "DS002")


def test_a_bad_baseline_is_one_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    baseline = tmp_path / "baseline.json"
    baseline.write_text('{"format": "durable-check-baseline/v1", "findings": [{"rule": 1}]}', encoding="utf-8")
    code = cli.main(["replay", str(_log(tmp_path)), "--baseline", str(baseline)])
    err = capsys.readouterr().err
    assert code == 2 and f"{baseline}: findings[0]: needs rule" in err


def test_serve_honours_the_configured_waivers_and_counts_what_they_waive(tmp_path: Path) -> None:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from tests.serve_support import emit_durable_spans

    waivers = _waivers(tmp_path, "  - rule: DS002\n    session: shop-*\n    reason: keyed at the provider\n")
    config = serve_config(tmp_path, {"evaluate": {"waivers": str(waivers)}})
    with running(config) as server:
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(
            OTLPSpanExporter(endpoint=f"http://127.0.0.1:{server.http_port}/v1/traces", timeout=10)))
        emit_durable_spans(provider, "shop-1")
        emit_durable_spans(provider, "other-1")
        provider.shutdown()
        assert wait_for(lambda: len(read_jsonl(tmp_path / "violations.jsonl")) >= 6, 20)
        waived = server.telemetry.registry.get_sample_value("durable_check_violations_waived_total",
                                                            {"rule": "DS002"})
    found = {(v["session_id"], v["rule"]): v.get("details", {}).get("waived") for v in
             read_jsonl(tmp_path / "violations.jsonl")}
    assert found[("shop-1", "DS002")] == {"reason": "keyed at the provider", "by": f"{waivers}:2:5"}
    assert found[("other-1", "DS002")] is None
    assert waived == 1


def test_the_operator_view_marks_waived_findings(tmp_path: Path, browser: Browser) -> None:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from playwright.sync_api import expect

    from tests.serve_support import emit_durable_spans

    waivers = _waivers(tmp_path, "  - rule: DS002\n    session: shop-*\n    reason: keyed at the provider\n")
    config = serve_config(tmp_path, {"evaluate": {"waivers": str(waivers)}, "ui": {"endpoint": "127.0.0.1:0"}})
    with running(config) as server:
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(
            OTLPSpanExporter(endpoint=f"http://127.0.0.1:{server.http_port}/v1/traces", timeout=10)))
        emit_durable_spans(provider, "shop-1")
        emit_durable_spans(provider, "other-1")
        provider.shutdown()
        assert wait_for(lambda: len(read_jsonl(tmp_path / "violations.jsonl")) >= 6, 20)
        assert server.ui is not None
        page = browser.new_page()
        try:
            page.goto(f"http://127.0.0.1:{server.ui.port}/violations?rule=DS002")
            rows = page.locator("table").nth(1).locator("tbody tr")
            expect(rows).to_have_count(2)
            expect(page.locator("p.waived-count")).to_have_text(
                "1 of these are waived: accepted by the operator, not errors.")
            waived_row = rows.filter(has_text="shop-1")
            expect(waived_row.locator(".badge.waived")).to_have_attribute(
                "title", f"keyed at the provider ({waivers}:2:5)")
            expect(rows.filter(has_text="other-1").locator(".badge.waived")).to_have_count(0)
        finally:
            page.close()


@pytest.mark.servers
def test_a_waived_finding_reaches_alertmanager_labelled_waived(tmp_path: Path) -> None:
    import httpx

    from exporters import AlertmanagerConfig, AlertmanagerExporter
    from processor.telemetry import Telemetry
    from processor.waivers import Exemptions, load_waivers
    from tests.servers import alertmanager_server, make_violation, wait_until

    waivers = _waivers(tmp_path, "  - rule: DS002\n    session: legacy-*\n    reason: keyed at the provider\n")
    waived, live = make_violation(1, session="legacy-1"), make_violation(2, session="shop-1")
    assert Exemptions(load_waivers(str(waivers))).apply([waived, live]) == 1
    with alertmanager_server(tmp_path / "alertmanager") as am:
        exporter = AlertmanagerExporter(AlertmanagerConfig(url=am.url), Telemetry())
        try:
            exporter.export([waived, live])

            def alerts() -> dict[str, dict[str, Any]] | None:
                got = httpx.get(f"{am.url}/api/v2/alerts", timeout=5).json()
                found = {a["labels"]["session"]: a for a in got if a["labels"].get("alertname")}
                return found if len(found) == 2 else None

            found = wait_until(alerts, timeout_s=15, what="both alerts in Alertmanager")
        finally:
            exporter.shutdown(5.0)
    assert found["legacy-1"]["labels"]["waived"] == "true"
    assert found["legacy-1"]["annotations"]["waived"] == f"keyed at the provider ({waivers}:2:5)"
    assert "waived" not in found["shop-1"]["labels"]


def test_a_waiver_that_expires_while_serve_runs_stops_waiving_that_day(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    from processor.waivers import Exemptions, load_waivers
    from tests.servers import make_violation

    waivers = _waivers(tmp_path, WAIVE_DS002.replace("checkout-*", "s-*") + "    expires: 2027-03-31\n")
    days = iter([datetime.date(2027, 3, 31), datetime.date(2027, 3, 31), datetime.date(2027, 4, 1)])
    exemptions = Exemptions(load_waivers(str(waivers)), today=lambda: next(days))
    assert exemptions.apply([make_violation(1)]) == 1  # the last day it holds
    with caplog.at_level("WARNING", logger="durable_check.waivers"):
        assert exemptions.apply([make_violation(2)]) == 0
    assert f"waiver at {waivers}:2:5 for DS002 expired on 2027-03-31" in caplog.text
    assert [w.where for w in exemptions.expired] == [f"{waivers}:2:5"]


def test_serve_honours_a_configured_baseline(tmp_path: Path) -> None:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from processor.violations import Violation
    from processor.waivers import write_baseline
    from tests.serve_support import emit_durable_spans

    def run(directory: Path, evaluate: dict[str, str], sessions: list[str]) -> list[dict[str, Any]]:
        directory.mkdir()
        with running(serve_config(directory, {"evaluate": evaluate})) as server:
            provider = TracerProvider()
            provider.add_span_processor(SimpleSpanProcessor(
                OTLPSpanExporter(endpoint=f"http://127.0.0.1:{server.http_port}/v1/traces", timeout=10)))
            for session in sessions:
                emit_durable_spans(provider, session)
            provider.shutdown()
            assert wait_for(lambda: len(read_jsonl(directory / "violations.jsonl")) >= 3 * len(sessions), 20)
        return read_jsonl(directory / "violations.jsonl")

    # Today's findings, written as a baseline the way replay writes one.
    today = run(tmp_path / "today", {}, ["shop-1"])
    baseline = tmp_path / "baseline.json"
    write_baseline(str(baseline), [Violation(v["rule"], v["name"], v["severity"], v["session_id"], v["action_id"],
                                             v["message"], v["violation_id"], kind=v.get("kind", ""))
                                   for v in today])
    # A later serve with it: the same findings are known, a new session's are not.
    later = run(tmp_path / "later", {"baseline": str(baseline)}, ["shop-1", "shop-2"])
    waived = {(v["session_id"], v["rule"]) for v in later if v.get("details", {}).get("waived")}
    fresh = {(v["session_id"], v["rule"]) for v in later if not v.get("details", {}).get("waived")}
    assert waived == {(v["session_id"], v["rule"]) for v in today}
    assert fresh and {session for session, _ in fresh} == {"shop-2"}
