"""Typed lines: an action-log line decoded and type-checked in one step (actionlog.typed_decoder).

The action-log lane reads a line as a typed struct instead of orjson's dict when its rule set
allows it. These tests hold the decoder to orjson + well_formed (it may refuse more, never
accept more or give other values), the code generated for typed lines to the closures, and
the lane on typed lines to the engine.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import msgspec
import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from processor.convert.actionlog import TYPED_LINE_MAX_BYTES, typed_decoder, well_formed
from processor.evaluate.cel import compile_expression, python_source
from processor.evaluate.cel._codegen import FieldTyping, SourceContext, conjuncts
from processor.evaluate.engine import Engine
from processor.evaluate.loglane import _META, LogLane
from processor.evaluate.rulefmt import load_rules
from processor.records import FIELD_TYPES, REQUIRED_FIELDS
from processor.report import Report
from tests.test_loglane import _ENV, _EXAMPLES, _both, _write
from tests.test_skill_parity import _logs, _record

_DECODERS = typed_decoder(["prompt"])
_DECODE, _OPEN, _UNSET = _DECODERS.strict, _DECODERS.lenient, _DECODERS.unset
_DECLARED = frozenset(FIELD_TYPES) | {"prompt"}


def _decoded(raw: bytes, decode: Any = _DECODE) -> Any:
    try:
        return decode(raw)
    except (ValueError, RecursionError):
        return None


def _opened(raw: bytes) -> Any:
    """The open decoder as the lane uses it: its line confirmed by orjson."""
    typed = _decoded(raw, _OPEN)
    if typed is None:
        return None
    try:
        orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return typed


def _as_orjson_gives(value: Any) -> Any:
    """orjson gives an integer past 64 bits as a float; the typed decoder keeps it an int."""
    if type(value) is int and not -(2**63) <= value < 2**64:
        return float(value)
    if type(value) is list:
        return [_as_orjson_gives(v) for v in value]
    if type(value) is dict:
        return {k: _as_orjson_gives(v) for k, v in value.items()}
    return value


def _same(left: Any, right: Any) -> bool:
    """Equal values of the same JSON types, all the way down (1 is not 1.0 is not True)."""
    if type(left) is not type(right):
        return False
    if type(left) is list:
        return len(left) == len(right) and all(_same(a, b) for a, b in zip(left, right, strict=True))
    if type(left) is dict:
        return list(left) == list(right) and all(_same(left[k], right[k]) for k in left)
    return bool(left == right)


# -- the decoder against orjson + well_formed ----------------------------------------------------

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=6),
    st.sampled_from(["", "ok", "é", "\u2028", "\x01", "a\\b", '"']),
)
_values = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(st.text(max_size=3), inner, max_size=3)),
                       max_leaves=6)  # fmt: skip
_names = st.one_of(st.sampled_from(sorted(_DECLARED)), st.sampled_from(["x", "", "kind ", "Kind"]))
_objects = st.lists(st.tuples(_names, _values), max_size=9)


def _json(value: Any) -> bytes:
    # json, not orjson: integers past 64 bits, and surrogates written as bytes (invalid UTF-8).
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


def _text(pairs: list[tuple[str, Any]], spaced: bool) -> bytes:
    """An object's JSON text written by hand: keys may repeat, separators may carry spaces."""
    colon, comma = (b" : ", b" ,\t") if spaced else (b":", b",")
    return b"{" + comma.join(_json(k) + colon + _json(v) for k, v in pairs) + b"}"


_required = st.fixed_dictionaries({name: st.sampled_from(["s1", "a1", "llm_call", "ok"]) for name in REQUIRED_FIELDS})
_lines = st.one_of(
    st.builds(lambda base, more, spaced: _text([*base.items(), *more], spaced), _required, _objects, st.booleans()),
    st.builds(_text, _objects, st.booleans()),
)
_edits = st.one_of(
    st.none(),
    st.tuples(st.just("cut"), st.integers(0, 400)),
    st.tuples(st.just("insert"), st.integers(0, 400), st.binary(min_size=1, max_size=2)),
)


def _edited(raw: bytes, edit: Any) -> bytes:
    if edit is None:
        return raw
    if edit[0] == "cut":
        return raw[: edit[1] % (len(raw) + 1)]
    place = edit[1] % (len(raw) + 1)
    return raw[:place] + edit[2] + raw[place:]


@settings(max_examples=600, deadline=None)
@given(raw=_lines, edit=_edits)
@example(raw=b'{"session_id":"s","action_id":"a","kind":"k","status":"ok","result":1e400}', edit=None)
@example(raw=b'{"session_id":"s","action_id":"a","kind":"k","status":"ok","result":"\xff"}', edit=None)
@example(raw=b'{"session_id":"s","action_id":"a","kind":"k","status":"ok","result":"\\ud800"}', edit=None)
@example(raw=b'{"session_id":"s","action_id":"a","kind":"k","status":"ok","attempts":1,"attempts":true}', edit=None)
@example(raw=b'{"session_id":"s","action_id":"a","kind":"k","status":"ok","attempts":1.0}', edit=None)
@example(raw=b'{"session_id":"s","action_id":"a","kind":"k","status":"ok","ttl_s":9223372036854775808}', edit=None)
@example(raw=b'{"session_id":"s","action_id":"a","kind":"k","status":"ok","wait_timeout_s":1e2}', edit=None)
@example(raw=b'{"session_id":"s","action_id":"a","kind":"k","status":"ok","result":' + b"[" * 990 + b"]" * 990 + b"}",
         edit=None)  # fmt: skip
def test_a_typed_line_is_what_orjson_and_well_formed_give(raw: bytes, edit: Any) -> None:
    raw = _edited(raw, edit)
    if len(raw) > TYPED_LINE_MAX_BYTES:
        return
    strict = _decoded(raw)
    if strict is not None:
        parsed = orjson.loads(raw)  # raises if the decoder took what orjson refuses
        assert set(parsed) <= _DECLARED
        _assert_same_fields(strict, parsed)
    opened = _opened(raw)
    if opened is not None:
        _assert_same_fields(opened, orjson.loads(raw))
    elif strict is not None:
        raise AssertionError("the open decoder refused what the strict one took")


def _assert_same_fields(typed: Any, parsed: Any) -> None:
    assert type(parsed) is dict
    assert well_formed(parsed)
    for name in _DECLARED:
        value = getattr(typed, name)
        if name not in parsed:
            assert value is _UNSET, name
        elif FIELD_TYPES.get(name, "any") == "any":
            assert _same(_as_orjson_gives(value), parsed[name]), name
        else:
            assert _same(value, parsed[name]), name


@pytest.mark.parametrize(
    "line",
    [
        b'{"session_id":"s","action_id":"a","kind":"k","status":"ok","model":"m"}',  # a field no rule names
        b'{"session_id":"s","action_id":"a","kind":"k","status":"ok","attempts":"1","attempts":2}',  # one repeat wrong
        b'{"session_id":"","action_id":"a","kind":"k","status":"ok"}',  # empty required field
        b'{"session_id":"s","action_id":"a","kind":"k","status":"ok","retryable":1}',  # a number for a bool
        b'{"session_id":"s","action_id":"a","kind":"k"}',  # status missing
        b"[1]",
        b"",
    ],
)
def test_the_decoder_refuses_what_the_general_path_must_say(line: bytes) -> None:
    """Refused lines go to orjson + validate_record, which say what is wrong (or accept a repeat)."""
    assert _decoded(line) is None


def test_a_repeated_key_keeps_its_last_value_as_orjson_does() -> None:
    typed = _decoded(b'{"session_id":"s","action_id":"a","kind":"k","status":"ok","attempts":1,"attempts":2}')
    assert typed is not None
    assert typed.attempts == 2


# -- generated code on typed lines --------------------------------------------------------------

_TYPED_RECORD = FieldTyping(code="r", types=FIELD_TYPES, always=frozenset(REQUIRED_FIELDS), attributes=_DECLARED)
_EXPRESSIONS = [
    "has(record.attempts) && record.attempts != null && record.attempts > 1",
    "record.kind in lists.kinds || (has(record.retryable) && record.retryable == true)",
    "has(record.ttl_s) && record.ttl_s == 1",
    "has(record.prompt) && record.prompt == 'x'",
    "!(has(record.result) && record.result == null) && record.status != 'ok'",
    "has(record.cacheable) && record.cacheable == true && !(has(record.cache_key) && record.cache_key != '')",
    "record.status == 'ok' && has(record.kind) && record.kind in lists.kinds && !has(record.result)",
    "has(record.wait_timeout_s) && record.wait_timeout_s != null && record.wait_timeout_s >= 1.5",
    "has(record.max_attempts) && record.max_attempts == 2 && has(record.attempts) && record.attempts != null"
    " && record.attempts > record.max_attempts",
    "record.kind == 'payment' ? has(record.idempotency_key) : record.status == 'ok'",
    "meta.source == 'span' ? record.attempts > 1 : record.kind in lists.kinds",
    "meta.source == 'log' ? has(record.retryable) && record.retryable == true : record.attempts > 1",
]
_field_values = st.one_of(st.none(), st.booleans(), st.integers(-2, 3), st.floats(0, 3, allow_nan=False),
                          st.sampled_from(["", "x", "llm_call", "payment"]))  # fmt: skip


@pytest.mark.parametrize("source", _EXPRESSIONS)
@settings(max_examples=150, deadline=None)
@given(
    fields=st.fixed_dictionaries(
        {"kind": st.sampled_from(["llm_call", "payment", "tool_call"]), "status": st.sampled_from(["ok", "error"])},
        optional={name: _field_values for name in ("attempts", "max_attempts", "retryable", "ttl_s", "prompt",
                                                    "result", "wait_timeout_s", "cacheable", "cache_key")},
    )
)  # fmt: skip
def test_generated_code_on_typed_lines_equals_the_closures(source: str, fields: dict[str, Any]) -> None:
    """Whole, and as the conjuncts the lane factors (presence tests dropped where a test decides)."""
    record = {"session_id": "s", "action_id": "a", **fields}
    if not well_formed(record):
        return  # the lane's records are valid ones
    typed = _DECODE(orjson.dumps(record))
    expression = compile_expression(source, _ENV)
    assert expression.tree is not None
    context = SourceContext(maps={"record": _TYPED_RECORD}, meta=dict(_META))
    meta = {"source": "log", "line": 1, "time_ns": 0, "synthetic_action_id": False}
    expected = expression.evaluate({"record": record, "meta": meta, "lists": {"kinds": ["llm_call", "payment"]}})
    namespace = {"_U": _UNSET}
    whole = python_source(expression.tree, expression.constants, context)
    terms = conjuncts(expression.tree, expression.constants, context)
    namespace.update(context.constants)

    def value(code: str) -> Any:
        return eval(compile(f"lambda r, line, t: {code}", "<test>", "eval"), namespace)(typed, 1, None)

    assert value(whole.code) is expected
    if terms is None:
        assert expected is False
        return
    assert value(" and ".join(term.code for term in terms) or "True") is expected
    for index, term in enumerate(terms):
        if term.alone is not None:
            # What the lane writes when it tests this term first, once for several rules.
            others = [t.code for i, t in enumerate(terms) if i != index]
            assert value(" and ".join([term.alone, *others])) is expected


# -- the lane on typed lines against the engine ---------------------------------------------------

_extra = st.fixed_dictionaries({}, optional={"model": st.sampled_from(["m1", "m2"]), "tokens": st.integers(0, 9)})
_mixed = st.lists(
    st.one_of(
        _record.map(orjson.dumps),
        st.tuples(_record, _extra).map(lambda pair: orjson.dumps({**pair[0], **pair[1]})),
        st.just(b'{"session_id":"s1","action_id":"big","kind":"llm_call","status":"ok","result":[18446744073709551616]}'),
    ),
    min_size=1,
    max_size=25,
)

PRESENCE_RULES = """
version: 1
record_fields: [prompt, model]
rules:
  - id: X101
    name: model-named
    severity: info
    condition: 'has(record.model) && record.status == "ok" && has(record.result)'
    message: "{{ record.kind }} {{ record.action_id }} names a model"
"""
VALUE_RULES = """
version: 1
record_fields: [model]
rules:
  - id: X102
    name: model-read
    severity: info
    condition: 'has(record.model) && record.model == "m1"'
    message: "model {{ record.model }}"
"""


@pytest.mark.parametrize("stretch", [1024, 2], ids=["stretch1024", "stretch2"])
@pytest.mark.parametrize("rules", [None, PRESENCE_RULES, VALUE_RULES], ids=["pack", "presence", "value"])
@pytest.mark.parametrize("fmt", ["text", "json"])
@settings(max_examples=_EXAMPLES // 2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(first=_mixed, second=_logs)
def test_the_lane_on_typed_lines_gives_the_engine_report(  # noqa: PLR0917 (hypothesis and parameters)
    first: list[bytes],
    second: list[bytes],
    rules: str | None,
    fmt: str,
    stretch: int,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stretches of two lines switch between the strict and the open decoder within these logs."""
    from processor.evaluate import loglane

    # replay makes its lane from the module's LogLane when it runs: this one reads shorter stretches.
    made = loglane.LogLane

    def with_stretch(engine: Engine, fmt: str = "text") -> LogLane:
        lane = made(engine, fmt)
        lane.stretch = stretch
        return lane

    monkeypatch.setattr(loglane, "LogLane", with_stretch)
    with tempfile.TemporaryDirectory() as directory:
        args = ["--pack", "durable-sessions", "--format", fmt]
        if rules is not None:
            path = Path(directory) / "rules.yaml"
            path.write_text(rules, encoding="utf-8")
            args += ["--rules", str(path)]
        one = _write(directory, "one.jsonl", first)
        two = _write(directory, "two.jsonl", second)
        _both([*args, "--strict", one], capsys)
        _both([*args, one, two], capsys)


def _lane(rules: str | None, tmp_path: Path) -> LogLane:
    files = []
    if rules is not None:
        path = tmp_path / "rules.yaml"
        path.write_text(rules, encoding="utf-8")
        files.append(str(path))
    return LogLane(Engine(load_rules(files, packs=["durable-sessions"])))


def test_typed_lines_are_used_only_where_they_cannot_differ(tmp_path: Path) -> None:
    assert _lane(None, tmp_path)._decode is not None  # the skill's pack reads typed fields and result's presence
    assert _lane(PRESENCE_RULES, tmp_path)._decode is not None  # an extra field tested with has() only
    assert _lane(VALUE_RULES, tmp_path)._decode is None  # an untyped field's value is read
    whole = PRESENCE_RULES.replace("has(record.model)", "size(record) > 5")
    assert _lane(whole, tmp_path)._decode is None  # the whole record is read


def test_stretches_of_lines_with_unnamed_fields_are_read_by_the_open_decoder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Stretches of lines with fields no rule names switch to the open decoder for a while (those
    fields skipped, orjson confirming the line); the report stays the engine's across the switches."""
    lines = []
    for n in range(30_000):
        record: dict[str, Any] = {"session_id": f"s{n % 50}", "action_id": f"a{n}", "kind": "llm_call",
                                  "status": "ok", "result": n}  # fmt: skip
        if (n // 7_000) % 2:
            record["model"] = "m"  # blocks of unnamed fields, then plain ones again
        if n % 997 == 0:
            del record["result"]  # DS001 now and then, in both kinds of block
        lines.append(orjson.dumps(record))
    log = _write(str(tmp_path), "long.jsonl", lines)
    code, out, _ = _both(["--pack", "durable-sessions", log], capsys)
    assert code == 1
    assert sum(" DS001 " in line for line in out.splitlines() if line.startswith("line ")) == 31
    # The strict decoder read the plain stretches; the open one most lines of the others.
    lane = _lane(None, tmp_path)
    try:
        lane.run([log], None, Report(inputs=[log]), set())
    finally:
        lane.close()
    assert 12_000 < lane.stretch_lines["strict"] < 20_000
    assert 10_000 < lane.stretch_lines["open"] < 18_000
    assert lane.stretch_lines["strict"] + lane.stretch_lines["open"] == 30_000


def test_the_struct_decoder_is_a_msgspec_struct_without_gc() -> None:
    """Kept small: no cycle can come from JSON, so the struct is not tracked by the collector."""
    typed = _DECODE(b'{"session_id":"s","action_id":"a","kind":"k","status":"ok","result":{"a":[1]}}')
    assert isinstance(typed, msgspec.Struct)
    assert typed.result == {"a": [1]}
    assert typed.prompt is _UNSET
