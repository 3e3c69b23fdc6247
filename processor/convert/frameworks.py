"""Approvals, waits and checkpoints that agent frameworks show only in their own way.

pydantic-ai ends a run that needs approval with a ``DeferredToolRequests`` result (the
``final_result`` of its ``invoke_agent`` span); LangGraph's ``interrupt()`` leaves a
``GraphInterrupt`` exception event on the interrupted tool's span, a
``Command(resume=...)`` is the input of the next run's root span, and a graph run
with a checkpointer names its thread and checkpoint namespace in every node span's
metadata. None of that is a ``durable.*`` attribute; this module turns it into the
records the session rules read: a wait (``workflow_state: awaiting_approval``, named
``approval:<tool>:<call>``, plan = the call), a decision (``approval_decision``) and a
checkpoint after each LangGraph step.

Durable runtimes also say what they recorded. DBOS (``dbos-tracer``) puts the workflow id
and the operation type on its workflow and step spans: a step that completed is recorded,
so its end is a checkpoint, and the identity stage (processor/evaluate/identity.py) tells a
step served from the record on recovery from one run again. A LangGraph model or tool span
inside a node names the node's checkpoint in its metadata: what it produced is recorded once
that checkpoint is seen.

Payloads are parsed only when a cheap prefix test says they have the expected shape,
and only up to a size bound; nothing read is copied into a record except ids and names.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any, Final

from processor.convert.options import ConvertOptions
from processor.convert.profiles import (
    GENAI_OPERATION,
    OI_OUTPUT_VALUE,
    OI_SPAN_KIND,
    OI_TOOL_NAME,
    AnyValue,
    text,
)
from processor.records import ROLE_DEFERRED

PYDANTIC_AI_FINAL_RESULT: Final = "final_result"
OI_INPUT_VALUE: Final = "input.value"
OI_METADATA: Final = "metadata"
# DBOS span attributes, in its default ("legacy") naming and its semantic-conventions naming.
DBOS_TYPE_KEYS: Final = ("operationType", "dbos.operation.type")
DBOS_WORKFLOW_KEYS: Final = ("operationUUID", "dbos.operation.workflow_id")
# The OpenAI Agents SDK's tool spans (through OpenInference) describe the tool; one without output
# is a call paused for approval (needs_approval), which did not run.
OI_TOOL_PARAMETERS: Final = "tool.parameters"
KEYS: Final = frozenset({
    PYDANTIC_AI_FINAL_RESULT, OI_INPUT_VALUE, OI_METADATA, OI_TOOL_PARAMETERS, *DBOS_TYPE_KEYS, *DBOS_WORKFLOW_KEYS,
})
# Read on span events (LangGraph's interrupt is an exception event).
EXCEPTION_TYPE: Final = "exception.type"
EXCEPTION_MESSAGE: Final = "exception.message"
EVENT_KEYS: Final = frozenset({EXCEPTION_TYPE, EXCEPTION_MESSAGE})

# Payloads past this size are not parsed: a deferred-tools result or a resume command is small.
_PARSE_LIMIT: Final = 64 * 1024
_INTERRUPT_TYPE: Final = "GraphInterrupt"
_INTERRUPT_ID: Final = re.compile(r"\bid='([0-9A-Za-z_-]{1,128})'")
# How LangGraph's Command serialises: every field is present, resume among them.
_COMMAND_PREFIX: Final = '{"graph": '
# How a ToolNode task's input starts (the tool call it runs, sent with its state).
_TOOL_CALL_INPUT: Final = '{"__type": "tool_call_with_context"'
_ID_LIMIT: Final = 256
# LangGraph's interrupt ids: 32 hex digits (a hash of the task's checkpoint namespace).
_INTERRUPT_KEY: Final = re.compile(r"[0-9a-f]{32}")
# How deep a resume value is searched for a decision ({"decision": {"type": "approve"}}).
_DECISION_DEPTH: Final = 4
_STATUS_CODE_ERROR: Final = 2
# How LangChain's tracer serialises node metadata (json.dumps with its default separators).
_NODE_KEY: Final = '"langgraph_node": '
_THREAD_KEY: Final = '"thread_id": '
_CHECKPOINT_NS_KEY: Final = '"langgraph_checkpoint_ns": '


@dataclass(frozen=True, slots=True)
class Derived:
    """A record a framework's span implies: its fields (action id and kind included) and when it happened."""

    fields: dict[str, Any]
    time_ns: int
    # The record of a durable runtime's completed step: the step's name (see SpanLinks.step).
    step: str = ""
    # SpanLinks.role of the record (ROLE_DEFERRED: the decision is derived from the next run).
    role: int = 0


@dataclass(frozen=True, slots=True)
class Reading:
    """What the frameworks' conventions say about a span."""

    derived: tuple[Derived, ...] = ()
    # The span's own action did not happen (an interrupted tool waits instead of running).
    suppress_span: bool = False
    # The checkpoint that records what the span's action produced, once seen (a LangGraph node's).
    covered_by: str = ""
    # The durable runtime's workflow the span runs in (a DBOS workflow id).
    workflow: str = ""


NOTHING: Final = Reading()


def _loads(value: AnyValue | None, prefix: str) -> Any:
    raw = text(value) if value is not None else None
    if not raw or len(raw) > _PARSE_LIMIT or not raw.startswith(prefix):
        return None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # nesting deep enough to exhaust the parser is no command either
        return None


def _short(value: Any) -> str | None:
    return value if isinstance(value, str) and 0 < len(value) <= _ID_LIMIT else None


def _wait(tool: str, call: str, state: str, options: ConvertOptions, time_ns: int) -> Derived:
    fields: dict[str, Any] = {
        "action_id": f"approval:{tool}:{call}" if state == "awaiting_approval" else f"wait:{tool}:{call}",
        "kind": "approval" if state == "awaiting_approval" else "tool_call",
        "workflow_state": state,
        "plan_version": call,
    }
    if options.approval_wait_timeout is not None and options.approval_wait_timeout > 0:
        fields["wait_timeout_s"] = float(options.approval_wait_timeout)
    return Derived(fields, time_ns)


def _pydantic_ai_deferred(found: dict[str, AnyValue], span: Any, options: ConvertOptions) -> Reading:
    """A run that ended with DeferredToolRequests: one wait per call awaiting approval or an external result."""
    result = _loads(found.get(PYDANTIC_AI_FINAL_RESULT), "{")
    if not isinstance(result, dict) or not isinstance(result.get("approvals"), list):
        return NOTHING
    derived: list[Derived] = []
    time_ns = span.end_time_unix_nano or span.start_time_unix_nano
    for key, state in (("approvals", "awaiting_approval"), ("calls", "waiting_on_external")):
        calls = result.get(key)
        if not isinstance(calls, list):
            continue
        for call in calls:
            if not isinstance(call, dict):
                continue
            tool, call_id = _short(call.get("tool_name")), _short(call.get("tool_call_id"))
            if tool and call_id:
                wait = _wait(tool, call_id, state, options, time_ns)
                if state == "awaiting_approval":
                    wait = Derived(wait.fields, wait.time_ns, role=ROLE_DEFERRED)
                derived.append(wait)
    return Reading(tuple(derived))


def _interrupt_id(span: Any) -> str | None:
    """The id of the LangGraph interrupt recorded on the span, or None when it was not interrupted."""
    for event in span.events:
        if event.name != "exception":
            continue
        kind = message = ""
        for kv in event.attributes:
            if kv.key == EXCEPTION_TYPE:
                kind = text(kv.value) or ""
            elif kv.key == EXCEPTION_MESSAGE:
                message = text(kv.value) or ""
        if kind.rsplit(".", 1)[-1] == _INTERRUPT_TYPE:
            match = _INTERRUPT_ID.search(message[:_PARSE_LIMIT])
            return match.group(1) if match else span.span_id.hex()
    return None


def _decision(resume: Any, options: ConvertOptions, depth: int = 0) -> str | None:
    """granted / denied when the resume value reads as one (a word, a boolean, or a dict naming it)."""
    if depth > _DECISION_DEPTH:
        return None
    if isinstance(resume, bool):
        return "granted" if resume else "denied"
    if isinstance(resume, str):
        word = resume.strip().lower()
        if word in options.approval_grant_words:
            return "granted"
        if word in options.approval_deny_words:
            return "denied"
        return None
    if isinstance(resume, dict):
        for key in ("approved", "approve"):
            if isinstance(resume.get(key), bool):
                return "granted" if resume[key] else "denied"
        for key in ("decision", "type", "action"):
            if key in resume:
                return _decision(resume[key], options, depth + 1)
        decisions = resume.get("decisions")
        if isinstance(decisions, list) and decisions:
            found = {_decision(d, options, depth + 1) for d in decisions}
            return "denied" if "denied" in found else ("granted" if found == {"granted"} else None)
    return None


def _langgraph_resume(found: dict[str, AnyValue], span: Any, options: ConvertOptions, thread: str | None) -> Reading:
    command = _loads(found.get(OI_INPUT_VALUE), _COMMAND_PREFIX)
    if not isinstance(command, dict) or "resume" not in command or command.get("resume") is None:
        return NOTHING
    resume = command["resume"]
    # Command(resume={interrupt_id: value, ...}) answers each interrupt by its id.
    keyed = isinstance(resume, dict) and resume and all(_INTERRUPT_KEY.fullmatch(k) for k in resume)
    answers: list[tuple[str | None, Any]] = list(resume.items()) if keyed else [(None, resume)]
    derived: list[Derived] = []
    time_ns = span.start_time_unix_nano
    for index, (interrupt, value) in enumerate(answers):
        decision = _decision(value, options)
        base = f"resume:{thread or span.trace_id.hex()}:{span.span_id.hex()}"
        fields: dict[str, Any] = {"action_id": f"{base}:{interrupt or index}", "kind": "approval"}
        if decision is not None:
            fields["approval_decision"] = decision
        else:
            fields["workflow_state"] = "executing"  # an answer that is no decision still ends the wait
        if interrupt:
            fields["plan_version"] = interrupt
        derived.append(Derived(fields, time_ns))
    return Reading(tuple(derived))


@functools.lru_cache(maxsize=1024)
def _node_key(name: str) -> str:
    """``"langgraph_node": "<name>"`` as the metadata spells it (a graph has a few node names: cached)."""
    return _NODE_KEY + json.dumps(name, ensure_ascii=False)


def _metadata(found: dict[str, AnyValue]) -> dict[str, Any] | None:
    meta = _loads(found.get(OI_METADATA), "{")
    return meta if isinstance(meta, dict) else None


def read(found: dict[str, AnyValue], span: Any, options: ConvertOptions) -> Reading:
    """The framework records ``span`` implies (``found``: its attributes of the keys this module reads).

    Cheap tests come first: most spans that hold these keys (every LangChain span has
    ``metadata`` and ``input.value``) imply nothing, and are let go without parsing.
    """
    if options.dbos_steps:
        workflow = _first(found, DBOS_WORKFLOW_KEYS)
        if workflow:
            return _dbos(found, span, workflow)
    if options.framework_approvals and PYDANTIC_AI_FINAL_RESULT in found:
        operation = found.get(GENAI_OPERATION)
        if operation is not None and text(operation) == "invoke_agent":
            return _pydantic_ai_deferred(found, span, options)
    span_kind = found.get(OI_SPAN_KIND)
    raw_meta = found.get(OI_METADATA)
    if span_kind is None:
        return NOTHING
    if raw_meta is None:
        if options.framework_approvals and OI_TOOL_PARAMETERS in found and OI_OUTPUT_VALUE not in found:
            return _paused_call(found, span)
        return NOTHING
    kind = (text(span_kind) or "").upper()
    if kind == "LLM":
        return _covered(found, options)
    if kind == "TOOL":
        interrupt = _interrupt_id(span) if options.framework_approvals and len(span.events) > 0 else None
        if interrupt is None:
            return _covered(found, options)
        tool = found.get(OI_TOOL_NAME)
        name = (text(tool) if tool is not None else None) or span.name
        time_ns = span.end_time_unix_nano or span.start_time_unix_nano
        return Reading((_wait(name, interrupt, "awaiting_approval", options, time_ns),), suppress_span=True)
    if kind not in ("CHAIN", "AGENT"):
        return NOTHING
    # A Command is the input of a graph run, the root span of its trace (a graph run inside
    # another's trace is a node there); only roots pay for reading their input.
    if options.framework_approvals and not span.parent_span_id:
        command = found.get(OI_INPUT_VALUE)
        if command is not None and (text(command) or "").startswith(_COMMAND_PREFIX):
            meta = _metadata(found)
            if meta is not None and "langgraph_node" not in meta:
                reading = _langgraph_resume(found, span, options, _short(meta.get("thread_id")))
                if reading.derived:
                    return reading
    if not span.end_time_unix_nano or span.status.code == _STATUS_CODE_ERROR:
        # A step that failed saved nothing: LangGraph checkpoints the steps that completed.
        return NOTHING
    # Only the node's own span (not the runnables inside it) ends the step: its name is the node's.
    raw = text(raw_meta) or ""
    if _THREAD_KEY not in raw or _node_key(span.name) not in raw:
        return NOTHING
    meta = _metadata(found)
    thread = _short(meta.get("thread_id")) if meta is not None else None
    if meta is None or thread is None or meta.get("langgraph_node") != span.name:
        return NOTHING
    interrupt = _interrupt_id(span) if len(span.events) > 0 else None
    if interrupt is not None:
        # interrupt() in a node of its own (a human review step) is the wait; in a tool node
        # the tool's span already is.
        if not options.framework_approvals or _tool_node(found, span.name):
            return NOTHING
        return Reading((_wait(span.name, interrupt, "awaiting_approval", options, span.end_time_unix_nano),))
    if not options.langgraph_checkpoints:
        return NOTHING
    namespace = _short(meta.get("langgraph_checkpoint_ns")) or span.span_id.hex()
    fields = {"action_id": f"checkpoint:{thread}:{namespace}", "kind": "checkpoint", "result": True}
    return Reading((Derived(fields, span.end_time_unix_nano, step=span.name),))


def _tool_node(found: dict[str, AnyValue], name: str) -> bool:
    """A LangGraph ToolNode task: its input is the tool call it runs (or, called with the whole
    state, it has the prebuilt agents' name for it)."""
    value = found.get(OI_INPUT_VALUE)
    return name == "tools" or (value is not None and (text(value) or "").startswith(_TOOL_CALL_INPUT))


def _first(found: dict[str, AnyValue], keys: tuple[str, ...]) -> str:
    for key in keys:
        value = found.get(key)
        if value is not None:
            found_text = _short(text(value))
            if found_text:
                return found_text
    return ""


def _dbos(found: dict[str, AnyValue], span: Any, workflow: str) -> Reading:
    """A DBOS span: its workflow, and for a step that completed, the step's record (a checkpoint).

    DBOS writes a step's output to its system database before the step's span ends, and
    returns that output instead of running the step again on recovery; a step that failed
    recorded its error, not an outcome to build on, and one whose span never ended never
    completed. The record's id is finished in the identity stage, which numbers the
    workflow's steps (DBOS's own step ids are not on the spans).
    """
    if _first(found, DBOS_TYPE_KEYS) != "step" or not span.end_time_unix_nano or span.status.code == _STATUS_CODE_ERROR:
        return Reading(workflow=workflow)
    name = (span.name or "step")[:_ID_LIMIT]
    fields = {"action_id": f"checkpoint:dbos:{workflow}:{name}", "kind": "checkpoint", "result": True}
    return Reading((Derived(fields, span.end_time_unix_nano, step=name),), workflow=workflow)


def _covered(found: dict[str, AnyValue], options: ConvertOptions) -> Reading:
    """A model or tool span inside a LangGraph node of a run with a checkpointer: the node's
    checkpoint, saved when the node completes, holds what the span produced."""
    if not options.langgraph_checkpoints:
        return NOTHING
    raw = text(found[OI_METADATA]) or ""
    if _THREAD_KEY not in raw or _CHECKPOINT_NS_KEY not in raw:
        return NOTHING
    meta = _metadata(found)
    if meta is None:
        return NOTHING
    thread, namespace = _short(meta.get("thread_id")), _short(meta.get("langgraph_checkpoint_ns"))
    if thread is None or namespace is None or not isinstance(meta.get("langgraph_node"), str):
        return NOTHING
    return Reading(covered_by=f"checkpoint:{thread}:{namespace}")


_PAUSED: Final = Reading(suppress_span=True)


def _paused_call(found: dict[str, AnyValue], span: Any) -> Reading:
    """An Agents SDK tool span with no output: the call was interrupted for approval, not run.

    The SDK ends the span of a ``needs_approval`` call when the run stops for the decision;
    the tool's code never ran, so the span is no tool call, let alone a side effect. It is no
    wait record either: it names neither the session (the SDK does not export ``group_id``)
    nor the call, so a deadline on it could never be met by the decision the code records.
    The wait is the code's ``annotate.waiting(...)`` (docs/frameworks.md).
    """
    if (text(found[OI_SPAN_KIND]) or "").upper() != "TOOL" or span.status.code == _STATUS_CODE_ERROR:
        return NOTHING
    return _PAUSED
