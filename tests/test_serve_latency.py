"""What keeps serve's violations quick: evaluated at once when idle, recorded and sent before the state is
written, and the collector's pauses kept out of the serving process (bench/soak_sessions.py measures it)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from processor.convert.spans import SpanConverter
from processor.errors import StateError
from processor.receive.otlp_common import count_spans, parse_protobuf
from processor.receive.queue import Batch, IngestQueue
from processor.serve import build_pipeline
from processor.state.journal import Journal, NewEntry
from processor.state.outbox import Outbox
from processor.state.session import SessionState
from processor.state.sqlite import SqliteStore
from processor.telemetry import Telemetry
from processor.violations import Violation
from processor.worker import EvaluatorWorker, WorkerOptions
from tests.serve_support import serve_config
from tests.servers import wait_until


def _violation(n: int) -> Violation:
    return Violation(rule="DS002", name="no-idempotency-key", severity="critical", session_id="s1",
                     action_id=f"a{n}", message=f"message {n}", violation_id=f"{n:032x}", time_ns=n)


def test_violations_added_now_commit_alone_and_outlive_the_unit_around_them(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "state.db")
    journal = Journal(store)
    outbox = Outbox(store, ["jsonl"])
    [entry_id] = journal.append([NewEntry(b"request-1", "grpc", "otlp-grpc", 1, 0)])
    assert isinstance(entry_id, int)
    entry = journal.pending()[0]
    with pytest.raises(RuntimeError), store.unit():
        journal.done_in_unit([(entry.id, entry.size)])
        fresh = outbox.add_now([_violation(1)])
        raise RuntimeError("the process dies before the state commits")
    # The violation is recorded; the request is still in the journal, to be evaluated again.
    assert [v.violation_id for _, v in fresh] == [_violation(1).violation_id]
    assert [e.body for e in journal.pending()] == [b"request-1"]
    # Found again by that evaluation: not recorded again, so not delivered again.
    with store.unit():
        again = outbox.add_now([_violation(1), _violation(2)])
        journal.done_in_unit([(entry.id, entry.size)])
    assert [v.action_id for _, v in again] == ["a2"]
    store.close()
    reopened = SqliteStore(tmp_path / "state.db")
    assert Journal(reopened).pending() == []
    assert [v.action_id for _, v in Outbox(reopened, ["jsonl"]).pending("jsonl")] == ["a1", "a2"]
    reopened.close()


def _payment_request(session: str, action_id: str) -> bytes:
    """One span: a payment without an idempotency key, which the per-record rule DS002 reports."""
    request = trace_service_pb2.ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    for key, value in (("service.name", "latency-test-agent"), ("durable.session.id", session)):
        kv = rs.resource.attributes.add()
        kv.key, kv.value.string_value = key, value
    span = rs.scope_spans.add().spans.add()
    span.name = "payment"
    span.trace_id = (0xABC).to_bytes(16, "big")
    span.span_id = (0xDEF).to_bytes(8, "big")
    span.start_time_unix_nano = time.time_ns()
    span.end_time_unix_nano = span.start_time_unix_nano + 1000
    for key, value in (("durable.action.id", action_id), ("durable.action.kind", "payment")):
        kv = span.attributes.add()
        kv.key, kv.value.string_value = key, value
    return request.SerializeToString()


def _put(queue: IngestQueue, body: bytes) -> None:
    request = parse_protobuf(body)
    assert queue.try_put(Batch(request=request, span_count=count_spans(request), protocol="grpc",
                               origin="otlp-grpc", body=body)) is None


def _written(tmp_path: Path, rule: str) -> list[str]:
    path = tmp_path / "violations.jsonl"
    if not path.exists():
        return []
    return [d["action_id"] for d in map(orjson.loads, path.read_bytes().splitlines()) if d["rule"] == rule]


@contextmanager
def _worker(tmp_path: Path, store: SqliteStore, options: WorkerOptions, tick_s: float) -> Iterator[EvaluatorWorker]:
    config = serve_config(tmp_path, {"state": {"backend": "sqlite", "path": str(store.path)}})
    telemetry = Telemetry()
    pipeline = build_pipeline(config, telemetry, store)
    queue = IngestQueue(100, 10_000, 1.0, telemetry)
    worker = EvaluatorWorker(queue, pipeline, store, converter=SpanConverter(config.convert), hold=None,
                             tick_interval_s=tick_s, telemetry=telemetry, options=options)
    worker.start()
    worker.queue_for_test = queue  # type: ignore[attr-defined]
    try:
        yield worker
    finally:
        queue.close()
        worker.drain(10.0)
        pipeline.shutdown(2.0)
        store.close()


def test_a_request_is_evaluated_at_once_when_nothing_else_waits(tmp_path: Path) -> None:
    """Grouping requests for one state commit is for when they queue up; alone, one is not held back."""
    store = SqliteStore(tmp_path / "state.db")
    # Neither the grouping delay nor the clock would evaluate it within the test's wait.
    options = WorkerOptions(evaluate_after_s=120.0)
    with _worker(tmp_path, store, options, tick_s=120.0) as worker:
        started = time.monotonic()
        _put(worker.queue_for_test, _payment_request("sess-idle", "pay-1"))  # type: ignore[attr-defined]
        wait_until(lambda: _written(tmp_path, "DS002") == ["pay-1"], timeout_s=20, what="DS002 written")
        assert time.monotonic() - started < 20


class _SlowStateStore(SqliteStore):
    """Holds the write of the engine's state until told (the large, slow part of a commit), and can fail it."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.release = threading.Event()
        self.writing = threading.Event()
        self.fail_next = False

    def _write_state(self, sessions: dict[str, SessionState | None], timers: Any, engine: Any) -> Any:
        if any(body is not None for body in sessions.values()):
            self.writing.set()
            assert self.release.wait(20.0), "the test never released the state write"
            if self.fail_next:
                self.fail_next = False
                raise StateError("disk I/O error (injected)")
        return super()._write_state(sessions, timers, engine)


def test_violations_go_out_before_the_state_is_written_and_once_when_that_write_fails(tmp_path: Path) -> None:
    store = _SlowStateStore(tmp_path / "state.db")
    store.fail_next = True
    with _worker(tmp_path, store, WorkerOptions(), tick_s=0.05) as worker:
        _put(worker.queue_for_test, _payment_request("sess-slow", "pay-1"))  # type: ignore[attr-defined]
        assert store.writing.wait(20.0)
        # The state write has not finished (nor will it succeed), yet the violation is in the file.
        assert _written(tmp_path, "DS002") == ["pay-1"]
        store.release.set()
        # The failed commit sends the request back to the journal: it is evaluated again (counted once its
        # state and the journal's "done" committed), and the violation it finds again is not written twice.
        wait_until(lambda: worker.stats.recoveries >= 1 and worker.stats.evaluated >= 1, timeout_s=20,
                   what="the request evaluated again after the failed state write")
    assert _written(tmp_path, "DS002") == ["pay-1"]
    reopened = SqliteStore(tmp_path / "state.db")
    try:
        assert Journal(reopened).pending() == []
        assert [v.action_id for _, v in Outbox(reopened, ["jsonl"]).pending("jsonl")] == []
    finally:
        reopened.close()


@pytest.mark.parametrize("stretch_s", [0.0, 3600.0], ids=["handed-out-per-stretch", "at-the-chunk-end"])
def test_a_long_chunk_hands_its_first_violations_out_before_its_last_request_is_evaluated(
    tmp_path: Path, stretch_s: float
) -> None:
    """Requests that queued up are evaluated as one chunk; the first one's finding does not wait for the rest."""
    store = SqliteStore(tmp_path / "state.db")
    second_started = threading.Event()
    go_on = threading.Event()
    with _worker(tmp_path, store, WorkerOptions(hand_out_every_s=stretch_s, linger_s=1.0), tick_s=120.0) as worker:
        pipeline = worker._pipeline
        evaluate = pipeline.evaluate
        calls: list[int] = []

        def held_second(items: Any) -> list[Violation]:
            calls.append(1)
            if len(calls) == 2:
                second_started.set()
                assert go_on.wait(20.0), "the test never let the second request's evaluation finish"
            return evaluate(items)

        pipeline.evaluate = held_second  # type: ignore[method-assign]
        queue = worker.queue_for_test  # type: ignore[attr-defined]
        # One group (the linger takes both), so one chunk: the second waits behind the first's evaluation.
        _put(queue, _payment_request("sess-a", "pay-1"))
        _put(queue, _payment_request("sess-b", "pay-2"))
        assert second_started.wait(20.0)
        try:
            if stretch_s == 0.0:
                wait_until(lambda: _written(tmp_path, "DS002") == ["pay-1"], timeout_s=20,
                           what="the first request's DS002 written while the second is evaluated")
            else:
                time.sleep(0.5)
                assert _written(tmp_path, "DS002") == []
        finally:
            go_on.set()
        wait_until(lambda: sorted(_written(tmp_path, "DS002")) == ["pay-1", "pay-2"], timeout_s=20,
                   what="both violations written, once each")
        assert calls == [1, 1]


def test_serve_freezes_what_it_loaded_and_collects_the_old_generation_rarely() -> None:
    """In a process of its own: the settings are process-wide."""
    code = ("import gc; from processor.gc_pauses import SERVE_THRESHOLDS, settle_for_serving; "
            "before = gc.get_freeze_count(); settle_for_serving(); "
            "print(before, gc.get_freeze_count(), gc.get_threshold() == SERVE_THRESHOLDS, gc.get_threshold()[2])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    before, frozen, applied, old_every = out.stdout.split()
    assert before == "0" and int(frozen) > 1000
    assert applied == "True" and int(old_every) > 10
