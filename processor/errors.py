"""The exception hierarchy: every error a user can cause names its place.

``DurableCheckError`` is the root; the CLI turns any of them into a message and an
exit code, never a traceback.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Problem:
    """One problem at one place: ``file:line:col``, a config path, or a span.

    ``at``: where a config path's key stands in its file (``file:line:col``), said first
    when known; two problems at the same path with the same message are the same problem.
    """

    where: str
    message: str
    at: str = field(default="", compare=False)

    def __str__(self) -> str:
        place = f"{self.at}: {self.where}" if self.at and self.where else (self.at or self.where)
        return f"{place}: {self.message}" if place else self.message


class DurableCheckError(Exception):
    """Base of every error Durable Check raises on purpose."""


class ProblemsError(DurableCheckError):
    """Several problems found at once (all of them, not just the first)."""

    def __init__(self, problems: list[Problem], summary: str = "") -> None:
        self.problems = list(problems)
        lines = [summary] if summary else []
        lines.extend(str(p) for p in self.problems)
        super().__init__("\n".join(lines))


class ConfigError(ProblemsError):
    """The configuration is invalid; each problem names its config path."""


class RuleFormatError(ProblemsError):
    """A rule file is invalid; each problem names file:line:col and the rule."""


class InputError(DurableCheckError):
    """An input cannot be read at all (replay exits 2)."""


class OutputError(DurableCheckError):
    """A report or converted output cannot be written (a full disk, a closed file): exit 2."""


class ExpressionError(DurableCheckError):
    """A CEL expression does not parse or type-check; line and col are 1-based within the expression."""

    def __init__(self, message: str, line: int = 1, col: int = 1) -> None:
        self.line = line
        self.col = col
        self.detail = message
        # Further problems of the same expression, each with its own place.
        self.more: list[ExpressionError] = []
        super().__init__(f"{line}:{col}: {message}")


class EvaluationError(DurableCheckError):
    """A compiled expression failed on a record (a type mismatch at run time)."""


class StateError(DurableCheckError):
    """The state store failed (locked, corrupt, full, unreachable); receivers answer retryable errors."""
