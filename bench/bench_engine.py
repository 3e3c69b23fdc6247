"""Throughput of Engine.submit_many with the shipped packs on a synthetic action stream.

Sessions interleave; each is a small story of spans (prompt, model call, approval wait,
payment, checkpoint, retries), about a third of them breaking some rule. Spans arrive in
event-time order with small jitter, so the reordering buffer works as in a real replay.

    python bench/bench_engine.py                 # 200k records
    python bench/bench_engine.py 1000000
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from processor.evaluate.engine import Engine, EngineOptions
from processor.evaluate.rulefmt import load_rules
from processor.records import Action

T0 = 1_793_524_440_000_000_000
S = 1_000_000_000


def stream(total: int, sessions: int = 5_000, seed: int = 1) -> list[Action]:
    rng = random.Random(seed)
    clock = [T0 + i * 7 * S for i in range(sessions)]
    counters = [0] * sessions
    out: list[Action] = []
    menu = (
        {"kind": "user_prompt", "result": {"a": 1}},
        {"kind": "llm_call", "result_ref": "blob://r"},
        {"kind": "external_read", "result": {"n": 3}, "cacheable": True, "cache_key": "q", "ttl_s": 60},
        {"kind": "payment", "idempotency_key": None, "plan_version": "v1"},
        {"kind": "checkpoint"},
        {"kind": "tool_call", "status": "error", "retryable": True, "max_attempts": 3, "attempts": 1},
        {"kind": "approval", "workflow_state": "awaiting_approval", "wait_timeout_s": 30},
        {"kind": "approval", "approval_decision": "granted", "plan_version": "v1"},
        {"kind": "llm_call"},
    )
    for n in range(total):
        index = rng.randrange(sessions)
        counters[index] += 1
        clock[index] += rng.randint(1, 20) * S
        session = f"s-{index:06d}"
        fields = dict(rng.choice(menu))
        if "idempotency_key" in fields:
            fields["idempotency_key"] = f"pay-{session}-{counters[index]}"
        span_id = f"{n + 1:016x}"
        trace_id = f"{index + 1:032x}"
        record = {
            "session_id": session,
            "action_id": f"{session}-{counters[index]}",
            "status": "ok",
            "service": "bench-agent",
            "instance": "pod-1",
            "trace_id": trace_id,
            "span_id": span_id,
            **fields,
        }
        out.append(
            Action(
                record=record,
                source="span",
                origin="bench",
                time_ns=clock[index],
                seq=n,
                delivery_key=(trace_id, span_id, 0),
            )
        )
    out.sort(key=lambda a: (a.time_ns or 0) + rng.randint(0, 2 * S))
    return out


def main() -> None:
    total = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
    items = stream(total)
    engine = Engine(load_rules([]), EngineOptions(allowed_lateness_s=5))
    batch = 1_000
    violations = 0
    started = time.perf_counter()
    cpu_started = time.process_time()
    for start in range(0, len(items), batch):
        violations += len(engine.submit_many(items[start : start + batch]))
    violations += len(engine.finish())
    elapsed = time.perf_counter() - started
    cpu = time.process_time() - cpu_started
    summary = engine.summary()
    # CPU time too: on a shared machine wall time also measures the neighbours.
    print(
        f"{total} records in {elapsed:.2f}s wall, {cpu:.2f}s CPU: {total / elapsed:,.0f} records/s wall, "
        f"{total / cpu:,.0f} records/s CPU "
        f"({violations} violations, {summary.late} late, {len(summary.open_waits)} open waits, "
        f"rule errors {summary.rule_errors or 'none'})"
    )


if __name__ == "__main__":
    main()
