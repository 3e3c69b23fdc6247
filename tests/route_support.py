"""Workloads for the two-tier topology's tests: sessions spread over traces whose children name no
session and end before the root that names it, interleaved and cut into export requests."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator

from processor.route.by_session import ROUTING_ATTRIBUTE
from tests.durable_support import session_steps
from tests.serve_support import Key, keys_of, read_jsonl

MS = 1_000_000
NS = 1_000_000_000
T0 = 1_780_000_000 * NS


class SeededIds(IdGenerator):
    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def generate_span_id(self) -> int:
        return self._rng.getrandbits(64) | 1

    def generate_trace_id(self) -> int:
        return self._rng.getrandbits(128) | 1


def session_traces(
    seed: int, sessions: int, traces: int, steps: int, start_ns: int = T0
) -> list[list[ReadableSpan]]:
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
                                  id_generator=SeededIds(seed * 1000 + s))
        provider.add_span_processor(SimpleSpanProcessor(memory))
        tracer = provider.get_tracer("durable-check-tests")
        steps_of_session = session_steps(rng, session, traces * steps)
        for k in range(traces):
            t0 = start_ns + k * 300 * MS + s * 5 * MS
            key = "gen_ai.conversation.id" if rng.random() < 0.5 else "durable.session.id"
            root = tracer.start_span(f"turn {k}", start_time=t0, attributes={key: session})
            context = trace.set_span_in_context(root)
            for n in range(steps):
                begin = t0 + (n + 1) * 40 * MS
                child = tracer.start_span(f"step {k}.{n}", context=context, start_time=begin,
                                          attributes=steps_of_session[k * steps + n].attributes)
                child.end(end_time=begin + 10 * MS)
            root.end(end_time=t0 + (steps + 1) * 40 * MS)
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


def spans_in(requests: Sequence[Any]) -> int:
    return sum(len(ss.spans) for r in requests for rs in r.resource_spans for ss in rs.scope_spans)



def later_span(seed: int, start_ns: int) -> Any:
    """One request: a tool call of another session, starting at ``start_ns``."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(id_generator=SeededIds(seed * 1000 + 999))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    attributes = {"durable.session.id": f"route-{seed}-later", "durable.action.id": f"route-{seed}-later-a0",
                  "durable.action.kind": "tool_call"}
    provider.get_tracer("durable-check-tests").start_span("later", start_time=start_ns,
                                                           attributes=attributes).end(end_time=start_ns + MS)
    provider.shutdown()
    return encode_spans(memory.get_finished_spans())


def assert_evaluators_agree_with_replay(files: Sequence[Path], references: Mapping[int, set[Key]], *,
                                        sessions_whole: bool = True) -> None:
    """The evaluators' JSONL files together: each session at one evaluator (spread over at least two),
    no violation written twice, and for each workload's seed exactly what replay found.

    ``sessions_whole=False``: the ring changed meanwhile, and a session handed over has findings
    at its old and its new evaluator."""
    documents = [read_jsonl(path) for path in files]
    ids = [d["violation_id"] for part in documents for d in part]
    assert len(ids) == len(set(ids)), "a violation was written twice"
    sessions = [{d["session_id"] for d in part} for part in documents]
    # The exporter's ring decides the split (it hashes the replicas' addresses, free ports here).
    assert sum(1 for held in sessions if held) >= 2, "the sessions must spread over the evaluators"
    for a in range(len(sessions) if sessions_whole else 0):
        for b in range(a + 1, len(sessions)):
            assert not sessions[a] & sessions[b], "a session reached two evaluators"
    found = keys_of([d for part in documents for d in part])
    for seed, reference in references.items():
        mine = {k for k in found if k[2].startswith(f"route-{seed}-")}
        assert mine == reference, f"seed {seed}: missing {sorted(reference - mine)}, extra {sorted(mine - reference)}"
