"""OTLP/HTTP edges under a careless or hostile client: cut connections, and what the refusal log says."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import httpx
import pytest

from processor.receive.otlp_common import RefusalLog
from tests.serve_support import make_request, running, serve_config, wait_for


def _cut_mid_body(port: int) -> None:
    """Headers promising 100,000 bytes, 10 of them, then the connection closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/x-protobuf\r\n"
                     b"Content-Length: 100000\r\n\r\n" + b"\x0a" * 10)


def test_clients_cutting_the_body_short_give_one_line_and_no_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    good = make_request({"durable.session.id": "s-cut", "durable.action.id": "a", "durable.action.kind": "read"})
    with running(serve_config(tmp_path)) as server:
        for _ in range(60):
            _cut_mid_body(server.http_port)
        url = f"http://127.0.0.1:{server.http_port}/v1/traces"
        # Every cut connection has been read to its end once a later request is answered after them.
        assert wait_for(lambda: sum("disconnected" in r.getMessage() for r in caplog.records) >= 1)
        response = httpx.post(url, content=good.SerializeToString(),
                              headers={"Content-Type": "application/x-protobuf"})
        assert response.status_code == 200
    tracebacks = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert tracebacks == [], [r.getMessage()[:200] for r in tracebacks]
    said = [r.getMessage() for r in caplog.records if "disconnected" in r.getMessage()]
    assert 1 <= len(said) <= 2, said


def test_the_refusal_summary_names_the_time_it_covers(caplog: pytest.LogCaptureFixture) -> None:
    now = [1000.0]
    log = RefusalLog(logging.getLogger("refusal-test"), interval_s=10.0, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, "refusal-test")
    log.refused("export", "bad token")
    now[0] += 2
    log.refused("export", "bad token")
    log.refused("export", "bad token")
    now[0] += 298  # five minutes after the first line
    log.refused("export", "bad token")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "export refused: bad token"
    assert lines[1] == "export refused: bad token (2 more refused the same way since the one logged 5min ago)"
    assert "last 10s" not in lines[1]
