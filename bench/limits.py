"""The physical limits replay is judged against: loops that do the unavoidable work and nothing else.

``otlp``: read a length-prefixed proto stream (the Collector's file exporter, ``format:
proto``), parse each ExportTraceServiceRequest with the same protobuf runtime, and read
what conversion cannot do without: every span's status code and start time, and the
value of every attribute whose key some enabled profile looks at (session, action id,
kind, status, the ``durable.*`` keys). No records, no rules, no output.

``actions``: the skill's reference checker's approach to an action log: read lines,
``json.loads`` each, look up the four required fields.

``skill``: the work the skill's own checker does: ``json.loads`` each line and apply its
ten checks (DS000-DS009) inline, counting what they find. ``replay --pack
durable-sessions`` is judged against this loop.

``floor``: less than any replay of an action log can do: read each line and parse it with
the fastest validating parser Python has (msgspec, in C, into a structure of the skill's
fields), nothing else: no check, no count by session, no report. What this costs, start-up
included, is the least CPU a Python replay of that log can take, so the loop's CPU over
it is the highest ratio to the ``skill`` loop that any Python replay can reach.

Each prints one JSON line, ``{"items": N}``, so the harness can check it saw the whole
input. Run as ``python -m bench.limits {otlp|actions|skill|floor} FILE``.
"""

from __future__ import annotations

import json
import sys
from typing import Final

# The skill's loop imports nothing but json, as the skill's checker does: protobuf and the
# converter's profiles (about 0.1 s of start-up) are imported by the OTLP loop alone.

_READ_SIZE: Final = 1 << 20


def wanted_keys() -> tuple[frozenset[str], frozenset[str]]:
    """The span and resource attribute keys SpanConverter's default options look at: nothing else is read."""
    from processor.convert.profiles import DURABLE_BY_KEY, GENAI, OPENINFERENCE, OPENLLMETRY, RESOURCE_KEYS

    wanted = frozenset(DURABLE_BY_KEY) | GENAI.keys | OPENINFERENCE.keys | OPENLLMETRY.keys
    return wanted, wanted | RESOURCE_KEYS


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
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    spans = 0
    wanted, resource_wanted = wanted_keys()
    for payload in otlp_payloads(path):  # type: ignore[attr-defined]
        request = ExportTraceServiceRequest.FromString(payload)
        for resource_spans in request.resource_spans:
            for kv in resource_spans.resource.attributes:
                if kv.key in resource_wanted:
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


_REQUIRED: Final = ("session_id", "action_id", "kind", "status")
_NONDETERMINISTIC: Final = frozenset({"user_prompt", "llm_call", "external_read", "random", "clock"})
_SIDE_EFFECTING: Final = frozenset({"write", "payment", "email", "notify", "deploy"})


def skill_limit(path: str, strict: bool = False) -> tuple[int, int]:
    """(lines checked, violations): the skill's ten checks, inline, as its checker runs them."""
    records = violations = 0
    seen: set[str] = set()
    loads = json.loads
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            text = line.strip()
            if not text or text[0] == "#":
                continue
            records += 1
            try:
                record = loads(text)
            except ValueError:
                violations += 1  # DS000
                continue
            if not isinstance(record, dict):
                violations += 1
                continue
            action_id = record.get("action_id")
            if not all(record.get(name) for name in _REQUIRED):
                violations += 1  # DS000; the id still counts
                if action_id:
                    seen.add(action_id)
                continue
            if action_id in seen:
                violations += 1  # DS009
            seen.add(action_id)
            kind = record["kind"]
            ok = record["status"] == "ok"
            if kind in _NONDETERMINISTIC and ok and "result" not in record and not record.get("result_ref"):
                violations += 1
            side_effect = kind in _SIDE_EFFECTING or record.get("side_effects") is True
            if side_effect and ok and not record.get("idempotency_key") and record.get("replay") != "skip":
                violations += 1
            retryable = record.get("retryable") is True
            cap = record.get("max_attempts")
            capped = isinstance(cap, int) and cap >= 1
            if retryable and not capped:
                violations += 1
            attempts = record.get("attempts")
            if retryable and capped and isinstance(attempts, int) and attempts > cap:
                violations += 1
            if record.get("cacheable") is True:
                if kind == "user_prompt":
                    violations += 1
                if not record.get("cache_key"):
                    violations += 1
                ttl = record.get("ttl_s")
                if not (isinstance(ttl, int) and ttl > 0):
                    violations += 1
            if strict and record["status"] == "error" and not retryable and not record.get("on_failure"):
                violations += 1
    return records, violations


def skill_floor(path: str) -> tuple[int, int]:
    """(lines, lines the typed parse refused): each line parsed into the skill's fields, and nothing else."""
    from typing import Any

    import msgspec

    # Built here, not at module level: the skill's loop imports nothing but json.
    maybe_str, maybe_bool, maybe_int = str | None, bool | None, int | None
    skill_record = msgspec.defstruct("SkillRecord", [
        ("session_id", str), ("action_id", str), ("kind", str), ("status", str),
        ("time", maybe_str, None), ("result", Any, None), ("result_ref", maybe_str, None),
        ("idempotency_key", maybe_str, None), ("replay", maybe_str, None), ("side_effects", maybe_bool, None),
        ("retryable", maybe_bool, None), ("max_attempts", maybe_int, None), ("attempts", maybe_int, None),
        ("cacheable", maybe_bool, None), ("cache_key", maybe_str, None), ("ttl_s", maybe_int, None),
        ("on_failure", maybe_str, None),
    ])

    decode = msgspec.json.Decoder(skill_record).decode
    refused_error = msgspec.DecodeError
    lines = refused = 0
    with open(path, "rb", buffering=_READ_SIZE) as handle:
        for line in handle:
            text = line.strip()
            if not text or text[0] == 0x23:  # "#": skipped as the skill's loop skips it
                continue
            lines += 1
            try:
                decode(text)
            except refused_error:
                refused += 1  # a malformed line, or a field of another type: one exception, no more
    return lines, refused


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ("otlp", "actions", "skill", "floor"):
        sys.stderr.write("usage: python -m bench.limits {otlp|actions|skill|floor} FILE\n")
        return 2
    if args[0] in ("skill", "floor"):
        count, found = skill_limit(args[1]) if args[0] == "skill" else skill_floor(args[1])
        key = "violations" if args[0] == "skill" else "refused"
        sys.stdout.write(json.dumps({"items": count, key: found}) + "\n")
        return 0
    count = otlp_limit(args[1]) if args[0] == "otlp" else actions_limit(args[1])
    sys.stdout.write(json.dumps({"items": count}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
