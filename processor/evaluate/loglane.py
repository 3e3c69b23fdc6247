"""The action-log lane: replay of action logs without the engine's machinery for spans.

Log lines are in the order the agent wrote them: no reordering by event time, no buffer, no
identity stage. The lane reads them itself:

- condition rules and ``log_scope: file`` sequences (a repeated action id in the file)
  become one generated Python function (``check``) and one per message, from the rules'
  checked expressions (``processor.evaluate.cel.python_source``, exact or refused; a refused
  expression runs its closure from inside ``check``);
- session rules (sequence, change, count, absence per session) run on the engine's own
  handlers and state, handed each valid line in input order (``Engine.log_session_rules``),
  with the engine's clock: one implementation of their semantics for both paths;
- a record is the dict orjson gives, validated as ``processor.convert.actionlog`` does; or,
  when the rule set has no session rules and reads only typed fields' values
  (``_typed_fields``), a typed line: the line decoded and type-checked in one step, in C,
  into a struct (``actionlog.typed_decoder``; the strict decoder takes no field the rules do
  not name, the open one skips such fields and orjson confirms the line), read by a twin of
  ``check`` generated over attributes. Session rules read dicts; the typed decode beside
  orjson's costs the compiled build what its dict check saves (measured, twelfth stop);
- a rule function (``timeDerived``, DS103) is called from the generated code itself, with
  arguments whose types it answers for without raising (``_FUNCTIONS``);
- a condition's top-level terms that several rules share are tested once, the rules
  nested under them (``_factored``);
- the report's violations (text lines, or the JSON report's list) are written as they are
  found, in the report's order, to a spool copied out after the run, or straight into the
  report's file when it is a regular file that can be cut back should the lane give up
  (``write_into``). Violations a session rule reports on an earlier line (a wait that fires)
  are sorted apart and merged in when the report is written (``_merged``), by the place
  recorded for each spooled one; rule sets that can report so keep the spool.

It gives the engine's verdicts, counts and summary exactly (``tests/test_loglane.py`` and
``tests/test_loglane_sessions.py`` compare both on random logs, every format). What it
cannot reproduce it does not attempt: it is chosen only for text and JSON reports of regular
files in the action-log format, and it gives up (``LaneAborted``) when a session would have
been evicted (more open sessions than ``max_sessions``) or could have expired (event times
spanning the idle timeout); replay then runs the engine from the start.

The generated source is parsed and checked against a short list of node types and names
before it is compiled (``_check_source``): it can only read the record and call the
helpers bound here, whatever a rule file says.
"""

from __future__ import annotations

import ast
import contextlib
import logging
import math
import os
import sys
import tempfile
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, Final, NamedTuple, TextIO

import orjson
from xxhash import xxh3_128_digest

from processor.convert.actionlog import (
    TYPED_LINE_MAX_BYTES,
    parsed_line,
    typed_decoder,
    unparsed_line,
    well_formed,
)
from processor.convert.timefmt import parse_rfc3339
from processor.errors import EvaluationError, InputError
from processor.evaluate.cel import (
    WHOLE_VALUE,
    CompiledExpression,
    FieldTyping,
    PythonSource,
    SourceContext,
    Unsupported,
    python_source,
)
from processor.evaluate.cel._ast import Has, Ident, Index, Literal, Node, Select
from processor.evaluate.cel._codegen import Conjunct, conjuncts, facts_when_true, is_plain_read
from processor.evaluate.engine import malformed_violation
from processor.evaluate.functions import time_derived
from processor.evaluate.model import MessageTemplate
from processor.fileio import pwrite_all
from processor.records import FIELD_TYPES, REQUIRED_FIELDS, Action, Malformed
from processor.report import (
    CONTROL_ESCAPES,
    JSON_BLOCK,
    Report,
    copy_utf8,
    json_block_bytes,
    json_report_parts,
    printable,
    span_where,
    violation_where,
)
from processor.state.file_ids import MEMORY_ENTRIES, FileIds
from processor.state.session import MISSING
from processor.summary import EngineSummary, SessionSummary
from processor.violations import Violation, make_violation_id

if TYPE_CHECKING:
    from processor.evaluate.engine import Engine, _Plan

log = logging.getLogger("durable_check.replay")

# What a kept tuple holds for a field the record lacks: the engine's marker, so that FileIds numbers such tuples.
_MISSING_KEPT: Final = MISSING
# A file's ids are a dict (fastest) up to this many, then FileIds (5 bytes an id in memory): a long log's ids
# would otherwise be most of what replay holds.
_IDS_IN_DICT: Final = 1 << 16
# Action ids longer than this are remembered as a 16-byte digest (the engine's), shorter ones as themselves.
_SHORT_ID: Final = 16
# What the typed decoder raises for a line it does not take (the general path then reads it).
_TYPED_REFUSED: Final = (ValueError, RecursionError)
# Lines are read in stretches. A stretch whose valid lines the strict typed decoder refused
# this often (they carry fields no rule reads) is followed by _TYPED_RETRY stretches read by
# the open one (those fields skipped, the line confirmed by orjson) before the strict one is
# tried again: a log of such lines pays for few refusals and no Python type check.
_STRETCH: Final = 1024
_TYPED_MISS_SHARE: Final = 0.25
_TYPED_RETRY: Final = 8
# What a JSON report's violations list is moved by at a time, when its head came out another
# length than the one it was placed after (see LogLane.write_into).
_MOVE_CHUNK: Final = 1 << 20
# A spooled violation's place is (input << _LINE_BITS) | line: lines below 2**40.
_LINE_BITS: Final = 40
# The last line of an object in a JSON spool (json_block form): its closing brace at the list's indentation.
_OBJECT_ENDS: Final = frozenset({b"    }", b"    },\n"})


class LaneAborted(Exception):
    """The input needs what the lane does not model (an eviction, an expiry): run the engine."""


@dataclass(frozen=True)
class _Generated:
    """The rule set as code: ``check(r, line, t, hits)`` appends the positions of the rules that fire."""

    check: Callable[..., None]
    # Per position (conditions, then file rules): the message, the message as the text report
    # prints it (escaped), "<id> <name>: " (escaped), the plan.
    messages: tuple[Callable[..., str], ...]
    printed: tuple[Callable[..., str], ...]
    heads: tuple[str, ...]
    plans: tuple[_Plan, ...]
    # Position -> its place in rule-id order (a record's violations are written in that order).
    rank: tuple[int, ...]
    fallback: int  # conditions (and file rules) that run their closures


class LogLane:
    """Built from an engine (its rules, lists and options); ``usable`` says whether it applies."""

    def __init__(self, engine: Engine, fmt: str = "text") -> None:
        self.engine = engine
        self._text = fmt == "text"
        # Violation lines of a text report (or a JSON report's violations list), in the report's
        # order and encoded as UTF-8, until written out: copied as bytes, not decoded and encoded again.
        self._spool: IO[bytes] | None = None
        # True: the report's violations go straight into the report's own file (write_into).
        self._direct = False
        # A JSON report written into its file: where the report begins, how to read the file
        # again, where its violations list begins once placed (None: its first blocks are held
        # in _held until then), the inputs' bytes and those read while the blocks were held.
        self._start = 0
        self._reread: Callable[[], IO[bytes]] | None = None
        self._json_at: int | None = None
        self._held: list[memoryview] = []
        self._seen_bytes = 0
        self._input_bytes = 0
        # Lines per stretch (the unit of the switch between typed decoders), and the lines read in
        # stretches of each typed decoder (a diagnostic: how often lines carried fields no rule names).
        self.stretch = _STRETCH
        # How many ids a file rule's groups hold in a dict before they move to FileIds.
        self.ids_in_dict = _IDS_IN_DICT
        # How many of FileIds' entries wait in memory before they are written to its temporary file.
        self.ids_in_memory = MEMORY_ENTRIES
        self.ids_on_disk = 0  # bytes of file ids written to temporary files (a diagnostic)
        self.ids_moved = 0  # a diagnostic: how many times a file's ids moved
        self.stretch_lines: dict[str, int] = {"strict": 0, "open": 0}
        self.reason = _unsupported_reason(engine)
        self.usable = self.reason is None
        if not self.usable:
            return
        self._conditions: list[_Plan] = list(engine._condition_plans)
        self._file_plans: list[_Plan] = list(engine._file_plans)
        self._malformed: list[_Plan] = list(engine._malformed_plans)
        self._act = engine._act
        self._meta = engine._meta
        # Per file rule, the groups of the file being read (cleared for the next): action id -> kept fields.
        self._file_groups: list[Any] = [{} for _ in self._file_plans]  # dicts, or _DigestedIds
        # A fired file rule's ``first`` map, for its message.
        self._views: dict[int, dict[str, Any]] = {}
        self._generated = _generate(self._conditions, self._file_plans, self)
        # Session rules (sequence, change, count, absence per session) run on the engine's own
        # handlers and state, a line at a time in input order (Engine.log_session_rules): one
        # implementation of them, whichever path reads the log. They read the record as a map.
        self._session_rules = _session_rules_on_logs(engine)
        # Violations a session rule reports on an earlier line than the one being read (a wait
        # that fires, a sequence reported on its opener): sorted apart (spilled past a bound, as
        # the engine's report does) and merged into the spooled ones when the report is written,
        # by the keys recorded for those (see _merged).
        self._late_possible = self._session_rules and any(
            (plan.kind == "absence" or plan.report_first) and not _never_opens_on_logs(plan)
            for plan in engine._stateful_plans
            if not plan.file_scope
        )
        self._late: Report | None = None
        # Per spooled violation, when late ones are possible: (input, line), its time, its rule's rank.
        self._keys_at = array("q")
        self._keys_time = array("q")
        self._keys_rank = array("I")
        rule_ids = sorted({plan.id for plan in (*engine._condition_plans, *engine._stateful_plans,
                                                *engine._malformed_plans)})
        self._rule_rank = {rule: rank for rank, rule in enumerate(rule_ids)}
        # The twin for typed lines, when the rule set allows it (see _typed_fields).
        self._typed: _Generated | None = None
        self._decode: Callable[[bytes], Any] | None = None
        self._open_decode: Callable[[bytes], Any] | None = None
        extras = None if self._session_rules else _typed_fields((*self._conditions, *self._file_plans))
        if extras is not None and not self._generated.fallback:
            decoders = typed_decoder(extras)
            try:
                self._typed = _generate(
                    self._conditions, self._file_plans, self, typed=(frozenset(FIELD_TYPES) | extras, decoders.unset)
                )
            except Unsupported:
                pass  # a message hole keeps its closure: dict records only
            else:
                self._decode = decoders.strict
                self._open_decode = _confirmed(decoders.lenient)
        self._malformed_offset = len(self._generated.plans)
        helpers = {"_text": _text, "_p": _printable}
        # Per malformed rule: its message and the message as the text report prints it, or
        # None when a hole needs the template's renderer; its "<id> <name>: " (escaped).
        self._malformed_messages = [_malformed_message(plan.rule.message, helpers) for plan in self._malformed]
        self._malformed_heads = [printable(f"{plan.id} {plan.name}: ") for plan in self._malformed]
        # Per file rule: its groups and what a malformed line's id opens them with.
        self._file_missing: list[tuple[Any, tuple[Any, ...]]] = []
        self._bind_groups(None, None)
        self._width = self._malformed_offset + len(self._malformed)
        # The report's violations, in its order, until written: text lines, or the JSON report's
        # violations list as it will be written (blocks and the ",\n" between), copied out as it is.
        self._objects: list[dict[str, Any]] = []
        self._json_blocks = 0

    # -- running --------------------------------------------------------------------

    def write_into(self, report_file: IO[bytes], reread: Callable[[], IO[bytes]] | None = None) -> None:
        """Write the report's violations into ``report_file`` (UTF-8) as they are found.

        The violations need no spool when the report goes to a file that can be cut back: the
        caller undoes what was written if ``run`` raises LaneAborted (``processor.cmd_replay``'s
        ``_ReportFile``). Saves writing every violation to a spool and reading it back.

        A text report's violation lines come first: ``write_text`` then adds only the tail. A
        JSON report's violations list comes after a head whose counts are known only at the
        end; it is placed where the head is expected to end (the counts estimated from what was
        read when the first block of violations is written), and ``write_json`` writes the head
        before it. When the head comes out another length, the list is moved to where it ends:
        ``reread`` (required for JSON) opens the file for reading for that move.
        """
        if not self._text and reread is None:
            raise ValueError("a JSON report is written into a file that can be read again")
        if self._late_possible:
            return  # late violations are merged in when the report is written: a spool it is
        self._spool = report_file
        self._direct = True
        self._start = report_file.tell()
        self._reread = reread

    def run(self, inputs: list[str], input_format: str | None, report: Report, said: set[str]) -> None:
        """Read every input into ``report`` (counts, summary; JSON: its violations); raises LaneAborted.

        A text report's violation lines wait in a spool for ``write_text`` (unless ``write_into``
        named the report's file).
        """
        from processor.receive.files import action_line_blocks, close_input, open_input

        if self._spool is None:
            self._spool = tempfile.TemporaryFile("w+b")  # noqa: SIM115 (closed by close())
        options = self.engine.options
        # Session -> its actions by kind; (session or None, rule) -> violations, counted at each block's end.
        self._sessions: dict[str, dict[str, int]] = {}
        # Session (None: a malformed line without one) -> violations per rule, by position
        # (conditions, file rules, malformed rules: see _Generated.plans and self._malformed).
        self._counts: dict[str | None, list[int]] = {}
        self._max_sessions = options.max_sessions
        self._idle_ns = round(options.session_idle_timeout_s * 1e9)
        self._min_t: int | None = None
        self._max_t: int | None = None
        self._actions = 0
        self._malformed_count = 0
        self._several = len(report.inputs) > 1
        self._report = report
        self._lines: list[str] = []
        self._found: list[Violation] = []
        if self._late_possible:
            self._late = Report(report.inputs)
        if self._placing():
            self._input_bytes = _sizes(inputs)
        for path in inputs:
            try:
                handle, chunks, _, origin = open_input(path, input_format)
                try:
                    self._read(action_line_blocks(chunks, origin), origin)
                finally:
                    close_input(handle, path)
            except InputError as exc:
                report.unreadable.append(str(exc))
                message = printable(str(exc))
                if message not in said:
                    said.add(message)
                    sys.stderr.write(f"durable-check: {message}\n")
        if self._session_rules:
            # The end of the input: deadlines up to the last event time fire (Engine.finish).
            self._set_aside(self.engine.finish())
        self._flush()
        if self._held:
            self._place(self._actions, self._malformed_count, final=True)
        report.tally(self._actions, self._malformed_count)
        report.summary = self._summary()
        report.violations_by_rule.update(report.summary.violations_by_rule)

    def write_text(self, out: TextIO) -> None:
        """The text report: the spooled violation lines, then sessions, totals and verdict."""
        from processor.report import write_text_tail

        spool = self._spool
        assert spool is not None
        if self._direct:
            spool.flush()  # the lines are in the file: the tail follows them through the text layer
        elif self._late is not None and self._late.violation_count:
            for piece in self._merged(spool, text=True):
                out.write(piece)
        else:
            copy_utf8(spool, out)
        write_text_tail(self._report, out)

    def write_json(self, out: TextIO) -> None:
        """The JSON report, its violations list copied from the spool as it was written, or
        already in the report's file (write_into): the head and the tail written around it."""
        from processor.report import write_json

        spool = self._spool
        assert spool is not None
        if self._late is not None and self._late.violation_count:
            write_json(self._report, out, lambda into: into.writelines(self._merged(spool, text=False)))
            return
        if not self._direct:
            write_json(self._report, out, lambda into: copy_utf8(spool, into))
            return
        before, after = json_report_parts(self._report)
        if after is None or self._json_at is None:
            # No violations were written: the report is its head alone.
            assert self._json_at is None and not self._held
            for piece in before:
                out.write(piece)
            return
        head = "".join(before).encode()
        spool.flush()
        length = spool.tell() - self._json_at
        at = self._start + len(head)
        if at != self._json_at:
            self._move(self._json_at, at, length)
        spool.seek(self._start)
        spool.write(head)
        spool.seek(at + length)
        for piece in after:
            spool.write(piece.encode())
        spool.truncate()  # a list moved back leaves its old end behind it

    def close(self) -> None:
        if self._spool is not None and not self._direct:
            self._spool.close()
        self._spool = None
        if self._late is not None:
            self._late.close()
        for groups in self._file_groups:
            self._close_ids(groups)

    def _close_ids(self, groups: Any) -> None:
        """A file's ids are done with: their temporary file goes (its bytes counted in ``ids_on_disk``)."""
        if type(groups) is _DigestedIds and not groups.closed:
            self.ids_on_disk += groups.ids.file_bytes
            groups.ids.close()
            groups.closed = True

    def _merged(self, spool: IO[bytes], *, text: bool) -> Iterator[str]:
        """The spooled violations (text lines, or the JSON list's objects) with the late ones
        merged in, in the report's order: by input, line, time, then rule id; a spooled one
        first on a tie, as it was found first."""
        late = self._late
        assert late is not None
        position = self._report._position
        rank = self._rule_rank
        several = self._several

        def late_key(v: Violation) -> tuple[int, int, int]:
            place = (position.get(v.origin, len(position)) << _LINE_BITS) | (v.line or 0)
            return (place, v.time_ns or 0, rank[v.rule])

        def late_piece(v: Violation) -> str:
            if text:
                return _found_line(v, several) + "\n"
            return bytes(json_block_bytes([v.to_json()])).decode()

        pending = late.ordered()
        waiting = next(pending, None)
        waiting_key = late_key(waiting) if waiting is not None else None
        keys = zip(self._keys_at, self._keys_time, self._keys_rank, strict=True)
        pieces = 0
        for piece in _spooled(spool, text=text):
            key = next(keys)
            while waiting is not None and waiting_key < key:  # type: ignore[operator]
                if pieces and not text:
                    yield ",\n"
                yield late_piece(waiting)
                pieces += 1
                waiting = next(pending, None)
                waiting_key = late_key(waiting) if waiting is not None else None
            if pieces and not text:
                yield ",\n"
            yield piece
            pieces += 1
        if next(keys, None) is not None:
            raise AssertionError("the spool holds fewer violations than were recorded")
        while waiting is not None:
            if pieces and not text:
                yield ",\n"
            yield late_piece(waiting)
            pieces += 1
            waiting = next(pending, None)

    def _read(self, blocks: Iterable[tuple[int, Any, bool]], origin: str) -> None:
        from processor.receive._streams import TooLong
        from processor.receive.files import DEFAULT_MAX_LINE_BYTES, too_long_line

        loads = orjson.loads
        decode_error = orjson.JSONDecodeError
        sessions = self._sessions
        plain = self._generated
        plain_check = plain.check
        typed = self._typed
        typed_check = typed.check if typed is not None else plain_check
        strict = self._decode
        open_decode = self._open_decode
        typed_max = TYPED_LINE_MAX_BYTES if strict is not None else -1
        views = self._views
        conditions = len(self._conditions)
        single_text = self._text and not self._several
        single_json = not self._text
        objects = self._objects
        violation_json = self._violation_json
        for position in range(len(self._file_groups)):
            self._bind_groups(position, {})  # a file's ids are its own (log_scope: file)
        fallback = plain.fallback
        act = self._act
        meta = self._meta
        hits: list[int] = []
        last_when: Any = None
        last_t: int | None = None
        lines = self._lines
        actions = 0
        typed_rest = 0  # stretches left to read with the open decoder
        stretch_length = self.stretch
        session_rules = self._session_rules
        session_stage = self._session_stage
        keyed = self._late_possible
        at_base = self._report._position.get(origin, len(self._report._position)) << _LINE_BITS
        keys_at, keys_time, keys_rank = self._keys_at, self._keys_time, self._keys_rank
        ranks = [self._rule_rank[plan.id] for plan in plain.plans]
        if session_rules:
            from processor.receive.files import LINES_PER_BATCH

            # The engine ends a batch every LINES_PER_BATCH lines of a block (replay's batches):
            # its bound on remembered entries is applied at the same points, between stretches
            # of a length that divides it.
            stretch_length = math.gcd(stretch_length, LINES_PER_BATCH)
            batch_stretches = LINES_PER_BATCH // stretch_length
        for first_line, block, has_too_long in blocks:
            number = first_line - 1
            placing = self._placing()
            if placing:
                self._seen(block, has_too_long)
            counts = self._counts
            width = self._width
            for start in range(0, len(block), stretch_length):
                if session_rules and start and (start // stretch_length) % batch_stretches == 0:
                    self.engine.end_log_batch()
                stretch = block[start : start + stretch_length] if len(block) > stretch_length else block
                decode = strict if typed_rest == 0 else open_decode
                typed_rest = max(0, typed_rest - 1)
                refused = 0  # valid lines the strict decoder did not take
                for raw in stretch:
                    number += 1
                    if has_too_long and isinstance(raw, TooLong):
                        self._malformed_line(
                            Malformed(too_long_line(raw, DEFAULT_MAX_LINE_BYTES), origin=origin, line=number), origin
                        )
                        continue
                    is_typed = tried = False
                    if len(raw) <= typed_max:
                        try:
                            record = decode(raw)  # type: ignore[misc]
                            is_typed = True
                        except _TYPED_REFUSED:
                            tried = True
                    if is_typed:
                        when = record.time
                        session_id = record.session_id
                        kind = record.kind
                        check = typed_check
                    else:
                        # Stripped as parse_line does: a line with spaces around it is parsed once.
                        stripped = raw.strip()
                        try:
                            record = loads(stripped)
                        except decode_error as error:
                            record = error
                        if not (type(record) is dict and well_formed(record)):
                            # What a line is, parsed no second time.
                            item: Action | Malformed | None
                            if isinstance(record, decode_error):
                                item = unparsed_line(raw, stripped, record, origin, number)
                            else:
                                item = parsed_line(record, origin, number)
                            if item is None:
                                continue
                            if isinstance(item, Malformed):
                                self._malformed_line(item, origin)
                                continue
                            record = item.record
                        refused += tried
                        when = record.get("time")
                        session_id = record["session_id"]
                        kind = record["kind"]
                        check = plain_check
                    # -- a valid record --------------------------------------------------
                    if type(when) is str:
                        if when != last_when:
                            last_when, last_t = when, parse_rfc3339(when)
                            if last_t is not None:
                                self._observe(last_t)
                        t = last_t
                    else:
                        t = None
                    kinds = sessions.get(session_id)
                    if kinds is None:
                        kinds = self._new_session(session_id)
                    kinds[kind] = kinds.get(kind, 0) + 1
                    actions += 1
                    if fallback:
                        act["record"] = record
                        meta["line"] = number
                        meta["time_ns"] = t or 0
                    check(record, number, t, hits)
                    if session_rules:
                        found = session_stage(record, origin, number, t)
                        if found:
                            # A session rule fired on this line: its violations join the line's, by rule id.
                            self._emit(hits, record, False, session_id, record["action_id"], kind, number, t, origin,
                                       found)
                            hits.clear()
                            continue
                    if hits:
                        generated = typed if is_typed else plain
                        assert generated is not None
                        action_id = record.action_id if is_typed else record["action_id"]
                        if len(hits) > 1 or not (single_text or single_json):
                            self._emit(hits, record, is_typed, session_id, action_id, kind, number, t, origin)
                            hits.clear()
                            continue
                        # The common case, inline: one violation on a line.
                        position = hits.pop()
                        if keyed:  # _key, inline: this runs once per violation
                            keys_at.append(at_base | number)
                            keys_time.append(t or 0)
                            keys_rank.append(ranks[position])
                        tally = counts.get(session_id)
                        if tally is None:
                            tally = counts[session_id] = [0] * width
                        tally[position] += 1
                        first = views.pop(position, None) if position >= conditions else None
                        if single_json:
                            message = generated.messages[position](record, first, number, t)
                            get = getattr if is_typed else dict.get
                            plan = generated.plans[position]
                            objects.append(violation_json(plan, record, get, session_id, action_id, kind, number, t,
                                                          origin, message))
                            if len(objects) >= JSON_BLOCK:
                                self._flush()
                            continue
                        message = generated.printed[position](record, first, number, t)
                        where = _where(record, is_typed, session_id, action_id, number)
                        lines.append(f"{where}: {generated.heads[position]}{message}")
                if decode is not None:
                    self.stretch_lines["strict" if decode is strict else "open"] += len(stretch)
                if decode is strict and refused > len(stretch) * _TYPED_MISS_SHARE:
                    # Most lines carry fields the rules do not name: the open decoder reads the next ones.
                    typed_rest = _TYPED_RETRY
                if lines:
                    # A stretch's lines at a time: written while they are still in the CPU's cache.
                    self._flush()
                for position, groups in enumerate(self._file_groups):
                    if type(groups) is dict and len(groups) > self.ids_in_dict:
                        self._bind_groups(position, _digested(groups, self.ids_in_memory))
                        self.ids_moved += 1
            if placing and self._held:
                self._place(self._actions + actions, self._malformed_count)
            if session_rules:
                self.engine.end_log_batch()
        self._actions += actions
        if fallback:
            act["record"] = _EMPTY_RECORD
            act["first"] = _EMPTY_RECORD

    def _observe(self, t: int) -> None:
        low, high = self._min_t, self._max_t
        if low is None or t < low:
            self._min_t = low = t
        if high is None or t > high:
            self._max_t = high = t
        if high - low >= self._idle_ns:
            raise LaneAborted("event times span the idle timeout: sessions may expire")

    def _new_session(self, session_id: str) -> dict[str, int]:
        """The session's actions by kind, counted from now."""
        if len(self._sessions) >= self._max_sessions:
            raise LaneAborted("more sessions than max_sessions: some would be evicted")
        kinds: dict[str, int] = {}
        self._sessions[session_id] = kinds
        return kinds

    # -- rules --------------------------------------------------------------------------

    def file_rule(
        self, position: int, record: dict[str, Any], line: int, t: int | None, *, hits: list[int], key: Any
    ) -> None:
        """A ``log_scope: file`` sequence whose expressions run their closures, as Engine._file_sequence does."""
        plan = self._file_plans[position]
        number = len(self._conditions) + position
        condition = plan.condition
        if condition is not None and not self._holds(plan, condition, record, None, line=line, t=t, where="condition"):
            return
        groups = self._file_groups[position]
        found = groups.get(key)
        if found is not None:
            if plan.then is not None:
                view = {n: v for n, v in zip(plan.first_names, found, strict=True) if v is not _MISSING_KEPT}
                if self._holds(plan, plan.then, record, view, line=line, t=t, where="then"):
                    hits.append(number)
                    self._views[number] = view
            return
        if plan.first is not None and self._holds(plan, plan.first, record, None, line=line, t=t, where="first"):
            reads = plan.file_reads
            groups[key] = tuple(
                record.get(name, _MISSING_KEPT) if reads is None or name in reads else _MISSING_KEPT
                for name in plan.first_names
            )

    def _holds(
        self,
        plan: _Plan,
        expression: CompiledExpression,
        record: dict[str, Any],
        first: dict[str, Any] | None,
        *,
        line: int,
        t: int | None,
        where: str,
    ) -> bool:
        act = self._act
        act["record"] = record
        act["first"] = first if first is not None else _EMPTY_RECORD
        self._meta["line"] = line
        self._meta["time_ns"] = t or 0
        try:
            return expression.evaluate(act) is True
        except EvaluationError:
            self.rule_error(plan, where)
            return False
        finally:
            act["first"] = _EMPTY_RECORD

    def _bind_groups(self, position: int | None, groups: Any) -> None:
        """Make ``groups`` the file rule's at ``position`` (None: only refresh what names them),
        in the generated code too."""
        if position is not None:
            self._close_ids(self._file_groups[position])
            self._file_groups[position] = groups
            for generated in (self._generated, self._typed):
                if generated is not None:
                    generated.check.__globals__[f"_g{position}"] = groups
        self._file_missing = [
            (groups, (_MISSING_KEPT,) * len(plan.first_names))
            for groups, plan in zip(self._file_groups, self._file_plans, strict=True)
        ]

    def rule_error(self, plan: _Plan, where: str) -> None:
        self.engine._rule_error(plan, where)

    def _malformed_line(self, item: Malformed, origin: str) -> None:
        """DS000 on a line, and its action id opens the file groups (Engine._submit_malformed)."""
        self._malformed_count += 1
        action_id = item.action_id
        if action_id:
            key = action_id if len(action_id) <= _SHORT_ID else _digest(action_id)
            for groups, missing in self._file_missing:
                groups.setdefault(key, missing)
        session_id = item.session_id or None
        if session_id is not None and session_id not in self._sessions:
            self._new_session(session_id)
        if session_id is not None and self._session_rules and not self.engine.log_session(session_id):
            raise LaneAborted("more sessions than max_sessions: some would be evicted")
        tally = self._tally(session_id)
        line = item.line or 0
        keyed = self._late_possible
        for index, plan in enumerate(self._malformed):
            tally[self._malformed_offset + index] += 1
            if keyed:
                self._key(origin, line, None, plan.id)
            messages = self._malformed_messages[index]
            if messages is None:
                meta = {"source": "log", "line": line, "problem": item.message}
                message = plan.rule.message.render({"meta": meta, "lists": self._act["lists"]})
                printed = printable(message)
            elif self._text:  # only the form the report prints
                printed = messages[1](item.message, line)
            else:
                message = messages[0](item.message, line)
            if not self._text:
                self._add_json(malformed_violation(plan, item, message).to_json())
                continue
            # The line as the engine's text report prints it: escaped part by part (the
            # rule's literals when generated, the values here), not scanned whole.
            prefix = f"{_printable(origin)}: " if self._several and origin else ""
            shown = _printable(action_id) if action_id else "-"
            self._lines.append(f"{prefix}line {item.line} [{shown}]: {self._malformed_heads[index]}{printed}")

    # -- violations ---------------------------------------------------------------------

    def _emit(  # noqa: PLR0917 (the hot path passes positions, not names)
        self, hits: list[int], record: Any, is_typed: bool, session_id: str, action_id: str, kind: str, line: int,
        t: int | None, origin: str, found: list[Violation] | None = None,
    ) -> None:
        """The violations of one record (a dict, or a typed line), written in the report's order (rule id);
        ``found``: the session rules' violations on it (the engine's), placed among them."""
        generated = self._typed if is_typed else self._generated
        assert generated is not None
        tally = self._tally(session_id)
        ordered = hits if len(hits) == 1 else sorted(hits, key=generated.rank.__getitem__)
        if found:
            self._emit_with(ordered, found, record, session_id, action_id, kind, line, t, origin)
            return
        if self._late_possible:
            for position in ordered:
                self._key(origin, line, t, generated.plans[position].id)
        conditions = len(self._conditions)
        if self._text:
            prefix = f"{_where(record, is_typed, session_id, action_id, line)}: "
            if self._several:
                prefix = f"{_printable(origin)}: {prefix}"
            heads = generated.heads
            printed = generated.printed
            for position in ordered:
                tally[position] += 1
                first = self._views.pop(position, None) if position >= conditions else None
                self._lines.append(prefix + heads[position] + printed[position](record, first, line, t))
            return
        get = getattr if is_typed else dict.get
        for position in ordered:
            tally[position] += 1
            first = self._views.pop(position, None) if position >= conditions else None
            message = generated.messages[position](record, first, line, t)
            self._add_json(self._violation_json(generated.plans[position], record, get, session_id, action_id, kind,
                                                line, t, origin, message))

    def _emit_with(  # noqa: PLR0917 (as _emit)
        self, ordered: list[int], found: list[Violation], record: Any, session_id: str, action_id: str, kind: str,
        line: int, t: int | None, origin: str,
    ) -> None:
        """A line's violations when session rules fired on it too: the lane's hits (dict records) and
        the engine's violations, in rule-id order (the engine's in the order it found them)."""
        generated = self._generated
        plans = generated.plans
        conditions = len(self._conditions)
        tally = self._tally(session_id)
        merged: list[tuple[str, int, int | Violation]] = [(plans[p].id, 0, p) for p in ordered]
        merged.extend((v.rule, 1, v) for v in found)
        merged.sort(key=lambda entry: (entry[0], entry[1]))  # stable: ties keep their order
        for rule, _, entry in merged:
            if self._late_possible:
                self._key(origin, line, t, rule)
            if isinstance(entry, Violation):
                self._add_found(entry)
                continue
            tally[entry] += 1
            first = self._views.pop(entry, None) if entry >= conditions else None
            if self._text:
                prefix = f"{_where(record, False, session_id, action_id, line)}: "
                if self._several:
                    prefix = f"{_printable(origin)}: {prefix}"
                self._lines.append(prefix + generated.heads[entry] + generated.printed[entry](record, first, line, t))
            else:
                message = generated.messages[entry](record, first, line, t)
                self._add_json(self._violation_json(plans[entry], record, dict.get, session_id, action_id, kind,
                                                    line, t, origin, message))

    def _add_found(self, violation: Violation) -> None:
        """One of the engine's violations, as the engine's report writes it."""
        if self._text:
            self._lines.append(_found_line(violation, self._several))
        else:
            self._add_json(violation.to_json())

    def _session_stage(self, record: dict[str, Any], origin: str, line: int, t: int | None) -> list[Violation]:
        """The session rules on a valid line (the engine's handlers); returns the violations on
        this line, and sets aside those on earlier lines (late)."""
        engine = self.engine
        if not engine.log_session(record["session_id"]):
            raise LaneAborted("more sessions than max_sessions: some would be evicted")
        out = self._found
        engine.log_session_rules(Action(record, "log", origin, line, t), out)
        if not out:
            return out
        self._found = []
        if all(v.line == line and v.origin == origin for v in out):
            return out
        now = [v for v in out if v.line == line and v.origin == origin]
        self._set_aside([v for v in out if not (v.line == line and v.origin == origin)])
        return now

    def _set_aside(self, violations: list[Violation]) -> None:
        """Violations reported on earlier lines: merged into the report's order when it is written."""
        if not violations:
            return
        late = self._late
        if late is None:  # a rule set where none was expected: the engine's report will be right
            raise LaneAborted("a session rule reported on an earlier line")
        late.add(violations)

    def _key(self, origin: str, line: int, t: int | None, rule: str) -> None:
        """Record a spooled violation's place in the report's order (see _merged_lines)."""
        position = self._report._position
        self._keys_at.append((position.get(origin, len(position)) << _LINE_BITS) | line)
        self._keys_time.append(t or 0)
        self._keys_rank.append(self._rule_rank[rule])

    def _tally(self, session_id: str | None) -> list[int]:
        """The session's violations per rule position (None: malformed lines without a session).

        _read keeps its own copy of this inline: it runs once per violation there."""
        tally = self._counts.get(session_id)
        if tally is None:
            tally = self._counts[session_id] = [0] * self._width
        return tally

    def _add_json(self, violation: dict[str, Any]) -> None:
        self._objects.append(violation)
        if len(self._objects) >= JSON_BLOCK:
            self._flush()

    def _flush(self) -> None:
        """Text lines, or a block of JSON violations, go to the spool in one write."""
        spool = self._spool
        assert spool is not None
        lines = self._lines
        if lines:
            lines.append("")  # the last line's newline
            spool.write("\n".join(lines).encode())
            lines.clear()
        if self._objects:
            write = self._held.append if self._placing() else spool.write
            if self._json_blocks:
                write(memoryview(b",\n"))
            write(json_block_bytes(self._objects))
            self._json_blocks += 1
            self._objects.clear()

    # -- a JSON report written into its file ----------------------------------------------

    def _placing(self) -> bool:
        """Whether the JSON report's violations list is still to be placed in the report's file."""
        return self._direct and not self._text and self._json_at is None

    def _seen(self, block: Any, has_too_long: bool) -> None:
        """Count a block's bytes while the violations list is not placed: what the estimate of
        the head's counts scales from."""
        if has_too_long:
            self._seen_bytes += sum(len(raw) + 1 for raw in block if type(raw) is bytes)
        else:
            self._seen_bytes += sum(map(len, block)) + len(block)

    def _place(self, actions: int, malformed: int, *, final: bool = False) -> None:
        """Write the held blocks where the JSON report's head is expected to end.

        The head holds the action and malformed counts: estimated in proportion to the bytes of
        the inputs read so far (exact when ``final``). A wrong estimate costs a move of the list
        when the report is written (write_json), never a wrong report.
        """
        scale = 1.0
        if not final and self._seen_bytes and self._input_bytes > self._seen_bytes:
            scale = self._input_bytes / self._seen_bytes
        guess = Report(self._report.inputs)
        guess.tally(round(actions * scale), round(malformed * scale))
        guess.violations_by_rule["-"] = 1  # a report with violations: its head ends where they begin
        head = "".join(json_report_parts(guess)[0])
        spool = self._spool
        assert spool is not None
        self._json_at = self._start + len(head.encode())
        spool.seek(self._json_at)
        for piece in self._held:
            spool.write(piece)
        self._held.clear()

    def _move(self, source: int, target: int, length: int) -> None:
        """Move ``length`` bytes of the report's file from ``source`` to ``target``, a chunk at
        a time in the direction that never overwrites what is still to be read."""
        spool = self._spool
        assert spool is not None and self._reread is not None
        log.debug("replay: the JSON report's head came out %d bytes %s than estimated; moving its %d-byte "
                  "violations list", abs(target - source), "longer" if target > source else "shorter", length)
        spool.flush()
        out = spool.fileno()
        with self._reread() as reader:
            into = reader.fileno()
            starts = range(0, length, _MOVE_CHUNK)
            for offset in starts if target < source else reversed(starts):
                size = min(_MOVE_CHUNK, length - offset)
                chunk = os.pread(into, size, source + offset)
                if len(chunk) != size:
                    raise OSError(f"the report's file was cut while it was written ({len(chunk)} of {size} bytes)")
                pwrite_all(out, chunk, target + offset)

    @staticmethod
    def _violation_json(  # noqa: PLR0917 (the hot path passes positions, not names)
        plan: _Plan,
        record: Any,
        get: Callable[[Any, str], Any],
        session_id: str,
        action_id: str,
        kind: str,
        line: int,
        t: int | None,
        origin: str,
        message: str,
    ) -> dict[str, Any]:
        """Violation.to_json() of the engine's violation on this record, built directly.

        ``session_id``, ``action_id``, ``kind``: the record's (required, so strings). ``get(record,
        field)`` reads the optional ones: ``dict.get``, or ``getattr`` for a typed line, whose
        absent field is the decoder's unset marker (not a string, so it counts as absent here).
        """
        out: dict[str, Any] = {
            "violation_id": make_violation_id(plan.id, session_id, action_id, f"line:{origin}:{line}"),
            "rule": plan.id,
            "name": plan.name,
            "severity": plan.severity,
            "session_id": session_id,
            "action_id": action_id,
            "message": message,
            "kind": kind,
            "line": line,
        }
        if origin:
            out["origin"] = origin
        trace_id = get(record, "trace_id")
        if type(trace_id) is str and trace_id:
            out["trace_id"] = trace_id
            span_id = get(record, "span_id")
            out["span_id"] = span_id if type(span_id) is str else ""
        service = get(record, "service")
        if type(service) is str and service:
            out["service"] = service
        if t is not None:
            out["time_unix_nano"] = t
        if plan.tags:
            out["tags"] = plan.tags  # a tuple: orjson writes it as the list it is
        return out

    def _summary(self) -> EngineSummary:
        kinds = self._sessions
        ids = [plan.id for plan in (*self._generated.plans, *self._malformed)]
        by_session: dict[str, dict[str, int]] = {}
        by_rule: dict[str, int] = {}
        for session_id, tally in self._counts.items():
            for position, n in enumerate(tally):
                if n:
                    rule = ids[position]
                    by_rule[rule] = by_rule.get(rule, 0) + n
                    if session_id is not None:
                        found = by_session.setdefault(session_id, {})
                        found[rule] = found.get(rule, 0) + n
        engine = self.engine
        counters = engine._state.counters
        if not self._session_rules:
            sessions = [
                SessionSummary(
                    session_id=session_id,
                    actions_by_kind=kinds[session_id],
                    violations_by_rule=by_session.get(session_id, {}),
                    open_waits=[],
                )
                for session_id in sorted(self._sessions)
            ]
        else:
            # The session rules' part is the engine's: its violations, open waits and late resolutions.
            for rule, n in engine._state.violations_by_rule.items():
                by_rule[rule] = by_rule.get(rule, 0) + n
            sessions = []
            for session_id in sorted(self._sessions):
                state = engine._sessions.get(session_id)
                counted = by_session.get(session_id, {})
                if state is None:
                    sessions.append(SessionSummary(session_id=session_id, actions_by_kind=kinds[session_id],
                                                   violations_by_rule=counted, open_waits=[]))
                    continue
                held = engine._session_summary(state, "open")
                for rule, n in held.violations_by_rule.items():
                    counted[rule] = counted.get(rule, 0) + n
                sessions.append(SessionSummary(
                    session_id=session_id,
                    actions_by_kind=kinds[session_id],
                    violations_by_rule=dict(sorted(counted.items())),
                    open_waits=held.open_waits,
                    waits_resolved_late=held.waits_resolved_late,
                ))
        return EngineSummary(
            sessions=sessions,
            actions_seen=self._actions,
            actions_evaluated=self._actions,
            malformed=self._malformed_count,
            violations_by_rule=by_rule,
            rule_errors=dict(engine._state.rule_errors),
            open_waits=[w for s in sessions for w in s.open_waits],
            groups_dropped=counters["groups_dropped"],
            waits_resolved_late=counters["waits_resolved_late"],
            fired_waits_dropped=counters["fired_waits_dropped"],
            watermark_ns=self._max_t,
        )


# ---------------------------------------------------------------------------
# Whether a rule set and an engine fit the lane


def _unsupported_reason(engine: Engine) -> str | None:
    if engine._serve:
        return "serve"
    if engine._telemetry is not None:
        return "telemetry"
    # File-scope rules are compact sequences keeping their first opener (rulefmt refuses any
    # other): the generated code models exactly those.
    return None


def _session_rules_on_logs(engine: Engine) -> bool:
    """Whether a session rule can do anything on an action log (one whose ``first`` requires a
    span can neither open nor fire there)."""
    return any(
        not plan.file_scope and not (plan.kind in ("sequence", "absence") and _never_opens_on_logs(plan))
        for plan in engine._stateful_plans
    )


def _never_opens_on_logs(plan: _Plan) -> bool:
    """``first`` requires ``meta.source == "span"`` (or another non-log source) at its top level."""
    from processor.evaluate.cel._ast import Binary, Ident, Literal, Logic, Select

    expression = plan.first
    if expression is None or expression.tree is None:
        return False
    tree = expression.tree
    terms = tree.terms if isinstance(tree, Logic) and tree.op == "&&" else (tree,)
    for term in terms:
        if isinstance(term, Binary) and term.op == "==":
            for side, other in ((term.left, term.right), (term.right, term.left)):
                if (
                    isinstance(side, Select)
                    and isinstance(side.operand, Ident)
                    and side.operand.name == "meta"
                    and side.field == "source"
                    and isinstance(other, Literal)
                    and type(other.value) is str
                    and other.value != "log"
                ):
                    return True
    return False


# ---------------------------------------------------------------------------
# Code generation

_RECORD: Final = FieldTyping(code="r", types=FIELD_TYPES, always=frozenset(REQUIRED_FIELDS))
# ``first`` holds the kept fields of a valid record (present ones have their types and, when
# required, a value), or nothing when a malformed line opened the group.
_FIRST: Final = FieldTyping(code="f", types=FIELD_TYPES, nonnull_when_present=frozenset(REQUIRED_FIELDS))
_META: Final = {
    "source": ("'log'", frozenset({str})),
    "synthetic_action_id": ("False", frozenset({bool})),
    "line": ("line", frozenset({int})),
    "time_ns": ("(t or 0)", frozenset({int})),  # what the engine's meta holds: the line's time, or 0
}
# Rule functions the generated code calls itself (RULE_FUNCTIONS), on the argument types each
# never raises for: timeDerived reads any string and any integer time.
_FUNCTIONS: Final = {"timeDerived": ("_timeDerived", (frozenset({str}), frozenset({int})), frozenset({bool}))}
# What a malformed rule's message may read: the line and the problem (no record).
_MALFORMED_META: Final = {
    "source": ("'log'", frozenset({str})),
    "line": ("line", frozenset({int})),
    "problem": ("problem", frozenset({str})),
}
_EMPTY_RECORD: Final[dict[str, Any]] = {}
_ALLOWED_NODES: Final = (
    ast.Module, ast.FunctionDef, ast.arguments, ast.arg, ast.Return, ast.If, ast.Try, ast.ExceptHandler,
    ast.Expr, ast.Call, ast.Name, ast.Load, ast.Store, ast.Constant, ast.Subscript, ast.Compare, ast.BoolOp,
    ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.IfExp, ast.BinOp, ast.Add, ast.In, ast.NotIn, ast.Is, ast.IsNot,
    ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.Attribute, ast.Pass, ast.Assign, ast.Tuple,
)  # fmt: skip


def _generate(
    conditions: list[_Plan], file_plans: list[_Plan], lane: LogLane, typed: tuple[frozenset[str], Any] | None = None
) -> _Generated:
    """The rule set as code over dict records or, with ``typed`` (the attributes and the absent
    marker of actionlog.typed_decoder's lines), over typed lines: then every expression is
    translated (the caller checked there is no fallback) and ``record.f`` reads ``r.f``."""
    record = _RECORD
    helpers: dict[str, Any] = {
        "_p": _printable,
        "_Error": EvaluationError,
        "_text": _text,
        "_cut": _cut,
        "_act": lane._act,
        "_lane": lane,
        "_timeDerived": time_derived,
    }
    if typed is not None:
        attributes, helpers["_U"] = typed
        record = FieldTyping(code="r", types=FIELD_TYPES, always=frozenset(REQUIRED_FIELDS), attributes=attributes)
    context = SourceContext(maps={"record": record, "first": _FIRST}, meta=_META, functions=_FUNCTIONS)

    body: list[str] = []
    fallback = 0
    translated: list[tuple[int, list[Conjunct]]] = []
    for position, plan in enumerate(conditions):
        expression = plan.condition
        assert expression is not None
        terms = _conjuncts(expression, context)
        if terms is not None:
            if terms:  # else never true: nothing to write
                translated.append((position, terms))
        else:
            fallback += 1
            name = f"_fn{position}"
            helpers[name] = expression.evaluate
            helpers[f"_plan{position}"] = plan
            body.append(
                f"    try:\n        if {name}(_act) is True:\n            hits.append({position})\n"
                f"    except _Error:\n        _lane.rule_error(_plan{position}, 'condition')"
            )
    body.extend(_factored(translated, "    "))
    if file_plans:
        body.append(f"    v = {record.read('action_id')}")
        body.append(f"    key = v if len(v) <= {_SHORT_ID} else _digest(v)")
        helpers["_digest"] = _digest
        helpers["_views"] = lane._views
        helpers["_M"] = _MISSING_KEPT
    offset = len(conditions)
    for position, plan in enumerate(file_plans):
        number = offset + position
        codes = [None if e is None else _expression(e, context) for e in (plan.condition, plan.first, plan.then)]
        supported = all(
            code is not None or expression is None
            for code, expression in zip(codes, (plan.condition, plan.first, plan.then), strict=True)
        )
        helpers[f"_g{position}"] = lane._file_groups[position]
        if not supported:
            fallback += 1
            helpers[f"_p{position}"] = position
            body.append(f"    _lane.file_rule(_p{position}, r, line, t, hits=hits, key=key)")
            continue
        condition_code, first_code, then_code = codes
        names = plan.first_names
        helpers[f"_view{position}"] = _view_maker(names)
        reads = plan.file_reads
        kept = "(" + "".join(
            f"{_kept_read(record, name) if reads is None or name in reads else '_M'}, " for name in names
        ) + ")"
        lines = [
            f"found = _g{position}.get(key)",
            "if found is not None:",
        ]
        if then_code is not None:
            lines += [
                f"    f = _view{position}(found)",
                f"    if {then_code}:",
                f"        hits.append({number})",
                f"        _views[{number}] = f",
            ]
        else:
            lines.append("    pass")
        if first_code is not None:
            lines += [f"elif {first_code}:", f"    _g{position}[key] = {kept}"]
        indent = "    "
        if condition_code is not None:
            body.append(f"    if {condition_code}:")
            indent = "        "
        body.extend(indent + line for line in lines)
    source = "def check(r, line, t, hits):\n" + ("\n".join(body) if body else "    pass") + "\n"
    if typed is not None and fallback:
        raise Unsupported("a typed twin of a rule set that has closures")
    namespace = _compile(source, helpers, context)
    check = namespace["check"]

    all_plans = (*conditions, *file_plans)
    messages: list[Callable[..., str]] = []
    printed_messages: list[Callable[..., str]] = []
    for position, plan in enumerate(all_plans):
        condition = plan.condition if position < len(conditions) else plan.then
        facts: frozenset[tuple[str, str, str]] = frozenset()
        if condition is not None and condition.tree is not None:
            try:
                facts = facts_when_true(condition.tree, condition.constants)
            except Unsupported:
                facts = frozenset()
        message, printed = _message(plan.rule.message, context, helpers, facts=facts, position=position, lane=lane)
        messages.append(message)
        printed_messages.append(printed)
    return _Generated(
        check=check,
        messages=tuple(messages),
        printed=tuple(printed_messages),
        heads=tuple(printable(f"{p.id} {p.name}: ") for p in all_plans),
        plans=all_plans,
        rank=tuple(
            sorted(range(len(all_plans)), key=lambda position: (all_plans[position].id, position)).index(p)
            for p in range(len(all_plans))
        ),
        fallback=fallback,
    )


def _kept_read(record: FieldTyping, name: str) -> str:
    """A kept field's value, or _M when the record lacks it (a dict's get, a typed line's _U)."""
    if record.attributes is None:
        return f"r.get({name!r}, _M)"
    if name in REQUIRED_FIELDS:
        return record.read(name)
    read = record.read(name)
    return f"(_M if {read} is _U else {read})"


def _typed_fields(plans: Iterable[_Plan]) -> frozenset[str] | None:
    """The fields outside FIELD_TYPES the rules read, when typed lines can stand for dicts; else None.

    Typed lines hold only fields the rules name (so a rule reading the whole record, or a
    field by a computed key, rules them out) and may differ from orjson's dict in one way:
    an integer beyond 64 bits inside an untyped field (see actionlog.typed_decoder). So an
    untyped field (``result``, or one FIELD_TYPES does not know) may only be tested with has().
    """
    fields: set[str] = set()
    for plan in plans:
        expressions = [e for e in (plan.condition, plan.first, plan.then) if e is not None]
        expressions += [part for part in plan.rule.message.parts if not isinstance(part, str)]
        for expression in expressions:
            for variable, name in expression.references:
                if variable not in ("record", "first"):
                    continue
                if name == WHOLE_VALUE or not name.isidentifier() or name.startswith("_"):
                    return None
                fields.add(name)
            if _reads_untyped_value(expression):
                return None
        fields.update(plan.first_names if plan.file_scope else ())
    return frozenset(fields - set(FIELD_TYPES))


def _untyped(name: str) -> bool:
    return FIELD_TYPES.get(name, "any") == "any"


def _reads_untyped_value(expression: CompiledExpression) -> bool:
    """Whether the expression reads the value of an untyped field of ``record`` or ``first``."""
    if expression.tree is None:
        return any(v in ("record", "first") and _untyped(name) for v, name in expression.references)
    stack: list[Node] = [expression.tree]
    while stack:
        node = stack.pop()
        if isinstance(node, Has):
            continue  # presence only
        operand = node.operand if isinstance(node, (Select, Index)) else None
        if isinstance(operand, Ident) and operand.name in ("record", "first"):
            if isinstance(node, Select) and _untyped(node.field):
                return True
            if isinstance(node, Index) and not (
                isinstance(node.index, Literal) and type(node.index.value) is str and not _untyped(node.index.value)
            ):
                return True
        stack.extend(node.children())
    return False


_NEVER: Final[list[Conjunct]] = []


def _conjuncts(expression: CompiledExpression, context: SourceContext) -> list[Conjunct] | None:
    """The condition's terms; [] when it is never true; None when it keeps its closure."""
    if expression.tree is None:
        return None
    try:
        terms = conjuncts(expression.tree, expression.constants, context)
    except Unsupported:
        return None
    if terms is None:
        return _NEVER
    return terms or [Conjunct("True", "True")]


def _factored(rules: list[tuple[int, list[Conjunct]]], indent: str) -> list[str]:
    """``if`` statements that append each rule's position when all its terms hold.

    A term several rules share and that stands alone (the skill's ``cacheable == true`` in
    three rules, ``status == "ok"`` in two) is tested once, its rules nested under it; the
    most shared first. Every term is total and free of effects, so the order of tests
    changes nothing but their number. Rules within a group keep their order.
    """
    out: list[str] = []
    remaining = rules
    while remaining:
        counts: dict[str, int] = {}
        for _, terms in remaining:
            for alone in {term.alone for term in terms if term.alone is not None}:
                counts[alone] = counts.get(alone, 0) + 1
        shared = max(counts.items(), key=lambda item: item[1], default=None)
        if shared is None or shared[1] < 2:
            for position, terms in remaining:
                if terms:
                    out.append(f"{indent}if {' and '.join(term.code for term in terms)}:")
                    out.append(f"{indent}    hits.append({position})")
                else:
                    out.append(f"{indent}hits.append({position})")
            break
        test = shared[0]
        group: list[tuple[int, list[Conjunct]]] = []
        rest: list[tuple[int, list[Conjunct]]] = []
        for position, terms in remaining:
            tested_alone = [term.alone for term in terms]
            if test not in tested_alone:
                rest.append((position, terms))
            else:
                index = tested_alone.index(test)
                group.append((position, terms[:index] + terms[index + 1 :]))
        out.append(f"{indent}if {test}:")
        out.extend(_factored(group, indent + "    "))
        remaining = rest
    return out


def _expression(expression: CompiledExpression, context: SourceContext) -> str | None:
    if expression.tree is None:
        return None
    try:
        written = python_source(expression.tree, expression.constants, context)
    except Unsupported:
        return None
    if written.types != frozenset({bool}):
        return None
    return written.code


def _message(
    template: MessageTemplate,
    context: SourceContext,
    helpers: dict[str, Any],
    *,
    facts: frozenset[tuple[str, str, str]],
    position: int,
    lane: LogLane,
) -> tuple[Callable[..., str], Callable[..., str]]:
    """``m(r, f, line, t)``: the message; ``p(...)``: the same for a terminal (see _message_functions)."""
    parts: list[str | _Hole] = []
    for index, part in enumerate(template.parts):
        if isinstance(part, str):
            parts.append(part)
            continue
        written = None
        if part.tree is not None:
            try:
                written = python_source(part.tree, part.constants, context, facts)
            except Unsupported:
                written = None
        limit = template.max_value_chars
        if written is None and context.maps["record"].attributes is not None:
            raise Unsupported("a message hole that runs its closure reads a dict")
        constant = _constant_text(written, limit)
        if constant is not None:  # a hole fixed for the lane (meta.source folded): text now
            parts.append(constant)
        elif written is None:
            name = f"_hole{position}_{index}"
            helpers[name] = _fallback_hole(part, limit, lane)
            parts.append(_Hole(f"{name}(r, f, line, t)"))
        elif written.types == frozenset({str}):
            if is_plain_read(written.code):  # r['field'] or r.field: read twice, called rarely
                code = written.code
                parts.append(_Hole(f"({code} if len({code}) <= {limit} else _cut({code}, {limit}))"))
            else:
                parts.append(_Hole(f"_cut({written.code}, {limit})"))
        else:
            parts.append(_Hole(f"_text({written.code}, {limit})"))
    return _message_functions(parts, "r, f, line, t", helpers, context)


def _malformed_message(
    template: MessageTemplate, helpers: dict[str, Any]
) -> tuple[Callable[[str, int], str], Callable[[str, int], str]] | None:
    """A ``malformed`` rule's message as ``m(problem, line)`` and ``p(problem, line)`` (escaped
    for a terminal, as ``_message``'s); None when a hole is not translated (render runs)."""
    context = SourceContext(maps={}, meta=_MALFORMED_META)
    parts: list[str | _Hole] = []
    for part in template.parts:
        if isinstance(part, str):
            parts.append(part)
            continue
        if part.tree is None:
            return None
        try:
            written = python_source(part.tree, part.constants, context)
        except Unsupported:
            return None
        constant = _constant_text(written, template.max_value_chars)
        parts.append(constant if constant is not None else _Hole(f"_text({written.code}, {template.max_value_chars})"))
    return _message_functions(parts, "problem, line", helpers, context)


class _Hole(NamedTuple):
    """A message hole's source (a str at run time); a plain str in a message's parts is text."""

    code: str


def _message_functions(
    parts: list[str | _Hole], params: str, helpers: dict[str, Any], context: SourceContext
) -> tuple[Callable[..., str], Callable[..., str]]:
    """``m(<params>)``: the message; ``p(<params>)``: the same for a terminal, control characters escaped.

    The text report escapes what it prints (processor.report.printable). Escaping is per
    character, so the escaped texts and escaped holes make the escaped message: the texts
    are escaped here, once, and only the holes' values at run time (checking a whole line
    costs more than finding and formatting the violation).
    """
    pieces = [part.code if isinstance(part, _Hole) else repr(part) for part in parts]
    escaped = [f"_p({part.code})" if isinstance(part, _Hole) else repr(printable(part)) for part in parts]
    body = " + ".join(pieces) if pieces else "''"
    body_escaped = " + ".join(escaped) if escaped else "''"
    source = f"def m({params}):\n    return {body}\ndef p({params}):\n    return {body_escaped}\n"
    namespace = _compile(source, helpers, context)
    return namespace["m"], namespace["p"]


def _constant_text(written: PythonSource | None, limit: int) -> str | None:
    """The text of a hole whose source is a single literal (``_text`` of it), else None."""
    if written is None:
        return None
    try:
        tree = ast.parse(written.code, mode="eval")
    except SyntaxError:
        return None
    if not isinstance(tree.body, ast.Constant) or type(tree.body.value) not in (str, int, float, bool, type(None)):
        return None
    return _text(tree.body.value, limit)


def _fallback_hole(part: CompiledExpression, limit: int, lane: LogLane) -> Callable[..., str]:
    lists = lane._act["lists"]

    def hole(record: dict[str, Any], first: dict[str, Any] | None, line: int, t: int | None) -> str:
        activation = {
            "record": record,
            "first": first if first is not None else _EMPTY_RECORD,
            "lists": lists,
            "meta": {"source": "log", "synthetic_action_id": False, "line": line, "time_ns": t or 0},
        }
        try:
            value = part.evaluate(activation)
        except EvaluationError:
            return "?"
        return _text(value, limit)

    return hole


def _view_maker(names: tuple[str, ...]) -> Callable[[tuple[Any, ...]], dict[str, Any]]:
    """``first`` as the map the engine's _first_view gives: the kept fields that were present."""

    def view(kept: tuple[Any, ...]) -> dict[str, Any]:
        return {n: v for n, v in zip(names, kept, strict=True) if v is not _MISSING_KEPT}

    return view


def _compile(source: str, helpers: dict[str, Any], context: SourceContext) -> dict[str, Any]:
    helpers.update(context.constants)
    tree = ast.parse(source, mode="exec")
    record = context.maps.get("record")
    _check_source(
        tree,
        set(helpers) | {"r", "f", "line", "t", "hits", "type", "str", "len", "v", "key", "found", "problem"},
        record.attributes if record is not None and record.attributes is not None else frozenset(),
    )
    namespace: dict[str, Any] = {"__builtins__": {"type": type, "str": str, "len": len}, **helpers}
    exec(compile(tree, "<durable-check rules>", "exec"), namespace)  # noqa: S102 (checked source, see _check_source)
    return namespace


def _check_source(tree: ast.AST, names: set[str], record_attributes: frozenset[str] = frozenset()) -> None:
    """Only the node types and names the generator writes: a rule cannot reach anything else.

    Attributes: the few methods the generator calls, and a typed line's fields on ``r``
    (a msgspec struct's declared fields, data only).
    """
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED_NODES):
            raise AssertionError(f"generated rule code has a {type(node).__name__} node")
        if isinstance(node, ast.Name) and node.id not in names:
            raise AssertionError(f"generated rule code names {node.id!r}")
        if isinstance(node, ast.Attribute) and not (
            isinstance(node.value, ast.Name)
            and (
                node.attr in ("append", "get", "rule_error", "file_rule")
                or (node.value.id == "r" and node.attr in record_attributes and not node.attr.startswith("_"))
            )
        ):
            raise AssertionError(f"generated rule code reads attribute {node.attr!r}")


def _found_line(v: Violation, several: bool) -> str:
    """One of the engine's violations as the text report prints it (no waivers in the lane)."""
    return printable(f"{violation_where(v, several)}: {v.rule} {v.name}: {v.message}")


def _spooled(spool: IO[bytes], *, text: bool) -> Iterator[str]:
    """The spool's violations one at a time: text lines (with their newline), or the JSON
    list's objects (json_block form, without the ",\n" between them)."""
    spool.flush()
    spool.seek(0)
    if text:
        for raw in spool:
            yield raw.decode()
        return
    # An object's last line is its closing brace at the list's indentation (nested objects are
    # indented deeper, and strings hold no raw newline): "    }", then ",\n" unless it is the last.
    held: list[bytes] = []
    for raw in spool:
        if raw in _OBJECT_ENDS:
            held.append(b"    }")
            yield b"".join(held).decode()
            held.clear()
        else:
            held.append(raw)
    if held:
        raise AssertionError("the JSON spool ends inside a violation")


def _text(value: Any, limit: int) -> str:
    """MessageTemplate.render's text of one value."""
    text = "null" if value is None else ("true" if value is True else "false" if value is False else str(value))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _where(record: Any, is_typed: bool, session_id: str, action_id: str, line: int) -> str:
    """Where the text report says a violation on this record is (``processor.report._where``,
    escaped as the report escapes its lines): by its line and action id, or by its ids when
    the record names a span."""
    span_id = record.span_id if is_typed else record.get("span_id")
    if not (type(span_id) is str and span_id):
        return f"line {line} [{_printable(action_id)}]"
    trace_id = record.trace_id if is_typed else record.get("trace_id")
    return _printable(span_where(line, session_id, action_id, trace_id if type(trace_id) is str else "", span_id))


def _printable(text: str) -> str:
    """processor.report.printable for a short value: most need no escaping, and say so cheaply."""
    return text if text.isascii() and text.isprintable() else text.translate(CONTROL_ESCAPES)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _digest(action_id: str) -> bytes:
    return xxh3_128_digest(action_id.encode("utf-8", "surrogatepass"))


class _DigestedIds:
    """A file's ids past _IDS_IN_DICT: FileIds, keyed as the generated code keys the dict (a
    short id as itself, a long one by its digest), every key digested."""

    __slots__ = ("closed", "ids")

    def __init__(self, ids: FileIds) -> None:
        self.ids = ids
        self.closed = False

    def __len__(self) -> int:
        return len(self.ids)

    def get(self, key: str | bytes) -> tuple[Any, ...] | None:
        return self.ids.get(key if type(key) is bytes else _digest(key))  # type: ignore[arg-type]

    def __setitem__(self, key: str | bytes, kept: tuple[Any, ...]) -> None:
        self.ids.put(key if type(key) is bytes else _digest(key), kept)  # type: ignore[arg-type]

    def setdefault(self, key: str | bytes, kept: tuple[Any, ...]) -> None:
        self.ids.setdefault(key if type(key) is bytes else _digest(key), kept)  # type: ignore[arg-type]


def _digested(groups: dict[Any, tuple[Any, ...]], memory_entries: int) -> _DigestedIds:
    """A file's ids so far, moved to FileIds."""
    moved = _DigestedIds(FileIds(memory_entries=memory_entries))
    for key, kept in groups.items():
        moved[key] = kept
    groups.clear()
    return moved


def _sizes(inputs: list[str]) -> int:
    """The inputs' bytes on disk (0 for one that cannot be read: it holds no lines)."""
    total = 0
    for path in inputs:
        with contextlib.suppress(OSError):
            total += os.stat(path).st_size
    return total


def _confirmed(lenient: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """The lenient typed decoder, its line confirmed by orjson (which checks the fields it skipped)."""
    loads = orjson.loads

    def decode(raw: bytes) -> Any:
        typed = lenient(raw)
        loads(raw)  # raises orjson.JSONDecodeError, a ValueError, where orjson refuses the line
        return typed

    return decode
