"""``serve`` killed with SIGKILL at random points while agents stream sessions into it, restarted on the
same state: the violations are those of an uninterrupted run, none missing, none written twice.

Both runs are real ``python -m processor.cli serve`` processes fed by a client that
retries like an OTLP exporter (UNAVAILABLE and lost connections, with backoff). The
kill points come from a seeded RNG, so a failure can be replayed. The killed run also
alerts a real Alertmanager, which must end up holding every violation. With
PostgreSQL, two replicas share the state; one is killed and the other finishes its
sessions, with the result of a single replica. And a violation still in an exporter's
retry queue (a failing webhook, a failing JSONL write) when the process is killed is
delivered once after the restart: the outbox counts it delivered only on the exporter's
confirmation.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from tests.durable_support import (
    RetryingSender,
    ServeProcess,
    send_sessions,
    serve_settings,
    workload,
    write_config,
)
from tests.pg_support import fresh_database, pg_server
from tests.serve_support import read_jsonl
from tests.servers import HttpRecorder, Received, alertmanager_server, free_port, wait_until

__all__ = ["pg_server"]  # the fixture, used by name

SESSIONS = 24
STEPS = 12
# Long enough for the one-second waits of the workload to fire from the clock after the last span.
SETTLE_S = 3.0


def _run(
    workdir: Path, state: dict[str, Any], kills: int, seed: int, alertmanager: str = ""
) -> tuple[list[dict[str, Any]], ServeProcess]:
    """One serve process (restarted after each kill) fed the workload; returns the JSONL documents."""
    workdir.mkdir(parents=True)
    port = free_port()
    jsonl = workdir / "violations.jsonl"
    settings = serve_settings(workdir, port, state, jsonl)
    if alertmanager:
        settings["exporters"]["alertmanager"] = {"url": alertmanager}
    config = write_config(workdir / "serve.yaml", settings)
    serve = ServeProcess(config, port, workdir / "serve.log")
    requests = workload(seed, SESSIONS, STEPS, time.time_ns())
    serve.start()
    serve.wait_ready()
    sender = RetryingSender(lambda: port, give_up_s=90.0)
    errors: list[BaseException] = []

    def send() -> None:
        try:
            send_sessions(sender, requests, workers=4, pause_s=0.15)
        except BaseException as exc:  # reported below
            errors.append(exc)

    sending = threading.Thread(target=send)
    sending.start()
    rng = random.Random(seed)
    try:
        for _ in range(kills):
            time.sleep(rng.uniform(0.2, 0.9))
            if not sending.is_alive():
                break
            serve.kill()
            time.sleep(rng.uniform(0.0, 0.4))
            serve.start()
            serve.wait_ready()
        sending.join(180.0)
        assert not sending.is_alive(), "the client did not finish"
        assert not errors, f"the client gave up: {errors[0]!r}\n{serve.log()}"
        time.sleep(SETTLE_S)
    finally:
        code = serve.stop()
    assert code == 0, serve.log()
    return read_jsonl(jsonl), serve


def _ids(documents: list[dict[str, Any]]) -> list[str]:
    return [str(d["violation_id"]) for d in documents]


def _assert_same(found: list[dict[str, Any]], expected: list[dict[str, Any]], log: str) -> None:
    twice = [vid for vid, n in Counter(_ids(found)).items() if n > 1]
    assert not twice, f"{len(twice)} violation(s) written twice"
    missing = set(_ids(expected)) - set(_ids(found))
    extra = set(_ids(found)) - set(_ids(expected))
    assert not missing and not extra, (
        f"missing {len(missing)} ({Counter(d['rule'] for d in expected if d['violation_id'] in missing)}), "
        f"extra {len(extra)} ({Counter(d['rule'] for d in found if d['violation_id'] in extra)})\n{log}"
    )


def test_sigkill_at_random_points_loses_nothing_and_repeats_nothing(tmp_path: Path) -> None:
    state = {"backend": "sqlite"}
    with alertmanager_server(tmp_path / "alertmanager-u") as reference_am:
        expected, _ = _run(tmp_path / "uninterrupted", {**state, "path": str(tmp_path / "u.db")}, kills=0,
                           seed=11, alertmanager=reference_am.url)
        # Waits that expired and later resolved end their alerts: what stays active is the rest.
        still_active = wait_until(lambda: _alerted_ids(reference_am.url), timeout_s=15.0,
                                  what="the reference run's alerts")
    assert {d["rule"] for d in expected} >= {"DS002", "DS107", "DS110"}, "the workload must exercise the rules"
    assert still_active < set(_ids(expected)), "some expired waits must resolve, ending their alerts"
    with alertmanager_server(tmp_path / "alertmanager") as am:
        found, serve = _run(tmp_path / "killed", {**state, "path": str(tmp_path / "k.db")}, kills=4, seed=11,
                            alertmanager=am.url)
        assert serve.kills >= 2, "the kills must land while the client is sending"
        _assert_same(found, expected, serve.log())
        # Alertmanager keys alerts by their labels (violation_id among them): a resent alert is the
        # same alert, so what counts there is that none is missing. A resolution is not kept across
        # a crash (the alert then ends by resolve_after), so more may still be active, never fewer.
        alerted = wait_until(lambda: _alerted_ids(am.url) >= still_active and _alerted_ids(am.url),
                             timeout_s=15.0, what="every unresolved violation alerted")
        assert alerted <= set(_ids(expected))


def _alerted_ids(url: str) -> set[str]:
    response = httpx.get(f"{url}/api/v2/alerts", params={"active": "true"}, timeout=5)
    response.raise_for_status()
    return {a["labels"]["violation_id"] for a in response.json() if "violation_id" in a["labels"]}


def _pg_state(url: str, replica: str) -> dict[str, Any]:
    return {"backend": "postgres", "postgres": {"dsn": url, "replica_id": replica, "lease_ttl": "2s"}}


def _send_routed(requests: dict[str, list[bytes]], port_for: Any, pause_s: float) -> RetryingSender:
    """Each session's requests in order, to the port ``port_for(session)`` names at the time of sending."""
    senders: dict[str, RetryingSender] = {}
    for session in requests:
        senders[session] = RetryingSender(lambda s=session: port_for(s), give_up_s=90.0)
    names = sorted(requests)
    errors: list[BaseException] = []

    def run(mine: list[str]) -> None:
        try:
            for index in range(STEPS):
                for name in mine:
                    senders[name].send(requests[name][index])
                time.sleep(pause_s)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(names[i::4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180.0)
    assert not errors, f"the client gave up: {errors[0]!r}"
    total = RetryingSender(lambda: 0)
    total.retries = sum(s.retries for s in senders.values())
    return total


def test_two_replicas_on_postgres_one_killed_the_other_finishes_its_sessions(tmp_path: Path, pg_server: str) -> None:
    import psycopg

    seed = 23
    # The reference: one replica, never interrupted.
    single = tmp_path / "single"
    single.mkdir()
    port = free_port()
    config = write_config(single / "serve.yaml",
                          serve_settings(single, port, _pg_state(fresh_database(pg_server), "solo"),
                                         single / "violations.jsonl"))
    solo = ServeProcess(config, port, single / "serve.log")
    solo.start()
    solo.wait_ready()
    try:
        _send_routed(workload(seed, SESSIONS, STEPS, time.time_ns()), lambda _: port, 0.1)
        time.sleep(SETTLE_S)
    finally:
        assert solo.stop() == 0, solo.log()
    expected = read_jsonl(single / "violations.jsonl")
    assert {d["rule"] for d in expected} >= {"DS002", "DS107", "DS110"}

    url = fresh_database(pg_server)
    replicas: dict[str, ServeProcess] = {}
    for name in ("r1", "r2"):
        workdir = tmp_path / name
        workdir.mkdir()
        replica_port = free_port()
        path = write_config(workdir / "serve.yaml",
                            serve_settings(workdir, replica_port, _pg_state(url, name), workdir / "violations.jsonl"))
        replicas[name] = ServeProcess(path, replica_port, workdir / "serve.log")
        replicas[name].start()
    for replica in replicas.values():
        replica.wait_ready()
    alive = {"r1": True}

    def port_for(session: str) -> int:
        # What the Collector's load-balancing exporter does: a stable choice per session,
        # and every session to the survivor once r1 is gone.
        if alive["r1"] and sum(session.encode()) % 2 == 0:
            return replicas["r1"].grpc_port
        return replicas["r2"].grpc_port

    def kill_r1() -> None:
        time.sleep(1.2)
        replicas["r1"].kill()
        alive["r1"] = False

    killer = threading.Thread(target=kill_r1)
    killer.start()
    try:
        _send_routed(workload(seed, SESSIONS, STEPS, time.time_ns()), port_for, 0.25)
        killer.join(30.0)
        assert replicas["r1"].kills == 1, "r1 must die while sessions are in flight"
        # r2 adopts r1's work once r1's lease (2s) has expired, then the waits fire.
        time.sleep(2.0 + 1.0 + SETTLE_S)
    finally:
        replicas["r1"].kill()
        assert replicas["r2"].stop() == 0, replicas["r2"].log()
    files = {name: read_jsonl(tmp_path / name / "violations.jsonl") for name in replicas}
    for name, documents in files.items():
        ids = _ids(documents)
        assert len(ids) == len(set(ids)), f"{name} wrote a violation twice"
    union = [d for documents in files.values() for d in documents]
    unique = list({d["violation_id"]: d for d in union}.values())
    _assert_same(unique, expected, replicas["r2"].log())
    assert files["r1"], "r1 must have found some violations before it died"
    with psycopg.connect(url) as conn:
        recorded = conn.execute("SELECT count(*) FROM outbox").fetchone()
        undelivered = conn.execute("SELECT count(*) FROM outbox_pending").fetchone()
        owners = conn.execute("SELECT DISTINCT replica_id FROM session_owner").fetchall()
    assert recorded is not None and recorded[0] == len(expected), "each violation is recorded once"
    assert undelivered is not None and undelivered[0] == 0, "every violation was delivered"
    assert owners == [("r2",)], "the survivor owns every session"


# -- violations still in an exporter's retry queue when the process dies -----------------------------------

def _outbox(db: Path) -> tuple[set[str], dict[str, set[str]]]:
    """Every violation id the outbox recorded, and per exporter the ids it has not confirmed (read-only)."""
    import sqlite3

    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        recorded = {str(r[0]) for r in conn.execute("SELECT violation_id FROM outbox")}
        pending: dict[str, set[str]] = {}
        for exporter, violation_id in conn.execute(
                "SELECT p.exporter, o.violation_id FROM outbox_pending p JOIN outbox o ON o.seq = p.seq"):
            pending.setdefault(str(exporter), set()).add(str(violation_id))
    finally:
        conn.close()
    return recorded, pending


def _header(received: Received, name: str) -> str:
    return next((v for k, v in received.headers.items() if k.lower() == name.lower()), "")


def _posted_ids(received: Received) -> list[str]:
    return [str(v["violation_id"]) for v in received.json()["violations"]]


def test_violations_in_the_webhook_retry_queue_at_sigkill_are_delivered_once_after_restart(tmp_path: Path) -> None:
    hook = HttpRecorder()
    hook.mode = "503"  # the endpoint fails until after the crash
    try:
        port = free_port()
        db = tmp_path / "state.db"
        jsonl = tmp_path / "violations.jsonl"
        settings = serve_settings(tmp_path, port, {"backend": "sqlite", "path": str(db)}, jsonl)
        # Many quick attempts: the violations are still being retried when the process dies.
        settings["exporters"]["webhook"] = {"url": f"{hook.url}/hook", "initial_backoff": "50ms",
                                            "max_backoff": "200ms", "max_attempts": 10_000}
        serve = ServeProcess(write_config(tmp_path / "serve.yaml", settings), port, tmp_path / "serve.log")
        serve.start()
        serve.wait_ready()
        try:
            send_sessions(RetryingSender(lambda: port), workload(31, 6, 5, time.time_ns()))
            time.sleep(SETTLE_S)  # the waits fire from the clock
            expected = set(_ids(read_jsonl(jsonl)))
            assert expected, "the workload must find violations"

            # The first is retried again and again; the others wait behind it in the exporter's queue.
            wait_until(lambda: len(hook.snapshot()) >= 3, timeout_s=15.0, what="failed webhook attempts")
            recorded, pending = _outbox(db)
            assert recorded == expected
            # JSONL confirmed its writes; the webhook confirmed nothing: its rows stay pending.
            assert "jsonl" not in pending
            assert pending.get("webhook") == expected
            serve.kill()
        finally:
            serve.kill()
        assert {r.status for r in hook.snapshot()} == {503}
        tried_before = {vid for r in hook.snapshot() for vid in _posted_ids(r)}
        hook.mode = "ok"
        serve.start()
        serve.wait_ready()
        try:
            wait_until(lambda: {vid for r in hook.snapshot() if r.status == 200 for vid in _posted_ids(r)} >= expected,
                       timeout_s=20.0, what="every violation delivered after the restart")
            # The outbox records the confirmations: nothing is handed over a third time.
            wait_until(lambda: not _outbox(db)[1], timeout_s=10.0, what="the outbox confirmed")
        finally:
            assert serve.stop() == 0, serve.log()
        delivered = Counter(vid for r in hook.snapshot() if r.status == 200 for vid in _posted_ids(r))
        assert set(delivered) == expected
        assert set(delivered.values()) == {1}, "each violation is delivered once"
        for received in hook.snapshot():
            # The violation id is the key, before and after the crash: a receiver can tell a repeat.
            assert _posted_ids(received) == [_header(received, "Idempotency-Key")]
        assert tried_before and tried_before <= set(delivered)
        assert sorted(_ids(read_jsonl(jsonl))) == sorted(expected), "JSONL wrote each violation once"
        assert _outbox(db) == (expected, {})
    finally:
        hook.stop()


def test_violations_whose_jsonl_write_failed_at_sigkill_are_written_once_after_restart(tmp_path: Path) -> None:
    port = free_port()
    db = tmp_path / "state.db"
    jsonl = tmp_path / "violations.jsonl"
    settings = serve_settings(tmp_path, port, {"backend": "sqlite", "path": str(db)}, jsonl)
    serve = ServeProcess(write_config(tmp_path / "serve.yaml", settings), port, tmp_path / "serve.log")
    serve.start()
    serve.wait_ready()
    # Once serve runs (start-up refuses a directory there), the file's place is taken by a
    # directory: every write fails with a real OSError. The file is opened at the first write.
    assert not jsonl.exists()
    jsonl.mkdir()
    try:
        send_sessions(RetryingSender(lambda: port), workload(37, 6, 5, time.time_ns()))
        time.sleep(SETTLE_S)
        wait_until(lambda: "exporter jsonl: write failed" in serve.log(), timeout_s=10.0,
                   what="the failed write to be logged")
        recorded, pending = _outbox(db)
        assert recorded, "the workload must find violations"
        assert pending == {"jsonl": recorded}, "nothing is confirmed while the write fails"
        serve.kill()
    finally:
        serve.kill()
    jsonl.rmdir()
    serve.start()
    serve.wait_ready()
    try:
        wait_until(lambda: set(_ids(read_jsonl(jsonl))) >= recorded, timeout_s=20.0,
                   what="every violation written after the restart")
        wait_until(lambda: not _outbox(db)[1], timeout_s=10.0, what="the outbox confirmed")
    finally:
        assert serve.stop() == 0, serve.log()
    written = _ids(read_jsonl(jsonl))
    assert sorted(written) == sorted(recorded), "each violation is written once"
    assert _outbox(db) == (recorded, {})
