"""``durable-check rules check|test|list``: lint rule files, run their unit tests, list what would run.

Exit codes (as promtool's): 0 all good; 1 a rule file has problems or a test failed;
2 a named file cannot be read at all.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Any, TextIO

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_UNREADABLE = 2


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "rules",
        help="check rule files, run rule unit tests, list rules",
        description="Work with rule files: lint them, run their YAML unit tests, list the rules that would run.",
    )
    commands = parser.add_subparsers(dest="rules_command", metavar="SUBCOMMAND")
    commands.required = True

    check = commands.add_parser(
        "check",
        help="check rule files strictly (every problem with file:line:col)",
        description="Check rule files together with the shipped packs (which overrides may name).",
    )
    check.add_argument("paths", nargs="+", metavar="PATH", help="rule file, or a directory of *.yaml rule files")
    check.add_argument(
        "--no-shipped", action="store_true", help="check the files alone, without the shipped rule packs"
    )
    check.add_argument(
        "--config", metavar="FILE", help="configuration whose evaluate.rule_limits apply (serve's own limits)"
    )
    check.set_defaults(func=run_check)

    test = commands.add_parser(
        "test",
        help="run unit tests for rules (*.test.yaml)",
        description="Run YAML unit tests for rules through the engine; print each failing test's differences.",
    )
    test.add_argument("paths", nargs="+", metavar="PATH", help="test file, or a directory of *.test.yaml files")
    test.set_defaults(func=run_test)

    listing = commands.add_parser(
        "list",
        help="list the rules that would run, after overrides",
        description="List every loaded rule: id, name, type, severity, and whether it runs by default.",
    )
    listing.add_argument("paths", nargs="*", metavar="PATH", help="user rule files to load besides the shipped packs")
    listing.add_argument("--strict", action="store_true", help="mark strict-only rules as running")
    listing.add_argument(
        "--pack", action="append", default=[], metavar="NAME", help="list only this shipped pack's rules (repeatable)"
    )
    listing.set_defaults(func=run_list)


def _names(paths: list[str]) -> str:
    return ", ".join(paths)


def _unreadable(paths: list[Path], err: TextIO) -> bool:
    bad = False
    for path in paths:
        try:
            with path.open("rb") as handle:
                handle.read(1)
        except OSError as exc:
            err.write(f"durable-check: cannot read {path}: {exc.strerror or exc}\n")
            bad = True
    return bad


def run_check(args: argparse.Namespace) -> int:
    out, err = sys.stdout, sys.stderr
    from processor.errors import RuleFormatError
    from processor.evaluate.rulefmt import lint, load_rules, rule_files_in, rule_sources
    from processor.evaluate.ruletest import load_test_file

    files = rule_files_in(args.paths)
    if not files:
        err.write(f"durable-check: no rule files (*.yaml, *.yml; tests excluded) in {_names(args.paths)}\n")
        return EXIT_UNREADABLE
    if _unreadable(files, err):
        return EXIT_UNREADABLE
    include_shipped = not args.no_shipped
    limits = None
    if args.config:
        from processor.config import load_config

        # Only the evaluate section matters here; ConfigError is printed by the CLI (exit 2).
        limits = load_config(args.config, sections=("evaluate",)).evaluate.rule_limits.cost_limits()
    # A shell glob such as rules/*.yaml also names the unit tests: check those as test files.
    test_files = [path for path in files if path.name.endswith((".test.yaml", ".test.yml"))]
    files = [path for path in files if path not in test_files]
    problems = lint(files, include_shipped=include_shipped, limits=limits) if files else []
    for path in test_files:
        try:
            load_test_file(path)
        except RuleFormatError as exc:
            problems.extend(exc.problems)
    if problems:
        out.write("FAILED:\n")
        for problem in problems:
            out.write(f"  {problem}\n")
        out.write(f"{len(problems)} problem{'s' if len(problems) != 1 else ''} found\n")
        return EXIT_FAILED
    ruleset = load_rules(files, include_shipped=include_shipped, limits=limits)
    per_file = Counter(rule.pos.file for rule in ruleset.rules)
    named = {path.resolve() for path in files}
    for path, display, _ in rule_sources(files, include_shipped=include_shipped):
        if path.resolve() in named:
            count = per_file.get(display, 0)
            out.write(f"{display}: SUCCESS: {count} rule{'s' if count != 1 else ''}\n")
    for path in test_files:
        out.write(f"{path}: SUCCESS: a valid rule test file\n")
    return EXIT_OK


def run_test(args: argparse.Namespace) -> int:
    out, err = sys.stdout, sys.stderr
    from processor.evaluate.ruletest import expand_test_paths, format_result, run_test_file

    files = expand_test_paths(args.paths)
    if not files:
        err.write(f"durable-check: no rule test files (*.test.yaml) in {_names(args.paths)}\n")
        return EXIT_UNREADABLE
    if _unreadable(files, err):
        return EXIT_UNREADABLE
    failed = 0
    for path in files:
        result = run_test_file(path)
        out.write(format_result(result))
        if not result.passed:
            failed += 1
    if failed:
        out.write(f"{failed} of {len(files)} test file{'s' if len(files) != 1 else ''} FAILED\n")
        return EXIT_FAILED
    return EXIT_OK


def run_list(args: argparse.Namespace) -> int:
    out, err = sys.stdout, sys.stderr
    from processor.evaluate.rulefmt import load_rules, rule_files_in, shipped_packs

    files = rule_files_in(args.paths)
    if _unreadable(files, err):
        return EXIT_UNREADABLE
    ruleset = load_rules(files, packs=list(dict.fromkeys(args.pack)))
    active = {rule.id for rule in ruleset.active(strict=args.strict)}
    # The pack a rule comes from: a shipped pack's name (what replay --pack takes), else its file.
    packs = {f"rules/{name}.yaml": name for name in shipped_packs()}
    width = max([18, *(len(packs.get(rule.pos.file, rule.pos.file)) for rule in ruleset.rules)])
    out.write(f"{'ID':<10} {'NAME':<32} {'TYPE':<10} {'SEVERITY':<9} {'PACK':<{width}} RUNS\n")
    for rule in ruleset.rules:
        if rule.id in active:
            runs = "yes"
        elif rule.enabled and rule.strict_only:
            runs = "strict only"
        else:
            runs = "no (disabled)"
        pack = packs.get(rule.pos.file, rule.pos.file)
        out.write(f"{rule.id:<10} {rule.name:<32} {rule.type:<10} {rule.severity:<9} {pack:<{width}} {runs}\n")
    return EXIT_OK
