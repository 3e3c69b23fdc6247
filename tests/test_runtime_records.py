"""What a durable runtime records counts: DBOS steps, LangGraph nodes, one action per tool call.

The DBOS tests build the spans DBOS emits (its ``dbos-tracer`` workflow and step spans with
``operationType`` and ``operationUUID``, nested as pydantic-ai's DBOS integration nests them:
the model request and the tool's work are steps under the framework's own spans) through
the real OpenTelemetry SDK, one process per resource, the recovered run a trace of its own.
The real frameworks and DBOS itself run in tests/test_durable_runtimes.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Span, Status, StatusCode

from durable_check import annotate
from processor.convert.options import ConvertOptions
from processor.convert.spans import SpanConverter
from processor.evaluate.engine import Engine, EngineOptions
from processor.evaluate.identity import IdentityResolver, IdentityState
from processor.records import Action
from processor.violations import Violation
from tests._engine_util import shipped
from tests.framework_support import FRAMEWORKS, Process, run_program

WORKFLOW = "wf-7f3a"
CONVERSATION = "conv-billing-1"


class DbosProcess:
    """One process of a DBOS application: its resource, its spans, a clock under the test's control."""

    def __init__(self, instance: str) -> None:
        self.memory = InMemorySpanExporter()
        self.provider = TracerProvider(resource=Resource.create({"service.name": "billing",
                                                                 "service.instance.id": instance}))
        self.provider.add_span_processor(SimpleSpanProcessor(self.memory))
        self.tracer = self.provider.get_tracer("tests")
        self.dbos = self.provider.get_tracer("dbos-tracer")
        self.now = 0

    def tick(self) -> int:
        # The wall clock, as the annotate helper's own spans use it; strictly increasing.
        self.now = max(time.time_ns(), self.now + 1_000)
        return self.now

    @contextmanager
    def span(self, name: str, attributes: dict[str, Any], *, dbos: bool = False, ends: bool = True,
             error: bool = False) -> Iterator[Span]:
        """A span; ``ends=False``: the process dies inside it, so it is never exported."""
        tracer = self.dbos if dbos else self.tracer
        with tracer.start_as_current_span(name, attributes=attributes, start_time=self.tick(),
                                          end_on_exit=False) as span:
            yield span
            if ends:
                if error:
                    span.set_status(Status(StatusCode.ERROR))
                span.end(end_time=self.tick())

    def workflow(self, *, ends: bool = True) -> Any:
        return self.span("billing_workflow", {"operationType": "workflow", "operationUUID": WORKFLOW,
                                                "executorID": "local"}, dbos=True, ends=ends)

    def step(self, name: str, *, ends: bool = True, error: bool = False) -> Any:
        return self.span(name, {"operationType": "step", "operationUUID": WORKFLOW, "executorID": "local"},
                         dbos=True, ends=ends, error=error)

    def agent_run(self, *, conversation: str | None = CONVERSATION, ends: bool = True) -> Any:
        attributes: dict[str, Any] = {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "billing"}
        if conversation is not None:
            attributes["gen_ai.conversation.id"] = conversation
        return self.span("invoke_agent billing", attributes, ends=ends)

    def chat(self, *, conversation: str | None = CONVERSATION, ends: bool = True, error: bool = False) -> Any:
        attributes: dict[str, Any] = {"gen_ai.operation.name": "chat", "gen_ai.request.model": "fake-model"}
        if conversation is not None:
            attributes["gen_ai.conversation.id"] = conversation
        return self.span("chat fake-model", attributes, ends=ends, error=error)

    def tool(self, call: str, *, conversation: str | None = CONVERSATION, ends: bool = True) -> Any:
        attributes: dict[str, Any] = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "charge_card",
                                      "gen_ai.tool.call.id": call}
        if conversation is not None:
            attributes["gen_ai.conversation.id"] = conversation
        return self.span("execute_tool charge_card", attributes, ends=ends)

    def model_request(self, *, ends: bool = True) -> None:
        """A model request, a DBOS step under the framework's chat span (its reply is the step's output)."""
        with self.chat(ends=ends), self.step("billing__model.request", ends=ends):
            pass

    def charge(self, call: str, *, keyed: bool, crash_inside: bool = False) -> None:
        """The charging tool: its work a DBOS step, the payment inside it annotated as the docs say.
        ``crash_inside``: the process dies right after the payment, before the step completes."""
        with self.tool(call, ends=not crash_inside), self.step("charge_card", ends=not crash_inside), \
                annotate.action("charge card", "payment", action_id=f"charge-{call}",
                                idempotency_key=f"order-42-{call}" if keyed else None, tracer_provider=self.provider):
            self.tick()

    def request(self) -> Any:
        return encode_spans(self.memory.get_finished_spans())


def evaluate(*processes: DbosProcess | Process, options: ConvertOptions | None = None
             ) -> tuple[list[Violation], list[Action]]:
    """Each process's spans as it exported them, in order, through identity and the shipped packs."""
    converter = SpanConverter(options or ConvertOptions())
    engine = Engine(shipped(), EngineOptions())
    engine.keep_admitted = True
    out: list[Violation] = []
    for process in processes:
        out += engine.submit_many(converter.convert(process.request(), "test").items)
    out += engine.finish()
    return out, engine.take_admitted()


def findings(violations: Sequence[Violation]) -> list[tuple[str, str]]:
    return sorted((v.rule, v.action_id) for v in violations)


def first_run(*, keyed: bool, crash: str) -> DbosProcess:
    """The first process: a model request, the charge, a second model request; it dies at ``crash``
    ("none", "in_charge": right after the payment, "before_second_model": after the charge step)."""
    process = DbosProcess("pod-a")
    with process.workflow(ends=crash == "none"), process.agent_run(ends=crash == "none"):
        process.model_request()
        process.charge("call-1", keyed=keyed, crash_inside=crash == "in_charge")
        if crash == "in_charge":
            return process
        if crash == "before_second_model":
            return process
        process.model_request()
    return process


def recovery(*, keyed: bool, crash: str) -> DbosProcess:
    """The second process recovers the workflow: DBOS runs it again from the start, serving each
    completed step from its record and running the rest."""
    process = DbosProcess("pod-b")
    with process.workflow(), process.agent_run():
        process.model_request()  # completed before the crash: served from the record
        if crash == "in_charge":
            process.charge("call-1", keyed=keyed)  # never completed: runs again
        else:
            # Completed: DBOS returns the recorded output without running the step, so nothing inside it runs.
            with process.tool("call-1"), process.step("charge_card"):
                pass
        process.model_request()  # the second request: new in the recovered run
    return process


@pytest.mark.parametrize("crash", ["none", "in_charge", "before_second_model"])
@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "unkeyed"])
def test_dbos_steps_are_recorded_and_replayed_from_the_record(keyed: bool, crash: str) -> None:
    before = first_run(keyed=keyed, crash=crash)
    processes = [before] if crash == "none" else [before, recovery(keyed=keyed, crash=crash)]
    out, admitted = evaluate(*processes)
    # What really ran: the payment once, except when the process died inside the charging step
    # before DBOS recorded its completion, where recovery ran it a second time.
    payments = [a for a in admitted if a.record["kind"] == "payment" and not a.record.get("replayed")]
    assert len(payments) == (2 if crash == "in_charge" else 1)
    expected: list[tuple[str, str]] = []
    if not keyed:
        expected += [("DS002", "charge-call-1")] * len(payments)  # each charge that ran had no key
        if crash == "in_charge":
            expected.append(("DS101", "charge-call-1"))  # a second charge
    if crash == "in_charge":
        # The crash came between the payment and the step's record: recovery repeated the charge.
        expected.append(("DS110", "charge-call-1"))
    assert findings(out) == sorted(expected)
    # Every model reply is the output of a step DBOS recorded; none was asked for twice.
    models = [a.record for a in admitted if a.record["kind"] == "llm_call"]
    assert models and all(str(r.get("result_ref", "")).startswith(f"checkpoint:dbos:{WORKFLOW}:") for r in models)
    if crash != "none":
        replayed = sorted(r["action_id"] for r in (a.record for a in admitted) if r.get("replayed"))
        served = ["checkpoint:dbos:wf-7f3a:billing__model.request#1"]
        if crash == "before_second_model":
            served += ["call-1", "checkpoint:dbos:wf-7f3a:charge_card#1"]
        # The model reply served from the record: its chat span (a made-up id) and its step's record.
        assert [i for i in replayed if not i.startswith("span-")] == sorted(served)


def test_a_failed_step_is_no_record() -> None:
    process = DbosProcess("pod-a")
    # The model request raised: DBOS recorded the error, not a reply, and the error went up through
    # the framework's span too.
    with process.workflow(), process.agent_run(), process.chat(error=True), \
            process.step("billing__model.request", error=True):
        pass
    _, admitted = evaluate(process)
    assert [(a.record["kind"], a.record["status"]) for a in admitted] == [("llm_call", "error")]
    assert "result_ref" not in admitted[0].record


def test_dbos_steps_off_leaves_the_spans_as_they_were() -> None:
    out, admitted = evaluate(first_run(keyed=True, crash="none"), options=ConvertOptions(dbos_steps=False))
    assert not [a for a in admitted if a.record["kind"] == "checkpoint"]
    assert ("DS001", "llm_call") in {(v.rule, v.kind) for v in out}
    assert ("DS110", "charge-call-1") in findings(out)


def test_the_workflow_joins_a_recovered_run_that_names_no_session() -> None:
    # The crash lost the only span that named the session in the recovered run's trace; DBOS's
    # workflow id is on every workflow and step span of both runs.
    before = first_run(keyed=True, crash="in_charge")
    after = DbosProcess("pod-b")
    with after.workflow(), after.agent_run(conversation=None):
        with after.chat(conversation=None), after.step("billing__model.request"):
            pass
        with after.tool("call-1", conversation=None), after.step("charge_card"):
            pass
    _, admitted = evaluate(before, after)
    assert {a.session_id for a in admitted} == {CONVERSATION}


def test_a_workflow_that_names_no_session_is_its_own_session() -> None:
    process = DbosProcess("pod-a")
    with process.workflow(), process.agent_run(conversation=None), process.chat(conversation=None), \
            process.step("billing__model.request"):
        pass
    _, admitted = evaluate(process)
    assert {a.session_id for a in admitted} == {WORKFLOW}


def test_what_identity_remembers_of_workflows_survives_a_restart() -> None:
    before = first_run(keyed=True, crash="before_second_model")
    converter = SpanConverter(ConvertOptions())
    first = IdentityResolver(IdentityState(), 0)
    first.admit(converter.convert(before.request(), "test").items, 0)
    first.release_all()
    restored = IdentityResolver(IdentityState.from_plain(first.state.to_plain()), 0)
    admitted = restored.admit(converter.convert(recovery(keyed=True, crash="before_second_model").request(),
                                                "test").items, 0)
    admitted += restored.release_all()
    replayed = {a.record["action_id"] for a in admitted if isinstance(a, Action) and a.record.get("replayed")}
    assert {"call-1", "checkpoint:dbos:wf-7f3a:charge_card#1"} <= replayed


# -- one action per tool call, with the real frameworks -------------------------------------------


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_an_annotated_action_inside_a_tool_is_the_call(framework: str) -> None:
    process = Process("pod-a")

    def charge_card(order: str) -> str:
        # The documented way for every framework: an action of its own inside the tool.
        with annotate.action("charge card", "payment", action_id=f"charge-{order}", idempotency_key=f"order-{order}",
                             session_id="conv-9", tracer_provider=process.provider):
            pass
        return "charged"

    run_program(framework, process, [("charge_card", {"order": "42"})], {"charge_card": charge_card},
                session="conv-9")
    out, admitted = evaluate(process)
    effects = [a.record for a in admitted if a.record["kind"] in ("payment", "tool_call")]
    assert [(r["action_id"], r.get("idempotency_key")) for r in effects] == [("charge-42", "order-42")]
    assert [v for v in out if v.rule == "DS002"] == []


def test_langgraph_model_replies_are_recorded_by_the_node_checkpoint() -> None:
    process = Process("pod-a")
    run_program("langgraph", process, [("lookup_order", {"order": "42"})], {"lookup_order": lambda order: "found"},
                session="th-3")
    out, admitted = evaluate(process)
    models = [a.record for a in admitted if a.record["kind"] == "llm_call"]
    assert len(models) == 2
    checkpoints = {a.record["action_id"] for a in admitted if a.record["kind"] == "checkpoint"}
    assert all(r.get("result_ref") in checkpoints for r in models)
    assert [v.rule for v in out if v.rule == "DS001"] == []
    # Without a checkpointer (the option says so), the replies are recorded nowhere.
    out, _ = evaluate(process, options=ConvertOptions(langgraph_checkpoints=False))
    assert [v.kind for v in out if v.rule == "DS001"] == ["llm_call", "llm_call"]
