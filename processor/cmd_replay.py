"""``durable-check replay``: the streaming engine over trace dumps and action logs.

Exit 0: no violations; 1: violations or malformed items; 2: an input could not be read, the report could not
be written, or a usage error.
Replay is the serve pipeline fed from files: the same converter, engine and rules.
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, TYPE_CHECKING, Any, TextIO

from processor.errors import InputError, OutputError

if TYPE_CHECKING:
    from processor.config import Config
    from processor.convert import SpanConverter
    from processor.evaluate.engine import EngineOptions
    from processor.evaluate.model import RuleSet
    from processor.pipeline import Pipeline
    from processor.report import Report
    from processor.waivers import Exemptions

log = logging.getLogger("durable_check.replay")

INPUT_FORMATS = ("actions", "otlp-json-lines", "otlp-json", "otlp-proto", "otlp-proto-stream")
# Allocations between young-generation collections (the default is 700).
_GC_YOUNG_THRESHOLD = 100_000


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "replay",
        help="check trace dumps or action logs offline",
        description=(
            "Check whether the sessions in trace dumps or action logs would survive a crash. "
            "Exit 0: no violations; 1: violations or malformed items; 2: an input could not be read or the report "
            "could not be written."
        ),
    )
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="file to read (gzip/zstd ok); - for standard input")
    parser.add_argument("--strict", action="store_true", help="also run strict-only rules (e.g. DS008)")
    parser.add_argument("--format", choices=("text", "json", "html", "junit", "sarif"), default="text",
                        help="report format (default: text); html is one self-contained file, junit and sarif "
                             "are for CI systems")
    parser.add_argument("--output", metavar="FILE", help="write the report to FILE instead of standard output")
    parser.add_argument("--config", metavar="FILE", help="configuration whose convert: and evaluate: sections apply")
    parser.add_argument(
        "--rules", action="append", default=[], metavar="PATH", help="extra rule file (repeatable); adds or overrides"
    )
    parser.add_argument("--no-shipped-rules", action="store_true", help="run only the rules given with --rules")
    parser.add_argument(
        "--pack",
        action="append",
        default=[],
        metavar="NAME",
        help="run only this shipped pack's rules (repeatable; `rules list` names them), e.g. durable-sessions",
    )
    parser.add_argument(
        "--input-format", choices=INPUT_FORMATS, default=None, help="override format detection for every input"
    )
    parser.add_argument(
        "--full-engine",
        action="store_true",
        help="run action logs through the full engine even when the faster action-log lane gives the same report",
    )
    parser.add_argument(
        "--allowed-lateness", default=None, metavar="DURATION", help="how far out of order spans may arrive (e.g. 5s)"
    )
    parser.add_argument("--waivers", metavar="FILE",
                        help="waiver file: the findings it names are reported as waived and do not fail the run")
    parser.add_argument("--baseline", metavar="FILE",
                        help="fail only on findings not in this baseline (written with --write-baseline)")
    parser.add_argument("--write-baseline", metavar="FILE", help="write today's findings as a baseline to FILE")
    parser.set_defaults(func=run)


def load_config_or_none(path: str | None) -> Config | None:
    if not path:
        return None
    from processor.config import load_config

    # Replay uses only these sections: a serve configuration whose other sections
    # reference environment variables (a database DSN, a token) still works here.
    return load_config(path, sections=("convert", "evaluate"))


def allowed_lateness_s(config: Config | None, override: str | None) -> float:
    """How far out of order spans may arrive: ``--allowed-lateness``, else the configuration's, else 5 s.

    A command-line value that is no duration is a ConfigError naming the option (exit 2).
    """
    from processor.configfmt import parse_duration
    from processor.errors import ConfigError, Problem

    if override:
        try:
            return parse_duration(override)
        except ValueError as exc:
            raise ConfigError([Problem("--allowed-lateness", str(exc))]) from None
    return float(config.evaluate.allowed_lateness) if config is not None else 5.0


def make_converter(config_path: str | None, config: Config | None = None) -> SpanConverter:
    from processor.convert import ConvertOptions, SpanConverter

    if config is None:
        config = load_config_or_none(config_path)
    options = config.convert if config is not None else ConvertOptions()
    return SpanConverter(options)


def replay_rules(config: Config | None, *, strict: bool = False, rules: list[str] | None = None,
                 include_shipped: bool = True, packs: list[str] | None = None,
                 allowed_lateness: str | None = None) -> tuple[RuleSet, EngineOptions]:
    """The rules and engine options of a replay: the configuration's, with the command line's over them.

    The pytest plugin checks each test's spans with these too (durable_check.pytest_plugin).
    """
    from processor.evaluate.engine import EngineOptions
    from processor.evaluate.rulefmt import load_rules

    rule_paths: list[str] = []
    chosen: list[str] = []
    options = EngineOptions(mode="replay")
    remembered = options.max_remembered_entries
    limits = None
    if config is not None:
        ev = config.evaluate
        remembered = ev.max_remembered_entries
        limits = ev.rule_limits.cost_limits()
        strict = strict or ev.strict
        rule_paths.extend(ev.rules)
        include_shipped = include_shipped and ev.include_shipped_rules
        chosen = list(ev.packs)
    lateness = allowed_lateness_s(config, allowed_lateness)
    rule_paths.extend(rules or [])
    if packs:
        chosen = list(dict.fromkeys(packs))  # the command line's choice replaces the configuration's
    ruleset = load_rules(rule_paths, include_shipped=include_shipped, packs=chosen, limits=limits)
    options = EngineOptions(
        strict=strict,
        allowed_lateness_s=lateness,
        mode="replay",
        max_remembered_entries=remembered,
    )
    return ruleset, options


def run(args: argparse.Namespace) -> int:
    from processor.evaluate.engine import Engine
    from processor.pipeline import Pipeline
    from processor.report import Report

    config = load_config_or_none(args.config)
    ruleset, options = replay_rules(config, strict=args.strict, rules=args.rules,
                                    include_shipped=not args.no_shipped_rules, packs=args.pack,
                                    allowed_lateness=args.allowed_lateness)
    pipeline = Pipeline(Engine(ruleset, options))
    pipeline.exemptions = exemptions = load_exemptions(config, args.waivers, args.baseline)
    if args.format in ("html", "junit"):
        from processor.state.views import MAX_ACTIONS_PER_SESSION, MemoryViews, ViewBounds

        # These reports list sessions and their timelines: replay keeps the view's read model, for
        # every session the engine may hold (the action bound is then never the one reached).
        sessions = ev_max_sessions(config)
        pipeline.views = MemoryViews(ViewBounds(sessions, sessions * MAX_ACTIONS_PER_SESSION))

    report = Report(inputs=list(args.inputs))
    said: set[str] = set()
    if exemptions is not None or args.write_baseline:
        args.full_engine = True  # the action-log lane writes its report as it goes: nothing to mark or keep
    try:
        return _run_replay(args, config=config, pipeline=pipeline, ruleset=ruleset, options=options, report=report,
                           said=said)
    except BrokenPipeError:
        raise  # a reader that closed early: the command line's own answer
    except OSError as exc:
        # Inputs that cannot be read are InputErrors by now: what fails here is writing the report.
        raise _unwritable(args, exc) from None


def _run_replay(args: argparse.Namespace, *, config: Config | None, pipeline: Pipeline, ruleset: RuleSet,
                options: EngineOptions, report: Report, said: set[str]) -> int:
    """The lane where it applies (starting over on the engine if it gives way), else the engine."""
    from processor.evaluate.engine import Engine
    from processor.pipeline import Pipeline
    from processor.report import Report

    with _paced_garbage_collection():
        if not args.full_engine and _lane_may_apply(args):
            from processor.evaluate.loglane import LaneAborted, LogLane

            lane = LogLane(pipeline.engine, args.format)
            if lane.usable:
                report_file = _ReportFile.open(args)
                if report_file is not None:
                    lane.write_into(report_file.buffer, report_file.reread if args.format == "json" else None)
                try:
                    return _replay_lane(args, lane, report, said, report_file)
                except LaneAborted as exc:
                    log.info("replay: %s; running the full engine from the start", exc)
                    if report_file is not None:
                        report_file.undo()
                finally:
                    lane.close()
                    report.close()
                # Nothing was written: start again with a fresh engine and report.
                pipeline.engine.close()
                pipeline = Pipeline(Engine(ruleset, options))
                report = Report(inputs=list(args.inputs))
        # The span converter (and protobuf) is loaded only for replays that may read spans.
        return _replay(args, pipeline, lambda: make_converter(args.config, config), report, ruleset, said=said)


def load_exemptions(config: Config | None, waivers: str | None, baseline: str | None) -> Exemptions | None:
    """The waivers (``--waivers``, else the configuration's ``evaluate.waivers``) and baseline (``--baseline``,
    else ``evaluate.baseline``) a run honours."""
    from processor.waivers import Exemptions, load_baseline, load_waivers

    path = waivers or (config.evaluate.waivers if config is not None else "")
    baseline = baseline or (config.evaluate.baseline if config is not None else "") or None
    if not path and not baseline:
        return None
    return Exemptions(load_waivers(path) if path else None, load_baseline(baseline) if baseline else None,
                      baseline_name=baseline or "")


def _unwritable(args: argparse.Namespace, exc: OSError) -> OutputError:
    """The error for a report that cannot be written (a full disk, say), said once, without a traceback."""
    from processor.cli import error_detail, quiet_stdout
    from processor.report import printable

    where = f"--output {printable(args.output)}" if args.output else "standard output"
    if not args.output:
        quiet_stdout()
    return OutputError(f"cannot write the report to {where} ({error_detail(exc)})")


def _lane_may_apply(args: argparse.Namespace) -> bool:
    """Text and JSON reports of regular action-log files (see processor.evaluate.loglane)."""
    from processor.receive.files import STDIN, close_input, open_input

    if args.format not in ("text", "json") or len(set(args.inputs)) != len(args.inputs):
        return False
    for path in args.inputs:
        if path == STDIN:
            return False  # read once: there is no start to go back to
        try:
            handle, _, chosen, _ = open_input(path, args.input_format)
        except InputError:
            continue  # the lane says so as the engine would
        close_input(handle, path)
        if chosen != "actions":
            return False
    return True


def _replay_lane(args: argparse.Namespace, lane: Any, report: Report, said: set[str],
                 report_file: _ReportFile | None = None) -> int:
    from processor.report import verdict_line

    lane.run(list(args.inputs), args.input_format, report, said)
    out = report_file.out if report_file is not None else _open_output(args)
    if out is None:
        return 2
    try:
        if args.format == "json":
            lane.write_json(out)
        else:
            lane.write_text(out)
    finally:
        if out is sys.stdout:
            out.flush()
        else:
            out.close()
    if args.output and args.format == "json":
        sys.stderr.write(verdict_line(report) + "\n")
    return report.exit_code


def ev_max_sessions(config: Config | None) -> int:
    from processor.config import EvaluateConfig

    return (config.evaluate if config is not None else EvaluateConfig()).max_sessions


def _replay(args: argparse.Namespace, pipeline: Pipeline, new_converter: Callable[[], SpanConverter],
            report: Report, ruleset: RuleSet, *, said: set[str]) -> int:
    from processor.receive.files import read_batches
    from processor.report import printable

    # One converter for every input of spans, made at the first (action logs need none).
    converter = functools.cache(new_converter)

    try:
        for path in args.inputs:
            try:
                # The reader's batches (a block of lines, one OTLP message) bound memory whatever the input size.
                for batch in read_batches(path, args.input_format, converter):
                    report.tally(batch.actions, batch.malformed)
                    report.add(pipeline.process(batch.items))
            except InputError as exc:
                # Said here, once, as it happens; the report's last line counts it (see processor.report).
                report.unreadable.append(str(exc))
                message = printable(str(exc))
                if message not in said:  # said already by a lane that gave up
                    said.add(message)
                    sys.stderr.write(f"durable-check: {message}\n")
        report.add(pipeline.finish())
        report.summary = pipeline.engine.summary()
        if args.write_baseline:
            from processor.waivers import write_baseline

            kept = write_baseline(args.write_baseline, report.ordered())
            sys.stderr.write(f"durable-check: wrote {kept} finding(s) to the baseline "
                             f"{printable(args.write_baseline)}\n")
        out = _open_output(args)
        if out is None:
            return 2
        try:
            _write_report(args.format, report, pipeline, ruleset, out)
        finally:
            if out is sys.stdout:
                out.flush()
            else:
                out.close()
        if args.output and args.format in ("html", "junit", "sarif", "json"):
            # The verdict still reaches the terminal when the report goes to a file.
            from processor.report import verdict_line

            sys.stderr.write(verdict_line(report) + "\n")
    finally:
        report.close()
        pipeline.engine.close()
    return report.exit_code


class _ReportFile:
    """The report's file, written as the action-log lane finds violations, when it can be
    cut back to where the report began should the lane give up (the full engine then writes the
    report from the start): a regular file, not opened for appending (what others append after
    the report would be cut too), in UTF-8, and not one of the inputs. A JSON report's file must
    also open again for reading (``reread``): its violations list may have to be moved once
    its head is known."""

    def __init__(self, out: TextIO, buffer: IO[bytes], start: int, *, owned: bool) -> None:
        self.out = out
        self.buffer = buffer
        self._start = start
        self._owned = owned

    @classmethod
    def open(cls, args: argparse.Namespace) -> _ReportFile | None:
        import codecs
        import os
        import stat

        if args.output:
            try:
                existing = os.stat(args.output)
            except OSError:
                existing = None
            if existing is not None and _is_input(existing, args.inputs):
                return None  # read first, written after: the spool keeps that working
            try:
                out: TextIO = open(args.output, "w", encoding="utf-8")  # noqa: SIM115 (closed by the caller)
            except OSError:
                return None  # said when the report is written, as without this file
        else:
            out = sys.stdout
        try:
            import fcntl  # ImportError where there is none: the spool then

            fd = out.fileno()
            status = os.fstat(fd)
            regular = stat.S_ISREG(status.st_mode)
            appending = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND)
            utf8 = codecs.lookup(out.encoding).name == "utf-8"
            buffer = getattr(out, "buffer", None)
            if not regular or appending or not utf8 or buffer is None or _is_input(status, args.inputs):
                raise OSError("not a file the report can be cut back in")
            out.flush()
            start = buffer.seek(0, os.SEEK_CUR)
            opened = cls(out, buffer, start, owned=out is not sys.stdout)
            if args.format == "json":
                opened.reread().close()  # else the spool, as for a file that cannot be cut back
        except (OSError, ValueError, AttributeError, LookupError, ImportError):
            if out is not sys.stdout:
                out.close()
            return None
        return opened

    def reread(self) -> IO[bytes]:
        """The report's file opened again, for reading: by its name, or where the system names
        an open file (standard output redirected to a file), checked to be the same file."""
        import os

        fd = self.out.fileno()
        name = self.out.name if self._owned else f"/proc/self/fd/{fd}"
        reader = open(name, "rb", buffering=0)  # noqa: SIM115 (the caller closes it)
        mine, found = os.fstat(fd), os.fstat(reader.fileno())
        if (mine.st_dev, mine.st_ino) != (found.st_dev, found.st_ino):
            reader.close()
            raise OSError("the report's file was replaced while it was written")
        return reader

    def undo(self) -> None:
        """Cut what the lane wrote: the file ends where the report began."""
        import os

        self.buffer.flush()
        os.ftruncate(self.out.fileno(), self._start)
        self.buffer.seek(self._start)
        if self._owned:
            self.out.close()  # the full engine opens --output afresh


def _is_input(status: Any, inputs: list[str]) -> bool:
    import os

    for path in inputs:
        try:
            found = os.stat(path)
        except OSError:
            continue
        if (found.st_dev, found.st_ino) == (status.st_dev, status.st_ino):
            return True
    return False


def _open_output(args: argparse.Namespace) -> TextIO | None:
    """Where the report goes (``--output`` or standard output); None, said on stderr, when it cannot be opened."""
    from processor.report import printable

    try:
        return open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    except OSError as exc:
        sys.stderr.write(f"durable-check: --output {printable(args.output)}: {exc.strerror or exc}\n")
        return None


def _write_report(fmt: str, report: Report, pipeline: Pipeline, ruleset: RuleSet, out: TextIO) -> None:
    from processor.report import write_json, write_text

    if fmt == "json":
        write_json(report, out)
    elif fmt in ("html", "junit"):
        from processor.report_formats import write_html, write_junit
        from processor.state.views import MemoryViews

        views = pipeline.views
        assert isinstance(views, MemoryViews)
        if fmt == "html":
            write_html(report, views, ruleset, out)
        else:
            write_junit(report, views, out)
    elif fmt == "sarif":
        from processor.report_formats import write_sarif

        write_sarif(report, ruleset, out)
    else:
        write_text(report, out)


@contextmanager
def _paced_garbage_collection() -> Iterator[None]:
    """Replay makes millions of short-lived records that hold no cycles (refcounts free them);
    at the collector's default pace it spends a tenth of the run finding nothing to collect."""
    thresholds = gc.get_threshold()
    gc.freeze()  # modules and rules loaded so far live as long as the process
    gc.set_threshold(_GC_YOUNG_THRESHOLD, *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
