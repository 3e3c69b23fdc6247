"""The declarations an expression is compiled against: variables, their fields, constants, functions."""

from __future__ import annotations

import keyword
from collections.abc import Callable, Mapping
from typing import Any, Final

from processor.evaluate.cel._cost import CostLimits
from processor.evaluate.cel._functions import BUILTINS
from processor.evaluate.cel._lexer import KEYWORDS, RESERVED_WORDS
from processor.evaluate.cel._values import kind

VARIABLE_TYPES: Final = frozenset({"map", "int", "uint", "double", "string", "bool", "list", "dyn"})
MACROS: Final = frozenset({"has", "exists", "all", "exists_one", "map", "filter"})
MAX_CONSTANT_DEPTH: Final = 50

ExtraFunction = tuple[Callable[..., Any], int]


def _is_name(name: object) -> bool:
    return (
        isinstance(name, str)
        and name.isidentifier()
        and name.isascii()
        and not keyword.iskeyword(name)
        and name not in KEYWORDS
        and name not in RESERVED_WORDS
    )


def _freeze(value: Any, where: str, depth: int = 0) -> Any:
    """A constant as an immutable CEL value: lists become tuples; anything not CEL-shaped is refused."""
    if depth > MAX_CONSTANT_DEPTH:
        raise ValueError(f"constant {where} nests more than {MAX_CONSTANT_DEPTH} levels deep")
    value_kind = kind(value)
    if value_kind == "list":
        return tuple(_freeze(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value))
    if value_kind == "map":
        frozen: dict[Any, Any] = {}
        for key, item in value.items():
            if kind(key) not in ("string", "int", "uint", "bool"):
                raise ValueError(
                    f"constant {where} has a key of type {kind(key)}; CEL map keys are strings, ints or bools"
                )
            frozen[key] = _freeze(item, f"{where}.{key}", depth + 1)
        return frozen
    if value_kind.startswith("unsupported"):
        raise ValueError(f"constant {where} has a value of unsupported Python type {type(value).__name__}")
    return value


class Environment:
    """Variables an expression may read (name -> CEL type), their allowed fields, constants and extra functions.

    ``known_fields[var]`` is the set of field names allowed after ``var.`` (None: any).
    ``constants[name]`` is a value fixed at compile time; expressions using it are
    constant-folded, and it need not be in the activation. ``functions[name]`` is
    ``(callable, arity)``; the callable gets evaluated arguments and may raise
    EvaluationError. ``limits`` bounds what one expression may cost, estimated when it
    compiles and counted while it runs (see :mod:`._cost`).
    """

    __slots__ = ("constants", "functions", "known_fields", "limits", "variables")

    def __init__(
        self,
        variables: Mapping[str, str],
        known_fields: Mapping[str, frozenset[str] | None] | None = None,
        constants: Mapping[str, Any] | None = None,
        functions: Mapping[str, ExtraFunction] | None = None,
        limits: CostLimits | None = None,
    ) -> None:
        self.limits = limits if limits is not None else CostLimits()
        bad_limits = self.limits.problems()
        if bad_limits:
            raise ValueError(f"cost limits: {'; '.join(bad_limits)}")
        self.variables: dict[str, str] = {}
        for name, type_name in variables.items():
            if not _is_name(name):
                raise ValueError(f"variable name {name!r} is not a valid CEL identifier")
            if type_name not in VARIABLE_TYPES:
                raise ValueError(
                    f"variable {name!r} has unknown type {type_name!r}; use one of {sorted(VARIABLE_TYPES)}"
                )
            self.variables[name] = type_name

        self.constants: dict[str, Any] = {}
        for name, value in (constants or {}).items():
            if not _is_name(name):
                raise ValueError(f"constant name {name!r} is not a valid CEL identifier")
            frozen = _freeze(value, name)
            declared = self.variables.get(name)
            if declared not in (None, "dyn") and declared != kind(frozen):
                raise ValueError(f"constant {name!r} is a {kind(frozen)} but the variable is declared {declared!r}")
            self.constants[name] = frozen

        self.known_fields: dict[str, frozenset[str] | None] = {}
        for name, fields in (known_fields or {}).items():
            if name not in self.variables:
                raise ValueError(f"known_fields names {name!r}, which is not a declared variable")
            self.known_fields[name] = None if fields is None else frozenset(fields)

        self.functions: dict[str, ExtraFunction] = {}
        for name, spec in (functions or {}).items():
            if not _is_name(name):
                raise ValueError(f"function name {name!r} is not a valid CEL identifier")
            if name in BUILTINS or name in MACROS:
                raise ValueError(f"function {name!r} would hide the built-in of the same name")
            impl, arity = spec
            if not callable(impl) or not isinstance(arity, int) or arity < 0:
                raise ValueError(f"function {name!r} must be given as (callable, arity >= 0)")
            self.functions[name] = (impl, arity)

    def type_of(self, name: str) -> str | None:
        """Static type of a top-level name, or None if it is not declared."""
        if name in self.constants:
            return kind(self.constants[name])
        return self.variables.get(name)
