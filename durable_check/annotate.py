"""Set Durable Check's ``durable.*`` span attributes from agent code, without typing their names.

Two kinds of helpers, both needing only ``opentelemetry-api``:

- ``set_*`` functions annotate the span that is current (a tool span a framework opened,
  or one of yours): its session, kind, idempotency key, retry policy, plan.
- ``action``, ``awaiting_approval``, ``waiting``, ``approval_decision`` and
  ``checkpoint`` start a span of their own: each is one action record of the session
  (a wait, a decision, a checkpoint), so it cannot share a span with the work around it.

Every value is type-checked here, so a mistake fails in the agent's tests rather than
as a rejected span in the checker.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator, Mapping
from typing import Final, Literal

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, Tracer, TracerProvider
from opentelemetry.util.types import AttributeValue

SESSION: Final = "durable.session.id"
ACTION_ID: Final = "durable.action.id"
KIND: Final = "durable.action.kind"
STATUS: Final = "durable.action.status"
RESULT_RECORDED: Final = "durable.result.recorded"
RESULT_REF: Final = "durable.result_ref"
IDEMPOTENCY_KEY: Final = "durable.idempotency_key"
REPLAY: Final = "durable.replay"
SIDE_EFFECTS: Final = "durable.side_effects"
RETRYABLE: Final = "durable.retry.retryable"
MAX_ATTEMPTS: Final = "durable.retry.max_attempts"
ATTEMPT: Final = "durable.retry.attempt"
ON_FAILURE: Final = "durable.on_failure"
REPLAYED: Final = "durable.replayed"
WORKFLOW_STATE: Final = "durable.workflow.state"
WAIT_TIMEOUT_S: Final = "durable.wait.timeout_s"
PLAN_VERSION: Final = "durable.plan.version"
APPROVAL_DECISION: Final = "durable.approval.decision"
INPUT_FINGERPRINT: Final = "durable.input.fingerprint"

Decision = Literal["granted", "denied"]
WaitState = Literal["awaiting_approval", "waiting_on_external"]
OnFailure = Literal["ask_user", "abort", "compensate"]
WorkflowState = Literal[
    "planned", "awaiting_approval", "executing", "waiting_on_external",
    "retry_scheduled", "completed", "failed", "compensated",
]

_TRACER_NAME: Final = "durable_check.annotate"


def _tracer(provider: TracerProvider | None) -> Tracer:
    return trace.get_tracer(_TRACER_NAME, tracer_provider=provider)


def _text(name: str, value: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string")
    return value


def _count(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1")
    return value


def _timeout(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError("timeout_s must be a positive, finite number of seconds")
    return float(value)


def _plan(value: str | int) -> str | int:
    if isinstance(value, bool) or not isinstance(value, str | int) or value == "":
        raise ValueError("plan_version must be a non-empty string or an integer")
    return value


def _framework_span() -> Span | None:
    """The span of the framework step the code runs in, where OpenTelemetry's context does not say.

    LangChain (and LangGraph on it) runs a tool without making the tool's span current;
    OpenInference's LangChain instrumentation knows the span of the current run. Read only
    when that instrumentation is already imported: nothing is imported for it here.
    """
    module = sys.modules.get("openinference.instrumentation.langchain")
    getter = getattr(module, "get_current_span", None) if module is not None else None
    if getter is None:
        return None
    try:
        span = getter()
    except Exception:
        return None
    return span if isinstance(span, Span) and span.get_span_context().is_valid else None


def _current(span: Span | None) -> Span:
    if span is not None:
        return span
    return _framework_span() or trace.get_current_span()


def _parent_context() -> Context | None:
    """Where a helper's own span goes: under the framework step's span when there is one."""
    span = _framework_span()
    return trace.set_span_in_context(span) if span is not None else None


# -- the current span ----------------------------------------------------------------------


def set_session(session_id: str, span: Span | None = None) -> None:
    """The session (conversation, workflow run) the span's action belongs to."""
    _current(span).set_attribute(SESSION, _text("session_id", session_id))


def set_action(
    kind: str,
    *,
    action_id: str | None = None,
    side_effects: bool | None = None,
    result_recorded: bool | None = None,
    result_ref: str | None = None,
    input_fingerprint: str | None = None,
    span: Span | None = None,
) -> None:
    """What the span's action is: its kind (``payment``, ``write``, ``user_prompt``...), a stable id,
    and whether its outcome is durably recorded (``result_recorded`` or a ``result_ref``)."""
    attributes: dict[str, AttributeValue] = {KIND: _text("kind", kind)}
    if action_id is not None:
        attributes[ACTION_ID] = _text("action_id", action_id)
    if side_effects is not None:
        attributes[SIDE_EFFECTS] = bool(side_effects)
    if result_recorded is not None:
        attributes[RESULT_RECORDED] = bool(result_recorded)
    if result_ref is not None:
        attributes[RESULT_REF] = _text("result_ref", result_ref)
    if input_fingerprint is not None:
        attributes[INPUT_FINGERPRINT] = _text("input_fingerprint", input_fingerprint)
    _current(span).set_attributes(attributes)


def set_idempotency_key(key: str, span: Span | None = None) -> None:
    """The key the side effect was sent with: recovery may then repeat it safely."""
    _current(span).set_attribute(IDEMPOTENCY_KEY, _text("key", key))


def set_replayed(span: Span | None = None) -> None:
    """This outcome was served from the durable log, not executed again."""
    _current(span).set_attribute(REPLAYED, True)


def set_retry(
    *, attempt: int, max_attempts: int | None, retryable: bool = True, span: Span | None = None
) -> None:
    """The retry policy and this attempt's number (from 1). ``max_attempts=None`` says there is no cap."""
    attributes: dict[str, AttributeValue] = {RETRYABLE: bool(retryable), ATTEMPT: _count("attempt", attempt)}
    if max_attempts is not None:
        attributes[MAX_ATTEMPTS] = _count("max_attempts", max_attempts)
    _current(span).set_attributes(attributes)


def set_on_failure(on_failure: OnFailure, span: Span | None = None) -> None:
    """What recovery does when this action fails for good."""
    if on_failure not in ("ask_user", "abort", "compensate"):
        raise ValueError("on_failure must be ask_user, abort or compensate")
    _current(span).set_attribute(ON_FAILURE, on_failure)


def set_plan(plan_version: str | int, *, state: WorkflowState | None = None, span: Span | None = None) -> None:
    """The plan (or the approved call) the span's action carries out, e.g. a gated tool's call id."""
    attributes: dict[str, AttributeValue] = {PLAN_VERSION: _plan(plan_version)}
    if state is not None:
        attributes[WORKFLOW_STATE] = state
    _current(span).set_attributes(attributes)


# -- actions of their own --------------------------------------------------------------------


def _fields(
    *, session_id: str | None, action_id: str, kind: str, extra: Mapping[str, AttributeValue]
) -> dict[str, AttributeValue]:
    attributes: dict[str, AttributeValue] = {ACTION_ID: _text("action_id", action_id), KIND: _text("kind", kind)}
    if session_id is not None:
        attributes[SESSION] = _text("session_id", session_id)
    attributes.update(extra)
    return attributes


@contextlib.contextmanager
def action(
    name: str,
    kind: str,
    *,
    action_id: str,
    session_id: str | None = None,
    idempotency_key: str | None = None,
    plan_version: str | int | None = None,
    tracer_provider: TracerProvider | None = None,
) -> Iterator[Span]:
    """A span that is one action of ``kind``; an exception escaping it marks the action failed."""
    extra: dict[str, AttributeValue] = {}
    if idempotency_key is not None:
        extra[IDEMPOTENCY_KEY] = _text("idempotency_key", idempotency_key)
    if plan_version is not None:
        extra[PLAN_VERSION] = _plan(plan_version)
    attributes = _fields(session_id=session_id, action_id=action_id, kind=kind, extra=extra)
    with _tracer(tracer_provider).start_as_current_span(name, context=_parent_context(), attributes=attributes) as span:
        yield span


def _emit(name: str, attributes: Mapping[str, AttributeValue], provider: TracerProvider | None) -> None:
    with _tracer(provider).start_as_current_span(name, context=_parent_context(), attributes=attributes):
        pass


def waiting(
    wait_id: str,
    *,
    state: WaitState = "waiting_on_external",
    timeout_s: float | None,
    plan_version: str | int | None = None,
    session_id: str | None = None,
    tracer_provider: TracerProvider | None = None,
) -> None:
    """The session starts waiting (for a webhook, a human, another system) now.

    ``timeout_s=None`` is allowed but says there is no deadline, which the checker
    reports: a wait that never ends is never noticed."""
    extra: dict[str, AttributeValue] = {WORKFLOW_STATE: state}
    if timeout_s is not None:
        extra[WAIT_TIMEOUT_S] = _timeout(timeout_s)
    if plan_version is not None:
        extra[PLAN_VERSION] = _plan(plan_version)
    # The wait itself reads nothing and changes nothing: a neutral kind (the answer is its own action).
    kind = "approval" if state == "awaiting_approval" else "tool_call"
    _emit(f"wait {wait_id}", _fields(session_id=session_id, action_id=wait_id, kind=kind, extra=extra), tracer_provider)


def awaiting_approval(
    tool: str,
    call_id: str,
    *,
    timeout_s: float | None,
    session_id: str | None = None,
    tracer_provider: TracerProvider | None = None,
) -> None:
    """The session waits for a human to approve the call ``call_id`` of ``tool``.

    The wait's action id is ``approval:<tool>:<call_id>`` and its plan the call id, the
    names the checker gives the waits it recognises in framework spans."""
    waiting(
        f"approval:{_text('tool', tool)}:{_text('call_id', call_id)}",
        state="awaiting_approval",
        timeout_s=timeout_s,
        plan_version=call_id,
        session_id=session_id,
        tracer_provider=tracer_provider,
    )


def approval_decision(
    call_id: str,
    decision: Decision,
    *,
    tool: str | None = None,
    session_id: str | None = None,
    tracer_provider: TracerProvider | None = None,
) -> None:
    """A human granted or denied the call ``call_id`` (its plan): record it before acting on it."""
    if decision not in ("granted", "denied"):
        raise ValueError("decision must be granted or denied")
    prefix = f"approval:{_text('tool', tool)}:" if tool is not None else "approval:"
    extra: dict[str, AttributeValue] = {APPROVAL_DECISION: decision, PLAN_VERSION: _text("call_id", call_id)}
    fields = _fields(session_id=session_id, action_id=f"{prefix}{call_id}:decision", kind="approval", extra=extra)
    _emit(f"approval {decision}", fields, tracer_provider)


def checkpoint(
    checkpoint_id: str,
    *,
    session_id: str | None = None,
    tracer_provider: TracerProvider | None = None,
) -> None:
    """The session's state is durably saved now (after a side effect, before the next action)."""
    fields = _fields(session_id=session_id, action_id=_text("checkpoint_id", checkpoint_id), kind="checkpoint",
                     extra={RESULT_RECORDED: True})
    _emit("checkpoint", fields, tracer_provider)
