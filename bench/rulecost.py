"""Per-record evaluation cost of a rule set, measured in a fresh process.

Records are parsed from a generated action log before the clock starts; the clock
covers only ``Engine.submit_many`` (in replay's chunk size) and ``finish``. Rules come
from the real loader: the shipped packs, or a generated file of N condition rules
(without the shipped packs, so the growth with N is the generated rules' alone).

    python -m bench.rulecost --log FILE --records 20000 --rules shipped
    python -m bench.rulecost --log FILE --records 20000 --rules 50
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from bench.generate import rule_file_text
from processor.convert.actionlog import parse_line
from processor.evaluate.engine import Engine, EngineOptions
from processor.evaluate.rulefmt import load_rules
from processor.records import Action, Malformed

CHUNK = 2048  # replay's chunk size


def measure(log: Path, records: int, rules: str) -> dict[str, float | int | str]:
    items: list[Action | Malformed] = []
    with log.open("rb") as handle:
        for line_number, raw in enumerate(handle, 1):
            item = parse_line(raw, str(log), line_number, seq=line_number)
            if item is not None:
                items.append(item)
            if len(items) >= records:
                break
    with tempfile.TemporaryDirectory() as tmp:
        if rules == "shipped":
            ruleset = load_rules([], include_shipped=True)
        else:
            path = Path(tmp) / f"bench-{rules}.yaml"
            path.write_text(rule_file_text(int(rules)), encoding="utf-8")
            ruleset = load_rules([path], include_shipped=False)
    engine = Engine(ruleset, EngineOptions(mode="replay"))
    violations = 0
    # CPU time of this process: other work on the machine does not count against it.
    started = time.process_time()
    for start in range(0, len(items), CHUNK):
        violations += len(engine.submit_many(items[start:start + CHUNK]))
    violations += len(engine.finish())
    elapsed = time.process_time() - started
    return {
        "rules": rules,
        "rule_count": len(ruleset.rules),
        "records": len(items),
        "seconds": elapsed,
        "us_per_record": elapsed / len(items) * 1e6,
        "violations": violations,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log", type=Path, required=True, help="action log (bench.generate actions)")
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--rules", default="shipped", help="'shipped' or a number of generated condition rules")
    args = parser.parse_args(argv)
    sys.stdout.write(json.dumps(measure(args.log, args.records, args.rules)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
