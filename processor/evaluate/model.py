"""The rule model: what a rule *is*, apart from how it is written (rulefmt) and run (engine).

Every rule is evaluated per session. Conditions are compiled CEL expressions over these
variables:

- ``record``: the action record (a dict in the skill's field names; absent key = absent field);
- ``meta``: facts about the record that are not record fields: ``source`` (``"log"`` or
  ``"span"``), ``synthetic_action_id`` (bool), ``line`` (int, 0 for spans), ``time_ns``
  (int: the record's event time in Unix ns, 0 when unknown; DS103 passes it to
  ``timeDerived``). In the message of a ``malformed`` rule, ``meta`` holds ``source``,
  ``line`` and ``problem`` (a string saying what is wrong, naming fields, never values);
- ``lists``: named constant lists declared in rule files (``lists.side_effecting``);
- ``first``: in ``then`` and ``message`` of stateful rules, the fields kept from the record
  that opened the group's state (only the fields the rule's expressions read are kept).

Rule types:

``condition``
    Fires on a record for which ``condition`` is true.
``malformed``
    Fires on input that could not become a record (DS000); has no condition.
``sequence``
    Per group: a record matching ``first`` opens state (``keep`` says whether a later
    match replaces it); a later record matching ``then`` (which may read ``first``) fires,
    if it came ``within`` seconds (when set). Reported on the ``then`` record, or on the
    ``first`` record with ``report_on: first``.
    With ``log_scope: file`` (grouped by ``record.action_id`` alone), action-log lines
    share one group per action id across the sessions of a file, and a malformed line
    that carries an action id opens it too (it fires nothing itself): the skill's
    checker counts every repeat of an id in a file. Spans keep per-session groups.
``absence``
    Per group: a record matching ``first`` starts a wait that a later record matching
    ``then`` resolves. Fires on the ``first`` record when the deadline passes unresolved:
    ``within`` seconds, or the per-record ``deadline`` expression (seconds after the first
    record's time), or when ``within_actions`` later records of the group arrived without
    a resolution, whichever comes first. A wait still pending at the end of a replay is
    listed as an open wait, not a violation.
``change``
    Per group: the value of ``field`` on records matching ``condition`` must stay the same;
    a record whose value differs from the first one seen fires.
``count``
    Per group: more than ``threshold`` records matching ``condition`` within ``window``
    seconds fire, once per crossing, on the record that crossed it.

``condition`` on a stateful rule is a filter applied before anything else: records for
which it is false do not touch the rule's state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from processor.violations import Severity

if TYPE_CHECKING:
    from processor.evaluate.cel import CompiledExpression

RuleType = Literal["condition", "malformed", "sequence", "absence", "change", "count"]
RULE_TYPES: tuple[RuleType, ...] = ("condition", "malformed", "sequence", "absence", "change", "count")
STATEFUL_TYPES: frozenset[RuleType] = frozenset({"sequence", "absence", "change", "count"})


@dataclass(frozen=True, slots=True)
class SourcePos:
    """Where a rule (or one of its keys) is written: 1-based line and column."""

    file: str
    line: int
    col: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


@dataclass(frozen=True, slots=True)
class MessageTemplate:
    """A message with ``{{ cel expression }}`` holes, compiled once.

    ``parts`` alternates literal text and compiled expressions; rendering never puts
    more than ``max_value_chars`` characters of one value into a message.
    """

    source: str
    parts: tuple[str | CompiledExpression, ...]
    max_value_chars: int = 300

    def render(self, activation: Mapping[str, Any]) -> str:
        """The message for one violation; a hole that cannot be evaluated renders as ``?``."""
        from processor.errors import EvaluationError

        out: list[str] = []
        for part in self.parts:
            if isinstance(part, str):
                out.append(part)
                continue
            try:
                value = part.evaluate(activation)
            except EvaluationError:
                out.append("?")
                continue
            text = "null" if value is None else ("true" if value is True else "false" if value is False else str(value))
            if len(text) > self.max_value_chars:
                text = text[: self.max_value_chars - 1] + "…"
            out.append(text)
        return "".join(out)


@dataclass(slots=True)
class Rule:
    id: str
    name: str
    description: str
    severity: Severity
    type: RuleType
    message: MessageTemplate
    pos: SourcePos
    enabled: bool = True
    strict_only: bool = False
    tags: tuple[str, ...] = ()
    # What to do about a finding, in the input's language: for span input (durable.* attributes,
    # the annotate helper, a framework's feature) and for action logs (record fields).
    fix_spans: str = ""
    fix_logs: str = ""
    # Filter (stateful types) or the whole check (``condition`` type).
    condition: CompiledExpression | None = None
    # Keys within the session that partition the rule's state (the session is always implied).
    group_by: tuple[CompiledExpression, ...] = ()
    # sequence / absence
    first: CompiledExpression | None = None
    then: CompiledExpression | None = None
    keep: Literal["first", "latest"] = "first"
    within_s: float | None = None
    report_on: Literal["first", "then"] = "then"
    # absence only
    deadline: CompiledExpression | None = None
    within_actions: int | None = None
    # change
    field: CompiledExpression | None = None
    # count
    threshold: int = 0
    window_s: float | None = None
    # Fields of ``first`` that later expressions read: all the state a group keeps.
    first_fields: frozenset[str] = frozenset()
    # sequence grouped by action id: on action-log lines, one group per file across sessions
    # (malformed lines with an action id open it too), as the skill's checker counts repeats.
    log_scope: Literal["session", "file"] = "session"

    @property
    def stateful(self) -> bool:
        return self.type in STATEFUL_TYPES

    def fix_for(self, spans: bool) -> str:
        """The fix for a finding on span input (``spans``) or on an action log; the description
        when the rule gives none."""
        return (self.fix_spans if spans else self.fix_logs) or self.description


@dataclass(slots=True)
class RuleSet:
    """All rules after shipped packs, user files and overrides are merged, in load order."""

    rules: list[Rule] = field(default_factory=list)
    lists: dict[str, list[str]] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)

    def by_id(self) -> dict[str, Rule]:
        return {rule.id: rule for rule in self.rules}

    def active(self, *, strict: bool) -> list[Rule]:
        """The rules that run: enabled, and strict-only ones only in strict mode."""
        return [r for r in self.rules if r.enabled and (strict or not r.strict_only)]
