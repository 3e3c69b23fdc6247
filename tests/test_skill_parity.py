"""Differential property test: ``replay --pack durable-sessions`` against a small model of the skill's checker.

The model below is written from the skill's ten checks (DS000-DS009) and the contract's
rule table, independently of the rule pack and the engine: random action logs of the
skill's shape (its field types, wrong types, missing fields, repeated ids across
sessions, lines that are not JSON) must get the same verdicts, line for line, in
default and in strict mode.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from processor import cli

REQUIRED = ("session_id", "action_id", "kind", "status")
NONDETERMINISTIC = {"user_prompt", "llm_call", "external_read", "random", "clock"}
SIDE_EFFECTING = {"write", "payment", "email", "notify", "deploy"}
# The JSON type each optional field must have (null is always accepted).
TYPES: dict[str, str] = {
    "result_ref": "str", "idempotency_key": "str", "replay": "str", "side_effects": "bool",
    "retryable": "bool", "max_attempts": "int", "attempts": "int", "cacheable": "bool",
    "cache_key": "str", "ttl_s": "int", "on_failure": "str", "input_fingerprint": "str",
}  # fmt: skip
_INT64 = 2**63


def _type_ok(value: Any, expected: str) -> bool:
    if value is None:
        return True
    if expected == "bool":
        return type(value) is bool
    if expected == "int":
        return type(value) is int and -_INT64 <= value < _INT64
    return type(value) is str


def _nonempty(record: dict[str, Any], name: str) -> bool:
    value = record.get(name)
    return value is not None and value != ""


def model(lines: list[bytes], *, strict: bool) -> list[tuple[int, str]]:
    """The skill's verdicts on one log: (line, rule), in line order."""
    found: list[tuple[int, str]] = []
    seen: set[str] = set()
    for number, raw in enumerate(lines, start=1):
        text = raw.strip()
        if not text or text.startswith(b"#"):
            continue
        try:
            record = json.loads(text)
        except ValueError:
            found.append((number, "DS000"))
            continue
        if not isinstance(record, dict):
            found.append((number, "DS000"))
            continue
        action_id = record.get("action_id")
        counted = isinstance(action_id, str) and action_id != ""
        well_formed = all(type(record.get(f)) is str and record.get(f) != "" for f in REQUIRED) and all(
            _type_ok(record[f], t) for f, t in TYPES.items() if f in record
        )
        if not well_formed:
            found.append((number, "DS000"))
            if counted:
                seen.add(action_id)
            continue
        if action_id in seen:
            found.append((number, "DS009"))
        seen.add(action_id)
        kind, ok = record["kind"], record["status"] == "ok"
        retryable = record.get("retryable") is True
        cap = record.get("max_attempts")
        finite_cap = type(cap) is int and cap >= 1
        cacheable = record.get("cacheable") is True
        if kind in NONDETERMINISTIC and ok and "result" not in record and not _nonempty(record, "result_ref"):
            found.append((number, "DS001"))
        side_effect = kind in SIDE_EFFECTING or record.get("side_effects") is True
        if side_effect and ok and not _nonempty(record, "idempotency_key") and record.get("replay") != "skip":
            found.append((number, "DS002"))
        if retryable and not finite_cap:
            found.append((number, "DS003"))
        attempts = record.get("attempts")
        if retryable and finite_cap and type(attempts) is int and attempts > cap:
            found.append((number, "DS004"))
        if kind == "user_prompt" and cacheable:
            found.append((number, "DS005"))
        if cacheable and not _nonempty(record, "cache_key"):
            found.append((number, "DS006"))
        ttl = record.get("ttl_s")
        if cacheable and not (type(ttl) is int and ttl > 0):
            found.append((number, "DS007"))
        if strict and record["status"] == "error" and not retryable and not _nonempty(record, "on_failure"):
            found.append((number, "DS008"))
    return sorted(found)


# -- random logs of the skill's shape ------------------------------------------------------------

_wrong = st.sampled_from([[], {}, 1.5, "x", 7, True])
_ids = st.sampled_from(["a1", "a2", "a3", "b1", "b2"])
_small_int = st.integers(min_value=-2, max_value=12)


def _maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(strategy, st.none(), _wrong)


_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "session_id": st.one_of(st.sampled_from(["s1", "s2", ""]), st.none(), st.just(3)),
    "action_id": st.one_of(_ids, st.just(""), st.none(), st.just(9)),
    "kind": st.one_of(
        st.sampled_from(sorted(NONDETERMINISTIC | SIDE_EFFECTING | {"tool_call", "approval", "checkpoint"})),
        st.just(""),
        st.just(4),
    ),
    "status": st.one_of(st.sampled_from(["ok", "error", "OK"]), st.none(), st.just(1)),
    "result": st.one_of(st.none(), st.integers(0, 3), st.text(max_size=3), st.just({"k": 1})),
    "result_ref": _maybe(st.sampled_from(["", "blob://r1"])),
    "idempotency_key": _maybe(st.sampled_from(["", "s1-a1"])),
    "replay": _maybe(st.sampled_from(["skip", "run", ""])),
    "side_effects": _maybe(st.booleans()),
    "retryable": _maybe(st.booleans()),
    "max_attempts": st.one_of(_maybe(_small_int), st.just(2**63), st.just(3.0)),
    "attempts": _maybe(_small_int),
    "cacheable": _maybe(st.booleans()),
    "cache_key": _maybe(st.sampled_from(["", "k1"])),
    "ttl_s": _maybe(st.integers(-5, 100)),
    "on_failure": _maybe(st.sampled_from(["ask_user", "abort", "compensate", ""])),
    "input_fingerprint": _maybe(st.sampled_from(["f1", "f2"])),
    "prompt": st.text(max_size=5),
}
_record = st.fixed_dictionaries(
    {name: _FIELDS[name] for name in REQUIRED},
    optional={name: value for name, value in _FIELDS.items() if name not in REQUIRED},
).flatmap(
    # Drop a required field now and then: absent is not the same as null or empty.
    lambda record: st.sets(st.sampled_from(REQUIRED), max_size=1).map(
        lambda gone: {k: v for k, v in record.items() if k not in gone}
    )
)
_odd_line = st.sampled_from(
    [b"", b"# a comment", b"{not json", b"[1, 2]", b'"text"', b"42", b"null", b'{"session_id": "s1",']
)
_line = st.one_of(_record.map(orjson.dumps), _record.map(orjson.dumps), _record.map(orjson.dumps), _odd_line)
_logs = st.lists(_line, min_size=1, max_size=25)


def _replay(lines: list[bytes], *, strict: bool, capsys: pytest.CaptureFixture[str]) -> tuple[int, Any]:
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "actions.jsonl"
        path.write_bytes(b"".join(line + b"\n" for line in lines))
        mode = ["--strict"] if strict else []
        code = cli.main(["replay", "--pack", "durable-sessions", "--format", "json", *mode, str(path)])
    return code, orjson.loads(capsys.readouterr().out)


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
@settings(max_examples=184, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=_logs)
def test_replay_agrees_with_the_skill_model_line_for_line(
    lines: list[bytes], strict: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = model(lines, strict=strict)
    code, report = _replay(lines, strict=strict, capsys=capsys)
    assert sorted((v["line"], v["rule"]) for v in report["violations"]) == expected
    assert code == (1 if expected else 0)


def test_the_model_gives_the_skill_verdicts_on_its_fixture() -> None:
    """The model is checked against the skill's own bad fixture before it judges anything."""
    fixture = Path(__file__).parent / "testdata" / "skill-fixtures" / "actions.bad.jsonl"
    lines = fixture.read_bytes().splitlines()
    assert model(lines, strict=False) == [
        (4, "DS001"), (5, "DS001"), (6, "DS002"), (7, "DS003"), (8, "DS004"),
        (9, "DS005"), (10, "DS006"), (10, "DS007"), (12, "DS009"), (13, "DS000"),
    ]  # fmt: skip
    assert (11, "DS008") in model(lines, strict=True)
