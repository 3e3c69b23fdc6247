"""Attribute profiles: which span attributes say what about an action.

``durable.*`` is the project's own convention and maps attribute by attribute onto
record fields. The others (OpenTelemetry GenAI, OpenInference, OpenLLMetry) are what
agent frameworks already emit; each profile reads the few attributes it knows and
gives a :class:`Verdict` — the span is an action of some kind, or a container (an
agent or workflow run: no action), or the profile has nothing to say.

Values are read straight from the protobuf ``AnyValue`` messages; only attributes
named here are ever looked at.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, NamedTuple

from processor.convert.options import ConvertOptions

AnyValue = Any  # opentelemetry.proto.common.v1.common_pb2.AnyValue (the proto stubs are untyped)
Found = Mapping[str, AnyValue]

ValueType = Literal["str", "int", "number", "bool", "str|int"]
# Integers are signed 64-bit downstream (stores, OTLP, JSON): [_INT64_MIN, _INT64_END).
_INT64_MIN: Final = -(2**63)
_INT64_END: Final = 2**63

TYPE_WORDS: Final[dict[ValueType, str]] = {
    "str": "a string",
    "int": "an integer",
    "number": "a number",
    "bool": "a boolean",
    "str|int": "a string or an integer",
}

_ONEOF_WORDS: Final = {
    "string_value": "a string",
    "bool_value": "a boolean",
    "int_value": "an integer",
    "double_value": "a double",
    "array_value": "an array",
    "kvlist_value": "a key-value list",
    "bytes_value": "bytes",
    None: "an empty value",
}


@dataclass(frozen=True, slots=True)
class DurableAttribute:
    key: str
    field: str
    type: ValueType


# Record field order follows the contract's table, so emitted records read the same way.
DURABLE_ATTRIBUTES: Final[tuple[DurableAttribute, ...]] = (
    DurableAttribute("durable.session.id", "session_id", "str"),
    DurableAttribute("durable.action.id", "action_id", "str"),
    DurableAttribute("durable.action.kind", "kind", "str"),
    DurableAttribute("durable.action.status", "status", "str"),
    DurableAttribute("durable.result.recorded", "result", "bool"),
    DurableAttribute("durable.result_ref", "result_ref", "str"),
    DurableAttribute("durable.idempotency_key", "idempotency_key", "str"),
    DurableAttribute("durable.replay", "replay", "str"),
    DurableAttribute("durable.side_effects", "side_effects", "bool"),
    DurableAttribute("durable.retry.retryable", "retryable", "bool"),
    DurableAttribute("durable.retry.max_attempts", "max_attempts", "int"),
    DurableAttribute("durable.retry.attempt", "attempts", "int"),
    DurableAttribute("durable.cache.cacheable", "cacheable", "bool"),
    DurableAttribute("durable.cache.key", "cache_key", "str"),
    DurableAttribute("durable.cache.ttl_s", "ttl_s", "int"),
    DurableAttribute("durable.on_failure", "on_failure", "str"),
    DurableAttribute("durable.replayed", "replayed", "bool"),
    DurableAttribute("durable.workflow.state", "workflow_state", "str"),
    DurableAttribute("durable.wait.timeout_s", "wait_timeout_s", "number"),
    DurableAttribute("durable.plan.version", "plan_version", "str|int"),
    DurableAttribute("durable.approval.decision", "approval_decision", "str"),
    DurableAttribute("durable.input.fingerprint", "input_fingerprint", "str"),
)
DURABLE_BY_KEY: Final = {a.key: a for a in DURABLE_ATTRIBUTES}
# Fields filled by dedicated logic (fallbacks, defaults), not copied as they are.
IDENTITY_FIELDS: Final = frozenset({"session_id", "action_id", "kind", "status", "result"})
DURABLE_SESSION_KEY: Final = "durable.session.id"
DURABLE_EVENT_NAME: Final = "durable.action"

# Resource attributes read for provenance.
SERVICE_NAME: Final = "service.name"
SERVICE_INSTANCE_ID: Final = "service.instance.id"
HOST_NAME: Final = "host.name"
PROCESS_PID: Final = "process.pid"
RESOURCE_KEYS: Final = frozenset({SERVICE_NAME, SERVICE_INSTANCE_ID, HOST_NAME, PROCESS_PID})

# OpenTelemetry GenAI.
GENAI_OPERATION: Final = "gen_ai.operation.name"
GENAI_CONVERSATION: Final = "gen_ai.conversation.id"
GENAI_TOOL_NAME: Final = "gen_ai.tool.name"
GENAI_TOOL_CALL_ID: Final = "gen_ai.tool.call.id"
GENAI_TOOL_RESULT: Final = "gen_ai.tool.call.result"
GENAI_OUTPUT_MESSAGES: Final = "gen_ai.output.messages"
# OpenInference.
OI_SPAN_KIND: Final = "openinference.span.kind"
OI_SESSION: Final = "session.id"
OI_TOOL_NAME: Final = "tool.name"
OI_TOOL_CALL_ID: Final = "tool_call.id"
OI_TOOL_ID: Final = "tool.id"
OI_OUTPUT_VALUE: Final = "output.value"
OI_OUTPUT_MESSAGES: Final = "llm.output_messages"
# OpenInference flattens message lists into indexed keys (llm.output_messages.0.message.content).
OI_OUTPUT_MESSAGES_PREFIX: Final = "llm.output_messages."
# OpenLLMetry (Traceloop).
TL_SPAN_KIND: Final = "traceloop.span.kind"
TL_ENTITY_NAME: Final = "traceloop.entity.name"
TL_ENTITY_OUTPUT: Final = "traceloop.entity.output"
TL_SESSION: Final = "traceloop.association.properties.session_id"
# Versions before the GenAI names; current ones say gen_ai.operation.name (read as GenAI).
TL_REQUEST_TYPE: Final = "llm.request.type"
# Older OpenLLMetry flattens replies into indexed keys (gen_ai.completion.0.content, ...).
TL_COMPLETION_PREFIX: Final = "gen_ai.completion."

CONTAINER: Final = "container"

GENAI_OPERATIONS: Final[dict[str, str]] = {
    "chat": "llm_call",
    "text_completion": "llm_call",
    "generate_content": "llm_call",
    "execute_tool": "tool_call",
    "retrieval": "external_read",
    "search_memory": "external_read",
    "embeddings": "external_read",
    "create_memory": "write",
    "add_memory": "write",
    "update_memory": "write",
    "delete_memory": "write",
    "invoke_agent": CONTAINER,
    "invoke_workflow": CONTAINER,
    "create_agent": CONTAINER,
}
OPENINFERENCE_KINDS: Final[dict[str, str]] = {
    "LLM": "llm_call",
    "TOOL": "tool_call",
    "RETRIEVER": "external_read",
    "EMBEDDING": "external_read",
    "RERANKER": "external_read",
    "AGENT": CONTAINER,
    "CHAIN": CONTAINER,
    "GUARDRAIL": CONTAINER,
    "EVALUATOR": CONTAINER,
}
TRACELOOP_KINDS: Final[dict[str, str]] = {
    "task": "tool_call",
    "tool": "tool_call",
    "workflow": CONTAINER,
    "agent": CONTAINER,
}
TRACELOOP_REQUEST_TYPES: Final[dict[str, str]] = {
    "chat": "llm_call",
    "completion": "llm_call",
    "text_completion": "llm_call",
    "embedding": "external_read",
    "embeddings": "external_read",
    "rerank": "external_read",
}


def text(value: AnyValue) -> str | None:
    """A string attribute (an integer is taken as its decimal form: some SDKs emit numeric ids)."""
    # A oneof reads as its default unless it is the case set: a non-empty string is the
    # answer, at a fraction of WhichOneof's cost.
    string = value.string_value
    if string:
        return str(string)
    case = value.WhichOneof("value")
    if case == "string_value":
        return str(value.string_value)
    if case == "int_value":
        return str(value.int_value)
    return None


def typed(value: AnyValue, expected: ValueType) -> tuple[bool, Any]:
    """(True, python value) when the attribute has the expected type, else (False, None)."""
    case = value.WhichOneof("value")
    if case == "string_value":
        return (expected in ("str", "str|int")), value.string_value
    if case == "int_value":
        return (expected in ("int", "number", "str|int")), value.int_value
    if case == "bool_value":
        return expected == "bool", value.bool_value
    if case == "double_value":
        number = value.double_value
        if not math.isfinite(number):
            return False, None  # NaN and infinities are no one's count or timeout
        if expected == "number":
            return True, number
        # JavaScript SDKs send whole numbers as doubles when they come from arithmetic;
        # a double past the 64-bit range is no such count.
        if expected in ("int", "str|int") and number.is_integer() and _INT64_MIN <= number < _INT64_END:
            return True, int(number)
    return False, None


# Per expected type, the AnyValue field that holds its usual case. A oneof field reads
# as its default unless it is the case set, so a value that reads non-default there
# is what ``typed`` would accept as it is; anything else needs ``typed``.
PROBE_FIELDS: Final[dict[ValueType, str]] = {
    "str": "string_value",
    "int": "int_value",
    "number": "int_value",
    "bool": "bool_value",
    "str|int": "string_value",
}


def type_word(value: AnyValue) -> str:
    """What the attribute holds, for a message that names types, never values."""
    case = value.WhichOneof("value")
    if case == "double_value":
        number = value.double_value
        if not math.isfinite(number):
            return "a non-finite double (NaN or infinity)"
        if number.is_integer() and not _INT64_MIN <= number < _INT64_END:
            return "a double beyond the 64-bit integer range"
    return _ONEOF_WORDS.get(case, "an unknown type")


class Verdict(NamedTuple):
    """What a profile says about a span: an action of ``kind`` (or a container)."""

    kind: str
    tool_name: str | None = None
    result_recorded: bool = False


# Verdicts without a tool name are few: made once, not per span.
_PLAIN_VERDICTS: Final = {
    (kind, recorded): Verdict(kind, None, recorded)
    for kind in {
        *GENAI_OPERATIONS.values(),
        *OPENINFERENCE_KINDS.values(),
        *TRACELOOP_KINDS.values(),
        *TRACELOOP_REQUEST_TYPES.values(),
    }
    for recorded in (False, True)
}


def _plain(kind: str, recorded: bool = False) -> Verdict:
    return _PLAIN_VERDICTS[kind, recorded]


def _llm_output_recorded(found: Found, telemetry_is_log: bool, *keys: str) -> bool:
    return telemetry_is_log and any(k in found for k in keys)


def genai_verdict(found: Found, telemetry_is_log: bool) -> Verdict | None:
    operation = found.get(GENAI_OPERATION)
    if operation is None:
        return None
    kind = GENAI_OPERATIONS.get(text(operation) or "")
    if kind is None:
        return None
    if kind == "tool_call":
        tool = found.get(GENAI_TOOL_NAME)
        return Verdict(kind, text(tool) if tool is not None else None, GENAI_TOOL_RESULT in found)
    if kind == "llm_call":
        return _plain(kind, _llm_output_recorded(found, telemetry_is_log, GENAI_OUTPUT_MESSAGES))
    return _plain(kind)


def openinference_verdict(found: Found, telemetry_is_log: bool) -> Verdict | None:
    span_kind = found.get(OI_SPAN_KIND)
    if span_kind is None:
        return None
    kind = OPENINFERENCE_KINDS.get((text(span_kind) or "").upper())
    if kind is None:
        return None
    if kind == "tool_call":
        tool = found.get(OI_TOOL_NAME)
        return Verdict(kind, text(tool) if tool is not None else None, OI_OUTPUT_VALUE in found)
    if kind == "llm_call":
        # The flattened llm.output_messages.N.* keys are found by the converter's prefix scan.
        recorded = _llm_output_recorded(found, telemetry_is_log, OI_OUTPUT_MESSAGES, OI_OUTPUT_VALUE)
        return _plain(kind, recorded)
    return _plain(kind)


def openllmetry_verdict(found: Found, telemetry_is_log: bool) -> Verdict | None:
    span_kind = found.get(TL_SPAN_KIND)
    if span_kind is not None:
        kind = TRACELOOP_KINDS.get((text(span_kind) or "").lower())
        if kind == "tool_call":
            entity = found.get(TL_ENTITY_NAME)
            return Verdict(kind, text(entity) if entity is not None else None, TL_ENTITY_OUTPUT in found)
        if kind is not None:
            return _plain(kind)
    # Current versions no longer set llm.request.type: their model calls carry the GenAI names
    # (gen_ai.operation.name, gen_ai.output.messages) and the GenAI profile reads them.
    request_type = found.get(TL_REQUEST_TYPE)
    if request_type is not None:
        kind = TRACELOOP_REQUEST_TYPES.get((text(request_type) or "").lower())
        if kind == "llm_call":
            # The flattened gen_ai.completion.N.* keys are found by the converter's prefix scan.
            return _plain(kind)
        if kind is not None:
            return _plain(kind)
    return None


ProfileFn = Callable[[Found, bool], "Verdict | None"]


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    verdict: ProfileFn
    # Attributes the profile reads; the converter collects only these.
    keys: frozenset[str]
    # Fallbacks, in the contract's order, for a span without durable.session.id / durable.action.id.
    session_keys: tuple[str, ...] = ()
    action_id_keys: tuple[str, ...] = ()


GENAI: Final = Profile(
    "genai",
    genai_verdict,
    frozenset(
        {
            GENAI_OPERATION,
            GENAI_CONVERSATION,
            GENAI_TOOL_NAME,
            GENAI_TOOL_CALL_ID,
            GENAI_TOOL_RESULT,
            GENAI_OUTPUT_MESSAGES,
        }
    ),
    session_keys=(GENAI_CONVERSATION,),
    action_id_keys=(GENAI_TOOL_CALL_ID,),
)
OPENINFERENCE: Final = Profile(
    "openinference",
    openinference_verdict,
    frozenset(
        {OI_SPAN_KIND, OI_SESSION, OI_TOOL_NAME, OI_TOOL_CALL_ID, OI_TOOL_ID, OI_OUTPUT_VALUE, OI_OUTPUT_MESSAGES}
    ),
    session_keys=(OI_SESSION,),
    action_id_keys=(OI_TOOL_CALL_ID, OI_TOOL_ID),
)
OPENLLMETRY: Final = Profile(
    "openllmetry",
    openllmetry_verdict,
    frozenset({TL_SPAN_KIND, TL_ENTITY_NAME, TL_ENTITY_OUTPUT, TL_SESSION, TL_REQUEST_TYPE}),
    session_keys=(TL_SESSION,),
)


def enabled_profiles(options: ConvertOptions) -> tuple[Profile, ...]:
    """The non-durable profiles switched on, in precedence order."""
    flags = ((options.genai, GENAI), (options.openinference, OPENINFERENCE), (options.openllmetry, OPENLLMETRY))
    return tuple(profile for on, profile in flags if on)
