"""``durable-check replay``: the streaming engine over trace dumps and action logs.

Exit 0: no violations; 1: violations; 2: an input could not be read, or a usage error.
Replay is the serve pipeline fed from files: the same converter, engine and rules.
"""

from __future__ import annotations

import argparse
import sys
from itertools import islice
from typing import TYPE_CHECKING, Any

from processor.errors import InputError

if TYPE_CHECKING:
    from processor.config import Config
    from processor.convert import SpanConverter

INPUT_FORMATS = ("actions", "otlp-json-lines", "otlp-json", "otlp-proto", "otlp-proto-stream")
# Items handed to the engine at a time: bounds memory whatever the input size.
CHUNK = 2048


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "replay",
        help="check trace dumps or action logs offline",
        description=(
            "Check whether the sessions in trace dumps or action logs would survive a crash. "
            "Exit 0: no violations; 1: violations; 2: an input could not be read."
        ),
    )
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="file to read (gzip/zstd ok); - for standard input")
    parser.add_argument("--strict", action="store_true", help="also run strict-only rules (e.g. DS008)")
    parser.add_argument("--format", choices=("text", "json"), default="text", help="report format (default: text)")
    parser.add_argument("--config", metavar="FILE", help="configuration whose convert: and evaluate: sections apply")
    parser.add_argument(
        "--rules", action="append", default=[], metavar="PATH", help="extra rule file (repeatable); adds or overrides"
    )
    parser.add_argument("--no-shipped-rules", action="store_true", help="run only the rules given with --rules")
    parser.add_argument(
        "--input-format", choices=INPUT_FORMATS, default=None, help="override format detection for every input"
    )
    parser.add_argument(
        "--allowed-lateness", default=None, metavar="DURATION", help="how far out of order spans may arrive (e.g. 5s)"
    )
    parser.set_defaults(func=run)


def load_config_or_none(path: str | None) -> Config | None:
    if not path:
        return None
    from processor.config import load_config

    return load_config(path)


def make_converter(config_path: str | None, config: Config | None = None) -> SpanConverter:
    from processor.convert import ConvertOptions, SpanConverter

    if config is None:
        config = load_config_or_none(config_path)
    options = config.convert if config is not None else ConvertOptions()
    return SpanConverter(options)


def run(args: argparse.Namespace) -> int:
    from processor.configfmt import parse_duration
    from processor.evaluate.engine import Engine, EngineOptions
    from processor.evaluate.rulefmt import load_rules
    from processor.pipeline import Pipeline
    from processor.receive.files import read_input
    from processor.report import Report, render_json, render_text

    config = load_config_or_none(args.config)
    converter = make_converter(args.config, config)
    strict = args.strict
    rule_paths: list[str] = []
    include_shipped = not args.no_shipped_rules
    lateness = 5.0
    options = EngineOptions(mode="replay")
    if config is not None:
        ev = config.evaluate
        strict = strict or ev.strict
        rule_paths.extend(ev.rules)
        include_shipped = include_shipped and ev.include_shipped_rules
        lateness = float(ev.allowed_lateness)
    if args.allowed_lateness:
        try:
            lateness = parse_duration(args.allowed_lateness)
        except ValueError as exc:
            sys.stderr.write(f"durable-check: --allowed-lateness: {exc}\n")
            return 2
    rule_paths.extend(args.rules)
    ruleset = load_rules(rule_paths, include_shipped=include_shipped)
    options = EngineOptions(strict=strict, allowed_lateness_s=lateness, mode="replay")
    pipeline = Pipeline(Engine(ruleset, options))

    report = Report(inputs=list(args.inputs))
    for path in args.inputs:
        try:
            items = iter(read_input(path, args.input_format, converter))
            while chunk := list(islice(items, CHUNK)):
                report.count(chunk)
                report.add(pipeline.process(chunk))
        except InputError as exc:
            report.unreadable.append(str(exc))
            sys.stderr.write(f"durable-check: {exc}\n")
    report.add(pipeline.finish())
    report.summary = pipeline.engine.summary()
    out = render_json(report) if args.format == "json" else render_text(report)
    sys.stdout.write(out)
    sys.stdout.flush()
    if report.unreadable:
        return 2
    return 1 if report.violations else 0
