"""Which kept fields of a stateful rule may be remembered as digests instead of values.

A sequence or absence rule keeps fields of its opening record for ``then`` to read as
``first.<field>``. A field that ``then`` only tests for presence or compares for
equality with the same field of the later record (``record.f != first.f``), or with
``null`` or ``""``, needs no value: its 8-byte digest answers those questions. The
engine then hands ``then`` either the later record's own value (digests equal) or a
string equal to nothing a record holds (digests differ), so each comparison has the
result the value itself would give. A field that anything renders or reads otherwise
(a message, an ordering, a function) keeps its value.
"""

from __future__ import annotations

from processor.evaluate.cel._ast import Binary, Comprehension, Has, Ident, Literal, Node, Select
from processor.evaluate.cel._parser import parse

# Literals a digested value may be compared with: a digest stands for a non-empty string.
_EMPTY_LITERALS = ("",)


def equality_only_fields(then_source: str) -> frozenset[str]:
    """Fields of ``first`` that ``then`` only tests with ``has`` or compares for equality (see module doc)."""
    tree = parse(then_source)
    allowed: set[str] = set()
    refused: set[str] = set()
    whole = _walk(tree, allowed, refused)
    if whole:
        return frozenset()
    return frozenset(allowed - refused)


def _first_field(node: Node) -> str | None:
    if isinstance(node, Select) and isinstance(node.operand, Ident) and node.operand.name == "first":
        return node.field
    return None


def _equality_partner(first_field: str, other: Node) -> bool:
    if isinstance(other, Select) and isinstance(other.operand, Ident) and other.operand.name == "record":
        return other.field == first_field
    if isinstance(other, Literal):
        return other.value is None or (type(other.value) is str and other.value in _EMPTY_LITERALS)
    return False


def _walk(node: Node, allowed: set[str], refused: set[str]) -> bool:
    """Sort the reads of ``first`` below ``node``; True when ``first`` is used as a whole."""
    if isinstance(node, Comprehension) and node.var == "first":
        return True  # a loop variable shadows first: give up rather than track scopes
    if isinstance(node, Has):
        field = _first_field(node.select)
        if field is not None:
            allowed.add(field)
            return False
    if isinstance(node, Binary) and node.op in ("==", "!="):
        for side, other in ((node.left, node.right), (node.right, node.left)):
            field = _first_field(side)
            if field is not None and _equality_partner(field, other):
                allowed.add(field)
                return _walk(other, allowed, refused)
    field = _first_field(node)
    if field is not None:
        refused.add(field)
        return False
    if isinstance(node, Ident) and node.name == "first":
        return True
    return any(_walk(child, allowed, refused) for child in node.children())
