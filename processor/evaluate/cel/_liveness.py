"""What an expression can still read once some of its paths are known.

A rule's ``then`` may test ``first`` only on spans (``meta.source == "log" || ...``): on
action-log lines that test is decided before it reads anything. ``references_when``
gives the (variable, field) pairs the expression can read when the paths in ``known``
hold those values: a term of ``&&`` / ``||`` that decides the whole chain leaves the
other terms unread, and a conditional with a decided test reads one branch. CEL's
``&&`` and ``||`` are commutative (a decisive term wins over an error in any other),
so a decided chain gives its result whatever the other terms would have read.

The answer is a superset: what this cannot decide it counts as read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from processor.evaluate.cel._ast import (
    Binary,
    Has,
    Ident,
    Index,
    Literal,
    Logic,
    Node,
    Select,
    Unary,
)
from processor.evaluate.cel._ast import Conditional as Ternary
from processor.evaluate.cel._checker import WHOLE_VALUE

# Neither true nor false: the expression depends on the record.
_OPEN: Final = object()


def references_when(
    tree: Node, constants: Mapping[int, Any], known: Mapping[tuple[str, str], str]
) -> frozenset[tuple[str, str]]:
    """The (variable, field) pairs ``tree`` can read when each ``known`` path holds its string."""
    out: set[tuple[str, str]] = set()
    _Reader(constants, known, out).read(tree)
    return frozenset(out)


class _Reader:
    def __init__(
        self, constants: Mapping[int, Any], known: Mapping[tuple[str, str], str], out: set[tuple[str, str]]
    ) -> None:
        self.constants = constants
        self.known = known
        self.out = out

    def read(self, node: Node) -> None:
        if id(node) in self.constants or isinstance(node, Literal):
            return
        if self.decided(node) is not _OPEN:
            return  # its value is known: nothing in it is read for it
        if isinstance(node, Logic):
            for term in node.terms:
                self.read(term)  # none decides the chain (decided() said so); each may be read
            return
        if isinstance(node, Ternary):
            test = self.decided(node.cond)
            if test is True:
                self.read(node.then)
            elif test is False:
                self.read(node.otherwise)
            else:
                for child in (node.cond, node.then, node.otherwise):
                    self.read(child)
            return
        path = self.path(node)
        if path is not None:
            self.out.add(path)
            return
        if isinstance(node, Ident):
            self.out.add((node.name, WHOLE_VALUE))
            return
        for child in node.children():
            self.read(child)

    def path(self, node: Node) -> tuple[str, str] | None:
        """``variable.field``, ``variable["field"]`` or ``has(variable.field)``: the pair it reads."""
        if isinstance(node, Has):
            node = node.select
        if isinstance(node, Select) and isinstance(node.operand, Ident):
            return node.operand.name, node.field
        if (
            isinstance(node, Index)
            and isinstance(node.operand, Ident)
            and isinstance(node.index, Literal)
            and type(node.index.value) is str
        ):
            return node.operand.name, node.index.value
        return None

    def decided(self, node: Node) -> Any:
        """True or False when ``known`` decides ``node`` as a bool, else _OPEN."""
        if isinstance(node, Literal):
            return node.value if type(node.value) is bool else _OPEN
        if isinstance(node, Unary) and node.op == "!":
            inner = self.decided(node.operand)
            return (not inner) if type(inner) is bool else _OPEN
        if isinstance(node, Logic):
            decisive = node.op == "||"
            undecided = False
            for term in node.terms:
                value = self.decided(term)
                if value is decisive:
                    return decisive
                if value is _OPEN:
                    undecided = True
            return _OPEN if undecided else (not decisive)
        if isinstance(node, Binary) and node.op in ("==", "!="):
            left, right = self.value(node.left), self.value(node.right)
            if left is _OPEN or right is _OPEN:
                return _OPEN
            return (left == right) == (node.op == "==")
        return _OPEN

    def value(self, node: Node) -> Any:
        """A string ``node`` certainly is (a literal, or a known path), else _OPEN."""
        if isinstance(node, Literal):
            return node.value if type(node.value) is str else _OPEN
        constant = self.constants.get(id(node), _OPEN)
        if type(constant) is str:
            return constant
        path = self.path(node) if not isinstance(node, Has) else None
        if path is not None and path in self.known:
            return self.known[path]
        return _OPEN
