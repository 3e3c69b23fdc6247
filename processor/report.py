"""Replay's report, as text (the reference checker's shape) or as one JSON object.

Violations are reported in input order, which is not the order the engine finds them
in (deadlines fire late, sessions interleave), so they are sorted before they are
written. The report holds a bounded number in memory; past that it writes sorted
runs to temporary files and merges them while it writes the report, so its memory
does not grow with the input.

The text report prints ids, kinds and messages taken from the input: control
characters in them are written escaped (``\\x1b``), so an input cannot drive the
terminal. Why an input could not be read is said once, on standard error, as it
happens (it reaches the user even when the report goes to a file or a pipe); the
text report's last line counts those inputs and the JSON report lists the messages.
"""

from __future__ import annotations

import codecs
import heapq
import io
import marshal
import struct
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any, Final, Protocol, TextIO, TypeVar

import orjson

from processor.records import STDIN_ORIGIN
from processor.summary import EngineSummary
from processor.violations import WAIVED, Violation

# Violations held in memory before a sorted run goes to a temporary file. Low: what a replay
# holds of its report should not be what makes its memory grow with the input.
SPILL_AT: Final = 4_096
# A run is written in chunks of this many violations (a length, then the chunk): reading a run
# back holds one chunk of it.
_RUN_CHUNK: Final = 256
# Runs merged at once. Runs are merged in tiers, this many of one tier into one of the next, so
# the runs open (and the chunks a merge holds) stay few however many violations the input has.
_MERGE_FAN_IN: Final = 16
_CHUNK_LENGTH: Final = struct.Struct("<I")
# A string no summary holds: where the streamed violations go in the JSON document.
_VIOLATIONS_MARK: Final = "\x00violations\x00"
# And where the streamed session summaries go: a JSON report of many sessions is never one string.
_SESSIONS_MARK: Final = "\x00sessions\x00"
_NESTED_INDENT: Final = "    "  # both lists sit two levels deep in the JSON document

SortKey = tuple[int, int, int, str, str]
_Item = TypeVar("_Item")
# C0 controls, DEL and C1 controls, each written as \xNN.
CONTROL_ESCAPES: Final = {code: f"\\x{code:02x}" for code in (*range(0x20), *range(0x7F, 0xA0))}


def printable(text: str) -> str:
    """``text`` with its control characters escaped, for a terminal."""
    if text.isascii() and text.isprintable():
        return text  # ASCII is not printable exactly at C0 and DEL: nothing to escape (the common case)
    return text.translate(CONTROL_ESCAPES)


class Report:
    def __init__(self, inputs: list[str], *, spill_at: int = SPILL_AT) -> None:
        # Named as their items' origin says: standard input ("-") is STDIN_ORIGIN.
        self.inputs = [STDIN_ORIGIN if name == "-" else name for name in inputs]
        # Actions the readers gave, duplicate deliveries included (see ``actions``).
        self.actions_read = 0
        self.malformed = 0
        self.unreadable: list[str] = []
        self.summary: EngineSummary | None = None
        self.violations_by_rule: Counter[str] = Counter()
        # Findings a waiver or baseline accepts: listed, counted apart, never failing the run.
        self.waived_by_rule: Counter[str] = Counter()
        self._position = {name: index for index, name in enumerate(self.inputs)}
        self._held: list[Violation] = []
        # Sorted runs on disk, oldest first, and the tier of each (0: spilled; n + 1: merged from
        # _MERGE_FAN_IN runs of tier n). Tiers never rise from oldest to newest.
        self._runs: list[IO[bytes]] = []
        self._tiers: list[int] = []
        self._spill_at = max(1, spill_at)

    @property
    def violation_count(self) -> int:
        return self.violations_by_rule.total()

    @property
    def actions(self) -> int:
        """Actions evaluated: a record delivered twice counts once (the engine's count, once it has one)."""
        return self.summary.actions_evaluated if self.summary is not None else self.actions_read

    @property
    def duplicates(self) -> int:
        return self.summary.duplicates if self.summary is not None else 0

    @property
    def exit_code(self) -> int:
        """2: an input could not be read; 1: violations or malformed items (even with DS000 off); else 0."""
        if self.unreadable:
            return 2
        return 1 if self.violation_count or self.malformed else 0

    def tally(self, actions: int, malformed: int) -> None:
        """Count a batch the reader has already counted (replay does not walk its items again)."""
        self.actions_read += actions
        self.malformed += malformed

    def add(self, violations: Iterable[Violation]) -> None:
        for violation in violations:
            if WAIVED in violation.details:
                self.waived_by_rule[violation.rule] += 1
            else:
                self.violations_by_rule[violation.rule] += 1
            self._held.append(violation)
        if len(self._held) >= self._spill_at:
            self._spill()

    def ordered(self) -> Iterator[Violation]:
        """Input order: by input, then line (logs) or time (spans), then rule id; ties in arrival order."""
        held = sorted(self._held, key=self._key)
        if not self._runs:
            return iter(held)
        while len(self._runs) > _MERGE_FAN_IN:
            self._merge_last(_MERGE_FAN_IN)
        # heapq.merge takes equal keys from earlier iterables first: runs in the order written, then held.
        return heapq.merge(*(_read_run(run) for run in self._runs), held, key=self._key)

    def close(self) -> None:
        """Remove the temporary files (they also go when the process ends)."""
        for run in self._runs:
            run.close()
        self._runs.clear()
        self._tiers.clear()

    def _key(self, v: Violation) -> SortKey:
        origin_index = self._position.get(v.origin, len(self._position))
        line = v.line if v.line is not None else 0
        return (origin_index, line, v.time_ns or 0, v.session_id, v.rule)

    def _spill(self) -> None:
        held = self._held
        held.sort(key=self._key)
        self._runs.append(_write_run(held))
        self._tiers.append(0)
        held.clear()
        tiers = self._tiers
        # The newest _MERGE_FAN_IN runs of one tier become one run of the next.
        while len(tiers) >= _MERGE_FAN_IN and tiers[-_MERGE_FAN_IN] == tiers[-1]:
            self._merge_last(_MERGE_FAN_IN)

    def _merge_last(self, count: int) -> None:
        """Merge the newest ``count`` runs into one, in their place. They are consecutive, and
        heapq.merge takes equal keys from earlier runs first: ties keep their arrival order."""
        runs = self._runs[-count:]
        merged = _write_run(heapq.merge(*map(_read_run, runs), key=self._key))
        for run in runs:
            run.close()
        tier = max(self._tiers[-count:]) + 1
        del self._runs[-count:]
        del self._tiers[-count:]
        self._runs.append(merged)
        self._tiers.append(tier)


def _write_run(violations: Iterable[Violation]) -> IO[bytes]:
    """A temporary file holding ``violations`` (in their order) as chunks of marshalled fields."""
    # Open until close(): the run is read back when the report is written.
    run = tempfile.TemporaryFile()  # noqa: SIM115
    # Each violation's fields as a tuple, a chunk of them marshalled in one call: a third of
    # what writing JSON objects and parsing them back cost. marshal reads only what this
    # process wrote, in a file no other process can open (see _read_run).
    chunk: list[tuple[Any, ...]] = []
    for violation in violations:
        chunk.append(_fields(violation))
        if len(chunk) == _RUN_CHUNK:
            _write_chunk(run, chunk)
            chunk = []
    if chunk:
        _write_chunk(run, chunk)
    return run


def _write_chunk(run: IO[bytes], chunk: list[tuple[Any, ...]]) -> None:
    data = marshal.dumps(chunk)
    run.write(_CHUNK_LENGTH.pack(len(data)))
    run.write(data)


def _fields(v: Violation) -> tuple[Any, ...]:
    """A violation's fields in the order Violation takes them (the inverse of ``Violation(*fields)``)."""
    return (
        v.rule, v.name, v.severity, v.session_id, v.action_id, v.message, v.violation_id, v.time_ns, v.line,
        v.origin, v.trace_id, v.span_id, v.service, v.kind, v.tags, v.details,
    )  # fmt: skip


def _read_run(run: IO[bytes]) -> Iterator[Violation]:
    run.seek(0)  # each ordered() reads the run from its start
    length_size = _CHUNK_LENGTH.size
    while header := run.read(length_size):
        (length,) = _CHUNK_LENGTH.unpack(header)
        # Only this process's own tuples: the run is a temporary file it wrote, unlinked at creation.
        for fields in marshal.loads(run.read(length)):  # noqa: S302
            yield Violation(*fields)


def violation_where(v: Violation, several_inputs: bool) -> str:
    """Where the text report says a violation is (its input's name first when there are several)."""
    prefix = f"{v.origin}: " if several_inputs and v.origin else ""
    if not v.span_id:
        # An action-log record: its line, as the reference checker prints it.
        if v.line is not None:
            return f"{prefix}line {v.line} [{v.action_id or '-'}]"
        return f"{prefix}session {v.session_id or '-'} action {v.action_id or '-'}"
    return prefix + span_where(v.line, v.session_id, v.action_id, v.trace_id, v.span_id)


def span_where(line: int | None, session_id: str, action_id: str, trace_id: str, span_id: str) -> str:
    """Where a violation on a span (or on a record that names one) is: the ids that find it in
    a trace viewer, after the line of the file it was read from."""
    at = f"line {line}: " if line is not None else ""
    return f"{at}session {session_id or '-'} action {action_id or '-'} trace {trace_id or '-'} span {span_id}"


def write_text(report: Report, out: TextIO) -> None:
    several = len(report.inputs) > 1
    for v in report.ordered():
        out.write(printable(f"{violation_where(v, several)}: {v.rule} {v.name}: {v.message}{waived_note(v)}") + "\n")
    write_text_tail(report, out)


def waived_note(v: Violation) -> str:
    """`` (waived: reason, by file:line)`` for a finding a waiver or baseline accepts, else empty."""
    mark = v.details.get(WAIVED)
    if not isinstance(mark, dict):
        return ""
    return f" (waived: {mark.get('reason', '')}; {mark.get('by', '')})"


def write_text_tail(report: Report, out: TextIO) -> None:
    """What follows the violations: a line per session, the totals, the verdict."""
    if report.summary is not None:
        for line in report.summary.text_lines():
            out.write(printable(line) + "\n")
    out.write(verdict_line(report) + "\n")


def verdict_line(report: Report) -> str:
    """The last line: OK, FAIL (violations or malformed items) or ERROR (an input could not be read)."""
    total = report.violation_count
    if total:
        rules = ", ".join(f"{rule}×{n}" for rule, n in sorted(report.violations_by_rule.items()))
        text = f"{total} violation(s) in {report.actions} action(s) [{rules}]"
    else:
        text = f"{report.actions} action(s), no violations"
    waived = report.waived_by_rule.total()
    if waived:
        text += f"; {waived} waived"
    if report.malformed:
        text += f"; {report.malformed} malformed item(s) not checked"
    if report.unreadable:
        count = len(report.unreadable)
        return f"ERROR: {count} input(s) could not be read (see standard error); {text}"
    return f"{'FAIL' if total or report.malformed else 'OK'}: {text}"


def render_text(report: Report) -> str:
    buffer = io.StringIO()
    write_text(report, buffer)
    return buffer.getvalue()


def write_json(report: Report, out: TextIO, write_violations: Callable[[TextIO], None] | None = None) -> None:
    """One JSON object (two-space indent); the violations and the sessions are written one block at a time into it.

    ``write_violations(out)``: writes the report's violations list already serialized
    (``json_block`` blocks joined by ``",\n"``, in report order) instead of the report's own.
    """
    before, after = json_report_parts(report)
    for piece in before:
        out.write(piece)
    if after is None:
        return
    if write_violations is not None:
        write_violations(out)
    else:
        for piece in _json_pieces(report.ordered()):
            out.write(piece)
    for piece in after:
        out.write(piece)


def json_report_parts(report: Report) -> tuple[Iterator[str], Iterator[str] | None]:
    """The JSON report's text before its violations list and after it (the final newline
    included), as pieces; with no violations, the whole report and None. The session
    summaries in it come a block at a time."""
    doc: dict[str, Any] = {
        "inputs": report.inputs,
        "actions": report.actions,
        "duplicates": report.duplicates,
        "malformed": report.malformed,
        "violations": [_VIOLATIONS_MARK] if report.violation_count or report.waived_by_rule else [],
        "unreadable": report.unreadable,
    }
    if report.waived_by_rule:
        doc["waived"] = report.waived_by_rule.total()  # findings listed with details.waived, failing nothing
    summary = report.summary
    if summary is not None:
        doc.update(summary.to_json(sessions=False))
        doc["sessions"] = [_SESSIONS_MARK] if summary.sessions else []
    text = orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode()
    before, found, after = text.partition(_marked(_VIOLATIONS_MARK))
    if not found:
        return _with_sessions(text + "\n", summary), None
    return iter((before,)), _with_sessions(after + "\n", summary)


def _marked(mark: str) -> str:
    return f'{_NESTED_INDENT}"{orjson.dumps(mark).decode()[1:-1]}"'


def _with_sessions(text: str, summary: EngineSummary | None) -> Iterator[str]:
    """``text`` with the session summaries written where their mark is, a block at a time."""
    before, found, after = text.partition(_marked(_SESSIONS_MARK))
    yield before
    if not found or summary is None:
        return
    yield from _json_pieces(iter(summary.sessions))
    yield after


class _ToJson(Protocol):
    def to_json(self) -> dict[str, Any]: ...


def _json_pieces(items: Iterator[_ToJson]) -> Iterator[str]:
    """A list's text (violations, session summaries), a block of items at a time, a ``",\n"`` between two.

    A generator function, not a generator expression: the compiled build makes a list of a
    generator expression, which here would hold the whole report's text at once.
    """
    first = True
    for block in _blocks(items, JSON_BLOCK):
        if not first:
            yield ",\n"
        first = False
        yield json_block([item.to_json() for item in block])


def json_block(objects: list[dict[str, Any]]) -> str:
    """Violations' JSON objects as they sit in the report's list: one orjson call for the block.

    The report's violations list is two levels deep (four spaces), as the list of a
    one-element list is: dumped that way, the outer brackets sliced off, the objects are
    indented where they belong with no pass over the text to re-indent it.
    """
    return str(json_block_bytes(objects), "utf-8")  # decoded from the view: no copy of the bytes first


def json_block_bytes(objects: list[dict[str, Any]]) -> memoryview:
    """``json_block`` as UTF-8, without a copy: what a binary spool writes."""
    if not objects:
        return memoryview(b"")
    return memoryview(orjson.dumps([objects], option=orjson.OPT_INDENT_2))[_NESTED_OPEN:-_NESTED_CLOSE]


# What copy_utf8 reads from the spool at a time.
_COPY_CHUNK: Final = 1 << 20


def copy_utf8(source: IO[bytes], out: TextIO) -> None:
    """UTF-8 text written to ``source`` (read from its start) onto ``out``: as bytes onto the
    stream's buffer when it writes UTF-8, with no decoding and encoding again; else decoded."""
    buffer = getattr(out, "buffer", None)
    encoding = getattr(out, "encoding", None)
    source.seek(0)
    if buffer is not None and encoding and codecs.lookup(encoding).name == "utf-8":
        out.flush()  # what the text layer holds goes first
        while chunk := source.read(_COPY_CHUNK):
            buffer.write(chunk)
        return
    decoder = codecs.getincrementaldecoder("utf-8")()
    while chunk := source.read(_COPY_CHUNK):
        out.write(decoder.decode(chunk))
    out.write(decoder.decode(b"", final=True))


# Violations serialized together in the JSON report. A block's objects are built, dumped and
# freed together: 256 of them (about 250 KB) stay in the CPU's cache through all three; at
# 1,024 replay of a flaw-heavy log took a quarter more CPU (measured: 2.35 against 1.85 s).
JSON_BLOCK: Final = 256
# What orjson writes around a list nested in a one-element list: "[\n  [\n" and "\n  ]\n]".
_NESTED_OPEN: Final = 6
_NESTED_CLOSE: Final = 6


def _blocks(items: Iterator[_Item], size: int) -> Iterator[list[_Item]]:
    block: list[_Item] = []
    for item in items:
        block.append(item)
        if len(block) >= size:
            yield block
            block = []
    if block:
        yield block


def render_json(report: Report) -> str:
    buffer = io.StringIO()
    write_json(report, buffer)
    return buffer.getvalue()
