"""exporters._recent.RecentIds against a first-in-first-out model of what it must remember."""

from __future__ import annotations

import collections
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exporters._recent import RecentIds, id_digest
from processor.violations import make_violation_id

# Violation ids (32 hex digits, their own digest) and arbitrary strings (digested), mixed.
_IDS = st.one_of(
    st.integers(min_value=0, max_value=40).map(lambda n: make_violation_id("DS002", "s", f"a{n}", "x")),
    st.text(max_size=6),
)


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(min_value=1, max_value=9), steps=st.lists(st.tuples(st.booleans(), _IDS), max_size=300))
def test_it_remembers_exactly_the_newest_ids_added(capacity: int, steps: list[tuple[bool, str]]) -> None:
    recent = RecentIds(capacity)
    order: collections.deque[str] = collections.deque()
    for adding, value in steps:
        if adding:
            assert recent.add(value) == (value not in order)
            if value not in order:
                if len(order) == capacity:
                    order.popleft()
                order.append(value)
        assert (value in recent) == (value in order)
        assert len(recent) == len(order)
    assert all(value in recent for value in order)


def test_long_probe_chains_survive_removals() -> None:
    # Many more ids than slots pass through a small memory: every removal shifts chains back.
    recent = RecentIds(50)
    ids = [uuid.UUID(int=n).hex for n in range(5000)]
    for n, value in enumerate(ids):
        recent.add(value)
        if n >= 50:
            assert ids[n - 50] not in recent
            assert all(v in recent for v in ids[n - 49 : n + 1])


def test_memory_is_allocated_once_and_does_not_grow() -> None:
    recent = RecentIds(100_000)
    before = recent.nbytes
    for n in range(150_000):
        recent.add(uuid.UUID(int=n).hex)
    assert recent.nbytes == before
    assert before <= 100_000 * 64


def test_ids_and_other_strings_digest_apart() -> None:
    vid = make_violation_id("DS001", "s", "a", "line:x:1")
    assert id_digest(vid) == bytes.fromhex(vid)
    assert id_digest(vid.upper()) != id_digest(vid)  # not hex digits as given: digested
    assert id_digest("0" * 32) != bytes(16)  # all zeros marks an empty slot
    assert len(id_digest("")) == 16


def test_a_capacity_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        RecentIds(0)
