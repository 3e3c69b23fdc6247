"""Sessions stored as rows: a commit writes what changed of a session, and a restart restores it exactly.

Run on SQLite and on a real PostgreSQL server; the migration of a state file of the
previous layout (one whole row per session) is checked on SQLite.
"""

from __future__ import annotations

import random
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from processor.errors import StateError
from processor.evaluate.engine import Engine, EngineOptions, buffer_row_plain
from processor.state.bufferrows import live_entries, segment_spans
from processor.state.postgres import PostgresStore
from processor.state.session import MISSING, CountState, RuleSchema, SessionState, group_key
from processor.state.session import key_digest as K  # the engine keys every group by a digest
from processor.state.sessionrows import MAX_DELTAS, session_plain
from processor.state.sqlite import SqliteStore
from processor.state.sqlstore import SCHEMA_VERSION, SqlStateStore
from tests._engine_util import Spans, fired, shipped
from tests.pg_support import fresh_database, pg_server
from tests.test_session_identity import LLM, Clock, agent_run
from tests.test_session_identity import convert as identity_convert
from tests.test_session_identity import engine as identity_engine

__all__ = ["pg_server"]  # the fixture, used by name

SCHEMA = RuleSchema(
    rule_ids=("R_COUNT", "R_CHANGE", "R_SEQ"),
    kinds=("count", "change", "sequence"),
    first_names=((), (), ("input_fingerprint", "kind")),
    compact=(False, False, True),
)
GROUP_LIMIT = 40
SEEN_LIMIT = 500


@pytest.fixture(params=["sqlite", "postgres"])
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], SqlStateStore]]:
    """Opens the store again on the same database, as a restarted process does."""
    opened: list[SqlStateStore] = []
    if request.param == "sqlite":
        def make() -> SqlStateStore:
            for store in opened:
                store.close()
            opened.append(SqliteStore(tmp_path / "state.db"))
            return opened[-1]
    else:
        url = fresh_database(request.getfixturevalue("pg_server"))

        def make() -> SqlStateStore:
            for store in opened:
                store.close()
            opened.append(PostgresStore(url, replica_id="r1", lease_ttl_s=30))
            return opened[-1]
    yield make
    for store in opened:
        store.close()


def _plain_of(store: SqlStateStore) -> dict[str, dict[str, Any]]:
    return {s.session_id: s.to_plain(SCHEMA) for s in store.load_sessions(SCHEMA)}


def _session_with_groups(groups: int) -> SessionState:
    session = SessionState("s1")
    for g in range(groups):
        session.put_group(0, K(f"g{g}"), CountState([g], 1), SCHEMA.width, GROUP_LIMIT)
    session.count_kind("tool_call")
    session.activity_ns = 1
    return session


def _past_whole_writes(session: SessionState) -> None:
    """Delivery keys enough for a base that outweighs the deltas of a test (their budget is the base's size)."""
    for d in range(600):
        session.check_seen(2**62 + d, 10_000)


def _rows_plain(store: SqlStateStore, schema: RuleSchema = SCHEMA) -> dict[str, dict[str, Any]]:
    """The sessions the database holds, read from its rows as a restart reads them (without loading)."""
    deltas: dict[str, list[bytes]] = {}
    for sid, body in store.query("SELECT session_id, body FROM session_deltas ORDER BY session_id, touched"):
        deltas.setdefault(str(sid), []).append(bytes(body))
    out = {}
    for sid, base in store.query("SELECT session_id, body FROM sessions"):
        plain, _ = session_plain(bytes(base), deltas.pop(str(sid), ()))
        out[str(sid)] = SessionState.from_plain(schema, plain).to_plain(schema)
    assert not deltas, "deltas without a base"
    return out


def _deltas(store: SqlStateStore) -> list[dict[str, Any]]:
    return [orjson.loads(bytes(r[0])) for r in store.query("SELECT body FROM session_deltas ORDER BY touched")]


def test_a_commit_writes_only_the_groups_and_digests_that_changed(open_store: Callable[[], SqlStateStore]) -> None:
    store = open_store()
    session = _session_with_groups(30)
    _past_whole_writes(session)
    store.save_session(session, SCHEMA)
    store.commit()
    assert (store.rows_written.bases, store.rows_written.deltas, store.rows_written.groups) == (1, 0, 30)
    base_bytes = store.rows_written.bytes

    # A group of a rule written by group appears, one digest arrives: a delta with just those.
    session.put_group(1, K("k0"), "first value", SCHEMA.width, GROUP_LIMIT)
    session.check_seen(10_001, 10_000)
    session.activity_ns = 2
    store.save_session(session, SCHEMA)
    store.commit()
    assert (store.rows_written.bases, store.rows_written.deltas, store.rows_written.groups) == (0, 1, 1)
    assert store.rows_written.bytes * 20 < base_bytes
    delta = _deltas(store)[-1]
    assert (delta["rules"], delta["drop"]) == ({}, [])
    assert delta["groups"] == {"R_CHANGE": [[[K("k0")], {"value": "first value"}]]}
    assert (delta["seen"], delta["forget"], delta["head"]["activity_ns"]) == ([10_001], 0, 2)

    # Compact sequence groups: put, put again (it becomes the newest), dropped; only those are written.
    for name in ("x1", "x2", "x3"):
        session.put_group(2, K(name), (b"\x00" * 8, f"kind-{name}"), SCHEMA.width, GROUP_LIMIT)
    store.save_session(session, SCHEMA)
    store.commit()
    session.put_group(2, K("x4"), (MISSING, "kind-x4"), SCHEMA.width, GROUP_LIMIT)
    session.put_group(2, K("x1"), (MISSING, "kind-x1 again"), SCHEMA.width, GROUP_LIMIT)
    session.drop_group(2, K("x2"))
    session.drop_group(2, K("never there"))
    store.save_session(session, SCHEMA)
    store.commit()
    assert (store.rows_written.deltas, store.rows_written.groups) == (1, 3)
    delta = _deltas(store)[-1]
    assert delta["rules"] == {} and list(delta["groups"]) == ["R_SEQ"]
    assert delta["groups"]["R_SEQ"] == [
        [[K("x4")], {"first": {"kind": "kind-x4"}, "time_ns": None, "prov": None, "reported": False}],
        [[K("x1")], {"first": {"kind": "kind-x1 again"}, "time_ns": None, "prov": None, "reported": False}],
        [[K("x2")], None],
    ]
    assert [k for k, _ in open_store().load_sessions(SCHEMA).__next__().iter_groups(2)] == [K("x3"), K("x4"), K("x1")]
    store = open_store()
    session = next(iter(store.load_sessions(SCHEMA)))

    # A count changes in place: its rule's groups are written, in their order; nothing else.
    count = session.get_group(0, K("g7"))
    count.times.append(8)
    count.count = 2
    store.save_session(session, SCHEMA)
    store.commit()
    delta = _deltas(store)[-1]
    assert list(delta["rules"]) == ["R_COUNT"] and delta["seen"] == []
    assert [key for key, _ in delta["rules"]["R_COUNT"]] == [[K(f"g{g}")] for g in range(30)]

    # A group that becomes the newest again (same state) is a change of order; a rule left
    # without groups is said so (the rules written by group by their groups dropped).
    session.put_group(0, K("g3"), session.get_group(0, K("g3")), SCHEMA.width, GROUP_LIMIT)
    session.drop_group(1, K("k0"))
    store.save_session(session, SCHEMA)
    store.commit()
    delta = _deltas(store)[-1]
    assert [key for key, _ in delta["rules"]["R_COUNT"]][-2:] == [[K("g29")], [K("g3")]]
    assert (delta["drop"], delta["groups"]) == ([], {"R_CHANGE": [[[K("k0")], None]]})
    for group in ("g0", "g1"):
        session.drop_group(0, K(group))
    store.save_session(session, SCHEMA)
    store.commit()
    for group in range(2, 30):
        session.drop_group(0, K(f"g{group}"))
    store.save_session(session, SCHEMA)
    store.commit()
    assert _deltas(store)[-1]["drop"] == ["R_COUNT"]

    restarted = open_store()
    assert _plain_of(restarted) == {"s1": session.to_plain(SCHEMA)}
    # The restarted store knows what it loaded: one more change is one more small delta.
    loaded = next(iter(restarted.load_sessions(SCHEMA)))
    loaded.put_group(1, K("k"), "first value", SCHEMA.width, GROUP_LIMIT)
    restarted.save_session(loaded, SCHEMA)
    restarted.commit()
    assert (restarted.rows_written.deltas, restarted.rows_written.groups) == (1, 1)
    assert _plain_of(open_store()) == {"s1": loaded.to_plain(SCHEMA)}


def test_a_session_is_a_base_once_then_deltas_and_a_new_one_of_the_same_id_a_base(
        open_store: Callable[[], SqlStateStore]) -> None:
    store = open_store()
    session = _session_with_groups(3)
    kinds: list[tuple[int, int]] = []
    for step in range(4):
        session.put_group(1, K(f"c{step}"), step, SCHEMA.width, GROUP_LIMIT)
        store.save_session(session, SCHEMA)
        store.commit()
        kinds.append((store.rows_written.bases, store.rows_written.deltas))
    assert kinds == [(1, 0), (0, 1), (0, 1), (0, 1)]
    # Gone, and back as a new session: a base, which replaces what the old one left.
    store.delete_session("s1")
    store.commit()
    again = SessionState("s1")
    again.put_group(1, K("fresh"), "v", SCHEMA.width, GROUP_LIMIT)
    store.save_session(again, SCHEMA)
    store.commit()
    assert (store.rows_written.bases, store.rows_written.deltas) == (1, 0)
    assert store.query("SELECT count(*) FROM session_deltas")[0][0] == 0
    again.put_group(1, K("fresh 2"), "v", SCHEMA.width, GROUP_LIMIT)
    store.save_session(again, SCHEMA)
    store.commit()
    assert (store.rows_written.bases, store.rows_written.deltas) == (0, 1)
    assert _plain_of(open_store()) == {"s1": again.to_plain(SCHEMA)}


def test_deltas_are_folded_into_a_new_base_once_they_outweigh_it(open_store: Callable[[], SqlStateStore]) -> None:
    store = open_store()
    session = _session_with_groups(3)
    _past_whole_writes(session)
    store.save_session(session, SCHEMA)
    store.commit()
    assert store.rows_written.bases == 1
    commits = 0
    while True:
        commits += 1
        session.put_group(0, K(f"n{commits}"), CountState([commits], 1), SCHEMA.width, GROUP_LIMIT)
        store.save_session(session, SCHEMA)
        store.commit()
        if store.rows_written.bases:
            break
        assert store.rows_written.deltas == 1
        assert commits <= MAX_DELTAS
    # The deltas were replaced by the base; the session reads back the same.
    assert store.query("SELECT count(*) FROM session_deltas")[0][0] == 0
    assert _plain_of(open_store()) == {"s1": session.to_plain(SCHEMA)}


def _mutate(rng: random.Random, session: SessionState, digest: list[int]) -> None:
    roll = rng.random()
    key = K(f"g{rng.randrange(60)}")
    if roll < 0.35:
        times = sorted(rng.randrange(1000) for _ in range(rng.randrange(1, 4)))
        session.put_group(0, key, CountState(times, len(times), rng.random() < 0.2), SCHEMA.width, GROUP_LIMIT)
    elif roll < 0.45:
        session.put_group(1, rng.choice([key, K(7), group_key((1, "x")), K(None)]), rng.choice(["v", 1.5, {"a": [1]}]),
                          SCHEMA.width, GROUP_LIMIT)
    elif roll < 0.5:
        # Compact sequence groups, a burst: new, put again (the newest), the oldest dropped at the
        # limit, one shared tuple among several.
        for _ in range(rng.randrange(1, 25)):
            kept = rng.choice([(MISSING, "tool_call"), (b"\x01" * 8, "payment"), ("fp", "llm_call")])
            session.put_group(2, K(f"a{rng.randrange(80)}"), kept, SCHEMA.width, GROUP_LIMIT)
    elif roll < 0.6:
        session.drop_group(rng.randrange(3), key if rng.random() < 0.5 else K(f"a{rng.randrange(80)}"))
    elif roll < 0.65:
        # A burst of more new digests than are kept: everything stored is forgotten at once.
        for _ in range(SEEN_LIMIT + rng.randrange(5)):
            digest[0] += 1
            session.check_seen(digest[0], SEEN_LIMIT)
    else:
        for _ in range(rng.randrange(1, 20)):
            digest[0] += 1
            session.check_seen(digest[0], SEEN_LIMIT)
        session.count_kind(rng.choice(["tool_call", "payment"]))
    session.activity_ns = rng.randrange(10**12)


@pytest.mark.parametrize("seed", [1, 2])
def test_restarts_restore_exactly_what_was_committed(open_store: Callable[[], SqlStateStore], seed: int) -> None:
    rng = random.Random(seed)
    store = open_store()
    live = {f"s{i}": SessionState(f"s{i}") for i in range(6)}
    saved: set[str] = set()
    digest = [2**62]
    restarts = 0
    written = [0, 0]  # bases, deltas
    for step in range(150):
        for _ in range(rng.randrange(1, 8)):
            sid = rng.choice(sorted(live))
            _mutate(rng, live[sid], digest)
            store.save_session(live[sid], SCHEMA)
            saved.add(sid)
        if rng.random() < 0.1:
            gone = rng.choice(sorted(live))
            store.delete_session(gone)
            saved.discard(gone)
            live[gone] = SessionState(gone)  # the same id may come back later, as a new session
        store.commit()
        written[0] += store.rows_written.bases
        written[1] += store.rows_written.deltas
        # After every commit, the rows read back are the sessions as they are now.
        assert _rows_plain(store) == {sid: live[sid].to_plain(SCHEMA) for sid in saved}, f"step {step}"
        if step % 15 == 14:
            store = open_store()
            restarts += 1
            loaded = {s.session_id: s for s in store.load_sessions(SCHEMA)}
            assert {sid: s.to_plain(SCHEMA) for sid, s in loaded.items()} == {
                sid: live[sid].to_plain(SCHEMA) for sid in saved
            }
            # The process goes on with what it loaded, as serve does after a restart.
            live = {sid: loaded.get(sid, SessionState(sid)) for sid in live}
    assert restarts == 10
    assert written[0] > 20 and written[1] > 100, "both whole and delta writes must be exercised"


@pytest.mark.parametrize("seed", [3, 4])
def test_sessions_written_by_change_are_what_the_engine_holds_after_every_commit(
        open_store: Callable[[], SqlStateStore], seed: int) -> None:
    """The engine's sessions note the groups put and dropped (put_group, the engine adding to a rule's
    dict itself, the group limit, the global bound); the store writes those. After every commit the
    rows read back are the engine's sessions."""
    rng = random.Random(seed)
    store = open_store()
    engine = Engine(shipped(), EngineOptions(allowed_lateness_s=0, max_groups_per_rule=30,
                                             max_remembered_entries=600), store)
    span = Spans()
    written = [0, 0]  # bases, deltas
    for step in range(40):
        items = []
        for _ in range(rng.randint(1, 30)):
            session = f"s{rng.randrange(5)}"
            fields: dict[str, Any] = {"action_id": f"{session}-a{rng.randrange(60)}",
                                      "kind": rng.choice(["tool_call", "payment", "llm_call"]),
                                      "status": rng.choice(["ok", "ok", "error"])}
            if rng.random() < 0.3:
                fields["idempotency_key"] = f"k{rng.randrange(20)}"
            if rng.random() < 0.2:
                fields["input_fingerprint"] = f"fp{rng.randrange(3)}"
            items.append(span(step + rng.random(), session=session, **fields))
        engine.submit_many(items)
        written[0] += store.rows_written.bases
        written[1] += store.rows_written.deltas
        held = {sid: s.to_plain(engine.schema) for sid, s in engine._sessions.items()}
        assert _rows_plain(store, engine.schema) == held, f"step {step}"
    assert written[1] > written[0] > 0, written
    assert engine.remembered_entries <= 600


def test_a_state_file_of_the_whole_session_layout_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    spans = Spans()
    first = SqliteStore(path)
    engine = Engine(shipped(), EngineOptions(), first)
    engine.submit_many([spans(1.0, "s1", workflow_state="awaiting_approval", wait_timeout_s=3, action_id="w1"),
                        spans(2.0, "s2", kind="payment"), spans(7.0, "s1"), spans(6.9, "s2"), spans(7.0, "s2")])
    expected = {s.session_id: s.to_plain(engine.schema) for s in first.load_sessions(engine.schema)}
    first.close()
    # The same state as the previous layout wrote it: each session whole in its row, version 1.
    conn = sqlite3.connect(path)
    for sid, plain in expected.items():
        conn.execute("UPDATE sessions SET body = ? WHERE session_id = ?", (orjson.dumps(plain), sid))
    conn.execute("DELETE FROM session_deltas")
    # ... and each buffered span in a row of its own, in the object form of that time.
    rows = live_entries(conn.execute("SELECT segment, body, released FROM buffer_segments"))
    buffered = [buffer_row_plain(row) for row in rows]
    assert buffered, "the workload must leave spans in the reordering buffer"
    conn.execute("CREATE TABLE engine_buffer (replica_id TEXT NOT NULL, arrival INTEGER NOT NULL,"
                 " body BLOB NOT NULL, PRIMARY KEY (replica_id, arrival))")
    conn.executemany("INSERT INTO engine_buffer VALUES ('local', ?, ?)",
                     [(e["arrival"], orjson.dumps(e)) for e in buffered])
    conn.execute("DROP TABLE buffer_segments")
    conn.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()

    again = SqliteStore(path)
    assert again.load_engine()["buffer"] == buffered
    restored = Engine(shipped(), EngineOptions(), again)
    assert {s.session_id: s.to_plain(restored.schema) for s in again.load_sessions(restored.schema)} == expected
    assert again.meta_get("schema_version") == str(SCHEMA_VERSION)
    assert not again.has_table("engine_buffer")
    found = restored.submit_many([spans(10.0, "s3")]) + restored.finish()
    assert ("DS107", "s1", "w1") in fired(found)
    again.close()


def test_a_state_file_whose_buffered_spans_are_objects_is_read_and_goes_on(tmp_path: Path) -> None:
    """Schema version 2 stored each buffered span as an object: read as it is, the run goes on
    from it exactly as from the rows this build writes, and new spans are written as rows."""
    path = tmp_path / "state.db"
    spans = Spans()
    workload = [spans(1.0, "s1", workflow_state="awaiting_approval", wait_timeout_s=3, action_id="w1"),
                spans(2.0, "s2", kind="payment"), spans(7.0, "s1"), spans(6.9, "s2"), spans(7.0, "s2")]
    rows_store = SqliteStore(tmp_path / "rows.db")
    Engine(shipped(), EngineOptions(), rows_store).submit_many(workload)
    first = SqliteStore(path)
    Engine(shipped(), EngineOptions(), first).submit_many(workload)
    first.close()
    conn = sqlite3.connect(path)
    segments = conn.execute("SELECT segment, body FROM buffer_segments").fetchall()
    assert segments and all(type(e) is list for segment, body in segments for e in segment_spans(segment, body))
    for segment, body in segments:
        objects = [buffer_row_plain(e) for e in segment_spans(segment, body)]
        conn.execute("UPDATE buffer_segments SET body = ? WHERE segment = ?", (orjson.dumps(objects), segment))
    conn.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()

    again = SqliteStore(path)
    assert again.meta_get("schema_version") == str(SCHEMA_VERSION)
    # New spans are written as rows.
    assert_an_older_database_goes_on(again, rows_store, spans,
                                     lambda segment, body: all(type(e) is list for e in segment_spans(segment, body)))
    again.close()
    rows_store.close()


def test_a_state_file_of_version_4_is_read_as_it_is_and_goes_on_by_group(tmp_path: Path) -> None:
    """Version 4 wrote a small session whole and a larger one's changed rules whole in its deltas
    (no groups by group): read as they are; this build's next deltas write groups."""
    path = tmp_path / "state.db"
    SqliteStore(path).close()
    small, large = _session_with_groups(2), _session_with_groups(5)
    small.session_id, large.session_id = "small", "large"
    for n in range(12):
        large.put_group(2, K(f"a{n}"), (MISSING, f"kind-{n}"), SCHEMA.width, GROUP_LIMIT)
    base = large.to_plain(SCHEMA)
    large.put_group(2, K("a3"), (MISSING, "kind-3 again"), SCHEMA.width, GROUP_LIMIT)
    large.put_group(1, K("c"), "value", SCHEMA.width, GROUP_LIMIT)
    after = large.to_plain(SCHEMA)
    v4_delta = {"head": {k: v for k, v in after.items() if k not in ("rules", "seen")},
                "rules": {"R_SEQ": after["rules"]["R_SEQ"], "R_CHANGE": after["rules"]["R_CHANGE"]},
                "drop": [], "seen": [], "forget": 0}
    conn = sqlite3.connect(path)
    conn.executemany("INSERT INTO sessions (session_id, touched, body) VALUES (?, ?, ?)",
                     [("small", 1, orjson.dumps(small.to_plain(SCHEMA))), ("large", 2, orjson.dumps(base))])
    conn.execute("INSERT INTO session_deltas (session_id, touched, body) VALUES (?, ?, ?)",
                 ("large", 3, orjson.dumps(v4_delta)))
    conn.execute("UPDATE meta SET value = '4' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()

    store = SqliteStore(path)
    assert store.meta_get("schema_version") == str(SCHEMA_VERSION) == "5"
    loaded = {s.session_id: s for s in store.load_sessions(SCHEMA)}
    assert {sid: s.to_plain(SCHEMA) for sid, s in loaded.items()} == {"small": small.to_plain(SCHEMA),
                                                                       "large": after}
    for session in loaded.values():
        session.put_group(2, K("new"), (MISSING, "tool_call"), SCHEMA.width, GROUP_LIMIT)
        session.drop_group(2, K("a5"))
        store.save_session(session, SCHEMA)
    store.commit()
    assert store.rows_written.deltas == 2
    assert all("R_SEQ" in delta["groups"] for delta in _deltas(store)[-2:])
    store.close()
    reopened = SqliteStore(path)
    again = {s.session_id: s.to_plain(SCHEMA) for s in reopened.load_sessions(SCHEMA)}
    assert again == {sid: s.to_plain(SCHEMA) for sid, s in loaded.items()}
    reopened.close()


def assert_an_older_database_goes_on(again: SqlStateStore, reference: SqlStateStore, spans: Spans,
                                     newest_segment: Callable[[int, bytes], bool]) -> None:
    """A database of an older layout, read as it is, holds what ``reference`` (the same workload
    written by this build) holds and goes on to the same verdicts; the segment the new spans
    are written to is in this build's form (``newest_segment``)."""
    assert again.load_engine() == reference.load_engine()
    restored = Engine(shipped(), EngineOptions(), again)
    expected = Engine(shipped(), EngineOptions(), reference)
    more = [spans(8.0, "s3", kind="payment"), spans(10.0, "s3")]
    found = restored.submit_many(more)
    ((segment, body),) = again.query("SELECT segment, body FROM buffer_segments ORDER BY segment DESC LIMIT 1")
    assert newest_segment(int(segment), bytes(body))
    found += restored.finish()
    assert fired(found) == fired(expected.submit_many(more) + expected.finish())


def test_a_state_file_of_an_unknown_layout_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    SqliteStore(path).close()
    conn = sqlite3.connect(path)
    conn.execute("UPDATE meta SET value = '9' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()
    with pytest.raises(StateError) as caught:
        SqliteStore(path)
    message = str(caught.value)
    assert str(path) in message and "schema version 9" in message and "move the database aside" in message


def _buffer_rows(store: SqlStateStore) -> list[tuple[int, int]]:
    """(segment, spans still held) of each stored buffer segment."""
    rows = store.query("SELECT segment, body, released FROM buffer_segments ORDER BY segment")
    return [(int(segment), len(live_entries([(segment, body, released)]))) for segment, body, released in rows]


def test_the_reordering_buffer_is_written_as_one_segment_per_commit(open_store: Callable[[], SqlStateStore]) -> None:
    spans = Spans()
    store = open_store()
    engine = Engine(shipped(), EngineOptions(allowed_lateness_s=5.0), store)
    # 40 spans within the lateness: one commit, one row holding all of them.
    engine.submit_many([spans(1.0 + i * 0.1, f"s{i % 4}", action_id=f"a{i}") for i in range(40)])
    assert _buffer_rows(store) == [(1, 40)]
    # The watermark (3.0) passes the first 21: they are marked released in that row; the new span
    # is the next segment.
    engine.submit_many([spans(8.0, "s9", action_id="late-mover")])
    assert len(engine._state.buffer) == 20
    assert _buffer_rows(store) == [(1, 19), (2, 1)]
    restarted = open_store()
    restored = restarted.load_engine()
    assert isinstance(restored, dict)
    assert sorted(e["arrival"] for e in restored["buffer"]) == sorted(b.arrival for b in engine._state.buffer)
    # Everything released: the segments go.
    again = Engine(shipped(), EngineOptions(allowed_lateness_s=5.0), restarted)
    again.submit_many([spans(30.0, "s9", action_id="last")])
    assert _buffer_rows(restarted) == [(3, 1)]


def _trace_rows(store: SqlStateStore) -> dict[str, int]:
    return {str(t): int(o) for t, o in store.query("SELECT trace_id, ord FROM engine_traces")}


def test_what_traces_named_is_written_a_trace_at_a_time(open_store: Callable[[], SqlStateStore]) -> None:
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer, clock = provider.get_tracer("tests"), Clock()
    store = open_store()
    checker = identity_engine(store)
    for run in range(4):
        agent_run(tracer, clock, {"gen_ai.operation.name": "invoke_agent", "gen_ai.conversation.id": f"conv-{run}"},
                  [("chat", LLM)])
    checker.submit_many(identity_convert(memory.get_finished_spans()))
    first = _trace_rows(store)
    assert len(first) == 4
    # One more run in a new trace: its row is written; the other rows are not touched.
    memory.clear()
    agent_run(tracer, clock, {"gen_ai.operation.name": "invoke_agent", "gen_ai.conversation.id": "conv-9"},
              [("chat", LLM)])
    checker.submit_many(identity_convert(memory.get_finished_spans()))
    second = _trace_rows(store)
    assert {t: o for t, o in second.items() if t in first} == first
    assert len(second) == 5 and max(second.values()) == max(first.values()) + 1
    # A restart reads back what the engine remembers, in its order.
    restored = open_store().load_engine()
    assert isinstance(restored, dict)
    assert restored["identity"] == checker._state.identity.to_plain()
    provider.shutdown()


@pytest.mark.parametrize("seed", [3, 17])
def test_traces_written_by_change_are_what_the_engine_holds_after_every_commit(
        open_store: Callable[[], SqlStateStore], seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store writes the traces the engine noted as changed or forgotten, not all of them; after
    every commit the rows, in their order, are the engine's traces, whatever happened to them:
    new, touched again, held spans released in place by the clock, resolved, evicted past the
    bound, forgotten when quiet. Both ways of planning the write are exercised."""
    import processor.evaluate.identity as identity_module
    from processor.state.tracerows import StoredTraces

    monkeypatch.setattr(identity_module, "MAX_TRACES", 12)  # evictions
    monkeypatch.setattr(identity_module, "MIN_TRACE_KEEP_NS", 1)  # quiet traces forgotten after 10 s
    plans = {"all": 0, "changes": 0}
    for name, key in (("plan", "all"), ("plan_changes", "changes")):
        original = getattr(StoredTraces, name)

        def counted(self: Any, *args: Any, _original: Any = original, _key: str = key) -> Any:
            plans[_key] += 1
            return _original(self, *args)

        monkeypatch.setattr(StoredTraces, name, counted)
    rng = random.Random(seed)
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer, clock = provider.get_tracer("tests"), Clock()
    store = open_store()
    now = [clock.now]
    checker = identity_engine(store, mode="serve", clock=lambda: now[0])
    waiting: list[Any] = []
    for step in range(60):
        memory.clear()
        for run in range(rng.randint(1, 4)):
            named = rng.random() < 0.6
            root = {"gen_ai.operation.name": "invoke_agent", "gen_ai.conversation.id": f"conv-{step}-{run}"}
            agent_run(tracer, clock, root if named else {}, [("chat", LLM)] * rng.randint(1, 3))
        items = identity_convert(memory.get_finished_spans())
        rng.shuffle(items)
        # Some spans arrive a few steps late (their trace's other spans were held meanwhile).
        late = [i for i in items if rng.random() < 0.2]
        waiting.extend(late)
        due = [w for w in waiting if rng.random() < 0.4]
        waiting = [w for w in waiting if w not in due]
        checker.submit_many([i for i in items if i not in late] + due)
        if rng.random() < 0.3:
            clock.now += rng.choice((2, 6, 30)) * 1_000_000_000  # the held are released; the quiet forgotten
        now[0] = clock.now
        checker.tick(now[0])
        rows = [[str(t), orjson.loads(bytes(b))]
                for t, b in store.query("SELECT trace_id, body FROM engine_traces ORDER BY ord")]
        assert rows == checker._state.identity.to_plain()["traces"], f"step {step}"
    assert plans["changes"] > 20 and plans["all"] >= 1, plans
    restored = open_store().load_engine()
    assert isinstance(restored, dict)
    assert restored["identity"] == checker._state.identity.to_plain()
    provider.shutdown()
