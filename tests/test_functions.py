"""timeDerived: which idempotency keys encode a time (DS103)."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from processor.evaluate import functions
from processor.evaluate.functions import MAX_SCANNED_CHARS, RULE_FUNCTIONS, time_derived

# 2026-11-01T09:14:00Z, the time of the skill's fixture sessions.
NOW = dt.datetime(2026, 11, 1, 9, 14, tzinfo=dt.UTC)
NOW_NS = int(NOW.timestamp()) * 1_000_000_000
DAY_S = 86_400


def _uuid_with_version(version: int) -> str:
    """A well-formed RFC 9562 UUID of the given version (bits set by hand: Python 3.11 lacks uuid7)."""
    raw = bytearray(uuid.uuid4().bytes)
    raw[6] = (raw[6] & 0x0F) | (version << 4)
    raw[8] = (raw[8] & 0x3F) | 0x80
    return str(uuid.UUID(bytes=bytes(raw)))


def _ulid(ms: int) -> str:
    alphabet = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
    value = (ms << 80) | 0x1234_5678_9ABC_DEF0_1234
    chars = []
    for _ in range(26):
        chars.append(alphabet[value & 31])
        value >>= 5
    return "".join(reversed(chars))


@pytest.mark.parametrize("version", [1, 6, 7])
def test_time_based_uuids_are_time_derived(version: int) -> None:
    key = _uuid_with_version(version)
    assert time_derived(key, NOW_NS)
    assert time_derived(f"pay-{key}", 0), "a UUID inside a longer key still counts, even with no known time"
    assert time_derived(key.upper(), 0)


@pytest.mark.parametrize("version", [3, 4, 5, 8])
def test_other_uuid_versions_are_not(version: int) -> None:
    assert not time_derived(_uuid_with_version(version), NOW_NS)


def test_real_uuid1_from_the_standard_library() -> None:
    assert time_derived(str(uuid.uuid1()), 0)
    assert not time_derived(str(uuid.uuid4()), 0)


def test_ulid_within_plausible_years() -> None:
    assert time_derived(_ulid(int(NOW.timestamp() * 1000)), 0)
    assert time_derived("charge:" + _ulid(int(NOW.timestamp() * 1000)).lower(), 0)
    # A 26-character token of the ULID alphabet whose time would be in the year 1970.
    assert not time_derived(_ulid(1000), 0)
    # One character too long or too short is not a ULID.
    assert not time_derived(_ulid(int(NOW.timestamp() * 1000)) + "A", 0)
    assert not time_derived(_ulid(int(NOW.timestamp() * 1000))[1:], 0)


@pytest.mark.parametrize(
    "key",
    ["order-2026-11-01", "2026-11-01T09:14:00Z", "k_1999-12-31_x", "20261101T0914", "sync-20261101T091400Z"],
)
def test_iso_dates(key: str) -> None:
    assert time_derived(key, 0)


@pytest.mark.parametrize("key", ["order-2026-13-01", "v-2026-02-30", "12026-11-01", "20261101T2599"])
def test_impossible_dates_are_not(key: str) -> None:
    assert not time_derived(key, 0)


def test_bare_basic_date_counts_only_near_the_time() -> None:
    assert time_derived("batch-20261101", NOW_NS)
    assert not time_derived("batch-20261101", 0)
    assert not time_derived("batch-20240101", NOW_NS), "more than 7 days away: an order number, not a date"


@pytest.mark.parametrize(
    ("digits", "scale"),
    [(10, 1), (13, 1_000), (16, 1_000_000), (19, 1_000_000_000)],
)
def test_epochs_near_the_record_time(digits: int, scale: int) -> None:
    near = str((int(NOW.timestamp()) - 3 * DAY_S) * scale)
    far = str((int(NOW.timestamp()) - 30 * DAY_S) * scale)
    assert len(near) == digits
    assert time_derived(f"pay-{near}", NOW_NS)
    assert not time_derived(f"pay-{far}", NOW_NS)
    assert not time_derived(f"pay-{near}", 0), "with no known time, a bare number is not evidence"


def test_epoch_must_be_a_whole_digit_run() -> None:
    seconds = str(int(NOW.timestamp()))
    assert not time_derived(f"pay-{seconds}7", NOW_NS), "11 digits is no epoch length"
    assert time_derived(f"pay-{seconds}x7", NOW_NS)


@pytest.mark.parametrize(
    "key",
    ["pay-s-7f21-a07", "itinerary-s-7f21", "s-9c40:b03:charge", "ord_12345", "a" * 40, "0123456789abcdef" * 2],
)
def test_stable_keys_are_not_time_derived(key: str) -> None:
    assert not time_derived(key, NOW_NS)


@pytest.mark.parametrize("key", [None, 17, True, "", ["2026-11-01"]])
def test_non_strings_never_are(key: object) -> None:
    assert not time_derived(key, NOW_NS)


def test_bad_time_is_treated_as_unknown() -> None:
    seconds = str(int(NOW.timestamp()))
    assert not time_derived(seconds, True)
    assert not time_derived(seconds, "soon")
    assert time_derived("2026-11-01", None)


def test_scan_is_bounded() -> None:
    hidden = "x" * MAX_SCANNED_CHARS + "-2026-11-01"
    assert not time_derived(hidden, NOW_NS)
    assert time_derived("2026-11-01" + "x" * 100_000, NOW_NS)


def test_registered_for_rules() -> None:
    impl, arity = RULE_FUNCTIONS["timeDerived"]
    assert arity == 2
    assert impl("2026-11-01", 0) is True


# Keys built from the pieces the forms are made of, so that near misses are common.
_PIECES = st.sampled_from(
    ["-", "T", ":", "_", "a", "Z", "0", "7", "9", "2026", "11", "01", "20261101", "1793524440", "1793524440000",
     str(uuid.uuid1()), "01J" + "A" * 23, "2026-11-01", "20261101T0914", "s-00953-a", "ord", "1", "12345678"]
)


@settings(max_examples=400, deadline=None)
@given(st.lists(_PIECES, max_size=8).map("".join) | st.text(max_size=40), st.sampled_from([0, NOW_NS]))
def test_the_short_key_shortcut_answers_as_the_full_scan(key: str, time_ns: int) -> None:
    # time_derived skips the four scans for a short key with no date and no long digit run; the
    # answer must be the scans' own, whatever the key.
    assert time_derived(key, time_ns) == (bool(key) and functions._full_scan(key, time_ns))


# Generated rule code calls timeDerived directly, with no place for an error: it must answer
# every string and every integer time, whatever they hold (digits of other scripts, odd
# dates, times at the ends of the 64-bit range).
_ANY_DIGITS = st.text(alphabet=st.sampled_from("0123456789٠١٢٣٤٥٦٧٨٩０１２３-T:Zz"), max_size=40)


@settings(max_examples=600, deadline=None)
@given(
    st.lists(_PIECES, max_size=8).map("".join) | st.text(max_size=60) | _ANY_DIGITS,
    st.integers(-(2**63), 2**63 - 1) | st.sampled_from([0, NOW_NS]),
)
def test_it_answers_every_string_and_integer_time_without_raising(key: str, time_ns: int) -> None:
    assert type(time_derived(key, time_ns)) is bool
