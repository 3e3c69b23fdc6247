"""Durable Check with a real OpenTelemetry Collector in the loop (built from deploy/collector/).

- Agents (the SDK's OTLP exporter) -> the Collector with the shipped routing config -> two
  ``serve`` replicas on PostgreSQL: the violations are those of one replica; with one replica
  SIGKILLed mid-stream, the other adopts its work and nothing is lost or written twice.
- The Collector's file exporter as users configure it (OTLP/JSON and protobuf; per-message
  zstd, whole-file zstd behind the ``exporter.file.nativeCompression`` gate, none; with
  rotation) writes dumps that ``replay`` reads with the verdicts of the live run.
- Processor mode: Collector -> ``serve`` forwarding -> a second Collector -> a file: every
  span arrives unchanged but for ``durable.violation.rules``, under load, with the
  downstream Collector restarted once.
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator

from processor.receive.forward import VIOLATION_RULES_ATTRIBUTE
from tests.collector_support import LOADBALANCING, Collector, build_collector, shipped_routing
from tests.durable_support import REPO, ServeProcess, serve_settings, session_steps, write_config
from tests.pg_support import fresh_database, pg_server
from tests.serve_support import Key, keys_of, read_jsonl, running, serve_config
from tests.servers import free_port, wait_until

__all__ = ["pg_server"]  # the fixture, used by name

_MS = 1_000_000
SESSIONS = 12
TRACES = 3  # per session: a session's traces may route to different replicas
STEPS = 4  # per trace
PAUSE_S = 2.5  # between a session's traces: about the lease, so some handovers are refused first
LEASE = "2s"
SETTLE_S = 3.0


@pytest.fixture(scope="module")
def otelcol() -> Path:
    return build_collector()


class _SeededIds(IdGenerator):
    """The SDK's ids from a seed, so two runs of one workload name the same traces and spans."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def generate_span_id(self) -> int:
        return self._rng.getrandbits(64) | 1

    def generate_trace_id(self) -> int:
        return self._rng.getrandbits(128) | 1


def agent_traces(
    seed: int, sessions: int, traces: int, steps: int, *, waits: bool = True
) -> dict[str, list[list[ReadableSpan]]]:
    """Per session, its traces as the SDK ends them (children first, then the turn's root span).

    Every span names its session (spans inheriting it from their trace are another matter).
    Event times start now and follow the traces' sending pace.
    """
    rng = random.Random(seed)
    start_ns = time.time_ns()
    out: dict[str, list[list[ReadableSpan]]] = {}
    for s in range(sessions):
        session = f"col-{seed}-{s:03d}"
        memory = InMemorySpanExporter()
        provider = TracerProvider(resource=Resource.create({"service.name": "collector-test-agent"}),
                                  id_generator=_SeededIds(seed * 10_000 + s))
        provider.add_span_processor(SimpleSpanProcessor(memory))
        tracer = provider.get_tracer("durable-check-tests")
        steps_of_session = session_steps(rng, session, traces * steps)
        session_traces: list[list[ReadableSpan]] = []
        for k in range(traces):
            t0 = start_ns + int(k * PAUSE_S * 1e9) + s * _MS
            root = tracer.start_span(f"turn {k}", start_time=t0, attributes={"durable.session.id": session})
            context = trace.set_span_in_context(root)
            for n in range(steps):
                attributes = dict(steps_of_session[k * steps + n].attributes)
                if not waits and "durable.wait.timeout_s" in attributes:
                    attributes = {"durable.action.id": attributes["durable.action.id"],
                                  "durable.action.kind": "tool_call"}
                attributes["durable.session.id"] = session
                begin = t0 + (n + 1) * 40 * _MS
                child = tracer.start_span(f"step {k}.{n}", context=context, start_time=begin, attributes=attributes)
                child.end(end_time=begin + 10 * _MS)
            root.end(end_time=t0 + (steps + 1) * 40 * _MS)
            session_traces.append(list(memory.get_finished_spans()))
            memory.clear()
        provider.shutdown()
        out[session] = session_traces
    return out


def _export(endpoint: str, spans: Sequence[ReadableSpan]) -> None:
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=True, timeout=10)
    try:
        assert exporter.export(spans) == SpanExportResult.SUCCESS, f"the export to {endpoint} failed"
    finally:
        exporter.shutdown()


def send_rounds(
    endpoint: str, traces: dict[str, list[list[ReadableSpan]]], *, meanwhile: Any = None, delivered: Any = None
) -> None:
    """Trace k of every session, then a pause, then trace k+1: agents taking turns.

    ``meanwhile(k, i)`` runs after the i-th export of round k; ``delivered(n)`` waits until
    the first ``n`` spans have gone past the Collector (a turn follows the previous one).
    """
    sent = 0
    for k in range(TRACES):
        started = time.monotonic()
        for i, session in enumerate(sorted(traces)):
            _export(endpoint, traces[session][k])
            sent += len(traces[session][k])
            if meanwhile is not None:
                meanwhile(k, i)
        if delivered is not None:
            delivered(sent)
        if k < TRACES - 1:
            time.sleep(max(0.0, PAUSE_S - (time.monotonic() - started)))


# -- routing in front of two replicas on PostgreSQL -------------------------------------------------------

def _pg_state(url: str, replica: str) -> dict[str, Any]:
    return {"backend": "postgres", "postgres": {"dsn": url, "replica_id": replica, "lease_ttl": LEASE}}


def _replica(tmp: Path, name: str, url: str, port: int | None = None) -> ServeProcess:
    workdir = tmp / name
    workdir.mkdir(parents=True)
    port = port or free_port()
    config = write_config(workdir / "serve.yaml",
                          serve_settings(workdir, port, _pg_state(url, name), workdir / "violations.jsonl"))
    return ServeProcess(config, port, workdir / "serve.log")


@pytest.fixture(scope="module")
def one_replica(tmp_path_factory: pytest.TempPathFactory, pg_server: str) -> set[Key]:
    """The reference: the same agents' spans straight into one replica on PostgreSQL."""
    tmp = tmp_path_factory.mktemp("one-replica")
    solo = _replica(tmp, "solo", fresh_database(pg_server))
    solo.start()
    try:
        solo.wait_ready()
        send_rounds(f"127.0.0.1:{solo.grpc_port}", agent_traces(5, SESSIONS, TRACES, STEPS))
        time.sleep(SETTLE_S)
    finally:
        assert solo.stop() == 0, solo.log()
    found = read_jsonl(tmp / "solo" / "violations.jsonl")
    assert {d["rule"] for d in found} >= {"DS002", "DS107", "DS110"}, "the workload must exercise the rules"
    return keys_of(found)


def _routing_collector(otelcol: Path, tmp: Path, replicas: Sequence[ServeProcess]) -> Collector:
    collector = Collector(otelcol, tmp, name="routing", metrics_port=free_port())
    config = shipped_routing(collector, [f"127.0.0.1:{r.grpc_port}" for r in replicas])
    exporter = config["exporters"][LOADBALANCING]
    assert exporter["routing_key"] == "traceID"
    # The per-replica exporters: short retries, so a refused handover is retried soon, and no
    # queue of their own, so the exporter's sent count means delivered to a replica.
    exporter["protocol"]["otlp"]["retry_on_failure"] = {
        "enabled": True, "initial_interval": "100ms", "max_interval": "1s", "max_elapsed_time": "120s"}
    exporter["protocol"]["otlp"]["sending_queue"] = {"enabled": False}
    collector.start(config)
    return collector


def _delivered_by(collector: Collector) -> Any:
    def wait(count: int) -> None:
        wait_until(lambda: collector.sent_spans(LOADBALANCING) >= count, timeout_s=60.0,
                   what=f"{count} spans delivered to the replicas")
    return wait


def _union(tmp: Path, names: Sequence[str]) -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    files = {name: read_jsonl(tmp / name / "violations.jsonl") for name in names}
    for name, documents in files.items():
        twice = [v for v, n in Counter(d["violation_id"] for d in documents).items() if n > 1]
        assert not twice, f"{name} wrote {len(twice)} violation(s) twice"
    unique = {d["violation_id"]: d for documents in files.values() for d in documents}
    return list(unique.values()), files


def _outbox_counts(url: str) -> tuple[int, int]:
    import psycopg

    with psycopg.connect(url) as conn:
        recorded = conn.execute("SELECT count(*) FROM outbox").fetchone()
        pending = conn.execute("SELECT count(*) FROM outbox_pending").fetchone()
    assert recorded is not None and pending is not None
    return int(recorded[0]), int(pending[0])


def test_two_replicas_behind_the_collector_find_what_one_replica_finds(
    tmp_path: Path, otelcol: Path, pg_server: str, one_replica: set[Key]
) -> None:
    url = fresh_database(pg_server)
    replicas = [_replica(tmp_path, name, url) for name in ("r1", "r2")]
    for replica in replicas:
        replica.start()
    collector: Collector | None = None
    try:
        for replica in replicas:
            replica.wait_ready()
        collector = _routing_collector(otelcol, tmp_path, replicas)
        send_rounds(collector.endpoint, agent_traces(5, SESSIONS, TRACES, STEPS), delivered=_delivered_by(collector))
        time.sleep(SETTLE_S)
        assert collector.stop() == 0, collector.log()
        assert "Dropping data" not in collector.log()
    finally:
        if collector is not None:
            collector.stop()
        codes = [replica.stop() for replica in replicas]
    assert codes == [0, 0], "\n".join(r.log() for r in replicas)
    found, files = _union(tmp_path, ["r1", "r2"])
    assert keys_of(found) == one_replica
    sessions_of = [{d["session_id"] for d in files[name]} for name in ("r1", "r2")]
    assert sessions_of[0] & sessions_of[1], "some sessions' traces must have reached both replicas (handed over)"
    recorded, pending = _outbox_counts(url)
    assert (recorded, pending) == (len(found), 0), "each violation recorded once and delivered"


def test_a_replica_killed_behind_the_collector_loses_nothing(
    tmp_path: Path, otelcol: Path, pg_server: str, one_replica: set[Key]
) -> None:
    import psycopg

    url = fresh_database(pg_server)
    r1, r2 = _replica(tmp_path, "r1", url), _replica(tmp_path, "r2", url)
    replacement = _replica(tmp_path, "r3", url, port=r1.grpc_port)
    for replica in (r1, r2):
        replica.start()
    collector: Collector | None = None

    def r1_dies_mid_stream(k: int, i: int) -> None:
        if (k, i) != (1, SESSIONS // 2):
            return
        r1.kill()
        # r2 notices the missing heartbeat and adopts r1's sessions, journal, buffer and outbox ...
        def adopted() -> bool:
            with psycopg.connect(url) as conn:
                return conn.execute("SELECT 1 FROM replicas WHERE replica_id = 'r1'").fetchone() is None
        wait_until(adopted, timeout_s=20.0, what="r2 adopting r1's work")
        # ... and a new replica takes r1's address, as a replaced pod would: the Collector's
        # static list still names it, and whatever it held for r1 goes there.
        replacement.start()
        replacement.wait_ready()

    try:
        for replica in (r1, r2):
            replica.wait_ready()
        collector = _routing_collector(otelcol, tmp_path, [r1, r2])
        send_rounds(collector.endpoint, agent_traces(5, SESSIONS, TRACES, STEPS), meanwhile=r1_dies_mid_stream,
                    delivered=_delivered_by(collector))
        time.sleep(SETTLE_S)
        assert collector.stop() == 0, collector.log()
        log = (tmp_path / "routing.log").read_text(errors="replace")
        assert "Dropping data" not in log
    finally:
        if collector is not None:
            collector.stop()
        r1.kill()
        codes = [r2.stop(), replacement.stop()]
    assert r1.kills == 1
    assert codes == [0, 0], r2.log() + replacement.log()
    assert "replica r1 stopped renewing its lease" in r2.log(), "r2 must be the one that adopted r1's work"
    found, files = _union(tmp_path, ["r1", "r2", "r3"])
    assert files["r1"], "r1 must have found violations before it died"
    missing, extra = one_replica - keys_of(found), keys_of(found) - one_replica
    assert not missing and not extra, f"missing {sorted(missing)}, extra {sorted(extra)}\n{r2.log()}"
    recorded, pending = _outbox_counts(url)
    assert (recorded, pending) == (len(found), 0), "each violation recorded once and delivered"


# -- the file exporter's dumps, replayed --------------------------------------------------------------------

_DUMPS: dict[str, dict[str, Any]] = {
    "json": {},
    "proto": {"format": "proto"},
    "json-zstd": {"compression": "zstd"},
    "proto-zstd": {"format": "proto", "compression": "zstd"},
    "json-rotated": {"rotation": {"max_megabytes": 1, "max_backups": 20}},
}
# Written by a second Collector with the exporter.file.nativeCompression gate on: one zstd
# stream for the whole file instead of a frame per message.
_NATIVE_DUMPS: dict[str, dict[str, Any]] = {
    "json-zstd-native": {"compression": "zstd"},
    "proto-zstd-native": {"format": "proto", "compression": "zstd"},
}


def _replay_keys(paths: Sequence[Path]) -> set[Key]:
    done = subprocess.run(
        [sys.executable, "-m", "processor.cli", "replay", "--format", "json", *map(str, paths)],
        cwd=REPO, capture_output=True, timeout=120, check=False,
    )
    assert done.returncode in (0, 1), done.stderr.decode(errors="replace")
    report = orjson.loads(done.stdout)
    assert report["malformed"] == 0 and not report["unreadable"], report
    return {(v["rule"], v["session_id"], v["action_id"]) for v in report["violations"]}


def test_file_exporter_dumps_replay_with_the_live_verdicts(tmp_path: Path, otelcol: Path) -> None:
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    config = serve_config(tmp_path, {"evaluate": {"allowed_lateness": "2s"}})
    native = Collector(otelcol, tmp_path, name="native", flags=("--feature-gates=exporter.file.nativeCompression",))
    native_exporters: dict[str, Any] = {}
    for name, settings in _NATIVE_DUMPS.items():
        native_exporters[f"file/{name}"] = {"path": str(dumps / name / "traces.out"), **settings}
        (dumps / name).mkdir()
    native.start({"receivers": native.receiver(), "exporters": native_exporters, "service": {"pipelines": {
        "traces": {"receivers": ["otlp"], "exporters": list(native_exporters)}}}})
    try:
        with running(config) as server:
            collector = Collector(otelcol, tmp_path, name="dumping")
            exporters: dict[str, Any] = {
                "otlp/live": {"endpoint": f"127.0.0.1:{server.grpc_port}", "tls": {"insecure": True},
                              "sending_queue": {"num_consumers": 1}},
                "otlp/native": {"endpoint": native.endpoint, "tls": {"insecure": True}},
            }
            for name, settings in _DUMPS.items():
                exporters[f"file/{name}"] = {"path": str(dumps / name / "traces.out"), **settings}
                (dumps / name).mkdir()
            collector.start({
                "receivers": collector.receiver(),
                "processors": {"batch": {"timeout": "100ms"}},
                "exporters": exporters,
                "service": {"pipelines": {
                    "traces/live": {"receivers": ["otlp"], "processors": ["batch"], "exporters": ["otlp/live"]},
                    "traces/dumps": {"receivers": ["otlp"], "processors": ["batch"],
                                     "exporters": [*(f"file/{name}" for name in _DUMPS), "otlp/native"]},
                }},
            })
            try:
                traces = agent_traces(7, 48, 4, 16, waits=False)
                for k in range(4):
                    for session in sorted(traces):
                        _export(collector.endpoint, traces[session][k])
            finally:
                # SIGTERM drains the exporters' queues and flushes the files.
                assert collector.stop() == 0, collector.log()
    finally:
        assert native.stop() == 0, native.log()
    live = keys_of(read_jsonl(tmp_path / "violations.jsonl"))
    assert {rule for rule, _, _ in live} >= {"DS002", "DS110"}
    for name in [*_DUMPS, *_NATIVE_DUMPS]:
        files = sorted((dumps / name).iterdir())  # rotated backups (dated) sort before the current file
        head = files[0].read_bytes()[:8]
        if "native" in name:
            assert head[:4] == b"\x28\xb5\x2f\xfd", f"{name}: expected one zstd stream"
        elif "zstd" in name:
            assert head[4:8] == b"\x28\xb5\x2f\xfd", f"{name}: expected length-prefixed zstd messages"
        elif name.startswith("proto"):
            assert head[4:5] == b"\n", f"{name}: expected length-prefixed protobuf"
        else:
            assert head[:1] == b"{", f"{name}: expected OTLP/JSON lines"
        if "rotated" in name:
            assert len(files) >= 2, f"{name}: the dump must have rotated"
        assert _replay_keys(files) == live, f"replay of the {name} dump disagrees with the live run"


# -- processor mode: forwarding through a Collector that restarts ---------------------------------------------

def _frames(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    offset = 0
    while offset < len(data):
        size = int.from_bytes(data[offset:offset + 4], "big")
        yield data[offset + 4:offset + 4 + size]
        offset += 4 + size


def _span_key(span: trace_pb2.Span) -> tuple[bytes, bytes]:
    return bytes(span.trace_id), bytes(span.span_id)


def _flatten(
    requests: Sequence[trace_service_pb2.ExportTraceServiceRequest],
) -> list[tuple[Any, Any, trace_pb2.Span]]:
    """(resource, scope, span) of every span."""
    return [(rs.resource, ss.scope, span) for request in requests for rs in request.resource_spans
            for ss in rs.scope_spans for span in ss.spans]


def test_processor_mode_forwards_every_span_through_a_restarted_collector(tmp_path: Path, otelcol: Path) -> None:
    out = tmp_path / "downstream" / "traces.bin"
    out.parent.mkdir()
    downstream = Collector(otelcol, tmp_path, name="downstream")
    downstream_config = {
        "receivers": downstream.receiver(),
        "exporters": {"file/out": {"path": str(out), "format": "proto", "append": True}},
        "service": {"pipelines": {"traces": {"receivers": ["otlp"], "exporters": ["file/out"]}}},
    }
    downstream.start(downstream_config)
    upstream: Collector | None = None
    traces = agent_traces(9, 64, 4, 20, waits=False)
    batches = [traces[s][k] for k in range(4) for s in sorted(traces)]
    sent = [span for batch in batches for span in batch]
    try:
        config = serve_config(tmp_path, {"forward": {"endpoint": downstream.endpoint, "protocol": "grpc",
                                                     "insecure": True, "max_attempts": 10}})
        with running(config) as server:
            upstream = Collector(otelcol, tmp_path, name="upstream")
            upstream.start({
                "receivers": upstream.receiver(),
                "processors": {"batch": {"timeout": "100ms"}},
                "exporters": {"otlp/durable-check": {"endpoint": f"127.0.0.1:{server.grpc_port}",
                                                     "tls": {"insecure": True}}},
                "service": {"pipelines": {"traces": {"receivers": ["otlp"], "processors": ["batch"],
                                                     "exporters": ["otlp/durable-check"]}}},
            })
            errors: list[BaseException] = []
            exported = Counter[str]()
            lock = threading.Lock()

            def agent(endpoint: str, mine: Sequence[Sequence[ReadableSpan]]) -> None:
                try:
                    for batch in mine:
                        _export(endpoint, batch)
                        with lock:
                            exported["batches"] += 1
                except BaseException as exc:  # reported to the test thread
                    errors.append(exc)

            agents = [threading.Thread(target=agent, args=(upstream.endpoint, batches[i::4])) for i in range(4)]
            for thread in agents:
                thread.start()
            # The downstream Collector restarts once while the agents are still sending.
            wait_until(lambda: exported["batches"] >= len(batches) // 4, timeout_s=60.0, what="a quarter sent")
            assert downstream.stop() == 0, downstream.log()
            assert exported["batches"] < len(batches), "the restart must happen under load"
            downstream.start(downstream_config)
            for thread in agents:
                thread.join(120.0)
            assert not errors, f"an agent's export failed: {errors[0]!r}"
            assert upstream.stop() == 0, upstream.log()

            def received() -> int:
                return sum(len(_flatten([trace_service_pb2.ExportTraceServiceRequest.FromString(f)]))
                           for f in _frames(out)) if out.exists() else 0
            # The file exporter flushes every second; the forwarder's retries carry the outage.
            wait_until(lambda: received() >= len(sent), timeout_s=60.0, what="every span downstream")
    finally:
        if upstream is not None:
            upstream.stop()
        assert downstream.stop() == 0, downstream.log()
    forwarded = _flatten([trace_service_pb2.ExportTraceServiceRequest.FromString(f) for f in _frames(out)])
    keys = Counter(_span_key(span) for _, _, span in forwarded)
    assert not [k for k, n in keys.items() if n > 1], "a span arrived twice"
    original = {_span_key(span): (resource, scope, span) for resource, scope, span in _flatten([encode_spans(sent)])}
    assert set(keys) == set(original), f"{len(set(original) - set(keys))} span(s) never arrived"
    violations = read_jsonl(tmp_path / "violations.jsonl")
    rules_of: dict[tuple[bytes, bytes], set[str]] = {}
    for doc in violations:
        if doc.get("span_id"):
            key = (bytes.fromhex(doc["trace_id"]), bytes.fromhex(doc["span_id"]))
            rules_of.setdefault(key, set()).add(doc["rule"])
    annotated = 0
    for resource, scope, span in forwarded:
        want_resource, want_scope, want_span = original[_span_key(span)]
        assert (resource, scope) == (want_resource, want_scope)
        plain = trace_pb2.Span()
        plain.CopyFrom(span)
        kept = [kv for kv in plain.attributes if kv.key != VIOLATION_RULES_ATTRIBUTE]
        rules = [kv for kv in plain.attributes if kv.key == VIOLATION_RULES_ATTRIBUTE]
        del plain.attributes[:]
        plain.attributes.extend(kept)
        assert plain == want_span, "a forwarded span changed beyond the violation attribute"
        if rules:
            annotated += 1
            named = {v.string_value for v in rules[0].value.array_value.values}
            assert named and named <= rules_of.get(_span_key(span), set())
    assert annotated >= 50, "spans with violations known on arrival carry their rule ids"
