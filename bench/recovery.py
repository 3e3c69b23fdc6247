"""Recovery after SIGKILL at the sustained rate: time to ready, and time to drain the journal.

serve runs as a subprocess on its default state (SQLite, ``synchronous: full``); the
load client of :mod:`bench.live` sends requests of the generated dump at ``--rate``
spans/s. After ``--before`` seconds serve is killed with SIGKILL in mid-stream. The
benchmark then reads what the database holds (journal entries acknowledged and not yet
evaluated, spans in the reordering window), starts serve again on it and measures:

- **time to ready**: from the start of the new process to ``/readyz`` answering 200
  (the store checked, sessions, timers and window loaded, the receivers listening);
- **time to drain**: from the start to ``durable_check_journal_depth`` reaching 0 (every
  request acknowledged before the kill evaluated).

It also reads how many sessions the new process could not restore
(``durable_check_sessions_not_restored_total``): a start that skips them is fast and
wrong, so any at all, or a counter that cannot be read, fail the run.

    python -m bench.recovery bench/out/data/otlp-1000000-10000-v3.bin --rate 3000 --before 15
    python -m bench.recovery bench/out/data/otlp-1000000-10000-v3.bin --rate 20000 --build compiled --runs 2
"""

from __future__ import annotations

import argparse
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Final

import orjson

from bench import build
from bench.live import _metric, free_ports, metric_or_none
from processor.state.bufferrows import live_entries

_ROOT: Final = Path(__file__).resolve().parents[1]


def _poll_ready(port: int, deadline_s: float) -> float | None:
    import httpx

    started = time.monotonic()
    while time.monotonic() - started < deadline_s:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1.0).status_code == 200:
                return time.monotonic()
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    return None


def _scrape(metrics_port: int) -> str | None:
    import httpx

    try:
        return httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2.0).text
    except httpx.HTTPError:
        return None


def run(dump: Path, rate: float, before_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="durable-check-recovery-") as tmp:
        work = Path(tmp)
        grpc_port, http_port, metrics_port = free_ports(3)
        db = work / "state.db"
        config_path = work / "serve.yaml"
        config_path.write_text(
            "receivers:\n  otlp:\n"
            f"    grpc:\n      endpoint: 127.0.0.1:{grpc_port}\n"
            f"    http:\n      endpoint: 127.0.0.1:{http_port}\n"
            f"state:\n  path: {db}\n"
            f"exporters:\n  jsonl:\n    path: {work / 'violations.jsonl'}\n"
            f"  prometheus:\n    endpoint: 127.0.0.1:{metrics_port}\n",
            encoding="utf-8",
        )
        env = build.child_env()
        command = [sys.executable, "-m", "processor.cli", "serve", "--config", str(config_path)]
        log = (work / "serve.stderr").open("ab")
        serve = subprocess.Popen(command, cwd=work, stdout=subprocess.DEVNULL, stderr=log, env=env)
        try:
            if _poll_ready(http_port, 60) is None:
                raise RuntimeError("serve did not become ready")
            requests = max(1, round(rate * (before_s + 5) / 512))
            client = subprocess.Popen(
                [sys.executable, "-m", "bench.live", "client", "--target", f"127.0.0.1:{grpc_port}",
                 "--dump", str(dump), "--requests", str(requests), "--rate", str(rate),
                 "--out", str(work / "client.json")],
                cwd=_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            time.sleep(before_s)
            serve.send_signal(signal.SIGKILL)
            serve.wait(10)
            client.wait(120)
            with sqlite3.connect(db) as connection:
                journal, journal_bytes = connection.execute(
                    "SELECT count(*), coalesce(sum(size), 0) FROM journal").fetchone()
                window = len(live_entries(connection.execute("SELECT segment, body, released FROM buffer_segments")))
                sessions = connection.execute("SELECT count(*) FROM sessions").fetchone()[0]
            db_bytes = sum(p.stat().st_size for p in work.glob("state.db*"))
            started = time.monotonic()
            serve = subprocess.Popen(command, cwd=work, stdout=subprocess.DEVNULL, stderr=log, env=env)
            ready_at = _poll_ready(http_port, 300)
            drained_at = None
            # The gauge is 0 until the worker loaded the journal, which is before the process is ready.
            not_restored: float | None = None
            while ready_at is not None and time.monotonic() - started < 300:
                text = _scrape(metrics_port)
                if text is not None and _metric(text, "durable_check_journal_depth") == 0:
                    drained_at = time.monotonic()
                    # Counted as the worker restored (before ready), by the process that restored.
                    not_restored = metric_or_none(text, "durable_check_sessions_not_restored_total")
                    break
                time.sleep(0.05)
        finally:
            if serve.poll() is None:
                serve.send_signal(signal.SIGTERM)
                serve.wait(60)
            log.close()
    return {
        "rate_spans_s": rate,
        "killed_after_s": before_s,
        "journal_entries_at_kill": journal,
        "journal_bytes_at_kill": journal_bytes,
        "window_spans_at_kill": window,
        "sessions_at_kill": sessions,
        "state_bytes_at_kill": db_bytes,
        "time_to_ready_s": None if ready_at is None else ready_at - started,
        "time_to_drain_s": None if drained_at is None else drained_at - started,
        # A start that skipped sessions it could not read is faster and wrong: it must be 0
        # (None: the counter was not read, which fails the run as well).
        "sessions_not_restored": None if not_restored is None else int(not_restored),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dump", type=Path)
    parser.add_argument("--rate", type=float, required=True, help="spans per second before the kill")
    parser.add_argument("--before", type=float, default=15.0, help="seconds of load before the kill")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--build", choices=build.BUILDS, default="source",
                        help="run serve from the checkout's sources or its compiled wheel (bench.build)")
    args = parser.parse_args(argv)
    build.select(args.build)
    results = [run(args.dump, args.rate, args.before) for _ in range(args.runs)]
    sys.stdout.write(orjson.dumps(results, option=orjson.OPT_INDENT_2).decode() + "\n")
    if any(result["sessions_not_restored"] is None for result in results):
        sys.stderr.write("recovery: serve's count of sessions not restored could not be read; the timings do not "
                         "count\n")
        return 1
    if any(result["sessions_not_restored"] for result in results):
        sys.stderr.write("recovery: serve could not restore some sessions; the timings do not count\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
