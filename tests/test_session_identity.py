"""Sessions and tool-call ids resolved across the spans of a trace, in any arrival order, in replay and serve."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Tracer

from processor.convert.options import ConvertOptions
from processor.convert.spans import SpanConverter
from processor.evaluate.engine import Engine, EngineOptions
from processor.evaluate.identity import IdentityResolver, IdentityState
from processor.records import Action
from processor.state.base import StateStore
from processor.state.postgres import PostgresStore
from processor.state.sqlite import SqliteStore
from tests._engine_util import shipped
from tests.pg_support import fresh_database, pg_server

__all__ = ["pg_server"]  # the fixture, used by name

_NS = 1_000_000_000
T0 = 1_780_000_000 * _NS


class Clock:
    """Span times under the test's control: each span starts a millisecond after the last."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> int:
        self.now += 1_000_000
        return self.now


@pytest.fixture
def traced() -> Iterator[tuple[Tracer, InMemorySpanExporter, Clock]]:
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    try:
        yield provider.get_tracer("tests"), memory, Clock()
    finally:
        provider.shutdown()


def span(tracer: Tracer, clock: Clock, name: str, attributes: dict[str, Any]) -> Any:
    return tracer.start_as_current_span(name, attributes=attributes, start_time=clock(), end_on_exit=True)


Children = Sequence[tuple[str, dict[str, Any]]]


def agent_run(tracer: Tracer, clock: Clock, root: dict[str, Any], children: Children) -> None:
    """A root span (the run) and child spans under it, in one trace."""
    with span(tracer, clock, "run", root):
        for name, attributes in children:
            with span(tracer, clock, name, attributes):
                pass


def engine(store: StateStore | None = None, mode: str = "replay", clock: Callable[[], int] | None = None) -> Engine:
    options = EngineOptions(allowed_lateness_s=5.0, mode=mode)  # type: ignore[arg-type]
    if clock is None:
        return Engine(shipped(), options, store)
    return Engine(shipped(), options, store, clock=clock)


def convert(spans: Sequence[ReadableSpan], options: ConvertOptions | None = None) -> list[Any]:
    result = SpanConverter(options).convert(encode_spans(spans), "test")
    assert result.rejected == []
    return result.items


def sessions_of(checker: Engine) -> dict[str, dict[str, int]]:
    return {s.session_id: s.actions_by_kind for s in checker.summary().sessions}


LLM = {"gen_ai.operation.name": "chat"}
TOOL = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "refund_payment", "gen_ai.tool.call.id": "c1"}


def test_session_named_on_some_spans_only_is_one_session_in_every_arrival_order(traced: Any) -> None:
    tracer, memory, clock = traced
    # The run names the conversation (openai-v2 with util-genai: invoke_agent only); its children do not.
    agent_run(tracer, clock, {"gen_ai.operation.name": "invoke_agent", "gen_ai.conversation.id": "conv-1"},
              [("chat", LLM), ("refund", TOOL), ("chat", LLM)])  # fmt: skip
    spans = memory.get_finished_spans()
    assert spans[-1].name == "run"  # the root ends last: exported after its children
    verdicts: list[set[tuple[str, str, str]]] = []
    for order in itertools.permutations(spans):
        checker = engine()
        found = checker.submit_many(convert(order)) + checker.finish()
        assert sessions_of(checker) == {"conv-1": {"llm_call": 2, "payment": 1}}
        verdicts.append({(v.rule, v.session_id, v.action_id) for v in found})
    assert verdicts[0] and all(v == verdicts[0] for v in verdicts)


def outer_and_inner(tracer: Tracer, clock: Clock, *, workflow: bool = False) -> None:
    """A run naming "outer" (under it, with ``workflow``, a chain naming no session), holding a
    sub-agent naming "inner" with a chat under it, and a chat of its own."""
    llm = {"openinference.span.kind": "LLM"}
    with contextlib.ExitStack() as stack:
        stack.enter_context(span(tracer, clock, "run", {"session.id": "outer", "openinference.span.kind": "CHAIN"}))
        if workflow:
            stack.enter_context(span(tracer, clock, "workflow", {"openinference.span.kind": "CHAIN"}))
        with (
            span(tracer, clock, "sub-agent", {"session.id": "inner", "openinference.span.kind": "AGENT"}),
            span(tracer, clock, "chat", llm),
        ):
            pass
        with span(tracer, clock, "chat", llm):
            pass


def test_nearest_ancestor_wins_over_another_session_of_the_trace(traced: Any) -> None:
    tracer, memory, clock = traced
    outer_and_inner(tracer, clock)
    checker = engine()
    checker.submit_many(convert(memory.get_finished_spans()))
    checker.finish()
    assert sessions_of(checker) == {"inner": {"llm_call": 1}, "outer": {"llm_call": 1}}


def test_a_remembered_span_is_kept_once_and_rows_of_older_builds_resolve_the_same(traced: Any) -> None:
    """A span that names a session is remembered by its session alone (the walk up stops there), one
    that names none by its parent: a trace's row holds each span once. A row written when named
    spans were also kept with their parents reads back to the same answers."""
    tracer, memory, clock = traced
    outer_and_inner(tracer, clock, workflow=True)
    spans = memory.get_finished_spans()
    for order in itertools.permutations(spans):
        checker = engine()
        checker.submit_many(convert(order))
        checker.finish()
        assert sessions_of(checker) == {"inner": {"llm_call": 1}, "outer": {"llm_call": 1}}
    ids = {s.name: format(s.context.span_id, "016x") for s in spans}
    checker = engine()
    checker.submit_many(convert(spans))
    (trace_id, plain), = checker._state.identity.to_plain()["traces"]
    assert set(plain["named"]) == {ids["run"], ids["sub-agent"]}
    assert set(plain["parents"]) == {ids["workflow"]}  # the only ancestor that names no session

    # As an older build wrote it: the named spans also under "parents", with their parents.
    older = {**plain, "parents": {**plain["parents"], ids["run"]: "", ids["sub-agent"]: ids["workflow"]}}
    state = IdentityState.from_plain({"max_event_ns": 0, "traces": [[trace_id, older]]})
    trace = state.traces[trace_id]
    assert set(trace.parents) == {ids["workflow"]} and set(trace.named) == {ids["run"], ids["sub-agent"]}
    resolver = IdentityResolver(state, 5 * _NS)
    assert resolver._session_of(trace, ids["workflow"], final=False) == "outer"
    assert resolver._session_of(trace, ids["sub-agent"], final=False) == "inner"


def test_a_conversation_over_two_traces_is_one_session(traced: Any) -> None:
    tracer, memory, clock = traced
    # OpenLLMetry: association properties on the workflow and tool spans, not on the model calls.
    session = {"traceloop.association.properties.session_id": "conv-2"}
    for _ in range(2):
        agent_run(tracer, clock, {"traceloop.span.kind": "workflow", **session},
                  [("openai.chat", LLM), ("refund.tool", {"traceloop.span.kind": "tool", **session})])  # fmt: skip
    spans = memory.get_finished_spans()
    assert len({s.context.trace_id for s in spans}) == 2
    checker = engine()
    checker.submit_many(convert(spans))
    checker.finish()
    assert sessions_of(checker) == {"conv-2": {"llm_call": 2, "tool_call": 2}}


def test_a_trace_that_never_names_a_session_is_its_own_session_after_the_lateness(traced: Any) -> None:
    tracer, memory, clock = traced
    agent_run(tracer, clock, {}, [("chat", LLM)])
    lone = convert(memory.get_finished_spans())
    trace_session = lone[0].record["session_id"]
    memory.clear()
    clock.now += 60 * _NS  # a later, unrelated run moves event time past the allowed lateness
    agent_run(tracer, clock, {"gen_ai.conversation.id": "conv-3", "gen_ai.operation.name": "invoke_agent"},
              [("chat", LLM)])  # fmt: skip
    checker = engine()
    checker.submit_many(lone)
    assert sessions_of(checker) == {}  # held: its trace may still name a session
    checker.submit_many(convert(memory.get_finished_spans()))
    assert sessions_of(checker) == {trace_session: {"llm_call": 1}, "conv-3": {"llm_call": 1}}


def test_serve_releases_what_waited_the_lateness_by_the_clock(traced: Any) -> None:
    tracer, memory, clock = traced
    agent_run(tracer, clock, {}, [("chat", LLM)])
    now = [T0]
    checker = engine(mode="serve", clock=lambda: now[0])
    checker.submit_many(convert(memory.get_finished_spans()))
    checker.tick(now[0] + 1 * _NS)
    assert sessions_of(checker) == {}
    checker.tick(now[0] + 6 * _NS)
    trace_id = memory.get_finished_spans()[0].context.trace_id.to_bytes(16, "big").hex()
    assert list(sessions_of(checker)) == [trace_id]


def test_held_spans_survive_a_restart_of_a_durable_store(traced: Any, tmp_path: Path) -> None:
    tracer, memory, clock = traced
    agent_run(tracer, clock, {"gen_ai.operation.name": "invoke_agent", "gen_ai.conversation.id": "conv-4"},
              [("refund", {**TOOL, "durable.idempotency_key": "k1"})])  # fmt: skip
    child, root = memory.get_finished_spans()
    store = SqliteStore(tmp_path / "state.db")
    first = engine(store)
    first.submit_many(convert([child]))
    assert sessions_of(first) == {}
    store.close()  # the process ends: only what the store committed remains
    again_store = SqliteStore(tmp_path / "state.db")
    again = engine(again_store)
    again.submit_many(convert([root]))
    assert sessions_of(again) == {"conv-4": {"payment": 1}}
    again_store.close()


# -- tool-call ids ------------------------------------------------------------------------


def _llm_offering(calls: Sequence[tuple[str, str]]) -> dict[str, Any]:
    attributes: dict[str, Any] = {"openinference.span.kind": "LLM", "llm.output_messages.0.message.role": "assistant"}
    for index, (name, call_id) in enumerate(calls):
        prefix = f"llm.output_messages.0.message.tool_calls.{index}.tool_call"
        attributes[f"{prefix}.id"] = call_id
        attributes[f"{prefix}.function.name"] = name
    return attributes


def _oi_tool(name: str, **extra: Any) -> dict[str, Any]:
    return {"openinference.span.kind": "TOOL", "tool.name": name, **extra}


def resolved(items: Sequence[Any]) -> list[Action]:
    """What the identity resolution hands the engine once the input ended."""
    resolver = IdentityResolver(IdentityState(), 5 * _NS)
    out = resolver.admit(items, 0)
    return [a for a in [*out, *resolver.release_all()] if isinstance(a, Action)]


@pytest.mark.parametrize("tools_first", [False, True])
def test_tool_spans_take_the_call_ids_of_the_llm_span_by_name_and_order(traced: Any, tools_first: bool) -> None:
    tracer, memory, clock = traced
    root = {"openinference.span.kind": "AGENT", "session.id": "conv-5"}
    offered = [("search_orders", "call_a"), ("refund_payment", "call_b"), ("search_orders", "call_c")]
    agent_run(tracer, clock, root, [
        ("llm", _llm_offering(offered)),
        ("search_orders", _oi_tool("search_orders")),
        ("refund_payment", _oi_tool("refund_payment")),
        ("search_orders", _oi_tool("search_orders")),
        ("send_email", _oi_tool("send_email")),  # the model never asked for it
    ])  # fmt: skip
    spans = list(memory.get_finished_spans())
    if tools_first:
        spans.sort(key=lambda s: s.name == "llm")  # the LLM span arrives after its tools
    names = {s.context.span_id.to_bytes(8, "big").hex(): s.name for s in spans}
    actions = resolved(convert(spans))
    tools = sorted(
        (a.time_ns or 0, names[a.record["span_id"]], a.action_id, a.synthetic_action_id)
        for a in actions
        if a.record["kind"] != "llm_call"
    )
    made_up = tools[-1][2]
    assert [t[1:] for t in tools] == [
        ("search_orders", "call_a", False),
        ("refund_payment", "call_b", False),
        ("search_orders", "call_c", False),
        ("send_email", made_up, True),
    ]
    assert made_up.startswith("span-")
    assert {a.session_id for a in actions} == {"conv-5"}


def test_tools_of_a_later_model_turn_take_that_turns_ids(traced: Any) -> None:
    tracer, memory, clock = traced
    agent_run(tracer, clock, {"openinference.span.kind": "AGENT", "session.id": "conv-8"}, [
        ("llm", _llm_offering([("refund_payment", "call_1")])),
        ("refund_payment", _oi_tool("refund_payment")),
        ("llm", _llm_offering([("refund_payment", "call_2")])),
        ("refund_payment", _oi_tool("refund_payment")),
    ])  # fmt: skip
    spans = list(memory.get_finished_spans())
    actions = resolved(convert(spans[::-1]))
    tools = sorted((a.time_ns or 0, a.action_id) for a in actions if a.record["kind"] != "llm_call")
    assert [action_id for _, action_id in tools] == ["call_1", "call_2"]


def test_lang_chain_tool_output_names_its_call(traced: Any) -> None:
    tracer, memory, clock = traced
    output = '{"type": "tool", "data": {"content": "refunded", "type": "tool", "tool_call_id": "call_lc"}}'
    agent_run(tracer, clock, {"openinference.span.kind": "CHAIN", "session.id": "conv-6"},
              [("refund_payment", _oi_tool("refund_payment", **{"output.value": output}))])  # fmt: skip
    tool = next(item for item in convert(memory.get_finished_spans()) if isinstance(item, Action))
    assert (tool.action_id, tool.synthetic_action_id) == ("call_lc", False)


def test_openllmetry_indexed_completions_count_as_a_recorded_reply(traced: Any) -> None:
    tracer, memory, clock = traced
    older = {"llm.request.type": "chat", "traceloop.association.properties.session_id": "conv-7"}
    agent_run(tracer, clock, {"traceloop.span.kind": "workflow"}, [
        ("openai.chat", {**older, "gen_ai.completion.0.role": "assistant", "gen_ai.completion.0.content": "ok"}),
        ("openai.chat", older),
    ])  # fmt: skip
    options = ConvertOptions(telemetry_is_log=True)
    actions = [item for item in convert(memory.get_finished_spans(), options) if isinstance(item, Action)]
    assert [("result" in a.record, a.record["kind"]) for a in actions] == [(True, "llm_call"), (False, "llm_call")]


def test_a_tool_span_delivered_twice_keeps_its_call_and_leaves_the_next_one(traced: Any) -> None:
    tracer, memory, clock = traced
    agent_run(tracer, clock, {"openinference.span.kind": "AGENT", "session.id": "conv-9"}, [
        ("llm", _llm_offering([("search_orders", "call_a"), ("search_orders", "call_b")])),
        ("search_orders", _oi_tool("search_orders")),
        ("search_orders", _oi_tool("search_orders")),
    ])  # fmt: skip
    llm, first, second, root = memory.get_finished_spans()
    # At-least-once delivery: the first tool span comes again before the second.
    actions = resolved([*convert([llm, first]), *convert([first]), *convert([second, root])])
    tools = [(a.record["span_id"], a.action_id) for a in actions if a.record["kind"] != "llm_call"]
    first_id = first.context.span_id.to_bytes(8, "big").hex()
    second_id = second.context.span_id.to_bytes(8, "big").hex()
    assert tools == [(first_id, "call_a"), (first_id, "call_a"), (second_id, "call_b")]


def test_held_spans_survive_a_restart_on_postgres(traced: Any, pg_server: str) -> None:
    tracer, memory, clock = traced
    agent_run(tracer, clock, {"gen_ai.operation.name": "invoke_agent", "gen_ai.conversation.id": "conv-10"},
              [("refund", {**TOOL, "durable.idempotency_key": "k1"})])  # fmt: skip
    child, root = memory.get_finished_spans()
    url = fresh_database(pg_server)
    store = PostgresStore(url, replica_id="r1", lease_ttl_s=30.0)
    first = engine(store)
    first.submit_many(convert([child]))
    assert sessions_of(first) == {}
    store.close()  # the replica restarts: only what it committed remains
    again_store = PostgresStore(url, replica_id="r1", lease_ttl_s=30.0)
    again = engine(again_store)
    again.submit_many(convert([root]))
    assert sessions_of(again) == {"conv-10": {"payment": 1}}
    again_store.close()


def test_a_session_is_handed_over_only_once_no_span_waits_for_its_session_here(traced: Any, pg_server: str) -> None:
    """A span that names no session may belong to the session asked for: it is not left behind at the old owner."""
    tracer, memory, clock = traced
    agent_run(tracer, clock, {"gen_ai.operation.name": "invoke_agent", "gen_ai.conversation.id": "conv-1"},
              [("chat", LLM), ("refund", TOOL)])
    *children, root = memory.get_finished_spans()
    url = fresh_database(pg_server)
    store = PostgresStore(url, replica_id="r1", lease_ttl_s=30.0)
    checker = engine(store)
    checker.submit_many(convert(children))
    with store.unit():
        assert checker.hand_over(["conv-1"]) == ([], [])
    # The root names the session: the children join it (the unkeyed refund is judged on acceptance)
    # and wait in the reordering window with it.
    accepted = checker.submit_many(convert([root]))
    assert ("DS002", "conv-1") in {(v.rule, v.session_id) for v in accepted}
    assert checker.load()[2] == 2
    with store.unit():
        _, going = checker.hand_over(["conv-1"])
    assert going == ["conv-1"]
    # What the window held of the session was evaluated before it left, and its state written.
    assert checker.load()[2] == 0
    assert not checker.holds_session("conv-1")
    loaded = engine(PostgresStore(url, replica_id="r1", lease_ttl_s=30.0))
    assert sessions_of(loaded) == {"conv-1": {"llm_call": 1, "payment": 1}}
    store.close()
