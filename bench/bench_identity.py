"""Cost of resolving sessions across a trace's spans at ingest (processor.evaluate.identity).

Agent runs as frameworks trace them: a root span (no action) names the session, its
model and tool calls name none, and the root ends, so arrives, last. Runs interleave.
Measured: the resolution alone (records/s), the engine with and without it on the same
records (the same records with every session named, which pass through untouched), and
what a durable store serializes of the resolution's state per batch.

    python bench/bench_identity.py              # 100k records
    python bench/bench_identity.py 300000
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from processor.evaluate.engine import Engine, EngineOptions
from processor.evaluate.identity import IdentityResolver, IdentityState
from processor.evaluate.rulefmt import load_rules
from processor.records import Action, SessionMark, SpanLinks

T0 = 1_793_524_440_000_000_000
MS = 1_000_000
CHILDREN = 9  # model and tool calls per run
CONCURRENT = 200  # runs in flight at once
KINDS = ("llm_call", "tool_call", "llm_call", "external_read", "llm_call", "write", "llm_call", "tool_call", "llm_call")


def runs(total: int, named: bool) -> list[Action | SessionMark]:
    """``total`` records of agent runs, children first, CONCURRENT runs interleaved."""
    out: list[Action | SessionMark] = []
    pending: list[list[Action | SessionMark]] = []
    seq = 0
    run = 0
    while seq < total:
        trace = f"{run + 1:032x}"
        root = f"{run + 1:08x}00000000"
        session = f"conv-{run // 3}"  # three runs per conversation
        start = T0 + run * 50 * MS
        items: list[Action | SessionMark] = []
        for child in range(CHILDREN):
            span = f"{run + 1:08x}{child + 1:08x}"
            record = {
                "session_id": session if named else trace,
                "action_id": f"span-{span}",
                "kind": KINDS[child],
                "status": "ok",
                "trace_id": trace,
                "span_id": span,
            }
            items.append(
                Action(record, "span", "bench", None, start + (child + 1) * MS, seq, (trace, span, 0), True,
                       SpanLinks(root, named))
            )
            seq += 1
        items.append(SessionMark(trace, root, "", session, start))
        pending.append(items)
        run += 1
        if len(pending) >= CONCURRENT or seq >= total:
            # Interleave the runs in flight, item by item.
            for group in zip(*pending, strict=False):
                out.extend(group)
            pending = []
    return out


def resolve_rate(items: list[Action | SessionMark]) -> float:
    resolver = IdentityResolver(IdentityState(), 5_000 * MS)
    started = time.process_time()
    count = 0
    for start in range(0, len(items), 1_000):
        count += len(resolver.admit(items[start : start + 1_000], 0))
    count += len(resolver.release_all())
    return count / (time.process_time() - started)


def engine_rate(items: list[Action | SessionMark]) -> float:
    engine = Engine(load_rules([]), EngineOptions(allowed_lateness_s=5))
    started = time.process_time()
    for start in range(0, len(items), 1_000):
        engine.submit_many(items[start : start + 1_000])
    engine.finish()
    return sum(isinstance(i, Action) for i in items) / (time.process_time() - started)


def state_cost(items: list[Action | SessionMark]) -> tuple[float, float, int]:
    """(median ms to serialize the state after a batch, its size in kB, traces remembered) at steady state."""
    resolver = IdentityResolver(IdentityState(), 5_000 * MS)
    times, sizes = [], []
    for start in range(0, len(items), 1_000):
        resolver.admit(items[start : start + 1_000], 0)
        began = time.process_time()
        body = orjson.dumps(resolver.state.to_plain())
        times.append(time.process_time() - began)
        sizes.append(len(body))
    return statistics.median(times) * 1000, statistics.median(sizes) / 1000, len(resolver.state.traces)


def main() -> None:
    total = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    unnamed = runs(total, named=False)
    resolve = [resolve_rate(unnamed) for _ in range(3)]
    print(f"resolution alone, sessions on the root only : {statistics.median(resolve):10,.0f} records/s CPU")
    pairs = []
    for _ in range(3):
        with_resolution = engine_rate(runs(total, named=False))
        named_already = engine_rate(runs(total, named=True))
        pairs.append((with_resolution, named_already))
    resolved, plain = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
    print(f"engine, sessions on the root only           : {resolved:10,.0f} records/s CPU")
    print(f"engine, every span names its session         : {plain:10,.0f} records/s CPU")
    print(f"ratio (median of pairs)                      : {statistics.median(p[0] / p[1] for p in pairs):.2f}")
    ms, kb, traces = state_cost(unnamed)
    print(f"state per batch of 1000: {ms:.2f} ms to serialize, {kb:.0f} kB, {traces} traces remembered")


if __name__ == "__main__":
    main()
