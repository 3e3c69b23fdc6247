"""One request must not cause unbounded work: spans per request, bytes in flight, violations per request and session."""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from exporters.config import JsonlConfig
from exporters.jsonl import JsonlExporter
from processor.telemetry import Telemetry
from processor.violations import Violation
from tests.serve_support import make_request, read_jsonl, running, serve_config, wait_for

PROTOBUF = {"Content-Type": "application/x-protobuf"}


def _payments(session: str, count: int) -> list[dict[str, Any]]:
    return [{"durable.session.id": session, "durable.action.id": f"pay-{i}", "durable.action.kind": "payment"}
            for i in range(count)]


def _rules_of(session: str, documents: list[dict[str, Any]]) -> list[str]:
    return [d["rule"] for d in documents if d["session_id"] == session]


def test_a_request_over_the_span_limit_is_refused_whole_with_its_count_and_the_limit(tmp_path: Path) -> None:
    config = serve_config(tmp_path, {"receivers": {"otlp": {"max_spans_per_request": 50}}})
    big = make_request(*_payments("s-big", 51))
    with running(config) as server:
        response = httpx.post(f"http://127.0.0.1:{server.http_port}/v1/traces", content=big.SerializeToString(),
                              headers=PROTOBUF)
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel, \
                pytest.raises(grpc.RpcError) as caught:
            trace_service_pb2_grpc.TraceServiceStub(channel).Export(big, timeout=5)
        fits = httpx.post(f"http://127.0.0.1:{server.http_port}/v1/traces",
                          content=make_request(*_payments("s-fits", 50)).SerializeToString(), headers=PROTOBUF)
        rejected = server.telemetry.spans_rejected.labels("http", "too_many_spans")._value.get()
    assert response.status_code == 400
    assert "holds 51 spans" in response.text and "at most 50" in response.text
    assert "max_spans_per_request" in response.text
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "holds 51 spans" in (caught.value.details() or "")
    assert fits.status_code == 200
    assert rejected == 51
    documents = read_jsonl(tmp_path / "violations.jsonl")
    assert _rules_of("s-big", documents) == []
    assert _rules_of("s-fits", documents).count("DS002") == 50


def test_violations_past_the_caps_become_one_summary_each(tmp_path: Path) -> None:
    config = serve_config(tmp_path, {"evaluate": {"max_violations_per_request": 20,
                                                  "max_violations_per_session": 30}})
    with running(config) as server:
        url = f"http://127.0.0.1:{server.http_port}/v1/traces"
        for request in (make_request(*_payments("s-flood", 100)), make_request(*_payments("s-flood", 100)),
                        make_request(*_payments("s-calm", 5))):
            assert httpx.post(url, content=request.SerializeToString(), headers=PROTOBUF).status_code == 200
        capped = {scope: server.telemetry.violations_capped.labels(scope)._value.get()
                  for scope in ("session", "request")}
    documents = read_jsonl(tmp_path / "violations.jsonl")
    flood = [d for d in documents if d["session_id"] == "s-flood"]
    reported = [d for d in flood if d["rule"] != "DS113"]
    summaries = [d for d in flood if d["rule"] == "DS113"]
    assert len(reported) == 30  # the session cap: 30 reported of 200 payments' violations
    assert [d["details"]["cap"] for d in summaries].count("session") == 1
    request_summaries = [d for d in summaries if d["details"]["cap"] == "request"]
    assert request_summaries  # the first request raised 100 DS002 alone
    assert all(d["details"]["limit"] == 20 for d in request_summaries)
    assert "max_violations_per_request" in request_summaries[0]["message"]
    assert request_summaries[0]["details"]["held_back"] == 80
    assert _rules_of("s-calm", documents).count("DS002") == 5
    # 200 DS002 (and any later stateful violations): 30 reported, the rest counted.
    assert capped["request"] >= 80 and capped["session"] >= 90
    # Every violation id is written once, the summaries included.
    ids = [d["violation_id"] for d in documents]
    assert len(ids) == len(set(ids))


def test_bytes_in_flight_are_bounded_across_requests(tmp_path: Path) -> None:
    config = serve_config(tmp_path, {"receivers": {"otlp": {"max_bytes_in_flight": "64KiB"}}})
    body = make_request(*_payments("s-bytes", 300)).SerializeToString()
    assert len(body) > 40_000
    with running(config) as server:
        url = f"http://127.0.0.1:{server.http_port}/v1/traces"
        # One request alone may use the whole budget.
        assert httpx.post(url, content=body, headers=PROTOBUF).status_code == 200
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=5) as slow:
            slow.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:40_000])
            assert wait_for(lambda: server.budget.in_use >= 40_000)
            busy = httpx.post(url, content=body, headers=PROTOBUF)
            slow.sendall(body[40_000:])
            answer = slow.recv(4096)
        assert wait_for(lambda: server.budget.in_use == 0)
        after = httpx.post(url, content=body, headers=PROTOBUF)
    assert busy.status_code == 503
    assert "max_bytes_in_flight" in busy.text
    assert int(busy.headers["retry-after"]) >= 1
    assert answer.startswith(b"HTTP/1.1 200")
    assert after.status_code == 200


def _violation(n: int) -> Violation:
    return Violation(rule="DS002", name="unkeyed-side-effect", severity="critical", session_id="s",
                     action_id=f"a-{n}", message="m" * 200, violation_id=f"{n:032x}")


def test_rotation_counts_and_logs_the_lines_it_removes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    telemetry = Telemetry()
    path = tmp_path / "v.jsonl"
    exporter = JsonlExporter(JsonlConfig(path=str(path), rotate_max_size=4096, rotate_keep=1, fsync="never"),
                             telemetry)
    caplog.set_level(logging.WARNING, "durable_check.exporters")
    for n in range(200):
        exporter.export([_violation(n)])
    exporter.shutdown(1.0)
    kept = sum(len(p.read_bytes().splitlines()) for p in (path, tmp_path / "v.jsonl.1"))
    removed = telemetry.jsonl_lines_rotated_away.labels("violations")._value.get()
    assert removed > 0
    assert kept + removed == 200  # every line written is either still there or counted
    said = [r.getMessage() for r in caplog.records if "rotation removed" in r.getMessage()]
    assert said and all("violations" in line for line in said)


def test_json_bodies_are_charged_for_what_decoding_them_holds(tmp_path: Path) -> None:
    """Parsed OTLP/JSON holds many times its size: with other bytes in flight a JSON body is refused first."""
    from tests.test_serve_http import otlp_json

    config = serve_config(tmp_path, {"receivers": {"otlp": {"max_bytes_in_flight": "256KiB"}}})
    held = make_request(*_payments("s-held", 300)).SerializeToString()
    small = make_request(*_payments("s-small", 60))
    as_json, as_protobuf = otlp_json(small), small.SerializeToString()
    assert 10_000 < len(as_json) < 25_000
    with running(config) as server:
        url = f"http://127.0.0.1:{server.http_port}/v1/traces"
        # Alone, a JSON body may use the whole budget.
        assert httpx.post(url, content=as_json, headers={"Content-Type": "application/json"}).status_code == 200
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=5) as slow:
            slow.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                         + f"Content-Length: {len(held)}\r\n\r\n".encode() + held[:40_000])
            assert wait_for(lambda: server.budget.in_use >= 40_000)
            json_answer = httpx.post(url, content=as_json, headers={"Content-Type": "application/json"})
            protobuf_answer = httpx.post(url, content=as_protobuf, headers=PROTOBUF)
            slow.sendall(held[40_000:])
            assert slow.recv(4096).startswith(b"HTTP/1.1 200")
        assert wait_for(lambda: server.budget.in_use == 0)
    assert json_answer.status_code == 503
    assert "max_bytes_in_flight" in json_answer.text
    assert protobuf_answer.status_code == 200
