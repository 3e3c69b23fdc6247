"""Findings in the input's language: the same flaw as an action-log line and as a span.

Each case is one flaw written both ways: log records with the contract's field names, and
spans with the ``durable.*`` attributes that fill the same fields. Replay gives the same
rule on the same action either way; the message (and the rule's fix) speaks of record
fields for the log and of span attributes or the annotate helper for the span. The whole
text of every message is kept in tests/testdata/messages_by_input.golden
(``UPDATE_GOLDEN=1`` rewrites it after review).
"""

from __future__ import annotations

import contextlib
import difflib
import io
import os
import re
from pathlib import Path
from typing import Any

import orjson
import pytest

from processor import cli
from processor.convert.profiles import DURABLE_ATTRIBUTES
from processor.evaluate.rulefmt import load_rules
from tests._spans import SpanSpec, otlp_json_from_request, request

GOLDEN = Path(__file__).parent / "testdata" / "messages_by_input.golden"
KEY_OF = {a.field: a.key for a in DURABLE_ATTRIBUTES}
T0 = 1_793_524_440_000_000_000
S = 1_000_000_000

# rule -> the records of the flaw (session s1, one action each, in time order).
CASES: dict[str, list[dict[str, Any]]] = {
    "DS001": [{"action_id": "a1", "kind": "llm_call"}],
    "DS002": [{"action_id": "a1", "kind": "payment", "result_ref": "r1"}],
    "DS003": [{"action_id": "a1", "kind": "tool_call", "retryable": True}],
    "DS004": [{"action_id": "a1", "kind": "tool_call", "retryable": True, "max_attempts": 3, "attempts": 4}],
    "DS005": [{"action_id": "a1", "kind": "user_prompt", "result_ref": "r1", "cacheable": True,
               "cache_key": "k", "ttl_s": 60}],
    "DS006": [{"action_id": "a1", "kind": "external_read", "result_ref": "r1", "cacheable": True, "ttl_s": 60}],
    "DS007": [{"action_id": "a1", "kind": "external_read", "result_ref": "r1", "cacheable": True, "cache_key": "k"}],
    "DS101": [{"action_id": "a1", "kind": "llm_call", "result_ref": "r1", "instance": "pod-a"},
              {"action_id": "a1", "kind": "llm_call", "result_ref": "r2", "instance": "pod-b"}],
    "DS102": [{"action_id": "a1", "kind": "payment", "status": "error", "idempotency_key": "s1-a1",
               "retryable": True, "max_attempts": 3, "attempts": 1},
              {"action_id": "a1", "kind": "payment", "idempotency_key": "s1-a1-retry", "result_ref": "r",
               "retryable": True, "max_attempts": 3, "attempts": 2}],
    "DS106": [{"action_id": "w1", "kind": "approval", "workflow_state": "awaiting_approval"}],
    "DS108": [{"action_id": "d1", "kind": "approval", "approval_decision": "granted", "plan_version": "1"},
              {"action_id": "a2", "kind": "payment", "idempotency_key": "k2", "plan_version": "2",
               "workflow_state": "executing"}],
    "DS109": [{"action_id": "d1", "kind": "approval", "approval_decision": "denied", "plan_version": "p1"},
              {"action_id": "a2", "kind": "payment", "idempotency_key": "k2", "plan_version": "p1"}],
    "DS112": [{"action_id": "a1", "kind": "tool_call", "on_failure": "retry"}],
}
# Field names only the action-log form may speak of (the span form names durable.* attributes).
LOG_WORDS = re.compile(r"\b(result_ref|idempotency_key|max_attempts|cache_key|ttl_s|wait_timeout_s|plan_version|"
                       r"replayed: true|on_failure|approval_decision)\b")


# What the span form names instead: attributes, the helper's calls and their keyword arguments.
SPAN_NAMES = re.compile(r"durable\.[\w.]+|annotate\.\w+(\([^)]*\))?|\w+=")


def _log_line(record: dict[str, Any], at: int) -> dict[str, Any]:
    return {"session_id": "s1", "status": "ok", **record, "time": f"2026-11-01T10:00:{at:02d}Z"}


def _span(record: dict[str, Any], at: int) -> SpanSpec:
    attributes = {KEY_OF[k]: v for k, v in {"session_id": "s1", "status": "ok", **record}.items()
                  if k in KEY_OF and k not in ("instance", "result_ref")}
    if "result_ref" in record:
        attributes["durable.result_ref"] = record["result_ref"]
    return SpanSpec(f"{record['kind']} {record['action_id']}", attributes, span_id=f"{at + 1:016x}",
                    start_ns=T0 + at * S)


def _replay(path: Path) -> list[dict[str, Any]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli.main(["replay", "--format", "json", "--strict", str(path)])
    violations: list[dict[str, Any]] = orjson.loads(out.getvalue())["violations"]
    return violations


def _messages(tmp_path: Path, rule: str) -> tuple[str, str]:
    records = CASES[rule]
    log = tmp_path / f"{rule}.jsonl"
    log.write_bytes(b"".join(orjson.dumps(_log_line(r, i)) + b"\n" for i, r in enumerate(records)))
    instances = {r.get("instance") for r in records}
    resources = [({"service.name": "agent", "service.instance.id": instance or "pod-a"},
                  [_span(r, i) for i, r in enumerate(records) if r.get("instance") == instance])
                 for instance in sorted(instances, key=str)]
    dump = tmp_path / f"{rule}.otlp.jsonl"
    dump.write_bytes(otlp_json_from_request(request(*resources)) + b"\n")
    by_log = [v for v in _replay(log) if v["rule"] == rule]
    by_span = [v for v in _replay(dump) if v["rule"] == rule]
    assert len(by_log) == len(by_span) == 1, (rule, by_log, by_span)
    assert by_log[0]["action_id"] == by_span[0]["action_id"]
    return str(by_log[0]["message"]), str(by_span[0]["message"])


@pytest.fixture(scope="module")
def messages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    tmp = tmp_path_factory.mktemp("messages")
    return {rule: _messages(tmp, rule) for rule in CASES}


def test_each_message_speaks_the_language_of_its_input(messages: dict[str, tuple[str, str]]) -> None:
    for rule, (log, span) in messages.items():
        assert log != span, rule
        assert "durable." in span or "annotate." in span, (rule, span)
        assert not LOG_WORDS.search(SPAN_NAMES.sub("", span)), (rule, span)
        assert "durable." not in log and "annotate." not in log, (rule, log)


def test_every_rule_with_a_span_form_says_what_to_do_in_both_languages() -> None:
    for rule in load_rules([]).rules:
        if rule.id in ("DS000",) or rule.fix_spans == rule.fix_logs:
            continue
        assert rule.fix_spans and rule.fix_logs, rule.id
        assert "durable." in rule.fix_spans or "annotate." in rule.fix_spans, rule.id
        assert "durable." not in rule.fix_logs, rule.id


def test_messages_match_the_golden_file(messages: dict[str, tuple[str, str]]) -> None:
    actual = [f"{rule} {form}: {text}" for rule, pair in messages.items() for form, text in zip(("log", "span"), pair,
                                                                                                 strict=True)]
    if os.environ.get("UPDATE_GOLDEN") == "1":
        GOLDEN.write_text("".join(line + "\n" for line in actual), encoding="utf-8")
        return
    expected = GOLDEN.read_text(encoding="utf-8").splitlines()
    if actual != expected:
        diff = "\n".join(difflib.unified_diff(expected, actual, "golden", "actual", lineterm=""))
        raise AssertionError(f"{GOLDEN.name} differs (UPDATE_GOLDEN=1 rewrites it after review):\n{diff}")
