"""Cost of the first tier of the two-tier topology (processor.route.by_session), per core.

Agent runs as frameworks trace them: a root span names the conversation, its nine model
and tool calls name none and end, so arrive, first; runs interleave, three runs per
conversation; requests of 512 spans. Measured on the same requests, each a median of
three runs of CPU time: converting alone (what a checker pays to read them), and the
splitter (converting, resolving each span's session, regrouping the spans per session
with the session on their resource, serializing what it sends on).

    python bench/bench_route.py              # 100k spans
    python bench/bench_route.py 300000
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from processor.convert.spans import SpanConverter
from processor.route.by_session import SessionSplitter

T0 = 1_793_524_440_000_000_000
MS = 1_000_000
CHILDREN = 9
CONCURRENT = 200
REQUEST_SPANS = 512
KINDS = ("llm_call", "tool_call", "llm_call", "external_read", "llm_call", "write", "llm_call", "tool_call", "llm_call")


def _attr(key: str, value: str) -> common_pb2.KeyValue:
    return common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(string_value=value))


def requests(total: int) -> list[Any]:
    """``total`` spans of agent runs, children first, CONCURRENT runs interleaved, cut into requests."""
    spans: list[trace_pb2.Span] = []
    pending: list[list[trace_pb2.Span]] = []
    run = 0
    while len(spans) + sum(map(len, pending)) < total:
        trace_id = (run + 1).to_bytes(16, "big")
        root_id = (run + 1).to_bytes(4, "big") + bytes(4)
        start = T0 + run * 50 * MS
        items = []
        for child in range(CHILDREN):
            items.append(trace_pb2.Span(
                trace_id=trace_id, span_id=(run + 1).to_bytes(4, "big") + (child + 1).to_bytes(4, "big"),
                parent_span_id=root_id, name=f"step {child}", start_time_unix_nano=start + (child + 1) * MS,
                end_time_unix_nano=start + (child + 2) * MS, attributes=[_attr("durable.action.kind", KINDS[child])]))
        items.append(trace_pb2.Span(
            trace_id=trace_id, span_id=root_id, name="invoke_agent", start_time_unix_nano=start,
            end_time_unix_nano=start + 20 * MS, attributes=[_attr("gen_ai.conversation.id", f"conv-{run // 3}")]))
        pending.append(items)
        run += 1
        if len(pending) >= CONCURRENT:
            for group in zip(*pending, strict=False):
                spans.extend(group)
            pending = []
    for group in zip(*pending, strict=False):
        spans.extend(group)
    resource = trace_pb2.ResourceSpans()
    resource.resource.attributes.append(_attr("service.name", "bench-agent"))
    out = []
    for at in range(0, len(spans), REQUEST_SPANS):
        unit = trace_pb2.ResourceSpans(resource=resource.resource)
        unit.scope_spans.add().spans.extend(spans[at:at + REQUEST_SPANS])
        out.append(trace_service_pb2.ExportTraceServiceRequest(resource_spans=[unit]))
    return out


def convert_rate(batch: list[Any]) -> float:
    converter = SpanConverter()
    started = time.process_time()
    spans = 0
    for request in batch:
        spans += converter.convert(request).spans_total
    return spans / (time.process_time() - started)


def split_rate(batch: list[Any]) -> tuple[float, int]:
    splitter = SessionSplitter(SpanConverter(), 5_000 * MS)
    started = time.process_time()
    spans = sent = 0
    for request in batch:
        out = splitter.admit(request, 0)
        spans += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        sent += len(trace_service_pb2.ExportTraceServiceRequest(resource_spans=out).SerializeToString())
    sent += len(trace_service_pb2.ExportTraceServiceRequest(resource_spans=splitter.release_all()).SerializeToString())
    return spans / (time.process_time() - started), sent


def main() -> None:
    total = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    batch = requests(total)
    pairs = [(convert_rate(batch), split_rate(batch)[0]) for _ in range(3)]
    converted = statistics.median(p[0] for p in pairs)
    split = statistics.median(p[1] for p in pairs)
    received = sum(len(r.SerializeToString()) for r in batch)
    _, sent = split_rate(batch)
    spans = sum(len(ss.spans) for r in batch for rs in r.resource_spans for ss in rs.scope_spans)
    print(f"requests of {REQUEST_SPANS} spans, {spans:,} spans")
    print(f"converting alone                            : {converted:10,.0f} spans/s CPU")
    print(f"splitter (convert, resolve, regroup, encode): {split:10,.0f} spans/s CPU")
    print(f"ratio (median of pairs)                     : {statistics.median(p[1] / p[0] for p in pairs):.2f}")
    print(f"bytes sent on / received                    : {sent / received:.2f}")


if __name__ == "__main__":
    main()
