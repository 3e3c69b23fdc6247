"""What converting spans in other processes would leave serve's evaluator: conversion against its hand-off.

    python -m bench.bench_handoff DUMP [--requests 40] [--runs 5] [--build compiled]

serve's evaluator thread converts every request it takes (``SpanConverter.convert_serialized``)
before it journals, evaluates and commits it, all on one core. Conversion needs no state,
so a pool of converting processes could take it off that core, any request to any
process; the evaluator would then read the converted items back from the bytes the pool
sends it. Whether that pays depends on two costs per converted item, measured here on
the dump's first requests (512 spans each, stamped as the live client stamps them):

- ``convert_us``: the conversion, what the evaluator spends on it today;
- ``load_us``: reading the converted items back (``pickle.loads`` of each request's
  items), what the evaluator would still spend;
- ``dump_us``: writing them (``pickle.dumps``), spent in the converting process.

``saved_share`` is ``1 - load_us / convert_us``: the part of the conversion the
evaluator's core would no longer spend. Medians of ``--runs`` runs, each doing the three
in turn, in CPU time of this process. ``--build compiled`` measures the compiled build
(what ``pip install .`` and the container run), as the other benchmarks do.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import build


def measure(dump: Path, requests: int, runs: int) -> dict[str, Any]:
    from bench.live import load_templates
    from processor import records
    from processor.convert.spans import SpanConverter

    now_ns = time.time_ns()
    payloads = [template.stamped(now_ns) for template in load_templates(dump, requests)]
    converter = SpanConverter()
    converted = [converter.convert_serialized(payload) for payload in payloads]
    items = [list(result.items) for result in converted]
    blobs = [pickle.dumps(request_items, protocol=pickle.HIGHEST_PROTOCOL) for request_items in items]
    if [pickle.loads(blob) for blob in blobs] != items:
        raise RuntimeError("the converted items read back differ from those written: no hand-off to measure")

    def cpu_s(work: Callable[[], object]) -> float:
        started = time.process_time()
        work()
        return time.process_time() - started

    converting: list[float] = []
    writing: list[float] = []
    reading: list[float] = []
    for _ in range(runs):
        converting.append(cpu_s(lambda: [converter.convert_serialized(payload) for payload in payloads]))
        writing.append(cpu_s(lambda: [pickle.dumps(i, protocol=pickle.HIGHEST_PROTOCOL) for i in items]))
        reading.append(cpu_s(lambda: [pickle.loads(blob) for blob in blobs]))
    count = sum(len(request_items) for request_items in items)
    spans = sum(result.spans_total for result in converted)

    def per_item_us(times: list[float]) -> float:
        return round(statistics.median(times) / count * 1e6, 3)

    convert_us, load_us = per_item_us(converting), per_item_us(reading)
    return {
        "build": "compiled" if not str(records.__file__).endswith(".py") else "source",
        "requests": len(payloads),
        "spans": spans,
        "items": count,
        "bytes_per_item": round(sum(map(len, blobs)) / count, 1),
        "convert_us": convert_us,
        "dump_us": per_item_us(writing),
        "load_us": load_us,
        "saved_share": round(1 - load_us / convert_us, 3) if convert_us else None,
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dump", type=Path, help="a dump written by bench.generate (otlp)")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--build", choices=build.BUILDS, default=None,
                        help="measure this build in a process of its own (default: whatever this one imports)")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.runs < 1:
        parser.error("--requests and --runs must be at least 1")
    if args.build is not None:
        build.select(args.build)
        command = [sys.executable, "-m", "bench.bench_handoff", str(args.dump.resolve()),
                   "--requests", str(args.requests), "--runs", str(args.runs)]
        return subprocess.run(command, cwd=build.ROOT, env=build.child_env(), check=False).returncode
    sys.stdout.write(json.dumps(measure(args.dump, args.requests, args.runs)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
