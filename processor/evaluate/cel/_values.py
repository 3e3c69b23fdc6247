"""CEL values as plain Python values, and the operators on them.

The mapping: bool -> ``bool``; int -> ``int`` (64-bit, checked); uint -> :class:`UInt`;
double -> ``float``; string -> ``str``; bytes -> ``bytes``; null -> ``None``;
list -> ``list`` or ``tuple``; map -> any ``Mapping``.

Each operator has a fast path for the common same-type case and falls back to a
slow path that works out the CEL kinds, so a wrong type is an EvaluationError that
names the types (never the values: messages end up in logs).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

from processor.errors import EvaluationError

INT_MIN: Final = -(2**63)
INT_MAX: Final = 2**63 - 1
UINT_MAX: Final = 2**64 - 1

# Bound on how deeply == walks nested lists and maps taken from records.
MAX_COMPARE_DEPTH: Final = 100


class UInt(int):
    """A CEL uint: an ``int`` that remembers it is unsigned (``1u``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"{int(self)}u"


_KIND_BY_TYPE: Final[dict[type, str]] = {
    bool: "bool",
    int: "int",
    UInt: "uint",
    float: "double",
    str: "string",
    bytes: "bytes",
    type(None): "null_type",
    list: "list",
    tuple: "list",
    dict: "map",
}
NUMERIC_KINDS: Final = frozenset({"int", "uint", "double"})
# Kinds a map key can be looked up by (doubles compare numerically with int keys).
_KEY_KINDS: Final = frozenset({"string", "int", "uint", "double", "bool"})
_ORDERED_KINDS: Final = frozenset({"int", "uint", "double", "string", "bool", "bytes"})


def kind(value: object) -> str:
    """The CEL type name of a Python value ("int", "string", "map", ...)."""
    found = _KIND_BY_TYPE.get(type(value))
    if found is not None:
        return found
    # Subclasses (a str enum, an OrderedDict) are rare; check them the slow way.
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, UInt):
        return "uint"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "double"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bytes):
        return "bytes"
    if isinstance(value, list | tuple):
        return "list"
    if isinstance(value, Mapping):
        return "map"
    return f"unsupported({type(value).__name__})"


def no_overload(op: str, *values: object) -> EvaluationError:
    kinds = ", ".join(kind(v) for v in values)
    return EvaluationError(f"no such overload: {op} applied to ({kinds})")


def check_int(result: int) -> int:
    if INT_MIN <= result <= INT_MAX:
        return result
    raise EvaluationError("int overflow: the result does not fit in 64 bits")


def check_uint(result: int) -> UInt:
    if 0 <= result <= UINT_MAX:
        return UInt(result)
    raise EvaluationError("uint overflow: the result does not fit in 64 unsigned bits")


# -- equality and ordering ----------------------------------------------------------


def equals(a: object, b: object, depth: int = 0) -> bool:
    """CEL ``==``: numbers compare across int/uint/double; other differing types are unequal."""
    ka, kb = kind(a), kind(b)
    if ka != kb:
        return ka in NUMERIC_KINDS and kb in NUMERIC_KINDS and a == b
    if ka in ("list", "map"):
        if depth >= MAX_COMPARE_DEPTH:
            raise EvaluationError(f"values nest more than {MAX_COMPARE_DEPTH} levels deep to compare")
        if ka == "list":
            assert isinstance(a, list | tuple) and isinstance(b, list | tuple)
            return len(a) == len(b) and all(equals(x, y, depth + 1) for x, y in zip(a, b, strict=True))
        assert isinstance(a, Mapping) and isinstance(b, Mapping)
        if len(a) != len(b):
            return False
        return all(map_contains(b, key) and equals(value, b[key], depth + 1) for key, value in a.items())
    return a == b


def not_equals(a: object, b: object) -> bool:
    return not equals(a, b)


def _comparable(op: str, a: object, b: object) -> None:
    ka, kb = kind(a), kind(b)
    if ka == kb and ka in _ORDERED_KINDS:
        return
    if ka in NUMERIC_KINDS and kb in NUMERIC_KINDS:
        return
    raise no_overload(op, a, b)


def less(a: Any, b: Any) -> bool:
    ta = type(a)
    if ta is type(b) and (ta is str or ta is int or ta is float):
        return bool(a < b)
    _comparable("<", a, b)
    return bool(a < b)


def less_equal(a: Any, b: Any) -> bool:
    ta = type(a)
    if ta is type(b) and (ta is str or ta is int or ta is float):
        return bool(a <= b)
    _comparable("<=", a, b)
    return bool(a <= b)


def greater(a: Any, b: Any) -> bool:
    ta = type(a)
    if ta is type(b) and (ta is str or ta is int or ta is float):
        return bool(a > b)
    _comparable(">", a, b)
    return bool(a > b)


def greater_equal(a: Any, b: Any) -> bool:
    ta = type(a)
    if ta is type(b) and (ta is str or ta is int or ta is float):
        return bool(a >= b)
    _comparable(">=", a, b)
    return bool(a >= b)


# -- membership, selection, indexing ----------------------------------------------------


def map_contains(mapping: Mapping[Any, Any], key: object) -> bool:
    """Key presence with CEL key semantics: ``true`` is not the key ``1``."""
    key_kind = kind(key)
    if key_kind == "bool":
        return any(type(k) is bool and k == key for k in mapping)
    if key_kind not in ("string", "int", "uint", "double"):
        return False
    if key_kind == "double" and not float(key).is_integer():  # type: ignore[arg-type]
        return False
    try:
        present = key in mapping
    except TypeError:
        return False
    # A numeric key must not match a bool key that Python considers equal (1 == True).
    return present and (key_kind == "string" or any(k == key and type(k) is not bool for k in mapping))


def contains(item: object, container: object) -> bool:
    """CEL ``item in container``: list membership by CEL equality, or map key presence."""
    if type(container) is list or type(container) is tuple:
        if type(item) is str:
            return item in container
        return any(equals(item, element) for element in container)
    container_kind = kind(container)
    if container_kind == "list":
        assert isinstance(container, list | tuple)
        return any(equals(item, element) for element in container)
    if container_kind == "map":
        assert isinstance(container, Mapping)
        if kind(item) not in _KEY_KINDS:
            raise no_overload("in", item, container)
        return map_contains(container, item)
    raise no_overload("in", item, container)


def select(operand: object, field: str) -> Any:
    """``operand.field`` on a map; a missing key is an error (guard with has())."""
    if isinstance(operand, Mapping):
        try:
            return operand[field]
        except KeyError:
            raise EvaluationError(f"no such key: {field}") from None
    raise EvaluationError(f"cannot select field '{field}' on a value of type {kind(operand)}")


def has_field(operand: object, field: str) -> bool:
    if type(operand) is dict or isinstance(operand, Mapping):
        return field in operand
    raise EvaluationError(f"has() cannot test field '{field}' on a value of type {kind(operand)}")


def index(container: object, key: object) -> Any:
    """``container[key]``: a list by int/uint (or integral double) position, or a map by key."""
    container_kind = kind(container)
    if container_kind == "list":
        assert isinstance(container, list | tuple)
        key_kind = kind(key)
        if key_kind in ("int", "uint") or (key_kind == "double" and float(key).is_integer()):  # type: ignore[arg-type]
            position = int(key)  # type: ignore[call-overload]
        else:
            raise no_overload("[]", container, key)
        if 0 <= position < len(container):
            return container[position]
        raise EvaluationError(f"index out of range: the list has {len(container)} element(s)")
    if container_kind == "map":
        assert isinstance(container, Mapping)
        if map_contains(container, key):
            return container[key]
        if kind(key) == "string":
            raise EvaluationError("no such key in map")
        if kind(key) not in ("int", "uint", "double", "bool"):
            raise no_overload("[]", container, key)
        raise EvaluationError("no such key in map")
    raise no_overload("[]", container, key)


def iteration_items(value: object, macro: str) -> Sequence[Any]:
    """What a macro iterates: a list's elements or a map's keys."""
    if type(value) is list or type(value) is tuple:
        return value
    value_kind = kind(value)
    if value_kind == "list":
        return value  # type: ignore[return-value]
    if value_kind == "map":
        assert isinstance(value, Mapping)
        return list(value)
    raise EvaluationError(f"{macro}() needs a list or a map, got {value_kind}")


# -- arithmetic ------------------------------------------------------------------------


def add(a: Any, b: Any) -> Any:
    ta, tb = type(a), type(b)
    if ta is int and tb is int:
        result = a + b
        if INT_MIN <= result <= INT_MAX:
            return result
        raise EvaluationError("int overflow: the result does not fit in 64 bits")
    if (ta is float and tb is float) or (ta is str and tb is str):
        return a + b
    ka, kb = kind(a), kind(b)
    if ka == kb:
        if ka == "int":
            return check_int(int(a) + int(b))
        if ka == "uint":
            return check_uint(a + b)
        if ka in ("double", "string", "bytes"):
            return a + b
        if ka == "list":
            return [*a, *b]
    raise no_overload("+", a, b)


def subtract(a: Any, b: Any) -> Any:
    ta, tb = type(a), type(b)
    if ta is int and tb is int:
        return check_int(a - b)
    if ta is float and tb is float:
        return a - b
    ka, kb = kind(a), kind(b)
    if ka == kb:
        if ka == "int":
            return check_int(int(a) - int(b))
        if ka == "uint":
            return check_uint(a - b)
        if ka == "double":
            return a - b
    raise no_overload("-", a, b)


def multiply(a: Any, b: Any) -> Any:
    ta, tb = type(a), type(b)
    if ta is int and tb is int:
        return check_int(a * b)
    if ta is float and tb is float:
        return a * b
    ka, kb = kind(a), kind(b)
    if ka == kb:
        if ka == "int":
            return check_int(int(a) * int(b))
        if ka == "uint":
            return check_uint(a * b)
        if ka == "double":
            return a * b
    raise no_overload("*", a, b)


def _truncated_quotient(a: int, b: int) -> int:
    quotient = abs(a) // abs(b)
    return quotient if (a < 0) == (b < 0) else -quotient


def divide(a: Any, b: Any) -> Any:
    ka, kb = kind(a), kind(b)
    if ka != kb:
        raise no_overload("/", a, b)
    if ka == "double":
        if b == 0.0:
            # IEEE 754, as CEL: x/0.0 is an infinity (or NaN for 0/0), not an error.
            if a == 0.0 or math.isnan(a):
                return math.nan
            return math.copysign(math.inf, a) * math.copysign(1.0, b)
        return a / b
    if ka == "int":
        if b == 0:
            raise EvaluationError("division by zero")
        return check_int(_truncated_quotient(int(a), int(b)))
    if ka == "uint":
        if b == 0:
            raise EvaluationError("division by zero")
        return UInt(int(a) // int(b))
    raise no_overload("/", a, b)


def modulo(a: Any, b: Any) -> Any:
    ka, kb = kind(a), kind(b)
    if ka != kb or ka not in ("int", "uint"):
        raise no_overload("%", a, b)
    if b == 0:
        raise EvaluationError("modulus by zero")
    if ka == "uint":
        return UInt(int(a) % int(b))
    if a == INT_MIN and b == -1:
        raise EvaluationError("int overflow: the result does not fit in 64 bits")
    # The remainder takes the dividend's sign (truncated division), as in CEL.
    remainder = abs(int(a)) % abs(int(b))
    return -remainder if a < 0 else remainder


def negate(a: Any) -> Any:
    ta = type(a)
    if ta is int:
        return check_int(-a)
    if ta is float:
        return -a
    ka = kind(a)
    if ka == "int":
        return check_int(-int(a))
    if ka == "double":
        return -float(a)
    raise no_overload("-", a)


def logical_not(a: object) -> bool:
    if a is True:
        return False
    if a is False:
        return True
    raise no_overload("!", a)
