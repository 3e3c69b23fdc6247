"""Configuration a careless operator could write: shared files, odd paths, an empty token; and what start-up says."""

from __future__ import annotations

import logging
import os
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import yaml

from exporters.config import JsonlConfig
from exporters.jsonl import JsonlExporter
from processor import cli
from processor.config import load_config
from processor.errors import ConfigError
from processor.telemetry import Telemetry
from tests.serve_support import running, serve_config


def _write(tmp_path: Path, document: dict[str, Any]) -> str:
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    return str(path)


def _check(path: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main(["serve", "--config", path, "--check"])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.err


def _outputs(state: str, jsonl: str) -> dict[str, Any]:
    return {"state": {"backend": "sqlite", "path": state}, "exporters": {"jsonl": {"path": jsonl}}}


def test_two_outputs_on_one_file_are_refused_however_the_file_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state.db"
    state.write_bytes(b"")
    (tmp_path / "link.jsonl").symlink_to(state)
    os.link(state, tmp_path / "hard.jsonl")
    (tmp_path / "rules.yaml").write_text("rules: []\n", encoding="utf-8")
    cases = {
        "same name": _outputs(str(state), str(state)),
        "dotted name": _outputs(str(state), str(tmp_path / "sub" / ".." / "state.db")),
        "symbolic link": _outputs(str(state), str(tmp_path / "link.jsonl")),
        "hard link": _outputs(str(state), str(tmp_path / "hard.jsonl")),
        "the SQLite WAL": _outputs(str(state), str(state) + "-wal"),
        "a rotated copy": _outputs(str(tmp_path / "v.jsonl.2"), str(tmp_path / "v.jsonl")),
        "a rule file": {**_outputs(str(state), str(tmp_path / "rules.yaml")),
                        "evaluate": {"rules": [str(tmp_path / "rules.yaml")]}},
    }
    for name, document in cases.items():
        code, err = _check(_write(tmp_path, document), capsys)
        assert code == 2, name
        assert "is the same file as" in err, (name, err)
    # Start-up refuses it the same way, before anything is opened or truncated.
    assert cli.main(["serve", "--config", _write(tmp_path, _outputs(str(state), str(state)))]) == 2
    assert "exporters.jsonl.path" in capsys.readouterr().err


def test_nul_bytes_directories_and_devices_are_caught_with_their_config_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a-file").write_text("x", encoding="utf-8")
    cases = {
        "state.path: contains a NUL byte": _outputs(str(tmp_path / "st\0ate.db"), str(tmp_path / "v.jsonl")),
        "exporters.jsonl.path: contains a NUL byte": _outputs(str(tmp_path / "s.db"), "v\0.jsonl"),
        f"exporters.jsonl.path: {tmp_path} is a directory": _outputs(str(tmp_path / "s.db"), str(tmp_path)),
        "exporters.jsonl.path: /dev/null is a device": _outputs(str(tmp_path / "s.db"), "/dev/null"),
        "state.path: /dev/null is a device": _outputs("/dev/null", str(tmp_path / "v.jsonl")),
        f"state.path: {tmp_path / 'a-file'} is not a directory": _outputs(str(tmp_path / "a-file" / "s.db"),
                                                                        str(tmp_path / "v.jsonl")),
    }
    for expected, document in cases.items():
        code, err = _check(_write(tmp_path, document), capsys)
        assert code == 2, expected
        assert expected in err, (expected, err)
    # A stream the operator reads is still a valid output.
    code, _ = _check(_write(tmp_path, _outputs(str(tmp_path / "s.db"), "/dev/stdout")), capsys)
    assert code == 0


def test_an_empty_bearer_token_from_the_environment_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DC_TEST_EMPTY_TOKEN", "")
    document = {"receivers": {"otlp": {"http": {"auth": {"bearer_token": "${env:DC_TEST_EMPTY_TOKEN}"}}}}}
    code, err = _check(_write(tmp_path, document), capsys)
    assert code == 2
    assert "receivers.otlp.http.auth.bearer_token: is empty" in err
    with pytest.raises(ConfigError):
        load_config(_write(tmp_path, {"receivers": {"otlp": {"grpc": {"auth": {"bearer_token": ""}}}}}))
    # Absent or null: auth is off, knowingly.
    off = load_config(_write(tmp_path, {"receivers": {"otlp": {"grpc": {"auth": {"bearer_token": None}}}}}))
    assert not off.receivers.otlp.grpc.auth.bearer_token


def test_start_up_says_for_each_listener_whether_tls_and_auth_are_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "processor.serve")
    config = serve_config(tmp_path, {"receivers": {"otlp": {"http": {"auth": {"bearer_token": "t0ken"}}}}})
    with running(config):
        pass
    lines = [r.getMessage() for r in caplog.records]
    assert "OTLP/HTTP receiver: TLS off, bearer-token auth on" in lines
    assert "OTLP/gRPC receiver: TLS off, bearer-token auth off" in lines
    assert not any("t0ken" in r.getMessage() for r in caplog.records)


def test_the_jsonl_exporter_never_cuts_a_file_that_is_not_its_own(tmp_path: Path) -> None:
    database = tmp_path / "state.db"
    with sqlite3.connect(database) as db:
        db.execute("CREATE TABLE t (v TEXT)")
        db.executemany("INSERT INTO t VALUES (?)", [("x" * 100,)] * 50)
    db.close()
    before = database.read_bytes()
    assert not before.endswith(b"\n")  # a torn-line repair would cut it
    with pytest.raises(ConfigError) as caught:
        JsonlExporter(JsonlConfig(path=str(database)), Telemetry())
    assert "exporters.jsonl.path" in str(caught.value)
    assert database.read_bytes() == before
    # Its own file with a torn last line is still repaired.
    own = tmp_path / "v.jsonl"
    own.write_bytes(b'{"violation_id": "a"}\n{"viol')
    JsonlExporter(JsonlConfig(path=str(own)), Telemetry()).shutdown(1.0)
    assert own.read_bytes() == b'{"violation_id": "a"}\n'
