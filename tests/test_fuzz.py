"""Fuzzing every decoder and parser of hostile input (see tests/fuzz_support.py).

The property everywhere: whatever the bytes, the code answers with a result or one
of its documented errors (DecodeError, OtlpJsonError, InputError, RuleFormatError,
ConfigError, ExpressionError, EvaluationError), in bounded time and memory; where two
paths promise the same answer (the fast and the official protobuf reading, a block
of log lines and the same lines one by one), they give it.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
import zstandard
from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from processor.config import load_config
from processor.convert.actionlog import parse_line, parse_lines
from processor.convert.otlp_json import OtlpJsonError, decode_traces
from processor.convert.spans import SpanConverter
from processor.errors import ConfigError, EvaluationError, ExpressionError, InputError, RuleFormatError
from processor.evaluate.cel import Environment, compile_expression
from processor.evaluate.rulefmt import lint, load_rules
from processor.receive.files import read_input
from processor.records import Action, Malformed, SessionMark
from tests.fuzz_support import FUZZ, bounded_memory, corpus, inputs, mutated, only_raises, seeds, text_of

pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(240)]

CONVERTER = SpanConverter()


def _ids(target: str) -> list[str]:
    return [p.name for p in corpus(target)]


# -- OTLP protobuf -----------------------------------------------------------------


def check_otlp_proto(data: bytes) -> None:
    fast = only_raises(lambda: CONVERTER.convert_serialized(data, "fuzz"), DecodeError)
    official = only_raises(lambda: ExportTraceServiceRequest.FromString(data), DecodeError)
    # The fast reading fails exactly when the official parser does, and otherwise agrees with it.
    assert isinstance(fast, DecodeError) == isinstance(official, DecodeError)
    if not isinstance(official, DecodeError):
        assert fast == CONVERTER.convert(official, "fuzz")
        for item in fast.items:
            assert isinstance(item, Action | Malformed | SessionMark)


@pytest.mark.parametrize("path", corpus("otlp-proto"), ids=_ids("otlp-proto"))
def test_otlp_proto_corpus(path: Path) -> None:
    check_otlp_proto(path.read_bytes())


@FUZZ
@given(inputs("otlp-proto"))
def test_otlp_proto_fuzz(data: bytes) -> None:
    with bounded_memory():
        check_otlp_proto(data)


# -- OTLP/JSON ---------------------------------------------------------------------


def check_otlp_json(data: bytes) -> None:
    document = only_raises(lambda: orjson.loads(data), orjson.JSONDecodeError)
    if isinstance(document, orjson.JSONDecodeError):
        return
    for keep in (None, CONVERTER.reads_attribute):
        decoded = only_raises(lambda keep=keep: decode_traces(document, keep=keep), OtlpJsonError)
        if isinstance(decoded, OtlpJsonError):
            assert str(decoded)
            continue
        traces, problems = decoded
        assert all(isinstance(p, str) and p for p in problems)
        result = CONVERTER.convert(traces, "fuzz")
        # What decoded converts the same after a trip through the wire format.
        assert CONVERTER.convert_serialized(traces.SerializeToString(), "fuzz") == result


@pytest.mark.parametrize("path", corpus("otlp-json"), ids=_ids("otlp-json"))
def test_otlp_json_corpus(path: Path) -> None:
    check_otlp_json(path.read_bytes())


@FUZZ
@given(inputs("otlp-json"))
def test_otlp_json_fuzz(data: bytes) -> None:
    with bounded_memory():
        check_otlp_json(data)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
_SPAN_KEYS = ["traceId", "spanId", "parentSpanId", "name", "kind", "startTimeUnixNano", "endTimeUnixNano",
              "attributes", "events", "status", "links", "flags", "traceState"]


@st.composite
def _otlp_shaped(draw: Any) -> bytes:
    """An OTLP/JSON document of the right outline whose span fields hold anything."""
    span = {key: draw(_JSON) for key in draw(st.lists(st.sampled_from(_SPAN_KEYS), max_size=6, unique=True))}
    attributes = draw(st.lists(st.fixed_dictionaries({"key": st.text(max_size=24), "value": _JSON}), max_size=3))
    if attributes:
        span["attributes"] = attributes
    resource = {"attributes": draw(_JSON)}
    return orjson.dumps({"resourceSpans": [{"resource": resource, "scopeSpans": [{"spans": [span]}]}]})


@FUZZ
@given(_otlp_shaped())
def test_otlp_json_shaped_fuzz(data: bytes) -> None:
    check_otlp_json(data)


# -- the action log ----------------------------------------------------------------


def check_action_lines(data: bytes) -> None:
    raw_lines = data.split(b"\n")
    one_by_one: list[Action | Malformed] = []
    seq = 0
    for number, raw in enumerate(raw_lines, start=1):
        item = parse_line(raw, "fuzz", number, seq)
        if item is None:
            continue
        assert isinstance(item, Action | Malformed)
        if isinstance(item, Action):
            assert isinstance(item.record, dict)
            seq += 1
        one_by_one.append(item)
    # A block of lines gives exactly what the lines give one by one.
    block: list[Action | Malformed] = []
    next_seq = parse_lines(raw_lines, "fuzz", 1, 0, block)
    assert block == one_by_one
    assert next_seq == seq


@pytest.mark.parametrize("path", corpus("actions"), ids=_ids("actions"))
def test_action_log_corpus(path: Path) -> None:
    check_action_lines(path.read_bytes())


@FUZZ
@given(inputs("actions"))
def test_action_log_fuzz(data: bytes) -> None:
    with bounded_memory():
        check_action_lines(data)


# -- whole inputs: detection, gzip and zstd streams, lines and length-prefixed frames -------


def check_reader(data: bytes, directory: Path, plain_size: int | None = None) -> None:
    """``plain_size``: how many bytes ``data`` holds once decompressed, when it is compressed."""
    path = directory / "input"
    path.write_bytes(data)
    for input_format in (None, "actions", "otlp-json-lines", "otlp-json", "otlp-proto", "otlp-proto-stream"):

        def read(input_format: str | None = input_format) -> list[Action | Malformed]:
            # Small limits, so the fuzzer reaches the too-long paths with small inputs.
            items = read_input(str(path), input_format, CONVERTER, max_line_bytes=4096, max_message_bytes=65536)
            return list(items)

        result = only_raises(read, InputError)
        if isinstance(result, InputError):
            assert str(result).startswith(str(path)) or "format" in str(result)
            continue
        assert all(isinstance(item, Action | Malformed) for item in result)
        # At most one item per input byte: nothing multiplies.
        assert len(result) <= max(1, len(data) if plain_size is None else plain_size)


@st.composite
def _compressed(draw: Any) -> tuple[bytes, int]:
    """Mutated inputs compressed afterwards, in one or several gzip members or zstd frames,
    so the readers get past decompression and meet hostile content (mutating compressed
    bytes mostly breaks a checksum); sometimes cut short."""
    plain = draw(mutated(seeds("streams") + seeds("actions") + seeds("otlp-proto")))
    cut = draw(st.integers(0, len(plain)))
    parts = [plain[:cut], plain[cut:]] if draw(st.booleans()) else [plain]
    if draw(st.booleans()):
        data = b"".join(gzip.compress(part) for part in parts)
    else:
        data = b"".join(zstandard.ZstdCompressor(level=1).compress(part) for part in parts)
    if draw(st.integers(0, 3)) == 0:
        data = data[: draw(st.integers(0, len(data)))]
    return data, len(plain)


@FUZZ
@given(_compressed())
def test_reader_compressed_fuzz(tmp_path_factory: pytest.TempPathFactory, compressed: tuple[bytes, int]) -> None:
    data, plain_size = compressed
    with bounded_memory():
        check_reader(data, tmp_path_factory.mktemp("reader"), plain_size)


@pytest.mark.parametrize("path", corpus("streams"), ids=_ids("streams"))
def test_reader_corpus(path: Path, tmp_path: Path) -> None:
    check_reader(path.read_bytes(), tmp_path)


@FUZZ
@given(inputs("streams"))
def test_reader_fuzz(tmp_path_factory: pytest.TempPathFactory, data: bytes) -> None:
    with bounded_memory():
        check_reader(data, tmp_path_factory.mktemp("reader"))


# -- structure-aware mutation of YAML documents (rule files, configurations) ------------------


def _leaves(tree: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(tree, dict):
        return [path] + [leaf for key, value in tree.items() for leaf in _leaves(value, (*path, key))]
    if isinstance(tree, list):
        return [path] + [leaf for index, value in enumerate(tree) for leaf in _leaves(value, (*path, index))]
    return [path]


def _replace(tree: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(tree, dict):
        return {**tree, head: _replace(tree[head], rest, value)}
    copy = list(tree)
    copy[head] = _replace(copy[head], rest, value)
    return copy


def _documents(target: str) -> list[dict[str, Any]]:
    documents = []
    for path in corpus(target):
        try:
            document = yaml.safe_load(path.read_bytes())
        except yaml.YAMLError:
            continue  # a corpus file kept for its broken syntax
        if isinstance(document, dict):
            documents.append(document)
    return documents


_CONFIG_WORDS = st.sampled_from(["1s", "0s", "-1m", "10MiB", "0", "${env:X}", "", "\x00", "/dev/null", "::"])


@st.composite
def _yaml_mutated(draw: Any, target: str, values: st.SearchStrategy[Any]) -> bytes:
    """A corpus document, parsed, with a few of its values (or whole subtrees) replaced, written back."""
    tree = draw(st.sampled_from(_documents(target)))
    for _ in range(draw(st.integers(1, 4))):
        path = draw(st.sampled_from(_leaves(tree)))
        tree = _replace(tree, path, draw(values))
    return yaml.safe_dump(tree, allow_unicode=True).encode()


# -- rule files ----------------------------------------------------------------------


def check_rules(data: bytes, directory: Path) -> None:
    path = directory / "rules.yaml"
    path.write_bytes(data)
    problems = lint([path], include_shipped=False)
    for problem in problems:
        assert str(problem)
    loaded = only_raises(lambda: load_rules([path], include_shipped=False), RuleFormatError)
    # lint and load agree: problems exactly when loading refuses.
    assert isinstance(loaded, RuleFormatError) == bool(problems)


@pytest.mark.parametrize("path", corpus("rules"), ids=_ids("rules"))
def test_rules_corpus(path: Path, tmp_path: Path) -> None:
    check_rules(path.read_bytes(), tmp_path)


@FUZZ
@given(inputs("rules"))
def test_rules_fuzz(tmp_path_factory: pytest.TempPathFactory, data: bytes) -> None:
    with bounded_memory():
        check_rules(data, tmp_path_factory.mktemp("rules"))


@FUZZ
@given(_yaml_mutated("rules", st.one_of(_JSON, st.deferred(lambda: _EXPRESSIONS))))
def test_rules_structured_fuzz(tmp_path_factory: pytest.TempPathFactory, data: bytes) -> None:
    with bounded_memory():
        check_rules(data, tmp_path_factory.mktemp("rules"))


# -- CEL -----------------------------------------------------------------------------

CEL_ENV = Environment(
    variables={"record": "map", "meta": "map"},
    constants={"lists": {"side_effecting": ["payment", "email"]}},
    functions={"timeDerived": (lambda key, time: isinstance(key, str) and bool(time), 2)},
)
ACTIVATIONS: list[dict[str, Any]] = [
    {"record": {}, "meta": {}},
    {
        "record": {"kind": "payment", "status": "ok", "n": 3, "key": "aaaa-1", "tags": ["x", "xy"],
                   "items": [[None], [1, 2]], "idempotency_key": "k", "result": {"a": 1}},
        "meta": {"time_ns": 1},
    },
    {"record": {"kind": 1, "n": "3", "key": None, "tags": "x", "items": {"a": [None]}}, "meta": {"time_ns": -1}},
]
_CEL_TOKENS = ["record", "meta", "lists", "x", "y", ".", ",", "(", ")", "[", "]", "{", "}", ":", "?", "!", "-",
               "+", "*", "/", "%", "==", "!=", "<", "<=", ">", ">=", "&&", "||", "in", "true", "false", "null",
               "0", "1", "-9223372036854775808", "18446744073709551615u", "1.5e308", "'a'", '"b"', "r'\\d'",
               "'''x'''", "kind", "n", "key", "tags", "items", "side_effecting", "size", "int", "uint", "double",
               "string", "bool", "dyn", "has", "matches", "startsWith", "contains", "lowerAscii", "duration",
               "timeDerived", "exists", "all", "exists_one", "map", "filter", "'(a|a)*$'", "'[z-a]'", "'\\\\1'"]


def check_cel(source: str) -> None:
    compiled = only_raises(lambda: compile_expression(source, CEL_ENV), ExpressionError)
    if isinstance(compiled, ExpressionError):
        assert compiled.line >= 1 and compiled.col >= 1
        return
    for activation in ACTIVATIONS:
        only_raises(lambda activation=activation: compiled.evaluate(activation), EvaluationError)
        value = only_raises(lambda activation=activation: compiled.predicate(activation), EvaluationError)
        assert isinstance(value, bool | EvaluationError)


@pytest.mark.parametrize("path", corpus("cel"), ids=_ids("cel"))
def test_cel_corpus(path: Path) -> None:
    check_cel(path.read_text(encoding="utf-8"))


@FUZZ
@given(inputs("cel"))
def test_cel_fuzz(data: bytes) -> None:
    with bounded_memory():
        check_cel(text_of(data))


@FUZZ
@given(st.lists(st.sampled_from(_CEL_TOKENS), min_size=1, max_size=30))
def test_cel_token_fuzz(tokens: list[str]) -> None:
    # Sequences of CEL's own tokens reach the checker and the compiler far more often than bytes do.
    check_cel(" ".join(tokens))


_FIELDS = ["kind", "status", "n", "key", "tags", "items", "result", "idempotency_key"]
_ATOMS = ["record", "meta", "x", "y", "lists.side_effecting", "meta.time_ns", "0", "1", "-1", "2u", "0.5",
          "-9223372036854775808", "18446744073709551615u", "1e308", "'payment'", "'x'", "''", "'\\u00e9'",
          "true", "false", "null", "[]", "{}", *(f"record.{f}" for f in _FIELDS)]
_BINARY = ["==", "!=", "<", "<=", ">", ">=", "in", "+", "-", "*", "/", "%", "&&", "||"]
_MACROS = ["exists", "all", "exists_one", "filter", "map"]
_GLOBALS = ["size", "int", "uint", "double", "string", "bool", "dyn", "duration"]
_METHODS = ["startsWith", "endsWith", "contains", "matches"]


def _grown(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.one_of(
        st.tuples(children, st.sampled_from(_BINARY), children).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        st.tuples(st.sampled_from(["!", "-"]), children).map(lambda t: f"{t[0]}({t[1]})"),
        st.tuples(children, children, children).map(lambda t: f"({t[0]} ? {t[1]} : {t[2]})"),
        st.tuples(children, st.sampled_from(_MACROS), st.sampled_from(["x", "y"]), children).map(
            lambda t: f"{t[0]}.{t[1]}({t[2]}, {t[3]})"
        ),
        st.tuples(st.sampled_from(_GLOBALS), children).map(lambda t: f"{t[0]}({t[1]})"),
        st.tuples(children, st.sampled_from(_METHODS), children).map(lambda t: f"{t[0]}.{t[1]}({t[2]})"),
        st.tuples(children, st.sampled_from(["lowerAscii", "upperAscii", "size"])).map(lambda t: f"{t[0]}.{t[1]}()"),
        st.lists(children, max_size=3).map(lambda items: f"[{', '.join(items)}]"),
        st.tuples(children, children).map(lambda t: f"{{{t[0]}: {t[1]}}}"),
        st.tuples(children, children).map(lambda t: f"{t[0]}[{t[1]}]"),
        st.sampled_from(_FIELDS).map(lambda f: f"has(record.{f})"),
        st.tuples(st.sampled_from(_FIELDS), st.sampled_from(["'payment'", "'ok'"])).map(
            lambda t: f"record.{t[0]} == {t[1]}"
        ),
        st.sampled_from(_FIELDS).map(lambda f: f"record.{f} in lists.side_effecting"),
    )


_EXPRESSIONS = st.recursive(st.sampled_from(_ATOMS), _grown, max_leaves=10)
_SCALARS = st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats()
_VALUES = st.recursive(
    _SCALARS | st.sampled_from(["payment", "ok", "", "a" * 45 + "!", "x"]),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.sampled_from(_FIELDS), children, max_size=3),
    max_leaves=8,
)
_RECORDS = st.dictionaries(st.sampled_from(_FIELDS), _VALUES, max_size=6)


def _outcome(compiled: Any, activation: dict[str, Any]) -> Any:
    try:
        value = compiled.evaluate(activation)
    except EvaluationError:
        return EvaluationError
    # Compared by repr: NaN, alone or inside a list, is not equal to itself.
    return value if isinstance(value, bool) else repr(value)


@FUZZ
@given(_EXPRESSIONS, _RECORDS)
def test_cel_grammar_fuzz(source: str, record: dict[str, Any]) -> None:
    """Well-formed expressions of every shape, on records of every shape, keep the compiler's promises."""
    compiled = only_raises(lambda: compile_expression(source, CEL_ENV), ExpressionError)
    if isinstance(compiled, ExpressionError):
        assert compiled.line >= 1 and compiled.col >= 1
        return
    activation = {"record": record, "meta": {"time_ns": 1}}
    outcome = _outcome(compiled, activation)
    predicate = only_raises(lambda: compiled.predicate(activation), EvaluationError)
    assert predicate == (outcome is True) if not isinstance(predicate, EvaluationError) else outcome is EvaluationError
    # A refuted guard means the expression is false there (not an error): the engine skips it.
    if compiled.guard is not None and compiled.guard.refuted(activation):
        assert outcome is False
    # The engine keeps only the fields an expression references: they give the same answer.
    if ("record", "*") not in compiled.references:
        kept = {f: v for f, v in record.items() if ("record", f) in compiled.references}
        assert _outcome(compiled, {"record": kept, "meta": {"time_ns": 1}}) == outcome


# -- configuration -------------------------------------------------------------------


def check_config(data: bytes, directory: Path) -> None:
    path = directory / "config.yaml"
    path.write_bytes(data)
    for sections in (None, ("convert", "evaluate")):
        result = only_raises(lambda sections=sections: load_config(str(path), {}, sections), ConfigError)
        if isinstance(result, ConfigError):
            assert result.problems


@pytest.mark.parametrize("path", corpus("config"), ids=_ids("config"))
def test_config_corpus(path: Path, tmp_path: Path) -> None:
    check_config(path.read_bytes(), tmp_path)


@FUZZ
@given(_yaml_mutated("config", _JSON | _CONFIG_WORDS))
def test_config_structured_fuzz(tmp_path_factory: pytest.TempPathFactory, data: bytes) -> None:
    with bounded_memory():
        check_config(data, tmp_path_factory.mktemp("config"))


@FUZZ
@given(inputs("config"))
def test_config_fuzz(tmp_path_factory: pytest.TempPathFactory, data: bytes) -> None:
    with bounded_memory():
        check_config(data, tmp_path_factory.mktemp("config"))
