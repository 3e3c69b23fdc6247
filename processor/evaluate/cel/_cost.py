"""What an expression may cost: an estimate before it runs, and a budget while it runs.

**The estimate** (:func:`estimate_cost`) is a worst case in *steps*, as CEL
implementations estimate cost at check time: every node evaluated counts one; a
string function (``matches``, ``contains``, ``lowerAscii``...) counts as many steps
as the longest string it may scan, in thousands of characters; and a comprehension
macro (``all``, ``exists``, ``exists_one``, ``map``, ``filter``) costs its range plus,
for each item the range may hold, its body. Nested macros therefore multiply. The
size of a list written in the expression or held in a constant is known; a list or
map read from a record is assumed to hold at most :attr:`CostLimits.list_size`
items, a string at most :attr:`CostLimits.string_chars` characters.

**The budget** bounds one evaluation whatever the records hold: each macro call
spends the size of its list or map (the items it may visit, even if ``exists`` stops
early) from :attr:`CostLimits.iterations`, as does what a macro's body builds
(lists and strings made by ``+``, lists kept by ``map``) and what it scans (``in``
over a list, ``==`` between lists or maps); past it the evaluation fails with
:class:`BudgetExceeded` (an EvaluationError, so the rule does not fire on that
record and the error is counted like any other). The budget lives in the
macros themselves: the outermost macro of an evaluation opens it and nested macros
draw on the same one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final

from processor.errors import EvaluationError
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
from processor.evaluate.cel._lexer import error_at

# Functions that scan a whole string (or build one as long): their cost grows with it.
_STRING_SCANS: Final = frozenset({"matches", "contains", "startsWith", "endsWith", "lowerAscii", "upperAscii"})
# One step stands for a scan of this many characters (C code scans far faster than a closure call).
_CHARS_PER_STEP: Final = 1_000
# What an environment's own function (timeDerived...) is assumed to cost.
_EXTRA_FUNCTION_STEPS: Final = 10

# The key under which an evaluation's remaining budget travels in macro scopes. It is
# not an identifier, so no expression can read or shadow it.
BUDGET_KEY: Final = " budget"


@dataclass(frozen=True, slots=True)
class CostLimits:
    """Bounds on what one expression may cost (see the module docstring)."""

    # Refuse an expression whose estimated worst case exceeds this many steps.
    max_cost: int = 1_000_000
    # Items assumed in a list or map read from a record, when estimating.
    list_size: int = 100
    # Characters assumed in a string read from a record, when estimating.
    string_chars: int = 100_000
    # Items the macros of one evaluation may be given (each call spends its list's size).
    iterations: int = 100_000

    def problems(self) -> list[str]:
        return [f"{name} must be at least 1" for name in self.__slots__ if getattr(self, name) < 1]


class BudgetExceeded(EvaluationError):
    """An evaluation visited more macro items than its budget allows."""


def budget_exceeded(limit: int) -> BudgetExceeded:
    return BudgetExceeded(f"evaluation stopped: its macros went over {limit} items (the per-evaluation budget)")


@dataclass(slots=True)
class _Estimate:
    steps: int
    # For a list, map or string: the most items (characters) it may hold; None for other values.
    size: int | None = None


class _Estimator:
    def __init__(
        self,
        constants: dict[int, Any],
        env_constants: dict[str, Any],
        extra_functions: frozenset[str],
        limits: CostLimits,
    ) -> None:
        self.constants = constants
        self.env_constants = env_constants
        self.extra_functions = extra_functions
        self.limits = limits
        self.scope: list[str] = []
        # The costliest macro seen, to point the refusal at it.
        self.worst: tuple[int, Comprehension] | None = None

    def sized(self, value: Any) -> _Estimate:
        if isinstance(value, str | tuple | list | dict):
            return _Estimate(1, len(value))
        return _Estimate(1)

    def unknown(self, steps: int, node: Node) -> _Estimate:
        """A value read from the activation: its size is only assumed."""
        if node.ctype == "string":
            return _Estimate(steps, self.limits.string_chars)
        if node.ctype in ("list", "map", "dyn"):
            # A dyn may be a list, a map or a string: assume the costlier of their sizes per use.
            return _Estimate(steps, self.limits.list_size)
        return _Estimate(steps)

    def string_size(self, node: Node, estimate: _Estimate) -> int:
        written = isinstance(node, Literal) or id(node) in self.constants
        return estimate.size if written and estimate.size is not None else self.limits.string_chars

    def string_steps(self, size: int) -> int:
        return 1 + size // _CHARS_PER_STEP

    def estimate(self, node: Node) -> _Estimate:
        if id(node) in self.constants:
            return self.sized(self.constants[id(node)])
        if isinstance(node, Literal):
            return self.sized(node.value)
        if isinstance(node, Ident):
            if node.name in self.env_constants and node.name not in self.scope:
                return self.sized(self.env_constants[node.name])
            return self.unknown(1, node)
        if isinstance(node, Select):
            return self.unknown(self.estimate(node.operand).steps + 1, node)
        if isinstance(node, Has):
            return _Estimate(self.estimate(node.select.operand).steps + 1)
        if isinstance(node, Index):
            return self.unknown(self.estimate(node.operand).steps + self.estimate(node.index).steps + 1, node)
        if isinstance(node, Call):
            return self.estimate_call(node)
        if isinstance(node, Unary):
            return _Estimate(self.estimate(node.operand).steps + 1)
        if isinstance(node, Binary):
            return self.estimate_binary(node)
        if isinstance(node, Logic):
            return _Estimate(sum(self.estimate(t).steps for t in node.terms) + 1)
        if isinstance(node, Conditional):
            then, otherwise = self.estimate(node.then), self.estimate(node.otherwise)
            sizes = [s for s in (then.size, otherwise.size) if s is not None]
            return _Estimate(
                self.estimate(node.cond).steps + max(then.steps, otherwise.steps) + 1, max(sizes) if sizes else None
            )
        if isinstance(node, ListLit):
            return _Estimate(sum(self.estimate(e).steps for e in node.elements) + 1, len(node.elements))
        if isinstance(node, MapLit):
            steps = sum(self.estimate(k).steps + self.estimate(v).steps for k, v in node.entries)
            return _Estimate(steps + 1, len(node.entries))
        if isinstance(node, Comprehension):
            return self.estimate_comprehension(node)
        raise AssertionError(f"unhandled node {type(node).__name__}")

    def estimate_call(self, node: Call) -> _Estimate:
        arg_nodes = ((node.target,) if node.target is not None else ()) + node.args
        args = [self.estimate(a) for a in arg_nodes]
        steps = sum(a.steps for a in args) + 1
        if node.target is None and node.name in self.extra_functions:
            return _Estimate(steps + _EXTRA_FUNCTION_STEPS)
        if node.name in _STRING_SCANS:
            # A string written in the expression has its own length; any other may be as long as a record's.
            longest = max(self.string_size(n, a) for n, a in zip(arg_nodes, args, strict=True))
            steps += self.string_steps(longest)
            return _Estimate(steps, longest if node.name in ("lowerAscii", "upperAscii") else None)
        if node.name == "string":
            return _Estimate(steps, args[0].size if args else None)
        return _Estimate(steps)

    def estimate_binary(self, node: Binary) -> _Estimate:
        left, right = self.estimate(node.left), self.estimate(node.right)
        steps = left.steps + right.steps + 1
        if node.op == "in" and right.size is not None:
            # Membership in a list compares item by item.
            return _Estimate(steps + right.size)
        if node.op == "+" and left.size is not None and right.size is not None:
            # Concatenation copies both sides.
            size = left.size + right.size
            return _Estimate(steps + size // _CHARS_PER_STEP, size)
        containers = ("list", "map")
        if node.op in ("==", "!=") and (node.left.ctype in containers or node.right.ctype in containers):
            # Lists and maps compare item by item (a value of unknown type is rarely one: not counted).
            sizes = [size for size in (left.size, right.size) if size is not None]
            return _Estimate(steps + min(sizes, default=self.limits.list_size))
        return _Estimate(steps)

    def estimate_comprehension(self, node: Comprehension) -> _Estimate:
        iter_range = self.estimate(node.iter_range)
        items = iter_range.size if iter_range.size is not None else self.limits.list_size
        self.scope.append(node.var)
        try:
            body = 1
            if node.predicate is not None:
                body += self.estimate(node.predicate).steps
            if node.transform is not None:
                body += self.estimate(node.transform).steps
        finally:
            self.scope.pop()
        steps = iter_range.steps + items * body + 1
        if self.worst is None or steps > self.worst[0]:
            self.worst = (steps, node)
        return _Estimate(steps, items if node.macro in ("map", "filter") else None)


def estimate_cost(
    source: str,
    tree: Node,
    constants: dict[int, Any],
    *,
    env_constants: dict[str, Any],
    extra_functions: frozenset[str],
    limits: CostLimits,
) -> int:
    """The worst-case steps of ``tree``; past ``limits.max_cost`` raises ExpressionError at the costliest macro."""
    estimator = _Estimator(constants, env_constants, extra_functions, limits)
    steps = estimator.estimate(tree).steps
    if steps <= limits.max_cost:
        return steps
    where = estimator.worst[1].pos if estimator.worst is not None else tree.pos
    nesting = _macro_depth(tree)
    why = f"; {nesting} comprehension macros nested in one another multiply their list sizes" if nesting > 1 else ""
    raise error_at(
        source,
        where,
        f"the expression may cost about {_rounded(steps)} steps on one record, more than the limit of "
        f"{limits.max_cost:,}{why} (lists from records count as {limits.list_size} items)",
    )


def _macro_depth(node: Node) -> int:
    below = max((_macro_depth(child) for child in node.children()), default=0)
    return below + 1 if isinstance(node, Comprehension) else below


def _rounded(steps: int) -> str:
    """A large count readable at a glance: 123,456,789 or 1.2e+40."""
    if steps < 10**15:
        return f"{steps:,}"
    return f"{steps:.1e}" if steps < 10**300 else f"10^{int(math.log10(steps))}"
