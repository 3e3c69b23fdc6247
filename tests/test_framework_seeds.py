"""The seed's durability scenarios, written once and run by pydantic-ai, LangGraph and the
OpenAI Agents SDK (real libraries, offline; see framework_support.py).

- crash between a side effect and the step's completion;
- retry after a transient failure;
- a workflow resumed after a delay on another instance (clean when replayed, DS101 when
  the human is re-asked);
- duplicate delivery of the same export.

The denied approval is tested with each framework's own approval mechanism in
test_framework_approvals.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from langgraph.checkpoint.memory import InMemorySaver

from durable_check import annotate
from processor.evaluate.engine import Engine, EngineOptions
from processor.records import Action
from processor.violations import Violation
from tests._engine_util import shipped
from tests.framework_support import FRAMEWORKS, Process, run_program, serve_and_replay

SESSION = "trip-2291"


class ProcessKilled(Exception):
    """The process dies here (what a crash looks like from inside the tool)."""


def check(actions: Sequence[Action]) -> tuple[list[Violation], Engine]:
    engine = Engine(shipped(), EngineOptions())
    out = engine.submit_many(actions) + engine.finish()
    # A model reply is not a durably recorded result unless telemetry is the log: DS001 on
    # every model call, the same for all three frameworks and beside these scenarios' point.
    return [v for v in out if not (v.rule == "DS001" and v.kind == "llm_call")], engine


def verdicts(actions: Sequence[Action]) -> list[tuple[str, str, str]]:
    instance = {(a.record["trace_id"], a.record["span_id"]): str(a.record.get("instance")) for a in actions}
    out, _ = check(actions)
    return sorted((v.rule, v.action_id, instance[v.trace_id, v.span_id]) for v in out)


def _deposit(process: Process, *, crash: bool, checkpoint: bool, keyed: bool = True) -> Any:
    def take_deposit(order: str) -> str:
        with annotate.action("charge card", "payment", action_id="pay-deposit", session_id=SESSION,
                             idempotency_key="trip-2291-deposit" if keyed else None,
                             tracer_provider=process.provider):
            pass
        if crash:
            raise ProcessKilled("killed after the payment, before anything recorded it")
        if checkpoint:
            annotate.checkpoint("ckpt-deposit", session_id=SESSION, tracer_provider=process.provider)
        return "paid"

    return take_deposit


@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "unkeyed"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_crash_between_side_effect_and_completion(framework: str, keyed: bool, tmp_path: Path) -> None:
    saver = InMemorySaver()  # LangGraph's checkpointer: a database both instances share
    calls = [("take_deposit", {"order": "42"})]
    before = Process("pod-a")
    with pytest.raises(Exception) as crash:
        run_program(framework, before, calls,
                    {"take_deposit": _deposit(before, crash=True, checkpoint=False, keyed=keyed)},
                    session=SESSION, saver=saver)
    assert "killed after the payment" in str(crash.value) or isinstance(crash.value, ProcessKilled)
    after = Process("pod-b")
    # LangGraph checkpoints each completed step by itself; the others need the code to.
    run_program(framework, after, calls,
                {"take_deposit": _deposit(after, crash=False, checkpoint=framework != "langgraph", keyed=keyed)},
                session=SESSION, saver=saver, resume=framework == "langgraph")
    # The payment was never checkpointed before the next action began, so recovery ran it again.
    expected = [("DS110", "pay-deposit", "pod-a")]
    if not keyed:
        # Without a key the second run is a second charge; with the first one's key it is a no-op.
        expected += [("DS002", "pay-deposit", "pod-a"), ("DS002", "pay-deposit", "pod-b"),
                     ("DS101", "pay-deposit", "pod-b")]
    assert verdicts(before.actions() + after.actions()) == sorted(expected)
    served = serve_and_replay(tmp_path, [before, after])
    assert {(rule, SESSION, action) for rule, action, _ in expected} == {k for k in served if k[0] != "DS001"}


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_retry_after_transient_failure_is_clean(framework: str, tmp_path: Path) -> None:
    process = Process("pod-a")
    attempts: list[int] = []

    def find_flights(order: str) -> str:
        attempts.append(len(attempts) + 1)
        try:
            with annotate.action("search flights", "external_read", action_id="search", session_id=SESSION,
                                 tracer_provider=process.provider) as span:
                annotate.set_retry(attempt=attempts[-1], max_attempts=3, span=span)
                if attempts[-1] == 1:
                    raise ConnectionError("timeout")
                annotate.set_action("external_read", result_recorded=True, span=span)
        except ConnectionError:
            return "temporary failure, try again"
        return "3 flights"

    calls = [("find_flights", {"order": "42"}), ("find_flights", {"order": "42"})]
    run_program(framework, process, calls, {"find_flights": find_flights}, session=SESSION)
    actions = process.actions()
    searches = [a.record for a in actions if a.record["action_id"] == "search"]
    assert [(r["status"], r["attempts"]) for r in searches] == [("error", 1), ("ok", 2)]
    assert verdicts(actions) == []
    assert {rule for rule, _, _ in serve_and_replay(tmp_path, [process])} <= {"DS001"}  # model replies only


def _trip(process: Process, *, replayed: bool, approved: bool) -> dict[str, Any]:
    def ask_traveller(order: str) -> str:
        if replayed:
            annotate.set_replayed()  # the framework's tool span, where it is the current span
        with annotate.action("ask traveller", "user_prompt", action_id="ask-dates", session_id=SESSION,
                             tracer_provider=process.provider) as span:
            annotate.set_action("user_prompt", result_recorded=True, span=span)
            if replayed:
                annotate.set_replayed(span)  # the answer is read back from the session's log
        return "in May"

    def request_booking(order: str) -> str:
        if not approved:
            annotate.awaiting_approval("book_trip", "plan-v1", timeout_s=86400, session_id=SESSION,
                                       tracer_provider=process.provider)
            raise ProcessKilled("the process stops while it waits for the approval")
        with annotate.action("book", "write", action_id="book", session_id=SESSION, plan_version="plan-v1",
                             idempotency_key="trip-2291-book", tracer_provider=process.provider):
            pass
        annotate.checkpoint("ckpt-book", session_id=SESSION, tracer_provider=process.provider)
        return "booked"

    return {"ask_traveller": ask_traveller, "request_booking": request_booking}


def _resumed_workflow(framework: str, *, reask: bool, tmp_path: Path) -> tuple[list[Action], set[Any]]:
    calls = [("ask_traveller", {"order": "42"}), ("request_booking", {"order": "42"})]
    saver = InMemorySaver()
    before = Process("pod-a")
    with pytest.raises(Exception, match="waits for the approval"):
        run_program(framework, before, calls, _trip(before, replayed=False, approved=False),
                    session=SESSION, saver=saver)
    # Later, the approval arrives and another instance resumes the workflow.
    after = Process("pod-c")
    annotate.approval_decision("plan-v1", "granted", tool="book_trip", session_id=SESSION,
                               tracer_provider=after.provider)
    # LangGraph resumes the thread from its checkpoints (unless they were lost with the
    # process); the others run the program again and must replay what is already done.
    resume = framework == "langgraph" and not reask
    run_program(framework, after, calls, _trip(after, replayed=not reask, approved=True), session=SESSION,
                saver=saver if resume else InMemorySaver(), resume=resume)
    return before.actions() + after.actions(), serve_and_replay(tmp_path, [before, after])


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_workflow_resumed_after_delay_with_replayed_outcomes_is_clean(framework: str, tmp_path: Path) -> None:
    actions, served = _resumed_workflow(framework, reask=False, tmp_path=tmp_path)
    assert {rule for rule, _, _ in served} <= {"DS001"}  # model replies only
    out, engine = check(actions)
    assert out == []
    assert engine.summary().open_waits == []


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_workflow_resumed_after_delay_that_reasks_the_human(framework: str, tmp_path: Path) -> None:
    # The question is asked inside the tool with annotate.action: that action is the tool call (one
    # action per call), so the re-asked human is reported once, not again on the tool's own span.
    expected = [("DS101", "ask-dates", "pod-c")]
    actions, served = _resumed_workflow(framework, reask=True, tmp_path=tmp_path)
    assert verdicts(actions) == expected
    assert {(rule, action) for rule, _, action in served if rule != "DS001"} == {(r, a) for r, a, _ in expected}


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_duplicate_delivery_counts_once(framework: str, tmp_path: Path) -> None:
    process = Process("pod-a")

    def take_deposit(order: str) -> str:
        with annotate.action("charge card", "payment", action_id="pay", session_id=SESSION,
                             tracer_provider=process.provider):
            pass  # no idempotency key: DS002
        annotate.checkpoint("ckpt", session_id=SESSION, tracer_provider=process.provider)
        return "paid"

    run_program(framework, process, [("take_deposit", {"order": "42"})], {"take_deposit": take_deposit},
                session=SESSION)
    once = process.actions()
    single, _ = check(once)
    assert [(v.rule, v.action_id) for v in single] == [("DS002", "pay")]
    # OTLP is at-least-once: the same export arrives again, interleaved and whole.
    twice = process.actions()
    out, engine = check(once[:2] + twice + once[2:])
    assert sorted(v.violation_id for v in out) == sorted(v.violation_id for v in single)
    # Every action the identity stage passed on the first time is a duplicate the second time (a
    # tool span holding the annotated payment is no action of its own, either time).
    first = Engine(shipped(), EngineOptions())
    first.keep_admitted = True
    first.submit_many(once)
    first.finish()
    assert engine.duplicates == len(first.take_admitted())
    # Over OTLP too: the same spans sent twice, and in the dump twice.
    served = serve_and_replay(tmp_path, [process, process])
    assert {(rule, action) for rule, _, action in served if rule != "DS001"} == {("DS002", "pay")}
