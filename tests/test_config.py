"""The serve configuration: defaults, every problem with its path, environment references, --check."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from processor import cli
from processor.config import (
    DEFAULT_CONFIG_YAML,
    SQLITE_STATE_AVAILABLE,
    Config,
    load_config,
    parse_config,
)
from processor.convert.options import ToolKindRule
from processor.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "testdata" / "config"
BAD = sorted(p for p in (DATA / "bad").glob("*.yaml") if p.with_suffix(".expected").exists())


def test_default_is_loopback_with_data_under_one_directory() -> None:
    config = load_config(None)
    assert config.receivers.otlp.grpc.endpoint == "127.0.0.1:4317"
    assert config.receivers.otlp.http.endpoint == "127.0.0.1:4318"
    assert config.receivers.otlp.grpc.max_recv_msg_size == 16 * 1024 * 1024
    assert config.state.path == "./durable-check-data/state.db"
    assert config.exporters.jsonl.path == "./durable-check-data/violations.jsonl"
    assert config.evaluate.allowed_lateness == 5.0
    assert config.evaluate.session_idle_timeout == 7 * 86400.0
    assert config.evaluate.tick_interval == 1.0
    assert not config.forward.enabled


def test_the_shipped_local_example_spells_out_the_defaults() -> None:
    # config/local.yaml documents the defaults; if one changes, the other must follow.
    assert load_config(str(ROOT / "config" / "local.yaml")) == load_config(None)


def test_full_file_decodes_every_section() -> None:
    config = load_config(str(DATA / "good" / "full.yaml"), environ={"DC_TEST_TOKEN": "s3cret"})
    grpc = config.receivers.otlp.grpc
    assert grpc.endpoint == "0.0.0.0:14317"
    assert grpc.max_recv_msg_size == 4 * 1024 * 1024
    assert grpc.auth.bearer_token == "s3cret"
    assert config.receivers.otlp.http.endpoint == "[::1]:14318"
    assert config.receivers.otlp.http.max_request_body_size == 512 * 1024
    assert (config.queue.max_requests, config.queue.max_spans, config.queue.retry_after) == (8, 4096, 0.25)
    assert config.convert.genai is False
    assert config.convert.telemetry_is_log is True
    assert tuple(config.convert.tool_kinds) == (
        ToolKindRule("charge_*", "payment"),
        ToolKindRule("lookup_*", "external_read"),
    )
    assert config.evaluate.strict is True
    assert config.evaluate.session_idle_timeout == 5400.0
    assert config.evaluate.tick_interval == 0.25
    assert config.forward.protocol == "http"
    # ${env:VAR:-default} falls back when the variable is unset.
    assert config.forward.headers == {"x-team": "agents"}
    assert config.telemetry.logs.level == "debug"


def test_minimal_file_keeps_defaults_elsewhere() -> None:
    config = load_config(str(DATA / "good" / "minimal.yaml"))
    assert config.receivers.otlp.http.endpoint == ""
    assert config.receivers.otlp.grpc == Config().receivers.otlp.grpc


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_bad_file_reports_every_problem_with_its_path(path: Path) -> None:
    expected = set(path.with_suffix(".expected").read_text(encoding="utf-8").splitlines())
    with pytest.raises(ConfigError) as caught:
        load_config(str(path), environ={})
    problems = caught.value.problems
    assert {f"{p.where}: {p.message}" for p in problems} == expected
    # Each is also placed in the file: at its key, or the nearest key above it that is written there.
    lines = path.read_text(encoding="utf-8").splitlines()
    for problem in problems:
        file, line, col = problem.at.rsplit(":", 2)
        assert file == str(path) and 1 <= int(line) <= len(lines) and int(col) >= 1, problem
        assert str(problem).startswith(f"{problem.at}: {problem.where}: ")


def test_config_problems_name_file_line_and_column_of_their_key() -> None:
    text = ("receivers:\n  otlp:\n    grpc:\n      max_recv_msg_size: 10\n"
            "evaluate:\n  rules:\n    - ''\n  tick_interval: 1ms\n"
            "exporters:\n  jsonl:\n    bogus: 1\n")
    with pytest.raises(ConfigError) as caught:
        parse_config(text, "c.yaml")
    assert sorted(str(p) for p in caught.value.problems) == sorted([
        "c.yaml:4:7: receivers.otlp.grpc.max_recv_msg_size: must be at least 1KiB",
        "c.yaml:7:7: evaluate.rules[0]: empty path",
        "c.yaml:8:3: evaluate.tick_interval: must be at least 10ms",
        "c.yaml:11:5: exporters.jsonl.bogus: unknown key; allowed: actions, actions_path, dedupe_ids, fsync, "
        "max_attempts, max_queue, path, rotate_hold_max_size, rotate_keep, rotate_max_size",
    ])


def test_yaml_syntax_error_names_file_line_and_column() -> None:
    path = DATA / "bad" / "syntax.yaml"
    with pytest.raises(ConfigError) as caught:
        load_config(str(path))
    (problem,) = caught.value.problems
    assert problem.where == f"{path}:4:5"
    assert problem.message.startswith("invalid YAML:")


def test_missing_file_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config("/nonexistent/durable-check.yaml")
    assert str(caught.value.problems[0]) == "/nonexistent/durable-check.yaml: no such file"


def test_top_level_must_be_a_mapping() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config("- a\n- b\n", "list.yaml")
    assert str(caught.value.problems[0]) == "list.yaml: the configuration must be a mapping of sections"


def test_environment_reference_is_substituted() -> None:
    config = parse_config(
        "receivers: {otlp: {grpc: {endpoint: '${env:DC_HOST}:${env:DC_PORT}'}}}\n", "env.yaml",
        environ={"DC_HOST": "127.0.0.1", "DC_PORT": "5317"},
    )
    assert config.receivers.otlp.grpc.endpoint == "127.0.0.1:5317"


def test_empty_file_is_the_defaults_without_exporters() -> None:
    config = parse_config("", "empty.yaml")
    # The embedded default also turns the operator view on; an empty file leaves it off.
    assert config == dataclasses.replace(load_config(None), exporters=Config().exporters, ui=Config().ui)


def test_tls_files_that_exist_are_accepted(tmp_path: Path) -> None:
    for name in ("cert.pem", "key.pem", "ca.pem"):
        (tmp_path / name).write_text("placeholder", encoding="utf-8")
    config = parse_config(
        f"receivers: {{otlp: {{grpc: {{tls: {{cert_file: {tmp_path}/cert.pem, key_file: {tmp_path}/key.pem, "
        f"client_ca_file: {tmp_path}/ca.pem}}}}}}}}\n",
        "tls.yaml",
    )
    assert config.receivers.otlp.grpc.tls.enabled


def test_sqlite_backend_depends_on_the_build() -> None:
    text = "state: {backend: sqlite}\n"
    if SQLITE_STATE_AVAILABLE:
        assert parse_config(text, "s.yaml").state.backend == "sqlite"
    else:
        with pytest.raises(ConfigError) as caught:
            parse_config(text, "s.yaml")
        assert [str(p) for p in caught.value.problems] == [
            "s.yaml:1:9: state.backend: 'sqlite' is not available in this build; use 'memory'"
        ]


def test_default_yaml_is_valid_on_its_own() -> None:
    assert parse_config(DEFAULT_CONFIG_YAML, "default") == load_config(None)


def test_check_flag_exits_0_on_a_good_file_and_2_on_a_bad_one(capsys: pytest.CaptureFixture[str]) -> None:
    good = str(DATA / "good" / "minimal.yaml")
    assert cli.main(["serve", "--config", good, "--check"]) == 0
    assert "is valid" in capsys.readouterr().out
    bad = str(DATA / "bad" / "forward.yaml")
    assert cli.main(["serve", "--config", bad, "--check"]) == 2
    err = capsys.readouterr().err
    assert "forward.max_attempts: must be at least 1" in err
    assert "Traceback" not in err


def test_forward_grpc_endpoint_may_be_a_url() -> None:
    for endpoint in ("collector.internal:4317", "http://collector.internal:4317", "https://collector.internal:4317/"):
        assert parse_config(f"forward: {{endpoint: '{endpoint}'}}\n", "f.yaml").forward.endpoint == endpoint
    with pytest.raises(ConfigError) as caught:
        parse_config("forward: {endpoint: 'https://collector.internal'}\n", "f.yaml")
    assert [str(p) for p in caught.value.problems] == [
        "f.yaml:1:11: forward.endpoint: must be host:port, got 'collector.internal'"
    ]


@pytest.mark.parametrize(
    ("text", "where", "message"),
    [
        ("a: &x [1, 2]\nb: *x\n", ":2:4", "YAML aliases are not allowed in a configuration"),
        ("evaluate:\n  strict: false\n  strict: true\n", ":3:3", "key 'strict' is given twice (first at line 2)"),
    ],
)
def test_configuration_yaml_is_strict(text: str, where: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(text, "cfg.yaml")
    [problem] = info.value.problems
    assert problem.where == "cfg.yaml" + where
    assert message in problem.message


def test_yes_is_not_a_boolean_and_durations_are_bounded() -> None:
    text = "evaluate:\n  strict: yes\n  allowed_lateness: .inf\n  session_idle_timeout: 100000w\n"
    with pytest.raises(ConfigError) as info:
        parse_config(text, "cfg.yaml")
    assert [str(p) for p in info.value.problems] == [
        "cfg.yaml:2:3: evaluate.strict: must be true or false, got a string",
        "cfg.yaml:3:3: evaluate.allowed_lateness: must be a duration from 0 to 3660d",
        "cfg.yaml:4:3: evaluate.session_idle_timeout: must be a duration from 0 to 3660d",
    ]


def test_durations_name_their_units_largest_first_each_once() -> None:
    config = parse_config("evaluate:\n  allowed_lateness: 1m30s500ms\n  session_idle_timeout: 90\n", "cfg.yaml")
    assert (config.evaluate.allowed_lateness, config.evaluate.session_idle_timeout) == (90.5, 90.0)
    with pytest.raises(ConfigError) as info:
        parse_config("evaluate:\n  allowed_lateness: 30s1m\n  session_idle_timeout: 1h1h\n", "cfg.yaml")
    order = "(units go from largest to smallest, each once; e.g. 1h30m)"
    assert [str(p) for p in info.value.problems] == [
        f"cfg.yaml:2:3: evaluate.allowed_lateness: not a duration: '30s1m' {order}",
        f"cfg.yaml:3:3: evaluate.session_idle_timeout: not a duration: '1h1h' {order}",
    ]


def test_replay_reads_only_convert_and_evaluate_of_a_serve_configuration(tmp_path: Path) -> None:
    text = (
        "state:\n  backend: postgres\n  postgres:\n    dsn: ${env:DSN_NOT_SET_ANYWHERE}\n"
        "evaluate:\n  strict: true\n  allowed_lateness: 2s\n"
    )
    with pytest.raises(ConfigError):
        parse_config(text, "serve.yaml", environ={})
    config = parse_config(text, "serve.yaml", environ={}, sections=("convert", "evaluate"))
    assert config.evaluate.strict is True and config.evaluate.allowed_lateness == 2.0
    # A misspelt section is still a mistake worth naming.
    with pytest.raises(ConfigError) as info:
        parse_config("evalute:\n  strict: true\n", "serve.yaml", environ={}, sections=("convert", "evaluate"))
    assert [p.where for p in info.value.problems] == ["evalute"]
    # And replay itself accepts the file.
    path = tmp_path / "serve.yaml"
    path.write_text(text, encoding="utf-8")
    log = Path(__file__).parent / "testdata" / "skill-fixtures" / "actions.good.jsonl"
    assert cli.main(["replay", "--config", str(path), str(log)]) == 0
