"""The first tier as a process: ``serve`` with ``route.endpoint`` set.

It receives whole traces (a Collector routes it by trace id), gives every span its
session with :class:`~processor.route.by_session.SessionSplitter` (the checker's own
identity stage) and sends the spans on to ``route.endpoint`` (a Collector routing by
session) with ``durable.session.id`` on their resource. It evaluates nothing.

**What it acknowledges survives a crash.** A request is journaled in SQLite
(``state.path``, the same inbox journal the evaluator keeps) before it is acknowledged.
The worker admits journaled requests into the splitter and sends what comes out; every
``route.checkpoint_interval``, once everything it has let out is taken by the downstream,
one transaction deletes the journal entries admitted so far and saves the splitter as
plain data (the sessions of the traces it has seen, the spans still waiting for theirs).
After a crash the splitter is read back from that checkpoint and the entries journaled
since are admitted again, with the wall time they were received: what went on after the
checkpoint goes on again, and the evaluators take a span they already have once (its
delivery key). Nothing acknowledged is lost; at most one interval is sent twice.

**Sending is retried, never dropped**: with capped exponential backoff and jitter (or the
downstream's own retry delay) for as long as it is unavailable; meanwhile requests are
still journaled until ``state.journal_max_size``, past which they are refused "retry
later". A request the downstream refuses for good (not retryable) is counted and logged
as a count, never its content.

At a clean stop the spans still waiting for their session stay in the checkpoint for
the next start, as the evaluator keeps its reordering window.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from processor.config import Config
from processor.convert.spans import SpanConverter
from processor.errors import StateError
from processor.receive.forward import forward_headers_for_log, open_sender, redact_endpoint, split_resource_spans
from processor.receive.intake import OtlpIntake
from processor.receive.otlp_common import partial_success_message
from processor.receive.queue import Ack, Batch, IngestQueue, ProcessingFailed
from processor.route.by_session import SessionSplitter
from processor.state.journal import Journal, JournalEntry, NewEntry
from processor.state.sqlite import SqliteStore
from processor.telemetry import Telemetry

log = logging.getLogger(__name__)

# The splitter's checkpoint, in the store's meta table.
_CHECKPOINT_KEY: Final = "route.splitter"
# Requests journaled together (one fsync), at most.
_MAX_GROUP: Final = 64
_MAX_STALL_S: Final = 60.0


@dataclass(slots=True)
class RouteStats:
    journaled: int = 0
    sent_spans: int = 0
    checkpoints: int = 0
    resumed_entries: int = 0


class RouteWorker:
    """The queue's single consumer in the first tier: journal, split by session, send on, checkpoint."""

    def __init__(self, queue: IngestQueue, store: SqliteStore, config: Config, telemetry: Telemetry) -> None:
        self._queue = queue
        self._store = store
        self._telemetry = telemetry
        self._route = config.route
        self._downstream = config.route.downstream()
        self._journal = Journal(store, max_bytes=int(config.state.journal_max_size), telemetry=telemetry)
        self._converter = SpanConverter(config.convert)
        self._lateness_ns = int(float(config.evaluate.allowed_lateness) * 1e9)
        self._tick_s = float(config.evaluate.tick_interval)
        self._splitter = SessionSplitter(self._converter, self._lateness_ns)
        self._sender = open_sender(self._downstream)
        # What the splitter let out and the downstream has not taken yet, in order: ResourceSpans of at
        # most max_batch_spans spans each, with their span counts.
        self._outgoing: list[tuple[Any, int]] = []
        # The splitter let spans out by the clock since the last checkpoint (not only by admissions).
        self._released_since_checkpoint = False
        # Journal entries (id, size) admitted into the splitter since the last checkpoint.
        self._admitted: list[tuple[int, int]] = []
        self._last_admitted_id = 0
        self._attempt = 0
        self._next_send = 0.0
        self._last_checkpoint = time.monotonic()
        self._deadline = float("inf")
        self._heartbeat = time.monotonic()
        self._last_failure = float("-inf")
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="durable-check-route", daemon=True)
        self.processed_spans = 0
        self.stats = RouteStats()

    # -- what serve asks of its worker ---------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        self._started.wait(60.0)
        if self._start_error is not None:
            raise self._start_error

    def drain(self, timeout_s: float) -> bool:
        """Wait until the (closed) queue is journaled and what can be sent is taken (at most ``timeout_s``)."""
        self._deadline = time.monotonic() + timeout_s
        self._thread.join(timeout_s + 1.0)
        return not self._thread.is_alive()

    def alive(self) -> tuple[bool, str]:
        if not self._thread.is_alive():
            return True, ""
        stalled = time.monotonic() - self._heartbeat
        if stalled > _MAX_STALL_S:
            return False, f"the first tier's worker has been stuck for {stalled:.0f}s"
        return True, ""

    @property
    def healthy(self) -> bool:
        return time.monotonic() - self._last_failure > 5.0

    @property
    def held_spans(self) -> int:
        return self._splitter.held_spans

    # -- the loop ------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._resume()
        except BaseException as exc:  # reported to start(): serve must not run without its journal
            self._start_error = exc
            self._started.set()
            return
        self._started.set()
        while True:
            self._heartbeat = time.monotonic()
            group = self._take_group(self._wait_s())
            if group:
                self._accept(group)
            self._admit_journaled()
            if self._release(self._splitter.release_due(time.time_ns())):
                self._released_since_checkpoint = True
            self._send_due()
            self._checkpoint_due()
            self._telemetry.route_held.set(self._splitter.held_spans)
            if self._queue.drained() and (not self._outgoing or time.monotonic() > self._deadline):
                self._checkpoint(final=True)
                self._sender.close()
                return

    def _wait_s(self) -> float:
        wait = self._tick_s
        if self._outgoing:
            wait = min(wait, max(0.0, self._next_send - time.monotonic()))
        return wait

    def _take_group(self, wait_s: float) -> list[Batch]:
        first = self._queue.get(wait_s)
        if first is None:
            return []
        group = [first]
        while len(group) < _MAX_GROUP:
            more = self._queue.get(0.0)
            if more is None:
                break
            group.append(more)
        return group

    # -- 1. journal, then acknowledge ------------------------------------------------------------

    def _accept(self, group: Sequence[Batch]) -> None:
        if time.monotonic() > self._deadline:
            for batch in group:
                _answer(batch, error=ProcessingFailed("the first tier stopped before taking this request"))
            return
        entries = [
            NewEntry(batch.body if batch.body is not None else batch.request.SerializeToString(),
                     batch.protocol, batch.origin, batch.received_ns, 0, list(batch.decode_problems))
            for batch in group
        ]
        try:
            outcome = self._journal.append(entries)
        except StateError as exc:
            self._last_failure = time.monotonic()
            log.error("journaling %d request(s) failed; the senders are asked to retry: %s", len(group), exc)
            for batch in group:
                self._telemetry.spans_rejected.labels(batch.protocol, "unavailable").inc(batch.span_count)
                _answer(batch, error=ProcessingFailed(f"the first tier's journal failed: {exc}"))
            return
        for batch, entry_id in zip(group, outcome, strict=True):
            if isinstance(entry_id, StateError):
                self._telemetry.spans_rejected.labels(batch.protocol, "unavailable").inc(batch.span_count)
                _answer(batch, error=ProcessingFailed(str(entry_id)))
                continue
            self.stats.journaled += 1
            self.processed_spans += batch.span_count
            # Spans an OTLP/JSON request carried that did not decode cannot go on: refused here, named.
            undecoded = len(batch.decode_problems)
            if undecoded:
                self._telemetry.spans_rejected.labels(batch.protocol, "unconvertible").inc(undecoded)
            _answer(batch, Ack(undecoded, partial_success_message([], batch.decode_problems)))

    # -- 2. split by session -----------------------------------------------------------------------

    def _resume(self) -> None:
        """The splitter as the last checkpoint left it; the entries journaled since, admitted again."""
        saved = self._store.meta_get(_CHECKPOINT_KEY)
        if saved is not None:
            self._splitter = SessionSplitter.from_plain(self._converter, self._lateness_ns, orjson.loads(saved))
        before = len(self._admitted)
        self._admit_journaled()
        self.stats.resumed_entries = len(self._admitted) - before
        if self.stats.resumed_entries or self._splitter.held_spans:
            log.info("first tier resumed: %d journaled request(s) admitted again, %d span(s) waiting for their "
                     "session", self.stats.resumed_entries, self._splitter.held_spans)

    def _admit_journaled(self) -> None:
        while True:
            entries = self._journal.pending(after_id=self._last_admitted_id, limit=256)
            if not entries:
                return
            for entry in entries:
                self._admit(entry)

    def _admit(self, entry: JournalEntry) -> None:
        self._last_admitted_id = entry.id
        self._admitted.append((entry.id, entry.size))
        if entry.damaged is not None:
            log.error("journal entry %d cannot be read back (%s); it is skipped", entry.id, entry.damaged)
            return
        request = trace_service_pb2.ExportTraceServiceRequest.FromString(entry.body)
        # The time it was received: after a restart, what waited then has waited as long now.
        self._splitter.release_due(entry.received_ns)
        self._release(self._splitter.admit(request, entry.received_ns))

    def _release(self, resource_spans: list[Any]) -> bool:
        """Queue what the splitter let out for sending; whether there was any."""
        if not resource_spans:
            return False
        if not self._outgoing:
            self._next_send = time.monotonic()
        for unit in resource_spans:
            self._outgoing.extend(split_resource_spans(unit, self._route.max_batch_spans))
        return True

    # -- 3. send on ---------------------------------------------------------------------------------

    def _send_due(self) -> None:
        """Send what is outgoing, in requests of at most ``max_batch_spans``, while the downstream takes it."""
        while self._outgoing and time.monotonic() >= self._next_send:
            spans = 0
            taken = 0
            for _, count in self._outgoing:
                if taken and spans + count > self._route.max_batch_spans:
                    break
                spans += count
                taken += 1
            request = trace_service_pb2.ExportTraceServiceRequest(
                resource_spans=[piece for piece, _ in self._outgoing[:taken]])
            outcome = self._sender.send(request)
            if outcome.ok or not outcome.retryable:
                if outcome.ok:
                    self.stats.sent_spans += spans
                    self._telemetry.route_sent.inc(spans)
                refused = spans if not outcome.ok else outcome.rejected_spans
                if refused:
                    self._telemetry.route_refused.inc(refused)
                    log.warning("the downstream refused %d of %d span(s) for good (%s)", refused, spans,
                                outcome.reason or "partial success")
                del self._outgoing[:taken]
                self._attempt = 0
                continue
            self._telemetry.route_send_failures.inc()
            backoff = min(float(self._route.max_backoff), float(self._route.initial_backoff) * 2 ** self._attempt)
            # Full jitter on the upper half: tiers that failed together do not come back together.
            delay = random.uniform(backoff / 2, backoff)  # noqa: S311 - jitter, not security
            if outcome.retry_after_s is not None:
                delay = min(float(self._route.max_backoff), max(delay, outcome.retry_after_s))
            if self._attempt == 0 or self._attempt % 10 == 0:
                log.warning("sending %d span(s) on failed (%s); retrying in %.1fs", spans, outcome.reason, delay)
            self._attempt += 1
            self._next_send = time.monotonic() + delay
            return

    # -- 4. checkpoint --------------------------------------------------------------------------------

    def _checkpoint_due(self) -> None:
        if (self._admitted or self._released_since_checkpoint) and \
                time.monotonic() - self._last_checkpoint >= float(self._route.checkpoint_interval):
            self._checkpoint(final=False)

    def _checkpoint(self, *, final: bool) -> None:
        """Record as done what the downstream has taken: possible only with nothing outgoing."""
        if self._outgoing or not (self._admitted or self._released_since_checkpoint):
            if final and self._outgoing:
                log.warning("stopping with %d span(s) not taken by the downstream; they go on at the next start",
                            sum(count for _, count in self._outgoing))
            return
        plain = orjson.dumps(self._splitter.to_plain()).decode()
        done = self._admitted
        try:
            with self._store.unit():
                self._journal.done_in_unit(done)
                self._store.in_unit(lambda: self._store.meta_put(_CHECKPOINT_KEY, plain))
        except StateError as exc:
            self._last_failure = time.monotonic()
            log.error("recording the first tier's checkpoint failed (retried at the next one): %s", exc)
            return
        self._admitted = []
        self._released_since_checkpoint = False
        self._last_checkpoint = time.monotonic()
        self.stats.checkpoints += 1


def _answer(batch: Batch, ack: Ack | None = None, error: Exception | None = None) -> None:
    with contextlib.suppress(Exception):
        if error is not None:
            batch.ack.set_exception(error)
        else:
            batch.ack.set_result(ack if ack is not None else Ack())


class RouteServer:
    """The receivers, the queue and the :class:`RouteWorker` of one first-tier process."""

    def __init__(self, config: Config, telemetry: Telemetry, store: SqliteStore) -> None:
        from exporters import build_exporters

        self.config = config
        self.telemetry = telemetry
        self.store = store
        q = config.queue
        self.queue = IngestQueue(q.max_requests, q.max_spans, float(q.retry_after), telemetry)
        self.worker = RouteWorker(self.queue, store, config, telemetry)
        self.intake = OtlpIntake(config.receivers.otlp, self.queue, telemetry, alive=self.worker.alive,
                                 healthy=lambda: self.worker.healthy, failing="the journal is failing")
        # Its own metrics only (route_problems allows no other exporter here).
        self.exporters = build_exporters(config.exporters, telemetry)

    @property
    def grpc_port(self) -> int:
        return self.intake.grpc_port

    @property
    def http_port(self) -> int:
        return self.intake.http_port

    async def start(self) -> None:
        """Start the worker and both receivers; OSError if an endpoint cannot be bound."""
        self.worker.start()
        await self.intake.start()
        route = self.config.route
        logging.getLogger("processor.serve").info(
            "first tier: every span goes on to %s over %s with its session on the resource (headers: %s); "
            "nothing is evaluated here", redact_endpoint(route.endpoint), route.protocol,
            forward_headers_for_log(route.headers))
        self.intake.started = True

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop accepting, journal and send what was accepted, checkpoint, stop the receivers."""
        deadline = time.monotonic() + timeout_s
        await self.intake.drain()
        loop = asyncio.get_running_loop()
        drained = await loop.run_in_executor(None, self.worker.drain, max(1.0, deadline - time.monotonic()))
        if not drained:
            log.error("the first tier did not finish draining in time")
        await self.intake.stop(deadline)
        for exporter in self.exporters:
            exporter.shutdown(max(1.0, deadline - time.monotonic()))
        if drained:
            self.store.close()
