"""``durable-check serve [--config FILE] [--check]``."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from processor.config import Config

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="receive OTLP traces and check sessions continuously",
        description=(
            "Receive spans over OTLP (gRPC and HTTP), check them as they arrive, and export violations. "
            "Without --config, listens on 127.0.0.1:4317 (gRPC) and 127.0.0.1:4318 (HTTP), writes "
            "violations to ./durable-check-data/violations.jsonl, and serves the operator view (what waits, "
            "violations, each session's story) on http://127.0.0.1:4319 (ui.endpoint; docs/operate.md). "
            "With route.endpoint set it is the first tier of a two-tier deployment instead: it gives each span "
            "its session and sends it on, evaluating nothing (docs/scaling.md)."
        ),
    )
    parser.add_argument("--config", metavar="FILE", help="configuration file (YAML); default: built-in defaults")
    parser.add_argument("--check", action="store_true", help="validate the configuration and rules, then exit (0 or 2)")
    parser.add_argument(
        "--flush-window-on-stop", action="store_true",
        help="at stop, evaluate the spans still held for ordering instead of keeping them in the state for the "
             "next start (evaluate.flush_window_on_stop; for local use)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Imported here: every other command (replay above all) would pay for the exporters it pulls in.
    from processor.config import load_config

    config = load_config(args.config)  # ConfigError: the CLI prints every problem and exits 2
    if args.flush_window_on_stop:
        config.evaluate.flush_window_on_stop = True
    if args.check:
        from processor.evaluate.rulefmt import load_rules

        load_rules(
            config.evaluate.rules,
            include_shipped=config.evaluate.include_shipped_rules,
            limits=config.evaluate.rule_limits.cost_limits(),
            packs=config.evaluate.packs,
        )
        sys.stdout.write(f"configuration {args.config or '(default)'} is valid\n")
        return 0
    logging.basicConfig(
        level=_LEVELS[config.telemetry.logs.level],
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from processor.open_files import raise_to_hard_limit

    # Before any listener starts: each keeps at most its share of the limit in connections.
    before, after = raise_to_hard_limit()
    if after > before:
        logging.getLogger("processor.serve").info("open files: soft limit raised from %d to %d", before, after)
    else:
        logging.getLogger("processor.serve").info("open files: soft limit %d", after)

    from processor.config_paths import output_files
    from processor.private_files import private_umask, report_loose

    report_loose(output_files(config))
    # What serve writes holds span payloads: private whatever the umask it was given.
    with private_umask():
        return _serve(config)


def _serve(config: Config) -> int:
    from processor.serve import Server, Serving, build_pipeline, build_store, serve_until_signalled
    from processor.state.sqlite import SqliteStore
    from processor.telemetry import Telemetry

    telemetry = Telemetry()
    store = build_store(config)  # StateError (locked, corrupt, unwritable): a message, exit 2
    server: Serving
    if config.route.enabled:
        from processor.route.first_tier import RouteServer

        assert isinstance(store, SqliteStore)  # route_problems requires state.backend sqlite
        server = RouteServer(config, telemetry, store)
    else:
        server = Server(config, build_pipeline(config, telemetry, store), telemetry, store)
    import asyncio  # here: replay and the rules commands never need it

    from processor.gc_pauses import settle_for_serving

    settle_for_serving()
    try:
        asyncio.run(serve_until_signalled(server))
    except OSError as exc:
        # An address in use or not available: a user's setting, not a crash.
        sys.stderr.write(f"durable-check: cannot start the receivers: {exc}\n")
        return 2
    return 0
