"""The first tier as a process (serve with ``route.endpoint``), and the whole two-tier topology.

Agents → the Collector (``config/otel-collector-two-tier.yaml``: by trace id) → first-tier
``serve`` replicas (journal, identity stage, session on the resource) → the same Collector's
second pipeline (by the resource's session) → evaluator ``serve`` replicas with embedded
SQLite state. Sessions span several traces, children are exported before the root that names
the session, traces interleave across requests of random sizes. Whatever replica a trace
reaches, the evaluators together find what ``replay`` finds on the spans as sent, each session
at one evaluator, no violation written twice; also with a first-tier replica SIGKILLed
halfway and started again at its address.
"""

from __future__ import annotations

import contextlib
import copy
import os
import random
import sqlite3
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest
import yaml
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from processor.config import parse_config
from processor.errors import ConfigError
from processor.route.first_tier import RouteServer
from processor.serve import ServerThread
from processor.state.sqlite import SqliteStore
from processor.telemetry import Telemetry
from tests.collector_support import REPO, Collector, build_collector
from tests.durable_support import ServeProcess, serve_settings, write_config
from tests.pg_support import fresh_database, pg_server
from tests.route_support import (
    NS,
    assert_evaluators_agree_with_replay,
    interleaved,
    later_span,
    requests_of,
    session_traces,
    spans_in,
)
from tests.serve_support import Key, keys_of, read_jsonl, replay_keys, running, serve_config, wait_for
from tests.servers import free_port, wait_until

TWO_TIER_CONFIG = REPO / "config" / "otel-collector-two-tier.yaml"
BY_TRACE = "loadbalancing/by-trace"
BY_SESSION = "loadbalancing/by-session"


def first_tier_document(workdir: Path, grpc_port: int, downstream: str, lateness: str,
                        max_batch_spans: int = 2048) -> dict[str, Any]:
    return {
        "receivers": {"otlp": {"grpc": {"endpoint": f"127.0.0.1:{grpc_port}"}, "http": {"endpoint": ""}}},
        "evaluate": {"tick_interval": "50ms", "allowed_lateness": lateness},
        "state": {"backend": "sqlite", "path": str(workdir / "first-tier.db")},
        "route": {"endpoint": downstream, "insecure": True, "checkpoint_interval": "200ms",
                  "initial_backoff": "100ms", "max_backoff": "1s", "max_batch_spans": max_batch_spans},
    }


# -- one first tier in process, in front of a real evaluator ----------------------------------------------

@contextlib.contextmanager
def first_tier(tmp_path: Path, downstream: str, lateness: str = "2s", max_batch_spans: int = 2048,
               ) -> Iterator[RouteServer]:
    document = first_tier_document(tmp_path, 0, downstream, lateness, max_batch_spans)
    config = parse_config(yaml.safe_dump(document), "first tier")
    telemetry = Telemetry()
    store = SqliteStore(config.state.path)
    with ServerThread(RouteServer(config, telemetry, store)) as server:
        yield server


def export(port: int, requests: Sequence[Any]) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = trace_service_pb2_grpc.TraceServiceStub(channel)  # type: ignore[no-untyped-call]
        for request in requests:
            stub.Export(request, timeout=10.0)


def test_the_first_tier_gives_the_evaluator_whole_sessions_and_retries_while_it_is_down(tmp_path: Path) -> None:
    """The evaluator is not there yet: the first tier still acknowledges (its journal holds the spans),
    retries with backoff, and once the evaluator listens it gets every span with its session: it finds
    what replay finds, without a session of a trace's id."""
    seed = 21
    rng = random.Random(seed)
    requests = requests_of(rng, interleaved(rng, session_traces(seed, sessions=5, traces=3, steps=3)))
    port = free_port()
    config = serve_config(tmp_path / "evaluator", {
        "receivers": {"otlp": {"grpc": {"endpoint": f"127.0.0.1:{port}"}}},
        "evaluate": {"allowed_lateness": "2s"},
    })
    (tmp_path / "evaluator").mkdir()
    (tmp_path / "tier").mkdir()
    reference = replay_keys(requests, config)
    # Small requests downstream: what the first tier sends on is cut at max_batch_spans.
    with first_tier(tmp_path / "tier", f"127.0.0.1:{port}", max_batch_spans=5) as tier:
        export(tier.grpc_port, requests)
        assert tier.worker.stats.journaled == len(requests)
        # Nothing has gone on: the downstream refuses connections, and the spans wait in the journal.
        assert wait_for(lambda: (tier.telemetry.registry.get_sample_value(
            "durable_check_route_send_failures_total") or 0) > 0)
        assert tier.worker.stats.sent_spans == 0
        with running(config) as evaluator:
            assert wait_for(lambda: tier.worker.stats.sent_spans >= spans_in(requests), timeout_s=30.0)
            assert wait_for(lambda: evaluator.worker.processed_spans >= spans_in(requests), timeout_s=30.0)
    found = keys_of(read_jsonl(tmp_path / "evaluator" / "violations.jsonl"))
    assert found == reference, f"missing {sorted(reference - found)}, extra {sorted(found - reference)}"
    assert {session for _, session, _ in found} <= {f"route-{seed}-{s:02d}" for s in range(5)}


def test_what_waits_for_its_session_at_a_stop_goes_on_after_the_restart(tmp_path: Path) -> None:
    """A payment span held for its root at a clean stop is in the checkpoint; the root arriving after
    the restart sends it on with its session, and the evaluator reports it there."""
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("durable-check-tests")
    payment = {"durable.action.id": "pay-1", "durable.action.kind": "payment"}
    with (tracer.start_as_current_span("turn", attributes={"gen_ai.conversation.id": "conv-held"}),
          tracer.start_as_current_span("charge card", attributes=payment)):
        pass
    provider.shutdown()
    child, root = memory.get_finished_spans()
    port = free_port()
    config = serve_config(tmp_path / "evaluator", {"receivers": {"otlp": {"grpc": {"endpoint": f"127.0.0.1:{port}"}}}})
    (tmp_path / "evaluator").mkdir()
    (tmp_path / "tier").mkdir()
    with running(config) as evaluator:
        with first_tier(tmp_path / "tier", f"127.0.0.1:{port}", lateness="30s") as tier:
            export(tier.grpc_port, [encode_spans([child])])
            assert wait_for(lambda: tier.worker.held_spans == 1)
        with first_tier(tmp_path / "tier", f"127.0.0.1:{port}", lateness="30s") as tier:
            assert tier.worker.held_spans == 1
            export(tier.grpc_port, [encode_spans([root])])
            assert wait_for(lambda: tier.worker.stats.sent_spans == 2)
        assert wait_for(lambda: evaluator.worker.processed_spans == 2)
    found = keys_of(read_jsonl(tmp_path / "evaluator" / "violations.jsonl"))
    assert found == {("DS002", "conv-held", "pay-1")}


def test_spans_whose_trace_never_names_a_session_go_on_once_and_are_not_held_after_a_restart(
        tmp_path: Path) -> None:
    """Released by the clock (after allowed_lateness, with the trace id as session), not by an
    admission: the next checkpoint records it, so a restart neither holds nor re-sends them."""
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    provider.get_tracer("durable-check-tests").start_span(
        "charge card", attributes={"durable.action.id": "pay-9", "durable.action.kind": "payment"}).end()
    provider.shutdown()
    (span,) = memory.get_finished_spans()
    port = free_port()
    config = serve_config(tmp_path / "evaluator", {"receivers": {"otlp": {"grpc": {"endpoint": f"127.0.0.1:{port}"}}}})
    (tmp_path / "evaluator").mkdir()
    (tmp_path / "tier").mkdir()
    with running(config) as evaluator:
        with first_tier(tmp_path / "tier", f"127.0.0.1:{port}", lateness="500ms") as tier:
            export(tier.grpc_port, [encode_spans([span])])
            assert wait_for(lambda: tier.worker.stats.sent_spans == 1)
            assert tier.worker.held_spans == 0
        with first_tier(tmp_path / "tier", f"127.0.0.1:{port}", lateness="500ms") as tier:
            assert tier.worker.held_spans == 0
            assert tier.worker.stats.resumed_entries == 0
            time.sleep(1.0)
            assert tier.worker.stats.sent_spans == 0
        assert wait_for(lambda: evaluator.worker.processed_spans == 1)
    trace_id = format(span.context.trace_id, "032x")
    found = keys_of(read_jsonl(tmp_path / "evaluator" / "violations.jsonl"))
    assert found == {("DS002", trace_id, "pay-9")}


def test_first_tier_settings_that_cannot_work_are_named() -> None:
    document = {
        "route": {"endpoint": "127.0.0.1:4317", "checkpoint_interval": "0s"},
        "state": {"backend": "memory"},
        "ui": {"endpoint": "127.0.0.1:4319"},
        "exporters": {"jsonl": {"path": "violations.jsonl"}},
        "forward": {"endpoint": "127.0.0.1:4999"},
    }
    with pytest.raises(ConfigError) as caught:
        parse_config(yaml.safe_dump(document), "tier.yaml")
    named = {problem.where for problem in caught.value.problems}
    assert {"route.checkpoint_interval", "state.backend", "ui.endpoint", "exporters.jsonl.path",
            "forward.endpoint"} <= named


# -- the whole topology with the real Collector ---------------------------------------------------------

FIRST_TIERS = 2
EVALUATORS = 3
# Workloads sent one after the other through one topology; other seeds by hand (docs/scaling.md):
# DURABLE_CHECK_TWO_TIER_SEEDS=41,42 python -m pytest tests/test_first_tier.py
__all__ = ["pg_server"]  # the fixture, used by name
SEEDS = tuple(int(seed) for seed in os.environ.get("DURABLE_CHECK_TWO_TIER_SEEDS", "31,32").split(","))


@pytest.fixture(scope="module")
def otelcol() -> Path:
    return build_collector()


def two_tier_collector(otelcol: Path, tmp: Path, sessions_port: int, first_tiers: Sequence[ServeProcess],
                       evaluators: Sequence[ServeProcess]) -> Collector:
    collector = Collector(otelcol, tmp, name="two-tier", metrics_port=free_port())
    collector.start(two_tier_document(collector, sessions_port, first_tiers, evaluators))
    return collector


def two_tier_document(collector: Collector, sessions_port: int, first_tiers: Sequence[ServeProcess],
                      evaluators: Sequence[ServeProcess]) -> dict[str, Any]:
    """config/otel-collector-two-tier.yaml as shipped, but for local addresses (static resolvers), short
    retry intervals and no queue on the second hop."""
    shipped = yaml.safe_load(TWO_TIER_CONFIG.read_text(encoding="utf-8"))
    document = copy.deepcopy(shipped)
    document["receivers"]["otlp"]["protocols"] = {"grpc": {"endpoint": collector.endpoint}}
    document["receivers"]["otlp/sessions"]["protocols"]["grpc"]["endpoint"] = f"127.0.0.1:{sessions_port}"
    for name, targets in ((BY_TRACE, first_tiers), (BY_SESSION, evaluators)):
        exporter = document["exporters"][name]
        exporter["resolver"] = {"static": {"hostnames": [f"127.0.0.1:{t.grpc_port}" for t in targets]}}
        # The exporter to each replica retries on its own (first at 5 s by default): a restarted replica
        # gets its traffic again within 1 s here.
        exporter["protocol"]["otlp"]["retry_on_failure"] = {
            "enabled": True, "initial_interval": "100ms", "max_interval": "1s", "max_elapsed_time": "60s"}
        exporter["protocol"]["otlp"]["sending_queue"] = {"enabled": False}
    # No queue on the second hop: the first tier's send returns once an evaluator has the spans, so an
    # idle first tier means that everything it took is at an evaluator (first_tier_idle).
    document["exporters"][BY_SESSION]["sending_queue"] = {"enabled": False}
    assert document["exporters"][BY_TRACE]["routing_key"] == "traceID"
    assert document["exporters"][BY_SESSION]["routing_attributes"] == ["durable.session.id"]
    return document


def through_first_hop(collector: Collector, spans: int) -> None:
    """The Collector (since it started) delivered ``spans`` spans to the first tier."""
    wait_until(lambda: collector.sent_spans(BY_TRACE) >= spans, timeout_s=60.0, what=f"{spans} spans to the first tier")


def first_tier_idle(database: Path) -> bool:
    """Nothing journaled that is not yet sent on, nothing waiting for its session (read beside the
    replica's own writes): everything it took has reached an evaluator, the Collector's second hop
    having no queue."""
    with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=5.0)) as db:
        journaled = int(db.execute("SELECT count(*) FROM journal").fetchone()[0])
        row = db.execute("SELECT value FROM meta WHERE key = 'route.splitter'").fetchone()
    return journaled == 0 and row is not None and not orjson.loads(row[0])["waiting"]


def through_both_hops(collector: Collector, spans: int, first_tiers: Sequence[Path]) -> None:
    """Every span sent so far is at an evaluator: taken by a first tier, then sent on by it."""
    through_first_hop(collector, spans)
    wait_until(lambda: all(first_tier_idle(database) for database in first_tiers), timeout_s=60.0,
               what="the first tiers sending on all they took")


def workload(seed: int, sessions: int, after_ns: int, lateness_s: int) -> tuple[list[Any], Any, int]:
    """One workload of ``sessions`` sessions of three traces, starting now and after ``after_ns``: its
    requests (children before roots, traces interleaved, 1 to 12 spans a request), then a later span of
    an agent still working, whose event time passes the waits' deadlines, and that span's time."""
    rng = random.Random(seed)
    start_ns = max(time.time_ns(), after_ns + NS)
    time.sleep(max(0.0, (start_ns - time.time_ns()) / NS))
    requests = requests_of(rng, interleaved(rng, session_traces(seed, sessions=sessions, traces=3, steps=3,
                                                                start_ns=start_ns)))
    later_ns = start_ns + (3 + lateness_s) * NS
    return requests, later_span(seed, later_ns), later_ns


def send_later(stub: Any, later: Any, collector: Collector, sent: int, databases: Sequence[Path]) -> int:
    """The workload's later span, once all sent before it is at an evaluator, then delivered too; the
    spans sent through this Collector. The later span names its session: it must not overtake the
    workload's spans, which its event time would make late at their evaluator (one watermark per
    evaluator)."""
    through_both_hops(collector, sent, databases)
    stub.Export(later, timeout=10.0)
    sent += spans_in([later])
    through_both_hops(collector, sent, databases)
    return sent


def topology(tmp_path: Path, evaluate: dict[str, str], states: Sequence[dict[str, Any]],
             ) -> tuple[list[ServeProcess], list[ServeProcess], list[Path], int]:
    """Evaluator serves (one per state setting, in e0, e1, ...) and FIRST_TIERS first tiers sending to the
    Collector's second pipeline, all started: (evaluators, first tiers, their databases, that pipeline's port)."""
    sessions_port = free_port()
    evaluators, first_tiers = [], []
    for n, state in enumerate(states):
        workdir = tmp_path / f"e{n}"
        workdir.mkdir()
        port = free_port()
        document = serve_settings(workdir, port, state, workdir / "violations.jsonl")
        document["evaluate"] = evaluate
        evaluators.append(ServeProcess(write_config(workdir / "serve.yaml", document), port, workdir / "serve.log"))
    for n in range(FIRST_TIERS):
        workdir = tmp_path / f"t{n}"
        workdir.mkdir()
        port = free_port()
        document = first_tier_document(workdir, port, f"127.0.0.1:{sessions_port}", evaluate["allowed_lateness"])
        first_tiers.append(ServeProcess(write_config(workdir / "serve.yaml", document), port, workdir / "serve.log"))
    databases = [tmp_path / f"t{n}" / "first-tier.db" for n in range(FIRST_TIERS)]
    for process in [*evaluators, *first_tiers]:
        process.start()
    return evaluators, first_tiers, databases, sessions_port


@pytest.mark.slow
@pytest.mark.parametrize("kill", [False, True], ids=["steady", "first-tier-killed"])
def test_two_tiers_behind_the_real_collector_find_what_replay_finds(tmp_path: Path, otelcol: Path,
                                                                     kill: bool) -> None:
    lateness_s = 5 if kill else 2
    evaluate = {"tick_interval": "50ms", "allowed_lateness": f"{lateness_s}s"}
    config = serve_config(tmp_path, {"evaluate": evaluate})
    evaluators, first_tiers, databases, sessions_port = topology(
        tmp_path, evaluate, [{"backend": "sqlite", "path": str(tmp_path / f"e{n}" / "state.db")}
                             for n in range(EVALUATORS)])
    collector: Collector | None = None
    references: dict[int, set[Key]] = {}
    later_ns = 0
    try:
        for process in [*evaluators, *first_tiers]:
            process.wait_ready()
        collector = two_tier_collector(otelcol, tmp_path, sessions_port, first_tiers, evaluators)
        sent = 0
        with grpc.insecure_channel(collector.endpoint) as channel:
            stub = trace_service_pb2_grpc.TraceServiceStub(channel)  # type: ignore[no-untyped-call]
            for seed in SEEDS:
                requests, later, later_ns = workload(seed, 8, later_ns, lateness_s)
                references[seed] = replay_keys([*requests, later], config)
                for index, request in enumerate(requests):
                    if kill and seed == SEEDS[0] and index == len(requests) // 2:
                        # Whatever the first tier acknowledged so far is in its journal or already on.
                        through_first_hop(collector, sent)
                        first_tiers[0].kill()
                        first_tiers[0].start()
                        first_tiers[0].wait_ready()
                    stub.Export(request, timeout=10.0)
                    sent += spans_in([request])
                sent = send_later(stub, later, collector, sent, databases)
        time.sleep(lateness_s + 2.0)  # the evaluators' reordering window and the waits' deadlines pass
        assert collector.stop() == 0, collector.log()
        assert "Dropping data" not in collector.log()
    finally:
        if collector is not None:
            collector.stop()
        codes = [process.stop() for process in [*first_tiers, *evaluators]]
    assert codes == [0] * (FIRST_TIERS + EVALUATORS), "\n".join(p.log() for p in [*first_tiers, *evaluators])
    assert sum(p.kills for p in first_tiers) == (1 if kill else 0)
    assert_evaluators_agree_with_replay([tmp_path / f"e{n}" / "violations.jsonl" for n in range(EVALUATORS)],
                                        references)


# -- the evaluators' ring changes: sessions handed over with their state ----------------------------------

@pytest.mark.slow
def test_evaluators_added_and_removed_mid_stream_hand_their_sessions_over(tmp_path: Path, otelcol: Path,
                                                                         pg_server: str) -> None:
    """The evaluators share PostgreSQL. Halfway through the first workload a fourth evaluator joins the
    Collector's ring (the Collector restarted with the longer list), halfway through the second it leaves
    again (still running). Sessions whose spans now route elsewhere are asked for by their new evaluator and
    handed over by their old one, with what its window held of them: the evaluators together find what
    ``replay`` finds, no violation twice. The Collector's restart holds up the traces it was routing: with
    the 5 s allowed lateness of the killed case above, a span waiting at a first tier for its trace's root
    is still waiting when the root comes (a ring that changes without a restart, as the Kubernetes resolver
    does, needs no such margin)."""
    lateness_s = 5
    evaluate = {"tick_interval": "50ms", "allowed_lateness": f"{lateness_s}s"}
    config = serve_config(tmp_path, {"evaluate": evaluate})
    url = fresh_database(pg_server)
    states = [{"backend": "postgres", "postgres": {"dsn": url, "replica_id": f"e{n}"}} for n in range(EVALUATORS + 1)]
    evaluators, first_tiers, databases, sessions_port = topology(tmp_path, evaluate, states)
    collector = Collector(otelcol, tmp_path, name="two-tier", metrics_port=free_port())
    references: dict[int, set[Key]] = {}
    later_ns = 0
    # The ring for each workload's first and second half: the fourth evaluator joins, then leaves.
    rings = [(evaluators[:EVALUATORS], evaluators), (evaluators, evaluators[:EVALUATORS])]
    try:
        for process in [*evaluators, *first_tiers]:
            process.wait_ready()
        with grpc.insecure_channel(collector.endpoint) as channel:
            stub = trace_service_pb2_grpc.TraceServiceStub(channel)  # type: ignore[no-untyped-call]
            for seed, (before, after) in zip(SEEDS, rings, strict=False):
                collector.start(two_tier_document(collector, sessions_port, first_tiers, before))
                sent = 0  # since this Collector started: its own count restarts with it
                requests, later, later_ns = workload(seed, 24, later_ns, lateness_s)
                references[seed] = replay_keys([*requests, later], config)
                for index, request in enumerate(requests):
                    if index == len(requests) // 2:
                        # Spans still waiting at a first tier for their trace's root stay there: they go
                        # on once it comes, through the new ring.
                        through_first_hop(collector, sent)
                        assert collector.stop() == 0, collector.log()
                        collector.start(two_tier_document(collector, sessions_port, first_tiers, after))
                        sent = 0
                    stub.Export(request, timeout=10.0)
                    sent += spans_in([request])
                send_later(stub, later, collector, sent, databases)
                assert collector.stop() == 0, collector.log()
        time.sleep(lateness_s + 2.0)  # the evaluators' reordering window and the waits' deadlines pass
        assert "Dropping data" not in collector.log()
    finally:
        collector.stop()
        codes = [process.stop() for process in [*first_tiers, *evaluators]]
    logs = [p.log_path.read_text(errors="replace") for p in evaluators]
    assert codes == [0] * (FIRST_TIERS + EVALUATORS + 1), "\n".join(p.log() for p in [*first_tiers, *evaluators])
    assert_evaluators_agree_with_replay([tmp_path / f"e{n}" / "violations.jsonl" for n in range(EVALUATORS + 1)],
                                        references, sessions_whole=False)
    handed = sum(log.count("handed over to the replica") for log in logs)
    assert handed >= 1, "no session changed evaluator with the ring"


@pytest.mark.slow
def test_the_two_tier_benchmark_gets_every_span_to_an_evaluator(otelcol: Path) -> None:
    """bench.two_tier on a small input: its run ends only once the evaluators took every span."""
    from bench import two_tier
    from bench.generate import otlp_requests

    made = list(otlp_requests(4_000, 400))
    run = two_tier.one_run(str(otelcol), [body for body, _ in made], sum(len(specs) for _, specs in made),
                           senders=2, first_tiers=1, evaluators=2)
    assert run.spans == 4_000
    assert run.first_tier_cpu_s > 0 and run.evaluator_cpu_s > 0 and run.collector_cpu_s > 0
