"""Compile a checked tree into nested Python closures.

Each node becomes one small function ``fn(activation) -> value``. Work that does
not depend on the record is done here, once: literals and constant paths are
folded, ``x in <constant list of strings>`` becomes a frozenset lookup, and the
shapes rules use most (``var.field``, ``var.field == "literal"``,
``has(var.field)``, ``!has(var.field)``, ``s.startsWith("literal")``,
``s.matches("literal")``) get fused closures that avoid a call level each.

Macro variables live in a copy of the activation made once per macro evaluation,
so every name is read the same way (``activation[name]``). That copy also carries
the evaluation's iteration budget (see :mod:`._cost`): the outermost macro opens it
and every macro nested in it spends from the same one, the size of its list or map
when it starts (one subtraction per macro call, not per item).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final, Protocol

from processor.errors import EvaluationError, ExpressionError
from processor.evaluate.cel._ast import (
    Binary,
    Call,
    Comprehension,
    Conditional,
    Has,
    Ident,
    Index,
    ListLit,
    Literal,
    Logic,
    MapLit,
    Node,
    Select,
    Unary,
)
from processor.evaluate.cel._checker import CheckResult
from processor.evaluate.cel._cost import BUDGET_KEY, BudgetExceeded, budget_exceeded
from processor.evaluate.cel._environment import Environment
from processor.evaluate.cel._functions import BUILTINS, compile_pattern, search
from processor.evaluate.cel._lexer import error_at
from processor.evaluate.cel._values import (
    NUMERIC_KINDS,
    add,
    contains,
    divide,
    equals,
    greater,
    greater_equal,
    has_field,
    index,
    iteration_items,
    kind,
    less,
    less_equal,
    logical_not,
    map_contains,
    modulo,
    multiply,
    negate,
    no_overload,
    not_equals,
    select,
    subtract,
)

Activation = Mapping[str, Any]
Fn = Callable[[Activation], Any]

_BINARY_IMPLS: Final[dict[str, Callable[[Any, Any], Any]]] = {
    "==": equals,
    "!=": not_equals,
    "<": less,
    "<=": less_equal,
    ">": greater,
    ">=": greater_equal,
    "in": contains,
    "+": add,
    "-": subtract,
    "*": multiply,
    "/": divide,
    "%": modulo,
}
_BOOL_BUILTINS: Final = frozenset({"startsWith", "endsWith", "contains", "matches", "bool"})
# Kinds of literal an equality compares by value alone (a module constant: mypyc cannot compile
# the starred tuple this was written in place).
_LITERAL_EQUALITY_KINDS: Final = frozenset({"string", "bool", "null_type", *NUMERIC_KINDS})


class Code:
    """A compiled node: its closure; when folded, its constant value; for ``name.field``, the pair."""

    __slots__ = ("fn", "is_const", "path", "value")

    def __init__(self, fn: Fn, is_const: bool = False, value: Any = None, path: tuple[str, str] | None = None) -> None:
        self.fn = fn
        self.is_const = is_const
        self.value = value
        # Set when the node reads activation[name][field]: consumers inline that read.
        self.path = path


def field_code(name: str, field: str) -> Code:
    return Code(_field_getter(name, field), path=(name, field))


def constant(value: Any) -> Code:
    def fn(_activation: Activation) -> Any:
        return value

    return Code(fn, True, value)


def failing(error: EvaluationError) -> Code:
    """A node that always fails; raised afresh on each evaluation (so tracebacks do not pile up)."""
    message = str(error)

    def fn(_activation: Activation) -> Any:
        raise EvaluationError(message)

    return Code(fn)


def fold(impl: Callable[..., Any], *codes: Code) -> Code | None:
    """Evaluate ``impl`` now if every operand is constant; an error becomes a node that fails at run time."""
    if not all(c.is_const for c in codes):
        return None
    try:
        value = impl(*(c.value for c in codes))
    except EvaluationError as exc:
        return failing(exc)
    # A folded list is shared by every evaluation: make it immutable.
    return constant(tuple(value) if type(value) is list else value)


def always_bool(node: Node) -> bool:
    """Whether ``node`` can only produce a bool (or fail), whatever the record holds."""
    if isinstance(node, Literal):
        return type(node.value) is bool
    if isinstance(node, Binary):
        return node.op in ("==", "!=", "<", "<=", ">", ">=", "in")
    if isinstance(node, Has | Logic):
        return True
    if isinstance(node, Unary):
        return node.op == "!"
    if isinstance(node, Comprehension):
        return node.macro in ("exists", "all", "exists_one")
    if isinstance(node, Call):
        return node.name in _BOOL_BUILTINS and node.name in BUILTINS
    return False


def _variable_getter(name: str) -> Fn:
    def get_variable(activation: Activation) -> Any:
        try:
            return activation[name]
        except KeyError:
            raise EvaluationError(f"no value for variable '{name}'") from None

    return get_variable


def _field_getter(variable: str, field: str) -> Fn:
    """``variable.field`` in one step; the slow path only runs to explain a failure."""
    get_variable = _variable_getter(variable)

    def explain(activation: Activation) -> Any:
        return select(get_variable(activation), field)

    def get_field(activation: Activation) -> Any:
        try:
            return activation[variable][field]
        except (KeyError, TypeError, IndexError):
            return explain(activation)

    return get_field


def _variable_has_field(name: str, field: str, negated: bool) -> Fn:
    """``has(name.field)`` (or its negation) reading the activation directly."""
    get_variable = _variable_getter(name)

    if negated:

        def variable_lacks_field(activation: Activation) -> bool:
            try:
                value = activation[name]
            except KeyError:
                value = get_variable(activation)
            if type(value) is dict:
                return field not in value
            return not has_field(value, field)

        return variable_lacks_field

    def variable_has_field(activation: Activation) -> bool:
        try:
            value = activation[name]
        except KeyError:
            value = get_variable(activation)
        if type(value) is dict:
            return field in value
        return has_field(value, field)

    return variable_has_field


def _literal_equality(code: Code, literal: Any, negated: bool) -> Fn:
    """``x == literal`` without the general equality walk; Python's == agrees with CEL's for these types."""
    getter = code.fn
    if type(literal) is str and code.path is not None:
        name, field = code.path
        if negated:

            def field_differs(activation: Activation) -> bool:
                try:
                    return activation[name][field] != literal  # type: ignore[no-any-return]
                except (KeyError, TypeError, IndexError):
                    return getter(activation) != literal  # type: ignore[no-any-return]

            return field_differs

        def field_equals(activation: Activation) -> bool:
            try:
                return activation[name][field] == literal  # type: ignore[no-any-return]
            except (KeyError, TypeError, IndexError):
                return getter(activation) == literal  # type: ignore[no-any-return]

        return field_equals
    if type(literal) is str:
        if negated:
            return lambda activation: getter(activation) != literal
        return lambda activation: getter(activation) == literal
    if type(literal) is bool or literal is None:
        if negated:
            return lambda activation: getter(activation) is not literal
        return lambda activation: getter(activation) is literal

    # A number: Python's 1 == True must not leak through.
    def numeric_equality(activation: Activation) -> bool:
        value = getter(activation)
        return (value == literal and type(value) is not bool) is not negated

    return numeric_equality


def _membership(code: Code, elements: Any, limit: int) -> Fn:
    """``x in <constant>``: a frozenset lookup when every element is a string (the common case).

    Anything else scans a constant list, which inside a macro spends its length.
    """
    getter = code.fn
    scanned = len(elements) if type(elements) is tuple or type(elements) is list else 0
    keys = list(elements)  # a list's elements or a map's keys
    if all(type(k) is str for k in keys):
        strings = frozenset(keys)

        def other_types(value: Any, activation: Activation) -> bool:
            if scanned:
                _spend(activation, scanned, limit)
            return contains(value, elements)

        if code.path is not None:
            name, field = code.path

            def field_in_strings(activation: Activation) -> bool:
                try:
                    value = activation[name][field]
                except (KeyError, TypeError, IndexError):
                    value = getter(activation)
                if type(value) is str:
                    return value in strings
                return other_types(value, activation)

            return field_in_strings

        def string_membership(activation: Activation) -> bool:
            value = getter(activation)
            if type(value) is str:
                return value in strings
            return other_types(value, activation)

        return string_membership

    if not scanned:
        return lambda activation: contains(getter(activation), elements)

    def scan_constant(activation: Activation) -> bool:
        value = getter(activation)
        _spend(activation, scanned, limit)
        return contains(value, elements)

    return scan_constant


class Compiler:
    def __init__(self, source: str, env: Environment, checked: CheckResult) -> None:
        self.src = source
        self.env = env
        self.checked = checked
        self.scope: list[str] = []

    def error(self, offset: int, message: str) -> ExpressionError:
        return error_at(self.src, offset, message)

    def activation_name(self, node: Node) -> str | None:
        """The name if ``node`` reads a name from the activation (a variable or a macro variable)."""
        if isinstance(node, Ident) and (node.name in self.scope or node.name not in self.env.constants):
            return node.name
        return None

    def compile(self, node: Node) -> Code:
        if id(node) in self.checked.constants:
            return constant(self.checked.constants[id(node)])
        if isinstance(node, Literal):
            return constant(node.value)
        if isinstance(node, Ident):
            if node.name in self.env.constants and node.name not in self.scope:
                return constant(self.env.constants[node.name])
            return Code(_variable_getter(node.name))
        if isinstance(node, Select):
            return self.compile_select(node)
        if isinstance(node, Has):
            return self.compile_has(node, negated=False)
        if isinstance(node, Index):
            return self.compile_index(node)
        if isinstance(node, Call):
            return self.compile_call(node)
        if isinstance(node, Unary):
            return self.compile_unary(node)
        if isinstance(node, Binary):
            return self.compile_binary(node)
        if isinstance(node, Logic):
            return self.compile_logic(node)
        if isinstance(node, Conditional):
            return self.compile_conditional(node)
        if isinstance(node, ListLit):
            return self.compile_list(node)
        if isinstance(node, MapLit):
            return self.compile_map(node)
        if isinstance(node, Comprehension):
            return self.compile_comprehension(node)
        raise AssertionError(f"unhandled node {type(node).__name__}")

    # -- field access -----------------------------------------------------------------

    def compile_select(self, node: Select) -> Code:
        field = node.field
        name = self.activation_name(node.operand)
        if name is not None:
            return field_code(name, field)
        operand = self.compile(node.operand)
        folded = fold(lambda value: select(value, field), operand)
        if folded is not None:
            return folded
        operand_fn = operand.fn

        def select_field(activation: Activation) -> Any:
            value = operand_fn(activation)
            if type(value) is dict:
                try:
                    return value[field]
                except KeyError:
                    raise EvaluationError(f"no such key: {field}") from None
            return select(value, field)

        return Code(select_field)

    def compile_has(self, node: Has, negated: bool) -> Code:
        field = node.select.field
        name = self.activation_name(node.select.operand)
        if name is not None:
            return Code(_variable_has_field(name, field, negated))
        operand = self.compile(node.select.operand)
        folded = fold(lambda value: has_field(value, field) is not negated, operand)
        if folded is not None:
            return folded
        operand_fn = operand.fn

        if negated:

            def lacks_field(activation: Activation) -> bool:
                value = operand_fn(activation)
                if type(value) is dict:
                    return field not in value
                return not has_field(value, field)

            return Code(lacks_field)

        def has_field_fast(activation: Activation) -> bool:
            value = operand_fn(activation)
            if type(value) is dict:
                return field in value
            return has_field(value, field)

        return Code(has_field_fast)

    def compile_index(self, node: Index) -> Code:
        name = self.activation_name(node.operand)
        if name is not None and isinstance(node.index, Literal) and type(node.index.value) is str:
            return field_code(name, node.index.value)
        operand, key = self.compile(node.operand), self.compile(node.index)
        folded = fold(index, operand, key)
        if folded is not None:
            return folded
        operand_fn, key_fn = operand.fn, key.fn

        def index_value(activation: Activation) -> Any:
            container, key_value = operand_fn(activation), key_fn(activation)
            if type(container) is dict and type(key_value) is str:
                try:
                    return container[key_value]
                except KeyError:
                    raise EvaluationError("no such key in map") from None
            return index(container, key_value)

        return Code(index_value)

    # -- calls ----------------------------------------------------------------------

    def compile_call(self, node: Call) -> Code:
        name = node.name
        if node.target is None and name in self.env.functions:
            return self.compile_extra_call(node)
        builtin = BUILTINS[name]
        arg_nodes = node.args if node.target is None else (node.target, *node.args)
        args = [self.compile(a) for a in arg_nodes]
        if all(a.is_const for a in args):
            try:
                return constant(builtin.impl(*(a.value for a in args)))
            except EvaluationError as exc:
                # Every argument is written out in the expression: this call can never succeed.
                raise self.error(node.pos, str(exc)) from None
        impl = builtin.impl
        if len(args) == 2 and args[1].is_const and type(args[1].value) is str:
            special = self.string_call(name, args[0].fn, args[1].value, arg_nodes[1].pos)
            if special is not None:
                return Code(special)
        if len(args) == 1:
            only = args[0].fn
            return Code(lambda activation: impl(only(activation)))
        if len(args) == 2:
            first, second = args[0].fn, args[1].fn
            return Code(lambda activation: impl(first(activation), second(activation)))
        fns = tuple(a.fn for a in args)
        return Code(lambda activation: impl(*(f(activation) for f in fns)))

    def string_call(self, name: str, target: Fn, literal: str, literal_pos: int) -> Fn | None:
        impl = BUILTINS[name].impl
        if name == "startsWith":

            def starts_with_literal(activation: Activation) -> bool:
                text = target(activation)
                return text.startswith(literal) if type(text) is str else bool(impl(text, literal))

            return starts_with_literal
        if name == "endsWith":

            def ends_with_literal(activation: Activation) -> bool:
                text = target(activation)
                return text.endswith(literal) if type(text) is str else bool(impl(text, literal))

            return ends_with_literal
        if name == "contains":

            def contains_literal(activation: Activation) -> bool:
                text = target(activation)
                return literal in text if type(text) is str else bool(impl(text, literal))

            return contains_literal
        if name == "matches":
            try:
                pattern = compile_pattern(literal)
            except ValueError as exc:
                raise self.error(literal_pos, f"matches(): {exc}") from None
            return lambda activation: search(pattern, target(activation))
        return None

    def compile_extra_call(self, node: Call) -> Code:
        name = node.name
        impl, _arity = self.env.functions[name]
        fns = tuple(self.compile(a).fn for a in node.args)

        def call_extra(activation: Activation) -> Any:
            values = [f(activation) for f in fns]
            try:
                return impl(*values)
            except EvaluationError:
                raise
            except Exception as exc:
                # The message of a foreign exception may quote record values; logs must not.
                raise EvaluationError(f"{name}() failed with {type(exc).__name__}") from exc

        return Code(call_extra)

    # -- operators ------------------------------------------------------------------

    def compile_negation(self, node: Node) -> Code | None:
        """``!node`` without a separate "not" step, where CEL's semantics allow it.

        ``!has(x.f)`` tests absence; ``!(a == b)`` is ``a != b``; De Morgan turns
        ``!(a && b)`` into ``!a || !b``, which CEL's error-absorbing logic keeps exact
        (an error on one side is absorbed by the same decisive value on the other).
        """
        if isinstance(node, Has):
            return self.compile_has(node, negated=True)
        if isinstance(node, Binary) and node.op in ("==", "!="):
            return self.compile_binary(node, negated=True)
        if isinstance(node, Logic):
            flipped = "||" if node.op == "&&" else "&&"
            negated_terms = tuple(Unary(term.pos, "!", term) for term in node.terms)
            return self.compile_logic(Logic(node.pos, flipped, negated_terms))
        return None

    def compile_unary(self, node: Unary) -> Code:
        if node.op == "!":
            negation = self.compile_negation(node.operand)
            if negation is not None:
                return negation
        operand = self.compile(node.operand)
        impl = logical_not if node.op == "!" else negate
        folded = fold(impl, operand)
        if folded is not None:
            return folded
        operand_fn = operand.fn
        if node.op == "!":

            def not_value(activation: Activation) -> bool:
                value = operand_fn(activation)
                if value is True:
                    return False
                if value is False:
                    return True
                raise no_overload("!", value)

            return Code(not_value)
        return Code(lambda activation: negate(operand_fn(activation)))

    def compile_binary(self, node: Binary, negated: bool = False) -> Code:
        """Compile ``node``; ``negated`` (only for == and !=) compiles its negation instead."""
        op = node.op
        if negated:
            op = {"==": "!=", "!=": "=="}[op]
        left, right = self.compile(node.left), self.compile(node.right)
        impl = _BINARY_IMPLS[op]
        folded = fold(impl, left, right)
        if folded is not None:
            return folded
        if op in ("==", "!="):
            return Code(self.equality(left, right, negated=op == "!="))
        if op == "in" and right.is_const and kind(right.value) in ("list", "map"):
            return Code(_membership(left, right.value, self.env.limits.iterations))
        left_fn, right_fn = left.fn, right.fn
        if op == "+":
            return Code(_spending_add(left_fn, right_fn, self.env.limits.iterations))
        if op == "in":
            return Code(_spending_membership(left_fn, right_fn, self.env.limits.iterations))
        # A constant operand is bound here rather than fetched through a call on every evaluation.
        if right.is_const:
            right_value = right.value
            return Code(lambda activation: impl(left_fn(activation), right_value))
        if left.is_const:
            left_value = left.value
            return Code(lambda activation: impl(left_value, right_fn(activation)))
        return Code(lambda activation: impl(left_fn(activation), right_fn(activation)))

    def equality(self, left: Code, right: Code, negated: bool) -> Fn:
        limit = self.env.limits.iterations
        for variable, literal in ((left, right), (right, left)):
            literal_kind = kind(literal.value) if literal.is_const else None
            is_nan = type(literal.value) is float and literal.value != literal.value
            if literal_kind in _LITERAL_EQUALITY_KINDS and not is_nan:
                return _literal_equality(variable, literal.value, negated)
        left_fn, right_fn = left.fn, right.fn
        if left.path is not None and right.path is not None:
            (left_name, left_field), (right_name, right_field) = left.path, right.path

            def fields_equal(activation: Activation) -> bool:
                try:
                    a = activation[left_name][left_field]
                    b = activation[right_name][right_field]
                except (KeyError, TypeError, IndexError):
                    a, b = left_fn(activation), right_fn(activation)
                if type(a) is str and type(b) is str:
                    return (a == b) is not negated
                if type(a) is list or type(a) is dict:
                    _spend(activation, len(a), limit)
                return equals(a, b) is not negated

            return fields_equal

        def values_equal(activation: Activation) -> bool:
            a, b = left_fn(activation), right_fn(activation)
            if type(a) is str and type(b) is str:
                return (a == b) is not negated
            if type(a) is list or type(a) is dict:
                _spend(activation, len(a), limit)
            return equals(a, b) is not negated

        return values_equal

    def compile_logic(self, node: Logic) -> Code:
        is_and = node.op == "&&"
        # For &&, false decides the result and true is neutral; for || the other way round.
        decisive: bool = not is_and
        neutral: bool = is_and
        terms: list[Fn] = []
        term_nodes: list[Node] = []
        for term_node in node.terms:
            term = self.compile(term_node)
            if term.is_const:
                if term.value is decisive:
                    return constant(decisive)
                if term.value is neutral:
                    continue
            terms.append(term.fn)
            term_nodes.append(term_node)
        if not terms:
            return constant(neutral)
        if len(terms) == 1 and always_bool(term_nodes[0]):
            return Code(terms[0])
        return Code(_logic_closure(node.op, tuple(terms)))

    def compile_conditional(self, node: Conditional) -> Code:
        cond, then, otherwise = self.compile(node.cond), self.compile(node.then), self.compile(node.otherwise)
        if cond.is_const:
            if cond.value is True:
                return then
            if cond.value is False:
                return otherwise
            return failing(no_overload("?:", cond.value))
        cond_fn, then_fn, otherwise_fn = cond.fn, then.fn, otherwise.fn

        def choose(activation: Activation) -> Any:
            test = cond_fn(activation)
            if test is True:
                return then_fn(activation)
            if test is False:
                return otherwise_fn(activation)
            raise no_overload("?:", test)

        return Code(choose)

    # -- literals of lists and maps ---------------------------------------------------

    def compile_list(self, node: ListLit) -> Code:
        elements = [self.compile(e) for e in node.elements]
        if all(e.is_const for e in elements):
            return constant(tuple(e.value for e in elements))
        fns = tuple(e.fn for e in elements)
        return Code(lambda activation: [f(activation) for f in fns])

    def compile_map(self, node: MapLit) -> Code:
        entries = [(self.compile(k), self.compile(v)) for k, v in node.entries]
        if all(k.is_const and v.is_const for k, v in entries):
            try:
                return constant(_build_map([(k.value, v.value) for k, v in entries]))
            except EvaluationError as exc:
                return failing(exc)
        fns = tuple((k.fn, v.fn) for k, v in entries)
        return Code(lambda activation: _build_map([(k(activation), v(activation)) for k, v in fns]))

    # -- macros -----------------------------------------------------------------------

    def compile_comprehension(self, node: Comprehension) -> Code:
        iter_range = self.compile(node.iter_range).fn
        self.scope.append(node.var)
        try:
            predicate = self.compile(node.predicate).fn if node.predicate is not None else None
            transform = self.compile(node.transform).fn if node.transform is not None else None
        finally:
            self.scope.pop()
        build = _MACRO_BUILDERS[node.macro]
        return Code(build(node.macro, node.var, iter_range, predicate, transform, limit=self.env.limits.iterations))


def _logic_closure(op: str, terms: tuple[Fn, ...]) -> Fn:
    """CEL's commutative ``&&`` / ``||`` over ``terms`` (at least two).

    The first decisive value (false for &&, true for ||) wins even over an earlier
    error; an error, or a value that is not a bool, wins only if no term decides.
    Up to four terms are unrolled: the fast path is a call and one identity test
    per term, and the first failure hands over to :func:`finish`.
    """
    decisive: bool = op == "||"
    neutral: bool = not decisive
    # Separate names to return, so that comparing with "is" does not narrow them to Any for mypy.
    decided: bool = decisive
    undecided: bool = neutral

    def finish(activation: Activation, failure: EvaluationError, start: int) -> bool:
        if type(failure) is BudgetExceeded:
            raise failure  # an overrun ends the evaluation: no other term may absorb it
        for term in terms[start:]:
            try:
                value = term(activation)
            except BudgetExceeded:
                raise
            except EvaluationError:
                continue
            if value is decisive:
                return decided
        raise failure

    def failure_of(value: Any) -> EvaluationError:
        return no_overload(op, value)

    if len(terms) == 2:
        t1, t2 = terms

        def two_terms(activation: Activation) -> bool:
            try:
                a = t1(activation)
            except EvaluationError as exc:
                return finish(activation, exc, 1)
            if a is not neutral:
                return decided if a is decisive else finish(activation, failure_of(a), 1)
            b = t2(activation)  # the last term's error propagates as it is
            if b is not neutral:
                if b is decisive:
                    return decided
                raise failure_of(b)
            return undecided

        return two_terms

    if len(terms) == 3:
        t1, t2, t3 = terms

        def three_terms(activation: Activation) -> bool:
            try:
                a = t1(activation)
            except EvaluationError as exc:
                return finish(activation, exc, 1)
            if a is not neutral:
                return decided if a is decisive else finish(activation, failure_of(a), 1)
            try:
                b = t2(activation)
            except EvaluationError as exc:
                return finish(activation, exc, 2)
            if b is not neutral:
                return decided if b is decisive else finish(activation, failure_of(b), 2)
            c = t3(activation)  # the last term's error propagates as it is
            if c is not neutral:
                if c is decisive:
                    return decided
                raise failure_of(c)
            return undecided

        return three_terms

    if len(terms) == 4:
        t1, t2, t3, t4 = terms

        def four_terms(activation: Activation) -> bool:
            try:
                a = t1(activation)
            except EvaluationError as exc:
                return finish(activation, exc, 1)
            if a is not neutral:
                return decided if a is decisive else finish(activation, failure_of(a), 1)
            try:
                b = t2(activation)
            except EvaluationError as exc:
                return finish(activation, exc, 2)
            if b is not neutral:
                return decided if b is decisive else finish(activation, failure_of(b), 2)
            try:
                c = t3(activation)
            except EvaluationError as exc:
                return finish(activation, exc, 3)
            if c is not neutral:
                return decided if c is decisive else finish(activation, failure_of(c), 3)
            d = t4(activation)  # the last term's error propagates as it is
            if d is not neutral:
                if d is decisive:
                    return decided
                raise failure_of(d)
            return undecided

        return four_terms

    def many_terms(activation: Activation) -> bool:
        for position, term in enumerate(terms):
            try:
                value = term(activation)
            except EvaluationError as exc:
                return finish(activation, exc, position + 1)
            if value is not neutral:
                return decided if value is decisive else finish(activation, failure_of(value), position + 1)
        return undecided

    return many_terms


def _build_map(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    built: dict[Any, Any] = {}
    for key, value in pairs:
        key_kind = kind(key)
        if key_kind not in ("string", "int", "uint", "bool"):
            raise EvaluationError(f"a map key must be a string, int, uint or bool, not {key_kind}")
        if map_contains(built, key) or (key_kind != "bool" and key in built):
            raise EvaluationError("repeated key in map literal")
        built[key] = value
    return built


class MacroBuilder(Protocol):
    def __call__(
        self, macro: str, var: str, iter_range: Fn, predicate: Fn | None, transform: Fn | None, /, *, limit: int
    ) -> Fn: ...


def _spend(activation: Activation, amount: int, limit: int) -> None:
    """Inside a macro (where the activation carries the budget), spend ``amount`` of it."""
    budget: list[int] | None = activation.get(BUDGET_KEY)
    if budget is not None:
        budget[0] -= amount
        if budget[0] < 0:
            raise budget_exceeded(limit)


def _spending_membership(left_fn: Fn, right_fn: Fn, limit: int) -> Fn:
    """``in`` over a list scans it: inside a macro the scan spends the list's size (a map is a lookup)."""

    def membership(activation: Activation) -> bool:
        item, container = left_fn(activation), right_fn(activation)
        if type(container) is list or type(container) is tuple:
            _spend(activation, len(container), limit)
        return contains(item, container)

    return membership


def _spending_add(left_fn: Fn, right_fn: Fn, limit: int) -> Fn:
    """``+`` that, inside a macro, spends the size of a list or string it builds.

    A macro's body runs once per item: a concatenation there (``l.map(x, l + l)``) would
    otherwise build lists quadratic in the record's. Strings spend one unit per 1,000
    characters, as the cost estimate counts them. Outside macros there is no budget and
    one concatenation is linear in its operands.
    """

    def add_values(activation: Activation) -> Any:
        value = add(left_fn(activation), right_fn(activation))
        value_type = type(value)
        if value_type is list or value_type is str:
            _spend(activation, len(value) if value_type is list else len(value) // 1_000, limit)
        return value

    return add_values


def _macro_scope(activation: Activation, limit: int) -> tuple[dict[str, Any], list[int]]:
    """A macro's own copy of the activation, and the budget it spends from (opened here when outermost)."""
    scope = dict(activation)
    budget: list[int] | None = scope.get(BUDGET_KEY)
    if budget is None:
        budget = scope[BUDGET_KEY] = [limit]
    return scope, budget


def _quantifier(decisive: bool) -> MacroBuilder:
    """``exists`` (decisive: true) or ``all`` (decisive: false).

    As with ``||`` and ``&&``, an item whose value decides wins even over an earlier
    error; an error, or a value that is not a bool, wins only if no item decides.
    """
    neutral: bool = not decisive
    # Separate names to return, so that comparing with "is" does not narrow them to Any for mypy.
    decided: bool = decisive
    undecided: bool = neutral

    def build(macro: str, var: str, iter_range: Fn, predicate: Fn | None, _transform: Fn | None, *, limit: int) -> Fn:
        assert predicate is not None

        def quantify(activation: Activation) -> bool:
            scope, budget = _macro_scope(activation, limit)
            failure: EvaluationError | None = None
            items = iteration_items(iter_range(activation), macro)
            budget[0] -= len(items)
            if budget[0] < 0:
                raise budget_exceeded(limit)
            for item in items:
                scope[var] = item
                try:
                    value = predicate(scope)
                except BudgetExceeded:
                    raise
                except EvaluationError as exc:
                    failure = failure or exc
                    continue
                if value is decisive:
                    return decided
                if value is not neutral:
                    failure = failure or no_overload(macro, value)
            if failure is not None:
                raise failure
            return undecided

        return quantify

    return build


def _exists_one(macro: str, var: str, iter_range: Fn, predicate: Fn | None, _transform: Fn | None, *, limit: int) -> Fn:
    assert predicate is not None

    def exists_one(activation: Activation) -> bool:
        scope, budget = _macro_scope(activation, limit)
        found = 0
        items = iteration_items(iter_range(activation), macro)
        budget[0] -= len(items)
        if budget[0] < 0:
            raise budget_exceeded(limit)
        for item in items:
            scope[var] = item
            value = predicate(scope)
            if value is True:
                found += 1
            elif value is not False:
                raise no_overload("exists_one", value)
        return found == 1

    return exists_one


def _map(macro: str, var: str, iter_range: Fn, predicate: Fn | None, transform: Fn | None, *, limit: int) -> Fn:
    assert transform is not None

    def map_items(activation: Activation) -> list[Any]:
        scope, budget = _macro_scope(activation, limit)
        mapped: list[Any] = []
        items = iteration_items(iter_range(activation), macro)
        budget[0] -= len(items)
        if budget[0] < 0:
            raise budget_exceeded(limit)
        for item in items:
            scope[var] = item
            if predicate is not None:
                keep = predicate(scope)
                if keep is False:
                    continue
                if keep is not True:
                    raise no_overload("map", keep)
            value = transform(scope)
            if type(value) is list or type(value) is dict:
                # What map keeps is built per item: its size is spent too.
                budget[0] -= len(value)
                if budget[0] < 0:
                    raise budget_exceeded(limit)
            mapped.append(value)
        return mapped

    return map_items


def _filter(macro: str, var: str, iter_range: Fn, predicate: Fn | None, _transform: Fn | None, *, limit: int) -> Fn:
    assert predicate is not None

    def filter_items(activation: Activation) -> list[Any]:
        scope, budget = _macro_scope(activation, limit)
        kept: list[Any] = []
        items = iteration_items(iter_range(activation), macro)
        budget[0] -= len(items)
        if budget[0] < 0:
            raise budget_exceeded(limit)
        for item in items:
            scope[var] = item
            keep = predicate(scope)
            if keep is True:
                kept.append(item)
            elif keep is not False:
                raise no_overload("filter", keep)
        return kept

    return filter_items


_MACRO_BUILDERS: Final[dict[str, MacroBuilder]] = {
    "exists": _quantifier(decisive=True),
    "all": _quantifier(decisive=False),
    "exists_one": _exists_one,
    "map": _map,
    "filter": _filter,
}
