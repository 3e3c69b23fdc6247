"""The corpus: every stack x build x crash point run for real, each with the facts measured outside the traces.

``python -m tests.durable_runtimes.corpus --out DIR`` writes ``DIR/<stack>-<build>-<crash>/``
with ``dump.jsonl`` (both processes' spans, OTLP/JSON lines, the format ``durable-check
replay`` reads) and ``facts.json``. The facts are what the payment ledger, the model server
and the runtimes' own databases say, never what Durable Check says.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sqlite3
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from tests.durable_runtimes.agent import BUILDS, CRASH_EXIT, CRASHES, STACKS
from tests.fake_openai import Script, scripted_openai

ROOT = Path(__file__).resolve().parents[2]
# One process of an agent, imports and all, takes a few seconds; a stuck one is a failure.
PROCESS_TIMEOUT_S = 120


@dataclass(frozen=True)
class Facts:
    """What really happened in one run."""

    stack: str
    build: str
    crash: str
    # Exit codes of the first process and of the recovering one (None: no recovery needed).
    first_exit: int
    recover_exit: int | None
    # The payment ledger: times the charge was attempted, and charges it took (a key is honoured).
    attempts: int
    charges: int
    # Chat completions the model server answered.
    model_requests: int
    # Rows of the runtime's own record: LangGraph checkpoints, DBOS step outputs.
    runtime_records: int

    @property
    def name(self) -> str:
        return f"{self.stack}-{self.build}-{self.crash}"


def _count(path: Path, query: str) -> int:
    if not path.exists():
        return 0
    with sqlite3.connect(path) as db:
        try:
            return int(db.execute(query).fetchone()[0])
        except sqlite3.OperationalError:
            return 0


def _process(run_dir: Path, *, stack: str, build: str, crash: str, phase: str, url: str) -> int:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OPENAI_API_KEY": "sk-fake"}
    result = subprocess.run(
        [sys.executable, "-m", "tests.durable_runtimes.agent", "--stack", stack, "--build", build, "--crash", crash,
         "--phase", phase, "--dir", str(run_dir), "--model-url", url],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S, check=False,
    )
    if result.returncode not in (0, CRASH_EXIT):
        raise RuntimeError(f"{run_dir.name} {phase} exited {result.returncode}:\n{result.stderr[-4000:]}")
    return result.returncode


def run_one(out: Path, stack: str, build: str, crash: str) -> Facts:
    """One run: the first process, and when it died, a second on the same databases; then the facts."""
    run_dir = out / f"{stack}-{build}-{crash}"
    run_dir.mkdir(parents=True, exist_ok=False)
    script = Script([("charge_card", {"order": "42"})])
    with scripted_openai(script) as url:
        first = _process(run_dir, stack=stack, build=build, crash=crash, phase="first", url=url)
        recover = None
        if first == CRASH_EXIT:
            recover = _process(run_dir, stack=stack, build=build, crash=crash, phase="recover", url=url)
    if stack == "langgraph":
        records = _count(run_dir / "checkpoints.db", "SELECT count(*) FROM checkpoints")
    else:
        records = _count(run_dir / "dbos.db", "SELECT count(*) FROM operation_outputs")
    facts = Facts(
        stack=stack, build=build, crash=crash, first_exit=first, recover_exit=recover,
        attempts=_count(run_dir / "ledger.db", "SELECT count(*) FROM attempts"),
        charges=_count(run_dir / "ledger.db", "SELECT count(*) FROM charges"),
        model_requests=len(script.requests), runtime_records=records,
    )
    (run_dir / "facts.json").write_text(json.dumps(asdict(facts), indent=2) + "\n")
    return facts


def generate(out: Path, workers: int = 2) -> list[Facts]:
    """Every stack x build x crash point, ``workers`` runs at a time."""
    runs = list(itertools.product(STACKS, BUILDS, CRASHES))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda run: run_one(out, *run), runs))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.durable_runtimes.corpus", description=__doc__)
    parser.add_argument("--out", required=True, type=Path, help="a directory that does not exist yet")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    for facts in generate(args.out, args.workers):
        print(f"{facts.name}: {facts.attempts} attempts, {facts.charges} charges, "
              f"{facts.model_requests} model requests, {facts.runtime_records} runtime records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
