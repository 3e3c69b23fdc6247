"""Durable Check's benchmark: each number beside the limit of this stack, measured in the same run.

    python -m bench [--size tiny|small|full] [--runs N] [--skip SECTION ...]

Sections (rows of the table):

- ``replay_otlp``: ``durable-check replay --format json --input-format otlp-proto-stream``
  over a generated Collector proto dump, beside ``bench.limits otlp`` (parse the same
  requests, read the attributes conversion needs, nothing else); then the same over a
  dump of the same story whose spans carry 30 more attributes each that no profile reads
  (flattened input messages, tags, counters), where the limit loop walks them all.
- ``replay_actions``: replay of an action log, beside a plain ``json.loads`` loop.
- ``replay_skill``: replay of logs of the skill's own shape, one with few flaws (4% of
  lines) and one flaw-heavy (about 0.85 violations per line), with the skill's pack
  alone (``--pack durable-sessions``) and with every shipped pack, beside
  ``bench.limits skill`` (``json.loads`` each line and apply the skill's ten checks
  inline: the work the skill's checker does); and the cost of one violation, from
  detection to its written report line. Replay writes its text report here, the shape
  the skill's checker prints. Beside the loop, the floor (``bench.limits floor``: each
  line read and parsed typed, nothing else), the least CPU any Python replay of the log
  can take, and replay's own start-up past the floor's (a one-line log).
- ``replay_rss``: peak RSS of replay at two input lengths (a tenth, and all, of the
  dump), the same sessions in both; then the same for the action log, all packs.
- ``live``: ``durable-check serve`` with its default state backend; offered load is
  stepped up until a step loses a span or falls behind; the same with the other store
  (``sqlite`` when the default is ``memory``); then the send-to-violation latency at
  half the sustained rate (with the default allowed lateness, and with 0s). Then two
  serves side by side on this machine, each with its own state of the default store, the
  dump's sessions split between them as the Collector routes them (``bench.live
  run_replicas``), stepped up from the rate one serve sustained. With
  ``--postgres DSN``, also one replica with its state in PostgreSQL (a new database on
  that server for each step), stepped up the same way: the figure per replica.
- ``memory``: RSS per idle open session (``bench/bench_sessions_memory.py``).
- ``rules``: per-record evaluation time of the shipped packs and of 10, 50 and 200
  generated condition rules.

Every measured command runs in a fresh subprocess: wall time and CPU time from
``os.wait4``, peak RSS from the child's own address space (:mod:`bench.peak`). Replay
rates are per CPU-second, medians over ``--runs`` runs; ratios are medians of the
ratios of runs taken back to back. Generated inputs are cached under ``bench/out/``;
the table is printed and written to ``bench/out/results.json``.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final, Protocol, TypeVar

import orjson

from bench import build, generate, live

ROOT: Final = Path(__file__).resolve().parents[1]
OUT: Final = ROOT / "bench" / "out"
SECTIONS: Final = ("replay_otlp", "replay_actions", "replay_skill", "replay_rss", "live", "memory", "rules")
# Every row the table has, whatever the size (tests/test_bench_smoke.py checks them).
ROW_KEYS: Final = (
    "replay_otlp.rate", "replay_otlp.rss", "replay_otlp.wide", "replay_actions.rate", "replay_actions.rss",
    "replay_skill.clean.pack", "replay_skill.clean.all", "replay_skill.flaws.pack", "replay_skill.flaws.all",
    "replay_skill.violation", "replay_skill.violation.pair.text", "replay_skill.violation.pair.json",
    "replay_skill.clean.floor", "replay_skill.flaws.floor", "replay_skill.clean.ideal", "replay_skill.flaws.ideal",
    "replay_skill.startup", "replay_skill.shapes",
    "replay_rss.small", "replay_rss.large", "replay_rss.actions.small", "replay_rss.actions.large",
    "live.sustained", "live.sustained.other", "live.sustained.replicas",
    "live.p50.default", "live.p99.default",
    "live.p50.zero", "live.p99.zero", "memory.smaller", "memory.larger",
    "rules.shipped", "rules.10", "rules.50", "rules.200",
)


@dataclass(frozen=True)
class Size:
    spans: int
    sessions: int
    actions: int
    live_rates: tuple[int, ...]
    live_step_s: float
    memory_sessions: tuple[int, ...]
    rule_records: int
    skill_lines: int = 200_000


SIZES: Final = {
    "tiny": Size(spans=10_240, sessions=100, actions=10_000, live_rates=(2_000,), live_step_s=1.0,
                 memory_sessions=(1_000, 5_000), rule_records=2_000, skill_lines=5_000),
    "small": Size(spans=102_400, sessions=1_000, actions=100_000,
                  live_rates=(5_000, 10_000, 15_000, 20_000, 25_000, 30_000, 40_000), live_step_s=5.0,
                  memory_sessions=(10_000, 100_000), rule_records=20_000, skill_lines=50_000),
    "full": Size(spans=1_000_000, sessions=10_000, actions=1_000_000,
                 live_rates=(5_000, 10_000, 15_000, 20_000, 25_000, 30_000, 35_000, 40_000, 50_000, 60_000),
                 live_step_s=20.0, memory_sessions=(10_000, 100_000), rule_records=50_000),
}
RULE_COUNTS: Final = (10, 50, 200)

# Targets, stated once: (comparison, threshold).
TARGET_OTLP_RATIO: Final = 0.6
# The second OTLP dump: the same story with this many more attributes a span that no profile reads.
WIDE_EXTRA_ATTRIBUTES: Final = 30
WIDE_SPANS_LIMIT: Final = 102_400
TARGET_ACTIONS_RATIO: Final = 2.0
# replay --pack durable-sessions beside the skill's checks inline; all shipped packs; one violation.
TARGET_SKILL_PACK_RATIO: Final = 2.0
TARGET_SKILL_ALL_RATIO: Final = 1.0
TARGET_VIOLATION_US: Final = 2.0
# Shares of flawed lines: ~4% of lines flag (the Story's rate), and ~0.85 violations per line.
SKILL_LOGS: Final = (("clean", 0.04), ("flaws", 0.68))
# The clean log's cost per line may grow this much when its records take thousands of shapes.
TARGET_SHAPES_GROWTH: Final = 1.1
TARGET_LIVE_SPANS_S: Final = 25_000
# Serves side by side on one machine in the live section's replicas row (one per core of the target machine).
LIVE_REPLICAS: Final = 2
TARGET_P99_MS: Final = 250.0
TARGET_SESSION_BYTES: Final = 2048
# Replay's peak RSS at the whole input against a tenth of it, the same sessions in both.
TARGET_RSS_GROWTH: Final = 1.3


# -- measuring a command ------------------------------------------------------------------


@dataclass(frozen=True)
class Measured:
    wall_s: float
    cpu_s: float
    peak_rss_mib: float
    returncode: int
    stdout: bytes


def child_env() -> dict[str, str]:
    """The environment of measured processes: compiled bytecode is cached (under bench/out/), as in an install."""
    env = build.child_env(PYTHONPYCACHEPREFIX=str(OUT / "pycache"))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def run_measured(command: Sequence[str], timeout_s: float = 3600.0) -> Measured:
    """Run ``command`` (``python -m MODULE ...``) in a fresh process.

    CPU time from ``wait4`` (this child's alone, not its siblings'); peak RSS from the
    child's own address space (see :mod:`bench.peak`).
    """
    if list(command[:2]) != [sys.executable, "-m"]:
        raise ValueError("run_measured runs python -m MODULE commands")
    stdout_path = OUT / f".stdout-{os.getpid()}"
    peak_path = OUT / f".peak-{os.getpid()}"
    peak_path.unlink(missing_ok=True)
    env = {**child_env(), "BENCH_PEAK_FILE": str(peak_path)}
    command = [sys.executable, "-m", "bench.peak", *command[2:]]
    with stdout_path.open("wb") as stdout:
        started = time.perf_counter()
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=stdout, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while True:
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                process.kill()
                pid, status, usage = os.wait4(process.pid, 0)
                break
            time.sleep(0.005)
        wall = time.perf_counter() - started
    process.returncode = os.waitstatus_to_exitcode(status)
    stderr = process.stderr.read() if process.stderr is not None else b""
    if process.stderr is not None:
        process.stderr.close()
    output = stdout_path.read_bytes()
    stdout_path.unlink()
    peak_kib = int(peak_path.read_text(encoding="ascii")) if peak_path.exists() else 0
    peak_path.unlink(missing_ok=True)
    # replay exits 1 when it found violations: that is its normal answer here.
    if process.returncode not in (0, 1):
        tail = stderr.decode(errors="replace")[-2000:]
        raise RuntimeError(f"{' '.join(command)} exited {process.returncode}: {tail}")
    return Measured(wall, usage.ru_utime + usage.ru_stime, peak_kib / 1024, process.returncode, output)


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


def replay_command(path: Path, input_format: str, report_format: str = "json") -> list[str]:
    return python("-m", "processor.cli", "replay", "--format", report_format, "--input-format", input_format, str(path))


_VERDICT: Final = re.compile(r"(?:(\d+) violation\(s\) in (\d+) action\(s\)|(\d+) action\(s\), no violations)")


def text_counts(stdout: bytes) -> tuple[int, int]:
    """(actions, violations) from the text report's last line (the verdict)."""
    last = stdout.rstrip().rsplit(b"\n", 1)[-1].decode()
    match = _VERDICT.search(last)
    if match is None:
        raise RuntimeError(f"no verdict in the text report's last line: {last[:200]!r}")
    if match.group(3) is not None:
        return int(match.group(3)), 0
    return int(match.group(2)), int(match.group(1))


# -- inputs -------------------------------------------------------------------------------


def data_dir() -> Path:
    path = OUT / "data"
    path.mkdir(parents=True, exist_ok=True)
    return path


def otlp_dump(spans: int, sessions: int, log: Callable[[str], None], extra: int = 0) -> tuple[Path, dict[str, int]]:
    wide = f"-x{extra}" if extra else ""
    path = data_dir() / f"otlp-{spans}-{sessions}{wide}-v{generate.GENERATOR_VERSION}.bin"
    sidecar = generate.flaws_path(path)
    if not (path.exists() and sidecar.exists()):
        log(f"generating {spans:,} spans of {sessions:,} sessions into {path.relative_to(ROOT)} ...")
        generate.write_otlp_stream(path, spans, sessions, extra=extra)
    stats: dict[str, int] = orjson.loads(sidecar.read_bytes())["stats"]
    return path, stats


def action_log(records: int, sessions: int, log: Callable[[str], None]) -> tuple[Path, dict[str, int]]:
    path = data_dir() / f"actions-{records}-{sessions}-v{generate.GENERATOR_VERSION}.jsonl"
    meta = path.with_name(path.name + ".stats.json")
    if not (path.exists() and meta.exists()):
        log(f"generating {records:,} action records of {sessions:,} sessions into {path.relative_to(ROOT)} ...")
        stats = generate.write_action_log(path, records, sessions)
        meta_tmp = meta.with_name(f"{meta.name}.{os.getpid()}.partial")
        meta_tmp.write_bytes(orjson.dumps(stats.as_dict()))
        meta_tmp.replace(meta)
    result: dict[str, int] = orjson.loads(meta.read_bytes())
    return path, result


# -- table --------------------------------------------------------------------------------


@dataclass
class Row:
    key: str  # stable name of the row (the smoke test checks every one is present)
    metric: str
    value: float | None
    unit: str
    reference: str = ""
    ratio: float | None = None
    target: str = ""
    met: bool | None = None
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit in ("spans/s", "records/s", "spans/CPU-s", "records/CPU-s", "B/session"):
        return f"{value:,.0f} {unit}"
    if unit in ("MiB", "ms", "us/record"):
        return f"{value:,.1f} {unit}"
    return f"{value:,.2f} {unit}".rstrip()


def render(rows: list[Row]) -> str:
    header = ("metric", "value", "limit / reference", "ratio", "target", "met")
    body = [
        (
            row.metric,
            _fmt(row.value, row.unit),
            row.reference,
            "-" if row.ratio is None else f"{row.ratio:.2f}",
            row.target,
            {True: "yes", False: "NO", None: ""}[row.met],
        )
        for row in rows
    ]
    widths = [max(len(line[i]) for line in (header, *body)) for i in range(len(header))]
    out = [" | ".join(cell.ljust(width) for cell, width in zip(header, widths, strict=True))]
    out.append("-+-".join("-" * width for width in widths))
    out += [" | ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)) for line in body]
    return "\n".join(out)


def render_markdown(rows: list[Row]) -> str:
    out = ["| metric | value | limit / reference | ratio | target | met |", "|---|---|---|---|---|---|"]
    for row in rows:
        ratio = "-" if row.ratio is None else f"{row.ratio:.2f}"
        met = {True: "yes", False: "**no**", None: ""}[row.met]
        out.append(f"| {row.metric} | {_fmt(row.value, row.unit)} | {row.reference} | {ratio} | {row.target} | {met} |")
    return "\n".join(out)


# -- sections -----------------------------------------------------------------------------


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def alternated(first: Sequence[str], second: Sequence[str], runs: int) -> tuple[list[Measured], list[Measured]]:
    """Two commands run in turn ``runs`` times, so that background load hits both alike.

    Each runs once unmeasured first: bytecode cache and page cache as a second run finds them.
    """
    run_measured(first)
    run_measured(second)
    firsts: list[Measured] = []
    seconds: list[Measured] = []
    for _ in range(runs):
        firsts.append(run_measured(first))
        seconds.append(run_measured(second))
    return firsts, seconds


def replay_vs_limit(path: Path, input_format: str, limit: str, *, items: int, expected_actions: int,
                    runs: int, extra: Sequence[str] = (), report_format: str = "json") -> dict[str, Any]:
    """Replay and its limit loop, alternated so that background load hits both alike.

    ``extra``: replay options (``--pack durable-sessions``); ``report_format``: json, or
    text (the reference checker's shape, counts read from its verdict line).
    """
    command = [*replay_command(path, input_format, report_format), *extra]
    limit_runs, replay_runs = alternated(python("-m", "bench.limits", limit, str(path)), command, runs)
    report: dict[str, Any] = {}
    for limit_run, replay_run in zip(limit_runs, replay_runs, strict=True):
        seen = orjson.loads(limit_run.stdout)["items"]
        if seen != items:
            raise RuntimeError(f"limit loop saw {seen} items, expected {items}")
        if report_format == "text":
            actions, found = text_counts(replay_run.stdout)
            report = {"actions": actions, "violations": found}
        else:
            report = orjson.loads(replay_run.stdout)
        if expected_actions >= 0 and report["actions"] != expected_actions:
            raise RuntimeError(f"replay read {report['actions']} actions, expected {expected_actions}")
    # Rates per CPU-second of the process (user + system; both are single-threaded): other
    # processes on the machine do not count against it. Wall-clock rates are kept beside them.
    return {
        "items": items,
        "violations": report["violations"] if isinstance(report["violations"], int) else len(report["violations"]),
        "replay_rate": _median([items / r.cpu_s for r in replay_runs]),
        "replay_wall_rate": _median([items / r.wall_s for r in replay_runs]),
        "replay_peak_rss_mib": _median([r.peak_rss_mib for r in replay_runs]),
        "limit_rate": _median([items / r.cpu_s for r in limit_runs]),
        "limit_wall_rate": _median([items / r.wall_s for r in limit_runs]),
        "limit_peak_rss_mib": _median([r.peak_rss_mib for r in limit_runs]),
        "ratio": _median([lr.cpu_s / rr.cpu_s for rr, lr in zip(replay_runs, limit_runs, strict=True)]),
        "wall_ratio": _median([lr.wall_s / rr.wall_s for rr, lr in zip(replay_runs, limit_runs, strict=True)]),
        "replay_wall_s": [r.wall_s for r in replay_runs],
        "replay_cpu_s": [r.cpu_s for r in replay_runs],
        "limit_wall_s": [r.wall_s for r in limit_runs],
        "limit_cpu_s": [r.cpu_s for r in limit_runs],
    }


def section_replay_otlp(size: Size, runs: int, log: Callable[[str], None], details: dict[str, Any]) -> list[Row]:
    path, stats = otlp_dump(size.spans, size.sessions, log)
    log(f"replay_otlp: {stats['spans']:,} spans, {stats['attributes'] / stats['spans']:.1f} attributes a span, "
        f"{stats['flawed_actions'] / stats['actions']:.1%} of actions flawed")
    result = replay_vs_limit(path, "otlp-proto-stream", "otlp", items=stats["spans"],
                             expected_actions=stats["actions"], runs=runs)
    result["input"] = stats
    details["replay_otlp"] = result
    ratio = result["ratio"]
    return [
        Row("replay_otlp.rate", f"replay OTLP proto stream ({stats['spans']:,} spans)", result["replay_rate"],
            "spans/CPU-s",
            f"{result['limit_rate']:,.0f} spans/CPU-s (parse + read needed attributes)", ratio,
            f">= {TARGET_OTLP_RATIO}x limit", ratio >= TARGET_OTLP_RATIO),
        Row("replay_otlp.rss", "replay OTLP: peak RSS", result["replay_peak_rss_mib"], "MiB",
            f"{result['limit_peak_rss_mib']:,.1f} MiB (limit loop)"),
        _replay_otlp_wide(size, runs, log, details),
    ]


def _replay_otlp_wide(size: Size, runs: int, log: Callable[[str], None], details: dict[str, Any]) -> Row:
    """The same story, each span carrying WIDE_EXTRA_ATTRIBUTES more attributes that no profile reads."""
    # At most 102,400 spans: at full size a million such spans would be a 2 GB file.
    path, stats = otlp_dump(min(size.spans, WIDE_SPANS_LIMIT), size.sessions, log, extra=WIDE_EXTRA_ATTRIBUTES)
    per_span = stats["attributes"] / stats["spans"]
    log(f"replay_otlp (wide): {stats['spans']:,} spans, {per_span:.1f} attributes a span")
    result = replay_vs_limit(path, "otlp-proto-stream", "otlp", items=stats["spans"],
                             expected_actions=stats["actions"], runs=runs)
    result["input"] = stats
    details["replay_otlp_wide"] = result
    ratio = result["ratio"]
    return Row("replay_otlp.wide", f"replay OTLP proto stream, {per_span:.0f} attributes a span", result["replay_rate"],
               "spans/CPU-s", f"{result['limit_rate']:,.0f} spans/CPU-s (parse + read needed attributes)", ratio,
               f">= {TARGET_OTLP_RATIO}x limit", ratio >= TARGET_OTLP_RATIO)


def section_replay_actions(size: Size, runs: int, log: Callable[[str], None], details: dict[str, Any]) -> list[Row]:
    path, stats = action_log(size.actions, size.sessions, log)
    log(f"replay_actions: {stats['actions']:,} lines")
    result = replay_vs_limit(path, "actions", "actions", items=stats["actions"], expected_actions=stats["actions"],
                             runs=runs)
    result["input"] = stats
    details["replay_actions"] = result
    ratio = result["ratio"]
    return [
        Row("replay_actions.rate", f"replay action log ({stats['actions']:,} lines)", result["replay_rate"],
            "records/CPU-s",
            f"{result['limit_rate']:,.0f} records/CPU-s (json.loads loop)", ratio,
            f">= {TARGET_ACTIONS_RATIO}x loop", ratio >= TARGET_ACTIONS_RATIO),
        Row("replay_actions.rss", "replay action log: peak RSS", result["replay_peak_rss_mib"], "MiB",
            f"{result['limit_peak_rss_mib']:,.1f} MiB (json.loads loop)"),
    ]


def skill_log(lines: int, name: str, flaw_share: float, log: Callable[[str], None],
              varied: bool = False) -> tuple[Path, dict[str, int]]:
    path = data_dir() / f"skill-{name}-{lines}-v{generate.GENERATOR_VERSION}.jsonl"
    meta = path.with_name(path.name + ".stats.json")
    if not (path.exists() and meta.exists()):
        log(f"generating {lines:,} lines of the skill's shape ({name}) into {path.relative_to(ROOT)} ...")
        stats = generate.write_skill_log(path, lines, max(1, lines // 100), flaw_share, varied=varied)
        meta.write_bytes(orjson.dumps(stats.as_dict()))
    result: dict[str, int] = orjson.loads(meta.read_bytes())
    return path, result


def section_replay_skill(size: Size, runs: int, log: Callable[[str], None], details: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    results: dict[str, Any] = {}
    for name, share in SKILL_LOGS:
        path, stats = skill_log(size.skill_lines, name, share, log)
        lines = stats["actions"]
        for packs, extra, target in (("pack", ("--pack", "durable-sessions"), TARGET_SKILL_PACK_RATIO),
                                     ("all", (), TARGET_SKILL_ALL_RATIO)):
            # Replay counts malformed lines apart from actions; the limit loop counts every line.
            result = replay_vs_limit(path, "actions", "skill", items=lines, expected_actions=-1, runs=runs,
                                     extra=extra, report_format="text")
            results[f"{name}.{packs}"] = result
            ratio = result["ratio"]
            label = "skill's pack alone" if packs == "pack" else "all shipped packs"
            log(f"replay_skill: {name}, {label}: {ratio:.2f}x the inline checks")
            rows.append(Row(f"replay_skill.{name}.{packs}",
                            f"replay skill-shaped log, {name} ({lines:,} lines, {result['violations']:,} violations), "
                            f"{label}", result["replay_rate"], "lines/CPU-s",
                            f"{result['limit_rate']:,.0f} lines/CPU-s (json.loads + ten checks inline)", ratio,
                            f">= {target}x loop", ratio >= target))
    clean, flaws = results["clean.pack"], results["flaws.pack"]
    extra_violations = flaws["violations"] - clean["violations"]
    per_violation = None
    if extra_violations > 0:
        # Both logs have the same length and record mix; the difference in CPU is what violations cost.
        cpu = _median(flaws["replay_cpu_s"]) - _median(clean["replay_cpu_s"])
        per_violation = max(0.0, cpu) / extra_violations * 1e6
    rows.append(Row("replay_skill.violation",
                    "cost of one violation, flaw-heavy log against the clean one (skill's pack, text report)",
                    per_violation, "us", "CPU difference of the two logs / extra violations (malformed lines "
                    "and the other shapes of flawed lines count too)", None, f"<= {TARGET_VIOLATION_US} us",
                    None if per_violation is None else per_violation <= TARGET_VIOLATION_US))
    for fmt in ("text", "json"):
        pair = violation_pair(size.skill_lines, fmt, runs)
        results[f"violation.pair.{fmt}"] = pair
        log(f"replay_skill: one violation, controlled pair, {fmt} report: {pair['us_per_violation']:.2f} us")
        rows.append(Row(f"replay_skill.violation.pair.{fmt}",
                        f"cost of one violation, {pair['violations']:,} payments with and without their key "
                        f"(skill's pack, {fmt} report)",
                        pair["us_per_violation"], "us",
                        "median of the CPU differences of alternated runs of the two logs / violations "
                        f"(difference of the medians: {pair['us_per_violation_of_medians']:.2f} us)", None,
                        f"<= {TARGET_VIOLATION_US} us", pair["us_per_violation"] <= TARGET_VIOLATION_US))
    # The floor beside the loop: how far a Python replay could go at most, and what the target leaves.
    for name, share in SKILL_LOGS:
        path, stats = skill_log(size.skill_lines, name, share, log)
        floor = loop_vs_skill(path, "floor", items=stats["actions"], runs=runs)
        results[f"{name}.floor"] = floor
        budget_us = (_median(floor["limit_cpu_s"]) / TARGET_SKILL_PACK_RATIO
                     - _median(floor["loop_cpu_s"])) / stats["actions"] * 1e6
        floor["budget_us_per_line"] = budget_us
        log(f"replay_skill: {name}, the floor: {floor['ratio']:.2f}x the inline checks; {TARGET_SKILL_PACK_RATIO}x "
            f"leaves {budget_us:.2f} us a line past the parse")
        rows.append(Row(f"replay_skill.{name}.floor",
                        f"the floor of a Python replay, {name}: each line read and parsed typed (msgspec), "
                        "nothing else", floor["loop_rate"], "lines/CPU-s",
                        f"{floor['limit_rate']:,.0f} lines/CPU-s (the loop)", floor["ratio"],
                        f"recorded: {TARGET_SKILL_PACK_RATIO}x the loop leaves {budget_us:.2f} us a line "
                        "past the parse, start-up and report included"))
    # The ceiling beside the loop: every shipped rule inline, in the least work each needs. Replay
    # with all packs can be no faster than this, whatever its evaluator is made of.
    for name, share in SKILL_LOGS:
        path, stats = skill_log(size.skill_lines, name, share, log)
        ideal = loop_vs_skill(path, "ideal", items=stats["actions"], runs=runs)
        results[f"{name}.ideal"] = ideal
        replay_all = results[f"{name}.all"]
        ideal["replay_all_share"] = _median(ideal["loop_cpu_s"]) / _median(replay_all["replay_cpu_s"])
        log(f"replay_skill: {name}, every pack inline: {ideal['ratio']:.2f}x the inline checks; replay with all "
            f"packs takes {1 / ideal['replay_all_share']:.2f}x its CPU")
        rows.append(Row(f"replay_skill.{name}.ideal",
                        f"every shipped rule inline, {name}: typed parse, plain dicts per session, counts only",
                        ideal["loop_rate"], "lines/CPU-s", f"{ideal['limit_rate']:,.0f} lines/CPU-s (the loop)",
                        ideal["ratio"],
                        f"recorded: the most all packs could reach ({TARGET_SKILL_ALL_RATIO}x asked); replay "
                        f"with all packs at {ideal['replay_all_share']:.2f} of its speed"))
    startup = startup_cost(runs)
    results["startup"] = startup
    log(f"replay_skill: start-up {startup['startup_ms']:.1f} ms of CPU past the floor's")
    rows.append(Row("replay_skill.startup", "replay's start-up (skill's pack, a one-line log) past the floor's",
                    startup["startup_ms"], "ms", f"{_median(startup['floor_cpu_s']) * 1e3:.1f} ms for the floor "
                    "(interpreter and parser)", None, "recorded"))
    # The clean log again, its records in thousands of shapes (payload keys, key order): the
    # growth of replay's cost per line beside the growth of the loop's (which parses more bytes).
    path, stats = skill_log(size.skill_lines, "varied", SKILL_LOGS[0][1], log, varied=True)
    varied = replay_vs_limit(path, "actions", "skill", items=stats["actions"], expected_actions=-1, runs=runs,
                             extra=("--pack", "durable-sessions"), report_format="text")
    results["varied.pack"] = varied
    growth = _median(varied["replay_cpu_s"]) / _median(clean["replay_cpu_s"])
    limit_growth = _median(varied["limit_cpu_s"]) / _median(clean["limit_cpu_s"])
    log(f"replay_skill: thousands of record shapes: replay x{growth:.2f}, the loop x{limit_growth:.2f}")
    rows.append(Row("replay_skill.shapes", "replay CPU, clean log in thousands of record shapes / in a few (pack)",
                    growth, "x", f"x{limit_growth:.2f} for the loop (more bytes to parse)", None,
                    f"<= {TARGET_SHAPES_GROWTH} x the loop's growth",
                    growth <= TARGET_SHAPES_GROWTH * limit_growth))
    details["replay_skill"] = results
    return rows


def loop_vs_skill(path: Path, loop: str, *, items: int, runs: int) -> dict[str, Any]:
    """The skill's loop and another of ``bench.limits``'s loops (the floor, the ideal), alternated."""
    limit_runs, loop_runs = alternated(python("-m", "bench.limits", "skill", str(path)),
                                       python("-m", "bench.limits", loop, str(path)), runs)
    for kind, done in (*(("skill", r) for r in limit_runs), *((loop, r) for r in loop_runs)):
        seen = orjson.loads(done.stdout)["items"]
        if seen != items:
            raise RuntimeError(f"{kind} loop saw {seen} items, expected {items}")
    return {
        "items": items,
        "loop_rate": _median([items / r.cpu_s for r in loop_runs]),
        "limit_rate": _median([items / r.cpu_s for r in limit_runs]),
        "ratio": _median([lr.cpu_s / fr.cpu_s for fr, lr in zip(loop_runs, limit_runs, strict=True)]),
        "loop_cpu_s": [r.cpu_s for r in loop_runs],
        "limit_cpu_s": [r.cpu_s for r in limit_runs],
    }


def startup_cost(runs: int) -> dict[str, Any]:
    """CPU of replay (the skill's pack) on a one-line log, past the floor's on the same line, alternated."""
    path = data_dir() / f"skill-one-v{generate.GENERATOR_VERSION}.jsonl"
    if not path.exists():
        path.write_bytes(b'{"session_id":"s-1","action_id":"a-1","kind":"checkpoint","status":"ok",'
                         b'"time":"2026-11-01T09:14:00Z","result":{"n":0}}\n')
    command = [*replay_command(path, "actions", "text"), "--pack", "durable-sessions"]
    # A run takes a tenth of a second: a few more than ``runs`` cost nothing.
    replay_runs, floor_runs = alternated(command, python("-m", "bench.limits", "floor", str(path)), max(runs, 5))
    return {
        "startup_ms": _median([(r.cpu_s - f.cpu_s) * 1e3 for r, f in zip(replay_runs, floor_runs, strict=True)]),
        "replay_cpu_s": [r.cpu_s for r in replay_runs],
        "floor_cpu_s": [r.cpu_s for r in floor_runs],
    }


def violation_pair(lines: int, report_format: str, runs: int) -> dict[str, Any]:
    """Replay (the skill's pack) of two logs that differ only in one violation a line, alternated."""
    keyed = data_dir() / f"pair-keyed-{lines}-v{generate.GENERATOR_VERSION}.jsonl"
    unkeyed = data_dir() / f"pair-unkeyed-{lines}-v{generate.GENERATOR_VERSION}.jsonl"
    if not (keyed.exists() and unkeyed.exists()):
        generate.write_violation_pair(keyed, unkeyed, lines, max(1, lines // 100))
    keyed_command, unkeyed_command = ([*replay_command(path, "actions", report_format), "--pack", "durable-sessions"]
                                      for path in (keyed, unkeyed))
    measured = dict(zip(("keyed", "unkeyed"), alternated(keyed_command, unkeyed_command, runs), strict=True))
    cpu = {name: [m.cpu_s for m in runs_of] for name, runs_of in measured.items()}
    found: dict[str, int] = {}
    for name, runs_of in measured.items():
        for m in runs_of:
            if report_format == "text":
                found[name] = text_counts(m.stdout)[1]
            else:
                found[name] = len(orjson.loads(m.stdout)["violations"])
    if found != {"keyed": 0, "unkeyed": lines}:
        raise RuntimeError(f"the pair's violations are {found}, expected none and {lines}")
    # Each pair's two runs are seconds apart: the median of their differences leaves out the
    # machine's drift over the section (up to a third), which the medians' difference keeps.
    differences = [unkeyed - keyed for keyed, unkeyed in zip(cpu["keyed"], cpu["unkeyed"], strict=True)]
    of_medians = _median(cpu["unkeyed"]) - _median(cpu["keyed"])
    return {"violations": lines, "keyed_cpu_s": cpu["keyed"], "unkeyed_cpu_s": cpu["unkeyed"],
            "us_per_violation": max(0.0, _median(differences)) / lines * 1e6,
            "us_per_violation_by_pair": [round(d / lines * 1e6, 3) for d in differences],
            "us_per_violation_of_medians": max(0.0, of_medians) / lines * 1e6}


def section_replay_rss(size: Size, runs: int, log: Callable[[str], None], details: dict[str, Any]) -> list[Row]:
    # The same sessions in both inputs, ten times as long in the second: only the input's length differs
    # (what grows with the number of open sessions is the memory section's subject).
    rows = []
    spans_by_length: dict[int, float] = {}
    for spans, sessions in ((size.spans // 10, size.sessions), (size.spans, size.sessions)):
        path, stats = otlp_dump(spans, sessions, log)
        log(f"replay_rss: {stats['spans']:,} spans")
        peaks = [run_measured(replay_command(path, "otlp-proto-stream")).peak_rss_mib for _ in range(runs)]
        spans_by_length[stats["spans"]] = _median(peaks)
    actions_by_length: dict[int, float] = {}
    for records in (size.actions // 10, size.actions):
        path, _ = action_log(records, size.sessions, log)
        log(f"replay_rss: {records:,} action-log lines")
        peaks = [run_measured(replay_command(path, "actions")).peak_rss_mib for _ in range(runs)]
        actions_by_length[records] = _median(peaks)
    details["replay_rss"] = {"peak_rss_mib_by_spans": spans_by_length, "peak_rss_mib_by_lines": actions_by_length}
    held = f"{size.sessions:,} sessions"
    for key, unit, measured in (("replay_rss", "spans", spans_by_length),
                                ("replay_rss.actions", "action-log lines", actions_by_length)):
        (small, small_rss), (large, large_rss) = sorted(measured.items())
        growth = large_rss / small_rss
        rows.append(Row(f"{key}.small", f"replay peak RSS at {small:,} {unit}, {held}", small_rss, "MiB"))
        rows.append(Row(f"{key}.large", f"replay peak RSS at {large:,} {unit}, {held}", large_rss, "MiB",
                        f"{small_rss:,.1f} MiB at {small // 1000:,}k {unit}", growth,
                        f"<= {TARGET_RSS_GROWTH}x", growth <= TARGET_RSS_GROWTH))
    return rows


class LiveStep(Protocol):
    """What the search reads of a step: one serve's (live.StepResult) or replicas' (live.ReplicasResult)."""

    @property
    def offered_spans_s(self) -> float: ...
    @property
    def achieved_spans_s(self) -> float: ...
    @property
    def lossless(self) -> bool: ...
    @property
    def sustained(self) -> bool: ...
    @property
    def state_backend(self) -> str: ...
    @property
    def errors(self) -> dict[str, int]: ...
    @property
    def retried(self) -> dict[str, int]: ...
    @property
    def evaluated_spans(self) -> int | None: ...
    @property
    def sent_spans(self) -> int: ...


Step = TypeVar("Step", bound=LiveStep)


def sustained_search(rates: Sequence[int], run: Callable[[float], Step],
                     log: Callable[[str], None]) -> tuple[list[Step], Step | None]:
    """Step the offered load up until a step is not sustained; the steps run and the last sustained one."""
    steps: list[Step] = []
    sustained: Step | None = None
    for offered in rates:
        step = run(offered)
        steps.append(step)
        log(f"live ({step.state_backend}): offered {offered:,} spans/s -> achieved {step.achieved_spans_s:,.0f}, "
            f"lossless={step.lossless}, sustained={step.sustained}")
        if not step.sustained:
            break
        sustained = step
    return steps, sustained


def sustained_row(key: str, steps: Sequence[LiveStep], sustained: LiveStep | None, label: str) -> Row:
    rate = sustained.offered_spans_s if sustained is not None else 0.0
    last = steps[-1]
    stopped = f"every step up to {last.offered_spans_s:,.0f} offered was sustained"
    if last is not sustained:
        stopped = (f"{last.offered_spans_s:,.0f} offered: {last.achieved_spans_s:,.0f} achieved, "
                   f"errors {last.errors or 'none'}, retried {last.retried or 'none'}, "
                   f"evaluated {last.evaluated_spans}/{last.sent_spans}")
    return Row(key, f"serve sustained, nothing lost (state: {label})", rate, "spans/s",
               stopped, None, f">= {TARGET_LIVE_SPANS_S:,}", rate >= TARGET_LIVE_SPANS_S)


def section_live(size: Size, runs: int, log: Callable[[str], None], details: dict[str, Any],
                 postgres_dsn: str | None = None) -> list[Row]:
    path, _ = otlp_dump(size.spans, size.sessions, log)
    def one_serve(state_backend: str | None, postgres_dsn: str | None = None) -> Callable[[float], live.StepResult]:
        return lambda offered: live.run_step(path, offered, size.live_step_s, state_backend=state_backend,
                                             postgres_dsn=postgres_dsn)

    steps, sustained = sustained_search(size.live_rates, one_serve(None), log)
    details["live_steps"] = [s.as_dict() for s in steps]
    backend = steps[0].state_backend
    rows = [sustained_row("live.sustained", steps, sustained, f"{backend}, the default")]
    # The other store, so that both the in-memory and the crash-safe numbers are in every table.
    other = "sqlite" if backend != "sqlite" else "memory"
    other_steps, other_sustained = sustained_search(size.live_rates, one_serve(other), log)
    details[f"live_steps_{other}"] = [s.as_dict() for s in other_steps]
    rows.append(sustained_row("live.sustained.other", other_steps, other_sustained, other))
    # Two replicas of the default store side by side on this machine, the sessions split between
    # them as the Collector routes them: what the machine sustains, beside what one process does.
    # Steps start at the rate one replica sustained (below it, two replicas are sure to).
    start = sustained.offered_spans_s if sustained is not None else 0.0
    pair_rates = [rate for rate in size.live_rates if rate >= start] or [size.live_rates[-1]]
    pair_steps, pair_sustained = sustained_search(
        pair_rates, lambda offered: live.run_replicas(path, offered, size.live_step_s, LIVE_REPLICAS), log)
    details["live_steps_replicas"] = [p.as_dict() for p in pair_steps]
    row = sustained_row("live.sustained.replicas", pair_steps, pair_sustained,
                        f"{backend}, {LIVE_REPLICAS} serves on this machine, sessions split between them, each its "
                        "own state")
    rows.append(replace(row, target=f"recorded (one serve's target: >= {TARGET_LIVE_SPANS_S:,})", met=None))
    if postgres_dsn is not None:
        # One replica, the database beside it: a figure recorded, not held to the target.
        pg_steps, pg_sustained = sustained_search(size.live_rates, one_serve("postgres", postgres_dsn), log)
        details["live_steps_postgres"] = [s.as_dict() for s in pg_steps]
        row = sustained_row("live.sustained.postgres", pg_steps, pg_sustained, "postgres, one replica")
        rows.append(replace(row, target="recorded", met=None))
    rate = sustained.offered_spans_s if sustained is not None else 0.0
    half = rate / 2
    for lateness in (None, "0s"):
        name = "default" if lateness is None else "zero"
        if sustained is None:
            for q in ("p50", "p99"):
                rows.append(Row(f"live.{q}.{name}", f"send -> violation {q}, allowed_lateness {lateness or 'default'}",
                                None, "ms", "not measured: no offered rate was sustained"))
            continue
        results = [live.run_step(path, half, size.live_step_s, allowed_lateness=lateness) for _ in range(runs)]
        p50s = [r.percentile_ms(0.5) for r in results]
        p99s = [r.percentile_ms(0.99) for r in results]
        if any(p is None for p in p50s + p99s):
            for q in ("p50", "p99"):
                rows.append(Row(f"live.{q}.{name}", f"send -> violation {q}, allowed_lateness {lateness or 'default'}",
                                None, "ms", "not measured: no violation was timed"))
            continue
        p50 = _median([p for p in p50s if p is not None])
        p99 = _median([p for p in p99s if p is not None])
        label = results[0].allowed_lateness + (" (default)" if lateness is None else "")
        details[f"live_latency_lateness_{results[0].allowed_lateness}"] = [r.as_dict() for r in results]
        log(f"live latency at {half:,.0f} spans/s, allowed_lateness {label}: p50 {p50:.1f} ms, p99 {p99:.1f} ms")
        where = f"at {half:,.0f} spans/s, allowed_lateness {label}"
        rows.append(Row(f"live.p50.{name}", f"send -> violation p50 {where}", p50, "ms"))
        rows.append(Row(f"live.p99.{name}", f"send -> violation p99 {where}", p99, "ms",
                        "", None, f"< {TARGET_P99_MS:.0f} ms", p99 < TARGET_P99_MS,
                        "spans are held allowed_lateness for reordering" if lateness is None else ""))
    return rows


def section_memory(size: Size, runs: int, log: Callable[[str], None], details: dict[str, Any]) -> list[Row]:
    rows = []
    results = {}
    for name, sessions in zip(("smaller", "larger"), size.memory_sessions, strict=True):
        command = python("-m", "bench.bench_sessions_memory", "--child", str(sessions))
        values = [orjson.loads(run_measured(command).stdout)["bytes_per_session"] for _ in range(runs)]
        value = _median(values)
        results[sessions] = values
        log(f"memory: {sessions:,} idle sessions: {value:,.0f} B/session")
        rows.append(Row(f"memory.{name}", f"RSS per idle open session at {sessions:,} sessions", value, "B/session",
                        "", None, f"<= {TARGET_SESSION_BYTES} B", value <= TARGET_SESSION_BYTES))
    details["memory"] = results
    return rows


def section_rules(size: Size, runs: int, log: Callable[[str], None], details: dict[str, Any]) -> list[Row]:
    path, _ = action_log(size.actions, size.sessions, log)
    rows = []
    results: dict[str, Any] = {}
    for rules in ("shipped", *map(str, RULE_COUNTS)):
        samples = [
            orjson.loads(run_measured(python("-m", "bench.rulecost", "--log", str(path), "--records",
                                             str(size.rule_records), "--rules", rules)).stdout)
            for _ in range(runs)
        ]
        cost = _median([s["us_per_record"] for s in samples])
        results[rules] = samples
        count = samples[0]["rule_count"]
        label = f"shipped packs ({count} rules)" if rules == "shipped" else f"{count} generated condition rules"
        log(f"rules: {label}: {cost:.1f} us/record")
        rows.append(Row(f"rules.{rules}", f"evaluation per record, {label}", cost, "us/record",
                        "" if rules == "shipped" else f"{cost / count:.2f} us per rule"))
    details["rules"] = results
    return rows


SECTION_FUNCTIONS: Final = {
    "replay_otlp": section_replay_otlp,
    "replay_actions": section_replay_actions,
    "replay_skill": section_replay_skill,
    "replay_rss": section_replay_rss,
    "live": section_live,
    "memory": section_memory,
    "rules": section_rules,
}


def machine() -> dict[str, str]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        memory = subprocess.run(["free", "-h"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        memory = ""
    return {
        "nproc": str(len(os.sched_getaffinity(0))),
        "cpu": cpu,
        "memory": memory,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=tuple(SIZES), default="small")
    parser.add_argument("--runs", type=int, default=3, help="runs of each measurement (median reported)")
    parser.add_argument("--skip", action="append", default=[], choices=SECTIONS, help="leave a section out")
    parser.add_argument("--out", type=Path, default=OUT / "results.json")
    parser.add_argument("--build", choices=build.BUILDS, default="source",
                        help="measure the checkout's sources (as an editable install runs them) or its compiled wheel")
    parser.add_argument("--postgres", metavar="DSN", default=None,
                        help="live: also measure one replica with its state on this PostgreSQL server (a new "
                             "database per step, dropped after it)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    OUT.mkdir(parents=True, exist_ok=True)
    size = SIZES[args.size]
    started = time.monotonic()

    def log(message: str) -> None:
        sys.stderr.write(f"[{time.monotonic() - started:7.1f}s] {message}\n")
        sys.stderr.flush()

    build.select(args.build, log)
    rows: list[Row] = []
    details: dict[str, Any] = {"load_average": {}}
    for name in SECTIONS:
        if name in args.skip:
            continue
        # Other work on the machine skews wall-clock numbers (live above all): say how much there was.
        before = os.getloadavg()[0]
        if name == "live":
            rows += section_live(size, args.runs, log, details, postgres_dsn=args.postgres)
        else:
            rows += SECTION_FUNCTIONS[name](size, args.runs, log, details)
        details["load_average"][name] = {"before": before, "after": os.getloadavg()[0]}
    table = render(rows)
    sys.stdout.write(table + "\n")
    result = {
        "size": args.size,
        "runs": args.runs,
        "machine": machine(),
        # The server's DSN is not recorded: it may hold a password.
        "command": f"python -m bench --size {args.size} --runs {args.runs} --build {args.build}"
                   + (" --postgres DSN" if args.postgres is not None else ""),
        "build": args.build,
        "elapsed_s": time.monotonic() - started,
        "rows": [row.as_dict() for row in rows],
        "markdown": render_markdown(rows),
        "details": details,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    log(f"table written to {args.out}")
    return 0
