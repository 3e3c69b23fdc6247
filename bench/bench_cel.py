"""Micro-benchmark: cost of one evaluation of a compiled rule condition.

Compares, for three typical rule conditions, the compiled closure with a
hand-written Python function doing the same check and, when they are installed
(they are not dependencies of Durable Check), with cel-python (``celpy``) and the
Rust-based ``common-expression-language`` binding (``cel``).

    python bench/bench_cel.py [--runs 7] [--scale 1.0]

Prints the median over the runs of the mean cost per evaluation, in microseconds.
Each run evaluates the condition over a cycle of records that match and do not
match, so both outcomes (and both short-circuit paths) are measured.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from processor.evaluate.cel import Environment, compile_expression
from processor.records import FIELD_TYPES, NONDETERMINISTIC_KINDS, SIDE_EFFECT_KINDS

LISTS = {"nondeterministic": sorted(NONDETERMINISTIC_KINDS), "side_effects": sorted(SIDE_EFFECT_KINDS)}
NONDETERMINISTIC = frozenset(LISTS["nondeterministic"])
SIDE_EFFECTS = frozenset(LISTS["side_effects"])


def unrecorded_nondeterminism(a: dict[str, Any]) -> bool:
    r = a["record"]
    return (
        r["kind"] in NONDETERMINISTIC
        and r["status"] == "ok"
        and "result" not in r
        and not ("result_ref" in r and r["result_ref"] != "")
    )


def unkeyed_side_effect(a: dict[str, Any]) -> bool:
    r = a["record"]
    return r["kind"] in SIDE_EFFECTS and r["status"] == "ok" and "idempotency_key" not in r


def plan_changed(a: dict[str, Any]) -> bool:
    f, r = a["first"], a["record"]
    return "plan_version" in f and "plan_version" in r and f["plan_version"] != r["plan_version"]


CASES: list[tuple[str, str, Callable[[dict[str, Any]], bool], list[dict[str, Any]]]] = [
    (
        "unrecorded nondeterminism",
        'record.kind in lists.nondeterministic && record.status == "ok" && !has(record.result) '
        '&& !(has(record.result_ref) && record.result_ref != "")',
        unrecorded_nondeterminism,
        [
            {"record": {"kind": "llm_call", "status": "ok"}},
            {"record": {"kind": "llm_call", "status": "ok", "result": "text"}},
            {"record": {"kind": "write", "status": "ok"}},
            {"record": {"kind": "external_read", "status": "ok", "result_ref": ""}},
        ],
    ),
    (
        "unkeyed side effect",
        'record.kind in lists.side_effects && record.status == "ok" && !has(record.idempotency_key)',
        unkeyed_side_effect,
        [
            {"record": {"kind": "payment", "status": "ok"}},
            {"record": {"kind": "payment", "status": "ok", "idempotency_key": "k1"}},
            {"record": {"kind": "llm_call", "status": "ok"}},
            {"record": {"kind": "email", "status": "error"}},
        ],
    ),
    (
        "plan changed since first",
        "has(first.plan_version) && has(record.plan_version) && first.plan_version != record.plan_version",
        plan_changed,
        [
            {"first": {"plan_version": "1"}, "record": {"plan_version": "2"}},
            {"first": {"plan_version": "1"}, "record": {"plan_version": "1"}},
            {"first": {}, "record": {"plan_version": "1"}},
            {"first": {"plan_version": 3}, "record": {"plan_version": 3}},
        ],
    ),
]


def per_call_us(fn: Callable[[Any], Any], inputs: list[Any], calls: int, runs: int) -> float:
    """Median over ``runs`` of the mean cost of one call, looping over ``inputs``."""
    cycle = (inputs * (calls // len(inputs) + 1))[:calls]
    samples = []
    for _ in range(runs):
        start = time.perf_counter_ns()
        for item in cycle:
            fn(item)
        samples.append((time.perf_counter_ns() - start) / calls / 1000)
    return statistics.median(samples)


def ours(source: str) -> Callable[[dict[str, Any]], Any]:
    env = Environment(
        variables={"record": "map", "first": "map", "lists": "map"},
        known_fields={"record": frozenset(FIELD_TYPES), "first": frozenset(FIELD_TYPES)},
        constants={"lists": LISTS},
    )
    return compile_expression(source, env).predicate


def celpy_runner(source: str) -> tuple[Callable[[Any], Any], Callable[[dict[str, Any]], Any]] | None:
    try:
        import celpy
        from celpy.adapter import json_to_cel
    except ImportError:
        return None
    env = celpy.Environment()
    program = env.program(env.compile(source))

    def convert(activation: dict[str, Any]) -> Any:
        return {k: json_to_cel(v) for k, v in {**activation, "lists": LISTS}.items()}

    return program.evaluate, convert


def rust_runner(source: str) -> tuple[Callable[[Any], Any], Callable[[dict[str, Any]], Any]] | None:
    try:
        import cel
    except ImportError:
        return None
    program = cel.compile(source)
    return program.execute, lambda activation: {**activation, "lists": LISTS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the number of calls per run")
    args = parser.parse_args()
    calls_fast = max(1000, int(200_000 * args.scale))
    calls_rust = max(100, int(20_000 * args.scale))
    calls_celpy = max(20, int(400 * args.scale))

    print(f"Python {sys.version.split()[0]}; median of {args.runs} runs; microseconds per evaluation")
    print(f"{'condition':30} {'compiled':>9} {'lambda':>9} {'ratio':>6} {'rust-cel':>9} {'cel-python':>11}")
    for name, source, hand_written, records in CASES:
        compiled = ours(source)
        for record in records:
            if compiled(record) != hand_written(record):
                raise SystemExit(f"{name}: compiled and hand-written disagree on {record}")
        ours_us = per_call_us(compiled, records, calls_fast, args.runs)
        lambda_us = per_call_us(hand_written, records, calls_fast, args.runs)

        columns = []
        for runner, calls in ((rust_runner(source), calls_rust), (celpy_runner(source), calls_celpy)):
            if runner is None:
                columns.append("n/a")
                continue
            execute, convert = runner
            converted = [convert(r) for r in records]
            for record, prepared in zip(records, converted, strict=True):
                if bool(execute(prepared)) != hand_written(record):
                    raise SystemExit(f"{name}: another CEL library disagrees on {record}")
            # The other libraries get the activation already converted: only evaluation is timed.
            columns.append(f"{per_call_us(execute, converted, calls, args.runs):.2f}")
        print(f"{name:30} {ours_us:9.3f} {lambda_us:9.3f} {ours_us / lambda_us:6.1f} {columns[0]:>9} {columns[1]:>11}")


if __name__ == "__main__":
    main()
