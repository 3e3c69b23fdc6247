"""`durable-check convert` writes the records `replay` evaluates: one identity stage for both.

The records replay evaluates are read where the rules receive them, after the identity stage
(``Engine.take_admitted``), with replay's own engine options; convert runs as the command line
runs it. Both read the same dump with the same configuration.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from processor import cli
from processor.cmd_replay import allowed_lateness_s, load_config_or_none, make_converter
from processor.evaluate.engine import Engine, EngineOptions
from processor.evaluate.rulefmt import load_rules
from processor.pipeline import Pipeline
from processor.receive.files import read_batches
from processor.records import Action
from processor.violations import Violation


class _Records:
    """An action sink, as the JSONL exporter with ``actions: true`` is one: what the pipeline hands on."""

    name = "records"
    wants_actions = True

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def export(self, violations: Sequence[Violation]) -> None:
        pass

    def resolve(self, violation_ids: Sequence[str]) -> None:
        pass

    def export_actions(self, actions: Sequence[Action]) -> None:
        self.records.extend(action.record for action in actions)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        pass


def replayed_records(dump: Path, config: Path | None = None) -> list[dict[str, Any]]:
    settings = load_config_or_none(str(config) if config else None)
    options = EngineOptions(mode="replay", allowed_lateness_s=allowed_lateness_s(settings, None))
    sink = _Records()
    pipeline = Pipeline(Engine(load_rules([], include_shipped=True), options), exporters=[sink])
    converter = make_converter(str(config) if config else None, settings)
    for batch in read_batches(str(dump), None, converter):
        pipeline.process(batch.items)
    pipeline.finish()
    return sink.records


def converted_records(dump: Path, config: Path | None = None) -> list[dict[str, Any]]:
    out = dump.with_name(dump.name + ".converted.jsonl")
    args = ["convert", str(dump), "-o", str(out)] + (["--config", str(config)] if config else [])
    with contextlib.redirect_stderr(io.StringIO()):
        assert cli.main(args) == 0
    return [orjson.loads(line) for line in out.read_bytes().splitlines()]


def assert_convert_agrees_with_replay(dump: Path, config: Path | None = None) -> int:
    """Record for record, in order; returns how many records there were."""
    converted = converted_records(dump, config)
    replayed = replayed_records(dump, config)
    assert len(converted) == len(replayed), (
        f"{dump.name}: convert wrote {len(converted)} records, replay evaluated {len(replayed)}")
    for index, (ours, theirs) in enumerate(zip(converted, replayed, strict=True)):
        assert ours == theirs, f"{dump.name}: record {index} differs:\nconvert: {ours}\nreplay:  {theirs}"
    return len(converted)
