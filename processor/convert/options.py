"""What the converter is told by configuration (the ``convert:`` section)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from processor.configfmt import Duration
from processor.errors import Problem
from processor.records import NEVER_CACHEABLE_KINDS, NONDETERMINISTIC_KINDS, SIDE_EFFECT_KINDS

# Every kind a record may name: the classified ones plus the neutral ones rules refer to.
KNOWN_KINDS: Final = frozenset(
    NONDETERMINISTIC_KINDS | SIDE_EFFECT_KINDS | NEVER_CACHEABLE_KINDS | {"tool_call", "approval", "checkpoint"}
)


@dataclass(frozen=True, slots=True)
class ToolKindRule:
    """A tool whose name matches ``pattern`` (a case-insensitive glob) is an action of ``kind``."""

    pattern: str
    kind: str


def _rules(kind: str, *patterns: str) -> tuple[ToolKindRule, ...]:
    return tuple(ToolKindRule(p, kind) for p in patterns)


# First match wins, so money and messages come before the broad write/read patterns
# ("refund_update" is a payment, not a write). Documented in docs/conventions.md.
DEFAULT_TOOL_KINDS: Final[tuple[ToolKindRule, ...]] = (
    *_rules("payment", "*pay*", "*charge*", "*refund*"),
    *_rules("email", "send_email*", "*email*"),
    *_rules("notify", "*notify*", "*slack*", "*sms*"),
    *_rules("deploy", "*deploy*"),
    *_rules("write", "write_*", "*_write", "save_*", "*update*", "*delete*", "*insert*", "*create_*"),
    *_rules("external_read", "*search*", "*fetch*", "*get_*", "*read*", "*lookup*"),
    *_rules("user_prompt", "ask_user*", "*human*", "*input*"),
)


@dataclass(frozen=True, slots=True)
class ConvertOptions:
    """Which attribute profiles turn spans into actions, and how tools are classified.

    ``telemetry_is_log``: the tracing pipeline is the session's durable log, so a model
    reply captured on a span (``gen_ai.output.messages``, ``llm.output_messages``)
    counts as a recorded result. Off by default: telemetry is sampled and dropped.
    """

    durable: bool = True
    genai: bool = True
    openinference: bool = True
    openllmetry: bool = True
    tool_kinds: Sequence[ToolKindRule] = DEFAULT_TOOL_KINDS
    telemetry_is_log: bool = False
    # Approvals and waits shown in pydantic-ai and LangGraph spans (see convert/frameworks.py).
    framework_approvals: bool = True
    # The deadline given to those waits: the frameworks set none, so without it DS106 says so.
    approval_wait_timeout: Duration | None = None
    # A LangGraph step of a run with a thread id (a checkpointer) counts as a checkpoint when it ends.
    langgraph_checkpoints: bool = True
    # DBOS records each completed step's output: a completed step is a checkpoint, what it
    # produced is recorded, and the same step seen again in a recovered run is a replay.
    dbos_steps: bool = True
    # A LangGraph resume value (Command(resume=...)) that reads as a decision.
    approval_grant_words: Sequence[str] = (
        "approve", "approved", "accept", "accepted", "yes", "y", "grant", "granted", "ok",
    )
    approval_deny_words: Sequence[str] = ("reject", "rejected", "deny", "denied", "no", "n", "decline", "declined")

    def validate(self, path: str) -> list[Problem]:
        """Every problem, each named by its config path (``<path>.tool_kinds[2].kind``)."""
        problems: list[Problem] = []
        if not (self.durable or self.genai or self.openinference or self.openllmetry):
            problems.append(Problem(path, "every profile is off: no span can become an action"))
        for name, words in (("approval_grant_words", self.approval_grant_words),
                            ("approval_deny_words", self.approval_deny_words)):
            for index, word in enumerate(words):
                if not word.strip() or word != word.strip().lower():
                    problems.append(Problem(f"{path}.{name}[{index}]", "a resume value is compared in lower case "
                                            "without surrounding spaces: write the word that way"))
        both = set(self.approval_grant_words) & set(self.approval_deny_words)
        if both:
            problems.append(Problem(f"{path}.approval_deny_words", "also a grant word: " + ", ".join(sorted(both))))
        seen: dict[str, int] = {}
        for index, rule in enumerate(self.tool_kinds):
            where = f"{path}.tool_kinds[{index}]"
            if not rule.pattern.strip():
                problems.append(Problem(f"{where}.pattern", "empty pattern"))
            elif rule.pattern.lower() in seen:
                problems.append(
                    Problem(
                        f"{where}.pattern",
                        f"same pattern as tool_kinds[{seen[rule.pattern.lower()]}], which matches first; "
                        "this rule never applies",
                    )
                )
            else:
                seen[rule.pattern.lower()] = index
            if rule.kind not in KNOWN_KINDS:
                problems.append(Problem(f"{where}.kind", f"unknown kind; use one of {', '.join(sorted(KNOWN_KINDS))}"))
            if _unbalanced_bracket(rule.pattern):
                problems.append(Problem(f"{where}.pattern", "'[' without a closing ']'"))
        return problems


_BRACKET: Final = re.compile(r"\[!?\]?[^\]]*\]")


def _unbalanced_bracket(pattern: str) -> bool:
    # fnmatch would silently match a lone '[' literally; a config author meant a set.
    return "[" in _BRACKET.sub("", pattern)
