"""The CEL subset rule conditions are written in, compiled into Python closures.

An expression is parsed once, checked once against an :class:`Environment`, and
compiled into nested closures; evaluating it against a record costs a few Python
calls, not an interpreter walk. The closures use no eval/exec/compile;
:func:`python_source` writes an expression as Python source only where that is exact,
for the action-log lane, which checks the source before it compiles it
(``processor.evaluate.loglane``).

    env = Environment(variables={"record": "map", "lists": "map"},
                      known_fields={"record": frozenset({"kind", "status", "result"})},
                      constants={"lists": {"nondeterministic": ["llm_call", "random"]}})
    expr = compile_expression('record.kind in lists.nondeterministic && !has(record.result)', env)
    expr.predicate({"record": {"kind": "llm_call", "status": "ok"}})   # True

**In the subset** (with CEL's semantics):

- Literals: int (decimal, hex), uint (``1u``), double, string (single, double and
  triple quotes; raw ``r"..."``; all CEL escapes), bool, null, lists, maps.
  ``//`` comments.
- Operators, loosest first: ``?:``, ``||``, ``&&``, ``== != < <= > >= in``,
  ``+ -``, ``* / %``, unary ``! -``, then ``a.b``, ``a[b]``, ``f(x)``, ``x.f(y)``.
- ``&&`` and ``||`` absorb errors both ways (``false && error`` is false, ``true ||
  error`` is true); otherwise an error propagates.
- Equality across int, uint and double compares numbers (``1 == 1.0``); ``==``
  between other different types is false. Ordering works within a type and across
  numbers; anything else (``"a" < 1``) is an EvaluationError, as are 64-bit int
  overflow and integer division or modulus by zero. Double division by zero gives
  an infinity, as IEEE 754 and CEL say. Arithmetic does not mix types (``1 + 1.0``
  is an error; convert with ``double()``).
- Selecting a missing map key (``record.result_ref``) is an EvaluationError; test
  with ``has(record.result_ref)`` first. A key present with a null value is present.
- Macros: ``has(x.f)``, ``l.exists(v, p)``, ``l.all(v, p)``, ``l.exists_one(v, p)``,
  ``l.map(v, e)``, ``l.map(v, p, e)``, ``l.filter(v, p)``; over a map they iterate its keys.
- Functions: ``size`` (also ``x.size()``), ``int``, ``uint``, ``double``, ``string``,
  ``bool``, ``dyn``, ``s.startsWith(t)``, ``s.endsWith(t)``, ``s.contains(t)``,
  ``s.matches(re)`` (also ``matches(s, re)``), ``s.lowerAscii()``, ``s.upperAscii()``,
  ``duration("1h30m")`` (seconds, as a double), plus the Environment's own functions.

**Out of the subset**: bytes literals, ``timestamp()`` and the google.protobuf
Duration/Timestamp types (``duration()`` returns seconds), ``type()`` and type
denotations, protobuf messages and ``Msg{field: v}`` construction, qualified names
starting with ``.``, optional values (``?.``), ``cel.bind``, and the strings
extension beyond ``lowerAscii``/``upperAscii`` (no ``split``, ``replace``, ``trim``...).

**Regular expressions** are RE2's (the syntax CEL defines for ``matches``) and are
matched by RE2 itself, in time linear in the text whatever the pattern: no rule and
no record can make a match backtrack. What RE2 cannot compile (backreferences,
lookaround, atomic or conditional groups, possessive quantifiers) is an error with
a message saying so. Literal patterns are checked and compiled once, at compile
time; patterns are limited to 1,000 characters and matched text to 100,000.

**Limits**: sources of at most 10,000 characters, nesting of at most 100 levels.
**Cost** (:mod:`._cost`): each expression's worst case is estimated when it compiles
(nested macros multiply the sizes of their lists) and refused past the Environment's
:class:`CostLimits` ``max_cost``; while it runs, each macro call spends the size
of its list from a per-evaluation budget, and past ``iterations`` the evaluation
fails with :class:`BudgetExceeded` (an EvaluationError that ``&&``, ``||`` and the
macros do not absorb).

**Compile-time errors** (ExpressionError with 1-based line:col in the source):
syntax, undeclared names, fields outside ``known_fields`` (with the closest known
name suggested), missing keys of constants, unknown functions, wrong arity, type
errors visible from literals (``"a" + 1``, ``1 && true``), invalid literal regular
expressions, and built-in calls on literals that can never succeed
(``duration("5 minutes")``).

**Values**: activations hold plain Python values: dict for maps (an absent key is
an absent field), list or tuple, str, int, float, bool, None for null. uint values
are :class:`UInt` (an ``int``). A constant list may come back as a tuple.

**guard** (a :class:`Guard`, or None) tells cheaply when the expression is certainly
false on an activation, from its top-level ``&&``/``||`` of ``has(v.f)``, ``v.f ==
"literal"`` and ``v.f in <constant strings>`` (see :mod:`._guards`); **path** is
``(variable, field)`` when the expression is exactly ``variable.field``.

**references** lists the (variable, field) pairs an expression reads, so the engine
keeps only those fields; ``(variable, "*")`` means the whole value is used (for
example ``size(record)`` or ``record[some_key]``). Constants are not listed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from processor.errors import EvaluationError, ExpressionError
from processor.evaluate.cel._ast import Node
from processor.evaluate.cel._checker import WHOLE_VALUE, check
from processor.evaluate.cel._codegen import FieldTyping, PythonSource, SourceContext, Unsupported, python_source
from processor.evaluate.cel._compiler import Compiler, always_bool
from processor.evaluate.cel._cost import BudgetExceeded, CostLimits, estimate_cost
from processor.evaluate.cel._environment import Environment
from processor.evaluate.cel._guards import Guard, extract_guard, field_path
from processor.evaluate.cel._liveness import references_when
from processor.evaluate.cel._parser import parse
from processor.evaluate.cel._values import UInt

__all__ = [
    "WHOLE_VALUE",
    "BudgetExceeded",
    "CompiledExpression",
    "CostLimits",
    "Environment",
    "EvaluationError",
    "ExpressionError",
    "FieldTyping",
    "Guard",
    "PythonSource",
    "SourceContext",
    "UInt",
    "Unsupported",
    "compile_expression",
    "python_source",
    "references_when",
]


class CompiledExpression:
    """A checked, compiled expression.

    ``evaluate(activation)`` returns the CEL value or raises EvaluationError;
    ``predicate(activation)`` is True only when the value is the bool true (an
    EvaluationError still propagates). Both are plain closures, so calling them
    costs no method dispatch.
    """

    __slots__ = (
        "constants", "cost", "evaluate", "guard", "path", "predicate", "references", "result_type", "source", "tree"
    )

    evaluate: Callable[[Mapping[str, Any]], Any]
    predicate: Callable[[Mapping[str, Any]], bool]

    def __init__(
        self,
        source: str,
        evaluate: Callable[[Mapping[str, Any]], Any],
        references: frozenset[tuple[str, str]],
        result_type: str,
        always_bool: bool = False,
        *,
        cost: int = 0,
        guard: Guard | None = None,
        path: tuple[str, str] | None = None,
        tree: Node | None = None,
        constants: Mapping[int, Any] | None = None,
    ) -> None:
        self.source = source
        # The checked tree and its folded constant paths (id(node) -> value): what
        # processor.evaluate.cel.python_source translates. The tree keeps the ids valid.
        self.tree = tree
        self.constants: Mapping[int, Any] = constants if constants is not None else {}
        # The estimated worst case in steps (see CostLimits), at most the environment's max_cost.
        self.cost = cost
        # When this refutes an activation, evaluate() would return false there (see Guard).
        self.guard = guard
        self.path = path
        self.evaluate = evaluate
        self.references = references
        # The CEL type the checker inferred ("bool", "int", ... or "dyn").
        self.result_type = result_type

        if always_bool:
            # The closure can only return True or False: it is its own predicate.
            self.predicate = evaluate
        else:

            def predicate(activation: Mapping[str, Any]) -> bool:
                return evaluate(activation) is True

            self.predicate = predicate

    def __repr__(self) -> str:
        return f"CompiledExpression({self.source!r})"


def compile_expression(source: str, env: Environment) -> CompiledExpression:
    """Parse, check and compile ``source``; raises ExpressionError with line:col on any problem."""
    if not isinstance(source, str):
        raise ExpressionError(f"an expression must be a string, not {type(source).__name__}")
    try:
        tree = parse(source)
        checked = check(source, tree, env)
        cost = estimate_cost(
            source,
            tree,
            checked.constants,
            env_constants=env.constants,
            extra_functions=frozenset(env.functions),
            limits=env.limits,
        )
        code = Compiler(source, env, checked).compile(tree)
    except RecursionError:
        # The depth limits keep a parse well inside Python's stack; this only
        # happens when the caller was itself nearly out of stack.
        raise ExpressionError("expression is nested too deeply to compile") from None
    return CompiledExpression(
        source,
        code.fn,
        frozenset(checked.references),
        tree.ctype,
        always_bool(tree),
        cost=cost,
        guard=extract_guard(tree, checked.constants),
        path=field_path(tree, checked.constants),
        tree=tree,
        constants=checked.constants,
    )
