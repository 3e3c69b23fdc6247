"""Real servers for the exporter tests, all on 127.0.0.1 with free ports in tmp dirs.

- ``PrometheusServer`` / ``AlertmanagerServer`` start the real binaries (skipping the
  test with a clear reason when a binary is missing) and stop them afterwards.
- ``HttpRecorder`` is a small HTTP server that records every request and answers as
  its current ``mode`` says (ok, an error status, slow), so tests can play an endpoint
  that fails and recovers.
- ``OtlpGrpcReceiver`` implements the OTLP TraceService and MetricsService.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import yaml
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from processor.violations import Violation, make_violation_id

LOCALHOST = "127.0.0.1"


# Ports handed out in this process: a port is released as soon as it is picked, and the
# kernel may give it to the next bind, so two servers of one test could be told the same one.
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port on 127.0.0.1 free now, never one handed out before in this test run."""
    for _ in range(1000):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((LOCALHOST, 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("no port free on 127.0.0.1 that was not handed out already")


def require_binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (CI installs it; on Debian: apt-get install prometheus "
                    "prometheus-alertmanager)")
    return path


def wait_until(predicate: Callable[[], Any], *, timeout_s: float, interval_s: float = 0.1, what: str = "") -> Any:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what or 'a condition'}; last: {last!r}")


class _Process:
    """A server binary started in a tmp dir, its output kept in a log file."""

    def __init__(self, name: str, args: list[str], workdir: Path, port: int) -> None:
        self.name = name
        self.port = port
        self.url = f"http://{LOCALHOST}:{port}"
        self.log_path = workdir / f"{name}.log"
        self._log = self.log_path.open("wb")
        self._proc = subprocess.Popen(args, cwd=workdir, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        def ready() -> bool:
            if self._proc.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self._proc.returncode}: {self.output()[-2000:]}")
            try:
                return httpx.get(f"{self.url}/-/ready", timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout_s=timeout_s, interval_s=0.2, what=f"{self.name} to be ready")

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
        self._log.close()


@contextmanager
def _serving(name: str, binary: str, workdir: Path, config: dict[str, Any], flags: list[str]) -> Iterator[_Process]:
    """``binary`` reading ``config`` (written as ``<name>.yml``), on a free loopback port until the block ends."""
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / f"{name}.yml"
    config_path.write_text(yaml.safe_dump(config))
    port = free_port()
    proc = _Process(name, [
        binary, f"--config.file={config_path}", *flags, f"--web.listen-address={LOCALHOST}:{port}",
    ], workdir, port)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@contextmanager
def prometheus_server(workdir: Path, targets: list[str], rule_files: list[Path],
                      jobs: Mapping[str, Mapping[str, Any]] | None = None) -> Iterator[_Process]:
    """Prometheus scraping ``targets`` every second and evaluating ``rule_files`` every second.

    ``jobs``: more scrape jobs by name, each a scrape config (``scheme``, ``authorization``, ``tls_config``,
    ``static_configs``...).
    """
    binary = require_binary("prometheus")
    scrape_configs: list[dict[str, Any]] = [{"job_name": "durable-check", "static_configs": [{"targets": targets}]}]
    scrape_configs += [{"job_name": name, **job} for name, job in (jobs or {}).items()]
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": scrape_configs,
    }
    with _serving("prometheus", binary, workdir, config, [f"--storage.tsdb.path={workdir / 'data'}"]) as proc:
        yield proc


@contextmanager
def alertmanager_server(workdir: Path) -> Iterator[_Process]:
    """Alertmanager with one do-nothing receiver, a short group_wait and no cluster."""
    binary = require_binary("prometheus-alertmanager")
    config = {
        "route": {"receiver": "null", "group_wait": "1s", "group_interval": "1s", "repeat_interval": "1h"},
        "receivers": [{"name": "null"}],
    }
    flags = [f"--storage.path={workdir / 'data'}", "--cluster.listen-address="]
    with _serving("alertmanager", binary, workdir, config, flags) as proc:
        yield proc


def query(prometheus_url: str, expr: str) -> list[dict[str, Any]]:
    """The result vector of an instant PromQL query."""
    response = httpx.get(f"{prometheus_url}/api/v1/query", params={"query": expr}, timeout=5)
    response.raise_for_status()
    result: list[dict[str, Any]] = response.json()["data"]["result"]
    return result


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    # The recorder's mode when the request came in, and the status it answered.
    mode: str
    status: int
    # time.monotonic() when the request arrived.
    at: float

    def json(self) -> Any:
        return json.loads(self.body)


class HttpRecorder:
    """Records every POST; ``mode`` decides the answer: "ok" (200), "slow" (answers 200
    after ``slow_s``), or a status code as text ("500", "503", "429", "400")."""

    def __init__(self, port: int = 0) -> None:
        self.mode = "ok"
        self.slow_s = 1.0
        self.retry_after: str | None = None
        self.response_body = b""
        self.received: list[Received] = []
        self._lock = threading.Lock()
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                arrived = time.monotonic()
                length = int(self.headers.get("Content-Length", "0"))
                body = self.rfile.read(length)
                mode = recorder.mode
                status = 200 if mode in ("ok", "slow") else int(mode)
                if mode == "slow":
                    time.sleep(recorder.slow_s)
                with recorder._lock:
                    recorder.received.append(Received(self.path, dict(self.headers), body, mode, status, arrived))
                try:
                    self.send_response(status)
                    if recorder.retry_after is not None and status != 200:
                        self.send_header("Retry-After", recorder.retry_after)
                    payload = recorder.response_body if status == 200 else b""
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timed out) first

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer((LOCALHOST, port), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self.url = f"http://{LOCALHOST}:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def snapshot(self) -> list[Received]:
        with self._lock:
            return list(self.received)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


class OtlpGrpcReceiver:
    """A real OTLP/gRPC receiver for traces and metrics; ``fail_with`` makes it refuse."""

    def __init__(self) -> None:
        self.trace_requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.metric_requests: list[metrics_service_pb2.ExportMetricsServiceRequest] = []
        self.metadata: list[dict[str, str]] = []
        self.fail_with: grpc.StatusCode | None = None
        self._lock = threading.Lock()
        receiver = self

        class Traces(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                if receiver.fail_with is not None:
                    context.abort(receiver.fail_with, "refused by the test")
                with receiver._lock:
                    receiver.trace_requests.append(request)
                    receiver.metadata.append(dict(context.invocation_metadata()))
                return trace_service_pb2.ExportTraceServiceResponse()

        class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                if receiver.fail_with is not None:
                    context.abort(receiver.fail_with, "refused by the test")
                with receiver._lock:
                    receiver.metric_requests.append(request)
                return metrics_service_pb2.ExportMetricsServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(  # type: ignore[no-untyped-call]
            Traces(), self._server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(  # type: ignore[no-untyped-call]
            Metrics(), self._server)
        self.port = self._server.add_insecure_port(f"{LOCALHOST}:0")
        self.endpoint = f"{LOCALHOST}:{self.port}"
        self._server.start()

    def spans(self) -> list[Any]:
        with self._lock:
            return [
                span
                for request in self.trace_requests
                for rs in request.resource_spans
                for ss in rs.scope_spans
                for span in ss.spans
            ]

    def stop(self) -> None:
        self._server.stop(grace=None)


def make_violation(n: int, *, rule: str = "DS002", severity: str = "critical", session: str = "s-test",
                   trace_id: str = "", span_id: str = "", time_ns: int | None = 1_790_000_000_000_000_000,
                   service: str = "booking-agent") -> Violation:
    """The n-th violation of a test session, with a real (derived) violation id."""
    action_id = f"a{n:03d}"
    identity = f"span:{trace_id}:{span_id}:0" if trace_id else f"line:actions.jsonl:{n}"
    return Violation(
        rule=rule,
        name="unkeyed-side-effect" if rule == "DS002" else "wait-expired-silently",
        severity=severity,  # type: ignore[arg-type]
        session_id=session,
        action_id=action_id,
        message=f"side effect {action_id} succeeded without an idempotency key",
        violation_id=make_violation_id(rule, session, action_id, identity),
        time_ns=None if time_ns is None else time_ns + n * 1_000_000,
        line=None if trace_id else n,
        origin="" if trace_id else "actions.jsonl",
        trace_id=trace_id,
        span_id=span_id,
        service=service,
        kind="payment",
    )
