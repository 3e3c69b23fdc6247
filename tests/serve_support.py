"""Shared by the serve tests: a real server on free ports, real SDK spans, and the replay path to compare with."""

from __future__ import annotations

import concurrent.futures
import contextlib
import sqlite3
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import orjson
import yaml
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Status, StatusCode

from processor.config import Config, parse_config
from processor.convert.spans import SpanConverter
from processor.evaluate.engine import Engine, EngineOptions
from processor.evaluate.rulefmt import load_rules
from processor.pipeline import Pipeline
from processor.serve import Server, ServerThread, build_pipeline, build_store
from processor.telemetry import Telemetry
from tests._spans import add_attributes

Key = tuple[str, str, str]


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _serve_document(tmp_path: Path, extra: Mapping[str, Any] | None) -> str:
    """Both receivers on free loopback ports, violations to ``tmp_path/violations.jsonl``, and ``extra`` over that."""
    base: dict[str, Any] = {
        "receivers": {"otlp": {"grpc": {"endpoint": "127.0.0.1:0"}, "http": {"endpoint": "127.0.0.1:0"}}},
        "evaluate": {"tick_interval": "50ms"},
        "exporters": {"jsonl": {"path": str(tmp_path / "violations.jsonl")}},
        # These tests are about receiving: the in-memory state evaluates what it holds at
        # shutdown, so a test can stop the server and read every violation. The durable
        # default (sqlite) has its own tests (test_state_*.py, test_crash_recovery.py).
        "state": {"backend": "memory", "path": str(tmp_path / "state.db")},
    }
    return yaml.safe_dump(_merge(base, extra or {}))


def serve_config(tmp_path: Path, extra: Mapping[str, Any] | None = None) -> Config:
    """The serve tests' configuration (see ``_serve_document``)."""
    return parse_config(_serve_document(tmp_path, extra), "test configuration")


def config_file(tmp_path: Path, extra: Mapping[str, Any] | None = None) -> Path:
    """The same as ``serve_config``, written to a file for a serve subprocess."""
    path = tmp_path / "serve.yaml"
    path.write_text(_serve_document(tmp_path, extra), encoding="utf-8")
    return path


@contextlib.contextmanager
def running(config: Config) -> Iterator[Server]:
    """A real server (engine, exporters, receivers) in a background thread; stopped gracefully on exit."""
    telemetry = Telemetry()
    store = build_store(config)
    server = Server(config, build_pipeline(config, telemetry, store), telemetry, store)
    thread = ServerThread(server)
    thread.start()
    try:
        yield server
    finally:
        thread.stop(30.0)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def keys_of(documents: Sequence[Mapping[str, Any]]) -> set[Key]:
    return {(d["rule"], d["session_id"], d["action_id"]) for d in documents}


def replay_keys(requests: Sequence[Any], config: Config) -> set[Key]:
    """What replay finds on the same requests, in this order: the same converter, every converted item
    (session marks included, so that the identity stage resolves sessions as replay's does), a fresh
    engine in replay mode."""
    ev = config.evaluate
    engine = Engine(
        load_rules(ev.rules, include_shipped=ev.include_shipped_rules),
        EngineOptions(
            strict=ev.strict,
            allowed_lateness_s=float(ev.allowed_lateness),
            session_idle_timeout_s=float(ev.session_idle_timeout),
            max_sessions=ev.max_sessions,
            mode="replay",
        ),
    )
    pipeline = Pipeline(engine, [], None)
    converter = SpanConverter(config.convert)
    found = []
    seq = 0
    for request in requests:
        result = converter.convert(request, "replay", seq)
        seq += len(result.actions)
        found.extend(pipeline.process(result.items))
    found.extend(pipeline.finish())
    return {(v.rule, v.session_id, v.action_id) for v in found}


class Recording:
    """A TracerProvider that sends to ``exporter`` and keeps a copy of every span for the replay side."""

    def __init__(self, exporter: SpanExporter, *, batch: bool = True, service: str = "refund-service") -> None:
        self.memory = InMemorySpanExporter()
        self.provider = TracerProvider(resource=Resource.create({"service.name": service}))
        processor = BatchSpanProcessor(exporter, schedule_delay_millis=50) if batch else SimpleSpanProcessor(exporter)
        self.provider.add_span_processor(processor)
        self.provider.add_span_processor(SimpleSpanProcessor(self.memory))

    def spans(self) -> tuple[ReadableSpan, ...]:
        return self.memory.get_finished_spans()

    def request(self) -> trace_service_pb2.ExportTraceServiceRequest:
        return encode_spans(self.spans())

    def shutdown(self) -> None:
        self.provider.shutdown()


_agent_lock = threading.Lock()


def run_refund_agent(provider: TracerProvider, prompt: str = "refund order 42") -> str:
    """A real pydantic-ai agent run (offline TestModel) that calls a payment tool and a search tool."""
    from pydantic_ai import Agent
    from pydantic_ai.models.instrumented import InstrumentationSettings
    from pydantic_ai.models.test import TestModel

    agent = Agent(TestModel(), name="refund-agent")

    @agent.tool_plain
    def refund_payment(order_id: str) -> str:
        return f"refunded {order_id}"

    @agent.tool_plain
    def search_orders(query: str) -> str:
        return f"found {query}"

    # instrument_all is process-wide: one agent run at a time.
    with _agent_lock:
        Agent.instrument_all(InstrumentationSettings(tracer_provider=provider))
        try:
            result = agent.run_sync(prompt)
        finally:
            Agent.instrument_all(False)
    return str(result.output)


def emit_durable_spans(provider: TracerProvider, session: str) -> None:
    """Spans with durable.* attributes that trip per-record rules (DS002, DS003, DS005, DS006)."""
    tracer = provider.get_tracer("durable-check-tests")
    with tracer.start_as_current_span("charge card", attributes={
        "durable.session.id": session, "durable.action.id": "charge-1", "durable.action.kind": "payment",
    }):
        pass
    with tracer.start_as_current_span("call flaky api", attributes={
        "durable.session.id": session, "durable.action.id": "call-1", "durable.action.kind": "external_read",
        "durable.retry.retryable": True, "durable.result.recorded": True,
    }) as span:
        span.set_status(Status(StatusCode.ERROR))
    with tracer.start_as_current_span("ask human", attributes={
        "durable.session.id": session, "durable.action.id": "ask-1", "durable.action.kind": "user_prompt",
        "durable.cache.cacheable": True, "durable.result.recorded": True,
    }):
        pass


@dataclass(frozen=True, slots=True)
class Flood:
    """What a flood of concurrent SDK exports came to."""

    sent: int  # spans sent
    results: list[SpanExportResult]  # one per export call
    processed: int  # spans the server's worker processed
    refused: float  # spans the receiver refused with queue_full (the exporters then retried them)


def flood(
    config: Config, protocol: Literal["grpc", "http"], *, senders: int, batches: int, per_batch: int, sessions: int,
    stall_until_refused: bool = False,
) -> Flood:
    """``senders`` real OTLP exporters at once, each sending ``batches`` batches of ``per_batch`` write
    spans spread over ``sessions`` sessions, to a server started with ``config``.

    ``stall_until_refused``: the evaluator is held up until the receiver has refused a request, so the
    queue overflows on any machine rather than only on one slower than the evaluator. ``config`` must keep
    its state in SQLite (with a ``busy_timeout`` longer than the stall): the flood takes that database's
    write lock, which the evaluator needs to journal what it takes, and lets go once a refusal is counted.
    """
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("flood")
    for i in range(senders * batches * per_batch):
        with tracer.start_as_current_span("tool", attributes={
            "durable.session.id": f"s-{i % sessions}", "durable.action.id": f"a-{i}", "durable.action.kind": "write",
            "durable.idempotency_key": f"k-{i}",
        }):
            pass
    spans = list(memory.get_finished_spans())
    chunks = [spans[i:i + per_batch] for i in range(0, len(spans), per_batch)]
    with running(config) as server:
        def refused_so_far() -> float:
            value = server.telemetry.registry.get_sample_value(
                "durable_check_spans_rejected_total", {"protocol": protocol, "reason": "queue_full"}
            )
            return value or 0.0

        def send(part: list[list[ReadableSpan]]) -> list[SpanExportResult]:
            exporter: SpanExporter
            if protocol == "grpc":
                exporter = GrpcSpanExporter(endpoint=f"127.0.0.1:{server.grpc_port}", insecure=True, timeout=30)
            else:
                exporter = HttpSpanExporter(endpoint=f"http://127.0.0.1:{server.http_port}/v1/traces", timeout=30)
            try:
                return [exporter.export(chunk) for chunk in part]
            finally:
                exporter.shutdown()

        with contextlib.ExitStack() as stall:
            if stall_until_refused:
                assert config.state.backend == "sqlite", "stall_until_refused holds the SQLite state's write lock"
                holder = sqlite3.connect(config.state.path, isolation_level=None, timeout=10)
                stall.callback(holder.close)
                holder.execute("BEGIN IMMEDIATE")
                stall.callback(holder.execute, "ROLLBACK")
            with concurrent.futures.ThreadPoolExecutor(senders) as pool:
                pending = pool.map(send, [chunks[i::senders] for i in range(senders)])
                if stall_until_refused:
                    wait_for(lambda: refused_so_far() > 0, timeout_s=20.0)
                    stall.close()
                results = list(pending)
        refused = refused_so_far()
        processed = server.worker.processed_spans
    return Flood(len(spans), [r for part in results for r in part], processed, refused)


def spans_of(request: Any) -> list[Any]:
    return [span for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans]


def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0, interval_s: float = 0.02) -> bool:
    """Poll ``predicate`` until true or the time is up (bounded)."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


_ids = iter(range(1, 1 << 62))
_ids_lock = threading.Lock()


def make_request(
    *spans: Mapping[str, Any], service: str = "svc", start_ns: int = 1_793_524_440_000_000_000,
) -> trace_service_pb2.ExportTraceServiceRequest:
    """One ResourceSpans holding a span per attribute mapping, each with fresh trace and span ids."""
    out = trace_service_pb2.ExportTraceServiceRequest()
    resource_spans = out.resource_spans.add()
    add_attributes(resource_spans.resource.attributes, {"service.name": service})
    scope_spans = resource_spans.scope_spans.add()
    scope_spans.scope.name = "durable-check-tests"
    for index, attributes in enumerate(spans):
        with _ids_lock:
            n = next(_ids)
        span = scope_spans.spans.add()
        span.name = f"span {n}"
        span.trace_id = n.to_bytes(16, "big")
        span.span_id = n.to_bytes(8, "big")
        span.start_time_unix_nano = start_ns + index * 1_000_000
        span.end_time_unix_nano = span.start_time_unix_nano + 500_000
        add_attributes(span.attributes, attributes)
    return out

