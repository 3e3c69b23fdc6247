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

``ideal``: every shipped rule that can fire on an action log, inline, in the least work each
needs (the floor's parse, plain dicts per session, findings counted): the ceiling of any
Python evaluator of the default rule set. Replay with all packs is judged against the
``skill`` loop; this one says how far any Python code could take that ratio.

Each prints one JSON line, ``{"items": N}``, so the harness can check it saw the whole
input. Run as ``python -m bench.limits {otlp|actions|skill|floor|ideal} FILE``.
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


def _skill_fields(result_type: object) -> list[tuple[object, ...]]:
    """The skill's fields as msgspec.defstruct takes them, ``result`` of ``result_type``."""
    maybe_str, maybe_bool, maybe_int = str | None, bool | None, int | None
    return [
        ("session_id", str), ("action_id", str), ("kind", str), ("status", str),
        ("time", maybe_str, None), ("result", result_type, None), ("result_ref", maybe_str, None),
        ("idempotency_key", maybe_str, None), ("replay", maybe_str, None), ("side_effects", maybe_bool, None),
        ("retryable", maybe_bool, None), ("max_attempts", maybe_int, None), ("attempts", maybe_int, None),
        ("cacheable", maybe_bool, None), ("cache_key", maybe_str, None), ("ttl_s", maybe_int, None),
        ("on_failure", maybe_str, None),
    ]


def skill_floor(path: str) -> tuple[int, int]:
    """(lines, lines the typed parse refused): each line parsed into the skill's fields, and nothing else."""
    from typing import Any

    import msgspec

    # Built here, not at module level: the skill's loop imports nothing but json.
    skill_record = msgspec.defstruct("SkillRecord", _skill_fields(Any))

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


# What the session-checks pack's lists hold (rules/session-checks.yaml), for the ideal loop below.
_WAIT_STATES: Final = frozenset({"awaiting_approval", "waiting_on_external"})
_UNFINISHED: Final = frozenset({"planned", "awaiting_approval", "executing", "waiting_on_external", "retry_scheduled"})
_ESCALATION: Final = frozenset({"user_prompt", "approval"})
_STATUSES: Final = frozenset({"ok", "error"})
_DECISIONS: Final = frozenset({"granted", "denied"})
_ON_FAILURE: Final = frozenset({"ask_user", "abort", "compensate"})
_WORKFLOW: Final = _UNFINISHED | {"completed", "failed", "compensated"}


def all_packs_ideal(path: str) -> tuple[int, int]:
    """(lines, findings): every shipped rule that can fire on an action log, inline, in the least
    work each needs: the ceiling of any Python evaluator of the default rule set, generated or not.

    Each line is parsed by the fastest validating parser (msgspec, in C, as ``floor``; a
    result is only found, not decoded) and its time by ``datetime.fromisoformat`` (C, once
    for lines that repeat the time before them). The ten checks of the skill loop, the five
    conditions of the session-checks pack (DS103 by the rule's own ``timeDerived``), and its
    session rules on plain dicts per session: DS101 and DS104 (the
    first record of an action id or key, and the repeat compared), DS102 (the key of an
    action id), DS105 and DS107 (a wait per session, due times in one heap), DS108 and DS109
    (the latest approval), DS111 (error times of an action id in a ten-minute window).
    Findings are counted, not reported; nothing is kept per session but the rules' state,
    nothing is bounded, no summary. It does less than replay must, so replay can be no
    faster than this loop, whatever its evaluator is made of.
    """
    from datetime import datetime
    from heapq import heappop, heappush
    from typing import Any

    import msgspec

    from processor.evaluate.functions import time_derived

    maybe_str = str | None
    record_type = msgspec.defstruct("Record", [
        *_skill_fields(msgspec.Raw),  # a result is only found, not decoded
        ("input_fingerprint", maybe_str, None), ("workflow_state", maybe_str, None), ("replayed", bool | None, None),
        ("approval_decision", maybe_str, None), ("plan_version", Any, None),
        ("wait_timeout_s", int | float | None, None),
    ], gc=False)
    decode = msgspec.json.Decoder(record_type).decode
    refused_error = msgspec.DecodeError
    parse_time = datetime.fromisoformat
    side_effecting, nondeterministic = _SIDE_EFFECTING, _NONDETERMINISTIC
    lines = found = 0
    ids: set[str] = set()
    # One entry per session: [DS101 by id, DS102 by id, DS104 by key, DS111 by id, DS105 wait, DS107 wait,
    # DS108 latest granted plan, DS109 by plan, DS111's ids above the threshold].
    sessions: dict[str, list[Any]] = {}
    due: list[tuple[float, str, int]] = []
    window = 600.0
    last_when: str | None = None
    last_t = 0.0
    with open(path, "rb", buffering=_READ_SIZE) as handle:
        for line in handle:
            text = line.strip()
            if not text or text[0] == 0x23:
                continue
            lines += 1
            try:
                r = decode(text)
            except refused_error:
                found += 1  # DS000
                continue
            action_id = r.action_id
            if action_id in ids:
                found += 1  # DS009
            ids.add(action_id)
            kind, status = r.kind, r.status
            ok = status == "ok"
            when = r.time
            if when != last_when:  # lines written in the same second share their time
                last_when, last_t = when, 0.0 if when is None else parse_time(when).timestamp()
            t = last_t
            while due and due[0][0] < t:  # waits whose deadline passed, in every session
                _, owner, slot = heappop(due)
                state = sessions[owner]
                if state[slot] is not None:
                    state[slot] = None
                    found += 1
            side = kind in side_effecting or r.side_effects is True
            key = r.idempotency_key
            retryable = r.retryable is True
            cap, attempts, state_name = r.max_attempts, r.attempts, r.workflow_state
            if kind in nondeterministic and ok and r.result is None and not r.result_ref:
                found += 1
            if side and ok and not key and r.replay != "skip":
                found += 1
            capped = cap is not None and cap >= 1
            if retryable and not capped:
                found += 1
            if capped and attempts is not None and attempts > cap:
                found += 1  # DS004, or DS114 when not retryable
            if r.cacheable is True:
                if kind == "user_prompt":
                    found += 1
                if not r.cache_key:
                    found += 1
                if not (r.ttl_s is not None and r.ttl_s > 0):
                    found += 1
            if key and time_derived(key, int(t * 1e9)):
                found += 1  # DS103, the rule's own function
            waiting = state_name in _WAIT_STATES
            timeout = r.wait_timeout_s
            if waiting and not (timeout is not None and timeout > 0):
                found += 1  # DS106
            decision, on_failure = r.approval_decision, r.on_failure
            if (status not in _STATUSES or (decision is not None and decision not in _DECISIONS)
                    or (on_failure and on_failure not in _ON_FAILURE)
                    or (state_name is not None and state_name not in _WORKFLOW)):
                found += 1  # DS112
            session_id = r.session_id
            state = sessions.get(session_id)
            if state is None:
                state = sessions[session_id] = [{}, {}, {}, {}, None, None, None, {}, set()]
            replayed = r.replayed is True
            fingerprint = r.input_fingerprint
            first = state[0].get(action_id)  # DS101
            if first is not None:
                if (kind == first[0] and not replayed and not (fingerprint and first[1] and fingerprint != first[1])
                        and not (side and key and key == first[2])):
                    found += 1
            elif ok and state_name not in _UNFINISHED:
                state[0][action_id] = (kind, fingerprint, key)
            if key:
                earlier = state[1].get(action_id)  # DS102
                if earlier is None:
                    state[1][action_id] = key
                elif earlier != key:
                    found += 1
                    state[1][action_id] = key
                opener = state[2].get(key)  # DS104
                if opener is None:
                    state[2][key] = (action_id, fingerprint)
                elif opener[0] != action_id or (fingerprint and opener[1] and fingerprint != opener[1]):
                    found += 1
            if status == "error":  # DS111: more than 10 in the window, reported as it crosses
                times = state[3].get(action_id)
                if times is None:
                    state[3][action_id] = [t]
                else:
                    times.append(t)
                    while times[0] < t - window:
                        times.pop(0)
                    if len(times) > 11:
                        del times[0]
                    if len(times) <= 10:
                        state[8].discard(action_id)
                    elif action_id not in state[8]:
                        state[8].add(action_id)
                        found += 1
            if state[4] is not None and (kind in _ESCALATION or state_name == "awaiting_approval"):
                state[4] = None  # DS105 resolved
            if (status == "error" and attempts is not None and cap is not None and attempts >= cap
                    and on_failure != "ask_user"):
                state[4] = t
                heappush(due, (t + 3600.0, session_id, 4))
            if state[5] is not None and (decision is not None or (state_name is not None and not waiting)
                                         or (action_id == state[5] and not waiting)):
                state[5] = None  # DS107 resolved
            if waiting and timeout is not None and timeout > 0:
                state[5] = action_id
                heappush(due, (t + timeout, session_id, 5))
            plan = r.plan_version
            if plan is not None:
                granted = state[6]  # DS108
                if (granted is not None and str(plan) != granted and not replayed
                        and (state_name == "executing" or side)):
                    found += 1
                text_plan = str(plan)
                decided = state[7].get(text_plan)  # DS109
                if decided == "denied" and ok and not replayed and side:
                    found += 1
                if decision is not None:
                    state[7][text_plan] = decision
                    if decision == "granted":
                        state[6] = text_plan
    return lines, found


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ("otlp", "actions", "skill", "floor", "ideal"):
        sys.stderr.write("usage: python -m bench.limits {otlp|actions|skill|floor|ideal} FILE\n")
        return 2
    if args[0] == "ideal":
        count, found = all_packs_ideal(args[1])
        sys.stdout.write(json.dumps({"items": count, "findings": found}) + "\n")
        return 0
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
