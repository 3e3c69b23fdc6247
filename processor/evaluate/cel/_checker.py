"""Static checks: names, fields, functions, arity, and the type errors visible before any record arrives.

Types are CEL type names ("int", "string", "map", ...) or "dyn" when only the
record can tell. A check fails only when the types are known and no overload
fits (``"a" + 1``, ``1 && true``); ``record.kind > 3`` passes and is checked at
run time. The checker also collects the (variable, field) pairs an expression
reads, and the values of constant paths such as ``lists.nondeterministic``.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any, Final

from processor.errors import ExpressionError
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
from processor.evaluate.cel._environment import MACROS, Environment
from processor.evaluate.cel._functions import BUILTINS, compile_pattern
from processor.evaluate.cel._lexer import error_at
from processor.evaluate.cel._values import NUMERIC_KINDS, kind

WHOLE_VALUE: Final = "*"

_ARITHMETIC: Final[dict[str, frozenset[str]]] = {
    "+": frozenset({"int", "uint", "double", "string", "list", "bytes"}),
    "-": frozenset({"int", "uint", "double"}),
    "*": frozenset({"int", "uint", "double"}),
    "/": frozenset({"int", "uint", "double"}),
    "%": frozenset({"int", "uint"}),
}
_ORDERED: Final = frozenset({"int", "uint", "double", "string", "bool", "bytes"})
_MAP_KEY_TYPES: Final = frozenset({"int", "uint", "string", "bool", "dyn"})


def suggestion(word: str, candidates: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, sorted(set(candidates)), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def describe_path(node: Node) -> str:
    if isinstance(node, Ident):
        return node.name
    if isinstance(node, Select):
        return f"{describe_path(node.operand)}.{node.field}"
    return "the value"


class CheckResult:
    __slots__ = ("constants", "references")

    def __init__(self) -> None:
        self.references: set[tuple[str, str]] = set()
        # id(node) -> value, for nodes whose value is fixed by Environment.constants.
        self.constants: dict[int, Any] = {}


class Checker:
    def __init__(self, source: str, env: Environment) -> None:
        self.src = source
        self.env = env
        self.scope: list[str] = []
        self.result = CheckResult()
        # Unknown names, fields and functions: each is told, and checking goes on with a dyn in
        # its place, so one pass reports every one of them (other problems stop at the first).
        self.errors: list[ExpressionError] = []

    def unknown(self, offset: int, message: str) -> str:
        self.errors.append(self.error(offset, message))
        return "dyn"

    def error(self, offset: int, message: str) -> ExpressionError:
        return error_at(self.src, offset, message)

    def check(self, node: Node) -> str:
        node.ctype = self.infer(node)
        return node.ctype

    def is_activation_variable(self, node: Node) -> bool:
        """A top-level variable read from the activation (not a constant, not a macro variable)."""
        return (
            isinstance(node, Ident)
            and node.name not in self.scope
            and node.name in self.env.variables
            and node.name not in self.env.constants
        )

    def infer(self, node: Node) -> str:
        if isinstance(node, Literal):
            return kind(node.value)
        if isinstance(node, Ident):
            return self.check_ident(node)
        if isinstance(node, Select):
            return self.check_select(node, presence=False)
        if isinstance(node, Has):
            self.check_select(node.select, presence=True)
            node.select.ctype = "dyn"
            return "bool"
        if isinstance(node, Index):
            return self.check_index(node)
        if isinstance(node, Call):
            return self.check_call(node)
        if isinstance(node, Unary):
            return self.check_unary(node)
        if isinstance(node, Binary):
            return self.check_binary(node)
        if isinstance(node, Logic):
            for term in node.terms:
                self.expect_bool(term, f"'{node.op}'")
            return "bool"
        if isinstance(node, Conditional):
            self.expect_bool(node.cond, "the condition of '? :'")
            then, otherwise = self.check(node.then), self.check(node.otherwise)
            return then if then == otherwise else "dyn"
        if isinstance(node, ListLit):
            for element in node.elements:
                self.check(element)
            return "list"
        if isinstance(node, MapLit):
            for key, value in node.entries:
                key_type = self.check(key)
                if key_type not in _MAP_KEY_TYPES:
                    raise self.error(key.pos, f"a map key must be a string, int, uint or bool, not {key_type}")
                self.check(value)
            return "map"
        if isinstance(node, Comprehension):
            return self.check_comprehension(node)
        raise AssertionError(f"unhandled node {type(node).__name__}")

    def expect_bool(self, node: Node, context: str) -> None:
        found = self.check(node)
        if found not in ("bool", "dyn"):
            raise self.error(node.pos, f"{context} needs a bool, but this is {_article(found)}")

    def check_ident(self, node: Ident) -> str:
        name = node.name
        if name in self.scope:
            return "dyn"
        if name in self.env.constants:
            value = self.env.constants[name]
            self.result.constants[id(node)] = value
            return kind(value)
        declared = self.env.variables.get(name)
        if declared is None:
            known = [*self.env.variables, *self.env.constants, *self.scope]
            return self.unknown(node.pos, f"undeclared reference to '{name}'{suggestion(name, known)}")
        self.result.references.add((name, WHOLE_VALUE))
        return declared

    def check_field_name(self, variable: str, field: str, offset: int) -> None:
        fields = self.env.known_fields.get(variable)
        if fields is not None and field not in fields:
            self.unknown(offset, f"'{variable}' has no field '{field}'{suggestion(field, fields)}")

    def check_select(self, node: Select, presence: bool) -> str:
        operand = node.operand
        if self.is_activation_variable(operand):
            assert isinstance(operand, Ident)
            declared = self.env.variables[operand.name]
            operand.ctype = declared
            if declared not in ("map", "dyn"):
                raise self.error(
                    node.pos, f"cannot select field '{node.field}': '{operand.name}' is {_article(declared)}"
                )
            self.check_field_name(operand.name, node.field, node.pos)
            self.result.references.add((operand.name, node.field))
            return "dyn"
        operand_type = self.check(operand)
        if id(operand) in self.result.constants:
            value = self.result.constants[id(operand)]
            if kind(value) == "map":
                if node.field in value:
                    self.result.constants[id(node)] = value[node.field]
                    return kind(value[node.field])
                if presence:
                    return "dyn"
                raise self.error(
                    node.pos,
                    f"'{describe_path(operand)}' has no key '{node.field}'{suggestion(node.field, map(str, value))}",
                )
        if operand_type not in ("map", "dyn"):
            raise self.error(node.pos, f"cannot select field '{node.field}' on {_article(operand_type)}")
        return "dyn"

    def check_index(self, node: Index) -> str:
        operand, index = node.operand, node.index
        if self.is_activation_variable(operand) and isinstance(index, Literal) and type(index.value) is str:
            assert isinstance(operand, Ident)
            declared = self.env.variables[operand.name]
            operand.ctype, index.ctype = declared, "string"
            if declared not in ("map", "dyn"):
                raise self.error(node.pos, f"cannot index '{operand.name}': it is {_article(declared)}")
            self.check_field_name(operand.name, index.value, index.pos)
            self.result.references.add((operand.name, index.value))
            return "dyn"
        operand_type = self.check(operand)
        index_type = self.check(index)
        if operand_type == "list":
            if index_type not in ("int", "uint", "double", "dyn"):
                raise self.error(index.pos, f"a list index must be an int, not {index_type}")
        elif operand_type not in ("map", "dyn"):
            raise self.error(node.pos, f"cannot index {_article(operand_type)}")
        return "dyn"

    def check_unary(self, node: Unary) -> str:
        if node.op == "!":
            self.expect_bool(node.operand, "'!'")
            return "bool"
        operand_type = self.check(node.operand)
        if operand_type not in ("int", "double", "dyn"):
            raise self.error(node.pos, f"no matching overload for unary '-' applied to {operand_type}")
        return operand_type

    def check_binary(self, node: Binary) -> str:
        left, right = self.check(node.left), self.check(node.right)
        op = node.op
        if op in ("==", "!="):
            return "bool"
        if op == "in":
            if right not in ("list", "map", "dyn"):
                raise self.error(node.pos, f"'in' needs a list or a map on its right, not {right}")
            return "bool"
        if op in ("<", "<=", ">", ">="):
            for side in (left, right):
                if side not in _ORDERED and side != "dyn":
                    raise self.error(node.pos, f"no matching overload for '{op}' applied to ({left}, {right})")
            if "dyn" not in (left, right) and left != right and not (left in NUMERIC_KINDS and right in NUMERIC_KINDS):
                raise self.error(node.pos, f"no matching overload for '{op}' applied to ({left}, {right})")
            return "bool"
        allowed = _ARITHMETIC[op]
        for side in (left, right):
            if side != "dyn" and side not in allowed:
                raise self.error(node.pos, f"no matching overload for '{op}' applied to ({left}, {right})")
        if left != "dyn" and right not in ("dyn", left):
            hint = " (convert one side with int() or double())" if {left, right} <= NUMERIC_KINDS else ""
            raise self.error(node.pos, f"no matching overload for '{op}' applied to ({left}, {right}){hint}")
        return left if left != "dyn" else right

    def check_call(self, node: Call) -> str:
        name = node.name
        extra = self.env.functions.get(name) if node.target is None else None
        if extra is not None:
            _impl, arity = extra
            if len(node.args) != arity:
                raise self.error(node.pos, f"{name}() takes {_count(arity)}, got {len(node.args)}")
            for arg in node.args:
                self.check(arg)
            return "dyn"
        builtin = BUILTINS.get(name)
        if node.target is None:
            if builtin is None or not builtin.global_form:
                if builtin is not None:
                    raise self.error(node.pos, f"{name}() is a method: write value.{name}(...)")
                known = [b.name for b in BUILTINS.values() if b.global_form] + [*self.env.functions, "has"]
                for arg in node.args:
                    self.check(arg)
                return self.unknown(node.pos, f"unknown function '{name}'{suggestion(name, known)}")
            args = node.args
            explicit_offset = 0
        else:
            if builtin is None or not builtin.receiver_form:
                if builtin is not None or name in self.env.functions:
                    raise self.error(node.pos, f"{name}() is not a method: write {name}(...)")
                known = [b.name for b in BUILTINS.values() if b.receiver_form] + sorted(MACROS - {"has"})
                raise self.error(node.pos, f"unknown method '{name}'{suggestion(name, known)}")
            args = (node.target, *node.args)
            explicit_offset = 1
        if len(args) not in builtin.arities:
            wanted = " or ".join(_count(a - explicit_offset) for a in sorted(builtin.arities))
            raise self.error(node.pos, f"{name}() takes {wanted}, got {len(node.args)}")
        types = [self.check(arg) for arg in args]
        fitting = [
            (params, result)
            for params, result in builtin.overloads
            if len(params) == len(types)
            and all(p in ("*", t) or t == "dyn" for p, t in zip(params, types, strict=True))
        ]
        if not fitting:
            raise self.error(node.pos, f"no matching overload for {name}() applied to ({', '.join(types)})")
        if name == "matches" and isinstance(args[1], Literal) and isinstance(args[1].value, str):
            try:
                compile_pattern(args[1].value)
            except ValueError as exc:
                raise self.error(args[1].pos, f"matches(): {exc}") from None
        results = {result for _params, result in fitting}
        return results.pop() if len(results) == 1 else "dyn"

    def check_comprehension(self, node: Comprehension) -> str:
        range_type = self.check(node.iter_range)
        if range_type not in ("list", "map", "dyn"):
            raise self.error(node.pos, f"{node.macro}() needs a list or a map, not {range_type}")
        self.scope.append(node.var)
        try:
            if node.predicate is not None:
                self.expect_bool(node.predicate, f"the condition of {node.macro}()")
            if node.transform is not None:
                self.check(node.transform)
        finally:
            self.scope.pop()
        return "list" if node.macro in ("map", "filter") else "bool"


def _article(type_name: str) -> str:
    return f"an {type_name}" if type_name[:1] in "aeiou" else f"a {type_name}"


def _count(n: int) -> str:
    return "no arguments" if n == 0 else f"{n} argument{'s' if n != 1 else ''}"


def check(source: str, node: Node, env: Environment) -> CheckResult:
    """The checked expression; raises the first problem found, with the other unknown names,
    fields and functions of the expression in its ``more``."""
    checker = Checker(source, env)
    try:
        checker.check(node)
    except ExpressionError as exc:
        if checker.errors:
            first, *rest = checker.errors
            first.more = [*rest, exc]
            raise first from None
        raise
    if checker.errors:
        first, *rest = checker.errors
        first.more = rest
        raise first
    return checker.result
