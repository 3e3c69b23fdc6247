"""serve's evaluator alone: its worker over a state store, fed the requests of a dump through its queue.

    python -m bench.bench_evaluator DUMP [--requests 300] [--state memory sqlite] [--profile OUT]

What the live benchmark measures less directly: the CPU the evaluator thread spends per
span, without the gRPC receiver and the client beside it on the same cores. The
requests (512 spans each) are stamped with the current clock, as the live client does,
and put into serve's own queue as fast as it takes them; the worker journals,
acknowledges, converts, evaluates, commits and hands violations to a JSONL exporter
exactly as in serve, built from the same configuration code, and the garbage collector
is tuned as serve tunes it (:mod:`processor.gc_pauses`). The rate is spans per
CPU-second of the process (the worker thread is the only busy one) from the first put
until every request was evaluated; wall time is reported beside it. ``--rate`` paces the
requests as a steady sender would: the worker then commits as it does in serve at that
rate (every 50 ms), so the CPU per span is what serve's evaluator spends at that rate.
``written_bytes_per_span`` is what the process handed to ``write()`` per span (database,
write-ahead log, violations file), from ``/proc/self/io``: unlike CPU time, the machine's
other work does not change it.

``--profile OUT`` runs the worker thread under cProfile and writes its statistics to
``OUT.<state>.pstats`` (and prints the 25 most expensive functions by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.live import Template, load_templates
from processor.config import parse_config
from processor.convert.spans import SpanConverter
from processor.gc_pauses import settle_for_serving
from processor.receive.otlp_common import parse_protobuf
from processor.receive.queue import Batch, IngestQueue, QueueFull
from processor.serve import build_pipeline, build_store
from processor.telemetry import Telemetry
from processor.worker import EvaluatorWorker


def measure(templates: list[Template], state: str, profile: Path | None = None,
            rate: float | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="durable-check-evaluator-") as tmp:
        work = Path(tmp)
        text = (f"state:\n  backend: {state}\n  path: {work / 'state.db'}\n"
                f"exporters:\n  jsonl:\n    path: {work / 'violations.jsonl'}\n")
        config = parse_config(text, "bench")
        telemetry = Telemetry()
        store = build_store(config)
        pipeline = build_pipeline(config, telemetry, store)
        queue = IngestQueue(config.queue.max_requests, config.queue.max_spans, 1.0, telemetry)
        worker = EvaluatorWorker(queue, pipeline, store, converter=SpanConverter(config.convert), hold=None,
                                 tick_interval_s=float(config.evaluate.tick_interval), telemetry=telemetry)
        # As serve does before traffic: with CPython's default thresholds full collections of
        # the growing heap were a sixth of the evaluator's CPU here, a cost serve does not pay.
        settle_for_serving()
        profiler = cProfile.Profile() if profile is not None else None
        if profiler is not None:
            run = worker._run

            def profiled() -> None:
                profiler.enable()
                try:
                    run()
                finally:
                    profiler.disable()

            worker._thread = threading.Thread(target=profiled, daemon=True)
        worker.start()
        now = time.time_ns()
        bodies = [t.stamped(now + i * 512_000) for i, t in enumerate(templates)]
        batches = [Batch(request=parse_protobuf(b), span_count=t.spans, protocol="grpc", origin="bench", body=b)
                   for b, t in zip(bodies, templates, strict=True)]
        spans = sum(t.spans for t in templates)
        written0 = _bytes_written()
        cpu0, wall0 = time.process_time(), time.monotonic()
        for index, batch in enumerate(batches):
            if rate is not None:
                # Paced as a steady sender would be: request i leaves at i * 512 / rate seconds.
                time.sleep(max(0.0, wall0 + index * batch.span_count / rate - time.monotonic()))
            while True:
                try:
                    queue.try_put(batch)
                    break
                except QueueFull:
                    time.sleep(0.001)
        for batch in batches:
            batch.ack.result(timeout=600)
        deadline = time.monotonic() + 600
        while worker.stats.evaluated < len(batches) and worker.journaled and time.monotonic() < deadline:
            time.sleep(0.002)
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        written = _bytes_written() - written0
        queue.close()
        worker.drain(60)
        pipeline.shutdown(10)
        if store is not None:
            store.close()
        if profiler is not None and profile is not None:
            out = profile.with_name(f"{profile.name}.{state}.pstats")
            profiler.dump_stats(out)
            pstats.Stats(str(out)).sort_stats("tottime").print_stats(25)
        return {"state": state, "rate": rate, "requests": len(batches), "spans": spans, "cpu_s": round(cpu, 3),
                "wall_s": round(wall, 3), "spans_per_cpu_s": round(spans / cpu), "spans_per_s": round(spans / wall),
                "written_bytes_per_span": round(written / spans)}


def _bytes_written() -> int:
    """Bytes this process handed to write() so far (the database, its WAL and the JSONL file)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dump", type=Path)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--state", nargs="+", default=["memory", "sqlite"], choices=["memory", "sqlite"])
    parser.add_argument("--runs", type=int, default=1, help="runs of each store, alternating")
    parser.add_argument("--profile", type=Path, default=None)
    parser.add_argument("--rate", type=float, default=None,
                        help="offer the requests at this many spans/s (default: as fast as the queue takes them); "
                             "the CPU per span at a given rate is what a live serve spends")
    args = parser.parse_args(argv)
    templates = load_templates(args.dump, args.requests)
    for _ in range(args.runs):
        for state in args.state:
            print(measure(templates, state, args.profile, args.rate), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
