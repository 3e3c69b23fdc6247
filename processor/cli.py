"""The ``durable-check`` command line.

Each sub-command lives in its own module (``processor/cmd_*.py``) with
``register(subparsers)``; this file only assembles them and turns every
``DurableCheckError`` into a message and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Final, NoReturn

from processor._build import build_kind
from processor._version import __version__
from processor.errors import DurableCheckError

EXIT_OK = 0
EXIT_VIOLATIONS = 1
EXIT_USAGE = 2

_COMMAND_MODULES = ("cmd_replay", "cmd_convert", "cmd_serve", "cmd_rules")
# Commands that run to completion with no thread or server left behind: once they have
# answered, their process ends without tearing down what they built (freeing a replay's
# remembered ids, its rules and modules object by object took 0.05-0.1 CPU-s of a 0.8 s
# replay). serve stops its own way.
_RUN_TO_COMPLETION: Final = frozenset({"replay", "convert", "rules"})


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
    return _run(argv)[0]


def entry() -> NoReturn:
    """The console script and ``python -m processor.cli``: ``main``, then the process ends."""
    code, command = _run(None)
    if command in _RUN_TO_COMPLETION:
        _exit_now(code)
    sys.exit(code)


def _exit_now(code: int) -> NoReturn:
    """Run the exit handlers (logging's, and any a caller registered) and write out standard
    output, as an interpreter's exit does, then end the process without its teardown."""
    import atexit
    import contextlib
    import os

    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        quiet_stdout()  # a reader that left early: not an error of ours, as in main
    except (OSError, ValueError) as exc:
        quiet_stdout()
        sys.stderr.write(f"durable-check: cannot write to standard output ({error_detail(exc)})\n")
        code = EXIT_USAGE
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.flush()  # else nowhere is left to say it
    os._exit(code)


def _run(argv: Sequence[str] | None) -> tuple[int, str]:
    """The exit code, and the command that gave it."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return _command(args), args.command


def _command(args: argparse.Namespace) -> int:
    try:
        code: int = args.func(args)
    except DurableCheckError as exc:
        sys.stderr.write(f"durable-check: {exc}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        # Ctrl-C: one line, so an interrupted run is not mistaken for one that ended (serve stops on its own).
        sys.stderr.write(f"durable-check: {args.command} interrupted; what it wrote so far is incomplete\n")
        return 130
    except BrokenPipeError:
        # Output piped into `head` and closed early: not an error of ours.
        return EXIT_OK
    except OSError as exc:
        # The commands turn what they read into InputError or ConfigError; what is left is the
        # machine's answer to a write (a full disk, a closed device): said once, not a traceback.
        from processor.report import printable

        quiet_stdout()
        where = f"{printable(str(exc.filename))}: " if exc.filename else ""
        sys.stderr.write(f"durable-check: {where}{error_detail(exc)}\n")
        return EXIT_USAGE
    return code


def error_detail(exc: Exception) -> str:
    """What went wrong, in the system's words when it gave some (an OSError's strerror)."""
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


def quiet_stdout() -> None:
    """Point standard output at the null device: what it still buffers would fail again at exit."""
    import contextlib
    import os

    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


if __name__ == "__main__":
    entry()
