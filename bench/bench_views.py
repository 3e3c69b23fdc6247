"""The operator view's API pages with N sessions in the store: p50 and p99 per page.

Fills a fresh SQLite state database's read model through the same path serve uses
(``SqlViews.record`` inside the store's units of work): N sessions of 4 actions, a
quarter of them waiting (some expired), and a violation for every tenth. Then asks
every API page ``--requests`` times through the real ASGI app (FastAPI, in process:
the HTTP socket is not what is measured) and reports medians and p99 in ms.

    python -m bench.bench_views                 # 100,000 sessions
    python -m bench.bench_views --sessions 20000 --requests 100
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from fastapi.testclient import TestClient

from processor.config import UiConfig
from processor.evaluate.rulefmt import load_rules
from processor.operate.app import ViewContext, build_app
from processor.records import Action
from processor.state.sqlite import SqliteStore
from processor.state.sqlviews import views_for
from processor.telemetry import Telemetry
from processor.violations import Violation

BATCH = 500


def _fill(store: SqliteStore, sessions: int, now_ns: int) -> float:
    views = views_for(store)
    started = time.perf_counter()
    batch_actions: list[Action] = []
    batch_violations: list[Violation] = []
    for i in range(sessions):
        sid = f"sess-{i:08d}"
        t0 = now_ns - (sessions - i) * 1_000_000_000
        waits = i % 4 == 0
        for n, (kind, state) in enumerate((("user_prompt", "executing"), ("llm_call", "executing"),
                                           ("tool_call", "planned"),
                                           ("approval", "awaiting_approval" if waits else "completed"))):
            record = {"session_id": sid, "action_id": f"a{n}", "kind": kind, "status": "ok", "workflow_state": state,
                      "trace_id": f"{i + 1:032x}", "span_id": f"{i * 4 + n + 1:016x}"}
            if waits and n == 3:
                record["wait_timeout_s"] = 600 if i % 8 == 0 else 10 ** 7
            batch_actions.append(Action(record=record, source="span", time_ns=t0 + n * 1000, seq=i * 4 + n,
                                        delivery_key=(record["trace_id"], record["span_id"], 0)))
        if i % 10 == 0:
            batch_violations.append(Violation(rule="DS002", name="unkeyed-side-effect", severity="critical",
                                              session_id=sid, action_id="a2", message="payment without a key",
                                              violation_id=f"{i:032x}", time_ns=t0))
        if len(batch_actions) >= BATCH * 4:
            with store.unit():
                views.record(batch_actions, batch_violations, now_ns)
            batch_actions, batch_violations = [], []
    if batch_actions or batch_violations:
        with store.unit():
            views.record(batch_actions, batch_violations, now_ns)
    views.close()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sessions", type=int, default=100_000)
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        store = SqliteStore(Path(tmp) / "state.db", synchronous="normal")
        now_ns = time.time_ns()
        fill_s = _fill(store, args.sessions, now_ns)
        views = views_for(store)
        ctx = ViewContext(views, load_rules([], include_shipped=True), Telemetry(), {"state": "sqlite"})
        client = TestClient(build_app(UiConfig(), ctx))
        pages = {
            "waiting, first page": "/api/v1/waiting",
            "waiting, page 100": "/api/v1/waiting?offset=5000",
            "violations": "/api/v1/violations",
            "violations by rule": "/api/v1/violations?rule=DS002&offset=1000",
            "violations of a session": f"/api/v1/violations?session=sess-{(args.sessions // 2) // 10 * 10:08d}",
            "session": f"/api/v1/sessions/sess-{args.sessions // 2:08d}",
            "pipeline": "/api/v1/pipeline",
        }
        print(f"{args.sessions} sessions; read model filled in {fill_s:.1f} s "
              f"({args.sessions / fill_s:,.0f} sessions/s, 4 actions each)")
        print(f"{'page':28} {'p50 ms':>8} {'p99 ms':>8}")
        worst = 0.0
        for name, url in pages.items():
            times = []
            for _ in range(args.requests):
                started = time.perf_counter()
                answer = client.get(url)
                times.append((time.perf_counter() - started) * 1000)
                assert answer.status_code == 200, (url, answer.status_code, answer.text[:200])
            times.sort()
            p99 = times[min(len(times) - 1, int(len(times) * 0.99))]
            worst = max(worst, p99)
            print(f"{name:28} {statistics.median(times):8.2f} {p99:8.2f}")
        print(f"worst p99: {worst:.1f} ms (target: under 200 ms)")
        views.close()
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
