"""The PostgreSQL store: sessions owned by one replica at a time, moved with their state when a lease
expires, and the work of a replica that died adopted by another. A real server, started by the tests."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest

from processor.evaluate.engine import Engine, EngineOptions
from processor.state.faults import SessionOwnedElsewhere, StateUnavailable
from processor.state.journal import Journal, NewEntry
from processor.state.outbox import Outbox
from processor.state.postgres import PostgresStore, redact
from processor.violations import Violation
from tests._engine_util import Spans, fired, shipped
from tests.pg_support import fresh_database, pg_server

__all__ = ["pg_server"]  # the fixture, used by name

TTL_S = 0.6


def _store(url: str, replica: str) -> PostgresStore:
    return PostgresStore(url, replica_id=replica, lease_ttl_s=TTL_S)


def _claim(store: PostgresStore, *sessions: str) -> list[int | object]:
    """Journal one request touching ``sessions``, claiming them as serve does."""
    journal = Journal(store)
    return list(journal.append([NewEntry(b"req", "grpc", "o", 1, 0, session_ids=frozenset(sessions))],
                               lambda e: store.admit(e.session_ids)))


def test_the_password_never_appears_in_messages() -> None:
    assert redact("postgresql://checker:s3cret@db.internal:5433/state") == "db.internal:5433/state"


def test_a_session_is_evaluated_by_one_replica_and_moves_with_its_state(pg_server: str) -> None:
    url = fresh_database(pg_server)
    spans = Spans()
    one, two = _store(url, "r1"), _store(url, "r2")
    assert isinstance(_claim(one, "s1")[0], int)
    engine_one = Engine(shipped(), EngineOptions(), one)
    # A wait opens on r1 and is committed with r1's claim on s1.
    engine_one.submit_many([spans(1.0, "s1", workflow_state="awaiting_approval", wait_timeout_s=3, action_id="w1"),
                            spans(7.0, "s1")])
    assert one.timer_count() == 1
    refused = _claim(two, "s1")[0]
    assert isinstance(refused, SessionOwnedElsewhere)
    time.sleep(TTL_S + 0.3)
    # r1's lease expired: r2 takes s1 over and loads its state, timer included.
    assert isinstance(_claim(two, "s1")[0], int)
    assert two.takeover_pending()
    two.reset()
    engine_two = Engine(shipped(), EngineOptions(), two)
    assert two.timer_count() == 1
    found = engine_two.submit_many([spans(30.0, "s2")]) + engine_two.finish()
    assert ("DS107", "s1", "w1") in fired(found)
    # r1 still holds s1 in memory; its next write of s1 is refused, naming who has it now.
    with pytest.raises(SessionOwnedElsewhere) as caught:
        engine_one.submit_many([spans(8.0, "s1")])
    assert caught.value.moved == {"s1": "r2"}
    assert one.stale
    one.close()
    two.close()


def test_a_dead_replicas_accepted_work_is_adopted(pg_server: str) -> None:
    url = fresh_database(pg_server)
    spans = Spans()
    dead, alive = _store(url, "r1"), _store(url, "r2")
    dead.maintain()
    alive.maintain()
    journal = Journal(dead)
    assert isinstance(_claim(dead, "s1")[0], int)
    engine = Engine(shipped(), EngineOptions(), dead)
    # Held in r1's reordering buffer (within the allowed lateness), acknowledged; their condition
    # rules ran when they were accepted (DS002), the session rules (DS101) wait for the buffer.
    accepted = engine.submit_many([spans(1.0, "s1", kind="payment", action_id="p1"),
                                   spans(2.0, "s1", kind="payment", action_id="p1")])
    assert {v.rule for v in accepted} == {"DS002"}
    outbox = Outbox(dead, ["jsonl"])
    violation = Violation(rule="DS002", name="n", severity="critical", session_id="s1", action_id="x",
                          message="m", violation_id="f" * 32)
    with dead.unit():
        outbox.add_in_unit([violation], lambda rows: None)
    assert len(journal.pending()) == 1
    dead.close()  # r1 dies: no more heartbeats
    time.sleep(TTL_S + 0.3)
    assert alive.maintain()
    alive.reset()
    assert len(Journal(alive).pending()) == 1
    # The spans r1 held for ordering join r2's reordering buffer as they were (not as redeliveries).
    engine_state = alive.load_engine()
    assert isinstance(engine_state, dict)
    assert [b["action"]["record"]["action_id"] for b in engine_state["buffer"]] == ["p1", "p1"]
    assert [v.violation_id for _, v in Outbox(alive, ["jsonl"]).pending("jsonl")] == ["f" * 32]
    adopted = Engine(shipped(), EngineOptions(), alive)
    assert [s.session_id for s in alive.load_sessions(adopted.schema)] == ["s1"]
    # Released at the end of the input: the payments r1 acknowledged meet the session rules, and
    # their condition rules, which ran in r1, do not run again.
    released = fired(adopted.finish())
    assert ("DS101", "s1", "p1") in released
    assert ("DS002", "s1", "p1") not in released
    alive.close()


def test_lost_connection_is_retryable_and_reconnects(pg_server: str) -> None:
    url = fresh_database(pg_server)
    store = _store(url, "r1")
    journal = Journal(store)
    victim = store.query("SELECT pg_backend_pid()")[0][0]
    killer = _store(url, "killer")
    killer.query("SELECT pg_terminate_backend(?)", (victim,))
    with pytest.raises(StateUnavailable) as caught:
        journal.append([NewEntry(b"r", "grpc", "o", 1, 0)])
    assert "lost the connection" in str(caught.value)
    assert all(isinstance(i, int) for i in journal.append([NewEntry(b"r", "grpc", "o", 1, 0)]))
    store.close()
    killer.close()


def _owners(store: PostgresStore) -> dict[str, str]:
    return {str(sid): str(owner) for sid, owner in store.query("SELECT session_id, replica_id FROM session_owner")}


def test_a_request_takes_its_sessions_in_order_up_to_the_first_held_elsewhere(pg_server: str) -> None:
    url = fresh_database(pg_server)
    one = PostgresStore(url, replica_id="r1", lease_ttl_s=60)
    two = PostgresStore(url, replica_id="r2", lease_ttl_s=60)
    assert isinstance(_claim(two, "s5")[0], int)
    assert isinstance(_claim(one, "s7")[0], int)
    lease_of_s7 = one.query("SELECT lease_until FROM session_owner WHERE session_id = 's7'")
    refused = _claim(one, *(f"s{i}" for i in range(1, 10)))[0]
    assert isinstance(refused, SessionOwnedElsewhere)
    assert "held by another replica" in str(refused)
    # s1-s4 come before r2's s5 and are taken; s6-s9 are not reached: s7 keeps its old lease.
    assert _owners(one) == {"s1": "r1", "s2": "r1", "s3": "r1", "s4": "r1", "s5": "r2", "s7": "r1"}
    assert one.query("SELECT lease_until FROM session_owner WHERE session_id = 's7'") == lease_of_s7
    # A request of the sessions r1 holds or nobody does is taken whole, the leases renewed.
    assert isinstance(_claim(one, "s1", "s7", "s8")[0], int)
    assert _owners(one)["s8"] == "r1"
    assert one.query("SELECT lease_until FROM session_owner WHERE session_id = 's7'") != lease_of_s7
    assert not one.takeover_pending()
    one.close()
    two.close()


def test_a_session_claimed_meanwhile_by_another_replica_stops_the_claims_there(pg_server: str) -> None:
    url = fresh_database(pg_server)
    one = PostgresStore(url, replica_id="r1", lease_ttl_s=60)
    results: list[object] = []
    with psycopg.connect(url) as other:
        # Another replica's claim of s5, not yet committed: r1 does not see it, and its own claim
        # of s5 waits for that transaction's outcome.
        other.execute("INSERT INTO session_owner VALUES ('s5', 'r2', clock_timestamp() + interval '1 hour')")
        claiming = threading.Thread(target=lambda: results.extend(_claim(one, *(f"s{i}" for i in range(1, 10)))))
        claiming.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not other.execute(
            "SELECT 1 FROM pg_stat_activity WHERE application_name = 'durable-check r1' AND wait_event_type = 'Lock'"
        ).fetchone():
            time.sleep(0.02)
        other.commit()
        claiming.join(timeout=20)
    assert not claiming.is_alive()
    assert isinstance(results[0], SessionOwnedElsewhere)
    assert "just claimed by another replica" in str(results[0])
    # What r1 would have claimed after s5 is given back in the same transaction.
    assert _owners(one) == {"s1": "r1", "s2": "r1", "s3": "r1", "s4": "r1", "s5": "r2"}
    one.close()


def test_the_outbox_records_each_violation_of_a_batch_once(pg_server: str) -> None:
    url = fresh_database(pg_server)
    store = PostgresStore(url, replica_id="r1", lease_ttl_s=60)
    outbox = Outbox(store, ["jsonl", "alertmanager"])

    def violation(n: int) -> Violation:
        return Violation(rule="DS002", name="n", severity="critical", session_id=f"s{n % 2}", action_id=f"a{n}",
                         message="m", violation_id=f"{n:032x}")

    first: list[tuple[int, Violation]] = []
    second: list[tuple[int, Violation]] = []
    with store.unit():
        outbox.add_in_unit([violation(1), violation(2), violation(1)], first.extend)
    with store.unit():
        # 2 was recorded by the first unit, 3 twice in this one: each is new once.
        outbox.add_in_unit([violation(2), violation(3), violation(4), violation(3)], second.extend)
    assert [v.action_id for _, v in first] == ["a1", "a2"]
    assert [v.action_id for _, v in second] == ["a3", "a4"]
    seqs = [seq for seq, _ in first + second]
    assert seqs == sorted(seqs) and len(set(seqs)) == 4
    assert [(seq, v.action_id) for seq, v in outbox.pending("alertmanager")] == [
        (seq, v.action_id) for seq, v in first + second
    ]
    assert store.query("SELECT count(*) FROM outbox")[0][0] == 4
    store.close()


def test_a_session_asked_for_by_another_replica_is_handed_over_with_what_its_owner_held(pg_server: str) -> None:
    """The Collector's ring changed: r2 now gets s1's spans while r1 holds s1 (a long lease). r2's refused
    request asks for it; r1 evaluates what its window holds of s1, fires none of its timers, and hands it
    over; r2's next request loads the state, and the wait fires there."""
    url = fresh_database(pg_server)
    spans = Spans()
    one = PostgresStore(url, replica_id="r1", lease_ttl_s=60)
    two = PostgresStore(url, replica_id="r2", lease_ttl_s=60)
    assert isinstance(_claim(one, "s1", "s2")[0], int)
    engine_one = Engine(shipped(), EngineOptions(), one)
    # The wait (deadline 4 s) is released; the first charge (2 s) is still in the reordering window.
    engine_one.submit_many([
        spans(1.0, "s1", workflow_state="awaiting_approval", wait_timeout_s=3, action_id="w1"),
        spans(2.0, "s1", action_id="c1", kind="payment", result=1, idempotency_key="s1-charge"),
        spans(6.5, "s2"),
    ])
    assert one.wanted_here() == []
    refused = _claim(two, "s1")[0]
    assert isinstance(refused, SessionOwnedElsewhere)
    assert "hands it over" in str(refused)
    assert one.wanted_here() == ["s1"]
    assert two.wanted_here() == []
    with one.unit():
        found, going = engine_one.hand_over(one.wanted_here())
        one.give_in_unit(going)
    assert going == ["s1"]
    assert found == []
    assert not engine_one.holds_session("s1")
    assert one.timer_count() == 0
    assert _owners(one) == {"s1": "r2", "s2": "r1"}
    assert one.wanted_here() == []
    # r1 goes on with s2 past s1's deadline: s1's wait is no longer r1's to fire.
    assert engine_one.submit_many([spans(20.0, "s2")]) == []
    # r2's retried request is taken, and the state comes with it: the wait, and the charge held at r1.
    assert isinstance(_claim(two, "s1")[0], int)
    assert two.takeover_pending()
    two.reset()
    engine_two = Engine(shipped(), EngineOptions(), two)
    assert two.timer_count() == 1
    found = engine_two.submit_many([spans(9.0, "s1", action_id="c2", kind="payment", result=1,
                                          idempotency_key="s1-charge")]) + engine_two.finish()
    assert ("DS107", "s1", "w1") in fired(found)
    assert ("DS104", "s1", "c2") in fired(found)
    assert not two.takeover_pending()
    # r1's next write of s2 is its own: nothing of s1 is written by r1 any more.
    engine_one.submit_many([spans(21.0, "s2")])
    assert _owners(two) == {"s1": "r2", "s2": "r1"}
    one.close()
    two.close()

