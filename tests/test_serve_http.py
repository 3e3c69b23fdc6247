"""OTLP/HTTP into serve: the SDK's own exporter, protobuf and JSON, compression, backpressure, bad input."""

from __future__ import annotations

import base64
import gzip
from pathlib import Path
from typing import Any

import httpx
import orjson
import zstandard
from google.protobuf import json_format
from google.rpc import status_pb2
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.sdk.trace.export import SpanExportResult

from tests.serve_support import (
    Recording,
    emit_durable_spans,
    flood,
    keys_of,
    make_request,
    read_jsonl,
    replay_keys,
    run_refund_agent,
    running,
    serve_config,
)

PROTOBUF = {"Content-Type": "application/x-protobuf"}
JSON = {"Content-Type": "application/json"}


def otlp_json(message: Any) -> bytes:
    """OTLP/JSON of a request: proto3 JSON with trace and span ids in hex, as the specification asks."""
    document = json_format.MessageToDict(message)
    for rs in document.get("resourceSpans", []):
        for ss in rs.get("scopeSpans", []):
            for span in ss.get("spans", []):
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:
                        span[key] = base64.b64decode(span[key]).hex()
    return orjson.dumps(document)


def _payment(session: str, action: str) -> dict[str, Any]:
    return {"durable.session.id": session, "durable.action.id": action, "durable.action.kind": "payment"}


def _status(response: httpx.Response) -> status_pb2.Status:
    status = status_pb2.Status()
    if response.headers["content-type"].startswith("application/x-protobuf"):
        status.ParseFromString(response.content)
    else:
        json_format.ParseDict(response.json(), status, ignore_unknown_fields=True)
    return status


def test_sdk_http_exporter_agent_run_finds_what_replay_finds(tmp_path: Path) -> None:
    config = serve_config(tmp_path)
    with running(config) as server:
        exporter = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{server.http_port}/v1/traces")
        recording = Recording(exporter)
        run_refund_agent(recording.provider, "refund order 7")
        emit_durable_spans(recording.provider, "s-durable-http")
        recording.shutdown()
    found = keys_of(read_jsonl(tmp_path / "violations.jsonl"))
    assert found == replay_keys([recording.request()], config)
    assert "DS002" in {rule for rule, _, _ in found}
    assert ("DS006", "s-durable-http", "ask-1") in found


def test_protobuf_json_gzip_and_zstd_bodies_all_count(tmp_path: Path) -> None:
    requests = [make_request(_payment(f"s-enc-{i}", f"pay-{i}")) for i in range(5)]
    bodies = [
        (requests[0].SerializeToString(), PROTOBUF),
        (otlp_json(requests[1]), JSON),
        (gzip.compress(requests[2].SerializeToString()), {**PROTOBUF, "Content-Encoding": "gzip"}),
        (zstandard.ZstdCompressor().compress(requests[3].SerializeToString()),
         {**PROTOBUF, "Content-Encoding": "zstd"}),
        (gzip.compress(otlp_json(requests[4])),
         {"Content-Encoding": "gzip", "Content-Type": "application/json; charset=utf-8"}),
    ]
    with running(serve_config(tmp_path)) as server:
        url = f"http://127.0.0.1:{server.http_port}/v1/traces"
        with httpx.Client() as client:
            for body, headers in bodies:
                response = client.post(url, content=body, headers=headers)
                assert response.status_code == 200, response.text
                expected = "application/json" if "json" in headers["Content-Type"] else "application/x-protobuf"
                assert response.headers["content-type"].startswith(expected)
    found = keys_of(read_jsonl(tmp_path / "violations.jsonl"))
    assert found == {("DS002", f"s-enc-{i}", f"pay-{i}") for i in range(5)}


def test_partial_success_in_both_encodings(tmp_path: Path) -> None:
    bad = {"durable.session.id": "s-part", "durable.action.id": "bad", "durable.action.kind": "write",
           "durable.retry.retryable": "sometimes"}
    with running(serve_config(tmp_path)) as server:
        url = f"http://127.0.0.1:{server.http_port}/v1/traces"
        as_protobuf = httpx.post(url, content=make_request(bad).SerializeToString(), headers=PROTOBUF)
        as_json = httpx.post(url, content=otlp_json(make_request(bad)), headers=JSON)
    answer = trace_service_pb2.ExportTraceServiceResponse()
    answer.ParseFromString(as_protobuf.content)
    assert answer.partial_success.rejected_spans == 1
    assert "durable.retry.retryable" in answer.partial_success.error_message
    assert "sometimes" not in answer.partial_success.error_message
    assert as_json.json()["partialSuccess"]["rejectedSpans"] in ("1", 1)
    documents = read_jsonl(tmp_path / "violations.jsonl")
    assert [d["rule"] for d in documents if d["session_id"] == "s-part"] == ["DS000", "DS000"]


def test_json_span_that_does_not_decode_is_rejected_not_the_request(tmp_path: Path) -> None:
    document = orjson.loads(otlp_json(make_request(_payment("s-json", "p-1"), _payment("s-json", "p-2"))))
    document["resourceSpans"][0]["scopeSpans"][0]["spans"][1]["traceId"] = "not-hex"
    with running(serve_config(tmp_path)) as server:
        response = httpx.post(f"http://127.0.0.1:{server.http_port}/v1/traces", content=orjson.dumps(document),
                              headers=JSON)
    assert response.status_code == 200
    assert response.json()["partialSuccess"]["rejectedSpans"] in ("1", 1)
    assert "traceId" in response.json()["partialSuccess"]["errorMessage"]
    found = keys_of(read_jsonl(tmp_path / "violations.jsonl"))
    assert ("DS002", "s-json", "p-1") in found


def test_bad_input_gets_its_status_and_the_server_keeps_serving(tmp_path: Path) -> None:
    config = serve_config(tmp_path, {"receivers": {"otlp": {"http": {"max_request_body_size": "256KiB"}}}})
    good = make_request(_payment("s-ok", "p-ok")).SerializeToString()
    wide: dict[str, Any] = {f"attr.{i}": i for i in range(10_000)}
    wide.update(_payment("s-wide", "wide-1"))
    bomb = gzip.compress(b"\x00" * (2 * 1024 * 1024))
    cases: list[tuple[str, str, bytes, dict[str, str], int, str]] = [
        ("garbage protobuf", "POST", b"\xff\xfe garbage", PROTOBUF, 400, "Wire format was corrupt"),
        ("garbage JSON", "POST", b"{not json", JSON, 400, "not JSON"),
        ("JSON of the wrong shape", "POST", b'{"resourceSpans": 5}', JSON, 400, "resourceSpans"),
        ("truncated", "POST", good[:-9], PROTOBUF, 400, "cannot decode"),
        ("invalid UTF-8", "POST", good.replace(b"s-ok", b"s-\xff\xfe"), PROTOBUF, 400, "bad UTF-8"),
        ("wrong content type", "POST", good, {"Content-Type": "text/plain"}, 415, "text/plain"),
        ("no content type", "POST", good, {}, 415, "Content-Type"),
        ("unknown encoding", "POST", good, {**PROTOBUF, "Content-Encoding": "br"}, 415, "Content-Encoding"),
        ("broken gzip", "POST", b"\x1f\x8b not gzip", {**PROTOBUF, "Content-Encoding": "gzip"}, 400, "gzip"),
        ("over the limit", "POST", b"\x00" * (300 * 1024), PROTOBUF, 413, "limit"),
        ("decompression bomb", "POST", bomb, {**PROTOBUF, "Content-Encoding": "gzip"}, 413, "decompressed"),
        ("wrong method", "GET", b"", {}, 405, "Method Not Allowed"),
        ("wrong path", "POST", good, PROTOBUF, 404, "Not Found"),
    ]
    with running(config) as server:
        base = f"http://127.0.0.1:{server.http_port}"
        with httpx.Client() as client:
            for name, method, body, headers, code, words in cases:
                url = f"{base}/v1/traces" if name != "wrong path" else f"{base}/v1/logs"
                response = client.request(method, url, content=body or None, headers=headers)
                assert response.status_code == code, (name, response.text)
                status = _status(response)
                assert words in status.message, (name, status.message)
                if code == 405:
                    assert response.headers["allow"] == "POST"
                # The next client is served as usual.
                assert client.post(f"{base}/v1/traces", content=good, headers=PROTOBUF).status_code == 200, name
            response = client.post(f"{base}/v1/traces", content=make_request(wide).SerializeToString(),
                                   headers=PROTOBUF)
            assert response.status_code == 200
    found = keys_of(read_jsonl(tmp_path / "violations.jsonl"))
    assert {("DS002", "s-ok", "p-ok"), ("DS002", "s-wide", "wide-1")} <= found


def test_sdk_http_exporter_retries_through_a_full_queue(tmp_path: Path) -> None:
    config = serve_config(tmp_path, {
        "queue": {"max_requests": 1, "max_spans": 100, "retry_after": "100ms"},
        "state": {"backend": "sqlite", "path": str(tmp_path / "state.db"), "busy_timeout": "60s"},
    })
    outcome = flood(config, "http", senders=6, batches=3, per_batch=100, sessions=20, stall_until_refused=True)
    assert all(r == SpanExportResult.SUCCESS for r in outcome.results)
    assert outcome.processed == outcome.sent
    assert outcome.refused > 0


def test_gzip_compressed_export_from_the_sdk(tmp_path: Path) -> None:
    from opentelemetry.exporter.otlp.proto.http import Compression

    with running(serve_config(tmp_path)) as server:
        exporter = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{server.http_port}/v1/traces",
                                    compression=Compression.Gzip)
        recording = Recording(exporter, batch=False)
        emit_durable_spans(recording.provider, "s-gzip-http")
        recording.shutdown()
    assert ("DS003", "s-gzip-http", "call-1") in keys_of(read_jsonl(tmp_path / "violations.jsonl"))


def test_the_worker_gets_the_decompressed_protobuf_bytes_and_none_for_json() -> None:
    """A durable store journals the protobuf bytes as received; an OTLP/JSON request is serialized once there."""
    import asyncio
    import gzip
    import threading

    import httpx
    from google.protobuf import json_format

    from processor.config import HttpReceiverConfig
    from processor.receive.otlp_http import build_app
    from processor.receive.queue import Ack, Batch, IngestQueue
    from processor.telemetry import Telemetry

    request = make_request({"durable.action.kind": "payment"})
    body = request.SerializeToString()
    telemetry = Telemetry()
    queue = IngestQueue(10, 1000, 1.0, telemetry)
    app = build_app(HttpReceiverConfig(), queue, telemetry, lambda: True, lambda: (True, ""))
    taken: list[Batch] = []

    def worker() -> None:
        for _ in range(2):
            batch = queue.get(10.0)
            if batch is None:
                return
            taken.append(batch)
            batch.ack.set_result(Ack())

    async def scenario() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://receiver") as client:
            compressed = await client.post("/v1/traces", content=gzip.compress(body), headers={
                "Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"})
            as_json = await client.post("/v1/traces", content=json_format.MessageToJson(request), headers={
                "Content-Type": "application/json"})
        return [compressed.status_code, as_json.status_code]

    consumer = threading.Thread(target=worker)
    consumer.start()
    assert asyncio.run(scenario()) == [200, 200]
    consumer.join(10.0)
    protobuf, json_batch = taken
    assert protobuf.body == body
    assert json_batch.body is None
