"""Recursive-descent parser for the CEL subset, with CEL's operator precedence.

Precedence, loosest first: ``?:`` (right-associative), ``||``, ``&&``, the relations
``== != < <= > >= in``, ``+ -``, ``* / %``, unary ``! -``, then member access, index
and calls. Macros (``has``, ``exists``, ``all``, ``exists_one``, ``map``, ``filter``)
are recognised here, as CEL does, because their first argument is not evaluated.

Depth is bounded twice: the recursion through sub-expressions (parentheses, lists,
arguments) and the height of the resulting tree both stop at ``MAX_DEPTH``, so a
hostile expression gets an ExpressionError, never a RecursionError.
"""

from __future__ import annotations

from typing import Final

from processor.errors import ExpressionError
from processor.evaluate.cel._ast import (
    MAX_DEPTH,
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
from processor.evaluate.cel._lexer import INT64_MAX, Token, error_at, tokenize
from processor.evaluate.cel._values import UInt

_BINARY_PRECEDENCE: Final = {
    "||": 1,
    "&&": 2,
    "==": 3,
    "!=": 3,
    "<": 3,
    "<=": 3,
    ">": 3,
    ">=": 3,
    "in": 3,
    "+": 4,
    "-": 4,
    "*": 5,
    "/": 5,
    "%": 5,
}
_COMPREHENSION_MACROS: Final = {"exists": (2,), "all": (2,), "exists_one": (2,), "filter": (2,), "map": (2, 3)}


def parse(source: str) -> Node:
    """Parse ``source`` into a tree; raises ExpressionError with the offending token's line:col."""
    tokens = tokenize(source)
    parser = _Parser(source, tokens)
    if tokens[0].kind == "eof":
        raise error_at(source, 0, "empty expression")
    node = parser.parse_expr()
    tok = parser.peek()
    if tok.kind != "eof":
        raise parser.unexpected(tok, "an operator or the end of the expression")
    return node


def describe(tok: Token) -> str:
    return "the end of the expression" if tok.kind == "eof" else repr(tok.text)


class _Parser:
    def __init__(self, source: str, tokens: list[Token]) -> None:
        self.src = source
        self.tokens = tokens
        self.i = 0
        self.depth = 0

    # -- token helpers -------------------------------------------------------------

    def peek(self, ahead: int = 0) -> Token:
        return self.tokens[min(self.i + ahead, len(self.tokens) - 1)]

    def advance(self) -> Token:
        tok = self.tokens[self.i]
        if tok.kind != "eof":
            self.i += 1
        return tok

    def expect(self, kind: str, what: str) -> Token:
        tok = self.peek()
        if tok.kind != kind:
            raise self.unexpected(tok, what)
        return self.advance()

    def error(self, offset: int, message: str) -> ExpressionError:
        return error_at(self.src, offset, message)

    def unexpected(self, tok: Token, expected: str) -> ExpressionError:
        if tok.kind == "eof":
            return self.error(tok.pos, f"expression ended early: expected {expected}")
        return self.error(tok.pos, f"unexpected {describe(tok)}: expected {expected}")

    def node(self, n: Node) -> Node:
        """Record ``n``'s height and reject trees deeper than MAX_DEPTH."""
        children = n.children()
        if children:
            n.height = 1 + max(c.height for c in children)
            if n.height > MAX_DEPTH:
                raise self.error(n.pos, f"expression nests deeper than {MAX_DEPTH} levels")
        return n

    # -- grammar ---------------------------------------------------------------------

    def parse_expr(self) -> Node:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise self.error(self.peek().pos, f"expression nests deeper than {MAX_DEPTH} levels")
        cond = self.parse_binary(1)
        if self.peek().kind == "?":
            question = self.advance()
            then = self.parse_binary(1)
            self.expect(":", "':' of the conditional '? :'")
            otherwise = self.parse_expr()
            cond = self.node(Conditional(question.pos, cond, then, otherwise))
        self.depth -= 1
        return cond

    def parse_binary(self, min_precedence: int) -> Node:
        left = self.parse_unary()
        while True:
            tok = self.peek()
            precedence = _BINARY_PRECEDENCE.get(tok.kind)
            if precedence is None or precedence < min_precedence:
                return left
            self.advance()
            if tok.kind in ("&&", "||"):
                terms = [left, self.parse_binary(precedence + 1)]
                while self.peek().kind == tok.kind:
                    self.advance()
                    terms.append(self.parse_binary(precedence + 1))
                left = self.node(Logic(tok.pos, tok.kind, tuple(terms)))
            else:
                right = self.parse_binary(precedence + 1)
                left = self.node(Binary(tok.pos, tok.kind, left, right))

    def parse_unary(self) -> Node:
        ops: list[Token] = []
        while self.peek().kind in ("!", "-"):
            ops.append(self.advance())
        if not ops:
            return self.parse_member()
        operand: Node
        nxt = self.peek()
        if ops[-1].kind == "-" and nxt.kind in ("int", "double") and self.peek(1).kind not in (".", "["):
            # A negative number literal is one literal, which is how -9223372036854775808 is written.
            self.advance()
            value = nxt.value
            assert isinstance(value, int | float)
            operand = Literal(ops[-1].pos, -value)
            ops.pop()
        else:
            operand = self.parse_member()
        self.check_int_literal(operand)
        for op in reversed(ops):
            operand = self.node(Unary(op.pos, op.kind, operand))
        return operand

    def check_int_literal(self, n: Node) -> None:
        if isinstance(n, Literal) and type(n.value) is int and n.value > INT64_MAX:
            raise self.error(n.pos, "int literal is out of range (more than 64 bits)")

    def parse_member(self) -> Node:
        n = self.parse_primary()
        while True:
            tok = self.peek()
            if tok.kind == ".":
                self.advance()
                name = self.expect("ident", "a field or method name after '.'")
                if self.peek().kind == "(":
                    args = self.parse_call_args()
                    n = self.receiver_call(n, name, args)
                else:
                    n = self.node(Select(name.pos, n, str(name.value)))
            elif tok.kind == "[":
                self.advance()
                index = self.parse_expr()
                self.expect("]", "']'")
                n = self.node(Index(tok.pos, n, index))
            else:
                return n

    def parse_call_args(self) -> list[Node]:
        self.expect("(", "'('")
        args: list[Node] = []
        if self.peek().kind == ")":
            self.advance()
            return args
        while True:
            args.append(self.parse_expr())
            tok = self.peek()
            if tok.kind == ")":
                self.advance()
                return args
            if tok.kind != ",":
                raise self.unexpected(tok, "',' or ')' in the argument list")
            self.advance()

    def receiver_call(self, target: Node, name: Token, args: list[Node]) -> Node:
        macro = str(name.value)
        if macro not in _COMPREHENSION_MACROS:
            return self.node(Call(name.pos, macro, tuple(args), target))
        counts = _COMPREHENSION_MACROS[macro]
        if len(args) not in counts:
            shape = "a variable name and a condition"
            if macro == "map":
                shape = "a variable name and an expression (or a variable, a condition and an expression)"
            raise self.error(name.pos, f"{macro}() takes {shape}; got {len(args)} argument(s)")
        var = args[0]
        if not isinstance(var, Ident):
            raise self.error(var.pos, f"the first argument of {macro}() must be a variable name")
        if macro == "map":
            predicate = args[1] if len(args) == 3 else None
            transform: Node | None = args[-1]
        else:
            predicate, transform = args[1], None
        return self.node(Comprehension(name.pos, macro, target, var.name, var.pos, predicate, transform))

    def parse_primary(self) -> Node:
        tok = self.peek()
        kind = tok.kind
        if kind == "ident":
            self.advance()
            if self.peek().kind == "(":
                args = self.parse_call_args()
                if tok.value == "has":
                    if len(args) != 1 or not isinstance(args[0], Select):
                        raise self.error(tok.pos, "has() takes one field selection, like has(record.result)")
                    return self.node(Has(tok.pos, args[0]))
                return self.node(Call(tok.pos, str(tok.value), tuple(args), None))
            return Ident(tok.pos, str(tok.value))
        if kind in ("int", "uint", "double", "string"):
            self.advance()
            value = tok.value
            lit = Literal(tok.pos, UInt(value) if kind == "uint" and isinstance(value, int) else value)
            self.check_int_literal(lit)
            return lit
        if kind in ("true", "false", "null"):
            self.advance()
            return Literal(tok.pos, {"true": True, "false": False, "null": None}[kind])
        if kind == "(":
            self.advance()
            inner = self.parse_expr()
            self.expect(")", "')'")
            return inner
        if kind == "[":
            self.advance()
            elements = self.parse_sequence("]", "list")
            return self.node(ListLit(tok.pos, tuple(elements)))
        if kind == "{":
            self.advance()
            entries = self.parse_map_entries()
            return self.node(MapLit(tok.pos, tuple(entries)))
        if kind == ".":
            raise self.error(tok.pos, "qualified names starting with '.' are not supported")
        raise self.unexpected(tok, "a value, a name, '(' , '[' or '{'")

    def parse_sequence(self, closer: str, what: str) -> list[Node]:
        items: list[Node] = []
        while True:
            if self.peek().kind == closer:
                self.advance()
                return items
            items.append(self.parse_expr())
            tok = self.peek()
            if tok.kind == ",":
                self.advance()
            elif tok.kind != closer:
                raise self.unexpected(tok, f"',' or '{closer}' in the {what}")

    def parse_map_entries(self) -> list[tuple[Node, Node]]:
        entries: list[tuple[Node, Node]] = []
        while True:
            if self.peek().kind == "}":
                self.advance()
                return entries
            key = self.parse_expr()
            self.expect(":", "':' between a map key and its value")
            value = self.parse_expr()
            entries.append((key, value))
            tok = self.peek()
            if tok.kind == ",":
                self.advance()
            elif tok.kind != "}":
                raise self.unexpected(tok, "',' or '}' in the map")
