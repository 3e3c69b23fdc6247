"""Serve's evaluator worker: take requests, make them safe, acknowledge, evaluate, deliver.

One worker for every state store. It is the single consumer of the queue and the only
thread that touches the engine and the store. Its loop:

1. **Accept.** Take every request waiting in the queue (up to ``max_group``, waiting
   ``linger_s`` for more after the first) and convert each (the partial-success answer
   needs the rejected spans).
2. **Make safe, acknowledge.** A store with a journal (sqlite, postgres) appends the
   requests to its inbox journal in one transaction (one fsync for the group; a shared
   store claims the requests' sessions there) and each journaled request is answered
   success; one that could not be journaled (disk full, read-only, journal full, its
   session held by another replica) is answered "retry later". Nothing is acknowledged
   that is not on disk. The in-memory store has no journal: nothing survives the
   process anyway, so a request is evaluated at once and answered once evaluated.
3. **Evaluate.** Pending requests go through the engine in order, up to ``max_evaluate``
   per unit of work: at once when no request waits in the queue, else once the oldest
   waited ``evaluate_after_s`` (requests that queue up share one commit). With a journal
   one transaction then commits the engine's state and deletes the entries from the
   journal; the violations are recorded in the outbox in that transaction (a shared
   store) or, with SQLite, in small ones of their own, each handed over at once: after
   every ``hand_out_every_s`` of evaluation and at the chunk's end, so that they wait
   neither for the rest of a long chunk nor for the state write (a crash in between
   evaluates the entries again, and the outbox does not record the same violation ids
   twice).
4. **Deliver.** With an outbox, new rows are handed to the exporters and a row is
   deleted from ``outbox_pending`` in a later transaction once its exporter confirms
   delivery (the line written, the endpoint's acceptance), not when ``export()``
   returns: a violation still in an exporter's retry queue at a crash is handed over
   again at the restart. Without one, violations go straight to the exporters.

Every ``tick_interval`` the engine's clock moves (deadlines fire, in a unit of work of
their own), overdue deliveries are handed over again, and a shared store renews its
lease and adopts the work of replicas that died.

**Faults.** A failed commit rolls back; the engine is rebuilt from the last committed
state and the journal's entries are evaluated again (with capped backoff while the
fault lasts). Requests arriving meanwhile are answered "retry later" when they cannot
be journaled. At start, entries left in the journal by a crash are evaluated before
anything new, and undelivered outbox rows are handed over again.

Telemetry: ``durable_check_journal_depth``/``_bytes`` (the journal),
``durable_check_outbox_pending{exporter}`` (the outbox) and
``durable_check_state_failures_total{kind}`` (every failed store operation, by
:func:`failure_kind`).

**Nothing wedges the evaluator.** A request whose evaluation raises is answered (in
memory) or done (journaled) and counted; one whose commit fails the same way every time
is narrowed down and set aside. A request that stops the process while it is evaluated
(a hang the liveness probe ends, a crash) comes back from the journal at every start:
so what was journaled before a start is evaluated under a durable marker naming the
entries in progress. When a start finds the marker still pointing at pending entries,
the previous run died evaluating them: they are evaluated one at a time (each under its
own marker), and an entry that was the only one in progress ``max_tries`` times is set
aside. Steady state writes no marker. The loop's heartbeat feeds :meth:`alive`: an
evaluator stuck for ``max_stall_s`` makes ``/healthz`` fail, so the process is
restarted and the marker does the rest. Every set-aside request is counted in
``durable_check_requests_set_aside_total{reason}`` and logged without its content.

**Stop.** The worker evaluates what was accepted. With a journal, the reordering
buffer stays in the store (the spans it holds were acknowledged and are released
after the restart), so there is no ``finish()``; in memory the worker ends with the
engine's serve-mode ``finish()``: the spans still buffered would otherwise be lost
with the process.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from google.protobuf.message import DecodeError

from processor.convert.spans import SpanConverter
from processor.errors import StateError
from processor.receive.otlp_common import partial_success_message, rejected_span_count
from processor.receive.queue import Ack, Batch, IngestQueue, ProcessingFailed
from processor.records import Action, Malformed, SessionMark
from processor.state.base import StateStore
from processor.state.faults import SessionOwnedElsewhere, failure_kind
from processor.state.journal import Journal, JournalEntry, NewEntry
from processor.state.outbox import Dispatcher, Outbox
from processor.state.sqlite import SqliteStore
from processor.state.sqlstore import SqlStateStore
from processor.telemetry import SET_ASIDE_REASONS, STATE_FAILURE_KINDS, Telemetry
from processor.violations import Violation

if TYPE_CHECKING:
    from processor.evaluate.engine import Engine, EngineOptions
    from processor.evaluate.model import RuleSet
    from processor.pipeline import Pipeline
    from processor.receive.forward import AnnotatingHold

# What conversion gives the engine: actions, inputs it reports as DS000, and spans that only name a session.
Item = Action | Malformed | SessionMark

log = logging.getLogger(__name__)

_MAX_BACKOFF_S: Final = 5.0
_PRUNE_EVERY_TICKS: Final = 60
_SEQ_KEY: Final = "next_seq"
# Meta key (per replica) naming the journal entries being evaluated after a start: "first,last,tries".
_EVALUATING_KEY: Final = "evaluating:"
_UNHEALTHY_AFTER_FAILURE_S: Final = 5.0


@dataclass(slots=True)
class _Work:
    """A request waiting for evaluation; ``items`` is None until converted (journal entries read back)."""

    entry_id: int
    size: int
    items: list[Action | Malformed | SessionMark] | None = None
    # The request, for processor mode's forwarder (None for entries read back after a restart).
    request: Any = None
    entry: JournalEntry | None = None
    # Without a journal the request is answered once evaluated: its pending acknowledgement.
    batch: Batch | None = None
    ack: Ack | None = None
    failed: bool = False


@dataclass(slots=True)
class WorkerOptions:
    linger_s: float = 0.003
    max_group: int = 64
    # While requests queue up, journaled ones are evaluated together, up to this many or once the oldest
    # waited this long, so that one state commit serves them all; alone, a request is evaluated at once.
    max_evaluate: int = 512
    evaluate_after_s: float = 0.05
    # With SQLite, a chunk of requests hands its violations out after each stretch of evaluation this long
    # (and at its end): a finding waits for that stretch, not for the chunk (see _evaluate_some).
    hand_out_every_s: float = 0.1
    journal_max_bytes: int = 256 * 1024 * 1024
    redeliver_after_s: float = 60.0
    maintain_interval_s: float = 1.0
    # An entry the process died evaluating, alone, this many times is set aside.
    max_tries: int = 2
    # The loop not coming round for this long (one evaluation hanging) makes alive() false.
    max_stall_s: float = 120.0
    # At stop, evaluate the spans in the reordering window instead of keeping them for the next start.
    flush_window_on_stop: bool = False
    # The status line: once this often while anything changed, and at stop.
    status_interval_s: float = 60.0


@dataclass(slots=True)
class _Stats:
    journaled: int = 0
    evaluated: int = 0
    replayed: int = 0
    recoveries: int = 0
    refused: int = 0
    groups: int = 0


class EvaluatorWorker:
    """The single consumer of the queue and sole user of the pipeline and its store."""

    def __init__(
        self,
        queue: IngestQueue,
        pipeline: Pipeline,
        store: StateStore | None,
        *,
        converter: SpanConverter,
        hold: AnnotatingHold | None,
        tick_interval_s: float,
        telemetry: Telemetry,
        options: WorkerOptions | None = None,
    ) -> None:
        self._queue = queue
        self._pipeline = pipeline
        # The store with a journal and an outbox; None for the in-memory one, which has neither.
        self._sql = store if isinstance(store, SqlStateStore) else None
        # Violations committed ahead of the state (see _evaluate_some) where one process owns every session;
        # a shared store commits them with the state, which its ownership check guards.
        self._ahead = isinstance(store, SqliteStore)
        self._engine_factory = pipeline.engine_factory
        if self._sql is not None and self._engine_factory is None:
            raise ValueError("a journaled store needs the pipeline's engine_factory to rebuild the engine")
        self._converter = converter
        self._hold = hold
        self._tick_interval_s = tick_interval_s
        self._telemetry = telemetry
        self._options = options or WorkerOptions()
        self._journal: Journal | None = None
        self._outbox: Outbox | None = None
        self._dispatcher: Dispatcher | None = None
        if self._sql is not None:
            self._outbox = Outbox(self._sql, [e.name for e in pipeline.exporters], telemetry=telemetry)
            for kind in STATE_FAILURE_KINDS:
                # Born at zero, so the first failure is an increase that rate() sees.
                telemetry.state_failures.labels(kind)
            self._dispatcher = Dispatcher(self._outbox, pipeline.exporters,
                                          redeliver_after_s=self._options.redeliver_after_s)
        for reason in SET_ASIDE_REASONS:
            telemetry.requests_set_aside.labels(reason)
        self._pending: collections.deque[_Work] = collections.deque()
        # Entries up to this id were journaled before this start: evaluated under the durable marker.
        self._replay_until = 0
        # The marker a start found still naming pending entries: (first id, last id, tries).
        self._suspect: tuple[int, int, int] | None = None
        self._heartbeat = time.monotonic()
        self._violations_by_severity: collections.Counter[str] = collections.Counter()
        self._changed = False
        self._last_status = time.monotonic()
        # When the oldest entry of _pending was journaled (or the last evaluation, if later).
        self._pending_since = 0.0
        self._seq = 0
        self._deadline = float("inf")
        self._broken_until = 0.0
        self._backoff_s = 0.0
        # After an unexpected error in a chunk, its requests are evaluated one at a time
        # (this many still to go) so that the one that fails alone can be set aside.
        self._isolate_left = 0
        self._poisoned: _Work | None = None
        self._ticks = 0
        self._last_maintain = 0.0
        self._handover_due = False
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="durable-check-evaluator", daemon=True)
        self.processed_spans = 0
        self.stats = _Stats()
        self._last_failure = float("-inf")

    @property
    def journaled(self) -> bool:
        """True when requests are journaled before they are acknowledged (a durable store)."""
        return self._sql is not None

    def alive(self) -> tuple[bool, str]:
        """False while one step of the evaluator has not come round for ``max_stall_s`` (liveness)."""
        if not self._thread.is_alive():
            return True, ""
        stalled = time.monotonic() - self._heartbeat
        if stalled > self._options.max_stall_s:
            return False, f"the evaluator has been stuck for {stalled:.0f}s"
        return True, ""

    @property
    def healthy(self) -> bool:
        """False while the store refuses writes (and for a few seconds after): readiness reports it."""
        return time.monotonic() - self._last_failure > _UNHEALTHY_AFTER_FAILURE_S

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        self._started.wait(60.0)
        if self._start_error is not None:
            raise self._start_error

    def drain(self, timeout_s: float) -> bool:
        """Wait until the (closed) queue is empty and what was accepted evaluated (at most ``timeout_s``)."""
        self._deadline = time.monotonic() + timeout_s
        self._thread.join(timeout_s + 1.0)
        return not self._thread.is_alive()

    def record_final_confirmations(self) -> int:
        """Record the deliveries the exporters confirmed while serve's shutdown flushed them (after this
        worker stopped), so a clean restart does not hand those violations over again; returns how many.

        Call it once the worker thread has stopped (it owns the store's connection), before the store closes.
        """
        if self._sql is None or self._dispatcher is None:
            return 0
        if self._thread.is_alive() or not self._dispatcher.has_confirmations():
            return 0
        try:
            with self._sql.unit():
                count = self._dispatcher.confirmations_in_unit()
        except StateError as exc:
            self._count_failure(exc)
            log.warning("recording the exporters' last confirmations failed; those violations are handed over "
                        "again at the next start: %s", exc)
            return 0
        return count

    def _run(self) -> None:
        try:
            self._resume()
        except BaseException as exc:  # reported to start(): serve must not run without its state
            self._start_error = exc
            self._started.set()
            return
        self._started.set()
        next_tick = time.monotonic() + self._tick_interval_s
        while True:
            group: list[Batch] = []
            self._heartbeat = time.monotonic()
            try:
                wait = max(0.0, next_tick - time.monotonic())
                if self._pending:
                    wait = min(wait, max(0.0, self._pending_since + self._options.evaluate_after_s - time.monotonic()))
                group = self._take_group(wait)
                if group:
                    self._accept(group)
                if self._evaluation_due():
                    self._evaluate_some()
                if time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + self._tick_interval_s
                    self._tick()
                    if self._changed and time.monotonic() - self._last_status >= self._options.status_interval_s:
                        self._log_status()
                if self._queue.drained() and (not self._pending or time.monotonic() > self._deadline):
                    self._final()
                    return
                if self._hold is not None:
                    self._hold.release_due(time.monotonic())
                if self._pending and time.monotonic() < self._broken_until:
                    time.sleep(min(0.05, self._broken_until - time.monotonic()))
            except Exception as exc:  # a bug must not stop the checker: back to the last committed state
                log.error("the evaluator met an unexpected error: %s", type(exc).__name__,
                          exc_info=log.isEnabledFor(logging.DEBUG))
                for batch in group:
                    _resolve(batch, error=ProcessingFailed("internal error; see the checker's log"))
                if self._sql is None:
                    # Nothing to go back to: what was being evaluated is answered (above) and let go.
                    for work in self._pending:
                        if work.batch is not None:
                            _resolve(work.batch, error=ProcessingFailed("internal error; see the checker's log"))
                    self._pending.clear()
                elif self._recover("an unexpected error") and self._poisoned is not None:
                    self._set_aside(self._poisoned, "commit_failed")
                self._poisoned = None

    def _resume(self) -> None:
        store = self._sql
        if store is None or self._dispatcher is None or self._outbox is None:
            return
        self._journal = Journal(store, max_bytes=self._options.journal_max_bytes, telemetry=self._telemetry)
        seq = store.meta_get(_SEQ_KEY)
        self._seq = int(seq) if seq is not None else 0
        self._outbox.forget_unknown_exporters()
        if store.maintain():
            # Work of a stopped replica adopted before this engine saw it: build it again with that work.
            store.reset()
            self._rebuild("work adopted from a replica that stopped")
        self._reload_journal()
        if self._pending:
            self._replay_until = self._pending[-1].entry_id
            self._suspect = self._read_marker()
            log.info("resuming: %d request(s) accepted before the last stop are evaluated first", len(self._pending))
            self.stats.replayed += len(self._pending)
        handed = self._dispatcher.resume()
        if handed:
            log.info("resuming: %d undelivered violation(s) handed to the exporters again", handed)

    def _reload_journal(self) -> None:
        assert self._journal is not None
        self._pending.clear()
        after = 0
        while True:
            entries = self._journal.pending(after, limit=1000)
            if not entries:
                break
            self._pending.extend(_Work(e.id, e.size, entry=e) for e in entries)
            after = entries[-1].id

    def _final(self) -> None:
        """In memory, release the reordering buffer; with a journal, record the confirmations that came in
        (the store keeps the rest for the next start, unless told to evaluate the window now)."""
        if self._sql is None:
            self._finish_in_memory()
        elif self._options.flush_window_on_stop and not self._pending:
            self._flush_window()
        if self._hold is not None:
            self._hold.release_all()
        if self._sql is not None and self._dispatcher is not None and self._dispatcher.has_confirmations():
            with contextlib.suppress(StateError), self._sql.unit():
                self._dispatcher.confirmations_in_unit()
        self._log_status(stopping=True)

    def _flush_window(self) -> None:
        """Evaluate what the reordering window holds, as the end of the input, in one unit of work."""
        assert self._sql is not None and self._outbox is not None and self._dispatcher is not None
        fresh: list[tuple[int, Violation]] = []
        try:
            with self._sql.unit():
                violations = self._pipeline.capped(self._pipeline.engine.finish())
                self._pipeline.record_views(self._pipeline.admitted_actions(), violations)
                self._outbox.add_in_unit(violations, fresh.extend)
        except StateError as exc:
            self._count_failure(exc)
            log.error("evaluating the reordering window at stop failed; it is kept for the next start: %s", exc)
            return
        self._note(violations)
        self._dispatcher.hand_over(fresh)
        self._pipeline.hand_resolutions()
        if self._hold is not None:
            self._hold.note(violations)

    def _note(self, violations: Sequence[Violation]) -> None:
        for violation in violations:
            self._violations_by_severity[violation.severity] += 1
            self._changed = True

    def _log_status(self, *, stopping: bool = False) -> None:
        """One line: what was taken in and found, and what the reordering window still holds."""
        self._last_status = time.monotonic()
        self._changed = False
        load = self._pipeline.engine.load()
        found = ", ".join(f"{n} {severity}" for severity, n in sorted(self._violations_by_severity.items())) or "none"
        if not load.window_spans:
            window = "nothing waiting in the reordering window"
        elif stopping:
            window = (f"{load.window_spans} spans waiting in the reordering window are kept in the state and "
                      "evaluated after the next start (evaluate.flush_window_on_stop evaluates them at stop)")
        else:
            due = load.window_release_ns
            when = (f"evaluated by {time.strftime('%H:%M:%SZ', time.gmtime(due / 1e9))} "
                    f"(in {max(0.0, due / 1e9 - time.time()):.0f}s)") if due is not None else "evaluated as more arrive"
            window = f"{load.window_spans} spans waiting in the reordering window, {when}"
        log.info("%s: %d spans received, %d actions, %d sessions, violations: %s; %s",
                 "stopped" if stopping else "status", self.processed_spans, load.actions, load.sessions, found, window)

    def _finish_in_memory(self) -> None:
        # The spans still buffered were acknowledged and would be lost with the process: evaluate them now.
        try:
            violations = self._pipeline.finish()
        except Exception as exc:  # shutdown goes on; the error is logged
            _log_failure("evaluating the held-back spans failed", exc)
            return
        self._note(violations)
        if self._hold is not None:
            self._hold.note(violations)

    # -- 1, 2: accept, make safe and acknowledge ------------------------------------------------

    def _evaluation_due(self) -> bool:
        if not self._pending or time.monotonic() < self._broken_until:
            return False
        return (
            len(self._pending) >= self._options.max_evaluate
            or time.monotonic() >= self._pending_since + self._options.evaluate_after_s
            or self._queue.closed
            # Nothing waits to be acknowledged: waiting to group more would only add latency.
            or not len(self._queue)
        )

    def _take_group(self, wait_s: float) -> list[Batch]:
        first = self._queue.get(wait_s)
        if first is None:
            return []
        group = [first]
        linger_until = time.monotonic() + self._options.linger_s
        while len(group) < self._options.max_group:
            more = self._queue.get(max(0.0, linger_until - time.monotonic()))
            if more is None:
                break
            group.append(more)
        return group

    def _convert(self, group: list[Batch]) -> list[tuple[Batch, list[Item], list[Malformed], int]]:
        """Each request's items, rejected spans and first seq; a request that fails to convert is answered."""
        converted: list[tuple[Batch, list[Item], list[Malformed], int]] = []
        seq = self._seq
        for batch in group:
            try:
                if batch.body is not None:
                    # The bytes as received: read with attributes as a map, the wanted keys picked
                    # out in C (the parsed request's attributes would be walked in Python).
                    result = self._converter.convert_serialized(batch.body, batch.origin, seq)
                else:
                    result = self._converter.convert(batch.request, batch.origin, seq)
            except Exception as exc:  # one bad request must not stop the others
                log.error("converting a request of %d spans failed: %s", batch.span_count, type(exc).__name__,
                          exc_info=log.isEnabledFor(logging.DEBUG))
                if self._hold is not None:
                    # Checking failed, forwarding need not: the spans still go downstream.
                    self._hold.add(batch.request, time.monotonic())
                # Not retryable: the same request would fail the same way. Said in the partial success.
                _resolve(batch, Ack(batch.span_count, "internal error while converting these spans; see the "
                                    "checker's log"))
                continue
            undecoded = [Malformed(message=p, origin=batch.origin, source="span") for p in batch.decode_problems]
            items: list[Action | Malformed | SessionMark] = [
                *result.marks, *result.actions, *result.rejected, *undecoded
            ]
            converted.append((batch, items, result.rejected, seq))
            seq += len(result.actions)
        return converted

    def _accept(self, group: list[Batch]) -> None:
        if time.monotonic() > self._deadline:
            for batch in group:
                _resolve(batch, error=ProcessingFailed("the checker stopped before taking this request"))
            return
        if self._sql is None:
            self._accept_in_memory(group)
            return
        store = self._sql
        if store.stale and not self._recover():
            self._refuse_all(group, "the checker's state store is failing")
            return
        assert self._journal is not None
        converted: list[tuple[Batch, list[Action | Malformed | SessionMark], list[Malformed], NewEntry]] = []
        next_seq = self._seq
        for batch, items, rejected, seq in self._convert(group):
            sessions = frozenset(i.session_id for i in items if i.session_id)
            # The bytes as received when the receiver kept them (protobuf), else serialized once here (JSON).
            body = batch.body if batch.body is not None else batch.request.SerializeToString()
            entry = NewEntry(body, batch.protocol, batch.origin, batch.received_ns,
                             seq, list(batch.decode_problems), sessions)
            next_seq = seq + sum(1 for i in items if isinstance(i, Action))
            converted.append((batch, items, rejected, entry))

        def admit(entry: NewEntry) -> StateError | None:
            return store.admit(entry.session_ids)

        def save_seq() -> None:
            # The seq counter goes with the entries that used it: a replay converts with the same numbers.
            store.meta_put(_SEQ_KEY, str(next_seq))

        try:
            outcome = self._journal.append([c[3] for c in converted], admit, also=[save_seq])
        except StateError as exc:
            self._count_failure(exc)
            self._last_failure = time.monotonic()
            log.error("journaling %d request(s) failed; the senders are asked to retry: %s", len(group), exc)
            self._refuse_all(group, f"the checker's state store failed: {exc}")
            store.stale = False  # nothing of the engine was touched: no rebuild needed
            return
        self._seq = next_seq
        self.stats.groups += 1
        for (batch, items, rejected, entry), entry_id in zip(converted, outcome, strict=True):
            if isinstance(entry_id, StateError):
                self.stats.refused += 1
                self._telemetry.spans_rejected.labels(batch.protocol, "unavailable").inc(batch.span_count)
                _resolve(batch, error=ProcessingFailed(str(entry_id)))
                continue
            self.stats.journaled += 1
            unconvertible = rejected_span_count(rejected, batch.decode_problems)
            if unconvertible:
                self._telemetry.spans_rejected.labels(batch.protocol, "unconvertible").inc(unconvertible)
            if not self._pending:
                self._pending_since = time.monotonic()
            self._pending.append(_Work(entry_id, len(entry.body), items, batch.request))
            # Counted before the sender hears of it: whoever reads the count after an answer sees it.
            self.processed_spans += batch.span_count
            _resolve(batch, Ack(unconvertible, partial_success_message(rejected, batch.decode_problems)))
        if store.takeover_pending():
            # Their state and timers as their last owner committed them (nothing of this replica is pending).
            try:
                store.reset()
                self._rebuild("sessions moved to this replica")
            except StateError as exc:
                self._failed("loading sessions moved to this replica", exc)

    def _accept_in_memory(self, group: list[Batch]) -> None:
        """No journal: nothing outlives the process, so a request is evaluated at once and answered after."""
        for batch, items, rejected, seq in self._convert(group):
            self._seq = seq + sum(1 for i in items if isinstance(i, Action))
            unconvertible = rejected_span_count(rejected, batch.decode_problems)
            ack = Ack(unconvertible, partial_success_message(rejected, batch.decode_problems))
            self._pending.append(_Work(0, 0, items, batch.request, batch=batch, ack=ack))
        self._pending_since = time.monotonic()
        while self._pending:
            self._evaluate_some()

    def _refuse_all(self, group: Sequence[Batch], message: str) -> None:
        for batch in group:
            if batch.ack.done():
                continue
            self.stats.refused += 1
            self._telemetry.spans_rejected.labels(batch.protocol, "unavailable").inc(batch.span_count)
            _resolve(batch, error=ProcessingFailed(message))

    # -- 3, 4: evaluate, record, deliver -------------------------------------------------------

    def _unit(self) -> contextlib.AbstractContextManager[None]:
        """One transaction for the engine's state, the journal and the outbox; nothing to group in memory."""
        return self._sql.unit() if self._sql is not None else contextlib.nullcontext()

    def _evaluate_some(self) -> None:
        self._heartbeat = time.monotonic()
        limit = 1 if self._isolate_left else self._options.max_evaluate
        guarded = self._guard_replay([self._pending[i] for i in range(min(limit, len(self._pending)))])
        if guarded is None:
            return
        chunk, replay_ends = guarded
        fresh: list[tuple[int, Violation]] = []
        found: list[list[Violation]] = []
        ahead = self._ahead and self._journal is not None and self._outbox is not None and self._dispatcher is not None
        try:
            with self._unit():
                out_from = 0  # found[out_from:] is not out yet
                out_at = time.monotonic() + self._options.hand_out_every_s
                for work in chunk:
                    found.append(self._evaluate(work))
                    if ahead and time.monotonic() >= out_at:
                        # A long chunk hands its violations out as it goes: a finding waits for
                        # at most this stretch of evaluation, not for the whole chunk.
                        self._hand_out_ahead([v for vs in found[out_from:] for v in vs])
                        out_from = len(found)
                        out_at = time.monotonic() + self._options.hand_out_every_s
                if self._journal is not None and self._outbox is not None and self._dispatcher is not None:
                    if ahead:
                        self._hand_out_ahead([v for vs in found[out_from:] for v in vs])
                    else:
                        self._outbox.add_in_unit([v for vs in found for v in vs], fresh.extend)
                    self._journal.done_in_unit([(w.entry_id, w.size) for w in chunk])
                    self._dispatcher.confirmations_in_unit()
                    if replay_ends:
                        self._clear_marker_in_unit()
        except StateError as exc:
            self._failed("committing evaluated requests", exc)
            if isinstance(exc, SessionOwnedElsewhere) and exc.moved:
                self._hand_off(exc.moved)
            return
        except Exception:
            # Not a fault of the store: something in these requests breaks evaluation or
            # its commit. Retrying the chunk would fail the same way for ever; narrow it
            # down to the request that fails alone, which is then set aside.
            if len(chunk) == 1:
                self._poisoned = chunk[0]
            else:
                self._isolate_left = len(chunk)
            raise
        for violations in found:
            self._note(violations)
        self._changed = True
        if self._isolate_left:
            self._isolate_left -= 1
        if replay_ends:
            self._replay_until = 0
            self._suspect = None
        for _ in chunk:
            self._pending.popleft()
        self._pending_since = time.monotonic()
        self.stats.evaluated += len(chunk)
        self._succeeded()
        if self._dispatcher is not None:
            self._dispatcher.hand_over(fresh)
            self._pipeline.hand_resolutions()
        now = time.monotonic()
        for work, violations in zip(chunk, found, strict=True):
            if self._dispatcher is None:
                # No outbox: each request's violations go out, and its resolutions after them.
                self._pipeline.export(violations)
                self._pipeline.hand_resolutions()
                self._answer(work)
            if self._hold is not None:
                # Held first: condition-rule violations of its own spans come back from its own evaluation.
                if work.request is not None:
                    self._hold.add(work.request, now)
                self._hold.note(violations)

    def _hand_out_ahead(self, violations: list[Violation]) -> list[tuple[int, Violation]]:
        """Violations into the outbox in a small transaction of their own, and out; returns the new rows.

        They need not wait for the state, the larger write. A crash before the state commits
        evaluates the same requests (or fires the same deadlines) again, finds the same violation
        ids, and the outbox records none twice (SQLite, where one process owns every session).
        """
        assert self._outbox is not None and self._dispatcher is not None
        if not violations:
            return []
        rows = self._outbox.add_now(violations)
        self._dispatcher.hand_over(rows)
        return rows

    def _guard_replay(self, chunk: list[_Work]) -> tuple[list[_Work], bool] | None:
        """The part of ``chunk`` to evaluate now, and whether it ends the entries journaled before this start.

        Those entries are evaluated under a durable marker (written first, in its own
        transaction), so that the next start knows which of them a dead process was
        evaluating. None when nothing is to be evaluated now (an entry set aside, a failed write).
        """
        if self._sql is None or not chunk or chunk[0].entry_id > self._replay_until:
            return chunk, False
        head = chunk[0]
        suspect = self._suspect
        if suspect is not None and suspect[0] <= head.entry_id <= suspect[1]:
            # The last process died evaluating these: one at a time, to find the one that kills it.
            tries = suspect[2] + 1 if suspect[0] == suspect[1] == head.entry_id else 1
            if suspect[0] == suspect[1] == head.entry_id and suspect[2] >= self._options.max_tries:
                self._set_aside(head, "crashed_evaluating")
                self._suspect = None
                return None
            chunk = [head]
        else:
            chunk = [w for w in chunk if w.entry_id <= self._replay_until]
            tries = 1
        marker = f"{chunk[0].entry_id},{chunk[-1].entry_id},{tries}"
        store = self._sql
        try:
            store.write([lambda: store.meta_put(_EVALUATING_KEY + store.replica_id, marker)])
        except StateError as exc:
            self._failed("marking the requests being evaluated", exc)
            return None
        return chunk, chunk[-1].entry_id >= self._replay_until

    def _read_marker(self) -> tuple[int, int, int] | None:
        assert self._sql is not None
        found = self._sql.meta_get(_EVALUATING_KEY + self._sql.replica_id)
        if found is None:
            return None
        try:
            first, last, tries = (int(part) for part in found.split(","))
        except ValueError:
            return None
        if not any(first <= w.entry_id <= last for w in self._pending):
            return None  # those entries were committed: nobody died evaluating them
        log.warning("the last run stopped while evaluating journaled requests %d..%d (try %d); they are evaluated "
                    "one at a time", first, last, tries)
        return first, last, tries

    def _clear_marker_in_unit(self) -> None:
        store = self._sql
        assert store is not None
        key = _EVALUATING_KEY + store.replica_id
        store.in_unit(lambda: store.execute("DELETE FROM meta WHERE key = ?", (key,)))

    def _answer(self, work: _Work) -> None:
        """The acknowledgement of a request evaluated without a journal."""
        batch = work.batch
        if batch is None:
            return
        if work.failed:
            # Not retryable: the same request would fail the same way. Said in the partial success.
            _resolve(batch, Ack(batch.span_count, "internal error while evaluating these spans; see the checker's log"))
            return
        if work.ack is not None and work.ack.rejected_spans:
            self._telemetry.spans_rejected.labels(batch.protocol, "unconvertible").inc(work.ack.rejected_spans)
        self.processed_spans += batch.span_count
        _resolve(batch, work.ack)

    def _set_aside(self, work: _Work, reason: str) -> None:
        """Drop a journaled request that cannot be evaluated, so the rest go on; counted and logged."""
        assert self._journal is not None and self._sql is not None
        journal = self._journal
        try:
            with self._sql.unit():
                journal.done_in_unit([(work.entry_id, work.size)])
        except StateError as exc:
            self._failed("setting aside a request that cannot be evaluated", exc)
            return
        self._pending = collections.deque(w for w in self._pending if w.entry_id != work.entry_id)
        self._isolate_left = max(0, self._isolate_left - 1)
        items = work.items if work.items is not None else self._read_back(work)
        spans = sum(1 for item in items if isinstance(item, Action))
        self._telemetry.spans_rejected.labels("journal", "evaluation_failed").inc(spans)
        self._telemetry.requests_set_aside.labels(reason).inc()
        why = ("the process stopped while evaluating it on every try" if reason == "crashed_evaluating"
               else "it breaks evaluation")
        log.error("a journaled request (entry %d, %d spans) was set aside so that the others go on: %s (%s); "
                  "run with debug logging to see why", work.entry_id, spans, why, reason)

    def _hand_off(self, moved: dict[str, str]) -> None:
        """Requests for sessions another replica took over (this one stalled past its lease) go to that replica."""
        assert self._sql is not None
        by_owner: dict[str, list[int]] = {}
        for work in self._pending:
            items = work.items if work.items is not None else self._read_back(work)
            work.items = items
            owners = {moved[i.session_id] for i in items if i.session_id in moved}
            if owners:
                by_owner.setdefault(min(owners), []).append(work.entry_id)
        try:
            for owner, ids in by_owner.items():
                self._sql.move_journal_entries(ids, owner)
        except StateError as exc:
            log.error("handing requests over to the sessions' new owner failed: %s", exc)
            return
        handed = {entry_id for ids in by_owner.values() for entry_id in ids}
        self._pending = collections.deque(w for w in self._pending if w.entry_id not in handed)
        if self._journal is not None:
            self._journal.refresh()
        log.warning("%d request(s) handed over to the replica that now owns their sessions", len(handed))

    def _evaluate(self, work: _Work) -> list[Violation]:
        items = work.items if work.items is not None else self._read_back(work)
        if not items:
            return []
        try:
            return self._pipeline.evaluate(items)
        except StateError:
            raise
        except Exception as exc:  # one bad request must not stop the checker; it is done (not retried forever)
            _log_failure(f"evaluating a request of {len(items)} items failed; it is set aside", exc)
            self._telemetry.requests_set_aside.labels("evaluation_failed").inc()
            work.failed = True
            return []

    def _read_back(self, work: _Work) -> list[Action | Malformed | SessionMark]:
        entry = work.entry
        if entry is None:
            return []
        work.request = None  # forwarded already (before the stop) or never: not again
        if entry.damaged is not None:
            log.error("journaled request %d could not be read back (%s); it is skipped", entry.id, entry.damaged)
            return []
        try:
            # As it was converted when it arrived (convert_serialized): the same items, the same seqs.
            result = self._converter.convert_serialized(entry.body, entry.origin, entry.seq_base)
        except DecodeError:
            log.error("a journaled request could not be read back; it is skipped")
            return []
        undecoded = [Malformed(message=p, origin=entry.origin, source="span") for p in entry.problems]
        return [*result.marks, *result.actions, *result.rejected, *undecoded]

    def _tick(self) -> None:
        self._ticks += 1
        if self._ticks % _PRUNE_EVERY_TICKS == 0:
            self._pipeline.forget_ended_sessions()
        if self._sql is None:
            self._tick_in_memory()
            return
        store = self._sql
        assert self._outbox is not None and self._dispatcher is not None
        if store.stale and not self._recover():
            return
        now = time.monotonic()
        if now - self._last_maintain >= self._options.maintain_interval_s:
            self._last_maintain = now
            try:
                self._handover_due = True
                if store.maintain():
                    self._recover("work adopted from a replica that stopped")
                    self._dispatcher.resume()
            except StateError as exc:
                self._failed("renewing this replica's lease", exc)
                return
        # Deadlines must see every accepted span: what is journaled is evaluated before the clock moves.
        for _ in range(8):
            if not self._pending or time.monotonic() < self._broken_until:
                break
            self._evaluate_some()
        if self._pending:
            return
        if self._handover_due:
            self._handover_due = False
            if not self._hand_over_wanted():
                return
        fresh: list[tuple[int, Violation]] = []
        ahead: list[tuple[int, Violation]] = []
        try:
            with store.unit():
                violations = self._pipeline.capped(self._pipeline.engine.tick(time.time_ns()))
                self._record_in_unit(violations, fresh, ahead)
                if self._ticks % _PRUNE_EVERY_TICKS == 0:
                    self._outbox.prune_in_unit()
        except StateError as exc:
            self._failed("committing fired deadlines", exc)
            return
        self._recorded(violations, fresh, ahead)
        try:
            self._dispatcher.redeliver_overdue()
        except StateError as exc:
            # Only a read: the rows stay pending and are tried again on a later tick.
            self._count_failure(exc)
            log.error("reading undelivered violations failed: %s", exc)

    def _record_in_unit(self, violations: list[Violation], fresh: list[tuple[int, Violation]],
                        ahead: list[tuple[int, Violation]]) -> None:
        """Violations found outside a request (the clock, a handover) into the outbox of the open unit."""
        assert self._outbox is not None and self._dispatcher is not None
        self._pipeline.record_views(self._pipeline.admitted_actions(), violations)
        if self._ahead:
            # As for evaluated requests (_evaluate_some): out before the state is written.
            ahead.extend(self._hand_out_ahead(violations))
        else:
            self._outbox.add_in_unit(violations, fresh.extend)
        self._dispatcher.confirmations_in_unit()

    def _recorded(self, violations: list[Violation], fresh: list[tuple[int, Violation]],
                  ahead: list[tuple[int, Violation]]) -> None:
        """After the unit of ``_record_in_unit`` committed: what was recorded goes out."""
        assert self._dispatcher is not None
        self._succeeded()
        self._note(violations)
        self._dispatcher.hand_over(fresh)
        self._pipeline.hand_resolutions()
        if self._hold is not None:
            self._hold.note(v for _, v in [*ahead, *fresh])

    def _hand_over_wanted(self) -> bool:
        """Sessions another replica asked for (the Collector now routes them there): evaluate what this
        replica holds of them and hand them over, with their state, in one unit. False when that failed."""
        assert self._sql is not None
        store = self._sql
        try:
            wanted = store.wanted_here()
        except StateError as exc:
            self._count_failure(exc)
            log.error("reading the sessions other replicas asked for failed: %s", exc)
            return True  # asked again at the next maintenance; the clock goes on meanwhile
        if not wanted:
            return True
        fresh: list[tuple[int, Violation]] = []
        ahead: list[tuple[int, Violation]] = []
        try:
            with store.unit():
                found, going = self._pipeline.engine.hand_over(wanted)
                violations = self._pipeline.capped(found)
                self._record_in_unit(violations, fresh, ahead)
                store.give_in_unit(going)
        except StateError as exc:
            self._failed("handing sessions over to the replicas that asked for them", exc)
            return False
        self._recorded(violations, fresh, ahead)
        if going:
            self._telemetry.sessions_handed_over.inc(len(going))
            log.info("%d session(s) handed over to the replica(s) the Collector now sends them to", len(going))
        return True

    def _tick_in_memory(self) -> None:
        try:
            violations = self._pipeline.tick(time.time_ns())
        except Exception as exc:  # the clock must keep running; the error is logged
            _log_failure("evaluating deadlines failed", exc)
            return
        self._note(violations)
        if self._hold is not None:
            self._hold.note(violations)

    # -- faults ----------------------------------------------------------------------------------

    def _count_failure(self, exc: StateError) -> None:
        kind = failure_kind(exc)
        if kind is not None:
            self._telemetry.state_failures.labels(kind).inc()

    def _failed(self, what: str, exc: StateError) -> None:
        self._count_failure(exc)
        self._last_failure = time.monotonic()
        self._backoff_s = min(_MAX_BACKOFF_S, max(0.05, self._backoff_s * 2))
        self._broken_until = time.monotonic() + self._backoff_s
        log.error("%s failed; retrying in %.2fs: %s", what, self._backoff_s, exc)
        self._recover()

    def _succeeded(self) -> None:
        if self._backoff_s:
            log.info("the state store accepts writes again")
        self._backoff_s = 0.0
        self._broken_until = 0.0

    def _recover(self, why: str = "a failed commit") -> bool:
        """Back to the last committed state: reload timers, rebuild the engine, re-read the journal."""
        if self._sql is None:
            return False
        try:
            self._sql.reset()
            self._rebuild(why)
            self._reload_journal()
            self.stats.recoveries += 1
            return True
        except StateError as exc:
            self._count_failure(exc)
            self._sql.stale = True
            log.error("the state store cannot be read back yet: %s", exc)
            return False

    def _rebuild(self, why: str) -> None:
        assert self._sql is not None and self._engine_factory is not None
        log.info("rebuilding the engine from the state store (%s)", why)
        self._pipeline.engine = self._engine_factory(self._sql)
        if self._journal is not None:
            self._journal.refresh()


def _log_failure(what: str, exc: Exception) -> None:
    # The exception's type only: its message may quote a record. The traceback only at debug level.
    log.error("%s: %s", what, type(exc).__name__, exc_info=log.isEnabledFor(logging.DEBUG))


def _resolve(batch: Batch, ack: Ack | None = None, error: Exception | None = None) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if error is not None:
            batch.ack.set_exception(error)
        else:
            batch.ack.set_result(ack if ack is not None else Ack())


def engine_factory(
    ruleset: RuleSet, options: EngineOptions, telemetry: Telemetry | None
) -> Callable[[StateStore], Engine]:
    """Builds the engine again on the store (after a failed commit or an adoption), with the rules loaded once."""
    from processor.evaluate.engine import Engine

    def build(store: StateStore) -> Engine:
        return Engine(ruleset, options, store, telemetry)

    return build
