"""What durability costs: spans/s through serve with the in-memory state against the SQLite state
(inbox journal + engine state + outbox, ``synchronous=FULL``), in one run on one machine.

A real server in this process (gRPC receiver, queue, evaluator) takes OTLP requests
from ``--clients`` concurrent senders, each request one session's ``--spans`` spans
with durable.* attributes. Throughput counts acknowledged spans: with a durable store
a span is acknowledged once it is journaled and fsynced.

    python bench/bench_durability.py                      # 4000 requests of 10 spans, 8 clients
    python bench/bench_durability.py --requests 20000 --synchronous normal
    python bench/bench_durability.py --postgres postgresql://user@127.0.0.1/db   # also PostgreSQL
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _requests(count: int, spans: int, sessions: int) -> list[bytes]:
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    now = time.time_ns()
    out: list[bytes] = []
    for n in range(count):
        session = f"bench-{n % sessions:05d}"
        request = trace_service_pb2.ExportTraceServiceRequest()
        rs = request.resource_spans.add()
        for key, value in (("service.name", "bench-agent"), ("durable.session.id", session)):
            kv = rs.resource.attributes.add()
            kv.key = key
            kv.value.string_value = value
        ss = rs.scope_spans.add()
        for i in range(spans):
            span = ss.spans.add()
            span.name = "tool"
            span.trace_id = (n + 1).to_bytes(16, "big")
            span.span_id = (i + 1).to_bytes(8, "big")
            span.start_time_unix_nano = now + (n * spans + i) * 1000
            span.end_time_unix_nano = span.start_time_unix_nano + 500
            for key, value in (("durable.action.id", f"{session}-{n}-{i}"),
                               ("durable.action.kind", "payment" if i % 5 == 0 else "tool_call")):
                kv = span.attributes.add()
                kv.key = key
                kv.value.string_value = value
        out.append(request.SerializeToString())
    return out


def _send_all(port: int, bodies: list[bytes], clients: int) -> float:
    import grpc

    from processor.receive.otlp_grpc import TRACE_SERVICE

    def run(mine: list[bytes]) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(f"/{TRACE_SERVICE}/Export", request_serializer=None,
                                       response_deserializer=None)
            for body in mine:
                for _ in range(100):
                    try:
                        call(body, timeout=30.0)
                        break
                    except grpc.RpcError as error:
                        if error.code() != grpc.StatusCode.UNAVAILABLE:
                            raise
                        time.sleep(0.05)

    threads = [threading.Thread(target=run, args=(bodies[i::clients],)) for i in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started


def _server(workdir: Path, backend: str, synchronous: str, dsn: str, lateness: str, *, ui: bool = False) -> Any:
    import yaml

    from exporters import build_exporters
    from processor.config import parse_config
    from processor.evaluate.engine import EngineOptions
    from processor.evaluate.rulefmt import load_rules
    from processor.pipeline import Pipeline
    from processor.serve import Server, ServerThread
    from processor.state.sqlite import SqliteStore
    from processor.telemetry import Telemetry
    from processor.worker import engine_factory

    settings = {
        "receivers": {"otlp": {"grpc": {"endpoint": "127.0.0.1:0"}, "http": {"endpoint": ""}}},
        "queue": {"max_requests": 256},
        "evaluate": {"tick_interval": "100ms", "allowed_lateness": lateness},
        "exporters": {"jsonl": {"path": str(workdir / "violations.jsonl")}},
    }
    if ui:
        # The operator view's read model is written with every batch: what that costs.
        settings["ui"] = {"endpoint": "127.0.0.1:0"}
    config = parse_config(yaml.safe_dump(settings), "bench")
    telemetry = Telemetry()
    options = EngineOptions(allowed_lateness_s=float(config.evaluate.allowed_lateness), mode="serve")
    factory = engine_factory(load_rules([], include_shipped=True), options, telemetry)
    exporters = build_exporters(config.exporters, telemetry)
    if backend == "memory":
        from processor.evaluate.engine import Engine

        pipeline = Pipeline(Engine(load_rules([], include_shipped=True), options, None, telemetry), exporters,
                            telemetry)
        server = Server(config, pipeline, telemetry)
    else:
        if backend == "postgres":
            from processor.state.postgres import PostgresStore

            store: Any = PostgresStore(dsn, replica_id="bench")
        else:
            store = SqliteStore(workdir / "state.db", synchronous="normal" if synchronous == "normal" else "full")
        # A durable store and an engine factory: the server journals, evaluates and uses the outbox.
        server = Server(config, Pipeline(factory(store), exporters, telemetry, factory), telemetry, store)
    return ServerThread(server)


def measure(
    backend: str, bodies: list[bytes], spans: int, clients: int, *, synchronous: str, dsn: str, lateness: str,
    ui: bool = False,
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-durability-") as tmp:
        thread = _server(Path(tmp), backend, synchronous, dsn, lateness, ui=ui)
        server = thread.start()
        try:
            _send_all(server.grpc_port, bodies[: max(1, len(bodies) // 20)], clients)  # warm up
            seconds = _send_all(server.grpc_port, bodies, clients)
        finally:
            thread.stop(60.0)
        stats = getattr(server.worker, "stats", None)
    names = {"memory": "memory", "postgres": "postgres (journal+state+outbox, session leases)",
             "sqlite": f"sqlite (journal+state+outbox, synchronous={synchronous})"}
    result: dict[str, Any] = {
        "backend": names[backend] + (" + operator view" if ui else ""), "allowed_lateness": lateness,
        "requests": len(bodies), "spans": len(bodies) * spans, "seconds": round(seconds, 3),
        "spans_per_s": round(len(bodies) * spans / seconds),
    }
    if stats is not None and stats.groups:
        result["requests_per_fsync"] = round(stats.journaled / stats.groups, 1)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--spans", type=int, default=10)
    parser.add_argument("--sessions", type=int, default=500)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--synchronous", choices=("full", "normal"), default="full")
    parser.add_argument("--allowed-lateness", default="5s", help="evaluate.allowed_lateness (default: 5s, serve's)")
    parser.add_argument("--with-ui", action="store_true", help="also measure each durable store with the operator "
                        "view's read model on")
    parser.add_argument("--postgres", metavar="DSN", default="", help="also measure the PostgreSQL store (an empty "
                        "database)")
    args = parser.parse_args()
    bodies = _requests(args.requests, args.spans, args.sessions)
    # Each run has its own server and state: the same requests are new to each.
    for backend in ("memory", "sqlite", *(("postgres",) if args.postgres else ())):
        for ui in (False, True) if args.with_ui and backend != "memory" else (False,):
            print(json.dumps(measure(backend, bodies, args.spans, args.clients, synchronous=args.synchronous,
                                     dsn=args.postgres, lateness=args.allowed_lateness, ui=ui)),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
