"""Event-time ordering: a dump whose sessions interleave and whose spans arrive out of order
(within the allowed lateness) gives the same violations as the same dump sorted."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from processor.evaluate.engine import Engine, EngineOptions
from processor.evaluate.model import RuleSet
from processor.records import Action
from processor.violations import Violation
from tests._engine_util import T0, S, shipped

LATENESS_S = 5.0


def _session_steps(rng: random.Random, session: str) -> Iterator[dict[str, Any]]:
    """Records of one session: each step a small story that may or may not break a rule."""
    n = 0

    def action(**fields: Any) -> dict[str, Any]:
        nonlocal n
        n += 1
        record: dict[str, Any] = {"session_id": session, "action_id": f"{session}-a{n}", "status": "ok",
                                  "kind": "tool_call", "instance": "i-1"}
        record.update(fields)
        return record

    for _ in range(rng.randint(3, 7)):
        story = rng.choice(("resume", "wait", "effect", "retry", "approval", "noise"))
        if story == "resume":
            ask = action(kind="user_prompt", result={"answer": 1})
            yield ask
            yield action(kind="llm_call", result_ref="blob://x")
            again = dict(ask, instance="i-2")
            if rng.random() < 0.5:
                again["replayed"] = True
            yield again
        elif story == "wait":
            timeout = rng.choice((20, 60, 600))
            waiting = action(kind="approval", workflow_state="awaiting_approval", wait_timeout_s=timeout)
            yield waiting
            if rng.random() < 0.6:
                yield {"_gap": rng.choice((10, 30, 90))}
                yield action(kind="approval", approval_decision="granted", plan_version="v1")
        elif story == "effect":
            yield action(kind="payment", idempotency_key=f"pay-{session}-{n}", plan_version="v1")
            if rng.random() < 0.5:
                yield action(kind="checkpoint")
        elif story == "retry":
            failed = action(status="error", retryable=True, max_attempts=2, attempts=2)
            yield failed
            if rng.random() < 0.5:
                yield action(kind="user_prompt", result={"retry": False})
        elif story == "approval":
            yield action(kind="approval", approval_decision=rng.choice(("granted", "denied")), plan_version="v1")
            yield action(kind="email", replay="skip", plan_version=rng.choice(("v1", "v2")))
        else:
            yield action(kind="external_read", result={"n": 1})


def _dump(seed: int, sessions: int) -> list[Action]:
    """Spans of many sessions in event-time order, times distinct."""
    rng = random.Random(seed)
    actions: list[Action] = []
    used: set[int] = set()
    for index in range(sessions):
        session = f"s{index:03d}"
        t = T0 + rng.randint(0, 600) * S
        trace = f"{index + 1:032x}"
        for step in _session_steps(rng, session):
            if "_gap" in step:
                t += step["_gap"] * S
                continue
            t += rng.randint(1, 6) * S + rng.randint(0, 999_999)
            while t in used:
                t += 1
            used.add(t)
            span_id = f"{len(actions) + 1:016x}"
            record = dict(step, trace_id=trace, span_id=span_id)
            actions.append(Action(record=record, source="span", origin="dump", time_ns=t,
                                  delivery_key=(trace, span_id, 0)))
    actions.sort(key=lambda a: a.time_ns or 0)
    for seq, item in enumerate(actions):
        item.seq = seq
    return actions


def _shuffled(actions: list[Action], seed: int) -> list[Action]:
    """Arrival order with bounded displacement: each span may arrive up to 0.9 x lateness after later ones."""
    rng = random.Random(seed)
    bound = int(0.9 * LATENESS_S * S)
    keyed = [((a.time_ns or 0) + rng.randint(0, bound), i, a) for i, a in enumerate(actions)]
    keyed.sort()
    return [a for _, _, a in keyed]


def _replay(
    ruleset: RuleSet, items: list[Action], batch: int, lateness_s: float = LATENESS_S
) -> tuple[list[tuple[Any, ...]], Engine]:
    engine = Engine(ruleset, EngineOptions(allowed_lateness_s=lateness_s))
    out: list[Violation] = []
    for start in range(0, len(items), batch):
        out += engine.submit_many(items[start:start + batch])
    out += engine.finish()
    return sorted((v.violation_id, v.rule, v.session_id, v.action_id, v.time_ns, v.message,
                   tuple(sorted(v.details.items()))) for v in out), engine


@pytest.fixture(scope="module")
def packs() -> RuleSet:
    return shipped()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_shuffled_dump_gives_the_same_violations_as_sorted(packs: RuleSet, seed: int) -> None:
    dump = _dump(seed, sessions=60)
    arrived = _shuffled(dump, seed + 100)
    assert arrived != dump  # the shuffle really reorders
    expected, sorted_engine = _replay(packs, dump, batch=len(dump))
    got, engine = _replay(packs, arrived, batch=len(arrived))
    assert got == expected
    assert engine.late == 0
    # Without the reordering buffer the same arrival order gives other verdicts: the shuffle matters.
    unordered, unordered_engine = _replay(packs, arrived, batch=len(arrived), lateness_s=0.0)
    assert unordered_engine.late > 0
    assert unordered != expected
    rules_hit = {v[1] for v in expected}
    # The dump exercises timers and stateful rules, not just per-record checks.
    assert {"DS101", "DS107", "DS110"} <= rules_hit
    assert sorted(w.to_json().items() for w in engine.summary().open_waits) == sorted(
        w.to_json().items() for w in sorted_engine.summary().open_waits
    )


def test_batch_size_does_not_change_the_result(packs: RuleSet) -> None:
    dump = _shuffled(_dump(7, sessions=30), 8)
    whole, _ = _replay(packs, dump, batch=len(dump))
    one_by_one, _ = _replay(packs, dump, batch=1)
    chunks, _ = _replay(packs, dump, batch=17)
    assert whole == one_by_one == chunks


def test_displacement_beyond_lateness_is_counted_late(packs: RuleSet) -> None:
    dump = _dump(11, sessions=10)
    # Hold back one span until a span 60s later has arrived: it is behind the watermark.
    held = dump[5]
    arrived = [a for a in dump if a is not held]
    later = next(i for i, a in enumerate(arrived) if (a.time_ns or 0) > (held.time_ns or 0) + 60 * S)
    arrived.insert(later + 1, held)
    _, engine = _replay(packs, arrived, batch=len(arrived))
    assert engine.late == 1
    assert engine.summary().actions_evaluated == len(dump)
