"""The first tier of the two-tier topology: spans regrouped per session, the session on their resource.

Sessions spread over several traces whose children name no session and end (and are
exported) before the root that names it, traces interleaved across requests of random
sizes: after the splitter, spans split by their resource's session over several
evaluators give, together, what ``replay`` gives on the spans as they were sent, and no
finding comes out of two evaluators.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator

from processor.config import Config
from processor.convert.spans import SpanConverter
from processor.evaluate.engine import Engine, EngineOptions
from processor.evaluate.rulefmt import load_rules
from processor.pipeline import Pipeline
from processor.route.by_session import ROUTING_ATTRIBUTE, SessionSplitter
from tests.durable_support import session_steps
from tests.serve_support import Key, serve_config

_MS = 1_000_000
_NS = 1_000_000_000
T0 = 1_780_000_000 * _NS
LATENESS_NS = 2 * _NS


class _SeededIds(IdGenerator):
    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def generate_span_id(self) -> int:
        return self._rng.getrandbits(64) | 1

    def generate_trace_id(self) -> int:
        return self._rng.getrandbits(128) | 1


def session_traces(seed: int, sessions: int, traces: int, steps: int) -> list[list[ReadableSpan]]:
    """Every session's traces, each as the SDK ends it: its children (naming no session) before its root.

    The root names the session with ``gen_ai.conversation.id`` or ``durable.session.id`` (the
    rng picks); a session's turns follow one another 300 ms apart, sessions start 5 ms apart.
    """
    rng = random.Random(seed)
    out: list[list[ReadableSpan]] = []
    for s in range(sessions):
        session = f"route-{seed}-{s:02d}"
        memory = InMemorySpanExporter()
        provider = TracerProvider(resource=Resource.create({"service.name": "route-test-agent"}),
                                  id_generator=_SeededIds(seed * 1000 + s))
        provider.add_span_processor(SimpleSpanProcessor(memory))
        tracer = provider.get_tracer("durable-check-tests")
        steps_of_session = session_steps(rng, session, traces * steps)
        for k in range(traces):
            t0 = T0 + k * 300 * _MS + s * 5 * _MS
            key = "gen_ai.conversation.id" if rng.random() < 0.5 else "durable.session.id"
            root = tracer.start_span(f"turn {k}", start_time=t0, attributes={key: session})
            context = trace.set_span_in_context(root)
            for n in range(steps):
                begin = t0 + (n + 1) * 40 * _MS
                child = tracer.start_span(f"step {k}.{n}", context=context, start_time=begin,
                                          attributes=steps_of_session[k * steps + n].attributes)
                child.end(end_time=begin + 10 * _MS)
            root.end(end_time=t0 + (steps + 1) * 40 * _MS)
            out.append(list(memory.get_finished_spans()))
            memory.clear()
        provider.shutdown()
    return out


def interleaved(rng: random.Random, traces: Sequence[Sequence[ReadableSpan]]) -> list[ReadableSpan]:
    """The traces' spans merged in a random interleaving, each trace's own order kept (children, then root).

    Traces are taken in a window of a few at a time, in the order their turns start, so
    event time moves on about as it would from live agents.
    """
    order = sorted(range(len(traces)), key=lambda i: traces[i][-1].start_time or 0)
    cursors = {i: 0 for i in order}
    pending = list(order)
    out: list[ReadableSpan] = []
    while pending:
        window = pending[:4]
        i = rng.choice(window)
        out.append(traces[i][cursors[i]])
        cursors[i] += 1
        if cursors[i] == len(traces[i]):
            pending.remove(i)
    return out


def requests_of(rng: random.Random, spans: Sequence[ReadableSpan]) -> list[Any]:
    """The spans cut into export requests of random sizes (1 to 12 spans)."""
    out: list[Any] = []
    at = 0
    while at < len(spans):
        size = rng.randint(1, 12)
        out.append(encode_spans(spans[at:at + size]))
        at += size
    return out


def session_of(resource_spans: Any) -> str:
    for kv in resource_spans.resource.attributes:
        if kv.key == ROUTING_ATTRIBUTE:
            return str(kv.value.string_value)
    return ""


def split_over(requests: Sequence[Any], evaluators: int) -> list[list[Any]]:
    """Through the splitter, then each ResourceSpans to the evaluator its session hashes to."""
    splitter = SessionSplitter(SpanConverter(), LATENESS_NS)
    routed: list[list[Any]] = [[] for _ in range(evaluators)]

    def send(resource_spans: list[Any]) -> None:
        parts: list[list[Any]] = [[] for _ in range(evaluators)]
        for unit in resource_spans:
            parts[zlib.crc32(session_of(unit).encode()) % evaluators].append(unit)
        for index, part in enumerate(parts):
            if part:
                routed[index].append(trace_service_pb2.ExportTraceServiceRequest(resource_spans=part))

    for request in requests:
        send(splitter.admit(request, 0))
    send(splitter.release_all())
    assert splitter.held_spans == 0
    return routed


def replay_keys(requests: Sequence[Any], config: Config) -> set[Key]:
    """What ``replay`` finds on these requests, in this order: every converted item (session marks
    included, so that the identity stage resolves sessions as it does in replay), a fresh engine."""
    ev = config.evaluate
    engine = Engine(
        load_rules(ev.rules, include_shipped=ev.include_shipped_rules),
        EngineOptions(allowed_lateness_s=float(ev.allowed_lateness), mode="replay"),
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


def spans_in(requests: Sequence[Any]) -> int:
    return sum(len(ss.spans) for r in requests for rs in r.resource_spans for ss in rs.scope_spans)


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
