"""Replay's report: input order, spilling sorted runs to disk, and the streamed JSON document."""

from __future__ import annotations

import dataclasses
import io
import random
import tempfile
import tracemalloc
from collections import Counter
from collections.abc import Callable
from typing import TextIO

import orjson
import pytest

from processor.report import Report, copy_utf8, render_json, render_text, write_json
from processor.summary import EngineSummary, SessionSummary
from processor.violations import Violation


def _violations(count: int, seed: int) -> list[Violation]:
    rng = random.Random(seed)
    out = []
    for n in range(count):
        from_log = rng.random() < 0.5
        out.append(
            Violation(
                rule=rng.choice(("DS001", "DS002", "DS107")),
                name="rule-name",
                severity="error",
                session_id=f"s{rng.randrange(5)}",
                action_id=f"a{n}",
                message=f"message {n}",
                violation_id=f"v{n}",
                time_ns=rng.choice((None, rng.randrange(1_000, 1_010))),
                line=rng.randrange(1, 20) if from_log else None,
                origin=rng.choice(("b.jsonl", "a.jsonl", "other")),
                trace_id="" if from_log else f"{n:032x}",
                span_id="" if from_log else f"{n:016x}",
                service=rng.choice(("", "booker")),
                kind=rng.choice(("", "payment")),
                tags=tuple(rng.sample(("money", "retry", "wait"), rng.randrange(3))),
                details=rng.choice(({}, {"deadline_unix_nano": n, "other": {"action_id": "x"}})),
            )
        )
    return out


def _summary() -> EngineSummary:
    return EngineSummary(
        sessions=[SessionSummary("s0", {"payment": 40}, {"DS001": 3}, [])],
        actions_seen=43,
        actions_evaluated=40,
        duplicates=3,
        malformed=2,
        violations_by_rule={"DS001": 3},
    )


def _report(violations: list[Violation], spill_at: int) -> Report:
    report = Report(["a.jsonl", "b.jsonl"], spill_at=spill_at)
    report.tally(actions=43, malformed=2)
    for start in range(0, len(violations), 7):
        report.add(violations[start : start + 7])
    report.summary = _summary()
    return report


def test_spilled_runs_merge_into_the_order_of_one_sort() -> None:
    violations = _violations(500, seed=1)
    in_memory = _report(violations, spill_at=10_000)
    spilled = _report(violations, spill_at=30)
    try:
        assert spilled._runs, "the small bound spilled runs to disk"
        expected = sorted(violations, key=in_memory._key)  # a stable sort: ties keep arrival order
        assert list(in_memory.ordered()) == expected
        assert list(spilled.ordered()) == expected
        assert render_text(spilled) == render_text(in_memory)
        assert render_json(spilled) == render_json(in_memory)
    finally:
        spilled.close()


def test_runs_longer_than_a_chunk_merge_in_order() -> None:
    # Runs are written a chunk of 256 violations at a time; these runs hold ten chunks.
    violations = _violations(7_000, seed=4)
    in_memory = _report(violations, spill_at=10_000)
    spilled = _report(violations, spill_at=2_500)
    try:
        assert len(spilled._runs) == 2
        assert list(spilled.ordered()) == list(in_memory.ordered())
    finally:
        spilled.close()


def test_many_runs_merge_in_tiers_into_the_order_of_one_sort() -> None:
    """Past 16 runs of one tier they are merged into one of the next: the runs open stay few
    (files, and a chunk of each held while the report is written), and ties keep arrival order."""
    violations = _violations(3_000, seed=6)
    in_memory = _report(violations, spill_at=10_000)
    spilled = _report(violations, spill_at=7)  # 428 runs of 7, one violation held
    try:
        # 428 runs of tier 0 are 26 of tier 1 (and 12 left), 1 of tier 2 and 10 of tier 1.
        assert spilled._tiers == [2] + [1] * 10 + [0] * 12
        assert len(spilled._held) == 4
        expected = sorted(violations, key=in_memory._key)
        assert list(spilled.ordered()) == expected
        assert len(spilled._runs) <= 16, "writing the report merges down to one fan-in first"
        assert list(spilled.ordered()) == expected, "a second reading gives the same"
        assert render_json(spilled) == render_json(in_memory)
    finally:
        spilled.close()
        in_memory.close()


def test_a_spilled_violation_keeps_every_field() -> None:
    # Every field set to something other than its default: a field left out of the spilled
    # form, or read back in another field's place, fails here whatever field is added later.
    def value(field: dataclasses.Field[object], n: int) -> object:
        if field.name in ("time_ns", "line"):
            return 1_000 + n
        if field.name == "tags":
            return ("money", f"tag{n}")
        if field.name == "details":
            return {"deadline_unix_nano": n, "other": {"action_id": "x", "ids": [1, 2.5, None, True]}}
        return f"{field.name}-{n}"

    violations = [Violation(**{f.name: value(f, n) for f in dataclasses.fields(Violation)}) for n in range(3)]
    report = Report(["a.jsonl"], spill_at=1)
    report.add(violations)
    try:
        assert len(report._runs) == 1
        assert list(report.ordered()) == violations
    finally:
        report.close()


@pytest.mark.parametrize("count", [60, 2_500])  # 2,500: the violations are written in several blocks
def test_the_streamed_json_is_the_whole_document_dumped_at_once(count: int) -> None:
    violations = _violations(count, seed=2)
    report = _report(violations, spill_at=25 if count < 100 else 700)
    try:
        assert render_json(report) == _dumped_at_once(report, violations)
    finally:
        report.close()


def _dumped_at_once(report: Report, violations: list[Violation]) -> str:
    """What the JSON report must be: the whole document (as _report made it) dumped in one call."""
    assert report.summary is not None
    document = {
        "inputs": ["a.jsonl", "b.jsonl"],
        "actions": 40,
        "duplicates": 3,
        "malformed": 2,
        "violations": [v.to_json() for v in sorted(violations, key=report._key)],
        "unreadable": [],
        **report.summary.to_json(),
    }
    return orjson.dumps(document, option=orjson.OPT_INDENT_2).decode() + "\n"


def test_the_json_report_holds_one_block_of_its_text_at_a_time() -> None:
    """Written as its violations are read back, in both builds (the compiled one makes a list
    of any generator expression: one that made the blocks held the whole text at once)."""
    violations = _violations(20_000, seed=5)
    report = _report(violations, spill_at=50_000)  # held in memory already: read back, it costs nothing new

    out = _written_measured(report)
    assert out.written > 5_000_000
    # A block of 256 violations is about 1/80 of this report's text; held whole, it would all be there.
    assert out.grown < out.written // 8, (out.grown, out.written)


class _MeasuredOut:
    """Counts what is written, its largest piece, and samples the traced heap at each write; keeps no text."""

    def __init__(self) -> None:
        self.written = 0
        self.largest = 0
        self.peak = 0
        self.grown = 0  # the traced heap's peak over its size before the report was written

    def write(self, text: str) -> int:
        self.written += len(text)
        self.largest = max(self.largest, len(text))
        self.peak = max(self.peak, tracemalloc.get_traced_memory()[0])
        return len(text)


def _written_measured(report: Report) -> _MeasuredOut:
    """``report`` written as JSON into a _MeasuredOut under tracemalloc, then closed."""
    out = _MeasuredOut()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        write_json(report, out)  # type: ignore[arg-type]  # what write_json calls of a stream: write()
        out.grown = out.peak - base
    finally:
        tracemalloc.stop()
        report.close()
    return out


def _many_sessions(count: int) -> EngineSummary:
    sessions = [
        SessionSummary(f"session-{n:06d}", {"payment": n % 7, "llm_call": 3}, {"DS001": n % 2} if n % 2 else {}, [],
                       end="expired" if n % 5 == 0 else "open")
        for n in range(count)
    ]
    return dataclasses.replace(_summary(), sessions=sessions)


@pytest.mark.parametrize(("violations", "sessions"), [(0, 0), (0, 1), (0, 700), (40, 1), (40, 700), (600, 2_500)])
def test_the_sessions_are_streamed_into_the_same_document(violations: int, sessions: int) -> None:
    report = _report(_violations(violations, seed=4), spill_at=100)
    report.summary = _many_sessions(sessions)
    try:
        assert render_json(report) == _dumped_at_once(report, _violations(violations, seed=4))
    finally:
        report.close()


@pytest.mark.parametrize("violations", [0, 300])
def test_a_report_of_many_sessions_holds_one_block_of_them_at_a_time(violations: int) -> None:
    """The session summaries are written a block at a time too, with or without violations before them."""
    report = _report(_violations(violations, seed=6), spill_at=50_000)
    report.summary = _many_sessions(40_000)
    out = _written_measured(report)
    assert out.written > 10_000_000
    # Held whole, the text (and its copies) would all be there at once.
    assert out.largest < out.written // 50 and out.grown < out.written // 8, (out.largest, out.grown)


def test_text_report_counts_by_rule_and_ends_with_the_verdict() -> None:
    violations = _violations(40, seed=3)
    report = _report(violations, spill_at=15)
    try:
        text = render_text(report).splitlines()
        by_rule = Counter(v.rule for v in violations)
        rules = ", ".join(f"{rule}×{n}" for rule, n in sorted(by_rule.items()))
        assert text[-1] == f"FAIL: 40 violation(s) in 40 action(s) [{rules}]; 2 malformed item(s) not checked"
        assert text[-2] == "sessions: 1 session(s), 40 action(s) evaluated, 3 duplicate deliveries skipped, 2 malformed"
        assert text[-3] == "session s0: 40 action(s) [payment×40], 3 violation(s) [DS001×3]"
        assert len(text) == 43
    finally:
        report.close()


def test_no_violations_is_ok_in_both_formats() -> None:
    report = Report(["a.jsonl"])
    report.tally(actions=3, malformed=0)
    assert render_text(report) == "OK: 3 action(s), no violations\n"
    assert orjson.loads(render_json(report))["violations"] == []
    assert '"violations": []' in render_json(report)


# A character whose UTF-8 form is split by the copy's chunk boundary, then more text after it
# (all of it within latin-1, so the latin-1 stream can hold it).
_ACROSS_CHUNKS = "x" * ((1 << 20) - 1) + "é [a-1]: DS001 ...\n" + "ünïcode line\n" * 3


def _utf8_stream() -> io.TextIOWrapper:
    return io.TextIOWrapper(io.BytesIO(), encoding="utf-8")


def _latin1_stream() -> io.TextIOWrapper:
    return io.TextIOWrapper(io.BytesIO(), encoding="latin-1")


def _written(out: TextIO) -> str:
    if isinstance(out, io.StringIO):
        return out.getvalue()
    assert isinstance(out, io.TextIOWrapper)
    buffer = out.buffer
    assert isinstance(buffer, io.BytesIO)
    return buffer.getvalue().decode(out.encoding)


@pytest.mark.parametrize(
    "make_out",
    [
        _utf8_stream,  # the bytes go to its buffer, after what its text layer still holds
        _latin1_stream,  # another encoding: decoded (across the chunk boundary) and written as text
        io.StringIO,  # no buffer at all
    ],
    ids=["utf-8", "latin-1", "string"],
)
def test_a_spooled_report_is_copied_whole_and_in_order_onto_any_text_stream(make_out: Callable[[], TextIO]) -> None:
    with tempfile.TemporaryFile("w+b") as spool:
        spool.write(_ACROSS_CHUNKS.encode())
        out = make_out()
        out.write("head\n")  # held by the text layer until the copy flushes it
        copy_utf8(spool, out)
        out.write("tail\n")
        out.flush()
    assert _written(out) == "head\n" + _ACROSS_CHUNKS + "tail\n"
