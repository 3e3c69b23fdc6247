"""Guards: cheap necessary conditions of a boolean expression, read from its syntax tree.

A guard answers one question about an activation: *is the expression certainly false
here?* It is built from the expression's top-level ``&&``/``||`` structure and three
kinds of atoms over activation variables (``var.field``):

- ``has(var.field)``: false when ``var`` is a map without ``field``;
- ``var.field == "literal"``: false when the field holds a string other than the literal;
- ``var.field in <constant list of strings>``: false when the field holds a string not in it;

and their negations (``!has(var.field)``, ``var.field != "literal"``, ``!(var.field in
<constant list of strings>)``), false in the opposite cases.

CEL's ``&&`` is false as soon as one term is false, errors in other terms
notwithstanding, and ``||`` is false when every term is; so a refuted guard means the
expression evaluates to false, never to an error. Anything else (negations, ternaries,
macros, comparisons with non-literals) is "unknown" and never refutes. A caller can
therefore skip evaluating an expression whose guard is refuted, and index records by
the fields guards read (their presence and, for value atoms, their value).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

from processor.evaluate.cel._ast import Binary, Has, Ident, ListLit, Literal, Logic, Node, Select, Unary

_ABSENT: Final = object()


class Guard:
    """A necessary condition of an expression; see the module docstring.

    ``presence`` lists the ``(variable, field)`` pairs whose presence it reads,
    ``values`` those whose (string) value it reads, with every literal it compares
    them to.
    """

    __slots__ = ("_refuted", "presence", "values")

    def __init__(
        self,
        refuted: Callable[[Mapping[str, Any]], bool],
        presence: frozenset[tuple[str, str]],
        values: Mapping[tuple[str, str], frozenset[str]],
    ) -> None:
        self._refuted = refuted
        self.presence = presence
        self.values = dict(values)

    def refuted(self, activation: Mapping[str, Any]) -> bool:
        """True when the expression certainly evaluates to false (not to an error) on ``activation``."""
        return self._refuted(activation)


class _Atom:
    __slots__ = ("allowed", "field", "negated", "variable")

    def __init__(self, variable: str, field: str, allowed: frozenset[str] | None, negated: bool = False) -> None:
        self.variable = variable
        self.field = field
        # None: a presence test; else the strings the field may hold for the (plain) atom to be true.
        self.allowed = allowed
        self.negated = negated

    def negation(self) -> _Atom:
        return _Atom(self.variable, self.field, self.allowed, not self.negated)

    def refuted(self, activation: Mapping[str, Any]) -> bool:
        container = activation.get(self.variable, _ABSENT)
        if type(container) is not dict:
            return False
        if self.allowed is None:
            return (self.field in container) is self.negated
        value = container.get(self.field, _ABSENT)
        # A missing field or a value of another type is an error or left to the expression.
        return type(value) is str and (value in self.allowed) is self.negated


_Term = _Atom | tuple[str, tuple["_Term", ...]]


def _refutes(term: _Term, activation: Mapping[str, Any]) -> bool:
    if isinstance(term, _Atom):
        return term.refuted(activation)
    op, terms = term
    if op == "&&":
        return any(_refutes(t, activation) for t in terms)
    return all(_refutes(t, activation) for t in terms)


def _atoms(term: _Term) -> list[_Atom]:
    if isinstance(term, _Atom):
        return [term]
    return [atom for t in term[1] for atom in _atoms(t)]


def extract_guard(
    tree: Node, constants: Mapping[int, Any], variables: frozenset[str] | None = None
) -> Guard | None:
    """The guard of a checked tree (None when no part of it can ever refute it).

    ``constants`` maps ``id(node)`` to the value of nodes fixed by the environment's
    constants (the checker's result); ``variables``, when given, limits atoms to those
    activation variables.
    """

    def variable_field(node: Node) -> tuple[str, str] | None:
        if isinstance(node, Select) and isinstance(node.operand, Ident) and id(node.operand) not in constants:
            name = node.operand.name
            if variables is None or name in variables:
                return name, node.field
        return None

    def string_list(node: Node) -> frozenset[str] | None:
        """The elements of a constant list of strings (``x in`` it is a set test)."""
        value: Any
        if isinstance(node, ListLit):
            if not all(isinstance(e, Literal) for e in node.elements):
                return None
            value = [e.value for e in node.elements if isinstance(e, Literal)]
        elif id(node) in constants:
            value = constants[id(node)]
        else:
            return None
        if isinstance(value, (list, tuple)) and all(type(v) is str for v in value):
            return frozenset(str(v) for v in value)
        return None

    def term_of(node: Node) -> _Term | None:
        if isinstance(node, Logic):
            terms = [term_of(t) for t in node.terms]
            if node.op == "&&":
                known = tuple(t for t in terms if t is not None)
                return ("&&", known) if known else None
            if any(t is None for t in terms):
                return None
            return ("||", tuple(t for t in terms if t is not None))
        if isinstance(node, Has):
            path = variable_field(node.select)
            return None if path is None else _Atom(path[0], path[1], None)
        if isinstance(node, Unary) and node.op == "!":
            # Only the negation of an atom: ``!(a && b)`` would need the other connective.
            inner = node.operand
            if isinstance(inner, Has) or (isinstance(inner, Binary) and inner.op in ("==", "in")):
                atom = term_of(inner)
                return atom.negation() if isinstance(atom, _Atom) else None
            return None
        if isinstance(node, Binary) and node.op == "!=":
            atom = term_of(Binary(node.pos, "==", node.left, node.right))
            return atom.negation() if isinstance(atom, _Atom) else None
        if isinstance(node, Binary) and node.op in ("==", "in"):
            sides = [(node.left, node.right)]
            if node.op == "==":
                sides.append((node.right, node.left))
            for operand, other in sides:
                path = variable_field(operand)
                if path is None:
                    continue
                if node.op == "==":
                    # Only a string literal: == with anything else is not a set test.
                    if not (isinstance(other, Literal) and type(other.value) is str):
                        continue
                    allowed: frozenset[str] | None = frozenset((other.value,))
                else:
                    allowed = string_list(other)
                if allowed is not None:
                    return _Atom(path[0], path[1], allowed)
        return None

    term = term_of(tree)
    if term is None:
        return None
    atoms = _atoms(term)
    presence = frozenset((a.variable, a.field) for a in atoms if a.allowed is None)
    values: dict[tuple[str, str], frozenset[str]] = {}
    for atom in atoms:
        if atom.allowed is not None:
            key = (atom.variable, atom.field)
            values[key] = values.get(key, frozenset()) | atom.allowed
    root = term

    def refuted(activation: Mapping[str, Any]) -> bool:
        return _refutes(root, activation)

    return Guard(refuted, presence, values)


def field_path(tree: Node, constants: Mapping[int, Any]) -> tuple[str, str] | None:
    """``(variable, field)`` when the whole expression is ``variable.field`` on an activation variable.

    Such an expression fails exactly when the variable is a map without the field.
    """
    if isinstance(tree, Select) and isinstance(tree.operand, Ident) and id(tree.operand) not in constants:
        return tree.operand.name, tree.field
    return None
