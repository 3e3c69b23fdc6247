"""What a session remembers is fixed-size: group keys and equality-only kept strings are digests.

Digests must be stable across processes (durable stores are read by the next process),
must not change a verdict, and state written with raw keys by earlier versions must still
find its groups. The global bound on remembered entries trims the least recently active
sessions and keeps open waits.
"""

from __future__ import annotations

import gc
import random
import subprocess
import sys
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from processor.errors import ConfigError
from processor.evaluate.engine import Engine, EngineOptions, _file_digest
from processor.evaluate.kept_digests import equality_only_fields
from processor.records import Action
from processor.state.base import StateStore, TimerEntry
from processor.state.memory import MemoryStore
from processor.state.postgres import PostgresStore
from processor.state.session import (
    MISSING,
    NO_GROUP,
    SEEN_PACKED_MAX,
    SMALL_GROUPS,
    RuleSchema,
    SessionState,
    group_key,
    group_key_from_plain,
    group_key_to_plain,
    key_digest,
)
from processor.state.sqlite import SqliteStore
from processor.telemetry import Telemetry
from processor.violations import Violation
from tests._engine_util import Spans, by_rule, fired, log_line, rules_from, shipped
from tests.pg_support import fresh_database, pg_server

__all__ = ["pg_server"]  # the fixture, used by name


def test_group_keys_are_the_same_in_another_process() -> None:
    # str hashes are salted per process; the digests a store holds must not be.
    values = ["call_7f3a9c2e-1b4d-4e8a", "", "ünïcode", 42]
    here = [key_digest(v) for v in values] + [group_key(["a", 1])]
    code = (
        "import json; from processor.state.session import key_digest, group_key; "
        f"print(json.dumps([key_digest(v) for v in {values!r}] + [group_key(['a', 1])]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345"}, cwd=Path(__file__).parent.parent)
    assert orjson.loads(out.stdout) == here
    assert all(type(k) is int and 0 <= k < 2**64 for k in here)


def test_group_keys_follow_cel_equality() -> None:
    assert key_digest(1) == key_digest(1.0)  # numbers compare as numbers
    assert key_digest(True) != key_digest(1)  # a bool is not a number
    assert key_digest("1") != key_digest(1)
    assert key_digest(None) != key_digest("")
    assert key_digest([1, 2]) != key_digest([2, 1])
    assert group_key(["ab", "c"]) != group_key(["a", "bc"])
    assert key_digest("") == NO_GROUP


def test_plain_keys_of_earlier_versions_are_digested_into_the_same_groups() -> None:
    for raw in ["a1", "", 7, 2.5, None, True]:
        assert group_key_from_plain(raw) == key_digest(raw)
    assert group_key_from_plain(["a", 1]) == group_key(["a", 1])
    # A list value's key was its canonical JSON text behind a prefix: it finds the same group.
    old_list_key = '\x00json:[1,"x"]'
    assert group_key_from_plain(old_list_key) == key_digest([1, "x"])
    assert group_key_from_plain(["k", old_list_key]) == group_key(["k", [1, "x"]])
    # A digest is written so that no earlier key reads like it.
    key = key_digest("a1")
    assert group_key_from_plain(orjson.loads(orjson.dumps(group_key_to_plain(key)))) == key


@pytest.mark.parametrize(
    ("then", "expected"),
    [
        ("record.action_id != first.action_id || (has(first.fp) && first.fp != null && first.fp != \"\""
         " && record.fp != first.fp)", {"action_id", "fp"}),
        ("first.a == record.a && first.b < record.b", {"a"}),  # ordering needs the value
        ("first.a == record.b", set()),  # another field: not the same value space
        ("first.a == \"x\"", set()),  # a literal other than null or "" needs the value
        ("size(first) > 1 && first.a == record.a", set()),  # first as a whole
        ("first.a.startsWith(record.a)", set()),
        ("[1].exists(first, first == 1) && first.a == record.a", set()),  # a shadowing loop variable
    ],
)
def test_which_kept_fields_are_only_compared_for_equality(then: str, expected: set[str]) -> None:
    assert equality_only_fields(then) == expected


_TWIN_RULES = """
version: 1
rules:
  - id: X1
    name: reused-key-digested
    description: One idempotency key for two actions or two inputs.
    severity: error
    type: sequence
    group_by: [record.idempotency_key]
    first: "true"
    then: >-
      record.action_id != first.action_id
      || (has(first.input_fingerprint) && first.input_fingerprint != ""
          && record.input_fingerprint != first.input_fingerprint)
    message: "{{ record.action_id }} reuses a key"
  - id: X2
    name: reused-key-values
    description: The same rule, whose message renders the kept values (so they stay values).
    severity: error
    type: sequence
    group_by: [record.idempotency_key]
    first: "true"
    then: >-
      record.action_id != first.action_id
      || (has(first.input_fingerprint) && first.input_fingerprint != ""
          && record.input_fingerprint != first.input_fingerprint)
    message: "{{ record.action_id }} reuses a key of {{ first.action_id }} {{ first.input_fingerprint }}"
"""


def test_digested_kept_values_give_the_verdicts_of_the_values(tmp_path: Path) -> None:
    rules = rules_from(tmp_path, _TWIN_RULES)
    engine = Engine(rules, EngineOptions())
    plans = {p.id: p for p in engine._stateful_plans}
    assert [plans["X1"].first_names[i] for i in plans["X1"].digest_at] == ["action_id", "input_fingerprint"]
    assert plans["X2"].digest_at == ()
    rng = random.Random(7)
    ids = [f"action-{n:04d}-" + "x" * rng.randint(0, 40) for n in range(6)]
    prints = ["", "short", *(f"sha256:{n:060x}" for n in range(4))]
    keys = [f"idem-{n}-" + "k" * 30 for n in range(5)]
    span = Spans()
    items = []
    for n in range(600):
        fields: dict[str, Any] = {"action_id": rng.choice(ids), "idempotency_key": rng.choice(keys)}
        if rng.random() < 0.8:
            fields["input_fingerprint"] = rng.choice(prints)
        items.append(span(n, session=f"s{n % 3}", **fields))
    found = engine.submit_many(items) + engine.finish()
    digested = [(v.session_id, v.action_id, v.span_id) for v in by_rule(found, "X1")]
    valued = [(v.session_id, v.action_id, v.span_id) for v in by_rule(found, "X2")]
    assert len(digested) > 50
    assert digested == valued


def _long_id_run(length: int, count: int = 3000) -> int:
    """Bytes the engine's sessions hold after ``count`` actions with ids and keys of ``length`` characters."""
    span = Spans()
    items = []
    for n in range(count):
        tag = f"{n:08d}"
        items.append(span(n, session=f"s{n % 10}", action_id=tag + "a" * length,
                          idempotency_key=tag + "k" * length, input_fingerprint=tag + "f" * length))
    engine = Engine(shipped(), EngineOptions())
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        engine.submit_many(items)
        del items
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def test_what_sessions_remember_does_not_grow_with_the_length_of_ids() -> None:
    short, long = _long_id_run(20), _long_id_run(1000)
    # Raw strings of 1000 characters, three per action, would add about 9 MB here.
    assert long < short * 1.1 + 200_000, (short, long)


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], StateStore]]:
    yield from _stores(request, tmp_path)


@pytest.fixture(params=["sqlite", "postgres"])
def make_durable_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], StateStore]]:
    yield from _stores(request, tmp_path)


def _stores(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], StateStore]]:
    opened: list[StateStore] = []
    if request.param == "memory":
        shared = MemoryStore()

        def open_store() -> StateStore:
            return shared
    elif request.param == "sqlite":
        def open_store() -> StateStore:
            store = SqliteStore(tmp_path / "state.db")
            opened.append(store)
            return store
    else:
        url = fresh_database(request.getfixturevalue("pg_server"))

        def open_store() -> StateStore:
            store = PostgresStore(url, replica_id="r1")
            opened.append(store)
            return store
    yield open_store
    for store in opened:
        store.close()


def _restart(make_store: Callable[[], StateStore], previous: StateStore) -> StateStore:
    if not isinstance(previous, MemoryStore):
        previous.close()
    return make_store()


def _claim(store: StateStore, *sessions: str) -> None:
    if isinstance(store, PostgresStore):
        from processor.state.journal import Journal, NewEntry

        Journal(store).append([NewEntry(b"req", "grpc", "o", 1, 0, session_ids=frozenset(sessions))],
                              lambda e: store.admit(e.session_ids))


def _stream(seed: int) -> list[Action]:
    rng = random.Random(seed)
    span = Spans()
    ids = [f"call_{n:04d}_" + "q" * 24 for n in range(8)]
    out = []
    for n in range(240):
        fields: dict[str, Any] = {"action_id": rng.choice(ids), "input_fingerprint": "fp-" + "z" * rng.randint(10, 30),
                                  "idempotency_key": "key-" + rng.choice(ids)}
        if rng.random() < 0.1:
            fields.update(workflow_state="awaiting_approval", wait_timeout_s=20)
        if rng.random() < 0.3:
            fields["status"] = "error"
        out.append(span(n, session=f"s{n % 4}", **fields))
    return out


def test_a_restart_restores_the_same_groups_and_verdicts(make_store: Callable[[], StateStore]) -> None:
    items = _stream(3)
    sessions = [f"s{n}" for n in range(4)]
    one = Engine(shipped(), EngineOptions(allowed_lateness_s=0), MemoryStore())
    expected = fired(one.submit_many(items) + one.finish())
    assert len(expected) > 20

    store = make_store()
    found: list[Violation] = []
    for part in (items[:80], items[80:170], items[170:]):
        _claim(store, *sessions)
        engine = Engine(shipped(), EngineOptions(allowed_lateness_s=0), store)
        found += engine.submit_many(part)
        if part is items[170:]:
            found += engine.finish()
        store = _restart(make_store, store)
    assert fired(found) == expected


def test_state_with_raw_keys_from_an_earlier_version_finds_its_groups(
    make_durable_store: Callable[[], StateStore],
) -> None:
    """A session and a timer written by an earlier version (raw keys) load into the digested groups."""
    make_store = make_durable_store
    store = make_store()
    _claim(store, "s1")
    engine = Engine(shipped(), EngineOptions(allowed_lateness_s=0), store)
    span = Spans()
    long_id = "call_" + "r" * 40
    engine.submit_many([span(0, action_id=long_id, input_fingerprint="fp1"),
                        span(1, action_id="w1", workflow_state="awaiting_approval", wait_timeout_s=30)])
    schema = engine.schema
    live = engine._sessions["s1"]
    # Rewrite the session as an earlier version wrote it: every group under its raw key.
    raw = {key_digest(long_id): long_id, key_digest("w1"): "w1", NO_GROUP: ""}
    old = SessionState("s1")
    old.kinds, old.activity_ns, old.seen = live.kinds, live.activity_ns, live.seen
    for index in range(schema.width):
        for key, state in live.iter_groups(index):
            old.put_group(index, raw[key], state, schema.width, 100)
            if getattr(state, "fire_at", None) is not None:
                store.remove_timer("s1", schema.rule_ids[index], key)
                store.put_timer(TimerEntry(state.fire_at, "s1", schema.rule_ids[index], raw[key]))
    plain = orjson.loads(orjson.dumps(old.to_plain(schema)))
    assert long_id in orjson.dumps(plain).decode()  # the raw form, as before digests
    store.save_session(old, schema)
    store.commit()

    store = _restart(make_store, store)
    _claim(store, "s1")
    later = Engine(shipped(), EngineOptions(allowed_lateness_s=0), store)
    out = later.submit_many([span(5, action_id=long_id, input_fingerprint="fp1"), span(60, session="s2")])
    out += later.finish()
    # The re-execution finds the opener's group, and the wait still fires at its deadline.
    assert ("DS101", "s1", long_id) in fired(out)
    assert ("DS107", "s1", "w1") in fired(out)


def test_the_global_bound_trims_the_least_recently_active_sessions_and_keeps_waits() -> None:
    tm = Telemetry()
    bound = 1000
    engine = Engine(shipped(), EngineOptions(max_remembered_entries=bound, allowed_lateness_s=0), telemetry=tm)
    span = Spans()
    # The oldest session opens a wait, then many sessions fill the state with groups.
    engine.submit(span(0, session="old", action_id="w", workflow_state="awaiting_approval", wait_timeout_s=600))
    for batch in range(30):
        items = [span(1 + batch, session=f"s{batch}", action_id=f"call-{batch}-{n}", idempotency_key=f"k-{batch}-{n}")
                 for n in range(40)]
        engine.submit_many(items)
        assert engine.remembered_entries <= bound
    get = tm.registry.get_sample_value
    dropped_groups = get("durable_check_state_entries_dropped_total", {"what": "group"})
    dropped_keys = get("durable_check_state_entries_dropped_total", {"what": "delivery_key"})
    assert dropped_groups and dropped_keys
    assert get("durable_check_state_entries") == engine.remembered_entries
    assert engine.summary().sessions_evicted == 0  # sessions stay; their oldest entries go
    # The most recent session still knows its actions: a re-execution is found.
    again = engine.submit(span(40, session="s29", action_id="call-29-3", idempotency_key="k-29-3"))
    assert [v.rule for v in again] == ["DS101"]
    # The least recently active ones forgot theirs: the same repeat there goes unseen.
    assert engine.submit(span(41, session="s0", action_id="call-0-3", idempotency_key="k-0-3")) == []
    # The wait of the least recently active session was kept, and fires at its deadline.
    late = engine.submit(span(700, session="s29", action_id="other"))
    assert ("DS107", "old", "w") in fired(late + engine.finish())


def test_the_global_bound_is_validated_with_its_path(tmp_path: Path) -> None:
    from processor.config import load_config

    path = tmp_path / "c.yaml"
    path.write_text("evaluate:\n  max_remembered_entries: 10\n")
    with pytest.raises(ConfigError, match=r"evaluate\.max_remembered_entries"):
        load_config(str(path))
    path.write_text("evaluate:\n  max_remembered_entries: 50000\n")
    assert load_config(str(path)).evaluate.max_remembered_entries == 50000


def test_file_scope_ids_are_digests_and_still_find_repeats() -> None:
    engine = Engine(shipped(), EngineOptions())
    long_id = "tool-" + "y" * 200
    out = engine.submit_many([log_line(1, action_id=long_id), log_line(2, session="s2", action_id=long_id)])
    assert [v.rule for v in out if v.rule == "DS009"] == ["DS009"]
    groups = next(g for g in engine._file_groups.values() if len(g))
    assert len(groups) == 1 and groups.get(_file_digest("actions.jsonl", long_id)) is not None


def test_delivery_key_digests_are_listed_oldest_first_in_both_forms() -> None:
    """Packed while few (big-endian words), an array past SEEN_PACKED_MAX: what a store writes is
    the digests in arrival order either way, and a session read back holds the same."""
    rng = random.Random(5)
    digests = [rng.getrandbits(64) for _ in range(SEEN_PACKED_MAX + 30)]
    session = SessionState("s1")
    for count, digest in enumerate(digests, start=1):
        assert not session.check_seen_packed(digest.to_bytes(8, "big"), 10_000)
        assert session.seen_digests() == digests[:count]
        assert isinstance(session.seen, bytes) == (count <= SEEN_PACKED_MAX), count
    assert session.check_seen_packed(digests[3].to_bytes(8, "big"), 10_000)  # a redelivery
    schema = RuleSchema(rule_ids=(), kinds=(), first_names=())
    for size in (SEEN_PACKED_MAX, len(digests)):
        plain = {"session_id": "s1", "kinds": {}, "seen": digests[:size]}
        assert SessionState.from_plain(schema, plain).seen_digests() == digests[:size]


def test_kept_tuples_shared_by_rules_are_written_with_each_rules_fields() -> None:
    """One record's kept tuple is shared by the rules keeping the same fields of it (Engine._kept);
    the plain form converts it once per call, and each rule's groups still read its own names."""
    schema = RuleSchema(
        rule_ids=("R1", "R2", "R3", "R4"),
        kinds=("sequence", "sequence", "sequence", "change"),
        first_names=(("input_fingerprint", "kind"), ("input_fingerprint", "kind"), ("action_id", "kind"), ()),
        compact=(True, True, True, False),
    )
    digest = bytes.fromhex("00ff00ff00ff00ff")
    shared = (digest, "tool_call")
    rng = random.Random(11)
    session = SessionState("s1")
    expected: dict[str, list[Any]] = {"R1": [], "R2": [], "R3": [], "R4": []}

    def first(names: tuple[str, ...], kept: tuple[Any, ...]) -> dict[str, Any]:
        out = {n: (v.hex() if type(v) is bytes else v) for n, v in zip(names, kept, strict=True) if v is not MISSING}
        digested = [n for n, v in zip(names, kept, strict=True) if type(v) is bytes]
        return {**out, "#digests": digested} if digested else out

    # R1 past SMALL_GROUPS (a dict slot), the others in tuple slots; every other group shares one tuple.
    for index, (rule, count) in enumerate((("R1", SMALL_GROUPS + 5), ("R2", 3), ("R3", 4))):
        for n in range(count):
            kept = shared if n % 2 == 0 else (MISSING if n % 3 else f"fp-{n}", "llm_call")
            key = rng.getrandbits(64)
            session.put_group(index, key, kept, schema.width, 100)
            names = schema.first_names[index]
            expected[rule].append([[key], {"first": first(names, kept), "time_ns": None, "prov": None,
                                           "reported": False}])
    session.put_group(3, NO_GROUP, "a value", schema.width, 100)
    expected["R4"].append([[NO_GROUP], {"value": "a value"}])
    plain = orjson.loads(orjson.dumps(session.to_plain(schema)))
    assert plain["rules"] == expected
    again = SessionState.from_plain(schema, plain)
    assert [again.iter_groups(i) for i in range(4)] == [session.iter_groups(i) for i in range(4)]
