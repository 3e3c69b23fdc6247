"""The benchmark harness runs end to end at its tiny size and its table has every row.

A smoke test only: no timing is asserted (performance is judged by running the
benchmark, see docs/performance.md). The run starts real serve and replay processes.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from bench.generate import Story, rule_file_text, write_otlp_stream
from bench.live import template_of
from bench.run import ROW_KEYS
from processor.evaluate.rulefmt import load_rules
from tests.pg_support import pg_server

__all__ = ["pg_server"]  # the fixture, used by name

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_benchmark_produces_every_row(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--size", "tiny", "--runs", "1", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = orjson.loads(out.read_bytes())
    keys = [row["key"] for row in result["rows"]]
    assert keys == list(ROW_KEYS)
    for row in result["rows"]:
        assert row["metric"] in done.stdout
    by_key = {row["key"]: row for row in result["rows"]}
    # Each measured section produced a number (the live latency rows need a sustained rate).
    for key in ("replay_otlp.rate", "replay_actions.rate", "replay_rss.large", "memory.larger", "rules.200"):
        assert by_key[key]["value"] is not None and by_key[key]["value"] > 0, key
    assert result["machine"]["nproc"]
    assert result["details"]["replay_otlp"]["input"]["spans"] == 10_240


def test_generated_dump_is_deterministic_and_flaws_are_recorded(tmp_path: Path) -> None:
    first, second = tmp_path / "a.bin", tmp_path / "b.bin"
    stats = write_otlp_stream(first, 2_000, 20, seed=3)
    write_otlp_stream(second, 2_000, 20, seed=3)
    assert first.read_bytes() == second.read_bytes()
    assert stats.spans == 2_000 and stats.requests == 4
    assert 10 <= stats.attributes / stats.spans <= 14
    sidecar = orjson.loads((tmp_path / "a.bin.flaws.json").read_bytes())
    assert sum(len(r) for r in sidecar["requests"]) == stats.flawed_actions > 0


def test_story_interleaves_sessions_in_time_order() -> None:
    spans = list(Story(sessions=40, turns=2, seed=1).spans())
    assert len(spans) == 40 * 2 * 10
    times = [s.time_ns for s in spans]
    assert times == sorted(times)
    # Sessions interleave: the first 50 spans already come from many sessions.
    assert len({s.session for s in spans[:50]}) > 10


def test_time_fields_are_found_and_restamped(tmp_path: Path) -> None:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from bench.generate import read_otlp_stream

    dump = tmp_path / "d.bin"
    write_otlp_stream(dump, 600, 10)
    payload = next(read_otlp_stream(dump))
    template = template_of(payload)
    assert template.spans == 512
    stamped = ExportTraceServiceRequest.FromString(template.stamped(2_000_000_000_000_000_000))
    spans = [s for rs in stamped.resource_spans for ss in rs.scope_spans for s in ss.spans]
    original = [s for rs in ExportTraceServiceRequest.FromString(payload).resource_spans
                for ss in rs.scope_spans for s in ss.spans]
    assert all(s.start_time_unix_nano >= 2_000_000_000_000_000_000 for s in spans)
    assert all(s.end_time_unix_nano > s.start_time_unix_nano for s in spans)
    # Nothing but the times changed.
    assert [s.span_id for s in spans] == [s.span_id for s in original]
    assert [len(s.attributes) for s in spans] == [len(s.attributes) for s in original]


def test_generated_rules_load_through_the_real_loader(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(rule_file_text(50), encoding="utf-8")
    ruleset = load_rules([path], include_shipped=False)
    assert len(ruleset.rules) == 50


def test_a_dump_split_for_replicas_keeps_each_session_whole_on_one_replica(tmp_path: Path) -> None:
    """Every span once, request by request; a session's spans, and its flaws, all on one replica."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from bench.generate import flaws_path, read_otlp_stream
    from bench.live import split_dump

    dump = tmp_path / "d.bin"
    write_otlp_stream(dump, 3_000, 30, seed=5)
    paths = split_dump(dump, 2)
    assert split_dump(dump, 2) == paths  # written once, then found

    def spans_of(payload: bytes) -> list[tuple[bytes, str, str]]:
        request = ExportTraceServiceRequest.FromString(payload)
        out = []
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    found = {kv.key: kv.value.string_value for kv in span.attributes}
                    out.append((span.span_id, found.get("durable.session.id", ""), found.get("durable.action.id", "")))
        return out

    original = [spans_of(p) for p in read_otlp_stream(dump)]
    shares = [[spans_of(p) for p in read_otlp_stream(path)] for path in paths]
    flaws = orjson.loads(flaws_path(dump).read_bytes())["requests"]
    sidecars = [orjson.loads(flaws_path(path).read_bytes()) for path in paths]
    split_flaws = [sidecar["requests"] for sidecar in sidecars]
    home: dict[str, int] = {}
    for index, spans in enumerate(original):
        parts = [share[index] for share in shares]
        assert sorted(s for part in parts for s in part) == sorted(spans)
        for replica, part in enumerate(parts):
            assert sidecars[replica]["spans"][index] == len(part)  # what run_replicas offers each replica
            actions = {action for _, _, action in part}
            for _, session, _ in part:
                if session:
                    assert home.setdefault(session, replica) == replica, session
            assert all(action in actions for action, _ in split_flaws[replica][index])
        assert sorted(map(tuple, flaws[index])) == sorted(tuple(f) for fs in split_flaws for f in fs[index])
    assert set(home.values()) == {0, 1} and len(home) == 30


def test_the_floor_reads_the_lines_the_skills_loop_checks_and_refuses_the_malformed(tmp_path: Path) -> None:
    """The floor parses what the loop checks, line for line; what it cannot parse typed it only counts."""
    from bench.limits import skill_floor, skill_limit

    log = tmp_path / "a.jsonl"
    log.write_text(
        '{"session_id":"s","action_id":"a1","kind":"checkpoint","status":"ok","result":{"n":1}}\n'
        "# a comment\n"
        "\n"
        '{"action_id":"a2","kind":"checkpoint","status":"ok"}\n'
        '{"session_id":"s","action_id":"a3","kind":"payment","status":"ok","attempts":"two"}\n'
        '{"session_id":"s","action_id":\n'
        '  {"session_id":"s","action_id":"a4","kind":"llm_call","status":"ok","retryable":true}  \n',
        encoding="utf-8",
    )
    lines, violations = skill_limit(str(log))
    # Two malformed lines, a payment without its key, a model call without its result and without a cap.
    assert (lines, violations) == (5, 5)
    assert skill_floor(str(log)) == (5, 3)  # the line without a session, the wrong type, the cut line


def _every_rule_once() -> list[bytes]:
    """A log on which each session rule of the shipped packs, and a few others, finds one thing."""
    lines: list[bytes] = []

    def add(session: str, action: str, kind: str, second: int, **fields: object) -> None:
        minutes, seconds = divmod(second, 60)
        record = {"session_id": session, "action_id": action, "kind": kind, "status": fields.pop("status", "ok"),
                  "time": f"2026-11-01T{9 + minutes // 60:02d}:{minutes % 60:02d}:{seconds:02d}Z", **fields}
        lines.append(orjson.dumps(record))

    add("s1", "a1", "llm_call", 0, result={"x": 1})
    add("s1", "a1", "llm_call", 1, result={"x": 1})  # DS009, DS101
    add("s1", "p1", "payment", 2, idempotency_key="k1", result=1)
    add("s1", "p1", "payment", 3, idempotency_key="k2", result=1, replayed=True)  # DS009, DS102
    add("s1", "p2", "payment", 4, idempotency_key="k2", result=1)  # DS104
    add("s2", "e1", "tool_call", 5, status="error", attempts=3, max_attempts=3, retryable=True, on_failure="abort")
    add("s2", "e2", "tool_call", 4000, result=1)  # DS105: no escalation within the hour
    add("s3", "w1", "approval", 10, workflow_state="awaiting_approval", wait_timeout_s=60)
    add("s3", "x1", "tool_call", 400)  # DS107: the wait passed
    add("s4", "g1", "approval", 20, approval_decision="granted", plan_version=1)
    add("s4", "x2", "payment", 21, plan_version=2, idempotency_key="k9", workflow_state="executing", result=1)  # DS108
    add("s5", "g2", "approval", 30, approval_decision="denied", plan_version=3)
    add("s5", "x3", "payment", 31, plan_version=3, idempotency_key="k8", result=1)  # DS109
    for attempt in range(1, 12):  # DS111 at the 11th failure in ten minutes; DS009 from the 2nd
        add("s6", "r1", "tool_call", 40 + attempt, status="error", retryable=True, max_attempts=20, attempts=attempt,
            on_failure="abort")
    add("s7", "c1", "clock", 60)  # DS001
    add("s7", "q1", "payment", 61, result=1)  # DS002
    add("s7", "b1", "tool_call", 62, workflow_state="paused")  # DS112
    lines.append(b'{"session_id": "s7",')  # DS000
    return lines


def test_the_ideal_loop_finds_what_replay_with_every_pack_finds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The ceiling loop does each rule's work: on a log where each finds something, it counts what replay reports."""
    from bench.limits import all_packs_ideal
    from processor import cli

    log = tmp_path / "every-rule.jsonl"
    log.write_bytes(b"".join(line + b"\n" for line in _every_rule_once()))
    cli.main(["replay", "--format", "json", str(log)])
    report = orjson.loads(capsys.readouterr().out)
    rules = {v["rule"] for v in report["violations"]}
    assert {"DS000", "DS001", "DS002", "DS009", "DS101", "DS102", "DS104", "DS105", "DS107", "DS108", "DS109",
            "DS111", "DS112"} <= rules  # fmt: skip
    assert all_packs_ideal(str(log)) == (len(_every_rule_once()), len(report["violations"]))


def test_the_ideal_loops_lists_are_the_packs_own() -> None:
    """The ideal loop holds the packs' lists inline (loading the rules would be measured with it)."""
    from bench import limits

    lists = load_rules([]).lists
    inline = {"wait_states": limits._WAIT_STATES, "unfinished_states": limits._UNFINISHED,
              "escalation_kinds": limits._ESCALATION, "statuses": limits._STATUSES,
              "approval_decisions": limits._DECISIONS, "on_failure_values": limits._ON_FAILURE,
              "workflow_states": limits._WORKFLOW, "side_effecting": limits._SIDE_EFFECTING,
              "nondeterministic": limits._NONDETERMINISTIC}  # fmt: skip
    for name, held in inline.items():
        assert frozenset(lists[name]) == held, name


def test_the_hand_off_reads_back_what_conversion_gave_and_measures_both_sides(tmp_path: Path) -> None:
    """bench_handoff converts the dump's requests, writes and reads their items back, and refuses
    to measure a hand-off that would not give the evaluator the same items."""
    from bench.bench_handoff import measure
    from processor import records

    dump = tmp_path / "dump.bin"
    write_otlp_stream(dump, 1_024, 10, seed=5)
    result = measure(dump, requests=2, runs=1)
    # It names the build it measured: the one this process imports (CI runs the suite on both).
    assert result["build"] == ("source" if str(records.__file__).endswith(".py") else "compiled")
    assert result["requests"] == 2 and result["spans"] == 1_024
    assert 0 < result["items"] <= 1_024
    assert result["convert_us"] > 0 and result["load_us"] > 0 and result["dump_us"] > 0
    assert result["bytes_per_item"] > 50  # a record's fields, not an empty shell
    assert result["saved_share"] == round(1 - result["load_us"] / result["convert_us"], 3)


def test_serves_threads_are_read_by_their_own_cpu_time() -> None:
    """A live step's ``serve_thread_cores``: each thread's own CPU seconds, the busiest first."""
    import os
    import threading
    import time

    from bench.live import busy_thread_cores, thread_cpu_s

    before = thread_cpu_s(os.getpid())
    started = time.monotonic()
    spent = [0.0]
    spinner: list[int] = []
    stop = threading.Event()

    def spin() -> None:
        spinner.append(threading.get_native_id())
        while not stop.is_set() and time.thread_time() < 5.0:  # bounded by its own CPU time
            sum(range(1_000))
            spent[0] = time.thread_time()

    busy = threading.Thread(target=spin)
    busy.start()
    deadline = time.monotonic() + 30
    while spent[0] < 0.3 and time.monotonic() < deadline:
        time.sleep(0.01)
    after = thread_cpu_s(os.getpid())  # read while the spinner still runs: an ended thread is gone
    wall_s = time.monotonic() - started
    stop.set()
    busy.join()
    assert after[spinner[0]] >= 0.25  # at least what it counted itself, to the clock's tick
    cores = busy_thread_cores(before, after, wall_s)
    assert cores[0] == round((after[spinner[0]] - before.get(spinner[0], 0.0)) / wall_s, 3)
    assert cores == sorted(cores, reverse=True) and all(c > 0.01 for c in cores)
    # A thread below a hundredth of a core is left out; no time elapsed, nothing to say.
    assert busy_thread_cores({1: 0.0, 2: 0.0}, {1: 0.5, 2: 0.001}, 1.0) == [0.5]
    assert busy_thread_cores(before, after, 0.0) == []


def test_the_wide_dump_tells_the_same_story_with_more_attributes(tmp_path: Path) -> None:
    """The second OTLP dump adds attributes no profile reads: the same actions come out of both."""
    from bench.generate import extra_attributes, read_otlp_stream
    from processor.convert import SpanConverter

    narrow, wide = tmp_path / "n.bin", tmp_path / "w.bin"
    narrow_stats = write_otlp_stream(narrow, 1_200, 10)
    wide_stats = write_otlp_stream(wide, 1_200, 10, extra=30)
    assert wide_stats.attributes == narrow_stats.attributes + 30 * wide_stats.spans
    converter = SpanConverter()
    assert not [key for key, _ in extra_attributes(30) if converter.reads_attribute(key)]

    def records(path: Path) -> list[object]:
        out: list[object] = []
        for payload in read_otlp_stream(path):
            out += [action.record for action in converter.convert_serialized(payload, "dump").actions]
        return out

    assert records(wide) == records(narrow)
    assert len(records(wide)) == wide_stats.actions


def test_a_live_step_starts_serve_again_when_a_port_chosen_for_it_was_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench import live

    dump = tmp_path / "dump.bin"
    write_otlp_stream(dump, 1_024, 10, seed=5)
    # Another process listens on the gRPC port the first start is given: serve says it cannot
    # listen and stops; the step starts it again on other ports instead of failing.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        real = live.free_ports
        chosen: list[list[int]] = []

        def ports(count: int) -> list[int]:
            got = real(count)
            if not chosen:
                got[0] = taken.getsockname()[1]
            chosen.append(got)
            return got

        monkeypatch.setattr(live, "free_ports", ports)
        result = live.run_step(dump, 1_000.0, 1.0)
    assert len(chosen) == 2
    assert result.ok_spans == result.sent_spans == 1_024
    assert result.evaluated_spans == 1_024


def test_a_live_step_keeps_serves_state_in_a_database_of_its_own(tmp_path: Path, pg_server: str) -> None:
    import psycopg

    from bench import live

    dump = tmp_path / "dump.bin"
    write_otlp_stream(dump, 1_024, 10, seed=5)
    result = live.run_step(dump, 1_000.0, 1.0, postgres_dsn=pg_server)
    assert result.state_backend == "postgres"
    assert result.ok_spans == result.sent_spans == result.evaluated_spans == 1_024
    assert result.expected_violations > 0
    assert result.found_violations == result.expected_violations
    # The step's database was dropped; nothing of it is left on the server.
    with psycopg.connect(pg_server) as conn:
        names = [row[0] for row in conn.execute("SELECT datname FROM pg_database")]
    assert not [name for name in names if name.startswith("durable_check_bench_")]


def test_a_live_step_refuses_postgres_without_a_server(tmp_path: Path) -> None:
    from bench import live

    with pytest.raises(ValueError, match="needs postgres_dsn"):
        live.run_step(tmp_path / "absent.bin", 1_000.0, 1.0, state_backend="postgres")
    with pytest.raises(ValueError, match="not with state_backend 'sqlite'"):
        live.run_step(tmp_path / "absent.bin", 1_000.0, 1.0, state_backend="sqlite", postgres_dsn="postgresql://x")


def test_the_live_section_records_one_postgres_replica_when_given_a_server(tmp_path: Path, pg_server: str) -> None:
    out = tmp_path / "results.json"
    skipped = [arg for name in ("replay_otlp", "replay_actions", "replay_skill", "replay_rss", "memory", "rules")
               for arg in ("--skip", name)]
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--size", "tiny", "--runs", "1", *skipped, "--postgres", pg_server,
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = orjson.loads(out.read_bytes())
    by_key = {row["key"]: row for row in result["rows"]}
    row = by_key["live.sustained.postgres"]
    assert row["target"] == "recorded" and row["met"] is None
    assert row["value"] == 2_000  # the tiny size's one step, sustained
    steps = result["details"]["live_steps_postgres"]
    assert [s["state_backend"] for s in steps] == ["postgres"]
    assert steps[0]["lossless"] and steps[0]["sustained"]
    # The server's address stays out of what the benchmark writes.
    assert pg_server not in out.read_text(encoding="utf-8")
    assert result["command"].endswith("--postgres DSN")
