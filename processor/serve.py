"""``durable-check serve``: OTLP in, violations out, for as long as the process runs.

One asyncio loop runs both receivers (grpc.aio and uvicorn). One evaluator thread
owns the pipeline (the engine is not thread-safe): it drains the bounded queue,
converts and evaluates each request, resolves the request's acknowledgement, hands
the spans to processor mode's forwarder, and moves the engine's clock every
``tick_interval`` so that deadlines fire even when no span arrives.

Shutdown (SIGTERM, SIGINT): stop accepting (readiness and gRPC health turn
NOT_SERVING, new requests are answered "retry later"), let the worker drain what was
accepted, stop the receivers, then ``pipeline.shutdown`` flushes every exporter.
With the in-memory state the worker ends with the engine's serve-mode ``finish()``:
the spans it still holds in its reordering buffer (the last ``allowed_lateness``)
were acknowledged and are evaluated now, or they would be lost with the process;
only deadlines the clock has already passed fire, and open waits stay open. A
durable store keeps that buffer across the restart instead.

The worker is :class:`processor.worker.EvaluatorWorker`, one for every store: with a
durable store (sqlite, postgres) it journals each request before acknowledging it and
records violations in the store's outbox before the exporters see them (docs/state.md).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from pathlib import Path
from typing import Final, Generic, Protocol, TypeVar

from processor.config import Config
from processor.convert.spans import SpanConverter
from processor.embedded_http import quiet_accept_errors
from processor.open_files import soft_limit
from processor.operate.server import UiServer, attach_views
from processor.operate.wait_gauges import WaitGauges
from processor.pipeline import Pipeline
from processor.receive.budget import ByteBudget
from processor.receive.forward import AnnotatingHold, Forwarder, forward_headers_for_log, redact_endpoint
from processor.receive.intake import RECEIVER_GRACE_S, OtlpIntake, describe_protection, with_port
from processor.receive.queue import IngestQueue
from processor.state.base import StateStore
from processor.telemetry import Telemetry
from processor.violation_caps import CapLimits, ViolationCaps
from processor.worker import EvaluatorWorker, WorkerOptions

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S: Final = 30.0


def build_store(config: Config) -> StateStore | None:
    """The configured state store; None for the engine's own in-memory one.

    StateError names the file or server (locked, corrupt, unwritable, unreachable).
    """
    state = config.state
    if state.backend == "sqlite":
        from processor.state.sqlite import SqliteStore

        return SqliteStore(state.path, synchronous=state.synchronous, busy_timeout_s=float(state.busy_timeout))
    if state.backend == "postgres":
        from processor.state.postgres import PostgresStore

        pg = state.postgres
        return PostgresStore(pg.dsn, replica_id=pg.replica_id or None, lease_ttl_s=float(pg.lease_ttl),
                             connect_timeout_s=float(pg.connect_timeout))
    return None


def build_pipeline(config: Config, telemetry: Telemetry, store: StateStore | None = None) -> Pipeline:
    """The engine with the configured rules and store, and the configured exporters. Raises RuleFormatError."""
    from exporters import build_exporters
    from processor.evaluate.engine import Engine, EngineOptions
    from processor.evaluate.rulefmt import load_rules

    ruleset = load_rules(
        config.evaluate.rules,
        include_shipped=config.evaluate.include_shipped_rules,
        limits=config.evaluate.rule_limits.cost_limits(),
        packs=config.evaluate.packs,
    )
    options = EngineOptions(
        strict=config.evaluate.strict,
        allowed_lateness_s=float(config.evaluate.allowed_lateness),
        session_idle_timeout_s=float(config.evaluate.session_idle_timeout),
        max_sessions=config.evaluate.max_sessions,
        max_remembered_entries=config.evaluate.max_remembered_entries,
        mode="serve",
    )
    engine = Engine(ruleset, options, store=store, telemetry=telemetry)

    def engine_factory(on: StateStore) -> Engine:
        return Engine(ruleset, options, store=on, telemetry=telemetry)

    caps = ViolationCaps(CapLimits(
        per_request=config.evaluate.max_violations_per_request,
        per_session=config.evaluate.max_violations_per_session,
        max_sessions=config.evaluate.max_sessions,
    ), telemetry)
    pipeline = Pipeline(engine, build_exporters(config.exporters, telemetry), telemetry, engine_factory, caps)
    if config.evaluate.waivers or config.evaluate.baseline:
        from processor.cmd_replay import load_exemptions

        # Read once at start: the waiver file and the baseline are the operator's, changed with a
        # restart like the rules. A baseline entry accepts as many findings as it counted.
        pipeline.exemptions = load_exemptions(config, None, None)
    return pipeline


class Server:
    """Receivers, queue, worker and forwarder of one serve process."""

    def __init__(
        self, config: Config, pipeline: Pipeline, telemetry: Telemetry, store: StateStore | None = None
    ) -> None:
        self.config = config
        self.store = store
        self.telemetry = telemetry
        self.pipeline = pipeline
        telemetry.open_files_limit.set(soft_limit())
        q = config.queue
        self.queue = IngestQueue(q.max_requests, q.max_spans, float(q.retry_after), telemetry)
        self.forwarder = Forwarder(config.forward, telemetry) if config.forward.enabled else None
        hold = None
        if self.forwarder is not None:
            # A span is evaluated once it has waited allowed_lateness and a tick has run.
            hold_s = float(config.evaluate.allowed_lateness) + 2 * float(config.evaluate.tick_interval)
            hold = AnnotatingHold(self.forwarder, hold_s, config.forward.max_buffer_spans)
        # Journal before acknowledging and violations through the outbox when the store is durable.
        self.worker = EvaluatorWorker(
            self.queue,
            pipeline,
            store,
            converter=SpanConverter(config.convert),
            hold=hold,
            tick_interval_s=float(config.evaluate.tick_interval),
            telemetry=telemetry,
            options=WorkerOptions(journal_max_bytes=int(config.state.journal_max_size),
                                  max_stall_s=float(config.evaluate.max_stall),
                                  flush_window_on_stop=config.evaluate.flush_window_on_stop),
        )
        # The operator view's read model, fed by the pipeline from the first batch: the open-wait gauges
        # read it whether the view (ui.endpoint) is served or not, so both always say the same. Not
        # served, it keeps only the gauges' part (ViewStore.waits_only).
        self.views = views = attach_views(config, pipeline, store)
        WaitGauges(telemetry, views)
        self.ui: UiServer | None = None
        if config.ui.endpoint:
            self.ui = UiServer(config, views, pipeline.engine.ruleset, telemetry, self.ready)
        self.intake = OtlpIntake(config.receivers.otlp, self.queue, telemetry, alive=self.worker.alive,
                                 healthy=lambda: self.worker.healthy, failing="the state store is failing")
        # The loop the receivers run in (set by start); other threads schedule onto it.
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def grpc_port(self) -> int:
        return self.intake.grpc_port

    @property
    def http_port(self) -> int:
        return self.intake.http_port

    @property
    def budget(self) -> ByteBudget:
        return self.intake.budget

    def accepting(self) -> bool:
        return self.intake.accepting()

    def ready(self) -> tuple[bool, str]:
        return self.intake.ready()

    async def start(self) -> None:
        """Start the worker, the forwarder and both receivers; OSError if an endpoint cannot be bound."""
        self.loop = asyncio.get_running_loop()
        quiet_accept_errors(self.loop)
        if self.forwarder is not None:
            self.forwarder.start()
        self.worker.start()
        await self.intake.start()
        if self.ui is not None:
            await self.ui.start()
            logger.info("operator view on %s://%s", "https" if self.config.ui.tls.enabled else "http",
                        with_port(self.config.ui.endpoint, self.ui.port))
            logger.info("operator view: %s", describe_protection(self.config.ui.tls, self.config.ui.auth))
        for line in _where_to_look(self.config, self.intake.http_port, self.intake.grpc_port):
            logger.info("%s", line)
        if self.forwarder is not None:
            fwd = self.config.forward
            logger.info("processor mode: forwarding every span to %s over %s (headers: %s)",
                        redact_endpoint(fwd.endpoint), fwd.protocol, forward_headers_for_log(fwd.headers))
        self.intake.started = True

    async def begin_drain(self) -> None:
        """Stop accepting: readiness and gRPC health turn NOT_SERVING; new requests are told to retry."""
        await self.intake.drain()

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop accepting, evaluate what was accepted, stop receivers, flush exporters and the forwarder."""
        deadline = time.monotonic() + timeout_s
        await self.begin_drain()
        loop = asyncio.get_running_loop()
        drained = await loop.run_in_executor(None, self.worker.drain, max(1.0, deadline - time.monotonic()))
        if not drained:
            logger.error("the evaluator did not finish draining in time")
        logger.debug("shutdown: queue drained")
        await self.intake.stop(deadline)
        if self.ui is not None:
            await self.ui.stop(max(1.0, min(RECEIVER_GRACE_S, deadline - time.monotonic())))
        else:
            self.views.close()  # the gauges' reader; the view's server closes it when there is one
        logger.debug("shutdown: receivers stopped")
        await loop.run_in_executor(None, self.pipeline.shutdown, max(1.0, deadline - time.monotonic()))
        logger.debug("shutdown: exporters flushed")
        if drained:
            # What the exporters delivered while flushing is recorded, not handed over again at the next start.
            self.worker.record_final_confirmations()
        if self.forwarder is not None:
            await loop.run_in_executor(None, self.forwarder.shutdown, max(1.0, deadline - time.monotonic()))
        if self.store is not None and drained:
            # Only once the worker is done with it: it is the store's single user.
            self.store.close()
        logger.debug("shutdown: done")


# Listening on every interface; never bound here, only named in a start-up line.
_WILDCARD_HOSTS: Final = frozenset({"0.0.0.0", "[::]", "::", ""})  # noqa: S104


def _reachable(endpoint: str, port: int) -> str:
    """An endpoint as an agent on this machine dials it: a wildcard address is this machine's loopback."""
    host = endpoint.rpartition(":")[0]
    return f"{'127.0.0.1' if host in _WILDCARD_HOSTS else host}:{port}"


def _where_to_look(config: Config, http_port: int, grpc_port: int) -> list[str]:
    """What a user starting serve needs next: what to set in the agents, where the violations go."""
    receivers = config.receivers.otlp
    lines = []
    if receivers.http.endpoint:
        scheme = "https" if receivers.http.tls.enabled else "http"
        lines.append(f"agents: OTEL_EXPORTER_OTLP_ENDPOINT={scheme}://{_reachable(receivers.http.endpoint, http_port)}")
    elif receivers.grpc.endpoint:
        scheme = "https" if receivers.grpc.tls.enabled else "http"
        lines.append("agents: OTEL_EXPORTER_OTLP_PROTOCOL=grpc "
                     f"OTEL_EXPORTER_OTLP_ENDPOINT={scheme}://{_reachable(receivers.grpc.endpoint, grpc_port)}")
    jsonl = config.exporters.jsonl.path
    if jsonl:
        lines.append(f"violations: {Path(jsonl).resolve()} (JSONL)")
    return lines


class Serving(Protocol):
    """A process's servers: the evaluator (Server) or the first tier (processor.route.first_tier)."""

    async def start(self) -> None: ...

    async def shutdown(self, timeout_s: float = 30.0) -> None: ...


async def serve_until_signalled(server: Serving, shutdown_timeout_s: float = 30.0) -> None:
    """Run until SIGTERM or SIGINT, then shut down gracefully."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await server.start()
        await stop.wait()
        logger.info("signal received; draining")
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        await server.shutdown(shutdown_timeout_s)


S = TypeVar("S", bound=Serving)


class ServerThread(Generic[S]):
    """A Server on its own loop in a background thread (tests, benchmarks, embedding)."""

    def __init__(self, server: S) -> None:
        self.server = server
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="durable-check-serve", daemon=True)

    def start(self) -> S:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result(_STARTUP_TIMEOUT_S)
        return self.server

    def stop(self, timeout_s: float = 30.0) -> None:
        future = asyncio.run_coroutine_threadsafe(self.server.shutdown(timeout_s), self._loop)
        try:
            future.result(timeout_s + 5.0)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5.0)
            self._loop.close()

    def __enter__(self) -> S:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
