"""Idle sessions hold their groups packed (SessionState.pack), and nothing they judge changes.

A session packed and unpacked keeps every group, in its order, equal to what it held:
the plain form a store writes is the same byte for byte. An engine that packs every
session at every batch gives the verdicts, the summary and the sessions' state of one that
never packs, on random streams of the shipped session rules' records (spans, with their
reordering window and timers, and log lines), cut into random batches; on SQLite, what it
wrote reads back as the same sessions.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from processor.evaluate.engine import Engine, EngineOptions
from processor.records import Action
from processor.state.cold import ColdFile
from processor.state.memory import MemoryStore
from processor.state.session import MISSING, CountState, RuleSchema, SessionState, Wait, value_digest
from processor.state.sqlite import SqliteStore
from tests._engine_util import T0, S, Spans, log_line, shipped

SCHEMA = RuleSchema(
    rule_ids=("R-SEQ", "R-CHANGE", "R-WAIT", "R-COUNT"),
    kinds=("sequence", "change", "absence", "count"),
    first_names=(("idempotency_key", "input_fingerprint", "kind"), (), ("action_id",), ()),
    compact=(True, False, False, False),
)


def _is_packed(session: SessionState) -> bool:
    return session.packed is not None


def _session_with_every_kind_of_group(groups: int) -> SessionState:
    session = SessionState("s1")
    odd_values: list[Any] = [MISSING, None, True, 1, -0.0, 2**63 - 1, "kind", ["a", {"b": 1.5}], value_digest("x")]
    for n in range(groups):
        kept = (value_digest(f"key-{n}"), odd_values[n % len(odd_values)], "tool_call")
        session.put_group(0, 10_000 + n, kept, SCHEMA.width, 10_000)
        session.put_group(1, 20_000 + n, value_digest(f"v-{n}") if n % 2 else n, SCHEMA.width, 10_000)
    wait = Wait(("a1",), ("a1", 1, 1, "log", "", "", "", "tool_call", None), T0, T0 + S, received_ns=T0, state="")
    session.put_group(2, 7, wait, SCHEMA.width, 10_000)
    session.put_group(3, 8, CountState([T0], 1), SCHEMA.width, 10_000)
    return session


@pytest.mark.parametrize("groups", [1, 8, 9, 300], ids=["one", "small-tuple", "dict", "many"])
def test_packing_keeps_every_group_in_its_order_and_the_plain_form_byte_for_byte(groups: int) -> None:
    session = _session_with_every_kind_of_group(groups)
    before = {index: session.iter_groups(index) for index in range(SCHEMA.width)}
    plain = orjson.dumps(session.to_plain(SCHEMA), option=orjson.OPT_NON_STR_KEYS)
    entries = session.entry_count()

    assert session.pack() == 2 * groups
    # The plain-valued rules are packed; the wait and the count, which change in place, are not.
    assert _is_packed(session)
    assert session.rules is not None and session.rules[0] is None and session.rules[1] is None
    assert session.waits() == [(2, 7, before[2][0][1])]
    assert session.entry_count() == entries

    assert orjson.dumps(session.to_plain(SCHEMA), option=orjson.OPT_NON_STR_KEYS) == plain
    assert not _is_packed(session)
    after = {index: session.iter_groups(index) for index in range(SCHEMA.width)}
    for index in (0, 1):
        assert [key for key, _ in after[index]] == [key for key, _ in before[index]]
        for (_, a), (_, b) in zip(after[index], before[index], strict=True):
            assert _same(a, b)
    assert after[2][0][1] is before[2][0][1] and after[3][0][1] is before[3][0][1]


def _same(a: Any, b: Any) -> bool:
    """Equal, type for type (True is not 1), -0.0 kept, MISSING itself."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    return type(a) is type(b) and a == b


def test_a_packed_session_unpacks_when_a_group_is_read_or_changed_and_drops_its_oldest_at_the_bound() -> None:
    session = _session_with_every_kind_of_group(5)
    session.pack()
    # Putting a sixth group past a bound of five drops the oldest, as on an unpacked session.
    dropped = session.put_group(0, 99, ("new",), SCHEMA.width, 5)
    assert not _is_packed(session)
    assert dropped is not None and dropped[0] == 10_000
    assert [key for key, _ in session.iter_groups(0)] == [10_001, 10_002, 10_003, 10_004, 99]
    session.pack()
    assert session.get_group(0, 99) == ("new",)
    assert not _is_packed(session)


def test_replay_packs_a_sessions_delivery_keys_with_its_groups_and_still_knows_a_duplicate() -> None:
    """With the file replay keeps (processor.state.cold) the digests leave memory with the
    groups; asking for one reads them back, and the bound counts the same entries throughout."""
    cold = ColdFile()
    try:
        for digests in (3, 2_000):  # a few in bytes, many in SeenDigests
            session = _session_with_every_kind_of_group(9)
            for n in range(digests):
                session.check_seen(n * 7919, 10_000)
            session.forget_seen(1)  # SeenDigests then reads its order from a start past 0
            entries = session.entry_count()
            plain = orjson.dumps(session.to_plain(SCHEMA), option=orjson.OPT_NON_STR_KEYS)
            assert session.pack(cold) == 18
            assert session.seen is None and session.entry_count() == entries
            assert session.check_seen(7919, 10_000), "remembered while packed"
            assert not _is_packed(session) and session.entry_count() == entries
            assert orjson.dumps(session.to_plain(SCHEMA), option=orjson.OPT_NON_STR_KEYS) == plain
            assert not session.check_seen(0, 10_000), "forgotten before packing, so new again"
    finally:
        cold.close()


def test_a_session_with_only_waits_and_counts_is_not_packed() -> None:
    session = SessionState("s1")
    session.put_group(3, 8, CountState([T0], 1), SCHEMA.width, 10)
    assert session.pack() == 0
    assert not _is_packed(session)


def test_an_idle_session_is_packed_and_its_groups_still_judge_its_next_record() -> None:
    engine = Engine(shipped(), EngineOptions(pack_idle_after_s=60, pack_every_records=1))
    span = Spans()
    engine.submit_many([span(0, session="quiet", action_id="ask", kind="user_prompt")])
    # Another session's records move event time two minutes on: "quiet" is idle past 60 s.
    for n in range(4):
        engine.submit_many([span(30 * (n + 1), session="busy", action_id=f"b{n}")])
    quiet = engine._sessions["quiet"]
    assert _is_packed(quiet)
    assert not _is_packed(engine._sessions["busy"])
    # The same completed action executed again: DS101 against the packed group.
    out = engine.submit_many([span(200, session="quiet", action_id="ask", kind="user_prompt")])
    out += engine.finish()
    assert [(v.rule, v.session_id, v.action_id) for v in out if v.rule == "DS101"] == [("DS101", "quiet", "ask")]


def _untimed_line(n: int, session: str, action_id: str) -> Action:
    record = log_line(n, session=session, action_id=action_id, kind="user_prompt").record
    return Action(record, "log", "actions.jsonl", n, None, n)


def test_an_untimed_log_packs_a_session_once_enough_others_have_had_records_since() -> None:
    """An action log without times has no idle clock: a session is idle once
    pack_untimed_after_sessions other sessions have had records after its last one."""
    engine = Engine(shipped(), EngineOptions(pack_every_records=1, pack_untimed_after_sessions=3))
    engine.submit_many([_untimed_line(1, "first", "ask")])
    engine.submit_many([_untimed_line(2, "second", "ask")])
    # A look comes every as many records as there are open sessions: the third session's
    # records are enough for one, when "first" has only two others ("second", "third") after it.
    for n in range(3, 7):
        engine.submit_many([_untimed_line(n, "third", f"t{n}")])
    assert not _is_packed(engine._sessions["first"])
    for n in range(7, 11):
        engine.submit_many([_untimed_line(n, "fourth", f"f{n}")])
    # Three others after "first" now; "second" has two.
    assert _is_packed(engine._sessions["first"])
    assert not _is_packed(engine._sessions["second"])
    assert not _is_packed(engine._sessions["third"])
    assert not _is_packed(engine._sessions["fourth"])
    out = engine.submit_many([_untimed_line(11, "first", "ask")])
    out += engine.finish()
    assert [(v.rule, v.session_id, v.line) for v in out if v.rule == "DS101"] == [("DS101", "first", 11)]
    assert not _is_packed(engine._sessions["first"])


def test_an_untimed_log_packs_long_sessions_once_the_recent_ones_hold_more_entries_than_the_budget() -> None:
    """Long sessions each bring back all their groups: sessions without times are held unpacked
    only while the most recent together hold at most pack_untimed_after_entries entries, even
    when pack_untimed_after_sessions would keep more of them."""

    def run(budget: int) -> Engine:
        engine = Engine(shipped(), EngineOptions(pack_every_records=1, pack_untimed_after_sessions=100,
                                                 pack_untimed_after_entries=budget))
        for n in range(1, 6):
            engine.submit_many([_untimed_line(n, "long", f"a{n}")])
        for n in range(6, 8):
            engine.submit_many([_untimed_line(n, "next", f"b{n}")])
        return engine

    small = run(4)
    assert small._sessions["long"].entry_count() == 5
    assert _is_packed(small._sessions["long"])
    large = run(32_768)
    assert not _is_packed(large._sessions["long"])
    # The same completed action executed again: DS101 against the packed group.
    out = small.submit_many([_untimed_line(8, "long", "a2")]) + small.finish()
    assert [(v.rule, v.session_id, v.line) for v in out if v.rule == "DS101"] == [("DS101", "long", 8)]
    assert not _is_packed(small._sessions["long"])


def test_the_entry_budget_grows_when_the_sessions_packed_for_it_come_back() -> None:
    """Two long sessions in turns: each is packed for the budget while the other runs, and comes
    back. The budget doubles each time more than a quarter of those come back, so the turns stop
    packing them; the verdicts are those of an engine that never packs."""
    packing = Engine(shipped(), EngineOptions(pack_every_records=1, pack_untimed_after_sessions=100,
                                              pack_untimed_after_entries=4))
    never = Engine(shipped(), EngineOptions(pack_idle_after_s=None))
    packed_after: list[bool] = []
    found: dict[str, list[Any]] = {"packing": [], "never": []}
    n = 0
    for turn in range(16):
        session, other = ("a", "b") if turn % 2 == 0 else ("b", "a")
        for i in range(4):
            n += 1
            # The last action of a turn repeats the first of the session's previous turn: DS101,
            # found in its groups, packed or not.
            action_id = f"{session}{turn - 2}-0" if turn >= 2 and i == 3 else f"{session}{turn}-{i}"
            found["packing"] += packing.submit_many([_untimed_line(n, session, action_id)])
            found["never"] += never.submit_many([_untimed_line(n, session, action_id)])
        if other in packing._sessions:
            packed_after.append(_is_packed(packing._sessions[other]))
    assert packed_after[0] is True  # 4 entries past a budget of 4
    # Both now hold more than five times the budget it started at, and neither is packed.
    assert packed_after[-4:] == [False, False, False, False]
    assert min(packing._sessions[s].entry_count() for s in "ab") > 20
    found["packing"] += packing.finish()
    found["never"] += never.finish()
    rows = {k: [(v.rule, v.session_id, v.line) for v in vs] for k, vs in found.items()}
    assert rows["packing"] == rows["never"]
    assert sum(1 for rule, _, _ in rows["packing"] if rule == "DS101") == 14


def test_a_quiet_serve_packs_an_idle_session_on_its_clock_and_reads_it_back() -> None:
    """No record needs to arrive: serve's ticks move the clock, and a look is due once it has
    moved on by the idle time (the first tick releases the span: its session changed then)."""
    now = [T0]
    engine = Engine(shipped(), EngineOptions(mode="serve", pack_idle_after_s=60), clock=lambda: now[0])
    span = Spans()
    engine.submit_many([span(0, session="quiet", action_id="ask", kind="user_prompt")])
    for after_s in (61, 122):
        now[0] = T0 + after_s * S
        engine.tick(now[0])
    assert _is_packed(engine._sessions["quiet"])
    now[0] = T0 + 130 * S
    out = engine.submit_many([span(130, session="quiet", action_id="ask", kind="user_prompt")])
    now[0] = T0 + 140 * S
    out += engine.tick(now[0])
    assert [(v.rule, v.action_id) for v in out if v.rule == "DS101"] == [("DS101", "ask")]


# -- the engine that packs against the one that never does ---------------------------------

_LONG = "0123456789abcdef-long-enough-to-be-digested"
_optional = {
    "idempotency_key": st.sampled_from(["k1", "k2", _LONG, "", None]),
    "input_fingerprint": st.sampled_from(["f1", "f2", _LONG + "-f"]),
    "replayed": st.booleans(),
    "workflow_state": st.sampled_from(["awaiting_approval", "waiting_on_external", "executing", "completed"]),
    "wait_timeout_s": st.sampled_from([1, 30, 600]),
    "approval_decision": st.sampled_from(["granted", "denied"]),
    "plan_version": st.sampled_from([1, 2, "2"]),
    "attempts": st.integers(1, 4),
    "max_attempts": st.integers(1, 3),
    "side_effects": st.booleans(),
    "on_failure": st.sampled_from(["ask_user", "abort"]),
}
_step = st.fixed_dictionaries(
    {
        "session": st.sampled_from(["s1", "s1", "s2", "s2", "s3"]),
        # A few ids that repeat (re-executions, key changes) and enough others for a rule's
        # groups to outgrow the flat tuple of a small session.
        "action_id": st.one_of(st.sampled_from(["a", "b", _LONG]), st.sampled_from([f"x{n}" for n in range(12)])),
        "kind": st.sampled_from(["tool_call", "payment", "user_prompt", "checkpoint", "approval", "llm_call"]),
        "status": st.sampled_from(["ok", "ok", "error"]),
        "gap_s": st.sampled_from([0, 0.5, 2, 45, 90, 4000]),
        "late_s": st.sampled_from([0, 0, 0, 3, 8]),
        # Delivered again: an earlier span (a duplicate delivery) or an earlier line, this many back.
        "again": st.sampled_from([0, 0, 0, 0, 1, 3, 9]),
    },
    optional=_optional,
)


def _items(steps: list[dict[str, Any]], source: str) -> list[Action]:
    span = Spans()
    clock = 0.0
    items = []
    for line, step in enumerate(steps, start=1):
        fields = dict(step)
        session = fields.pop("session")
        clock += fields.pop("gap_s")
        late = fields.pop("late_s")
        again = fields.pop("again")
        if again and len(items) >= again:
            items.append(items[-again])
            continue
        if source == "span":
            items.append(span(clock - late, session=session, **fields))
        else:
            # A timed log line (its time is what idle measures), or one without a time.
            record = log_line(line, session=session, **fields).record
            time_ns = None if source == "untimed-log" else T0 + round(clock * S)
            items.append(Action(record, "log", "actions.jsonl", line, time_ns, line))
    return items


def _judged(items: list[Action], sizes: list[int], options: EngineOptions, backend: str) -> tuple[Any, ...]:
    with tempfile.TemporaryDirectory() as directory:
        store = MemoryStore() if backend == "memory" else SqliteStore(Path(directory) / "state.db")
        engine = Engine(shipped(), options, store)
        out = []
        start = 0
        # Small batches: a session left out of one is packed at its end, and read again later.
        for n in range(len(items)):
            if start >= len(items):
                break
            size = sizes[n % len(sizes)]
            out += engine.submit_many(items[start : start + size])
            start += size
        out += engine.finish()
        summary = engine.summary()
        if isinstance(store, SqliteStore):
            # What was written, read back by a new process: the stored sessions, not the live ones.
            store.close()
            again = SqliteStore(Path(directory) / "state.db")
            loaded = list(again.load_sessions(engine.schema))
            again.close()
        else:
            loaded = list(engine._sessions.values())
        sessions = {s.session_id: s.to_plain(engine.schema) for s in loaded}
    return [v.to_json() for v in out], summary, sessions


@pytest.mark.parametrize(
    ("source", "lateness_s", "backend"),
    [("span", 0, "memory"), ("span", 5, "memory"), ("log", 5, "memory"), ("untimed-log", 5, "memory"),
     ("span", 0, "sqlite")],
)
@settings(max_examples=80, deadline=None)
@given(steps=st.lists(_step, min_size=1, max_size=60), sizes=st.lists(st.integers(1, 3), min_size=1, max_size=6))
def test_an_engine_that_packs_every_idle_session_judges_as_one_that_never_packs(
    steps: list[dict[str, Any]], sizes: list[int], source: str, lateness_s: float, backend: str
) -> None:
    never = _judged(
        _items(steps, source), sizes, EngineOptions(allowed_lateness_s=lateness_s, pack_idle_after_s=None), "memory"
    )
    packing = _judged(
        _items(steps, source),
        sizes,
        EngineOptions(
            allowed_lateness_s=lateness_s, pack_idle_after_s=0, pack_every_records=1, pack_untimed_after_sessions=0
        ),
        backend,
    )
    assert packing == never


def test_shared_kept_tuples_are_bounded_and_common_ones_still_shared_after_a_new_start() -> None:
    """The engine shares equal kept-field tuples through a bounded cache that starts over when
    full: it never pins more than its bound of tuples no group holds any more (their sessions
    packed or ended), and a tuple many records keep is shared again from its next record."""
    from processor.evaluate.engine import _KEPT_TUPLES_MAX

    engine = Engine(shipped(), EngineOptions())
    plan = engine._plan_by_id["DS101"]
    common = {"session_id": "s", "action_id": "a", "kind": "tool_call", "status": "ok"}
    for n in range(3 * _KEPT_TUPLES_MAX + 7):
        engine._kept(plan, {**common, "idempotency_key": f"k{n}"})
        assert len(engine._kept_cache) <= _KEPT_TUPLES_MAX
    first = engine._kept(plan, dict(common))
    again = engine._kept(plan, dict(common))
    assert first == again and first is again
    # Started over three times: the last 7 unique tuples, then the common one.
    assert len(engine._kept_cache) == 8


def test_serve_says_how_many_sessions_are_packed_and_what_they_take() -> None:
    """The gauges follow the packing passes: two idle sessions packed, one unpacked by its next record."""
    from processor.telemetry import Telemetry

    tm = Telemetry()
    now = [T0]
    engine = Engine(shipped(), EngineOptions(mode="serve", pack_idle_after_s=60), clock=lambda: now[0], telemetry=tm)
    span = Spans()
    engine.submit_many([span(0, session=s, action_id="ask", kind="user_prompt") for s in ("one", "two")])
    get = tm.registry.get_sample_value
    assert get("durable_check_sessions_packed") == 0
    for after_s in (61, 122):
        now[0] = T0 + after_s * S
        engine.tick(now[0])
    sessions = engine._sessions
    assert _is_packed(sessions["one"]) and _is_packed(sessions["two"])
    held = sessions["one"].packed_bytes() + sessions["two"].packed_bytes()
    assert get("durable_check_sessions_packed") == 2 and get("durable_check_packed_bytes") == held > 0
    now[0] = T0 + 130 * S
    engine.submit_many([span(130, session="one", action_id="again", kind="llm_call")])
    # The next pass (a minute after the last) finds "one" active 55 s ago: unpacked, not packed again.
    now[0] = T0 + 185 * S
    engine.tick(now[0])
    assert not _is_packed(sessions["one"]) and _is_packed(sessions["two"])
    assert get("durable_check_sessions_packed") == 1
    assert get("durable_check_packed_bytes") == sessions["two"].packed_bytes()
    # A minute later it is idle too.
    now[0] = T0 + 250 * S
    engine.tick(now[0])
    assert get("durable_check_sessions_packed") == 2
    assert get("durable_check_packed_bytes") == sum(s.packed_bytes() for s in sessions.values())
