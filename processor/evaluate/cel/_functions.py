"""Built-in functions of the CEL subset: their signatures (for the checker) and implementations.

Regular expressions are RE2's, as CEL defines them, matched by RE2 itself: matching
takes time linear in the text for any pattern, so no pattern a rule author writes
can backtrack. What RE2 cannot compile (backreferences, lookaround) is refused with
a message saying so; matched input and patterns are bounded in length.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Final

import re2
from re2 import _re2

from processor.errors import EvaluationError
from processor.evaluate.cel._values import INT_MIN, UINT_MAX, UInt, check_int, kind, no_overload

MAX_MATCH_INPUT_CHARS: Final = 100_000
MAX_PATTERN_CHARS: Final = 1_000


@dataclass(frozen=True, slots=True)
class Builtin:
    """A built-in function. ``overloads`` lists (parameter types, result type); "*" takes any type.

    For a receiver call ``x.f(y)`` the receiver is the first parameter.
    """

    name: str
    impl: Callable[..., Any]
    overloads: tuple[tuple[tuple[str, ...], str], ...]
    global_form: bool
    receiver_form: bool

    @property
    def arities(self) -> frozenset[int]:
        return frozenset(len(params) for params, _ in self.overloads)


# -- size and conversions ------------------------------------------------------------


def size(value: Any) -> int:
    if type(value) is str or type(value) is list or type(value) is dict:
        return len(value)
    if kind(value) in ("string", "bytes", "list", "map"):
        return len(value)
    raise no_overload("size", value)


_INT_TEXT: Final = re.compile(r"[+-]?[0-9]+")
_UINT_TEXT: Final = re.compile(r"[0-9]+")


def to_int(value: Any) -> int:
    value_kind = kind(value)
    if value_kind == "int":
        return int(value)
    if value_kind == "uint":
        return check_int(int(value))
    if value_kind == "double":
        # As cel-go: both ends are exclusive, since 2**63 - 1 has no double of its own.
        if math.isnan(value) or not (INT_MIN < value < 2.0**63):
            raise EvaluationError("int() overflow: the double does not fit in an int")
        return int(value)
    if value_kind == "string":
        # Python's int() would also take blanks and "1_000"; CEL takes an optional sign and digits.
        if not _INT_TEXT.fullmatch(value):
            raise EvaluationError("int() cannot parse the string as an integer")
        return check_int(int(value, 10))
    raise no_overload("int", value)


def to_uint(value: Any) -> UInt:
    value_kind = kind(value)
    if value_kind in ("int", "uint"):
        if not 0 <= int(value) <= UINT_MAX:
            raise EvaluationError("uint() overflow: the value does not fit in a uint")
        return UInt(int(value))
    if value_kind == "double":
        if math.isnan(value) or not (0 <= value < 2.0**64):
            raise EvaluationError("uint() overflow: the double does not fit in a uint")
        return UInt(int(value))
    if value_kind == "string":
        if not _UINT_TEXT.fullmatch(value):
            raise EvaluationError("uint() cannot parse the string as an unsigned integer")
        parsed = int(value, 10)
        if not 0 <= parsed <= UINT_MAX:
            raise EvaluationError("uint() overflow: the value does not fit in a uint")
        return UInt(parsed)
    raise no_overload("uint", value)


# Each grammar is written so a string has one way to match: a failed fullmatch backs off
# digit by digit once (linear), never tries every split of a digit run (quadratic).
_DOUBLE_TEXT: Final = re.compile(r"[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?")
_DOUBLE_WORDS: Final = re.compile(r"[+-]?(inf|infinity|nan)", re.IGNORECASE)


def to_double(value: Any) -> float:
    value_kind = kind(value)
    if value_kind in ("int", "uint", "double"):
        return float(value)
    if value_kind == "string":
        # Python's float() also takes "1_000" and surrounding blanks; CEL does not.
        if _DOUBLE_WORDS.fullmatch(value):
            return float(value)
        if not _DOUBLE_TEXT.fullmatch(value):
            raise EvaluationError("double() cannot parse the string as a number")
        parsed = float(value)
        if math.isinf(parsed):
            raise EvaluationError("double() overflow: the number is out of range")
        return parsed
    raise no_overload("double", value)


def format_double(value: float) -> str:
    """A double as CEL's string() writes it: Go's %g, the shortest form that reads back the same.

    Exponent notation is used below 1e-4 and from 1e6 on, as Go does when the precision is the shortest.
    """
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == 0.0:
        return "-0" if math.copysign(1.0, value) < 0 else "0"
    sign, digit_tuple, exponent = Decimal(repr(value)).normalize().as_tuple()
    assert isinstance(exponent, int)
    digits = "".join(str(d) for d in digit_tuple)
    decimal_exponent = len(digits) + exponent - 1  # the power of ten of the first digit
    prefix = "-" if sign else ""
    if decimal_exponent < -4 or decimal_exponent >= 6:
        mantissa = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
        exp_sign = "-" if decimal_exponent < 0 else "+"
        return f"{prefix}{mantissa}e{exp_sign}{abs(decimal_exponent):02d}"
    if decimal_exponent < 0:
        return f"{prefix}0.{'0' * (-decimal_exponent - 1)}{digits}"
    whole = digits[: decimal_exponent + 1].ljust(decimal_exponent + 1, "0")
    fraction = digits[decimal_exponent + 1 :]
    return f"{prefix}{whole}.{fraction}" if fraction else f"{prefix}{whole}"


def to_string(value: Any) -> str:
    value_kind = kind(value)
    if value_kind == "string":
        return str(value)
    if value_kind == "bool":
        return "true" if value else "false"
    if value_kind in ("int", "uint"):
        return str(int(value))
    if value_kind == "double":
        return format_double(value)
    if value_kind == "bytes":
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise EvaluationError("string() got bytes that are not valid UTF-8") from None
    raise no_overload("string", value)


_BOOL_WORDS: Final = {
    "1": True, "t": True, "true": True, "TRUE": True, "True": True,
    "0": False, "f": False, "false": False, "FALSE": False, "False": False,
}  # fmt: skip


def to_bool(value: Any) -> bool:
    value_kind = kind(value)
    if value_kind == "bool":
        return bool(value)
    if value_kind == "string":
        found = _BOOL_WORDS.get(value)
        if found is None:
            raise EvaluationError("bool() cannot parse the string as a bool")
        return found
    raise no_overload("bool", value)


def to_dyn(value: Any) -> Any:
    return value


# -- strings ------------------------------------------------------------------------


def _strings(name: str, a: Any, b: Any) -> None:
    if kind(a) != "string" or kind(b) != "string":
        raise no_overload(name, a, b)


def starts_with(text: Any, prefix: Any) -> bool:
    if type(text) is str and type(prefix) is str:
        return text.startswith(prefix)
    _strings("startsWith", text, prefix)
    return bool(text.startswith(prefix))


def ends_with(text: Any, suffix: Any) -> bool:
    if type(text) is str and type(suffix) is str:
        return text.endswith(suffix)
    _strings("endsWith", text, suffix)
    return bool(text.endswith(suffix))


def contains_text(text: Any, part: Any) -> bool:
    if type(text) is str and type(part) is str:
        return part in text
    _strings("contains", text, part)
    return bool(part in text)


_ASCII_LOWER: Final = {c: c + 32 for c in range(ord("A"), ord("Z") + 1)}
_ASCII_UPPER: Final = {c: c - 32 for c in range(ord("a"), ord("z") + 1)}


def lower_ascii(text: Any) -> str:
    if kind(text) != "string":
        raise no_overload("lowerAscii", text)
    # Only A-Z change: str.lower() would also fold non-ASCII letters.
    return str(text).lower() if text.isascii() else str(text).translate(_ASCII_LOWER)


def upper_ascii(text: Any) -> str:
    if kind(text) != "string":
        raise no_overload("upperAscii", text)
    return str(text).upper() if text.isascii() else str(text).translate(_ASCII_UPPER)


# -- regular expressions --------------------------------------------------------------

# RE2 matches in time linear in the text whatever the pattern, so no rule and no record
# can make a match backtrack. The bindings' own core (_re2) is called directly: a yes/no
# answer needs neither the Python wrapper's match objects nor captures, and skipping
# both halves the cost of a call. Errors are not logged to stderr: they become messages.
_RE2_OPTIONS: Final = re2.Options()
_RE2_OPTIONS.log_errors = False
_RE2_OPTIONS.never_capture = True
_UNANCHORED: Final = _re2.RE2.Anchor.UNANCHORED

# What RE2's terse refusals mean to a rule author, by how its message starts.
_RE2_REFUSALS: Final = (
    ("invalid perl operator: (?=", "lookahead (?=...) is not supported"),
    ("invalid perl operator: (?!", "lookahead (?!...) is not supported"),
    ("invalid perl operator: (?<=", "lookbehind (?<=...) is not supported"),
    ("invalid perl operator: (?<!", "lookbehind (?<!...) is not supported"),
    ("invalid perl operator: (?P=", "named backreferences (?P=...) are not supported"),
    ("invalid perl operator: (?>", "atomic groups (?>...) are not supported"),
    ("invalid perl operator: (?(", "conditional groups (?(...) are not supported"),
)
_RE2_NOTE: Final = " (CEL regular expressions are RE2's, matched in linear time)"
_BACKREFERENCE: Final = re.compile(r"invalid escape sequence: \\[1-9]")


class Pattern:
    """A compiled RE2 pattern; ``search(text)`` is true when it matches any part of ``text``."""

    __slots__ = ("_regexp",)

    def __init__(self, regexp: Any) -> None:
        self._regexp = regexp

    def search(self, text: str) -> bool:
        # Text is handed over as UTF-8; a lone surrogate (possible in a CEL escape) passes through.
        data = text.encode("utf-8", "surrogatepass")
        start: int = self._regexp.Match(_UNANCHORED, data, 0, len(data))[0][0]
        return start >= 0


def _refusal(message: str) -> str:
    if message.startswith("invalid perl operator: (?P") and not message.startswith("invalid perl operator: (?P<"):
        message = "invalid perl operator: (?P="
    for prefix, meaning in _RE2_REFUSALS:
        if message.startswith(prefix):
            return f"{meaning}{_RE2_NOTE}"
    if _BACKREFERENCE.match(message):
        return f"backreferences (\\1) are not supported{_RE2_NOTE}"
    return f"invalid regular expression: {message}"


def compile_pattern(pattern: str) -> Pattern:
    """Compile an RE2 pattern (the syntax CEL defines for ``matches``); raises ValueError with a reason."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(f"the pattern is longer than {MAX_PATTERN_CHARS} characters")
    regexp = _re2.RE2(pattern.encode("utf-8", "surrogatepass"), _RE2_OPTIONS)
    if not regexp.ok():
        detail = regexp.error()
        raise ValueError(_refusal(detail.decode("utf-8", "replace") if isinstance(detail, bytes) else str(detail)))
    return Pattern(regexp)


@functools.lru_cache(maxsize=128)
def _cached_pattern(pattern: str) -> Pattern | str:
    try:
        return compile_pattern(pattern)
    except ValueError as exc:
        return str(exc)


def search(compiled: Pattern, text: Any) -> bool:
    if type(text) is not str and kind(text) != "string":
        raise no_overload("matches", text, "")
    if len(text) > MAX_MATCH_INPUT_CHARS:
        raise EvaluationError(f"matches() input is longer than {MAX_MATCH_INPUT_CHARS} characters")
    return compiled.search(str(text))


def matches(text: Any, pattern: Any) -> bool:
    """CEL ``matches``: true when the pattern matches any part of the text."""
    _strings("matches", text, pattern)
    compiled = _cached_pattern(str(pattern))
    if isinstance(compiled, str):
        raise EvaluationError(f"matches(): {compiled}")
    return search(compiled, text)


# -- durations ---------------------------------------------------------------------

_DURATION_UNITS: Final = {
    "ns": 1e-9,
    "us": 1e-6,
    "\u00b5s": 1e-6,
    "\u03bcs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_DURATION_PART: Final = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|\u00b5s|\u03bcs|ms|s|m|h)")
# CEL's duration range: about +-10,000 years.
_MAX_DURATION_S: Final = 315_576_000_000.0


def duration(text: Any) -> float:
    """``duration("1h30m")`` as seconds (a double); Go duration syntax, as CEL uses."""
    if kind(text) != "string":
        raise no_overload("duration", text)
    body = str(text)
    sign = 1.0
    if body[:1] in ("+", "-"):
        sign = -1.0 if body[0] == "-" else 1.0
        body = body[1:]
    if body == "0":
        return 0.0
    if not body:
        raise EvaluationError('duration() needs a value such as "5m" or "1h30m"')
    total = 0.0
    position = 0
    while position < len(body):
        part = _DURATION_PART.match(body, position)
        if part is None:
            raise EvaluationError('duration() cannot parse the string: use units h, m, s, ms, us, ns as in "1h30m"')
        total += float(part.group(1)) * _DURATION_UNITS[part.group(2)]
        position = part.end()
    if total > _MAX_DURATION_S:
        raise EvaluationError("duration() is out of range")
    return sign * total


# -- the table ------------------------------------------------------------------------

_NUMERIC_OR_STRING: Final = ("int", "uint", "double", "string")


def _unary(name: str, impl: Callable[..., Any], params: tuple[str, ...], result: str) -> Builtin:
    return Builtin(name, impl, tuple(((p,), result) for p in params), True, False)


BUILTINS: Final[Mapping[str, Builtin]] = {
    b.name: b
    for b in (
        Builtin("size", size, tuple(((p,), "int") for p in ("string", "bytes", "list", "map")), True, True),
        _unary("int", to_int, _NUMERIC_OR_STRING, "int"),
        _unary("uint", to_uint, _NUMERIC_OR_STRING, "uint"),
        _unary("double", to_double, _NUMERIC_OR_STRING, "double"),
        _unary("string", to_string, ("string", "int", "uint", "double", "bool", "bytes"), "string"),
        _unary("bool", to_bool, ("bool", "string"), "bool"),
        _unary("dyn", to_dyn, ("*",), "dyn"),
        _unary("duration", duration, ("string",), "double"),
        Builtin("startsWith", starts_with, ((("string", "string"), "bool"),), False, True),
        Builtin("endsWith", ends_with, ((("string", "string"), "bool"),), False, True),
        Builtin("contains", contains_text, ((("string", "string"), "bool"),), False, True),
        Builtin("matches", matches, ((("string", "string"), "bool"),), True, True),
        Builtin("lowerAscii", lower_ascii, ((("string",), "string"),), False, True),
        Builtin("upperAscii", upper_ascii, ((("string",), "string"),), False, True),
    )
}
