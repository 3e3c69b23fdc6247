"""Memory held per idle open session: RSS growth over N sessions, each fed 3 typical records.

Each measurement runs in a fresh subprocess: load the shipped packs and build the engine,
take the baseline RSS, feed N sessions (user prompt, model call, keyed payment; spans with
delivery keys, as serve sees them), release the reordering buffer (``finish``), collect
garbage, and report (RSS - baseline) / N.

    python bench/bench_sessions_memory.py            # 10k and 100k sessions
    python bench/bench_sessions_memory.py 50000      # one size
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Importable when run as a script from anywhere (the measuring child is started that way).
sys.path.insert(0, str(ROOT))
T0 = 1_793_524_440_000_000_000


def _records(sessions: int) -> Iterator[object]:
    from processor.records import Action

    for index in range(sessions):
        session = f"sess-{index:08d}"
        trace = f"{index + 1:032x}"
        base = T0 + index * 1_000_000
        fields = (
            {"action_id": f"{session}-a1", "kind": "user_prompt", "result": {"answer": "Kyoto, 2400 GBP"}},
            {"action_id": f"{session}-a2", "kind": "llm_call", "result_ref": f"blob://{session}/a2.json"},
            {"action_id": f"{session}-a3", "kind": "payment", "idempotency_key": f"pay-{session}-a3"},
        )
        for n, extra in enumerate(fields, 1):
            span_id = f"{index * 4 + n:016x}"
            record = {
                "session_id": session,
                "status": "ok",
                "trace_id": trace,
                "span_id": span_id,
                "service": "travel-agent",
                "instance": "pod-a",
                **extra,
            }
            yield Action(
                record=record,
                source="span",
                origin="bench",
                time_ns=base + n * 1_000_000_000,
                seq=index * 4 + n,
                delivery_key=(trace, span_id, 0),
            )


def measure(sessions: int) -> dict[str, float]:
    import psutil

    from processor.evaluate.engine import Engine, EngineOptions
    from processor.evaluate.rulefmt import load_rules

    engine = Engine(load_rules([]), EngineOptions(max_sessions=max(sessions, 1)))
    process = psutil.Process()
    gc.collect()
    baseline = process.memory_info().rss
    batch: list[object] = []
    for item in _records(sessions):
        batch.append(item)
        if len(batch) >= 1000:
            engine.submit_many(batch)  # type: ignore[arg-type]
            batch.clear()
    engine.submit_many(batch)  # type: ignore[arg-type]
    batch.clear()
    engine.finish()
    gc.collect()
    grown = process.memory_info().rss - baseline
    summary = engine.summary()
    assert summary.actions_evaluated == sessions * 3, summary.actions_evaluated
    return {"sessions": sessions, "bytes_per_session": grown / sessions, "rss_growth_mib": grown / 2**20}


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(measure(int(sys.argv[2]))))
        return
    sizes = [int(a) for a in sys.argv[1:]] or [10_000, 100_000]
    for size in sizes:
        done = subprocess.run(
            [sys.executable, __file__, "--child", str(size)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        )
        result = json.loads(done.stdout)
        print(
            f"{result['sessions']:>8} sessions: {result['bytes_per_session']:8.0f} bytes/session "
            f"({result['rss_growth_mib']:.1f} MiB)"
        )


if __name__ == "__main__":
    main()
