"""Durable agents judged by what really happened: the real-framework corpus.

A billing agent charges a card with three real stacks and their durable execution
(LangGraph with a SqliteSaver checkpointer, pydantic-ai on DBOS, the OpenAI Agents SDK on
DBOS; tests/durable_runtimes/), well built (the charge keyed as docs/frameworks.md says)
and broken (no key), each with no crash, a crash inside the charging tool right after the
charge, and a crash before the second model request, recovered by a second process on the
same databases. The expected findings are derived below from facts measured outside the
traces (the payment ledger, the model server's requests), never from Durable Check's output.
"""

from __future__ import annotations

import contextlib
import io
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from processor import cli
from tests._spans import reference_request
from tests.convert_parity import assert_convert_agrees_with_replay
from tests.durable_runtimes.agent import CHARGE_ACTION, CRASH_EXIT, SESSION
from tests.durable_runtimes.corpus import Facts, generate
from tests.serve_support import config_file, keys_of, read_jsonl, running, serve_config, wait_for

pytestmark = pytest.mark.slow

SERIOUS = ("error", "critical")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[Facts]]]:
    out = tmp_path_factory.mktemp("corpus")
    yield out, generate(out)


def replay(dump: Path, config: Path | None = None) -> list[dict[str, Any]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli.main(["replay", "--format", "json", *(["--config", str(config)] if config else []), str(dump)])
    violations: list[dict[str, Any]] = orjson.loads(out.getvalue())["violations"]
    return violations


def expected_findings(facts: Facts) -> set[tuple[str, str]]:
    """The findings on the charge, from the facts alone.

    - A charge that ran without a key is an unkeyed side effect: DS002 (each run of it).
    - A charge that ran twice without a key charged twice: DS101 on the second run.
    - A charge that ran twice at all was lost by the crash before anything recorded it (the
      runtime's step record or checkpoint, which would have served it instead): DS110, a
      warning the facts prove; with a key the second run was a no-op, so nothing else.
    """
    keyed = facts.build == "well"
    ran_twice = facts.attempts >= 2
    required: set[tuple[str, str]] = set()
    if not keyed:
        required.add(("DS002", CHARGE_ACTION))
        if ran_twice:
            required.add(("DS101", CHARGE_ACTION))
    if ran_twice:
        required.add(("DS110", CHARGE_ACTION))
    return required


def test_the_facts_are_what_the_design_says(corpus: tuple[Path, list[Facts]]) -> None:
    # The runs did what they were built to do (else the verdicts below would prove nothing).
    _, runs = corpus
    assert len(runs) == 18
    for facts in runs:
        crashed = facts.crash != "none"
        assert facts.first_exit == (CRASH_EXIT if crashed else 0), facts
        assert facts.recover_exit == (0 if crashed else None), facts
        assert facts.runtime_records > 0, facts  # the runtime's own record was on
        # A crash in the charging tool loses the charge's step: recovery charges again, which a key collapses.
        assert facts.attempts == (2 if facts.crash == "in_charge" else 1), facts
        assert facts.charges == (1 if facts.build == "well" else facts.attempts), facts
        # Recovery served the first model reply from the record: the model was never asked twice.
        assert facts.model_requests == 2, facts


def test_verdicts_follow_the_facts(corpus: tuple[Path, list[Facts]]) -> None:
    out, runs = corpus
    for facts in runs:
        found = replay(out / facts.name / "dump.jsonl")
        keys = {(v["rule"], v["action_id"]) for v in found}
        required = expected_findings(facts)
        assert required <= keys, (facts.name, sorted(keys))
        # Nothing the facts disprove: every finding is on the charge, and is one the facts require.
        assert keys <= required, (facts.name, sorted(keys - required))
        # Every run is one session, whatever process and trace its spans came from.
        assert {v["session_id"] for v in found} <= {SESSION}, facts.name
        if facts.build == "well":
            assert [v for v in found if v["severity"] in SERIOUS] == [], facts.name


def test_convert_writes_the_records_replay_evaluates(corpus: tuple[Path, list[Facts]]) -> None:
    out, runs = corpus
    for facts in runs:
        assert_convert_agrees_with_replay(out / facts.name / "dump.jsonl")


@pytest.mark.parametrize("run", ["agents-sdk-dbos-broken-in_charge", "langgraph-well-in_charge",
                                 "pydantic-ai-dbos-well-before_second_model"])
def test_serve_gives_the_replay_verdicts(corpus: tuple[Path, list[Facts]], run: str, tmp_path: Path) -> None:
    # The dump's requests as the agents' exporters sent them, over OTLP/HTTP to a real serve.
    out, _ = corpus
    requests = [reference_request(line) for line in (out / run / "dump.jsonl").read_bytes().splitlines() if line]
    spans = sum(len(s.spans) for r in requests for rs in r.resource_spans for s in rs.scope_spans)
    with running(serve_config(tmp_path)) as server:
        for request in requests:
            post = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/v1/traces",
                                          data=request.SerializeToString(),
                                          headers={"Content-Type": "application/x-protobuf"})
            with urllib.request.urlopen(post, timeout=10) as response:
                assert response.status == 200
        assert wait_for(lambda: server.worker.processed_spans >= spans, 20)
    served = keys_of(read_jsonl(tmp_path / "violations.jsonl"))
    replayed = keys_of(replay(out / run / "dump.jsonl", config_file(tmp_path)))
    assert served == replayed
