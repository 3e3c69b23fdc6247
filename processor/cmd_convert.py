"""``durable-check convert``: inputs -> action records, as JSONL in the skill's format.

The output is what the durable-sessions skill's own checker reads, so a trace dump can
be checked by either tool. The records go through the same identity stage as in replay
and serve (processor.evaluate.identity: sessions and tool-call ids named elsewhere in the
trace), with the same allowed lateness, so they are the records replay evaluates.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable
from typing import Any, BinaryIO

import orjson

from processor.errors import InputError
from processor.records import Action, Malformed


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "convert",
        help="write the action records of trace dumps or action logs as JSONL",
        description="Convert inputs into action records (JSONL, the durable-sessions skill's format).",
    )
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="file to read; - for standard input")
    parser.add_argument("-o", "--output", required=True, metavar="FILE", help="where to write; - for standard output")
    parser.add_argument("--input-format", default=None, help="override format detection (see replay --help)")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="configuration whose convert: section (and evaluate.allowed_lateness) applies")
    parser.add_argument(
        "--allowed-lateness", default=None, metavar="DURATION",
        help="how far out of order spans may arrive (e.g. 5s), as for replay: a span waiting for the span that names "
             "its session or its tool call is held this long in event time",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from processor.cmd_replay import allowed_lateness_s, load_config_or_none, make_converter
    from processor.evaluate.identity import IdentityResolver, IdentityState
    from processor.receive.files import read_batches
    from processor.report import printable

    config = load_config_or_none(args.config)
    lateness = allowed_lateness_s(config, args.allowed_lateness)
    converter = make_converter(args.config, config)
    # The identity stage replay and serve evaluate through, over all inputs as one stream.
    identity = IdentityResolver(IdentityState(), round(lateness * 1_000_000_000))
    out: BinaryIO
    if args.output != "-":
        for path in args.inputs:
            if _same_file(path, args.output):
                sys.stderr.write(f"durable-check: {args.output}: is also an input; write the records somewhere else\n")
                return 2
        try:
            out = open(args.output, "wb")  # noqa: SIM115 - closed in the finally below
        except OSError as exc:
            sys.stderr.write(f"durable-check: cannot write {args.output}: {exc.strerror or exc}\n")
            return 2
    else:
        out = sys.stdout.buffer
    unreadable = 0
    written = 0
    skipped = 0

    def write(items: Iterable[Action | Malformed]) -> None:
        nonlocal written, skipped
        for item in items:
            if isinstance(item, Action):
                out.write(orjson.dumps(item.record, option=orjson.OPT_APPEND_NEWLINE))
                written += 1
            else:
                skipped += 1
                where = f"{item.origin}:{item.line}" if item.line is not None else item.origin
                sys.stderr.write(printable(f"{where}: skipped: {item.message}") + "\n")

    try:
        for path in args.inputs:
            try:
                for batch in read_batches(path, args.input_format, converter):
                    write(identity.admit(batch.items, 0))
            except InputError as exc:
                unreadable += 1
                sys.stderr.write(f"durable-check: {exc}\n")
        write(identity.release_all())
    finally:
        if out is not sys.stdout.buffer:
            out.close()
        else:
            out.flush()
    sys.stderr.write(f"{written} record(s) written, {skipped} skipped\n")
    return 2 if unreadable else 0


def _same_file(a: str, b: str) -> bool:
    """Writing the output would truncate this input before it is read."""
    if a == "-" or not (os.path.exists(a) and os.path.exists(b)):
        return False
    return os.path.samefile(a, b)
