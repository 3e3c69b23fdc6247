"""The first tier of the two-tier topology: spans regrouped per session, the session on their resource.

Sessions spread over several traces whose children name no session and end (and are
exported) before the root that names it, traces interleaved across requests of random
sizes: after the splitter, spans split by their resource's session over several
evaluators give, together, what ``replay`` gives on the spans as they were sent, and no
finding comes out of two evaluators.
"""

from __future__ import annotations

import contextlib
import copy
import random
import sqlite3
import subprocess
import sys
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest
import yaml
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from processor.convert.spans import SpanConverter
from processor.route.by_session import ROUTING_ATTRIBUTE, SessionSplitter
from tests.collector_support import REPO, Collector, build_collector
from tests.durable_support import ServeProcess, serve_settings, write_config
from tests.route_support import NS as _NS
from tests.route_support import (
    assert_evaluators_agree_with_replay,
    interleaved,
    later_span,
    requests_of,
    session_of,
    session_traces,
    spans_in,
)
from tests.serve_support import Key, replay_keys, serve_config
from tests.servers import free_port, wait_until

LATENESS_NS = 2 * _NS
BY_SESSION_CONFIG = REPO / "config" / "otel-collector-by-session.yaml"
BY_SESSION = "loadbalancing/by-session"


def through_splitter(requests: Sequence[Any], lateness_ns: int = LATENESS_NS) -> list[list[Any]]:
    """What the first tier sends on for each request (and, last, what it held to the end)."""
    splitter = SessionSplitter(SpanConverter(), lateness_ns)
    out = [splitter.admit(request, 0) for request in requests]
    out.append(splitter.release_all())
    assert splitter.held_spans == 0
    return out


def split_over(requests: Sequence[Any], evaluators: int) -> list[list[Any]]:
    """Through the splitter, then each ResourceSpans to the evaluator its session hashes to."""
    routed: list[list[Any]] = [[] for _ in range(evaluators)]

    def send(resource_spans: list[Any]) -> None:
        parts: list[list[Any]] = [[] for _ in range(evaluators)]
        for unit in resource_spans:
            parts[zlib.crc32(session_of(unit).encode()) % evaluators].append(unit)
        for index, part in enumerate(parts):
            if part:
                routed[index].append(trace_service_pb2.ExportTraceServiceRequest(resource_spans=part))

    for resource_spans in through_splitter(requests):
        send(resource_spans)
    return routed


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_evaluators_fed_by_session_find_together_what_replay_finds(seed: int, tmp_path: Path) -> None:
    config = serve_config(tmp_path, {"evaluate": {"allowed_lateness": "2s"}})
    rng = random.Random(seed)
    traces = session_traces(seed, sessions=8, traces=3, steps=3)
    requests = requests_of(rng, interleaved(rng, traces))
    reference = replay_keys(requests, config)
    assert {rule for rule, _, _ in reference} >= {"DS002", "DS110"}, "the workload must exercise the rules"

    routed = split_over(requests, evaluators=3)
    assert sum(spans_in(part) for part in routed) == spans_in(requests), "every span goes on once"
    found = [replay_keys(part, config) for part in routed]
    union: set[Key] = set().union(*found)
    assert union == reference, f"missing {sorted(reference - union)}, extra {sorted(union - reference)}"
    assert sum(len(keys) for keys in found) == len(union), "a finding came out of two evaluators"
    sessions = [{session for _, session, _ in keys} for keys in found]
    assert sum(1 for s in sessions if s) >= 2, "the sessions must spread over the evaluators"

    # The same evaluators fed by trace id (what the first tier's Collector does) split sessions:
    # the workload is one where routing matters.
    by_trace = [replay_keys(part, config) for part in split_by_trace(requests, evaluators=3)]
    assert set().union(*by_trace) != reference


def split_by_trace(requests: Sequence[Any], evaluators: int) -> list[list[Any]]:
    routed: list[list[Any]] = [[] for _ in range(evaluators)]
    for request in requests:
        for unit in request.resource_spans:
            for scope in unit.scope_spans:
                for span in scope.spans:
                    part = trace_service_pb2.ExportTraceServiceRequest()
                    target = part.resource_spans.add(resource=unit.resource).scope_spans.add(scope=scope.scope)
                    target.spans.append(span)
                    routed[zlib.crc32(bytes(span.trace_id)) % evaluators].append(part)
    return routed


def test_a_held_span_goes_on_with_its_session_once_the_root_arrives() -> None:
    traces = session_traces(7, sessions=1, traces=1, steps=2)
    children, root = traces[0][:-1], traces[0][-1]
    splitter = SessionSplitter(SpanConverter(), LATENESS_NS)
    assert splitter.admit(encode_spans(children), 0) == []
    assert splitter.held_spans == 2
    out = splitter.admit(encode_spans([root]), 0)
    assert [session_of(rs) for rs in out] == ["route-7-00"]
    assert sum(len(ss.spans) for ss in out[0].scope_spans) == 3
    assert splitter.held_spans == 0


def test_a_trace_that_never_names_its_session_goes_on_as_its_own_session_after_the_lateness() -> None:
    traces = session_traces(8, sessions=1, traces=1, steps=2)
    children = traces[0][:-1]
    splitter = SessionSplitter(SpanConverter(), LATENESS_NS)
    assert splitter.admit(encode_spans(children), 10 * _NS) == []
    assert splitter.release_due(10 * _NS + LATENESS_NS - 1) == []
    out = splitter.release_due(10 * _NS + LATENESS_NS)
    trace_id = format(children[0].context.trace_id, "032x")
    assert [session_of(rs) for rs in out] == [trace_id]


# -- the second hop: a real Collector routing by the resource's session to evaluators on SQLite ----------

EVALUATORS = 3
# Workloads sent one after the other through one topology (more were run by hand: docs/scaling.md).
COLLECTOR_SEEDS = (11, 12)


@pytest.fixture(scope="module")
def otelcol() -> Path:
    return build_collector()


def sessions_held(state: Path) -> int:
    """Sessions a replica's SQLite state holds (read-only, beside the replica's own writes)."""
    with contextlib.closing(sqlite3.connect(f"file:{state}?mode=ro", uri=True, timeout=5.0)) as db:
        row = db.execute("SELECT count(*) FROM sessions").fetchone()
    return int(row[0])


def delivered(collector: Collector, count: int) -> None:
    wait_until(lambda: collector.sent_spans(BY_SESSION) >= count, timeout_s=60.0, what=f"{count} spans delivered")


def _by_session_collector(otelcol: Path, tmp: Path, replicas: Sequence[ServeProcess]) -> Collector:
    """The second hop as config/otel-collector-by-session.yaml ships it, a static resolver naming local replicas."""
    collector = Collector(otelcol, tmp, name="by-session", metrics_port=free_port())
    shipped = yaml.safe_load(BY_SESSION_CONFIG.read_text(encoding="utf-8"))
    exporter = copy.deepcopy(shipped["exporters"][BY_SESSION])
    assert exporter["routing_key"] == "attributes" and exporter["routing_attributes"] == [ROUTING_ATTRIBUTE]
    exporter["resolver"] = {"static": {"hostnames": [f"127.0.0.1:{r.grpc_port}" for r in replicas]}}
    exporter["protocol"]["otlp"]["retry_on_failure"] = {
        "enabled": True, "initial_interval": "100ms", "max_interval": "1s", "max_elapsed_time": "60s"}
    exporter["protocol"]["otlp"]["sending_queue"] = {"enabled": False}
    collector.start({
        "receivers": collector.receiver(),
        "exporters": {BY_SESSION: exporter},
        "service": {"pipelines": {"traces": {"receivers": ["otlp"], "exporters": [BY_SESSION]}}},
    })
    return collector


@pytest.mark.slow
@pytest.mark.parametrize("kill", [False, True], ids=["steady", "evaluator-killed"])
def test_a_real_collector_routing_by_the_resource_session_gives_each_session_to_one_evaluator(
    tmp_path: Path, otelcol: Path, kill: bool
) -> None:
    """The splitter's output through the Collector's loadbalancing exporter (routing_key: attributes)
    to three ``serve`` replicas with embedded SQLite state: together they find what replay finds,
    each session at one replica, nothing written twice; two seeds, one after the other.

    With ``kill``: one replica is SIGKILLed halfway through the first seed and started again at
    its address; the Collector holds and retries what routes to it meanwhile, and the replica
    resumes from its own state (journal, reordering buffer, outbox). Its spans wait in its
    reordering window by the wall clock: a span that reaches it after a downtime longer than
    ``allowed_lateness`` is late there (evaluated at once, out of order), so this case allows
    5 s for a restart of about 2 s (the steady case, 2 s)."""
    lateness_s = 5 if kill else 2
    settings: dict[str, Any] = {"evaluate": {"tick_interval": "50ms", "allowed_lateness": f"{lateness_s}s"}}
    config = serve_config(tmp_path, settings)
    replicas = []
    for n in range(EVALUATORS):
        workdir = tmp_path / f"e{n}"
        workdir.mkdir()
        port = free_port()
        document = serve_settings(workdir, port, {"backend": "sqlite", "path": str(workdir / "state.db")},
                                  workdir / "violations.jsonl")
        document["evaluate"] = settings["evaluate"]
        replicas.append(ServeProcess(write_config(workdir / "serve.yaml", document), port, workdir / "serve.log"))
    for replica in replicas:
        replica.start()
    collector: Collector | None = None
    references: dict[int, set[Key]] = {}
    later_ns = 0
    try:
        for replica in replicas:
            replica.wait_ready()
        collector = _by_session_collector(otelcol, tmp_path, replicas)
        sent = 0
        with grpc.insecure_channel(collector.endpoint) as channel:
            stub = trace_service_pb2_grpc.TraceServiceStub(channel)  # type: ignore[no-untyped-call]
            for seed in COLLECTOR_SEEDS:
                rng = random.Random(seed)
                # After the previous seed's later span: what a replica receives stays in event-time order.
                start_ns = max(time.time_ns(), later_ns + _NS)
                time.sleep(max(0.0, (start_ns - time.time_ns()) / _NS))
                traces = session_traces(seed, sessions=8, traces=3, steps=3, start_ns=start_ns)
                requests = requests_of(rng, interleaved(rng, traces))
                # Agents keep working after these sessions: event time passes their waits' deadlines,
                # so replay decides the waits as the replicas' clocks do.
                # Past the last wait's deadline (about 2 s in) and the lateness.
                later_ns = start_ns + (3 + lateness_s) * _NS
                later = later_span(seed, later_ns)
                references[seed] = replay_keys([*requests, later], config)
                for stage, part in enumerate(([*requests], [later])):
                    outputs = through_splitter(part, lateness_ns=lateness_s * _NS)
                    for index, resource_spans in enumerate(outputs):
                        if kill and (seed, stage, index) == (COLLECTOR_SEEDS[0], 0, len(outputs) // 2):
                            delivered(collector, sent + sum(len(ss.spans) for batch in outputs[:index]
                                                           for rs in batch for ss in rs.scope_spans))
                            held = [sessions_held(tmp_path / f"e{n}" / "state.db") for n in range(EVALUATORS)]
                            killed = replicas[held.index(max(held))]
                            assert max(held) > 0
                            killed.kill()
                            killed.start()
                            killed.wait_ready()
                        if resource_spans:
                            stub.Export(trace_service_pb2.ExportTraceServiceRequest(resource_spans=resource_spans),
                                        timeout=10.0)
                    sent += spans_in(part)
                    delivered(collector, sent)
        assert collector is not None
        time.sleep(lateness_s + 2.0)  # the replicas' reordering window and the waits' deadlines pass
        assert collector.stop() == 0, collector.log()
        assert "Dropping data" not in collector.log()
    finally:
        if collector is not None:
            collector.stop()
        codes = [replica.stop() for replica in replicas]
    assert codes == [0] * EVALUATORS, "\n".join(r.log() for r in replicas)
    assert sum(replica.kills for replica in replicas) == (1 if kill else 0)
    assert_evaluators_agree_with_replay([tmp_path / f"e{n}" / "violations.jsonl" for n in range(EVALUATORS)],
                                        references)


# -- the benchmarks run end to end at a tiny size (no timing asserted) --------------------------------------

def test_the_first_tiers_benchmark_runs(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "bench/bench_route.py", "3000"], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "splitter (convert, resolve, regroup, encode)" in done.stdout and "3,000 spans" in done.stdout


@pytest.mark.slow
def test_the_two_tier_latency_benchmark_finds_every_run(otelcol: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "bench.route_latency", "--runs", "30", "--rate", "30"], cwd=REPO,
                          capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "findings 30 " in done.stdout and "send to finding: median" in done.stdout


def test_a_span_delivered_twice_while_held_goes_on_twice_with_its_session(tmp_path: Path) -> None:
    """A redelivery is not the splitter's to drop: both copies go on, and the evaluator that gets
    them counts the span once, as replay of the same requests does."""
    config = serve_config(tmp_path, {"evaluate": {"allowed_lateness": "2s"}})
    traces = session_traces(9, sessions=1, traces=1, steps=2)
    children, root = traces[0][:-1], traces[0][-1]
    requests = [encode_spans(children), encode_spans(children), encode_spans([root])]
    splitter = SessionSplitter(SpanConverter(), LATENESS_NS)
    assert splitter.admit(requests[0], 0) == [] and splitter.admit(requests[1], 0) == []
    out = splitter.admit(requests[2], 0)
    assert [session_of(rs) for rs in out] == ["route-9-00"]
    assert sum(len(ss.spans) for ss in out[0].scope_spans) == 5
    routed = [trace_service_pb2.ExportTraceServiceRequest(resource_spans=out)]
    assert replay_keys(routed, config) == replay_keys(requests, config)


def test_a_rejected_span_goes_on_at_once_and_is_rejected_where_it_lands(tmp_path: Path) -> None:
    config = serve_config(tmp_path, {"evaluate": {"allowed_lateness": "2s"}})
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("durable-check-tests")
    with tracer.start_as_current_span("run", attributes={"gen_ai.conversation.id": "conv-bad"}):
        tracer.start_span("step", attributes={"durable.action.kind": "tool_call",
                                              "durable.retry.attempt": "three"}).end()
    provider.shutdown()
    request = encode_spans(memory.get_finished_spans())
    assert SpanConverter().convert(request).rejected, "the span must be one the converter rejects"
    splitter = SessionSplitter(SpanConverter(), LATENESS_NS)
    out = splitter.admit(request, 0) + splitter.release_all()
    assert sum(len(ss.spans) for rs in out for ss in rs.scope_spans) == 2
    routed = [trace_service_pb2.ExportTraceServiceRequest(resource_spans=out)]
    assert replay_keys(routed, config) == replay_keys([request], config)
    assert any(rule == "DS000" for rule, _, _ in replay_keys([request], config))


@pytest.mark.parametrize("seed", [5, 6])
def test_a_splitter_read_back_from_its_plain_state_goes_on_as_the_one_it_was(seed: int) -> None:
    """What a restart would keep: cut the stream anywhere, write the splitter's state as JSON, read
    it back into a new splitter and go on; what it sends on is what an uninterrupted one sends."""
    rng = random.Random(seed)
    requests = requests_of(rng, interleaved(rng, session_traces(seed, sessions=6, traces=3, steps=3)))
    whole = through_splitter(requests)
    for cut in rng.sample(range(1, len(requests)), 3):
        first = SessionSplitter(SpanConverter(), LATENESS_NS)
        out = [first.admit(request, 0) for request in requests[:cut]]
        assert first.held_spans, "cut where spans are held, or nothing is read back"
        plain = orjson.loads(orjson.dumps(first.to_plain()))
        second = SessionSplitter.from_plain(SpanConverter(), LATENESS_NS, plain)
        out += [second.admit(request, 0) for request in requests[cut:]]
        out.append(second.release_all())
        assert [[rs.SerializeToString() for rs in batch] for batch in out] == \
            [[rs.SerializeToString() for rs in batch] for batch in whole]
