"""One agent program run by each of three real frameworks, offline, for the seed scenarios.

The program is a list of tool calls the fake model makes and plain Python tools; each
framework wraps the tools its own way and talks to the local fake OpenAI server.
Side effects are recorded by the tools with the annotate helper (their own spans), which
works the same under every framework.
"""

from __future__ import annotations

import contextlib
import io
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import agents
import orjson
from langchain_core.tools import StructuredTool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.prebuilt import create_react_agent
from openai import AsyncOpenAI
from openinference.instrumentation.langchain import LangChainInstrumentor
from openinference.instrumentation.openai_agents import OpenAIAgentsInstrumentor
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic_ai import Agent
from pydantic_ai.models.instrumented import InstrumentationSettings
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from processor import cli
from processor.convert.options import ConvertOptions
from processor.convert.spans import SpanConverter
from processor.records import Action
from tests._spans import otlp_json_from_request
from tests.convert_parity import assert_convert_agrees_with_replay
from tests.fake_openai import Script, scripted_openai
from tests.serve_support import Key, config_file, keys_of, read_jsonl, running, serve_config, wait_for

FRAMEWORKS = ("pydantic-ai", "langgraph", "agents-sdk")
# Instrumentation is process-wide: one framework run at a time.
LOCK = threading.Lock()

Tool = Callable[[str], str]


class Process:
    """One process of the agent: its own resource (service.instance.id) and spans."""

    def __init__(self, instance: str) -> None:
        self.memory = InMemorySpanExporter()
        self.provider = TracerProvider(resource=Resource.create({"service.name": "travel-agent",
                                                                 "service.instance.id": instance}))
        self.provider.add_span_processor(SimpleSpanProcessor(self.memory))

    def request(self) -> Any:
        return encode_spans(self.memory.get_finished_spans())

    def actions(self, options: ConvertOptions | None = None) -> list[Action]:
        result = SpanConverter(options or ConvertOptions()).convert(self.request(), "test")
        assert result.rejected == []
        return result.actions


def run_program(framework: str, process: Process, calls: Sequence[tuple[str, Mapping[str, Any]]],
                tools: Mapping[str, Tool], *, session: str, saver: InMemorySaver | None = None,
                fail_after_results: int | None = None, resume: bool = False) -> None:
    """The fake model calls ``calls`` in order, then answers with text. Exceptions (a crash) propagate.

    ``saver``: LangGraph's checkpointer, shared by the processes of one session (as a database
    would be); ``resume``: LangGraph continues the thread from its last checkpoint.
    """
    script = Script([(name, dict(args)) for name, args in calls], fail_after_results=fail_after_results)
    with LOCK, scripted_openai(script) as url:
        if framework == "pydantic-ai":
            _pydantic_ai(process, url, tools, session)
        elif framework == "langgraph":
            _langgraph(process, url, tools, session, saver=saver or InMemorySaver(), resume=resume)
        else:
            _agents_sdk(process, url, tools)


def _typed(name: str, fn: Tool) -> Callable[[str], str]:
    def tool(order: str) -> str:
        return fn(order)

    tool.__name__ = name
    tool.__doc__ = f"{name} for an order."
    return tool


def _pydantic_ai(process: Process, url: str, tools: Mapping[str, Tool], session: str) -> None:
    client = AsyncOpenAI(base_url=url, api_key="sk-fake", max_retries=0)
    agent: Agent[None, str] = Agent(OpenAIChatModel("fake-model", provider=OpenAIProvider(openai_client=client)),
                                    name="travel-agent")
    for name, fn in tools.items():
        agent.tool_plain(name=name)(_typed(name, fn))
    Agent.instrument_all(InstrumentationSettings(tracer_provider=process.provider))
    try:
        agent.run_sync("plan my trip", conversation_id=session)
    finally:
        Agent.instrument_all(False)


def _langgraph(process: Process, url: str, tools: Mapping[str, Tool], session: str, *, saver: InMemorySaver,
               resume: bool) -> None:
    instrumentor = LangChainInstrumentor()
    instrumentor.instrument(tracer_provider=process.provider)
    try:
        llm = ChatOpenAI(model="fake-model", base_url=url, api_key="sk-fake", max_retries=0)
        wrapped = [StructuredTool.from_function(_typed(name, fn), name=name) for name, fn in tools.items()]
        graph = create_react_agent(llm, wrapped, checkpointer=saver)
        config: Any = {"configurable": {"thread_id": session}}
        graph.invoke(None if resume else {"messages": [("user", "plan my trip")]}, config)
    finally:
        instrumentor.uninstrument()


def _agents_sdk(process: Process, url: str, tools: Mapping[str, Tool]) -> None:
    agents.set_trace_processors([])
    instrumentor = OpenAIAgentsInstrumentor()
    instrumentor.instrument(tracer_provider=process.provider)
    try:
        agents.set_default_openai_client(AsyncOpenAI(base_url=url, api_key="sk-fake", max_retries=0),
                                         use_for_tracing=False)
        agents.set_default_openai_api("chat_completions")
        wrapped = [agents.function_tool(_typed(name, fn), name_override=name, failure_error_function=None)
                   for name, fn in tools.items()]
        agent = agents.Agent(name="travel-agent", instructions="plan", tools=wrapped, model="fake-model")
        agents.Runner.run_sync(agent, "plan my trip")
    finally:
        instrumentor.uninstrument()


def serve_and_replay(tmp_path: Path, processes: Sequence[Process], convert: Mapping[str, Any] | None = None
                     ) -> set[Key]:
    """Export the processes' spans over OTLP/HTTP to a real ``serve`` and write them to an OTLP/JSON
    dump; ``replay`` the dump with the same configuration. Both must find the same violations,
    which are returned as (rule, session, action id)."""
    extra = {"convert": dict(convert or {})}
    config = serve_config(tmp_path, extra)
    spans = sum(len(p.memory.get_finished_spans()) for p in processes)
    with running(config) as server:
        for process in processes:
            exporter = HttpSpanExporter(endpoint=f"http://127.0.0.1:{server.http_port}/v1/traces", timeout=10)
            assert exporter.export(process.memory.get_finished_spans()) is SpanExportResult.SUCCESS
            exporter.shutdown()
        assert wait_for(lambda: server.worker.processed_spans >= spans, 20)
    served = keys_of(read_jsonl(tmp_path / "violations.jsonl"))
    dump = tmp_path / "dump.jsonl"
    dump.write_bytes(b"".join(otlp_json_from_request(p.request()) + b"\n" for p in processes))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli.main(["replay", "--format", "json", "--config", str(config_file(tmp_path, extra)), str(dump)])
    replayed = {(v["rule"], v["session_id"], v["action_id"]) for v in orjson.loads(out.getvalue())["violations"]}
    assert served == replayed
    assert_convert_agrees_with_replay(dump, config_file(tmp_path, extra))
    return served
