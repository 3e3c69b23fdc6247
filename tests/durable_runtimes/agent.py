"""The billing agent, one run of one process: ``python -m tests.durable_runtimes.agent ...``.

It charges a card for order 42 through a tool, with one of three real stacks and their own
durable execution, against the local fake OpenAI server:

- ``langgraph``: LangGraph's ReAct agent with a persistent ``SqliteSaver``, traced with
  OpenInference's LangChain instrumentation;
- ``pydantic-ai-dbos``: pydantic-ai's ``DBOSAgent`` (model requests are DBOS steps), the
  charge a DBOS step, on a SQLite system database, traced by pydantic-ai and DBOS;
- ``agents-sdk-dbos``: the OpenAI Agents SDK run by ``DBOSRunner`` in a DBOS workflow, the
  charge a DBOS step, traced with OpenInference's Agents SDK instrumentation and DBOS.

``--build well`` keys the charge as docs/frameworks.md says (``annotate.action`` with an
idempotency key); ``broken`` does not. ``--crash`` kills the first process (``os._exit``)
right after the charge inside the tool, or just before the second model request; the
``recover`` phase is a second process on the same databases, which resumes the run the way
the runtime does. What really happened is written outside the traces: the payment ledger
(a SQLite table that honours the idempotency key, as a payment API would) counts charges
and attempts. Every span that ends is written at once to the dump, one OTLP/JSON line each,
so what a crash leaves is what a real exporter would have sent.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
from pathlib import Path
from typing import Any

import httpx
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

from durable_check import annotate
from tests._spans import otlp_json_from_request

STACKS = ("langgraph", "pydantic-ai-dbos", "agents-sdk-dbos")
BUILDS = ("well", "broken")
CRASHES = ("none", "in_charge", "before_second_model")
CRASH_EXIT = 86
ORDER = "42"
# The session: LangGraph's thread, pydantic-ai's conversation, the DBOS workflow id.
SESSION = "order-42"
CHARGE_ACTION = f"charge-order-{ORDER}"


class DumpExporter(SpanExporter):
    """Each ended span as one OTLP/JSON line, written through to the file before the span's caller goes on."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("ab")

    def export(self, spans: Any) -> SpanExportResult:
        self._file.write(otlp_json_from_request(encode_spans(list(spans))) + b"\n")
        self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self._file.close()


class Ledger:
    """The payment provider's ledger: a charge with a key already used is not charged again."""

    def __init__(self, path: Path) -> None:
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("CREATE TABLE IF NOT EXISTS attempts (id INTEGER PRIMARY KEY, order_id TEXT)")
        self._db.execute("CREATE TABLE IF NOT EXISTS charges (id INTEGER PRIMARY KEY, order_id TEXT, key TEXT UNIQUE)")

    def charge(self, order: str, key: str | None) -> None:
        self._db.execute("INSERT INTO attempts (order_id) VALUES (?)", (order,))
        self._db.execute("INSERT OR IGNORE INTO charges (order_id, key) VALUES (?, ?)", (order, key))


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dir = Path(args.dir)
        self.ledger = Ledger(self.dir / "ledger.db")
        self.requests = 0
        resource = Resource.create({"service.name": "billing-agent",
                                    "service.instance.id": f"{args.phase}-{os.getpid()}"})
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(SimpleSpanProcessor(DumpExporter(self.dir / "dump.jsonl")))
        trace.set_tracer_provider(self.provider)  # DBOS traces through the global provider

    def crash_at(self, point: str) -> None:
        if self.args.phase == "first" and self.args.crash == point:
            os._exit(CRASH_EXIT)

    def charge(self, order: str) -> str:
        """The charging tool's work: the payment, recorded as the docs say."""
        key = f"order-{order}" if self.args.build == "well" else None
        with annotate.action("charge card", "payment", action_id=f"charge-order-{order}", idempotency_key=key,
                             tracer_provider=self.provider):
            self.ledger.charge(order, key)
        self.crash_at("in_charge")  # right after the charge, before the tool returns
        return "charged"

    def before_request(self) -> None:
        self.requests += 1
        if self.requests == 2:
            self.crash_at("before_second_model")

    def sync_client(self) -> httpx.Client:
        return httpx.Client(event_hooks={"request": [lambda request: self.before_request()]})

    def async_client(self) -> httpx.AsyncClient:
        async def hook(request: httpx.Request) -> None:
            self.before_request()

        return httpx.AsyncClient(event_hooks={"request": [hook]})


def _langgraph(run: Run) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.checkpoint.sqlite import SqliteSaver
    from langgraph.prebuilt import create_react_agent
    from openinference.instrumentation.langchain import LangChainInstrumentor

    LangChainInstrumentor().instrument(tracer_provider=run.provider)
    saver = SqliteSaver(sqlite3.connect(run.dir / "checkpoints.db", check_same_thread=False))

    @tool
    def charge_card(order: str) -> str:
        """Charge the card for an order."""
        return run.charge(order)

    llm = ChatOpenAI(model="fake-model", base_url=run.args.model_url, api_key="sk-fake", max_retries=0,
                     http_client=run.sync_client())
    graph = create_react_agent(llm, [charge_card], checkpointer=saver)
    config: Any = {"configurable": {"thread_id": SESSION}}
    # Each step's checkpoint written before the next step starts (LangGraph's default writes it
    # while the next step runs, so a crash there loses it).
    graph.invoke(None if run.args.phase == "recover" else {"messages": [("user", f"charge order {ORDER}")]}, config,
                 durability="sync")


def _dbos(run: Run) -> Any:
    from dbos import DBOS

    DBOS(config={"name": "billing-agent", "system_database_url": f"sqlite:///{run.dir / 'dbos.db'}",
                 "enable_otlp": True})

    @DBOS.step()
    def charge_step(order: str) -> str:
        return run.charge(order)

    return DBOS, charge_step


def _finish_dbos(run: Run, dbos: Any, start: Any) -> None:
    from dbos import SetWorkflowID

    dbos.launch()  # a second process recovers the workflow the first left pending, by itself
    if run.args.phase == "first":
        with SetWorkflowID(SESSION):
            start()
    else:
        dbos.retrieve_workflow(SESSION).get_result()


def _pydantic_ai_dbos(run: Run) -> None:
    from openai import AsyncOpenAI
    from pydantic_ai import Agent
    from pydantic_ai.durable_exec.dbos import DBOSAgent
    from pydantic_ai.models.instrumented import InstrumentationSettings
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    dbos, charge_step = _dbos(run)
    client = AsyncOpenAI(base_url=run.args.model_url, api_key="sk-fake", max_retries=0, http_client=run.async_client())
    agent: Agent[None, str] = Agent(OpenAIChatModel("fake-model", provider=OpenAIProvider(openai_client=client)),
                                    name="billing")

    @agent.tool_plain
    def charge_card(order: str) -> str:
        """Charge the card for an order."""
        return str(charge_step(order))

    durable = DBOSAgent(agent)
    Agent.instrument_all(InstrumentationSettings(tracer_provider=run.provider))
    _finish_dbos(run, dbos, lambda: durable.run_sync(f"charge order {ORDER}", conversation_id=SESSION))


def _agents_sdk_dbos(run: Run) -> None:
    import agents
    from dbos_openai_agents import DBOSRunner
    from openai import AsyncOpenAI
    from openinference.instrumentation.openai_agents import OpenAIAgentsInstrumentor

    dbos, charge_step = _dbos(run)

    @agents.function_tool
    def charge_card(order: str) -> str:
        """Charge the card for an order."""
        return str(charge_step(order))

    agents.set_trace_processors([])
    OpenAIAgentsInstrumentor().instrument(tracer_provider=run.provider)
    agents.set_default_openai_client(AsyncOpenAI(base_url=run.args.model_url, api_key="sk-fake", max_retries=0,
                                                 http_client=run.async_client()), use_for_tracing=False)
    agents.set_default_openai_api("chat_completions")
    agent = agents.Agent(name="billing", instructions="Charge orders.", tools=[charge_card], model="fake-model")

    @dbos.workflow()
    def billing(order: str) -> str:
        return str(DBOSRunner.run_sync(agent, f"charge order {order}").final_output)

    _finish_dbos(run, dbos, lambda: billing(ORDER))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.durable_runtimes.agent")
    parser.add_argument("--stack", choices=STACKS, required=True)
    parser.add_argument("--build", choices=BUILDS, required=True)
    parser.add_argument("--crash", choices=CRASHES, required=True)
    parser.add_argument("--phase", choices=("first", "recover"), required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--model-url", required=True)
    args = parser.parse_args(argv)
    os.environ.setdefault("OPENAI_API_KEY", "sk-fake")
    run = Run(args)
    stacks = {"langgraph": _langgraph, "pydantic-ai-dbos": _pydantic_ai_dbos, "agents-sdk-dbos": _agents_sdk_dbos}
    stacks[args.stack](run)
    run.provider.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
