"""The ``durable-check`` command line.

Each sub-command lives in its own module (``processor/cmd_*.py``) with
``register(subparsers)``; this file only assembles them and turns every
``DurableCheckError`` into a message and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from processor._build import build_kind
from processor._version import __version__
from processor.errors import DurableCheckError

EXIT_OK = 0
EXIT_VIOLATIONS = 1
EXIT_USAGE = 2

_COMMAND_MODULES = ("cmd_replay", "cmd_convert", "cmd_serve", "cmd_rules")


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(
        prog="durable-check",
        description="Tell whether long-lived agent sessions would survive a crash.",
    )
    parser.add_argument("--version", action="version", version=f"durable-check {__version__} ({build_kind()})")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name in _COMMAND_MODULES:
        module = importlib.import_module(f"processor.{name}")
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
    except DurableCheckError as exc:
        sys.stderr.write(f"durable-check: {exc}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # Output piped into `head` and closed early: not an error of ours.
        return EXIT_OK
    except OSError as exc:
        # The commands turn what they read into InputError or ConfigError; what is left is the
        # machine's answer to a write (a full disk, a closed device): said once, not a traceback.
        from processor.report import printable

        quiet_stdout()
        detail = exc.strerror or str(exc) or type(exc).__name__
        where = f"{printable(str(exc.filename))}: " if exc.filename else ""
        sys.stderr.write(f"durable-check: {where}{detail}\n")
        return EXIT_USAGE
    return code


def quiet_stdout() -> None:
    """Point standard output at the null device: what it still buffers would fail again at exit."""
    import contextlib
    import os

    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
