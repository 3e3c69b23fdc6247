"""The rule-file format: strict YAML in, :class:`~processor.evaluate.model.RuleSet` out.

A rule file is decoded from YAML's node graph (not from plain Python values) so that
every problem names the ``file:line:col`` of the key or value at fault, the rule it
belongs to, and what to do about it. Loading never stops at the first problem: every
problem in every file is collected and raised at once as one :class:`RuleFormatError`,
each reading ``file:line:col: rule DS123 (name): message``.

What the loader checks: YAML syntax, a single document, ``version: 1``, unknown keys
(with a "did you mean" hint), duplicate keys, value types (no YAML 1.1 ``yes``/``no``
booleans), required keys, severities, durations, keys that a rule's type does not take,
CEL expressions (parsed and type-checked; an error inside a folded or literal block
scalar is placed at its real line and column in the file), record fields beyond the
convention's that no file declared in ``record_fields``, message templates, list
names used but not declared, duplicate rule ids within and across files (naming both
places), ids reserved for shipped rules, and overrides of unknown ids. Sizes are
bounded: file size, rules per file and in total, expression length, list lengths.

The format itself is documented in docs/rules.md.
"""

from __future__ import annotations

import bisect
import difflib
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Final, Literal, cast

import yaml
from yaml.constructor import ConstructorError, SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from processor import configfmt
from processor.errors import ExpressionError, Problem, RuleFormatError
from processor.evaluate.cel import CostLimits, Environment, compile_expression
from processor.evaluate.functions import RULE_FUNCTIONS
from processor.evaluate.model import (
    RULE_TYPES,
    STATEFUL_TYPES,
    MessageTemplate,
    Rule,
    RuleSet,
    RuleType,
    SourcePos,
)
from processor.records import FIELD_TYPES
from processor.violations import SEVERITIES, Severity

FORMAT_VERSION: Final = 1
MAX_FILE_BYTES: Final = 1 << 20
MAX_RULES_PER_FILE: Final = 1_000
MAX_RULES_TOTAL: Final = 5_000
MAX_EXPRESSION_CHARS: Final = 4_000
MAX_MESSAGE_CHARS: Final = 2_000
MAX_LISTS: Final = 200
MAX_LIST_ITEMS: Final = 10_000
MAX_GROUP_BY: Final = 8
MAX_TAGS: Final = 32
MAX_DURATION_S: Final = 400 * 86_400
MAX_PROBLEMS: Final = 500

RULE_ID_PATTERN: Final = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$")
RULE_NAME_PATTERN: Final = re.compile(r"^[a-z][a-z0-9]*(?:-[a-z0-9]+)*$")
LIST_NAME_PATTERN: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
# A record field that CEL can select as ``record.name``.
FIELD_NAME_PATTERN: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
TAG_PATTERN: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")
# Ids of this shape belong to the shipped packs: a user file changes them with an override.
RESERVED_ID_PATTERN: Final = re.compile(r"^DS[0-9]+$")

TOP_LEVEL_KEYS: Final = ("version", "lists", "record_fields", "rules", "overrides")
COMMON_RULE_KEYS: Final = (
    "id", "name", "description", "severity", "enabled", "strict_only", "tags", "type", "message", "fix",
)  # fmt: skip
# What a rule's fix is written for: span input (durable.* attributes, the annotate helper, a
# framework's feature) and action logs (record fields). A plain string serves both.
FIX_KEYS: Final = ("spans", "logs")
TYPE_KEYS: Final[dict[RuleType, tuple[str, ...]]] = {
    "condition": ("condition",),
    "malformed": (),
    "sequence": ("condition", "group_by", "first", "then", "keep", "within", "report_on", "log_scope"),
    "absence": ("condition", "group_by", "first", "then", "within", "deadline", "within_actions"),
    "change": ("condition", "group_by", "field"),
    "count": ("condition", "group_by", "threshold", "window"),
}
REQUIRED_TYPE_KEYS: Final[dict[RuleType, tuple[str, ...]]] = {
    "condition": ("condition",),
    "malformed": (),
    "sequence": ("first", "then"),
    "absence": ("first", "then"),
    "change": ("field",),
    "count": ("threshold", "window"),
}
ALL_RULE_KEYS: Final = tuple(dict.fromkeys([*COMMON_RULE_KEYS, *(k for ks in TYPE_KEYS.values() for k in ks)]))
OVERRIDE_KEYS: Final = ("id", "enabled", "severity", "strict_only")

# What ``meta`` holds for a record, and for input that could not become one (DS000).
META_FIELDS: Final = frozenset({"source", "synthetic_action_id", "line", "time_ns"})
MALFORMED_META_FIELDS: Final = frozenset({"source", "line", "problem"})

_YAML_TAG: Final = "tag:yaml.org,2002:"
# Keys whose expression is a test: anything but a bool (or a value only known at run time) is a mistake.
_BOOLEAN_KEYS: Final = frozenset({"condition", "first", "then"})
# A YAML number that is also a CEL literal (no 0x, 0o, sexagesimal or .inf forms).
_PLAIN_NUMBER: Final = re.compile(r"\d+(?:\.\d+)?")
# How CEL reports a key missing from the ``lists`` constant: said here in the format's words.
_MISSING_LIST: Final = re.compile(r"^'lists' has no key '([^']*)'")
# What CEL's references say for "the whole value" (``size(first)``, ``first[key]``).
_WHOLE: Final = "*"
_TAG_WORDS: Final = {
    "str": "a string",
    "int": "an integer",
    "float": "a number",
    "bool": "a boolean",
    "null": "null",
    "seq": "a list",
    "map": "a mapping",
    "timestamp": "a timestamp",
}


def shipped_rules_dir() -> Path:
    """Where the shipped rule packs are: inside the installed package, else the source checkout's rules/."""
    installed = resources.files("processor").joinpath("_shipped_rules")
    if installed.is_dir():
        return Path(str(installed))
    return Path(__file__).resolve().parents[2] / "rules"


def shipped_rule_files() -> list[Path]:
    """The shipped packs in load order (rule files only; ``*.test.yaml`` are their unit tests)."""
    directory = shipped_rules_dir()
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.glob("*.yaml") if not p.name.endswith(".test.yaml"))


def shipped_packs() -> dict[str, Path]:
    """The shipped packs by name (the file name without ``.yaml``: ``durable-sessions``), in load order."""
    return {path.stem: path for path in shipped_rule_files()}


def unknown_packs(names: Sequence[str]) -> list[Problem]:
    """A problem for each name that is not a shipped pack, listing the ones that are."""
    known = shipped_packs()
    return [
        Problem("", f"no rule pack named {name!r}{_suggest(name, list(known))}; shipped packs: {', '.join(known)}")
        for name in names
        if name not in known
    ]


def parse_duration(text: str, *, allow_zero: bool = False) -> float:
    """Seconds in a duration such as ``90s``, ``5m``, ``2h``, ``7d``, ``1w`` or ``1h30m``.

    Units appear largest first, each at most once; the total is positive and at most
    400 days. Raises ValueError with a message fit for a user.
    """
    hint = "a duration such as 90s, 5m, 2h, 7d or 1h30m"
    try:
        total = configfmt.parse_duration(text)
    except configfmt.DurationError as exc:
        if exc.reason == "empty":
            raise ValueError(f"empty duration: want {hint}") from None
        if exc.reason == "order":
            raise ValueError(f"bad duration {text!r}: units must go from largest to smallest, each once") from None
        raise ValueError(f"bad duration {text!r}: want {hint}") from None
    if total <= 0 and not allow_zero:
        raise ValueError(f"bad duration {text!r}: must be more than zero")
    if total > MAX_DURATION_S:
        raise ValueError(f"bad duration {text!r}: at most 400d")
    return total


# ---------------------------------------------------------------------------
# CEL environments


@dataclass(frozen=True, slots=True)
class _Environments:
    """The CEL environments a rule's expressions compile in, by where they appear."""

    record: Any  # condition, group_by, first, field, deadline; messages of single-record rules
    with_first: Any  # then, and messages of sequence and absence rules
    malformed: Any  # the message of a malformed rule


def _environments(
    lists: dict[str, list[str]], extra_fields: Iterable[str] = (), limits: CostLimits | None = None
) -> _Environments:
    """``extra_fields``: record fields beyond the convention's that rule files declared (``record_fields``).

    ``limits`` bounds each expression's estimated and run-time cost (the defaults when None).
    """
    record_fields = frozenset(FIELD_TYPES) | frozenset(extra_fields)
    functions = dict(RULE_FUNCTIONS)
    constants = {"lists": {name: list(values) for name, values in lists.items()}}
    base_vars = {"record": "map", "meta": "map"}
    known = {"record": record_fields, "meta": META_FIELDS}
    return _Environments(
        record=Environment(
            variables=base_vars, known_fields=known, constants=constants, functions=functions, limits=limits
        ),
        with_first=Environment(
            variables={**base_vars, "first": "map"},
            known_fields={**known, "first": record_fields},
            constants=constants,
            functions=functions,
            limits=limits,
        ),
        malformed=Environment(
            variables={"meta": "map"},
            known_fields={"meta": MALFORMED_META_FIELDS},
            constants=constants,
            functions=functions,
            limits=limits,
        ),
    )


# ---------------------------------------------------------------------------
# Source text and positions


class _StrictLoader(yaml.SafeLoader):
    """A SafeLoader that composes nodes only: values are decoded here, with their marks."""


# libyaml composes the same nodes ten times faster (rule loading is most of a short replay's
# start-up). Used for ASCII text, where its marks count as ours do; any YAML error is composed
# again by the Python loader, whose messages the problems quote.
_FastLoader: type[yaml.SafeLoader] | None = getattr(yaml, "CSafeLoader", None)


@dataclass(slots=True)
class _SourceFile:
    name: str
    text: str
    shipped: bool
    line_starts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        starts = [0]
        index = self.text.find("\n")
        while index >= 0:
            starts.append(index + 1)
            index = self.text.find("\n", index + 1)
        self.line_starts = starts

    def pos_at(self, index: int) -> SourcePos:
        index = max(0, min(index, len(self.text)))
        line = bisect.bisect_right(self.line_starts, index) - 1
        return SourcePos(self.name, line + 1, index - self.line_starts[line] + 1)

    def pos(self, node: Node) -> SourcePos:
        return SourcePos(self.name, node.start_mark.line + 1, node.start_mark.column + 1)

    def file_pos(self) -> SourcePos:
        return SourcePos(self.name, 1, 1)


def _scalar_offsets(text: str, node: ScalarNode) -> list[int] | None:
    """For each character of the scalar's value (and one past its end), its index in ``text``.

    YAML folds, strips indentation and unescapes scalars, so a value's line:col is not
    the file's. The value's non-blank characters appear in the source in the same order;
    they are aligned one by one, with blanks (folded line breaks, indentation) mapped to
    the next source character. Returns None when the alignment fails (it should not).
    """
    value: str = node.value
    start, end = node.start_mark.index, node.end_mark.index
    style = node.style
    if style in ("|", ">"):
        newline = text.find("\n", start, end)
        cursor = end if newline < 0 else newline + 1
    elif style in ("'", '"'):
        cursor = start + 1
        end = max(cursor, end - 1)
    else:
        cursor = start
    units = list(_source_units(text, cursor, end, style))
    offsets: list[int] = []
    u = 0
    for char in value:
        if char.isspace():
            if u < len(units) and (units[u][1] == "" or units[u][1].isspace()):
                offsets.append(units[u][0])
                u += 1
            else:
                offsets.append(units[u][0] if u < len(units) else (units[-1][0] + 1 if units else cursor))
            continue
        while u < len(units) and (units[u][1] == "" or units[u][1].isspace()):
            u += 1
        if u >= len(units) or units[u][1] != char:
            return None
        offsets.append(units[u][0])
        u += 1
    offsets.append(offsets[-1] + 1 if offsets else cursor)
    return offsets


def _source_units(text: str, start: int, end: int, style: str | None) -> Iterator[tuple[int, str]]:
    """(index, produced character) for the source of a scalar, undoing quote escapes."""
    i = start
    while i < end:
        char = text[i]
        if style == "'" and char == "'" and i + 1 < end and text[i + 1] == "'":
            yield i, "'"
            i += 2
            continue
        if style == '"' and char == "\\" and i + 1 < end:
            escaped = text[i + 1]
            if escaped in '"\\/':
                yield i, escaped
                i += 2
                continue
            width = {"x": 2, "u": 4, "U": 8}.get(escaped)
            if width is not None:
                digits = text[i + 2 : i + 2 + width]
                try:
                    yield i, chr(int(digits, 16))
                except ValueError:
                    yield i, ""
                i += 2 + width
                continue
            # \n, \t, a line continuation, ...: blanks as far as alignment goes.
            yield i, " "
            i += 2
            continue
        yield i, char
        i += 1


# ---------------------------------------------------------------------------
# Decoding


class _Problems:
    """Collects problems; reports them by file (in load order), then line and column."""

    def __init__(self) -> None:
        self.items: list[tuple[SourcePos | str, str]] = []
        self.file_order: dict[str, int] = {}
        self.dropped = 0
        # A node reached through several YAML aliases is checked once per alias: its
        # problems are said once.
        self._seen: set[tuple[str, str]] = set()

    def add(self, where: SourcePos | str, message: str) -> None:
        key = (str(where), message)
        if key in self._seen:
            return
        self._seen.add(key)
        if len(self.items) >= MAX_PROBLEMS:
            self.dropped += 1
            return
        self.items.append((where, message))

    def count(self) -> int:
        return len(self.items) + self.dropped

    def final(self) -> list[Problem]:
        def order(item: tuple[SourcePos | str, str]) -> tuple[int, int, int]:
            where = item[0]
            if isinstance(where, SourcePos):
                return (self.file_order.get(where.file, len(self.file_order)), where.line, where.col)
            return (self.file_order.get(where, len(self.file_order)), 0, 0)

        out = [Problem(str(where), message) for where, message in sorted(self.items, key=order)]
        if self.dropped:
            out.append(Problem("", f"... and {self.dropped} more problems not shown"))
        return out


def _tag_word(node: Node) -> str:
    tag = node.tag[len(_YAML_TAG) :] if node.tag.startswith(_YAML_TAG) else node.tag
    return _TAG_WORDS.get(tag, f"a value tagged {node.tag}")


def _suggest(key: str, allowed: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(allowed), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


@dataclass(slots=True)
class _Context:
    """Where decoding is: the file, and the label of the rule or override being read."""

    src: _SourceFile
    problems: _Problems
    label: str = ""

    def error(self, node: Node | SourcePos, message: str) -> None:
        where = node if isinstance(node, SourcePos) else self.src.pos(node)
        self.problems.add(where, f"{self.label}: {message}" if self.label else message)

    def mapping(self, node: Node, what: str, allowed: Sequence[str]) -> dict[str, tuple[ScalarNode, Node]] | None:
        """The entries of a mapping node keyed by name; reports non-string, duplicate and unknown keys."""
        if not isinstance(node, MappingNode):
            self.error(node, f"{what} must be a mapping, got {_tag_word(node)}")
            return None
        entries: dict[str, tuple[ScalarNode, Node]] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, ScalarNode) or key_node.tag != _YAML_TAG + "str":
                self.error(key_node, f"keys of {what} must be strings, got {_tag_word(key_node)}")
                continue
            key = key_node.value
            if key in entries:
                first = self.src.pos(entries[key][0])
                self.error(key_node, f"duplicate key {key} (first set at line {first.line}, column {first.col})")
                continue
            if key not in allowed:
                self.error(key_node, f"unknown key {key} in {what}{_suggest(key, allowed)}")
                continue
            entries[key] = (key_node, value_node)
        return entries

    def string(self, node: Node, what: str, *, allow_empty: bool = False) -> str | None:
        if not isinstance(node, ScalarNode) or node.tag != _YAML_TAG + "str":
            self.error(node, f"{what} must be a string, got {_tag_word(node)}")
            return None
        if not allow_empty and not node.value.strip():
            self.error(node, f"{what} must not be empty")
            return None
        return cast(str, node.value)

    def boolean(self, node: Node, what: str) -> bool | None:
        if isinstance(node, ScalarNode) and node.tag == _YAML_TAG + "bool":
            word = str(node.value).lower()
            if word in ("true", "false"):
                return word == "true"
            self.error(
                node, f"{what} must be true or false, got {node.value!r} (YAML 1.1 yes/no/on/off are not accepted)"
            )
            return None
        self.error(node, f"{what} must be true or false, got {_tag_word(node)}")
        return None

    def integer(self, node: Node, what: str, *, minimum: int, maximum: int) -> int | None:
        if not isinstance(node, ScalarNode) or node.tag != _YAML_TAG + "int":
            self.error(node, f"{what} must be an integer, got {_tag_word(node)}")
            return None
        try:
            value: int = SafeConstructor().construct_yaml_int(node)
        except (ConstructorError, ValueError):
            self.error(node, f"{what} must be an integer")
            return None
        if not minimum <= value <= maximum:
            self.error(node, f"{what} must be between {minimum} and {maximum}, got {value}")
            return None
        return value

    def choice(self, node: Node, what: str, choices: Sequence[str]) -> str | None:
        value = self.string(node, what)
        if value is None:
            return None
        if value not in choices:
            self.error(node, f"{what} must be one of {', '.join(choices)}, got {value!r}{_suggest(value, choices)}")
            return None
        return value

    def duration(self, node: Node, what: str, *, allow_zero: bool = False) -> float | None:
        if isinstance(node, ScalarNode) and node.tag in (_YAML_TAG + "int", _YAML_TAG + "float"):
            self.error(node, f"{what} needs a unit: write {node.value}s for seconds, or 5m, 2h, 7d")
            return None
        text = self.string(node, what)
        if text is None:
            return None
        try:
            return parse_duration(text.strip(), allow_zero=allow_zero)
        except ValueError as exc:
            self.error(node, f"{what}: {exc}")
            return None

    def string_list(
        self,
        node: Node,
        what: str,
        *,
        pattern: re.Pattern[str] | None = None,
        limit: int,
        hint: str = "letters, digits, _ . : -",
    ) -> list[tuple[str, ScalarNode]] | None:
        if not isinstance(node, SequenceNode):
            self.error(node, f"{what} must be a list, got {_tag_word(node)}")
            return None
        if len(node.value) > limit:
            self.error(node, f"{what} has {len(node.value)} items; at most {limit} are allowed")
            return None
        out: list[tuple[str, ScalarNode]] = []
        for item in node.value:
            text = self.string(item, f"an item of {what}")
            if text is None:
                continue
            if pattern is not None and not pattern.match(text):
                self.error(item, f"{what}: {text!r} is not a valid name ({hint})")
                continue
            out.append((text, cast(ScalarNode, item)))
        return out

    def expression_source(self, node: Node, what: str, *, limit: int = MAX_EXPRESSION_CHARS) -> str | None:
        """The CEL text of a key; a YAML boolean (``first: true``) or number (``deadline: 600``) is a constant."""
        if isinstance(node, ScalarNode) and node.tag == _YAML_TAG + "bool" and node.value.lower() in ("true", "false"):
            return cast(str, node.value.lower())
        if what == "deadline" and isinstance(node, ScalarNode) and node.tag in (_YAML_TAG + "int", _YAML_TAG + "float"):
            number = str(node.value).replace("_", "")
            if _PLAIN_NUMBER.fullmatch(number):
                return number
        if not isinstance(node, ScalarNode) or node.tag != _YAML_TAG + "str":
            self.error(node, f"{what} must be a CEL expression (a string), got {_tag_word(node)}")
            return None
        text = cast(str, node.value)
        if not text.strip():
            self.error(node, f"{what} must not be empty")
            return None
        if len(text) > limit:
            self.error(node, f"{what} is {len(text)} characters long; at most {limit} are allowed")
            return None
        return text

    def expression_error_pos(self, node: Node, offset: int) -> SourcePos:
        """The file position of character ``offset`` of the scalar's value."""
        if isinstance(node, ScalarNode) and node.tag == _YAML_TAG + "str":
            offsets = _scalar_offsets(self.src.text, node)
            if offsets is not None:
                return self.src.pos_at(offsets[max(0, min(offset, len(offsets) - 1))])
        return self.src.pos(node)


def _offset_of(source: str, line: int, col: int) -> int:
    """Character offset of a 1-based line:col inside ``source``."""
    offset = 0
    for _ in range(max(0, line - 1)):
        newline = source.find("\n", offset)
        if newline < 0:
            break
        offset = newline + 1
    return offset + max(0, col - 1)


# ---------------------------------------------------------------------------
# One file


@dataclass(slots=True)
class _ParsedFile:
    src: _SourceFile
    lists: dict[str, tuple[list[str], SourcePos]] = field(default_factory=dict)
    record_fields: list[tuple[str, SourcePos]] = field(default_factory=list)
    rule_nodes: list[Node] = field(default_factory=list)
    override_nodes: list[Node] = field(default_factory=list)


def _read_file(path: Path, display: str, shipped: bool, problems: _Problems) -> _SourceFile | None:
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            problems.add(
                SourcePos(display, 1, 1), f"file is {size} bytes; rule files are limited to {MAX_FILE_BYTES} bytes"
            )
            return None
        data = path.read_bytes()
    except OSError as exc:
        problems.add(display, f"cannot read rule file: {exc.strerror or exc}")
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        problems.add(display, f"not UTF-8 text (byte {exc.start})")
        return None
    return _SourceFile(display, text, shipped)


def _compose(src: _SourceFile, problems: _Problems) -> Node | None:
    if _FastLoader is not None and src.text.isascii():
        try:
            return yaml.compose(src.text, Loader=_FastLoader)
        except yaml.YAMLError:
            pass  # said below, in the Python loader's words
    try:
        return yaml.compose(src.text, Loader=_StrictLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = SourcePos(src.name, mark.line + 1, mark.column + 1) if mark is not None else src.file_pos()
        detail = exc.problem or exc.context or "invalid YAML"
        if exc.context and exc.problem:
            detail = f"{exc.context}: {exc.problem}" if "expected a single document" not in exc.context else exc.context
        problems.add(where, f"YAML syntax error: {detail}")
    except yaml.YAMLError as exc:
        problems.add(src.file_pos(), f"YAML error: {exc}")
    return None


def _parse_file(src: _SourceFile, problems: _Problems) -> _ParsedFile | None:
    before = problems.count()
    root = _compose(src, problems)
    if root is None:
        if problems.count() == before:
            problems.add(src.file_pos(), "empty rule file: expected `version: 1` and `rules:`")
        return None
    ctx = _Context(src, problems)
    top = ctx.mapping(root, "a rule file", TOP_LEVEL_KEYS)
    if top is None:
        return None
    parsed = _ParsedFile(src)
    if "version" not in top:
        ctx.error(root, f"missing key version (this release reads `version: {FORMAT_VERSION}`)")
    else:
        version_node = top["version"][1]
        if not (
            isinstance(version_node, ScalarNode)
            and version_node.tag == _YAML_TAG + "int"
            and version_node.value.strip() == str(FORMAT_VERSION)
        ):
            ctx.error(
                version_node,
                f"unsupported version {version_node.value!r}: this release reads version {FORMAT_VERSION}"
                if isinstance(version_node, ScalarNode)
                else f"version must be {FORMAT_VERSION}",
            )
    if "lists" in top:
        _parse_lists(ctx, top["lists"][1], parsed)
    if "record_fields" in top:
        declared = ctx.string_list(
            top["record_fields"][1],
            "record_fields",
            pattern=FIELD_NAME_PATTERN,
            limit=MAX_LIST_ITEMS,
            hint="letters, digits and _, not starting with a digit",
        )
        for name, item in declared or ():
            if name in FIELD_TYPES:
                ctx.error(
                    item, f"record_fields: {name} is a field of the convention already; list only your own fields"
                )
            else:
                parsed.record_fields.append((name, ctx.src.pos(item)))
    if "rules" in top:
        node = top["rules"][1]
        if isinstance(node, SequenceNode):
            if len(node.value) > MAX_RULES_PER_FILE:
                ctx.error(node, f"{len(node.value)} rules in one file; at most {MAX_RULES_PER_FILE} are allowed")
            else:
                parsed.rule_nodes = list(node.value)
        elif not (isinstance(node, ScalarNode) and node.tag == _YAML_TAG + "null"):
            ctx.error(node, f"rules must be a list, got {_tag_word(node)}")
    if "overrides" in top:
        node = top["overrides"][1]
        if isinstance(node, SequenceNode):
            if len(node.value) > MAX_RULES_PER_FILE:
                ctx.error(node, f"{len(node.value)} overrides in one file; at most {MAX_RULES_PER_FILE} are allowed")
            else:
                parsed.override_nodes = list(node.value)
        elif not (isinstance(node, ScalarNode) and node.tag == _YAML_TAG + "null"):
            ctx.error(node, f"overrides must be a list, got {_tag_word(node)}")
    if "rules" not in top and "overrides" not in top:
        ctx.error(root, "a rule file needs `rules:` or `overrides:`")
    return parsed


def _parse_lists(ctx: _Context, node: Node, parsed: _ParsedFile) -> None:
    if not isinstance(node, MappingNode):
        ctx.error(node, f"lists must be a mapping of name: [values], got {_tag_word(node)}")
        return
    if len(node.value) > MAX_LISTS:
        ctx.error(node, f"{len(node.value)} lists; at most {MAX_LISTS} are allowed")
        return
    names = [k.value for k, _ in node.value if isinstance(k, ScalarNode)]
    entries = ctx.mapping(node, "lists", names)
    if entries is None:
        return
    for name, (key_node, value_node) in entries.items():
        if not LIST_NAME_PATTERN.match(name):
            ctx.error(key_node, f"list name {name!r} must be an identifier (letters, digits, _)")
            continue
        items = ctx.string_list(value_node, f"list {name}", limit=MAX_LIST_ITEMS)
        if items is not None:
            parsed.lists[name] = ([text for text, _ in items], ctx.src.pos(key_node))


# ---------------------------------------------------------------------------
# Rules


@dataclass(slots=True)
class _Located:
    rule: Rule
    src: _SourceFile
    id_node: Node


def _rule_label(node: Node, index: int) -> str:
    """``rule DS001 (name)``, read leniently so that every problem of the rule can be labelled."""
    rule_id = name = None
    if isinstance(node, MappingNode):
        for key, value in node.value:
            if isinstance(key, ScalarNode) and isinstance(value, ScalarNode):
                if key.value == "id" and value.value:
                    rule_id = value.value
                elif key.value == "name" and value.value:
                    name = value.value
    label = f"rule {rule_id}" if rule_id else f"rule #{index + 1}"
    return f"{label} ({name})" if name else label


class _RuleBuilder:
    """Decodes and compiles the rules of one file in the environments of the merged lists."""

    def __init__(self, envs: _Environments, lists: dict[str, list[str]], problems: _Problems) -> None:
        self.envs = envs
        self.lists = lists
        self.problems = problems

    def compile(
        self, ctx: _Context, node: Node, what: str, env: Any, *, limit: int = MAX_EXPRESSION_CHARS
    ) -> Any | None:
        source = ctx.expression_source(node, what, limit=limit)
        if source is None:
            return None
        return self.compile_source(ctx, node, what, env, source, base=0)

    def compile_source(self, ctx: _Context, node: Node, what: str, env: Any, source: str, *, base: int) -> Any | None:
        """Compile ``source``, found at character ``base`` of ``node``'s value; map errors into the file."""
        try:
            compiled = compile_expression(source, env)
        except ExpressionError as exc:
            for problem in (exc, *exc.more):
                offset = base + _offset_of(source, problem.line, problem.col)
                detail = problem.detail
                if env is not self.envs.with_first and "reference to 'first'" in detail:
                    detail = "first is only known in then and message of sequence and absence rules"
                missing_list = _MISSING_LIST.match(detail)
                if missing_list is not None:
                    declared = ", ".join(sorted(self.lists)) or "none"
                    detail = f"list {missing_list.group(1)} is not declared (declared lists: {declared})"
                ctx.error(ctx.expression_error_pos(node, offset), f"{what}: {detail}")
            return None
        if what in _BOOLEAN_KEYS and compiled.result_type not in ("bool", "dyn"):
            ctx.error(
                ctx.expression_error_pos(node, base),
                f"{what} must be a boolean expression, but it gives {compiled.result_type}",
            )
            return None
        if what == "deadline" and compiled.result_type not in ("int", "uint", "double", "dyn"):
            ctx.error(
                ctx.expression_error_pos(node, base),
                f"deadline must give a number of seconds, but it gives {compiled.result_type}",
            )
            return None
        if any(v == "first" and f == _WHOLE for v, f in compiled.references):
            ctx.error(
                ctx.expression_error_pos(node, base + max(0, source.find("first"))),
                f"{what}: read first field by field (first.kind): a group keeps only the fields its rule reads",
            )
            return None
        undeclared = sorted(f for v, f in compiled.references if v == "lists" and f and f not in self.lists)
        if undeclared:
            declared = ", ".join(sorted(self.lists)) or "none"
            ctx.error(
                ctx.expression_error_pos(node, base + max(0, source.find(undeclared[0]))),
                f"{what}: list {undeclared[0]} is not declared (declared lists: {declared})",
            )
            return None
        return compiled

    def message(self, ctx: _Context, node: Node, env: Any) -> MessageTemplate | None:
        text = ctx.string(node, "message")
        if text is None:
            return None
        if len(text) > MAX_MESSAGE_CHARS:
            ctx.error(node, f"message is {len(text)} characters long; at most {MAX_MESSAGE_CHARS} are allowed")
            return None
        parts: list[Any] = []
        position = 0
        ok = True
        while position < len(text):
            opening = text.find("{{", position)
            if opening < 0:
                parts.append(text[position:])
                break
            if opening > position:
                parts.append(text[position:opening])
            closing = text.find("}}", opening + 2)
            if closing < 0:
                ctx.error(ctx.expression_error_pos(node, opening), "message: {{ is never closed by }}")
                return None
            hole = text[opening + 2 : closing]
            if not hole.strip():
                ctx.error(ctx.expression_error_pos(node, opening), "message: empty {{ }}")
                ok = False
            else:
                compiled = self.compile_source(ctx, node, "message", env, hole, base=opening + 2)
                if compiled is None:
                    ok = False
                else:
                    parts.append(compiled)
            position = closing + 2
        if not ok:
            return None
        return MessageTemplate(source=text, parts=tuple(parts))

    def build(self, ctx: _Context, node: Node) -> _Located | None:
        entries = ctx.mapping(node, "a rule", ALL_RULE_KEYS)
        if entries is None:
            return None
        problems_before = self.problems.count()

        def value(key: str) -> Node | None:
            entry = entries.get(key)
            return entry[1] if entry is not None else None

        missing = [key for key in ("id", "name", "severity", "message") if key not in entries]
        if missing:
            ctx.error(node, f"missing key{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
        rule_id = ctx.string(n, "id") if (n := value("id")) is not None else None
        if rule_id is not None and not RULE_ID_PATTERN.match(rule_id):
            ctx.error(value("id") or node, f"id {rule_id!r} must start with a letter and hold letters, digits, _ . -")
            rule_id = None
        if rule_id is not None and not ctx.src.shipped and RESERVED_ID_PATTERN.match(rule_id):
            ctx.error(
                value("id") or node,
                f"ids DS<number> are reserved for shipped rules: to change {rule_id}, list it under `overrides:`; "
                "for a rule of your own pick another id (e.g. ACME001)",
            )
        name = ctx.string(n, "name") if (n := value("name")) is not None else None
        if name is not None and not RULE_NAME_PATTERN.match(name):
            ctx.error(
                value("name") or node, f"name {name!r} must be lower-case words joined by - (like unrecorded-result)"
            )
        description = ctx.string(n, "description", allow_empty=True) if (n := value("description")) is not None else ""
        fix_spans = fix_logs = ""
        if (n := value("fix")) is not None:
            if isinstance(n, MappingNode):
                fixes = ctx.mapping(n, "fix", FIX_KEYS)
                if fixes is not None:
                    fix_spans = (ctx.string(fixes["spans"][1], "fix.spans") or "") if "spans" in fixes else ""
                    fix_logs = (ctx.string(fixes["logs"][1], "fix.logs") or "") if "logs" in fixes else ""
            else:
                fix_spans = fix_logs = ctx.string(n, "fix") or ""
        severity = ctx.choice(n, "severity", SEVERITIES) if (n := value("severity")) is not None else None
        enabled = ctx.boolean(n, "enabled") if (n := value("enabled")) is not None else True
        strict_only = ctx.boolean(n, "strict_only") if (n := value("strict_only")) is not None else False
        tags: tuple[str, ...] = ()
        if (n := value("tags")) is not None:
            items = ctx.string_list(n, "tags", pattern=TAG_PATTERN, limit=MAX_TAGS)
            tags = tuple(t for t, _ in items) if items is not None else ()

        rule_type = self._type(ctx, node, entries)
        if rule_type is None:
            return None
        for key, (key_node, _) in entries.items():
            if key not in COMMON_RULE_KEYS and key not in TYPE_KEYS[rule_type]:
                allowed = ", ".join(TYPE_KEYS[rule_type]) or "none beyond the common keys"
                ctx.error(key_node, f"key {key} does not apply to a {rule_type} rule (its keys: {allowed})")
        for key in REQUIRED_TYPE_KEYS[rule_type]:
            if key not in entries:
                ctx.error(
                    node, f"missing key {key} (a {rule_type} rule needs {', '.join(REQUIRED_TYPE_KEYS[rule_type])})"
                )
        if rule_type == "absence" and not any(k in entries for k in ("within", "deadline", "within_actions")):
            ctx.error(node, "an absence rule needs a deadline: within, deadline or within_actions")

        envs = self.envs
        stateful = rule_type in STATEFUL_TYPES
        record_env = envs.record
        late_env = envs.with_first if rule_type in ("sequence", "absence") else envs.record
        message_env = envs.malformed if rule_type == "malformed" else late_env

        condition = self.compile(ctx, n, "condition", record_env) if (n := value("condition")) is not None else None
        group_by: list[Any] = []
        if (n := value("group_by")) is not None and stateful:
            if not isinstance(n, SequenceNode):
                ctx.error(n, f"group_by must be a list of expressions, got {_tag_word(n)}")
            elif len(n.value) > MAX_GROUP_BY:
                ctx.error(n, f"group_by has {len(n.value)} items; at most {MAX_GROUP_BY} are allowed")
            else:
                for item in n.value:
                    compiled = self.compile(ctx, item, "group_by", record_env)
                    if compiled is not None:
                        group_by.append(compiled)
        first = self.compile(ctx, n, "first", record_env) if (n := value("first")) is not None else None
        then = self.compile(ctx, n, "then", late_env) if (n := value("then")) is not None else None
        deadline = self.compile(ctx, n, "deadline", record_env) if (n := value("deadline")) is not None else None
        field_expr = self.compile(ctx, n, "field", record_env) if (n := value("field")) is not None else None
        keep = ctx.choice(n, "keep", ("first", "latest")) if (n := value("keep")) is not None else "first"
        report_on = ctx.choice(n, "report_on", ("first", "then")) if (n := value("report_on")) is not None else "then"
        within_s = ctx.duration(n, "within") if (n := value("within")) is not None else None
        window_s = ctx.duration(n, "window") if (n := value("window")) is not None else None
        within_actions = (
            ctx.integer(n, "within_actions", minimum=1, maximum=100_000)
            if (n := value("within_actions")) is not None
            else None
        )
        threshold = (
            ctx.integer(n, "threshold", minimum=1, maximum=1_000_000) if (n := value("threshold")) is not None else 0
        )
        message = self.message(ctx, n, message_env) if (n := value("message")) is not None else None
        log_scope = "session"
        if (n := value("log_scope")) is not None:
            log_scope = ctx.choice(n, "log_scope", ("session", "file")) or "session"
            by_action_id = len(group_by) == 1 and group_by[0].path == ("record", "action_id")
            if log_scope == "file" and not (
                by_action_id and keep == "first" and report_on == "then" and within_s is None
            ):
                # A malformed line carries its action id and nothing else a rule could read.
                ctx.error(
                    n,
                    "log_scope: file needs group_by: [record.action_id], keep: first, report_on: then and no within",
                )

        if self.problems.count() != problems_before:
            return None
        assert rule_id is not None and name is not None and severity is not None and message is not None
        first_fields: set[str] = set()
        if rule_type in ("sequence", "absence"):
            for compiled in (then, *(p for p in message.parts if not isinstance(p, str))):
                if compiled is not None:
                    first_fields.update(f for v, f in compiled.references if v == "first" and f)
        rule = Rule(
            id=rule_id,
            name=name,
            description=(description or "").strip(),
            fix_spans=" ".join(fix_spans.split()),
            fix_logs=" ".join(fix_logs.split()),
            severity=cast(Severity, severity),
            type=rule_type,
            message=message,
            pos=ctx.src.pos(node),
            enabled=bool(enabled),
            strict_only=bool(strict_only),
            tags=tags,
            condition=condition,
            group_by=tuple(group_by),
            first=first,
            then=then,
            keep=cast(Literal["first", "latest"], keep),
            within_s=within_s,
            report_on=cast(Literal["first", "then"], report_on),
            deadline=deadline,
            within_actions=within_actions,
            field=field_expr,
            threshold=threshold or 0,
            window_s=window_s,
            first_fields=frozenset(first_fields),
            log_scope=cast(Literal["session", "file"], log_scope),
        )
        return _Located(rule, ctx.src, entries["id"][1])

    def _type(self, ctx: _Context, node: Node, entries: dict[str, tuple[ScalarNode, Node]]) -> RuleType | None:
        if "type" in entries:
            chosen = ctx.choice(entries["type"][1], "type", RULE_TYPES)
            return cast("RuleType | None", chosen)
        stateful_keys = [k for k in entries if k not in COMMON_RULE_KEYS and k != "condition"]
        if "condition" in entries and not stateful_keys:
            return "condition"
        ctx.error(
            node,
            f"missing key type (one of {', '.join(RULE_TYPES)}; only a rule with `condition` alone may leave it out)",
        )
        return None


# ---------------------------------------------------------------------------
# Overrides


@dataclass(slots=True)
class _Override:
    rule_id: str
    id_node: Node
    src: _SourceFile
    enabled: bool | None
    severity: Severity | None
    strict_only: bool | None


def _parse_override(ctx: _Context, node: Node) -> _Override | None:
    entries = ctx.mapping(node, "an override", OVERRIDE_KEYS)
    if entries is None:
        return None
    before = ctx.problems.count()
    if "id" not in entries:
        ctx.error(node, "missing key id (the id of the rule to change)")
        return None
    rule_id = ctx.string(entries["id"][1], "id")
    enabled = ctx.boolean(entries["enabled"][1], "enabled") if "enabled" in entries else None
    severity = ctx.choice(entries["severity"][1], "severity", SEVERITIES) if "severity" in entries else None
    strict_only = ctx.boolean(entries["strict_only"][1], "strict_only") if "strict_only" in entries else None
    if len(entries) == 1:
        ctx.error(node, "an override changes something: give enabled, severity or strict_only")
    if rule_id is None or ctx.problems.count() != before:
        return None
    return _Override(rule_id, entries["id"][1], ctx.src, enabled, cast("Severity | None", severity), strict_only)


# ---------------------------------------------------------------------------
# Loading


def _expand(paths: Sequence[str | Path]) -> list[Path]:
    """Files named, with directories expanded to their rule files (``*.yaml``/``*.yml``, not tests)."""
    out: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            out.extend(
                sorted(
                    p
                    for p in path.iterdir()
                    if p.suffix in (".yaml", ".yml") and not p.name.endswith((".test.yaml", ".test.yml"))
                )
            )
        else:
            out.append(path)
    return out


def _is_shipped(path: Path) -> bool:
    try:
        return path.resolve().parent == shipped_rules_dir().resolve()
    except OSError:
        return False


def rule_sources(paths: Sequence[str | Path], include_shipped: bool = True) -> list[tuple[Path, str, bool]]:
    """(path, name used in messages, shipped?) of every file a load reads, in load order, each once."""
    return _collect(paths, include_shipped)


def _collect(paths: Sequence[str | Path], include_shipped: bool) -> list[tuple[Path, str, bool]]:
    chosen: list[tuple[Path, str, bool]] = []
    seen: set[Path] = set()
    candidates: list[tuple[Path, str]] = []
    if include_shipped:
        # Named as in the source tree, wherever the package installed them.
        candidates.extend((p, f"rules/{p.name}") for p in shipped_rule_files())
    candidates.extend((p, str(p)) for p in _expand(paths))
    for path, display in candidates:
        try:
            key = path.resolve()
        except OSError:
            key = path
        if key in seen:
            continue
        seen.add(key)
        chosen.append((path, display, _is_shipped(path)))
    return chosen


def _load(
    paths: Sequence[str | Path],
    include_shipped: bool,
    strict_only_ok: bool,
    problems: _Problems,
    *,
    limits: CostLimits | None = None,
    packs: Sequence[str] = (),
) -> RuleSet:
    for problem in unknown_packs(packs):
        problems.add(problem.where, problem.message)
    # Packs not chosen are still read for their lists (session-checks uses durable-sessions'),
    # but their rules are left out, so overrides cannot name them either.
    left_out = (
        {f"rules/{name}.yaml" for name in shipped_packs() if name not in packs} if packs and include_shipped else set()
    )
    parsed_files: list[_ParsedFile] = []
    for path, display, shipped in _collect(paths, include_shipped):
        problems.file_order.setdefault(display, len(problems.file_order))
        src = _read_file(path, display, shipped, problems)
        if src is None:
            continue
        parsed = _parse_file(src, problems)
        if parsed is not None:
            parsed_files.append(parsed)

    lists: dict[str, list[str]] = {}
    list_places: dict[str, SourcePos] = {}
    for parsed in parsed_files:
        for name, (values, where) in parsed.lists.items():
            if name in lists:
                problems.add(
                    where, f"list {name} is already declared at {list_places[name]}; lists cannot be redeclared"
                )
                continue
            lists[name] = values
            list_places[name] = where

    ruleset = RuleSet(lists=lists, files=[p.src.name for p in parsed_files])
    total = sum(len(p.rule_nodes) for p in parsed_files)
    if total > MAX_RULES_TOTAL:
        problems.add("", f"{total} rules in all; at most {MAX_RULES_TOTAL} are allowed")
        return ruleset
    extra_fields = {name for parsed in parsed_files for name, _ in parsed.record_fields}
    builder = _RuleBuilder(_environments(lists, extra_fields, limits), lists, problems)
    # Ids are compared as written, before a rule is built: a duplicate is reported even
    # when either rule has other problems (every problem is said at once).
    placed: dict[str, str] = {}
    for parsed in parsed_files:
        for index, node in enumerate(parsed.rule_nodes):
            ctx = _Context(parsed.src, problems, _rule_label(node, index))
            id_node = _raw_id_node(node)
            duplicate = False
            if id_node is not None:
                here = str(parsed.src.pos(id_node))
                earlier = placed.setdefault(id_node.value, here)
                if earlier != here:
                    ctx.error(id_node, f"duplicate id {id_node.value}: already used at {earlier}")
                    duplicate = True
            if parsed.src.name in left_out:
                continue  # a shipped pack not chosen: its rules are checked by its own tests, not built here
            located = builder.build(ctx, node)
            if located is not None and not duplicate:
                ruleset.rules.append(located.rule)
    if left_out:
        ruleset.files = [name for name in ruleset.files if name not in left_out]

    overridden: dict[str, _Override] = {}
    rules_by_id = ruleset.by_id()
    for parsed in parsed_files:
        for node in parsed.override_nodes:
            ctx = _Context(parsed.src, problems, _override_label(node))
            override = _parse_override(ctx, node)
            if override is None:
                continue
            target = rules_by_id.get(override.rule_id)
            if target is None:
                known_ids = sorted(rules_by_id)
                ctx.error(override.id_node, f"no rule has id {override.rule_id}{_suggest(override.rule_id, known_ids)}")
                continue
            earlier_override = overridden.get(override.rule_id)
            if earlier_override is not None:
                ctx.error(
                    override.id_node,
                    f"{override.rule_id} is already overridden at {earlier_override.src.pos(earlier_override.id_node)}",
                )
                continue
            overridden[override.rule_id] = override
            if override.enabled is not None:
                target.enabled = override.enabled
            if override.severity is not None:
                target.severity = override.severity
            if override.strict_only is not None:
                target.strict_only = override.strict_only
    if not strict_only_ok:
        ruleset.rules = [r for r in ruleset.rules if not r.strict_only]
    return ruleset


def _raw_id_node(node: Node) -> ScalarNode | None:
    """The ``id:`` value of a rule node as written, when it is a non-empty scalar."""
    if isinstance(node, MappingNode):
        for key, value in node.value:
            if isinstance(key, ScalarNode) and key.value == "id" and isinstance(value, ScalarNode) and value.value:
                return value
    return None


def _override_label(node: Node) -> str:
    if isinstance(node, MappingNode):
        for key, value in node.value:
            if isinstance(key, ScalarNode) and key.value == "id" and isinstance(value, ScalarNode) and value.value:
                return f"override {value.value}"
    return "override"


def load_rules(
    paths: Sequence[str | Path],
    include_shipped: bool = True,
    strict_only_ok: bool = True,
    packs: Sequence[str] = (),
    *,
    limits: CostLimits | None = None,
) -> RuleSet:
    """Load the shipped packs (unless ``include_shipped`` is false) and ``paths``, then apply overrides.

    ``packs``, when given, names the shipped packs whose rules run (``durable-sessions``
    alone gives the skill's checks); the others are read only for their lists.

    ``paths`` may name directories (their ``*.yaml`` rule files, tests excluded). A path
    that is itself a shipped pack is loaded once. With ``strict_only_ok`` false, rules
    that run only in strict mode are left out of the set (for callers that never run
    strict). ``limits`` bounds what each expression may cost: one estimated past
    ``max_cost`` is a problem at its place; the defaults when None. Raises
    :class:`RuleFormatError` listing every problem in every file.
    """
    problems = _Problems()
    ruleset = _load(paths, include_shipped, strict_only_ok, problems, limits=limits, packs=packs)
    found = problems.final()
    if found:
        count = len(found)
        raise RuleFormatError(found, f"{count} problem{'s' if count != 1 else ''} in rule files:")
    return ruleset


def lint(
    paths: Sequence[str | Path],
    include_shipped: bool = True,
    packs: Sequence[str] = (),
    *,
    limits: CostLimits | None = None,
) -> list[Problem]:
    """Every problem in ``paths`` (checked together with the shipped packs, which overrides may name)."""
    problems = _Problems()
    _load(paths, include_shipped, True, problems, limits=limits, packs=packs)
    return problems.final()


def rule_files_in(paths: Sequence[str | Path]) -> list[Path]:
    """The files ``paths`` name once directories are expanded, for callers that check readability first."""
    return _expand(paths)
