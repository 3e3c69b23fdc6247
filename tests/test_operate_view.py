"""The operator view in real headless Chromium against a real serve fed real OTLP from the SDK exporter."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from playwright.sync_api import Browser, expect

from processor.serve import Server
from tests.browser_support import browser, interactive_roles, screenshot, unlabelled_controls
from tests.serve_support import emit_durable_spans, running, serve_config
from tests.servers import wait_until

__all__ = ["browser"]

TOKEN = "view-token-3f9a"


@pytest.fixture(params=["sqlite", "memory"])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Server]:
    config = serve_config(tmp_path, {
        "state": {"backend": request.param},
        "ui": {"endpoint": "127.0.0.1:0", "trace_url": "http://127.0.0.1:16686/trace/{trace_id}"},
    })
    with running(config) as srv:
        yield srv


def _provider(srv: Server) -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": "travel-agent"}))
    exporter = OTLPSpanExporter(endpoint=f"127.0.0.1:{srv.grpc_port}", insecure=True)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


def _emit(provider: TracerProvider, session: str, action: str, kind: str, state: str, **extra: Any) -> None:
    attrs = {"durable.session.id": session, "durable.action.id": action, "durable.action.kind": kind,
             "durable.workflow.state": state, **extra}
    with provider.get_tracer("operate-tests").start_as_current_span(f"{kind} {action}", attributes=attrs):
        pass


def _until(check: Any, what: str, timeout_s: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _api(srv: Server, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
    assert srv.ui is not None
    return httpx.get(f"http://127.0.0.1:{srv.ui.port}{path}", headers=headers, timeout=10)


def _session_rules(srv: Server, session: str) -> set[str]:
    answer = _api(srv, f"/api/v1/sessions/{session}")
    return {v["rule"] for v in answer.json()["violations"]} if answer.status_code == 200 else set()


def _waiting_ids(srv: Server) -> list[str]:
    return [w["session_id"] for w in _api(srv, "/api/v1/waiting").json()["items"]]


def test_waits_appear_and_leave_and_sessions_show_violations(server: Server, browser: Browser) -> None:
    srv = server
    assert srv.ui is not None
    backend = srv.config.state.backend
    provider = _provider(srv)
    _emit(provider, "s-refund-7", "plan-1", "tool_call", "planned")
    _emit(provider, "s-refund-7", "approve-1", "approval", "awaiting_approval", **{"durable.wait.timeout_s": 3600})
    _emit(provider, "s-visa-2", "ext-1", "external_read", "waiting_on_external", **{"durable.wait.timeout_s": 7200})
    emit_durable_spans(provider, "s-bad-1")
    _until(lambda: {"s-refund-7", "s-visa-2"} <= set(_waiting_ids(srv)), "both waits in the API")

    base = f"http://127.0.0.1:{srv.ui.port}"
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    try:
        page.goto(base + "/")
        row = page.locator("tr", has_text="s-refund-7")
        expect(row).to_be_visible()
        expect(row).to_contain_text("awaiting_approval")
        # The deadline is an hour after the wait began, and the time left is shown.
        wait = next(w for w in _api(srv, "/api/v1/waiting").json()["items"] if w["session_id"] == "s-refund-7")
        assert wait["deadline_ns"] - wait["since_ns"] == 3600 * 10**9
        assert 3500 < wait["time_left_s"] <= 3600
        expect(row).to_contain_text(time.strftime("%Y-%m-%d", time.gmtime(wait["deadline_ns"] / 1e9)))
        expect(row).to_contain_text("left")
        # Oldest first: the approval came before the external wait.
        ids = [r.inner_text() for r in page.locator("tbody tr td:first-child").all()]
        assert ids.index("s-refund-7") < ids.index("s-visa-2")
        screenshot(page, f"waiting-now-{backend}")

        _emit(provider, "s-refund-7", "approve-1", "approval", "executing", **{"durable.approval.decision": "granted"})
        _until(lambda: "s-refund-7" not in _waiting_ids(srv), "the approved session to leave the list")
        page.reload()
        expect(page.locator("tr", has_text="s-visa-2")).to_be_visible()
        expect(page.locator("tr", has_text="s-refund-7")).to_have_count(0)

        _until(lambda: _session_rules(srv, "s-bad-1") >= {"DS002", "DS003", "DS005", "DS006"}, "its violations")
        page.goto(base + "/sessions/s-bad-1")
        expect(page.locator("h1")).to_contain_text("s-bad-1")
        expect(page.locator("tr.action-row[data-action=charge-1]")).to_have_count(1)
        # Each violation sits right under the action it concerns, with the rule's fix.
        under: dict[str, set[str]] = {}
        current = ""
        for r in page.locator("table").first.locator("tbody tr").all():
            action, rule = r.get_attribute("data-action"), r.get_attribute("data-rule")
            if action is not None:
                current = action
                under[current] = set()
            elif rule is not None:
                under[current].add(rule)
        assert "DS002" in under["charge-1"] and "DS003" in under["call-1"]
        assert {"DS005", "DS006"} <= under["ask-1"]
        assert "DS002" not in under["call-1"] | under["ask-1"]
        expect(page.locator("tr[data-rule=DS002]")).to_contain_text("How to fix")
        link = page.get_by_role("link", name="Open trace in your tracing UI")
        assert (link.get_attribute("href") or "").startswith("http://127.0.0.1:16686/trace/")
        screenshot(page, f"session-{backend}")

        page.goto(base + "/violations")
        expect(page.locator("h2", has_text="Counts by rule")).to_be_visible()
        page.get_by_label("Rule", exact=True).select_option("DS002")
        page.get_by_role("button", name="Apply filters").click()
        expect(page).to_have_url(base + "/violations?rule=DS002")
        expect(page.locator("main")).to_have_attribute("data-shows", "/violations?rule=DS002")
        recent = page.locator("table").nth(1).locator("tbody tr")
        expect(recent).to_have_count(1)
        expect(recent).to_contain_text("s-bad-1")
        screenshot(page, f"violations-{backend}")

        page.goto(base + "/pipeline")
        expect(page.locator("h2", has_text="Exporters")).to_be_visible()
        jsonl = page.locator("tr", has_text="jsonl")
        expect(jsonl).to_be_visible()
        # The JSONL exporter wrote the violations above: its last delivery is a time, not "never".
        expect(jsonl.locator("td").nth(1)).to_contain_text("UTC")
        screenshot(page, f"pipeline-{backend}")
    finally:
        page.close()
        provider.shutdown()


def test_keyboard_navigation_and_labels(server: Server, browser: Browser) -> None:
    srv = server
    assert srv.ui is not None
    provider = _provider(srv)
    emit_durable_spans(provider, "s-keys")
    provider.shutdown()
    _until(lambda: _api(srv, "/api/v1/violations").json()["items"], "violations in the view")
    base = f"http://127.0.0.1:{srv.ui.port}"
    page = browser.new_page()
    try:
        page.goto(base + "/violations")
        expect(page.locator("h2", has_text="Recent")).to_be_visible()
        assert unlabelled_controls(page) == []
        roles = interactive_roles(page)
        assert ("combobox", "Rule") in roles and ("combobox", "Severity") in roles and ("textbox", "Session") in roles
        # Tab reaches the filters, the keyboard sets them, Enter applies them.
        focused = []
        for _ in range(12):
            page.keyboard.press("Tab")
            focused.append(page.evaluate("document.activeElement.id || document.activeElement.textContent"))
            if focused[-1] == "f-session":
                break
        assert "f-rule" in focused and focused[-1] == "f-session"
        page.keyboard.type("s-keys")
        page.keyboard.press("Enter")
        expect(page).to_have_url(base + "/violations?session=s-keys")
        expect(page.locator("main")).to_have_attribute("data-shows", "/violations?session=s-keys")
        expect(page.locator("table").nth(1).locator("tbody tr").first).to_contain_text("s-keys")
        # A session link is reachable and followed with the keyboard alone.
        page.locator("tbody a", has_text="s-keys").first.focus()
        page.keyboard.press("Enter")
        expect(page).to_have_url(base + "/sessions/s-keys")
        expect(page.locator("h1")).to_contain_text("s-keys")
        assert unlabelled_controls(page) == []
        page.goto(base + "/")
        page.keyboard.press("Tab")
        assert page.evaluate("document.activeElement.textContent") == "Skip to content"
    finally:
        page.close()


def test_security_headers_and_bounded_pages(server: Server) -> None:
    for path in ("/", "/api/v1/waiting", "/static/view.js"):
        answer = _api(server, path)
        assert answer.status_code == 200
        assert "frame-ancestors 'none'" in answer.headers["content-security-policy"]
        assert answer.headers["x-frame-options"] == "DENY"
    too_many = _api(server, "/api/v1/waiting?limit=5000")
    assert too_many.status_code == 400 and "limit" in too_many.json()["error"]
    assert _api(server, "/api/v1/violations?offset=999999").status_code == 400
    assert _api(server, "/api/v1/sessions/nobody").status_code == 404
    icon = _api(server, "/favicon.ico")  # browsers ask for it on every page
    assert icon.status_code == 200 and icon.headers["content-type"] == "image/svg+xml"
    assert icon.content == _api(server, "/static/favicon.svg").content
    assert httpx.post(f"http://127.0.0.1:{server.ui.port}/api/v1/waiting").status_code == 405  # type: ignore[union-attr]


def test_violation_filters_hold_for_the_counts_and_an_unknown_severity_is_refused(server: Server) -> None:
    emit_durable_spans(_provider(server), "s-filters")  # DS002, DS003, DS005, DS006
    counts = wait_until(lambda: (c := _api(server, "/api/v1/violations").json()["counts"]) and len(c) >= 2 and c,
                        timeout_s=20, interval_s=0.2, what="violations of several rules in the view")
    rule = counts[0]["rule"]
    filtered = _api(server, f"/api/v1/violations?rule={rule}").json()
    assert filtered["counts"] == [c for c in counts if c["rule"] == rule]
    assert filtered["items"] and all(v["rule"] == rule for v in filtered["items"])
    # A rule with no violation: an empty list and no counts (the counts used to list every rule).
    assert _api(server, "/api/v1/violations?rule=DS999").json()["counts"] == []
    severity = counts[0]["severity"]
    by_severity = _api(server, f"/api/v1/violations?severity={severity}").json()["counts"]
    assert by_severity == [c for c in counts if c["severity"] == severity]
    bogus = _api(server, "/api/v1/violations?severity=bogus")
    assert bogus.status_code == 400
    assert bogus.json()["error"] == "query parameter severity must be one of critical, error, warning, info"


def test_a_wait_row_names_its_action_once_and_links_to_its_finding(server: Server, browser: Browser) -> None:
    assert server.ui is not None
    provider = _provider(server)
    # A framework's wait id already says its kind; a wait with no deadline is DS106.
    _emit(provider, "s-nodeadline", "approval:refund:call-9", "approval", "awaiting_approval")
    _until(lambda: "s-nodeadline" in _waiting_ids(server), "the wait in the API")
    _until(lambda: "DS106" in _session_rules(server, "s-nodeadline"), "its DS106")
    page = browser.new_page()
    try:
        page.goto(f"http://127.0.0.1:{server.ui.port}/")
        row = page.locator("tr", has_text="s-nodeadline")
        cells = row.locator("td")
        expect(cells.nth(2)).to_have_text("approval:refund:call-9")  # not "approval approval:refund:call-9"
        link = row.get_by_role("link", name="DS106")
        assert link.get_attribute("href") == "/violations?rule=DS106&session=s-nodeadline"
        link.click()
        expect(page.locator("table").last.locator("tbody tr")).to_have_count(1)
        expect(page.locator("table").last.locator("tbody tr")).to_contain_text("DS106")
    finally:
        page.close()


def test_auth_refuses_requests_without_the_token(tmp_path: Path) -> None:
    config = serve_config(tmp_path, {"state": {"backend": "memory"},
                                     "ui": {"endpoint": "127.0.0.1:0", "auth": {"bearer_token": TOKEN}}})
    with running(config) as srv:
        for path in ("/", "/sessions/x", "/static/view.js", "/api/v1/waiting", "/api/v1/pipeline"):
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}):
                refused = _api(srv, path, headers)
                assert refused.status_code == 401, (path, headers)
                assert refused.headers["www-authenticate"] == "Bearer"
            assert _api(srv, path, {"authorization": f"Bearer {TOKEN}"}).status_code in (200, 404)
        assert _api(srv, "/api/v1/waiting", {"authorization": f"Bearer {TOKEN}"}).json()["total"] == 0


def test_ui_is_off_unless_configured(tmp_path: Path) -> None:
    with running(serve_config(tmp_path, {"state": {"backend": "memory"}})) as srv:
        assert srv.ui is None
        # The read model is kept all the same, the part the open-wait gauges read: no rows per action.
        assert srv.pipeline.views is srv.views and srv.views.waits_only


def test_ui_config_problems_name_their_paths(tmp_path: Path) -> None:
    from processor.config import parse_config
    from processor.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        parse_config("ui:\n  endpoint: nowhere\n  trace_url: http://jaeger/trace\n"
                     "  tls: {cert_file: /no/such.pem}\n", "ui.yaml")
    paths = {p.where for p in caught.value.problems}
    assert {"ui.endpoint", "ui.trace_url", "ui.tls.key_file", "ui.tls.cert_file"} <= paths


@pytest.mark.parametrize("template", [
    "http://jaeger.example:16686/trace/{trace_id}",
    'http://grafana.example:3000/explore?left={"datasource":"tempo","queries":[{"query":"{trace_id}"}]}',
    "http://phoenix.example:6006/projects/default/traces/{trace_id}",
    "https://langfuse.example/trace/{trace_id}",
])
def test_documented_trace_url_examples_are_accepted(template: str) -> None:
    from processor.config import parse_config

    assert template in (Path(__file__).parent.parent / "docs/operate.md").read_text(encoding="utf-8").replace(
        "JAEGER", "jaeger.example").replace("GRAFANA", "grafana.example").replace(
        "PHOENIX", "phoenix.example").replace("http://LANGFUSE:3000", "https://langfuse.example")
    config = parse_config(f"ui:\n  trace_url: '{template}'\n", "ui.yaml")
    assert config.ui.trace_url == template
