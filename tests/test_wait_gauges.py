"""The open-wait gauges say what Waiting now lists: a real Prometheus scraping a real serve, a real browser.

Three waits, one per scenario: one with no deadline, one that expires, one that resolves.
After each step the page (Playwright on Debian's Chromium) and Prometheus (PromQL over
what it scraped) must count the same waits by state, the same expired ones, and an oldest
wait at least as old as the oldest row.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from playwright.sync_api import Browser, Page

from processor.operate.wait_gauges import WaitGauges
from processor.serve import Server
from processor.state.views import MemoryViews
from processor.telemetry import Telemetry
from tests.browser_support import browser
from tests.serve_support import running, serve_config
from tests.servers import free_port, prometheus_server, query, wait_until

__all__ = ["browser"]

STATES = ("awaiting_approval", "waiting_on_external", "retry_scheduled")


@pytest.fixture(params=["sqlite", "memory"])
def served(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Server, int]]:
    metrics = free_port()
    config = serve_config(tmp_path, {
        "state": {"backend": request.param},
        "ui": {"endpoint": "127.0.0.1:0"},
        "exporters": {"prometheus": {"endpoint": f"127.0.0.1:{metrics}"}},
    })
    with running(config) as srv:
        yield srv, metrics


def _emit(provider: TracerProvider, session: str, action: str, state: str, **extra: Any) -> None:
    attrs = {"durable.session.id": session, "durable.action.id": action, "durable.action.kind": "approval",
             "durable.workflow.state": state, **extra}
    with provider.get_tracer("wait-gauge-tests").start_as_current_span(f"approval {action}", attributes=attrs):
        pass


def _page_counts(page: Page, base: str) -> tuple[Counter[str], Counter[str]]:
    """Waiting now as a person sees it: rows by state, and the expired rows by state."""
    page.goto(base + "/")
    page.wait_for_selector("h1:has-text('Waiting now')")
    page.wait_for_selector("table, p:has-text('Nothing is waiting')")
    open_, expired = Counter[str](), Counter[str]()
    for row in page.locator("table tbody tr").all():
        state = row.locator("span.state").inner_text()
        open_[state] += 1
        if "expired" in (row.get_attribute("class") or ""):
            expired[state] += 1
    return open_, expired


def _prometheus_counts(url: str) -> tuple[Counter[str], Counter[str], float]:
    def by_state(metric: str) -> Counter[str]:
        return Counter({r["metric"]["state"]: int(float(r["value"][1])) for r in query(url, metric)
                        if float(r["value"][1]) > 0})

    oldest = query(url, "durable_check_oldest_open_wait_age_seconds")
    return (by_state("durable_check_open_waits"), by_state("durable_check_expired_waits"),
            float(oldest[0]["value"][1]) if oldest else -1.0)


def _agree(page: Page, base: str, prometheus: str, *, expect_open: dict[str, int], expect_expired: dict[str, int],
           oldest_at_least_s: float) -> None:
    """The page shows what the step expects, and Prometheus scraped the same."""
    wait_until(lambda: _page_counts(page, base) == (Counter(expect_open), Counter(expect_expired)),
               timeout_s=20, what=f"Waiting now to list {expect_open}, expired {expect_expired}")
    wait_until(lambda: _prometheus_counts(prometheus)[:2] == (Counter(expect_open), Counter(expect_expired)),
               timeout_s=20, what=f"Prometheus to scrape {expect_open}, expired {expect_expired}")
    # Both at once (a scrape that times out on a loaded machine leaves a gap: wait past it).
    wait_until(lambda: _page_counts(page, base) == _prometheus_counts(prometheus)[:2], timeout_s=20,
               what="the page and Prometheus to agree")
    wait_until(lambda: _prometheus_counts(prometheus)[2] >= oldest_at_least_s, timeout_s=20,
               what=f"the oldest open wait to be at least {oldest_at_least_s:.1f}s old")


def test_open_wait_gauges_equal_waiting_now(served: tuple[Server, int], browser: Browser, tmp_path: Path) -> None:
    srv, metrics = served
    assert srv.ui is not None
    base = f"http://127.0.0.1:{srv.ui.port}"
    provider = TracerProvider(resource=Resource.create({"service.name": "billing"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"127.0.0.1:{srv.grpc_port}",
                                                                      insecure=True)))
    page = browser.new_page()
    with prometheus_server(tmp_path / "prometheus", [f"127.0.0.1:{metrics}"], []) as prometheus:
        wait_until(lambda: query(prometheus.url, 'up{job="durable-check"} == 1'), timeout_s=30,
                   what="Prometheus to scrape serve")
        # Nothing waits: zero everywhere, not missing.
        _agree(page, base, prometheus.url, expect_open={}, expect_expired={}, oldest_at_least_s=0)
        assert {r["metric"]["state"] for r in query(prometheus.url, "durable_check_open_waits")} >= set(STATES)

        # 1. A wait with no deadline is a wait all the same.
        started = time.monotonic()
        _emit(provider, "s-no-deadline", "approval:refund:1", "awaiting_approval")
        _agree(page, base, prometheus.url, expect_open={"awaiting_approval": 1}, expect_expired={},
               oldest_at_least_s=0)

        # 2. A wait that expires stays open, and is counted among the expired; the oldest age counts it.
        _emit(provider, "s-expires", "wait:visa:1", "waiting_on_external", **{"durable.wait.timeout_s": 2})
        time.sleep(2.5)
        _agree(page, base, prometheus.url, expect_open={"awaiting_approval": 1, "waiting_on_external": 1},
               expect_expired={"waiting_on_external": 1}, oldest_at_least_s=time.monotonic() - started - 1)

        # 3. A wait that resolves leaves both.
        _emit(provider, "s-resolves", "approval:charge:1", "awaiting_approval", **{"durable.wait.timeout_s": 3600})
        _agree(page, base, prometheus.url, expect_open={"awaiting_approval": 2, "waiting_on_external": 1},
               expect_expired={"waiting_on_external": 1}, oldest_at_least_s=2)
        _emit(provider, "s-resolves", "approval:charge:1", "executing", **{"durable.approval.decision": "granted"})
        _agree(page, base, prometheus.url, expect_open={"awaiting_approval": 1, "waiting_on_external": 1},
               expect_expired={"waiting_on_external": 1}, oldest_at_least_s=2)
        # The Pipeline page reads the same gauges.
        page.goto(base + "/pipeline")
        page.wait_for_selector("dt:has-text('Past their deadline')")
        facts = dict(zip(page.locator("dl.facts dt").all_inner_texts(), page.locator("dl.facts dd").all_inner_texts(),
                         strict=True))
        assert facts["Open waits"].startswith("2 ")
        assert facts["Past their deadline"].startswith("1 ")
    page.close()
    provider.shutdown()


def test_gauges_read_the_view_at_the_instant_they_are_read() -> None:
    # A wait passes its deadline between two reads with no batch in between: the second read says so.
    from processor.records import Action

    now = [1_800_000_000 * 10**9]
    views = MemoryViews()
    telemetry = Telemetry()
    WaitGauges(telemetry, views, clock=lambda: now[0])
    record = {"session_id": "s1", "action_id": "w1", "kind": "approval", "status": "ok",
              "workflow_state": "awaiting_approval", "wait_timeout_s": 10}
    views.record([Action(record, "span", time_ns=now[0])], [], now[0])
    get = telemetry.registry.get_sample_value
    assert get("durable_check_open_waits", {"state": "awaiting_approval"}) == 1
    assert get("durable_check_expired_waits", {"state": "awaiting_approval"}) == 0
    now[0] += 11 * 10**9
    assert get("durable_check_open_waits", {"state": "awaiting_approval"}) == 1
    assert get("durable_check_expired_waits", {"state": "awaiting_approval"}) == 1
    assert get("durable_check_oldest_open_wait_age_seconds") == pytest.approx(11.0)
