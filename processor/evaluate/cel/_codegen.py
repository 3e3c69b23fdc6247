"""A checked expression as Python source, where the translation is exact.

The action-log lane (:mod:`processor.evaluate.loglane`) runs a whole rule set as one
generated Python function instead of a closure per node. This module writes the source
of one expression for it, and refuses (:class:`Unsupported`) wherever the source could
differ from the closure compiler's value:

- every node it emits is *total* on the records the lane gives it: validated action-log
  records, whose required fields are non-empty strings and whose typed fields have their
  type or are null (``processor.records.FIELD_TYPES``). ``record.f`` is emitted only
  when ``f`` is required or an enclosing ``has(record.f)`` (a fact of the ``&&`` chain
  or the ``?:`` condition it sits in) has established it; otherwise the field may be
  absent, the closure would raise, and CEL's error absorption in ``&&``/``||`` has no
  Python counterpart;
- so a total ``&&``/``||`` of total boolean terms is Python's ``and``/``or`` exactly;
- equality with a literal keeps CEL's typing (``1 == true`` is false, ``1 == 1.0`` is
  true); ordering is emitted only between values known to be numbers or known to be
  strings; ``x in lists.name`` only over a constant list of strings;
- calls, macros, indexing, arithmetic other than string concatenation are refused.

A refused expression keeps its closure; nothing else changes. The source only ever
names the variables of :class:`SourceContext` and constants bound by the caller, and
every value taken from a rule is written with ``repr`` of a str, int, float, bool or
None: a rule cannot inject code (the lane also checks the parsed result, see
``processor.evaluate.loglane``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from keyword import iskeyword
from typing import Any, Final

from processor.evaluate.cel._ast import Binary, Call, Conditional, Has, Ident, Literal, Logic, Node, Select, Unary
from processor.evaluate.cel._values import UInt

# Python types a value may have, or None when nothing is known.
Types = frozenset[type] | None

_NONE: Final = type(None)
_BOOL: Final[frozenset[type]] = frozenset({bool})
_STR: Final[frozenset[type]] = frozenset({str})
_NUMBERS: Final[frozenset[type]] = frozenset({int, float})
# FIELD_TYPES' words as Python types (orjson gives int and float, never a bool for a number).
_FIELD_TYPE_SETS: Final[dict[str, frozenset[type]]] = {
    "str": _STR,
    "int": frozenset({int}),
    "number": _NUMBERS,
    "bool": _BOOL,
    "str|int": frozenset({str, int}),
}
_ORDERING: Final = frozenset({"<", "<=", ">", ">="})


class Unsupported(Exception):
    """The expression has a node whose translation could differ from the closure's value."""


@dataclass(frozen=True)
class FieldTyping:
    """What is known of one map variable's fields (``record`` or ``first``) before any fact."""

    code: str  # the name the source uses for the map
    # field -> FIELD_TYPES word; fields not listed may hold any JSON value.
    types: Mapping[str, str]
    # Fields always present with a non-null value of their type.
    always: frozenset[str] = frozenset()
    # Fields never null when present (a kept field of a valid record).
    nonnull_when_present: frozenset[str] = frozenset()
    # A typed line (processor.convert.actionlog.typed_decoder) rather than a dict: these are
    # its attributes, ``_U`` when absent; a field not listed is refused.
    attributes: frozenset[str] | None = None

    def present(self, field_name: str) -> str:
        if self.attributes is None:
            return f"({field_name!r} in {self.code})"
        return f"({self.read(field_name)} is not _U)"

    def read(self, field_name: str) -> str:
        if self.attributes is None:
            return f"{self.code}[{field_name!r}]"
        if field_name not in self.attributes or not field_name.isidentifier() or iskeyword(field_name):
            raise Unsupported(f"{field_name} is not an attribute of the typed line")
        return f"{self.code}.{field_name}"


@dataclass(frozen=True)
class SourceContext:
    """The variables an expression may read, as the generated function names them."""

    maps: Mapping[str, FieldTyping]
    # ``meta.<field>`` -> (source, its types); a value fixed for the whole lane is a literal.
    meta: Mapping[str, tuple[str, frozenset[type]]]
    # Bound by the caller: constant name -> value (frozensets for ``in``).
    constants: dict[str, Any] = field(default_factory=dict)
    # Rule functions called directly: name -> (the helper's name in the generated code, the types
    # each argument must have, the result's types). Only functions that cannot raise on
    # arguments of those types: the generated code has no place for an evaluation error.
    functions: Mapping[str, tuple[str, tuple[frozenset[type], ...], frozenset[type]]] = field(default_factory=dict)

    def bind(self, value: Any) -> str:
        for name, bound in self.constants.items():
            if type(bound) is type(value) and bound == value:
                return name
        name = f"_k{len(self.constants)}"
        self.constants[name] = value
        return name


@dataclass(frozen=True)
class PythonSource:
    code: str
    types: Types


# A fact: ("present" | "nonnull", variable, field).
Fact = tuple[str, str, str]


def python_source(
    tree: Node, constants: Mapping[int, Any], context: SourceContext, facts: frozenset[Fact] = frozenset()
) -> PythonSource:
    """The source of ``tree`` (raises Unsupported); ``facts`` hold where it is evaluated."""
    return _Writer(constants, context).write(tree, facts)


@dataclass(frozen=True)
class Conjunct:
    """One term of a condition's top-level ``&&``."""

    code: str  # its source where it stands (earlier terms hold)
    # Its source on its own (exact whatever the other terms say), when it has one: such a
    # term may be tested before the others, or once for several rules.
    alone: str | None


def conjuncts(tree: Node, constants: Mapping[int, Any], context: SourceContext) -> list[Conjunct] | None:
    """A boolean condition as its top-level ``&&`` terms (raises Unsupported); None when it is never true.

    On typed lines (``record`` has attributes) ``has(record.f)`` followed in the chain by a
    test that an absent field fails (``== <a literal other than null>``, ``in <a list>``) is
    dropped: the absent marker compares unequal to every literal, so the test alone decides.
    """
    return _Writer(constants, context).conjuncts(tree)


def facts_when_true(tree: Node, constants: Mapping[int, Any]) -> frozenset[Fact]:
    """What holds of the record once ``tree`` evaluated to true (a rule fired)."""
    return _Writer(constants, None).facts(tree)


class _Writer:
    def __init__(self, constants: Mapping[int, Any], context: SourceContext | None) -> None:
        self.folded = constants
        self.context = context

    # -- facts ------------------------------------------------------------------------

    def facts(self, node: Node) -> frozenset[Fact]:
        if isinstance(node, Has):
            path = _map_field(node.select)
            return frozenset({("present", *path)}) if path is not None else frozenset()
        if isinstance(node, Logic) and node.op == "&&":
            out: frozenset[Fact] = frozenset()
            for term in node.terms:
                out |= self.facts(term)
            return out
        if isinstance(node, Binary) and node.op in ("==", "!="):
            for side, other in ((node.left, node.right), (node.right, node.left)):
                path = _map_field(side) if isinstance(side, Select) else None
                literal = self.literal_of(other)
                if path is None or literal is _NOT_LITERAL:
                    continue
                # x != null, or x == <a non-null literal>: present and not null.
                if (node.op == "!=" and literal is None) or (node.op == "==" and literal is not None):
                    return frozenset({("present", *path), ("nonnull", *path)})
        return frozenset()

    # -- source -----------------------------------------------------------------------

    def conjuncts(self, tree: Node) -> list[Conjunct] | None:
        assert self.context is not None
        terms = tree.terms if isinstance(tree, Logic) and tree.op == "&&" else (tree,)
        dropped, decided = self.presence_decided(terms)
        out: list[Conjunct] = []
        known: frozenset[Fact] = frozenset()
        for index, term in enumerate(terms):
            value = self.static_bool(term)
            if value is False:
                return None
            if value is None and index not in dropped:
                code = self.boolean(term, known)
                alone: str | None = code if index in decided else None
                if alone is None:
                    try:
                        alone = self.boolean(term, frozenset())
                    except Unsupported:
                        alone = None
                out.append(Conjunct(code, alone))
            known |= self.facts(term)
        return out

    def presence_decided(self, terms: tuple[Node, ...]) -> tuple[set[int], set[int]]:
        """In an ``&&`` chain on typed lines: the ``has(record.f)`` terms a later term makes
        redundant (it fails when ``f`` is absent), and those later terms."""
        dropped: set[int] = set()
        decided: set[int] = set()
        assert self.context is not None
        record = self.context.maps.get("record")
        if record is None or record.attributes is None:
            return dropped, decided
        for index, term in enumerate(terms):
            path = _map_field(term.select) if isinstance(term, Has) else None
            if path is None or path[0] != "record":
                continue
            for later in range(index + 1, len(terms)):
                if self.fails_when_absent(terms[later], path[1]):
                    dropped.add(index)
                    decided.add(later)
                    break
        return dropped, decided

    def fails_when_absent(self, node: Node, field_name: str) -> bool:
        """``record.<field_name> == <literal, not null>`` or ``record.<field_name> in <list>``."""
        if not isinstance(node, Binary):
            return False
        sides: tuple[tuple[Node, Node], ...] = ()
        if node.op == "==":
            sides = ((node.left, node.right), (node.right, node.left))
        elif node.op == "in":
            sides = ((node.left, node.right),)
        for side, other in sides:
            if isinstance(side, Select) and _map_field(side) == ("record", field_name):
                literal = self.literal_of(other)
                if literal is not _NOT_LITERAL and literal is not None:
                    return True
        return False

    def write(self, node: Node, facts: frozenset[Fact]) -> PythonSource:
        literal = self.literal_of(node)
        if literal is not _NOT_LITERAL:
            return _literal(literal)
        if isinstance(node, Select):
            return self.select(node, facts)
        if isinstance(node, Has):
            path = _map_field(node.select)
            if path is None or self.context is None or path[0] not in self.context.maps:
                raise Unsupported("has() on something other than a record map")
            return PythonSource(self.context.maps[path[0]].present(path[1]), _BOOL)
        if isinstance(node, Unary) and node.op == "!":
            operand = self.boolean(node.operand, facts)
            return PythonSource(f"(not {operand})", _BOOL)
        if isinstance(node, Logic):
            return self.logic(node, facts)
        if isinstance(node, Binary):
            return self.binary(node, facts)
        if isinstance(node, Call):
            return self.call(node, facts)
        if isinstance(node, Conditional):
            fixed = self.static_bool(node.cond)  # meta.source == "span": known for the whole lane
            if fixed is True:
                return self.write(node.then, facts | self.facts(node.cond))
            if fixed is False:
                return self.write(node.otherwise, facts)
            condition = self.boolean(node.cond, facts)
            then = self.write(node.then, facts | self.facts(node.cond))
            otherwise = self.write(node.otherwise, facts)
            types = None if then.types is None or otherwise.types is None else then.types | otherwise.types
            return PythonSource(f"({then.code} if {condition} else {otherwise.code})", types)
        raise Unsupported(type(node).__name__)

    def call(self, node: Call, facts: frozenset[Fact]) -> PythonSource:
        """A rule function the context binds, on arguments whose types it takes (never a method call)."""
        known = None if self.context is None or node.target is not None else self.context.functions.get(node.name)
        if known is None:
            raise Unsupported(f"a call of {node.name}")
        code, wanted, result = known
        if len(node.args) != len(wanted):
            raise Unsupported(f"{node.name} with {len(node.args)} arguments")
        args = []
        for arg, types in zip(node.args, wanted, strict=True):
            written = self.write(arg, facts)
            if written.types is None or not written.types <= types:
                raise Unsupported(f"an argument of {node.name} that may have another type")
            args.append(written.code)
        return PythonSource(f"{code}({', '.join(args)})", result)

    def boolean(self, node: Node, facts: frozenset[Fact]) -> str:
        written = self.write(node, facts)
        if written.types != _BOOL:
            raise Unsupported("an operand that may not be a bool")
        return written.code

    def select(self, node: Select, facts: frozenset[Fact]) -> PythonSource:
        assert self.context is not None
        if not isinstance(node.operand, Ident):
            raise Unsupported("a nested field")
        name, field_name = node.operand.name, node.field
        if name == "meta":
            known = self.context.meta.get(field_name)
            if known is None:
                raise Unsupported(f"meta.{field_name}")
            return PythonSource(known[0], known[1])
        typing = self.context.maps.get(name)
        if typing is None:
            raise Unsupported(f"variable {name}")
        present = field_name in typing.always or ("present", name, field_name) in facts
        if not present:
            raise Unsupported(f"{name}.{field_name} may be absent")
        word = typing.types.get(field_name)
        code = typing.read(field_name)
        if word is None or word == "any":
            return PythonSource(code, None)
        types = _FIELD_TYPE_SETS[word]
        nonnull = (
            field_name in typing.always
            or field_name in typing.nonnull_when_present
            or ("nonnull", name, field_name) in facts
        )
        return PythonSource(code, types if nonnull else types | {_NONE})

    def logic(self, node: Logic, facts: frozenset[Fact]) -> PythonSource:
        # A term whose value is fixed decides (false in &&, true in ||: CEL absorbs any error on
        # the other terms then) or drops out; the rest are written.
        decisive = node.op == "||"
        codes = []
        known = facts
        dropped = self.presence_decided(node.terms)[0] if node.op == "&&" else set()
        for index, term in enumerate(node.terms):
            value = self.static_bool(term)
            if value is decisive:
                return PythonSource(repr(decisive), _BOOL)
            if value is None and index not in dropped:
                codes.append(self.boolean(term, known))
            if node.op == "&&":
                known = known | self.facts(term)
        if not codes:
            return PythonSource(repr(not decisive), _BOOL)
        joiner = " and " if node.op == "&&" else " or "
        return PythonSource(f"({joiner.join(codes)})", _BOOL)

    def static_bool(self, node: Node) -> bool | None:
        """The value of a term fixed for the whole lane (``meta.source == "log"``), else None."""
        literal = self.literal_of(node)
        if literal is not _NOT_LITERAL:
            return literal if type(literal) is bool else None
        if isinstance(node, Unary) and node.op == "!":
            inner = self.static_bool(node.operand)
            return None if inner is None else not inner
        if isinstance(node, Binary) and node.op in ("==", "!="):
            left, right = self.static_string(node.left), self.static_string(node.right)
            if left is None or right is None:
                return None
            return (left == right) is (node.op == "==")
        if isinstance(node, Logic):
            values = [self.static_bool(term) for term in node.terms]
            decisive = node.op == "||"
            if decisive in values:
                return decisive
            return (not decisive) if all(v is not None for v in values) else None
        return None

    def static_string(self, node: Node) -> str | None:
        literal = self.literal_of(node)
        if type(literal) is str:
            return literal
        if (
            self.context is not None
            and isinstance(node, Select)
            and isinstance(node.operand, Ident)
            and node.operand.name == "meta"
        ):
            known = self.context.meta.get(node.field)
            if known is not None and known[1] == _STR and known[0][:1] in ("'", '"'):
                return str(known[0][1:-1])
        return None

    def binary(self, node: Binary, facts: frozenset[Fact]) -> PythonSource:
        op = node.op
        if op in ("==", "!="):
            return self.equality(node, facts, negated=op == "!=")
        if op == "in":
            return self.membership(node, facts)
        left, right = self.write(node.left, facts), self.write(node.right, facts)
        if op in _ORDERING:
            if _within(left.types, _NUMBERS) and _within(right.types, _NUMBERS):
                return PythonSource(f"({left.code} {op} {right.code})", _BOOL)
            if left.types == _STR and right.types == _STR:
                return PythonSource(f"({left.code} {op} {right.code})", _BOOL)
            raise Unsupported("an ordering between values of unknown types")
        if op == "+" and left.types == _STR and right.types == _STR:
            return PythonSource(f"({left.code} + {right.code})", _STR)
        raise Unsupported(f"operator {op}")

    def equality(self, node: Binary, facts: frozenset[Fact], *, negated: bool) -> PythonSource:
        for side, other in ((node.left, node.right), (node.right, node.left)):
            literal = self.literal_of(other)
            if literal is _NOT_LITERAL:
                continue
            value = self.write(side, facts)
            if literal is None or type(literal) is bool:
                op = "is not" if negated else "is"
                return PythonSource(f"({value.code} {op} {literal!r})", _BOOL)
            if type(literal) is str:
                op = "!=" if negated else "=="
                return PythonSource(f"({value.code} {op} {literal!r})", _BOOL)
            if type(literal) in (int, float):
                # Python's == agrees with CEL's for every JSON value but a bool (True == 1).
                op = "!=" if negated else "=="
                number = _literal(literal).code
                if value.types is not None and bool not in value.types:
                    return PythonSource(f"({value.code} {op} {number})", _BOOL)
                if is_plain_read(value.code):
                    if negated:
                        return PythonSource(f"(type({value.code}) is bool or {value.code} != {number})", _BOOL)
                    return PythonSource(f"(type({value.code}) is not bool and {value.code} == {number})", _BOOL)
            raise Unsupported("a number compared with a value of unknown type")
        left, right = self.write(node.left, facts), self.write(node.right, facts)
        same = (left.types == _STR and right.types == _STR) or (
            _within(left.types, _NUMBERS) and _within(right.types, _NUMBERS)
        )
        if not same:
            raise Unsupported("an equality between values of unknown types")
        op = "!=" if negated else "=="
        return PythonSource(f"({left.code} {op} {right.code})", _BOOL)

    def membership(self, node: Binary, facts: frozenset[Fact]) -> PythonSource:
        assert self.context is not None
        elements = self.literal_of(node.right)
        if type(elements) not in (list, tuple) or not all(type(e) is str for e in elements):
            raise Unsupported("in: not a constant list of strings")
        name = self.context.bind(frozenset(elements))
        value = self.write(node.left, facts)
        if value.types == _STR:
            return PythonSource(f"({value.code} in {name})", _BOOL)
        if not is_plain_read(value.code):
            raise Unsupported("in: an operand read twice")
        # A value of another type is in no list of strings (CEL's heterogeneous equality is false).
        return PythonSource(f"(type({value.code}) is str and {value.code} in {name})", _BOOL)

    def literal_of(self, node: Node) -> Any:
        if id(node) in self.folded:
            value = self.folded[id(node)]
        elif isinstance(node, Literal):
            value = node.value
        else:
            return _NOT_LITERAL
        if isinstance(value, UInt) or (type(value) is float and not math.isfinite(value)):
            raise Unsupported("a uint or a non-finite double")
        if value is None or type(value) in (str, int, float, bool):
            return value
        if type(value) in (list, tuple):
            return value
        raise Unsupported(f"a constant of type {type(value).__name__}")


class _NotLiteral:
    pass


_NOT_LITERAL: Final = _NotLiteral()


def _literal(value: Any) -> PythonSource:
    if value is None:
        return PythonSource("None", frozenset({_NONE}))
    if type(value) is bool:
        return PythonSource(repr(value), _BOOL)
    if type(value) is str:
        return PythonSource(repr(value), _STR)
    if type(value) is int:
        return PythonSource(repr(value), frozenset({int}))
    if type(value) is float:
        return PythonSource(repr(value), frozenset({float}))
    raise Unsupported("a list literal outside in")


def _map_field(node: Select) -> tuple[str, str] | None:
    return (node.operand.name, node.field) if isinstance(node.operand, Ident) else None


def _within(types: Types, allowed: frozenset[type]) -> bool:
    return types is not None and bool(types) and types <= allowed


def is_plain_read(code: str) -> bool:
    """``r['field']`` or ``r.field``: reading it twice costs a lookup and cannot differ."""
    if code.count("[") == 1 and code.endswith("]") and code[0].isidentifier():
        return True
    variable, dot, attribute = code.partition(".")
    return bool(dot) and variable.isidentifier() and attribute.isidentifier()
