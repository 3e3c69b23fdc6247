"""Approvals, waits and checkpoints of real agent frameworks, run offline, traced and checked.

pydantic-ai runs on its FunctionModel; LangGraph (with OpenInference's langchain
instrumentor) and the OpenAI Agents SDK (with OpenInference's instrumentor) talk to a
local fake OpenAI server. Each scenario is checked with the shipped rules on what
the converter made of the real spans.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any, TypedDict

import agents
import pytest
from langchain_core.tools import InjectedToolCallId, tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.prebuilt import create_react_agent
from langgraph.types import Command, interrupt
from openai import AsyncOpenAI
from openinference.instrumentation.langchain import LangChainInstrumentor
from openinference.instrumentation.openai_agents import OpenAIAgentsInstrumentor
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic_ai import Agent, DeferredToolRequests, DeferredToolResults, RunContext, ToolDenied
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.models.instrumented import InstrumentationSettings

from durable_check import annotate
from processor.config import Config
from processor.convert.options import ConvertOptions
from processor.convert.spans import SpanConverter
from processor.evaluate.engine import Engine, EngineOptions
from processor.records import Action
from tests._engine_util import shipped
from tests.fake_openai import Script, scripted_openai
from tests.framework_support import serve_and_replay
from tests.serve_support import keys_of, read_jsonl, replay_keys, running, serve_config, wait_for

_lock = threading.Lock()  # instrumentation is process-wide: one framework run at a time
WAIT = 3600.0


class Traced:
    def __init__(self) -> None:
        self.memory = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.memory))

    def request(self) -> Any:
        return encode_spans(self.memory.get_finished_spans())

    def actions(self, options: ConvertOptions | None = None) -> list[Action]:
        result = SpanConverter(options or ConvertOptions(approval_wait_timeout=WAIT)).convert(self.request(), "test")
        assert result.rejected == []
        return result.actions


# What these tests are about; DS001 (a model reply is not a durably recorded result unless
# telemetry is the log) fires on every framework's model calls and is tested elsewhere.
RULES = frozenset({"DS002", "DS009", "DS101", "DS105", "DS106", "DS107", "DS108", "DS109", "DS110"})


def served(tmp_path: Path, traced: Traced) -> list[tuple[str, str]]:
    """The same verdicts from a real serve over OTLP and from replay of a dump (which must agree)."""
    found = serve_and_replay(tmp_path, [traced], {"approval_wait_timeout": "1h"})  # type: ignore[list-item]
    return sorted((rule, action) for rule, _, action in found if rule in RULES)


def verdicts(actions: Sequence[Action]) -> list[tuple[str, str]]:
    engine = Engine(shipped(), EngineOptions())
    out = engine.submit_many(actions) + engine.finish()
    return sorted((v.rule, v.action_id) for v in out if v.rule in RULES)


def records(actions: Sequence[Action], kind: str) -> list[dict[str, Any]]:
    return [a.record for a in actions if a.record["kind"] == kind]


# -- pydantic-ai -------------------------------------------------------------------------------


def _pydantic_refund(traced: Traced, approve: bool, *, decided: str | None, conversation: str = "conv-1") -> list[str]:
    """A refund tool that needs approval; ``approve`` is what the code hands to pydantic-ai,
    ``decided`` what the human said (recorded with the annotate helper; None: not recorded).
    Returns the refunds made."""

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if any(isinstance(part, ToolReturnPart) for part in messages[-1].parts):
            return ModelResponse(parts=[TextPart("done")])
        return ModelResponse(parts=[ToolCallPart("refund_payment", {"order_id": "42"}, tool_call_id="call-1")])

    refunds: list[str] = []
    agent = Agent(FunctionModel(model), name="refunder", output_type=[str, DeferredToolRequests])

    @agent.tool(requires_approval=True)
    def refund_payment(ctx: RunContext[None], order_id: str) -> str:
        # The gated call carries out the approved plan: its call id.
        annotate.set_plan(str(ctx.tool_call_id))
        annotate.set_idempotency_key(f"refund-{order_id}")
        refunds.append(order_id)
        return "refunded"

    with _lock:
        Agent.instrument_all(InstrumentationSettings(tracer_provider=traced.provider))
        try:
            first = agent.run_sync("refund 42", conversation_id=conversation)
            assert isinstance(first.output, DeferredToolRequests)
            call = first.output.approvals[0]
            if decided is not None:
                annotate.approval_decision(call.tool_call_id, "granted" if decided == "granted" else "denied",
                                           tool=call.tool_name, session_id=conversation,
                                           tracer_provider=traced.provider)
            results = DeferredToolResults(approvals={call.tool_call_id: True if approve else ToolDenied("no")})
            agent.run_sync(message_history=first.all_messages(), deferred_tool_results=results,
                           conversation_id=conversation)
        finally:
            Agent.instrument_all(False)
    return refunds


def test_pydantic_ai_deferred_approval_is_a_wait_naming_the_tool_and_call() -> None:
    traced = Traced()
    _pydantic_refund(traced, approve=True, decided="granted")
    waits = [r for r in traced.actions() if r.record.get("workflow_state") == "awaiting_approval"]
    assert len(waits) == 1
    wait = waits[0].record
    assert wait["action_id"] == "approval:refund_payment:call-1"
    assert (wait["kind"], wait["plan_version"], wait["wait_timeout_s"], wait["session_id"]) == (
        "approval", "call-1", WAIT, "conv-1")
    # With no deadline configured the framework's wait has none, and DS106 says so.
    assert ("DS106", "approval:refund_payment:call-1") in verdicts(traced.actions(ConvertOptions()))


def test_pydantic_ai_granted_runs_the_tool_and_is_clean(tmp_path: Path) -> None:
    traced = Traced()
    assert _pydantic_refund(traced, approve=True, decided="granted") == ["42"]
    actions = traced.actions()
    assert [r["action_id"] for r in records(actions, "payment")] == ["call-1"]
    assert verdicts(actions) == [("DS110", "call-1")]  # pydantic-ai saves no checkpoint: the checker says so
    assert served(tmp_path, traced) == verdicts(traced.actions())


def test_pydantic_ai_denied_skips_the_tool_and_is_clean(tmp_path: Path) -> None:
    traced = Traced()
    assert _pydantic_refund(traced, approve=False, decided="denied") == []
    actions = traced.actions()
    assert records(actions, "payment") == []
    assert verdicts(actions) == []
    assert served(tmp_path, traced) == verdicts(traced.actions())


def test_pydantic_ai_denied_but_executed_is_ds109(tmp_path: Path) -> None:
    traced = Traced()
    # The human said no, but the code approved the call anyway.
    assert _pydantic_refund(traced, approve=True, decided="denied") == ["42"]
    assert ("DS109", "call-1") in verdicts(traced.actions())
    assert served(tmp_path, traced) == verdicts(traced.actions())


@pytest.mark.parametrize(("approve", "decision", "refunded"), [(True, "granted", ["42"]), (False, "denied", [])])
def test_pydantic_ai_decision_is_read_from_the_resumed_run(approve: bool, decision: str, refunded: list[str],
                                                           tmp_path: Path) -> None:
    # The code records no decision: the resumed run shows it. An approved call runs there (its span
    # carries the call id); a denied one does not run, and the run ends without it.
    traced = Traced()
    assert _pydantic_refund(traced, approve=approve, decided=None) == refunded
    engine = Engine(shipped(), EngineOptions())
    engine.keep_admitted = True
    items = SpanConverter(ConvertOptions(approval_wait_timeout=WAIT)).convert(traced.request(), "test").items
    out = engine.submit_many(items) + engine.finish()
    admitted = [a.record for a in engine.take_admitted()]
    decisions = [(r["action_id"], r["approval_decision"], r["plan_version"])
                 for r in admitted if "approval_decision" in r]
    assert decisions == [("approval:refund_payment:call-1:shown", decision, "call-1")]
    # Granted, the decision comes before the refund it allows (the refund carries the call as its plan).
    order = [r["action_id"] for r in admitted if r["action_id"].startswith(("approval:", "call-1"))]
    assert order == ["approval:refund_payment:call-1", "approval:refund_payment:call-1:shown",
                     *(["call-1"] if approve else [])]
    assert [v.rule for v in out if v.rule in ("DS107", "DS108", "DS109")] == []
    assert [rule for rule, _ in served(tmp_path, traced) if rule in ("DS107", "DS108", "DS109")] == []


def test_pydantic_ai_decision_recorded_by_the_code_is_the_decision() -> None:
    # The human said no, the code approved the call anyway: the recorded denial stands, nothing is
    # derived over it, and the refund is DS109.
    traced = Traced()
    _pydantic_refund(traced, approve=True, decided="denied")
    engine = Engine(shipped(), EngineOptions())
    engine.keep_admitted = True
    items = SpanConverter(ConvertOptions(approval_wait_timeout=WAIT)).convert(traced.request(), "test").items
    out = engine.submit_many(items) + engine.finish()
    assert [r["approval_decision"] for r in (a.record for a in engine.take_admitted()) if "approval_decision" in r] == [
        "denied"]
    assert ("DS109", "call-1") in {(v.rule, v.action_id) for v in out}


# -- LangGraph -----------------------------------------------------------------------------------


def _langgraph_refund(traced: Traced, answer: str | None, *, thread: str = "th-1", honour: bool = True,
                      checkpointer: bool = True) -> list[str]:
    """A ReAct agent whose refund tool calls interrupt(); the run is resumed with ``answer`` (None: never).
    ``honour=False``: the tool refunds whatever the answer was."""

    refunds: list[str] = []

    @tool
    def reimburse_order(order_id: str, tool_call_id: Annotated[str, InjectedToolCallId]) -> str:
        """Reimburse an order."""
        answer = interrupt({"tool": "reimburse_order", "order_id": order_id})
        if honour and answer != "approve":
            return "not refunded"
        # LangChain's tracer does not make the tool span current: the side effect gets its own span.
        with annotate.action("refund", "payment", action_id=f"refund-{order_id}", plan_version=tool_call_id,
                             idempotency_key=f"refund-{order_id}", session_id=thread,
                             tracer_provider=traced.provider):
            refunds.append(order_id)
        return "refunded"

    with _lock, scripted_openai(Script([("reimburse_order", {"order_id": "42"})])) as url:
        instrumentor = LangChainInstrumentor()
        instrumentor.instrument(tracer_provider=traced.provider)
        try:
            llm = ChatOpenAI(model="fake-model", base_url=url, api_key="sk-fake")
            agent = create_react_agent(llm, [reimburse_order], checkpointer=InMemorySaver() if checkpointer else None)
            config: Any = {"configurable": {"thread_id": thread}}
            first = agent.invoke({"messages": [("user", "refund 42")]}, config)
            assert first["__interrupt__"]
            if not honour:
                # What the human said, for the plan of the call the tool ran.
                call_id = first["messages"][-1].tool_calls[0]["id"]
                annotate.approval_decision(call_id, "denied", tool="reimburse_order", session_id=thread,
                                           tracer_provider=traced.provider)
            if answer is not None:
                agent.invoke(Command(resume=answer), config)
        finally:
            instrumentor.uninstrument()
    return refunds


def test_langgraph_interrupt_is_a_wait_and_resume_a_decision() -> None:
    traced = Traced()
    _langgraph_refund(traced, "approve")
    actions = traced.actions()
    waits = [a.record for a in actions if a.record.get("workflow_state") == "awaiting_approval"]
    assert len(waits) == 1 and waits[0]["action_id"].startswith("approval:reimburse_order:")
    assert waits[0]["session_id"] == "th-1"
    decisions = [a.record for a in actions if "approval_decision" in a.record]
    assert [d["approval_decision"] for d in decisions] == ["granted"]
    # The interrupted tool span is the wait, not a tool call; the resumed one is.
    assert len(records(actions, "tool_call")) == 1
    assert len(records(actions, "payment")) == 1
    assert records(actions, "checkpoint")  # a step of a checkpointed run


def test_langgraph_granted_runs_the_tool_and_is_clean(tmp_path: Path) -> None:
    traced = Traced()
    assert _langgraph_refund(traced, "approve") == ["42"]
    assert verdicts(traced.actions()) == []
    assert served(tmp_path, traced) == verdicts(traced.actions())


def test_langgraph_without_checkpointer_awareness_is_ds110() -> None:
    traced = Traced()
    _langgraph_refund(traced, "approve")
    found = verdicts(traced.actions(ConvertOptions(approval_wait_timeout=WAIT, langgraph_checkpoints=False)))
    assert [rule for rule, _ in found] == ["DS110"]


def test_langgraph_denied_skips_the_refund_and_is_clean(tmp_path: Path) -> None:
    traced = Traced()
    assert _langgraph_refund(traced, "reject") == []
    actions = traced.actions()
    assert [d["approval_decision"] for d in actions_with(actions, "approval_decision")] == ["denied"]
    assert verdicts(actions) == []
    assert served(tmp_path, traced) == verdicts(traced.actions())


def test_langgraph_denied_but_executed_is_ds109(tmp_path: Path) -> None:
    traced = Traced()
    assert _langgraph_refund(traced, "reject", honour=False) == ["42"]
    found = verdicts(traced.actions())
    assert found == [("DS109", "refund-42")]
    assert served(tmp_path, traced) == verdicts(traced.actions())


class _Review(TypedDict):
    plan: str
    approved: bool


@pytest.mark.parametrize(("answer", "decision"), [("approve", "granted"), ("reject", "denied")])
def test_langgraph_interrupt_in_a_review_node_is_a_wait(answer: str, decision: str, tmp_path: Path) -> None:
    traced = Traced()

    def human_review(state: _Review) -> dict[str, bool]:
        return {"approved": interrupt({"plan": state["plan"]}) == "approve"}

    def act(state: _Review) -> dict[str, bool]:
        if state["approved"]:
            with annotate.action("deploy", "deploy", action_id="deploy-v2", session_id="th-review",
                                 idempotency_key="deploy-v2", tracer_provider=traced.provider):
                pass
        return {}

    graph = StateGraph(_Review)
    graph.add_node("human_review", human_review)
    graph.add_node("act", act)
    graph.add_edge(START, "human_review")
    graph.add_edge("human_review", "act")
    graph.add_edge("act", END)
    app = graph.compile(checkpointer=InMemorySaver())
    config: Any = {"configurable": {"thread_id": "th-review"}}
    with _lock:
        instrumentor = LangChainInstrumentor()
        instrumentor.instrument(tracer_provider=traced.provider)
        try:
            first = app.invoke({"plan": "v2", "approved": False}, config)
            app.invoke(Command(resume=answer), config)
        finally:
            instrumentor.uninstrument()
    actions = traced.actions()
    [wait] = actions_with(actions, "workflow_state")
    assert wait["action_id"] == f"approval:human_review:{first['__interrupt__'][0].id}"
    assert [d["approval_decision"] for d in actions_with(actions, "approval_decision")] == [decision]
    assert len(records(actions, "deploy")) == (1 if decision == "granted" else 0)
    # Each completed step is a checkpoint: the deploy is followed by one (no DS110), and the
    # interrupted review step is not.
    assert len(records(actions, "checkpoint")) == 2
    assert verdicts(actions) == []
    assert served(tmp_path, traced) == []


def actions_with(actions: Sequence[Action], field: str) -> list[dict[str, Any]]:
    return [a.record for a in actions if field in a.record]


# -- the OpenAI Agents SDK ------------------------------------------------------------------------


def _agents_refund(traced: Traced, approve: bool, *, decided: str | None, group: str = "conv-9",
                   wait_s: float = WAIT) -> list[str]:
    """``needs_approval``: the SDK's spans hold no trace of the interruption, so the code records
    the wait and the decision with the annotate helper, and traces the resumed run on its own.
    ``decided=None``: nobody answers, the run is never resumed."""

    refunds: list[str] = []

    @agents.function_tool(needs_approval=True)
    def refund_payment(order_id: str) -> str:
        """Refund an order."""
        annotate.set_session(group)
        # The SDK's tool spans carry no call id: a stable action id of the user's own.
        annotate.set_action("payment", action_id=f"refund-{order_id}")
        annotate.set_plan(f"refund-{order_id}")
        annotate.set_idempotency_key(f"refund-{order_id}")
        refunds.append(order_id)
        return "refunded"

    with _lock, scripted_openai(Script([("refund_payment", {"order_id": "42"})])) as url:
        agents.set_trace_processors([])
        instrumentor = OpenAIAgentsInstrumentor()
        instrumentor.instrument(tracer_provider=traced.provider)
        try:
            agents.set_default_openai_client(AsyncOpenAI(base_url=url, api_key="sk-fake"), use_for_tracing=False)
            agents.set_default_openai_api("chat_completions")
            agent = agents.Agent(name="refunder", instructions="refund", tools=[refund_payment], model="fake-model")
            config = agents.RunConfig(group_id=group, workflow_name="refund")
            first = agents.Runner.run_sync(agent, "refund 42", run_config=config)
            state = first.to_state()
            for item in first.interruptions:
                plan = f"refund-{'42'}"
                annotate.waiting(f"approval:{item.tool_name}:{plan}", state="awaiting_approval", timeout_s=wait_s,
                                 plan_version=plan, session_id=group, tracer_provider=traced.provider)
                if decided is None:
                    return refunds
                annotate.approval_decision(plan, "granted" if decided == "granted" else "denied",
                                           tool=item.tool_name, session_id=group, tracer_provider=traced.provider)
                state.approve(item) if approve else state.reject(item)
            # A resumed run continues the first run's SDK trace, which the instrumentor has closed.
            with agents.trace("refund", group_id=group):
                agents.Runner.run_sync(agent, state, run_config=config)
        finally:
            instrumentor.uninstrument()
    return refunds


@pytest.mark.parametrize(("approve", "decided", "refunded", "expected"), [
    (True, "granted", ["42"], []),
    (False, "denied", [], []),
    (True, "denied", ["42"], ["DS109"]),
])
def test_agents_sdk_approvals(approve: bool, decided: str, refunded: list[str], expected: list[str],
                              tmp_path: Path) -> None:
    os.environ.setdefault("OPENAI_API_KEY", "sk-fake")
    traced = Traced()
    assert _agents_refund(traced, approve, decided=decided) == refunded
    actions = [a for a in traced.actions() if a.session_id == "conv-9"]
    found = [rule for rule, _ in verdicts(actions) if rule != "DS110"]  # the SDK saves no checkpoint
    assert found == expected
    assert [rule for rule, action in served(tmp_path, traced) if action == "refund-42" and rule != "DS110"] == expected
    # The span the SDK ends for the paused call (no output: the tool never ran) is no action, so
    # no refund that did not happen is reported anywhere, in any session.
    paused = [a for a in traced.actions() if a.record["kind"] in ("payment", "tool_call")
              and a.record.get("action_id") != "refund-42"]
    assert paused == []
    assert [rule for rule, _ in verdicts(traced.actions()) if rule == "DS002"] == []


# -- serve: the same verdicts over OTLP, and a deadline that passes ----------------------------


def _serve(tmp_path: Path, timeout: str, lateness: str = "5s") -> Config:
    return serve_config(tmp_path, {
        "convert": {"approval_wait_timeout": timeout},
        "evaluate": {"allowed_lateness": lateness, "tick_interval": "50ms"},
    })


def _deny_but_run(framework: str, traced: Traced) -> tuple[str, str]:
    """The denied-but-executed run of ``framework``; (session, action id) of the DS109 it must give."""
    if framework == "pydantic-ai":
        _pydantic_refund(traced, approve=True, decided="denied", conversation="conv-serve")
        return "conv-serve", "call-1"
    if framework == "langgraph":
        _langgraph_refund(traced, "reject", honour=False, thread="th-serve")
        return "th-serve", "refund-42"
    _agents_refund(traced, True, decided="denied", group="conv-serve")
    return "conv-serve", "refund-42"


def _wait_only(framework: str, traced: Traced, wait_s: float) -> tuple[str, str]:
    """A run of ``framework`` that stops for approval and is never answered; (session, wait id)."""
    if framework == "pydantic-ai":
        def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
            return ModelResponse(parts=[ToolCallPart("deploy_release", {"tag": "v2"}, tool_call_id="call-7")])

        agent = Agent(FunctionModel(model), name="deployer", output_type=[str, DeferredToolRequests])

        @agent.tool_plain(requires_approval=True)
        def deploy_release(tag: str) -> str:
            return "deployed"

        with _lock:
            Agent.instrument_all(InstrumentationSettings(tracer_provider=traced.provider))
            try:
                agent.run_sync("ship it", conversation_id="conv-wait")
            finally:
                Agent.instrument_all(False)
        return "conv-wait", "approval:deploy_release:call-7"
    if framework == "langgraph":
        _langgraph_refund(traced, None, thread="th-wait")
        [wait] = [a.record for a in traced.actions() if a.record.get("workflow_state") == "awaiting_approval"]
        return "th-wait", str(wait["action_id"])
    _agents_refund(traced, True, decided=None, group="conv-wait", wait_s=wait_s)
    return "conv-wait", "approval:refund_payment:refund-42"


def _export(server: Any, traced: Traced) -> None:
    exporter = HttpSpanExporter(endpoint=f"http://127.0.0.1:{server.http_port}/v1/traces", timeout=10)
    assert exporter.export(traced.memory.get_finished_spans()).name == "SUCCESS"
    exporter.shutdown()


FRAMEWORKS = ["pydantic-ai", "langgraph", "agents-sdk"]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_over_otlp_serve_gives_the_replay_verdicts(framework: str, tmp_path: Path) -> None:
    config = _serve(tmp_path, "1h")
    traced = Traced()
    session, action_id = _deny_but_run(framework, traced)
    with running(config) as server:
        _export(server, traced)
        assert wait_for(lambda: server.worker.processed_spans >= len(traced.memory.get_finished_spans()))
    served = keys_of(read_jsonl(tmp_path / "violations.jsonl"))
    assert ("DS109", session, action_id) in served
    assert served == replay_keys([traced.request()], config)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_framework_wait_whose_deadline_passes_is_ds107_in_serve(framework: str, tmp_path: Path) -> None:
    # Spans of one export are in time order per instrumentation scope only: no lateness is
    # allowed here, so the wait must fire on the clock alone.
    config = _serve(tmp_path, "3s", lateness="0s")
    traced = Traced()
    session, wait_id = _wait_only(framework, traced, 3.0)
    [wait] = [a for a in traced.actions(ConvertOptions(approval_wait_timeout=3.0)) if a.record["action_id"] == wait_id]
    assert wait.time_ns is not None
    deadline_ns = wait.time_ns + 3 * 1_000_000_000
    with running(config) as server:
        _export(server, traced)
        # Nothing else arrives: the deadline alone must bring the verdict, while the server runs.
        assert wait_for(lambda: any(v["rule"] == "DS107" for v in read_jsonl(tmp_path / "violations.jsonl")), 20)
        assert time.time_ns() >= deadline_ns
    ds107 = [v for v in read_jsonl(tmp_path / "violations.jsonl") if v["rule"] == "DS107"]
    assert [(v["session_id"], v["action_id"], v["time_unix_nano"]) for v in ds107] == [(session, wait_id, deadline_ns)]


@pytest.fixture(autouse=True)
def _fake_key() -> Iterator[None]:
    old = os.environ.get("OPENAI_API_KEY")
    os.environ["OPENAI_API_KEY"] = "sk-fake"
    yield
    if old is None:
        del os.environ["OPENAI_API_KEY"]
    else:
        os.environ["OPENAI_API_KEY"] = old


# -- what a resume value says ---------------------------------------------------------------------


@pytest.mark.parametrize(("resume", "decision"), [
    ('"approve"', "granted"), ('"Reject"', "denied"), ("true", "granted"), ("false", "denied"),
    ('{"approved": false}', "denied"), ('{"type": "accept"}', "granted"),
    ('{"decisions": [{"type": "approve"}, {"type": "reject"}]}', "denied"),
    ('"Paris, please"', None),
])
def test_a_langgraph_resume_value_as_decision(resume: str, decision: str | None) -> None:
    from tests.serve_support import make_request

    command = '{"graph": null, "update": null, "resume": ' + resume + ', "goto": []}'
    request = make_request({"openinference.span.kind": "CHAIN", "input.value": command, "session.id": "th-9",
                            "metadata": '{"thread_id": "th-9"}'})
    [action] = SpanConverter().convert(request, "test").actions
    assert action.record["session_id"] == "th-9" and action.record["kind"] == "approval"
    if decision is None:
        assert "approval_decision" not in action.record and action.record["workflow_state"] == "executing"
    else:
        assert action.record["approval_decision"] == decision


def test_oversized_or_broken_payloads_are_not_parsed() -> None:
    from tests.serve_support import make_request

    huge = '{"graph": null, "resume": "approve", "pad": "' + "x" * 70_000 + '"}'
    broken = '{"graph": null, "resume": "appro'
    deferred = '{"calls": [], "approvals": [{"tool_name": "t", "tool_call_id": "c"' + "]" * 3
    request = make_request(
        {"openinference.span.kind": "CHAIN", "input.value": huge, "metadata": '{"thread_id": "a"}'},
        {"openinference.span.kind": "CHAIN", "input.value": broken, "metadata": '{"thread_id": "a"}'},
        {"gen_ai.operation.name": "invoke_agent", "final_result": deferred},
    )
    result = SpanConverter().convert(request, "test")
    assert result.actions == [] and result.rejected == [] and result.spans_not_actions == 3


def test_framework_options_are_read_and_checked() -> None:
    from processor.config import parse_config
    from processor.errors import ConfigError

    config = parse_config("convert: {approval_wait_timeout: 2h, langgraph_checkpoints: false, "
                          "approval_grant_words: [sure]}", "test.yaml")
    assert config.convert.approval_wait_timeout == 7200
    assert config.convert.langgraph_checkpoints is False
    assert list(config.convert.approval_grant_words) == ["sure"]
    with pytest.raises(ConfigError) as error:
        parse_config("convert: {approval_grant_words: [Sure, ok], approval_deny_words: [ok]}", "test.yaml")
    message = str(error.value)
    assert "convert.approval_grant_words[0]: a resume value is compared in lower case" in message
    assert "convert.approval_deny_words: also a grant word: ok" in message


def test_langgraph_spans_convert_the_same_from_an_otlp_json_file(tmp_path: Path) -> None:
    """What replay reads from a Collector file dump (OTLP/JSON, attributes filtered by the converter)."""
    from processor.receive.files import read_input
    from tests._spans import otlp_json_from_request

    traced = Traced()
    _langgraph_refund(traced, "approve")
    request = traced.request()
    dump = tmp_path / "traces.jsonl"
    dump.write_bytes(otlp_json_from_request(request) + b"\n")
    converter = SpanConverter(ConvertOptions(approval_wait_timeout=WAIT))
    from_file = [item.record for item in read_input(str(dump), None, converter) if isinstance(item, Action)]
    from_proto = [a.record for a in traced.actions()]
    assert from_file == from_proto
    assert any(r.get("workflow_state") == "awaiting_approval" for r in from_file)


def test_a_resume_nested_past_any_reason_is_no_decision_and_no_crash() -> None:
    from tests.serve_support import make_request

    deep = '{"decision": ' * 20 + '"approve"' + "}" * 20
    deeper = "[" * 30_000 + "]" * 30_000  # more nesting than the JSON parser takes
    requests = [make_request({"openinference.span.kind": "CHAIN", "metadata": '{"thread_id": "t"}',
                              "input.value": '{"graph": null, "resume": ' + value + "}"}) for value in (deep, deeper)]
    nested, broken = (SpanConverter().convert(request, "test") for request in requests)
    assert [a.record["workflow_state"] for a in nested.actions] == ["executing"]  # an answer, not a decision
    assert broken.actions == [] and broken.rejected == []


def test_a_resume_keyed_by_interrupt_id_carries_it_as_plan() -> None:
    from tests.serve_support import make_request

    command = '{"graph": null, "update": null, "resume": {"' + "ab" * 16 + '": "reject"}, "goto": []}'
    request = make_request({"openinference.span.kind": "CHAIN", "input.value": command,
                            "metadata": '{"thread_id": "t"}'})
    [action] = SpanConverter().convert(request, "test").actions
    assert (action.record["approval_decision"], action.record["plan_version"]) == ("denied", "ab" * 16)
