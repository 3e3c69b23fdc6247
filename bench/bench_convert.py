"""Micro-benchmark of SpanConverter.convert against the floor: parse + read the needed attributes.

Run: python bench/bench_convert.py [--spans N] [--repeat R]

Every loop starts from the serialized ExportTraceServiceRequest, as a receiver does.
The floor parses it and reads the value of every attribute whose key conversion
looks at; the converter does that and builds the records, either from the parsed
message (``convert``, what receivers handed a message use) or from the bytes
(``convert_serialized``, what replay uses). Medians of R runs, in spans per
CPU-second of this process.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import orjson
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from processor.convert import SpanConverter, decode_traces
from processor.convert.profiles import DURABLE_BY_KEY, GENAI, OPENINFERENCE, OPENLLMETRY

BASE_NS = 1_793_524_440_000_000_000
Attrs = tuple[tuple[str, object], ...]
MESSAGES = orjson.dumps([{"role": "user", "parts": [{"type": "text", "content": "Find me a flight to Kyoto. " * 12}]}])


def _add(attributes: object, key: str, value: object) -> None:
    kv = attributes.add()  # type: ignore[attr-defined]
    kv.key = key
    if isinstance(value, bool):
        kv.value.bool_value = value
    elif isinstance(value, int):
        kv.value.int_value = value
    else:
        kv.value.string_value = str(value)


def build_request(spans: int) -> ExportTraceServiceRequest:
    """Agent traffic: per 10 spans, 4 model calls, 4 tool calls, 1 HTTP call, 1 agent root; ~12 attributes each."""
    request = ExportTraceServiceRequest()
    per_resource = 500
    for start in range(0, spans, per_resource):
        resource_spans = request.resource_spans.add()
        for resource_key, resource_value in (
            ("service.name", "travel-agent"),
            ("service.instance.id", f"pod-{start // per_resource}"),
            ("telemetry.sdk.language", "python"),
            ("telemetry.sdk.version", "1.45.2"),
            ("host.name", "node-7"),
        ):
            _add(resource_spans.resource.attributes, resource_key, resource_value)
        scope = resource_spans.scope_spans.add()
        scope.scope.name = "pydantic-ai"
        for index in range(start, min(start + per_resource, spans)):
            span = scope.spans.add()
            span.trace_id = (index // 10 + 1).to_bytes(16, "big")
            span.span_id = (index + 1).to_bytes(8, "big")
            span.start_time_unix_nano = BASE_NS + index * 1_000_003
            span.end_time_unix_nano = span.start_time_unix_nano + 5_000_000
            conversation = f"conv-{index // 10}"
            role = index % 10
            pairs: Attrs
            if role < 4:
                span.name = "chat gpt-4o"
                pairs = (
                    ("gen_ai.operation.name", "chat"),
                    ("gen_ai.provider.name", "openai"),
                    ("gen_ai.request.model", "gpt-4o"),
                    ("gen_ai.response.model", "gpt-4o-2024-08-06"),
                    ("gen_ai.conversation.id", conversation),
                    ("gen_ai.agent.name", "booker"),
                    ("gen_ai.usage.input_tokens", 812),
                    ("gen_ai.usage.output_tokens", 64),
                    ("gen_ai.input.messages", MESSAGES.decode()),
                    ("gen_ai.output.messages", MESSAGES.decode()),
                    ("gen_ai.response.finish_reasons", "stop"),
                    ("server.address", "api.openai.com"),
                )
            elif role < 8:
                tool = ("search_flights", "book_seat", "check_visa", "send_email")[role - 4]
                span.name = f"execute_tool {tool}"
                pairs = (
                    ("gen_ai.operation.name", "execute_tool"),
                    ("gen_ai.tool.name", tool),
                    ("gen_ai.tool.call.id", f"call_{index}"),
                    ("gen_ai.tool.call.arguments", '{"destination":"KIX","date":"2026-11-02"}'),
                    ("gen_ai.tool.call.result", "3 quotes found"),
                    ("gen_ai.conversation.id", conversation),
                    ("gen_ai.agent.name", "booker"),
                    ("logfire.msg", f"running tool: {tool}"),
                    ("durable.retry.retryable", True),
                    ("durable.retry.max_attempts", 3),
                    ("durable.retry.attempt", 1),
                    ("durable.idempotency_key", f"conv-{index // 10}-{tool}"),
                )
            elif role == 8:
                span.name = "GET /quotes"
                pairs = (
                    ("http.request.method", "GET"),
                    ("url.full", "https://quotes.example/api/v2/search?to=KIX"),
                    ("http.response.status_code", 200),
                    ("server.address", "quotes.example"),
                    ("server.port", 443),
                    ("network.protocol.version", "1.1"),
                    ("user_agent.original", "httpx/0.28"),
                    ("http.request.body.size", 0),
                    ("http.response.body.size", 5120),
                    ("url.scheme", "https"),
                    ("url.path", "/api/v2/search"),
                    ("client.address", "10.0.0.7"),
                )
            else:
                span.name = "invoke_agent booker"
                pairs = (
                    ("gen_ai.operation.name", "invoke_agent"),
                    ("gen_ai.agent.name", "booker"),
                    ("gen_ai.conversation.id", conversation),
                    ("gen_ai.agent.call.id", f"run-{index}"),
                    ("model_name", "gpt-4o"),
                    ("agent_name", "booker"),
                    ("logfire.msg", "booker run"),
                    ("final_result", "booked"),
                    ("gen_ai.aggregated_usage.input_tokens", 4000),
                    ("gen_ai.aggregated_usage.output_tokens", 300),
                    ("pydantic_ai.all_messages", MESSAGES.decode()),
                    ("logfire.json_schema", "{}"),
                )
            for key, value in pairs:
                _add(span.attributes, key, value)
    return request


WANTED = frozenset(DURABLE_BY_KEY) | GENAI.keys | OPENINFERENCE.keys | OPENLLMETRY.keys


def floor(payload: bytes) -> int:
    """Parse, then read the value of every attribute conversion would look at."""
    request = ExportTraceServiceRequest.FromString(payload)
    seen = 0
    for resource_spans in request.resource_spans:
        for kv in resource_spans.resource.attributes:
            if kv.key in WANTED:
                kv.value.WhichOneof("value")
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                for kv in span.attributes:
                    if kv.key in WANTED:
                        value = kv.value
                        getattr(value, value.WhichOneof("value") or "string_value")
                seen += 1
    return seen


def convert(payload: bytes, converter: SpanConverter) -> int:
    result = converter.convert(ExportTraceServiceRequest.FromString(payload), "bench")
    return result.spans_total


def convert_serialized(payload: bytes, converter: SpanConverter) -> int:
    return converter.convert_serialized(payload, "bench").spans_total


def convert_json(payload: bytes, converter: SpanConverter) -> int:
    traces, _ = decode_traces(orjson.loads(payload), keep=converter.reads_attribute)
    return converter.convert(traces, "bench").spans_total


def rate(work: Callable[[], int]) -> float:
    # CPU time of this process: other processes on a shared machine do not count against it.
    start = time.process_time()
    spans = work()
    return spans / (time.process_time() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spans", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()

    request = build_request(args.spans)
    payload = request.SerializeToString()
    attributes = sum(len(s.attributes) for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans)
    converter = SpanConverter()
    result = converter.convert(request)
    print(
        f"{args.spans} spans, {attributes / args.spans:.1f} attributes per span, {len(payload) / 1e6:.1f} MB; "
        f"{len(result.actions)} actions, {result.spans_not_actions} not actions, {len(result.rejected)} rejected"
    )
    # Alternate the loops so that load from other processes hits them alike; the
    # median of the per-run ratios is steadier than the ratio of the medians.
    floor_rates, convert_rates, serialized_rates = [], [], []
    for _ in range(args.repeat):
        floor_rates.append(rate(lambda: floor(payload)))
        convert_rates.append(rate(lambda: convert(payload, converter)))
        serialized_rates.append(rate(lambda: convert_serialized(payload, converter)))
    ratio = statistics.median(c / f for c, f in zip(convert_rates, floor_rates, strict=True))
    serialized_ratio = statistics.median(c / f for c, f in zip(serialized_rates, floor_rates, strict=True))
    print(f"parse + read needed attributes : {statistics.median(floor_rates):10,.0f} spans/s")
    print(f"SpanConverter.convert (proto)  : {statistics.median(convert_rates):10,.0f} spans/s")
    print(f"  .convert_serialized (bytes)  : {statistics.median(serialized_rates):10,.0f} spans/s")
    print(f"convert / floor (median of pairs): {ratio:.2f}")
    print(f"convert_serialized / floor       : {serialized_ratio:.2f}")

    json_payload = json_format.MessageToJson(request).encode()  # ids in base64: the decoder accepts both
    json_rates = [rate(lambda: convert_json(json_payload, converter)) for _ in range(max(3, args.repeat // 2))]
    print(f"OTLP/JSON decode + convert     : {statistics.median(json_rates):10,.0f} spans/s")


if __name__ == "__main__":
    main()
