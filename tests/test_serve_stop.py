"""What serve does with the reordering window at stop, and the line it logs about it.

A durable store keeps the spans still held for ordering across a restart; with
``evaluate.flush_window_on_stop`` (``--flush-window-on-stop``) a stop evaluates them, so
a local run shows every violation once Ctrl-C returns (docs/quickstart.md).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import grpc
import pytest

from processor.receive.otlp_grpc import TRACE_SERVICE
from tests.serve_support import make_request, read_jsonl, running, serve_config

# A payment, then the next step with no checkpoint between: DS110 needs the second span in order,
# so it waits in the reordering window (DS002, a per-record rule, does not).
SESSION = [
    {"durable.session.id": "stop-1", "durable.action.id": "pay", "durable.action.kind": "payment",
     "durable.idempotency_key": "k-1"},
    {"durable.session.id": "stop-1", "durable.action.id": "next", "durable.action.kind": "tool_call"},
]


def _send(port: int) -> None:
    request = make_request(*SESSION, start_ns=time.time_ns())
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        export = channel.unary_unary(f"/{TRACE_SERVICE}/Export", request_serializer=None,
                                     response_deserializer=None)
        export(request.SerializeToString(), timeout=10)


def _stop_line(caplog: pytest.LogCaptureFixture) -> str:
    lines = [r.getMessage() for r in caplog.records if r.name == "processor.worker" and
             r.getMessage().startswith("stopped:")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("flush", [False, True])
def test_the_window_at_stop_is_kept_or_evaluated_and_the_stop_line_says_which(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, flush: bool
) -> None:
    config = serve_config(tmp_path, {
        "state": {"backend": "sqlite", "path": str(tmp_path / "state.db")},
        "evaluate": {"allowed_lateness": "30s", "flush_window_on_stop": flush},
    })
    caplog.set_level(logging.INFO, logger="processor.worker")
    with running(config) as server:
        _send(server.grpc_port)
    rules = sorted(d["rule"] for d in read_jsonl(tmp_path / "violations.jsonl"))
    line = _stop_line(caplog)
    assert line.startswith("stopped: 2 spans received, 2 actions, 1 sessions, violations: ")
    if flush:
        assert "DS110" in rules
        assert line.endswith("; nothing waiting in the reordering window")
        assert "1 warning" in line
    else:
        assert "DS110" not in rules
        assert "2 spans waiting in the reordering window are kept in the state and evaluated after the next " \
               "start" in line
        # The next start evaluates them (here at once: told to flush at its own stop).
        caplog.clear()
        config.evaluate.flush_window_on_stop = True
        with running(config):
            pass
        assert "DS110" in [d["rule"] for d in read_jsonl(tmp_path / "violations.jsonl")]
        assert _stop_line(caplog).endswith("nothing waiting in the reordering window")
    assert "stop-1" not in line, "no ids in the status line"


def test_the_status_line_comes_while_running_when_something_changed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from processor.serve import Server

    config = serve_config(tmp_path, {"evaluate": {"allowed_lateness": "30s"}})
    caplog.set_level(logging.INFO, logger="processor.worker")
    with running(config) as server:
        assert isinstance(server, Server)
        server.worker._options.status_interval_s = 0.2  # a minute in production
        _send(server.grpc_port)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(r.getMessage().startswith("status:") for r in caplog.records):
            time.sleep(0.05)
        statuses = [r.getMessage() for r in caplog.records if r.getMessage().startswith("status:")]
        assert statuses, "a status line while running"
        assert "2 spans waiting in the reordering window, evaluated by " in statuses[0]
        time.sleep(1.0)
        # Nothing changed since: no more lines.
        assert len([r for r in caplog.records if r.getMessage().startswith("status:")]) == 1


def test_a_start_that_cannot_read_a_stored_session_counts_it_and_serves_the_others(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import sqlite3

    config = serve_config(tmp_path, {"state": {"backend": "sqlite", "path": str(tmp_path / "state.db")}})
    sessions = [{**span, "durable.session.id": f"restore-{n}", "durable.action.id": f"{span['durable.action.id']}-{n}",
                 "durable.idempotency_key": f"k-{n}"} for n in range(3) for span in SESSION]
    with running(config) as server:
        request = make_request(*sessions, start_ns=time.time_ns())
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            export = channel.unary_unary(f"/{TRACE_SERVICE}/Export", request_serializer=None,
                                         response_deserializer=None)
            export(request.SerializeToString(), timeout=10)
    with sqlite3.connect(tmp_path / "state.db") as db:
        stored = sorted(row[0] for row in db.execute("SELECT session_id FROM sessions"))
        assert stored == ["restore-0", "restore-1", "restore-2"]
        db.execute("UPDATE sessions SET body = ? WHERE session_id = 'restore-1'", (b"\x00\xff",))

    caplog.set_level(logging.ERROR, logger="processor.state.sqlstore")
    config.evaluate.flush_window_on_stop = True
    with running(config) as server:
        counted = server.telemetry.registry.get_sample_value("durable_check_sessions_not_restored_total")
        assert counted == 1
        assert server.pipeline.engine.holds_session("restore-0")
        assert not server.pipeline.engine.holds_session("restore-1")
    assert "1 session(s) could not be restored from the state store" in caplog.text
    assert "restore-1" not in caplog.text, "no ids in the log"
    # The sessions it restored finish as they would have: DS110 for each, once the window is evaluated.
    fired = sorted(d["session_id"] for d in read_jsonl(tmp_path / "violations.jsonl") if d["rule"] == "DS110")
    assert "restore-0" in fired and "restore-2" in fired
