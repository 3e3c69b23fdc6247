"""Syntax tree of the CEL subset.

Every node keeps the source offset of the token an error about it should point at
(for an operator, the operator itself). ``ctype`` is filled in by the checker.
``&&`` and ``||`` chains are n-ary so a long chain stays shallow and evaluates in a loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

MAX_DEPTH: Final = 100


@dataclass(eq=False, slots=True)
class Node:
    pos: int
    height: int = field(default=1, init=False)
    ctype: str = field(default="dyn", init=False)

    def children(self) -> tuple[Node, ...]:
        return ()


@dataclass(eq=False, slots=True)
class Literal(Node):
    value: object


@dataclass(eq=False, slots=True)
class Ident(Node):
    name: str


@dataclass(eq=False, slots=True)
class Select(Node):
    """``operand.field``; ``pos`` is the field name's offset."""

    operand: Node
    field: str

    def children(self) -> tuple[Node, ...]:
        return (self.operand,)


@dataclass(eq=False, slots=True)
class Has(Node):
    """``has(operand.field)``: presence of a map key."""

    select: Select

    def children(self) -> tuple[Node, ...]:
        return (self.select,)


@dataclass(eq=False, slots=True)
class Index(Node):
    operand: Node
    index: Node

    def children(self) -> tuple[Node, ...]:
        return (self.operand, self.index)


@dataclass(eq=False, slots=True)
class Call(Node):
    """A function call ``name(args)`` or receiver call ``target.name(args)``; ``pos`` is the name's offset."""

    name: str
    args: tuple[Node, ...]
    target: Node | None

    def children(self) -> tuple[Node, ...]:
        return self.args if self.target is None else (self.target, *self.args)


@dataclass(eq=False, slots=True)
class Unary(Node):
    op: str  # "!" or "-"
    operand: Node

    def children(self) -> tuple[Node, ...]:
        return (self.operand,)


@dataclass(eq=False, slots=True)
class Binary(Node):
    op: str  # == != < <= > >= in + - * / %
    left: Node
    right: Node

    def children(self) -> tuple[Node, ...]:
        return (self.left, self.right)


@dataclass(eq=False, slots=True)
class Logic(Node):
    op: str  # "&&" or "||"
    terms: tuple[Node, ...]

    def children(self) -> tuple[Node, ...]:
        return self.terms


@dataclass(eq=False, slots=True)
class Conditional(Node):
    cond: Node
    then: Node
    otherwise: Node

    def children(self) -> tuple[Node, ...]:
        return (self.cond, self.then, self.otherwise)


@dataclass(eq=False, slots=True)
class ListLit(Node):
    elements: tuple[Node, ...]

    def children(self) -> tuple[Node, ...]:
        return self.elements


@dataclass(eq=False, slots=True)
class MapLit(Node):
    entries: tuple[tuple[Node, Node], ...]

    def children(self) -> tuple[Node, ...]:
        return tuple(n for entry in self.entries for n in entry)


@dataclass(eq=False, slots=True)
class Comprehension(Node):
    """A macro over a list or map: exists, all, exists_one, map, filter; ``pos`` is the macro name's offset.

    ``transform`` is the mapped expression of ``map``; ``predicate`` is the test
    (``None`` for the two-argument ``map``).
    """

    macro: str
    iter_range: Node
    var: str
    var_pos: int
    predicate: Node | None
    transform: Node | None

    def children(self) -> tuple[Node, ...]:
        return tuple(n for n in (self.iter_range, self.predicate, self.transform) if n is not None)
