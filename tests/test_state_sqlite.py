"""The SQLite store: the engine's state, the inbox journal and the outbox survive a restart, together."""

from __future__ import annotations

import dataclasses
import random
import sqlite3
from pathlib import Path
from typing import Any

import orjson
import pytest

from processor.evaluate.engine import Engine, EngineOptions
from processor.records import Action
from processor.state.faults import JournalFull
from processor.state.journal import Journal, NewEntry
from processor.state.memory import MemoryStore
from processor.state.outbox import Dispatcher, Outbox, violation_from_bytes, violation_to_bytes
from processor.state.sqlite import SqliteStore
from processor.violations import Violation
from tests._engine_util import Spans, fired, shipped


def _mixed_items(seed: int, count: int = 400, sessions: int = 20) -> list[Action]:
    """Spans of many sessions that open and resolve waits, sequences and counts, slightly out of order."""
    rng = random.Random(seed)
    spans = Spans()
    out: list[Action] = []
    t = 0.0
    for i in range(count):
        session = f"s{rng.randrange(sessions)}"
        t += rng.random()
        roll = rng.random()
        at = t - rng.random() * 0.5  # a little disorder for the reordering buffer
        if roll < 0.2:
            out.append(spans(at, session, kind="payment", action_id=f"p{i}"))
        elif roll < 0.35:
            out.append(spans(at, session, workflow_state="awaiting_approval", wait_timeout_s=3, action_id=f"w{i}"))
        elif roll < 0.5:
            out.append(spans(at, session, kind="checkpoint"))
        elif roll < 0.6:
            out.append(spans(at, session, status="error", attempts=3, max_attempts=3, action_id=f"e{i}"))
        else:
            out.append(spans(at, session))
    return out


def _uninterrupted(items: list[Action]) -> list[Violation]:
    engine = Engine(shipped(), EngineOptions(), MemoryStore())
    found = engine.submit_many(items)
    return found + engine.finish()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_restarts_between_batches_find_exactly_what_one_run_finds(tmp_path: Path, seed: int) -> None:
    items = _mixed_items(seed)
    expected = _uninterrupted(items)
    assert {v.rule for v in expected} >= {"DS107", "DS110"}, "the workload must exercise timers and sequences"
    rng = random.Random(seed)
    cuts = [*sorted(rng.sample(range(1, len(items)), 5)), len(items)]
    found: list[Violation] = []
    start = 0
    for cut in cuts:
        # A new process each time: a new connection, a new engine rebuilt from the file.
        store = SqliteStore(tmp_path / "state.db")
        engine = Engine(shipped(), EngineOptions(), store)
        chunk = items[start:cut]
        for i in range(0, len(chunk), 7):
            found += engine.submit_many(chunk[i:i + 7])
        if cut == len(items):
            found += engine.finish()
        store.close()
        start = cut
    assert fired(found) == fired(expected)
    assert len(found) == len(expected)


def test_uncommitted_batch_is_invisible_after_restart(tmp_path: Path) -> None:
    spans = Spans()
    store = SqliteStore(tmp_path / "state.db")
    engine = Engine(shipped(), EngineOptions(), store)
    # The later span moves the watermark past the wait (released) but not past its deadline.
    engine.submit_many([spans(1.0, "s1", workflow_state="awaiting_approval", wait_timeout_s=3, action_id="w1"),
                        spans(7.0, "s1")])
    assert store.timer_count() == 1
    with pytest.raises(RuntimeError), store.unit():
        engine.submit_many([spans(2.5, "s2", workflow_state="awaiting_approval", wait_timeout_s=3),
                            spans(7.5, "s2")])
        assert store.timer_count() == 2
        raise RuntimeError("the process dies before the unit commits")
    store.close()
    again = SqliteStore(tmp_path / "state.db")
    restored = Engine(shipped(), EngineOptions(), again)
    assert again.timer_count() == 1
    assert [s.session_id for s in again.load_sessions(restored.schema)] == ["s1"]
    # The wait of s1 fires from the restored timer at the end of the input.
    found = restored.submit_many([spans(10.0, "s3")]) + restored.finish()
    assert ("DS107", "s1", "w1") in fired(found)
    again.close()


def _violation(n: int, session: str = "s1") -> Violation:
    return Violation(rule="DS002", name="no-idempotency-key", severity="critical", session_id=session,
                     action_id=f"a{n}", message=f"message {n}", violation_id=f"{n:032x}", time_ns=n,
                     tags=("x", "y"), details={"n": n})


def test_violation_round_trips_through_outbox_bytes() -> None:
    violation = _violation(7)
    violation.details = {"n": 7, "other": {"action_id": "a1", "attempts": [1, 2]}, "pair": ("a", "b")}
    body = violation_to_bytes(violation)
    # The stored body is every field by name (rows written by earlier builds are read the same way).
    assert orjson.loads(body) == {
        **{f.name: getattr(violation, f.name) for f in dataclasses.fields(Violation)},
        "tags": ["x", "y"], "details": {"n": 7, "other": {"action_id": "a1", "attempts": [1, 2]}, "pair": ["a", "b"]},
    }
    violation.details["pair"] = ["a", "b"]
    assert violation_from_bytes(body) == violation


def test_journal_outbox_and_state_commit_in_one_transaction(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "state.db")
    journal = Journal(store)
    outbox = Outbox(store, ["jsonl", "webhook"])
    ids = journal.append([NewEntry(b"request-1", "grpc", "otlp-grpc", 1, 0), NewEntry(b"request-2", "grpc", "o", 2, 1)])
    assert all(isinstance(i, int) for i in ids)
    entries = journal.pending()
    assert [e.body for e in entries] == [b"request-1", b"request-2"]
    recorded: list[tuple[int, Violation]] = []
    with pytest.raises(RuntimeError), store.unit():
        journal.done_in_unit([(entries[0].id, entries[0].size)])
        outbox.add_in_unit([_violation(1)], recorded.extend)
        raise RuntimeError("crash before commit")
    assert recorded == []
    assert len(journal.pending()) == 2 and outbox.recorded_ids() == set()
    with store.unit():
        journal.done_in_unit([(entries[0].id, entries[0].size)])
        outbox.add_in_unit([_violation(1)], recorded.extend)
    assert [v.violation_id for _, v in recorded] == [_violation(1).violation_id]
    store.close()
    reopened = SqliteStore(tmp_path / "state.db")
    assert [e.body for e in Journal(reopened).pending()] == [b"request-2"]
    again = Outbox(reopened, ["jsonl", "webhook"])
    assert [v.violation_id for _, v in again.pending("jsonl")] == [_violation(1).violation_id]
    assert [v.violation_id for _, v in again.pending("webhook")] == [_violation(1).violation_id]
    reopened.close()


def test_outbox_records_a_violation_once_and_forgets_delivered_rows_per_exporter(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "state.db")
    outbox = Outbox(store, ["jsonl", "alertmanager"])
    first: list[tuple[int, Violation]] = []
    second: list[tuple[int, Violation]] = []
    with store.unit():
        outbox.add_in_unit([_violation(1), _violation(2)], first.extend)
    with store.unit():
        # Found again (a re-evaluation): never recorded, nor delivered, again.
        outbox.add_in_unit([_violation(2), _violation(3), _violation(3)], second.extend)
    assert [v.action_id for _, v in first] == ["a1", "a2"]
    assert [v.action_id for _, v in second] == ["a3"]
    with store.unit():
        outbox.delivered_in_unit("jsonl", [seq for seq, _ in first])
    assert [v.action_id for _, v in outbox.pending("jsonl")] == ["a3"]
    assert [v.action_id for _, v in outbox.pending("alertmanager")] == ["a1", "a2", "a3"]
    store.close()


class _ConfirmingExporter:
    """An exporter that confirms only what its test says was delivered."""

    name = "confirming"

    def __init__(self) -> None:
        self.exported: list[str] = []
        self.listeners: list[object] = []

    def add_delivery_listener(self, callback: object) -> None:
        self.listeners.append(callback)

    def export(self, violations: list[Violation]) -> None:
        self.exported.extend(v.violation_id for v in violations)


def test_dispatcher_deletes_pending_rows_only_when_the_exporter_confirms(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "state.db")
    exporter = _ConfirmingExporter()
    outbox = Outbox(store, [exporter.name])
    dispatcher = Dispatcher(outbox, [exporter])
    fresh: list[tuple[int, Violation]] = []
    with store.unit():
        outbox.add_in_unit([_violation(1), _violation(2)], fresh.extend)
    dispatcher.hand_over(fresh)
    assert exporter.exported == [_violation(1).violation_id, _violation(2).violation_id]
    confirm = exporter.listeners[0]
    assert callable(confirm)
    confirm([_violation(1).violation_id])
    with store.unit():
        assert dispatcher.confirmations_in_unit() == 1
    assert [v.action_id for _, v in outbox.pending(exporter.name)] == ["a2"]
    # A restart hands over what was never confirmed, and only that.
    exporter.exported.clear()
    assert Dispatcher(outbox, [exporter]).resume() == 1
    assert exporter.exported == [_violation(2).violation_id]
    store.close()


def test_journal_is_bounded_and_refuses_with_a_retryable_error(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "state.db")
    journal = Journal(store, max_bytes=1000)
    outcome = journal.append([NewEntry(b"x" * 600, "grpc", "o", 1, 0), NewEntry(b"y" * 600, "grpc", "o", 2, 0)])
    assert isinstance(outcome[0], int)
    assert isinstance(outcome[1], JournalFull)
    assert "1000" in str(outcome[1])
    with store.unit():
        journal.done_in_unit([(e.id, e.size) for e in journal.pending()])
    assert journal.pending_bytes == 0
    assert all(isinstance(o, int) for o in journal.append([NewEntry(b"y" * 600, "grpc", "o", 2, 0)]))
    store.close()


def test_store_uses_wal_and_full_sync_by_default(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "state.db")
    store.close()
    conn = sqlite3.connect(tmp_path / "state.db")
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()
    store = SqliteStore(tmp_path / "state.db")
    assert store.query("PRAGMA synchronous")[0][0] == 2  # FULL
    store.close()


def test_requests_acknowledged_but_not_evaluated_before_a_crash_are_evaluated_at_start(tmp_path: Path) -> None:
    """The crash window between the journal commit (the acknowledgement) and the state commit."""
    import time

    from tests.durable_support import durable_server, memory_run_ids, workload
    from tests.serve_support import read_jsonl, serve_config

    requests = workload(3, sessions=6, steps=6, start_ns=time.time_ns())
    (tmp_path / "ref").mkdir()
    settings = {"evaluate": {"allowed_lateness": "200ms"}}
    expected = memory_run_ids(serve_config(tmp_path / "ref", settings), requests, 2.5)
    # What the worker had journaled (and so acknowledged) when the process died.
    store = SqliteStore(tmp_path / "state.db")
    journal = Journal(store)
    ordered = [body for step in range(6) for name in sorted(requests) for body in requests[name][step:step + 1]]
    assert all(isinstance(i, int) for i in journal.append(
        [NewEntry(body, "grpc", "otlp-grpc", time.time_ns(), 0) for body in ordered]))
    config = serve_config(tmp_path, {**settings, "state": {"backend": "sqlite", "path": str(tmp_path / "state.db")}})
    with durable_server(config, store):
        time.sleep(2.5)
    found = [d["violation_id"] for d in read_jsonl(tmp_path / "violations.jsonl")]
    assert sorted(found) == sorted(expected)
    reopened = SqliteStore(tmp_path / "state.db")
    assert Journal(reopened).pending() == []
    reopened.close()


def test_retry_queue_tells_delivery_listeners_only_after_delivery() -> None:
    """What an exporter needs to confirm outbox rows: the keys of each batch its endpoint accepted."""
    import threading

    from exporters.base import RetryPolicy, RetryQueue, SendResult
    from processor.telemetry import Telemetry

    attempts: list[list[str]] = []
    delivered: list[list[str]] = []
    done = threading.Event()

    def send(items: list[str]) -> SendResult:
        attempts.append(list(items))
        # The endpoint fails the first attempt: nothing may be confirmed for it.
        return SendResult.retry("503") if len(attempts) == 1 else SendResult.success()

    queue: RetryQueue[str] = RetryQueue("test", Telemetry(), send, lambda item: item, max_queue=10, batch_size=10,
                                        policy=RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.02))
    queue.add_delivery_listener(lambda keys: (delivered.append(keys), done.set()))
    queue.put(["a", "b"])
    assert done.wait(5.0)
    queue.shutdown(1.0)
    assert attempts == [["a", "b"], ["a", "b"]]
    assert delivered == [["a", "b"]]


def _gauge(telemetry: object, name: str, labels: dict[str, str] | None = None) -> float:
    from processor.telemetry import Telemetry

    assert isinstance(telemetry, Telemetry)
    value = telemetry.registry.get_sample_value(name, labels or {})
    assert value is not None, f"{name}{labels or ''} is not exposed"
    return value


def test_journal_depth_and_outbox_pending_are_published(tmp_path: Path) -> None:
    from processor.telemetry import Telemetry

    telemetry = Telemetry()
    store = SqliteStore(tmp_path / "state.db")
    journal = Journal(store, telemetry=telemetry)
    journal.append([NewEntry(b"r" * 100, "grpc", "o", 1, 0), NewEntry(b"s" * 50, "grpc", "o", 2, 0)])
    assert _gauge(telemetry, "durable_check_journal_depth") == 2
    assert _gauge(telemetry, "durable_check_journal_bytes") == 150
    outbox = Outbox(store, ["jsonl", "webhook"], telemetry=telemetry)
    fresh: list[tuple[int, Violation]] = []
    with store.unit():
        journal.done_in_unit([(e.id, e.size) for e in journal.pending()[:1]])
        outbox.add_in_unit([_violation(1), _violation(2), _violation(3)], fresh.extend)
    assert _gauge(telemetry, "durable_check_journal_depth") == 1
    assert _gauge(telemetry, "durable_check_journal_bytes") == 50
    assert _gauge(telemetry, "durable_check_outbox_pending", {"exporter": "webhook"}) == 3
    with store.unit():
        outbox.delivered_in_unit("jsonl", [seq for seq, _ in fresh])
        outbox.delivered_in_unit("webhook", [fresh[0][0]])
    assert _gauge(telemetry, "durable_check_outbox_pending", {"exporter": "jsonl"}) == 0
    assert _gauge(telemetry, "durable_check_outbox_pending", {"exporter": "webhook"}) == 2
    store.close()
    # A new process counts what the database holds.
    reopened = SqliteStore(tmp_path / "state.db")
    again = Telemetry()
    Journal(reopened, telemetry=again)
    assert _gauge(again, "durable_check_journal_depth") == 1
    restarted = Outbox(reopened, ["jsonl", "webhook"], telemetry=again)
    Dispatcher(restarted, []).resume()
    assert _gauge(again, "durable_check_outbox_pending", {"exporter": "webhook"}) == 2
    # Pruning recounts exactly (here: past max_pending, the oldest pending row is dropped).
    restarted.max_pending = 1
    with reopened.unit():
        restarted.prune_in_unit()
    assert _gauge(again, "durable_check_outbox_pending", {"exporter": "webhook"}) == 1
    # What the bound dropped is counted where exporters count what they give up on.
    assert _gauge(again, "durable_check_exporter_dropped_total", {"exporter": "webhook"}) == 1
    reopened.close()


def test_a_confirmation_whose_commit_failed_is_committed_by_the_next_unit(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "state.db")
    exporter = _ConfirmingExporter()
    outbox = Outbox(store, [exporter.name])
    dispatcher = Dispatcher(outbox, [exporter])
    fresh: list[tuple[int, Violation]] = []
    with store.unit():
        outbox.add_in_unit([_violation(1)], fresh.extend)
    dispatcher.hand_over(fresh)
    confirm = exporter.listeners[0]
    assert callable(confirm)
    confirm([_violation(1).violation_id])
    with pytest.raises(RuntimeError), store.unit():
        assert dispatcher.confirmations_in_unit() == 1
        raise RuntimeError("the commit fails")
    store.reset()
    assert [v.action_id for _, v in outbox.pending(exporter.name)] == ["a1"]
    assert dispatcher.has_confirmations(), "kept for the next unit"
    with store.unit():
        assert dispatcher.confirmations_in_unit() == 1
    assert outbox.pending(exporter.name) == []
    assert not dispatcher.has_confirmations()
    store.close()


class _QueuedExporter(_ConfirmingExporter):
    """A confirming exporter with a retry queue of its own (``queue.depth``), like the network exporters."""

    name = "queued"

    class _Queue:
        depth = 0

    def __init__(self) -> None:
        super().__init__()
        self.queue = self._Queue()


def test_unconfirmed_rows_are_handed_over_again_once_the_exporter_has_no_backlog(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "state.db")
    exporter = _QueuedExporter()
    outbox = Outbox(store, [exporter.name])
    dispatcher = Dispatcher(outbox, [exporter], redeliver_after_s=0.0)
    fresh: list[tuple[int, Violation]] = []
    with store.unit():
        outbox.add_in_unit([_violation(n) for n in range(1, 4)], fresh.extend)
    dispatcher.hand_over(fresh)
    exporter.exported.clear()
    # Still working through its own queue: what it holds is not lost, so nothing is pushed onto it.
    exporter.queue.depth = 3
    assert dispatcher.redeliver_overdue() == 0
    assert exporter.exported == []
    # It gave up on them (retries spent); one row was dropped from the outbox at its bound meanwhile.
    exporter.queue.depth = 0
    with store.unit():
        outbox.delivered_in_unit(exporter.name, [fresh[0][0]])
    assert dispatcher.redeliver_overdue() == 2
    assert exporter.exported == [_violation(2).violation_id, _violation(3).violation_id]
    store.close()


def test_store_failures_are_counted_by_kind(tmp_path: Path) -> None:
    import os

    import psycopg

    from processor.errors import StateError
    from processor.state.faults import SessionOwnedElsewhere, StateCorrupt, failure_kind, postgres_error, sqlite_error

    def sqlite_failure(name: str) -> StateError:
        error = sqlite3.OperationalError("test")
        error.sqlite_errorname = name
        return sqlite_error(error, tmp_path / "state.db", 5.0)

    assert failure_kind(sqlite_failure("SQLITE_BUSY")) == "locked"
    assert failure_kind(sqlite_failure("SQLITE_FULL")) == "full"
    assert failure_kind(sqlite_failure("SQLITE_READONLY_DIRECTORY")) == "read_only"
    assert failure_kind(sqlite_failure("SQLITE_CORRUPT")) == "corrupt"
    assert failure_kind(sqlite_failure("SQLITE_CANTOPEN")) == "other"
    assert failure_kind(postgres_error(psycopg.OperationalError("gone"), "db:5432/dc")) == "connection"
    assert failure_kind(postgres_error(psycopg.errors.DiskFull(), "db:5432/dc")) == "full"
    assert failure_kind(postgres_error(psycopg.errors.ReadOnlySqlTransaction(), "db:5432/dc")) == "read_only"
    assert failure_kind(postgres_error(psycopg.errors.LockNotAvailable(), "db:5432/dc")) == "locked"
    assert failure_kind(StateCorrupt("x")) == "corrupt"
    # Refusals that are no failure of the store.
    assert failure_kind(JournalFull("full journal")) is None
    assert failure_kind(SessionOwnedElsewhere("held elsewhere")) is None
    # A real cap on the file reads as a full disk.
    capped = SqliteStore(tmp_path / "capped.db", max_page_count=40)
    with pytest.raises(StateError) as caught:
        for n in range(200):
            Journal(capped).append([NewEntry(os.urandom(4000), "grpc", "o", n, 0)])
    assert failure_kind(caught.value) == "full"
    capped.close()


def test_a_locked_database_is_counted_as_a_state_failure_while_serving(tmp_path: Path) -> None:
    """serve on SQLite while another process holds the write lock: refused, retried, counted as ``locked``."""
    import time

    import grpc

    from tests.durable_support import EXPORT, durable_server, workload
    from tests.serve_support import serve_config

    path = tmp_path / "state.db"
    config = serve_config(tmp_path, {"state": {"backend": "sqlite", "path": str(path), "busy_timeout": "100ms"}})
    store = SqliteStore(path, busy_timeout_s=0.1)
    body = next(iter(workload(5, 1, 1, time.time_ns()).values()))[0]
    with durable_server(config, store) as server:
        telemetry = server.telemetry
        assert _gauge(telemetry, "durable_check_state_failures_total", {"kind": "locked"}) == 0
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        try:
            with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
                call = channel.unary_unary(EXPORT, request_serializer=None, response_deserializer=None)
                with pytest.raises(grpc.RpcError) as refused:
                    call(body, timeout=10.0)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "locked" in (refused.value.details() or "")
            assert _gauge(telemetry, "durable_check_state_failures_total", {"kind": "locked"}) >= 1
            assert _gauge(telemetry, "durable_check_journal_depth") == 0
        finally:
            other.execute("ROLLBACK")
            other.close()
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            channel.unary_unary(EXPORT, request_serializer=None, response_deserializer=None)(body, timeout=10.0)


def test_deliveries_confirmed_during_the_shutdown_flush_are_recorded(tmp_path: Path) -> None:
    """serve stops the evaluator, then flushes the exporters: what they deliver then is not handed over again."""
    import time

    from processor.convert.spans import SpanConverter
    from processor.receive.otlp_common import count_spans, parse_protobuf
    from processor.receive.queue import Batch, IngestQueue
    from processor.serve import build_pipeline
    from processor.telemetry import Telemetry
    from processor.worker import EvaluatorWorker
    from tests.durable_support import workload
    from tests.serve_support import serve_config
    from tests.servers import HttpRecorder, wait_until

    hook = HttpRecorder()
    hook.mode = "503"
    path = tmp_path / "state.db"
    config = serve_config(tmp_path, {
        "evaluate": {"allowed_lateness": "100ms"},
        "state": {"backend": "sqlite", "path": str(path)},
        "exporters": {"webhook": {"url": hook.url, "initial_backoff": "20ms", "max_backoff": "50ms",
                                  "max_attempts": 1000}},
    })
    telemetry = Telemetry()
    store = SqliteStore(path)
    pipeline = build_pipeline(config, telemetry, store)
    assert pipeline.engine_factory is not None
    queue = IngestQueue(10, 1000, 1.0, telemetry)
    worker = EvaluatorWorker(queue, pipeline, store, converter=SpanConverter(config.convert),
                           hold=None, tick_interval_s=0.05, telemetry=telemetry)
    worker.start()
    try:
        for bodies in workload(41, 2, 4, time.time_ns()).values():
            for body in bodies:
                request = parse_protobuf(body)
                queue.try_put(Batch(request=request, span_count=count_spans(request), protocol="grpc",
                                    origin="otlp-grpc", body=body))
        outbox = Outbox(store, ["jsonl", "webhook"])
        wait_until(lambda: len(hook.snapshot()) >= 2, timeout_s=10, what="failed webhook attempts")
        queue.close()
        assert worker.drain(10.0)
        pending = {v.violation_id for _, v in outbox.pending("webhook")}
        assert pending and outbox.pending("jsonl") == []
        hook.mode = "ok"
        pipeline.shutdown(5.0)  # the webhook delivers in its flush, after the evaluator stopped
        assert {r.json()["violations"][0]["violation_id"] for r in hook.snapshot() if r.status == 200} == pending
        assert worker.record_final_confirmations() == len(pending)
        assert outbox.pending("webhook") == []
    finally:
        queue.close()
        worker.drain(5.0)
        pipeline.shutdown(1.0)
        hook.stop()
        store.close()


def test_a_request_that_breaks_the_commit_is_set_aside_and_the_others_go_on(tmp_path: Path) -> None:
    """A request whose state cannot be stored fails the same way on every retry: it must not stop the checker."""
    import time

    from processor.convert.spans import SpanConverter
    from processor.receive.otlp_common import count_spans, parse_protobuf
    from processor.receive.queue import Batch, IngestQueue
    from processor.serve import build_pipeline
    from processor.state.session import SessionState
    from processor.telemetry import Telemetry
    from processor.worker import EvaluatorWorker
    from tests.durable_support import workload
    from tests.serve_support import serve_config
    from tests.servers import wait_until

    requests = workload(43, 3, 4, time.time_ns())
    poisoned = sorted(requests)[1]

    class UnstorableSession(SqliteStore):
        # What an integer beyond 64 bits in a session's state did to the commit: a TypeError, every time.
        def _write_state(self, sessions: dict[str, SessionState | None], timers: Any, engine: Any) -> Any:
            if sessions.get(poisoned) is not None:
                raise TypeError("Integer exceeds 64-bit range")
            return super()._write_state(sessions, timers, engine)

    path = tmp_path / "state.db"
    config = serve_config(tmp_path, {
        "evaluate": {"allowed_lateness": "50ms"},
        "state": {"backend": "sqlite", "path": str(path)},
    })
    telemetry = Telemetry()
    store = UnstorableSession(path)
    pipeline = build_pipeline(config, telemetry, store)
    assert pipeline.engine_factory is not None
    queue = IngestQueue(100, 10_000, 1.0, telemetry)
    worker = EvaluatorWorker(queue, pipeline, store, converter=SpanConverter(config.convert),
                           hold=None, tick_interval_s=0.05, telemetry=telemetry)
    worker.start()
    try:
        for bodies in requests.values():
            for body in bodies:
                request = parse_protobuf(body)
                assert queue.try_put(Batch(request=request, span_count=count_spans(request), protocol="grpc",
                                           origin="otlp-grpc", body=body)) is None
        rejected = ("durable_check_spans_rejected_total", {"protocol": "journal", "reason": "evaluation_failed"})

        def set_aside() -> float:
            return telemetry.registry.get_sample_value(*rejected) or 0.0

        def settled() -> bool:
            return worker.stats.evaluated + set_aside() >= 12

        wait_until(settled, timeout_s=30, what="every request evaluated or set aside")
        outbox = Outbox(store, ["jsonl"])
        sessions = {v.session_id for _, v in outbox.pending("jsonl")} | {
            v.session_id for v in _read_jsonl_violations(tmp_path)
        }
        assert poisoned not in sessions
        assert sessions, "the other sessions' violations were recorded"
        assert worker.stats.evaluated == 8
        assert set_aside() == 4
    finally:
        queue.close()
        worker.drain(5.0)
        pipeline.shutdown(1.0)
        store.close()


def _read_jsonl_violations(tmp: Path) -> list[Violation]:
    out: list[Violation] = []
    for file in tmp.rglob("*.jsonl"):
        for line in file.read_bytes().splitlines():
            doc = orjson.loads(line)
            out.append(Violation(rule=doc["rule"], name=doc["name"], severity=doc["severity"],
                                 session_id=doc["session_id"], action_id=doc["action_id"],
                                 message=doc["message"], violation_id=doc["violation_id"]))
    return out


def test_a_stored_session_that_cannot_be_read_back_is_counted_and_the_others_restore(tmp_path: Path) -> None:
    from processor.telemetry import Telemetry

    path = tmp_path / "state.db"
    items = _mixed_items(seed=4)
    store = SqliteStore(path)
    engine = Engine(shipped(), EngineOptions(), store)
    for i in range(0, len(items), 7):
        engine.submit_many(items[i:i + 7])
    stored = sorted(s.session_id for s in store.load_sessions(engine.schema))
    store.close()
    assert len(stored) >= 5
    damaged = stored[2]
    with sqlite3.connect(path) as db:  # a base row no version of the schema can read
        assert db.execute("UPDATE sessions SET body = ? WHERE session_id = ?", (b"\x00\xff", damaged)).rowcount == 1

    telemetry = Telemetry()
    again = SqliteStore(path)
    restarted = Engine(shipped(), EngineOptions(), again, telemetry)
    assert again.sessions_not_restored() == 1
    assert _gauge(telemetry, "durable_check_sessions_not_restored_total") == 1
    # Every other session came back; the damaged one is not in the engine.
    assert [s for s in stored if restarted.holds_session(s)] == [s for s in stored if s != damaged]

    # At its next span the damaged session starts again empty, and its rows are written anew.
    restarted.submit_many([Spans(trace_id="0" * 31 + "1")(1_000.0, damaged, kind="checkpoint")])
    again.close()
    fresh = Telemetry()
    third = SqliteStore(path)
    Engine(shipped(), EngineOptions(), third, fresh)
    assert third.sessions_not_restored() == 0
    assert _gauge(fresh, "durable_check_sessions_not_restored_total") == 0
    assert damaged in {s.session_id for s in third.load_sessions(restarted.schema)}
    third.close()
