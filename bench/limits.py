"""The physical limits replay is judged against: loops that do the unavoidable work and nothing else.

``otlp``: read a length-prefixed proto stream (the Collector's file exporter, ``format:
proto``), parse each ExportTraceServiceRequest with the same protobuf runtime, and read
what conversion cannot do without: every span's status code and start time, and the
value of every attribute whose key some enabled profile looks at (session, action id,
kind, status, the ``durable.*`` keys). No records, no rules, no output.

``actions``: the skill's reference checker's approach to an action log: read lines,
``json.loads`` each, look up the four required fields.

Each prints one JSON line, ``{"items": N}``, so the harness can check it saw the whole
input. Run as ``python -m bench.limits {otlp|actions} FILE``.
"""

from __future__ import annotations

import json
import sys
from typing import Final

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from processor.convert.profiles import DURABLE_BY_KEY, GENAI, OPENINFERENCE, OPENLLMETRY, RESOURCE_KEYS

# The keys SpanConverter's default options look at: nothing else is read.
WANTED: Final = frozenset(DURABLE_BY_KEY) | GENAI.keys | OPENINFERENCE.keys | OPENLLMETRY.keys
RESOURCE_WANTED: Final = WANTED | RESOURCE_KEYS
_READ_SIZE: Final = 1 << 20


def _value(any_value: object) -> object:
    kind = any_value.WhichOneof("value")  # type: ignore[attr-defined]
    return getattr(any_value, kind) if kind is not None else None


def otlp_payloads(path: str) -> object:
    """Each length-prefixed message of the file, as bytes, reading in 1 MiB blocks."""
    with open(path, "rb", buffering=_READ_SIZE) as handle:
        read = handle.read
        while header := read(4):
            size = int.from_bytes(header, "big")
            payload = read(size)
            if len(payload) != size:
                raise SystemExit(f"{path}: truncated message")
            yield payload


def otlp_limit(path: str) -> int:
    spans = 0
    wanted = WANTED
    for payload in otlp_payloads(path):  # type: ignore[attr-defined]
        request = ExportTraceServiceRequest.FromString(payload)
        for resource_spans in request.resource_spans:
            for kv in resource_spans.resource.attributes:
                if kv.key in RESOURCE_WANTED:
                    _value(kv.value)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans += 1
                    span.status.code  # noqa: B018 (read: the default status)
                    span.start_time_unix_nano  # noqa: B018 (read: event time)
                    for kv in span.attributes:
                        if kv.key in wanted:
                            _value(kv.value)
    return spans


def actions_limit(path: str) -> int:
    records = 0
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            record.get("session_id")
            record.get("action_id")
            record.get("kind")
            record.get("status")
            records += 1
    return records


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ("otlp", "actions"):
        sys.stderr.write("usage: python -m bench.limits {otlp|actions} FILE\n")
        return 2
    count = otlp_limit(args[1]) if args[0] == "otlp" else actions_limit(args[1])
    sys.stdout.write(json.dumps({"items": count}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
