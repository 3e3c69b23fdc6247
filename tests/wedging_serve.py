"""``serve`` on a SQLite store whose commit hangs for one session: a request that wedges the evaluator.

Run as ``python -m tests.wedging_serve CONFIG SESSION``. The hang stands for anything that
stops the evaluator on one request (a rule that never ends, a driver that blocks): it
blocks in the commit of every unit of work that saves ``SESSION``, every time, in every
process, so only setting the request aside lets serve go on.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from typing import Any

from processor.config import load_config
from processor.serve import Server, build_pipeline, serve_until_signalled
from processor.state.session import SessionState
from processor.state.sqlite import SqliteStore
from processor.telemetry import Telemetry


def main(config_path: str, poisoned: str) -> None:
    class WedgingStore(SqliteStore):
        def _write_state(self, sessions: dict[str, SessionState | None], timers: Any, engine: Any) -> Any:
            if sessions.get(poisoned) is not None:
                threading.Event().wait()  # never set: this evaluation does not come back
            return super()._write_state(sessions, timers, engine)

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = load_config(config_path)
    telemetry = Telemetry()
    store = WedgingStore(config.state.path)
    server = Server(config, build_pipeline(config, telemetry, store), telemetry, store)
    asyncio.run(serve_until_signalled(server))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
