"""OTLP/gRPC into serve: the SDK's own exporter, backpressure under a flood, and bad input."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.sdk.trace.export import SpanExportResult

from processor.receive.otlp_grpc import TRACE_SERVICE
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

EXPORT = f"/{TRACE_SERVICE}/Export"


def _raw_export(port: int, body: bytes, timeout_s: float = 10.0) -> tuple[grpc.StatusCode, str, Any]:
    """Send ``body`` as the Export request, unparsed: what a broken client would send."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(EXPORT, request_serializer=None, response_deserializer=None)
        try:
            response = call(body, timeout=timeout_s)
        except grpc.RpcError as error:
            return error.code(), error.details() or "", None
    answer = trace_service_pb2.ExportTraceServiceResponse()
    answer.ParseFromString(response)
    return grpc.StatusCode.OK, "", answer


def _good_request(session: str = "s-good", action: str = "a-1") -> trace_service_pb2.ExportTraceServiceRequest:
    return make_request({
        "durable.session.id": session, "durable.action.id": action, "durable.action.kind": "write",
        "durable.idempotency_key": f"k-{action}",
    })


def test_sdk_grpc_exporter_agent_run_finds_what_replay_finds(tmp_path: Path) -> None:
    config = serve_config(tmp_path)
    with running(config) as server:
        exporter = OTLPSpanExporter(endpoint=f"127.0.0.1:{server.grpc_port}", insecure=True)
        recording = Recording(exporter)
        output = run_refund_agent(recording.provider)
        emit_durable_spans(recording.provider, "s-durable-grpc")
        recording.shutdown()
    assert "refund_payment" in output
    found = keys_of(read_jsonl(tmp_path / "violations.jsonl"))
    expected = replay_keys([recording.request()], config)
    assert found == expected
    rules = {rule for rule, _, _ in found}
    # The agent's refund is an unkeyed payment; the durable spans trip their own rules.
    assert "DS002" in rules
    assert {("DS003", "s-durable-grpc", "call-1"), ("DS005", "s-durable-grpc", "ask-1")} <= found


def test_a_journaled_request_is_counted_before_its_sender_hears_of_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What reads the processed count after an answer (the flood below, serve's status line)
    sees the request in it, however the worker's thread is scheduled."""
    import processor.worker as worker_module

    config = serve_config(tmp_path, {"state": {"backend": "sqlite", "path": str(tmp_path / "state.db")}})
    answered: list[tuple[int, int]] = []
    resolve = worker_module._resolve
    with running(config) as server:

        def counted_then_resolved(batch: Any, *args: Any, **kwargs: Any) -> None:
            answered.append((batch.span_count, server.worker.processed_spans))
            resolve(batch, *args, **kwargs)

        monkeypatch.setattr(worker_module, "_resolve", counted_then_resolved)
        for n in range(3):
            code, _, _ = _raw_export(server.grpc_port, _good_request(action=f"a-{n}").SerializeToString())
            assert code == grpc.StatusCode.OK
    assert [spans for spans, _ in answered] == [1, 1, 1]
    assert [processed for _, processed in answered] == [1, 2, 3]


def test_flood_beyond_the_queue_is_delayed_not_lost(tmp_path: Path) -> None:
    config = serve_config(tmp_path, {
        "queue": {"max_requests": 2, "max_spans": 400, "retry_after": "200ms"},
        "state": {"backend": "sqlite", "path": str(tmp_path / "state.db"), "busy_timeout": "60s"},
    })
    outcome = flood(config, "grpc", senders=8, batches=6, per_batch=100, sessions=50, stall_until_refused=True)
    assert all(r == SpanExportResult.SUCCESS for r in outcome.results)
    assert outcome.processed == outcome.sent
    # The queue did overflow: the exporters' retries are what carried those spans through.
    assert outcome.refused > 0


def test_bad_input_gets_its_status_and_the_server_keeps_serving(tmp_path: Path) -> None:
    config = serve_config(tmp_path, {"receivers": {"otlp": {"grpc": {"max_recv_msg_size": "256KiB"}}}})
    good = _good_request().SerializeToString()
    with running(config) as server:
        port = server.grpc_port
        cases: dict[str, tuple[bytes, grpc.StatusCode, str]] = {
            "garbage": (b"\xff\xfe not protobuf \x00\x01", grpc.StatusCode.INVALID_ARGUMENT, "Wire format was corrupt"),
            "truncated": (good[:-7], grpc.StatusCode.INVALID_ARGUMENT, "cannot decode"),
            "over the limit": (
                make_request({"big": "x" * 300_000}).SerializeToString(),
                grpc.StatusCode.RESOURCE_EXHAUSTED, "",
            ),
            "invalid UTF-8": (
                good.replace(b"s-good", b"s-\xff\xfeod"), grpc.StatusCode.INVALID_ARGUMENT, "bad UTF-8",
            ),
        }
        for name, (body, code, words) in cases.items():
            got, details, _ = _raw_export(port, body)
            assert got == code, name
            assert words in details, (name, details)
            # The next client is served as usual.
            assert _raw_export(port, good)[0] == grpc.StatusCode.OK, name

        # 10,000 attributes on one span: accepted and evaluated, not a crash.
        attributes: dict[str, Any] = {f"attr.{i}": i for i in range(10_000)}
        attributes.update(
            {"durable.session.id": "s-wide", "durable.action.id": "wide-1", "durable.action.kind": "payment"}
        )
        code, _, answer = _raw_export(port, make_request(attributes).SerializeToString())
        assert code == grpc.StatusCode.OK
        assert answer.partial_success.rejected_spans == 0

        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            unknown = channel.unary_unary(f"/{TRACE_SERVICE}/Nope", request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.RpcError) as caught:
                unknown(b"", timeout=5)
            assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    found = keys_of(read_jsonl(tmp_path / "violations.jsonl"))
    assert ("DS002", "s-wide", "wide-1") in found


def test_unconvertible_spans_are_partial_success_and_ds000(tmp_path: Path) -> None:
    config = serve_config(tmp_path)
    bad_type = {
        "durable.session.id": "s-partial", "durable.action.id": "bad-1", "durable.action.kind": "write",
        "durable.retry.max_attempts": "three",
    }
    fine = {
        "durable.session.id": "s-partial", "durable.action.id": "ok-1", "durable.action.kind": "write",
        "durable.idempotency_key": "k-1",
    }
    body = make_request(bad_type, fine).SerializeToString()
    with running(config) as server:
        code, _, answer = _raw_export(server.grpc_port, body)
    assert code == grpc.StatusCode.OK
    assert answer.partial_success.rejected_spans == 1
    assert "durable.retry.max_attempts" in answer.partial_success.error_message
    assert "three" not in answer.partial_success.error_message
    rules = [d["rule"] for d in read_jsonl(tmp_path / "violations.jsonl") if d["session_id"] == "s-partial"]
    assert rules == ["DS000"]


def test_empty_request_is_acknowledged(tmp_path: Path) -> None:
    with running(serve_config(tmp_path)) as server:
        code, _, answer = _raw_export(server.grpc_port, b"")
    assert code == grpc.StatusCode.OK
    assert answer.partial_success.rejected_spans == 0


def test_gzip_compressed_export_from_the_sdk(tmp_path: Path) -> None:
    from grpc import Compression

    with running(serve_config(tmp_path)) as server:
        exporter = OTLPSpanExporter(endpoint=f"127.0.0.1:{server.grpc_port}", insecure=True,
                                    compression=Compression.Gzip)
        recording = Recording(exporter, batch=False)
        emit_durable_spans(recording.provider, "s-gzip")
        recording.shutdown()
    assert ("DS003", "s-gzip", "call-1") in keys_of(read_jsonl(tmp_path / "violations.jsonl"))


def test_the_worker_gets_the_request_bytes_as_received() -> None:
    """A durable store journals the bytes the client sent instead of serializing the request again."""
    import asyncio
    import threading

    from processor.config import GrpcReceiverConfig
    from processor.receive.otlp_grpc import OTLPGrpcReceiver
    from processor.receive.queue import Ack, Batch, IngestQueue
    from processor.telemetry import Telemetry

    body = make_request({"durable.action.kind": "payment"}, {"durable.action.kind": "checkpoint"}).SerializeToString()
    telemetry = Telemetry()
    queue = IngestQueue(10, 1000, 1.0, telemetry)
    taken: list[Batch] = []

    def worker() -> None:
        batch = queue.get(10.0)
        if batch is not None:
            taken.append(batch)
            batch.ack.set_result(Ack())

    async def scenario() -> grpc.StatusCode:
        receiver = OTLPGrpcReceiver(GrpcReceiverConfig(endpoint="127.0.0.1:0"), queue, telemetry, lambda: True)
        port = await receiver.start()
        try:
            code, _, _ = await asyncio.get_running_loop().run_in_executor(None, _raw_export, port, body)
        finally:
            await receiver.stop(1.0)
        return code

    consumer = threading.Thread(target=worker)
    consumer.start()
    assert asyncio.run(scenario()) == grpc.StatusCode.OK
    consumer.join(10.0)
    (batch,) = taken
    assert batch.body == body
    assert batch.request.SerializeToString() == body
