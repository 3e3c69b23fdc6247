"""Tokenizer for the CEL subset: source text -> a list of tokens with offsets.

Offsets (not line/col) travel with tokens and nodes; :func:`error_at` turns an offset
into the 1-based line:col that :class:`ExpressionError` carries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from processor.errors import ExpressionError

MAX_SOURCE_CHARS: Final = 10_000

INT64_MAX: Final = 2**63 - 1
UINT64_MAX: Final = 2**64 - 1

# Words CEL reserves for future use: accepting them as identifiers now would break
# rules the day the language gives them a meaning.
RESERVED_WORDS: Final = frozenset(
    {
        "as", "break", "const", "continue", "else", "for", "function", "if", "import",
        "let", "loop", "package", "namespace", "return", "var", "void", "while",
    }
)  # fmt: skip
KEYWORDS: Final = frozenset({"true", "false", "null", "in"})

# Longest first, so "<=" wins over "<".
_PUNCTUATION: Final = (
    "==", "!=", "<=", ">=", "&&", "||",
    "<", ">", "!", "?", ":", "+", "-", "*", "/", "%", ".", ",", "(", ")", "[", "]", "{", "}", "=",
)  # fmt: skip

_SIMPLE_ESCAPES: Final = {
    "a": "\a",
    "b": "\b",
    "f": "\f",
    "n": "\n",
    "r": "\r",
    "t": "\t",
    "v": "\v",
    "\\": "\\",
    "'": "'",
    '"': '"',
    "`": "`",
    "?": "?",
}
_HEX_DIGITS: Final = frozenset("0123456789abcdefABCDEF")
_IDENT_START: Final = frozenset("_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_IDENT_CHARS: Final = _IDENT_START | frozenset("0123456789")
_DIGITS: Final = frozenset("0123456789")
_SPACE: Final = frozenset(" \t\n\r\f\v")


@dataclass(frozen=True, slots=True)
class Token:
    """One token. ``kind`` is "int", "uint", "double", "string", "ident", "eof", a keyword or a punctuation mark."""

    kind: str
    value: object
    pos: int
    text: str


def position(source: str, offset: int) -> tuple[int, int]:
    """1-based (line, col) of ``offset`` in ``source``; col counts characters."""
    offset = max(0, min(offset, len(source)))
    line = source.count("\n", 0, offset) + 1
    line_start = source.rfind("\n", 0, offset) + 1
    return line, offset - line_start + 1


def error_at(source: str, offset: int, message: str) -> ExpressionError:
    line, col = position(source, offset)
    return ExpressionError(message, line, col)


def tokenize(source: str) -> list[Token]:
    """Split ``source`` into tokens; raises ExpressionError at the first bad character."""
    if len(source) > MAX_SOURCE_CHARS:
        raise ExpressionError(f"expression is {len(source)} characters long; the limit is {MAX_SOURCE_CHARS}", 1, 1)
    return _Lexer(source).run()


class _Lexer:
    def __init__(self, source: str) -> None:
        self.src = source
        self.i = 0
        self.tokens: list[Token] = []

    def error(self, offset: int, message: str) -> ExpressionError:
        return error_at(self.src, offset, message)

    def run(self) -> list[Token]:
        src = self.src
        n = len(src)
        while True:
            self.skip_space_and_comments()
            if self.i >= n:
                self.tokens.append(Token("eof", None, n, ""))
                return self.tokens
            c = src[self.i]
            if c in _IDENT_START:
                if self.string_prefix_length() is not None:
                    self.lex_string()
                else:
                    self.lex_ident()
            elif c in _DIGITS or (c == "." and self.i + 1 < n and src[self.i + 1] in _DIGITS):
                self.lex_number()
            elif c in "\"'":
                self.lex_string()
            else:
                self.lex_punctuation()

    def skip_space_and_comments(self) -> None:
        src, n = self.src, len(self.src)
        while self.i < n:
            c = src[self.i]
            if c in _SPACE:
                self.i += 1
            elif src.startswith("//", self.i):
                end = src.find("\n", self.i)
                self.i = n if end < 0 else end + 1
            else:
                return

    def lex_ident(self) -> None:
        start = self.i
        src, n = self.src, len(self.src)
        while self.i < n and src[self.i] in _IDENT_CHARS:
            self.i += 1
        word = src[start : self.i]
        if word in RESERVED_WORDS:
            raise self.error(start, f"'{word}' is a reserved word and cannot be used as a name")
        kind = word if word in KEYWORDS else "ident"
        self.tokens.append(Token(kind, word, start, word))

    def lex_punctuation(self) -> None:
        start = self.i
        for p in _PUNCTUATION:
            if self.src.startswith(p, start):
                if p == "=":
                    raise self.error(start, "unexpected '='; use '==' to compare")
                self.i += len(p)
                self.tokens.append(Token(p, p, start, p))
                return
        raise self.error(start, f"unexpected character {self.src[start]!r}")

    def lex_number(self) -> None:
        src, n = self.src, len(self.src)
        start = self.i
        if src.startswith(("0x", "0X"), start):
            self.i += 2
            digits_start = self.i
            while self.i < n and src[self.i] in _HEX_DIGITS:
                self.i += 1
            if self.i == digits_start:
                raise self.error(start, "hexadecimal literal has no digits")
            value = int(src[digits_start : self.i], 16)
            self.finish_integer(start, value)
            return
        while self.i < n and src[self.i] in _DIGITS:
            self.i += 1
        is_double = False
        if self.i + 1 < n and src[self.i] == "." and src[self.i + 1] in _DIGITS:
            is_double = True
            self.i += 1
            while self.i < n and src[self.i] in _DIGITS:
                self.i += 1
        if self.i < n and src[self.i] in "eE":
            j = self.i + 1
            if j < n and src[j] in "+-":
                j += 1
            if j < n and src[j] in _DIGITS:
                is_double = True
                self.i = j
                while self.i < n and src[self.i] in _DIGITS:
                    self.i += 1
        if not is_double:
            self.finish_integer(start, int(src[start : self.i]))
            return
        text = src[start : self.i]
        self.reject_trailing_letters(start)
        number = float(text)
        if number == float("inf"):
            raise self.error(start, "double literal is out of range")
        self.tokens.append(Token("double", number, start, text))

    def finish_integer(self, start: int, value: int) -> None:
        src, n = self.src, len(self.src)
        if self.i < n and src[self.i] in "uU":
            self.i += 1
            self.reject_trailing_letters(start)
            if value > UINT64_MAX:
                raise self.error(start, "uint literal is out of range (more than 64 bits)")
            self.tokens.append(Token("uint", value, start, src[start : self.i]))
            return
        self.reject_trailing_letters(start)
        # INT64_MAX + 1 is allowed here: it is valid only right after a unary minus,
        # which the parser checks.
        if value > INT64_MAX + 1:
            raise self.error(start, "int literal is out of range (more than 64 bits)")
        self.tokens.append(Token("int", value, start, src[start : self.i]))

    def reject_trailing_letters(self, start: int) -> None:
        if self.i < len(self.src) and self.src[self.i] in _IDENT_CHARS:
            raise self.error(start, f"invalid number literal {self.src[start : self.i + 1]!r}")

    def string_prefix_length(self) -> int | None:
        """Length of a string prefix (r, b, rb, br in any case) at the cursor, if a quote follows it."""
        src = self.src
        for length in (1, 2):
            prefix = src[self.i : self.i + length].lower()
            if len(prefix) == length and prefix in ("r", "b", "rb", "br"):
                after = self.i + length
                if after < len(src) and src[after] in "\"'":
                    return length
        return None

    def lex_string(self) -> None:
        src, n = self.src, len(self.src)
        start = self.i
        prefix_len = self.string_prefix_length() or 0
        prefix = src[start : start + prefix_len].lower()
        if "b" in prefix:
            raise self.error(start, "bytes literals are not supported in rule expressions")
        raw = "r" in prefix
        self.i += prefix_len
        quote = src[self.i]
        triple = src.startswith(quote * 3, self.i)
        delimiter = quote * 3 if triple else quote
        self.i += len(delimiter)
        parts: list[str] = []
        while True:
            if self.i >= n:
                raise self.error(start, "unterminated string literal")
            if src.startswith(delimiter, self.i):
                self.i += len(delimiter)
                break
            c = src[self.i]
            if c in "\n\r" and not triple:
                raise self.error(start, "unterminated string literal (a newline needs a triple-quoted string)")
            if c == "\\" and not raw:
                parts.append(self.lex_escape())
                continue
            parts.append(c)
            self.i += 1
        value = "".join(parts)
        self.tokens.append(Token("string", value, start, src[start : self.i]))

    def lex_escape(self) -> str:
        src, n = self.src, len(self.src)
        start = self.i
        if self.i + 1 >= n:
            raise self.error(start, "unterminated string literal")
        c = src[self.i + 1]
        if c in _SIMPLE_ESCAPES:
            self.i += 2
            return _SIMPLE_ESCAPES[c]
        hex_lengths = {"x": 2, "X": 2, "u": 4, "U": 8}
        if c in hex_lengths:
            digits = src[self.i + 2 : self.i + 2 + hex_lengths[c]]
            if len(digits) != hex_lengths[c] or not all(d in _HEX_DIGITS for d in digits):
                raise self.error(start, f"invalid escape: \\{c} needs {hex_lengths[c]} hex digits")
            code = int(digits, 16)
            if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
                raise self.error(start, "invalid escape: not a Unicode scalar value")
            self.i += 2 + len(digits)
            return chr(code)
        if c in "0123":
            digits = src[self.i + 1 : self.i + 4]
            if len(digits) != 3 or not all(d in "01234567" for d in digits):
                raise self.error(start, "invalid escape: an octal escape needs 3 octal digits")
            self.i += 4
            return chr(int(digits, 8))
        raise self.error(start, f"invalid escape sequence '\\{c}'")
