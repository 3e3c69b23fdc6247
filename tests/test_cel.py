"""The CEL subset: parsing, checking, compiling and evaluating rule expressions."""

from __future__ import annotations

import itertools
import math
import random
import re
from collections.abc import Mapping
from typing import Any

import cel as rust_cel  # the Rust-based binding (common-expression-language)
import celpy  # cel-python
import pytest

from processor.errors import EvaluationError as BaseEvaluationError
from processor.errors import ExpressionError as BaseExpressionError
from processor.evaluate.cel import (
    WHOLE_VALUE,
    CompiledExpression,
    Environment,
    EvaluationError,
    ExpressionError,
    UInt,
    compile_expression,
)
from processor.records import FIELD_TYPES, NONDETERMINISTIC_KINDS

RECORD_FIELDS = frozenset(FIELD_TYPES)
NONDETERMINISTIC = sorted(NONDETERMINISTIC_KINDS)

ENV = Environment(
    variables={"record": "map", "first": "map", "lists": "map", "now": "int", "r": "map", "x": "dyn"},
    known_fields={"record": RECORD_FIELDS, "first": None},
    constants={"lists": {"nondeterministic": NONDETERMINISTIC, "side_effects": ["write", "payment", "email"]}},
)

# The outcome of an expression that fails with an EvaluationError.
ERROR = object()

TYPICAL_CONDITION = (
    'record.kind in lists.nondeterministic && record.status == "ok" && !has(record.result) '
    '&& !(has(record.result_ref) && record.result_ref != "")'
)


def evaluate(source: str, env: Environment = ENV, **activation: Any) -> Any:
    return compile_expression(source, env).evaluate(activation)


def compile_error(source: str, env: Environment = ENV) -> ExpressionError:
    with pytest.raises(ExpressionError) as caught:
        compile_expression(source, env)
    return caught.value


def evaluation_error(source: str, env: Environment = ENV, **activation: Any) -> EvaluationError:
    expr = compile_expression(source, env)
    with pytest.raises(EvaluationError) as caught:
        expr.evaluate(activation)
    return caught.value


# -- the public API ----------------------------------------------------------------------


def test_errors_are_the_project_errors() -> None:
    assert ExpressionError is BaseExpressionError
    assert EvaluationError is BaseEvaluationError


def test_typical_rule_condition() -> None:
    expr = compile_expression(TYPICAL_CONDITION, ENV)
    assert isinstance(expr, CompiledExpression)
    assert expr.source == TYPICAL_CONDITION
    assert expr.result_type == "bool"
    unrecorded = {"kind": "llm_call", "status": "ok"}
    assert expr.predicate({"record": unrecorded}) is True
    assert expr.predicate({"record": {**unrecorded, "result": None}}) is False  # null result is recorded
    assert expr.predicate({"record": {**unrecorded, "result_ref": "blob://1"}}) is False
    assert expr.predicate({"record": {**unrecorded, "result_ref": ""}}) is True
    assert expr.predicate({"record": {**unrecorded, "status": "error"}}) is False
    assert expr.predicate({"record": {**unrecorded, "kind": "write"}}) is False
    assert expr.evaluate({"record": unrecorded}) is True


def test_predicate_is_true_only_for_bool_true() -> None:
    assert compile_expression("x", ENV).predicate({"x": 1}) is False
    assert compile_expression("x", ENV).predicate({"x": "true"}) is False
    assert compile_expression("x", ENV).predicate({"x": True}) is True
    with pytest.raises(EvaluationError, match="no such key: result"):
        compile_expression("record.result == 1", ENV).predicate({"record": {}})


def test_missing_variable_in_activation_is_an_evaluation_error() -> None:
    with pytest.raises(EvaluationError, match="no value for variable 'record'"):
        evaluate("record.kind == 'a'")


# -- literals -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("42", 42),
        ("0x1F", 31),
        ("0XfF", 255),
        ("-0x10", -16),
        ("9223372036854775807", 2**63 - 1),
        ("-9223372036854775808", -(2**63)),
        ("1.5", 1.5),
        ("1e3", 1000.0),
        ("2.5E-1", 0.25),
        (".5", 0.5),
        ("-1.25", -1.25),
        ('"double"', "double"),
        ("'single'", "single"),
        ('"""triple "quoted" text"""', 'triple "quoted" text'),
        ("'''line\nbreak'''", "line\nbreak"),
        (r'r"raw\n"', "raw\\n"),
        (r"R'\d+'", "\\d+"),
        (r'"\a\b\f\n\r\t\v\\\'\"\`\?"', "\a\b\f\n\r\t\v\\'\"`?"),
        (r'"\x41\u00e9\U0001F600\101"', "A\u00e9\U0001f600A"),
        ('"é漢"', "é漢"),
        ("true", True),
        ("false", False),
        ("null", None),
        ("[1, 'a', null]", (1, "a", None)),
        ("[]", ()),
        ("[1, 2,]", (1, 2)),
        ("{'a': 1, 2: 'b', true: null}", {"a": 1, 2: "b", True: None}),
        ("{}", {}),
        ("1 // a comment\n + 2", 3),
    ],
)
def test_literals(source: str, expected: Any) -> None:
    value = evaluate(source)
    assert value == expected
    assert type(value) is type(expected)


def test_uint_literals_are_uint() -> None:
    value = evaluate("7u")
    assert isinstance(value, UInt)
    assert value == 7
    assert isinstance(evaluate("0xFFu"), UInt)
    assert evaluate("18446744073709551615u") == 2**64 - 1


# -- precedence -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("1 + 2 * 3", 7),
        ("(1 + 2) * 3", 9),
        ("10 - 4 - 3", 3),
        ("100 / 10 / 5", 2),
        ("2 * 3 % 4", 2),
        ("-2 * 3", -6),
        ("- (2 - 5)", 3),
        ("1 + 2 == 3", True),
        ("1 < 2 == true", True),
        ("true || false && false", True),
        ("(true || false) && false", False),
        ("!false && false", False),
        ("!(false && false)", True),
        ("true ? 1 : 2 + 10", 1),
        ("false ? 1 : 2 + 10", 12),
        ("false ? 1 : true ? 2 : 3", 2),
        ("true ? (false ? 1 : 2) : 3", 2),
        ("1 in [1] && 2 in [2]", True),
        ("[1, 2][1] * 10", 20),
        ("{'a': {'b': 5}}.a.b + 1", 6),
        ("'ab'.size() + size('cde')", 5),
        ("!!true", True),
        ("--3", 3),
    ],
)
def test_precedence(source: str, expected: Any) -> None:
    assert evaluate(source) == expected


# -- operators ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("7 / 2", 3),
        ("-7 / 2", -3),
        ("7 / -2", -3),
        ("7 % 3", 1),
        ("-7 % 3", -1),
        ("7 % -3", 1),
        ("7u / 2u", 3),
        ("7u % 4u", 3),
        ("1.5 + 2.25", 3.75),
        ("5.0 - 7.5", -2.5),
        ("1.5 * 4.0", 6.0),
        ("3.0 / 2.0", 1.5),
        ("'foo' + 'bar'", "foobar"),
        ("[1] + [2, 3]", [1, 2, 3]),
        ("-(5)", -5),
        ("-(2.5)", -2.5),
    ],
)
def test_arithmetic(source: str, expected: Any) -> None:
    value = evaluate(source)
    assert list(value) == expected if isinstance(expected, list) else value == expected


def test_double_division_by_zero_follows_ieee() -> None:
    assert evaluate("1.0 / 0.0") == math.inf
    assert evaluate("-1.0 / 0.0") == -math.inf
    assert math.isnan(evaluate("0.0 / 0.0"))


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("9223372036854775807 + 1", "int overflow"),
        ("-9223372036854775808 - 1", "int overflow"),
        ("4611686018427387904 * 2", "int overflow"),
        ("-9223372036854775808 / -1", "int overflow"),
        ("-(-9223372036854775808)", "int overflow"),
        ("1u - 2u", "uint overflow"),
        ("18446744073709551615u + 1u", "uint overflow"),
        ("1 / 0", "division by zero"),
        ("1 % 0", "modulus by zero"),
        ("1u / 0u", "division by zero"),
    ],
)
def test_arithmetic_errors(source: str, message: str) -> None:
    assert message in str(evaluation_error(source))


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("1 == 1.0", True),
        ("1u == 1", True),
        ("1u == 1.0", True),
        ("0.1 + 0.2 == 0.3", False),
        ("2 != 2.0", False),
        ("'a' == 'a'", True),
        ("'a' == 1", False),
        ("true == 1", False),
        ("1 == true", False),
        ("null == null", True),
        ("null == 0", False),
        ("null != 'x'", True),
        ("[1, 2] == [1, 2]", True),
        ("[1, 2] == [2, 1]", False),
        ("[1, [2]] == [1, [2.0]]", True),
        ("[1] == ['1']", False),
        ("{'a': 1, 'b': 2} == {'b': 2, 'a': 1.0}", True),
        ("{'a': 1} == {'a': 2}", False),
        ("{'a': 1} == {'b': 1}", False),
        ("1 < 2", True),
        ("2 <= 2", True),
        ("3 > 2.5", True),
        ("2u >= 3", False),
        ("-1 < 1u", True),
        ("'abc' < 'abd'", True),
        ("'b' > 'abc'", True),
        ("false < true", True),
        ("2 in [1, 2, 3]", True),
        ("4 in [1, 2, 3]", False),
        ("1.0 in [1, 2]", True),
        ("true in [1]", False),
        ("'b' in {'a': 1, 'b': 2}", True),
        ("'c' in {'a': 1}", False),
        ("1 in {1: 'one'}", True),
        ("[1] in [[1], [2]]", True),
    ],
)
def test_comparisons(source: str, expected: bool) -> None:
    assert evaluate(source) is expected


@pytest.mark.parametrize(
    ("source", "activation"),
    [
        ("x < 1", {"x": "a"}),
        ("x >= 'a'", {"x": 1}),
        ("x < 1", {"x": None}),
        ("x > r.l", {"x": [1], "r": {"l": [2]}}),
        ("x + 1", {"x": 1.5}),
        ("x + 1", {"x": "1"}),
        ("x - 1", {"x": True}),
        ("x * 2", {"x": [1]}),
        ("x % 2", {"x": 2.5}),
        ("-x", {"x": "a"}),
        ("!x", {"x": 1}),
        ("x in r.s", {"x": "a", "r": {"s": "abc"}}),
        ("x in r", {"r": {}, "x": [1]}),
        ("x ? 1 : 2", {"x": "yes"}),
        ("x.field", {"x": [1]}),
        ("x[0]", {"x": "abc"}),
        ("x[true]", {"x": [1]}),
        ("size(x)", {"x": 5}),
        ("x.startsWith('a')", {"x": 5}),
        ("int(x)", {"x": [1]}),
    ],
)
def test_strict_types_at_run_time(source: str, activation: dict[str, Any]) -> None:
    error = evaluation_error(source, **activation)
    assert str(error)


def test_type_error_message_names_types_not_values() -> None:
    error = evaluation_error("x < 1", x="secret-value")
    assert str(error) == "no such overload: < applied to (string, int)"
    assert "secret" not in str(evaluation_error("x + 1", x="secret-value"))


def test_dynamic_comparison_of_a_field_with_a_literal_is_allowed() -> None:
    expr = compile_expression("record.attempts > 3", ENV)
    assert expr.evaluate({"record": {"attempts": 4}}) is True
    assert expr.evaluate({"record": {"attempts": 2.5}}) is False
    with pytest.raises(EvaluationError, match=r"no such overload: > applied to \(string, int\)"):
        expr.evaluate({"record": {"attempts": "4"}})


def test_equality_with_literal_respects_cel_types() -> None:
    for source, value, expected in [
        ("x == 1", True, False),
        ("x == 1", 1.0, True),
        ("x != 1", True, True),
        ("x == true", 1, False),
        ("x == 'ok'", ["ok"], False),
        ("x == null", 0, False),
        ("x == null", None, True),
        ("x != null", None, False),
        ("x == 1.0", UInt(1), True),
    ]:
        assert evaluate(source, x=value) is expected, (source, value)


# -- fields, presence, indexing --------------------------------------------------------------


def test_field_access_and_missing_keys() -> None:
    record = {"kind": "llm_call", "result": None, "tags": ["a", "b"], "nested": {"k": 1}}
    assert evaluate("record.kind", record=record) == "llm_call"
    assert evaluate("record.result", record=record) is None
    assert evaluate("record.result == null", record=record) is True
    assert evaluate("r.nested.k", r=record) == 1
    error = evaluation_error("record.result_ref != ''", record=record)
    assert str(error) == "no such key: result_ref"
    assert "no such key: missing" in str(evaluation_error("r.nested.missing", r=record))
    assert "cannot select field 'kind' on a value of type list" in str(evaluation_error("r.tags.kind", r=record))


def test_has_tests_presence_not_value() -> None:
    record = {"result": None, "nested": {"k": False}}
    assert evaluate("has(r.result)", r=record) is True
    assert evaluate("has(r.result_ref)", r=record) is False
    assert evaluate("!has(r.result_ref)", r=record) is True
    assert evaluate("!has(r.result)", r=record) is False
    assert evaluate("has(r.nested.k)", r=record) is True
    assert evaluate("has({'a': 1}.a)") is True
    assert evaluate("has({'a': 1}.b)") is False
    assert "has() cannot test field 'k'" in str(evaluation_error("has(r.list.k)", r={"list": [1]}))
    assert "no such key: nested" in str(evaluation_error("has(r.nested.k)", r={}))


def test_indexing() -> None:
    r = {"tags": ["x", "y"], "m": {"a": 1, 2: "two"}}
    assert evaluate("r.tags[1]", r=r) == "y"
    assert evaluate("r.tags[1u]", r=r) == "y"
    assert evaluate("r.tags[1.0]", r=r) == "y"
    assert evaluate("r.m['a']", r=r) == 1
    assert evaluate("r.m[2]", r=r) == "two"
    assert evaluate("r['tags'][0]", r=r) == "x"
    assert "index out of range" in str(evaluation_error("r.tags[2]", r=r))
    assert "index out of range" in str(evaluation_error("r.tags[-1]", r=r))
    assert "no such key" in str(evaluation_error("r.m['b']", r=r))
    assert "no such key" in str(evaluation_error("r.m[x]", r=r, x="zz"))
    assert "zz" not in str(evaluation_error("r.m[x]", r=r, x="zz"))


# -- logic ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("false && r.missing", False),
        ("r.missing && false", False),
        ("true || r.missing", True),
        ("r.missing || true", True),
        ("r.missing == 1 && false && r.other", False),
        ("r.missing == 1 || r.other || true", True),
        ("1 / 0 == 1 && false", False),
        ("x && false", False),
        ("x || true", True),
        ("false ? r.missing : 1", 1),
        ("true ? 1 : r.missing", 1),
    ],
)
def test_logic_absorbs_errors(source: str, expected: Any) -> None:
    assert evaluate(source, r={}, x="not a bool") == expected


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("r.missing && true", "no such key: missing"),
        ("true && r.missing", "no such key: missing"),
        ("r.missing || false", "no such key: missing"),
        ("r.missing && r.other", "no such key: missing"),
        ("x && true", "no such overload: && applied to (string)"),
        ("false || x", "no such overload: || applied to (string)"),
        ("true && true && x", "no such overload: && applied to (string)"),
        ("r.a || r.b || r.c", "no such key: a"),
    ],
)
def test_logic_propagates_errors_when_undecided(source: str, message: str) -> None:
    assert message in str(evaluation_error(source, r={}, x="not a bool"))


@pytest.mark.parametrize(
    ("source", "activation", "expected"),
    [
        ("!(r.missing && false)", {"r": {}}, True),
        ("!(false && r.missing)", {"r": {}}, True),
        ("!(r.missing && true)", {"r": {}}, ERROR),
        ("!(true || r.missing)", {"r": {}}, False),
        ("!(r.missing || false)", {"r": {}}, ERROR),
        ("!(x && true)", {"x": 1}, ERROR),
        ("!(x || false)", {"x": "s"}, ERROR),
        ("!(x && false)", {"x": 1}, True),
        ("!(x == 1)", {"x": True}, True),
        ("!(x == 1)", {"x": 1.0}, False),
        ("!(x != 'a')", {"x": 1}, False),
        ("!(x == r.y)", {"x": "a", "r": {"y": "a"}}, False),
        ("!(r.a == r.b)", {"r": {"a": 1, "b": 1.0}}, False),
        ("!(r.a != r.b)", {"r": {"a": [1], "b": [1]}}, True),
        ("!(r.a == 1)", {"r": {}}, ERROR),
        ("!!(r.a == 1)", {"r": {"a": 1}}, True),
        ("!(has(r.a) && r.a != '')", {"r": {"a": ""}}, True),
        ("!(has(r.a) && r.a != '')", {"r": {"a": "x"}}, False),
        ("!(has(r.a) && r.a != '')", {"r": {}}, True),
        ("!(!has(r.a) || !(r.a > 1))", {"r": {"a": 2}}, True),
    ],
)
def test_negation_keeps_cel_semantics(source: str, activation: dict[str, Any], expected: Any) -> None:
    outcome = _outcome(source, activation)
    assert outcome is expected if expected is ERROR or isinstance(expected, bool) else outcome == expected


def test_logic_matches_a_reference_model_for_every_mix_of_outcomes() -> None:
    """Every sequence of 2-5 terms drawn from true, false, an error and a non-bool, for && and ||."""
    terms = {"r.t": True, "r.f": False, "r.missing": "no such key: missing", "r.s": "applied to (string)"}
    activation = {"r": {"t": True, "f": False, "s": "text"}}
    checked = 0
    for op, decisive in (("&&", False), ("||", True)):
        for count in range(2, 6):
            for combination in itertools.product(terms, repeat=count):
                source = f" {op} ".join(combination)
                outcomes = [terms[t] for t in combination]
                expr = compile_expression(source, ENV)
                # The negation is compiled by De Morgan's law; it must agree with negating the result.
                negated = compile_expression(f"!({source})", ENV)
                if decisive in outcomes:
                    assert expr.evaluate(activation) is decisive, source
                    assert negated.evaluate(activation) is (not decisive), source
                elif all(o is (not decisive) for o in outcomes):
                    assert expr.evaluate(activation) is (not decisive), source
                    assert negated.evaluate(activation) is decisive, source
                else:
                    first_failure = next(o for o in outcomes if isinstance(o, str))
                    with pytest.raises(EvaluationError) as caught:
                        expr.evaluate(activation)
                    assert first_failure in str(caught.value), source
                    with pytest.raises(EvaluationError):
                        negated.evaluate(activation)
                checked += 1
    assert checked == 2 * sum(4**n for n in range(2, 6))


def test_long_logic_chains_are_flat() -> None:
    source = " && ".join(f"r.f{i} == {i}" for i in range(300))
    expr = compile_expression(source, ENV)
    assert expr.evaluate({"r": {f"f{i}": i for i in range(300)}}) is True
    assert expr.evaluate({"r": {f"f{i}": i if i != 150 else -1 for i in range(300)}}) is False


# -- macros ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("[1, 2, 3].exists(v, v > 2)", True),
        ("[1, 2, 3].exists(v, v > 3)", False),
        ("[].exists(v, v)", False),
        ("[1, 2, 3].all(v, v > 0)", True),
        ("[1, 2, 3].all(v, v > 1)", False),
        ("[].all(v, false)", True),
        ("[1, 2, 3].exists_one(v, v > 2)", True),
        ("[1, 2, 3].exists_one(v, v > 1)", False),
        ("[1, 2, 3].map(v, v * 10)", [10, 20, 30]),
        ("[1, 2, 3].map(v, v > 1, v * 10)", [20, 30]),
        ("[1, 2, 3, 4].filter(v, v % 2 == 0)", [2, 4]),
        ("{'a': 1, 'bb': 2}.all(k, k.size() <= 2)", True),
        ("{'a': 1, 'bb': 2}.exists(k, k == 'bb')", True),
        ("{'a': 1, 'bb': 2}.map(k, k + '!')", ["a!", "bb!"]),
        ("[[1, 2], [3]].exists(l, l.exists(v, v == 3))", True),
        ("[1, 2].map(v, [3, 4].map(w, v * w))", [[3, 4], [6, 8]]),
        ("[0, 1].exists(v, 1 / v == 1)", True),
        ("[0, 1].all(v, 1 / v > 5)", False),
        ("r.tags.exists(t, t.startsWith('mcp_'))", True),
        ("r.tags.filter(t, t.endsWith('_x')).size()", 1),
        ("r.tags.exists(r, r == 'mcp_a')", True),
        ("lists.side_effects.exists(lists, lists == 'email')", True),
    ],
)
def test_macros(source: str, expected: Any) -> None:
    value = evaluate(source, r={"tags": ["mcp_a", "b_x"]})
    if isinstance(expected, list):
        assert [list(v) if isinstance(v, list | tuple) else v for v in value] == expected
    else:
        assert value == expected


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("[0, 1].exists(v, 1 / v == 5)", "division by zero"),
        ("[0, 1].all(v, 1 / v == 1)", "division by zero"),
        ("[0, 1].exists_one(v, 1 / v == 1)", "division by zero"),
        ("[1, 'a'].map(v, v + 1)", "no such overload"),
        ("[1, 2].filter(v, v)", "no such overload"),
        ("[1, 2].exists(v, v)", "no such overload"),
        ("x.exists(v, v)", "exists() needs a list or a map, got int"),
    ],
)
def test_macro_errors(source: str, message: str) -> None:
    assert message in str(evaluation_error(source, x=5))


def test_macro_variable_does_not_leak_into_the_activation() -> None:
    activation: dict[str, Any] = {"r": {"tags": [1, 2]}}
    compile_expression("r.tags.all(v, v > 0)", ENV).evaluate(activation)
    assert activation == {"r": {"tags": [1, 2]}}


# -- functions -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("size('héllo')", 5),
        ("'héllo'.size()", 5),
        ("size([1, 2, 3])", 3),
        ("size({'a': 1})", 1),
        ("int('-42')", -42),
        ("int(3.9)", 3),
        ("int(-3.9)", -3),
        ("int(7u)", 7),
        ("uint(7)", 7),
        ("uint('12')", 12),
        ("double(2)", 2.0),
        ("double('2.5')", 2.5),
        ("double('1e3')", 1000.0),
        ("string(42)", "42"),
        ("string(-3)", "-3"),
        ("string(7u)", "7"),
        ("string(true)", "true"),
        ("string(1.5)", "1.5"),
        ("string(2.0)", "2"),
        ("string(1e21)", "1e+21"),
        ("string(123456.0)", "123456"),
        ("string(1234567.0)", "1.234567e+06"),
        ("string(-0.5)", "-0.5"),
        ("string(0.0001)", "0.0001"),
        ("string(0.00001)", "1e-05"),
        ("string('s')", "s"),
        ("bool('true')", True),
        ("bool('f')", False),
        ("dyn(1) == 1.0", True),
        ("'hello'.startsWith('he')", True),
        ("'hello'.startsWith('lo')", False),
        ("'hello'.endsWith('lo')", True),
        ("'hello'.contains('ell')", True),
        ("'hello'.contains('')", True),
        ("'hello'.matches('^h.*o$')", True),
        ("'hello'.matches('ell')", True),
        ("'hello'.matches('^ell')", False),
        ("matches('abc123', '[0-9]+')", True),
        ("'x1'.matches('\\\\d')", True),
        ("'HeLLo Wörld'.lowerAscii()", "hello wörld"),
        ("'straße'.upperAscii()", "STRAßE"),
        ("duration('5m')", 300.0),
        ("duration('1h30m')", 5400.0),
        ("duration('1.5s')", 1.5),
        ("duration('-2m')", -120.0),
        ("duration('0')", 0.0),
        ("duration('250ms')", 0.25),
    ],
)
def test_functions(source: str, expected: Any) -> None:
    value = evaluate(source)
    assert value == expected
    assert type(value) is type(expected) or isinstance(value, UInt)


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        ("(a)\\\\2", "backreferences"),
        ("(?P<x>a)(?P=x)", "named backreferences"),
        ("(?<=a)b", "lookbehind"),
        ("(?<!a)b", "lookbehind"),
        ("a(?!b)", "lookahead"),
        ("(?>a+)b", "atomic groups"),
        ("(a)?(?(1)b|c)", "conditional groups"),
        ("a++", "bad repetition operator"),
        ("a{2}{3}", "bad repetition operator"),
        ("*a", "no argument for repetition operator"),
        ("a{1001}", "invalid repetition size"),
        ("(", "invalid regular expression"),
        ("a" * 1001, "longer than 1000 characters"),
    ],
)
def test_literal_patterns_are_checked_at_compile_time(pattern: str, message: str) -> None:
    error = compile_error(f"r.s.matches('{pattern}')")
    assert (error.line, error.col) == (1, 13)
    assert message in error.detail


@pytest.mark.parametrize(
    ("pattern", "text", "expected"),
    [
        ("(?i)^abc$", "ABC", True),
        ("(?P<word>ab)+c", "ababc", True),
        ("(?<word>ab)+c", "ababc", True),
        ("[(]+x", "((x", True),
        ("x{2,}", "axxb", True),
        ("(ab){2,}", "abab", True),
        ("a*?b", "aab", True),
        ("\\\\d+", "no digits", False),
        ("\\\\d", "\u0661", False),
        ("end\\\\z", "the end", True),
        ("end\\\\z", "end\n", False),
        ("end$", "end\n", False),
        ("end$", "the end", True),
        ("(?m)^b$", "a\nb\nc", True),
        ("[$]", "cost: $", True),
    ],
)
def test_accepted_patterns_match_like_re2(pattern: str, text: str, expected: bool) -> None:
    assert evaluate(f"x.matches('{pattern}')", x=text) is expected
    assert evaluate("x.matches(r.p)", x=text, r={"p": pattern.replace("\\\\", "\\")}) is expected


# Patterns that make a backtracking engine take time exponential in the key: under
# Python's re each of these runs for hours on a 41-character key that matches at
# first and then fails. The timeout marker is the failure signal; the assertions
# check the answer, which RE2 gives in time linear in the key.
@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("pattern", "key"),
    [
        ("^(a|a)*$", "a" * 41 + "!"),
        ("^(a|aa)*$", "a" * 41 + "!"),
        ("^(a+)+$", "a" * 41 + "!"),
        ("(x+x+)+y", "x" * 41),
        ("^((ab)*c?)*$", "ab" * 30 + "!"),
        ("^(?:a|b+)*c", "b" * 41),
        ("^(\\\\w+\\\\s?)*$", "payment " * 8 + "!"),
    ],
)
def test_backtracking_patterns_answer_in_linear_time(pattern: str, key: str) -> None:
    assert evaluate(f"x.matches('{pattern}')", x=key) is False
    assert evaluate("x.matches(r.p)", x=key, r={"p": pattern.replace("\\\\", "\\")}) is False
    # The same patterns still match what they describe.
    matching = key[:-1] if key.endswith("!") else key + "y"
    if not pattern.startswith("^(?:a|b+)*c"):
        assert evaluate(f"x.matches('{pattern}')", x=matching) is True


def test_re2_syntax_beyond_pythons_re_is_understood() -> None:
    assert evaluate("x.matches('a(?i)bc')", x="aBC") is True
    assert evaluate("x.matches('^\\\\p{Greek}+$')", x="\u03b1\u03b2") is True
    assert evaluate("x.matches('^[[:digit:]]+$')", x="123") is True
    # A lone surrogate (a CEL escape can write one) is matched, not an encoding crash.
    assert evaluate("x.matches('a')", x="\ud800a") is True


# A number or duration grammar that splits a digit run many ways makes a failed match
# quadratic in the run: a 100,000-digit string took minutes.
@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("double(x)", "double() cannot parse"),
        ("duration(x)", "duration() cannot parse"),
    ],
)
def test_number_grammars_fail_in_linear_time(source: str, message: str) -> None:
    assert message in str(evaluation_error(source, x="1" * 100_000 + "x"))


def test_uint_conversion_results_are_uint() -> None:
    assert isinstance(evaluate("uint(7)"), UInt)
    assert isinstance(evaluate("7u + 1u"), UInt)


@pytest.mark.parametrize(
    ("source", "activation", "message"),
    [
        ("int(x)", {"x": "12abc"}, "int() cannot parse"),
        ("int(x)", {"x": " 12"}, "int() cannot parse"),
        ("int(x)", {"x": "1_000"}, "int() cannot parse"),
        ("int(x)", {"x": "9223372036854775808"}, "int overflow"),
        ("int(x)", {"x": -9223372036854775808.0}, "int() overflow"),
        ("uint(x)", {"x": "-1"}, "uint() cannot parse"),
        ("double(x)", {"x": "1e400"}, "double() overflow"),
        ("double(x)", {"x": " 1.5"}, "double() cannot parse"),
        ("x % -1", {"x": -(2**63)}, "int overflow"),
        ("int(x)", {"x": 1e19}, "int() overflow"),
        ("int(x)", {"x": float("nan")}, "int() overflow"),
        ("int(x)", {"x": UInt(2**63)}, "int overflow"),
        ("uint(x)", {"x": -1}, "uint() overflow"),
        ("double(x)", {"x": "1_000"}, "double() cannot parse"),
        ("bool(x)", {"x": "yes"}, "bool() cannot parse"),
        ("duration(x)", {"x": "5 minutes"}, "duration() cannot parse"),
        ("x.matches('a')", {"x": "a" * 100_001}, "longer than 100000 characters"),
        ("'abc'.matches(x)", {"x": "(a)\\1"}, "backreferences"),
        ("'abc'.matches(x)", {"x": "(unclosed"}, "invalid regular expression"),
        ("x.lowerAscii()", {"x": 1}, "no such overload: lowerAscii applied to (int)"),
    ],
)
def test_function_errors(source: str, activation: dict[str, Any], message: str) -> None:
    assert message in str(evaluation_error(source, **activation))


def test_extra_functions_get_evaluated_arguments() -> None:
    calls: list[tuple[Any, ...]] = []

    def time_derived(key: Any, time: Any) -> bool:
        calls.append((key, time))
        return isinstance(key, str) and key.endswith(str(time))

    def broken(value: Any) -> Any:
        raise ValueError(f"cannot use {value}")

    def refuses(value: Any) -> Any:
        raise EvaluationError("timeDerived() needs a string")

    env = Environment(
        variables={"record": "map"},
        functions={"timeDerived": (time_derived, 2), "broken": (broken, 1), "refuses": (refuses, 1)},
    )
    expr = compile_expression("timeDerived(record.idempotency_key, record.time)", env)
    assert expr.evaluate({"record": {"idempotency_key": "k-2024", "time": 2024}}) is True
    assert calls == [("k-2024", 2024)]
    error = evaluation_error("broken(record.secret)", env, record={"secret": "hunter2"})
    assert str(error) == "broken() failed with ValueError"
    assert "timeDerived() needs a string" in str(evaluation_error("refuses(1)", env))
    assert "takes 2 arguments, got 1" in compile_error("timeDerived(record.a)", env).detail


# -- compile-time errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "line", "col", "message"),
    [
        ("record.reslt", 1, 8, "'record' has no field 'reslt' (did you mean 'result'?)"),
        ("has(record.reslt_ref)", 1, 12, "did you mean 'result_ref'?"),
        ("record['knd'] == 'x'", 1, 8, "'record' has no field 'knd' (did you mean 'kind'?)"),
        ("recrod.kind", 1, 1, "undeclared reference to 'recrod' (did you mean 'record'?)"),
        ("nobody", 1, 1, "undeclared reference to 'nobody'"),
        ("lists.nondeterminstic", 1, 7, "'lists' has no key 'nondeterminstic' (did you mean 'nondeterministic'?)"),
        ("sise(record.kind)", 1, 1, "unknown function 'sise' (did you mean 'size'?)"),
        ("record.kind.startWith('a')", 1, 13, "unknown method 'startWith' (did you mean 'startsWith'?)"),
        ("startsWith('a', 'b')", 1, 1, "startsWith() is a method"),
        ("size(1, 2)", 1, 1, "size() takes 1 argument, got 2"),
        ("'a'.size(1)", 1, 5, "size() takes no arguments, got 1"),
        ("'a' + 1", 1, 5, "no matching overload for '+' applied to (string, int)"),
        ("1 + 1.0", 1, 3, "convert one side with int() or double()"),
        ("1 && true", 1, 1, "'&&' needs a bool, but this is an int"),
        ("true || 'x'", 1, 9, "'||' needs a bool, but this is a string"),
        ("!1", 1, 2, "'!' needs a bool"),
        ("-'a'", 1, 1, "no matching overload for unary '-'"),
        ("'a' < 1", 1, 5, "no matching overload for '<' applied to (string, int)"),
        ("[1] < [2]", 1, 5, "no matching overload for '<'"),
        ("1 in 2", 1, 3, "'in' needs a list or a map"),
        ("'abc'.startsWith(1)", 1, 7, "no matching overload for startsWith() applied to (string, int)"),
        ("1 ? 2 : 3", 1, 1, "the condition of '? :' needs a bool"),
        ("now.field", 1, 5, "cannot select field 'field': 'now' is an int"),
        ("'abc'.field", 1, 7, "cannot select field 'field' on a string"),
        ("{1.5: 'a'}", 1, 2, "a map key must be a string, int, uint or bool"),
        ("[1].exists(1, true)", 1, 12, "first argument of exists() must be a variable name"),
        ("[1].all(v)", 1, 5, "all() takes a variable name and a condition"),
        ("has(record)", 1, 1, "has() takes one field selection"),
        ("5.exists(v, true)", 1, 3, "exists() needs a list or a map, not int"),
        ("r.s.matches('(a)\\\\1')", 1, 13, "backreferences"),
        ("r.s.matches('(?=a)')", 1, 13, "lookahead"),
        ("r.s.matches('a{2}{3}')", 1, 13, "bad repetition operator"),
        ("r.s.matches('[')", 1, 13, "invalid regular expression"),
        ("duration('5 minutes')", 1, 1, "duration() cannot parse"),
        ("int('abc')", 1, 1, "int() cannot parse"),
        ("1 +", 1, 4, "expression ended early"),
        ("(1 + 2", 1, 7, "expected ')'"),
        ("1 2", 1, 3, "unexpected '2'"),
        ("record.", 1, 8, "expected a field or method name"),
        ("a = 1", 1, 3, "use '==' to compare"),
        ("1 # 2", 1, 3, "unexpected character '#'"),
        ("'unterminated", 1, 1, "unterminated string literal"),
        ("'a\nb'", 1, 1, "newline needs a triple-quoted string"),
        ("'\\q'", 1, 2, "invalid escape sequence '\\q'"),
        ("'\\x4'", 1, 2, "needs 2 hex digits"),
        ("'\\uD800'", 1, 2, "not a Unicode scalar value"),
        ("b'bytes'", 1, 1, "bytes literals are not supported"),
        ("9223372036854775808", 1, 1, "int literal is out of range"),
        ("-(9223372036854775808)", 1, 3, "int literal is out of range"),
        ("18446744073709551616u", 1, 1, "uint literal is out of range"),
        ("1e999", 1, 1, "double literal is out of range"),
        ("0x", 1, 1, "hexadecimal literal has no digits"),
        ("12abc", 1, 1, "invalid number literal"),
        ("if", 1, 1, "'if' is a reserved word"),
        ("", 1, 1, "empty expression"),
        ("  // only a comment", 1, 1, "empty expression"),
        (".record", 1, 1, "qualified names starting with '.'"),
        ("[1, 2", 1, 6, "expression ended early"),
        ("{'a' 1}", 1, 6, "':' between a map key and its value"),
        ("f(1,)", 1, 5, "unexpected ')'"),
        ("true ? false ? 1 : 2 : 3", 1, 14, "expected ':' of the conditional"),
    ],
)
def test_compile_errors_point_at_the_offending_token(source: str, line: int, col: int, message: str) -> None:
    error = compile_error(source)
    assert (error.line, error.col) == (line, col), error
    assert message in error.detail
    assert str(error) == f"{line}:{col}: {error.detail}"


def test_compile_errors_in_multi_line_expressions() -> None:
    source = 'record.kind == "write"\n  && has(record.idempotency_key)\n  && record.atempts > 3'
    error = compile_error(source)
    assert (error.line, error.col) == (3, 13)
    assert error.detail == "'record' has no field 'atempts' (did you mean 'attempts'?)"

    error = compile_error("record.status == 'ok' &&\n\t'a' +\n\t\t1")
    assert (error.line, error.col) == (2, 6)

    error = compile_error("record.kind in [\n  'a',\n  'b'\n")
    assert (error.line, error.col) == (4, 1)
    assert "expression ended early" in error.detail

    error = compile_error("'''first\nsecond''' + \n  \"x\" + sise('a')")
    assert (error.line, error.col) == (3, 9)


def test_fields_are_free_for_variables_without_known_fields() -> None:
    assert evaluate("first.anything_at_all", first={"anything_at_all": 1}) == 1


def test_typo_suggestion_only_when_close() -> None:
    assert "did you mean" not in compile_error("record.zzzzzz").detail
    assert "did you mean 'status'" in compile_error("record.statsu").detail
    assert "did you mean 'record'" in compile_error("recor").detail


# -- bounds ----------------------------------------------------------------------------------------


def test_source_length_limit() -> None:
    assert evaluate("1" + " " * 9_999) == 1  # exactly at the limit
    long_source = "1 + " * 2500 + "1"
    assert len(long_source) > 10_000
    error = compile_error(long_source)
    assert "limit is 10000" in error.detail


@pytest.mark.parametrize(
    "source",
    [
        "(" * 150 + "1" + ")" * 150,
        "[" * 150 + "]" * 150,
        "!" * 150 + "true",
        "-" * 150 + "1",
        "1" + " + 1" * 150,
        "f(" * 150 + ")" * 150,
        "{'a': " * 150 + "1" + "}" * 150,
        "x" + ".a" * 150,
        "true ? 1 : " * 150 + "2",
        "[1]" + ".map(v, [v]" * 150 + ")" * 150,
    ],
)
def test_deep_nesting_is_an_expression_error(source: str) -> None:
    error = compile_error(source)
    assert "nests deeper than 100 levels" in error.detail


def test_nesting_at_the_limit() -> None:
    assert evaluate("(" * 99 + "1" + ")" * 99) == 1
    assert "nests deeper" in compile_error("(" * 100 + "1" + ")" * 100).detail
    nested = evaluate("[" * 99 + "]" * 99)
    non_empty_levels = 0
    while nested:
        nested = nested[0]
        non_empty_levels += 1
    assert non_empty_levels == 98
    assert "nests deeper" in compile_error("[" * 101 + "]" * 101).detail


def test_comparing_deeply_nested_values_is_an_evaluation_error_not_a_crash() -> None:
    deep: Any = 1
    for _ in range(500):
        deep = [deep]
    error = evaluation_error("r.a == r.b", r={"a": deep, "b": deep})
    assert "nest more than 100 levels" in str(error)
    shallow: Any = 1
    for _ in range(50):
        shallow = {"k": [shallow]}
    assert evaluate("r.a == r.b", r={"a": shallow, "b": shallow}) is True


def test_nesting_below_the_limit_compiles() -> None:
    assert evaluate("(" * 90 + "1" + ")" * 90) == 1
    assert evaluate("1" + " + 1" * 90) == 91
    assert evaluate("!" * 90 + "true") is True


# -- references --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "references"),
    [
        (TYPICAL_CONDITION, {("record", f) for f in ("kind", "status", "result", "result_ref")}),
        ("first.plan_version != record.plan_version", {("first", "plan_version"), ("record", "plan_version")}),
        ("record['kind'] == 'x'", {("record", "kind")}),
        ("size(record) > 2", {("record", WHOLE_VALUE)}),
        ("r[x] == 1", {("r", WHOLE_VALUE), ("x", WHOLE_VALUE)}),
        ("now > 5", {("now", WHOLE_VALUE)}),
        ("r.tags.exists(t, t.name == first.name)", {("r", "tags"), ("first", "name")}),
        ("r.tags.exists(r, r.name == 'x')", {("r", "tags")}),
        ("r.a.b.c == 1", {("r", "a")}),
        ("record.kind in lists.nondeterministic", {("record", "kind")}),
        ("1 + 2 == 3", set()),
    ],
)
def test_references(source: str, references: set[tuple[str, str]]) -> None:
    assert WHOLE_VALUE == "*"
    assert compile_expression(source, ENV).references == frozenset(references)


# -- constant folding ----------------------------------------------------------------------------------


def test_constants_are_folded_and_need_no_activation() -> None:
    expr = compile_expression("record.kind in lists.nondeterministic", ENV)
    # "lists" is absent from the activation: its value was folded in at compile time.
    assert expr.evaluate({"record": {"kind": "llm_call"}}) is True
    assert expr.evaluate({"record": {"kind": "write"}}) is False
    assert expr.evaluate({"record": {"kind": 7}}) is False
    assert expr.evaluate({"record": {"kind": ["llm_call"]}}) is False
    assert compile_expression("lists.nondeterministic", ENV).evaluate({}) == tuple(NONDETERMINISTIC)
    assert compile_expression("size(lists.side_effects) * 2 + 1", ENV).evaluate({}) == 7


def test_constants_are_copied_at_environment_creation() -> None:
    kinds = ["a", "b"]
    env = Environment(variables={"record": "map"}, constants={"lists": {"kinds": kinds}})
    expr = compile_expression("record.kind in lists.kinds", env)
    kinds.append("c")
    assert expr.evaluate({"record": {"kind": "c"}}) is False
    assert expr.evaluate({"record": {"kind": "b"}}) is True


def test_constant_membership_keeps_cel_equality_for_other_element_types() -> None:
    env = Environment(variables={"x": "dyn"}, constants={"c": {"nums": [1, 2.5], "flags": [True], "keys": {"a": 1}}})
    assert evaluate("x in c.nums", env, x=1.0) is True
    assert evaluate("x in c.nums", env, x=True) is False
    assert evaluate("x in c.flags", env, x=1) is False
    assert evaluate("x in c.flags", env, x=True) is True
    assert evaluate("x in c.keys", env, x="a") is True
    assert evaluate("x in c.keys", env, x="b") is False


def test_folded_errors_keep_cel_semantics() -> None:
    assert evaluate("false && 1 / 0 == 1") is False
    assert evaluate("1 / 0 == 1 || true") is True
    assert "division by zero" in str(evaluation_error("1 / 0 == 1"))
    assert "repeated key in map literal" in str(evaluation_error("{'a': 1, 'a': 2}"))


def test_has_on_a_constant_map_is_folded() -> None:
    assert evaluate("has(lists.nondeterministic)") is True
    assert evaluate("has(lists.unknown)") is False


# -- the environment ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"variables": {"record": "object"}}, "unknown type 'object'"),
        ({"variables": {"in": "map"}}, "not a valid CEL identifier"),
        ({"variables": {"record": "map"}, "known_fields": {"rec": None}}, "not a declared variable"),
        ({"variables": {}, "constants": {"c": object()}}, "unsupported Python type"),
        ({"variables": {}, "constants": {"c": {1.5: "x"}}}, "a key of type double"),
        ({"variables": {"lists": "int"}, "constants": {"lists": {}}}, "declared 'int'"),
        ({"variables": {}, "functions": {"size": (len, 1)}}, "would hide the built-in"),
        ({"variables": {}, "functions": {"f": (len, -1)}}, "(callable, arity >= 0)"),
    ],
)
def test_environment_rejects_bad_declarations(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Environment(**kwargs)


def test_compile_rejects_non_string_source() -> None:
    with pytest.raises(ExpressionError, match="must be a string"):
        compile_expression(42, ENV)  # type: ignore[arg-type]


def test_activation_may_be_any_mapping() -> None:
    class Frozen(Mapping[str, Any]):
        def __init__(self, data: dict[str, Any]) -> None:
            self.data = data

        def __getitem__(self, key: str) -> Any:
            return self.data[key]

        def __iter__(self) -> Any:
            return iter(self.data)

        def __len__(self) -> int:
            return len(self.data)

    activation = Frozen({"record": Frozen({"kind": "llm_call", "status": "ok"})})
    assert compile_expression(TYPICAL_CONDITION, ENV).evaluate(activation) is True
    assert compile_expression("[1, 2].exists(v, v == 2)", ENV).evaluate(activation) is True


# -- a conformance-style cross-check --------------------------------------------------------------------------

# (expression, activation, expected). Written from the CEL language definition;
# activations use the variables declared in ENV (r and x).
CONFORMANCE: list[tuple[str, dict[str, Any], Any]] = [
    # integer and double arithmetic
    ("1 + 2 * 3 - 4", {}, 3),
    ("17 / 5", {}, 3),
    ("-17 / 5", {}, -3),
    ("-17 % 5", {}, -2),
    ("17 % -5", {}, 2),
    ("0x7fffffffffffffff", {}, 9223372036854775807),
    ("9223372036854775807 + 1", {}, ERROR),
    ("-9223372036854775808 - 1", {}, ERROR),
    ("9223372036854775807 * 2", {}, ERROR),
    ("1 / 0", {}, ERROR),
    ("5 % 0", {}, ERROR),
    ("3u * 4u", {}, UInt(12)),
    ("0u - 1u", {}, ERROR),
    ("2.5 + 0.5", {}, 3.0),
    ("1.0 / 4.0", {}, 0.25),
    ("-(3.5)", {}, -3.5),
    ("x + 1.0", {"x": 1}, ERROR),
    # strings
    ("'ab' + 'cd'", {}, "abcd"),
    ("size('\u00e9t\u00e9')", {}, 3),
    ("'abc' < 'abd'", {}, True),
    ("'a' < 'B'", {}, False),
    ("'hello'.contains('ll')", {}, True),
    ("'hello'.startsWith('hel')", {}, True),
    ("'hello'.endsWith('x')", {}, False),
    ("'foobar'.matches('o+b')", {}, True),
    ("'foobar'.matches('^o+b')", {}, False),
    ("'\\x48\\u0069'", {}, "Hi"),
    ("r'\\x48'", {}, "\\x48"),
    ("'''a\"b'''", {}, 'a"b'),
    # equality and ordering
    ("1 == 1", {}, True),
    ("1 != 2", {}, True),
    ("2.0 == 2", {}, True),
    ("2u == 2.0", {}, True),
    ("'1' == 1", {}, False),
    ("null == false", {}, False),
    ("[1, 2, 3] == [1, 2, 3]", {}, True),
    ("[1, 2] != [1, 2, 3]", {}, True),
    ("{'k': 'v'} == {'k': 'v'}", {}, True),
    ("{'k': 'v'} == {'k': 'w'}", {}, False),
    ("1 < 2.5", {}, True),
    ("3.5 >= 3", {}, True),
    ("x < 1", {"x": "0"}, ERROR),
    ("x <= 'z'", {"x": 1}, ERROR),
    ("true > false", {}, True),
    # membership
    ("'b' in ['a', 'b']", {}, True),
    ("'z' in ['a', 'b']", {}, False),
    ("3 in [1, 2, 3]", {}, True),
    ("3.0 in [1, 2, 3]", {}, True),
    ("'k' in {'k': 1}", {}, True),
    ("'v' in {'k': 'v'}", {}, False),
    ("x in r.list", {"x": 2, "r": {"list": [1, 2]}}, True),
    # logic
    ("true && false", {}, False),
    ("false || true", {}, True),
    ("!true", {}, False),
    ("false && r.missing", {"r": {}}, False),
    ("r.missing && false", {"r": {}}, False),
    ("true || r.missing", {"r": {}}, True),
    ("r.missing || true", {"r": {}}, True),
    ("r.missing || false", {"r": {}}, ERROR),
    ("r.missing && true", {"r": {}}, ERROR),
    ("true ? 'y' : 'n'", {}, "y"),
    ("r.flag ? 1 : 2", {"r": {"flag": False}}, 2),
    # fields and presence
    ("r.a", {"r": {"a": 7}}, 7),
    ("r.b", {"r": {"a": 7}}, ERROR),
    ("has(r.a)", {"r": {"a": None}}, True),
    ("has(r.b)", {"r": {"a": None}}, False),
    ("has(r.a.b)", {"r": {"a": {"b": 1}}}, True),
    ("r.a.b", {"r": {"a": {"c": 1}}}, ERROR),
    ("r.list[1]", {"r": {"list": ["p", "q"]}}, "q"),
    ("r.list[5]", {"r": {"list": ["p", "q"]}}, ERROR),
    ("r['a']", {"r": {"a": 1}}, 1),
    # macros
    ("[1, 2, 3].exists(i, i == 2)", {}, True),
    ("[1, 2, 3].all(i, i < 3)", {}, False),
    ("[1, 2, 3].exists_one(i, i == 2)", {}, True),
    ("[1, 2, 2].exists_one(i, i == 2)", {}, False),
    ("[1, 2, 3].map(i, i + 1)", {}, [2, 3, 4]),
    ("[1, 2, 3].filter(i, i != 2)", {}, [1, 3]),
    ("r.list.all(s, s.size() == 1)", {"r": {"list": ["a", "b"]}}, True),
    ("{'a': 1, 'b': 2}.exists(k, k == 'b')", {}, True),
    ("[1, 0].exists(i, 10 / i == 10)", {}, True),
    ("[1, 0].all(i, 10 / i == 10)", {}, ERROR),
    # conversions
    ("int('123')", {}, 123),
    ("int(2.9)", {}, 2),
    ("int(x)", {"x": "abc"}, ERROR),
    ("double(3)", {}, 3.0),
    ("string(12)", {}, "12"),
    ("string(false)", {}, "false"),
    ("uint(3)", {}, UInt(3)),
    ("size([1, 2]) + size({'a': 1})", {}, 3),
    ("'ABC'.lowerAscii()", {}, "abc"),
]


def _normalize(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return [_normalize(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _normalize(v) for k, v in value.items()}
    return value


def _outcome(source: str, activation: dict[str, Any]) -> Any:
    try:
        return _normalize(compile_expression(source, ENV).evaluate(activation))
    except EvaluationError:
        return ERROR


def test_conformance_table_is_large_enough() -> None:
    assert len(CONFORMANCE) >= 60


@pytest.mark.parametrize(("source", "activation", "expected"), CONFORMANCE, ids=[c[0] for c in CONFORMANCE])
def test_conformance(source: str, activation: dict[str, Any], expected: Any) -> None:
    outcome = _outcome(source, activation)
    if expected is ERROR:
        assert outcome is ERROR
    else:
        assert outcome is not ERROR
        assert outcome == _normalize(expected)
        assert type(outcome) is type(expected)


# Where cel-python 0.5 departs from the CEL language definition, so the cross-check cannot agree.
CELPY_DEPARTURES = {
    # Numeric equality and ordering across int, uint and double (heterogeneous equality).
    "2.0 == 2",
    "2u == 2.0",
    "1 < 2.5",
    "3.5 >= 3",
    "3.0 in [1, 2, 3]",
    "'1' == 1",
    "null == false",
    # string(bool) gives Python's "False".
    "string(false)",
    # lowerAscii() belongs to CEL's strings extension, which cel-python lacks.
    "'ABC'.lowerAscii()",
}


def _celpy_outcome(celpy: Any, source: str, activation: dict[str, Any]) -> Any:
    env = celpy.Environment()
    try:
        program = env.program(env.compile(source))
        value = program.evaluate({k: celpy.json_to_cel(v) for k, v in activation.items()})
    except Exception:
        return ERROR
    if isinstance(value, Exception):
        return ERROR
    return _from_celpy(value)


def _from_celpy(value: Any) -> Any:
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, list | tuple):
        return [_from_celpy(v) for v in value]
    if isinstance(value, Mapping):
        return {_from_celpy(k): _from_celpy(v) for k, v in value.items()}
    return value


@pytest.mark.parametrize(
    ("source", "activation", "expected"),
    [c for c in CONFORMANCE if c[0] not in CELPY_DEPARTURES],
    ids=[c[0] for c in CONFORMANCE if c[0] not in CELPY_DEPARTURES],
)
def test_agrees_with_cel_python(source: str, activation: dict[str, Any], expected: Any) -> None:
    ours = _outcome(source, activation)
    theirs = _celpy_outcome(celpy, source, activation)
    assert (ours is ERROR) == (theirs is ERROR), (ours, theirs)
    if ours is not ERROR:
        assert ours == theirs


# Where the Rust-based binding departs from the CEL language definition or lacks a function.
RUST_BINDING_DEPARTURES = {
    # size() of a string counts UTF-8 bytes there; CEL counts code points.
    "size('\u00e9t\u00e9')",
    # string() conversion and lowerAscii() are not provided.
    "string(false)",
    "'ABC'.lowerAscii()",
}


@pytest.mark.parametrize(
    ("source", "activation", "expected"),
    [c for c in CONFORMANCE if c[0] not in RUST_BINDING_DEPARTURES],
    ids=[c[0] for c in CONFORMANCE if c[0] not in RUST_BINDING_DEPARTURES],
)
def test_agrees_with_rust_cel_binding(source: str, activation: dict[str, Any], expected: Any) -> None:
    ours = _outcome(source, activation)
    try:
        theirs = _normalize(rust_cel.evaluate(source, activation))
    except Exception:
        theirs = ERROR
    assert (ours is ERROR) == (theirs is ERROR), (ours, theirs)
    if ours is not ERROR:
        assert ours == theirs


# -- robustness: random input never escapes as anything but the two documented errors ---------------------

_ATOMS = [
    "1", "-2", "3u", "2.5", "0.0", "'s'", "''", "true", "false", "null", "[]", "[1, 'a']", "{}", "{'k': 1}",
    "r.i", "r.d", "r.s", "r.l", "r.m", "r.n", "r.b", "r.missing", "x", "r.l[0]", "r.m['k']", "r.m.k",
]  # fmt: skip
_BINARY = ["+", "-", "*", "/", "%", "==", "!=", "<", "<=", ">", ">=", "in", "&&", "||"]
_CALLS = [
    "size({})", "int({})", "uint({})", "double({})", "string({})", "bool({})", "dyn({})", "duration({})",
    "{}.startsWith({})", "{}.endsWith({})", "{}.contains({})", "{}.matches({})", "{}.lowerAscii()",
    "{}.exists(v, {})", "{}.all(v, {})", "{}.map(v, {})", "{}.filter(v, {})", "{}.exists_one(v, {})",
    "has({}.k)", "!{}", "-{}", "({})", "[{}, {}]", "{{'a': {}}}", "{} ? {} : {}", "{}[{}]",
]  # fmt: skip
_ROBUSTNESS_ACTIVATION = {
    "r": {"i": 7, "d": 1.5, "s": "text", "l": [1, "two", None], "m": {"k": "v"}, "n": None, "b": True},
    "x": UInt(3),
}


def _random_expression(rng: random.Random, depth: int) -> str:
    if depth <= 0 or rng.random() < 0.3:
        return rng.choice(_ATOMS)
    if rng.random() < 0.5:
        return f"{_random_expression(rng, depth - 1)} {rng.choice(_BINARY)} {_random_expression(rng, depth - 1)}"
    template = rng.choice(_CALLS)
    return template.format(*(_random_expression(rng, depth - 1) for _ in range(template.count("{}"))))


def test_random_expressions_raise_only_documented_errors() -> None:
    rng = random.Random(20261129)
    outcomes = {"value": 0, "compile error": 0, "evaluation error": 0}
    for _ in range(3000):
        source = _random_expression(rng, 4)
        try:
            expr = compile_expression(source, ENV)
        except ExpressionError:
            outcomes["compile error"] += 1
            continue
        try:
            expr.evaluate(_ROBUSTNESS_ACTIVATION)
            expr.predicate(_ROBUSTNESS_ACTIVATION)
            outcomes["value"] += 1
        except EvaluationError:
            outcomes["evaluation error"] += 1
    # The generator must exercise all three outcomes, or the test proves little.
    assert all(count > 100 for count in outcomes.values()), outcomes


def test_random_garbage_raises_only_expression_errors() -> None:
    rng = random.Random(7)
    alphabet = "abr.()[]{}'\"\\,:?!<>=&|+-*/%0123456789 \n\tux_"
    compiled = 0
    for _ in range(3000):
        source = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        try:
            compile_expression(source, ENV)
            compiled += 1
        except ExpressionError as error:
            assert error.line >= 1
            assert error.col >= 1
    assert compiled < 3000
