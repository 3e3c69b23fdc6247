"""Rule cost is bounded: estimated and refused when a rule loads, counted and cut off while it runs."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from processor.cli import main
from processor.errors import EvaluationError, ExpressionError
from processor.evaluate.cel import BudgetExceeded, CostLimits, Environment, compile_expression
from processor.evaluate.engine import Engine, EngineOptions
from processor.evaluate.rulefmt import lint, load_rules
from processor.telemetry import Telemetry
from tests._engine_util import log_line

ENV = Environment(variables={"record": "map"})

# The rule of the report: all/exists eight deep over ten-item lists, about 400 bytes of YAML.
TEN = "[0,1,2,3,4,5,6,7,8,9]"
NESTED = (
    f"{TEN}.all(a, {TEN}.exists(b, {TEN}.all(c, {TEN}.exists(d, {TEN}.all(e, {TEN}.exists(f, "
    f"{TEN}.all(g, {TEN}.exists(h, a+b+c+d+e+f+g+h < size(record.kind)))))))))"
)
NESTED_RULE = f"""\
version: 1
rules:
  - id: ACME9
    name: nested
    severity: info
    condition: >-
      {NESTED}
    message: hit
"""


def test_the_reported_rule_is_a_small_file() -> None:
    assert len(NESTED_RULE.encode()) < 400


def test_nested_macros_are_refused_at_compile_time_at_the_outer_macro() -> None:
    with pytest.raises(ExpressionError) as caught:
        compile_expression(NESTED, ENV)
    error = caught.value
    assert (error.line, error.col) == (1, len(TEN) + 2)  # the outermost ".all("
    assert "more than the limit of 1,000,000" in error.detail
    assert "8 comprehension macros nested" in error.detail


def test_estimates_grow_with_nesting_and_list_sizes() -> None:
    one = compile_expression("record.items.exists(a, a == 1)", ENV).cost
    two = compile_expression("record.items.exists(a, record.items.exists(b, a == b))", ENV).cost
    literal = compile_expression("[1, 2, 3].exists(a, a == record.n)", ENV).cost
    flat = compile_expression("record.kind == 'payment' && has(record.result)", ENV).cost
    assert flat < 10
    assert 100 < one < 1_000  # a record list counts as 100 items
    assert two > 100 * one // 2
    assert literal < 30  # a literal list counts as its own size
    # String scans count the characters they may read.
    assert compile_expression("record.key.matches('^a+$')", ENV).cost > 100


def test_limits_are_configurable() -> None:
    source = "record.items.exists(a, record.items.exists(b, a == b))"
    tight = Environment(variables={"record": "map"}, limits=CostLimits(max_cost=10_000))
    with pytest.raises(ExpressionError, match="more than the limit of 10,000"):
        compile_expression(source, tight)
    small_lists = Environment(variables={"record": "map"}, limits=CostLimits(max_cost=10_000, list_size=10))
    assert compile_expression(source, small_lists).cost <= 10_000
    roomy = Environment(variables={"record": "map"}, limits=CostLimits(max_cost=10**10))
    assert compile_expression(NESTED, roomy).cost > 10**8
    with pytest.raises(ValueError, match="iterations must be at least 1"):
        Environment(variables={"record": "map"}, limits=CostLimits(iterations=0))


def test_the_budget_bounds_one_evaluation_at_run_time() -> None:
    env = Environment(variables={"record": "map"}, limits=CostLimits(iterations=1_000))
    nested = compile_expression("record.items.exists(a, record.items.exists(b, a == -1))", env)
    assert nested.evaluate({"record": {"items": list(range(20))}}) is False  # 420 items visited
    with pytest.raises(BudgetExceeded, match="went over 1000 items"):
        nested.evaluate({"record": {"items": list(range(40))}})  # 1,640 items
    # An overrun is an EvaluationError: the engine treats it as any rule error.
    assert issubclass(BudgetExceeded, EvaluationError)
    # Each evaluation has its own budget: the failure above leaves nothing behind.
    assert nested.evaluate({"record": {"items": list(range(20))}}) is False


@pytest.mark.parametrize(
    "source",
    [
        "record.items.all(a, a >= 0)",
        "!record.items.exists(a, a < 0)",
        "record.items.exists_one(a, a < 0) || record.yes",
        "record.items.exists(a, a < 0 || record.items[0] > 0) || record.yes",
        "size(record.items.map(a, a + 1)) > 0",
        "size(record.items.filter(a, a >= 0)) > 0",
    ],
)
def test_every_macro_spends_the_budget_and_nothing_absorbs_an_overrun(source: str) -> None:
    env = Environment(variables={"record": "map"}, limits=CostLimits(iterations=50))
    expression = compile_expression(source, env)
    assert expression.evaluate({"record": {"items": list(range(50)), "yes": True}}) is True
    with pytest.raises(BudgetExceeded):
        # || would absorb an ordinary error next to a true term; an overrun ends the evaluation.
        expression.evaluate({"record": {"items": list(range(51)), "yes": True}})


@pytest.mark.timeout(60)
def test_a_deep_nesting_over_record_lists_stops_at_the_budget() -> None:
    # Estimated small (lists from records count as 3 items here), but the record holds 30:
    # 30^6 = 729 million visits without the budget; the default budget stops it at 100,000.
    env = Environment(variables={"record": "map"}, limits=CostLimits(list_size=3))
    body = "a + b + c + d + e + f < 0"
    for var in reversed("abcdef"):
        body = f"record.items.exists({var}, {body})"
    expression = compile_expression(body, env)
    with pytest.raises(BudgetExceeded, match="went over 100000 items"):
        expression.evaluate({"record": {"items": list(range(30))}})


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_rules_check_refuses_the_nested_rule_with_its_place(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, "nested.yaml", NESTED_RULE)
    problems = [str(p) for p in lint([path], include_shipped=False)]
    col = len("      ") + len(TEN) + 2
    assert len(problems) == 1
    assert problems[0].startswith(f"{path}:7:{col}: rule ACME9 (nested): condition: the expression may cost")
    assert main(["rules", "check", "--no-shipped", str(path)]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out
    assert f"{path}:7:{col}: rule ACME9 (nested)" in out


def test_rules_check_takes_the_limits_of_a_configuration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rule = _write(
        tmp_path,
        "two.yaml",
        NESTED_RULE.replace(NESTED, "record.tags.exists(a, record.tags.exists(b, a == b))").replace(
            "version: 1\n", "version: 1\nrecord_fields: [tags]\n"
        ),
    )
    assert main(["rules", "check", "--no-shipped", str(rule)]) == 0
    tight = _write(tmp_path, "tight.yaml", "evaluate:\n  rule_limits:\n    max_cost: 1000\n")
    assert main(["rules", "check", "--no-shipped", "--config", str(tight), str(rule)]) == 1
    assert "more than the limit of 1,000" in capsys.readouterr().out
    assert load_rules([rule], include_shipped=False, limits=CostLimits(max_cost=10**6)).rules


def test_shipped_rules_cost_little() -> None:
    # The shipped packs load under the defaults with room to spare (a tenth of the limit).
    assert load_rules([], limits=CostLimits(max_cost=100_000)).rules


OVERRUN_RULE = """\
version: 1
record_fields: [items]
rules:
  - id: ACME7
    name: pairs
    severity: warning
    condition: record.items.exists(a, record.items.exists(b, a + b == -1))
    message: hit
  - id: ACME8
    name: every-record
    severity: info
    condition: "true"
    message: seen
"""


def test_an_overrun_is_a_rule_error_counted_per_rule_and_logged_once_without_values(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rules = load_rules([_write(tmp_path, "r.yaml", OVERRUN_RULE)], include_shipped=False)
    tm = Telemetry()
    engine = Engine(rules, EngineOptions(), telemetry=tm)
    secret = "card-4111111111111111"
    # 400 items: 160,400 visits in the worst case, past the default budget of 100,000.
    big = [log_line(n, action_id=f"a{n}", items=[secret] * 0 + list(range(400)), note=secret) for n in (1, 2)]
    small = log_line(3, action_id="a3", items=[1, 2, 3])
    with caplog.at_level(logging.WARNING):
        out = engine.submit_many([*big, small]) + engine.finish()
    # The costly rule does not fire on the records it overran on; the other rule still runs on every record.
    assert sorted(v.rule for v in out) == ["ACME8", "ACME8", "ACME8"]
    assert engine.summary().rule_errors == {"ACME7": 2}
    assert tm.registry.get_sample_value("durable_check_rule_errors_total", {"rule": "ACME7"}) == 2
    warnings = [r.getMessage() for r in caplog.records if "ACME7" in r.getMessage()]
    assert len(warnings) == 1
    assert secret not in caplog.text
    assert "400" not in warnings[0]


REGEX_RULES = """\
version: 1
rules:
  - id: ACME5
    name: odd-key
    severity: warning
    condition: has(record.idempotency_key) && record.idempotency_key.matches('^(a|a)*$')
    message: odd key
  - id: ACME6
    name: nested-plus
    severity: warning
    condition: has(record.idempotency_key) && record.idempotency_key.matches('^(a+)+$')
    message: nested plus
"""


@pytest.mark.timeout(30)
def test_one_record_with_a_matching_then_failing_key_does_not_freeze_the_engine(tmp_path: Path) -> None:
    # Both rules passed the old load-time guard or were its only catch; under a backtracking
    # engine each of these records takes hours. The timeout marker is the failure signal.
    rules = load_rules([_write(tmp_path, "r.yaml", REGEX_RULES)], include_shipped=False)
    engine = Engine(rules, EngineOptions())
    hostile = [log_line(n, action_id=f"a{n}", idempotency_key="a" * (40 + n) + "!") for n in (1, 2, 3)]
    plain = log_line(4, action_id="a4", idempotency_key="a" * 50)
    out = engine.submit_many([*hostile, plain]) + engine.finish()
    assert sorted((v.rule, v.action_id) for v in out) == [("ACME5", "a4"), ("ACME6", "a4")]
    assert engine.summary().rule_errors == {}


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        ("(?=pay)", "lookahead (?=...) is not supported"),
        ("(?<!x)pay", "lookbehind (?<!...) is not supported"),
        ("(a)\\\\1", "backreferences (\\1) are not supported"),
    ],
)
def test_rules_check_refuses_a_pattern_re2_cannot_compile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], pattern: str, message: str
) -> None:
    text = REGEX_RULES.split("  - id: ACME6", maxsplit=1)[0].replace("^(a|a)*$", pattern)
    path = _write(tmp_path, "r.yaml", text)
    col = text.splitlines()[5].index("matches('") + len("matches(") + 1  # the pattern's opening quote
    expected = f"{path}:6:{col}: rule ACME5 (odd-key): condition: matches(): {message}"
    assert [str(p) for p in lint([path], include_shipped=False)] == [
        f"{expected} (CEL regular expressions are RE2's, matched in linear time)"
    ]
    assert main(["rules", "check", "--no-shipped", str(path)]) == 1
    assert expected in capsys.readouterr().out


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "source",
    [
        # Each would build about 1,000 lists of 2,000 items (or strings of 200,000 characters).
        "size(record.items.map(x, record.items + record.items)) > 0",
        "record.items.exists(x, size(record.items + record.items) < 0)",
        "record.items.exists(x, size(record.text + record.text) < 0)",
        # Each would compare about a million pairs in Python: a scan per item.
        "record.items.exists(x, x + 1000 in record.items)",
        "record.items.exists(x, record.items != record.items)",
    ],
)
def test_building_inside_a_macro_spends_the_budget(source: str) -> None:
    expression = compile_expression(source, ENV)
    big = {"record": {"items": list(range(1_000)), "text": "x" * 100_000}}
    with pytest.raises(BudgetExceeded):
        expression.evaluate(big)
    small = {"record": {"items": list(range(10)), "text": "x" * 100}}
    assert expression.evaluate(small) is ("map" in source)
    # Outside a macro a concatenation is linear in its operands and spends nothing.
    assert compile_expression("size(record.items + record.items)", ENV).evaluate(big) == 2_000


def test_membership_in_a_long_constant_list_spends_inside_a_macro() -> None:
    numbers = ",".join(str(n) for n in range(2_000))
    env = Environment(variables={"record": "map"}, limits=CostLimits(max_cost=10**9))
    expression = compile_expression(f"record.items.exists(x, x + 5000 in [{numbers}])", env)
    with pytest.raises(BudgetExceeded):
        expression.evaluate({"record": {"items": list(range(1_000))}})  # two million comparisons
    assert expression.evaluate({"record": {"items": list(range(10))}}) is False
    # Strings are looked up in a set: nothing to scan, nothing spent.
    strings = compile_expression("record.items.exists(x, x in lists.kinds)", Environment(
        variables={"record": "map"}, constants={"lists": {"kinds": [str(n) for n in range(2_000)]}}
    ))
    assert strings.evaluate({"record": {"items": ["x"] * 50_000}}) is False
