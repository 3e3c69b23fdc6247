"""Shared by the durability tests: a deterministic agent workload as OTLP requests, a retrying
gRPC client, and ``serve`` as a real subprocess that can be killed and started again."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import orjson
import yaml
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from processor.receive.otlp_grpc import TRACE_SERVICE

if TYPE_CHECKING:
    from processor.config import Config
    from processor.serve import Server
    from processor.state.sqlstore import SqlStateStore

EXPORT = f"/{TRACE_SERVICE}/Export"
REPO = Path(__file__).resolve().parent.parent
_MS = 1_000_000


def _kv(target: Any, key: str, value: Any) -> None:
    kv = target.add()
    kv.key = key
    if isinstance(value, bool):
        kv.value.bool_value = value
    elif isinstance(value, int):
        kv.value.int_value = value
    else:
        kv.value.string_value = str(value)


@dataclass(slots=True)
class Step:
    """One span of a session: its attributes."""

    attributes: dict[str, Any]


def session_steps(rng: random.Random, session: str, steps: int) -> list[Step]:
    """A session that trips stateful and per-record rules in a fixed order (the rng decides which).

    A wait comes only as a session's last step: whether a wait fires in serve depends on
    the wall-clock arrival of what follows it, and a crash delays arrivals. Nothing
    follows these, so each fires once, from the clock, however late.
    """
    out: list[Step] = []
    for n in range(steps):
        action = f"{session}-a{n}"
        roll = rng.random()
        attrs: dict[str, Any] = {"durable.action.id": action}
        if n == steps - 1 and roll < 0.5:
            # A wait with a short timeout nobody resolves: DS107 fires at the deadline, from the clock.
            attrs.update({"durable.action.kind": "tool_call", "durable.workflow.state": "awaiting_approval",
                          "durable.wait.timeout_s": 1})
        elif roll < 0.25:
            # A payment with no checkpoint after it (DS110 on the next action), no idempotency key (DS002).
            attrs.update({"durable.action.kind": "payment"})
        elif roll < 0.45:
            attrs.update({"durable.action.kind": "checkpoint"})
        elif roll < 0.6:
            attrs.update({"durable.action.kind": "external_read", "durable.action.status": "error",
                          "durable.retry.attempt": 3, "durable.retry.max_attempts": 3})
        else:
            attrs.update({"durable.action.kind": "tool_call"})
        out.append(Step(attrs))
    return out


def workload(seed: int, sessions: int, steps: int, start_ns: int) -> dict[str, list[bytes]]:
    """Per session, its requests (one span each, the session id on the resource), in event-time order.

    Ids and times are derived from the seed, so the same workload can be sent to two servers.
    """
    rng = random.Random(seed)
    out: dict[str, list[bytes]] = {}
    for s in range(sessions):
        session = f"sess-{seed}-{s:03d}"
        requests: list[bytes] = []
        for n, step in enumerate(session_steps(rng, session, steps)):
            request = trace_service_pb2.ExportTraceServiceRequest()
            rs = request.resource_spans.add()
            _kv(rs.resource.attributes, "service.name", "durability-test-agent")
            _kv(rs.resource.attributes, "durable.session.id", session)
            ss = rs.scope_spans.add()
            ss.scope.name = "durability-test"
            span = ss.spans.add()
            span.name = f"step {n}"
            span.trace_id = (seed * 1_000_003 + s + 1).to_bytes(16, "big")
            span.span_id = (s * 1000 + n + 1).to_bytes(8, "big")
            span.start_time_unix_nano = start_ns + (n * 40 + s) * _MS
            span.end_time_unix_nano = span.start_time_unix_nano + _MS
            for key, value in step.attributes.items():
                _kv(span.attributes, key, value)
            requests.append(request.SerializeToString())
        out[session] = requests
    return out


class RetryingSender:
    """Sends requests like an OTLP exporter: retry UNAVAILABLE and connection loss with backoff, bounded."""

    def __init__(self, port_of: Any, *, give_up_s: float = 60.0) -> None:
        self._port_of = port_of
        self.give_up_s = give_up_s
        self.retries = 0
        self._lock = threading.Lock()

    def send(self, body: bytes) -> None:
        deadline = time.monotonic() + self.give_up_s
        backoff = 0.05
        while True:
            port = self._port_of()
            try:
                with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                    call = channel.unary_unary(EXPORT, request_serializer=None, response_deserializer=None)
                    call(body, timeout=5.0)
                return
            except grpc.RpcError as error:
                if error.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                        grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN):
                    raise
            with self._lock:
                self.retries += 1
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not take a request within the time allowed")
            time.sleep(backoff)
            backoff = min(1.0, backoff * 2)


def send_sessions(sender: RetryingSender, sessions: Mapping[str, Sequence[bytes]], workers: int = 4,
                  pause_s: float = 0.0) -> None:
    """Each session's requests in order (one client thread per group of sessions), sessions in parallel."""
    names = sorted(sessions)
    errors: list[BaseException] = []

    def run(mine: list[str]) -> None:
        try:
            for index in range(max(len(sessions[n]) for n in mine)):
                for name in mine:
                    if index < len(sessions[name]):
                        sender.send(sessions[name][index])
                if pause_s:
                    time.sleep(pause_s)
        except BaseException as exc:  # reported to the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(names[i::workers],)) for i in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180.0)
    if errors:
        raise errors[0]


@dataclass
class ServeProcess:
    """``python -m processor.cli serve --config FILE`` as a subprocess, on fixed loopback ports."""

    config_path: Path
    grpc_port: int
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    kills: int = 0
    env: dict[str, str] = field(default_factory=dict)

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO), **self.env}
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "processor.cli", "serve", "--config", str(self.config_path)],
            cwd=REPO, env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
        )
        log.close()
        self.starts += 1

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}") as channel:
                    answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"serve did not become ready:\n{self.log()}")

    def kill(self) -> None:
        """SIGKILL: no drain, no flush, no goodbye."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10.0)
            self.kills += 1

    def stop(self, timeout_s: float = 40.0) -> int:
        """SIGTERM and wait for the graceful exit."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5.0)
                raise
        return int(self.proc.returncode)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except OSError:
            return ""


def write_config(path: Path, settings: Mapping[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(dict(settings)), encoding="utf-8")
    return path


def serve_settings(tmp: Path, grpc_port: int, state: Mapping[str, Any], jsonl: Path) -> dict[str, Any]:
    return {
        "receivers": {"otlp": {"grpc": {"endpoint": f"127.0.0.1:{grpc_port}"}, "http": {"endpoint": ""}}},
        "evaluate": {"tick_interval": "50ms", "allowed_lateness": "200ms"},
        "state": dict(state),
        "exporters": {"jsonl": {"path": str(jsonl)}},
    }


class RecordingSender(RetryingSender):
    """A RetryingSender that also keeps the messages of the retryable errors it met."""

    def __init__(self, port_of: Any, *, give_up_s: float = 60.0) -> None:
        super().__init__(port_of, give_up_s=give_up_s)
        self.errors: list[str] = []

    def send(self, body: bytes) -> None:
        deadline = time.monotonic() + self.give_up_s
        backoff = 0.05
        while True:
            try:
                with grpc.insecure_channel(f"127.0.0.1:{self._port_of()}") as channel:
                    call = channel.unary_unary(EXPORT, request_serializer=None, response_deserializer=None)
                    call(body, timeout=5.0)
                return
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                with self._lock:
                    self.retries += 1
                    self.errors.append(error.details() or "")
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not take a request within the time allowed")
            time.sleep(backoff)
            backoff = min(0.5, backoff * 2)


@contextlib.contextmanager
def durable_server(config: Config, store: SqlStateStore) -> Iterator[Server]:
    """A real server in this process on ``store``: its evaluator journals, evaluates and uses the outbox."""
    from processor.serve import Server, ServerThread, build_pipeline
    from processor.telemetry import Telemetry
    from processor.worker import EvaluatorWorker

    telemetry = Telemetry()
    server = Server(config, build_pipeline(config, telemetry, store), telemetry, store)
    assert isinstance(server.worker, EvaluatorWorker) and server.worker.journaled
    thread = ServerThread(server)
    thread.start()
    try:
        yield server
    finally:
        thread.stop(30.0)


def memory_run_ids(config: Config, requests: Mapping[str, Sequence[bytes]], settle_s: float) -> list[str]:
    """The violation ids an uninterrupted in-memory serve finds on the same requests (the reference)."""
    from processor.serve import Server, ServerThread, build_pipeline
    from processor.telemetry import Telemetry

    telemetry = Telemetry()
    server = Server(config, build_pipeline(config, telemetry), telemetry)
    thread = ServerThread(server)
    thread.start()
    try:
        send_sessions(RetryingSender(lambda: server.grpc_port), requests)
        time.sleep(settle_s)
    finally:
        thread.stop(30.0)
    path = Path(config.exporters.jsonl.path)
    return [str(orjson.loads(line)["violation_id"]) for line in path.read_bytes().splitlines() if line.strip()]
