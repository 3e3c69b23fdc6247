"""The journal's requests and the reordering buffer's segments are stored compressed (schema 4).

On SQLite and a real PostgreSQL: what is stored is a zstd frame, several times smaller
than a request of agent spans, and reads back byte for byte; rows of schema version 3,
stored as they came, are read as they are; a damaged row is named, and the journal's
other requests are still evaluated.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
import pytest
from backports.zstd import decompress as zstd_decompress
from backports.zstd import get_frame_info

from processor.errors import StateError
from processor.evaluate.engine import Engine, EngineOptions
from processor.state.compression import ZSTD_MAGIC, DamagedBody, compress, decompress, decompress_segment
from processor.state.journal import Journal, JournalEntry, NewEntry
from processor.state.postgres import PostgresStore
from processor.state.sqlite import SqliteStore
from processor.state.sqlstore import SCHEMA_VERSION, SqlStateStore
from processor.worker import _Work
from tests._engine_util import Spans, shipped
from tests._spans import SpanSpec, request
from tests.pg_support import fresh_database, pg_server
from tests.test_state_rows import assert_an_older_database_goes_on
from tests.test_worker_convert import _worker

__all__ = ["pg_server"]  # the fixture, used by name


def _agent_request(spans: int, session: str = "s1") -> bytes:
    """A request as an instrumented agent sends it: attribute keys and ids repeat from span to span."""
    return request(({"service.name": "agent", "deployment.environment": "prod"}, [
        SpanSpec(f"tool {n}", {"durable.session.id": session, "durable.action.id": f"a{n:05d}",
                               "durable.action.kind": "tool", "gen_ai.operation.name": "execute_tool",
                               "gen_ai.tool.name": "search", "durable.action.idempotency_key": f"{session}-a{n}"})
        for n in range(spans)
    ])).SerializeToString()


@pytest.fixture(params=["sqlite", "postgres"])
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], SqlStateStore]]:
    """Opens the store (again) on one database."""
    opened: list[SqlStateStore] = []
    url = fresh_database(request.getfixturevalue("pg_server")) if request.param == "postgres" else ""

    def make() -> SqlStateStore:
        for store in opened:
            store.close()
        opened.clear()
        opened.append(SqliteStore(tmp_path / "state.db") if not url else PostgresStore(url, replica_id="local"))
        return opened[-1]

    yield make
    for store in opened:
        store.close()


def test_a_journaled_request_is_stored_compressed_and_read_back_as_received(
        open_store: Callable[[], SqlStateStore]) -> None:
    store = open_store()
    body = _agent_request(200)
    ids = Journal(store).append([NewEntry(body, "grpc", "otlp-grpc", 5, 40, problems=["span 3: bad"])])
    kind, stored = store.query("SELECT kind, body FROM journal WHERE id = ?", (ids[0],))[0]
    stored = bytes(stored)
    assert kind == "otlp+zstd" and stored.startswith(ZSTD_MAGIC)
    assert len(stored) * 4 < len(body), f"{len(stored)} bytes stored for a request of {len(body)}"
    assert zstd_decompress(stored) == body  # a plain zstd frame, readable by any zstd tool
    # After a restart the request comes back byte for byte, with what it was received with.
    (entry,) = Journal(open_store()).pending()
    assert (entry.kind, entry.body, entry.size, entry.seq_base, entry.problems, entry.damaged) == (
        "otlp", body, len(body), 40, ["span 3: bad"], None)


def test_journal_rows_of_schema_3_are_read_as_they_are(open_store: Callable[[], SqlStateStore]) -> None:
    store = open_store()
    journal = Journal(store)
    old = _agent_request(3, "s-old")
    # A row as version 3 wrote it: the request's bytes as they came, kind "otlp".
    store.write([lambda: store.execute(
        "INSERT INTO journal (replica_id, kind, protocol, origin, received_ns, seq_base, problems, size, body)"
        " VALUES (?, 'otlp', 'grpc', 'otlp-grpc', 1, 0, '[]', ?, ?)", (store.replica_id, len(old), old))])
    new = _agent_request(3, "s-new")
    journal.append([NewEntry(new, "grpc", "otlp-grpc", 2, 3)])
    again = Journal(open_store())
    assert [(e.body, e.damaged) for e in again.pending()] == [(old, None), (new, None)]
    assert again.pending_bytes == len(old) + len(new)  # the bound counts requests as received


def test_a_damaged_journal_row_is_named_and_the_others_are_evaluated(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    worker, store = _worker(tmp_path, "sqlite")
    try:
        journal = Journal(store)
        bodies = [_agent_request(4, f"s{n}") for n in range(3)]
        ids = journal.append([NewEntry(b, "grpc", "otlp-grpc", n, n * 10) for n, b in enumerate(bodies)])
        (stored,) = store.query("SELECT body FROM journal WHERE id = ?", (ids[1],))[0]
        store.write([lambda: store.execute("UPDATE journal SET body = ? WHERE id = ?",
                                           (bytes(stored)[:-7], ids[1]))])
        entries = journal.pending()
        assert [e.damaged is None for e in entries] == [True, False, True]
        assert entries[1].body == b"" and "zstd frame" in str(entries[1].damaged)
        read = {e.id: worker._read_back(_work(e)) for e in entries}
    finally:
        store.close()
    assert read[ids[1]] == []
    assert {i.session_id for i in read[ids[0]]} == {"s0"} and {i.session_id for i in read[ids[2]]} == {"s2"}
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any(f"journaled request {ids[1]} could not be read back" in m for m in said), said


def _work(entry: JournalEntry) -> _Work:
    return _Work(entry.id, entry.size, entry=entry)


def test_the_reordering_buffer_is_stored_compressed_and_a_version_3_database_goes_on(tmp_path: Path) -> None:
    spans = Spans()
    workload = [spans(1.0, "s1", workflow_state="awaiting_approval", wait_timeout_s=3, action_id="w1"),
                spans(2.0, "s2", kind="payment"), spans(7.0, "s1"), spans(6.9, "s2"), spans(7.0, "s2")]
    reference = SqliteStore(tmp_path / "reference.db")
    Engine(shipped(), EngineOptions(), reference).submit_many(workload)
    path = tmp_path / "state.db"
    first = SqliteStore(path)
    Engine(shipped(), EngineOptions(), first).submit_many(workload)
    first.close()
    conn = sqlite3.connect(path)
    segments = conn.execute("SELECT segment, body FROM buffer_segments").fetchall()
    assert segments and all(bytes(body).startswith(ZSTD_MAGIC) for _, body in segments)
    # Back to how version 3 stored them: the JSON itself.
    for segment, body in segments:
        conn.execute("UPDATE buffer_segments SET body = ? WHERE segment = ?", (zstd_decompress(body), segment))
    conn.execute("UPDATE meta SET value = '3' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()

    again = SqliteStore(path)
    assert again.meta_get("schema_version") == str(SCHEMA_VERSION)
    # What this build writes: compressed.
    assert_an_older_database_goes_on(again, reference, spans, lambda _, body: body.startswith(ZSTD_MAGIC))
    again.close()
    reference.close()


def test_a_damaged_buffer_segment_is_refused_naming_it(tmp_path: Path) -> None:
    spans = Spans()
    path = tmp_path / "state.db"
    first = SqliteStore(path)
    Engine(shipped(), EngineOptions(), first).submit_many([spans(1.0, "s1"), spans(2.0, "s2")])
    first.close()
    conn = sqlite3.connect(path)
    segment, body = conn.execute("SELECT segment, body FROM buffer_segments").fetchone()
    conn.execute("UPDATE buffer_segments SET body = ? WHERE segment = ?", (bytes(body)[:-3], segment))
    conn.commit()
    conn.close()
    again = SqliteStore(path)
    with pytest.raises(StateError, match=f"reordering buffer's segment {segment} is damaged"):
        again.load_engine()
    again.close()


def test_decompression_is_bounded_by_what_the_row_declares() -> None:
    body = orjson.dumps([[n, "s1", {"kind": "tool"}] for n in range(1000)])
    frame = compress(body)
    assert get_frame_info(frame).decompressed_size == len(body)
    assert decompress(frame, len(body)) == body
    assert decompress_segment(frame) == body
    assert decompress_segment(body) == body  # version 3: JSON as stored
    with pytest.raises(DamagedBody, match="does not hold"):
        decompress(frame, len(body) - 1)  # holds more than recorded: not read past the record
    with pytest.raises(DamagedBody, match="does not hold"):
        decompress(frame, len(body) + 1)
    with pytest.raises(DamagedBody, match="does not hold"):
        decompress(frame + b"more", len(body))
    with pytest.raises(DamagedBody, match="readable"):
        decompress(b"\x28\xb5\x2f\xfd garbage", 10)
    # A frame header claiming 1 TiB (single segment, 8-byte content size) is refused before
    # anything is allocated.
    huge = ZSTD_MAGIC + b"\xe0" + (1 << 40).to_bytes(8, "little") + b"\x01\x00\x00"
    assert get_frame_info(huge).decompressed_size == 1 << 40
    with pytest.raises(DamagedBody, match="plausible size"):
        decompress_segment(huge)
