"""JSONL rotation keeps the copies whose violations another exporter has not delivered yet.

A real webhook exporter points at a loopback port nobody listens on (every attempt is
refused), so its deliveries stay pending while the JSONL file rotates; then a receiver
comes up on that port and the held copies go at the next rotation.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from exporters import build_exporters
from exporters.base import Exporter
from exporters.config import ExportersConfig, JsonlConfig, WebhookConfig
from exporters.jsonl import JsonlExporter
from exporters.webhook import WebhookExporter
from processor.configfmt import ByteSize, Duration
from processor.telemetry import Telemetry
from tests.serve_support import make_request, read_jsonl, running, serve_config, wait_for
from tests.servers import HttpRecorder, free_port, make_violation

FILE_SIZE = 4096


def _exporters(tmp_path: Path, port: int, telemetry: Telemetry, **jsonl: Any) -> tuple[JsonlExporter, WebhookExporter]:
    cfg = ExportersConfig(
        jsonl=JsonlConfig(path=str(tmp_path / "v.jsonl"), rotate_max_size=ByteSize(FILE_SIZE), rotate_keep=1,
                          fsync="never", **jsonl),
        webhook=WebhookConfig(url=f"http://127.0.0.1:{port}/hook", max_attempts=10_000, batch_size=50,
                              initial_backoff=Duration(0.1), max_backoff=Duration(0.3), timeout=Duration(2.0)),
    )
    built: list[Exporter] = build_exporters(cfg, telemetry)
    jsonl_exporter, webhook = built
    assert isinstance(jsonl_exporter, JsonlExporter) and isinstance(webhook, WebhookExporter)
    return jsonl_exporter, webhook


def _export(exporters: tuple[JsonlExporter, WebhookExporter], first: int, count: int) -> None:
    """As the pipeline does: every batch to every exporter."""
    for n in range(first, first + count):
        for exporter in exporters:
            exporter.export([make_violation(n)])


def _files(tmp_path: Path, name: str = "v.jsonl") -> list[Path]:
    return sorted(tmp_path.glob(f"{name}*"))


def _ids_in_files(tmp_path: Path, name: str = "v.jsonl") -> list[str]:
    return [d["violation_id"] for path in _files(tmp_path, name) for d in read_jsonl(path)]


def _rotated_away(telemetry: Telemetry) -> float:
    value: float = telemetry.jsonl_lines_rotated_away.labels("violations")._value.get()
    return value


def test_rotation_keeps_what_a_down_webhook_has_not_received_and_lets_go_once_it_has(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    telemetry = Telemetry()
    port = free_port()  # nothing listens: every delivery is refused and stays queued
    exporters = _exporters(tmp_path, port, telemetry)
    jsonl, webhook = exporters
    caplog.set_level(logging.WARNING, "durable_check.exporters")
    try:
        _export(exporters, 0, 200)
        # 200 lines of ~400 bytes are ~20 files of 4 KiB: rotate_keep 1 alone would keep ~2 of them.
        assert len(_files(tmp_path)) > 10
        assert sorted(_ids_in_files(tmp_path)) == sorted(make_violation(n).violation_id for n in range(200))
        assert _rotated_away(telemetry) == 0
        assert jsonl.held_bytes() > 0
        assert webhook.queue.depth == 200

        recorder = HttpRecorder(port)
        try:
            assert wait_for(lambda: webhook.queue.depth == 0, timeout_s=20), "the webhook delivered its queue"
            _export(exporters, 200, 20)  # the next rotation lets the delivered copies go
            assert wait_for(lambda: webhook.queue.depth == 0, timeout_s=20)
            delivered = {d["violation_id"] for r in recorder.snapshot() for d in r.json()["violations"]}
        finally:
            recorder.stop()
    finally:
        for exporter in exporters:
            exporter.shutdown(1.0)
    assert delivered == {make_violation(n).violation_id for n in range(220)}
    assert jsonl.held_bytes() == 0
    assert [p.name for p in _files(tmp_path)] == ["v.jsonl", "v.jsonl.1"]
    kept = len(_ids_in_files(tmp_path))
    assert kept + _rotated_away(telemetry) == 220  # every line is still there or counted
    said = [r.getMessage() for r in caplog.records if "rotation removed" in r.getMessage()]
    assert said and not any("not yet delivered" in line for line in said)


def test_what_is_held_is_bounded_and_what_goes_past_the_bound_is_counted_and_logged(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    telemetry = Telemetry()
    exporters = _exporters(tmp_path, free_port(), telemetry, rotate_hold_max_size=ByteSize(3 * FILE_SIZE))
    jsonl, webhook = exporters
    caplog.set_level(logging.WARNING, "durable_check.exporters")
    try:
        _export(exporters, 0, 200)
        held = jsonl.held_bytes()
        owed = webhook.queue.depth
    finally:
        for exporter in exporters:
            exporter.shutdown(1.0)
    assert 0 < held <= 3 * FILE_SIZE
    assert owed == 200  # the JSONL copy went at the bound; the webhook still holds every one
    removed = _rotated_away(telemetry)
    assert removed > 0
    assert len(_ids_in_files(tmp_path)) + removed == 200
    said = [r.getMessage() for r in caplog.records if "not yet delivered by another exporter" in r.getMessage()]
    assert said and all("rotate_hold_max_size" in line for line in said)


def test_jsonl_alone_is_the_only_copy_and_rotation_removes_the_oldest(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    telemetry = Telemetry()
    caplog.set_level(logging.INFO, "durable_check.exporters")
    cfg = ExportersConfig(jsonl=JsonlConfig(path=str(tmp_path / "v.jsonl"), rotate_max_size=ByteSize(FILE_SIZE),
                                            rotate_keep=1, fsync="never"))
    (jsonl,) = build_exporters(cfg, telemetry)
    for n in range(200):
        jsonl.export([make_violation(n)])
    jsonl.shutdown(1.0)
    assert [p.name for p in _files(tmp_path)] == ["v.jsonl", "v.jsonl.1"]
    assert len(_ids_in_files(tmp_path)) + _rotated_away(telemetry) == 200
    assert any("the only exporter that delivers violations" in r.getMessage() for r in caplog.records)


def _payments(session: str, count: int) -> list[dict[str, Any]]:
    return [{"durable.session.id": session, "durable.action.id": f"pay-{i}", "durable.action.kind": "payment"}
            for i in range(count)]


def test_durable_serve_holds_what_the_outbox_still_owes_the_webhook_across_a_restart(tmp_path: Path) -> None:
    """The outbox's pending rows decide: held while the webhook is down, kept across a restart
    (read back from the held copies), let go once the resumed webhook confirmed them."""
    port = free_port()
    extra = {
        "state": {"backend": "sqlite", "path": str(tmp_path / "state.db")},
        "exporters": {
            "jsonl": {"rotate_max_size": FILE_SIZE, "rotate_keep": 1, "fsync": "never"},
            "webhook": {"url": f"http://127.0.0.1:{port}/hook", "max_attempts": 10_000, "batch_size": 50,
                        "initial_backoff": "100ms", "max_backoff": "300ms", "timeout": "2s"},
        },
    }
    config = serve_config(tmp_path, extra)
    headers = {"Content-Type": "application/x-protobuf"}

    def post(server: Any, session: str, count: int) -> None:
        body = make_request(*_payments(session, count)).SerializeToString()
        answer = httpx.post(f"http://127.0.0.1:{server.http_port}/v1/traces", content=body, headers=headers)
        assert answer.status_code == 200

    def written(server: Any) -> float:
        value: float = server.telemetry.exporter_sent.labels("jsonl")._value.get()
        return value

    with running(config) as server:
        post(server, "s-first", 60)
        pending = server.telemetry.outbox_pending.labels("webhook")
        assert wait_for(lambda: pending._value.get() >= 60 and written(server) >= 60, timeout_s=20)
    # 60 lines of ~600 bytes, and what the session's end found at shutdown, all still there.
    assert _rotated_away(server.telemetry) == 0
    first_ids = _ids_in_files(tmp_path, "violations.jsonl")
    assert len(first_ids) == written(server) >= 60
    assert len(_files(tmp_path, "violations.jsonl")) > 2  # held past rotate_keep

    recorder = HttpRecorder(port)
    try:
        with running(config) as server:
            # At start the outbox hands its pending rows over again; the webhook, up now, confirms them.
            pending = server.telemetry.outbox_pending.labels("webhook")
            assert wait_for(lambda: len(recorder.snapshot()) > 0 and pending._value.get() == 0, timeout_s=30)
            post(server, "s-second", 30)  # rotates: the held copies of the first run go
            assert wait_for(lambda: written(server) >= 30 and pending._value.get() == 0, timeout_s=20)
            time.sleep(1.1)  # held copies are looked at again at most once a second
            post(server, "s-third", 1)
            assert wait_for(lambda: len(_files(tmp_path, "violations.jsonl")) == 2, timeout_s=20)
            removed = _rotated_away(server.telemetry)
            kept = len(_ids_in_files(tmp_path, "violations.jsonl"))
            total = len(first_ids) + written(server)
    finally:
        recorder.stop()
    delivered = {d["violation_id"] for r in recorder.snapshot() for d in r.json()["violations"]}
    assert set(first_ids) <= delivered
    assert removed > 0
    assert kept + removed == total  # every line is still there or counted
