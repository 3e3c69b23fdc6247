"""Pack selection (``replay --pack``, ``evaluate.packs``, ``rules list``) and the skill's action-log verdicts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from processor import cli
from processor.config import load_config
from processor.errors import ConfigError, RuleFormatError
from processor.evaluate.rulefmt import load_rules

FIXTURES = Path(__file__).parent / "testdata" / "skill-fixtures"
# The skill's checker on its bad fixture (line, rule), DS008 in strict mode.
SKILL_BAD = [
    (4, "DS001"), (5, "DS001"), (6, "DS002"), (7, "DS003"), (8, "DS004"),
    (9, "DS005"), (10, "DS006"), (10, "DS007"), (12, "DS009"), (13, "DS000"),
]  # fmt: skip


def _replay(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any, str]:
    code = cli.main(["replay", "--format", "json", *argv])
    captured = capsys.readouterr()
    return code, orjson.loads(captured.out) if captured.out else None, captured.err


def _verdicts(report: dict[str, Any]) -> list[tuple[int, str]]:
    return [(v["line"], v["rule"]) for v in report["violations"]]


def _log(tmp_path: Path, *records: dict[str, Any] | bytes) -> str:
    path = tmp_path / "actions.jsonl"
    path.write_bytes(b"".join(r if isinstance(r, bytes) else orjson.dumps(r) + b"\n" for r in records))
    return str(path)


def _rec(session: str, action: str, **fields: Any) -> dict[str, Any]:
    return {"session_id": session, "action_id": action, "kind": "tool_call", "status": "ok", "result": 1, **fields}


def test_the_skill_pack_alone_gives_the_skill_verdicts(capsys: pytest.CaptureFixture[str]) -> None:
    bad = str(FIXTURES / "actions.bad.jsonl")
    code, report, _ = _replay(capsys, "--pack", "durable-sessions", bad)
    assert code == 1 and _verdicts(report) == SKILL_BAD
    code, report, _ = _replay(capsys, "--pack", "durable-sessions", "--strict", bad)
    assert code == 1 and _verdicts(report) == sorted([*SKILL_BAD, (11, "DS008")])
    code, report, _ = _replay(capsys, "--pack", "durable-sessions", str(FIXTURES / "actions.good.jsonl"))
    assert code == 0 and report["violations"] == []


def test_pack_selection_leaves_the_other_packs_rules_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Over a non-retryable cap: the skill says nothing; the project's DS114 speaks unless its pack is left out.
    log = _log(tmp_path, _rec("s1", "a1", retryable=False, max_attempts=2, attempts=5))
    assert _verdicts(_replay(capsys, log)[1]) == [(1, "DS114")]
    assert _verdicts(_replay(capsys, "--pack", "durable-sessions", log)[1]) == []
    assert _verdicts(_replay(capsys, "--pack", "session-checks", log)[1]) == [(1, "DS114")]
    both = _replay(capsys, "--pack", "session-checks", "--pack", "durable-sessions", log)[1]
    assert _verdicts(both) == [(1, "DS114")]


def test_session_checks_alone_still_read_the_skill_pack_lists() -> None:
    ids = [rule.id for rule in load_rules([], packs=["session-checks"]).rules]
    assert ids == [f"DS1{i:02d}" for i in range(1, 13)] + ["DS114"]
    assert "nondeterministic" in load_rules([], packs=["session-checks"]).lists


def test_an_unknown_pack_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _replay(capsys, "--pack", "durable-session", _log(tmp_path, _rec("s", "a")))
    assert code == 2
    assert "no rule pack named 'durable-session' (did you mean durable-sessions?)" in err
    assert "shipped packs: durable-sessions, session-checks" in err
    with pytest.raises(RuleFormatError):
        load_rules([], packs=["nope"])


def test_packs_in_configuration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("evaluate:\n  packs: [durable-sessions]\n", encoding="utf-8")
    log = _log(tmp_path, _rec("s1", "a1", retryable=False, max_attempts=2, attempts=5))
    assert _verdicts(_replay(capsys, "--config", str(config), log)[1]) == []
    # The command line's choice replaces the configuration's.
    assert _verdicts(_replay(capsys, "--config", str(config), "--pack", "session-checks", log)[1]) == [(1, "DS114")]
    config.write_text("evaluate:\n  packs: [durable-sessions, skill]\n", encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_config(str(config))
    assert "evaluate.packs[1]: no rule pack named 'skill'" in str(caught.value)


def test_rules_list_names_each_rules_pack(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["rules", "list"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["DS009"][4] == "durable-sessions" and rows["DS114"][4] == "session-checks"
    assert cli.main(["rules", "list", "--pack", "durable-sessions"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]]
    assert listed == [f"DS00{i}" for i in range(10)]


def test_a_repeated_id_in_a_log_is_a_duplicate_whatever_its_session(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = _log(
        tmp_path,
        _rec("s1", "a1"),
        _rec("s2", "a1", kind="clock"),
        _rec("s3", "a1"),
        {"action_id": "a2", "kind": "clock", "status": "ok"},  # DS000 (no session), yet its id counts
        _rec("s3", "a2"),
        {"session_id": "s3", "action_id": "a2", "kind": "clock", "status": 7},  # DS000 alone, not DS009 too
        b"{not json\n",
        _rec("s4", "a3"),
    )
    code, report, _ = _replay(capsys, "--pack", "durable-sessions", log)
    assert code == 1
    assert _verdicts(report) == [(2, "DS009"), (3, "DS009"), (4, "DS000"), (5, "DS009"), (6, "DS000"), (7, "DS000")]
    messages = [v["message"] for v in report["violations"] if v["rule"] == "DS009"]
    assert messages[0].startswith("action id a1 is used again (first as tool_call, now as clock)")
    assert messages[2].startswith("action id a2 is used again (first on a malformed line, now as tool_call)")


def test_a_repeat_counts_within_one_file_not_across_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = tmp_path / "one.jsonl"
    second = tmp_path / "two.jsonl"
    first.write_bytes(orjson.dumps(_rec("s1", "a1")) + b"\n")
    second.write_bytes(orjson.dumps(_rec("s1", "a1")) + b"\n")
    code, report, _ = _replay(capsys, "--pack", "durable-sessions", str(first), str(second))
    assert code == 0 and report["violations"] == []
