"""Operating serve: health and readiness, draining, TLS and mTLS, bearer tokens, SIGTERM under load."""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from processor.receive.otlp_grpc import TRACE_SERVICE
from processor.serve import Server, build_pipeline
from processor.telemetry import Telemetry
from tests.pki_support import make_pki
from tests.serve_support import config_file, keys_of, make_request, read_jsonl, running, serve_config, wait_for

ROOT = Path(__file__).resolve().parent.parent
PROTOBUF = {"Content-Type": "application/x-protobuf"}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _spans(n: int = 3) -> list[Any]:
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("ops")
    for i in range(n):
        with tracer.start_as_current_span("pay", attributes={
            "durable.session.id": f"s-ops-{i}", "durable.action.id": f"pay-{i}", "durable.action.kind": "payment",
        }):
            pass
    return list(memory.get_finished_spans())


def _health(channel: grpc.Channel, service: str = "") -> Any:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


# -- health, readiness, draining -------------------------------------------------------------


def test_health_and_readiness_follow_the_lifecycle(tmp_path: Path) -> None:
    with running(serve_config(tmp_path)) as server:
        http = f"http://127.0.0.1:{server.http_port}"
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
            assert _health(channel, TRACE_SERVICE) == health_pb2.HealthCheckResponse.SERVING
            assert httpx.get(f"{http}/healthz").json() == {"status": "alive"}
            assert httpx.get(f"{http}/readyz").status_code == 200

            assert server.loop is not None
            asyncio.run_coroutine_threadsafe(server.begin_drain(), server.loop).result(5)

            assert _health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
            assert _health(channel, TRACE_SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
            assert httpx.get(f"{http}/healthz").status_code == 200
            ready = httpx.get(f"{http}/readyz")
            assert (ready.status_code, ready.json()["reason"]) == (503, "shutting down")

            # New data is refused with "retry later", never dropped in silence.
            stub = trace_service_pb2_grpc.TraceServiceStub(channel)
            with pytest.raises(grpc.RpcError) as caught:
                stub.Export(make_request({"durable.session.id": "s", "durable.action.id": "a"}), timeout=5)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            trailing = dict(caught.value.trailing_metadata())
            status = status_pb2.Status.FromString(trailing["grpc-status-details-bin"])
            info = error_details_pb2.RetryInfo()
            assert status.details[0].Unpack(info)
            assert info.retry_delay.seconds + info.retry_delay.nanos / 1e9 >= 1.0

            response = httpx.post(f"{http}/v1/traces", headers=PROTOBUF,
                                  content=make_request({"durable.session.id": "s"}).SerializeToString())
            assert response.status_code == 503
            assert int(response.headers["retry-after"]) >= 1
            assert status_pb2.Status.FromString(response.content).code == 14  # UNAVAILABLE


# -- TLS ----------------------------------------------------------------------------------------


def test_tls_accepts_a_client_that_trusts_the_server_and_refuses_one_that_does_not(
    tmp_path: Path, pki: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # requests lets these variables override the exporter's own certificate_file.
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    monkeypatch.delenv("CURL_CA_BUNDLE", raising=False)
    tls = {"cert_file": str(pki["server_cert"]), "key_file": str(pki["server_key"])}
    config = serve_config(tmp_path, {"receivers": {"otlp": {"grpc": {"tls": tls}, "http": {"tls": dict(tls)}}}})
    with running(config) as server:
        trusted = grpc.ssl_channel_credentials(root_certificates=pki["ca"].read_bytes())
        exporter = GrpcExporter(endpoint=f"127.0.0.1:{server.grpc_port}", credentials=trusted, timeout=5)
        assert exporter.export(_spans()) == SpanExportResult.SUCCESS
        exporter.shutdown()
        http_exporter = HttpExporter(endpoint=f"https://127.0.0.1:{server.http_port}/v1/traces",
                                     certificate_file=str(pki["ca"]), timeout=5)
        assert http_exporter.export(_spans()) == SpanExportResult.SUCCESS
        http_exporter.shutdown()

        untrusted = grpc.ssl_channel_credentials(root_certificates=pki["other_ca"].read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{server.grpc_port}", untrusted) as channel:
            with pytest.raises(grpc.RpcError) as caught:
                trace_service_pb2_grpc.TraceServiceStub(channel).Export(make_request({}), timeout=3)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(httpx.ConnectError):
            httpx.post(f"https://127.0.0.1:{server.http_port}/v1/traces",
                       verify=ssl.create_default_context(cafile=str(pki["other_ca"])), content=b"", headers=PROTOBUF)
        # Plaintext to a TLS port does not get through either.
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel, pytest.raises(grpc.RpcError):
            trace_service_pb2_grpc.TraceServiceStub(channel).Export(make_request({}), timeout=3)


def test_mtls_requires_a_client_certificate(tmp_path: Path, pki: dict[str, Path]) -> None:
    tls = {"cert_file": str(pki["server_cert"]), "key_file": str(pki["server_key"]), "client_ca_file": str(pki["ca"])}
    config = serve_config(tmp_path, {"receivers": {"otlp": {"grpc": {"tls": tls}, "http": {"tls": dict(tls)}}}})
    ca, cert, key = (pki[k].read_bytes() for k in ("ca", "client_cert", "client_key"))
    with running(config) as server:
        with_cert = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
        exporter = GrpcExporter(endpoint=f"127.0.0.1:{server.grpc_port}", credentials=with_cert, timeout=5)
        assert exporter.export(_spans()) == SpanExportResult.SUCCESS
        exporter.shutdown()
        url = f"https://127.0.0.1:{server.http_port}/v1/traces"
        body = make_request({"durable.session.id": "s-mtls"}).SerializeToString()
        context = ssl.create_default_context(cafile=str(pki["ca"]))
        context.load_cert_chain(str(pki["client_cert"]), str(pki["client_key"]))
        assert httpx.post(url, verify=context, content=body, headers=PROTOBUF).status_code == 200

        without_cert = grpc.ssl_channel_credentials(root_certificates=ca)
        with grpc.secure_channel(f"127.0.0.1:{server.grpc_port}", without_cert) as channel:
            with pytest.raises(grpc.RpcError) as caught:
                trace_service_pb2_grpc.TraceServiceStub(channel).Export(make_request({}), timeout=3)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(httpx.HTTPError):
            httpx.post(url, verify=ssl.create_default_context(cafile=str(pki["ca"])), content=body, headers=PROTOBUF)


# -- bearer tokens ----------------------------------------------------------------------------------


def test_bearer_token_accepts_the_right_client_and_refuses_the_wrong_one(tmp_path: Path) -> None:
    auth = {"bearer_token": "right-token"}
    config = serve_config(tmp_path, {"receivers": {"otlp": {"grpc": {"auth": auth}, "http": {"auth": dict(auth)}}}})
    with running(config) as server:
        grpc_endpoint = f"127.0.0.1:{server.grpc_port}"
        http_url = f"http://127.0.0.1:{server.http_port}/v1/traces"
        right = {"authorization": "Bearer right-token"}
        wrong = {"authorization": "Bearer wrong-token"}

        exporter = GrpcExporter(endpoint=grpc_endpoint, insecure=True, headers=right, timeout=5)
        assert exporter.export(_spans()) == SpanExportResult.SUCCESS
        exporter.shutdown()
        http_exporter = HttpExporter(endpoint=http_url, headers=right, timeout=5)
        assert http_exporter.export(_spans()) == SpanExportResult.SUCCESS
        http_exporter.shutdown()

        with grpc.insecure_channel(grpc_endpoint) as channel:
            stub = trace_service_pb2_grpc.TraceServiceStub(channel)
            for metadata in (tuple(wrong.items()), (), (("authorization", "Basic cmlnaHQtdG9rZW4="),)):
                with pytest.raises(grpc.RpcError) as caught:
                    stub.Export(make_request({}), metadata=metadata, timeout=5)
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "wrong-token" not in (caught.value.details() or "")
            # Probes need no token.
            assert _health(channel) == health_pb2.HealthCheckResponse.SERVING

        body = make_request({"durable.session.id": "s"}).SerializeToString()
        for headers in (wrong, {}):
            response = httpx.post(http_url, content=body, headers={**PROTOBUF, **headers})
            assert response.status_code == 401
            assert response.headers["www-authenticate"] == "Bearer"
        assert httpx.post(http_url, content=body, headers={**PROTOBUF, **right}).status_code == 200
        assert httpx.get(f"http://127.0.0.1:{server.http_port}/readyz").status_code == 200
    found = keys_of(read_jsonl(tmp_path / "violations.jsonl"))
    assert ("DS002", "s-ops-0", "pay-0") in found


# -- SIGTERM under load -------------------------------------------------------------------------------


def _read_lines(stream: Any, into: queue.Queue[str]) -> None:
    for line in iter(stream.readline, ""):
        into.put(line)


@pytest.mark.slow
def test_sigterm_under_load_loses_nothing_that_was_acknowledged(tmp_path: Path) -> None:
    path = config_file(tmp_path, {"queue": {"max_requests": 8}, "evaluate": {"allowed_lateness": "2s"}})
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "processor.cli", "serve", "--config", str(path)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_read_lines, args=(proc.stderr, lines), daemon=True).start()
    ports: dict[str, int] = {}
    log: list[str] = []
    deadline = time.monotonic() + 30
    try:
        while len(ports) < 2 and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                assert proc.poll() is None, "serve exited: " + "".join(log)
                continue
            log.append(line)
            for protocol in ("gRPC", "HTTP"):
                marker = f"OTLP/{protocol} receiver listening on "
                if marker in line:
                    ports[protocol] = int(line.rsplit(":", 1)[1])
        assert len(ports) == 2, "".join(log)

        acked: list[tuple[str, str]] = []
        acked_lock = threading.Lock()
        stop_sending = threading.Event()

        def payments(sender: str, n: int) -> tuple[list[tuple[str, str]], bytes, Any]:
            keys = [(f"s-{sender}-{n}-{i}", f"pay-{sender}-{n}-{i}") for i in range(20)]
            message = make_request(*[
                {"durable.session.id": s, "durable.action.id": a, "durable.action.kind": "payment"} for s, a in keys
            ])
            return keys, message.SerializeToString(), message

        def grpc_sender(sender: str) -> None:
            with grpc.insecure_channel(f"127.0.0.1:{ports['gRPC']}") as channel:
                stub = trace_service_pb2_grpc.TraceServiceStub(channel)
                for n in range(2000):
                    if stop_sending.is_set():
                        return
                    keys, _, message = payments(sender, n)
                    try:
                        stub.Export(message, timeout=10)
                    except grpc.RpcError:
                        return  # refused while shutting down, or gone: not acknowledged
                    with acked_lock:
                        acked.extend(keys)

        def http_sender(sender: str) -> None:
            with httpx.Client(timeout=10) as client:
                for n in range(2000):
                    if stop_sending.is_set():
                        return
                    keys, body, _ = payments(sender, n)
                    try:
                        response = client.post(f"http://127.0.0.1:{ports['HTTP']}/v1/traces", content=body,
                                               headers=PROTOBUF)
                    except httpx.HTTPError:
                        return
                    if response.status_code != 200:
                        return
                    with acked_lock:
                        acked.extend(keys)

        senders = [threading.Thread(target=grpc_sender, args=(f"g{i}",)) for i in range(3)]
        senders += [threading.Thread(target=http_sender, args=(f"h{i}",)) for i in range(2)]
        for thread in senders:
            thread.start()
        time.sleep(1.5)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        stop_sending.set()
        for thread in senders:
            thread.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert code == 0, "".join(log) + "".join(lines.queue)
    assert len(acked) > 100
    found = keys_of(read_jsonl(tmp_path / "violations.jsonl"))
    missing = [key for key in acked if ("DS002", *key) not in found]
    assert missing == []


def test_sqlite_state_keeps_held_back_spans_across_a_restart(tmp_path: Path) -> None:
    config = serve_config(tmp_path, {
        "state": {"backend": "sqlite", "path": str(tmp_path / "state.db")},
        "evaluate": {"allowed_lateness": "3s"},
    })
    sessions = [f"s-restart-{i}" for i in range(5)]
    # Per session: a tool call run twice (DS101, a session rule: after the buffer) and an
    # unkeyed payment (DS002, a condition rule: when the span is accepted).
    message = make_request(*[
        {"durable.session.id": s, "durable.action.id": action, "durable.action.kind": kind}
        for s in sessions
        for action, kind in (("call", "tool_call"), ("call", "tool_call"), ("pay", "payment"))
    ])
    with running(config) as server:
        response = httpx.post(f"http://127.0.0.1:{server.http_port}/v1/traces", content=message.SerializeToString(),
                              headers=PROTOBUF)
        assert response.status_code == 200
    # Stopped within the allowed lateness: the spans were still held for ordering, in the store.
    assert (tmp_path / "state.db").exists()
    accepted = {("DS002", s, "pay") for s in sessions}
    held = {("DS101", s, "call") for s in sessions}
    found = keys_of(read_jsonl(tmp_path / "violations.jsonl"))
    assert accepted <= found
    assert not held & found
    with running(config):
        assert wait_for(lambda: held <= keys_of(read_jsonl(tmp_path / "violations.jsonl")), timeout_s=15)
    # Released after the restart, the payments ran their session rules only: DS002 once each.
    reported = read_jsonl(tmp_path / "violations.jsonl")
    assert sorted(d["session_id"] for d in reported if d["rule"] == "DS002") == sessions


def test_a_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for receiver in ("grpc", "http"):
            config = serve_config(tmp_path, {"receivers": {"otlp": {receiver: {"endpoint": f"127.0.0.1:{port}"}}}})
            telemetry = Telemetry()
            server = Server(config, build_pipeline(config, telemetry), telemetry)

            async def attempt(server: Server = server) -> None:
                try:
                    await server.start()
                finally:
                    await server.shutdown(5.0)

            with pytest.raises(OSError, match=f"receivers.otlp.{receiver}.endpoint: cannot listen on 127.0.0.1:{port}"):
                asyncio.run(attempt())


def test_refused_requests_are_logged_once_per_interval_without_values(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    auth = {"bearer_token": "sekret-token"}
    config = serve_config(tmp_path, {"receivers": {"otlp": {"http": {"auth": auth}}}})
    with running(config) as server:
        url = f"http://127.0.0.1:{server.http_port}/v1/traces"
        body = make_request({"durable.session.id": "private-session-value"}).SerializeToString()
        with httpx.Client() as client:
            right = {**PROTOBUF, "authorization": "Bearer sekret-token"}
            wrong = {**PROTOBUF, "authorization": "Bearer guessed-token"}
            for _ in range(5):
                assert client.post(url, content=body[:-3], headers=right).status_code == 400
            for _ in range(3):
                assert client.post(url, content=body, headers=wrong).status_code == 401
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len([m for m in refusals if "(400)" in m]) == 1
    assert len([m for m in refusals if "(401)" in m]) == 1
    for secret in ("private-session-value", "sekret-token", "guessed-token"):
        assert secret not in caplog.text


def test_queue_is_bounded_by_requests_and_spans_and_refuses_after_close() -> None:
    from processor.receive.queue import Batch, IngestQueue, QueueClosed, QueueFull

    queue_ = IngestQueue(max_requests=2, max_spans=100, retry_after_s=0.5, telemetry=Telemetry())

    def batch(spans: int) -> Batch:
        return Batch(request=None, span_count=spans, protocol="grpc", origin="test")

    # An empty queue takes a request larger than max_spans: it could never fit otherwise.
    queue_.try_put(batch(150))
    with pytest.raises(QueueFull) as caught:
        queue_.try_put(batch(1))
    assert 0.5 <= caught.value.retry_after_s <= 0.75
    assert queue_.get(0.1) is not None
    queue_.try_put(batch(60))
    with pytest.raises(QueueFull):
        queue_.try_put(batch(41))  # 101 spans
    queue_.try_put(batch(40))
    with pytest.raises(QueueFull):
        queue_.try_put(batch(0))  # 2 requests
    assert queue_.is_full()
    queue_.close()
    with pytest.raises(QueueClosed):
        queue_.try_put(batch(1))
    # What was accepted before the close is still handed out, then the queue reports drained.
    assert [queue_.get(0.1) is not None for _ in range(2)] == [True, True]
    assert queue_.get(0.1) is None
    assert queue_.drained()


def test_start_up_says_what_to_set_in_the_agents_and_where_violations_go_once(tmp_path: Path) -> None:
    from tests.serve_process import serve_process

    with serve_process(tmp_path) as served:
        wait_for(lambda: "violations:" in served.log_text(), 10)
    log = served.log_text()  # after the stop, which uvicorn also used to announce per server
    lines = [line.split(": ", 1)[1] for line in log.splitlines() if " INFO " in line]
    assert f"agents: OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:{served.http_port}" in lines
    assert f"violations: {tmp_path / 'violations.jsonl'} (JSONL)" in lines
    assert f"operator view on http://127.0.0.1:{served.ui_port}" in lines
    # Each embedded server (receiver, view, metrics) used to print uvicorn's own process lines again.
    assert "Started server process" not in log and "Finished server process" not in log


def test_a_grpc_port_in_use_is_one_clear_line_and_exit_2(tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = config_file(tmp_path, {"receivers": {"otlp": {"grpc": {"endpoint": f"127.0.0.1:{port}"}}}})
        done = subprocess.run([sys.executable, "-m", "processor.cli", "serve", "--config", str(config)],
                              capture_output=True, text=True, timeout=60, cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert done.returncode == 2
    problems = [line for line in done.stderr.splitlines() if " INFO " not in line and " WARNING " not in line]
    # Only our line: no raw line from gRPC's C core before it.
    assert problems == [f"durable-check: cannot start the receivers: receivers.otlp.grpc.endpoint: cannot listen on "
                        f"127.0.0.1:{port}: Address already in use"]
