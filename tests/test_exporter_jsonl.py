"""The JSONL exporter: one line per violation, written once, rotated by size, fsync policy."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from exporters import ExportersConfig, JsonlConfig, JsonlExporter, build_exporters
from processor.configfmt import ByteSize, decode
from processor.convert.actionlog import parse_line
from processor.convert.timefmt import format_rfc3339, parse_rfc3339
from processor.errors import Problem
from processor.records import Action
from processor.telemetry import Telemetry
from tests.servers import make_violation, wait_until


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def counter(telemetry: Telemetry, name: str, exporter: str) -> float:
    value = telemetry.registry.get_sample_value(name, {"exporter": exporter})
    return value or 0.0


def test_one_line_per_violation_with_rfc3339_time(tmp_path: Path) -> None:
    out = tmp_path / "violations.jsonl"
    telemetry = Telemetry()
    exporter = JsonlExporter(JsonlConfig(path=str(out)), telemetry)
    violations = [make_violation(i) for i in range(3)]
    exporter.export(violations)
    # Synchronous: the lines are there when export() returns, before shutdown.
    lines = read_lines(out)
    exporter.shutdown()
    assert [line["violation_id"] for line in lines] == [v.violation_id for v in violations]
    for line, v in zip(lines, violations, strict=True):
        expected = v.to_json()
        expected["time"] = format_rfc3339(v.time_ns or 0)
        assert line == expected
        assert parse_rfc3339(line["time"]) == v.time_ns
    assert counter(telemetry, "durable_check_exporter_sent_total", "jsonl") == 3


def test_violation_without_time_gets_the_export_time(tmp_path: Path) -> None:
    out = tmp_path / "v.jsonl"
    exporter = JsonlExporter(JsonlConfig(path=str(out)), Telemetry())
    exporter.export([make_violation(1, time_ns=None)])
    exporter.shutdown()
    (line,) = read_lines(out)
    assert "time_unix_nano" not in line
    assert parse_rfc3339(line["time"]) is not None


def test_a_violation_is_written_once_within_a_run(tmp_path: Path) -> None:
    out = tmp_path / "v.jsonl"
    exporter = JsonlExporter(JsonlConfig(path=str(out)), Telemetry())
    first = [make_violation(i) for i in range(3)]
    exporter.export(first)
    exporter.export([first[1], make_violation(7), first[1]])
    exporter.shutdown()
    ids = [line["violation_id"] for line in read_lines(out)]
    assert ids == [v.violation_id for v in [*first, make_violation(7)]]


def test_a_restart_does_not_write_a_violation_twice(tmp_path: Path) -> None:
    out = tmp_path / "v.jsonl"
    # Small files so that the earlier ids sit in rotated copies too.
    cfg = JsonlConfig(path=str(out), rotate_max_size=ByteSize(1200), rotate_keep=20)
    first_run = [make_violation(i) for i in range(10)]
    exporter = JsonlExporter(cfg, Telemetry())
    exporter.export(first_run)
    exporter.shutdown()
    assert out.with_name("v.jsonl.1").exists(), "the first run should have rotated"

    # The same input evaluated again after a restart, plus one new violation.
    exporter = JsonlExporter(cfg, Telemetry())
    exporter.export([*first_run, make_violation(10)])
    exporter.shutdown()
    files = [out.with_name(f"v.jsonl.{i}") for i in range(20, 0, -1)] + [out]
    ids = [line["violation_id"] for f in files if f.exists() for line in read_lines(f)]
    assert ids == [v.violation_id for v in [*first_run, make_violation(10)]]


def test_the_memory_of_written_ids_is_bounded(tmp_path: Path) -> None:
    out = tmp_path / "v.jsonl"
    cfg = JsonlConfig(path=str(out), dedupe_ids=3)
    exporter = JsonlExporter(cfg, Telemetry())
    exporter.export([make_violation(i) for i in range(5)])
    assert exporter.written_count() == 3
    exporter.shutdown()
    # After a restart the newest three are known; the two oldest are written again.
    exporter = JsonlExporter(cfg, Telemetry())
    assert [exporter.has_written(make_violation(i).violation_id) for i in range(5)] == [False, False, True, True, True]
    exporter.export([make_violation(i) for i in range(5)])
    exporter.shutdown()
    assert len(read_lines(out)) == 7


def test_a_restart_reads_back_only_as_far_as_the_ids_it_keeps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from exporters import jsonl

    out = tmp_path / "v.jsonl"
    cfg = JsonlConfig(path=str(out), rotate_max_size=ByteSize(1200), rotate_keep=20, dedupe_ids=4)
    exporter = JsonlExporter(cfg, Telemetry())
    for i in range(12):
        exporter.export([make_violation(i)])
    exporter.shutdown()
    files = [out, *sorted(out.parent.glob("v.jsonl.*"), key=lambda p: int(p.suffix[1:]))]
    per_file = [[line["violation_id"] for line in read_lines(f)] for f in files]  # newest file first
    assert len(files) >= 4 and all(per_file)
    read: list[str] = []
    real = jsonl._iter_violation_ids

    def reading(path: Path) -> Any:
        read.append(path.name)
        return real(path)

    monkeypatch.setattr(jsonl, "_iter_violation_ids", reading)
    again = JsonlExporter(cfg, Telemetry())
    # The newest four ids are known, the older ones not; and no file older than those four was read.
    assert [again.has_written(make_violation(i).violation_id) for i in range(12)] == [False] * 8 + [True] * 4
    needed = next(n for n in range(1, len(files) + 1) if sum(len(ids) for ids in per_file[:n]) >= 4)
    assert read == [f.name for f in files[:needed]] and needed < len(files)
    again.shutdown()


def test_a_torn_last_line_is_cut_and_its_violation_written_again(tmp_path: Path) -> None:
    out = tmp_path / "v.jsonl"
    whole = json.dumps(make_violation(0).to_json()) + "\n"
    torn = json.dumps(make_violation(1).to_json())[:40]
    out.write_text(whole + torn)
    exporter = JsonlExporter(JsonlConfig(path=str(out)), Telemetry())
    exporter.export([make_violation(0), make_violation(1)])
    exporter.shutdown()
    ids = [line["violation_id"] for line in read_lines(out)]
    assert ids == [make_violation(0).violation_id, make_violation(1).violation_id]


def test_rotation_keeps_whole_lines_and_at_most_keep_files(tmp_path: Path) -> None:
    out = tmp_path / "v.jsonl"
    max_size = 1500
    exporter = JsonlExporter(JsonlConfig(path=str(out), rotate_max_size=ByteSize(max_size), rotate_keep=2),
                             Telemetry())
    violations = [make_violation(i) for i in range(40)]
    for v in violations:
        exporter.export([v])
    exporter.shutdown()
    rotated = [out.with_name("v.jsonl.2"), out.with_name("v.jsonl.1"), out]
    assert all(p.exists() for p in rotated)
    assert not out.with_name("v.jsonl.3").exists()
    kept: list[str] = []
    for p in rotated:
        assert 0 < p.stat().st_size <= max_size
        kept += [line["violation_id"] for line in read_lines(p)]
    # The newest lines are kept, in order, without gaps.
    all_ids = [v.violation_id for v in violations]
    assert kept == all_ids[len(all_ids) - len(kept):]
    assert len(kept) < len(all_ids)


def test_rotate_keep_zero_starts_a_fresh_file(tmp_path: Path) -> None:
    out = tmp_path / "v.jsonl"
    exporter = JsonlExporter(JsonlConfig(path=str(out), rotate_max_size=ByteSize(600), rotate_keep=0), Telemetry())
    for i in range(10):
        exporter.export([make_violation(i)])
    exporter.shutdown()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.jsonl"]
    assert read_lines(out)[-1]["violation_id"] == make_violation(9).violation_id


@pytest.mark.parametrize(("mode", "expected"), [("always", 6), ("batch", 2), ("never", 0)])
def test_fsync_policy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, expected: int) -> None:
    out = tmp_path / "v.jsonl"
    exporter = JsonlExporter(JsonlConfig(path=str(out), fsync=mode), Telemetry())  # type: ignore[arg-type]
    calls: list[int] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        calls.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    exporter.export([make_violation(i) for i in range(3)])   # always: 3, batch: 1
    exporter.export([make_violation(i) for i in range(3, 6)])  # always: 3, batch: 1
    assert len(calls) == expected
    monkeypatch.setattr(os, "fsync", real_fsync)
    exporter.shutdown()
    assert len(read_lines(out)) == 6


def test_action_records_in_the_skills_format(tmp_path: Path) -> None:
    out, actions_out = tmp_path / "v.jsonl", tmp_path / "actions.jsonl"
    exporter = JsonlExporter(JsonlConfig(path=str(out), actions=True, actions_path=str(actions_out)), Telemetry())
    records: list[dict[str, Any]] = [
        {"session_id": "s-1", "action_id": "a01", "kind": "user_prompt", "status": "ok", "result": None},
        {"session_id": "s-1", "action_id": "a02", "kind": "payment", "status": "ok", "idempotency_key": "pay-1"},
    ]
    exporter.export_actions([Action(record=r, source="span", origin="otlp") for r in records])
    exporter.shutdown()
    parsed = [parse_line(line, "actions.jsonl", n) for n, line in enumerate(actions_out.read_bytes().splitlines(), 1)]
    assert [p.record for p in parsed if isinstance(p, Action)] == records
    assert not out.exists() or out.read_text() == ""


def test_actions_are_not_written_unless_asked(tmp_path: Path) -> None:
    exporter = JsonlExporter(JsonlConfig(path=str(tmp_path / "v.jsonl")), Telemetry())
    exporter.export_actions([Action(record={"session_id": "s", "action_id": "a", "kind": "k", "status": "ok"},
                                    source="log")])
    exporter.shutdown()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_failed_write_is_kept_and_retried_never_raised(tmp_path: Path) -> None:
    out = tmp_path / "v.jsonl"
    exporter = JsonlExporter(JsonlConfig(path=str(out)), Telemetry())
    telemetry = exporter._telemetry
    # The file's place is taken by a directory: every open fails with a real OSError.
    out.mkdir()
    exporter.export([make_violation(0), make_violation(1)])
    exporter.export([make_violation(2)])  # queued behind the earlier ones, order kept
    assert counter(telemetry, "durable_check_exporter_failures_total", "jsonl") >= 1
    assert exporter._queue.depth == 3
    out.rmdir()
    wait_until(lambda: exporter._queue.depth == 0, timeout_s=10, what="the retry to write")
    exporter.shutdown()
    assert [line["violation_id"] for line in read_lines(out)] == [make_violation(i).violation_id for i in range(3)]
    assert counter(telemetry, "durable_check_exporter_dropped_total", "jsonl") == 0


def test_lines_written_before_a_failed_rotation_are_not_written_again(tmp_path: Path) -> None:
    out = tmp_path / "v.jsonl"
    line_size = len(json.dumps(make_violation(0).to_json())) + 60
    exporter = JsonlExporter(JsonlConfig(path=str(out), rotate_max_size=ByteSize(line_size * 3 // 2),
                                         rotate_keep=1), Telemetry())
    # Rotation cannot move the file onto a non-empty directory: it fails after the first line.
    blocker = out.with_name("v.jsonl.1")
    blocker.mkdir()
    (blocker / "keep").write_text("x")
    exporter.export([make_violation(0), make_violation(1)])
    assert [line["violation_id"] for line in read_lines(out)] == [make_violation(0).violation_id]
    assert exporter._queue.depth == 2
    shutil.rmtree(blocker)
    wait_until(lambda: exporter._queue.depth == 0, timeout_s=10, what="the retried rotation")
    exporter.shutdown()
    assert [line["violation_id"] for line in read_lines(blocker)] == [make_violation(0).violation_id]
    assert [line["violation_id"] for line in read_lines(out)] == [make_violation(1).violation_id]


def test_disk_full_is_counted_not_raised(tmp_path: Path) -> None:
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    telemetry = Telemetry()
    exporter = JsonlExporter(JsonlConfig(path="/dev/full", fsync="never", max_attempts=1), telemetry)
    exporter.export([make_violation(0)])
    assert counter(telemetry, "durable_check_exporter_failures_total", "jsonl") >= 1
    exporter.shutdown(timeout_s=1.0)
    assert counter(telemetry, "durable_check_exporter_dropped_total", "jsonl") == 1


def test_config_defaults_and_problems(tmp_path: Path) -> None:
    problems: list[Problem] = []
    cfg = decode(ExportersConfig, {}, "exporters", problems)
    assert problems == []
    assert build_exporters(cfg, Telemetry()) == []  # every exporter is off without its key
    assert cfg.jsonl.fsync == "batch" and cfg.jsonl.rotate_max_size == 64 * 1024 * 1024

    raw = {
        "jsonl": {"path": str(tmp_path / "v.jsonl"), "fsync": "sometimes", "actions": True, "rotate_keep": -1},
        "otlp": {"endpoint": "collector", "protocol": "grpc", "headers": {"bad header": "x"}},
        "alertmanager": {"url": "alertmanager:9093", "trace_url_template": "https://t/{trace}"},
        "webhook": {"url": "https://hooks.example/x", "max_backoff": "10ms", "timeout": "soon"},
        "prometheus": {"endpoint": "0.0.0.0:99999"},
    }
    problems = []
    decode(ExportersConfig, raw, "exporters", problems)
    where = {p.where for p in problems}
    assert {
        "exporters.jsonl.fsync",
        "exporters.jsonl.actions_path",
        "exporters.jsonl.rotate_keep",
        "exporters.otlp.endpoint",
        "exporters.otlp.headers.bad header",
        "exporters.alertmanager.url",
        "exporters.alertmanager.trace_url_template",
        "exporters.webhook.max_backoff",
        "exporters.webhook.timeout",
        "exporters.prometheus.endpoint",
    } <= where, problems


def test_build_exporters_starts_each_configured_exporter(tmp_path: Path) -> None:
    from exporters import Exporter
    from tests.servers import HttpRecorder, OtlpGrpcReceiver

    receiver, recorder = OtlpGrpcReceiver(), HttpRecorder()
    raw = {
        "jsonl": {"path": str(tmp_path / "v.jsonl"), "actions": True, "actions_path": str(tmp_path / "a.jsonl")},
        "otlp": {"endpoint": receiver.endpoint, "insecure": True},
        "prometheus": {"endpoint": "127.0.0.1:0"},
        "otlp_metrics": {"endpoint": receiver.endpoint, "insecure": True, "interval": "1h"},
        "alertmanager": {"url": recorder.url, "resend_interval": "1m"},
        "webhook": {"url": recorder.url + "/hook"},
    }
    problems: list[Problem] = []
    cfg = decode(ExportersConfig, raw, "exporters", problems)
    assert problems == []
    exporters = build_exporters(cfg, Telemetry())
    try:
        assert [e.name for e in exporters] == ["jsonl", "otlp", "prometheus", "otlp_metrics", "alertmanager",
                                               "webhook"]
        assert all(isinstance(e, Exporter) for e in exporters)
        assert [e.name for e in exporters if e.wants_actions] == ["jsonl"]
        for e in exporters:
            e.export([make_violation(1)])
    finally:
        for e in exporters:
            e.shutdown(2.0)
        receiver.stop()
        recorder.stop()
    assert len(read_lines(tmp_path / "v.jsonl")) == 1
    assert len(receiver.spans()) == 1
    assert {r.path for r in recorder.snapshot()} == {"/api/v2/alerts", "/hook"}


def test_delivery_is_confirmed_once_written_and_a_failed_write_only_after_its_retry(tmp_path: Path) -> None:
    out = tmp_path / "v.jsonl"
    exporter = JsonlExporter(JsonlConfig(path=str(out)), Telemetry())
    confirmed: list[list[str]] = []
    exporter.add_delivery_listener(lambda ids: confirmed.append(list(ids)))
    first, second = make_violation(0), make_violation(1)
    exporter.export([first])
    assert confirmed == [[first.violation_id]]
    assert [line["violation_id"] for line in read_lines(out)] == [first.violation_id]
    # Written before: not written again, but confirmed (the outbox hands over what it did not see confirmed).
    exporter.export([first])
    assert confirmed[-1] == [first.violation_id]
    assert len(read_lines(out)) == 1
    exporter.shutdown()
    blocked = tmp_path / "blocked.jsonl"
    blocked.mkdir()  # the file's place is taken by a directory: every write fails
    failing = JsonlExporter(JsonlConfig(path=str(blocked)), Telemetry())
    confirmed.clear()
    failing.add_delivery_listener(lambda ids: confirmed.append(list(ids)))
    failing.export([second])
    assert confirmed == [], "a failed write is not a delivery"
    blocked.rmdir()
    wait_until(lambda: confirmed, timeout_s=10, what="the retried write to be confirmed")
    assert confirmed == [[second.violation_id]]
    failing.shutdown()
    assert [line["violation_id"] for line in read_lines(blocked)] == [second.violation_id]
